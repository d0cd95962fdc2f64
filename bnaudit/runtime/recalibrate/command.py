"""`recalibrate` on a checkpoint (a file, or a folder holding one: `audit.resolve`): load the
model, re-estimate its BatchNorm statistics on calibration data (`methods.recalibrate_module`),
write a new checkpoint in the input's format and layout (a sharded checkpoint as a folder of
shards) with only those buffers changed (`formats.write.save_like`, atomic), and
report per layer how far the old and the new statistics are from the calibration data
(`bnaudit.audit.statistics.Drift`), and with held-out data the gap report of both checkpoints.

The file-level safety lives here: the output never replaces an input (checkpoint, data,
model source) or lands in a data folder, a layer whose buffers the file lacks is left out
rather than written as new keys, and SIGTERM unwinds like Ctrl-C while a run is in progress
so no temporary file stays behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import signal
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from bnaudit import __version__
from bnaudit.config import Config
from bnaudit.errors import BnauditError
from bnaudit.formats.atomic import check_output
from bnaudit.formats.bnstats import Shard, write_statistics
from bnaudit.formats.provenance import RecalibrationRecord
from bnaudit.formats.write import check_destination, check_writable, save_like, statistics_digests
from bnaudit.reports.gap import GapReport, is_large
from bnaudit.reports.recalibrate import LayerChange, RecalibrationReport, SkippedLayer
from bnaudit.runtime.attribution import BROAD_FRACTION, channel_scores
from bnaudit.runtime.data import make_loader
from bnaudit.runtime.distributed import torchrun
from bnaudit.runtime.gap import measure_model_gap, statistics_mature
from bnaudit.runtime.inputs import input_problem
from bnaudit.runtime.models import (
    ModelSpec,
    as_model_spec,
    load_forward,
    load_runnable,
    resolve_device,
    resolve_model,
    to_device,
)
from bnaudit.runtime.models import forward as run_forward
from bnaudit.runtime.norms import classify_layers, norm_modules
from bnaudit.runtime.recalibrate.methods import (
    METHODS,
    Calibration,
    LayerCalibration,
    calibration_warnings,
    recalibrate_module,
    to_numpy,
)
from bnaudit.runtime.recalibrate.statsfiles import statistics_of
from bnaudit.runtime.stats import drift


def record_date() -> str:
    """The record's UTC date: now, or SOURCE_DATE_EPOCH where set (reproducible outputs,
    https://reproducible-builds.org/specs/source-date-epoch/; the README's examples use it)."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH", "").strip()
    when = (
        datetime.datetime.fromtimestamp(int(epoch), datetime.UTC)
        if epoch.isdigit()
        else datetime.datetime.now(datetime.UTC)
    )
    return when.replace(microsecond=0).isoformat()


def layer_changes(calibration: Calibration, model: Any) -> list[LayerChange]:
    """Before/after drift of every recalibrated layer; `after` uses the statistics as
    stored (in the buffers' dtype), read back from `model`."""
    modules = dict(model.named_modules())  # get_submodule does not work on TorchScript
    stored = {
        layer.name: (to_numpy(modules[layer.name].running_mean), to_numpy(modules[layer.name].running_var))
        for layer in calibration.layers
    }
    return layer_changes_of(calibration.layers, stored)


def layer_changes_of(layers: Iterable[LayerCalibration], stored: Mapping[str, tuple[Any, Any]]) -> list[LayerChange]:
    """Before/after drift of each of `layers` against the data's statistics; `stored`: each
    layer's new (mean, var) as written, in the buffers' dtype."""
    changes = []
    for layer in layers:
        stored_mean, stored_var = stored[layer.name]
        changes.append(
            LayerChange(
                name=layer.name,
                channels=layer.num_features,
                values=layer.count,
                batches=layer.batches,
                before=drift(layer.data_mean, layer.data_var, layer.old_mean, layer.old_var, layer.eps),
                after=drift(layer.data_mean, layer.data_var, stored_mean, stored_var, layer.eps),
            )
        )
    return changes


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """While the block runs, SIGTERM raises KeyboardInterrupt (so the atomic writer
    removes its temporary file, as after Ctrl-C); the previous handler is restored on
    exit. Python delivers signals to the main thread only, so elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminated(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def recalibrate_checkpoint(
    spec: ModelSpec | str,
    output: str | None,
    options: Any,
    *,
    stats_out: str | None = None,
    shard: Shard | None = None,
    method: str = "exact",
    amp: bool = False,
    include: Iterable[str] = (),
    exclude: Iterable[str] = (),
    force: bool = False,
    eval_data: Any = None,
    config: Config | None = None,
    progress: Callable[[int, int], None] | None = None,
    warn: Callable[[str], None] | None = None,
    allow_input_mismatch: bool = False,
) -> RecalibrationReport | None:
    """Load the model (`spec`: a `bnaudit.ModelSpec`, or a checkpoint path), re-estimate its
    BN statistics on `options` (a `bnaudit.DataOptions`),
    write `output` (in the input's format unless its name says another: see
    `formats.write.output_format`), and report. `config` (None: the defaults) decides
    which inspect findings the --eval-data gap reports carry. Returns None on
    ranks other than 0 under torchrun (rank 0 writes and reports).

    `stats_out`: also (or, with `output` None, instead) write the pass's statistics file
    (`bnaudit.formats.bnstats`), for `bnaudit merge`. `shard`: run only the whole batches
    rank `shard.index` of `shard.count` would run under torchrun (`BatchPlan.shard` of the
    one seeded plan), so that independent runs of every shard cover the data once.

    Before anything is written, `input_mismatch` compares the calibration data at the
    first BN layer with its stored statistics; a mature checkpoint whose first layer
    disagrees is refused (wrong preprocessing is the likelier cause) unless
    `allow_input_mismatch`.

    >>> import bnaudit                                                        # doctest: +SKIP
    >>> bnaudit.recalibrate_checkpoint(bnaudit.ModelSpec("model.pt", arch="mypkg.models:net"),
    ...                                "model.recal.pt", bnaudit.DataOptions(path="calib/")).layers[0].after  # doctest: +SKIP
    """
    warn = warn or (lambda _message: None)
    config = config or Config()
    with sigterm_unwinds():
        spec = resolve_model(as_model_spec(spec), config)  # a folder: the model inspect finds in it
        checkpoint, trust_pickle, forward = spec.checkpoint, spec.trust_pickle, spec.forward
        _check_request(checkpoint, output, options, method, eval_data, force, (spec.arch, forward))
        _check_statistics_request(checkpoint, output, stats_out, shard, method, options, force)
        target = resolve_device(spec.device)
        forward_fn = load_forward(forward)
        with torchrun(target) as ranks:
            world, target = ranks.world, ranks.device
            autocast = None
            if amp:
                if target.type == "cuda":
                    autocast = torch.autocast("cuda", dtype=torch.float16)
                elif ranks.reports:
                    warn("--amp applies on CUDA only: ignored on the CPU")
            runnable = load_runnable(spec)
            ckpt = runnable.checkpoint
            if output is not None:
                check_writable(ckpt, output, trust_pickle)  # before the calibration, not after it
            absent = _absent_buffers(runnable)
            stream = make_loader(dataclasses.replace(options, pin_memory=target.type == "cuda"))
            plan_batches = len(stream.plan)
            if shard is not None:
                stream = _shard_of(stream, shard)
            local = stream.shard(ranks.rank, world)
            batches: Any = local if world == 1 or local.plan else []
            eval_before = None
            model = runnable.module
            if eval_data is not None and ranks.reports:
                eval_before = _measure(runnable, eval_data, target, forward_fn, config)
            model.to(target)
            # --grayscale applies to image folders only: elsewhere it is no fix to suggest
            grayscale = options.grayscale if getattr(stream.source, "is_images", False) else None
            calibration = recalibrate_module(
                model,
                batches,
                method=method,
                include=include,
                exclude=tuple(exclude) + tuple(absent),
                forward=_batch_runner(target, forward_fn, grayscale),
                autocast=autocast,
                progress=progress,
            )
            skipped = _skipped_layers(calibration, absent, forward)
            if not allow_input_mismatch:
                # every rank holds the same merged statistics: all refuse alike
                suspicion = input_mismatch(runnable, calibration)
                if suspicion:
                    raise BnauditError(suspicion)
            if not ranks.reports:
                return None
            provenance = None
            if output is not None:
                updates = {name: value for name, value in calibration.buffers().items() if name in ckpt.tensors}
                provenance = _provenance(calibration, options, stream.description, world, ckpt, updates)
                save_like(ckpt, updates, output, force=force, provenance=provenance, trust_pickle=trust_pickle)
            if stats_out is not None:
                first = stream.plan.first
                statistics = statistics_of(
                    calibration,
                    ckpt,
                    options,
                    stream.description,
                    shard,
                    (first, first + len(stream.plan)),
                    plan_batches,
                )
                write_statistics(statistics, stats_out, force=force)
            eval_after = None
            if eval_data is not None and output is not None:
                written = load_runnable(resolve_model(dataclasses.replace(spec, checkpoint=output)))
                eval_after = _measure(written, eval_data, target, forward_fn, config)
            return RecalibrationReport(
                input=checkpoint,
                output=output,
                stats_out=stats_out,
                shard=None if shard is None else str(shard),
                format=ckpt.format,
                key=ckpt.key,
                model=runnable.describe(),
                data=stream.description,
                method=method,
                samples=calibration.samples,
                batches=calibration.batches,
                batch_size=options.batch_size,
                seed=options.seed,
                shuffle=options.shuffle,
                device=str(target),
                world_size=world,
                layers=layer_changes(calibration, model),
                skipped=skipped,
                # statistics alone are merged: the merge warns of few samples, not each part
                warnings=calibration.warnings
                if output is not None
                else calibration_warnings(calibration.samples, calibration.layers, counts=False),
                provenance=provenance,
                eval_before=eval_before,
                eval_after=eval_after,
                prefix=ckpt.prefix,
            )


def _check_statistics_request(
    checkpoint: str,
    output: str | None,
    stats_out: str | None,
    shard: Shard | None,
    method: str,
    options: Any,
    force: bool,
) -> None:
    """The refusals of --stats-out and --shard, before any work."""
    if output is None and stats_out is None:
        raise BnauditError("nothing to write: give --output PATH, --stats-out PATH or both")
    if shard is not None and stats_out is None:
        raise BnauditError(
            f"--shard {shard} runs one share of the data, whose statistics are merged later: give --stats-out PATH "
            "(and merge the shards with `bnaudit merge`)"
        )
    if stats_out is None:
        return
    if method == "sequential":
        raise BnauditError(
            "--method sequential needs one pass per layer, each on the checkpoint with the layers before it already "
            "fixed, so one statistics file cannot hold it: across jobs run one round per layer in forward order, "
            "`recalibrate --method exact --layers LAYER --stats-out` in every job, then `bnaudit merge` into the "
            "checkpoint the next round starts from (docs/distributed.md)"
        )
    check_output(stats_out, checkpoint, force)
    if output is not None and os.path.abspath(output) == os.path.abspath(stats_out):
        raise BnauditError(f"{stats_out}: is also --output; write the statistics and the checkpoint to two files")
    protect_inputs(stats_out, [("--data", options.path), ("checkpoint", checkpoint)])


def _shard_of(stream: Any, shard: Shard) -> Any:
    """The whole batches rank `shard.index` of `shard.count` would run under torchrun."""
    total = len(stream.plan)
    part = stream.shard(shard.index, shard.count)
    if not part.plan:
        raise BnauditError(
            f"--shard {shard}: the data makes {total} batches of {stream.options.batch_size}, none of them for shard "
            f"{shard.index}: use at most {total} shards, or a smaller --batch-size"
        )
    return part


def _check_request(
    checkpoint: str,
    output: str | None,
    options: Any,
    method: str,
    eval_data: Any,
    force: bool,
    specs: tuple[str | None, str | None],
) -> None:
    """The refusals that need no model: the method, the destination, the data options,
    an output that would replace an input, a batch too small for the method, held-out
    data that is the calibration data. `specs`: the --arch and --forward specs."""
    if method not in METHODS:
        raise BnauditError(f"unknown --method {method!r} (choose from {', '.join(METHODS)})")
    if output is not None:
        check_destination(output, checkpoint, force)  # a sharded input is written as a folder
    options.validate()
    arch, forward = specs
    inputs = [
        ("--data", options.path),
        ("--eval-data", eval_data.path if eval_data is not None else None),
        *(
            (option, _spec_file(spec))
            for option, spec in (("--arch", arch), ("--dataset", options.dataset), ("--forward", forward))
        ),
    ]
    if output is not None:
        protect_inputs(output, inputs)
    if options.batch_size < 2 and method != "sequential":
        raise BnauditError(
            f"--batch-size {options.batch_size}: the {method} method normalises by batch statistics, which a batch of "
            "one sample does not have (one value per channel in a BatchNorm1d layer); use --batch-size 2 or more, "
            "or --method sequential"
        )
    if eval_data is not None:
        if output is None:
            raise BnauditError(
                "--eval-data compares the written checkpoint with the input: give --output too (check a merged "
                "checkpoint with `bnaudit gap`)"
            )
        eval_data.validate()
        if _same_data(options, eval_data):
            raise BnauditError("--eval-data must be held-out data, not the calibration data (--data)")


def _absent_buffers(runnable: Any) -> list[str]:
    """The BN layers whose buffers the file lacks: they cannot be written back without new keys."""
    tensors = runnable.checkpoint.tensors
    return [
        name
        for name in classify_layers(runnable.module)[0]
        if f"{name}.running_mean" not in tensors or f"{name}.running_var" not in tensors
    ]


def _batch_runner(target: Any, forward_fn: Any, grayscale: bool | None) -> Callable[[Any, Any], Any]:
    """The model's forward on one batch; a batch the model rejects for a reason the
    inputs show (channels, size, scale) is one line naming the batch."""

    def run(module: Any, batch: Any) -> Any:
        inputs = to_device(batch.inputs if hasattr(batch, "inputs") else batch, target)
        try:
            return run_forward(module, inputs, forward_fn)
        except Exception:
            problem = input_problem(module, inputs, grayscale) if forward_fn is None else None
            if problem is None:
                raise
            raise BnauditError(f"batch {getattr(batch, 'index', 0)}: the model rejects the batch: {problem}") from None

    return run


def _skipped_layers(calibration: Calibration, absent: list[str], forward: str | None) -> list[SkippedLayer]:
    """The layers left as they were, each with its reason; none recalibrated is an error."""
    skipped = [
        SkippedLayer(s.name, "its buffers are not in the checkpoint: left out (no new keys are written)")
        if s.name in absent
        else s
        for s in calibration.skipped
    ]
    if not calibration.layers:
        unreached = forward is not None and any(s.reason.startswith("never reached") for s in skipped)
        raise BnauditError(
            "no BatchNorm layer was recalibrated (see the skipped layers: "
            + "; ".join(f"{s.name}: {s.reason}" for s in skipped[:4])
            + ")"
            + (f"; does --forward {forward} call the model on the batch?" if unreached else "")
        )
    return skipped


def _provenance(
    calibration: Calibration, options: Any, data: str, world: int, ckpt: Any, updates: dict[str, Any]
) -> RecalibrationRecord:
    """The recalibration record written into the checkpoint's metadata."""
    names = tuple(layer.name for layer in calibration.layers)
    return RecalibrationRecord(
        method=calibration.method,
        samples=calibration.samples,
        batches=calibration.batches,
        batch_size=options.batch_size,
        seed=options.seed,
        shuffle=options.shuffle,
        data=data,
        world_size=world,
        recalibrated_layers=names,
        digests=statistics_digests(ckpt, updates, list(names)),
        bnaudit_version=__version__,
        date=record_date(),
    )


def input_mismatch(runnable: Any, calibration: Calibration) -> str | None:
    """Why the calibration data looks wrongly preprocessed, or None.

    Only for mature statistics (`gap.statistics_mature`: no BN002 reset and no BN003 immature
    under the default configuration, whatever the project ignores: those
    describe no data, so any data disagrees with them). The first BN layer sees the input
    after one linear stage; when it is large by `bnaudit.reports.gap.is_large`
    on its channel means (mean shift or variance log-ratio >= DRIFT_LARGE) and at least
    BROAD_FRACTION of its channels drift, the calibration data differs from the training
    data at the input, and statistics fitted to it would break correctly preprocessed data.
    """
    norms = norm_modules(runnable.module)
    if not norms:
        return None
    first_name = next(iter(norms))
    layer = next((x for x in calibration.layers if x.name == first_name), None)
    if layer is None:
        return None
    if not statistics_mature(runnable):
        return None
    d = drift(layer.data_mean, layer.data_var, layer.old_mean, layer.old_var, layer.eps)
    scores = channel_scores(layer.data_mean, layer.data_var, layer.old_mean, layer.old_var, layer.eps)
    if not is_large(d.mean_shift, d.var_log_ratio, None) or scores.broad < BROAD_FRACTION:
        return None
    return (
        f"not written: the calibration data disagrees with the mature statistics of the first BN layer "
        f"{first_name} in {scores.broad * 100:.0f}% of its channels (mean shift {d.mean_shift:.2f}, variance "
        f"log-ratio {d.var_log_ratio:.2f}): the data is likelier preprocessed differently from training "
        "(--mean/--std, 0-255 scale, channel order) than the statistics stale; check with `bnaudit gap`, or "
        "pass --allow-input-mismatch if this data is what the model will see"
    )


def protect_inputs(output: str, inputs: Iterable[tuple[str, str | None]]) -> None:
    """Refuse an output that would replace an input file (even with --force: the data,
    held-out data or the model's source) or land inside a data folder (it would change
    the data set the next run reads)."""
    landing = os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(output))), os.path.basename(output))
    for option, path in inputs:
        if not path or not os.path.exists(path):
            continue
        if os.path.isdir(path):
            root = os.path.realpath(path)
            if os.path.commonpath([root, landing]) == root:
                raise BnauditError(f"{output}: lies inside the {option} folder {path}; write the checkpoint elsewhere")
        elif os.path.exists(output) and os.path.samefile(output, path):
            raise BnauditError(f"{output}: is the {option} file; write the new checkpoint to another file")


def _spec_file(spec: str | None) -> str | None:
    """The file of a `path/to/file.py:CALLABLE` spec (None for MODULE:CALLABLE)."""
    where = (spec or "").rpartition(":")[0]
    return where if where.endswith(".py") or "/" in where or os.sep in where else None


def _same_data(a: Any, b: Any) -> bool:
    if a.path is not None and b.path is not None and os.path.exists(a.path) and os.path.exists(b.path):
        return os.path.samefile(a.path, b.path)
    return a.dataset is not None and a.dataset == b.dataset


def _measure(runnable: Any, options: Any, device: Any, forward_fn: Any, config: Config) -> GapReport:
    """The gap report of a model on held-out data, measured in this process alone (under
    torchrun only rank 0 evaluates: it alone has the written checkpoint to reload)."""
    stream = make_loader(dataclasses.replace(options, pin_memory=device.type == "cuda"))
    return measure_model_gap(runnable, stream, device, forward_fn, config, shard=False)

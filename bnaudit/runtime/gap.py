"""`gap`: what switching BatchNorm to its stored statistics costs, and which layer is to blame.

Every batch is read and decoded once and goes through the model twice:

  train mode   every BN layer normalises with the statistics of the batch (training mode
               for BN modules only; the buffers are restored afterwards, so the model is
               unchanged whichever pass runs first)
  eval mode    every module in eval mode: BN normalises with running_mean / running_var

Dropout and every other mode-dependent module stay in eval mode in both, so the
difference is BatchNorm's alone. Definitions (N samples, y_t / y_e their outputs):

  accuracy      top-1: fraction of samples whose argmax equals the label (None without labels)
  gap           train-mode accuracy - eval-mode accuracy (positive: eval mode loses accuracy)
  agreement     fraction of samples whose argmax is the same in both modes
  divergence    classifier outputs (N, K), K >= 2: mean over samples of
                  KL(p_e || p_t) = sum_k p_e,k (log p_e,k - log p_t,k),  p = softmax(y)
                other outputs ("relative_l2"): mean over samples of relative_l2 of y_t
                against y_e, ||y_t - y_e||_2 / ||y_e||_2 (`bnaudit.audit.statistics`)

Per-layer drift compares the data that reaches each BN layer in eval mode (exact
per-channel mean mu_d and unbiased variance var_d over all samples, float64, merged
with `bnaudit.runtime.stats.ChannelStats`) with its running statistics mu_r, var_r. A
tracked InstanceNorm normalises each instance (sample, channel) by its own statistics
and its running statistics average them over the instances, so there mu_d and var_d are
the means of the per-instance means and unbiased variances (`stats.InstanceStats`); the
variance pooled over all values would add the spread of the instance means and blame a
layer that describes its data.

  mean_shift, max_mean_shift, var_log_ratio   as `bnaudit.audit.statistics.Drift` defines them
  drift           mean_shift + var_log_ratio (both are 0 when the stored statistics
                  describe the data; a shift of one running std and a variance off by a
                  factor e weigh alike)
  worst, peak     the channels with the largest shift_c + log_var_c and that largest value
                  (`bnaudit.runtime.attribution`, which also decides which layers are
                  ORIGINS of the drift and when the input itself is the likelier suspect)

Layers are ranked origins first (in forward order), then by peak, largest first: a
single broken channel dominates its layer, and the layer where drift starts comes before
the layers that only inherit it.

Accuracies carry 95% Wilson intervals and the gap Newcombe's interval
(`bnaudit.runtime.confidence`); a gap whose interval contains 0 is "not significant".

Under torchrun (`bnaudit.runtime.distributed`) every rank plans the same batches from the
seed and scores a contiguous block of WHOLE batches (`batching.BatchPlan.shard`): a
train-mode output depends on which samples share its batch, so the ranks must run exactly
the single process's batches. The ranks then combine what a single process accumulates:
the sample, label, correct (both modes), agreement and non-finite counts and the batch
and skipped counts are summed (exact integers); the divergence sums are added in rank
order (float64 rounding); every BN layer's and the input's per-channel (count, mean, M2)
are Chan-merged (`stats.all_gather_merge`: float64 rounding), an InstanceNorm's sums
added in rank order. Every rank then builds the same report, so accuracy, gap and
agreement equal a single process's exactly and exit codes agree.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from bnaudit.audit.checkpoint.inspect import audit_checkpoint
from bnaudit.config import Config, measurement_fail_on
from bnaudit.errors import BnauditError
from bnaudit.reports.gap import NEEDS_LABELS, GapReport, LayerDrift, check_max_gap, diagnose
from bnaudit.runtime.attribution import (
    channel_scores,
    find_origins,
    first_layer_mismatch,
    implied_input,
)
from bnaudit.runtime.confidence import difference_interval, wilson
from bnaudit.runtime.data import make_loader
from bnaudit.runtime.deviation import relative_l2s
from bnaudit.runtime.distributed import distributed, gather_objects, together, torchrun
from bnaudit.runtime.inputs import input_problem, locate_failure
from bnaudit.runtime.models import (
    ModelSpec,
    as_model_spec,
    forward,
    load_forward,
    load_runnable,
    output_tensor,
    resolve_device,
    resolve_model,
    to_device,
)
from bnaudit.runtime.norms import batch_statistics, is_batchnorm, norm_modules
from bnaudit.runtime.stats import (
    ChannelStats,
    InstanceStats,
    all_gather_stats,
    drift,
    record_bn_inputs,
)
from bnaudit.text import exception_line


@dataclass
class _Totals:
    samples: int = 0
    labelled: int = 0
    correct_train: int = 0
    correct_eval: int = 0
    agree: int = 0
    divergence_sum: float = 0.0
    classifier: bool | None = None
    non_finite_train: int = 0
    non_finite_eval: int = 0
    batches: int = 0
    skipped: int = 0
    notes: list[str] = field(default_factory=list)
    output_batch: int = 0  # the first batch scored (the first output shape, in messages)


def _reduce_totals(totals: _Totals) -> _Totals:
    """Every rank's totals combined (see the module docstring): counts summed, the
    divergence sums added in rank order, notes joined in order of appearance. Collective;
    raises on every rank alike when two ranks disagree on whether outputs are class scores."""
    parts = gather_objects(totals)
    combined = _Totals()
    for name in _COUNTS:
        setattr(combined, name, sum(getattr(p, name) for p in parts))
    for p in parts:
        combined.divergence_sum += p.divergence_sum
        combined.notes += [n for n in p.notes if n not in combined.notes]
        if p.classifier is None:  # a rank without batches
            continue
        if combined.classifier is None:
            combined.classifier, combined.output_batch = p.classifier, p.output_batch
        elif p.classifier != combined.classifier:
            raise BnauditError(
                f"batch {p.output_batch}: the output shape differs from that of batch {combined.output_batch} "
                "(class scores in one, not in the other)"
            )
    return combined


_COUNTS = (
    "samples",
    "labelled",
    "correct_train",
    "correct_eval",
    "agree",
    "non_finite_train",
    "non_finite_eval",
    "batches",
    "skipped",
)


def measure_model_gap(
    runnable: Any,
    stream: Any,
    device: Any = "cpu",
    forward_fn: Callable[[Any, Any], Any] | None = None,
    config: Config | None = None,
    progress: Callable[[int, int], None] | None = None,
    train_first: bool = True,
    shard: bool = True,
) -> GapReport:
    """Run every batch of `stream` through `runnable.module` in both modes (see module doc).

    `runnable` is a `bnaudit.runtime.models.RunnableModel`, `stream` a
    `bnaudit.runtime.data.BatchStream`. `train_first` only chooses which pass runs first
    on each batch: the result is the same either way, because the train-mode pass
    restores the buffers it changes.

    Under torch.distributed (an initialised process group) each rank scores its share of
    whole batches and every rank returns the report of all of them (module docstring);
    collective, so every rank must call it. `shard=False` measures all of `stream` in this
    process alone, as one rank may (recalibrate's --eval-data on rank 0).
    """
    device = resolve_device(device) if isinstance(device, str) else device
    if stream.batch_size < 2:
        raise BnauditError("--batch-size must be at least 2: train-mode BatchNorm normalises by batch statistics")
    if stream.num_samples < 2:
        raise BnauditError("gap needs at least 2 samples")
    config = config or Config()
    inspection = audit_checkpoint(runnable.checkpoint, config, runnable.facts)
    model = runnable.module
    model.to(device)
    norms = norm_modules(model)
    # Hooks cannot be attached inside a TorchScript module: no per-layer drift there.
    hooked = {} if runnable.scripted else norms
    # --grayscale applies to image folders only: elsewhere it is no fix to suggest
    grayscale = stream.options.grayscale if getattr(stream.source, "is_images", False) else None
    rank, world = distributed() if shard else (0, 1)
    local = stream.shard(rank, world)
    totals, seen = _score_batches(
        model, local, device, forward_fn, norms, hooked, grayscale, train_first, progress, world > 1
    )
    totals.skipped, totals.notes = local.skipped, list(getattr(local, "notes", []))
    if world > 1:
        totals = _reduce_totals(totals)
        seen = _merge_ranks(seen, device)
    layers = _drift(norms, seen.layers, hooked)
    report = _gap_report(runnable, stream, device, totals, layers, inspection)
    _add_input_statistics(report, seen, runnable, norms, forward_fn)
    report.diagnosis = diagnose(report, scripted=runnable.scripted)
    return report


@dataclass
class _Seen:
    """What the eval-mode passes saw: each hooked layer's input statistics, the model's
    own input per channel (what the preprocessing produced), and one input sample for
    `_probe_first_layer`."""

    layers: dict[str, ChannelStats | InstanceStats]
    inputs: ChannelStats = field(default_factory=ChannelStats)
    example: Any = None


def _score_batches(
    model: Any,
    local: Any,
    device: Any,
    forward_fn: Callable[[Any, Any], Any] | None,
    norms: dict[str, Any],
    hooked: dict[str, Any],
    grayscale: bool | None,
    train_first: bool,
    progress: Callable[[int, int], None] | None,
    collective: bool,
) -> tuple[_Totals, _Seen]:
    """This process's share of the batches (`local`), each through both modes, compared
    (`_compare`) and recorded in eval mode; `collective` keeps the ranks in step (`together`)."""
    # InstanceNorm's running statistics average per-instance statistics (stats.InstanceStats)
    instance = {name for name, m in hooked.items() if not is_batchnorm(m)}
    seen = _Seen({name: InstanceStats() if name in instance else ChannelStats() for name in hooked})
    totals = _Totals()
    mine = local.plan
    with batch_statistics(model, {}), torch.no_grad(), together() if collective else contextlib.nullcontext():
        for batch in local if mine else ():
            inputs = to_device(batch.inputs, device)
            if _image_like(inputs):
                seen.inputs.update(inputs)
                if seen.example is None:
                    seen.example = inputs[:1]
            labels = None if batch.labels is None else batch.labels.to(device)

            # called within this iteration only: the defaults pin this batch for the linter
            def run_train(inputs: Any = inputs, batch: Any = batch) -> Any:
                return _run(model, inputs, forward_fn, batch.index, norms, train=True, grayscale=grayscale)

            def run_eval(inputs: Any = inputs, batch: Any = batch) -> Any:
                with record_bn_inputs(hooked, instance) as stats:
                    out = _run(model, inputs, forward_fn, batch.index, norms, train=False, grayscale=grayscale)
                for name, s in stats.items():
                    seen.layers[name].add(s)  # type: ignore[arg-type]  # the same kind, by name
                return out

            if train_first:
                out_train = run_train()
                out_eval = run_eval()
            else:
                out_eval = run_eval()
                out_train = run_train()
            _compare(out_train, out_eval, labels, batch, totals)
            totals.batches += 1
            if progress is not None:
                progress(totals.batches, len(mine))
    return totals, seen


def _merge_ranks(seen: _Seen, device: Any) -> _Seen:
    """Every rank's statistics of each layer's input and of the model's input, merged, and
    the first rank's example (module docstring). Collective."""
    *layer_stats, merged_input = all_gather_stats([*seen.layers.values(), seen.inputs])
    layers = dict(zip(seen.layers, layer_stats, strict=True))
    assert isinstance(merged_input, ChannelStats)
    return _Seen(layers, merged_input, _shared_example(seen.example, device))


def _gap_report(
    runnable: Any, stream: Any, device: Any, totals: _Totals, layers: list[LayerDrift], inspection: Any
) -> GapReport:
    """The report of the combined totals: accuracies, gap and their intervals over the
    labelled samples, agreement and divergence over all (module docstring)."""
    labelled = totals.labelled
    return GapReport(
        checkpoint=runnable.checkpoint.path,
        model=runnable.describe(),
        data=stream.description,
        samples=totals.samples,
        batch_size=stream.batch_size,
        batches=totals.batches,
        seed=stream.options.seed,
        shuffle=stream.options.shuffle,
        device=str(device),
        train_accuracy=totals.correct_train / totals.labelled if totals.labelled else None,
        eval_accuracy=totals.correct_eval / totals.labelled if totals.labelled else None,
        gap=(totals.correct_train - totals.correct_eval) / totals.labelled if totals.labelled else None,
        agreement=totals.agree / totals.samples if totals.classifier and totals.samples else None,
        divergence=totals.divergence_sum / totals.samples if totals.samples else None,
        divergence_kind="kl" if totals.classifier else "relative_l2",
        layers=layers,
        inspection=inspection,
        skipped=totals.skipped,
        non_finite={"train_mode": totals.non_finite_train, "eval_mode": totals.non_finite_eval},
        labelled=labelled,
        notes=totals.notes,
        train_interval=wilson(totals.correct_train, labelled) if labelled else None,
        eval_interval=wilson(totals.correct_eval, labelled) if labelled else None,
        gap_interval=difference_interval(totals.correct_train, totals.correct_eval, labelled) if labelled else None,
    )


def _add_input_statistics(
    report: GapReport, seen: _Seen, runnable: Any, norms: dict[str, Any], forward_fn: Any
) -> None:
    """The model input's per-channel mean and std, whether the drift points at the
    preprocessing (`_preprocessing_suspect`) and, when it does, the input statistics the
    first BN layer's running statistics imply (`attribution.implied_input`)."""
    if seen.inputs.count >= 2:
        report.input_mean = [float(v) for v in seen.inputs.mean.cpu()]
        report.input_std = [math.sqrt(max(float(v), 0.0)) for v in seen.inputs.var.cpu()]
    report.preprocessing_mismatch = _preprocessing_suspect(report, statistics_mature(runnable))
    if report.preprocessing_mismatch and report.input_mean is not None and report.input_std is not None:
        first_name = min((d for d in report.layers if d.drift is not None), key=lambda d: d.position).name
        first = norms[first_name]
        stats = seen.layers[first_name]
        implied = implied_input(
            report.input_mean,
            report.input_std,
            _probe_first_layer(runnable.module, first, seen.example, forward_fn),
            stats.mean.cpu(),
            stats.var.cpu(),
            first.running_mean.detach().double().cpu(),
            first.running_var.detach().double().cpu(),
        )
        if implied is not None:
            report.implied_mean, report.implied_std = implied


def _shared_example(example: Any, device: Any) -> Any:
    """The input probe needs only an example's shape and dtype (`_probe_first_layer`): the
    first rank's, on every rank, so that a rank without batches builds the same report.
    Collective."""
    known = [e for e in gather_objects(None if example is None else (tuple(example.shape), example.dtype)) if e]
    if example is not None or not known:
        return example
    shape, dtype = known[0]
    return torch.zeros(shape, dtype=dtype, device=device)


def _image_like(inputs: Any) -> bool:
    """A floating tensor with a channel dimension (N, C, ...): its per-channel statistics
    are the model's input statistics."""
    return isinstance(inputs, torch.Tensor) and inputs.dim() >= 2 and inputs.dtype.is_floating_point


def statistics_mature(runnable: Any) -> bool:
    """No BN002 (reset) and no BN003 (immature) finding under the default configuration:
    a project that ignores those rules in its reports must not turn a reset checkpoint
    into a suspected input."""
    codes = {f.code for f in audit_checkpoint(runnable.checkpoint, Config(), runnable.facts).findings}
    return not codes & {"BN002", "BN003"}


def _preprocessing_suspect(report: GapReport, mature: bool) -> bool:
    """The preprocessing pattern of `bnaudit.runtime.attribution` on mature statistics."""
    if not mature:
        return False
    measured = sorted((d for d in report.layers if d.drift is not None), key=lambda d: d.position)
    if not measured or measured[0].position != 0:
        return False
    return first_layer_mismatch([d.large for d in measured], measured[0].broad)


class _Reached(Exception):
    """Raised by a pre-hook to stop a forward once the first BN layer has its input."""


def _probe_first_layer(model: Any, first: Any, example: Any, forward_fn: Any) -> tuple[Any, Any] | None:
    """The first BN layer's per-channel input mean for constant inputs 0, 1 and 2 (shape of
    `example`), as (z0, z1 - z0); None when the path to it is not affine in the input
    (z2 - z1 differs from z1 - z0) or the model cannot run on such inputs."""
    if example is None:
        return None
    seen: list[Any] = []

    def hook(_module: Any, args: tuple[Any, ...]) -> None:
        x = args[0].detach().to(torch.float64)
        seen.append(x.transpose(0, 1).reshape(x.shape[1], -1).mean(dim=1).cpu())
        raise _Reached

    handle = first.register_forward_pre_hook(hook)
    try:
        for value in (0.0, 1.0, 2.0):
            batch = torch.full((2, *example.shape[1:]), value, dtype=example.dtype, device=example.device)
            try:
                forward(model, batch, forward_fn)
            except _Reached:
                pass
    except Exception:
        return None
    finally:
        handle.remove()
    if len(seen) != 3:
        return None
    z0, z1, z2 = seen
    step = z1 - z0
    if not torch.allclose(z2 - z1, step, rtol=1e-3, atol=1e-6 * float(step.abs().max().clamp_min(1.0))):
        return None
    return z0.numpy(), step.numpy()


def _run(
    model: Any,
    inputs: Any,
    forward_fn: Any,
    index: int,
    norms: dict[str, Any],
    train: bool,
    grayscale: bool | None = None,
) -> Any:
    """One forward in the requested mode; a failure names the layer and the shape it got."""

    def call() -> Any:
        if train:
            with batch_statistics(model, norms):
                return forward(model, inputs, forward_fn)
        return forward(model, inputs, forward_fn)

    try:
        output = call()
    except BnauditError:
        raise
    except Exception as exc:
        where = locate_failure(model, call)
        mode = "train mode (batch statistics)" if train else "eval mode"
        problem = input_problem(model, inputs, grayscale) if forward_fn is None else None
        raise BnauditError(
            f"batch {index}: the model rejects the batch in {mode}: {where}{problem or exception_line(exc)}"
        ) from None
    try:
        return output_tensor(output)
    except BnauditError as exc:
        if forward_fn is None:
            raise BnauditError(f"batch {index}: {exc}") from None
        raise BnauditError(
            f"batch {index}: the --forward function returned {type(output).__name__}, which holds no tensor: "
            "it must return the model's output (the logits, one row per sample)"
        ) from None


def _compare(out_train: Any, out_eval: Any, labels: Any, batch: Any, totals: _Totals) -> None:
    train = out_train.detach().to(torch.float64)
    evals = out_eval.detach().to(torch.float64)
    if train.shape != evals.shape or evals.dim() == 0 or evals.shape[0] != batch.size:
        raise BnauditError(
            f"batch {batch.index}: the model's output has shape {list(evals.shape)} for {batch.size} samples; "
            "pass --forward MODULE:CALLABLE returning one row of logits per sample"
        )
    classifier = evals.dim() == 2 and evals.shape[1] >= 2
    if totals.classifier is None:
        totals.classifier, totals.output_batch = classifier, batch.index
    elif totals.classifier != classifier:
        raise BnauditError(f"batch {batch.index}: the output shape changed to {list(evals.shape)}")
    n = batch.size
    totals.samples += n
    totals.non_finite_train += int((~torch.isfinite(train.reshape(n, -1)).all(dim=1)).sum())
    totals.non_finite_eval += int((~torch.isfinite(evals.reshape(n, -1)).all(dim=1)).sum())
    if classifier:
        pred_t, pred_e = train.argmax(dim=1), evals.argmax(dim=1)
        totals.agree += int((pred_t == pred_e).sum())
        logp_t, logp_e = torch.log_softmax(train, dim=1), torch.log_softmax(evals, dim=1)
        kl = (logp_e.exp() * (logp_e - logp_t)).sum(dim=1)
        totals.divergence_sum += float(kl.sum())
        if labels is not None:
            if int(labels.min()) < 0 or int(labels.max()) >= evals.shape[1]:
                raise BnauditError(
                    f"batch {batch.index}: labels range over {int(labels.min())}..{int(labels.max())} but the model "
                    f"has {evals.shape[1]} outputs"
                )
            totals.labelled += n
            totals.correct_train += int((pred_t == labels).sum())
            totals.correct_eval += int((pred_e == labels).sum())
    else:
        totals.divergence_sum += float(relative_l2s(train, evals).sum())


def _drift(norms: dict[str, Any], accumulated: dict[str, Any], hooked: dict[str, Any]) -> list[LayerDrift]:
    layers: list[LayerDrift] = []
    for position, (name, module) in enumerate(norms.items()):
        kind = getattr(module, "original_name", None) or type(module).__name__
        channels = int(getattr(module, "num_features", 0) or 0)
        mean_run, var_run = getattr(module, "running_mean", None), getattr(module, "running_var", None)

        def unmeasured(values: int, note: str) -> LayerDrift:
            return LayerDrift(name, position, kind, channels, values, None, None, None, note)  # noqa: B023 (called at once)

        if name not in hooked:
            layers.append(unmeasured(0, "not measured (TorchScript)"))
            continue
        stats = accumulated[name]
        if mean_run is None or var_run is None:
            layers.append(unmeasured(stats.count, "no running statistics (track_running_stats=False)"))
            continue
        if stats.count < 2:
            layers.append(unmeasured(stats.count, "not reached by the data" if stats.count == 0 else "too few values"))
            continue
        data_mean, data_var = stats.mean.cpu(), stats.var.cpu()
        run_mean, run_var = mean_run.detach().double().cpu(), var_run.detach().double().cpu()
        d = drift(data_mean, data_var, run_mean, run_var, float(module.eps))
        scores = channel_scores(data_mean, data_var, run_mean, run_var, float(module.eps))
        layers.append(
            LayerDrift(
                name,
                position,
                kind,
                int(mean_run.numel()),
                stats.count,
                d.mean_shift,
                d.max_mean_shift,
                d.var_log_ratio,
                worst=scores.worst,
                peak=scores.peak,
                broad=scores.broad,
            )
        )
    return rank_layers(layers)


def rank_layers(layers: list[LayerDrift]) -> list[LayerDrift]:
    """Mark the origins (`bnaudit.runtime.attribution.find_origins`, forward order) and
    rank: origins first in forward order, then measured layers by peak (largest first),
    then the unmeasured ones."""
    measured = sorted((d for d in layers if d.drift is not None), key=lambda d: d.position)
    origins = find_origins([d.large for d in measured], [d.peak for d in measured])
    marked = {d.name: replace(d, origin=o) for d, o in zip(measured, origins, strict=True)}
    layers = [marked.get(d.name, d) for d in layers]

    def key(d: LayerDrift) -> tuple[int, float, int]:
        if d.drift is None:
            return (2, 0.0, d.position)
        if d.origin:
            return (0, 0.0, d.position)
        peak = d.peak if d.peak is not None else math.inf
        return (1, -peak, d.position)

    return sorted(layers, key=key)


def measure_gap(
    spec: ModelSpec | str,
    options: Any,
    *,
    config: Config | None = None,
    progress: Callable[[int, int], None] | None = None,
    max_gap: float | None = None,
    strict: bool = False,
    fail_on: str | None = None,
) -> GapReport:
    """Load the model (`spec`: a `bnaudit.ModelSpec`, or a checkpoint path that needs no
    other option) and the data (`options`: a `bnaudit.DataOptions`) and measure the gap
    (see the module docstring). `config` (None: the defaults) decides which inspect findings
    the report carries; `max_gap`, `strict` (a gap that is not significant fails too) and
    `fail_on` (the inspect findings at or above it fail the run; None: the configuration
    file's fail-on, if it states one, `bnaudit.config.measurement_fail_on`) are stored on
    the report for `GapReport.exit_code`.

    Under torchrun (WORLD_SIZE > 1) it joins the process group for the measurement (gloo
    on the CPU, nccl with one GPU per rank for CUDA); each rank scores its share of whole
    batches and every rank returns the same report of all the samples (module docstring).

    >>> import bnaudit                                                      # doctest: +SKIP
    >>> bnaudit.measure_gap(bnaudit.ModelSpec("model.pt", arch="mypkg.models:net"),
    ...                     bnaudit.DataOptions(path="val.safetensors")).gap  # doctest: +SKIP
    """
    check_max_gap(max_gap)
    threshold = measurement_fail_on(config, fail_on)
    spec = as_model_spec(spec)
    target = resolve_device(spec.device)
    options.validate()
    if options.batch_size < 2:  # before the model loads: the cheapest refusal first
        raise BnauditError("--batch-size must be at least 2: train-mode BatchNorm normalises by batch statistics")
    forward_fn = load_forward(spec.forward)
    runnable = load_runnable(resolve_model(spec, config))
    stream = make_loader(replace(options, pin_memory=target.type == "cuda"))
    if max_gap is not None and stream.has_labels is False:
        raise BnauditError(NEEDS_LABELS)
    with torchrun(target) as ranks:
        report = measure_model_gap(runnable, stream, ranks.device, forward_fn, config, progress)
    report.max_gap = max_gap
    report.strict = strict
    report.fail_on = threshold
    if max_gap is not None and report.gap is not None and report.gap > max_gap and not report.gap_significant:
        verdict = "fails with --strict" if strict else "passes (--strict would fail it)"
        report.diagnosis.append(
            f"The gap exceeds --max-gap {max_gap:g} but its 95% interval contains 0: not significant, so the "
            f"check {verdict}."
        )
    if max_gap is not None and report.gap is None:
        raise BnauditError(NEEDS_LABELS)
    return report

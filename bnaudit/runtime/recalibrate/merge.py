"""`bnaudit merge`: statistics files of disjoint data (shards of one plan, separate jobs,
federated clients) merged exactly and written into their checkpoint.

Every file is read and checked (`bnaudit.formats.bnstats`) and every file refused that would
not merge into the statistics of one pass over the union (`statsfiles.check_mergeable`)
before anything is written. The files are merged in a fixed order (by data, then batch
range, then checksum: the output does not depend on the order of the arguments) with
Chan's formulas (`statsfiles.combine_statistics`), the method's statistics are stored as
`recalibrate` stores them (`methods.stored_statistics`), and the checkpoint is written in
its own format by `formats.write.save_like` (atomic; only running_mean, running_var and
num_batches_tracked change), with a recalibration record naming every file merged.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from bnaudit import __version__
from bnaudit.audit.layers import discover_layers
from bnaudit.config import Config
from bnaudit.errors import BnauditError
from bnaudit.formats.bnstats import StatisticsFile, read_statistics
from bnaudit.formats.model import Checkpoint
from bnaudit.formats.provenance import RecalibrationRecord, StatisticsSource
from bnaudit.formats.read import read_checkpoint
from bnaudit.formats.write import check_destination, check_writable, save_like, statistics_digests
from bnaudit.reports.merge import MergedFile, MergeReport
from bnaudit.runtime.models import ModelSpec, resolve_model
from bnaudit.runtime.recalibrate.command import layer_changes_of, record_date, sigterm_unwinds
from bnaudit.runtime.recalibrate.methods import LayerCalibration, calibration_warnings, stored_statistics, to_numpy
from bnaudit.runtime.recalibrate.statsfiles import check_mergeable, checkpoint_digest, combine_statistics


def read_statistics_files(paths: Sequence[str]) -> list[StatisticsFile]:
    """Every file read and checked; the same file named twice is refused first."""
    if not paths:
        raise BnauditError("give the statistics files to merge")
    seen: dict[str, str] = {}
    for path in paths:
        real = os.path.realpath(path)
        if real in seen:
            also = "" if seen[real] == path else f" (also as {seen[real]})"
            raise BnauditError(f"{path}: given twice{also}: each statistics file counts once")
        seen[real] = path
    return [read_statistics(path) for path in paths]


def merge_statistics(
    paths: Sequence[str],
    checkpoint: str,
    output: str,
    *,
    key: str | None = None,
    trust_pickle: bool = False,
    force: bool = False,
    config: Config | None = None,
) -> MergeReport:
    """Merge the statistics files `paths` and write `checkpoint` again to `output` with the
    merged statistics (module docstring). `key`: the container key of the state dict (the
    files' own by default). A folder is resolved to the model checkpoint inspect finds in it.

    >>> import bnaudit                                                        # doctest: +SKIP
    >>> bnaudit.merge_statistics(["s0.bnstats", "s1.bnstats"], "model.pt", "model.recal.pt")  # doctest: +SKIP
    """
    with sigterm_unwinds():
        path = resolve_model(ModelSpec(checkpoint, key=key, trust_pickle=trust_pickle), config).checkpoint
        check_destination(output, path, force)
        for given in paths:
            if os.path.exists(output) and os.path.exists(given) and os.path.samefile(output, given):
                raise BnauditError(f"{output}: is the statistics file {given}; write the checkpoint to another file")
        files = read_statistics_files(paths)
        first = files[0]
        ckpt = _rebased(
            read_checkpoint(path, key=key if key is not None else first.key, trust_pickle=trust_pickle), first
        )
        names = list(first.layer_names)
        lacking = [
            n for n in names if f"{n}.running_mean" not in ckpt.tensors or f"{n}.running_var" not in ckpt.tensors
        ]
        if lacking:
            raise BnauditError(f"{path}: has no running statistics for layer {lacking[0]!r} of {first.path}")
        warnings = check_mergeable(files, checkpoint_digest(ckpt, names))
        check_writable(ckpt, output, trust_pickle)
        ordered = sorted(files, key=lambda s: (s.data, s.batch_range, s.checksum))
        records = combine_statistics(ordered)
        calibrated = _layers(ckpt, records, first.method, names)
        updates = _updates(ckpt, calibrated)
        provenance = _provenance(ordered, calibrated, statistics_digests(ckpt, updates, names))
        save_like(ckpt, updates, output, force=force, provenance=provenance, trust_pickle=trust_pickle)
        samples = sum(s.samples for s in files)
        return MergeReport(
            checkpoint=path,
            output=output,
            format=ckpt.format,
            key=ckpt.key,
            method=first.method,
            samples=samples,
            batches=sum(s.batches for s in files),
            files=[MergedFile(s.path, s.samples, s.batches, _shard(s), s.data, s.world_size) for s in files],
            layers=layer_changes_of([m.calibration for m in calibrated], {m.name: m.stored for m in calibrated}),
            warnings=warnings + calibration_warnings(samples, [layer.calibration for layer in calibrated]),
            provenance=provenance,
            prefix=ckpt.prefix,
        )


def _shard(stats: StatisticsFile) -> str | None:
    return None if stats.shard is None else str(stats.shard)


def _rebased(ckpt: Checkpoint, stats: StatisticsFile) -> Checkpoint:
    """`ckpt` named as the files name its layers: stored names less the files' prefix (the
    part `recalibrate` did not strip to match the model's names)."""
    prefix = stats.prefix
    stored = {ckpt.prefix + n: ref for n, ref in ckpt.tensors.items()}
    if not all(name.startswith(prefix) for name in stored):
        raise BnauditError(
            f"{ckpt.path}: its keys do not start with {prefix!r}, as those of the checkpoint {stats.path} was "
            "computed on did: statistics of another checkpoint"
        )
    tensors = {name[len(prefix) :]: ref.renamed(name[len(prefix) :]) for name, ref in stored.items()}
    return dataclasses.replace(ckpt, tensors=tensors, prefix=prefix)


@dataclasses.dataclass(frozen=True)
class _Merged:
    """One merged layer: what recalibrate would have measured, and its statistics as stored."""

    calibration: LayerCalibration
    stored: tuple[np.ndarray, np.ndarray]

    @property
    def name(self) -> str:
        return self.calibration.name


def _layers(ckpt: Checkpoint, records: dict[str, Any], method: str, names: list[str]) -> list[_Merged]:
    """Each layer's merged record as the `LayerCalibration` one process would have made."""
    eps = {layer.name: layer.eps for layer in discover_layers(ckpt).layers}
    merged = []
    for name in names:
        record = records[name]
        mean_ref, var_ref = ckpt.tensors[f"{name}.running_mean"], ckpt.tensors[f"{name}.running_var"]
        old_mean, old_var = to_numpy(mean_ref.to_torch()), to_numpy(var_ref.to_torch())
        counter = ckpt.tensors.get(f"{name}.num_batches_tracked")
        new_mean, new_var = stored_statistics(record, method)
        if not (np.isfinite(new_mean).all() and np.isfinite(new_var).all()):
            raise BnauditError(f"layer {name}: the merged statistics are not finite; nothing written")
        dtype = getattr(torch, var_ref.dtype)
        layer = LayerCalibration(
            name=name,
            num_features=len(old_mean),
            eps=eps.get(name, 1e-5),
            count=record.stats.count,
            batches=record.batches,
            calls_per_batch=record.max_calls,
            old_mean=old_mean,
            old_var=old_var,
            old_num_batches_tracked=int(counter.read()[0]) if counter is not None and counter.is_integer else None,
            data_mean=to_numpy(record.stats.mean),
            data_var=to_numpy(record.stats.var),
            new_mean=new_mean,
            new_var=new_var,
            stats_dtype=var_ref.dtype,
            data_m2=to_numpy(record.stats.m2),
            calls=record.calls,
        )
        stored = (
            to_numpy(torch.from_numpy(new_mean).to(getattr(torch, mean_ref.dtype))),
            to_numpy(torch.from_numpy(new_var).to(dtype)),
        )
        merged.append(_Merged(layer, stored))
    return merged


def _updates(ckpt: Checkpoint, layers: list[_Merged]) -> dict[str, Any]:
    updates: dict[str, Any] = {}
    for merged in layers:
        layer = merged.calibration
        updates[f"{layer.name}.running_mean"] = torch.from_numpy(layer.new_mean)
        updates[f"{layer.name}.running_var"] = torch.from_numpy(layer.new_var)
        if f"{layer.name}.num_batches_tracked" in ckpt.tensors:
            updates[f"{layer.name}.num_batches_tracked"] = torch.tensor(layer.batches, dtype=torch.int64)
    return updates


def _provenance(files: list[StatisticsFile], layers: list[_Merged], digests: dict[str, str]) -> RecalibrationRecord:
    """The record of a merge: every file named with its counts, the sums, the shared plan."""

    def common(values: set[Any], otherwise: Any) -> Any:
        return next(iter(values)) if len(values) == 1 else otherwise

    data = sorted({s.data for s in files})
    return RecalibrationRecord(
        method=files[0].method,
        samples=sum(s.samples for s in files),
        batches=sum(s.batches for s in files),
        batch_size=common({s.batch_size for s in files}, 0),
        seed=common({s.seed for s in files}, 0),
        shuffle=common({s.shuffle for s in files}, False),
        data=f"merged from {len(files)} statistics files of " + "; ".join(data),
        world_size=sum(s.world_size for s in files),
        recalibrated_layers=tuple(layer.name for layer in layers),
        digests=digests,
        bnaudit_version=__version__,
        date=record_date(),
        statistics_files=tuple(
            StatisticsSource(os.path.basename(s.path), s.samples, s.batches, _shard(s) or "", s.data, s.checksum)
            for s in files
        ),
    )

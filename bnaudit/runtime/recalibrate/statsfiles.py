"""Statistics files on the torch side: what `recalibrate --stats-out` writes, the checkpoint
digest that binds a file to its checkpoint, and the exact merge of several files.

A file holds per layer the (count, mean, M2) of one pass (`bnaudit.formats.bnstats`). Files
of disjoint data merge like torchrun's ranks do (`distributed.reduce_pass`): counts and
batches summed, (count, mean, M2) combined with Chan et al.'s formulas
(`bnaudit.runtime.stats.ChannelStats.merge`), cumulative's sums of batch means and variances
summed. The merged record then gives the stored statistics exactly as one process would
(`methods.stored_statistics`): the population statistics of the union, equal to a single
process over the same batches to float64 rounding.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from bnaudit import __version__
from bnaudit.errors import BnauditError
from bnaudit.formats.bnstats import LayerEntry, Shard, StatisticsFile
from bnaudit.formats.model import Checkpoint
from bnaudit.runtime.recalibrate.distributed import LayerRecord
from bnaudit.runtime.recalibrate.methods import Calibration
from bnaudit.runtime.stats import ChannelStats

# The buffers a recalibration writes: never part of the digest of what it depends on.
_STATISTICS = ("running_mean", "running_var", "num_batches_tracked")


def checkpoint_digest(ckpt: Checkpoint, layers: Iterable[str]) -> str:
    """SHA-256 of every tensor of `ckpt` except the running statistics of `layers` (model
    names, as `ckpt.tensors` has them): name as stored (`ckpt.prefix` + name), dtype, shape
    and bytes, in the order of the stored names. What a pass depends on: the weights, and the
    statistics of the layers it leaves in eval mode."""
    skipped = {f"{layer}.{leaf}" for layer in layers for leaf in _STATISTICS}
    digest = hashlib.sha256(b"bnaudit checkpoint digest 1\0")
    for stored, name in sorted((ckpt.prefix + n, n) for n in ckpt.tensors if n not in skipped):
        tensor = ckpt.tensors[name].to_torch().detach().to("cpu").contiguous()
        if tensor.is_quantized:
            tensor = tensor.int_repr()
        digest.update(json.dumps([stored, str(tensor.dtype), list(tensor.shape)]).encode("utf-8") + b"\0")
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def statistics_of(
    calibration: Calibration,
    ckpt: Checkpoint,
    options: Any,
    data: str,
    shard: Shard | None,
    batch_range: tuple[int, int],
    plan_batches: int,
) -> StatisticsFile:
    """The statistics file of a finished calibration (`exact` or `cumulative`) of `ckpt` on
    the data `options` describe (`data`: its description)."""
    layers = tuple(
        LayerEntry(
            name=layer.name,
            channels=layer.num_features,
            batches=layer.batches,
            calls=layer.calls,
            calls_per_batch=layer.calls_per_batch,
            count=layer.count,
            mean=tuple(layer.data_mean.tolist()),
            m2=tuple((layer.data_m2 if layer.data_m2 is not None else layer.data_var * (layer.count - 1)).tolist()),
            batch_mean_sum=None if layer.batch_mean_sum is None else tuple(layer.batch_mean_sum.tolist()),
            batch_var_sum=None if layer.batch_var_sum is None else tuple(layer.batch_var_sum.tolist()),
        )
        for layer in calibration.layers
    )
    return StatisticsFile(
        path="",
        checkpoint_digest=checkpoint_digest(ckpt, [layer.name for layer in layers]),
        key=ckpt.key,
        prefix=ckpt.prefix,
        method=calibration.method,
        batch_size=options.batch_size,
        seed=options.seed,
        shuffle=options.shuffle,
        num_samples=options.num_samples,
        data=data,
        samples=calibration.samples,
        batches=calibration.batches,
        world_size=calibration.world_size,
        shard=shard,
        batch_range=batch_range,
        plan_batches=plan_batches,
        bnaudit_version=__version__,
        checksum="",
        layers=layers,
    )


def combine_statistics(files: Sequence[StatisticsFile]) -> dict[str, LayerRecord]:
    """Every layer's record merged over `files`, in the order given (module docstring):
    count, mean and M2 by Chan's formulas, batches and calls summed, the most calls per
    forward kept, cumulative's sums summed. The files must hold the same layers
    (`check_mergeable`)."""
    records: dict[str, LayerRecord] = {}
    for stats in files:
        for layer in stats.layers:
            record = records.setdefault(layer.name, LayerRecord(ChannelStats()))
            mean = torch.tensor(layer.mean, dtype=torch.float64)
            record.stats.merge(layer.count, mean, torch.tensor(layer.m2, dtype=torch.float64))
            record.batches += layer.batches
            record.calls += layer.calls
            record.max_calls = max(record.max_calls, layer.calls_per_batch)
            if layer.batch_mean_sum is not None and layer.batch_var_sum is not None:
                sums = torch.tensor(layer.batch_mean_sum, dtype=torch.float64)
                squares = torch.tensor(layer.batch_var_sum, dtype=torch.float64)
                record.mean_sum = sums if record.mean_sum is None else record.mean_sum + sums
                record.var_sum = squares if record.var_sum is None else record.var_sum + squares
    return records


def check_mergeable(files: Sequence[StatisticsFile], digest: str | None = None) -> list[str]:
    """Refuse files that do not merge into one set of statistics (a BnauditError naming the
    first problem): the same file or the same statistics twice, mixed methods, other layers
    or another checkpoint (`digest`: the checkpoint's, when known), shards of one plan that
    overlap. Returns warnings: shards of a plan that leave some of its batches out."""
    if not files:
        raise BnauditError("no statistics files to merge")
    first = files[0]
    seen: dict[str, str] = {}
    for stats in files:
        if stats.checksum in seen:
            raise BnauditError(
                f"{stats.path} and {seen[stats.checksum]} hold the same statistics (identical checksums): "
                "each shard's statistics count once"
            )
        seen[stats.checksum] = stats.path
        if stats.method != first.method:
            raise BnauditError(
                f"{stats.path}: method {stats.method}, but {first.path}: method {first.method}; "
                "statistics of one method merge"
            )
        if (stats.key, stats.prefix) != (first.key, first.prefix):
            raise BnauditError(f"{stats.path}: statistics of another state dict than {first.path}'s (key, prefix)")
        _same_layers(stats, first)
        if digest is not None and stats.checkpoint_digest != digest:
            raise BnauditError(
                f"{stats.path}: statistics of another checkpoint (digest {stats.checkpoint_digest[:12]}, the "
                f"checkpoint's {digest[:12]}): recalibrate every shard on the checkpoint given to merge"
            )
        if stats.checkpoint_digest != first.checkpoint_digest:
            raise BnauditError(
                f"{stats.path}: statistics of another checkpoint than {first.path}'s "
                f"(digests {stats.checkpoint_digest[:12]} and {first.checkpoint_digest[:12]})"
            )
    return _check_shards(files)


def _same_layers(stats: StatisticsFile, first: StatisticsFile) -> None:
    mine = {layer.name: layer.channels for layer in stats.layers}
    theirs = {layer.name: layer.channels for layer in first.layers}
    if mine == theirs:
        return
    only = sorted(set(mine) - set(theirs)) or sorted(set(theirs) - set(mine))
    if only:
        where = stats.path if only[0] in mine else first.path
        raise BnauditError(
            f"{stats.path}: another layer set than {first.path} ({only[0]!r} only in {where}): "
            "recalibrate every shard with the same --layers/--exclude"
        )
    name = next(n for n in mine if mine[n] != theirs[n])
    raise BnauditError(f"{stats.path}: layer {name!r} has {mine[name]} channels, {theirs[name]} in {first.path}")


def _check_shards(files: Sequence[StatisticsFile]) -> list[str]:
    """Files of the same data: sharded ones must come from one batch plan and not overlap;
    a file of the whole data overlaps every shard of it. Files of different data (another
    description) are independent. Returns a warning per plan whose shards leave batches out."""
    by_data: dict[str, list[StatisticsFile]] = {}
    for stats in files:
        by_data.setdefault(stats.data, []).append(stats)
    warnings = []
    for data, group in by_data.items():
        sharded = [s for s in group if s.shard is not None]
        if not sharded:
            continue  # whole-data files of one description: different sites' data can share a name
        plans = {s.plan() for s in group}
        if len(plans) > 1:
            a, b = group[0], next(s for s in group if s.plan() != group[0].plan())
            raise BnauditError(
                f"{b.path} and {a.path}: statistics of {data} from different batch plans ({_plan_words(b)} vs "
                f"{_plan_words(a)}): shards partition the data only under one --batch-size, --seed and --num-samples"
            )
        spans = sorted((s.batch_range, s.path, s.shard) for s in group)
        for (a_range, a_path, a_shard), (b_range, b_path, b_shard) in itertools.pairwise(spans):
            if b_range[0] < a_range[1]:
                what = "the same shard twice" if a_range == b_range else "overlapping shards"
                raise BnauditError(
                    f"{b_path} ({_covers(b_shard)}) and {a_path} ({_covers(a_shard)}): {what} of {data}: batches "
                    f"{b_range[0]}..{min(a_range[1], b_range[1]) - 1} counted twice"
                )
        covered = sum(end - start for (start, end), _, _ in spans)
        total = group[0].plan_batches
        if covered < total:
            warnings.append(
                f"the shards of {data} cover {covered} of its {total} batches: the merged statistics leave the "
                "others out"
            )
    return warnings


def _covers(shard: Shard | None) -> str:
    return "the whole data" if shard is None else f"shard {shard}"


def _plan_words(stats: StatisticsFile) -> str:
    order = f"seed {stats.seed}" if stats.shuffle else "file order"
    cap = "" if stats.num_samples is None else f", {stats.num_samples} samples"
    return f"batch size {stats.batch_size}, {order}{cap}, {stats.plan_batches} batches"

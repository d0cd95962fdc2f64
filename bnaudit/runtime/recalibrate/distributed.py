"""Recalibration under torchrun: each rank calibrates its own shard of the samples, and
the ranks' statistics are merged exactly.

Rank r of W takes every W-th sample of the one global order (`shard_plan`), so no sample
is seen twice or left out. After a pass each rank holds per-layer (count, mean, M2); they
are all-gathered and Chan-merged in rank order (`stats.all_gather_merge`), so every rank
ends with the population statistics of all samples, equal to one process seeing them all
to float64 rounding. Counters (samples, batches, calls) are summed, maxima taken; the
cumulative method's sums of batch means and variances are summed. Every collective runs
on every rank in the same order; `together` turns one rank's failure into an error on
all ranks instead of a hang. Without torch.distributed all of this is a no-op.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from bnaudit.errors import BnauditError
from bnaudit.runtime.norms import merge_trailing_singleton_plan, num_features
from bnaudit.runtime.stats import ChannelStats, all_gather_merge


@dataclass
class LayerRecord:
    """What one pass measured at one layer, on this rank (or merged over all ranks)."""

    stats: ChannelStats = field(default_factory=ChannelStats)
    mean_sum: Any = None  # cumulative: sum of batch means (float64)
    var_sum: Any = None  # cumulative: sum of unbiased batch variances
    calls: int = 0  # BN calls (cumulative's B)
    batches: int = 0  # forwards that reached the layer
    max_calls: int = 0


@dataclass
class PassResult:
    """One pass over the data: every observed layer's record and the batch counts."""

    records: dict[str, LayerRecord]
    samples: int = 0
    batches: int = 0
    max_batch: int = 0


def distributed() -> tuple[int, int]:
    """(rank, world size) when torch.distributed is initialised, else (0, 1)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@contextlib.contextmanager
def together() -> Iterator[None]:
    """Under torch.distributed, a failure on one rank ends the work on every rank
    (rather than leaving the others waiting in the next collective)."""
    if distributed()[1] == 1:
        yield
        return
    failure: BaseException | None = None
    try:
        yield
    except Exception as exc:
        failure = exc
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    flag = torch.tensor([int(failure is not None)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if failure is not None:
        raise failure
    if int(flag.item()):
        raise BnauditError("another rank failed (its error is in that rank's output)")


def reduce_pass(result: PassResult, observed: dict[str, Any], cumulative: bool) -> PassResult:
    """Combine every rank's pass exactly (collective; same layer order on every rank)."""
    if distributed()[1] == 1:
        return result
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    names = list(observed)
    counts = torch.tensor(
        [[result.samples, result.batches]] + [[result.records[n].batches, result.records[n].calls] for n in names],
        dtype=torch.int64,
        device=device,
    )
    dist.all_reduce(counts)
    maxima = torch.tensor(
        [result.max_batch] + [result.records[n].max_calls for n in names], dtype=torch.int64, device=device
    )
    dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
    merged = PassResult({}, int(counts[0, 0]), int(counts[0, 1]), int(maxima[0]))
    for i, name in enumerate(names):
        record = result.records[name]
        channels = num_features(observed[name])
        new = LayerRecord(
            all_gather_merge(record.stats, channels),
            batches=int(counts[i + 1, 0]),
            calls=int(counts[i + 1, 1]),
            max_calls=int(maxima[i + 1]),
        )
        if cumulative:
            sums = torch.zeros(2, channels, dtype=torch.float64, device=device)
            if record.mean_sum is not None:
                sums[0], sums[1] = record.mean_sum.to(device), record.var_sum.to(device)
            dist.all_reduce(sums)
            new.mean_sum, new.var_sum = sums[0].cpu(), sums[1].cpu()
        merged.records[name] = new
    return merged


def shard_plan(plan: list[list[int]], batch_size: int, rank: int, world: int) -> list[list[int]]:
    """This rank's batches: every `world`-th sample of the global order (no sample on
    two ranks, none left out), cut into batches, a last batch of one sample merged."""
    order = [index for batch in plan for index in batch]
    mine = order[rank::world]
    return merge_trailing_singleton_plan([mine[i : i + batch_size] for i in range(0, len(mine), batch_size)])


@contextlib.contextmanager
def process_group(device: Any) -> Iterator[tuple[int, int]]:
    """Under torchrun (WORLD_SIZE > 1): join the process group (nccl for CUDA, gloo for
    the CPU) for the block and yield (rank, world size); otherwise (0, 1)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        yield 0, 1
        return
    if dist.is_initialized():  # the caller set it up
        yield dist.get_rank(), dist.get_world_size()
        return
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        yield dist.get_rank(), dist.get_world_size()
    finally:
        dist.destroy_process_group()


def device_for_rank(device: Any) -> Any:
    """Under torchrun each rank takes its own GPU (LOCAL_RANK)."""
    if device.type == "cuda" and device.index is None and "LOCAL_RANK" in os.environ:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % max(torch.cuda.device_count(), 1))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device

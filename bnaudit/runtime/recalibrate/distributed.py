"""Recalibration under torchrun: each rank calibrates its own shard of whole batches, and
the ranks' statistics are merged exactly.

Rank r of W takes a contiguous block of the single-process run's batches
(`bnaudit.runtime.batching.BatchPlan.shard`), so no sample is seen twice or left out and
every batch holds the samples it holds in one process. After a pass each rank holds
per-layer (count, mean, M2); they are all-gathered and Chan-merged in rank order
(`stats.all_gather_merge`), so every rank ends with the population statistics of all
samples, equal to one process seeing them all to float64 rounding. Counters (samples,
batches, calls) are summed, maxima taken; the cumulative method's sums of batch means and
variances are summed. Every collective runs on every rank in the same order. Process
groups, devices and failures are `bnaudit.runtime.distributed`'s, sharding
`bnaudit.runtime.batching`'s. Without torch.distributed all of this is a no-op.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from bnaudit.runtime.distributed import collective_device, distributed
from bnaudit.runtime.norms import num_features
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


def reduce_pass(result: PassResult, observed: dict[str, Any], cumulative: bool) -> PassResult:
    """Combine every rank's pass exactly (collective; same layer order on every rank)."""
    if distributed()[1] == 1:
        return result
    device = collective_device()
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

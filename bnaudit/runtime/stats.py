"""Streaming per-channel statistics of BN inputs, exact in float64.

For the values x_1..x_n that reach channel c of a BN layer (n = N*H*W per batch for a
2-D map), bnaudit defines

  mean       mu_c      = (1/n) * sum_i x_i
  M2         M2_c      = sum_i (x_i - mu_c)^2
  variance   var_c     = M2_c / (n - 1)     (unbiased: what PyTorch stores in running_var)
  biased     var_b_c   = M2_c / n           (what training-mode forward normalises with)

Batches are merged with Chan et al.'s parallel formulas
  n = n_a + n_b,  d = mu_b - mu_a,  mu = mu_a + d * n_b / n,  M2 = M2_a + M2_b + d^2 n_a n_b / n
so the result is the population statistic of all samples, independent of batch size,
sample order and sharding (to float64 rounding), and never E[x^2] - E[x]^2.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from bnaudit.audit.statistics import Drift
from bnaudit.runtime.distributed import collective_device, gather_objects


def drift(data_mean: Any, data_var: Any, run_mean: Any, run_var: Any, eps: float) -> Drift:
    """`Drift` of per-channel arrays (numpy, or CPU tensors), computed in float64."""
    mu_d, var_d, mu_r, var_r = (np.asarray(a, dtype=np.float64) for a in (data_mean, data_var, run_mean, run_var))
    with np.errstate(all="ignore"):
        shift = np.abs(mu_d - mu_r) / np.sqrt(var_r + eps)
        log_ratio = np.abs(np.log((var_d + eps) / (var_r + eps)))

    def finite(x: float) -> float | None:
        return float(x) if np.isfinite(x) else None

    return Drift(finite(shift.mean()), finite(shift.max()), finite(log_ratio.mean()))


# float64 scratch per chunk on the CPU: small enough to stay in a core's L2 cache
# through the four passes over it (copy, subtract, sum, square-and-sum), which makes
# the whole update about twice as fast as on one batch-sized copy.
CHUNK_BYTES = 1 << 19


def shifted_sums(x: Any, shift: Any) -> Any:
    """Per-channel float64 S1 = sum(d), S2 = sum(d^2) with d = x - shift over every
    value of channel c in a batch x of shape (N, C, *); shift: (C,) float64 on x's device.
    Returns the pair as the rows of one (2, C) tensor (`s1, s2 = shifted_sums(...)`).

    d is formed in float64 (exact for float32/float16 data; the subtraction is one
    float64 rounding). On the CPU the samples are taken a few at a time into one
    reused float64 buffer (CHUNK_BYTES); the chunk sums are added in float64, so the
    result is the same sums to float64 rounding. On an accelerator: one chunk.
    Called for every BN input of every batch: few tensor operations per call.
    """
    samples = x.shape[0]
    dims = [0, *range(2, x.dim())]
    shift = shift.view([1, -1] + [1] * (x.dim() - 2))
    per_sample = max(x.numel() // max(samples, 1), 1)
    step = samples if x.device.type != "cpu" else max(1, min(samples, CHUNK_BYTES // (8 * per_sample)))
    if step >= samples:
        deviation = x.to(torch.float64, copy=True).sub_(shift)
        s1 = deviation.sum(dim=dims)
        return torch.stack([s1, deviation.square_().sum(dim=dims)])
    parts = x.split(step)
    buffer = torch.empty((step, *x.shape[1:]), dtype=torch.float64, device=x.device)
    sums = torch.empty((2, len(parts), x.shape[1]), dtype=torch.float64, device=x.device)
    rows1, rows2 = sums[0].unbind(0), sums[1].unbind(0)
    for i, part in enumerate(parts):
        deviation = buffer if part.shape[0] == step else buffer[: part.shape[0]]
        deviation.copy_(part).sub_(shift)
        torch.sum(deviation, dim=dims, out=rows1[i])
        torch.sum(deviation.square_(), dim=dims, out=rows2[i])
    return sums.sum(dim=1)


@dataclass
class ChannelStats:
    """count, mean and M2 per channel (float64 tensors on the device of the data).

    A batch is summed around a per-channel `shift`: with d = x - shift in float64
    (exact for float32/float16 data), it contributes mean = shift + sum(d)/n and
    M2 = sum(d^2) - sum(d)^2/n, every sum in float64 (`shifted_sums`: cache-sized
    float64 chunks on the CPU, no batch-sized temporaries), and is exact to float64
    rounding, amplified only by (mean - shift)^2 / variance. Unset, the shift is the
    first sample seen (well conditioned); pass a fixed one (e.g. the layer's
    running_mean) to make the sums independent of which sample comes first, so that
    any batching or sharding of the same samples agrees to float64 rounding.
    """

    count: int = 0
    mean: Any = None  # torch.Tensor (C,) float64
    m2: Any = None  # torch.Tensor (C,) float64
    shift: Any = None  # torch.Tensor (C,)

    def update(self, x: Any) -> None:
        """Merge a batch of shape (N, C, *) into the running statistics."""
        if x.dim() < 2:
            raise ValueError(f"BN input must have a channel dimension, got shape {tuple(x.shape)}")
        channels = x.shape[1]
        n = x.numel() // channels if channels else 0
        if n == 0:
            return
        if self.shift is None:
            first = x.detach()[0].reshape(channels, -1)[:, 0].to(torch.float64)
            self.shift = torch.where(torch.isfinite(first), first, torch.zeros_like(first))
        shift = self.shift.to(x.device, torch.float64)  # no copy when it is already
        s1, s2 = shifted_sums(x.detach(), shift)
        batch_mean = (s1 / n).add_(shift)  # shift + s1 / n
        batch_m2 = s2.sub_(s1.square_().div_(n)).clamp_min_(0.0)  # s2 - s1^2 / n, s1 spent
        if self.count == 0:  # fresh tensors: nothing to copy
            self.count, self.mean, self.m2 = n, batch_mean, batch_m2
        else:
            self.merge(n, batch_mean, batch_m2)

    def merge(self, n_b: int, mean_b: Any, m2_b: Any) -> None:
        """Chan's merge of another (count, mean, M2) into this one."""
        if n_b == 0:
            return
        if self.count == 0:
            self.count, self.mean, self.m2 = n_b, mean_b.clone(), m2_b.clone()
            return
        n_a, n = self.count, self.count + n_b
        delta = mean_b - self.mean
        # in place: this object owns mean and m2 (cloned at the first merge)
        self.mean.add_(delta * (n_b / n))
        self.m2.add_(m2_b).add_(delta.square_().mul_(n_a * n_b / n))
        self.count = n

    @property
    def var(self) -> Any:
        """Unbiased variance M2 / (n - 1); NaN where n < 2."""
        if self.count < 2:
            return torch.full_like(self.m2, float("nan"))
        return self.m2 / (self.count - 1)

    @property
    def var_biased(self) -> Any:
        """Biased variance M2 / n (what training-mode forward normalises with)."""
        return self.m2 / self.count

    def add(self, other: ChannelStats) -> None:
        """Merge another accumulation of the same layer (Chan's merge)."""
        self.merge(other.count, other.mean, other.m2)


@dataclass
class InstanceStats:
    """Per-channel statistics of an InstanceNorm input, as its running statistics define
    them. An instance is one (sample, channel) of L values (L = H*W for a 2-D map); over
    the k instances seen, with mean_j and the unbiased variance var_j of instance j,

      mean   (1/k) * sum_j mean_j
      var    (1/k) * sum_j var_j

    which is what a tracked InstanceNorm's running_mean / running_var average (its
    training-mode forward normalises each instance by its own statistics and updates the
    running ones with their mean over the batch). The variance pooled over all values
    would add the spread of the instance means, which InstanceNorm removes. `count`:
    values per channel (k * L). Sums in float64; merging adds them (float64 rounding).
    """

    count: int = 0
    instances: int = 0
    mean_sum: Any = None  # torch.Tensor (C,) float64
    var_sum: Any = None  # torch.Tensor (C,) float64

    def update(self, x: Any) -> None:
        """Add a batch of shape (N, C, *), or (C, L) unbatched."""
        x = x.detach()
        if x.dim() == 2:
            x = x.unsqueeze(0)
        values = x.to(torch.float64).flatten(2)  # (N, C, L)
        n, length = values.shape[0], values.shape[2]
        if n == 0 or length == 0:
            return
        var = values.var(dim=2) if length > 1 else torch.full(values.shape[:2], float("nan"), dtype=torch.float64)
        self.add(InstanceStats(n * length, n, values.mean(dim=2).sum(dim=0), var.sum(dim=0)))

    def add(self, other: InstanceStats) -> None:
        if other.instances == 0:
            return
        if self.instances == 0:
            self.count, self.instances = other.count, other.instances
            self.mean_sum, self.var_sum = other.mean_sum.clone(), other.var_sum.clone()
            return
        self.count += other.count
        self.instances += other.instances
        self.mean_sum = self.mean_sum + other.mean_sum.to(self.mean_sum.device)
        self.var_sum = self.var_sum + other.var_sum.to(self.var_sum.device)

    @property
    def mean(self) -> Any:
        return self.mean_sum / self.instances

    @property
    def var(self) -> Any:
        return self.var_sum / self.instances


def all_gather_instances(stats: InstanceStats) -> InstanceStats:
    """Every rank's `InstanceStats` added in rank order, identical on every rank.
    Collective."""
    merged = InstanceStats()
    for part in gather_objects(
        stats
        if stats.instances == 0
        else InstanceStats(stats.count, stats.instances, stats.mean_sum.cpu(), stats.var_sum.cpu())
    ):
        merged.add(part)
    return merged


@contextlib.contextmanager
def record_bn_inputs(
    modules: dict[str, Any], instance: Collection[str] = ()
) -> Iterator[dict[str, ChannelStats | InstanceStats]]:
    """Accumulate the input statistics of each named module while the block runs:
    `InstanceStats` for the names in `instance` (InstanceNorm layers), `ChannelStats`
    for the others.

    Forward pre-hooks see exactly what the layer normalises; they are removed on
    exit, also on error.
    """
    stats: dict[str, ChannelStats | InstanceStats] = {
        name: InstanceStats() if name in instance else ChannelStats() for name in modules
    }
    handles = []
    for name, module in modules.items():

        def hook(_module: Any, args: tuple[Any, ...], _name: str = name) -> None:
            stats[_name].update(args[0])

        handles.append(module.register_forward_pre_hook(hook))
    try:
        yield stats
    finally:
        for handle in handles:
            handle.remove()


def all_gather_merge(stats: ChannelStats, num_channels: int, group: Any = None) -> ChannelStats:
    """The exact population statistics of every rank's `stats`, identical on all ranks.

    Each rank contributes its (count, mean, M2); they are all-gathered in float64 and
    Chan-merged in rank order, so every rank computes the same numbers by the same
    operations. Equal, to float64 rounding, to one process seeing all the samples
    (unlike averaging per-rank variances, it includes the spread of the rank means).
    A rank that saw nothing contributes count 0. Collective: every rank must call it,
    in the same order. gloo needs CPU tensors, nccl CUDA ones.
    """
    device = collective_device(group)
    packed = torch.zeros(2 * num_channels + 1, dtype=torch.float64, device=device)
    if stats.count:
        # counts are integers below 2^53 in any realistic run: exact in float64
        packed[0] = float(stats.count)
        packed[1 : num_channels + 1] = stats.mean.to(device)
        packed[num_channels + 1 :] = stats.m2.to(device)
    gathered = [torch.empty_like(packed) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, packed, group=group)
    merged = ChannelStats()
    for part in gathered:
        n = int(part[0].item())
        merged.merge(n, part[1 : num_channels + 1].cpu(), part[num_channels + 1 :].cpu())
    return merged


def all_gather_stats(stats: list[ChannelStats | InstanceStats]) -> list[ChannelStats | InstanceStats]:
    """Every rank's accumulations, each merged over the ranks (`all_gather_merge`,
    `all_gather_instances`), identical on every rank. A channel count that only some ranks
    know (a rank that saw nothing) is agreed first. Collective: every rank passes the
    same kinds in the same order."""
    known = gather_objects([_channels(s) for s in stats])
    merged: list[ChannelStats | InstanceStats] = []
    for i, part in enumerate(stats):
        channels = max(counts[i] for counts in known)
        if isinstance(part, InstanceStats):
            merged.append(all_gather_instances(part))
        else:
            merged.append(all_gather_merge(part, channels) if channels else ChannelStats())
    return merged


def _channels(stats: ChannelStats | InstanceStats) -> int:
    return int(stats.mean.numel()) if stats.count else 0

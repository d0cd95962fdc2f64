"""Batch plans: which samples share a batch, in which order, and which rank runs it.

gap, invariance and recalibrate (and export parity) all batch through this one plan:

  order      the sample indices 0..n-1, in an order fixed by a seed (a torch.randperm of
             n from torch.Generator().manual_seed(seed)), or in file order
  plan       the order cut into consecutive batches of `size` (`BatchPlan.cut`); a last
             batch of one sample joins the batch before it (`merge_trailing_singleton`),
             because training-mode BatchNorm cannot normalise one value per channel (a
             (1, C) input has no variance)
  shard      under torchrun, rank r of W runs a contiguous block of WHOLE batches of the
             one global plan (`BatchPlan.shard`): B batches give the first B mod W ranks
             floor(B/W) + 1 batches and the others floor(B/W). Train-mode BatchNorm
             normalises by the statistics of the batch, so its outputs depend on which
             samples share a batch: every rank runs exactly the batches one process
             runs, no sample twice and none left out. Batches keep the numbers they have
             in the whole plan (`BatchPlan.first`), so messages name the same batch on
             any number of ranks.

The rule for a last batch of one sample is applied once, to the global plan, before
sharding, so a shard never ends in a batch that one process would not have. Batches that
arrive already formed (the recalibration API, --skip-bad shrinking one) follow the same
rule through `merge_trailing_singleton`, which joins them with `concat_batches`.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch


def sample_order(n: int, shuffle: bool = True, seed: int = 0) -> list[int]:
    """0..n-1 in the order fixed by `seed` (torch.randperm), or in file order."""
    if not shuffle:
        return list(range(n))
    return [int(i) for i in torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()]


@dataclass(frozen=True)
class BatchPlan:
    """Sample indices per batch, in run order; `first` is the number of the first batch
    in the whole run (nonzero for a rank's share)."""

    batches: list[list[int]]
    first: int = 0

    @classmethod
    def cut(cls, order: Sequence[int], size: int) -> BatchPlan:
        """`order` cut into batches of `size`, a last batch of one sample joined to the
        one before (module docstring)."""
        if size < 1:
            raise ValueError(f"batch size {size} is not at least 1")
        batches = [list(order[i : i + size]) for i in range(0, len(order), size)]
        return cls(list(merge_trailing_singleton(batches, size=len, join=operator.add)))

    @classmethod
    def draw(cls, n: int, size: int, num_samples: int | None = None, shuffle: bool = True, seed: int = 0) -> BatchPlan:
        """The plan of a data set of `n` samples: `sample_order`, capped at `num_samples`
        (a seeded random subset, or the first samples in file order), cut into batches."""
        order = sample_order(n, shuffle, seed)
        return cls.cut(order if num_samples is None else order[:num_samples], size)

    @classmethod
    def singles(cls, n: int) -> BatchPlan:
        """Every sample in a batch of its own (no companions, so no joining)."""
        return cls([[i] for i in range(n)])

    def shard(self, rank: int, world: int) -> BatchPlan:
        """Rank `rank`'s contiguous block of whole batches (module docstring); the plan
        itself with one rank. With fewer batches than ranks the last ranks get none (they
        still join every collective); rank 0 always has one when the plan has one."""
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in a world of {world}")
        if world == 1:
            return self
        share, extra = divmod(len(self.batches), world)
        start = rank * share + min(rank, extra)
        return BatchPlan(self.batches[start : start + share + (rank < extra)], self.first + start)

    @property
    def samples(self) -> int:
        return sum(len(b) for b in self.batches)

    def numbered(self) -> Iterator[tuple[int, list[int]]]:
        """(number in the whole run, sample indices) of every batch."""
        return enumerate(self.batches, start=self.first)

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)


def batch_len(batch: Any) -> int:
    """Number of samples in a batch: a tensor's first dimension, a `data.Batch`'s
    size, else that of the first tensor found in a tuple/list/dict batch."""
    if hasattr(batch, "shape") and len(batch.shape) > 0:
        return int(batch.shape[0])
    size = getattr(batch, "size", None)
    if isinstance(size, int):  # bnaudit.runtime.data.Batch
        return size
    if isinstance(batch, Mapping):
        items = list(batch.values())
    elif isinstance(batch, (list, tuple)):
        items = list(batch)
    else:
        items = []
    for item in items:
        n = batch_len(item)
        if n:
            return n
    return 0


def concat_batches(a: Any, b: Any) -> Any:
    """Join two batches of the same structure along the sample dimension (None: a
    structure this does not know, left to its producer)."""
    if isinstance(a, torch.Tensor):
        return torch.cat([a, b.to(a.device)])
    if isinstance(a, Mapping):
        joined = {k: concat_batches(a[k], b[k]) for k in a}
        return None if any(v is None for v in joined.values()) else joined
    if isinstance(a, tuple):
        parts = [concat_batches(x, y) for x, y in zip(a, b)]
        if any(p is None for p in parts):
            return None
        return type(a)(*parts) if hasattr(a, "_fields") else tuple(parts)
    if isinstance(a, list):
        if a and len(a) == len(b) and all(isinstance(x, torch.Tensor) for x in a):
            return [concat_batches(x, y) for x, y in zip(a, b)]
        return a + b  # a list of per-sample items (file names, strings)
    if isinstance(a, (int, float, str, bytes)) or a is None:
        return a  # a per-batch constant
    return None


def merge_trailing_singleton(
    batches: Iterable[Any],
    size: Callable[[Any], int] = batch_len,
    join: Callable[[Any, Any], Any] = concat_batches,
) -> Iterator[Any]:
    """Yield the batches, with a last batch of one sample joined to the one before.

    `size` counts a batch's samples, `join` joins two batches (None: cannot, both are
    yielded as they are). Streams with two batches of lookahead.
    """
    held: list[Any] = []  # the last two batches, not yet yielded
    for batch in batches:
        held.append(batch)
        if len(held) == 3:
            yield held.pop(0)
    if len(held) == 2 and size(held[1]) == 1:
        joined = join(held[0], held[1])
        if joined is not None:
            held = [joined]
    yield from held

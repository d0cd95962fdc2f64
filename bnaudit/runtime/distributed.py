"""Running one measurement on many processes under torchrun, with a single process's result.

Every command that runs under `python -m torch.distributed.run --nproc-per-node N`
(recalibrate, gap, invariance) follows the same steps, all here:

  process_group    join the group (gloo on the CPU, nccl for CUDA), left at exit
  device_for_rank  one GPU per rank, by LOCAL_RANK
  shard_batches    the batch plan (lists of sample indices) is made once, identically on
                   every rank from the seed; rank r takes a contiguous block of WHOLE
                   batches, so every rank runs exactly the batches a single process runs
                   (train-mode BatchNorm normalises by the statistics of the batch: its
                   results depend on which samples share a batch), no sample is read twice
                   and none is left out
  together         a failure on one rank ends the work on every rank, instead of leaving
                   the others waiting in the next collective
  gather_objects   each rank's plain-Python totals, in rank order, on every rank
  reporting        for the CLI: rank 0 prints the one report before any rank exits

The plan's rule for a last batch of one sample (`norms.merge_trailing_singleton_plan`) is
applied once to the global plan, before sharding, so a shard never ends in a batch that
the single process would not have. Without torch.distributed (or with one process) every
function here is a no-op.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from bnaudit.errors import BnauditError


def distributed() -> tuple[int, int]:
    """(rank, world size) when torch.distributed is initialised, else (0, 1)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def collective_device(group: Any = None) -> Any:
    """Where the tensors of a collective live: the rank's GPU under nccl, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@contextlib.contextmanager
def together() -> Iterator[None]:
    """Under torch.distributed, a failure on one rank ends the work on every rank
    (rather than leaving the others waiting in the next collective): the failing rank
    raises its own exception, every other rank a `BnauditError` with the first failing
    rank's message, so rank 0's one-line error (or JSON error document) says what went
    wrong. Collective: every rank enters and leaves the block the same number of times."""
    if distributed()[1] == 1:
        yield
        return
    failure: BaseException | None = None
    try:
        yield
    except Exception as exc:
        failure = exc
    messages = gather_objects(None if failure is None else str(failure) or type(failure).__name__)
    if failure is not None:
        raise failure
    for rank, message in enumerate(messages):
        if message is not None:
            raise BnauditError(f"rank {rank}: {message}")


@contextlib.contextmanager
def process_group(device: Any) -> Iterator[tuple[int, int]]:
    """Under torchrun (WORLD_SIZE > 1): join the process group (nccl for CUDA, gloo for
    the CPU) and yield (rank, world size); otherwise (0, 1).

    The group stays open until the process exits, for the next measurement: joining a
    second group through torchrun's rendezvous store after leaving the first can read
    the first group's stale addresses and fail to connect. A group the caller set up is
    used as it is."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        yield 0, 1
        return
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        atexit.register(_leave)
    yield dist.get_rank(), dist.get_world_size()


def _leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def reporting(device: Any) -> Iterator[int]:
    """For a command under torchrun whose ranks all end with the same report and exit
    code (gap, invariance): hold the process group (`process_group`) around the measurement and rank
    0's printing, yield this rank, and on leaving wait for every rank (a barrier). torchrun
    stops the remaining ranks as soon as one exits non-zero, so without the wait rank 0
    could be stopped while it prints the report of a failed check (exit 1)."""
    with process_group(device) as (rank, world):
        try:
            yield rank
        finally:
            if world > 1:
                dist.barrier()


def device_for_rank(device: Any) -> Any:
    """Under torchrun each rank takes its own GPU (LOCAL_RANK)."""
    if device.type == "cuda" and device.index is None and "LOCAL_RANK" in os.environ:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % max(torch.cuda.device_count(), 1))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def shard_stream(stream: Any, rank: int, world: int) -> Any:
    """Rank `rank`'s share of a `bnaudit.runtime.data.BatchStream` (`shard_batches`), its
    batches numbered as the whole run numbers them (errors name the same batch on any
    world size); the stream itself with one rank."""
    if world == 1:
        return stream
    first, mine = shard_batches(stream.plan, rank, world)
    return dataclasses.replace(stream, plan=mine, first_index=stream.first_index + first)


def shard_batches(plan: list[list[int]], rank: int, world: int) -> tuple[int, list[list[int]]]:
    """Rank `rank`'s share of the global batch plan: (index of its first batch, its batches).

    B batches over W ranks: the first B mod W ranks take floor(B/W) + 1 consecutive
    batches, the others floor(B/W); the batches are the plan's own, unchanged. With fewer
    batches than ranks the last ranks get none (they still join every collective). Rank 0
    always has a batch when the plan has one.
    """
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a world of {world}")
    share, extra = divmod(len(plan), world)
    first = rank * share + min(rank, extra)
    return first, plan[first : first + share + (rank < extra)]


def gather_objects(value: Any) -> list[Any]:
    """Every rank's `value` (small, picklable), in rank order, on every rank; [value]
    without torch.distributed. Collective."""
    world = distributed()[1]
    if world == 1:
        return [value]
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, value)
    return gathered


def first_error(message: str | None) -> str | None:
    """The first rank's error message (rank order), on every rank; None when no rank
    failed. For a step whose failure is itself a finding (a model that cannot score one
    sample alone): every rank records the same one. Collective."""
    return next((m for m in gather_objects(message) if m is not None), None)


def combine_rows(rows: Any, filled: Any) -> tuple[Any, Any]:
    """One (N, ...) tensor whose rows were filled on different ranks, every rank's other
    rows zero (`rows` None on a rank that filled none), and the (N,) bool mask of the
    rows each filled: the rows summed across ranks, in float64 and back to their dtype,
    and the masks joined. Each row is filled on one rank only, so its sum adds zeros to
    one value: exact. Identical on every rank; (rows, filled) as given without
    torch.distributed. Collective."""
    if distributed()[1] == 1:
        return rows, filled
    shapes = [s for s in gather_objects(None if rows is None else (tuple(rows.shape), rows.dtype)) if s is not None]
    if not shapes:
        return rows, filled
    if any(s != shapes[0] for s in shapes):
        raise BnauditError(
            "the model's outputs differ in shape between batches: "
            + ", ".join(sorted({str(list(s[0][1:])) for s in shapes}))
        )
    shape, dtype = shapes[0]
    device = collective_device()
    wide = torch.float64 if dtype.is_floating_point else torch.int64
    total = torch.zeros(shape, dtype=wide, device=device) if rows is None else rows.to(device, wide)
    dist.all_reduce(total)
    mask = filled.to(device, torch.int64)
    dist.all_reduce(mask)
    return total.to("cpu", dtype), mask.cpu() > 0

"""Running one measurement on many processes under torchrun, with a single process's result.

Every command that runs under `python -m torch.distributed.run --nproc-per-node N`
(recalibrate, gap, invariance) runs through this one runner:

  torchrun         join the group (gloo on the CPU, nccl for CUDA; left at exit), take
                   this rank's device (one GPU per rank, by LOCAL_RANK) and yield `Ranks`
  batches          every rank makes the one global batch plan from the seed and runs its
                   share of WHOLE batches (`bnaudit.runtime.batching.BatchPlan.shard`)
  together         one step of per-rank work: the first failure (in rank order) ends the
                   step on every rank as one line, instead of leaving the others waiting
                   in the next collective
  gather_objects   each rank's plain-Python totals, in rank order, on every rank
  combine_rows     rows filled on different ranks, summed exactly
  prints           rank 0 alone prints the report (every plain process prints); a runner
                   entered with wait=True holds every rank until rank 0 has printed

Without torch.distributed (or with one process) every function here is a no-op.
"""

from __future__ import annotations

import atexit
import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
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


class RankError(BnauditError):
    """The first failure of a step on another rank: `rank` and its one-line `message`
    (str: "rank R: message")."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(f"rank {rank}: {message}")
        self.rank = rank
        self.message = message


def failure_message(exc: BaseException) -> str:
    """An error's one line as every rank records it: a `RankError`'s own message."""
    return exc.message if isinstance(exc, RankError) else str(exc) or type(exc).__name__


@contextlib.contextmanager
def together() -> Iterator[None]:
    """One step of per-rank work. Under torch.distributed the first failure, in rank
    order, ends the step on every rank: that rank raises its own exception (its traceback
    for --debug), every other rank a `RankError` with its one-line message, so rank 0's
    error line (or JSON error document) says what went wrong and every rank can record
    the same failure. Collective: every rank enters and leaves the block the same number
    of times."""
    rank, world = distributed()
    if world == 1:
        yield
        return
    failure: BaseException | None = None
    try:
        yield
    except Exception as exc:
        failure = exc
    messages = gather_objects(None if failure is None else failure_message(failure))
    first = next((r for r, message in enumerate(messages) if message is not None), None)
    if first is None:
        return
    if first == rank and failure is not None:
        raise failure
    raise RankError(first, messages[first])


@dataclass(frozen=True)
class Ranks:
    """This process in the run: its rank, the world size and the device it computes on."""

    rank: int
    world: int
    device: Any

    @property
    def reports(self) -> bool:
        """Rank 0 writes and reports for the run."""
        return self.rank == 0


def prints() -> bool:
    """Whether this process prints the report: rank 0 under torchrun, any plain process.
    Known before the group is joined (torchrun sets RANK for every rank it starts)."""
    return int(os.environ.get("RANK", "0")) == 0


@contextlib.contextmanager
def torchrun(device: Any, wait: bool = False) -> Iterator[Ranks]:
    """The runner: under torchrun (WORLD_SIZE > 1) join the process group (nccl for CUDA,
    gloo for the CPU) and yield this rank with its device (`device_for_rank`); otherwise
    rank 0 of 1 on `device`.

    The group stays open until the process exits, for the next measurement: joining a
    second group through torchrun's rendezvous store after leaving the first can read
    the first group's stale addresses and fail to connect. A group the caller set up is
    used as it is. `wait`: on leaving, every rank waits for the others (a barrier), for a
    caller that prints inside the block: torchrun stops the remaining ranks as soon as one
    exits non-zero, so without the wait rank 0 could be stopped while it prints the report
    of a failed check (exit 1)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        yield Ranks(0, 1, device)
        return
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        atexit.register(_leave)
    try:
        yield Ranks(dist.get_rank(), dist.get_world_size(), device_for_rank(device))
    finally:
        if wait:
            dist.barrier()


def _leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def device_for_rank(device: Any) -> Any:
    """Under torchrun each rank takes its own GPU (LOCAL_RANK)."""
    if device.type == "cuda" and device.index is None and "LOCAL_RANK" in os.environ:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % max(torch.cuda.device_count(), 1))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def gather_objects(value: Any) -> list[Any]:
    """Every rank's `value` (small, picklable), in rank order, on every rank; [value]
    without torch.distributed. Collective."""
    world = distributed()[1]
    if world == 1:
        return [value]
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, value)
    return gathered


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

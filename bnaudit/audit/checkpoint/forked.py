"""The files of a scan audited on several cores at once, by forked workers.

A folder of checkpoints costs about a millisecond of pure Python per file (the pickle or
header, the BN tensors, the per-channel figures, the rules), all of it under one GIL:
threads cannot share it out, and a `multiprocessing` pool costs more to start than fifty
files take. A fork costs about a millisecond and inherits everything already imported
and configured. So, on Linux, `forked_map` forks `workers - 1` children; child k computes
items k, k + workers, ... and sends its results back as one pickle through a pipe, while
the parent computes its own share. Striding rather than cutting the list into blocks
spreads a folder's large and small files evenly.

The result is always the serial one. A child that fails in any way (an exception, a
result that does not pickle, killed by a signal) only costs time: the parent computes
that child's items itself, so a file's error is reported (or, with --debug, raised) by
the parent exactly as without workers.

Forking is safe only in a process with one thread: a thread holding a lock at the fork
(torch's and BLAS's thread pools, a logging handler) would leave it locked in the child
forever. The check counts the threads in /proc/self/task, which sees the ones Python
does not know about, and anywhere else than Linux nothing is forked (macOS's system
libraries are not fork-safe; Windows has no fork).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

# Fewer files than this per worker do not pay for the fork and the pickle round trip.
MIN_PER_WORKER = 8


def usable_cpus(cgroup_root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> int:
    """The CPUs this process may really use: its affinity mask (which `taskset` and cpusets
    narrow; `os.process_cpu_count` where Python has it), capped by the CPU quota of its
    cgroups (a container limited to 1.5 CPUs on a 64-core host gets 2, not 64)."""
    process_cpu_count = getattr(os, "process_cpu_count", None)  # Python 3.13+
    if process_cpu_count is not None:
        count = process_cpu_count() or 1
    else:
        try:
            count = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):  # not Linux
            count = os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup_root, proc_cgroup)
    return max(1, min(count, math.ceil(quota))) if quota is not None else count


def cgroup_cpu_quota(cgroup_root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> float | None:
    """The smallest CPU quota (quota / period, in CPUs) on the path from this process's cgroup
    up to the root of its hierarchy, or None where none is set or none can be read.

    cgroup v2: `cpu.max` holds "QUOTA PERIOD" or "max PERIOD"; v1: the `cpu` controller's
    `cpu.cfs_quota_us` (-1: none) and `cpu.cfs_period_us`. Inside a container the path
    /proc/self/cgroup names may not exist under the mount (no cgroup namespace): the walk
    then starts at the mount itself."""
    try:
        with open(proc_cgroup, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    found: list[float] = []
    for line in lines:
        _, controllers, path = line.split(":", 2) if line.count(":") >= 2 else ("", "", "")
        if controllers == "":
            found += _quotas(cgroup_root, path, _v2_quota)
        elif "cpu" in controllers.split(","):
            for mount in (f"{cgroup_root}/{controllers}", f"{cgroup_root}/cpu", f"{cgroup_root}/cpu,cpuacct"):
                if os.path.isdir(mount):
                    found += _quotas(mount, path, _v1_quota)
                    break
    return min(found) if found else None


def _quotas(mount: str, path: str, read: Callable[[str], float | None]) -> list[float]:
    """The quotas `read` finds in the cgroup folder of `path` and each parent up to `mount`."""
    mount = os.path.normpath(mount)
    folder = os.path.normpath(os.path.join(mount, path.lstrip("/")))
    if not os.path.isdir(folder) or not folder.startswith(mount):
        folder = mount
    quotas = []
    while True:
        quota = read(folder)
        if quota is not None:
            quotas.append(quota)
        if folder == mount:
            return quotas
        folder = os.path.dirname(folder)


def _v2_quota(folder: str) -> float | None:
    try:
        with open(os.path.join(folder, "cpu.max"), encoding="utf-8") as fh:
            quota, period = fh.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError, ZeroDivisionError):
        return None


def _v1_quota(folder: str) -> float | None:
    try:
        with open(os.path.join(folder, "cpu.cfs_quota_us"), encoding="utf-8") as fh:
            quota = int(fh.read())
        with open(os.path.join(folder, "cpu.cfs_period_us"), encoding="utf-8") as fh:
            period = int(fh.read())
        return None if quota < 0 else quota / period
    except (OSError, ValueError, ZeroDivisionError):
        return None


def worker_count(items: int, jobs: int | None) -> int:
    """How many processes should share `items` files: `jobs` (None: every usable CPU),
    but no more than leaves MIN_PER_WORKER files to each, and 1 where forking is unsafe."""
    if sys.platform != "linux":
        return 1
    limit = usable_cpus() if jobs is None else jobs
    return max(1, min(limit, items // MIN_PER_WORKER))


def single_threaded() -> bool:
    """True when this process runs exactly one thread, native ones included."""
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return False


def forked_map(func: Callable[[T], R], items: Sequence[T], workers: int) -> list[R]:
    """[func(x) for x in items], computed by `workers` processes (see the module docstring).
    `func`'s results must pickle; where one does not, its child's share is computed here."""
    if workers <= 1 or len(items) < 2 or not single_threaded():
        return [func(x) for x in items]
    workers = min(workers, len(items))
    children: list[tuple[int, int, range]] = []  # pid, read end of its pipe, its items
    try:
        for k in range(1, workers):
            share = range(k, len(items), workers)
            read_end, write_end = os.pipe()
            pid = os.fork()
            if pid == 0:
                _child(func, items, share, write_end)  # never returns
            os.close(write_end)
            children.append((pid, read_end, share))
        results: dict[int, R] = {i: func(items[i]) for i in range(0, len(items), workers)}
        while children:
            pid, read_end, share = children.pop(0)
            got: list[R] | None = _collect(pid, read_end, len(share))
            for i, result in zip(share, got) if got is not None else ((i, func(items[i])) for i in share):
                results[i] = result
    finally:
        for pid, read_end, _ in children:  # only after an exception here (Ctrl-C): stop them
            _stop(pid, read_end)
    return [results[i] for i in range(len(items))]


def _child(func: Callable[[T], R], items: Sequence[T], share: range, write_end: int) -> None:
    code = 1
    try:
        # the default SIGINT handler: Ctrl-C at the terminal reaches the whole process group,
        # and the parent, not each child, decides what happens next
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        import pickle  # here: only a forked scan pickles

        data = pickle.dumps([func(items[i]) for i in share], protocol=pickle.HIGHEST_PROTOCOL)
        with os.fdopen(write_end, "wb") as pipe:
            pipe.write(data)
        code = 0
    except BaseException:  # the parent recomputes this share; nothing may escape a fork
        pass
    finally:
        os._exit(code)  # no atexit handlers, no flushing of the parent's buffers a second time


def _collect(pid: int, read_end: int, count: int) -> list[R] | None:
    """The child's results, or None if it failed (its share is then computed by the caller)."""
    with os.fdopen(read_end, "rb") as pipe:
        data = pipe.read()
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:  # SIGCHLD ignored (inherited from the caller): reaped, status unknown
        status = 0  # the bytes decide: a child cut short leaves a pickle that does not load
    if os.waitstatus_to_exitcode(status) != 0:
        return None
    try:
        import pickle

        results = pickle.loads(data)  # written by our own fork, never read from a file
    except Exception:  # truncated or corrupt: recompute
        return None
    return results if isinstance(results, list) and len(results) == count else None


def _stop(pid: int, read_end: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):  # SIGCHLD ignored: reaped already
        os.waitpid(pid, 0)
    os.close(read_end)

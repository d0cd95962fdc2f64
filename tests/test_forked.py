"""The files of a scan audited by forked workers (bnaudit.audit.checkpoint.forked): the result is the
serial one whatever a child does.

The test process has imported torch, which runs threads, so nothing forks here (that is
the rule under test in the last tests): each forking case runs in a fresh interpreter
that has not imported torch, and prints what it saw as JSON."""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest
from conftest import SAMPLES, run_python

from bnaudit.audit.checkpoint import forked
from bnaudit.errors import BnauditError

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="workers are forked on Linux only")


def _run(body: str) -> dict:
    """Run `body` with forked_map imported; it must print one JSON document."""
    script = "import json, os, signal, sys, threading, time\nfrom bnaudit.audit.checkpoint.forked import forked_map\n"
    done = run_python(script + textwrap.dedent(body))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_each_worker_takes_every_kth_item_and_the_results_are_in_order():
    seen = _run(
        """
        parent = os.getpid()
        out = forked_map(lambda x: (x * x, os.getpid()), list(range(37)), 3)
        print(json.dumps({"parent": parent, "out": out}))
        """
    )
    squares = [value for value, _ in seen["out"]]
    assert squares == [x * x for x in range(37)]
    pids = [pid for _, pid in seen["out"]]
    assert len(set(pids)) == 3
    for k in range(3):  # item i is computed by worker i % 3, the parent being worker 0
        assert len({pids[i] for i in range(k, 37, 3)}) == 1
    assert {pids[i] for i in range(0, 37, 3)} == {seen["parent"]}


@pytest.mark.parametrize(
    "failure",
    [
        "raise ValueError('only in a child')",
        "os.kill(os.getpid(), signal.SIGKILL)",
        "return lambda: None",  # a result that does not pickle
        "os._exit(0)",  # leaves without sending anything
    ],
)
def test_a_failing_child_costs_time_not_results(failure):
    seen = _run(
        f"""
        parent = os.getpid()

        def work(x):
            if x == 5 and os.getpid() != parent:
                {failure}
            return (x + 100, os.getpid())

        out = forked_map(work, list(range(30)), 3)
        print(json.dumps({{"parent": parent, "out": out}}))
        """
    )
    assert [value for value, _ in seen["out"]] == [x + 100 for x in range(30)]
    pids = [pid for _, pid in seen["out"]]
    # item 5 is worker 2's: the parent computed that whole share again, worker 1's stands
    assert {pids[i] for i in range(2, 30, 3)} == {seen["parent"]}
    assert seen["parent"] not in {pids[i] for i in range(1, 30, 3)}


def test_a_caller_that_ignores_sigchld_still_gets_every_result():
    """With SIGCHLD ignored (a supervisor's setting a process inherits), children are reaped
    by the kernel and waitpid finds none: their bytes decide, and a killed one is recomputed."""
    seen = _run(
        """
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)
        parent = os.getpid()

        def work(x):
            if x == 4 and os.getpid() != parent:
                os.kill(os.getpid(), signal.SIGKILL)
            return (x, os.getpid())

        out = forked_map(work, list(range(30)), 3)
        print(json.dumps({"parent": parent, "out": out}))
        """
    )
    assert [value for value, _ in seen["out"]] == list(range(30))
    pids = [pid for _, pid in seen["out"]]
    assert {pids[i] for i in range(1, 30, 3)} == {seen["parent"]}  # item 4 is worker 1's
    assert seen["parent"] not in {pids[i] for i in range(2, 30, 3)}


def test_a_process_running_another_thread_does_not_fork():
    seen = _run(
        """
        stop = threading.Event()
        threading.Thread(target=stop.wait, daemon=True).start()
        out = forked_map(lambda x: os.getpid(), list(range(40)), 4)
        stop.set()
        print(json.dumps({"parent": os.getpid(), "pids": sorted(set(out))}))
        """
    )
    assert seen["pids"] == [seen["parent"]]


def test_an_interrupted_parent_stops_its_children_and_leaves_none_behind():
    seen = _run(
        """
        parent = os.getpid()

        def work(x):
            if os.getpid() != parent:
                time.sleep(60)  # the children would keep the test waiting a minute
            elif x == 3:
                raise KeyboardInterrupt
            return x

        start = time.monotonic()
        try:
            forked_map(work, list(range(12)), 3)
            outcome = "returned"
        except KeyboardInterrupt:
            outcome = "interrupted"
        try:
            os.waitpid(-1, os.WNOHANG)
            left = "a child is left"
        except ChildProcessError:
            left = "none"
        print(json.dumps({"outcome": outcome, "left": left, "seconds": time.monotonic() - start}))
        """
    )
    assert seen["outcome"] == "interrupted"
    assert seen["left"] == "none"
    assert seen["seconds"] < 30


def test_worker_count_by_hand(monkeypatch):
    monkeypatch.setattr(forked, "usable_cpus", lambda: 4)
    monkeypatch.setattr(forked.sys, "platform", "linux")
    assert forked.MIN_PER_WORKER == 8
    assert forked.worker_count(7, None) == 1  # 7 // 8 = 0 -> at least 1
    assert forked.worker_count(16, None) == 2  # 16 // 8
    assert forked.worker_count(100, None) == 4  # every usable CPU
    assert forked.worker_count(100, 1) == 1
    assert forked.worker_count(100, 9) == 9  # --jobs may ask for more than the CPUs
    assert forked.worker_count(40, 9) == 5  # but never fewer than 8 files each
    monkeypatch.setattr(forked.sys, "platform", "darwin")
    assert forked.worker_count(100, 4) == 1


def fake_cgroups(tmp_path, proc_line: str, files: dict[str, str]) -> tuple[str, str]:
    """A cgroup mount under tmp_path holding `files` (path -> text), and a /proc/self/cgroup."""
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    root.mkdir(exist_ok=True)
    proc = tmp_path / "proc_cgroup"
    proc.write_text(proc_line)
    return str(root), str(proc)


@pytest.mark.parametrize(
    ("proc_line", "files", "quota"),
    [
        # cgroup v2, a quota of 1.5 CPUs on the process's own group
        ("0::/ci/job\n", {"ci/job/cpu.max": "150000 100000\n", "cpu.max": "max 100000\n"}, 1.5),
        # v2, no quota anywhere
        ("0::/ci/job\n", {"ci/job/cpu.max": "max 100000\n"}, None),
        # v2, the parent's quota is the smaller one
        ("0::/ci/job\n", {"ci/job/cpu.max": "400000 100000\n", "ci/cpu.max": "100000 100000\n"}, 1.0),
        # v2 without a cgroup namespace: the named path is absent, the mount is the container's
        ("0::/docker/abc\n", {"cpu.max": "200000 100000\n"}, 2.0),
        # cgroup v1, the cpu controller mounted as cpu,cpuacct
        (
            "4:memory:/x\n3:cpu,cpuacct:/job\n",
            {"cpu,cpuacct/job/cpu.cfs_quota_us": "50000\n", "cpu,cpuacct/job/cpu.cfs_period_us": "100000\n"},
            0.5,
        ),
        # v1, no quota (-1)
        ("3:cpu:/\n", {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        # nothing readable
        ("0::/\n", {}, None),
    ],
)
def test_cgroup_cpu_quota_by_hand(tmp_path, proc_line, files, quota):
    root, proc = fake_cgroups(tmp_path, proc_line, files)
    assert forked.cgroup_cpu_quota(root, proc) == quota


def test_a_quota_caps_the_usable_cpus_and_one_cpu_never_forks(tmp_path, monkeypatch):
    monkeypatch.setattr(forked.os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    monkeypatch.delattr(forked.os, "process_cpu_count", raising=False)
    root, proc = fake_cgroups(tmp_path, "0::/job\n", {"job/cpu.max": "150000 100000\n"})
    assert forked.usable_cpus(root, proc) == 2  # 1.5 CPUs: two processes keep the quota busy
    root, proc = fake_cgroups(tmp_path / "one", "0::/job\n", {"job/cpu.max": "100000 100000\n"})
    assert forked.usable_cpus(root, proc) == 1
    root, proc = fake_cgroups(tmp_path / "none", "0::/job\n", {"job/cpu.max": "max 100000\n"})
    assert forked.usable_cpus(root, proc) == 64  # no quota: the affinity mask decides
    monkeypatch.setattr(forked, "usable_cpus", lambda: 1)
    assert forked.worker_count(1000, None) == 1


def test_this_process_runs_threads_so_it_never_forks():
    import torch  # noqa: F401 - its import starts a thread

    assert not forked.single_threaded()
    pids = forked.forked_map(lambda x: os.getpid(), list(range(40)), 4)
    assert set(pids) == {os.getpid()}


def test_a_folder_audited_by_workers_reports_what_one_process_reports(tmp_path):
    """A folder of 20 checkpoints (the sample models, the most varied files there are, and
    copies of one), audited with and without workers: the same JSON document, and the
    default did fork."""
    names = sorted(n for n in os.listdir(SAMPLES) if n.endswith((".pt", ".safetensors", ".pth", ".onnx")))
    for i, name in enumerate((names * 3)[:20]):
        os.symlink(os.path.join(SAMPLES, name), tmp_path / f"{i:02d}_{name}")
    seen = _run(
        f"""
        from bnaudit.audit.checkpoint import forked, inspect as audit
        from bnaudit.output import emit
        import io
        forks = []
        real_fork = os.fork
        def counting_fork():
            forks.append(1)
            return real_fork()
        os.fork = counting_fork
        forked.usable_cpus = lambda: 2
        documents = []
        for jobs in (None, 1, 2):
            before = len(forks)
            text = io.StringIO()
            emit(audit.inspect_paths({str(tmp_path)!r}, jobs=jobs), "json", text)
            documents.append((len(forks) - before, json.loads(text.getvalue())))
        print(json.dumps(documents))
        """
    )
    (forks_default, default), (forks_serial, serial), (forks_two, two) = seen
    assert (forks_default, forks_serial, forks_two) == (1, 0, 1)
    # 20 files; a container holding a live model and its EMA copy is one entry per state dict
    assert len({f["path"] for f in serial["files"]}) == serial["summary"]["files"] == 20
    assert default == serial == two


def test_jobs_below_one_is_a_usage_error(cli):
    with pytest.raises(BnauditError, match="--jobs must be at least 1, got 0"):
        from bnaudit.api import inspect

        inspect(SAMPLES, jobs=0)
    result = cli("inspect", SAMPLES, "--jobs", "0")
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == ["bnaudit: error: --jobs must be at least 1, got 0"]

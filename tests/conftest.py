"""Shared builders: small state dicts written in every format bnaudit reads."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from hypothesis import settings as hypothesis_settings

# The property tests (hypothesis) draw the same examples on every run, seeded from each
# test's name: CI and a user's `pytest -q` judge one fixed set, never a new draw that fails
# once in many runs. HYPOTHESIS_PROFILE=explore draws new examples to look for more.
hypothesis_settings.register_profile("fixed", derandomize=True)
hypothesis_settings.register_profile("explore", derandomize=False)
hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fixed"))

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLES = os.path.join(REPO, "sample_models")

try:
    import torch
except ModuleNotFoundError:  # the torch-free tier (below) runs where torch is not installed
    torch = None
else:
    torch.set_num_threads(1)

# The torch-free tier: the test modules that use the `torchfree` marker (pyproject.toml).
# Without torch only they can run, since every other module imports torch: the others are
# not collected, and a run that does not ask for the tier is refused, as a run of the whole
# suite that silently ran a fraction of it would pass for what it is not.
_TORCHFREE = re.compile(r"\bpytest\.mark\.torchfree\b")


def pytest_configure(config):
    if torch is None and "torchfree" not in config.getoption("markexpr"):
        raise pytest.UsageError(
            "torch is not installed: without it run the torch-free tier "
            "(python -m pytest -q -m 'torchfree and not slow'), or install torch for the whole suite"
        )


def pytest_ignore_collect(collection_path, config):
    module = collection_path.suffix == ".py" and collection_path.name.startswith("test_")
    if torch is None and module and not _TORCHFREE.search(collection_path.read_text(encoding="utf-8")):
        return True
    return None


def bn_entries(
    prefix: str,
    channels: int = 4,
    *,
    mean=None,
    var=None,
    weight=None,
    bias=None,
    counter: int | None = 100,
    dtype=None,
) -> dict[str, torch.Tensor]:
    """The state-dict entries of one BN layer (float32 unless `dtype`); defaults are
    trained-looking values."""
    dtype = torch.float32 if dtype is None else dtype
    g = torch.Generator().manual_seed(len(prefix) * 7 + channels)
    entries = {
        f"{prefix}.weight": weight if weight is not None else 0.5 + torch.rand(channels, generator=g),
        f"{prefix}.bias": bias if bias is not None else torch.randn(channels, generator=g) * 0.1,
        f"{prefix}.running_mean": mean if mean is not None else torch.randn(channels, generator=g),
        f"{prefix}.running_var": var if var is not None else 0.5 + torch.rand(channels, generator=g),
    }
    entries = {k: v.to(dtype) for k, v in entries.items()}
    if counter is not None:
        entries[f"{prefix}.num_batches_tracked"] = torch.tensor(counter)
    return entries


def save_torch(obj, path) -> str:
    torch.save(obj, path)
    return str(path)


def save_safetensors(state: dict[str, torch.Tensor], path, metadata=None) -> str:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, str(path), metadata=metadata)
    return str(path)


def train_classifier(model, x, y, steps: int = 80, lr: float = 0.03, batch: int = 32, seed: int = 2):
    """A few Adam steps on random mini-batches of (x, y): a small trained model for fixtures."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):
        idx = torch.randperm(len(x), generator=g)[:batch]
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    return model


def count_data_reads(monkeypatch) -> list[int]:
    """Route `open` in bnaudit.runtime.sources through a file that records the byte count of
    every `readinto`: the list that fills as data is read."""
    import bnaudit.runtime.sources as data

    read: list[int] = []
    real_open = open

    class Counting:
        def __init__(self, *args, **kwargs):
            self.file = real_open(*args, **kwargs)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

        def seek(self, offset):
            return self.file.seek(offset)

        def readinto(self, buffer):
            n = self.file.readinto(buffer)
            read.append(n)
            return n

        def read(self, n=-1):
            return self.file.read(n)

    monkeypatch.setattr(data, "open", Counting, raising=False)
    return read


def default_sigint() -> None:
    """preexec_fn for children a test interrupts with SIGINT.

    A process started with SIGINT ignored (a background job of a non-interactive
    shell, as some CI runners start the suite) passes that on, and Python then
    installs no KeyboardInterrupt handler: the child would never see the signal.
    SIG_DFL survives exec, after which Python installs its own handler.
    """
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture
def cli():
    """Invoke the typer app with a pinned terminal width; returns the click Result."""
    from typer.testing import CliRunner

    from bnaudit.cli import app

    runner = CliRunner()

    def invoke(*args: str, width: int = 120):
        return runner.invoke(app, list(args), env={"COLUMNS": str(width), "NO_COLOR": "1"})

    return invoke


@pytest.fixture
def python() -> str:
    return sys.executable


def run_python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`python -c code ARGS` in a fresh interpreter (none of this process's imports: torch,
    numpy, threads) with this checkout first on the path, run from the repository root."""
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True, env=env, timeout=120
    )


def run_in_4_gib(code: str) -> subprocess.CompletedProcess[str]:
    """run_python with the address space capped at 4 GiB (RLIMIT_AS): an allocation a forged
    file asks for fails instead of swapping."""
    return run_python("import resource\nresource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))\n" + code)


def run_ranks(args: list[str], cwd, ranks: int = 2) -> subprocess.CompletedProcess[str]:
    """`python ARGS` in `cwd` under `torch.distributed.run --standalone --nproc-per-node
    ranks` (gloo on the CPU), or as one plain process with `ranks=1`: this checkout first
    on the path, one intra-op thread each, and no rank variables inherited from a caller
    that runs under torchrun itself."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)] if ranks > 1 else []
    return subprocess.run(
        [sys.executable, *launch, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


BOUNDED = """
import resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, ({memory}, {memory}))
resource.setrlimit(resource.RLIMIT_CPU, ({cpu}, {cpu} + 1))
sys.argv[1:] = {argv!r}
import bnaudit.api  # start-up is not the file's cost
import bnaudit.formats.read, bnaudit.formats.torchsave, bnaudit.formats.dcp, bnaudit.formats.pt2


def peak_kib():  # this process's own high-water mark (ru_maxrss keeps the forking parent's)
    with open("/proc/self/status") as status:
        return int(next(line for line in status if line.startswith("VmHWM:")).split()[1])


before = peak_kib()
started = time.process_time()
{code}
print("BOUNDED", peak_kib() - before, time.process_time() - started)
"""


def run_bounded(code: str, *argv: str, memory: int = 1 << 30, cpu: int = 10) -> tuple[str, float, float]:
    """Run `code` in a fresh interpreter under an address-space cap (`memory` bytes) and a CPU
    time cap (`cpu` seconds: SIGXCPU past it); returns (its output, the peak memory it added
    in MiB, its CPU seconds). A file that asks for more than the caps fails the test, however
    it fails: the process is killed, or a MemoryError escapes."""
    proc = run_python(BOUNDED.format(memory=memory, cpu=cpu, argv=list(argv), code=code))
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    *out, last = proc.stdout.strip().splitlines()
    tag, kib, seconds = last.split()
    assert tag == "BOUNDED", proc.stdout
    return "\n".join(out), int(kib) / 1024, float(seconds)


def package_copy(dest) -> str:
    """What `pip install` of this checkout reads (pyproject.toml, README.md, LICENSE and the
    package), copied into `dest`: an install builds there, never in the checkout, and
    installs the working tree as it is, committed or not."""
    import shutil

    os.makedirs(dest, exist_ok=True)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(os.path.join(REPO, name), dest)
    shutil.copytree(
        os.path.join(REPO, "bnaudit"), os.path.join(dest, "bnaudit"), ignore=shutil.ignore_patterns("__pycache__")
    )
    return str(dest)


def pip_cannot_download(tmp_path) -> str | None:
    """Why pip cannot fetch packages here (no index reachable, no local wheels), or None.
    The tests that install bnaudit into a new environment skip with this reason."""
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(tmp_path), "setuptools>=64"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode == 0:
        return None
    last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return f"pip cannot download packages here (pip download setuptools: {last})"

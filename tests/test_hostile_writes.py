"""No command modifies its inputs; recalibrate writes its output whole or not at all:
interrupted (SIGINT, SIGTERM) or killed (SIGKILL) in a real process, on a read-only
folder or a full disk.

The tests run as root, for whom chmod does not make a folder read-only, and they cannot
mount a read-only or a full file system. So:
  * a full disk is real: the kernel refuses writes past RLIMIT_FSIZE (EFBIG) in a
    subprocess, for every output format; ENOSPC itself is raised by a patched write
    and a patched fsync (where a full disk reports it);
  * a read-only folder is emulated at the system-call boundary: os.access answers
    False (the early check), or os.open raises EROFS for files in the folder (a
    refusal that comes after the check, as when the folder changes meanwhile).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from conftest import default_sigint
from safetensors.torch import save_file

from bnaudit.formats import atomic as atomic_mod
from bnaudit.formats import write as write_mod

torch.set_num_threads(1)
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")
REPO = Path(__file__).resolve().parents[1]

MODEL_SOURCE = '''
import time
from pathlib import Path

import torch
from torch import nn


def net():
    return nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, 2))


class Blocking(torch.utils.data.Dataset):
    """Item 10 (batch 2 of 4 samples in file order) touches MARKER and blocks."""

    def __len__(self):
        return 24

    def __getitem__(self, i):
        if i == 10:
            Path(MARKER).touch()
            time.sleep(120)
        return torch.full((1, 5, 5), float(i)) + torch.arange(25.0).view(1, 5, 5) / 25


def blocking():
    return Blocking()
'''


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def hashes(paths: list[Path]) -> dict[str, str]:
    return {str(p): sha(p) for p in paths}


def invoke(*args: str):
    from typer.testing import CliRunner

    from bnaudit.cli import app

    return CliRunner().invoke(app, list(args), env={"COLUMNS": "120", "NO_COLOR": "1"})


def one_line_error(result) -> str:
    lines = result.stderr.splitlines()
    assert result.exit_code == 2, (result.exit_code, result.stdout, result.stderr)
    assert len(lines) == 1 and lines[0].startswith("bnaudit: error: ") and "internal error" not in lines[0], lines
    return lines[0].removeprefix("bnaudit: error: ")


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The same small model as safetensors, torch.save zip (a container), legacy torch.save
    and TorchScript; labelled data as a file and as a folder of shards."""
    root = tmp_path_factory.mktemp("writes")
    (root / "writes_net.py").write_text(MODEL_SOURCE.replace("MARKER", repr(str(root / "blocked"))))
    ns: dict = {}
    exec(MODEL_SOURCE, ns)
    torch.manual_seed(0)
    model = ns["net"]().eval()
    state = model.state_dict()
    save_file(state, str(root / "model.safetensors"))
    torch.save({"state_dict": state, "epoch": 3}, root / "model.ckpt")
    torch.save(state, root / "model_legacy.pt", _use_new_zipfile_serialization=False)
    torch.jit.save(torch.jit.script(model), str(root / "model_script.pt"))
    g = torch.Generator().manual_seed(1)
    inputs, labels = torch.randn(24, 1, 5, 5, generator=g), torch.randint(0, 2, (24,), generator=g)
    save_file({"inputs": inputs, "labels": labels}, str(root / "data.safetensors"))
    (root / "shards").mkdir()
    save_file({"inputs": inputs[:12], "labels": labels[:12]}, str(root / "shards" / "a.safetensors"))
    save_file({"inputs": inputs[12:], "labels": labels[12:]}, str(root / "shards" / "b.safetensors"))
    checkpoints = {
        "safetensors": root / "model.safetensors",
        "zip": root / "model.ckpt",
        "legacy": root / "model_legacy.pt",
        "torchscript": root / "model_script.pt",
    }
    return {
        "root": root,
        "checkpoints": checkpoints,
        "arch": "writes_net:net",
        "inputs": [
            *checkpoints.values(),
            root / "data.safetensors",
            root / "shards" / "a.safetensors",
            root / "shards" / "b.safetensors",
            root / "writes_net.py",
        ],
    }


def model_args(world: dict, kind: str) -> list[str]:
    path = str(world["checkpoints"][kind])
    return [path] if kind == "torchscript" else [path, "--arch", world["arch"]]


# ----------------------------------------------------------------------------- inputs stay as they are


def test_no_command_modifies_its_inputs(world: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(world["root"])
    before = hashes(world["inputs"])
    for kind, path in world["checkpoints"].items():
        assert invoke("inspect", str(path), "--exit-zero").exit_code == 0
        result = invoke("gap", *model_args(world, kind), "--data", "data.safetensors", "--batch-size", "8")
        assert result.exit_code == 0, result.stderr
        out = tmp_path / f"{kind}.out"
        for extra in ([], ["--force"]):  # a new file, then over it
            result = invoke(
                "recalibrate",
                *model_args(world, kind),
                "--data",
                "shards",
                "--eval-data",
                "data.safetensors",
                "--batch-size",
                "8",
                "-o",
                str(out),
                *extra,
            )
            assert result.exit_code == 0, result.stderr
        written = sha(out)
        # an existing output without --force: refused, untouched
        result = invoke("recalibrate", *model_args(world, kind), "--data", "data.safetensors", "-o", str(out))
        assert one_line_error(result) == f"{out}: already exists (pass --force to overwrite)"
        assert sha(out) == written
        # an output that is one of the inputs: refused even with --force
        for target, message in [
            (path, f"{path}: is the input checkpoint"),
            (world["root"] / "data.safetensors", "is the --data file"),
            (world["root"] / "shards" / "a.safetensors", "lies inside the --data folder shards"),
            (world["root"] / "shards" / "new.safetensors", "lies inside the --data folder shards"),
        ]:
            result = invoke(
                "recalibrate",
                *model_args(world, kind),
                "--data",
                "shards" if "shards" in str(target) else "data.safetensors",
                "-o",
                str(target),
                "--force",
            )
            assert message in one_line_error(result)
        assert hashes(world["inputs"]) == before
    result = invoke(
        "recalibrate",
        "model.safetensors",
        "--arch",
        "./writes_net.py:net",
        "--data",
        "data.safetensors",
        "--eval-data",
        "shards",
        "-o",
        "writes_net.py",
        "--force",
    )
    assert one_line_error(result) == "writes_net.py: is the --arch file; write the new checkpoint to another file"
    result = invoke(
        "recalibrate",
        "model.safetensors",
        "--arch",
        world["arch"],
        "--data",
        "shards",
        "--eval-data",
        "data.safetensors",
        "-o",
        "data.safetensors",
        "--force",
    )
    assert "is the --eval-data file" in one_line_error(result)
    assert hashes(world["inputs"]) == before
    assert not (world["root"] / "shards" / "new.safetensors").exists()
    assert sorted(os.listdir(tmp_path)) == sorted(f"{kind}.out" for kind in world["checkpoints"])


# ----------------------------------------------------------------------------- signals, in real processes


def cli_env(world: dict) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{world['root']}"}


def wait_for(marker: Path, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while not marker.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"never reached {marker.name}: {proc.communicate()}")
        time.sleep(0.02)


def finish(proc: subprocess.Popen, signum: int) -> tuple[int, str]:
    proc.send_signal(signum)
    try:
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, stderr


def check_ending(signum: int, returncode: int, stderr: str) -> None:
    if signum == signal.SIGKILL:
        assert returncode == -signal.SIGKILL
    else:  # SIGINT and SIGTERM unwind: one line, exit 130
        assert returncode == 130, stderr
        assert stderr.strip().splitlines()[-1] == "bnaudit: interrupted"


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=["INT", "TERM", "KILL"])
def test_recalibrate_stopped_while_calibrating_leaves_nothing(world: dict, tmp_path: Path, signum: int) -> None:
    marker = world["root"] / "blocked"
    marker.unlink(missing_ok=True)
    target = tmp_path / "target"
    target.mkdir()
    (target / "other.txt").write_text("unrelated")
    before = hashes(world["inputs"])
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bnaudit",
            "recalibrate",
            str(world["checkpoints"]["zip"]),
            "--arch",
            world["arch"],
            "--dataset",
            "writes_net:blocking",
            "--no-shuffle",
            "--batch-size",
            "4",
            "-o",
            str(target / "out.ckpt"),
        ],
        cwd=world["root"],
        env=cli_env(world),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_sigint,
    )
    wait_for(marker, proc)
    check_ending(signum, *finish(proc, signum))
    assert os.listdir(target) == ["other.txt"]
    assert hashes(world["inputs"]) == before


SLOW_WRITER = textwrap.dedent("""
    import sys
    import time
    from pathlib import Path

    import bnaudit.formats.atomic as atomic
    import bnaudit.formats.write as writer

    marker, mode = sys.argv[1], sys.argv[2]
    write = writer._rewrite_safetensors


    def write_then_block(source, updates, record, f):
        write(source, updates, record, f)  # every byte of the new file, not yet named
        f.flush()
        Path(marker).touch()
        time.sleep(120)


    writer._rewrite_safetensors = write_then_block
    if mode == "named":  # the fallback where O_TMPFILE is missing: a hidden temporary file
        atomic._open_unnamed = lambda directory: None
    from bnaudit.cli import main

    sys.argv = ["bnaudit", *sys.argv[3:]]
    main()
""")


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode, signum, existing",
    [
        ("unnamed", signal.SIGINT, False),
        ("unnamed", signal.SIGTERM, True),
        ("unnamed", signal.SIGKILL, False),
        ("unnamed", signal.SIGKILL, True),
        ("named", signal.SIGINT, True),
        ("named", signal.SIGTERM, False),
    ],
    ids=["unnamed-INT", "unnamed-TERM-force", "unnamed-KILL", "unnamed-KILL-force", "named-INT-force", "named-TERM"],
)
def test_recalibrate_stopped_while_writing_leaves_no_partial_file(
    world: dict, tmp_path: Path, mode: str, signum: int, existing: bool
) -> None:
    """Stopped after the whole file is written but before it gets its name. (In the
    fallback mode a SIGKILL cannot be cleaned up after: the hidden temporary file
    stays until the next write of that output (test_save); O_TMPFILE, the default on Linux, is
    what makes SIGKILL safe.)"""
    marker, target = tmp_path / "writing", tmp_path / "target"
    target.mkdir()
    out = target / "out.safetensors"
    if existing:
        out.write_bytes(b"the previous output")
    before = hashes(world["inputs"])
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            SLOW_WRITER,
            str(marker),
            mode,
            "recalibrate",
            str(world["checkpoints"]["safetensors"]),
            "--arch",
            world["arch"],
            "--data",
            "data.safetensors",
            "-o",
            str(out),
            *(["--force"] if existing else []),
        ],
        cwd=world["root"],
        env=cli_env(world),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_sigint,
    )
    wait_for(marker, proc)
    check_ending(signum, *finish(proc, signum))
    if existing:
        assert os.listdir(target) == ["out.safetensors"] and out.read_bytes() == b"the previous output"
    else:
        assert os.listdir(target) == []
    assert hashes(world["inputs"]) == before


# ----------------------------------------------------------------------------- full disk, read-only folder

FULL_DISK = textwrap.dedent("""
    import json
    import resource
    import sys

    from typer.testing import CliRunner

    from bnaudit.cli import app

    # the kernel refuses to let this process grow any file past 256 bytes (EFBIG): every
    # output below is larger, every input is only read
    resource.setrlimit(resource.RLIMIT_FSIZE, (256, 256))
    results = []
    for args in json.loads(sys.argv[1]):
        result = CliRunner().invoke(app, args)
        results.append([result.exit_code, result.stdout, result.stderr])
    print(json.dumps(results))
""")


@pytest.mark.slow
def test_full_disk_is_one_line_and_leaves_no_file_in_every_format(world: dict, tmp_path: Path) -> None:
    runs, outputs = [], []
    for kind in world["checkpoints"]:
        out = tmp_path / f"{kind}.out"
        outputs.append(out)
        runs.append(
            ["recalibrate", *model_args(world, kind), "--data", "data.safetensors", "-o", str(out), "--format", "json"]
        )
    before = hashes(world["inputs"])
    proc = subprocess.run(
        [sys.executable, "-c", FULL_DISK, json.dumps(runs)],
        cwd=world["root"],
        env=cli_env(world),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    for out, (code, stdout, stderr) in zip(outputs, json.loads(proc.stdout.splitlines()[-1])):
        message = f"cannot write {out}: File too large"
        assert code == 2 and stderr == "", stderr  # said once: in the JSON document
        assert json.loads(stdout) == {"error": message}
    assert os.listdir(tmp_path) == []
    assert hashes(world["inputs"]) == before


@pytest.fixture(params=["unnamed", "named"])
def write_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "named":
        monkeypatch.setattr(atomic_mod, "_open_unnamed", lambda _directory: None)
    return request.param


def recalibrate_into(world: dict, out: Path, *extra: str):
    return invoke(
        "recalibrate",
        str(world["checkpoints"]["safetensors"]),
        "--arch",
        world["arch"],
        "--data",
        str(world["root"] / "data.safetensors"),
        "-o",
        str(out),
        *extra,
    )


@pytest.mark.parametrize("existing", [False, True])
def test_no_space_while_writing(
    world: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, write_mode: str, existing: bool
) -> None:
    monkeypatch.chdir(world["root"])
    out = tmp_path / "out.safetensors"
    if existing:
        out.write_bytes(b"previous")
    write = write_mod._rewrite_safetensors

    def half_then_full(source, updates, record, f) -> None:
        f.write(b"\0" * 300)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(write_mod, "_rewrite_safetensors", half_then_full)
    result = recalibrate_into(world, out, *(["--force"] if existing else []))
    assert one_line_error(result) == f"cannot write {out}: No space left on device"
    assert os.listdir(tmp_path) == (["out.safetensors"] if existing else [])
    if existing:
        assert out.read_bytes() == b"previous"
    # a full disk that shows only at fsync (delayed allocation)
    monkeypatch.setattr(write_mod, "_rewrite_safetensors", write)
    real_fsync = os.fsync

    def fsync_full(fd: int) -> None:
        if not os.path.isdir(f"/proc/self/fd/{fd}"):  # the new file, not its folder
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync_full)
    result = recalibrate_into(world, out, *(["--force"] if existing else []))
    assert one_line_error(result) == f"cannot write {out}: No space left on device"
    assert os.listdir(tmp_path) == (["out.safetensors"] if existing else [])
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert recalibrate_into(world, out, "--force").exit_code == 0  # and it works once there is room
    assert os.listdir(tmp_path) == ["out.safetensors"] and out.read_bytes()[:8] != b"previous"


def test_read_only_folder_is_refused_before_the_work(
    world: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    real_access = os.access
    monkeypatch.setattr(
        os,
        "access",
        lambda path, mode, **kw: False if os.fspath(path) == str(folder) else real_access(path, mode, **kw),
    )
    calls: list[int] = []
    monkeypatch.setattr("bnaudit.runtime.recalibrate.command.load_runnable", lambda *a, **k: calls.append(1))
    result = recalibrate_into(world, folder / "out.safetensors")
    assert one_line_error(result) == f"{folder / 'out.safetensors'}: folder {folder} is not writable"
    assert os.listdir(folder) == [] and calls == []


def test_read_only_folder_refusing_the_write_is_one_line(
    world: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, write_mode: str
) -> None:
    """The folder passes the early check, then refuses every new file (EROFS)."""
    folder = tmp_path / "ro"
    folder.mkdir()
    real_open = os.open
    refused: list[str] = []

    def read_only_open(path, flags, *args, **kwargs):
        path_text = os.fspath(path)
        creating = flags & (os.O_CREAT | getattr(os, "O_TMPFILE", 0)) or flags & (os.O_WRONLY | os.O_RDWR)
        if creating and (path_text == str(folder) or os.path.dirname(path_text) == str(folder)):
            refused.append(path_text)
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path_text)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only_open)
    out = folder / "out.safetensors"
    result = recalibrate_into(world, out)
    assert one_line_error(result) == f"cannot write {out}: Read-only file system"
    assert refused and os.listdir(folder) == []


FILLED_DISK = textwrap.dedent("""
    import resource, signal, sys
    from typer.testing import CliRunner
    from bnaudit.cli import app

    # past 32 KiB the kernel refuses this process's writes (EFBIG, SIGXFSZ ignored): the
    # output's first records fit, its tensors do not, so the failure comes from inside
    # torch's zip writer, as a disk filling up mid-file does
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (32768, 32768))
    result = CliRunner().invoke(app, sys.argv[1:])
    print(result.exit_code)
    print(result.stderr, end="")
""")


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_a_disk_filling_up_inside_torchs_writer_is_one_line_naming_the_cause(tmp_path: Path, legacy: bool) -> None:
    # was: "internal error: RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos"
    torch.manual_seed(0)
    source = (
        "import torch\ndef net():\n    return torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4))\n"
    )
    (tmp_path / "disk_net.py").write_text(source)
    ns: dict = {}
    exec(source, ns)
    state = {"state_dict": ns["net"]().state_dict(), "epoch": 3, "extra": torch.randn(64, 1024)}  # 256 KiB more
    torch.save(state, tmp_path / "model.pt", _use_new_zipfile_serialization=not legacy)
    g = torch.Generator().manual_seed(1)
    save_file({"inputs": torch.randn(16, 1, 5, 5, generator=g)}, str(tmp_path / "data.safetensors"))
    out = tmp_path / "out.pt"
    out.write_bytes(b"previous")
    args = [
        "recalibrate",
        "model.pt",
        "--arch",
        "disk_net:net",
        "--data",
        "data.safetensors",
        "-o",
        "out.pt",
        "--force",
    ]
    proc = subprocess.run(
        [sys.executable, "-c", FILLED_DISK, *args],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{tmp_path}"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    code, *stderr = proc.stdout.splitlines()
    assert code == "2", proc.stdout + proc.stderr
    errors = [line for line in stderr if line.startswith("bnaudit: error:")]
    assert errors == ["bnaudit: error: cannot write out.pt: File too large"], stderr
    assert out.read_bytes() == b"previous"  # the previous output intact
    left = sorted(set(os.listdir(tmp_path)) - {"__pycache__"})
    assert left == ["data.safetensors", "disk_net.py", "model.pt", "out.pt"]  # no partial file

"""Hostile and broken inputs: never run code, never crash, never allocate what a file claims.

Every forged file is built here, byte by byte where the format allows it. A payload
test also proves its payload is live (it does run under plain pickle), so a test
that passes because the payload is inert cannot hide a regression.
"""

from __future__ import annotations

import argparse
import collections
import io
import json
import os
import pickle
import struct
import subprocess
import sys
import tracemalloc
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_in_4_gib
from typer.testing import CliRunner

from bnaudit.api import inspect
from bnaudit.cli import app
from bnaudit.errors import BnauditError
from bnaudit.formats.read import read_checkpoint
from bnaudit.formats.safetensors import read_safetensors

REPO = Path(__file__).resolve().parents[1]
torch.set_num_threads(1)


# ----------------------------------------------------------------------------- helpers


def cli(*args: str):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})


def stderr_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.strip()]


def assert_one_line_error(result, path: str, *words: str) -> str:
    """Exit 2, exactly one stderr line naming `path`, no traceback; returns the line."""
    assert result.exit_code == 2, (result.exit_code, result.stdout, result.stderr)
    lines = stderr_lines(result)
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"bnaudit: error: {path}: "), lines[0]
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert "Traceback" not in result.stdout + result.stderr
    return lines[0]


def bn_state(channels: int = 3, mean: float = 0.5, var: float = 2.0, batches: int = 1000) -> dict:
    return {
        "bn.weight": torch.full((channels,), 1.5),
        "bn.bias": torch.full((channels,), 0.25),
        "bn.running_mean": torch.full((channels,), mean),
        "bn.running_var": torch.full((channels,), var),
        "bn.num_batches_tracked": torch.tensor(batches),
    }


def write_safetensors(path: Path, header: dict | bytes, data: bytes = b"", claimed: int | None = None) -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(raw) if claimed is None else claimed
    path.write_bytes(struct.pack("<Q", n) + raw + data)
    return path


def st_tensors(tensors: dict[str, np.ndarray]) -> tuple[dict, bytes]:
    """A safetensors header and data block for little-endian numpy arrays."""
    codes = {"float32": "F32", "float64": "F64", "float16": "F16", "int64": "I64", "int32": "I32"}
    header, data = {}, b""
    for name, array in tensors.items():
        raw = np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<")).tobytes()
        header[name] = {
            "dtype": codes[array.dtype.name],
            "shape": list(array.shape),
            "data_offsets": [len(data), len(data) + len(raw)],
        }
        data += raw
    return header, data


def save_st(path: Path, tensors: dict[str, np.ndarray]) -> Path:
    header, data = st_tensors(tensors)
    return write_safetensors(path, header, data)


class SystemPayload:
    """Unpickling this runs `os.system(command)`."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


class ExecPayload:
    """Unpickling this runs `builtins.exec(code)`."""

    def __init__(self, code: str) -> None:
        self.code = code

    def __reduce__(self):
        import builtins

        return (builtins.exec, (self.code,))


def payload(kind: str, marker: Path):
    if kind == "os.system":
        return SystemPayload(f"touch {marker}"), f"{os.system.__module__}.system"  # posix.system
    return ExecPayload(f"open({str(marker)!r}, 'w').write('ran')"), "builtins.exec"


# ----------------------------------------------------------------------------- no code execution


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
@pytest.mark.parametrize("kind", ["os.system", "builtins.exec"])
def test_reduce_payload_is_refused_without_running(tmp_path, kind, legacy):
    marker = tmp_path / "marker"
    evil, global_name = payload(kind, marker)
    path = tmp_path / "evil.pt"
    torch.save({"state_dict": bn_state(), "extra": evil}, path, _use_new_zipfile_serialization=not legacy)
    before = path.read_bytes()

    result = cli("inspect", str(path))

    line = assert_one_line_error(result, str(path), global_name, "--trust-pickle", "safetensors")
    assert "refused" in line
    assert not marker.exists()
    assert path.read_bytes() == before

    # The payload is live: plain unpickling of the same object does run it.
    pickle.loads(pickle.dumps(evil))
    assert marker.exists()


@pytest.mark.parametrize("kind", ["os.system", "builtins.exec"])
def test_plain_pickle_payload_is_refused_without_running(tmp_path, kind):
    # Not torch.save at all: the payload sits in the file's first pickle.
    marker = tmp_path / "marker"
    evil, _ = payload(kind, marker)
    path = tmp_path / "plain.pt"
    path.write_bytes(pickle.dumps({"state_dict": {"w": 1}, "x": evil}, protocol=2))
    assert_one_line_error(cli("inspect", str(path)), str(path), "not one written by torch.save")
    assert not marker.exists()
    pickle.loads(path.read_bytes())  # the payload is live
    assert marker.exists()


def test_trust_pickle_is_what_runs_the_payload(tmp_path):
    marker = tmp_path / "marker"
    path = tmp_path / "evil.pt"
    torch.save({"state_dict": bn_state(), "extra": SystemPayload(f"touch {marker}")}, path)
    result = cli("inspect", "--trust-pickle", str(path))
    assert marker.exists()  # documented: --trust-pickle runs the file's code
    assert result.exit_code == 0, result.stdout + result.stderr


def scripted_archive(tmp_path: Path) -> Path:
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.BatchNorm2d(2, eps=1e-3, momentum=0.05))
    with torch.no_grad():
        model[1].running_mean.copy_(torch.tensor([0.5, -1.0]))
        model[1].running_var.copy_(torch.tensor([2.0, 3.0]))
    path = tmp_path / "scripted.pt"
    torch.jit.save(torch.jit.script(model), str(path))
    return path


def replace_zip_entry(src: Path, dst: Path, suffix: str, content: bytes) -> Path:
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for name in zin.namelist():
            zout.writestr(name, content if name.endswith(suffix) and name.count("/") == 1 else zin.read(name))
    return dst


def test_torchscript_with_malicious_global_is_refused_by_restricted_unpickler(tmp_path, monkeypatch):
    marker = tmp_path / "marker"
    evil, global_name = payload("os.system", marker)
    path = replace_zip_entry(
        scripted_archive(tmp_path), tmp_path / "evil_script.pt", "/data.pkl", pickle.dumps({"x": evil}, protocol=2)
    )
    calls = []
    monkeypatch.setattr(torch.jit, "load", lambda *a, **k: calls.append(a))

    result = cli("inspect", str(path))

    line = assert_one_line_error(result, str(path), global_name, "safetensors")
    assert "TorchScript" in line
    assert not marker.exists()
    assert calls == []


def test_torchscript_is_read_without_torch_jit_load(tmp_path, monkeypatch):
    path = scripted_archive(tmp_path)
    calls = []
    monkeypatch.setattr(torch.jit, "load", lambda *a, **k: calls.append(a))
    ckpt = read_checkpoint(str(path))
    assert calls == []
    assert np.array_equal(ckpt.tensors["1.running_mean"].read(), np.array([0.5, -1.0], np.float32))
    assert np.array_equal(ckpt.tensors["1.running_var"].read(), np.array([2.0, 3.0], np.float32))
    assert ckpt.modules["1"].eps == pytest.approx(1e-3)
    assert ckpt.modules["1"].momentum == pytest.approx(0.05)


def test_whole_module_of_torch_nn_classes_loads_through_allow_list(tmp_path):
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 2, 3), torch.nn.BatchNorm2d(2, eps=1e-3, momentum=0.01), torch.nn.ReLU()
    )
    with torch.no_grad():
        model[1].running_var.copy_(torch.tensor([1e-6, 4.0]))
    path = tmp_path / "model.pt"
    torch.save(model, path)
    report = inspect(str(path))
    (file,) = report.files
    assert file.error is None
    (layer,) = file.layers
    assert (layer.name, layer.kind, layer.eps, layer.momentum) == ("1", "BatchNorm2d", 1e-3, 0.01)
    bn004 = [f for f in file.findings if f.code == "BN004"]
    assert [f.channels for f in bn004] == [(0,)]  # 1e-6 < 10 * 1e-3; 4.0 is not


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_numpy_scalars_and_namespace_containers_load(tmp_path, legacy):
    path = tmp_path / "container.pt"
    container = {
        "model": bn_state(channels=2, var=0.5),
        "args": argparse.Namespace(lr=0.1, arch="resnet", milestones=[30, 60]),
        "epoch": np.int64(90),
        "best_acc": np.float32(0.761),
        "history": np.arange(4, dtype=np.float64),
    }
    torch.save(container, path, _use_new_zipfile_serialization=not legacy)
    (file,) = inspect(str(path)).files
    assert file.error is None, file.error
    assert file.key == "model"
    assert [(s.name, s.num_features, s.num_batches_tracked) for s in file.layers] == [("bn", 2, 1000)]


def test_legacy_whole_module_pickle_is_refused_with_the_way_out(tmp_path):
    path = tmp_path / "old.pt"
    torch.save(torch.nn.Sequential(torch.nn.BatchNorm1d(2)), path, _use_new_zipfile_serialization=False)
    result = cli("inspect", str(path))
    assert_one_line_error(result, str(path), "legacy", "--trust-pickle", "safetensors")


def test_forged_module_attributes_do_not_crash(tmp_path):
    model = torch.nn.Sequential(torch.nn.BatchNorm1d(2))
    model[0].momentum = "fast"  # not a number: the assumed default is used instead
    model[0].eps = "tiny"
    path = tmp_path / "forged.pt"
    torch.save(model, path)
    (file,) = inspect(str(path)).files
    assert file.error is None, file.error
    (layer,) = file.layers
    assert (layer.eps, layer.momentum) == (1e-5, 0.1)

    model = torch.nn.Sequential(torch.nn.BatchNorm1d(2))
    model[0]._modules = ["not", "a", "dict"]
    torch.save(model, path)
    result = cli("inspect", str(path))
    assert_one_line_error(result, str(path), "malformed pickled module")


# ----------------------------------------------------------------------------- broken files


def _truncated_zip(tmp_path: Path) -> Path:
    good = tmp_path / "good_src.pt"
    torch.save(bn_state(), good)
    data = good.read_bytes()
    out = tmp_path / "truncated.pt"
    out.write_bytes(data[: len(data) // 2])
    return out


def _symlink_loop(tmp_path: Path) -> Path:
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    a.symlink_to(b)
    b.symlink_to(a)
    return a


def _fifo(tmp_path: Path) -> Path:
    path = tmp_path / "pipe.pt"
    os.mkfifo(path)  # open() would block forever waiting for a writer
    return path


BROKEN = {
    "empty": (lambda p: _write(p / "empty.pt", b""), "empty file"),
    "truncated zip": (_truncated_zip, "damaged zip"),
    "random bytes": (lambda p: _write(p / "random.pt", np.random.default_rng(7).bytes(4096)), "not a checkpoint"),
    "text": (lambda p: _write(p / "notes.pt", b"epoch 3: loss 0.12\n"), "not a checkpoint"),
    "json": (lambda p: _write(p / "config.pt", json.dumps({"lr": 0.1}).encode()), "not a checkpoint"),
    "empty directory": (lambda p: _mkdir(p / "nothing_here"), "holds no checkpoint"),
    "missing": (lambda p: p / "missing.pt", "no such file"),
    "symlink loop": (_symlink_loop, "symbolic links"),
    "device": (lambda p: Path("/dev/zero"), "not a regular file"),
}


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _mkdir(path: Path) -> Path:
    path.mkdir()
    (path / "README.txt").write_text("no checkpoints")
    return path


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_input_is_one_line_exit_2(tmp_path, case):
    make, words = BROKEN[case]
    path = make(tmp_path)
    result = cli("inspect", str(path))
    assert_one_line_error(result, str(path), words)


def run_cli_process(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """The CLI in a child process: a regression that hangs or crashes the interpreter fails one test."""
    return subprocess.run(
        [sys.executable, "-m", "bnaudit", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"},
        timeout=timeout,
    )


@pytest.mark.slow
def test_fifo_is_refused_without_blocking(tmp_path):
    path = _fifo(tmp_path)
    proc = run_cli_process("inspect", str(path), timeout=60)  # open() on it would wait for a writer forever
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"bnaudit: error: {path}: not a regular file (a pipe, socket or device)"


@pytest.mark.parametrize("case", ["empty", "random bytes", "missing", "symlink loop"])
def test_json_format_reports_broken_file_as_error_field(tmp_path, case):
    make, words = BROKEN[case]
    path = make(tmp_path)
    result = cli("inspect", "--format", "json", str(path))
    assert result.exit_code == 2
    doc = json.loads(result.stdout)
    (file,) = doc["files"]
    assert words in file["error"]
    assert doc["summary"]["unreadable"] == 1


def test_readable_files_are_still_audited_next_to_broken_ones(tmp_path):
    good = tmp_path / "good.pt"
    state = bn_state(channels=2, var=2.0)
    state["bn.running_var"] = torch.tensor([2.0, 0.0])  # BN004 warning: exit 1 on its own
    torch.save(state, good)
    empty = _write(tmp_path / "empty.pt", b"")
    missing = tmp_path / "missing.pt"

    alone = cli("inspect", str(good))
    assert alone.exit_code == 1

    result = cli("inspect", "--format", "json", str(empty), str(good), str(missing))
    assert result.exit_code == 2  # an unreadable file wins over findings
    doc = json.loads(result.stdout)
    by_path = {f["path"]: f for f in doc["files"]}
    assert by_path[str(good)]["error"] is None
    assert [f["channels"] for f in by_path[str(good)]["findings"] if f["code"] == "BN004"] == [[1]]
    assert "empty file" in by_path[str(empty)]["error"]
    assert "no such file" in by_path[str(missing)]["error"]
    assert stderr_lines(result) == []  # said once: in the document
    lines = stderr_lines(cli("inspect", str(empty), str(good), str(missing)))  # a table: on stderr
    assert len(lines) == 2 and str(empty) in lines[0] and str(missing) in lines[1]


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_file_name_that_is_not_utf8_is_still_audited(tmp_path, legacy):
    # A name with byte 0xff reaches Python as a surrogate escape; torch's reader takes UTF-8 only.
    path = os.fsdecode(os.fsencode(str(tmp_path)) + b"/\xff\xfeckpt.pt")
    state = bn_state(channels=2)
    state["bn.running_var"] = torch.tensor([2.0, 1e-7])
    torch.save(state, path, _use_new_zipfile_serialization=not legacy)
    result = cli("inspect", "--format", "json", str(tmp_path))
    assert result.exit_code == 1, result.stdout + result.stderr
    (file,) = json.loads(result.stdout)["files"]
    assert file["path"] == path and file["error"] is None
    assert [f["channels"] for f in file["findings"] if f["code"] == "BN004"] == [[1]]
    assert cli("inspect", str(tmp_path)).exit_code == 1  # the table prints the name too


def test_internal_error_on_one_file_spares_the_others_and_debug_shows_it(tmp_path, monkeypatch):
    import bnaudit.audit.checkpoint.inspect as audit_module

    good, bad = tmp_path / "good.pt", tmp_path / "bad.pt"
    torch.save(bn_state(), good)
    torch.save(bn_state(), bad)
    real = audit_module.discover_layers

    def discover(ckpt, *args, **kwargs):
        if ckpt.path == str(bad):
            raise ZeroDivisionError("simulated bug")
        return real(ckpt, *args, **kwargs)

    monkeypatch.setattr(audit_module, "discover_layers", discover)
    result = cli("inspect", str(good), str(bad))
    assert result.exit_code == 2
    assert "Traceback" not in result.stdout + result.stderr
    (line,) = stderr_lines(result)
    assert line.startswith(f"bnaudit: error: {bad}: internal error: ZeroDivisionError: simulated bug")
    assert "--debug" in line
    assert "1 BN layer:" in result.stdout  # good.pt was audited

    debug = cli("inspect", "--debug", str(good), str(bad))
    assert isinstance(debug.exception, ZeroDivisionError)


@pytest.mark.slow
def test_unreadable_file_and_folder_are_reported_as_permission_denied(tmp_path):
    """chmod alone does not stop root, so the check runs with real permissions as `nobody`.

    A child process imports everything as root, drops to uid/gid 65534 (losing
    CAP_DAC_OVERRIDE), then inspects a 0644 control file, a 0000 file and a
    folder holding a 0000 sub-folder. Skipped where neither root nor an ordinary
    user can set this up.
    """
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="bnaudit-perm-", dir="/tmp"))
    try:
        base.chmod(0o755)
        readable, locked = base / "readable.pt", base / "locked.pt"
        torch.save(bn_state(), readable)
        torch.save(bn_state(), locked)
        readable.chmod(0o644)
        locked.chmod(0o000)
        folder = base / "folder"
        (folder / "sub").mkdir(parents=True)
        torch.save(bn_state(), folder / "ok.pt")
        torch.save(bn_state(), folder / "sub" / "hidden.pt")
        folder.chmod(0o755)
        (folder / "ok.pt").chmod(0o644)
        (folder / "sub").chmod(0o000)
        script = f"""
import json, os, sys
from typer.testing import CliRunner
from bnaudit.cli import app
runner = CliRunner()
runner.invoke(app, ["inspect", {str(readable)!r}])  # import everything while still privileged
if os.geteuid() == 0:
    os.setgroups([]); os.setgid(65534); os.setuid(65534)
out = {{}}
for name, path in (("control", {str(readable)!r}), ("locked", {str(locked)!r}), ("folder", {str(folder)!r})):
    r = runner.invoke(app, ["inspect", "--format", "json", path])
    out[name] = {{"code": r.exit_code, "stdout": r.stdout, "stderr": r.stderr}}
print(json.dumps(out))
"""
        proc = subprocess.run(
            [sys.executable, "-c", script],
            cwd=REPO,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            timeout=120,
        )
        if proc.returncode != 0:
            pytest.skip(f"cannot drop privileges here: {proc.stderr.strip().splitlines()[-1:]}")
        out = json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        for p in (base / "locked.pt", base / "folder" / "sub"):
            if p.exists():
                p.chmod(0o755)
        import shutil

        shutil.rmtree(base, ignore_errors=True)

    if out["control"]["code"] != 0:
        # The control is a readable file: if uid 65534 cannot audit it, the environment
        # itself is closed to that user (a virtualenv under a 0700 folder, say).
        pytest.skip(f"uid 65534 cannot run bnaudit here: {out['control']['stderr'].strip()[-200:]}")
    assert out["locked"]["code"] == 2
    assert out["locked"]["stderr"] == ""  # --format json: said once, in the document
    assert json.loads(out["locked"]["stdout"])["files"][0]["error"] == "permission denied"
    folder_doc = json.loads(out["folder"]["stdout"])
    errors = {f["path"]: f["error"] for f in folder_doc["files"]}
    assert errors[str(folder / "ok.pt")] is None  # the readable file is still audited
    assert "permission denied" in errors[str(folder / "sub")]
    assert out["folder"]["code"] == 2


# ----------------------------------------------------------------------------- hostile sizes


def _peak_bytes(fn) -> int:
    tracemalloc.start()
    try:
        fn()
    except BnauditError:
        pass
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def test_safetensors_header_claiming_2_pow_60_bytes_is_refused_without_reading(tmp_path):
    path = write_safetensors(tmp_path / "huge.safetensors", b'{"a": 1}', claimed=2**60)
    with pytest.raises(BnauditError, match=f"claims {2**60} bytes"):
        read_safetensors(str(path))
    assert _peak_bytes(lambda: read_safetensors(str(path))) < 1 << 20


def test_safetensors_header_larger_than_limit_is_refused_even_if_file_is_that_big(tmp_path):
    path = tmp_path / "sparse.safetensors"
    claimed = 150 * 1024 * 1024
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", claimed) + b"{")
        f.truncate(8 + claimed + 16)  # sparse: costs no disk
    assert _peak_bytes(lambda: read_safetensors(str(path))) < 1 << 20
    with pytest.raises(BnauditError, match="corrupt safetensors header"):
        read_safetensors(str(path))


@pytest.mark.parametrize(
    ("entry", "words"),
    [
        ({"dtype": "F32", "shape": [4], "data_offsets": [0, 10**12]}, "lies outside the file"),
        ({"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}, "lies outside the file"),
        ({"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 16]}, "16 bytes for shape"),
        ({"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}, "invalid shape"),
        ({"dtype": "F32", "shape": [True, 4], "data_offsets": [0, 16]}, "invalid shape"),
        ({"dtype": "F32", "shape": [4.0], "data_offsets": [0, 16]}, "invalid shape"),
        ({"dtype": "X99", "shape": [4], "data_offsets": [0, 16]}, "unknown dtype"),
        ({"dtype": ["F32"], "shape": [4], "data_offsets": [0, 16]}, "unknown dtype"),
        ({"dtype": "F32", "shape": [4], "data_offsets": [16, 0]}, "lies outside the file"),
        ({"dtype": "F32", "shape": [4]}, "corrupt safetensors entry"),
        ("not an object", "corrupt safetensors entry"),
    ],
)
def test_safetensors_forged_entry_is_refused(tmp_path, entry, words):
    path = write_safetensors(tmp_path / "forged.safetensors", {"bn.running_mean": entry}, b"\0" * 16)
    result = cli("inspect", str(path))
    assert_one_line_error(result, str(path), words)
    assert _peak_bytes(lambda: read_checkpoint(str(path))) < 1 << 20


@pytest.mark.parametrize(
    "header",
    [
        b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",  # nesting past the recursion limit
        b'{"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 1' + b"0" * 5000 + b"]}}",  # 5000-digit int
        b'{"a": "\xff\xfe"}',  # not UTF-8
        b'{"a": 1',  # cut short
        b'["list"]',  # valid JSON, not an object (starts with "[": sniffed as no checkpoint)
        b'{"__metadata__": [1, 2]}',
    ],
    ids=["deep", "bigint", "utf8", "short", "list", "metadata"],
)
def test_safetensors_malformed_json_header_is_one_line(tmp_path, header):
    path = write_safetensors(tmp_path / "bad.safetensors", header)
    result = cli("inspect", str(path))
    assert_one_line_error(result, str(path))


def test_safetensors_statistics_sharing_their_bytes_are_refused(tmp_path):
    # running_mean and running_var claiming the same 12 bytes: the safetensors package
    # refuses the file ("invalid offset"), and so does inspect, naming the tensor
    header, data = st_tensors({"bn.running_mean": np.zeros(3, np.float32)})
    header["bn.running_var"] = dict(header["bn.running_mean"])
    path = write_safetensors(tmp_path / "aliased.safetensors", header, data)
    assert_one_line_error(cli("inspect", str(path)), str(path), "'bn.running_var' overlaps the tensor before it")


def test_safetensors_file_cut_after_header_is_refused(tmp_path):
    header, data = st_tensors({"bn.running_mean": np.zeros(3, np.float32), "bn.running_var": np.ones(3, np.float32)})
    path = write_safetensors(tmp_path / "cut.safetensors", header, data[:-4])
    assert_one_line_error(cli("inspect", str(path)), str(path), "lies outside the file")


def test_zip_entry_inflating_past_the_file_is_refused(tmp_path):
    path = tmp_path / "bomb.pt"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("archive/data.pkl", b"\0" * (8 << 20))  # 8 MiB that deflates to ~8 KiB
        archive.writestr("archive/version", b"3\n")
    assert path.stat().st_size < 1 << 20
    result = cli("inspect", str(path))
    assert_one_line_error(result, str(path), "archive/data.pkl", str(8 << 20), "refused")


class FakeStorage:
    def __init__(self, key: str, numel: int) -> None:
        self.key, self.numel = key, numel


class FakeTensor:
    """Pickles as torch's own tensor record, with whatever sizes the test claims."""

    def __init__(self, storage: FakeStorage, offset: int, size: tuple, stride: tuple) -> None:
        self.args = (storage, offset, size, stride, False, collections.OrderedDict())

    def __reduce__(self):
        return (torch._utils._rebuild_tensor_v2, self.args)


def _pickle_with_storages(obj, legacy: bool) -> bytes:
    class Pickler(pickle.Pickler):
        def persistent_id(self, value):
            if isinstance(value, FakeStorage):
                record = ("storage", torch.FloatStorage, value.key, "cpu", value.numel)
                return record + (None,) if legacy else record
            return None

    buffer = io.BytesIO()
    Pickler(buffer, protocol=2).dump(obj)
    return buffer.getvalue()


def write_legacy(path: Path, obj, storages: dict[str, np.ndarray]) -> Path:
    """The pre-1.6 torch.save layout: magic, protocol, sys info, pickle, keys, storages."""
    out = io.BytesIO()
    for header in (
        0x1950A86A20F9469CFC6C,
        1001,
        {"protocol_version": 1001, "little_endian": True, "type_sizes": {"short": 2, "int": 4, "long": 4}},
    ):
        pickle.dump(header, out, protocol=2)
    out.write(_pickle_with_storages(obj, legacy=True))
    pickle.dump(sorted(storages), out, protocol=2)
    for key in sorted(storages):
        out.write(struct.pack("<q", storages[key].size) + storages[key].astype("<f4").tobytes())
    path.write_bytes(out.getvalue())
    return path


def write_torch_zip(path: Path, obj, storages: dict[str, np.ndarray]) -> Path:
    writer = torch._C.PyTorchFileWriter(str(path))
    data = _pickle_with_storages(obj, legacy=False)
    writer.write_record("data.pkl", data, len(data))
    writer.write_record("byteorder", b"little", 6)
    for key, array in storages.items():
        raw = array.astype("<f4").tobytes()
        writer.write_record(f"data/{key}", raw, len(raw))
    writer.write_end_of_file()
    return path


def _bn_records(mean_tensor: FakeTensor) -> dict:
    return {"bn.running_mean": mean_tensor, "bn.running_var": FakeTensor(FakeStorage("1", 3), 0, (3,), (1,))}


STORES = {"0": np.array([0.5, 1.0, 1.5]), "1": np.array([2.0, 3.0, 4.0])}


def test_handmade_legacy_and_zip_files_read_back(tmp_path):
    """The forging helpers write files torch itself reads: the forged cases below are honest."""
    records = _bn_records(FakeTensor(FakeStorage("0", 3), 0, (3,), (1,)))
    for path in (write_legacy(tmp_path / "l.pt", records, STORES), write_torch_zip(tmp_path / "z.pt", records, STORES)):
        loaded = torch.load(path, weights_only=True)
        assert loaded["bn.running_mean"].tolist() == [0.5, 1.0, 1.5]
        ckpt = read_checkpoint(str(path))
        assert ckpt.tensors["bn.running_var"].read() == [2.0, 3.0, 4.0]


@pytest.mark.parametrize("numel", [2**40, 2**33])
def test_legacy_storage_claiming_more_than_the_file_is_refused_before_torch_load(tmp_path, monkeypatch, numel):
    path = write_legacy(tmp_path / "claims.pt", _bn_records(FakeTensor(FakeStorage("0", numel), 0, (3,), (1,))), STORES)

    def forbidden(*args, **kwargs):
        raise AssertionError("torch.load must not see a file whose storages lie")

    monkeypatch.setattr(torch, "load", forbidden)
    (file,) = inspect(str(path)).files
    assert "storages claim" in file.error
    assert str(numel * 4 + 4 * 3 + 16) in file.error  # both storages' bytes plus their 8-byte lengths


def test_legacy_string_claiming_gigabytes_is_refused(tmp_path):
    path = tmp_path / "longstring.pt"
    body = io.BytesIO()
    pickle.dump(0x1950A86A20F9469CFC6C, body, protocol=2)
    body.write(b"\x80\x02X" + struct.pack("<I", 0xFFFFFF00) + b"abc")  # BINUNICODE of 4 GiB, 3 bytes follow
    path.write_bytes(body.getvalue())
    result = cli("inspect", str(path))
    assert_one_line_error(result, str(path), "damaged torch.save file")


def test_legacy_tar_polyglot_is_refused_before_torch_load(tmp_path, monkeypatch):
    # torch's pre-0.4 tar loader trusts the sizes inside; a tar whose first member name
    # starts like a pickle would be sniffed as legacy and handed to it.
    import tarfile

    path = tmp_path / "old.pt"
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as archive:
        info = tarfile.TarInfo("\udc80\x02storages")  # surrogateescape: the raw byte 0x80
        info.size = 4
        archive.addfile(info, io.BytesIO(b"\0" * 4))
    assert path.read_bytes()[:1] == b"\x80"
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load reached"))
    (file,) = inspect(str(path)).files
    assert "tar-format" in file.error


@pytest.mark.parametrize(
    ("tensor", "words"),
    [
        (FakeTensor(FakeStorage("0", 3), 0, (2**40,), (1,)), "not a readable torch.save file"),
        (FakeTensor(FakeStorage("0", 3), 2**50, (3,), (1,)), "not a readable torch.save file"),
        (FakeTensor(FakeStorage("0", 3), 2, (3,), (-1,)), "not a readable torch.save file"),
        (FakeTensor(FakeStorage("7", 3), 0, (3,), (1,)), "not a readable torch.save file"),
    ],
    ids=["size", "offset", "negative-stride", "missing-record"],
)
def test_torch_zip_records_with_absurd_claims_are_refused(tmp_path, tensor, words):
    path = write_torch_zip(tmp_path / "forged.pt", _bn_records(tensor), STORES)
    assert_one_line_error(cli("inspect", str(path)), str(path), words)


def test_torch_zip_storage_numel_claim_is_bounded_by_the_record(tmp_path):
    # The storage claims 2^40 floats; mmap loading bounds it by the record actually stored.
    path = write_torch_zip(
        tmp_path / "numel.pt", _bn_records(FakeTensor(FakeStorage("0", 2**40), 0, (3,), (1,))), STORES
    )
    ckpt = read_checkpoint(str(path))
    assert ckpt.tensors["bn.running_mean"].read() == [0.5, 1.0, 1.5]


# TorchScript records are read by bnaudit's own unpickler: forged ones must not reach as_strided.


class ScriptNode:
    """An instance of a `__torch__` class holding `attrs`, as data.pkl stores modules."""

    def __init__(self, qualname: str, attrs: dict) -> None:
        self.qualname, self.attrs = qualname, attrs


def script_pickle(root) -> bytes:
    """data.pkl bytes for a tree of ScriptNodes and FakeTensors (opcodes written by pickle).

    pickle writes a class as a GLOBAL of its module, which must be importable while
    dumping: stand-in `__torch__...` modules exist only for the duration of the dump.
    """
    import types

    created: list[str] = []
    classes: dict[str, type] = {}

    def instance(node: ScriptNode):
        module, _, name = node.qualname.rpartition(".")
        if node.qualname not in classes:
            parts = module.split(".")
            for i in range(1, len(parts) + 1):
                mod_name = ".".join(parts[:i])
                if mod_name not in sys.modules:
                    sys.modules[mod_name] = types.ModuleType(mod_name)
                    created.append(mod_name)
            cls = type(name, (), {"__module__": module, "__qualname__": name})
            setattr(sys.modules[module], name, cls)
            classes[node.qualname] = cls
        return classes[node.qualname].__new__(classes[node.qualname])

    converted: dict[int, object] = {}

    def convert(node):
        if not isinstance(node, ScriptNode):
            return node
        if id(node) not in converted:  # shared nodes stay shared (memoised by pickle)
            inst = instance(node)
            inst.__dict__.update({k: convert(v) for k, v in node.attrs.items()})
            converted[id(node)] = inst
        return converted[id(node)]

    class Pickler(pickle.Pickler):
        def persistent_id(self, value):
            if isinstance(value, FakeStorage):
                return ("storage", torch.FloatStorage, value.key, "cpu", value.numel)
            return None

    buffer = io.BytesIO()
    try:
        Pickler(buffer, protocol=2).dump(convert(root))
    finally:
        for name in created:
            sys.modules.pop(name, None)
    return buffer.getvalue()


def forged_script(tmp_path: Path, root) -> Path:
    """A real scripted archive whose data.pkl is replaced by `root` (entries keep the root 'scripted/')."""
    return replace_zip_entry(
        scripted_archive(tmp_path), tmp_path / "forged_script.pt", "/data.pkl", script_pickle(root)
    )


BN_CLASS = "__torch__.torch.nn.modules.batchnorm.BatchNorm2d"


def test_forged_script_helper_builds_a_readable_archive(tmp_path):
    storage = FakeStorage("0", 18)  # data/0 of the scripted Conv2d: its 18 weights
    root = ScriptNode(
        "__torch__.M",
        {
            "bn": ScriptNode(
                BN_CLASS,
                {"running_mean": FakeTensor(storage, 0, (2,), (1,)), "running_var": FakeTensor(storage, 2, (2,), (1,))},
            )
        },
    )
    path = forged_script(tmp_path, root)
    with zipfile.ZipFile(path) as archive:
        stored = np.frombuffer(archive.read("scripted/data/0"), "<f4")
    ckpt = read_checkpoint(str(path))
    assert np.array_equal(ckpt.tensors["bn.running_mean"].read(), stored[0:2])
    assert np.array_equal(ckpt.tensors["bn.running_var"].read(), stored[2:4])
    assert ckpt.modules["bn"].class_name == "BatchNorm2d"


@pytest.mark.slow
def test_torchscript_negative_stride_is_refused_not_read_out_of_bounds(tmp_path):
    storage = FakeStorage("0", 18)
    root = ScriptNode(
        BN_CLASS,
        {"running_mean": FakeTensor(storage, 0, (4,), (-(10**9),)), "running_var": FakeTensor(storage, 0, (4,), (1,))},
    )
    path = forged_script(tmp_path, root)
    # In a child process: were the stride trusted, as_strided would read far outside
    # the buffer and the process would die with SIGSEGV.
    proc = run_cli_process("inspect", str(path))
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert proc.stderr.strip() == f"bnaudit: error: {path}: unreadable TorchScript archive (malformed tensor record)"


def test_torchscript_zero_stride_view_claiming_2_pow_40_elements_is_refused(tmp_path):
    storage = FakeStorage("0", 18)
    root = ScriptNode(
        BN_CLASS,
        {"running_mean": FakeTensor(storage, 0, (2**40,), (0,)), "running_var": FakeTensor(storage, 0, (2**40,), (0,))},
    )
    path = forged_script(tmp_path, root)
    assert_one_line_error(cli("inspect", str(path)), str(path), f"claims {2**40} elements")


@pytest.mark.slow
def test_torchscript_shared_nodes_nested_exponentially_are_refused(tmp_path):
    storage = FakeStorage("0", 18)
    node = ScriptNode(
        BN_CLASS,
        {"running_mean": FakeTensor(storage, 0, (2,), (1,)), "running_var": FakeTensor(storage, 2, (2,), (1,))},
    )
    for _ in range(60):  # 2^60 paths through 61 distinct nodes
        node = ScriptNode("__torch__.M", {"a": node, "b": node})
    path = forged_script(tmp_path, node)
    proc = run_cli_process("inspect", str(path), timeout=120)  # unbounded, the walk would never end
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith(f"bnaudit: error: {path}: TorchScript archive names more than 100000 modules")


@pytest.mark.slow
def test_torchscript_huge_memo_index_is_not_allocated(tmp_path):
    # LONG_BINPUT 0xFFFFFFF0: the C unpickler would grow its memo array to 32 GiB.
    # Run under a 4 GiB address-space limit so that a regression fails instead of swapping.
    path = replace_zip_entry(
        scripted_archive(tmp_path),
        tmp_path / "memo.pt",
        "/data.pkl",
        b"\x80\x02N" + b"r" + struct.pack("<I", 0xFFFFFFF0) + b".",
    )
    proc = run_in_4_gib(
        f"from bnaudit.formats.read import read_checkpoint\nprint(len(read_checkpoint({str(path)!r}).tensors))\n"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "0"


def test_torchscript_non_string_attribute_names_are_skipped(tmp_path):
    storage = FakeStorage("0", 18)
    root = ScriptNode(
        BN_CLASS,
        {
            "running_mean": FakeTensor(storage, 0, (2,), (1,)),
            "running_var": FakeTensor(storage, 2, (2,), (1,)),
            7: FakeTensor(storage, 4, (2,), (1,)),
            (1, 2): ScriptNode("__torch__.M", {}),
        },
    )
    ckpt = read_checkpoint(str(forged_script(tmp_path, root)))
    assert sorted(ckpt.tensors) == ["running_mean", "running_var"]


@pytest.mark.parametrize(
    "record",
    [("storage", "object", "0", "cpu", 18), ("storage", "float32", 0, "cpu", 18), ("weird",)],
)
def test_torchscript_forged_storage_records_are_refused(tmp_path, record):
    class Pickler(pickle.Pickler):
        def persistent_id(self, value):
            return record if value == "STORAGE" else None

    buffer = io.BytesIO()
    Pickler(buffer, protocol=2).dump({"running_mean": "STORAGE"})
    path = replace_zip_entry(scripted_archive(tmp_path), tmp_path / "storage.pt", "/data.pkl", buffer.getvalue())
    assert_one_line_error(cli("inspect", str(path)), str(path), "unreadable TorchScript archive")


def test_pathological_wrapper_prefix_is_stripped_a_bounded_number_of_times(tmp_path):
    prefix = "module." * 20_000
    path = save_st(
        tmp_path / "prefix.safetensors",
        {prefix + "bn.running_mean": np.zeros(2, np.float32), prefix + "bn.running_var": np.ones(2, np.float32)},
    )
    ckpt = read_checkpoint(str(path))
    assert ckpt.prefix == "module." * 8
    assert sorted(ckpt.tensors) == sorted(
        n[len(ckpt.prefix) :] for n in (prefix + "bn.running_mean", prefix + "bn.running_var")
    )


# ----------------------------------------------------------------------------- values


def audit_arrays(tmp_path: Path, tensors: dict[str, np.ndarray], name: str = "values.safetensors"):
    (file,) = inspect(str(save_st(tmp_path / name, tensors))).files
    assert file.error is None, file.error
    return file


def codes_for(file, layer: str) -> set[str]:
    return {f.code for f in file.findings if f.layer == layer}


@pytest.mark.parametrize("buffer", ["running_mean", "running_var", "weight", "bias"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_value_in_any_buffer_is_bn005(tmp_path, buffer, bad):
    values = {
        "running_mean": np.array([0.1, 0.2, 0.3]),
        "running_var": np.array([1.5, 2.0, 2.5]),
        "weight": np.array([1.1, 0.9, 1.2]),
        "bias": np.array([0.0, 0.1, -0.1]),
    }
    values[buffer] = values[buffer].copy()
    values[buffer][1] = bad
    tensors = {f"bn.{k}": v.astype(np.float32) for k, v in values.items()}
    tensors["bn.num_batches_tracked"] = np.array(500, np.int64)
    file = audit_arrays(tmp_path, tensors)
    (bn005,) = [f for f in file.findings if f.code == "BN005"]
    assert bn005.channels == (1,)
    assert buffer in bn005.message
    cli_result = cli("inspect", "--format", "json", str(tmp_path / "values.safetensors"))
    assert cli_result.exit_code == 1
    json.loads(cli_result.stdout)  # strict JSON: no NaN literals


def test_negative_variance_and_counter_are_bn005_negative_mean_is_not(tmp_path):
    file = audit_arrays(
        tmp_path,
        {
            "a.running_mean": np.array([-3.0, -1.0], np.float32),
            "a.running_var": np.array([1.0, 2.0], np.float32),
            "a.num_batches_tracked": np.array(100, np.int64),
            "b.running_mean": np.array([0.5, 0.5], np.float32),
            "b.running_var": np.array([1.0, -2.0], np.float32),
            "b.num_batches_tracked": np.array(-7, np.int64),
        },
    )
    assert "BN005" not in codes_for(file, "a")
    (bn005,) = [f for f in file.findings if f.code == "BN005"]
    assert bn005.layer == "b" and bn005.channels == (1,)
    assert "negative" in bn005.message and "-7" in bn005.message


def test_denormal_variance_is_finite_and_near_eps_not_invalid(tmp_path):
    tiny = np.float32(1e-40)  # a float32 denormal
    assert 0 < tiny < np.finfo(np.float32).tiny
    file = audit_arrays(
        tmp_path,
        {
            "bn.running_mean": np.array([tiny, 0.0], np.float32),
            "bn.running_var": np.array([tiny, 2.0], np.float32),
            "bn.num_batches_tracked": np.array(100, np.int64),
        },
    )
    assert "BN005" not in codes_for(file, "bn")
    (bn004,) = [f for f in file.findings if f.code == "BN004"]
    assert bn004.channels == (0,)
    (layer,) = file.layers
    assert layer.max_eval_gain == pytest.approx(1 / np.sqrt(float(tiny) + 1e-5))


def test_zero_channel_layer_does_not_crash_and_is_not_bn002(tmp_path):
    file = audit_arrays(
        tmp_path,
        {
            "bn.running_mean": np.zeros(0, np.float32),
            "bn.running_var": np.zeros(0, np.float32),
            "bn.weight": np.zeros(0, np.float32),
            "bn.num_batches_tracked": np.array(3, np.int64),
        },
    )
    (layer,) = file.layers
    assert layer.num_features == 0 and layer.var_min is None and layer.max_eval_gain is None
    assert "BN002" not in codes_for(file, "bn")
    result = cli("inspect", str(tmp_path / "values.safetensors"))
    assert result.exit_code in (0, 1) and "Traceback" not in result.stdout + result.stderr


def test_one_channel_layer(tmp_path):
    file = audit_arrays(
        tmp_path,
        {
            "bn.running_mean": np.array([0.0], np.float32),
            "bn.running_var": np.array([0.0], np.float32),
            "bn.num_batches_tracked": np.array(1000, np.int64),
        },
    )
    (bn004,) = [f for f in file.findings if f.code == "BN004"]
    assert bn004.channels == (0,) and bn004.severity == "warning"  # gain 1/sqrt(1e-5) = 316 >= 100
    assert file.layers[0].max_eval_gain == pytest.approx(1 / np.sqrt(1e-5))


def test_odd_stat_shapes_and_types_are_not_layers_and_do_not_crash(tmp_path):
    file = audit_arrays(
        tmp_path,
        {
            "two_d.running_mean": np.zeros((3, 1), np.float32),
            "two_d.running_var": np.ones((3, 1), np.float32),
            "scalar.running_mean": np.array(0.0, np.float32),
            "scalar.running_var": np.array(1.0, np.float32),
            "ints.running_mean": np.zeros(3, np.int64),
            "ints.running_var": np.ones(3, np.int64),
            "ok.running_mean": np.array([0.5, 0.1], np.float32),
            "ok.running_var": np.array([1.5, 2.0], np.float32),
            "ok.num_batches_tracked": np.array(1000, np.int64),
        },
    )
    assert [s.name for s in file.layers] == ["ok"]


def test_mismatched_weight_length_is_bn005(tmp_path):
    file = audit_arrays(
        tmp_path,
        {
            "bn.running_mean": np.array([0.5, 0.1, 0.2], np.float32),
            "bn.running_var": np.array([1.5, 2.0, 3.0], np.float32),
            "bn.weight": np.ones(5, np.float32),
            "bn.bias": np.zeros(3, np.float32),
            "bn.num_batches_tracked": np.array(1000, np.int64),
        },
    )
    (bn005,) = [f for f in file.findings if f.code == "BN005"]
    assert "weight has 5 values but the statistics have 3" in bn005.message
    assert file.layers[0].max_eval_gain == pytest.approx(1 / np.sqrt(1.5 + 1e-5))  # gamma ignored, taken as 1


@pytest.mark.parametrize(
    "counter",
    [np.array(3.0, np.float32), np.array([3, 4], np.int64), np.zeros((1, 1, 2), np.int64)],
    ids=["float", "two-elements", "3-d"],
)
def test_odd_counters_are_ignored_not_crashed_on(tmp_path, counter):
    file = audit_arrays(
        tmp_path,
        {
            "bn.running_mean": np.array([0.5, 0.1], np.float32),
            "bn.running_var": np.array([1.5, 2.0], np.float32),
            "bn.num_batches_tracked": counter,
        },
    )
    (layer,) = file.layers
    assert layer.num_batches_tracked is None
    assert "BN003" not in codes_for(file, "bn")


@pytest.mark.slow
def test_ten_thousand_bn_layers(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {}
    dead = {}
    for i in range(10_000):
        var = rng.uniform(0.5, 2.0, 4).astype(np.float32)
        if i % 1000 == 0:
            var[i % 4] = 0.0
            dead[f"block{i}.bn"] = (i % 4,)
        tensors[f"block{i}.bn.running_mean"] = rng.normal(size=4).astype(np.float32)
        tensors[f"block{i}.bn.running_var"] = var
        tensors[f"block{i}.bn.num_batches_tracked"] = np.array(5000, np.int64)
    file = audit_arrays(tmp_path, tensors, "many.safetensors")
    assert len(file.layers) == 10_000
    assert {f.layer: f.channels for f in file.findings if f.code == "BN004"} == dead


def test_markup_and_control_characters_in_names_are_printed_inert(tmp_path):
    evil = "a[/bold][red]x\x1b]0;owned\x07\u202e"
    path = save_st(
        tmp_path / "names.safetensors",
        {
            f"{evil}.running_mean": np.zeros(2, np.float32),
            f"{evil}.running_var": np.ones(2, np.float32),
            "[inf].running_mean": np.array([np.inf, np.inf], np.float32),
            "[inf].running_var": np.ones(2, np.float32),
        },
    )
    result = cli("inspect", str(path))
    assert result.exit_code == 1, result.stdout + result.stderr
    assert "\x1b" not in result.stdout and "\x07" not in result.stdout and "\u202e" not in result.stdout
    assert "a[/bold][red]x\\x1b]0;owned\\x07\\u202e" in result.stdout
    assert "[inf, inf]" in result.stdout  # a mean range that looks like a markup tag

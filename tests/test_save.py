"""save_like: same format and container out, only the BN statistics changed, written atomically."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from bnaudit.errors import BnauditError
from bnaudit.formats import atomic as atomic_mod
from bnaudit.formats.atomic import atomic_write
from bnaudit.formats.provenance import RecalibrationRecord
from bnaudit.formats.read import read_checkpoint
from bnaudit.formats.sniff import sniff_format
from bnaudit.formats.write import save_like

torch.set_num_threads(1)
# torch.jit.script/save/load warn that TorchScript is deprecated; it is still a format users ship
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")
REPO = Path(__file__).resolve().parents[1]


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def state_dict(prefix: str = "") -> OrderedDict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    sd = OrderedDict()
    sd[prefix + "conv.weight"] = torch.randn(4, 2, 3, 3, generator=g)
    sd[prefix + "bn.weight"] = torch.rand(4, generator=g)
    sd[prefix + "bn.bias"] = torch.randn(4, generator=g)
    sd[prefix + "bn.running_mean"] = torch.randn(4, generator=g)
    sd[prefix + "bn.running_var"] = torch.rand(4, generator=g) + 0.5
    sd[prefix + "bn.num_batches_tracked"] = torch.tensor(7)
    sd[prefix + "bn2.running_mean"] = torch.randn(3, generator=g).to(torch.bfloat16)
    sd[prefix + "bn2.running_var"] = (torch.rand(3, generator=g) + 0.5).to(torch.bfloat16)
    sd[prefix + "bn2.num_batches_tracked"] = torch.tensor(2)
    sd[prefix + "fc.weight"] = torch.randn(5, 4, generator=g).half()
    return sd


NEW = {
    "bn.running_mean": torch.tensor([0.5, -1.25, 2.0, 3.0], dtype=torch.float64),
    "bn.running_var": torch.tensor([1.5, 0.25, 4.0, 9.0], dtype=torch.float64),
    "bn.num_batches_tracked": torch.tensor(11),
    "bn2.running_var": torch.tensor([2.0, 3.0, 0.5], dtype=torch.float64),
}


# a record as recalibrate writes it (a non-ASCII data description included)
RECORD = RecalibrationRecord(
    method="exact",
    samples=90,
    batches=2,
    batch_size=64,
    seed=0,
    shuffle=True,
    data="calibration data é",
    world_size=1,
    recalibrated_layers=("bn", "bn2"),
    digests={"bn": "0" * 64, "bn2": "1" * 64},
    bnaudit_version="0.1.0",
    date="2026-12-02",
)


# ----------------------------------------------------------------------------- safetensors


def test_safetensors_out_changes_only_the_updated_bytes_and_keeps_metadata(tmp_path: Path) -> None:
    src, out = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    sd = state_dict("module.")
    save_file(sd, str(src), metadata={"format": "pt", "origin": "unit test"})
    digest = sha(src)
    ckpt = read_checkpoint(str(src))
    assert ckpt.prefix == "module."
    save_like(ckpt, NEW, str(out), provenance=RECORD)
    assert sha(src) == digest  # the input is untouched

    # the data section is the input's, with exactly the updated slices replaced
    def sections(path: Path) -> tuple[dict, bytes]:
        data = path.read_bytes()
        n = int.from_bytes(data[:8], "little")
        return json.loads(data[8 : 8 + n]), data[8 + n :]

    header_in, data_in = sections(src)
    header_out, data_out = sections(out)
    expected = bytearray(data_in)
    for name, value in NEW.items():
        full = "module." + name
        begin, end = header_in[full]["data_offsets"]
        expected[begin:end] = raw(value.to(sd[full].dtype))
    assert data_out == bytes(expected)
    assert {k: v for k, v in header_out.items() if k != "__metadata__"} == {
        k: v for k, v in header_in.items() if k != "__metadata__"
    }

    loaded = load_file(str(out))
    assert list(loaded) == list(load_file(str(src)))
    for name, tensor in sd.items():
        short = name.removeprefix("module.")
        want = NEW[short].to(tensor.dtype) if short in NEW else tensor
        assert loaded[name].dtype == tensor.dtype and raw(loaded[name]) == raw(want), name
    with safe_open(str(out), "pt") as f:
        metadata = f.metadata()
    assert metadata["format"] == "pt" and metadata["origin"] == "unit test"
    assert json.loads(metadata["bnaudit"]) == RECORD.as_dict()
    assert RecalibrationRecord.from_metadata(metadata) == RECORD  # written and read by the same record


def _expected(sd: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """`sd` with NEW applied (cast to the stored dtypes), each tensor a copy of its own."""
    out = {}
    for name, tensor in sd.items():
        short = name.removeprefix(prefix)
        out[name] = (NEW[short].to(tensor.dtype) if short in NEW else tensor).clone()
    return out


def assert_same_safetensors(ours: bytes, theirs: bytes) -> None:
    """`ours` is the file `theirs` is, byte for byte but for the order of the `__metadata__`
    entries: the package keeps metadata in a hash map whose order varies from call to call
    (and writes every header with the same compact JSON, so equal parses and equal lengths
    leave nothing else to differ)."""

    def parts(blob: bytes) -> tuple[int, list, bytes]:
        n = int.from_bytes(blob[:8], "little")
        header = json.loads(blob[8 : 8 + n], object_pairs_hook=list)
        header = [(k, sorted(v) if k == "__metadata__" else v) for k, v in header]
        return n, header, blob[8 + n :]

    assert len(ours) == len(theirs) and parts(ours) == parts(theirs)


def test_safetensors_out_from_a_torch_file_is_what_the_package_writes(tmp_path: Path) -> None:
    from safetensors.torch import save

    src, out = tmp_path / "in.pt", tmp_path / "out.safetensors"
    sd = state_dict()
    sd["fc.tied"] = sd["fc.weight"]  # tied: one storage, two names (the package alone refuses these)
    torch.save(sd, src)
    save_like(read_checkpoint(str(src)), NEW, str(out), provenance=RECORD)
    record = json.dumps(RECORD.as_dict(), sort_keys=True)
    assert_same_safetensors(out.read_bytes(), save(_expected(sd), metadata={"format": "pt", "bnaudit": record}))


def test_safetensors_out_from_a_hand_made_safetensors_file_is_what_the_package_writes(tmp_path: Path) -> None:
    # a file another writer made: tensors in name order, no alignment padding, metadata last;
    # the output is the package's layout of the same tensors, the metadata kept
    from safetensors.torch import save

    src, out = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    sd = state_dict("module.")
    header, data = {}, b""
    for name in sorted(sd):
        header[name] = {
            "dtype": {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64"}[
                sd[name].dtype
            ],
            "shape": list(sd[name].shape),
            "data_offsets": [len(data), len(data) + len(raw(sd[name]))],
        }
        data += raw(sd[name])
    header["__metadata__"] = {"origin": "by hand"}
    text = json.dumps(header).encode()
    src.write_bytes(len(text).to_bytes(8, "little") + text + data)
    save_like(read_checkpoint(str(src)), NEW, str(out), provenance=RECORD)
    metadata = {"origin": "by hand", "bnaudit": json.dumps(RECORD.as_dict(), sort_keys=True)}
    assert_same_safetensors(out.read_bytes(), save(_expected(sd, "module."), metadata=metadata))


# ----------------------------------------------------------------------------- torch containers


def test_container_keeps_every_other_key_and_only_the_chosen_state_dict_changes(tmp_path: Path) -> None:
    src, out = tmp_path / "ckpt.pth", tmp_path / "out.pth"
    model_sd, ema_sd = state_dict("module."), state_dict("module.")
    optimizer = {
        "state": {0: {"momentum_buffer": torch.randn(4, 2, 3, 3)}},
        "param_groups": [{"lr": 0.1, "params": [0]}],
    }
    container = {
        "model": model_sd,
        "model_ema": ema_sd,
        "optimizer": optimizer,
        "epoch": 3,
        "args": argparse.Namespace(lr=0.1, arch="net"),
    }
    torch.save(container, src)
    digest = sha(src)
    ckpt = read_checkpoint(str(src))
    assert (ckpt.key, ckpt.prefix) == ("model", "module.")
    save_like(ckpt, NEW, str(out))
    assert sha(src) == digest
    assert sniff_format(str(out)) == "torch-zip"

    loaded = torch.load(out, weights_only=False)
    assert list(loaded) == list(container)
    assert loaded["epoch"] == 3 and loaded["args"] == container["args"]
    assert torch.equal(loaded["optimizer"]["state"][0]["momentum_buffer"], optimizer["state"][0]["momentum_buffer"])
    assert loaded["optimizer"]["param_groups"] == optimizer["param_groups"]
    for name, tensor in ema_sd.items():  # the EMA copy is a different state dict: untouched
        assert raw(loaded["model_ema"][name]) == raw(tensor)
    assert list(loaded["model"]) == list(model_sd)  # no new keys, same order
    for name, tensor in model_sd.items():
        short = name.removeprefix("module.")
        want = NEW[short].to(tensor.dtype) if short in NEW else tensor
        got = loaded["model"][name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape and raw(got) == raw(want), name


def test_the_key_chosen_by_the_user_is_the_one_written(tmp_path: Path) -> None:
    src, out = tmp_path / "ckpt.pth", tmp_path / "out.pth"
    torch.save({"state_dict": state_dict(), "state_dict_ema": state_dict()}, src)
    ckpt = read_checkpoint(str(src), key="state_dict_ema")
    save_like(ckpt, NEW, str(out))
    loaded = torch.load(out, weights_only=True)
    assert torch.equal(loaded["state_dict_ema"]["bn.running_var"], NEW["bn.running_var"].float())
    assert torch.equal(loaded["state_dict"]["bn.running_var"], state_dict()["bn.running_var"])


def test_bare_state_dict_still_loads_strictly_with_its_metadata(tmp_path: Path) -> None:
    src, out = tmp_path / "sd.pt", tmp_path / "out.pt"
    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4))
    torch.save(model.state_dict(), src)
    save_like(read_checkpoint(str(src)), {"1.running_var": torch.full((4,), 2.0)}, str(out))
    loaded = torch.load(out, weights_only=True)
    assert list(loaded) == list(model.state_dict())
    assert loaded._metadata == model.state_dict()._metadata
    fresh = nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4))
    fresh.load_state_dict(loaded, strict=True)
    assert torch.equal(fresh[1].running_var, torch.full((4,), 2.0))


def test_legacy_format_in_gives_legacy_format_out(tmp_path: Path) -> None:
    src, out = tmp_path / "old.pt", tmp_path / "out.pt"
    torch.save(state_dict(), src, _use_new_zipfile_serialization=False)
    ckpt = read_checkpoint(str(src))
    assert ckpt.format == "torch-legacy"
    save_like(ckpt, NEW, str(out))
    assert sniff_format(str(out)) == "torch-legacy"
    assert torch.equal(torch.load(out, weights_only=True)["bn.running_mean"], NEW["bn.running_mean"].float())


def test_pickled_module_gets_its_buffers_set(tmp_path: Path) -> None:
    src, out = tmp_path / "whole.pt", tmp_path / "out.pt"
    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4))
    torch.save({"model": model, "epoch": 1}, src)
    save_like(read_checkpoint(str(src)), {"1.running_mean": torch.arange(4.0)}, str(out))
    loaded = torch.load(out, weights_only=False)
    assert isinstance(loaded["model"], nn.Sequential) and loaded["epoch"] == 1
    assert torch.equal(loaded["model"][1].running_mean, torch.arange(4.0))
    assert torch.equal(loaded["model"][0].weight, model[0].weight)


# ----------------------------------------------------------------------------- TorchScript


def test_torchscript_in_gives_torchscript_out_with_extra_files(tmp_path: Path) -> None:
    src, out = tmp_path / "net.pt", tmp_path / "out.pt"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).eval()
    torch.jit.save(torch.jit.script(model), str(src), _extra_files={"notes.txt": b"keep me"})
    ckpt = read_checkpoint(str(src))
    assert ckpt.format == "torchscript"
    save_like(
        ckpt,
        {
            "1.running_mean": torch.ones(4),
            "1.running_var": torch.full((4,), 4.0),
            "1.num_batches_tracked": torch.tensor(9),
        },
        str(out),
    )
    assert sniff_format(str(out)) == "torchscript"
    extra = {"notes.txt": b""}
    loaded = torch.jit.load(str(out), _extra_files=extra)
    assert extra["notes.txt"] == b"keep me"
    buffers = dict(loaded.named_buffers())
    assert torch.equal(buffers["1.running_var"], torch.full((4,), 4.0))
    assert buffers["1.num_batches_tracked"].item() == 9
    for name, p in model.named_parameters():
        assert raw(dict(loaded.named_parameters())[name]) == raw(p.detach())
    # it still runs, and computes with the new statistics
    x = torch.randn(2, 2, 5, 5)
    model[1].running_mean.fill_(1.0)
    model[1].running_var.fill_(4.0)
    assert torch.allclose(loaded(x), model(x))


# ----------------------------------------------------------------------------- refusals


def test_non_finite_statistics_are_refused_naming_the_layer(tmp_path: Path) -> None:
    src = tmp_path / "in.safetensors"
    save_file(state_dict(), str(src))
    with pytest.raises(BnauditError, match="layer bn: refusing to write a non-finite running_var"):
        save_like(
            read_checkpoint(str(src)),
            {"bn.running_var": torch.tensor([1.0, float("nan"), 1.0, 1.0])},
            str(tmp_path / "out.safetensors"),
        )
    with pytest.raises(BnauditError, match="layer bn2: refusing to write a non-finite running_var"):
        # finite in float64, infinite once cast to the stored bfloat16
        save_like(
            read_checkpoint(str(src)),
            {"bn2.running_var": torch.tensor([1e39, 1.0, 1.0], dtype=torch.float64)},
            str(tmp_path / "out.safetensors"),
        )
    assert sorted(os.listdir(tmp_path)) == ["in.safetensors"]


def test_only_running_statistics_may_be_written(tmp_path: Path) -> None:
    src = tmp_path / "in.safetensors"
    save_file(state_dict(), str(src))
    with pytest.raises(ValueError, match="only writes"):
        save_like(read_checkpoint(str(src)), {"bn.weight": torch.ones(4)}, str(tmp_path / "o.safetensors"))
    with pytest.raises(ValueError, match="differs from stored"):
        save_like(read_checkpoint(str(src)), {"bn.running_var": torch.ones(5)}, str(tmp_path / "o.safetensors"))


def test_existing_output_is_refused_without_force_and_replaced_with_it(tmp_path: Path) -> None:
    src, out = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    save_file(state_dict(), str(src))
    out.write_bytes(b"precious")
    with pytest.raises(BnauditError, match="already exists .*--force"):
        save_like(read_checkpoint(str(src)), NEW, str(out))
    assert out.read_bytes() == b"precious"
    save_like(read_checkpoint(str(src)), NEW, str(out), force=True)
    assert torch.equal(load_file(str(out))["bn.running_var"], NEW["bn.running_var"].float())
    assert sorted(os.listdir(tmp_path)) == ["in.safetensors", "out.safetensors"]


def test_the_input_is_never_the_output_even_with_force(tmp_path: Path) -> None:
    src = tmp_path / "in.safetensors"
    save_file(state_dict(), str(src))
    digest = sha(src)
    with pytest.raises(BnauditError, match="is the input checkpoint"):
        save_like(read_checkpoint(str(src)), NEW, str(src), force=True)
    assert sha(src) == digest


def test_missing_folder_is_a_clear_error(tmp_path: Path) -> None:
    src = tmp_path / "in.safetensors"
    save_file(state_dict(), str(src))
    with pytest.raises(BnauditError, match="does not exist"):
        save_like(read_checkpoint(str(src)), NEW, str(tmp_path / "nowhere" / "out.safetensors"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_folder_is_a_clear_error(tmp_path: Path) -> None:
    target = tmp_path / "ro"
    target.mkdir()
    target.chmod(0o500)
    try:
        with pytest.raises(BnauditError, match="cannot write"):
            atomic_write(str(target / "out.bin"), lambda f: f.write(b"x"))
    finally:
        target.chmod(0o700)


@pytest.mark.parametrize("mode", ["unnamed", "unnamed-copied", "named"])
def test_interrupted_write_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    if mode == "named":
        monkeypatch.setattr(atomic_mod, "_open_unnamed", lambda _d: None)
    if mode == "unnamed-copied":
        monkeypatch.setattr(atomic_mod, "_link_fd", lambda _fd, _t: False)

    def half_then_ctrl_c(f) -> None:
        f.write(b"x" * 1000)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(str(tmp_path / "out.bin"), half_then_ctrl_c)
    assert os.listdir(tmp_path) == []
    # and the same path completes normally, in each mode
    atomic_write(str(tmp_path / "out.bin"), lambda f: f.write(b"whole"))
    assert (tmp_path / "out.bin").read_bytes() == b"whole"
    assert os.listdir(tmp_path) == ["out.bin"]
    with pytest.raises(BnauditError, match="already exists"):
        atomic_write(str(tmp_path / "out.bin"), lambda f: f.write(b"again"))
    atomic_write(str(tmp_path / "out.bin"), lambda f: f.write(b"forced"), force=True)
    assert (tmp_path / "out.bin").read_bytes() == b"forced" and os.listdir(tmp_path) == ["out.bin"]


@pytest.mark.slow
def test_killed_writer_leaves_no_file(tmp_path: Path) -> None:
    out, started = tmp_path / "out" / "model.pt", tmp_path / "started"
    out.parent.mkdir()
    script = textwrap.dedent(f"""
        import time
        from bnaudit.formats.atomic import atomic_write
        def slow(f):
            f.write(b"x" * 4096)
            f.flush()
            open({str(started)!r}, "w").close()
            time.sleep(60)
        atomic_write({str(out)!r}, slow)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO)
    try:
        deadline = time.monotonic() + 60
        while not started.exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert os.listdir(out.parent) == []


def _dead_pid() -> int:
    """The PID of a process that has exited (a PID is not handed out again this soon)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_what_a_killed_write_left_is_removed_by_the_next_write_of_that_output(tmp_path: Path) -> None:
    """SIGKILL runs no cleanup: the hidden temporaries of a dead writer stay until the next
    write of the same output removes them. Only those: not a live process's, not another
    output's, not a `.old` folder (a previous output renamed aside), not a link's target."""
    dead, live = _dead_pid(), os.getpid()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.bin").write_bytes(b"not ours")
    folder = tmp_path / "target"
    folder.mkdir()
    stale_file = folder / f".out.safetensors.bnaudit-{dead}-1a2b3c4d.tmp"
    stale_file.write_bytes(b"half a checkpoint")
    stale_folder = folder / f".shards.bnaudit-{dead}-k2j4_x9q.tmp"
    stale_folder.mkdir()
    (stale_folder / "model-00001-of-00002.safetensors").write_bytes(b"half a shard")
    stale_link = folder / f".shards.bnaudit-{dead}-linked00.tmp"
    stale_link.symlink_to(outside)
    kept = [
        f".shards.bnaudit-{dead}-k2j4_x9q.old",  # the previous output, renamed aside
        f".out.safetensors.bnaudit-{live}-5e6f7a8b.tmp",  # a writer still running
        f".other.bnaudit-{dead}-1a2b3c4d.tmp",  # another output's
        ".out.safetensors.bnaudit-x1-1a2b3c4d.tmp",  # not a PID
        f"out.safetensors.bnaudit-{dead}-1a2b3c4d.tmp",  # not hidden: not a name bnaudit writes
    ]
    for name in kept:
        (folder / name).write_bytes(b"keep")

    atomic_write(str(folder / "out.safetensors"), lambda f: f.write(b"new"))
    assert not stale_file.exists()
    assert (folder / "out.safetensors").read_bytes() == b"new"
    assert stale_folder.exists() and stale_link.is_symlink()  # the folder output's: not yet

    atomic_mod.atomic_folder(str(folder / "shards"), lambda temp: Path(temp, "index.json").write_text("{}"))
    assert not stale_folder.exists() and not stale_link.is_symlink()
    assert (outside / "keep.bin").read_bytes() == b"not ours"  # the link went, not what it named
    assert sorted(os.listdir(folder)) == sorted([*kept, "out.safetensors", "shards"])
    assert atomic_mod.remove_stale_temporaries(str(folder), "out.safetensors") == []


def test_a_record_read_back_is_typed_or_none():
    good = RECORD.as_dict()
    assert good["layers"] == 2  # written for readers, ignored when read back
    assert RecalibrationRecord.from_metadata({"bnaudit": RECORD.to_json()}) == RECORD
    for name, wrong in [("method", 3), ("samples", "90"), ("samples", True), ("shuffle", 1), ("date", None)]:
        forged = json.dumps({**good, name: wrong})
        assert RecalibrationRecord.from_metadata({"bnaudit": forged}) is None, name
    for layers in ["bn", ["bn", 1], None]:
        assert (
            RecalibrationRecord.from_metadata({"bnaudit": json.dumps({**good, "recalibrated_layers": layers})}) is None
        )
    unbound = RecalibrationRecord.from_metadata({"bnaudit": json.dumps({**good, "digests": ["x"]})})
    assert unbound is not None and unbound.digests == {}  # claims layers, binds none
    for raw in ["", "[1]", "{", "x" * 10_000_001]:
        assert RecalibrationRecord.from_metadata({"bnaudit": raw}) is None

"""Output format follows the output name (issue #12): `recalibrate -o x.safetensors` from a
torch file writes a real safetensors file, the reverse a torch zip; what safetensors cannot
hold is refused before any work; an unknown extension keeps the input's format."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from conftest import SAMPLES
from test_repaired_audit import ARCH, CALIB, LAYERS, bn003_bn010, digits_net, immature_input

import bnaudit.runtime.recalibrate.command as command
from bnaudit.formats.sniff import sniff_format


def run(cli, source: Path, out: Path, *extra: str):
    arch = [] if "torchscript" in source.name else ["--arch", ARCH]
    return cli(
        "recalibrate",
        str(source),
        *arch,
        "--data",
        CALIB,
        "--batch-size",
        "32",
        "--num-samples",
        "64",
        "-o",
        str(out),
        "-q",
        *extra,
    )


def header_of(path: Path) -> tuple[dict, int]:
    """The safetensors header as stored, parsed by hand, and where the data begins."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), 8 + n


@pytest.mark.parametrize("fmt", ["zip", "legacy", "torchscript"])
def test_torch_input_to_safetensors_name_writes_a_real_safetensors_file(cli, tmp_path, fmt):
    from safetensors import safe_open
    from safetensors.torch import load_file

    source = immature_input(tmp_path, fmt)
    out = tmp_path / "out.safetensors"
    result = run(cli, source, out)
    assert result.exit_code == 0, result.output
    assert sniff_format(str(out)) == "safetensors"

    header, data_start = header_of(out)
    assert (data_start - 8) % 8 == 0  # data section aligned as safetensors writes it
    loaded = load_file(str(out))  # the safetensors library is the oracle
    if fmt == "torchscript":
        expected = torch.jit.load(str(source)).state_dict()
    else:
        expected = torch.load(source, weights_only=True)
    assert sorted(loaded) == sorted(expected)
    for name, tensor in expected.items():
        assert loaded[name].dtype == tensor.dtype and loaded[name].shape == tensor.shape, name
        if not name.split(".")[-1].startswith(("running_", "num_batches")):
            assert torch.equal(loaded[name], tensor), name  # untouched tensors, bit for bit
    assert [int(loaded[f"{layer}.num_batches_tracked"]) for layer in LAYERS] == [2, 2, 2]
    with safe_open(str(out), "pt") as f:
        metadata = f.metadata()
    assert metadata["format"] == "pt"
    assert json.loads(metadata["bnaudit"])["recalibrated_layers"] == LAYERS
    # the file's bytes are exactly header + each tensor's little-endian bytes at its offsets
    raw = out.read_bytes()
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        want = loaded[name].reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
        assert raw[data_start + begin : data_start + end] == want, name
    assert bn003_bn010(out) == []
    digits_net().load_state_dict(loaded, strict=True)


def test_safetensors_input_to_torch_name_writes_a_torch_zip(cli, tmp_path):
    from safetensors.torch import load_file

    source = immature_input(tmp_path, "safetensors")
    out = tmp_path / "out.pt"
    assert run(cli, source, out).exit_code == 0
    assert sniff_format(str(out)) == "torch-zip"
    loaded = torch.load(out, weights_only=True)  # torch is the oracle
    original = load_file(str(source))
    assert list(loaded) == list(original)
    for name, tensor in original.items():
        if not name.split(".")[-1].startswith(("running_", "num_batches")):
            assert torch.equal(loaded[name], tensor), name
    digits_net().load_state_dict(loaded, strict=True)
    assert json.loads(loaded._metadata[""]["bnaudit"])["batches"] == 2
    assert bn003_bn010(out) == []


def test_container_that_safetensors_cannot_hold_is_refused_before_any_work(cli, tmp_path, monkeypatch):
    state = torch.load(Path(SAMPLES) / "immature.pt", weights_only=True)
    source = tmp_path / "container.pt"
    opt = torch.optim.AdamW(digits_net().parameters())
    torch.save({"state_dict": state, "epoch": 7, "optimizer": opt.state_dict()}, source)

    def no_work(*args, **kwargs):
        raise AssertionError("calibration data was opened")

    monkeypatch.setattr(command, "make_loader", no_work)
    out = tmp_path / "out.safetensors"
    result = run(cli, source, out)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.output
    assert lines[0].startswith(f"bnaudit: error: {out}: a safetensors file holds named tensors only")
    assert "'epoch'" in lines[0] and "'optimizer'" in lines[0] and "'state_dict'" not in lines[0]
    assert not out.exists()


def test_state_dict_with_a_non_tensor_entry_is_refused_naming_it(cli, tmp_path, monkeypatch):
    state = torch.load(Path(SAMPLES) / "immature.pt", weights_only=True)
    state["head.2.note"] = [1, 2]  # a list in the state dict: no safetensors equivalent
    source = tmp_path / "sd.pt"
    torch.save(state, source)
    monkeypatch.setattr(command, "make_loader", lambda *a, **k: pytest.fail("calibration data was opened"))
    result = run(cli, source, tmp_path / "out.safetensors")
    assert result.exit_code == 2
    assert "'head.2.note'" in result.stderr and "epoch" not in result.stderr


@pytest.mark.parametrize("fmt", ["zip", "legacy", "safetensors"])
def test_unknown_extension_keeps_the_input_format(cli, tmp_path, fmt):
    source = immature_input(tmp_path, fmt)
    out = tmp_path / "out.weights"
    assert run(cli, source, out).exit_code == 0
    assert sniff_format(str(out)) == sniff_format(str(source))
    assert bn003_bn010(out) == []


def test_torchscript_to_a_torch_name_stays_torchscript(cli, tmp_path):
    source = immature_input(tmp_path, "torchscript")
    out = tmp_path / "out.pt"
    assert run(cli, source, out).exit_code == 0
    assert sniff_format(str(out)) == "torchscript"

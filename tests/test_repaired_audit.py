"""Repaired files pass their own audit, in every format (issue #12).

`recalibrate` on sample_models/immature.pt (counters at 3: BN003 on every layer) with one
or two calibration batches leaves counters of 1 or 2, which BN003 would read as 90% or
81% initial weight; the record the output carries says those layers hold population
statistics, and it must survive in every format and through a user's torch.load +
torch.save, without adding a state-dict key.
"""

from __future__ import annotations

import collections
import importlib.util
import io
import json
from pathlib import Path

import pytest
import torch
from conftest import SAMPLES

from bnaudit import inspect
from bnaudit.formats.provenance import statistics_digest
from bnaudit.formats.read import read_checkpoint

ARCH = f"{SAMPLES}/digits_net.py:digits_net"
CALIB = f"{SAMPLES}/data/digits_calib.safetensors"
LAYERS = ["features.1", "features.4", "head.2"]


def digits_net() -> torch.nn.Module:
    spec = importlib.util.spec_from_file_location("digits_net_for_tests", f"{SAMPLES}/digits_net.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.digits_net()


def immature_input(tmp_path: Path, fmt: str) -> Path:
    state = torch.load(Path(SAMPLES) / "immature.pt", weights_only=True)
    if fmt == "zip":
        path = tmp_path / "in.pt"
        torch.save(state, path)
    elif fmt == "legacy":
        path = tmp_path / "in.pth"
        torch.save(state, path, _use_new_zipfile_serialization=False)
    elif fmt == "safetensors":
        from safetensors.torch import save_file

        path = tmp_path / "in.safetensors"
        save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    else:
        model = digits_net()
        model.load_state_dict(state)
        path = tmp_path / "in.torchscript.pt"
        torch.jit.save(torch.jit.script(model), str(path))
    return path


def recalibrate(cli, source: Path, out: Path, batches: int, *extra: str) -> None:
    arch = [] if "torchscript" in source.name else ["--arch", ARCH]
    result = cli(
        "recalibrate",
        str(source),
        *arch,
        "--data",
        CALIB,
        "--batch-size",
        "32",
        "--num-samples",
        str(32 * batches),
        "-o",
        str(out),
        "-q",
        *extra,
    )
    assert result.exit_code == 0, result.output


def bn003_bn010(path: Path) -> list[tuple[str, str | None]]:
    (file,) = inspect(str(path)).files
    assert file.error is None, file.error
    return [(f.code, f.layer) for f in file.findings if f.code in ("BN003", "BN010")]


@pytest.mark.parametrize("batches", [1, 2])
@pytest.mark.parametrize("fmt", ["zip", "legacy", "torchscript", "safetensors"])
def test_recalibrated_output_raises_no_bn003_or_bn010(cli, tmp_path, fmt, batches):
    source = immature_input(tmp_path, fmt)
    assert sorted(layer for code, layer in bn003_bn010(source) if code == "BN003") == LAYERS
    out = tmp_path / f"out{''.join(source.suffixes)}"
    recalibrate(cli, source, out, batches)

    assert bn003_bn010(out) == []
    (file,) = inspect(str(out)).files
    assert file.provenance.startswith("statistics of 3 layers re-estimated by bnaudit recalibrate (method exact,")
    ckpt = read_checkpoint(str(out))
    assert [ckpt.tensors[f"{layer}.num_batches_tracked"].read() for layer in LAYERS] == [[batches]] * 3
    record = json.loads(ckpt.metadata["bnaudit"])
    assert record["recalibrated_layers"] == LAYERS and record["batches"] == batches
    for layer in LAYERS:  # the digest is of the bytes as stored, recomputed here from torch's values
        mean, var = ckpt.tensors[f"{layer}.running_mean"], ckpt.tensors[f"{layer}.running_var"]
        expected = statistics_digest(mean.to_torch().double().tolist(), var.to_torch().double().tolist())
        assert record["digests"][layer] == expected


@pytest.mark.parametrize("fmt", ["zip", "legacy"])
def test_torch_output_keeps_its_keys_and_the_record_survives_a_users_round_trip(cli, tmp_path, fmt):
    model = digits_net()
    model.load_state_dict(torch.load(Path(SAMPLES) / "immature.pt", weights_only=True))
    source = tmp_path / "in.pt"
    torch.save(model.state_dict(), source, _use_new_zipfile_serialization=fmt == "zip")  # with torch's _metadata
    out = tmp_path / "out.pt"
    recalibrate(cli, source, out, 1)
    before = torch.load(source, weights_only=True)
    after = torch.load(out, weights_only=True)
    assert list(after) == list(before)  # no new state-dict key
    digits_net().load_state_dict(after, strict=True)
    assert json.loads(after._metadata[""]["bnaudit"])["recalibrated_layers"] == LAYERS
    # torch's module versions are kept; the root entry gains the record and nothing else
    assert {k: v for k, v in after._metadata.items() if k} == {k: v for k, v in before._metadata.items() if k}
    assert {k: v for k, v in after._metadata[""].items() if k != "bnaudit"} == before._metadata[""]
    assert after._metadata["features.1"] == {"version": 2}

    # the user loads and saves again (torch's defaults): the record is still there and honoured
    again = tmp_path / "again.pt"
    torch.save(torch.load(out, weights_only=True), again)
    assert bn003_bn010(again) == []

    # the user trains one more step in train mode: counters and statistics move, the record
    # no longer matches them, and BN003 speaks again
    model = digits_net()
    model.load_state_dict(after)
    model.train()
    with torch.no_grad():
        model(torch.randn(8, 1, 8, 8))
    trained = model.state_dict()
    trained._metadata = after._metadata
    moved = tmp_path / "moved.pt"
    torch.save(trained, moved)
    assert sorted(layer for code, layer in bn003_bn010(moved) if code == "BN003") == LAYERS
    assert "does not match" in inspect(str(moved)).files[0].provenance


def test_container_output_keeps_the_record_in_the_chosen_state_dict(cli, tmp_path):
    state = torch.load(Path(SAMPLES) / "immature.pt", weights_only=True)
    source = tmp_path / "container.ckpt"
    torch.save({"epoch": 3, "state_dict": {f"model.{k}": v for k, v in state.items()}}, source)
    out = tmp_path / "out.ckpt"
    recalibrate(cli, source, out, 1)
    loaded = torch.load(out, weights_only=True)
    assert list(loaded) == ["epoch", "state_dict"]
    assert list(loaded["state_dict"]) == [f"model.{k}" for k in state]
    assert bn003_bn010(out) == []


@pytest.mark.parametrize(
    "forge",
    ["copied", "no-digests", "not json", "[1, 2]", '{"recalibrated_layers": [1, null]}'],
)
def test_forged_record_changes_nothing_but_the_note(cli, tmp_path, forge):
    source = immature_input(tmp_path, "zip")
    out = tmp_path / "out.pt"
    recalibrate(cli, source, out, 1)
    real = json.loads(torch.load(out, weights_only=True)._metadata[""]["bnaudit"])
    if forge == "copied":  # a real record, put on statistics it was not written for
        raw = json.dumps(real)
    elif forge == "no-digests":
        raw = json.dumps({k: v for k, v in real.items() if k != "digests"})
    else:
        raw = forge
    state = collections.OrderedDict(torch.load(source, weights_only=True))
    state._metadata = collections.OrderedDict({"": {"bnaudit": raw}})
    forged = tmp_path / "forged.pt"
    torch.save(state, forged)
    assert bn003_bn010(forged) == bn003_bn010(source)
    (file,) = inspect(str(forged)).files
    if forge in ("copied", "no-digests"):
        assert "names 3 layers whose statistics it does not match" in file.provenance
    else:
        assert file.provenance == ""


def test_torchscript_record_is_an_extra_file_that_loading_ignores(cli, tmp_path):
    source = immature_input(tmp_path, "torchscript")
    out = tmp_path / "out.torchscript.pt"
    recalibrate(cli, source, out, 2)
    extra = {"bnaudit.json": ""}
    module = torch.jit.load(str(out), _extra_files=extra)
    assert json.loads(extra["bnaudit.json"])["recalibrated_layers"] == LAYERS
    buffer = io.BytesIO()
    torch.jit.save(module, buffer)  # a user's plain save drops extra files: then BN003 applies again
    plain = tmp_path / "plain.pt"
    plain.write_bytes(buffer.getvalue())
    assert sorted(layer for code, layer in bn003_bn010(plain) if code == "BN003") == LAYERS


def test_pickled_whole_module_carries_the_record_as_an_attribute(cli, tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3, padding=1),
        torch.nn.BatchNorm2d(4),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(256, 10),
    )
    with torch.no_grad():
        model[1].running_mean.copy_(torch.randn(4))
        model[1].running_var.copy_(0.5 + torch.rand(4))
        model[1].num_batches_tracked.fill_(3)
    source = tmp_path / "whole.pt"
    torch.save({"model": model, "epoch": 3}, source)
    assert bn003_bn010(source) == [("BN003", "1")]
    out = tmp_path / "out.pt"
    result = cli(
        "recalibrate", str(source), "--data", CALIB, "--batch-size", "32", "--num-samples", "32", "-o", str(out)
    )
    assert result.exit_code == 0, result.output
    assert bn003_bn010(out) == []
    (file,) = inspect(str(out)).files
    assert file.provenance.startswith("statistics of 1 layer re-estimated")
    loaded = torch.load(out, weights_only=False)
    assert json.loads(loaded["model"].bnaudit_recalibration)["recalibrated_layers"] == ["1"]
    assert list(loaded) == ["model", "epoch"]

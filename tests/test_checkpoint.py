"""Formats sniffed from bytes, the containers training frameworks save, prefixes, EMA, lazy reads."""

from __future__ import annotations

import argparse
import os
import zipfile

import numpy as np
import pytest
import torch
from conftest import bn_entries, save_safetensors, save_torch
from torch import nn

from bnaudit.errors import BnauditError
from bnaudit.formats.read import read_checkpoint
from bnaudit.formats.sniff import sniff_format


def small_state(prefix: str = "") -> dict[str, torch.Tensor]:
    state = {f"{prefix}conv.weight": torch.randn(4, 3, 3, 3)}
    state.update(bn_entries(f"{prefix}bn1", 4))
    return state


# ----------------------------------------------------------------------------- formats


def test_format_is_sniffed_from_bytes_not_extension(tmp_path):
    state = small_state()
    zip_path = save_torch(state, tmp_path / "weights.safetensors")  # a lie of an extension
    legacy = tmp_path / "legacy.bin"
    torch.save(state, legacy, _use_new_zipfile_serialization=False)
    st_path = save_safetensors(state, tmp_path / "model.pt")
    scripted = tmp_path / "scripted.ckpt"
    torch.jit.save(torch.jit.script(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))), str(scripted))
    assert sniff_format(zip_path) == "torch-zip"
    assert sniff_format(str(legacy)) == "torch-legacy"
    assert sniff_format(st_path) == "safetensors"
    assert sniff_format(str(scripted)) == "torchscript"


@pytest.mark.parametrize("fmt", ["torch-zip", "torch-legacy", "safetensors"])
def test_every_format_yields_the_same_tensors(tmp_path, fmt):
    state = small_state()
    path = tmp_path / "m"
    if fmt == "torch-zip":
        save_torch(state, path)
    elif fmt == "torch-legacy":
        torch.save(state, path, _use_new_zipfile_serialization=False)
    else:
        save_safetensors(state, path)
    ckpt = read_checkpoint(str(path))
    assert ckpt.format == fmt
    assert set(ckpt.tensors) == set(state)
    for name, tensor in state.items():
        assert ckpt.tensors[name].read() == tensor.reshape(-1).tolist()
        assert ckpt.tensors[name].shape == tuple(tensor.shape)
        loaded = ckpt.tensors[name].to_torch()
        assert loaded.dtype == tensor.dtype and torch.equal(loaded, tensor)


def test_torchscript_archive_read_without_loading_gives_real_eps_and_momentum(tmp_path, monkeypatch):
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, eps=1e-3, momentum=0.01))
    model.train()
    model(torch.randn(8, 3, 6, 6))
    path = tmp_path / "ts.pt"
    torch.jit.save(torch.jit.script(model), str(path))
    monkeypatch.setattr(torch.jit, "load", lambda *a, **k: pytest.fail("inspect must not run TorchScript"))
    ckpt = read_checkpoint(str(path))
    np.testing.assert_array_equal(ckpt.tensors["1.running_var"].read(), model[1].running_var.numpy())
    assert ckpt.modules["1"].eps == 1e-3 and ckpt.modules["1"].momentum == 0.01
    assert ckpt.modules["1"].class_name == "BatchNorm2d"


def test_bfloat16_safetensors_decoded_exactly_without_torch(tmp_path):
    values = torch.tensor([1.0, 0.5, 3.140625, -2.0], dtype=torch.bfloat16)
    path = save_safetensors({"bn.running_var": values}, tmp_path / "b.safetensors")
    ref = read_checkpoint(path).tensors["bn.running_var"]
    assert ref.dtype == "bfloat16"
    np.testing.assert_array_equal(ref.read(), values.float().numpy())


SPECIALS = [0.0, -0.0, 1.0, -2.5, 65504.0, 1e-7, float("inf"), float("-inf"), float("nan"), 3.0e38, 1e-40]


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.uint16,
        torch.uint32,
        torch.uint64,
        torch.bool,
    ],
)
def test_safetensors_values_decode_to_what_torch_holds(tmp_path, dtype):
    """Every stored dtype, decoded without torch or numpy, equals torch's own reading
    of the same bytes, value for value (NaN where torch has NaN; -0.0 kept)."""
    if dtype.is_floating_point:
        values = torch.tensor(SPECIALS, dtype=torch.float64).to(dtype)
    elif dtype == torch.bool:
        values = torch.tensor([True, False, True])
    else:
        info = torch.iinfo(dtype)
        values = torch.tensor([info.min, info.max, 0, 1, 7], dtype=dtype)
    path = save_safetensors({"t": values.reshape(-1, 1)}, tmp_path / "v.safetensors")
    ref = read_checkpoint(path).tensors["t"]
    got, want = ref.read(), values.tolist()
    assert [type(v) for v in got] == [type(v) for v in want]
    assert [repr(v) for v in got] == [repr(v) for v in want]  # repr: tells -0.0 and NaN apart
    as_torch = ref.to_torch()
    assert as_torch.dtype == dtype and as_torch.shape == (len(want), 1)
    assert torch.equal(
        as_torch.isnan() if dtype.is_floating_point else as_torch,
        values.reshape(-1, 1).isnan() if dtype.is_floating_point else values.reshape(-1, 1),
    )


def test_torchscript_strided_views_read_in_row_major_order(tmp_path):
    """Buffers that are views into a larger storage (offset, transposed, stepped) read
    back as torch lays them out: the archive's own unpickler walks the strides."""

    class Views(nn.Module):
        def __init__(self):
            super().__init__()
            base = torch.arange(24, dtype=torch.float32)
            self.register_buffer("stepped", base[3::5])
            self.register_buffer("transposed", base.reshape(4, 6).t()[1:4])
            self.register_buffer("empty", base[:0])

        def forward(self, x):
            return x + self.stepped.sum() + self.transposed.sum() + self.empty.sum()

    module = Views()
    path = tmp_path / "views.pt"
    torch.jit.save(torch.jit.script(module), str(path))
    tensors = read_checkpoint(str(path)).tensors
    for name in ("stepped", "transposed", "empty"):
        expected = getattr(module, name)
        assert tensors[name].read() == expected.reshape(-1).tolist()
        assert torch.equal(tensors[name].to_torch(), expected)


def test_safetensors_metadata_kept(tmp_path):
    path = save_safetensors(small_state(), tmp_path / "m.safetensors", metadata={"format": "pt", "who": "me"})
    assert read_checkpoint(path).metadata == {"format": "pt", "who": "me"}


def test_safetensors_tensor_location_holds_exactly_its_bytes(tmp_path):
    # Data readers stream inputs from `location`: it must be where the tensor's bytes lie,
    # as the safetensors library itself (the independent reader) decodes them.
    from safetensors.numpy import load_file

    state = small_state()
    state["inputs"] = torch.arange(60, dtype=torch.float16).reshape(5, 3, 4)
    path = save_safetensors(state, tmp_path / "m.safetensors")
    expected = load_file(path)
    tensors = read_checkpoint(path).tensors
    with open(path, "rb") as f:
        for name, ref in tensors.items():
            offset, nbytes = ref.location
            f.seek(offset)
            raw = f.read(nbytes)
            assert len(raw) == nbytes == expected[name].nbytes
            assert raw == expected[name].astype(expected[name].dtype.newbyteorder("<")).tobytes(), name
    assert read_checkpoint(save_torch(small_state(), tmp_path / "m.pt")).tensors["bn1.running_var"].location is None


def test_safetensors_reads_only_the_tensors_asked_for(tmp_path, monkeypatch):
    """Only BN tensors are read: corrupting nothing, we count the byte ranges read."""
    state = small_state()
    state["big.weight"] = torch.randn(256, 256)
    path = save_safetensors(state, tmp_path / "m.safetensors")
    from bnaudit.audit.checkpoint import inspect as audit

    reads: list[int] = []
    real_open = open

    class CountingFile:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def seek(self, *a):
            return self.f.seek(*a)

        def read(self, n=-1):
            data = self.f.read(n)
            reads.append(len(data))
            return data

        def readinto(self, buffer):
            n = self.f.readinto(buffer)
            reads.append(n)
            return n

    monkeypatch.setattr(
        "builtins.open",
        lambda p, mode="r", *a, **k: (
            CountingFile(real_open(p, mode, *a, **k)) if str(p) == path else real_open(p, mode, *a, **k)
        ),
    )
    report = audit.inspect_paths(path)
    assert len(report.files[0].layers) == 1
    assert max(reads) < 256 * 256 * 4  # the big tensor was never read
    assert sum(reads) < 4096
    bn_sizes = sorted(t.numel() * t.element_size() for k, t in state.items() if k.startswith("bn1."))
    assert sorted(reads[-len(bn_sizes) :]) == bn_sizes  # each BN tensor read once, whole
    assert sum(reads[: -len(bn_sizes)]) < 1024  # before them: the format sniff and the header


# ----------------------------------------------------------------------------- containers


def container_cases(state):
    ema = {k: v.clone() for k, v in state.items()}
    return {
        "torchvision": (
            {
                "model": state,
                "optimizer": {"state": {}, "param_groups": []},
                "lr_scheduler": {"last_epoch": 3},
                "epoch": 3,
                "args": argparse.Namespace(lr=0.1),
                "model_ema": ema,
            },
            "model",
        ),
        "timm": (
            {
                "state_dict": state,
                "state_dict_ema": ema,
                "optimizer": {},
                "args": argparse.Namespace(x=1),
                "epoch": 9,
                "metric": np.float64(0.75),
            },
            "state_dict",
        ),
        "lightning": (
            {
                "state_dict": {f"model.{k}": v for k, v in state.items()},
                "hyper_parameters": {"lr": 1e-3},
                "optimizer_states": [{}],
                "loops": {},
                "callbacks": {},
                "epoch": 1,
            },
            "state_dict",
        ),
        "deepspeed": ({"module": state, "buffer_names": [], "global_steps": 10}, "module"),
        "pycls": ({"model_state": state, "optimizer_state": {}, "epoch": 3}, "model_state"),
        "mmengine": (
            {"state_dict": state, "ema_state_dict": ema, "message_hub": {}, "meta": {"epoch": 1}},
            "state_dict",
        ),
        "chgnet": (
            {"model": {"state_dict": state, "model_args": {"atom_fea_dim": 64}}, "optimizer": {}},
            "model/state_dict",
        ),
        "batdetect2": ({"epoch": 4, "state_dict": state, "params": {"lr": 0.1, "classes": ["a", "b"]}}, "state_dict"),
        "net": ({"net": state, "acc": 0.9}, "net"),
        "model_state_dict": ({"model_state_dict": state, "optimizer_state_dict": {}}, "model_state_dict"),
    }


@pytest.mark.parametrize("layout", list(container_cases({})))
def test_container_layouts_find_the_model_state_dict(tmp_path, layout):
    state = small_state()
    container, expected_key = container_cases(state)[layout]
    ckpt = read_checkpoint(save_torch(container, tmp_path / "c.pth"))
    assert ckpt.key == expected_key
    assert set(ckpt.tensors) == set(state)  # Lightning's model. prefix stripped
    np.testing.assert_array_equal(ckpt.tensors["bn1.running_var"].read(), state["bn1.running_var"].numpy())
    assert not ckpt.is_ema


def test_ema_copies_are_listed_and_audited_when_chosen(tmp_path):
    state = small_state()
    ema = bn_entries("bn1", 4, counter=0)  # ModelEmaV2 averages the counter to ~0
    ema["conv.weight"] = state["conv.weight"]
    path = save_torch({"model": state, "model_ema": ema, "epoch": 1}, tmp_path / "c.pth")
    default = read_checkpoint(path)
    assert default.key == "model" and default.other_keys == ["model_ema"]
    chosen = read_checkpoint(path, key="model_ema")
    assert chosen.key == "model_ema" and chosen.is_ema
    with pytest.raises(BnauditError, match="no state dict under key 'nope'.*'model'.*'model_ema'"):
        read_checkpoint(path, key="nope")


def test_wrapper_prefixes_stripped_only_when_every_key_has_them(tmp_path):
    state = small_state()
    ddp_compiled = {f"module._orig_mod.{k}": v for k, v in state.items()}
    ckpt = read_checkpoint(save_torch(ddp_compiled, tmp_path / "a.pt"))
    assert ckpt.prefix == "module._orig_mod." and set(ckpt.tensors) == set(state)
    # torch_geometric-style: ".module." in the middle, and one key without the prefix
    mixed = {f"module.{k}": v for k, v in state.items()}
    mixed["head.module.weight"] = torch.ones(2)
    ckpt = read_checkpoint(save_torch(mixed, tmp_path / "b.pt"))
    assert ckpt.prefix == "" and "module.bn1.running_mean" in ckpt.tensors


def test_whole_pickled_module_of_torch_nn_classes_loads_with_its_real_eps(tmp_path):
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, eps=1e-3, momentum=None))
    ckpt = read_checkpoint(save_torch(model, tmp_path / "whole.pt"))
    assert ckpt.holds_module
    assert ckpt.modules["1"].eps == 1e-3 and ckpt.modules["1"].momentum is None


class CustomNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(3)


def test_pickled_custom_class_is_refused_with_its_name_and_never_run(tmp_path):
    path = save_torch(CustomNet(), tmp_path / "custom.pt")
    with pytest.raises(BnauditError) as err:
        read_checkpoint(path)
    message = str(err.value)
    assert "test_checkpoint.CustomNet" in message and "--trust-pickle" in message
    assert read_checkpoint(path, trust_pickle=True).modules["bn"].class_name == "BatchNorm1d"


def test_file_without_state_dict_is_an_error(tmp_path):
    with pytest.raises(BnauditError, match="holds no state dict"):
        read_checkpoint(save_torch({"epoch": 3, "lr": 0.1}, tmp_path / "x.pt"))


def test_zip_that_is_not_torch_is_a_clear_error(tmp_path):
    path = tmp_path / "x.pt"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("hello.txt", "hi")
    with pytest.raises(BnauditError, match="not a torch.save file"):
        read_checkpoint(str(path))
    assert os.path.getsize(path) > 0

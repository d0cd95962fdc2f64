"""Real files the readers got wrong (issue #32), and what torch's own loader rebuilds.

- pesto-pitch 2.0.1's `mir-1k_g7.ckpt` (Lightning): its omegaconf 2.0 hparams pickle
  `collections.defaultdict` REDUCEd with `builtins.dict`; it was refused. A defaultdict with
  an allow-listed factory (dict, list, set, int) is data.
- BeatNet 1.1.3's `model-1.pt`, a whole pickled model of the class `model.BDA`: the refusal
  blamed `torch.device` (which torch's weights-only loader allows) after importing torch to
  refuse (10-14 s); it names `model.BDA` now, without torch.
- lpips 0.1.4's `weights/v0.0/*.pth`, PyTorch <= 0.3 legacy files rebuilding tensors with
  `torch._utils._rebuild_tensor`: read without torch (torch.load was the fallback).

Each real file is used when its package is installed (skipped otherwise: CI installs none of
them); a small derived reproduction, built here, always runs. Beside them: torch's globals that
torch.load(weights_only=True) rebuilds and bnaudit used to hand to it (torch.load is no
fallback any more): each is read as a record, read torch-free, or recorded and not loaded.
"""

from __future__ import annotations

import collections
import importlib.util
import io
import json
import os
import pickle
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_python

from bnaudit.api import inspect
from bnaudit.formats.read import read_checkpoint
from bnaudit.formats.torchobjects import load_torch_save


def installed_file(package: str, *parts: str) -> Path:
    spec = importlib.util.find_spec(package)  # a top-level package: found, not imported
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{package} is not installed")
    path = Path(next(iter(spec.submodule_search_locations)), *parts)
    if not path.exists():
        pytest.skip(f"{path} is not in the installed {package}")
    return path


PROBE = """
import json, sys, time
start = time.perf_counter()
from bnaudit.api import inspect
(file,) = inspect(sys.argv[1]).files
print(json.dumps({"error": file.error, "layers": [l.name for l in file.layers], "notes": file.not_loaded,
                  "torch": "torch" in sys.modules, "numpy": "numpy" in sys.modules,
                  "seconds": time.perf_counter() - start}))
"""


def probe(path: Path) -> dict:
    proc = run_python(PROBE, str(path))
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def conv_bn() -> torch.nn.Sequential:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv1d(1, 4, 3), torch.nn.BatchNorm1d(4))
    model.train()
    model(torch.randn(8, 1, 16))
    return model.eval()


# ----------------------------------------------------------------------------- pesto


def test_lightning_hparams_with_a_defaultdict_of_dict_are_data(tmp_path):
    model = conv_bn()
    hparams = {"resolver_cache": collections.defaultdict(dict), "lists": collections.defaultdict(list)}
    hparams["lists"]["a"].append(1)
    checkpoint = {
        "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
        "hyper_parameters": hparams,
        "epoch": 3,
    }
    path = tmp_path / "pesto_like.ckpt"
    torch.save(checkpoint, path)
    assert b"defaultdict" in path.read_bytes()  # REDUCEd with __builtin__.dict, as omegaconf 2.0's
    result = probe(path)
    assert result["error"] is None, result["error"]  # was: refused, "calls collections.defaultdict"
    assert result["layers"] == ["1"] and not result["torch"]
    rebuilt = load_torch_save(str(path), "torch-zip")["hyper_parameters"]
    assert rebuilt == torch.load(path, weights_only=False)["hyper_parameters"]
    assert rebuilt["resolver_cache"].default_factory is dict


def test_a_defaultdict_whose_factory_could_run_code_is_refused_naming_it(tmp_path):
    class Factory:
        def __reduce__(self):
            return (collections.defaultdict, (os.system,))

    path = tmp_path / "factory.ckpt"
    torch.save({"state_dict": conv_bn().state_dict(), "hyper_parameters": Factory()}, path)
    (file,) = inspect(str(path)).files
    assert file.error is not None and "refused to unpickle" in file.error and "posix.system" in file.error


def test_pesto_pitch_default_model_is_audited():
    from test_torchfree import lenient_pickle  # torch's full unpickling, omegaconf's classes inert

    path = installed_file("pesto", "weights", "mir-1k_g7.ckpt")
    result = probe(path)
    assert result["error"] is None, result["error"]  # was: refused, "calls collections.defaultdict"
    assert not result["torch"] and any("omegaconf" in note for note in result["notes"])
    expected = torch.load(path, weights_only=False, pickle_module=lenient_pickle)["state_dict"]
    ckpt = read_checkpoint(str(path))
    assert len(ckpt.tensors) == len(expected) > 0
    for name, tensor in expected.items():
        assert ckpt.tensors[name.removeprefix(ckpt.prefix)].read() == tensor.reshape(-1).tolist(), name
    bn = sorted({k.rsplit(".", 1)[0] for k in expected if k.endswith("running_var")})
    assert result["layers"] == bn  # pesto's encoder has LayerNorms only: none


# ----------------------------------------------------------------------------- BeatNet


BDA_SOURCE = """
import torch
from torch import nn


class BDA(nn.Module):  # BeatNet's shape: an LSTM, a conv, a linear head, the device kept
    def __init__(self):
        super().__init__()
        self.device = torch.device("cpu")
        self.conv1 = nn.Conv1d(1, 2, 3)
        self.lstm = nn.LSTM(4, 8, 2, batch_first=True)
        self.linear0 = nn.Linear(8, 3)
        self.softmax = nn.Softmax(dim=0)
"""


def test_a_whole_model_pickle_is_refused_naming_its_class_without_torch(tmp_path, monkeypatch):
    (tmp_path / "model.py").write_text(BDA_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import model as beatnet_model  # type: ignore[import-not-found]

    path = tmp_path / "model-1.pt"
    try:
        torch.save(beatnet_model.BDA(), path)
    finally:
        sys.modules.pop("model", None)
    (tmp_path / "model.py").unlink()
    result = probe(path)
    assert "model.BDA" in result["error"] and "torch.device" not in result["error"], result["error"]
    assert "refused to unpickle" in result["error"] and "--trust-pickle" in result["error"]
    assert not result["torch"]  # was: torch imported to refuse (10-14 s)


def test_beatnet_whole_model_is_refused_naming_its_class():
    path = installed_file("BeatNet", "models", "model-1.pt")
    result = probe(path)
    assert "model.BDA" in result["error"] and "torch.device" not in result["error"], result["error"]
    assert not result["torch"] and result["seconds"] < 5


# ----------------------------------------------------------------------------- lpips


def legacy_file(path: Path, obj, storages: dict[str, np.ndarray], views: dict[int, tuple[str, tuple]]) -> Path:
    """A PyTorch <= 0.3 file: tensors rebuilt by `_rebuild_tensor(storage, offset, size,
    stride)`, storages named by ('storage', type, key, location, numel, view) persistent ids,
    a view (torch < 0.4) being elements [offset, offset + size) of another storage."""

    class Pickler(pickle.Pickler):
        def persistent_id(self, value):
            if isinstance(value, OldStorage):
                root, view = views.get(id(value), (value.key, None))
                return ("storage", torch.FloatStorage, root, "cuda:0", storages[root].size, view)
            return None

    out = io.BytesIO()
    for header in (0x1950A86A20F9469CFC6C, 1001, {"protocol_version": 1001, "little_endian": True}):
        pickle.dump(header, out, protocol=2)
    Pickler(out, protocol=2).dump(obj)
    pickle.dump(sorted(storages), out, protocol=2)
    for key in sorted(storages):
        out.write(struct.pack("<q", storages[key].size) + storages[key].astype("<f4").tobytes())
    path.write_bytes(out.getvalue())
    return path


class OldStorage:
    def __init__(self, key: str) -> None:
        self.key = key


class OldTensor:
    def __init__(self, storage: OldStorage, offset: int, size: tuple, stride: tuple) -> None:
        self.args = (storage, offset, size, stride)

    def __reduce__(self):
        return (torch._utils._rebuild_tensor, self.args)


def test_a_pytorch_0_3_legacy_file_reads_like_torch_load_without_torch(tmp_path):
    rng = np.random.default_rng(0)
    stores = {"100": rng.standard_normal(12).astype(np.float32), "200": rng.random(6).astype(np.float32) + 0.5}
    whole, part = OldStorage("100"), OldStorage("100-view")
    obj = collections.OrderedDict(
        [
            ("lin0.model.1.weight", OldTensor(whole, 0, (1, 4, 1, 1), (4, 1, 1, 1))),
            ("bn.running_mean", OldTensor(part, 0, (3,), (1,))),  # a view of storage 100 from element 5
            ("bn.running_var", OldTensor(OldStorage("200"), 1, (3,), (2,))),  # strided
        ]
    )
    path = legacy_file(tmp_path / "alex.pth", obj, stores, {id(part): ("100", ("100-view", 5, 3))})
    expected = torch.load(path, weights_only=True, map_location="cpu")
    ckpt = read_checkpoint(str(path))
    for name, tensor in expected.items():
        assert ckpt.tensors[name].read() == tensor.reshape(-1).tolist(), name
    assert expected["bn.running_mean"].tolist() == stores["100"][5:8].tolist()
    result = probe(path)
    assert result["error"] is None and result["layers"] == ["bn"] and not result["torch"]


@pytest.mark.parametrize("name", ["alex", "vgg", "squeeze"])
def test_lpips_v0_0_weights_read_like_torch_load(name):
    path = installed_file("lpips", "weights", "v0.0", f"{name}.pth")
    expected = torch.load(path, weights_only=True, map_location="cpu")
    ckpt = read_checkpoint(str(path))
    assert set(ckpt.tensors) == set(expected)
    for key, tensor in expected.items():
        assert ckpt.tensors[key].read() == tensor.reshape(-1).tolist(), key
    result = probe(path)
    assert result["error"] is None and not result["torch"]


# ----------------------------------------------------------------------------- torch's other globals


def test_tensors_of_new_dtypes_are_read_or_rebuilt_like_torch_load(tmp_path):
    # uint16/uint32 and float8 tensors pickle as _rebuild_tensor_v3 over an untyped storage
    state = {
        "u16": torch.tensor([0, 1, 65535], dtype=torch.uint16),
        "u32": torch.tensor([0, 70000, 4000000000], dtype=torch.uint32),
        "f8": torch.tensor([0.5, -2.0, 448.0]).to(torch.float8_e4m3fn),
        "c64": torch.tensor([1 + 2j, -0.5j], dtype=torch.complex64),
        "bn.running_var": torch.ones(2),
    }
    path = tmp_path / "dtypes.pt"
    torch.save(state, path)
    ckpt = read_checkpoint(str(path))
    expected = torch.load(path, weights_only=True)
    assert ckpt.tensors["u16"].read() == expected["u16"].tolist()
    assert ckpt.tensors["u32"].read() == expected["u32"].tolist()
    rebuilt = load_torch_save(str(path), "torch-zip")
    for key, tensor in expected.items():
        assert rebuilt[key].dtype == tensor.dtype and torch.equal(
            rebuilt[key].view(torch.uint8), tensor.view(torch.uint8)
        )


def test_quantized_and_sparse_tensors_are_recorded_not_loaded(tmp_path):
    quantized = torch.quantize_per_tensor(torch.tensor([0.5, 1.0]), 0.1, 0, torch.qint8)
    sparse = torch.eye(3).to_sparse()
    path = tmp_path / "kinds.pt"
    torch.save({"state_dict": conv_bn().state_dict(), "calibration": {"q": quantized, "s": sparse}}, path)
    (file,) = inspect(str(path)).files
    assert file.error is None and [layer.name for layer in file.layers] == ["1"]
    assert any("_rebuild_qtensor" in note for note in file.not_loaded), file.not_loaded
    inside = tmp_path / "inside.pt"
    torch.save({**conv_bn().state_dict(), "1.scale": quantized}, inside)
    (file,) = inspect(str(inside)).files
    assert file.error is not None and "torch._utils._rebuild_qtensor" in file.error


def test_a_pickled_module_reads_back_as_the_module_torch_load_gives(tmp_path):
    # the writer's path: records rebuilt as torch objects, parameters and shared storages kept
    model = conv_bn()
    model.tied = torch.nn.Parameter(model[0].weight.detach()[:1])  # a view of another parameter's storage
    path = tmp_path / "module.pt"
    torch.save(model, path)
    expected = torch.load(path, weights_only=False)
    rebuilt = load_torch_save(str(path), "torch-zip")
    assert type(rebuilt) is type(expected)
    assert isinstance(rebuilt[0].weight, torch.nn.Parameter) and rebuilt[0].weight.requires_grad
    for (name, a), (_, b) in zip(rebuilt.state_dict().items(), expected.state_dict().items()):
        assert torch.equal(a, b), name
    assert rebuilt.tied.untyped_storage().data_ptr() == rebuilt[0].weight.untyped_storage().data_ptr()
    assert (rebuilt[1].eps, rebuilt[1].momentum) == (expected[1].eps, expected[1].momentum)


def test_numpy_values_rebuild_like_torch_load_and_a_forged_shape_is_refused(tmp_path):
    path = tmp_path / "numpy.pt"
    torch.save({"state_dict": conv_bn().state_dict(), "metric": np.float64(0.75), "history": np.arange(4.0)}, path)
    rebuilt = load_torch_save(str(path), "torch-zip")
    assert rebuilt["metric"] == np.float64(0.75) and type(rebuilt["metric"]) is np.float64
    assert np.array_equal(rebuilt["history"], np.arange(4.0))

    class Claims:  # an array claiming 2^40 elements before its data
        def __reduce__(self):
            return (np.core.multiarray._reconstruct, (np.ndarray, (1 << 40,), b"b"))

    forged = tmp_path / "claims.pt"
    torch.save({"state_dict": conv_bn().state_dict(), "history": Claims()}, forged)
    assert inspect(str(forged)).files[0].error is None  # an audit never rebuilds it
    with pytest.raises(Exception, match="claims a shape before its data"):
        load_torch_save(str(forged), "torch-zip")

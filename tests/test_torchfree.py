"""torch.save files read without torch: the values equal torch.load's, bit for bit.

bnaudit's own reader (formats/torchsave.py) resolves every tensor record of a torch.save
file to the bytes of the file; torch.load(weights_only=True) is the independent reader.
Every sample checkpoint and every generated one (zip and legacy, big-endian, each stored
dtype, strided views, storage offsets, shared storages, a pickled nn.Module) is read both
ways and compared tensor by tensor: the decoded values (NaN-aware, signed zeros) and the
bytes of the tensor `to_torch()` builds.
"""

from __future__ import annotations

import collections
import glob
import io
import math
import os
import pickle
import shutil
import struct
import zipfile
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
from conftest import REPO
from test_startup import run_probe

from bnaudit import inspect
from bnaudit.errors import BnauditError
from bnaudit.formats.containers import module_infos
from bnaudit.formats.model import TensorRef
from bnaudit.formats.pickled import PickledModule
from bnaudit.formats.read import read_checkpoint
from bnaudit.formats.sniff import sniff_format
from bnaudit.formats.torchobjects import load_torch_save
from bnaudit.formats.torchsave import read_torch_save

ITEMSIZE = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2, torch.float64: 8, torch.int64: 8, torch.int32: 4}


def free_object(path: str):
    """What bnaudit's reader makes of the file, asserting torch's loader was not used."""
    fmt = sniff_format(path)
    assert fmt in ("torch-zip", "torch-legacy"), (path, fmt)
    real_load = torch.load
    try:
        torch.load = lambda *a, **k: pytest.fail(f"torch.load reached for {path}")
        return read_torch_save(path, fmt == "torch-legacy").value
    finally:
        torch.load = real_load


def same_value(a, b) -> bool:
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return a == b and (not isinstance(a, float) or math.copysign(1, a) == math.copysign(1, b))


def assert_same_tensor(ref: TensorRef, tensor: torch.Tensor, where: str) -> None:
    assert isinstance(ref, TensorRef), where
    assert ref.shape == tuple(tensor.shape), where
    assert ref.dtype == str(tensor.dtype).removeprefix("torch."), where
    expected = tensor.detach().reshape(-1).tolist()
    got = ref.read()
    assert len(got) == len(expected), where
    assert all(same_value(g, e) for g, e in zip(got, expected)), where
    built = ref.to_torch()
    assert built.dtype == tensor.dtype and tuple(built.shape) == tuple(tensor.shape), where
    # bit for bit, NaN payloads included
    as_bytes = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    assert built.contiguous().reshape(-1).view(torch.uint8).tolist() == as_bytes.tolist(), where


def compare(expected, got, where: str = "") -> int:
    """Walk torch.load's object and bnaudit's side by side; the number of tensors compared."""
    if isinstance(expected, torch.Tensor):
        assert_same_tensor(got, expected, where)
        return 1
    if isinstance(expected, torch.nn.Module):
        assert isinstance(got, PickledModule), where
        assert [n for n, _ in got.named_modules()] == [n for n, _ in expected.named_modules()]
        return compare(expected.state_dict(), got.state_dict(), where)
    if isinstance(expected, Mapping):
        assert isinstance(got, Mapping), where
        assert list(got) == list(expected), where
        return sum(compare(v, got[k], f"{where}/{k}") for k, v in expected.items())
    if isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), where
        return sum(compare(e, g, f"{where}/{i}") for i, (e, g) in enumerate(zip(expected, got)))
    if isinstance(expected, (int, float, str, bool, type(None))):
        assert same_value(got, expected), where
    return 0


def count_tensors(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return 1
    if isinstance(obj, torch.nn.Module):
        return len(obj.state_dict())
    if isinstance(obj, Mapping):
        return sum(count_tensors(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(count_tensors(v) for v in obj)
    return 0


def assert_reads_like_torch(path: str, weights_only: bool = True) -> int:
    expected = torch.load(path, map_location="cpu", weights_only=weights_only)
    n = compare(expected, free_object(path))
    assert n == count_tensors(expected) > 0, path
    return n


class _Inert:
    """What torch.load below makes of a class the test environment cannot import."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __setstate__(self, state) -> None:
        pass


class _LenientUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        try:
            return super().find_class(module, name)
        except (ImportError, AttributeError):
            return type(name, (_Inert,), {})


class lenient_pickle:
    """torch.load's `pickle_module` for trusted samples whose project classes are not installed."""

    Unpickler = _LenientUnpickler
    load = staticmethod(pickle.load)


SAMPLES = sorted(
    p
    for pattern in ("**/*.pt", "**/*.pth", "**/*.bin", "**/*.ckpt")
    for p in glob.glob(os.path.join(REPO, "sample_models", pattern), recursive=True)
    if sniff_format(p) in ("torch-zip", "torch-legacy")
)


def test_samples_are_found():
    names = {os.path.relpath(p, REPO) for p in SAMPLES}
    assert {"sample_models/healthy.pt", "sample_models/ema_container.pth", "sample_models/nan_stats.pt"} <= names
    assert "sample_models/lightning/last.ckpt" in names
    assert len(names) >= 10


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: os.path.relpath(p, REPO))
def test_every_sample_checkpoint_reads_like_torch_load(path):
    # the samples are ours: torch may unpickle them fully (their project classes inert)
    expected = torch.load(path, map_location="cpu", weights_only=False, pickle_module=lenient_pickle)
    got = free_object(path)
    assert compare(expected, got) == count_tensors(expected)


def mixed_state() -> OrderedDict:
    """Every stored dtype, views with strides and offsets, shared storages."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 5, generator=g)
    base[0, 0], base[0, 1], base[0, 2] = float("nan"), float("inf"), -0.0
    shared = torch.randn(12, generator=g)
    return OrderedDict(
        [
            ("bn.weight", torch.randn(4, generator=g)),
            ("bn.running_mean", torch.randn(4, generator=g)),
            ("bn.running_var", torch.rand(4, generator=g) + 0.5),
            ("bn.num_batches_tracked", torch.tensor(123456789012, dtype=torch.int64)),
            ("half.running_var", (torch.rand(8, generator=g) * 3).half()),
            ("bf16.running_var", (torch.rand(8, generator=g) * 3).to(torch.bfloat16)),
            ("f64.running_var", torch.rand(8, generator=g, dtype=torch.float64)),
            ("int32", torch.arange(-5, 5, dtype=torch.int32)),
            ("int16", torch.arange(-3, 3, dtype=torch.int16) * 1000),
            ("int8", torch.arange(-4, 4, dtype=torch.int8)),
            ("uint8", torch.arange(250, 256, dtype=torch.uint8)),
            ("bool", torch.tensor([True, False, True])),
            ("transposed", base.t()),  # strides (1, 5)
            ("column", base[:, 3]),  # stride 5, offset 3
            ("tail", base[2:]),  # offset 10, contiguous
            ("every_other", base[::2, 1::2]),  # strides (10, 2), offset 1
            ("shared_a", shared[:6]),
            ("shared_b", shared[4:].view(2, 4)),  # overlaps shared_a's storage
            ("scalar", torch.tensor(2.5)),
            ("empty", torch.zeros(0, 3)),
        ]
    )


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_generated_checkpoint_of_every_dtype_and_view_reads_like_torch_load(tmp_path, legacy):
    path = str(tmp_path / "mixed.pt")
    torch.save({"state_dict": mixed_state(), "epoch": 3, "note": "x"}, path, _use_new_zipfile_serialization=not legacy)
    assert sniff_format(path) == ("torch-legacy" if legacy else "torch-zip")
    assert assert_reads_like_torch(path) == len(mixed_state())
    # the views stayed views in the file: one storage for base, one for shared
    ckpt = read_checkpoint(path)
    assert ckpt.tensors["bn.num_batches_tracked"].read() == [123456789012]
    assert ckpt.tensors["column"].read() == mixed_state()["column"].tolist()


def to_big_endian(src: str, dst: str, itemsize: int) -> None:
    """The archive a big-endian machine writes: `byteorder` says "big", every storage's
    elements have their bytes reversed (all storages of the file hold `itemsize` elements)."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info)
            if info.filename.endswith("/byteorder"):
                data = b"big"
            elif "/data/" in info.filename:
                data = b"".join(data[i : i + itemsize][::-1] for i in range(0, len(data), itemsize))
            zout.writestr(info.filename, data)


@pytest.mark.parametrize("dtype", list(ITEMSIZE), ids=str)
def test_big_endian_archive_reads_like_torch_load(tmp_path, dtype):
    g = torch.Generator().manual_seed(1)
    values = (torch.randn(6, 4, generator=g) * 100).to(dtype)
    state = {"bn.running_var": values[:, 1], "bn.running_mean": values.t(), "whole": values}
    little, big = str(tmp_path / "little.pt"), str(tmp_path / "big.pt")
    torch.save(state, little)
    to_big_endian(little, big, ITEMSIZE[dtype])
    # torch itself swaps it back: the file is a genuine big-endian archive
    assert torch.equal(torch.load(big, weights_only=True)["whole"], values)
    assert assert_reads_like_torch(big) == 3
    swapped = read_checkpoint(big).tensors["whole"].read()
    assert swapped == read_checkpoint(little).tensors["whole"].read()


def test_unknown_byte_order_is_refused(tmp_path):
    little, odd = str(tmp_path / "little.pt"), str(tmp_path / "odd.pt")
    torch.save({"bn.running_var": torch.ones(3)}, little)
    with zipfile.ZipFile(little) as zin, zipfile.ZipFile(odd, "w") as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, b"middle" if info.filename.endswith("/byteorder") else zin.read(info))
    (file,) = inspect(odd).files
    assert "unknown byte order" in file.error


def test_pickled_module_reads_like_torch_load_with_its_settings(tmp_path):
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, bias=False),
        torch.nn.BatchNorm2d(4, eps=1e-3, momentum=0.03),
        torch.nn.Sequential(torch.nn.ReLU(), torch.nn.BatchNorm1d(2, momentum=None, track_running_stats=True)),
        torch.nn.InstanceNorm2d(4, track_running_stats=True),
    )
    model[1].register_buffer("scratch", torch.ones(2), persistent=False)  # not in the state dict
    with torch.no_grad():
        model[1].running_var.copy_(torch.tensor([0.5, 1.5, 2.5, 3.5]))
        model[1].num_batches_tracked.fill_(77)
    path = str(tmp_path / "model.pt")
    torch.save(model, path)
    assert assert_reads_like_torch(path, weights_only=False) == len(model.state_dict())

    ckpt = read_checkpoint(path)
    assert ckpt.holds_module
    assert list(ckpt.tensors) == list(model.state_dict())
    expected = module_infos(torch.load(path, weights_only=False))
    assert set(ckpt.modules) == set(expected) == {"1", "2.1", "3"}
    for name, info in expected.items():
        got = ckpt.modules[name]
        assert (got.class_name, got.eps, got.momentum, got.track_running_stats, got.momentum_known) == (
            info.class_name,
            info.eps,
            info.momentum,
            info.track_running_stats,
            info.momentum_known,
        ), name
    assert (ckpt.modules["1"].eps, ckpt.modules["1"].momentum) == (1e-3, 0.03)
    assert ckpt.modules["2.1"].momentum is None and ckpt.modules["2.1"].momentum_known


def test_conftest_and_legacy_handmade_files_read_like_torch_load(tmp_path):
    # the checkpoints other tests build: conftest's bn_entries through torch.save, both formats
    from conftest import bn_entries

    for legacy in (False, True):
        path = str(tmp_path / f"entries_{legacy}.pt")
        torch.save(bn_entries("layer1.0.bn1"), path, _use_new_zipfile_serialization=not legacy)
        assert assert_reads_like_torch(path) >= 4


def test_bytes_pickled_by_protocol_2_are_rebuilt(tmp_path):
    path = str(tmp_path / "with_bytes.pt")
    torch.save({"state_dict": {"bn.running_var": torch.ones(2)}, "blob": b"\x00\xffabc"}, path)
    assert free_object(path)["blob"] == b"\x00\xffabc"


def test_torch_constants_are_records_and_rebuild_to_what_torch_load_gives(tmp_path):
    # torch.Size, dtypes, devices: read as records without torch.load (once handed to it),
    # rebuilt to torch's own objects for a writer
    path = str(tmp_path / "sized.pt")
    saved = {
        "state_dict": {"bn.running_var": torch.ones(2)},
        "shape": torch.Size([2]),
        "dt": torch.float16,
        "device": torch.device("cuda", 1),
        "counts": collections.Counter(a=2),
        "blob": bytearray(b"\x00\x01"),
        "z": complex(1.5, -2.0),
    }
    torch.save(saved, path)
    records = free_object(path)
    assert records["shape"] == (2,) and records["dt"].name == "float16" and records["device"].index == 1
    expected = torch.load(path, weights_only=True)
    rebuilt = load_torch_save(path, "torch-zip")
    assert rebuilt["shape"] == expected["shape"] and type(rebuilt["shape"]) is torch.Size
    assert rebuilt["dt"] is torch.float16 and rebuilt["device"] == expected["device"]
    assert rebuilt["counts"] == expected["counts"] and type(rebuilt["counts"]) is collections.Counter
    assert rebuilt["blob"] == expected["blob"] and rebuilt["z"] == expected["z"]
    assert torch.equal(rebuilt["state_dict"]["bn.running_var"], expected["state_dict"]["bn.running_var"])


def legacy_parts(path: str) -> tuple[bytes, list, int]:
    """(the main pickle's bytes, the storage keys, the offset of the first storage's count)
    of a legacy torch.save file of our own making (read with pickle: the test's file)."""
    import pickletools

    with open(path, "rb") as f:
        for _ in range(3):  # magic, protocol version, sys info
            pickle.load(f)
        start = f.tell()
        for _ in pickletools.genops(f):  # to the main pickle's STOP, nothing built
            pass
        end = f.tell()
        keys = pickle.load(f)
        data = f.tell()
        f.seek(start)
        return f.read(end - start), keys, data


def test_legacy_big_endian_counts_are_read_in_the_files_byte_order(tmp_path):
    # torch reads legacy files in the machine's byte order, so it cannot be the reference
    # here: the file is built by hand from a little-endian one, values swapped by struct.
    src = str(tmp_path / "little.pt")
    values = [0.5, -2.25, 3.0e-3]
    torch.save({"bn.running_var": torch.tensor(values)}, src, _use_new_zipfile_serialization=False)
    main, keys, data = legacy_parts(src)
    raw = Path(src).read_bytes()
    out = io.BytesIO()
    for header in (0x1950A86A20F9469CFC6C, 1001):
        pickle.dump(header, out, protocol=2)
    pickle.dump({"protocol_version": 1001, "little_endian": False, "type_sizes": {}}, out, protocol=2)
    out.write(main)
    pickle.dump(keys, out, protocol=2)
    out.write(struct.pack(">q", len(values)) + struct.pack(f">{len(values)}f", *values))
    big = tmp_path / "big.pt"
    big.write_bytes(out.getvalue())
    assert raw[data + 8 : data + 20] == struct.pack("<3f", *values)
    ckpt = read_checkpoint(str(big))
    assert ckpt.tensors["bn.running_var"].read() == [struct.unpack("<f", struct.pack("<f", v))[0] for v in values]


@pytest.mark.slow
def test_inspect_diff_scan_and_sarif_of_torch_save_files_import_neither_torch_nor_numpy(tmp_path):
    healthy = os.path.join(REPO, "sample_models", "healthy.pt")
    finetuned = os.path.join(REPO, "sample_models", "finetuned.pt")
    module = str(tmp_path / "module.pt")
    torch.save(torch.nn.Sequential(torch.nn.Conv2d(1, 2, 1), torch.nn.BatchNorm2d(2)), module)
    legacy = str(tmp_path / "legacy.pt")
    torch.save(
        {"bn.running_var": torch.ones(2), "bn.running_mean": torch.zeros(2)},
        legacy,
        _use_new_zipfile_serialization=False,
    )
    # a folder of every sample torch.save file but the RNG state, whose numpy arrays need numpy
    folder = tmp_path / "folder"
    folder.mkdir()
    for sample in SAMPLES:
        if not sample.endswith("rng_state.pth"):
            shutil.copy(sample, folder / os.path.relpath(sample, REPO).replace(os.sep, "_"))
    for args in (
        ("inspect", healthy, "--exit-zero"),
        ("inspect", module, legacy, "--exit-zero"),
        ("inspect", healthy, "--format", "sarif", "--exit-zero"),
        ("diff", healthy, finetuned),
        ("inspect", str(folder), "--exit-zero"),
    ):
        out: list[str] = []
        code, loaded = run_probe(*args, stdout=out)
        assert code in (0, 1), (args, out)
        assert out[0].strip(), args  # it reported something
        assert not loaded["torch"] and not loaded["numpy"], args


@pytest.mark.slow
def test_trust_pickle_is_what_imports_torch(tmp_path):
    path = os.path.join(REPO, "sample_models", "healthy.pt")
    code, loaded = run_probe("inspect", "--trust-pickle", path, "--exit-zero")
    assert code == 0
    assert loaded["torch"]


def test_archive_with_compressed_records_reads_like_torch_load(tmp_path):
    # torch writes its records stored; a re-zipped archive deflates them, and is read through zipfile
    src, deflated = str(tmp_path / "stored.pt"), str(tmp_path / "deflated.pt")
    torch.save(mixed_state(), src)
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(deflated, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info))
    assert assert_reads_like_torch(deflated) == len(mixed_state())


def test_pickled_module_sharing_children_exponentially_is_refused_quickly(tmp_path):
    # Each level holds the level below twice: 2^40 paths to walk for a state dict (torch's own
    # state_dict would never return); bnaudit's walk is bounded.
    import time

    module = torch.nn.BatchNorm1d(2)
    for _ in range(40):
        level = torch.nn.Module()
        level.add_module("a", module)
        level.add_module("b", module)
        module = level
    path = str(tmp_path / "nested.pt")
    torch.save(module, path)
    start = time.perf_counter()
    (file,) = inspect(path).files
    assert time.perf_counter() - start < 30
    assert "malformed pickled module" in file.error and "forged nesting" in file.error


def test_forged_state_on_a_tensor_record_is_refused(tmp_path):
    # BUILD onto a tensor would replace what reading it returns: refused, never applied
    class Forged:
        def __reduce__(self):
            return (
                torch._utils._rebuild_tensor_v2,
                (torch.ones(2).storage(), 0, (2,), (1,), False, OrderedDict()),
                {"_reader": 1},
            )

    path = str(tmp_path / "forged.pt")
    torch.save({"bn.running_var": Forged(), "bn.running_mean": torch.zeros(2)}, path)
    with pytest.raises(BnauditError, match="sets state on a tensor record"):
        free_object(path)  # torch.load never reached


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_expanded_buffers_read_like_torch_load(tmp_path, legacy):
    """A buffer saved as an expanded view (stride 0: one stored element shown n times) is
    what torch.load gives; a forged claim of 2**40 elements stays refused."""
    path = str(tmp_path / "expanded.pt")
    state = OrderedDict(
        [
            ("bn.weight", torch.ones(6)),
            ("bn.bias", torch.zeros(6)),
            ("bn.running_mean", torch.zeros(1).expand(6)),
            ("bn.running_var", torch.full((1,), 0.25).expand(6)),
            ("grid", torch.tensor([[1.0], [2.0]]).expand(2, 3)),  # strides (1, 0)
            ("bn.num_batches_tracked", torch.tensor(7)),
        ]
    )
    assert state["grid"].stride() == (1, 0) and state["bn.running_var"].stride() == (0,)
    torch.save(state, path, _use_new_zipfile_serialization=not legacy)
    assert assert_reads_like_torch(path) == len(state)
    ckpt = read_checkpoint(path)
    assert ckpt.tensors["bn.running_var"].read() == [0.25] * 6
    assert ckpt.tensors["grid"].read() == [1.0, 1.0, 1.0, 2.0, 2.0, 2.0]
    (file,) = inspect(path).files
    assert file.error is None and [layer.name for layer in file.layers] == ["bn"]


def test_expanded_buffer_of_a_scripted_module_reads_like_torch(tmp_path):
    module = torch.nn.BatchNorm1d(6).eval()
    module.running_var = torch.full((1,), 0.25).expand(6)
    path = str(tmp_path / "scripted.pt")
    torch.jit.save(torch.jit.script(module), path)
    assert torch.jit.load(path).running_var.stride() == (0,)
    assert read_checkpoint(path).tensors["running_var"].read() == [0.25] * 6


def test_a_read_checkpoint_is_freed_without_the_cycle_collector(tmp_path):
    """Reading a torch.save file leaves no reference cycle behind: dropped, everything it
    built goes at once by reference counting (a folder scan would otherwise keep each file's
    records until the collector runs, and pay for traversing them)."""
    import gc

    path = str(tmp_path / "plain.pt")
    torch.save({"state_dict": mixed_state(), "epoch": 3}, path)
    read_checkpoint(path)  # first-use caches (regexes, imports) are not garbage
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        ckpt = read_checkpoint(path)
        assert ckpt.tensors["bn.running_var"].read() == mixed_state()["bn.running_var"].tolist()
        del ckpt
        assert gc.collect() == 0  # nothing unreachable was left for the collector
    finally:
        if was_enabled:
            gc.enable()

"""No file of a few KB costs more than ~100 MB or ~5 s to read (issue #32).

Each hostile file is written here, byte by byte where the format allows it, and read in a
fresh interpreter under an address-space cap and a CPU-time cap (conftest.run_bounded):
a file that asks for more than the caps kills the process or raises MemoryError, and the
test fails. The peak memory each adds and its CPU time are asserted too. Before the bounds:
a `.pt2` tensor with stride 0 (or an empty storage) claiming 5M elements took ~1 GB and
35 s, a DCP folder whose `.metadata` claims a 50M-element shape 449 MB before any chunk was
read, a 330-byte pickle whose persistent id shares itself level by level an exponential
message (depth 24: 44 s, 164 MB; depth 40 here), and an 8 MB run of EMPTY_LIST ~75 bytes of
memory per byte (606 MB).
"""

from __future__ import annotations

import io
import json
import pickle
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import REPO, run_bounded

SAMPLES = Path(REPO) / "sample_models"

# A few KB of input: ~100 MB and ~5 s at most (start-up excluded: measured from after imports).
FEW_KB_MEMORY_MIB = 100
FEW_KB_CPU_SECONDS = 5

INSPECT = """
from bnaudit.api import inspect
(file,) = inspect(sys.argv[1]).files
print(file.error if file.error else f"{len(file.layers)} layers")
"""


def inspected(path: Path | str, memory: int = 1 << 30, cpu: int = FEW_KB_CPU_SECONDS) -> tuple[str, float, float]:
    return run_bounded(INSPECT, str(path), memory=memory, cpu=cpu)


def assert_cheap(result: tuple[str, float, float], *words: str) -> str:
    out, mib, seconds = result
    assert mib < FEW_KB_MEMORY_MIB, (mib, out)
    assert seconds < FEW_KB_CPU_SECONDS, (seconds, out)
    for word in words:
        assert word in out, (word, out)
    return out


# ----------------------------------------------------------------------------- builders


def shared_tuples(depth: int) -> bytes:
    """Opcodes leaving on the stack a tuple that holds the one below twice, `depth` levels:
    its full text is 2^depth times as long as one level's, the pickle ~8 bytes a level."""
    ops = pickle.NONE + pickle.BINPUT + b"\x00" + pickle.POP
    for _ in range(depth):
        ops += pickle.BINGET + b"\x00" + pickle.BINGET + b"\x00" + pickle.TUPLE2 + pickle.BINPUT + b"\x00" + pickle.POP
    return ops + pickle.BINGET + b"\x00"


def shared_persistent_id(depth: int = 40) -> bytes:
    """A pickle whose persistent id is the tuple of `shared_tuples`."""
    return pickle.PROTO + b"\x02" + shared_tuples(depth) + pickle.BINPERSID + pickle.STOP


def shared_dict_key(depth: int = 40) -> bytes:
    """A dict keyed by the tuple of `shared_tuples`: hashing it walks 2^depth nodes."""
    return (
        pickle.PROTO + b"\x02" + pickle.EMPTY_DICT + shared_tuples(depth) + pickle.NONE + pickle.SETITEM + pickle.STOP
    )


def torch_zip_with_pickle(path: Path, data: bytes) -> Path:
    """A torch.save zip of a real BN state dict whose data.pkl is `data`."""
    src = path.with_suffix(".src")
    torch.save({"bn.running_var": torch.ones(4), "bn.running_mean": torch.zeros(4)}, src)
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(path, "w") as zout:
        for entry in zin.namelist():
            zout.writestr(entry, data if entry.endswith("/data.pkl") else zin.read(entry))
    src.unlink()
    return path


def legacy_with_pickle(path: Path, data: bytes) -> Path:
    """The pre-1.6 layout (magic, protocol, sys info) with `data` as its main pickle."""
    out = io.BytesIO()
    for header in (0x1950A86A20F9469CFC6C, 1001, {"protocol_version": 1001, "little_endian": True}):
        pickle.dump(header, out, protocol=2)
    out.write(data)
    pickle.dump([], out, protocol=2)
    path.write_bytes(out.getvalue())
    return path


def script_with_pickle(path: Path, data: bytes) -> Path:
    model = torch.jit.script(torch.nn.Sequential(torch.nn.BatchNorm1d(2)))
    src = path.with_suffix(".src")
    torch.jit.save(model, str(src))
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(path, "w") as zout:
        for entry in zin.namelist():
            keep = not (entry.endswith("/data.pkl") and entry.count("/") == 1)
            zout.writestr(entry, zin.read(entry) if keep else data)
    src.unlink()
    return path


def dcp_with_metadata(folder: Path, data: bytes) -> Path:
    shutil.copytree(SAMPLES / "dcp", folder)
    (folder / ".metadata").write_bytes(data)
    return folder


# ----------------------------------------------------------------------------- messages


@pytest.mark.parametrize("where", ["zip", "legacy", "torchscript", "dcp"])
def test_a_persistent_id_sharing_itself_is_refused_with_a_short_message(tmp_path, where):
    data = shared_persistent_id()
    assert len(data) < 400
    build = {
        "zip": lambda: torch_zip_with_pickle(tmp_path / "pid.pt", data),
        "legacy": lambda: legacy_with_pickle(tmp_path / "pid.pt", data),
        "torchscript": lambda: script_with_pickle(tmp_path / "pid.pt", data),
        "dcp": lambda: dcp_with_metadata(tmp_path / "pid", data),
    }[where]
    out = assert_cheap(inspected(build()), "persistent id")
    assert len(out) < 600, out


def test_a_dict_key_sharing_itself_is_refused_before_it_is_hashed(tmp_path):
    path = torch_zip_with_pickle(tmp_path / "key.pt", shared_dict_key())
    assert_cheap(inspected(path), "too large to hash")


def test_messages_and_exception_lines_render_shared_values_within_their_limit():
    from bnaudit.text import exception_line, shown_value

    value: object = None
    for _ in range(60):
        value = (value, value)
    text = shown_value(value)
    assert len(text) <= 80 and text.startswith("((((")
    assert len(exception_line(KeyError(value))) <= 200
    big = 10**5000  # int -> str is quadratic and refused past 4300 digits
    assert shown_value(big) == f"<int of {big.bit_length()} bits>"
    assert shown_value("x" * 10**6, 20) == "'" + "x" * 16 + "..."


# ----------------------------------------------------------------------------- .pt2


def pt2_with(tmp_path: Path, edit, extra: dict[str, bytes] | None = None) -> tuple[Path, str]:
    """The sample program with the first running_var's weights-config entry edited; (path, fqn)."""
    src = SAMPLES / "pt2" / "eval.pt2"
    dst = tmp_path / "claims.pt2"
    fqn = ""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        root = zin.namelist()[0].split("/")[0]
        for info in zin.infolist():
            data = zin.read(info.filename)
            if info.filename.endswith("model_weights_config.json"):
                doc = json.loads(data)
                fqn = next(k for k in doc["config"] if k.endswith("running_var"))
                edit(doc["config"][fqn])
                data = json.dumps(doc).encode()
            zout.writestr(info.filename, data)
        for name, data in (extra or {}).items():
            zout.writestr(f"{root}/data/weights/{name}", data)
    return dst, fqn


@pytest.mark.parametrize("case", ["stride 0", "empty storage"])
def test_a_pt2_tensor_claiming_millions_of_elements_is_refused_before_it_is_built(tmp_path, case):
    claim = 5_000_000

    def edit(meta: dict) -> None:
        meta["tensor_meta"]["sizes"] = [{"as_int": claim}]
        meta["tensor_meta"]["strides"] = [{"as_int": 0 if case == "stride 0" else 1}]
        if case == "empty storage":
            meta["path_name"] = "weight_empty"

    path, _ = pt2_with(tmp_path, edit, {"weight_empty": b""})
    assert path.stat().st_size < 100 * 1024
    assert_cheap(inspected(path), str(claim), "at most 1048576 may be expanded")


def test_a_pt2_expanded_buffer_within_the_bound_reads_as_torch_export_reads_it(tmp_path):
    from torch.export import load

    from bnaudit.formats.read import read_checkpoint

    def edit(meta: dict) -> None:
        meta["tensor_meta"]["strides"] = [{"as_int": 0}]

    path, fqn = pt2_with(tmp_path, edit)
    expected = load(str(path)).state_dict[fqn]
    assert expected.stride() == (0,)
    assert read_checkpoint(str(path)).tensors[fqn].read() == expected.tolist()


# ----------------------------------------------------------------------------- DCP


READ_TENSOR = """
from bnaudit.errors import BnauditError
from bnaudit.formats.read import read_checkpoint
try:
    read_checkpoint(sys.argv[1]).tensors[sys.argv[2]].read()
except BnauditError as exc:
    print(exc)
"""


def test_a_dcp_shape_claiming_50m_elements_is_refused_before_it_is_allocated(tmp_path):
    from test_dcp import rewrite_metadata

    folder = tmp_path / "claims"
    shutil.copytree(SAMPLES / "dcp", folder)
    claim = 50_000_000

    def change(metadata) -> None:
        entry = metadata.state_dict_metadata["model.features.1.running_var"]
        entry.size = torch.Size([claim])
        entry.chunks[0].sizes = torch.Size([claim])

    rewrite_metadata(folder, change)
    assert sum(p.stat().st_size for p in folder.iterdir()) < 300 * 1024
    result = run_bounded(READ_TENSOR, str(folder), "features.1.running_var", memory=1 << 30, cpu=FEW_KB_CPU_SECONDS)
    assert_cheap(result, "does not hold a float32 tensor of shape [50000000]")


# ----------------------------------------------------------------------------- object counts


@pytest.mark.parametrize("opcode", [pickle.EMPTY_LIST, pickle.EMPTY_DICT])
def test_a_run_of_empty_containers_is_refused_within_a_fixed_allowance(tmp_path, opcode):
    # 8 MB of one-byte containers: was 606 MB of memory, about 75 bytes a byte
    data = pickle.PROTO + b"\x02" + pickle.MARK + opcode * (8 << 20) + pickle.LIST + pickle.STOP
    path = torch_zip_with_pickle(tmp_path / "runs.pt", data)
    out, mib, seconds = inspected(path, cpu=30)
    assert "builds more than 2097152 objects" in out
    assert mib < 300, mib  # 2^21 objects of ~100 bytes at most, whatever the pickle's size
    assert seconds < 30, seconds


def test_expanded_views_are_bounded_per_file_not_only_per_tensor(tmp_path):
    # each of 8 layers expands one stored element 2^20 times (allowed alone): 2^23 in all
    import numpy as np
    from test_hostile import FakeStorage, FakeTensor, write_torch_zip

    state = {}
    for i in range(8):
        for leaf in ("running_mean", "running_var"):
            state[f"bn{i}.{leaf}"] = FakeTensor(FakeStorage("0", 1), 0, (1 << 20,), (0,))
    path = write_torch_zip(tmp_path / "expanded.pt", state, {"0": np.ones(1)})
    assert path.stat().st_size < 8 * 1024
    assert_cheap(inspected(path), "expanded views claim more than 4194304 elements")


def test_a_real_checkpoint_stays_within_the_bounds(tmp_path):
    # the bounds refuse forged files, not real ones: 20 conv + BN blocks, their Adam state
    blocks = [torch.nn.Sequential(torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8)) for _ in range(20)]
    model = torch.nn.Sequential(*blocks)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8, 6, 6)).sum().backward()
    optimizer.step()
    path = tmp_path / "run.ckpt"
    torch.save({"state_dict": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 1}, path)
    assert_cheap(inspected(path), "20 layers")


def test_numpy_scalars_are_decoded_without_numpy_where_a_value_is_read(tmp_path):
    """A pickled module whose eps is a numpy float64: read as the number torch.load gives."""
    import numpy as np

    model = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 1), torch.nn.BatchNorm2d(2))
    model[1].eps = np.float64(2.5e-3)
    model[1].momentum = np.float32(0.25)
    path = tmp_path / "numpy_eps.pt"
    torch.save(model, path)
    from bnaudit.api import inspect

    (file,) = inspect(str(path)).files
    (layer,) = file.layers
    loaded = torch.load(path, weights_only=False)
    assert (layer.eps, layer.momentum) == (float(loaded[1].eps), float(loaded[1].momentum))

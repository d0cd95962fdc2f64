"""The C-unpickler first try of formats/torchsave.py reads exactly what the restricted one reads.

A torch.save zip's `data.pkl` is first run by pickle's C unpickler with a tight set of
globals; anything else (and any error) leaves the file to the pure-Python restricted
unpickler, which is the independent reference here: every file below is read both ways
(first try on, and off) and the two outcomes must be the same object, or the same error.
The files: every torch.save sample, torch-built state dicts, modules, big-endian and legacy
files, and hostile variants (forged globals, BUILD on bnaudit's records and functions, a
huge memo index, every third truncation and 300 single-byte changes of a real state dict's
pickle). Last, state that a pickle sets on a tensor or storage record (BUILD) is refused by
every reader, never applied.
"""

from __future__ import annotations

import math
import os
import pickle
import random
import struct
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.jit._pickle
from conftest import REPO, run_in_4_gib
from test_torchfree import SAMPLES, mixed_state, to_big_endian

from bnaudit.errors import BnauditError
from bnaudit.formats import torchsave
from bnaudit.formats.allowlist import load_torch_object
from bnaudit.formats.model import TensorRef
from bnaudit.formats.pickled import PickledModule
from bnaudit.formats.read import read_checkpoint
from bnaudit.formats.sniff import sniff_format
from bnaudit.formats.standins import StandIn, StandInObject

# ----------------------------------------------------------------------------- both ways


def described(obj: Any, depth: int = 0, seen: frozenset[int] = frozenset()) -> Any:
    """A plain, comparable picture of what a reader returned: tensors by their values."""
    if depth > 12 or id(obj) in seen:
        return ("...",)
    seen = seen | {id(obj)}
    if isinstance(obj, TensorRef):
        try:
            values = tuple(
                "nan" if isinstance(v, float) and math.isnan(v) else (v, math.copysign(1, v)) for v in obj.read()
            )
        except Exception as exc:
            values = ("unreadable", str(exc))
        return ("tensor", obj.name, obj.shape, obj.dtype, values)
    if isinstance(obj, torch.Tensor):
        return ("torch", tuple(obj.shape), str(obj.dtype), obj.detach().reshape(-1).tolist())
    if isinstance(obj, PickledModule):
        return ("module", obj.qualname, described(obj.state, depth + 1, seen))
    if isinstance(obj, (StandIn, StandInObject)):
        return ("stand-in", repr(obj))
    if isinstance(obj, Mapping):
        items = [(described(k, depth + 1, seen), described(v, depth + 1, seen)) for k, v in obj.items()]
        attrs = described(vars(obj), depth + 1, seen) if hasattr(obj, "__dict__") else None
        return (type(obj).__name__, items, attrs)
    if isinstance(obj, (list, tuple, set, frozenset)):
        return (type(obj).__name__, [described(v, depth + 1, seen) for v in obj])
    if obj is None or isinstance(obj, (str, bytes, int, float)):
        return ("value", repr(obj))
    return ("object", type(obj).__qualname__)  # a class or function kept as data


@contextmanager
def first_try(enabled: bool) -> Iterator[list[bool]]:
    """The fast path on or off; yields whether each read took it."""
    real = torchsave._fast_load
    taken: list[bool] = []

    def recording(*args: Any) -> tuple[bool, Any]:
        result = real(*args) if enabled else (False, None)
        taken.append(result[0])
        return result

    torchsave._fast_load = recording  # type: ignore[assignment]
    try:
        yield taken
    finally:
        torchsave._fast_load = real  # type: ignore[assignment]


def outcome(read: Callable[[], Any]) -> tuple[Any, ...]:
    try:
        return ("ok", described(read()))
    except Exception as exc:
        return ("error", type(exc).__name__, str(exc))


def checkpoint_outcome(path: str) -> tuple[Any, ...]:
    def read() -> Any:
        ckpt = read_checkpoint(path)
        return {"tensors": ckpt.tensors, "meta": dict(ckpt.metadata or {}), "notes": list(ckpt.not_loaded or [])}

    return outcome(read)


def both_ways(path: str) -> tuple[tuple[Any, ...], list[bool]]:
    """The object (and the checkpoint) read with the first try and without it: equal."""
    fmt = sniff_format(path)

    def load() -> Any:
        return load_torch_object(path, mmap=fmt == "torch-zip", stand_ins=True)

    with first_try(True) as taken:
        fast = outcome(load), checkpoint_outcome(path)
    with first_try(False):
        reference = outcome(load), checkpoint_outcome(path)
    assert fast == reference, path
    return fast, taken


# ----------------------------------------------------------------------------- files


def bn_net() -> torch.nn.Module:
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(), torch.nn.BatchNorm2d(4)
    )
    net.train()
    net(torch.randn(8, 3, 6, 6))  # running statistics away from their init
    return net.eval()


def torch_built(tmp_path: Path) -> dict[str, str]:
    net = bn_net()
    files: dict[str, Any] = {
        "state_dict": net.state_dict(),  # an OrderedDict with _metadata: BUILD on it
        "mixed": {"state_dict": mixed_state(), "epoch": 3, "note": "x", "blob": b"\x00\xffabc"},
        "parameters": {"w": torch.nn.Parameter(torch.randn(3)), "nested": [torch.ones(2), (torch.zeros(1), 2.5)]},
        "module": net,  # torch.nn classes: the first try leaves them to the restricted unpickler
        "sized": {"bn.running_var": torch.ones(2), "shape": torch.Size([2])},  # a torch global: torch.load
    }
    paths = {}
    for name, obj in files.items():
        paths[name] = str(tmp_path / f"{name}.pt")
        torch.save(obj, paths[name])
    paths["legacy"] = str(tmp_path / "legacy.pt")
    torch.save(net.state_dict(), paths["legacy"], _use_new_zipfile_serialization=False)
    paths["protocol4"] = str(tmp_path / "protocol4.pt")
    torch.save(net.state_dict(), paths["protocol4"], pickle_protocol=4)
    paths["big_endian"] = str(tmp_path / "big.pt")
    torch.save({k: v.float() for k, v in net.state_dict().items()}, str(tmp_path / "little.pt"))
    to_big_endian(str(tmp_path / "little.pt"), paths["big_endian"], 4)
    return paths


def with_pickle(tmp_path: Path, name: str, data: bytes) -> str:
    """A torch.save zip of a real BN state dict whose data.pkl is `data`."""
    src = tmp_path / "src.pt"
    if not src.exists():
        torch.save(bn_net().state_dict(), src)
    path = tmp_path / f"{name}.pt"
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(path, "w") as zout:
        for entry in zin.namelist():
            zout.writestr(entry, data if entry.endswith("/data.pkl") else zin.read(entry))
    return str(path)


def real_pickle(tmp_path: Path) -> bytes:
    src = tmp_path / "src.pt"
    if not src.exists():
        torch.save(bn_net().state_dict(), src)
    with zipfile.ZipFile(src) as z:
        return z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))


def text(s: str) -> bytes:
    b = s.encode()
    return pickle.BINUNICODE + struct.pack("<I", len(b)) + b


def glob(module: str, name: str) -> bytes:
    return pickle.GLOBAL + f"{module}\n{name}\n".encode()


def tensor(key: str, n: int, build: bytes = b"", storage_build: bytes = b"", function_build: bytes = b"") -> bytes:
    """torch's pickle of a float tensor of `n` elements on the record data/<key>; `build`,
    `storage_build` and `function_build`: a BUILD state applied to the tensor, its storage
    or the rebuild function before it is called."""
    p = glob("torch._utils", "_rebuild_tensor_v2") + function_build + (pickle.BUILD if function_build else b"")
    p += pickle.MARK
    p += pickle.MARK + text("storage") + glob("torch", "FloatStorage") + text(key) + text("cpu")
    p += pickle.BININT1 + bytes([n]) + pickle.TUPLE + pickle.BINPERSID
    p += storage_build + (pickle.BUILD if storage_build else b"")
    p += pickle.BININT1 + b"\x00" + pickle.BININT1 + bytes([n]) + pickle.TUPLE1 + pickle.BININT1 + b"\x01"
    p += pickle.TUPLE1 + pickle.NEWFALSE + glob("collections", "OrderedDict") + pickle.EMPTY_TUPLE + pickle.REDUCE
    p += pickle.TUPLE + pickle.REDUCE
    return p + build + (pickle.BUILD if build else b"")


def state(*entries: tuple[str, bytes]) -> bytes:
    body = b"".join(text(k) + v for k, v in entries)
    return pickle.PROTO + b"\x02" + pickle.EMPTY_DICT + pickle.MARK + body + pickle.SETITEMS + pickle.STOP


FORGED = {
    "plain": state(("bn.running_mean", tensor("1", 4)), ("bn.running_var", tensor("2", 4))),
    "build_on_tensor": state(
        ("bn.running_var", tensor("2", 4, build=pickle.EMPTY_DICT + text("_reader") + pickle.NONE + pickle.SETITEM))
    ),
    "build_on_storage": state(
        (
            "bn.running_var",
            tensor("2", 4, storage_build=pickle.EMPTY_DICT + text("path") + text("/etc/passwd") + pickle.SETITEM),
        )
    ),
    "build_on_rebuild_function": state(
        ("bn.running_var", tensor("2", 4, function_build=pickle.EMPTY_DICT + text("a") + pickle.NONE + pickle.SETITEM))
    ),
    "build_slots_on_rebuild_function": state(
        ("bn.running_var", tensor("2", 4, function_build=pickle.NONE + pickle.EMPTY_DICT + pickle.TUPLE2))
    ),
    "build_on_ordereddict_class": state(
        (
            "x",
            glob("collections", "OrderedDict")
            + pickle.EMPTY_DICT
            + text("a")
            + pickle.NONE
            + pickle.SETITEM
            + pickle.BUILD
            + pickle.EMPTY_TUPLE
            + pickle.REDUCE,
        )
    ),
    "build_on_parameter_function": state(
        (
            "w",
            glob("torch._utils", "_rebuild_parameter")
            + pickle.EMPTY_DICT
            + text("a")
            + pickle.NONE
            + pickle.SETITEM
            + pickle.BUILD
            + pickle.MARK
            + tensor("2", 4)
            + pickle.NEWFALSE
            + pickle.TUPLE
            + pickle.REDUCE,
        )
    ),
    "rebuild_function_as_data": state(
        ("bn.running_var", tensor("2", 4)), ("f", glob("torch._utils", "_rebuild_tensor_v2"))
    ),
    "parameter_function_as_data": state(
        ("bn.running_var", tensor("2", 4)), ("f", glob("torch._utils", "_rebuild_parameter"))
    ),
    "ordereddict_class_as_data": state(("bn.running_var", tensor("2", 4)), ("c", glob("collections", "OrderedDict"))),
    "newobj_ordereddict": state(
        ("bn.running_var", tensor("2", 4)),
        ("o", glob("collections", "OrderedDict") + pickle.EMPTY_TUPLE + pickle.NEWOBJ),
    ),
    "os_system": state(("x", glob("os", "system") + pickle.MARK + text("true") + pickle.TUPLE + pickle.REDUCE)),
    "python2_builtin_eval": state(
        ("x", glob("__builtin__", "eval") + pickle.MARK + text("1") + pickle.TUPLE + pickle.REDUCE)
    ),
    "stand_in_called": state(
        ("bn.running_var", tensor("2", 4)), ("h", glob("my_project", "HParams") + pickle.EMPTY_TUPLE + pickle.REDUCE)
    ),
    "stand_in_kept": state(
        ("bn.running_var", tensor("2", 4)), ("h", glob("my_project", "HParams") + pickle.EMPTY_TUPLE + pickle.NEWOBJ)
    ),
    "codecs_latin1": state(
        ("bn.running_var", tensor("2", 4)),
        ("b", glob("_codecs", "encode") + text("\xff") + text("latin1") + pickle.TUPLE2 + pickle.REDUCE),
    ),
    "codecs_other": state(("b", glob("_codecs", "encode") + text("x") + text("rot13") + pickle.TUPLE2 + pickle.REDUCE)),
    "huge_memo_index": pickle.PROTO + b"\x02" + pickle.EMPTY_DICT + b"r" + struct.pack("<I", 0xFFFFFFF0) + pickle.STOP,
    "missing_record": state(("bn.running_var", tensor("99", 4))),
    "tensor_past_storage": state(("bn.running_var", tensor("2", 200))),
    "protocol3": b"\x80\x03" + state(("bn.running_var", tensor("2", 4)))[2:],
    "no_stop": state(("bn.running_var", tensor("2", 4)))[:-1],
}


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: os.path.relpath(p, REPO))
def test_every_sample_reads_the_same_with_and_without_the_first_try(path):
    both_ways(path)


def test_torch_built_files_read_the_same_and_plain_state_dicts_take_the_first_try(tmp_path):
    paths = torch_built(tmp_path)
    taken = {name: both_ways(path)[1] for name, path in paths.items()}
    # plain state dicts and containers of tensors: C unpickler only (each read: object, checkpoint)
    for name in ("state_dict", "mixed", "parameters", "big_endian"):
        assert taken[name] == [True, True], name
    # nn classes, torch globals, another protocol: the restricted unpickler decides
    for name in ("module", "sized", "protocol4"):
        assert True not in taken[name], name
    assert taken["legacy"] == []  # a legacy file is read by the restricted unpickler alone


def test_a_plain_state_dict_never_reaches_the_restricted_unpickler(tmp_path, monkeypatch):
    path = torch_built(tmp_path)["state_dict"]

    def refuse(self: Any) -> None:
        raise AssertionError("the restricted unpickler was used")

    monkeypatch.setattr(torchsave._ZipUnpickler, "load", refuse)
    ckpt = read_checkpoint(path)
    expected = bn_net().state_dict()
    assert set(ckpt.tensors) == set(expected)
    for key, value in expected.items():
        assert ckpt.tensors[key].read() == value.reshape(-1).tolist(), key


@pytest.mark.parametrize("name", list(FORGED), ids=list(FORGED))
def test_forged_pickles_read_the_same_or_fail_the_same(tmp_path, name):
    (got, checkpoint), taken = both_ways(with_pickle(tmp_path, name, FORGED[name]))
    if name in ("plain", "codecs_latin1", "ordereddict_class_as_data"):
        assert True in taken, name  # what the first try completes
    else:
        assert True not in taken, name
    if name.startswith("build_on") or name.startswith("build_slots"):
        assert got[0] == "error" and checkpoint[0] == "error", got
    if name == "build_on_storage":
        assert "root:" not in repr(got) + repr(checkpoint)


def test_the_memo_index_is_bounded_before_the_c_unpickler_runs(tmp_path, monkeypatch):
    started: list[bytes] = []
    real = torchsave._FastZipUnpickler

    def recording(data: bytes, *args: Any) -> Any:
        started.append(data)
        return real(data, *args)

    monkeypatch.setattr(torchsave, "_FastZipUnpickler", recording)
    read_checkpoint(with_pickle(tmp_path, "plain", FORGED["plain"]))
    assert started == [FORGED["plain"]]
    with pytest.raises(BnauditError, match="holds no state dict"):  # {} as the restricted unpickler reads it
        read_checkpoint(with_pickle(tmp_path, "memo", FORGED["huge_memo_index"]))
    assert started == [FORGED["plain"]]  # the C unpickler never saw the huge index

    plain = pickle.PROTO + b"\x02" + pickle.EMPTY_DICT + b"r" + struct.pack("<I", (1 << 18) - 1) + pickle.STOP
    assert torchsave._plain_pickle(plain)
    assert not torchsave._plain_pickle(plain.replace(struct.pack("<I", (1 << 18) - 1), struct.pack("<I", 1 << 18)))
    # an 'r' inside a string is text, not an opcode
    assert torchsave._plain_pickle(pickle.PROTO + b"\x02" + text("running_var\xff\xff") + pickle.STOP)
    assert not torchsave._plain_pickle(pickle.PROTO + b"\x02" + text("abc")[:-1])
    assert torchsave._plain_pickle(pickle.PROTO + b"\x02" + text("") + pickle.STOP)
    assert not torchsave._plain_pickle(pickle.PROTO + b"\x02" + text("")[:-1] + pickle.STOP)
    assert not torchsave._plain_pickle(pickle.PROTO + b"\x02")
    assert not torchsave._plain_pickle(pickle.PROTO + b"\x02" + pickle.NEWOBJ + pickle.STOP)  # a class instantiated


def test_truncations_of_a_state_dicts_pickle_read_the_same(tmp_path):
    data = real_pickle(tmp_path)
    for cut in range(0, len(data), 3):
        both_ways(with_pickle(tmp_path, "cut", data[:cut]))


def test_single_byte_changes_of_a_state_dicts_pickle_read_the_same(tmp_path):
    data = real_pickle(tmp_path)
    rng = random.Random(25)
    for _ in range(300):
        at = rng.randrange(len(data))
        changed = data[:at] + bytes([rng.randrange(256)]) + data[at + 1 :]
        both_ways(with_pickle(tmp_path, "changed", changed))


@pytest.mark.slow
def test_a_torch_save_file_with_a_huge_memo_index_is_not_allocated(tmp_path):
    # LONG_BINPUT 0xFFFFFFF0: the C unpickler would grow its memo array to 64 GiB
    path = with_pickle(tmp_path, "memo", FORGED["huge_memo_index"])
    proc = run_in_4_gib(
        f"from bnaudit.formats.allowlist import load_torch_object\nprint(load_torch_object({path!r}, stand_ins=True))\n"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "{}"


def test_a_torch_save_archive_has_its_directory_parsed_once(tmp_path, monkeypatch):
    path = torch_built(tmp_path)["state_dict"]
    parsed: list[str] = []
    real = zipfile.ZipFile._RealGetContents  # type: ignore[attr-defined]

    def counting(self: zipfile.ZipFile) -> None:
        parsed.append(str(self.filename))
        real(self)

    monkeypatch.setattr(zipfile.ZipFile, "_RealGetContents", counting)
    assert set(read_checkpoint(path).tensors) == set(bn_net().state_dict())
    assert parsed == [path]  # was two: sniffing, then reading


# ----------------------------------------------------------------------------- records take no state


class StateOnStorage:
    """A storage record handed back by an identity global (`via`), then given `state` by
    BUILD: the pickle would move the bytes a tensor reads (another file, range or record)."""

    def __init__(self, storage: Any, via: Any, state: dict[str, Any]) -> None:
        self.storage, self.via, self.state = storage, via, state

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            self.via,
            (self.storage, "tag")
            if self.via is torch.jit._pickle.restore_type_tag
            else (self.storage, False, OrderedDict()),
            self.state,
        )


ELSEWHERE = {"path": "/etc/passwd", "offset": 0, "entry": "scripted/data/1"}


@pytest.mark.parametrize("layout", ["zip", "legacy"])
def test_state_set_on_a_storage_record_is_refused(tmp_path, layout):
    from test_hostile import FakeStorage, FakeTensor, write_legacy, write_torch_zip

    moved = StateOnStorage(FakeStorage("1", 3), torch._utils._rebuild_parameter, ELSEWHERE)
    obj = {
        "bn.running_mean": FakeTensor(FakeStorage("0", 3), 0, (3,), (1,)),
        "bn.running_var": FakeTensor(moved, 0, (3,), (1,)),
    }
    storages = {"0": np.zeros(3), "1": np.ones(3)}
    write = write_torch_zip if layout == "zip" else write_legacy
    path = str(write(tmp_path / f"{layout}.pt", obj, storages))
    with pytest.raises(BnauditError, match="a storage record takes no pickled state"):
        read_checkpoint(path)  # was: running_var read from /etc/passwd (zip) or the file's header (legacy)


def test_state_set_on_a_torchscript_storage_record_is_refused(tmp_path):
    from test_hostile import BN_CLASS, FakeStorage, FakeTensor, ScriptNode, forged_script

    moved = StateOnStorage(FakeStorage("0", 18), torch.jit._pickle.restore_type_tag, ELSEWHERE)
    root = ScriptNode(
        BN_CLASS,
        {
            "running_mean": FakeTensor(FakeStorage("0", 18), 0, (2,), (1,)),
            "running_var": FakeTensor(moved, 0, (2,), (1,)),
        },
    )
    with pytest.raises(BnauditError, match="a storage record takes no pickled state"):
        read_checkpoint(str(forged_script(tmp_path, root)))  # was: running_var read from another record


def test_state_set_on_a_torchscript_tensor_is_refused(tmp_path):
    from test_hostile import BN_CLASS, FakeStorage, FakeTensor, ScriptNode, forged_script

    class Retyped(FakeTensor):
        def __reduce__(self) -> tuple[Any, ...]:
            return (*super().__reduce__(), {"dtype": "int8", "shape": (8,)})  # BUILD on the tensor

    storage = FakeStorage("0", 18)
    root = ScriptNode(
        BN_CLASS, {"running_mean": Retyped(storage, 0, (2,), (1,)), "running_var": FakeTensor(storage, 2, (2,), (1,))}
    )
    with pytest.raises(BnauditError, match="a tensor record takes no pickled state"):
        read_checkpoint(str(forged_script(tmp_path, root)))  # was: read as 8 int8 values

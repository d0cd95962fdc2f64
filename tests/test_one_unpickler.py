"""One interpreter decides what a pickle means: formats/unpickle.py, for every pickle bnaudit reads.

The C-unpickler first try of torch.save reading is gone (it and the restricted unpickler
disagreed on a do-nothing BUILD on the OrderedDict class: exit 1 against exit 2), and so is
torch.load as a fallback for files naming torch globals. Pinned here: torch-built files of
every layout read like torch.load(weights_only=True) (the independent reader), without
torch.load; hostile pickles (BUILD on bnaudit's records and functions and on the
OrderedDict class, calls of stand-ins, a huge memo index, every third truncation and 300
single-byte changes of a real state dict's pickle) either read or end in one BnauditError
line, never another exception; state a pickle sets on a tensor or storage record is
refused, never applied; and pickle's own Unpicklers are never used on a file's bytes.
"""

from __future__ import annotations

import os
import pickle
import random
import struct
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.jit._pickle
from conftest import REPO, run_in_4_gib
from test_torchfree import compare, count_tensors, mixed_state, to_big_endian

from bnaudit.errors import BnauditError
from bnaudit.formats.read import read_checkpoint
from bnaudit.formats.sniff import sniff_format
from bnaudit.formats.torchsave import read_torch_save


def free_object(path: str) -> Any:
    """bnaudit's reading of a torch.save file, torch.load unreachable."""
    real = torch.load
    try:
        torch.load = lambda *a, **k: pytest.fail(f"torch.load reached for {path}")  # type: ignore[assignment]
        return read_torch_save(path, sniff_format(path) == "torch-legacy").value
    finally:
        torch.load = real  # type: ignore[assignment]


def outcome(path: str) -> tuple[Any, ...]:
    """("ok", tensor names) or ("error", the one line): any other exception fails the test."""
    try:
        ckpt = read_checkpoint(path)
    except BnauditError as exc:
        text = str(exc)
        assert "\n" not in text and len(text) < 2000, text
        return ("error", text)
    for ref in ckpt.tensors.values():
        try:
            ref.read()
        except BnauditError:
            pass
    return ("ok", sorted(ckpt.tensors))


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
        "module": net,  # torch.nn classes: PickledModules
        "sized": {"bn.running_var": torch.ones(2), "shape": torch.Size([2])},  # a torch global: a record
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


def test_torch_built_files_of_every_layout_read_like_torch_load_without_it(tmp_path):
    for name, path in torch_built(tmp_path).items():
        # our own files: torch may unpickle them fully (its weights-only reader has no FRAME opcode)
        expected = torch.load(path, map_location="cpu", weights_only=name not in ("module", "protocol4"))
        assert compare(expected, free_object(path)) == count_tensors(expected) > 0, name


@pytest.mark.parametrize("name", list(FORGED), ids=list(FORGED))
def test_forged_pickles_read_or_fail_in_one_line(tmp_path, name):
    got = outcome(with_pickle(tmp_path, name, FORGED[name]))
    if name.startswith(("build_on", "build_slots")) or name in ("os_system", "python2_builtin_eval", "stand_in_called"):
        assert got[0] == "error", got
    if name == "stand_in_kept":  # a stand-in inside the audited state dict
        assert got[0] == "error", got
    if name == "build_on_storage":
        assert "/etc/passwd" not in repr(got)
    if name in ("plain", "codecs_latin1", "ordereddict_class_as_data", "protocol3"):
        assert got == ("ok", ["bn.running_mean", "bn.running_var"][name != "plain" :]), got


def test_a_do_nothing_build_on_the_ordereddict_class_is_refused_by_the_command(tmp_path, cli):
    # was: audited by the C-unpickler first try (exit 1), refused by the restricted one (exit 2)
    path = with_pickle(tmp_path, "build", FORGED["build_on_ordereddict_class"])
    result = cli("inspect", path)
    assert result.exit_code == 2, result.stdout
    (line,) = [x for x in result.stderr.splitlines() if x.strip()]
    assert "refused to unpickle" in line and "collections.OrderedDict" in line


def test_pickles_own_unpicklers_never_see_a_files_bytes(tmp_path, monkeypatch):
    def forbidden(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("pickle's Unpickler was used")

    monkeypatch.setattr(pickle, "Unpickler", forbidden)
    monkeypatch.setattr(pickle, "_Unpickler", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    for path in torch_built(tmp_path).values():
        assert read_checkpoint(path).tensors
    for sample in ("healthy.pt", "lightning/last.ckpt", "traced_train.pt", "dcp/step-3"):
        full = os.path.join(REPO, "sample_models", sample)
        if os.path.exists(full):
            assert read_checkpoint(full).tensors, sample


def test_truncations_of_a_state_dicts_pickle_read_or_fail_in_one_line(tmp_path):
    data = real_pickle(tmp_path)
    for cut in range(0, len(data), 3):
        assert outcome(with_pickle(tmp_path, "cut", data[:cut]))[0] == "error"


def test_single_byte_changes_of_a_state_dicts_pickle_read_or_fail_in_one_line(tmp_path):
    data = real_pickle(tmp_path)
    rng = random.Random(25)
    for _ in range(300):
        at = rng.randrange(len(data))
        outcome(with_pickle(tmp_path, "changed", data[:at] + bytes([rng.randrange(256)]) + data[at + 1 :]))


@pytest.mark.slow
def test_a_torch_save_file_with_a_huge_memo_index_is_not_allocated(tmp_path):
    # LONG_BINPUT 0xFFFFFFF0: a memo kept as an array would be 64 GiB
    path = with_pickle(tmp_path, "memo", FORGED["huge_memo_index"])
    proc = run_in_4_gib(
        f"from bnaudit.formats.torchsave import read_torch_save\nprint(read_torch_save({path!r}, False).value)\n"
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
    with pytest.raises(BnauditError, match="a parameter of something that is not a tensor"):
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
    with pytest.raises(BnauditError, match=r"sets state on a Storage \(BUILD\)"):
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
    with pytest.raises(BnauditError, match=r"sets state on a tensor record \(BUILD\)"):
        read_checkpoint(str(forged_script(tmp_path, root)))  # was: read as 8 int8 values

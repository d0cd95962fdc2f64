"""TorchScript archives and torch.save zip records, read without torch and without pickle's code.

`read_torchscript` unpickles an archive's `data.pkl` with inert stand-ins for its
`__torch__` classes and resolves tensors to the zip records that hold their bytes; eps
and momentum come from the archive's code files (`Final` constants), since a scripted
BN module stores them there, and so do the normalisation operators each class calls
(a scripted module keeps only its class name: `class MyBN(nn.BatchNorm2d)` is `MyBN`,
whose code calls `torch.nn.functional.batch_norm`), which `bnaudit.normkinds` classifies by. `stored_tensors` finds where the top-level tensors of a
torch.save zip lie, so data files can be streamed row by row. A global that could run
code is refused: bnaudit never runs TorchScript to inspect it.
"""

from __future__ import annotations

import io
import math
import pickle
import re
import zipfile
from dataclasses import dataclass
from typing import Any

from bnaudit.errors import BnauditError
from bnaudit.formats.containers import real_or_none
from bnaudit.formats.model import (
    STORAGE_DTYPES,
    STORAGE_ITEMSIZE,
    ModuleInfo,
    TensorRef,
    claim_too_large,
    decode_values,
)
from bnaudit.formats.provenance import RECORD_KEY
from bnaudit.formats.safetensors import is_count
from bnaudit.formats.sniff import check_zip_sizes
from bnaudit.normkinds import constant_training_calls, norm_calls
from bnaudit.text import exception_line


class _ScriptObject:
    """An inert stand-in for a `__torch__.*` class: it only keeps its attributes."""

    qualname = "?"

    def __setstate__(self, state: Any) -> None:
        self.attrs = state if isinstance(state, dict) else {"__state__": state}


@dataclass(frozen=True)
class _StorageRef:
    entry: str
    dtype: str

    def __setstate__(self, state: Any) -> None:
        # a pickle's BUILD would name another record (frozen is no guard against it)
        raise TypeError("a storage record takes no pickled state")


class _RefusedGlobal(pickle.UnpicklingError):
    def __init__(self, name: str) -> None:
        super().__init__(f"refusing global {name}")
        self.name = name


# The pure-Python unpickler keeps its memo in a dict; the C one grows an array to
# the largest memo index the file names (LONG_BINPUT 2^32-1 -> 32 GiB of pointers).
class _ScriptUnpickler(pickle._Unpickler):
    def __init__(self, data: bytes, archive: zipfile.ZipFile, root: str) -> None:
        super().__init__(io.BytesIO(data))
        self.archive, self.root = archive, root
        self.classes: dict[str, type] = {}

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("__torch__"):
            qual = f"{module}.{name}"
            if qual not in self.classes:
                self.classes[qual] = type(name, (_ScriptObject,), {"qualname": qual})
            return self.classes[qual]
        if module == "torch" and name in STORAGE_DTYPES:
            return STORAGE_DTYPES[name]
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return self._rebuild_tensor
        if (module, name) == ("collections", "OrderedDict"):
            from collections import OrderedDict

            return OrderedDict
        if module == "torch.jit._pickle" and name.startswith("build_"):
            return lambda items: list(items)
        if (module, name) == ("torch.jit._pickle", "restore_type_tag"):
            return lambda value, _tag: value
        raise _RefusedGlobal(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> _StorageRef:
        if not (isinstance(pid, tuple) and len(pid) >= 3 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unexpected persistent id {str(pid)[:80]}")
        if pid[1] not in STORAGE_DTYPES.values() or not isinstance(pid[2], str):
            raise pickle.UnpicklingError(f"malformed storage record {str(pid)[:80]}")
        return _StorageRef(f"{self.root}/data/{pid[2]}", pid[1])

    def _rebuild_tensor(
        self, storage: _StorageRef, offset: int, size: tuple[int, ...], stride: tuple[int, ...], *_: Any
    ) -> TensorRef:
        check_tensor_record(storage, offset, size, stride, _StorageRef)
        archive = self.archive

        def read() -> list[float]:
            flat = decode_values(archive.read(storage.entry), storage.dtype)
            numel = math.prod(size)
            if numel == 0:
                return []
            if claim_too_large(numel, len(flat)):  # zero strides (x.expand(n)): the copy allocates the claim
                raise BnauditError(f"tensor claims {numel} elements, its storage {storage.entry} holds {len(flat)}")
            span = offset + sum((s - 1) * st for s, st in zip(size, stride)) + 1
            if offset < 0 or span > len(flat):
                raise BnauditError(f"tensor view runs past its storage {storage.entry}")
            index = [offset]
            for extent, step in zip(size, stride):  # row-major: the last dimension varies fastest
                index = [base + i * step for base in index for i in range(extent)]
            return [flat[i] for i in index]

        return TensorRef("", tuple(size), storage.dtype, read)


def check_tensor_record(storage: Any, offset: Any, size: Any, stride: Any, storage_type: type = object) -> None:
    """A pickled tensor record (storage, offset, size, stride) of well-formed types:
    checked before anything is read, since a negative or mismatched stride would read
    outside the storage."""
    if not (
        isinstance(storage, storage_type)
        and is_count(offset)
        and isinstance(size, tuple)
        and isinstance(stride, tuple)
        and len(size) == len(stride)
        and _all_counts(size + stride)
    ):
        raise pickle.UnpicklingError("malformed tensor record")


_INT = {int}


def _all_counts(values: tuple[Any, ...]) -> bool:
    """`is_count` of every value: a folder scan checks thousands of sizes and strides, so
    plain ints (all a pickle gives) are checked by type and minimum at C speed; anything
    else, one by one."""
    if set(map(type, values)) <= _INT:
        return not values or min(values) >= 0
    return all(is_count(x) for x in values)


class ArchiveUnpickler(_ScriptUnpickler):
    """The restricted unpickler of a zip archive's `data.pkl`, for readers built on it
    (formats/standins.py): storages become records of their zip entries, tensors lazy
    `TensorRef`s read from those entries, and every global outside the TorchScript set
    raises `pickle.UnpicklingError`."""


def open_archive_pickle(path: str, opened: zipfile.ZipFile | None = None) -> tuple[zipfile.ZipFile, str, bytes]:
    """(archive, root folder, bytes of `<root>/data.pkl`) of a torch zip archive, sizes checked;
    `opened`: the archive of `path` that `sniff.sniff_opening` parsed and checked, taken as is."""
    archive = opened
    if archive is None:
        archive = zipfile.ZipFile(path)
        check_zip_sizes(path, archive)
    entry = next(n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1)
    return archive, entry.split("/")[0], archive.read(entry)


@dataclass(frozen=True)
class StoredTensor:
    """Where a tensor of a torch.save zip archive lies: `start`, the file offset of its
    first element, when its storage is stored uncompressed and the tensor is laid out in
    C order (so that row i is the bytes [start + i * row, start + (i + 1) * row)); None
    otherwise."""

    dtype: str
    shape: tuple[int, ...]
    start: int | None


class _RecordUnpickler(_ScriptUnpickler):
    """Reads a torch.save pickle to the storage records of its tensors, nothing more."""

    def _rebuild_tensor(
        self, storage: _StorageRef, offset: int, size: tuple[int, ...], stride: tuple[int, ...], *_: Any
    ) -> Any:
        check_tensor_record(storage, offset, size, stride, _StorageRef)
        return (storage, offset, size, stride)


def stored_tensors(path: str) -> dict[str, StoredTensor]:
    """The top-level tensors of a torch.save zip archive holding a dict, by key, with where
    their bytes lie. Empty for anything else: the caller keeps torch.load's tensors."""
    try:
        archive = zipfile.ZipFile(path)
        entry = next(n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1)
        obj = _RecordUnpickler(archive.read(entry), archive, entry.split("/")[0]).load()
    except Exception:  # torch.load has read the file: anything unusual here just means no locations
        return {}
    if not isinstance(obj, dict):
        return {}
    found = {}
    for key, record in obj.items():
        if isinstance(key, str) and isinstance(record, tuple) and len(record) == 4:
            storage, offset, size, stride = record
            found[key] = StoredTensor(storage.dtype, size, _c_order_start(archive, storage, offset, size, stride))
    return found


def _c_order_start(
    archive: zipfile.ZipFile, storage: _StorageRef, offset: int, size: tuple[int, ...], stride: tuple[int, ...]
) -> int | None:
    expected: list[int] = []
    step = 1
    for extent in reversed(size):
        expected.insert(0, step)
        step *= extent
    if any(extent > 1 and st != want for extent, st, want in zip(size, stride, expected)):
        return None
    if archive.filename is None:  # opened from a file object: no path to reopen
        return None
    try:
        info = archive.getinfo(storage.entry)
        with open(archive.filename, "rb") as f:
            f.seek(info.header_offset)
            head = f.read(30)
    except (KeyError, OSError, TypeError):
        return None
    if info.compress_type != zipfile.ZIP_STORED or head[:4] != b"PK\x03\x04":
        return None
    itemsize = STORAGE_ITEMSIZE.get(storage.dtype, 0)
    if itemsize == 0 or (offset + math.prod(size)) * itemsize > info.file_size:
        return None
    names, extra = int.from_bytes(head[26:28], "little"), int.from_bytes(head[28:30], "little")
    return info.header_offset + 30 + names + extra + offset * itemsize


# The extra file of a TorchScript archive in which `recalibrate` keeps its record
# (`torch.jit.save(..., _extra_files=...)`; loading the archive ignores it).
RECORD_EXTRA_FILE = "bnaudit.json"
_MAX_RECORD_BYTES = 10_000_000


def script_metadata(path: str) -> dict[str, str]:
    """`{"bnaudit": record}` from the archive's `extra/bnaudit.json`, {} without one (or
    one too large or not UTF-8: the record is untrusted and only ever a note)."""
    try:
        with zipfile.ZipFile(path) as archive:
            entry = next(
                (n for n in archive.namelist() if n.count("/") == 2 and n.endswith(f"/extra/{RECORD_EXTRA_FILE}")), None
            )
            if entry is None or archive.getinfo(entry).file_size > _MAX_RECORD_BYTES:
                return {}
            return {RECORD_KEY: archive.read(entry).decode("utf-8")}
    except (OSError, ValueError, zipfile.BadZipFile):
        return {}


_MAX_SCRIPT_VISITS = 100_000


def read_torchscript(path: str) -> tuple[dict[str, TensorRef], dict[str, ModuleInfo]]:
    """Tensors and BN module settings of a TorchScript archive, without loading it."""
    try:
        archive = zipfile.ZipFile(path)
        check_zip_sizes(path, archive)
        entry = next(n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1)
        root = entry.split("/")[0]
        obj = _ScriptUnpickler(archive.read(entry), archive, root).load()
    except BnauditError:
        raise
    except _RefusedGlobal as exc:
        raise BnauditError(
            f"{path}: refused to unpickle the TorchScript archive: it needs a global that could run "
            f"code ({exc.name}); bnaudit never runs TorchScript to inspect it; a state dict or a "
            ".safetensors file is the safe format"
        ) from None
    except Exception as exc:  # forged bytes fail anywhere in the pickle machine
        raise BnauditError(f"{path}: unreadable TorchScript archive ({exception_line(exc, with_type=False)})") from None
    tensors: dict[str, TensorRef] = {}
    modules: dict[str, ModuleInfo] = {}
    classes = _ScriptClasses(archive, root)
    # A module may be shared (visited under each of its names, as state_dict does),
    # but a forged archive can nest shared nodes so that the paths double per level.
    budget = [_MAX_SCRIPT_VISITS]

    def walk(node: Any, prefix: str, depth: int) -> None:
        if depth > 200 or not isinstance(node, _ScriptObject):
            return
        budget[0] -= 1
        if budget[0] < 0:
            raise BnauditError(
                f"{path}: TorchScript archive names more than {_MAX_SCRIPT_VISITS} modules (forged nesting?)"
            )
        code = classes.of(node.qualname)
        attrs = {**code.constants, **getattr(node, "attrs", {})}
        cls = node.qualname.rsplit(".", 1)[-1]
        if "running_mean" in attrs or "track_running_stats" in attrs:
            eps, momentum = attrs.get("eps"), attrs.get("momentum")
            tracking = attrs.get("track_running_stats")
            training = attrs.get("training")
            constant = code.training_calls
            modules[prefix.rstrip(".")] = ModuleInfo(
                cls,
                real_or_none(eps),
                real_or_none(momentum),
                tracking if isinstance(tracking, bool) else None,
                momentum_known="momentum" in attrs and (momentum is None or real_or_none(momentum) is not None),
                calls=code.calls,
                training_mode=True if constant else None,
                training_reason=(
                    f"its TorchScript code calls {', '.join(constant)} with training=True as a constant "
                    "(traced in training mode? .eval() cannot switch it)"
                    if constant
                    else None
                ),
                saved_training=training if isinstance(training, bool) else None,
            )
        for name, value in attrs.items():
            if not isinstance(name, str):
                continue
            if isinstance(value, TensorRef):
                full = prefix + name
                tensors[full] = value.renamed(full)
            elif isinstance(value, _ScriptObject):
                walk(value, f"{prefix}{name}.", depth + 1)

    try:
        walk(obj, "", 0)
    except BnauditError:
        raise
    except Exception as exc:  # a damaged code file (bad CRC) or a forged attribute
        raise BnauditError(f"{path}: unreadable TorchScript archive ({exception_line(exc, with_type=False)})") from None
    return tensors, modules


@dataclass(frozen=True)
class _ScriptClass:
    constants: dict[str, Any]
    calls: tuple[str, ...]
    # BatchNorm operators its code calls with a literal training=True (normkinds.constant_training_calls)
    training_calls: tuple[str, ...] = ()


_NO_CLASS = _ScriptClass({}, ())


class _ScriptClasses:
    """What an archive's code files say of each class: its `Final` constants (eps,
    momentum, ...) and the normalisation operators its methods call.

    TorchScript compiles BatchNorm's eps and momentum into its code as
    `eps : Final[float] = 0.001`, and a BatchNorm's forward as a call of
    `__torch__.torch.nn.functional.batch_norm` (scripted) or `torch.batch_norm` (traced);
    the file is read as text, never executed.
    """

    _CLASS_RE = re.compile(r"^class (\w+)\(", re.MULTILINE)
    # [ \t] rather than \s, greedy rather than lazy: the code files come from the
    # archive, and \s+ spanning newlines backtracks quadratically on blank runs.
    _FINAL_RE = re.compile(r"^[ \t]+(\w+) : Final\[\w+\] = (.+)$", re.MULTILINE)

    def __init__(self, archive: zipfile.ZipFile, root: str) -> None:
        self.archive, self.root = archive, root
        self.cache: dict[str, dict[str, _ScriptClass]] = {}

    def of(self, qualname: str) -> _ScriptClass:
        module, _, cls = qualname.rpartition(".")
        if module not in self.cache:
            entry = f"{self.root}/code/{module.replace('.', '/')}.py"
            try:
                source = self.archive.read(entry).decode("utf-8", "replace")
            except KeyError:
                source = ""
            self.cache[module] = self._parse(source)
        return self.cache[module].get(cls, _NO_CLASS)

    def _parse(self, source: str) -> dict[str, _ScriptClass]:
        classes: dict[str, _ScriptClass] = {}
        starts = [(m.start(), m.group(1)) for m in self._CLASS_RE.finditer(source)]
        for i, (start, name) in enumerate(starts):
            end = starts[i + 1][0] if i + 1 < len(starts) else len(source)
            body = source[start:end]
            values: dict[str, Any] = {}
            for key, literal in self._FINAL_RE.findall(body):
                values[key] = _literal(literal.strip())
            classes[name] = _ScriptClass(values, norm_calls(body), constant_training_calls(body))
        return classes


def _literal(text: str) -> Any:
    if text == "None":
        return None
    if text in ("True", "False"):
        return text == "True"
    try:
        return float(text) if any(c in text for c in ".eE") or text in ("inf", "nan") else int(text)
    except ValueError:
        return text

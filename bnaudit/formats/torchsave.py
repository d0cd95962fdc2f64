"""torch.save files (zip and legacy) read without importing torch.

The file's main pickle goes through bnaudit's restricted unpickler (the stand-in one of
formats/standins.py, whose opcodes never call a class they do not know), with torch's
own rebuild functions replaced by readers of the file:

  torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)
                        a lazy `TensorRef`: only the bytes of the elements it spans,
                        [offset, offset + sum((size_i - 1) * stride_i) + 1) elements of
                        its storage, are read, and only when the tensor is read
  _rebuild_parameter, _rebuild_parameter_with_state
                        the tensor itself (what a state dict holds)
  ('storage', torch.FloatStorage, key, location, numel)
                        zip: the record `<root>/data/<key>` (its size bounds the
                        storage, whatever `numel` claims); legacy: the range
                        `legacy.legacy_layout` found
  torch.nn.modules.*    a `PickledModule` (class name and `__dict__` as data)
  _codecs.encode(text, "latin1")
                        the bytes protocol 2 pickles that way

Byte order: the zip's `byteorder` record ("little" when absent, as torch assumes), a
legacy file's `little_endian` entry; big-endian elements are swapped before decoding.
Any other torch global (quantized, sparse or nested tensors, torch.Size, dtypes,
storages of other types) raises `NeedsTorch`: the caller reads that file with
`torch.load` as before. A file that names globals outside the allow-list is left to the
stand-in reader, exactly as before.

A zip archive's plain state dict is first run by pickle's C unpickler, about eight times
faster, as a first try only (`_fast_load`): any opcode, global or event it does not mirror
exactly leaves the same bytes to the restricted unpickler, which decides as above.
"""

from __future__ import annotations

import _compat_pickle
import functools
import io
import os
import pickle
import re
import struct
import sys
import zipfile
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, ClassVar

from bnaudit.errors import BnauditError
from bnaudit.formats.legacy import LegacyLayout, legacy_layout, whole_model_refusal
from bnaudit.formats.model import STORAGE_DTYPES, STORAGE_ITEMSIZE, TensorRef
from bnaudit.formats.pickled import PickledModule
from bnaudit.formats.standins import (
    CalledStandIn,
    StandIn,
    StandInObject,
    StandInUnpickler,
    read_legacy_with_stand_ins,
    read_with_stand_ins,
)
from bnaudit.formats.torchscript import check_tensor_record, open_archive_pickle
from bnaudit.formats.views import Storage, lazy_tensor, storage_record
from bnaudit.text import exception_line

NN_MODULE_PREFIXES = ("torch.nn.modules.", "torch.ao.nn.", "torch.nn.intrinsic.", "torch.nn.quantized.")

# Globals torch.load(weights_only=True) rebuilds that this reader does not: files naming
# them are read by torch as before (besides every other `torch.*` name).
_TORCH_ONLY = {"builtins.bytearray", "builtins.complex", "collections.Counter"}


class NeedsTorch(Exception):  # a signal to the caller, not an error
    """The file names a global only torch rebuilds (`name`): read it with torch.load."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


class _ModuleClass:
    """A `torch.nn` class named by the file: instantiated only as a `PickledModule`."""

    def __init__(self, name: str) -> None:
        self.name = name


def _rebuild_parameter(data: Any, *rest: Any) -> Any:
    return data  # an nn.Parameter's tensor is what a state dict holds


def _codecs_encode(text: Any, encoding: Any = "utf-8", *rest: Any) -> bytes:
    # protocol 2 pickles bytes as _codecs.encode(str, "latin1"); nothing else is accepted
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1") or rest:
        raise pickle.UnpicklingError("_codecs.encode called with something other than latin1 text")
    return text.encode("latin1")


def check_storage_pid(pid: Any) -> None:
    """A persistent id of the form ('storage', dtype, key: str, location, numel, ...)."""
    if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage"):
        raise pickle.UnpicklingError(f"unexpected persistent id {str(pid)[:80]}")
    if pid[1] not in STORAGE_DTYPES.values() or not isinstance(pid[2], str):
        raise pickle.UnpicklingError(f"malformed storage record {str(pid)[:80]}")


# A zip archive's `data/<key>` record: (file offset of its bytes when stored uncompressed,
# else None; its size in bytes; its entry name).
_Record = tuple[int | None, int, str]


def _record_storage(path: str, records: dict[str, _Record], pid: Any) -> Storage:
    record = records.get(pid[2])
    if record is None:
        raise pickle.UnpicklingError(f"storage record data/{pid[2][:40]} is missing")
    start, nbytes, entry = record
    # the record, not the pickle's claim, bounds the storage (as torch's mmap does)
    return storage_record(path, pid[1], nbytes // STORAGE_ITEMSIZE[pid[1]], start, entry)


def _compat_name(module: str, name: str) -> tuple[str, str]:
    """The (module, name) a protocol 2 pickle's global means (Python 2 names mapped), as
    `_FreeUnpickler.find_class` maps them."""
    if (module, name) in _compat_pickle.NAME_MAPPING:
        module, name = _compat_pickle.NAME_MAPPING[(module, name)]
    return _compat_pickle.IMPORT_MAPPING.get(module, module), name


class _FreeUnpickler(StandInUnpickler):
    """The stand-in unpickler with torch's rebuild functions replaced (module docstring)."""

    def __init__(self, data: bytes, allowed: Callable[[str], Any], big_endian: bool) -> None:
        super().__init__(data, None, "", allowed)
        self.big_endian = big_endian
        self.rebuild_tensor = self._rebuild_tensor

    def find_class(self, module: str, name: str) -> Any:
        if self.proto < 3:
            if (module, name) in _compat_pickle.NAME_MAPPING:
                module, name = _compat_pickle.NAME_MAPPING[(module, name)]
            module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        full = f"{module}.{name}"
        if full == "torch._utils._rebuild_tensor_v2":
            return self.rebuild_tensor
        if full in ("torch._utils._rebuild_parameter", "torch._utils._rebuild_parameter_with_state"):
            return _rebuild_parameter
        if full == "_codecs.encode":
            return _codecs_encode
        if module == "torch" and name in STORAGE_DTYPES:
            return STORAGE_DTYPES[name]
        if full.startswith(NN_MODULE_PREFIXES) and name.isidentifier():
            return _ModuleClass(full)
        if module == "torch" or module.startswith("torch.") or full in _TORCH_ONLY:
            raise NeedsTorch(full)
        return super().find_class(module, name)

    def storage(self, pid: Any) -> Storage:
        raise NotImplementedError

    def persistent_load(self, pid: Any) -> Any:
        check_storage_pid(pid)
        return self.storage(pid)

    def _rebuild_tensor(self, storage: Any, offset: Any, size: Any, stride: Any, *_: Any) -> TensorRef:
        check_tensor_record(storage, offset, size, stride, Storage)
        return lazy_tensor(storage, offset, size, stride, self.big_endian)

    def load_reduce(self) -> None:
        # pickle's REDUCE with the stand-in reader's refusal inlined: a torch.save pickle is
        # mostly REDUCEs, and each level of calls costs start-up in a folder scan
        stack = self.stack
        args = stack.pop()
        func = stack[-1]
        if isinstance(func, _ModuleClass):  # calling an nn class: torch's loader decides
            raise NeedsTorch(func.name)
        if isinstance(func, (StandIn, StandInObject)):
            raise CalledStandIn(func.name)
        stack[-1] = func(*args)

    def load_newobj(self) -> None:
        if isinstance(self.stack[-2], _ModuleClass):
            args = self.stack.pop()
            cls = self.stack.pop()
            if args != ():
                raise NeedsTorch(cls.name)
            self.append(PickledModule(cls.name))  # type: ignore[attr-defined]
            return
        super().load_newobj()

    def load_build(self) -> None:
        if isinstance(self.stack[-2], _ModuleClass):
            raise NeedsTorch(self.stack[-2].name)
        if isinstance(self.stack[-2], PickledModule):
            state = self.stack.pop()
            if not isinstance(state, dict):
                raise pickle.UnpicklingError(f"state of {self.stack[-1].class_name} is not a dict")
            self.stack[-1].state = state
            return
        super().load_build()

    def _instantiate(self, klass: Any, args: Any) -> None:
        if isinstance(klass, _ModuleClass):
            raise NeedsTorch(klass.name)
        super()._instantiate(klass, args)

    dispatch: ClassVar[dict[int, Callable[[Any], None]]] = dict(StandInUnpickler.dispatch)
    dispatch[pickle.REDUCE[0]] = load_reduce
    dispatch[pickle.NEWOBJ[0]] = load_newobj
    dispatch[pickle.BUILD[0]] = load_build


class _ZipUnpickler(_FreeUnpickler):
    def __init__(
        self, data: bytes, allowed: Callable[[str], Any], big_endian: bool, path: str, records: dict[str, _Record]
    ) -> None:
        super().__init__(data, allowed, big_endian)
        self.path, self.records = path, records

    def storage(self, pid: Any) -> Storage:
        return _record_storage(self.path, self.records, pid)


class _LegacyUnpickler(_FreeUnpickler):
    def __init__(self, layout: LegacyLayout, allowed: Callable[[str], Any], path: str) -> None:
        super().__init__(layout.pickle, allowed, layout.byteorder == "big")
        self.path, self.layout = path, layout

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and pid and pid[0] == "module":
            raise whole_model_refusal(self.path)
        if isinstance(pid, tuple) and len(pid) > 5 and pid[5] is not None:
            raise NeedsTorch("a storage view (torch < 0.4)")
        return super().persistent_load(pid)

    def storage(self, pid: Any) -> Storage:
        found = self.layout.storages.get(str(pid[2]))
        if found is None or found.dtype != pid[1]:
            raise pickle.UnpicklingError(f"malformed storage record {str(pid)[:80]}")
        return storage_record(self.path, found.dtype, found.numel, found.offset)


_HEADER_PAGE = 4096
# a zip local header's signature, file name length and extra field length
_LOCAL_HEADER = struct.Struct("<4s22xHH").unpack_from


def _zip_records(
    path: str, archive: zipfile.ZipFile, root: str, base: int = 0, end: int | None = None
) -> tuple[dict[str, _Record], bool]:
    """The `data/<key>` records of a torch zip archive by key and whether its
    byte order is big-endian; an archive stored inside `path` lies at [base, end)."""
    records: dict[str, _Record] = {}
    prefix = f"{root}/data/"
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size if end is None else end
        # local headers are read a page at a time: the records of a BN layer's five small
        # tensors lie within one, and a header the page holds whole is the same 30 bytes
        page_start, page = 0, b""
        for info in archive.infolist():
            if not info.filename.startswith(prefix):
                continue
            start = None
            if info.compress_type == zipfile.ZIP_STORED and not info.flag_bits & 0x1:
                position = base + info.header_offset
                at = position - page_start
                if not (at >= 0 and at + 30 <= len(page)):
                    page_start, page, at = position, os.pread(fd, _HEADER_PAGE, position), 0
                if at + 30 <= len(page):
                    signature, names, extra = _LOCAL_HEADER(page, at)
                else:  # the file ends inside the header: what a short read of it gives
                    head = page[at:]
                    signature, names = head[:4], int.from_bytes(head[26:28], "little")
                    extra = int.from_bytes(head[28:30], "little")
                if signature == b"PK\x03\x04":
                    start = position + 30 + names + extra
                    if start + info.file_size > size:
                        raise BnauditError(f"{path}: zip record '{info.filename}' runs past the end of the file")
            key = info.filename[len(prefix) :]
            records[key] = (start, info.file_size, info.filename)
    finally:
        os.close(fd)
    order = f"{root}/byteorder"
    try:
        byteorder = archive.read(order)
    except KeyError:  # absent: torch assumes little-endian
        byteorder = b"little"
    if byteorder not in (b"little", b"big"):
        raise BnauditError(f"{path}: unknown byte order {byteorder[:20]!r} in the archive")
    return records, byteorder == b"big"


# The fast path: a first try at a plain torch.save state dict with pickle's C unpickler,
# about eight times faster than the pure-Python restricted one, which stays the only judge.
# It runs only a pickle `_plain_pickle` accepts (protocol 2 opcodes that build containers,
# call, get and put; nothing that instantiates a class), resolves only torch's tensor
# rebuilds, storages, OrderedDict and latin1 bytes, and any other global, any error at all
# abandons it: the restricted unpickler then reads the same bytes from the start.

# A run of the accepted opcodes whose arguments have a fixed length (GLOBAL's two lines
# too), matched at C speed. LONG_BINPUT only below 2**18: the C unpickler grows its memo
# array to twice the largest index a file names (2**32 - 1 would zero 64 GiB), so at most
# 4 MiB here; a file with more memo entries is left to the restricted unpickler. Each
# opcode byte starts one alternative only, so the run is the same without backtracking
# (`*+`: the engine keeps no backtracking state, a tenth faster); the most frequent first.
_FIXED_RUN = re.compile(
    rb"(?:[Kqh].|r..[\x00-\x03]\x00|[()}\]t\x85\x86\x87N\x88\x89RQsuaeb]|M..|[Jj]....|G.{8}"
    rb"|c[^\n]*\n[^\n]*\n)*+",
    re.DOTALL,
)


_UINT4 = struct.Struct("<I").unpack_from


def _plain_pickle(data: bytes) -> bool:
    """`data` is PROTO 2, then opcodes of `_FIXED_RUN` and BINUNICODE strings only, up to a
    STOP. Each opcode is read exactly as the unpickler reads it (its argument's length
    fixed by the opcode), so the C unpickler runs no other opcode and no larger memo."""
    if type(data) is bytes and len(data) <= _REMEMBERED_BYTES:
        return _remembered_scan(data)
    return _scan(data)


def _scan(data: bytes) -> bool:
    """`_plain_pickle`'s scan."""
    if data[:2] != b"\x80\x02":
        return False
    pos, end = 2, len(data)
    match = _FIXED_RUN.match
    while True:
        pos = match(data, pos).end()  # type: ignore[union-attr]  # `*` always matches
        if pos + 5 > end or data[pos] != 0x58:  # not a whole BINUNICODE header: STOP or nothing
            return pos < end and data[pos] == 0x2E
        pos += 5 + _UINT4(data, pos + 1)[0]
        if pos > end:
            return False


# The checkpoints of one model saved alike (a folder of epochs, of seeds) share one pickle,
# byte for byte: the scan, a function of the bytes alone, is remembered for the last few
# small ones (at most 16 x 256 KiB held), found again by hash and comparison at C speed.
_REMEMBERED_BYTES = 1 << 18
_remembered_scan = functools.lru_cache(maxsize=16)(_scan)


class _Abandon(Exception):  # a signal: the restricted unpickler reads the file instead
    pass


class _FastFunction:
    """A function the fast path hands to the pickle: it takes no pickled state (C
    pickle's BUILD would set attributes of the function)."""

    __slots__ = ()

    def __setstate__(self, state: Any) -> None:
        raise _Abandon("BUILD on a function")


class _FastRebuild(_FastFunction):
    """torch's `_rebuild_tensor_v2`: a lazy `TensorRef`, as `_FreeUnpickler` builds it."""

    __slots__ = ("big_endian",)

    def __init__(self, big_endian: bool) -> None:
        self.big_endian = big_endian

    def __call__(self, storage: Any, offset: Any, size: Any, stride: Any, *_: Any) -> TensorRef:
        check_tensor_record(storage, offset, size, stride, Storage)
        return lazy_tensor(storage, offset, size, stride, self.big_endian)


class _FastCall(_FastFunction):
    """`_rebuild_parameter` or `_codecs.encode`, as `_FreeUnpickler` resolves them."""

    __slots__ = ("function",)

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function

    def __call__(self, *args: Any) -> Any:
        return self.function(*args)


class _FastZipUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, path: str, records: dict[str, _Record], calls: dict[str, Any]) -> None:
        # buffered: with `peek` the C unpickler takes the bytes in large chunks, not through a
        # Python-level read() call per opcode (a third of the time of the whole load)
        super().__init__(io.BufferedReader(io.BytesIO(data)))
        self.path, self.records, self.calls = path, records, calls

    def find_class(self, module: str, name: str) -> Any:
        module, name = _compat_name(module, name)  # protocol 2: `_plain_pickle` checked it
        found = self.calls.get(f"{module}.{name}")
        if found is not None:
            return found
        if module == "torch" and name in STORAGE_DTYPES:
            return STORAGE_DTYPES[name]
        raise _Abandon(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        check_storage_pid(pid)
        return _record_storage(self.path, self.records, pid)


def _fast_load(data: bytes, path: str, records: dict[str, _Record], big_endian: bool) -> tuple[bool, Any]:
    """(True, the object `data` pickles) when the fast path reads it exactly as the
    restricted unpickler would; (False, None) when that one must read it."""
    count = getattr(sys, "getrefcount", None)  # CPython's; elsewhere the restricted unpickler reads
    if count is None or not _plain_pickle(data):
        return False, None
    parameter = _FastCall(_rebuild_parameter)
    functions = (_FastRebuild(big_endian), parameter, _FastCall(_codecs_encode))
    calls: dict[str, Any] = {
        "torch._utils._rebuild_tensor_v2": functions[0],
        "torch._utils._rebuild_parameter": parameter,
        "torch._utils._rebuild_parameter_with_state": parameter,
        "_codecs.encode": functions[2],
        "collections.OrderedDict": OrderedDict,  # the class itself, as the restricted unpickler gives it
    }
    held = [count(f) for f in functions]
    try:
        obj = _FastZipUnpickler(data, path, records, calls).load()  # freed here, with its memo
    except Exception:
        return False, None
    # a function kept as data would not be the restricted unpickler's own: more references
    # to one than before say the object holds it
    if [count(f) for f in functions] != held:
        return False, None
    return True, obj


def read_torch_free(
    path: str, legacy: bool, allowed: Callable[[str], Any], stand_ins: bool, opened: zipfile.ZipFile | None = None
) -> Any:
    """The object a torch.save file holds, tensors as lazy `TensorRef`s, torch.nn modules as
    `PickledModule`s, without importing torch.

    `allowed` gives the plain-data globals rebuilt for real (allowlist.py's policy). A file
    naming other globals: with `stand_ins`, read by the stand-in reader as before; without,
    `NeedsTorch` (torch's loader refuses it, listing them). Raises `NeedsTorch` for a file
    only torch's loader rebuilds. `opened`: the zip archive of `path` just sniffed (the
    caller closes it).
    """
    unpickler: _FreeUnpickler
    called = False
    try:
        if legacy:
            layout = legacy_layout(path)
            unpickler = _LegacyUnpickler(layout, allowed, path)
        else:
            archive, root, data = open_archive_pickle(path, opened)
            try:
                records, big = _zip_records(path, archive, root)
            finally:
                if archive is not opened:
                    archive.close()
            fast, obj = _fast_load(data, path, records, big)
            if fast:
                return obj
            unpickler = _ZipUnpickler(data, allowed, big, path, records)
        obj = unpickler.load()
    except (BnauditError, NeedsTorch):
        raise
    except CalledStandIn:  # the stand-in reader refuses it, naming the global
        obj, called = None, True
    except Exception as exc:  # forged bytes fail anywhere in the pickle machine
        raise BnauditError(f"{path}: not a readable torch.save file ({exception_line(exc, with_type=False)})") from None
    if called or unpickler.stand_ins:
        if not stand_ins:
            raise NeedsTorch(next(iter(unpickler.stand_ins), "a global"))
        if legacy:
            return read_legacy_with_stand_ins(path, legacy_layout(path), allowed)
        return read_with_stand_ins(path, allowed)
    return obj


class _Window(io.RawIOBase):
    """Bytes [start, start + length) of an open file as a file of their own (zipfile reads
    an archive stored inside a larger file through it)."""

    def __init__(self, f: Any, start: int, length: int) -> None:
        super().__init__()
        self.f, self.start, self.length, self.position = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = 0) -> int:
        origin = {0: 0, 1: self.position, 2: self.length}[whence]
        self.position = max(0, origin + offset)
        return self.position

    def readinto(self, buffer: Any) -> int:
        count = max(0, min(len(buffer), self.length - self.position))
        self.f.seek(self.start + self.position)
        data = self.f.read(count)
        buffer[: len(data)] = data
        self.position += len(data)
        return len(data)


def read_stored_tensor(path: str, start: int, length: int) -> TensorRef:
    """The one tensor a torch.save zip archive stored at bytes [start, start + length) of
    `path` holds (a torch.distributed.checkpoint chunk: formats/dcp.py), its elements read
    lazily from `path` like any torch.save file's. Only tensor records are rebuilt: any other
    global, anything but one tensor, a compressed record or one past the range is one line."""
    where = f"{path}: torch.save archive at bytes {start}..{start + length}"
    try:
        with open(path, "rb") as f:
            archive = zipfile.ZipFile(io.BufferedReader(_Window(f, start, length)))
            for info in archive.infolist():
                if info.file_size > length:
                    raise BnauditError(f"{where}: entry '{info.filename}' claims more bytes than the archive holds")
            entry = next(n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1)
            root = entry.split("/")[0]
            records, big = _zip_records(path, archive, root, base=start, end=start + length)
            if any(start is None for start, _, _ in records.values()):
                raise BnauditError(f"{where}: a compressed tensor record (torch.save never writes one)")
            unpickler = _ZipUnpickler(archive.read(entry), lambda name: None, big, path, records)
            obj = unpickler.load()
    except BnauditError:
        raise
    except NeedsTorch as exc:
        raise BnauditError(f"{where}: names {exc.name}, which a stored tensor never needs") from None
    except Exception as exc:  # forged bytes fail anywhere in zipfile or the pickle machine
        raise BnauditError(f"{where}: unreadable ({exception_line(exc, with_type=False)})") from None
    if unpickler.stand_ins or not isinstance(obj, TensorRef):
        raise BnauditError(f"{where}: holds {type(obj).__name__}, not one tensor")
    return obj

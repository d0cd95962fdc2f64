"""torch.save files (zip and legacy) read without importing torch.

A zip archive's `<root>/data.pkl` (a legacy file's main pickle: formats/legacy.py) is read
once, by the restricted unpickler (formats/unpickle.py, `Mode.TORCH_SAVE`), with torch's
storages resolved here to the zip records that hold their bytes:

  ('storage', torch.FloatStorage, key, location, numel)
                        the record `<root>/data/<key>`: its size, not the pickle's `numel`,
                        bounds the storage (as torch's mmap does), read only in the ranges
                        the tensors audited span
  torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)
                        a lazy `TensorRef` (formats/views.py)

Byte order: the zip's `byteorder` record ("little" when absent, as torch assumes);
big-endian elements are swapped before decoding. `read_stored` reads a torch.save archive
stored inside another file (a torch.distributed.checkpoint chunk) the same way, in
`Mode.TENSORS`.
"""

from __future__ import annotations

import io
import os
import struct
import zipfile
from typing import Any

from bnaudit.errors import BnauditError
from bnaudit.formats.allowed import CalledStandIn, Mode, Refused, RefusedGlobal, Storages
from bnaudit.formats.legacy import read_legacy
from bnaudit.formats.model import TensorRef
from bnaudit.formats.sniff import check_zip_sizes
from bnaudit.formats.standins import called_refusal, unsafe_globals_error
from bnaudit.formats.unpickle import Unpickled, unpickle
from bnaudit.formats.views import ITEMSIZE, Storage, storage_record
from bnaudit.text import shown_value

# A zip archive's `data/<key>` record: (file offset of its bytes when stored uncompressed,
# else None; its size in bytes; its entry name).
_Record = tuple[int | None, int, str]


class ZipStorages(Storages):
    """The storages of a torch zip archive (or a TorchScript one): the records `data/<key>`."""

    def __init__(self, path: str, records: dict[str, _Record], big_endian: bool) -> None:
        self.path, self.records, self.big_endian = path, records, big_endian

    def storage(self, dtype: str, key: str, numel: int, view: Any) -> Storage:
        record = self.records.get(key)
        if record is None:
            raise Refused(f"storage record data/{shown_value(key, 40)} is missing")
        start, nbytes, entry = record
        # the record, not the pickle's claim, bounds the storage (as torch's mmap does)
        return storage_record(self.path, dtype, nbytes // ITEMSIZE[dtype], start, entry)


def open_archive_pickle(path: str, opened: zipfile.ZipFile | None = None) -> tuple[zipfile.ZipFile, str, bytes]:
    """(archive, root folder, bytes of `<root>/data.pkl`) of a torch zip archive, sizes checked;
    `opened`: the archive of `path` that `sniff.sniff_opening` parsed and checked, taken as is."""
    archive = opened
    if archive is None:
        archive = zipfile.ZipFile(path)
        check_zip_sizes(path, archive)
    entry = next(n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1)
    return archive, entry.split("/")[0], archive.read(entry)


_HEADER_PAGE = 4096
# a zip local header's signature, file name length and extra field length
_LOCAL_HEADER = struct.Struct("<4s22xHH").unpack_from


def zip_records(
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


def read_torch_save(
    path: str, legacy: bool, mode: Mode = Mode.TORCH_SAVE, opened: zipfile.ZipFile | None = None
) -> Unpickled:
    """What a torch.save file holds, read once by the restricted unpickler in `mode`
    (`Mode.TORCH_SAVE`, or `Mode.TENSORS` for a data file): tensors as lazy `TensorRef`s,
    torch.nn modules as `PickledModule`s, other globals as stand-ins (`.stand_ins`). A
    pickle that calls a stand-in, or names a global `mode` refuses, is refused naming it;
    any other refusal or damage is one line. `opened`: the zip archive of `path` just
    sniffed (the caller closes it)."""
    try:
        if legacy:
            return read_legacy(path, mode)
        archive, root, data = open_archive_pickle(path, opened)
        try:
            records, big = zip_records(path, archive, root)
        finally:
            if archive is not opened:
                archive.close()
        return unpickle(data, mode, ZipStorages(path, records, big))
    except BnauditError:
        raise
    except CalledStandIn as exc:
        raise called_refusal(path, exc.name) from None
    except RefusedGlobal as exc:
        raise unsafe_globals_error(path, [exc.name]) from None
    except Refused as exc:
        raise BnauditError(f"{path}: not a readable torch.save file ({exc})") from None
    except Exception as exc:  # zipfile on forged bytes: BadZipFile, EOFError, zlib.error, ...
        raise BnauditError(f"{path}: not a readable torch.save file ({type(exc).__name__})") from None


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


def read_stored(path: str, start: int, length: int) -> Any:
    """The object a torch.save zip archive stored at bytes [start, start + length) of `path`
    holds (a torch.distributed.checkpoint chunk or object: formats/dcp.py), read in
    `Mode.TENSORS` (tensors and plain containers only), tensors lazy views of `path`. Any
    other global, a compressed record or one past the range is one line."""
    where = f"{path}: torch.save archive at bytes {start}..{start + length}"
    try:
        with open(path, "rb") as f:
            archive = zipfile.ZipFile(io.BufferedReader(_Window(f, start, length)))
            for info in archive.infolist():
                if info.file_size > length:
                    raise BnauditError(f"{where}: entry '{info.filename}' claims more bytes than the archive holds")
            entry = next(n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1)
            root = entry.split("/")[0]
            records, big = zip_records(path, archive, root, base=start, end=start + length)
            if any(start is None for start, _, _ in records.values()):
                raise BnauditError(f"{where}: a compressed tensor record (torch.save never writes one)")
            return unpickle(archive.read(entry), Mode.TENSORS, ZipStorages(path, records, big)).value
    except BnauditError:
        raise
    except RefusedGlobal as exc:
        raise BnauditError(f"{where}: names {exc.name}, which a stored tensor or plain object never needs") from None
    except Refused as exc:
        raise BnauditError(f"{where}: unreadable ({exc})") from None
    except Exception as exc:  # forged bytes fail anywhere in zipfile
        raise BnauditError(f"{where}: unreadable ({type(exc).__name__})") from None


def read_stored_tensor(path: str, start: int, length: int) -> TensorRef:
    """`read_stored` of an archive that must hold one tensor."""
    obj = read_stored(path, start, length)
    if not isinstance(obj, TensorRef):
        raise BnauditError(
            f"{path}: torch.save archive at bytes {start}..{start + length}: holds {type(obj).__name__}, not one tensor"
        )
    return obj

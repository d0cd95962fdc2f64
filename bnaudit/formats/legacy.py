"""Legacy (pre-1.6) torch.save files, checked before torch reads them.

torch's legacy loader allocates every storage at the size its pickle claims before it
reads the bytes, so a tiny forged file can ask for terabytes. `check_legacy_claims`
walks the file's pickles with inert classes (nothing named in the file is imported or
called) and refuses it when the storages claim more bytes than follow the header. A
plain pickle is reported as `NotTorchSave` with the globals it names; which of those
would run code is decided by the allow-list (allowlist.py), not here.
"""

from __future__ import annotations

import io
import os
import pickle
from dataclasses import dataclass
from typing import Any

from bnaudit.errors import BnauditError
from bnaudit.formats.model import STORAGE_DTYPES, STORAGE_ITEMSIZE
from bnaudit.text import exception_line

# torch.serialization.MAGIC_NUMBER: the first pickle of every legacy torch.save file.
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C


class _Inert:
    """Stands for every class a scanned pickle names: takes anything, does nothing."""

    def __new__(cls, *args: Any, **kwargs: Any) -> _Inert:
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, item: Any) -> None:
        pass

    def extend(self, items: Any) -> None:
        pass


@dataclass(frozen=True)
class _StorageType:
    dtype: str


class _StrictReader:
    """A file as a pickle reads it; asking for bytes past the end is a forged length.

    pickle trusts the lengths in its opcodes and asks for that many bytes at once,
    so a 2^32-byte string claimed by a tiny file would be allocated before the
    short read is noticed.
    """

    def __init__(self, file: io.BufferedReader, size: int) -> None:
        self.file, self.size = file, size

    def read(self, n: int | None = -1) -> bytes:
        remaining = self.size - self.file.tell()
        if n is None or n < 0:
            n = remaining
        if n > remaining:
            raise pickle.UnpicklingError(f"a record claims {n} bytes, only {remaining} remain")
        return self.file.read(n)

    def readinto(self, buffer: Any) -> int:
        if len(buffer) > self.size - self.file.tell():
            raise pickle.UnpicklingError("a record runs past the end of the file")
        return self.file.readinto(buffer)

    def readline(self) -> bytes:
        return self.file.readline()


class _LegacyScanner(pickle._Unpickler):  # the pure-Python unpickler: its memo is a dict
    """Walks a legacy torch.save pickle with inert classes to collect its storage claims.

    Nothing named in the file is imported or called: every global becomes `_Inert`
    and every storage becomes a record of (key, bytes claimed).
    """

    def __init__(self, file: Any) -> None:
        super().__init__(file)
        self.claims: dict[str, int] = {}
        self.dtypes: dict[str, str] = {}
        self.globals: list[str] = []  # every global named, in order: a refusal names them

    def find_class(self, module: str, name: str) -> Any:
        self.globals.append(f"{module}.{name}")
        if module == "torch" and name in STORAGE_DTYPES:
            return _StorageType(STORAGE_DTYPES[name])
        return _Inert

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage":
            storage_type, key, numel = pid[1], pid[2], pid[4]
            itemsize = STORAGE_ITEMSIZE.get(getattr(storage_type, "dtype", ""), 1)
            if not isinstance(numel, int) or isinstance(numel, bool) or numel < 0:
                raise pickle.UnpicklingError(f"storage {key!r} has an invalid size {numel!r}")
            self.claims[str(key)] = max(self.claims.get(str(key), 0), numel * itemsize)
            self.dtypes[str(key)] = getattr(storage_type, "dtype", "")
        return _Inert  # also stands for a class a ('module', ...) id names


class NotTorchSave(BnauditError):
    """A plain pickle where a legacy torch.save file was expected.

    `globals` lists every global the pickle names, in order: the caller, which owns the
    allow-list, says which of them would run code.
    """

    def __init__(self, path: str, globals_named: list[str]) -> None:
        super().__init__(f"{path}: a pickle, but not one written by torch.save")
        self.globals = globals_named


def check_legacy_claims(path: str) -> None:
    """Refuse a legacy torch.save file whose storages claim more bytes than it holds.

    torch's legacy loader allocates each storage at the size the pickle claims
    before it reads the data, so the claims are checked against the file first:
    the storages' bytes (plus an 8-byte length each) must fit after the pickles.
    """
    import tarfile

    if tarfile.is_tarfile(path):  # torch < 0.4 tar format: read by a loader that trusts its sizes
        raise BnauditError(f"{path}: tar-format torch.save file (PyTorch < 0.4) is not supported")
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            reader = _StrictReader(f, size)
            # Every pickle of the file goes through the scanner, the first one too:
            # a plain pickle (not torch.save) puts its payload right there.
            first = _LegacyScanner(reader)
            if first.load() != _LEGACY_MAGIC:
                raise NotTorchSave(path, first.globals)
            for _ in range(2):  # protocol version, sys info
                _LegacyScanner(reader).load()
            scanner = _LegacyScanner(reader)
            scanner.load()
            keys = _LegacyScanner(reader).load()
            data_size = size - f.tell()
    except BnauditError:
        raise
    except Exception as exc:  # any parse failure of forged bytes
        raise BnauditError(f"{path}: damaged torch.save file ({exception_line(exc, with_type=False)})") from None
    if not isinstance(keys, list):
        raise BnauditError(f"{path}: damaged torch.save file (no storage list)")
    claimed = sum(scanner.claims.values()) + 8 * len(scanner.claims)
    if claimed > data_size:
        raise BnauditError(
            f"{path}: storages claim {claimed} bytes but only {data_size} follow the header: truncated or forged file"
        )


@dataclass(frozen=True)
class LegacyStorage:
    """Where a storage of a legacy torch.save file lies: its elements start at byte
    `offset` (after the 8-byte count), `numel` of them, of `dtype`."""

    offset: int
    dtype: str
    numel: int

    def __setstate__(self, state: Any) -> None:
        # a pickle's BUILD would move the range read (frozen is no guard against it)
        raise TypeError("a storage record takes no pickled state")


@dataclass(frozen=True)
class LegacyLayout:
    """A legacy torch.save file taken apart without running it: the bytes of its main
    pickle, its storages by key, and every global the main pickle names."""

    pickle: bytes
    storages: dict[str, LegacyStorage]
    globals: list[str]
    byteorder: str = "little"


def legacy_layout(path: str) -> LegacyLayout:
    """The layout of a legacy torch.save file whose claims `check_legacy_claims` accepts.

    After the pickles come the storages in the order of the key list, each as an 8-byte
    element count and that many elements, both in the byte order of the machine that
    saved it (the sys info's `little_endian`); each count is checked against the claim
    and the file's end.
    """
    check_legacy_claims(path)
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            reader = _StrictReader(f, size)
            for _ in range(2):  # magic, protocol version
                _LegacyScanner(reader).load()
            info = _LegacyScanner(reader).load()
            big = isinstance(info, dict) and info.get("little_endian") is False
            start = f.tell()
            scanner = _LegacyScanner(reader)
            scanner.load()
            end = f.tell()
            keys = _LegacyScanner(reader).load()
            position = f.tell()
            f.seek(start)
            main = f.read(end - start)
            storages: dict[str, LegacyStorage] = {}
            for key in keys if isinstance(keys, list) else []:
                f.seek(position)
                count = int.from_bytes(f.read(8), "big" if big else "little", signed=True)
                dtype = scanner.dtypes.get(str(key), "")
                itemsize = STORAGE_ITEMSIZE.get(dtype, 0)
                if count < 0 or itemsize == 0 or position + 8 + count * itemsize > size:
                    raise BnauditError(f"{path}: damaged torch.save file (storage {str(key)[:40]!r} runs past the end)")
                storages[str(key)] = LegacyStorage(position + 8, dtype, count)
                position += 8 + count * itemsize
    except BnauditError:
        raise
    except Exception as exc:  # any parse failure of forged bytes
        raise BnauditError(f"{path}: damaged torch.save file ({exception_line(exc, with_type=False)})") from None
    return LegacyLayout(main, storages, scanner.globals, "big" if big else "little")


def whole_model_refusal(path: str) -> BnauditError:
    """The refusal of a pre-1.6 whole-model pickle (its classes' source code inside)."""
    return BnauditError(
        f"{path}: a legacy (pre-1.6) whole-model pickle cannot be read without running "
        "its code; if you trust this file, pass --trust-pickle; safer still, save a "
        "state dict or a .safetensors file"
    )

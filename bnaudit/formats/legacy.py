"""Legacy (pre-1.6) torch.save files, read without torch in one pass over their pickles.

A legacy file is five pickles in a row, then the storages' bytes:

  magic number, protocol version, sys info  plain data (`Mode.PLAIN`: no global at all);
                                 sys info's `little_endian` gives the byte order
  the object                     read in the caller's mode; each persistent id
                                 ('storage', type, key, location, numel, view) makes a
                                 storage of `numel` claimed elements, its place unknown yet
                                 (a view, torch < 0.4: elements [offset, offset + size) of
                                 its root storage)
  the storage keys               plain data: the order in which the storages follow

then, per key, an 8-byte element count in the file's byte order and the elements. torch's
legacy loader allocates each storage at the size the pickle claims before it reads it: here
the claims are checked against the bytes that follow first (their sum, then each count equal
to its claim, as torch's loader checks, and inside the file), and only then are the storages
placed; nothing is read until an audit asks for a tensor. A first pickle that is not the
magic number is no torch.save file: `NotTorchSave` names the globals it would need (read by
the same unpickler in `Mode.SCAN`, nothing run).
"""

from __future__ import annotations

import mmap
import os
from typing import Any, Literal

from bnaudit.errors import BnauditError
from bnaudit.formats.allowed import Mode, Refused, Storages, torch_save_allows
from bnaudit.formats.standins import unsafe_globals_error
from bnaudit.formats.unpickle import Unpickled, unpickle
from bnaudit.formats.views import ITEMSIZE, Storage, place_storage, storage_record
from bnaudit.text import shown_value

# torch.serialization.MAGIC_NUMBER: the first pickle of every legacy torch.save file.
LEGACY_MAGIC = 0x1950A86A20F9469CFC6C


class NotTorchSave(BnauditError):
    """A plain pickle where a legacy torch.save file was expected; `globals` lists every
    global the pickle names, in order."""

    def __init__(self, path: str, globals_named: list[str]) -> None:
        unsafe = [name for name in globals_named if not torch_save_allows(name)]
        # say what it would have run, and what to do instead
        refusal = str(unsafe_globals_error(path, unsafe)).removeprefix(f"{path}: ") if unsafe else ""
        super().__init__(f"{path}: a pickle, but not one written by torch.save" + (f"; {refusal}" if refusal else ""))
        self.globals = globals_named


class _LegacyStorages(Storages):
    """Storages of a legacy file: made at their claimed size while the object is read,
    placed once the storage keys say in which order they follow (`place`)."""

    def __init__(self, path: str, big_endian: bool) -> None:
        self.path, self.big_endian = path, big_endian
        self.roots: dict[str, Storage] = {}
        self.views: list[tuple[Storage, Storage, int]] = []

    def module(self, pid: tuple[Any, ...]) -> Any:
        raise whole_model_refusal(self.path)

    def storage(self, dtype: str, key: str, numel: int, view: Any) -> Storage:
        root = self.roots.get(key)
        if root is None:
            root = self.roots[key] = storage_record(self.path, dtype, numel, -1)
        elif root.dtype != dtype or root.numel != numel:
            raise Refused(f"storage {shown_value(key, 40)} claimed twice, differently")
        if view is None:
            return root
        if not (isinstance(view, tuple) and len(view) == 3 and isinstance(view[0], str)):
            raise Refused(f"malformed storage view {shown_value(view)}")
        _, offset, size = view
        if not (type(offset) is int and type(size) is int and offset >= 0 and size >= 0 and offset + size <= numel):
            raise Refused(f"storage view {shown_value(view)} runs past its storage")
        part = storage_record(self.path, dtype, size, -1)
        self.views.append((part, root, offset))
        return part

    def place(self, data: Any, keys: Any, position: int, size: int) -> None:
        """Place every storage after the pickles, in the order of `keys`."""
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise BnauditError(f"{self.path}: damaged torch.save file (no storage list)")
        claimed = sum(s.numel * ITEMSIZE[s.dtype] + 8 for s in self.roots.values())
        if claimed > size - position:
            raise BnauditError(
                f"{self.path}: storages claim {claimed} bytes but only {size - position} follow the header: "
                "truncated or forged file"
            )
        order: Literal["big", "little"] = "big" if self.big_endian else "little"
        for key in keys:
            root = self.roots.get(key)
            if root is None or root.start != -1:
                raise BnauditError(
                    f"{self.path}: damaged torch.save file (storage {shown_value(key, 40)} listed but not used, or twice)"
                )
            count = int.from_bytes(bytes(data[position : position + 8]), order, signed=True)
            if count != root.numel or position + 8 + count * ITEMSIZE[root.dtype] > size:
                raise BnauditError(
                    f"{self.path}: damaged torch.save file (storage {shown_value(key, 40)} holds {count} elements, "
                    f"its pickle claims {root.numel})"
                )
            place_storage(root, position + 8)
            position += 8 + count * ITEMSIZE[root.dtype]
        unplaced = [k for k, s in self.roots.items() if s.start == -1]
        if unplaced:
            raise BnauditError(
                f"{self.path}: damaged torch.save file (storage {shown_value(unplaced[0], 40)} has no data)"
            )
        for part, root, offset in self.views:
            place_storage(part, root.start + offset * ITEMSIZE[root.dtype])  # type: ignore[operator]


def read_legacy(path: str, mode: Mode) -> Unpickled:
    """The object of a legacy torch.save file, read in `mode` (module docstring); `Refused`
    for a pickle its mode refuses, `BnauditError` for a damaged or forged layout."""
    import tarfile  # here, not at the top: a zip checkpoint never needs it

    if tarfile.is_tarfile(path):  # torch < 0.4 tar format: read by a loader that trusts its sizes
        raise BnauditError(f"{path}: tar-format torch.save file (PyTorch < 0.4) is not supported")
    size = os.path.getsize(path)
    if size == 0:
        raise BnauditError(f"{path}: empty file")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        first = unpickle(data, Mode.SCAN)
        if type(first.value) is not int or first.value != LEGACY_MAGIC:
            raise NotTorchSave(path, list(first.stand_ins))
        try:
            version = unpickle(data, Mode.PLAIN, start=first.end)
            info = unpickle(data, Mode.PLAIN, start=version.end)
        except Refused as exc:
            raise BnauditError(f"{path}: damaged torch.save file ({exc})") from None
        big = isinstance(info.value, dict) and info.value.get("little_endian") is False
        storages = _LegacyStorages(path, big)
        main = unpickle(data, mode, storages, start=info.end)
        try:
            keys = unpickle(data, Mode.PLAIN, start=main.end)
        except Refused as exc:
            raise BnauditError(f"{path}: damaged torch.save file ({exc})") from None
        storages.place(data, keys.value, keys.end, size)
    return main


def whole_model_refusal(path: str) -> BnauditError:
    """The refusal of a pre-1.6 whole-model pickle (its classes' source code inside)."""
    return BnauditError(
        f"{path}: a legacy (pre-1.6) whole-model pickle cannot be read without running "
        "its code; if you trust this file, pass --trust-pickle; safer still, save a "
        "state dict or a .safetensors file"
    )

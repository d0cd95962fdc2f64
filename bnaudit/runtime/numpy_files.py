"""`.npy` / `.npz` data files, read without unpickling and, where the bytes lie in place,
batch by batch.

An `.npy` file is a header (magic, version, a Python-literal dict with descr, fortran_order
and shape) followed by the raw array. An `.npz` is a zip of `.npy` members; a member stored
without compression (np.savez) lies as plain bytes at a known offset of the zip, so it
can be read a few rows at a time like an `.npy`; a compressed member (np.savez_compressed)
must be inflated whole. Arrays of Python objects are refused (allow_pickle=False).

Names in an `.npz`: `inputs`/`labels`, or `x`/`y`, or one array alone (inputs, no labels).
"""

from __future__ import annotations

import os
import struct
import zipfile
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from bnaudit.errors import BnauditError
from bnaudit.text import single_line

# numpy dtype name -> torch dtype name for arrays read in place (little-endian, C order)
_TORCH_NAMES = {
    "bool": "bool",
    "uint8": "uint8",
    "int8": "int8",
    "int16": "int16",
    "int32": "int32",
    "int64": "int64",
    "uint16": "uint16",
    "uint32": "uint32",
    "uint64": "uint64",
    "float16": "float16",
    "float32": "float32",
    "float64": "float64",
}

_PAIRS = (("inputs", "labels"), ("x", "y"))


@dataclass(frozen=True)
class StoredRows:
    """An array whose rows lie in place in a file: row 0 at `offset`, C order,
    little-endian, `dtype` a torch dtype name."""

    path: str
    offset: int
    dtype: str
    shape: tuple[int, ...]


def open_numpy(path: str) -> dict[str, Any]:
    """{"inputs": StoredRows or tensor, "labels": tensor} of an `.npy` / `.npz` file."""
    try:
        if path.lower().endswith(".npy"):
            return {"inputs": _npy(path, 0, os.path.getsize(path), compressed=None)}
        return _npz(path)
    except (OSError, ValueError, zipfile.BadZipFile, struct.error) as exc:
        raise BnauditError(f"{path}: not a readable numpy file ({single_line(str(exc))})") from None


def _npz(path: str) -> dict[str, Any]:
    with zipfile.ZipFile(path) as archive:
        members = {info.filename.removesuffix(".npy"): info for info in archive.infolist()}
    names = next(((a, b) for a, b in _PAIRS if a in members), None)
    if names is None:
        if len(members) != 1:
            found = ", ".join(repr(k) for k in list(members)[:8]) or "nothing"
            raise BnauditError(
                f"{path}: name the arrays 'inputs' and 'labels' (or 'x' and 'y'), or store one array; found {found}"
            )
        names = (next(iter(members)), "")
    out: dict[str, Any] = {}
    for key, name in (("inputs", names[0]), ("labels", names[1])):
        info = members.get(name)
        if info is None:
            continue
        start = _member_data_offset(path, info)
        array = _npy(path, start, info.file_size, compressed=None if info.compress_type == 0 else info)
        if key == "labels":
            array = _whole(array)
        out[key] = array
    return out


def _member_data_offset(path: str, info: zipfile.ZipInfo) -> int:
    """Where a member's bytes start: after its local header (30 bytes, name, extra)."""
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        header = f.read(30)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        raise BnauditError(f"{path}: damaged zip (member {info.filename!r})")
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return int(info.header_offset) + 30 + int(name_len) + int(extra_len)


def _npy(path: str, start: int, size: int, compressed: zipfile.ZipInfo | None) -> Any:
    """StoredRows of an array in place, or a tensor read whole (compressed, Fortran
    order, big-endian, or a dtype torch cannot view in place)."""
    if compressed is not None:
        with zipfile.ZipFile(path) as archive, archive.open(compressed) as f:
            return _to_tensor(np.load(f, allow_pickle=False), path)
    with open(path, "rb") as f:
        f.seek(start)
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        else:
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        offset = f.tell()
    if dtype.hasobject:
        raise BnauditError(f"{path}: holds Python objects (dtype {dtype}): not read (it would need unpickling)")
    shape = tuple(int(n) for n in shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if offset - start + nbytes > size:
        raise BnauditError(f"{path}: truncated: the header claims {list(shape)} {dtype} but the bytes are missing")
    name = _TORCH_NAMES.get(dtype.name)
    if not fortran and name is not None and dtype.byteorder in ("<", "|", "=") and shape:
        return StoredRows(path, offset, name, shape)
    array = np.fromfile(path, dtype=dtype, count=nbytes // max(dtype.itemsize, 1), offset=offset)
    return _to_tensor(array.reshape(shape, order="F" if fortran else "C"), path)


def _to_tensor(array: Any, path: str) -> Any:
    if array.dtype.kind in "USO":
        raise BnauditError(f"{path}: holds {array.dtype} values: inputs must be numbers, labels integer class indices")
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    try:
        return torch.from_numpy(np.ascontiguousarray(array))
    except TypeError:
        raise BnauditError(f"{path}: numpy dtype {array.dtype} has no torch equivalent") from None


def _whole(value: Any) -> Any:
    """Labels are small: read them whole as a tensor."""
    if not isinstance(value, StoredRows):
        return value
    dtype = np.dtype(value.dtype)
    array = np.fromfile(value.path, dtype=dtype, count=int(np.prod(value.shape)), offset=value.offset)
    return torch.from_numpy(array.reshape(value.shape))

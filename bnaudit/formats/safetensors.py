"""The one safetensors header parser, for checkpoints and data files alike.

A safetensors header is untrusted JSON that claims offsets into the file: every claim
is checked against the file's real size before anything is allocated or read, and
both the reader (lazy `TensorRef`s with their file `location`) and the writer
(`write.save_like`, which keeps the header and rewrites a few slots) start from the
same validated `SafetensorsHeader`. No safetensors package is imported: it would
bring numpy or torch into `inspect`.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

from bnaudit.errors import BnauditError
from bnaudit.formats.model import TensorRef, file_slice_ref
from bnaudit.text import exception_line

# Header size above which a safetensors file is refused before reading the header:
# real headers are kilobytes to a few megabytes; a hostile one claims petabytes.
_MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024


_ST_DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
    "U16": ("uint16", 2),
    "U32": ("uint32", 4),
    "U64": ("uint64", 8),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
}


# torch dtype name -> safetensors dtype code, for writers
SAFETENSORS_DTYPE_CODES = {name: code for code, (name, _size) in _ST_DTYPES.items()}


@dataclass(frozen=True)
class SafetensorsHeader:
    """A safetensors header, every claim checked against the file.

    `entries` maps tensor names to their entries as stored (`dtype`, `shape`,
    `data_offsets` relative to `data_start`); `metadata` is `__metadata__` as stored.
    """

    entries: dict[str, dict[str, Any]]
    metadata: dict[str, Any]
    data_start: int


def read_safetensors_header(path: str) -> SafetensorsHeader:
    """Parse and validate the header of a safetensors file.

    Every claim (header length, offsets, shapes, dtypes) is checked against the file's
    real size before anything is allocated.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise BnauditError(f"{path}: truncated safetensors file")
        n = int.from_bytes(head, "little")
        if n > size - 8 or n > _MAX_SAFETENSORS_HEADER:
            raise BnauditError(f"{path}: corrupt safetensors header (claims {n} bytes, file has {size})")
        try:
            header = json.loads(f.read(n))
        except (ValueError, RecursionError) as exc:  # bad UTF-8/JSON, 5000-digit ints, deep nesting
            raise BnauditError(f"{path}: corrupt safetensors header ({exception_line(exc, with_type=False)})") from None
    if not isinstance(header, dict):
        raise BnauditError(f"{path}: corrupt safetensors header (not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise BnauditError(f"{path}: corrupt safetensors metadata (not a JSON object)")
    data_size = size - 8 - n
    for name, info in header.items():
        try:
            st_dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise BnauditError(f"{path}: corrupt safetensors entry '{name}'") from None
        if not isinstance(st_dtype, str) or st_dtype not in _ST_DTYPES:
            raise BnauditError(f"{path}: tensor '{name}' has unknown dtype {str(st_dtype)[:40]!r}")
        if not (isinstance(shape, list) and all(is_count(s) for s in shape)):
            raise BnauditError(f"{path}: tensor '{name}' has an invalid shape {str(shape)[:80]}")
        itemsize = _ST_DTYPES[st_dtype][1]
        if not (is_count(begin) and is_count(end) and begin <= end <= data_size):
            raise BnauditError(f"{path}: tensor '{name}' lies outside the file (offsets {begin}..{end})")
        if math.prod(shape) * itemsize != end - begin:
            raise BnauditError(f"{path}: tensor '{name}' has {end - begin} bytes for shape {shape}")
    return SafetensorsHeader(header, metadata, 8 + n)


def read_safetensors(path: str) -> tuple[dict[str, TensorRef], dict[str, str]]:
    """Lazy per-tensor readers of a safetensors file (header validated), and its
    metadata as strings. Each reader knows its `location` in the file."""
    header = read_safetensors_header(path)
    tensors: dict[str, TensorRef] = {}
    for name, info in header.entries.items():
        begin, end = info["data_offsets"]
        dtype = _ST_DTYPES[info["dtype"]][0]
        tensors[name] = file_slice_ref(path, name, header.data_start + begin, end - begin, dtype, tuple(info["shape"]))
    return tensors, {str(k): str(v) for k, v in header.metadata.items()}


def is_count(value: Any) -> bool:
    """A non-negative JSON integer (True and False are ints to Python, not here)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0

"""The torch-free safetensors header reader, for `inspect` and `diff`.

Everywhere numpy or torch is loaded anyway, bnaudit opens safetensors files with the
`safetensors` package (`safe_open`) and writes them with it. This reader exists only
because `safe_open` imports numpy, which `inspect x.safetensors` must not pay for; so
it accepts and refuses exactly what the package does (tests/test_safetensors_reference.py
proves it on a corpus of malformed files and on generated ones), which means following
the package's Rust parser (serde_json) rather than Python's json where they differ:

  length      8-byte little-endian header length n <= 100,000,000 (decimal), and 8 + n
              within the file
  JSON        UTF-8, one object; no NaN/Infinity; numbers outside float64's range,
              lone UTF-16 surrogates and nesting of 128 arrays/objects refused anywhere
  entries     per tensor an object {dtype, shape, data_offsets} (unknown fields ignored,
              a known field twice refused) or the 3-element array [dtype, shape,
              offsets]; dtype a code or {code: null}; counts JSON integers in [0, 2**64)
  names       a name given twice: the last entry counts (each must be valid);
              `__metadata__` twice refused; `__metadata__` null or a string-to-string map
  data        entries sorted by offsets follow each other from 0 without gaps or
              overlaps and end exactly at the end of the file; each spans
              prod(shape) x bits(dtype) / 8 bytes (the product refused past 2**64 - 1,
              sub-byte totals must fill whole bytes)

Every claim is checked against the file's real size before anything is allocated or read.
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

# The reference's MAX_HEADER_SIZE (bytes, decimal): real headers are kilobytes to a few
# megabytes; a hostile one claims petabytes.
_MAX_HEADER = 100_000_000
_U64_MAX = 2**64 - 1
# serde_json refuses the 128th nested array/object (the outer object counts as 1)
_MAX_DEPTH = 127

# safetensors dtype code -> (torch-style name, bits per element); the names of codes
# torch has no dtype for (F4, F6) are descriptive only.
_ST_DTYPES: dict[str, tuple[str, int]] = {
    "BOOL": ("bool", 8),
    "F4": ("float4_e2m1fn", 4),
    "F6_E2M3": ("float6_e2m3fn", 6),
    "F6_E3M2": ("float6_e3m2fn", 6),
    "U8": ("uint8", 8),
    "I8": ("int8", 8),
    "F8_E5M2": ("float8_e5m2", 8),
    "F8_E4M3": ("float8_e4m3fn", 8),
    "F8_E8M0": ("float8_e8m0fnu", 8),
    "F8_E4M3FNUZ": ("float8_e4m3fnuz", 8),
    "F8_E5M2FNUZ": ("float8_e5m2fnuz", 8),
    "I16": ("int16", 16),
    "U16": ("uint16", 16),
    "F16": ("float16", 16),
    "BF16": ("bfloat16", 16),
    "I32": ("int32", 32),
    "U32": ("uint32", 32),
    "F32": ("float32", 32),
    "C64": ("complex64", 64),
    "F64": ("float64", 64),
    "I64": ("int64", 64),
    "U64": ("uint64", 64),
}

# safetensors dtype code -> torch-style name, and back (what the package writes for it)
TORCH_DTYPE_NAMES = {code: name for code, (name, _bits) in _ST_DTYPES.items()}
SAFETENSORS_DTYPE_CODES = {name: code for code, name in TORCH_DTYPE_NAMES.items()}


@dataclass(frozen=True)
class SafetensorsEntry:
    """One tensor's header entry: `dtype` its safetensors code, `begin`/`end` byte
    offsets relative to the data section."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class SafetensorsHeader:
    """A safetensors header, every claim checked against the file: `entries` in the
    header's order, `metadata` the `__metadata__` map ({} when absent or null),
    `data_start` the file offset of the data section."""

    entries: dict[str, SafetensorsEntry]
    metadata: dict[str, str]
    data_start: int


class _Object(list[tuple[str, Any]]):
    """A JSON object as its key/value pairs in order, duplicates kept: which duplicate
    is an error depends on where the object sits."""


def read_safetensors_header(path: str) -> SafetensorsHeader:
    """Parse and validate the header of a safetensors file, as the `safetensors`
    package does (see the module docstring); BnauditError naming the first problem."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise BnauditError(f"{path}: truncated safetensors file")
        n = int.from_bytes(head, "little")
        if n > size - 8 or n > _MAX_HEADER:
            raise BnauditError(f"{path}: corrupt safetensors header (claims {n} bytes, file has {size})")
        raw = f.read(n)
    root = _parse_json(path, raw)
    entries, metadata = _interpret(path, root)
    _check_layout(path, entries, size - 8 - n)
    return SafetensorsHeader(entries, metadata, 8 + n)


def read_safetensors(path: str) -> tuple[dict[str, TensorRef], dict[str, str]]:
    """Lazy per-tensor readers of a safetensors file (header validated), and its
    metadata. Each reader knows its `location` in the file."""
    header = read_safetensors_header(path)
    tensors: dict[str, TensorRef] = {}
    for name, entry in header.entries.items():
        dtype = _ST_DTYPES[entry.dtype][0]
        start, length = header.data_start + entry.begin, entry.end - entry.begin
        tensors[name] = file_slice_ref(path, name, start, length, dtype, entry.shape)
    return tensors, dict(header.metadata)


def is_count(value: Any) -> bool:
    """A non-negative JSON integer (True and False are ints to Python, not here)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _corrupt(path: str, why: str) -> BnauditError:
    return BnauditError(f"{path}: corrupt safetensors header ({why})")


def _finite(value: float) -> float:
    if math.isinf(value):  # serde_json: "number out of range"
        raise ValueError("number out of range")
    return value


def _parse_int(text: str) -> int | float:
    # serde_json reads an integer as u64 where it fits, else as f64 (so `-0` and `-1`
    # are not counts, and 10**400 is out of range); a float never passes `_is_u64`
    if text.startswith("-") or len(text) > 20 or int(text) > _U64_MAX:
        return _finite(float(text))
    return int(text)


def _no_constant(text: str) -> Any:
    raise ValueError(f"{text} is not JSON")


def _parse_json(path: str, raw: bytes) -> Any:
    try:
        root = json.loads(
            raw.decode("utf-8"),
            object_pairs_hook=_Object,
            parse_int=_parse_int,
            parse_float=lambda text: _finite(float(text)),
            parse_constant=_no_constant,
        )
    except (ValueError, RecursionError) as exc:  # bad UTF-8/JSON, deep nesting past Python's limit
        raise _corrupt(path, exception_line(exc, with_type=False)) from None
    # what Python's json takes and serde_json does not: deep nesting, lone surrogates
    stack: list[tuple[Any, int]] = [(root, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            _check_text(path, value)
        elif isinstance(value, list):
            if depth > _MAX_DEPTH:
                raise _corrupt(path, f"nested deeper than {_MAX_DEPTH} levels")
            for item in value:
                if isinstance(value, _Object):
                    _check_text(path, item[0])
                    item = item[1]
                stack.append((item, depth + 1))
    return root


def _check_text(path: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a \uD800-\uDFFF escape not part of a pair
        raise _corrupt(path, "a string holds a lone UTF-16 surrogate") from None


def _interpret(path: str, root: Any) -> tuple[dict[str, SafetensorsEntry], dict[str, str]]:
    if not isinstance(root, _Object):
        raise _corrupt(path, "not a JSON object")
    entries: dict[str, SafetensorsEntry] = {}
    metadata: dict[str, str] = {}
    seen_metadata = False
    for key, value in root:
        if key != "__metadata__":
            entries[key] = _entry(path, key, value)  # a repeated name: the last one counts
            continue
        if seen_metadata:
            raise _corrupt(path, "__metadata__ given twice")
        seen_metadata = True
        if value is not None and not (isinstance(value, _Object) and all(isinstance(v, str) for _, v in value)):
            raise BnauditError(f"{path}: corrupt safetensors metadata (not a map of strings to strings)")
        metadata = dict(value or [])
    return entries, metadata


def _entry(path: str, name: str, value: Any) -> SafetensorsEntry:
    if isinstance(value, _Object):
        fields: dict[str, Any] = {}
        for field, item in value:
            if field in ("dtype", "shape", "data_offsets"):
                if field in fields:
                    raise BnauditError(f"{path}: corrupt safetensors entry '{name}' (field {field} given twice)")
                fields[field] = item
        if len(fields) != 3:
            raise BnauditError(f"{path}: corrupt safetensors entry '{name}'")
        dtype, shape, offsets = fields["dtype"], fields["shape"], fields["data_offsets"]
    elif isinstance(value, list) and len(value) == 3:
        dtype, shape, offsets = value
    else:
        raise BnauditError(f"{path}: corrupt safetensors entry '{name}'")
    if isinstance(dtype, _Object) and len(dtype) == 1 and dtype[0][1] is None:
        dtype = dtype[0][0]  # serde's other spelling of a unit variant: {"F32": null}
    if not isinstance(dtype, str) or dtype not in _ST_DTYPES:
        raise BnauditError(f"{path}: tensor '{name}' has unknown dtype {str(dtype)[:40]!r}")
    if not (type(shape) is list and all(_is_u64(s) for s in shape)):
        raise BnauditError(f"{path}: tensor '{name}' has an invalid shape {str(shape)[:80]}")
    if not (type(offsets) is list and len(offsets) == 2 and all(_is_u64(o) for o in offsets)):
        raise BnauditError(f"{path}: tensor '{name}' has invalid offsets {str(offsets)[:80]}")
    return SafetensorsEntry(dtype, tuple(shape), offsets[0], offsets[1])


def _is_u64(value: Any) -> bool:
    return is_count(value) and value <= _U64_MAX


def _check_layout(path: str, entries: dict[str, SafetensorsEntry], data_size: int) -> None:
    """Sorted by offsets, the entries tile the data section exactly: no gap, no
    overlap (two names for the same bytes), nothing after the last."""
    start = 0
    for name, entry in sorted(entries.items(), key=lambda item: (item[1].begin, item[1].end)):
        begin, end = entry.begin, entry.end
        if end > data_size or end < begin:
            raise BnauditError(f"{path}: tensor '{name}' lies outside the file (offsets {begin}..{end})")
        if begin != start:
            what = "overlaps the tensor before it" if begin < start else "leaves a gap after the tensor before it"
            raise BnauditError(f"{path}: tensor '{name}' {what} (offsets {begin}..{end}, previous end {start})")
        start = end
        count = 1
        for dim in entry.shape:
            count *= dim
            if count > _U64_MAX:
                raise BnauditError(f"{path}: tensor '{name}' has {end - begin} bytes for shape {list(entry.shape)}")
        bits = count * _ST_DTYPES[entry.dtype][1]
        if bits > _U64_MAX or bits % 8 or bits // 8 != end - begin:
            raise BnauditError(f"{path}: tensor '{name}' has {end - begin} bytes for shape {list(entry.shape)}")
    if start != data_size:
        raise BnauditError(
            f"{path}: the tensors cover {start} of the {data_size} bytes after the safetensors header (trailing bytes)"
        )

"""`.safetensors` data files (`--data`, `--eval-data`), read through the `safetensors` package.

`gap`, `invariance` and `recalibrate` have torch loaded anyway, so the package's own
`safe_open` validates the file and reads it; bnaudit's header reader
(`formats/safetensors.py`) is for the torch-free `inspect` only. The inputs are read a
batch at a time (`SafetensorsRows.take`), each batch through a file opened for it alone:
peak memory stays at a batch whatever the file's size (measured: under 4 MiB more for
streaming a 128 MiB file in batches of 64 rows). Not the package's `pread` backend: 0.8's
reads the whole tensor for every slice. Labels (one integer a sample) are read whole. A safetensors checkpoint
loaded into `--arch` is read by the package too (`read_checkpoint_tensors`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from bnaudit.errors import BnauditError
from bnaudit.formats.model import TensorRef
from bnaudit.formats.safetensors import TORCH_DTYPE_NAMES, read_safetensors_header
from bnaudit.text import exception_line


@dataclass(frozen=True)
class SafetensorsRows:
    """The tensor `name` of the safetensors file `path`, read a few rows at a time.

    `dtype` is torch's name of the stored type, `shape` the stored shape (rows first).
    Picklable (it holds no open file): each `take` opens the file again.
    """

    path: str
    name: str
    dtype: str
    shape: tuple[int, ...]

    def take(self, rows: list[int]) -> Any:
        """The rows `rows`, in that order, as one new tensor; runs of consecutive rows
        are read with one slice each."""
        if not rows:
            return torch.empty((0, *self.shape[1:]), dtype=getattr(torch, self.dtype))
        parts = []
        with _opened(self.path) as f:
            stored = f.get_slice(self.name)
            start = 0
            while start < len(rows):
                end = start + 1
                while end < len(rows) and rows[end] == rows[end - 1] + 1:
                    end += 1
                parts.append(stored[rows[start] : rows[end - 1] + 1])
                start = end
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def open_safetensors(path: str) -> dict[str, Any]:
    """The tensors of a safetensors data file: `inputs` as SafetensorsRows (where it has
    rows), every other tensor read whole."""
    out: dict[str, Any] = {}
    with _opened(path) as f:
        for name in f.offset_keys():
            stored = f.get_slice(name)
            shape = tuple(int(n) for n in stored.get_shape())
            dtype = TORCH_DTYPE_NAMES.get(stored.get_dtype())
            if name == "inputs" and shape and dtype is not None and hasattr(torch, dtype):
                out[name] = SafetensorsRows(path, name, dtype, shape)
            else:
                out[name] = _read(path, f, name)
    return out


@contextmanager
def _opened(path: str) -> Iterator[Any]:
    """`safe_open(path)` (torch tensors), its refusals one BnauditError line."""
    try:
        handle = safe_open(path, framework="pt")
    except (SafetensorError, OSError) as exc:
        raise BnauditError(f"{path}: not a valid safetensors file ({_why(exc)})") from None
    with handle as f:
        yield f


def _read(path: str, f: Any, name: str) -> Any:
    try:
        return f.get_tensor(name)
    except (SafetensorError, TypeError, ValueError) as exc:  # a dtype torch lacks (F6, F4)
        raise BnauditError(f"{path}: cannot read tensor '{name}' ({_why(exc)})") from None


def _why(exc: BaseException) -> str:
    return exception_line(exc, with_type=False).removeprefix("Error while deserializing header: ")


def read_checkpoint_tensors(path: str, refs: Mapping[str, TensorRef]) -> dict[str, Any]:
    """The tensors `refs` (found by bnaudit's reader in the single safetensors file `path`,
    under any name) read by the package instead: each found by its place in the file,
    which no two non-empty tensors share (the reader refuses overlaps). Empty tensors are
    made from their dtype and shape."""
    header = read_safetensors_header(path)
    stored_at = {
        (header.data_start + entry.begin, entry.end - entry.begin): stored
        for stored, entry in header.entries.items()
        if entry.end > entry.begin
    }
    out: dict[str, Any] = {}
    with _opened(path) as f:
        for name, ref in refs.items():
            stored = stored_at.get(ref.location) if ref.location is not None else None
            out[name] = _read(path, f, stored) if stored is not None else ref.to_torch()
    return out

"""Lazy views of a torch.save file's storages: the records the torch-free readers build.

A `Storage` is where a storage's elements lie (a byte range of the file, or a compressed zip
record); `lazy_tensor` is a view (offset, size, stride) of one as a `TensorRef`, checked
against the storage when built and read only when asked (formats/unpickle.py builds one for
every tensor of a file, and an audit reads only its BN buffers). Each keeps its
`StorageView`, from which a writer rebuilds torch tensors over shared storages.
"""

from __future__ import annotations

import functools
import math
import operator
import os
import pickle
import zipfile
from dataclasses import dataclass
from typing import Any, NamedTuple

from bnaudit.errors import BnauditError
from bnaudit.formats.model import (
    OTHER_ITEMSIZE,
    STORAGE_ITEMSIZE,
    TensorRef,
    claim_too_large,
    decode_values,
    lazy_ref,
)
from bnaudit.formats.safetensors import is_count

ITEMSIZE = {**STORAGE_ITEMSIZE, **OTHER_ITEMSIZE}


@dataclass(frozen=True)
class Storage:
    """A storage's elements: `numel` of `dtype` at file offset `start` of `path` (an
    uncompressed record or a legacy range), or inside the zip record `entry`."""

    path: str
    dtype: str
    numel: int
    start: int | None
    entry: str | None = None

    def read(self, first: int, count: int) -> bytearray:
        """The raw bytes of elements [first, first + count)."""
        size = ITEMSIZE[self.dtype]
        length = count * size
        if not length:
            return bytearray()
        if self.start is not None:
            fd = os.open(self.path, os.O_RDONLY)
            try:
                position, chunks, left = self.start + first * size, [], length
                while left:  # one pread returns at most about 2 GiB
                    chunk = os.pread(fd, left, position)
                    if not chunk:
                        raise BnauditError(f"{self.path}: truncated tensor data")
                    chunks.append(chunk)
                    position, left = position + len(chunk), left - len(chunk)
            finally:
                os.close(fd)
            return bytearray(b"".join(chunks))
        with zipfile.ZipFile(self.path) as archive, archive.open(str(self.entry)) as member:
            member.seek(first * size)
            chunk = member.read(length)
        if len(chunk) != length:
            raise BnauditError(f"{self.path}: truncated tensor data")
        return bytearray(chunk)


_new = object.__new__


def storage_record(path: str, dtype: str, numel: int, start: int | None, entry: str | None = None) -> Storage:
    """`Storage(path, dtype, numel, start, entry)`, its fields set without the frozen __init__
    (a third of the cost): a folder scan builds one for every tensor of every file."""
    new = _new(Storage)
    fields = new.__dict__
    fields["path"], fields["dtype"], fields["numel"] = path, dtype, numel
    fields["start"], fields["entry"] = start, entry
    return new


def _swapped(raw: bytearray, itemsize: int) -> bytearray:
    """Each `itemsize`-byte element of `raw` with its bytes reversed (big <-> little endian)."""
    out = bytearray(len(raw))
    for k in range(itemsize):
        out[k::itemsize] = raw[itemsize - 1 - k :: itemsize]
    return out


def place_storage(storage: Storage, start: int) -> None:
    """Set where a legacy file's storage lies, known only once every pickle of the file is
    read (its storages follow them in the order of the last one): the one field a `Storage`
    gets after it is built, before any tensor over it is read."""
    storage.__dict__["start"] = start


class StorageView(NamedTuple):
    """How a pickle rebuilt a tensor: the view (offset, size, stride) of `storage`, its
    elements big-endian or not, `requires_grad`, and whether it was an `nn.Parameter`."""

    storage: Storage
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    big_endian: bool
    requires_grad: bool = False
    parameter: bool = False


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


def lazy_tensor(
    storage: Storage,
    offset: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    big_endian: bool,
    requires_grad: bool = False,
) -> TensorRef:
    """The view (offset, size, stride) of `storage`, read lazily.

    Element (i_0, ..., i_n) is storage element offset + sum(i_k * stride_k); the view spans
    span = sum((size_k - 1) * stride_k) + 1 elements from `offset`, which must lie inside the
    storage; a view with zero strides may claim more elements than the storage holds
    (`x.expand(n)`), up to `model.EXPANDED_LIMIT` (decoding allocates the claim). Values
    come out row-major.
    """
    check_tensor_record(storage, offset, size, stride, Storage)
    # at C speed where it can be (a folder scan builds thousands of these):
    # span = 1 + sum((size_k - 1) * stride_k)
    numel = math.prod(size)
    span = 1 + sum(map(operator.mul, size, stride)) - sum(stride) if numel else 0
    if claim_too_large(numel, storage.numel):
        raise pickle.UnpicklingError(f"tensor claims {numel} elements, its storage holds {storage.numel}")
    if offset + span > storage.numel:
        raise pickle.UnpicklingError("tensor view runs past its storage")
    view = (storage, offset, span, size, stride, big_endian)
    record = StorageView(storage, offset, size, stride, big_endian, requires_grad is True)
    # no `location`: data files are streamed through their own reader (runtime/data.py)
    return lazy_ref(
        "",
        size,
        storage.dtype,
        functools.partial(_view_values, *view),
        functools.partial(_view_tensor, *view),
        None,
        record,
    )


def as_parameter(ref: TensorRef, requires_grad: Any) -> TensorRef:
    """`ref` as an `nn.Parameter` was pickled (`_rebuild_parameter`): the same tensor to an
    audit, a Parameter to a writer."""
    if not isinstance(ref, TensorRef) or ref.view is None:
        raise pickle.UnpicklingError("a parameter of something that is not a tensor")
    new = ref.renamed(ref.name)
    new.__dict__["view"] = ref.view._replace(parameter=True, requires_grad=requires_grad is True)
    return new


def contiguous_start(ref: TensorRef) -> int | None:
    """The file offset of `ref`'s first element when its storage lies uncompressed in the
    file and the view is laid out in C order (row i is then a plain byte range); else None."""
    view = ref.view
    if not isinstance(view, StorageView) or view.storage.start is None or view.big_endian:
        return None
    step = 1
    for extent, st in zip(reversed(view.size), reversed(view.stride)):
        if extent > 1 and st != step:
            return None
        step *= extent
    return view.storage.start + view.offset * ITEMSIZE[view.storage.dtype]


def storage_bytes(storage: Storage, big_endian: bool) -> bytearray:
    """Every element of `storage` as little-endian bytes (a writer's whole storage)."""
    return _view_bytes(storage, 0, storage.numel, big_endian)


def _view_bytes(storage: Storage, offset: int, span: int, big_endian: bool) -> bytearray:
    """The little-endian bytes of the `span` storage elements a view spans from `offset`."""
    data = storage.read(offset, span)
    itemsize = ITEMSIZE[storage.dtype]
    return _swapped(data, itemsize) if big_endian and itemsize > 1 else data


def _view_values(
    storage: Storage, offset: int, span: int, size: tuple[int, ...], stride: tuple[int, ...], big_endian: bool
) -> list[float]:
    """`TensorRef.read` of a view (`lazy_tensor`): its values row-major."""
    flat = decode_values(_view_bytes(storage, offset, span, big_endian), storage.dtype)
    if len(size) == 1 and (stride[0] == 1 or size[0] <= 1):  # most BN buffers: no loop to tell
        return flat
    numel, contiguous = 1, True
    for extent, st in zip(reversed(size), reversed(stride)):
        contiguous = contiguous and (extent <= 1 or st == numel)
        numel *= extent
    if contiguous:
        return flat
    index = [0]
    for extent, st in zip(size, stride):  # row-major: the last dimension varies fastest
        index = [base + i * st for base in index for i in range(extent)]
    return [flat[i] for i in index]


def _view_tensor(
    storage: Storage, offset: int, span: int, size: tuple[int, ...], stride: tuple[int, ...], big_endian: bool
) -> Any:
    """`TensorRef.to_torch` of a view (`lazy_tensor`)."""
    import torch

    dtype = getattr(torch, storage.dtype)
    if math.prod(size) == 0:
        return torch.empty(size, dtype=dtype)
    base = torch.frombuffer(_view_bytes(storage, offset, span, big_endian), dtype=dtype)  # ours and writable
    return base.as_strided(size, stride, 0).contiguous()

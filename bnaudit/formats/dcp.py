"""torch.distributed.checkpoint (DCP) folders, read without running their code.

`dcp.save(state_dict, checkpoint_id=folder)` (the FileSystemWriter) writes one folder:

  .metadata               a pickle of torch.distributed.checkpoint.metadata.Metadata:
    state_dict_metadata     fqn -> TensorStorageMetadata(properties (dtype, ...), size,
                            chunks [ChunkStorageMetadata(offsets, sizes)]), or
                            BytesStorageMetadata for a pickled object (optimizer settings)
    planner_data            fqn -> its key path in the nested state dict the user saved
                            ("model.1.weight" -> ("model", "1.weight"))
    storage_data            MetadataIndex(fqn, offsets) -> _StorageInfo(relative_path,
                            offset, length): where each chunk lies
  __<rank>_<n>.distcp     the chunks: each a whole torch.save zip of that chunk's tensor
                          at bytes [offset, offset + length)

`.metadata` goes through the restricted unpickler (formats/unpickle.py) in
`Mode.DCP_METADATA`: bnaudit's own inert records for DCP's dataclasses, torch.Size, dtypes,
layouts, memory-format codes and pathlib paths and nothing else; no class named in the
file is imported, and a pickle that calls anything outside that list is refused. Every record
is validated before it is trusted: chunk files stay inside the folder (no absolute path,
no `..`, no symlink out), each chunk's byte range fits its file, and a tensor's chunks lie
inside it with volumes adding up to its size; when a tensor is read, its chunks must
cover every element exactly once (FSDP2 shards parameters along dim 0 across ranks, so a
BN weight is assembled from one chunk per rank; replicated buffers are saved once), and
every chunk is read (its storage bounding its size) before the tensor is allocated.

Only the tensors an audit reads are read, each chunk through the torch-free torch.save
reader (formats/torchsave.py), which reads only the bytes of the elements asked for. The nested state dict (`model.`, `optim.`,
`app.model.`) is a container like a torch.save file's: formats/containers.py chooses the
model part and skips optimizer state; `--key` names another part.
"""

from __future__ import annotations

import itertools
import math
import os
import re
from dataclasses import dataclass
from typing import Any, TypeGuard

from bnaudit.errors import BnauditError
from bnaudit.formats.allowed import CalledStandIn, Mode, Refused
from bnaudit.formats.containers import checkpoint_from_object
from bnaudit.formats.model import Checkpoint, TensorRef
from bnaudit.formats.pickled import Record, TorchValue, mapping_items
from bnaudit.formats.provenance import RECORD_KEY
from bnaudit.formats.sniff import DCP_METADATA
from bnaudit.formats.standins import stand_ins_in
from bnaudit.formats.torchsave import read_stored, read_stored_tensor
from bnaudit.formats.unpickle import unpickle
from bnaudit.formats.views import ITEMSIZE

# Real metadata files are kilobytes to tens of megabytes (a few records per tensor chunk).
_MAX_METADATA_BYTES = 1 << 30


def _is_count(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass(frozen=True)
class DcpChunk:
    """One stored piece of a tensor: elements [offsets, offsets + sizes) per dimension,
    saved by torch.save in `file` (relative to the folder) at bytes [start, start + length)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    start: int
    length: int
    transformed: bool = False  # written through a stream transform (compression): not read


@dataclass(frozen=True)
class DcpTensor:
    fqn: str
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[DcpChunk, ...]


@dataclass(frozen=True)
class DcpLayout:
    """A validated `.metadata`: tensors and pickled objects by fqn, each fqn's key path in
    the saved state dict, the files the chunks lie in, and DCP's format version."""

    folder: str
    tensors: dict[str, DcpTensor]
    objects: dict[str, DcpChunk]  # pickled objects: never unpickled here
    paths: dict[str, tuple[str | int, ...]]
    files: list[str]
    version: str | None


def _malformed(folder: str, what: str) -> BnauditError:
    return BnauditError(f"{folder}: malformed {DCP_METADATA} ({what})")


def _fields(folder: str, record: Any, kind: str) -> dict[str, Any]:
    if not isinstance(record, Record) or record.kind != kind or type(record.state) is not dict:
        raise _malformed(folder, f"expected {kind}, found {type(record).__name__}")
    return record.state


def read_dcp_layout(folder: str) -> DcpLayout:
    """Parse and validate `folder/.metadata` (see module docstring); one line per problem."""
    path = os.path.join(folder, DCP_METADATA)
    try:
        size = os.path.getsize(path)
        if size > _MAX_METADATA_BYTES:
            raise BnauditError(f"{path}: {size} bytes is too large for DCP metadata")
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise BnauditError(f"{path}: cannot open ({exc.strerror or exc})") from None
    try:
        read = unpickle(data, Mode.DCP_METADATA)
    except CalledStandIn as exc:  # --trust-pickle does not apply: nothing but these records is ever needed
        raise BnauditError(
            f"{path}: refused to unpickle: it calls a global that could run code ({exc.name}); "
            "DCP's metadata holds only its own dataclasses, tensor sizes and dtypes"
        ) from None
    except Refused as exc:
        raise BnauditError(f"{path}: cannot unpickle safely ({exc})") from None
    meta = read.value
    found = stand_ins_in(getattr(meta, "state", None))
    if found:  # data only, but not the data DCP writes
        place, named = found[0]
        raise BnauditError(f"{path}: refused: {place} holds {named}, which DCP's metadata never holds")
    fields = _fields(folder, meta, "Metadata")
    storage = fields.get("storage_data")
    if type(storage) is not dict:
        raise BnauditError(
            f"{folder}: {DCP_METADATA} has no file storage records (not written by torch's FileSystemWriter)"
        )
    where: dict[tuple[str, tuple[int, ...]], DcpChunk] = {}
    files: dict[str, int] = {}
    for index, info in dict.items(storage):
        key = _fields(folder, index, "MetadataIndex")
        stored = _fields(folder, info, "_StorageInfo")
        fqn, offsets = key.get("fqn"), key.get("offset")
        name, start, length = stored.get("relative_path"), stored.get("offset"), stored.get("length")
        if not isinstance(fqn, str) or not (offsets is None or isinstance(offsets, tuple)):
            raise _malformed(folder, "a storage key without a name")
        if not isinstance(name, str) or not _is_count(start) or not _is_count(length):
            raise _malformed(folder, f"storage record of '{fqn}'")
        if name not in files:
            files[name] = os.path.getsize(_inside(folder, name))
        if start + length > files[name]:
            raise BnauditError(
                f"{folder}: '{fqn}' claims bytes {start}..{start + length} of {name}, which holds {files[name]}"
            )
        where[(fqn, offsets or ())] = DcpChunk((), (), name, start, length, bool(stored.get("transform_descriptors")))
    tensors, objects = _tensors(folder, fields.get("state_dict_metadata"), where)
    return DcpLayout(
        folder,
        tensors,
        objects,
        _key_paths(folder, fields.get("planner_data")),
        sorted(files),
        fields.get("version") if isinstance(fields.get("version"), str) else None,
    )


def _tensors(
    folder: str, entries: Any, where: dict[tuple[str, tuple[int, ...]], DcpChunk]
) -> tuple[dict[str, DcpTensor], dict[str, DcpChunk]]:
    if type(entries) is not dict:
        raise _malformed(folder, "no state_dict_metadata")
    tensors: dict[str, DcpTensor] = {}
    objects: dict[str, DcpChunk] = {}
    for fqn, entry in dict.items(entries):
        if not isinstance(fqn, str):
            raise _malformed(folder, "a key that is not a name")
        if isinstance(entry, Record) and entry.kind == "BytesStorageMetadata":
            stored = where.get((fqn, ()))
            if stored is None:
                raise BnauditError(f"{folder}: the object '{fqn}' has no storage record")
            objects[fqn] = stored
            continue
        fields = _fields(folder, entry, "TensorStorageMetadata")
        shape, chunks = fields.get("size"), fields.get("chunks")
        dtype = _dtype_of(folder, fqn, fields.get("properties"))
        if not (isinstance(shape, tuple) and all(_is_count(n) for n in shape)) or type(chunks) is not list:
            raise _malformed(folder, f"tensor record of '{fqn}'")
        placed = []
        volume = 0
        for chunk in chunks:
            c = _fields(folder, chunk, "ChunkStorageMetadata")
            offsets, sizes = c.get("offsets"), c.get("sizes")
            if not (
                isinstance(offsets, tuple)
                and isinstance(sizes, tuple)
                and len(offsets) == len(sizes) == len(shape)
                and all(_is_count(n) for n in offsets + sizes)
            ):
                raise _malformed(folder, f"a chunk of '{fqn}'")
            if any(o + s > n for o, s, n in zip(offsets, sizes, shape)):
                raise BnauditError(f"{folder}: a chunk of '{fqn}' at {list(offsets)} runs past its shape {list(shape)}")
            stored = where.get((fqn, offsets))
            if stored is None:
                raise BnauditError(f"{folder}: the chunk of '{fqn}' at {list(offsets)} has no storage record")
            placed.append(DcpChunk(offsets, sizes, stored.file, stored.start, stored.length, stored.transformed))
            volume += math.prod(sizes)
        if volume != math.prod(shape):
            raise BnauditError(
                f"{folder}: the chunks of '{fqn}' hold {volume} elements, its shape {list(shape)} "
                f"{math.prod(shape)}: they do not tile it"
            )
        ranges = sorted((c.file, c.start, c.start + c.length) for c in placed)
        if any(a[0] == b[0] and b[1] < a[2] for a, b in itertools.pairwise(ranges)):
            # each chunk's bytes bound its elements: shared bytes would let a few bytes claim any size
            raise BnauditError(f"{folder}: two chunks of '{fqn}' share bytes of one file: they do not tile it")
        tensors[fqn] = DcpTensor(fqn, dtype, shape, tuple(placed))
    return tensors, objects


def _dtype_of(folder: str, fqn: str, properties: Any) -> str:
    """TensorProperties pickles (dtype, layout, requires_grad, memory format, pin_memory)
    through its __getstate__; older writers a dict of fields."""
    if not isinstance(properties, Record) or properties.kind != "TensorProperties":
        raise _malformed(folder, f"properties of '{fqn}'")
    state = properties.state
    dtype = state[0] if isinstance(state, tuple) and state else state.get("dtype") if type(state) is dict else None
    if not (isinstance(dtype, TorchValue) and dtype.kind == "dtype"):
        raise _malformed(folder, f"dtype of '{fqn}'")
    return dtype.name


def _key_paths(folder: str, planner_data: Any) -> dict[str, tuple[str | int, ...]]:
    """fqn -> key path from the default planner's data; {} from another planner (the fqns
    are then the keys of one flat state dict)."""
    if type(planner_data) is not dict:
        return {}
    paths: dict[str, tuple[str | int, ...]] = {}
    for fqn, path in dict.items(planner_data):
        if not (
            isinstance(fqn, str)
            and isinstance(path, tuple)
            and path
            and all(isinstance(p, str) or (isinstance(p, int) and not isinstance(p, bool)) for p in path)
        ):
            return {}
        paths[fqn] = path
    return paths


def _inside(folder: str, name: str) -> str:
    """`folder/name`, refused unless it is a regular file inside `folder`."""
    if not name or os.path.isabs(name) or name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name):
        raise BnauditError(f"{folder}: chunk file '{name}' is absolute: DCP names files in its own folder")
    if ".." in re.split(r"[/\\]", name):
        raise BnauditError(f"{folder}: chunk file '{name}' leaves the checkpoint's folder ('..')")
    joined = os.path.join(folder, name)
    real_folder = os.path.realpath(folder)
    if os.path.commonpath([real_folder, os.path.realpath(joined)]) != real_folder:
        raise BnauditError(f"{folder}: chunk file '{name}' is a symlink out of the checkpoint's folder: refused")
    if not os.path.isfile(joined):
        raise BnauditError(f"{folder}: missing chunk file '{name}' (named in {DCP_METADATA})")
    return joined


def stored_object(folder: str, chunk: DcpChunk, fqn: str) -> Any:
    """The object a storage record points at (a pickled object: optimizer settings), read
    by the restricted unpickler: tensors and plain data only."""
    what = f"{folder}: object '{fqn}' in {chunk.file}"
    if chunk.transformed:
        raise BnauditError(f"{what}: written through a stream transform (compressed?): not supported")
    path = _inside(folder, chunk.file)
    try:
        return read_stored(path, chunk.start, chunk.length)
    except BnauditError as exc:
        raise BnauditError(f"{what}: {str(exc).removeprefix(f'{path}: ')}") from None


def _read_chunk(folder: str, tensor: DcpTensor, chunk: DcpChunk) -> TensorRef:
    """The chunk as a lazy tensor: the torch.save zip at its byte range, read by the
    torch-free torch.save reader (formats/torchsave.py; only tensor records rebuilt)."""
    what = f"{folder}: chunk of '{tensor.fqn}' at {list(chunk.offsets)} in {chunk.file}"
    if chunk.transformed:
        raise BnauditError(f"{what}: written through a stream transform (compressed?): not supported")
    path = _inside(folder, chunk.file)
    with open(path, "rb") as f:
        f.seek(chunk.start)
        head = f.read(4)
    if head != b"PK\x03\x04":  # DCP's serialization_format=SAFETENSORS keeps no per-chunk archive
        raise BnauditError(f"{what}: not a torch.save archive (saved with serialization_format=SAFETENSORS?)")
    try:
        ref = read_stored_tensor(path, chunk.start, chunk.length)
    except BnauditError as exc:
        raise BnauditError(f"{what}: {str(exc).removeprefix(f'{path}: ')}") from None
    if ref.shape != chunk.sizes or ref.dtype != tensor.dtype:
        raise BnauditError(f"{what}: does not hold a {tensor.dtype} tensor of shape {list(chunk.sizes)}")
    if math.prod(ref.shape) * ITEMSIZE.get(ref.dtype, 1) > chunk.length:
        raise BnauditError(f"{what}: claims more elements than its {chunk.length} bytes hold")
    return ref


def assemble(folder: str, tensor: DcpTensor) -> list[float]:
    """The whole tensor, flat row-major, from its chunks placed by offsets and sizes;
    refused unless they cover every element exactly once. Every chunk is read first (each
    bounded by the bytes its file holds), so the tensor is allocated only at a size its
    chunks' contents give, never at the size `.metadata` alone claims."""
    pieces = [(chunk, _read_chunk(folder, tensor, chunk).read()) for chunk in tensor.chunks]
    numel = math.prod(tensor.shape)
    if sum(len(values) for _, values in pieces) != numel:
        raise BnauditError(
            f"{folder}: the chunks of '{tensor.fqn}' hold fewer elements than its shape: they do not tile it"
        )
    strides = [math.prod(tensor.shape[d + 1 :]) for d in range(len(tensor.shape))]
    values: list[float] = [0.0] * numel
    covered = bytearray(numel)
    for chunk, chunk_values in pieces:
        index = [sum(o * s for o, s in zip(chunk.offsets, strides))]
        for extent, step in zip(chunk.sizes, strides):  # row-major: the last dimension varies fastest
            index = [base + i * step for base in index for i in range(extent)]
        for i, value in zip(index, chunk_values):
            if covered[i]:
                raise BnauditError(f"{folder}: chunks of '{tensor.fqn}' overlap: they do not tile it")
            covered[i] = 1
            values[i] = value
    if not all(covered):
        raise BnauditError(f"{folder}: chunks of '{tensor.fqn}' leave elements uncovered: they do not tile it")
    return values


def assemble_torch(folder: str, tensor: DcpTensor) -> Any:
    """`assemble` as a torch tensor, each chunk copied into its region by torch (whole
    weights for --arch and for writing back: no Python loop per element); chunks read
    and checked before the tensor is allocated, as there."""
    import torch

    pieces = [(chunk, _read_chunk(folder, tensor, chunk).to_torch()) for chunk in tensor.chunks]
    if sum(int(piece.numel()) for _, piece in pieces) != math.prod(tensor.shape):
        raise BnauditError(
            f"{folder}: the chunks of '{tensor.fqn}' hold fewer elements than its shape: they do not tile it"
        )
    dtype = getattr(torch, tensor.dtype)
    out = torch.empty(tensor.shape, dtype=dtype)
    covered = torch.zeros(tensor.shape, dtype=torch.bool)
    for chunk, piece in pieces:
        region = tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))
        if bool(covered[region].any()):
            raise BnauditError(f"{folder}: chunks of '{tensor.fqn}' overlap: they do not tile it")
        covered[region] = True
        out[region] = piece
    if not bool(covered.all()):
        raise BnauditError(f"{folder}: chunks of '{tensor.fqn}' leave elements uncovered: they do not tile it")
    return out


def tensor_ref(folder: str, tensor: DcpTensor) -> TensorRef:
    """The whole tensor as a lazy `TensorRef`: its chunks are read and assembled when asked."""
    return TensorRef(
        tensor.fqn,
        tensor.shape,
        tensor.dtype,
        lambda: assemble(folder, tensor),
        lambda: assemble_torch(folder, tensor),
    )


_NOT_A_TENSOR = "<pickled object: not loaded>"

# `recalibrate` keeps its record beside the DCP files (DCP reads only the files its
# metadata names); untrusted like any record, and only ever read as text.
RECORD_FILE = "bnaudit.json"
_MAX_RECORD_BYTES = 10_000_000


def _record_beside(folder: str) -> dict[str, str]:
    path = os.path.join(folder, RECORD_FILE)
    try:
        if not os.path.isfile(path) or os.path.getsize(path) > _MAX_RECORD_BYTES:
            return {}
        with open(path, "rb") as f:
            return {RECORD_KEY: f.read().decode("utf-8")}
    except (OSError, UnicodeDecodeError):
        return {}


def nested_state_dict(layout: DcpLayout, values: dict[str, Any] | None = None) -> dict[Any, Any]:
    """The state dict DCP flattened, rebuilt from the planner's key paths: tensors as lazy
    `TensorRef`s, pickled objects (optimizer settings) as placeholders never unpickled;
    `values` (fqn -> value) replaces both (a writer's loaded tensors and objects)."""
    root: dict[Any, Any] = {}
    entries: list[tuple[str, Any]] = [(f, tensor_ref(layout.folder, t)) for f, t in layout.tensors.items()]
    entries += [(f, _NOT_A_TENSOR) for f in layout.objects]
    if values is not None:
        entries = [(f, values[f]) for f, _ in entries]
    for fqn, value in entries:
        path = layout.paths.get(fqn, (fqn,))
        node = root
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise _malformed(layout.folder, f"'{fqn}' nests inside a tensor")
        if path[-1] in node:
            raise _malformed(layout.folder, f"'{fqn}' stored twice")
        node[path[-1]] = value
    nested: dict[Any, Any] = _lists(root)  # the root's keys are names: it stays a mapping
    return nested


def _lists(node: Any) -> Any:
    """Integer path elements index lists (an optimizer's param_groups): a mapping keyed
    by integers becomes the list DCP flattened, gaps None (as torch's unflatten does)."""
    if not isinstance(node, dict):
        return node
    items = {k: _lists(v) for k, v in mapping_items(node)}
    if items and all(isinstance(k, int) and not isinstance(k, bool) and 0 <= k < 1_000_000 for k in items):
        return [items.get(i) for i in range(max(items) + 1)]
    return items


def read_dcp(folder: str, key: str | None = None) -> Checkpoint:
    """The model state dict of a DCP folder as a `Checkpoint` of lazy tensors."""
    layout = read_dcp_layout(folder)
    nested = nested_state_dict(layout)
    ckpt = checkpoint_from_object(folder, "dcp", nested, key)
    ckpt.metadata = _record_beside(folder)
    sharded = sum(1 for t in layout.tensors.values() if len(t.chunks) > 1)
    parts = ", ".join(str(k) for k in list(nested)[:8]) + (" ..." if len(nested) > 8 else "")
    files = f"{len(layout.files)} .distcp file{'s' if len(layout.files) != 1 else ''}"
    ckpt.notes.append(
        f"torch.distributed.checkpoint folder: {files}, parts {parts}"
        + (f"; {sharded} tensors assembled from several chunks" if sharded else "")
    )
    return ckpt

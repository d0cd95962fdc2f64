"""Sharded checkpoints (the Hugging Face layout): one index, many files, ONE checkpoint.

`model.safetensors.index.json` (or `pytorch_model.bin.index.json`) is what
`transformers` / `huggingface_hub` write next to `model-00001-of-00003.safetensors`...:

    {"metadata": {"total_size": 1234}, "weight_map": {"bn1.running_mean": "model-00001-of-00003.safetensors", ...}}

The index is untrusted: `read_index` refuses a tensor listed twice, a shard path that
leaves the index's folder (absolute, `..`, or a symlink resolving outside it, except into
the repo's `blobs/` in a Hugging Face cache snapshot: formats/hfcache.py), and a
missing shard; `read_sharded` also refuses a file of the series (same stem, `-of-N`) the
index does not list and a tensor that the shards and the index disagree on. Shards are
opened lazily (safetensors headers only; torch.save zips through mmap), so a BN layer
whose `running_mean` sits in one shard and `running_var` in another is one layer, and
only the tensors the audit asks for are read, from whichever shard holds them.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

from bnaudit.errors import BnauditError
from bnaudit.formats.containers import find_state_dicts, strip_wrapper_prefix, wrap_candidate
from bnaudit.formats.hfcache import in_blobs
from bnaudit.formats.model import Checkpoint, TensorRef
from bnaudit.formats.provenance import RECORD_KEY
from bnaudit.formats.safetensors import read_safetensors
from bnaudit.formats.sniff import sniff_format
from bnaudit.text import exception_line

INDEX_SUFFIXES = (".safetensors.index.json", ".bin.index.json")

# `model-00001-of-00003.safetensors`, `pytorch_model-00002-of-00002.bin`: what
# transformers' `shard_checkpoint` / huggingface_hub's `split_torch_state_dict_into_shards` name.
SHARD_NAME = re.compile(r"^(?P<stem>.+)-(?P<k>\d{5})-of-(?P<n>\d{5})\.(?P<ext>safetensors|bin)$")

# Real indexes are kilobytes to a few megabytes (one line per tensor).
_MAX_INDEX_BYTES = 64 * 1024 * 1024


def is_index(path: str) -> bool:
    return os.path.basename(path).lower().endswith(INDEX_SUFFIXES)


def shard_position(path: str) -> tuple[int, int] | None:
    """(k, N) when the file name says it is shard k of N, else None."""
    match = SHARD_NAME.match(os.path.basename(path))
    if not match:
        return None
    k, n = int(match["k"]), int(match["n"])
    return (k, n) if 1 <= k <= n else None


def index_beside(shard: str) -> str | None:
    """The index file next to a shard that names like one (`model-00001-of-00003.safetensors`
    -> `model.safetensors.index.json`), if it exists."""
    match = SHARD_NAME.match(os.path.basename(shard))
    if not match:
        return None
    index = os.path.join(os.path.dirname(shard), f"{match['stem']}.{match['ext']}.index.json")
    return index if os.path.isfile(index) else None


def _series_of(index_path: str) -> tuple[str, str]:
    """(stem, extension) of the shard files an index belongs to: `model.safetensors.index.json`
    -> ("model", "safetensors"), `pytorch_model.bin.index.json` -> ("pytorch_model", "bin")."""
    base = os.path.basename(index_path)[: -len(".index.json")]
    stem, _, ext = base.rpartition(".")
    return stem, ext.lower()


@dataclass(frozen=True)
class ShardIndex:
    """A validated index: `weight_map` tensor name -> shard path (joined with the folder),
    `shards` in first-listed order, `metadata` as stored."""

    path: str
    weight_map: dict[str, str]
    shards: list[str]
    metadata: dict[str, Any] = field(default_factory=dict)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise BnauditError(f"tensor '{key}' listed twice in the index")
        out[key] = value
    return out


def _inside(folder: str, name: str, index_path: str) -> str:
    """The shard path `name` joined to `folder`, refused unless it stays inside the folder."""
    if not name or os.path.isabs(name) or name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name):
        raise BnauditError(f"{index_path}: shard path '{name}' is absolute: an index names files in its own folder")
    if ".." in re.split(r"[/\\]", name):
        raise BnauditError(f"{index_path}: shard path '{name}' leaves the index's folder ('..')")
    joined = os.path.join(folder, name)
    real_folder, real = os.path.realpath(folder), os.path.realpath(joined)
    # a Hugging Face cache snapshot's shards are links into its repo's blobs/: that far only
    if os.path.commonpath([real_folder, real]) != real_folder and not in_blobs(folder, real):
        raise BnauditError(
            f"{index_path}: shard '{name}' is a symlink to {os.path.realpath(joined)}, outside the index's "
            "folder: refused (copy the shards next to the index)"
        )
    return joined


def read_index(path: str) -> ShardIndex:
    """Parse and validate a shard index (see module docstring); one BnauditError per problem."""
    try:
        size = os.path.getsize(path)
        if size > _MAX_INDEX_BYTES:
            raise BnauditError(f"{path}: shard index of {size} bytes is too large to be real")
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise BnauditError(f"{path}: no such file") from None
    except OSError as exc:
        raise BnauditError(f"{path}: cannot open ({exc.strerror or exc})") from None
    try:
        doc = json.loads(raw, object_pairs_hook=_no_duplicates)
    except BnauditError as exc:
        raise BnauditError(f"{path}: {exc}") from None
    except (ValueError, RecursionError) as exc:
        raise BnauditError(f"{path}: corrupt shard index ({exception_line(exc, with_type=False)})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("weight_map"), dict):
        raise BnauditError(f'{path}: not a shard index (no "weight_map" object)')
    metadata = doc.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise BnauditError(f'{path}: corrupt shard index ("metadata" is not an object)')
    folder = os.path.dirname(path) or "."
    weight_map: dict[str, str] = {}
    joined: dict[str, str] = {}
    for name, shard in doc["weight_map"].items():
        if not isinstance(shard, str):
            raise BnauditError(f"{path}: tensor '{name}' maps to {type(shard).__name__}, not a file name")
        if shard not in joined:
            joined[shard] = _inside(folder, shard, path)
        weight_map[name] = joined[shard]
    if not weight_map:
        raise BnauditError(f"{path}: shard index lists no tensors")
    for shard, full in joined.items():
        if not os.path.isfile(full):
            raise BnauditError(f"{path}: missing shard '{shard}' (listed in the index, not in the folder)")
    return ShardIndex(path, weight_map, list(joined.values()), metadata)


def series_members(index_path: str) -> set[str]:
    """Files next to `index_path` that belong to it: those its weight map names (when it
    parses) and those named like its shards (`<stem>-0000k-of-0000N.<ext>`). Never raises:
    used to keep a directory scan or an explicit list from auditing shards twice."""
    folder = os.path.dirname(index_path) or "."
    stem, ext = _series_of(index_path)
    members: set[str] = set()
    try:
        names = os.listdir(folder)
    except OSError:
        names = []
    for name in names:
        match = SHARD_NAME.match(name)
        if match and match["stem"] == stem and match["ext"].lower() == ext:
            members.add(os.path.realpath(os.path.join(folder, name)))
    try:
        members.update(os.path.realpath(p) for p in read_index(index_path).shards)
    except BnauditError:
        pass
    return members


def _shard_tensors(shard: str, trust_pickle: bool) -> tuple[str, dict[str, TensorRef], dict[str, str]]:
    """Format, tensors (lazy, names as stored) and metadata of one shard."""
    fmt = sniff_format(shard)
    if fmt == "safetensors":
        return (fmt, *read_safetensors(shard))
    if fmt not in ("torch-zip", "torch-legacy"):
        raise BnauditError(f"{shard}: a {fmt} file cannot be a shard")
    # here: the unpickler costs start-up that safetensors shards never need
    if trust_pickle:
        from bnaudit.formats.torchobjects import load_torch_save

        obj = load_torch_save(shard, fmt, trust_pickle=True)
    else:
        from bnaudit.formats.standins import unsafe_globals_error
        from bnaudit.formats.torchsave import read_torch_save

        read = read_torch_save(shard, fmt == "torch-legacy")
        if read.stand_ins:  # a shard is a plain state dict: nothing else to skip
            raise unsafe_globals_error(shard, list(read.stand_ins))
        obj = read.value
    candidates = find_state_dicts(obj)
    if "" not in candidates:
        raise BnauditError(f"{shard}: a shard must be a plain state dict (name -> tensor)")
    return fmt, wrap_candidate(shard, fmt, candidates, "").tensors, {}


def read_sharded(path: str, trust_pickle: bool = False) -> Checkpoint:
    """One `Checkpoint` from an index and its shards (see module docstring)."""
    index = read_index(path)
    folder = os.path.dirname(path) or "."
    listed = {os.path.realpath(s) for s in index.shards}
    stem, ext = _series_of(path)
    for name in sorted(os.listdir(folder)):
        match = SHARD_NAME.match(name)
        if (
            match
            and match["stem"] == stem
            and match["ext"].lower() == ext
            and os.path.realpath(os.path.join(folder, name)) not in listed
        ):
            raise BnauditError(f"{path}: shard '{name}' is not in the index (a stale or foreign shard?)")
    tensors: dict[str, TensorRef] = {}
    holder: dict[str, str] = {}
    metadata: dict[str, str] = {}
    formats: list[str] = []
    for shard in index.shards:
        fmt, shard_refs, shard_meta = _shard_tensors(shard, trust_pickle)
        formats.append(fmt)
        for name, ref in shard_refs.items():
            if name in holder:
                raise BnauditError(
                    f"{path}: tensor '{name}' is stored twice ({os.path.basename(holder[name])} and "
                    f"{os.path.basename(shard)})"
                )
            holder[name] = shard
            tensors[name] = ref
        for k, v in shard_meta.items():
            metadata.setdefault(k, v)
    for name, shard in holder.items():
        expected = index.weight_map.get(name)
        shown = os.path.basename(shard)
        if expected is None:
            raise BnauditError(f"{path}: {shown} holds tensor '{name}', which the index does not list")
        if expected != shard:  # both the folder-joined path `read_index` made
            raise BnauditError(
                f"{path}: tensor '{name}' is in {shown} but the index puts it in {os.path.basename(expected)}"
            )
    for name, shard in index.weight_map.items():
        if name not in holder:
            raise BnauditError(
                f"{path}: the index puts tensor '{name}' in {os.path.basename(shard)}, which does not hold it"
            )
    record = index.metadata.get(RECORD_KEY)
    if isinstance(record, str):  # recalibrate's record: in the index too, for shards that carry no metadata
        metadata.setdefault(RECORD_KEY, record)
    ckpt = Checkpoint(path, "+".join(sorted(set(formats))), tensors, metadata=metadata)
    ckpt.shards = len(index.shards)
    return strip_wrapper_prefix(ckpt)

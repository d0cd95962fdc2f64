"""Statistics files (`.bnstats`): the sufficient statistics of a recalibration pass, for a
merge elsewhere (`bnaudit recalibrate --stats-out`, `bnaudit merge`, `bnaudit fed --stats`).

A statistics file is a safetensors file, written through the `safetensors` package, that
anyone can write. For every layer L of the metadata's `layers` list (the values x_1..x_n
that reached channel c during the pass):

  L.count           (C,) float64   n, the same for every channel (an integer below 2^53)
  L.mean            (C,) float64   mu_c = (1/n) sum_i x_i
  L.m2              (C,) float64   M2_c = sum_i (x_i - mu_c)^2 (so var_c = M2_c / (n - 1),
                                   the unbiased variance BN buffers hold)
  L.batch_mean_sum  (C,) float64   method cumulative only: the sum over the B BN calls of
  L.batch_var_sum   (C,) float64   the batch mean and of the unbiased batch variance

and nothing else. Its `__metadata__` (strings, as safetensors requires):

  format, format_version   "bnaudit statistics", "1"
  checkpoint_digest        SHA-256 of the checkpoint's tensors the statistics depend on (every
                           tensor but the running statistics of the listed layers)
  key, prefix              the container key of the state dict, and the part of its stored
                           names in front of the model's layer names
  layers                   JSON [{"name", "channels", "batches", "calls", "calls_per_batch"}]:
                           batches that reached the layer (its num_batches_tracked), BN calls
                           (cumulative's B), most calls in one forward
  method                   exact or cumulative (sequential needs one round per layer)
  batch_size, seed, shuffle ("true"/"false"), num_samples ("" for all)   the batch plan
  data, samples, batches, world_size                what was read, and by how many ranks
  shard                    "I/N" for --shard I/N, "" for the whole data
  batch_range              "FIRST,END": the plan's batches this file covers (END exclusive)
  plan_batches             batches in the whole plan
  bnaudit_version
  checksum                 `statistics_checksum` of everything above and every tensor

The checksum detects a hand-edited, damaged or truncated file (it is no signature: anyone
can compute it). A file read here is untrusted: its size is bounded before anything is
read, its header is validated by bnaudit's safetensors reader (the package's rules), and
every value is checked (finite, counts whole and equal across channels, M2 >= 0) before
a merge sees it. Torch-free: `fed` reads the counts without torch.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import sys
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from bnaudit.errors import BnauditError
from bnaudit.formats.safetensors import read_safetensors_header
from bnaudit.formats.sniff import STATISTICS_FORMAT

FORMAT = STATISTICS_FORMAT
FORMAT_VERSION = "1"
SUFFIX = ".bnstats"
METHODS = ("exact", "cumulative")

# Per-channel tensors of every layer, and those only the cumulative method adds.
LEAVES = ("count", "mean", "m2")
CUMULATIVE_LEAVES = ("batch_mean_sum", "batch_var_sum")

# A real file holds 3-5 float64 vectors per BN channel: a few MB for the largest models.
MAX_FILE_BYTES = 512 << 20
# Counts are kept in float64: exact integers up to 2^53.
MAX_COUNT = 2**53

_KEYS = (
    "format",
    "format_version",
    "checkpoint_digest",
    "key",
    "prefix",
    "layers",
    "method",
    "batch_size",
    "seed",
    "shuffle",
    "num_samples",
    "data",
    "samples",
    "batches",
    "world_size",
    "shard",
    "batch_range",
    "plan_batches",
    "bnaudit_version",
)


@dataclass(frozen=True)
class LayerEntry:
    """One layer of a statistics file: its name and counters, and its per-channel values."""

    name: str
    channels: int
    batches: int
    calls: int
    calls_per_batch: int
    count: int
    mean: tuple[float, ...]
    m2: tuple[float, ...]
    batch_mean_sum: tuple[float, ...] | None = None
    batch_var_sum: tuple[float, ...] | None = None


@dataclass(frozen=True)
class Shard:
    """`--shard index/count`: rank `index` of `count`'s whole batches of the plan."""

    index: int
    count: int

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def parse_shard(text: str) -> Shard:
    """ "I/N" with 0 <= I < N (torchrun's rank numbering) -> Shard; BnauditError otherwise."""
    index, slash, count = text.strip().partition("/")
    if not slash or not _digits(index) or not _digits(count) or len(text) > 40:
        raise BnauditError(f"--shard {text!r}: give I/N, shard I of N counted from 0 (e.g. 0/4)")
    shard = Shard(int(index), int(count))
    if shard.count < 1 or shard.index >= shard.count:
        raise BnauditError(f"--shard {text}: I must lie in 0..N-1 (shards are numbered like torchrun ranks)")
    return shard


@dataclass(frozen=True)
class StatisticsFile:
    """A statistics file as read and checked (module docstring for every field)."""

    path: str
    checkpoint_digest: str
    key: str | None
    prefix: str
    method: str
    batch_size: int
    seed: int
    shuffle: bool
    num_samples: int | None
    data: str
    samples: int
    batches: int
    world_size: int
    shard: Shard | None
    batch_range: tuple[int, int]
    plan_batches: int
    bnaudit_version: str
    checksum: str
    layers: tuple[LayerEntry, ...]

    @property
    def layer_names(self) -> tuple[str, ...]:
        return tuple(layer.name for layer in self.layers)

    def plan(self) -> tuple[Any, ...]:
        """What makes two files' batches parts of one plan: the data and how it was batched."""
        return (self.data, self.batch_size, self.seed, self.shuffle, self.num_samples, self.plan_batches)


def statistics_checksum(metadata: Mapping[str, str], tensors: Mapping[str, tuple[str, Sequence[int], bytes]]) -> str:
    """SHA-256 over the metadata (every key but `checksum`, as sorted JSON) and every tensor
    (name, dtype, shape and little-endian bytes, in name order): what `checksum` holds."""
    digest = hashlib.sha256(b"bnaudit statistics checksum 1\0")
    shown = {k: v for k, v in metadata.items() if k != "checksum"}
    digest.update(json.dumps(shown, sort_keys=True, ensure_ascii=True).encode("ascii"))
    for name in sorted(tensors):
        dtype, shape, raw = tensors[name]
        digest.update(b"\0" + json.dumps([name, dtype, list(shape), len(raw)], ensure_ascii=True).encode("ascii"))
        digest.update(raw)
    return digest.hexdigest()


def float64_bytes(values: Sequence[float]) -> bytes:
    """Little-endian float64 bytes of `values` (what safetensors stores for F64)."""
    return struct.pack(f"<{len(values)}d", *values)


def layer_tensors(layers: Sequence[LayerEntry], method: str) -> dict[str, list[float]]:
    """The per-channel tensors of `layers` by name, as the file stores them."""
    out: dict[str, list[float]] = {}
    for layer in layers:
        out[f"{layer.name}.count"] = [float(layer.count)] * layer.channels
        out[f"{layer.name}.mean"] = list(layer.mean)
        out[f"{layer.name}.m2"] = list(layer.m2)
        if method == "cumulative":
            out[f"{layer.name}.batch_mean_sum"] = list(layer.batch_mean_sum or ())
            out[f"{layer.name}.batch_var_sum"] = list(layer.batch_var_sum or ())
    return out


def statistics_metadata(stats: StatisticsFile) -> dict[str, str]:
    """The `__metadata__` of `stats` without its checksum (`write_statistics` adds it)."""
    entries = [
        {
            "name": layer.name,
            "channels": layer.channels,
            "batches": layer.batches,
            "calls": layer.calls,
            "calls_per_batch": layer.calls_per_batch,
        }
        for layer in stats.layers
    ]
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "checkpoint_digest": stats.checkpoint_digest,
        "key": stats.key or "",
        "prefix": stats.prefix,
        "layers": json.dumps(entries, ensure_ascii=True),
        "method": stats.method,
        "batch_size": str(stats.batch_size),
        "seed": str(stats.seed),
        "shuffle": "true" if stats.shuffle else "false",
        "num_samples": "" if stats.num_samples is None else str(stats.num_samples),
        "data": stats.data,
        "samples": str(stats.samples),
        "batches": str(stats.batches),
        "world_size": str(stats.world_size),
        "shard": "" if stats.shard is None else str(stats.shard),
        "batch_range": f"{stats.batch_range[0]},{stats.batch_range[1]}",
        "plan_batches": str(stats.plan_batches),
        "bnaudit_version": stats.bnaudit_version,
    }


def write_statistics(stats: StatisticsFile, output: str, force: bool = False) -> str:
    """Write `stats` to `output` through the `safetensors` package, atomically (`atomic_write`:
    all or nothing); returns the checksum written. `stats.checksum` is ignored."""
    import torch

    from bnaudit.formats.atomic import atomic_write
    from bnaudit.formats.write import write_safetensors

    for layer in stats.layers:
        _check_layer(output, layer, stats.method)
    values = layer_tensors(stats.layers, stats.method)
    metadata = statistics_metadata(stats)
    metadata["checksum"] = statistics_checksum(
        metadata, {name: ("F64", (len(v),), float64_bytes(v)) for name, v in values.items()}
    )
    tensors = {name: torch.tensor(v, dtype=torch.float64) for name, v in values.items()}
    atomic_write(output, lambda f: write_safetensors(tensors, metadata, f), force=force)
    return metadata["checksum"]


def read_statistics(path: str) -> StatisticsFile:
    """Read and check the statistics file `path` (module docstring); one BnauditError line
    naming the file and the first problem."""
    try:
        size = os.path.getsize(path)
    except OSError as exc:
        raise BnauditError(f"{path}: cannot read statistics file ({exc.strerror or exc})") from None
    if os.path.isdir(path):
        raise BnauditError(f"{path}: is a directory, not a statistics file")
    if size > MAX_FILE_BYTES:
        raise BnauditError(f"{path}: {size} bytes is too large for a statistics file (at most {MAX_FILE_BYTES})")
    try:
        header = read_safetensors_header(path)
    except BnauditError as exc:  # the reader's line starts with the path
        raise BnauditError(f"{path}: not a complete statistics file ({str(exc).removeprefix(path + ': ')})") from None
    meta = header.metadata
    if meta.get("format") != FORMAT:
        raise BnauditError(f"{path}: not a bnaudit statistics file (no format '{FORMAT}' in its metadata)")
    if meta.get("format_version") != FORMAT_VERSION:
        raise BnauditError(
            f"{path}: statistics file format version {meta.get('format_version', '?')[:20]!r}; this bnaudit "
            f"reads version {FORMAT_VERSION}"
        )
    missing = [k for k in (*_KEYS, "checksum") if k not in meta]
    if missing:
        raise BnauditError(f"{path}: statistics file without {', '.join(missing)} in its metadata")
    with open(path, "rb") as f:
        f.seek(header.data_start)
        data = f.read(size - header.data_start)
    if len(data) != size - header.data_start:
        raise BnauditError(f"{path}: truncated statistics file")
    raw = {name: data[e.begin : e.end] for name, e in header.entries.items()}
    expected = statistics_checksum(meta, {n: (e.dtype, e.shape, raw[n]) for n, e in header.entries.items()})
    if meta["checksum"] != expected:
        raise BnauditError(
            f"{path}: the checksum does not match the contents: the statistics file was edited or damaged "
            "after bnaudit wrote it"
        )
    return _interpret(path, meta, header.entries, raw)


def _interpret(
    path: str, meta: Mapping[str, str], entries: Mapping[str, Any], raw: Mapping[str, bytes]
) -> StatisticsFile:
    """The checked metadata and values of a file whose checksum matched."""
    method = meta["method"]
    if method not in METHODS:
        raise BnauditError(f"{path}: unknown method {method[:30]!r} in a statistics file")
    try:
        layer_info = json.loads(meta["layers"])
    except (ValueError, RecursionError):
        layer_info = None
    if not isinstance(layer_info, list) or not layer_info:
        raise BnauditError(f"{path}: the statistics file's layer list is not a non-empty JSON list")
    leaves = LEAVES + (CUMULATIVE_LEAVES if method == "cumulative" else ())
    layers: list[LayerEntry] = []
    names: set[str] = set()
    for item in layer_info:
        layers.append(_layer(path, item, leaves, entries, raw, method))
        if layers[-1].name in names:
            raise BnauditError(f"{path}: layer {layers[-1].name!r} is listed twice")
        names.add(layers[-1].name)
    expected = {f"{layer.name}.{leaf}" for layer in layers for leaf in leaves}
    extra = sorted(set(entries) - expected)
    if extra:
        raise BnauditError(f"{path}: tensor {extra[0]!r} belongs to no listed layer")
    shard_text = meta["shard"]
    first, _, end = meta["batch_range"].partition(",")
    record = StatisticsFile(
        path=path,
        checkpoint_digest=_text(path, meta, "checkpoint_digest"),
        key=meta["key"] or None,
        prefix=meta["prefix"],
        method=method,
        batch_size=_integer(path, "batch_size", meta["batch_size"], 1),
        seed=_integer(path, "seed", meta["seed"], -(2**63)),
        shuffle=_flag(path, meta["shuffle"]),
        num_samples=None if meta["num_samples"] == "" else _integer(path, "num_samples", meta["num_samples"], 1),
        data=meta["data"],
        samples=_integer(path, "samples", meta["samples"], 1),
        batches=_integer(path, "batches", meta["batches"], 1),
        world_size=_integer(path, "world_size", meta["world_size"], 1),
        shard=None if shard_text == "" else _shard(path, shard_text),
        batch_range=(_integer(path, "batch_range", first, 0), _integer(path, "batch_range", end, 0)),
        plan_batches=_integer(path, "plan_batches", meta["plan_batches"], 1),
        bnaudit_version=meta["bnaudit_version"],
        checksum=meta["checksum"],
        layers=tuple(layers),
    )
    start, stop = record.batch_range
    if not start < stop <= record.plan_batches or stop - start != record.batches:
        raise BnauditError(
            f"{path}: batch_range {start},{stop} does not fit {record.batches} of {record.plan_batches} batches"
        )
    return record


def _layer(
    path: str, item: Any, leaves: tuple[str, ...], entries: Mapping[str, Any], raw: Mapping[str, bytes], method: str
) -> LayerEntry:
    fields = ("name", "channels", "batches", "calls", "calls_per_batch")
    if not isinstance(item, dict) or set(item) != set(fields):
        raise BnauditError(f"{path}: a layer entry is not an object of {', '.join(fields)}")
    name = item["name"]
    if not isinstance(name, str) or not name:
        raise BnauditError(f"{path}: a layer name is not a non-empty string")
    counters = {}
    for field in fields[1:]:
        value = item[field]
        if not isinstance(value, int) or isinstance(value, bool) or not 0 < value < MAX_COUNT:
            raise BnauditError(f"{path}: layer {name!r}: {field} is not a positive integer")
        counters[field] = value
    channels = counters["channels"]
    values: dict[str, list[float]] = {}
    for leaf in leaves:
        tensor = f"{name}.{leaf}"
        entry = entries.get(tensor)
        if entry is None:
            raise BnauditError(f"{path}: layer {name!r} has no tensor {tensor!r}")
        if entry.dtype != "F64" or entry.shape != (channels,):
            raise BnauditError(f"{path}: tensor {tensor!r} is {entry.dtype} {list(entry.shape)}, not F64 [{channels}]")
        values[leaf] = _float64s(raw[tensor])
        if not all(math.isfinite(v) for v in values[leaf]):
            raise BnauditError(f"{path}: tensor {tensor!r} holds NaN or Inf")
    counts = values["count"]
    count = counts[0]
    if any(c != count for c in counts) or count != int(count) or not 2 <= count < MAX_COUNT:
        raise BnauditError(f"{path}: layer {name!r}: count must be one whole number of at least 2 for every channel")
    if any(v < 0 for v in values["m2"]) or (method == "cumulative" and any(v < 0 for v in values["batch_var_sum"])):
        raise BnauditError(f"{path}: layer {name!r}: a sum of squared deviations is negative")
    entry = LayerEntry(
        name,
        channels,
        counters["batches"],
        counters["calls"],
        counters["calls_per_batch"],
        int(count),
        tuple(values["mean"]),
        tuple(values["m2"]),
    )
    if method == "cumulative":
        entry = replace(
            entry, batch_mean_sum=tuple(values["batch_mean_sum"]), batch_var_sum=tuple(values["batch_var_sum"])
        )
    return entry


def _check_layer(path: str, layer: LayerEntry, method: str) -> None:
    """What the writer refuses to put in a file (the reader refuses it too)."""
    sums = (layer.batch_mean_sum, layer.batch_var_sum)
    vectors = (layer.mean, layer.m2, *(sums if method == "cumulative" else ()))
    if any(v is None or len(v) != layer.channels for v in vectors):
        raise BnauditError(f"{path}: layer {layer.name}: statistics of the wrong length")
    if not all(math.isfinite(x) for v in vectors if v is not None for x in v):
        raise BnauditError(f"{path}: layer {layer.name}: the statistics are not finite; nothing written")


def _float64s(raw: bytes) -> list[float]:
    values = array("d")
    values.frombytes(raw)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


def _text(path: str, meta: Mapping[str, str], key: str) -> str:
    value = meta[key]
    if not value:
        raise BnauditError(f"{path}: {key} is empty in a statistics file")
    return value


def _integer(path: str, key: str, text: str, least: int) -> int:
    if not _digits(text.removeprefix("-")) or len(text) > 24 or int(text) < least:
        raise BnauditError(f"{path}: {key} {text[:30]!r} is not an integer of at least {least}")
    return int(text)


def _digits(text: str) -> bool:
    """ASCII digits only (str.isdigit also takes superscripts, which int() refuses)."""
    return text.isascii() and text.isdigit()


def _flag(path: str, text: str) -> bool:
    if text not in ("true", "false"):
        raise BnauditError(f"{path}: shuffle {text[:10]!r} is neither true nor false")
    return text == "true"


def _shard(path: str, text: str) -> Shard:
    try:
        return parse_shard(text)
    except BnauditError:
        raise BnauditError(f"{path}: shard {text[:40]!r} is not I/N") from None

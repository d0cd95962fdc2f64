"""The recalibration record: what `bnaudit recalibrate` writes beside the statistics it
re-estimated, and what `inspect` and `diff` read back. One typed record, written and read
here only.

Where it is kept (each reader hands its raw text over as the metadata entry `bnaudit`):
a safetensors file's metadata, a torch state dict's `_metadata[""]["bnaudit"]`, a pickled
module's `MODULE_RECORD_ATTRIBUTE`, a TorchScript archive's `extra/bnaudit.json`, a DCP
folder's `bnaudit.json`, a shard index's `metadata.bnaudit`. The text is JSON with sorted
keys. A record read from a file is untrusted: anything that is not a JSON object whose
every field has its type is no record at all (`audit/provenance.py` then audits the file
as usual), a record without well-formed digests binds no layer (its claims are reported as
not matching), and even a well-formed record speaks for a layer only where its digest
matches the statistics stored now.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

# The metadata key the record is stored under.
RECORD_KEY = "bnaudit"

# The attribute in which a pickled nn.Module carries the record (a string: unpickled by
# torch.load(weights_only=True) like any attribute of an allowed module).
MODULE_RECORD_ATTRIBUTE = "bnaudit_recalibration"

_MAX_RECORD = 10_000_000  # characters: a record names each layer twice, far below this


@dataclass(frozen=True)
class StatisticsSource:
    """One statistics file a merged recalibration was made of (`bnaudit merge`): its name as
    given, its samples and batches, its `--shard` ("" for the whole data), the data it
    describes and its checksum (`bnaudit.formats.bnstats`)."""

    file: str
    samples: int
    batches: int
    shard: str
    data: str
    checksum: str


@dataclass(frozen=True)
class RecalibrationRecord:
    """One run of `bnaudit recalibrate`, or one `bnaudit merge` of statistics files.

    method               exact, sequential or cumulative (bnaudit.runtime.recalibrate)
    samples, batches     calibration samples and batches seen (all ranks together)
    batch_size, seed, shuffle, data   how the data was read (`data`: its description)
    world_size           torchrun ranks (1 without torchrun)
    recalibrated_layers  the layers re-estimated: their num_batches_tracked counts
                         calibration batches, not training steps
    digests              layer -> `statistics_digest` of the statistics written: binds the
                         record to them
    bnaudit_version, date  who wrote it and when (SOURCE_DATE_EPOCH when set)
    statistics_files     a merge: every statistics file merged (empty for a recalibrate run);
                         samples, batches and world_size are then the files' sums, and
                         batch_size, seed and shuffle the files' common values (0, 0 and
                         false where they differ)
    """

    method: str
    samples: int
    batches: int
    batch_size: int
    seed: int
    shuffle: bool
    data: str
    world_size: int
    recalibrated_layers: tuple[str, ...]
    digests: Mapping[str, str]
    bnaudit_version: str
    date: str
    statistics_files: tuple[StatisticsSource, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """The record as JSON data; `layers` (their count) is written for readers' convenience
        and ignored when read back."""
        data: dict[str, Any] = {}
        for field in fields(self):
            value = getattr(self, field.name)
            if field.name == "recalibrated_layers":
                data["layers"] = len(value)
                value = list(value)
            elif field.name == "digests":
                value = dict(value)
            elif field.name == "statistics_files":
                if not value:
                    continue  # a recalibrate run's record stays as it was
                value = [{f.name: getattr(source, f.name) for f in fields(source)} for source in value]
            data[field.name] = value
        return data

    def to_json(self) -> str:
        """The text stored in a file's metadata."""
        return json.dumps(self.as_dict(), sort_keys=True)

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, str]) -> RecalibrationRecord | None:
        """The record in a file's metadata (`RECORD_KEY`), or None when there is none or it
        is not well formed (see the module docstring)."""
        raw = metadata.get(RECORD_KEY)
        if not isinstance(raw, str) or len(raw) > _MAX_RECORD:
            return None
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError):
            return None
        if not isinstance(data, dict):
            return None
        values: dict[str, Any] = {}
        for field in fields(cls):
            value = data.get(field.name)
            if field.name == "recalibrated_layers":
                if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                    return None
                value = tuple(value)
            elif field.name == "digests":  # absent or malformed: the record binds no layer
                valid = isinstance(value, dict) and all(isinstance(v, str) for v in value.values())
                value = value if valid else {}
            elif field.name == "statistics_files":
                sources = _sources(value)
                if sources is None:
                    return None
                value = sources
            elif not _is(value, field.type):
                return None
            values[field.name] = value
        return cls(**values)


def _sources(value: Any) -> tuple[StatisticsSource, ...] | None:
    """A record's `statistics_files` (absent: none), or None when it is not a list of
    objects whose every field has its type."""
    if value is None:
        return ()
    if not isinstance(value, list):
        return None
    sources = []
    for item in value:
        if not isinstance(item, dict):
            return None
        kept = {}
        for field in fields(StatisticsSource):
            if not _is(item.get(field.name), field.type):
                return None
            kept[field.name] = item[field.name]
        sources.append(StatisticsSource(**kept))
    return tuple(sources)


def _is(value: Any, annotation: object) -> bool:
    """Whether a JSON value has a scalar field's type (annotations are strings here)."""
    if annotation == "bool":
        return isinstance(value, bool)
    if annotation == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, str)


def statistics_digest(running_mean: list[float], running_var: list[float]) -> str:
    """SHA-256 of a layer's statistics as stored, each value widened exactly to a
    little-endian double (mean then var): what a recalibration record binds its layer to,
    so that statistics changed after `recalibrate` (further training, a record copied
    from another file) are audited as usual. Torch-free: computed from `TensorRef.read()`."""
    import hashlib

    values = [float(v) for v in running_mean] + [float(v) for v in running_var]
    return hashlib.sha256(struct.pack(f"<{len(values)}d", *values)).hexdigest()


def record_from_state_dict_metadata(metadata: Any) -> dict[str, str]:
    """The record's text as a torch state dict keeps it in `_metadata` (root entry "", key
    "bnaudit"; `load_state_dict` reads only "version" there), as the `{"bnaudit": json}`
    metadata a safetensors file carries; {} if there is none."""
    root = metadata.get("") if isinstance(metadata, Mapping) else None
    raw = root.get(RECORD_KEY) if isinstance(root, Mapping) else None
    return {RECORD_KEY: raw} if isinstance(raw, str) else {}

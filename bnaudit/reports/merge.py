"""The `merge` report: which statistics files were merged into which checkpoint, and per layer
how far the old and the new statistics are from the merged statistics
(`bnaudit.audit.statistics.Drift`, as `recalibrate` reports them).

Torch-free: `bnaudit.output` renders these records; `bnaudit.runtime.recalibrate.merge`
fills them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from bnaudit.formats.provenance import RecalibrationRecord
from bnaudit.reports.recalibrate import LayerChange


@dataclass(frozen=True)
class MergedFile:
    """One statistics file of a merge, as its metadata describes it."""

    path: str
    samples: int
    batches: int
    shard: str | None  # "I/N"; None: the whole data
    data: str
    world_size: int


@dataclass
class MergeReport:
    """The result of `merge_statistics`: the checkpoint written from the merged statistics."""

    kind: ClassVar[Literal["merge"]] = "merge"  # bnaudit.output.EMITTERS

    checkpoint: str
    output: str
    format: str
    key: str | None
    method: str
    samples: int
    batches: int
    files: list[MergedFile]
    layers: list[LayerChange]
    warnings: list[str]
    provenance: RecalibrationRecord
    prefix: str = ""  # the wrapper prefix of the checkpoint's keys

"""The `recalibrate` report: what was written, and how far the old and the new statistics
are from the calibration data per layer (`bnaudit.audit.statistics.Drift`).

Torch-free: `bnaudit.output` renders these records; `bnaudit.runtime.recalibrate.command`
fills them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from bnaudit.audit.statistics import Drift
from bnaudit.formats.provenance import RecalibrationRecord
from bnaudit.reports.gap import GapReport


@dataclass(frozen=True)
class SkippedLayer:
    """A normalisation layer whose statistics were left as they are, and why."""

    name: str
    reason: str


@dataclass(frozen=True)
class LayerChange:
    """One recalibrated layer: drift of the old and of the new (stored) statistics
    against the calibration data's statistics (the data mean and unbiased variance per
    channel that the new statistics were estimated from)."""

    name: str
    channels: int
    values: int
    batches: int
    before: Drift
    after: Drift


@dataclass
class RecalibrationReport:
    """The result of `recalibrate_checkpoint`; `eval_before` / `eval_after`: the gap
    reports of the input and of the written checkpoint on --eval-data (else None).
    `output` None: only the statistics file `stats_out` was written (then `provenance` is
    None too); `shard`: "I/N" for a run of --shard I/N."""

    kind: ClassVar[Literal["recalibrate"]] = "recalibrate"  # bnaudit.output.EMITTERS

    input: str
    output: str | None
    format: str
    key: str | None
    model: str
    data: str
    method: str
    samples: int
    batches: int
    batch_size: int
    seed: int
    shuffle: bool
    device: str
    world_size: int
    layers: list[LayerChange]
    skipped: list[SkippedLayer]
    warnings: list[str]
    provenance: RecalibrationRecord | None
    eval_before: GapReport | None = None
    eval_after: GapReport | None = None
    prefix: str = ""  # the wrapper prefix stripped from the input's keys
    stats_out: str | None = None
    shard: str | None = None

"""The result of `inspect`: per-layer summaries, per-file findings, the exit code.

Plain dataclasses with everything the emitters of bnaudit.output print, computed here
once (min / median / max of the statistics, eval gains, near-eps channels), so that
table, JSON and SARIF cannot disagree. Statistics are summarised without NaNs;
`InspectReport.exit_code` is 2 for an unreadable file, 1 for a finding at or above
`fail_on`, else 0 (with `exit_zero`: 2 only for an unreadable file the user named);
files skipped as not model weights never count.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from bnaudit.audit.layers import BNLayer
from bnaudit.audit.rules import Finding
from bnaudit.config import SEVERITIES, Config, exit_code_for, severity_rank
from bnaudit.formats.hfcache import HubSource
from bnaudit.formats.model import Averaging
from bnaudit.severity import Severity


@dataclass(frozen=True)
class LayerChannels:
    """Every channel of one BN layer, for the renderers that draw them (`--format html`).

    running_var  the stored running_var per channel (NaN and Inf as read)
    eval_gain    |gamma_c| / sqrt(running_var_c + eps), bnaudit.audit.formulas.eval_gains
                 (NaN where the variance is invalid)
    near_eps     the near-eps channels (formulas.near_eps_channels at the report's factor)

    Kept only when asked (`inspect_paths(..., channels=True)`): every other format prints the
    summary alone, and a scan of many files should neither hold nor send between its worker
    processes a list per channel that nothing reads. The lists are the layer's own, read
    once (`BNLayer`), never copied or recomputed.
    """

    running_var: list[float]
    eval_gain: list[float]
    near_eps: list[int]


@dataclass(frozen=True)
class LayerSummary:
    """What the reports print of one BN layer: its settings and its statistics summarised;
    `channels`, the per-channel values, only where the report was asked to keep them."""

    name: str
    kind: str
    num_features: int
    num_batches_tracked: int | None
    eps: float
    momentum: float | None
    stats_dtype: str
    mean_min: float | None
    mean_max: float | None
    var_min: float | None
    var_median: float | None
    var_max: float | None
    near_eps_channels: int
    max_eval_gain: float | None
    # not a summary: left out of equality and repr (a summary is the same with or without it)
    channels: LayerChannels | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, layer: BNLayer, near_eps_factor: float, channels: bool = False) -> LayerSummary:
        """`layer` summarised; `channels`: keep its per-channel values too (LayerChannels)."""
        mean, gains = _numbers(layer.running_mean), _numbers(layer.gains)
        ordered = sorted(layer.running_var if layer.var_finite else _numbers(layer.running_var))
        near_eps = layer.near_eps(near_eps_factor)
        return cls(
            name=layer.name,
            kind=layer.kind,
            num_features=layer.num_features,
            num_batches_tracked=layer.num_batches_tracked,
            eps=layer.eps,
            momentum=layer.momentum,
            stats_dtype=layer.stats_dtype,
            mean_min=min(mean, default=None),
            mean_max=max(mean, default=None),
            var_min=ordered[0] if ordered else None,
            var_median=_median(ordered) if ordered else None,
            var_max=ordered[-1] if ordered else None,
            near_eps_channels=len(near_eps),
            max_eval_gain=max(gains, default=None),
            channels=LayerChannels(layer.running_var, layer.gains, near_eps) if channels else None,
        )


def _numbers(values: list[float]) -> list[float]:
    """The values without NaN (one C-speed sum tells whether there is any)."""
    total = sum(values)
    return values if total == total else [v for v in values if v == v]  # v != v: NaN


def _median(ordered: list[float]) -> float:
    """The middle value of sorted values, or the mean of the two middle ones (as numpy.median)."""
    half = len(ordered) // 2
    return ordered[half] if len(ordered) % 2 else (ordered[half - 1] + ordered[half]) / 2


# FileReport.skip_reason: a training-run file (formats/classify.py), a file of no
# checkpoint format found by a scan (formats/sniff.py), a data set found by a scan.
SKIP_REASONS = ("not model weights", "not a checkpoint", "data, not a model")


@dataclass
class FileReport:
    """The audit of one file: its layers and findings, or why it was not audited."""

    path: str
    format: str | None = None
    key: str | None = None
    other_keys: list[str] = field(default_factory=list)
    prefix: str = ""
    is_ema: bool = False
    averaging: Averaging | None = None  # an averaged copy (SWA / EMA): how it was averaged
    settings: str = ""
    provenance: str = ""
    # objects outside the state dict that the restricted reader left as inert stand-ins
    not_loaded: list[str] = field(default_factory=list)
    layers: list[LayerSummary] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    error: str | None = None
    # Named on the command line but excluded by the configuration: why (not audited).
    excluded: str | None = None
    # Recognisably not model weights (optimizer, scheduler, RNG state, training
    # arguments), no checkpoint format at all, or a data set found by a scan: what it is.
    # Never audited, never an exit code.
    skipped: str | None = None
    # Why a skipped file has nothing to audit: SKIP_REASONS.
    skip_reason: str = "not model weights"
    # False for a file a directory scan found; True for one the user named (an
    # unreadable named file is exit 2 even with --exit-zero).
    named: bool = True
    # What the reader says about the layout (shards joined, a shard read alone).
    notes: list[str] = field(default_factory=list)
    # A file of a Hugging Face cache: its repo, revision and path in the snapshot.
    hub: HubSource | None = None
    # One of several state dicts of the same file, each audited (a live model and its EMA
    # copy in one container): shown as `path:key`.
    entry: bool = False

    @property
    def shown(self) -> str:
        """The name printed for the file: its path, or `repo@revision/file` from the hub
        cache; `path:key` for one of several state dicts of the file."""
        where = self.hub.shown() if self.hub is not None else self.path
        return f"{where}:{self.key}" if self.entry and self.key is not None else where

    def skipped_line(self) -> str:
        """ "path: skipped: optimizer state (state, param_groups): not model weights"."""
        return f"{self.shown}: skipped: {self.skipped}: {self.skip_reason}"

    def layer_status(self, name: str) -> str:
        severities = [f.severity for f in self.findings if f.layer == name]
        return max(severities, key=severity_rank) if severities else "ok"


@dataclass
class InspectReport:
    """The result of `inspect`: one FileReport per file, and the configuration they were audited with."""

    kind: ClassVar[Literal["inspect"]] = "inspect"  # bnaudit.output.EMITTERS

    files: list[FileReport]
    config: Config

    @property
    def findings(self) -> list[Finding]:
        return [f for file in self.files for f in file.findings]

    def summary(self) -> dict[str, int]:
        """Counts; `files` are the files audited or unreadable, `excluded` those named on
        the command line that the configuration's `exclude` left out, `state_dicts` the
        model state dicts audited (more than the files where a container holds several: a
        live model and its EMA copy)."""
        counts = {s: sum(1 for f in self.findings if f.severity == s) for s in SEVERITIES}
        entries = [f for f in self.files if f.entry]
        return {
            "files": sum(1 for f in self.files if f.excluded is None and not f.entry) + len({f.path for f in entries}),
            "state_dicts": sum(1 for f in self.files if not (f.excluded or f.skipped or f.error)),
            "excluded": sum(1 for f in self.files if f.excluded is not None),
            "layers": sum(len(f.layers) for f in self.files),
            "errors": counts[Severity.ERROR],
            "warnings": counts[Severity.WARNING],
            "infos": counts[Severity.INFO],
            "unreadable": sum(1 for f in self.files if f.error),
        }

    @property
    def skipped(self) -> list[FileReport]:
        return [f for f in self.files if f.skipped]

    def exit_code(self, fail_on: str | None = None, exit_zero: bool = False) -> int:
        """2 if a file could not be read, 1 if a finding is at or above fail_on, else 0.

        `exit_zero`: 0 unless a file the user named could not be read (an unreadable
        file found by a directory scan is reported, not an exit code). Skipped non-weight
        files never count.
        """
        return exit_code_for(
            (f.severity for f in self.findings),
            fail_on or self.config.fail_on,
            error=any(f.error and f.named for f in self.files),
            found_error=any(f.error for f in self.files),
            exit_zero=exit_zero,
        )

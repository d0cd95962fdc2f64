"""The `gap` report: its records, and the diagnosis in plain words that follows from them.

Torch-free: `bnaudit.output` renders these records and imports this module; the
measurement that fills them is `bnaudit.runtime.gap` (whose docstring defines every
figure: accuracy, gap, agreement, divergence, per-layer drift).

Per channel c of a BN layer, with mu_d, var_d the mean and unbiased variance of the data
reaching the layer in eval mode and mu_r, var_r its running statistics
(`bnaudit.audit.statistics` defines the per-layer aggregates):

  shift_c        |mu_d - mu_r| / sqrt(var_r + eps)           (in running standard deviations)
  log_var_c      |log((var_d + eps) / (var_r + eps))|         (0: the variances agree)
  score_c        shift_c + log_var_c                          (a channel's drift)

A layer is *large* (its stored statistics do not describe the data) when its channel-mean
shift or variance log-ratio reaches DRIFT_LARGE or its peak (largest score_c) reaches
PEAK_LARGE; `bnaudit.runtime.attribution` decides origins from that.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from bnaudit.audit.checkpoint.report import FileReport
from bnaudit.audit.rules import Finding
from bnaudit.config import exit_code_for
from bnaudit.errors import BnauditError
from bnaudit.text import layer_list, plural

# A channel-mean shift or variance log-ratio at or above this: the layer's statistics do
# not describe the data (half a running std off, or a variance off by a factor 1.65).
DRIFT_LARGE = 0.5

# One channel this far off (e.g. 2 running stds, or a variance off by a factor 7.4)
# makes its layer large on its own, even when the channel mean hides it.
PEAK_LARGE = 2.0


@dataclass(frozen=True)
class ChannelDrift:
    """One channel's statistics and drift (see the module docstring for the formulas)."""

    index: int
    data_mean: float
    data_var: float
    running_mean: float
    running_var: float
    shift: float
    log_var_ratio: float

    @property
    def score(self) -> float:
        """shift + log_var_ratio."""
        return self.shift + self.log_var_ratio


def is_large(mean_shift: float | None, var_log_ratio: float | None, peak: float | None) -> bool:
    """A layer whose stored statistics do not describe the data (module docstring)."""
    return any(v is not None and v >= DRIFT_LARGE for v in (mean_shift, var_log_ratio)) or (
        peak is not None and peak >= PEAK_LARGE
    )


# An accuracy difference (or disagreement) of at least one point is worth explaining.
GAP_NOTABLE = 0.01


# Below this many samples per batch, batch statistics are noisy (Wu & Johnson 2021).
SMALL_BATCH = 16


@dataclass(frozen=True)
class LayerDrift:
    """Drift of one BN layer (see the module docstring); None where not measurable.

    `position` is the layer's place in registration order (0 = first BN layer);
    `values` the number of values per channel that reached it in eval mode.
    """

    name: str
    position: int
    kind: str
    channels: int
    values: int
    mean_shift: float | None
    max_mean_shift: float | None
    var_log_ratio: float | None
    note: str | None = None
    worst: tuple[ChannelDrift, ...] = ()
    peak: float | None = None
    broad: float = 0.0
    origin: bool = False

    @property
    def drift(self) -> float | None:
        if self.mean_shift is None or self.var_log_ratio is None:
            return None
        return self.mean_shift + self.var_log_ratio

    @property
    def large(self) -> bool:
        return is_large(self.mean_shift, self.var_log_ratio, self.peak)


@dataclass
class GapReport:
    """The result of `measure_gap`; `layers` ranked by drift, worst first. `max_gap`: the
    largest gap (a fraction of samples) that passes, None for no limit."""

    kind: ClassVar[Literal["gap"]] = "gap"  # bnaudit.output.EMITTERS

    checkpoint: str
    model: str
    data: str
    samples: int
    batch_size: int
    batches: int
    seed: int
    shuffle: bool
    device: str
    train_accuracy: float | None
    eval_accuracy: float | None
    gap: float | None
    agreement: float | None
    divergence: float | None
    divergence_kind: str
    layers: list[LayerDrift]
    inspection: FileReport
    diagnosis: list[str] = field(default_factory=list)
    skipped: int = 0
    non_finite: dict[str, int] = field(default_factory=dict)
    max_gap: float | None = None
    strict: bool = False
    fail_on: str | None = None
    labelled: int = 0
    train_interval: tuple[float, float] | None = None
    eval_interval: tuple[float, float] | None = None
    gap_interval: tuple[float, float] | None = None
    input_mean: list[float] | None = None
    input_std: list[float] | None = None
    implied_mean: list[float] | None = None
    implied_std: list[float] | None = None
    preprocessing_mismatch: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def findings(self) -> list[Finding]:
        return self.inspection.findings

    @property
    def key(self) -> str | None:
        """The state dict measured: --key, or the one the reader chose in a container."""
        return self.inspection.key

    @property
    def prefix(self) -> str:
        """The wrapper prefix stripped from its keys ("" when none)."""
        return self.inspection.prefix

    @property
    def gap_significant(self) -> bool | None:
        """Whether the gap's 95% interval excludes 0 (None without labels)."""
        if self.gap_interval is None:
            return None
        low, high = self.gap_interval
        return low > 0 or high < 0

    @property
    def exceeds_max_gap(self) -> bool:
        """Whether the gap exceeds `max_gap`: significantly (its 95% interval excludes 0),
        or at all with `strict`. False without a `max_gap` or without a gap."""
        if self.max_gap is None or self.gap is None or self.gap <= self.max_gap:
            return False
        return self.strict or bool(self.gap_significant)

    def exit_code(self, exit_zero: bool = False) -> int:
        """`bnaudit.config.exit_code_for`: 1 when the gap exceeds `max_gap` (`exceeds_max_gap`)
        or an inspect finding is at or above `fail_on`; 2, never an exception, for a
        `max_gap` without a gap to check (unlabelled data: `measure_gap` refuses it first,
        with the reason); 0 otherwise or with `exit_zero`."""
        return exit_code_for(
            (f.severity for f in self.findings),
            self.fail_on,
            failed=self.exceeds_max_gap,
            error=self.max_gap is not None and self.gap is None,
            exit_zero=exit_zero,
        )


NEEDS_LABELS = "--max-gap needs labelled data (the gap is an accuracy difference)"


def check_max_gap(max_gap: float | None) -> None:
    """Refuse a --max-gap that is no fraction of samples (the gap lies in [-1, 1])."""
    if max_gap is not None and not -1 <= max_gap <= 1:  # also refuses NaN
        raise BnauditError(f"--max-gap is a fraction of samples in [-1, 1], got {max_gap}")


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 100:.1f}%"


def diagnose(report: GapReport, scripted: bool = False) -> list[str]:
    """Plain-word conclusions that follow from the numbers and the inspect findings: the
    suspected input, the accuracy gap, reset or immature statistics, where drift starts,
    dead channels and invalid values, the batch size, and what to do."""
    by_code: dict[str, list[Finding]] = {}
    for f in report.inspection.findings:
        by_code.setdefault(f.code, []).append(f)
    ordered = sorted((d for d in report.layers if d.drift is not None), key=lambda d: d.position)
    gap, agreement = report.gap, report.agreement
    eval_loses = gap > GAP_NOTABLE if gap is not None else (agreement is not None and agreement < 1 - GAP_NOTABLE)
    eval_wins = gap is not None and gap < -GAP_NOTABLE
    reset = [f.layer for f in by_code.get("BN002", []) if f.layer]
    immature = [f.layer for f in by_code.get("BN003", []) if f.layer]
    dead_layers = [f.layer for f in by_code.get("BN004", []) if f.layer]

    lines: list[str] = []
    if report.preprocessing_mismatch:
        lines.append(_preprocessing_line(report, ordered))
    if gap is not None:
        lines.append(_gap_line(report, gap, eval_loses, eval_wins))
    if reset:
        lines.append(
            f"{_sentence(layer_list(reset))} hold the initial statistics (mean 0, variance 1): reset or never loaded, "
            "so eval mode normalises with values that describe no data. Recalibrate: "
            "`bnaudit recalibrate` on a few thousand representative samples."
        )
    if immature and report.inspection.is_ema:
        averaging = report.inspection.averaging
        kind = f" ({averaging.kind})" if averaging is not None else ""
        lines.append(
            f"This is an EMA copy{kind} whose statistics are immature (BN003) in {layer_list(immature)}: the "
            "average still holds much of the initial mean 0 and variance 1, whatever the data. Not a "
            "preprocessing problem: recalibrate it, or use the live statistics (`bnaudit recalibrate`)."
        )
    elif immature:
        lines.append(
            f"Immature statistics (BN003) in {layer_list(immature)}: the initial values still weigh in. "
            "Recalibrate with `bnaudit recalibrate`."
        )
    large = [d for d in ordered if d.large]
    origins = [d for d in ordered if d.origin]
    if origins and not reset and not immature and not report.preprocessing_mismatch:
        lines.append(_origin_line(origins[0], ordered, dead_layers, eval_loses))
        large = origins
    if dead_layers and not (large and large[0].name in dead_layers):
        lines.append(
            f"Dead channels (BN004) in {layer_list(dead_layers)}: running variance near eps, so eval mode "
            "amplifies any input they receive; see the findings."
        )
    lines += _value_lines(report, by_code)
    lines += _batch_lines(report, eval_wins)
    if scripted:
        lines.append(
            "Per-layer drift needs hooks, which TorchScript modules do not run: pass --arch with the "
            "state dict to see it."
        )
    if not eval_loses and not eval_wins and not large and not reset and not immature and not dead_layers:
        lines.append("The stored statistics describe this data: nothing to fix.")
    return lines


def _gap_line(report: GapReport, gap: float, eval_loses: bool, eval_wins: bool) -> str:
    """The accuracy of both modes in words, with the gap's confidence."""
    if eval_loses:
        return (
            f"Eval mode loses {gap * 100:.1f} accuracy points: {_pct(report.eval_accuracy)} with the stored "
            f"statistics against {_pct(report.train_accuracy)} with batch statistics{_gap_confidence(report)}."
        )
    if eval_wins:
        return (
            f"Eval mode is {-gap * 100:.1f} points better than batch statistics "
            f"({_pct(report.eval_accuracy)} against {_pct(report.train_accuracy)}){_gap_confidence(report)}."
        )
    return (
        f"Eval mode and batch statistics give the same accuracy within {GAP_NOTABLE * 100:.0f} point "
        f"({_pct(report.eval_accuracy)} and {_pct(report.train_accuracy)}){_gap_confidence(report)}."
    )


def _origin_line(first: LayerDrift, ordered: list[LayerDrift], dead_layers: list[str], eval_loses: bool) -> str:
    """Where drift starts (`first`, the first origin; `ordered` the measured layers in
    forward order) and what that points to."""
    channel = _channel_words(first)
    if first.name in dead_layers:
        return (
            f"Drift starts at {first.name}, where BN004 found channels with a running variance near eps: "
            "the data reaching them still varies, so eval mode multiplies it by their eval gain. "
            f"Recalibrate the statistics on representative data (or prune the channels).{channel}"
        )
    if first.position == ordered[0].position:
        holds = " while batch statistics keep the accuracy" if eval_loses else ""
        return (
            f"Drift is large from the first BN layer on ({first.name}: mean shift {first.mean_shift:.2f}, "
            f"variance log-ratio {first.var_log_ratio:.2f}){holds}: the stored statistics do not "
            f"describe this data (immature, or computed on other data). Recalibrate on representative data.{channel}"
        )
    before = ordered[: ordered.index(first)]
    later = len([d for d in ordered if d.large and d.position > first.position])
    inherits = (
        f"; the {plural(later, 'large layer')} after it inherit{'s' if later == 1 else ''} its drift" if later else ""
    )
    return (
        f"Drift starts at {first.name} (BN layer {first.position + 1}; the {plural(len(before), 'layer')} "
        f"before it {'matches' if len(before) == 1 else 'match'} the data{inherits}): a domain shift that "
        "shows from this depth on, a broken statistic, or layers before it changed after its statistics were "
        f"recorded. Recalibrate on data of the target domain (AdaBN-style).{channel}"
    )


def _value_lines(report: GapReport, by_code: dict[str, list[Finding]]) -> list[str]:
    """Invalid statistics, non-finite outputs and layers without running statistics."""
    lines = []
    if "BN005" in by_code:
        lines.append("Invalid values in the statistics (BN005): eval-mode outputs of those channels are NaN or Inf.")
    if report.non_finite.get("eval_mode"):
        count = report.non_finite["eval_mode"]
        lines.append(f"{plural(count, 'sample')} {'gets' if count == 1 else 'get'} NaN or Inf outputs in eval mode.")
    if "BN006" in by_code:
        lines.append(
            "Some BatchNorm layers keep no running statistics (BN006): they use batch statistics in eval "
            "mode too, so both modes depend on the batch there."
        )
    return lines


def _batch_lines(report: GapReport, eval_wins: bool) -> list[str]:
    """What the batches say about the train-mode reference: sorted data, noisy batch statistics."""
    if not report.shuffle:
        return [
            "--no-shuffle: if the data is sorted by class, each batch holds one class and train-mode numbers "
            "mean nothing; run without --no-shuffle for a fair reference."
        ]
    if eval_wins:
        return [
            f"Batch statistics are noisy at batch size {report.batch_size}: the train-mode numbers depend on "
            "the batch size; the stored statistics are fine. A larger --batch-size narrows this."
        ]
    if report.batch_size < SMALL_BATCH:
        return [
            f"Batch size {report.batch_size} is small: batch statistics are noisy, so train-mode numbers are "
            "a weak reference."
        ]
    return []


def _gap_confidence(report: GapReport) -> str:
    """The sample count and the gap's 95% interval; "not significant" when it contains 0."""
    if report.gap_interval is None:
        return ""
    low, high = report.gap_interval
    words = (
        f". Over {report.labelled} labelled samples the gap's 95% interval is {low * 100:+.1f} to "
        f"{high * 100:+.1f} points"
    )
    if not report.gap_significant and abs(report.gap or 0.0) > GAP_NOTABLE:
        return words + ": not significant, more labelled samples would tell"
    return words


def _channel_words(layer: LayerDrift) -> str:
    """The worst channel of a layer in words: index, data against running statistics."""
    if not layer.worst:
        return ""
    c = layer.worst[0]
    return (
        f" Worst channel of {layer.name}: {c.index} (data mean {c.data_mean:.3g}, variance {c.data_var:.3g} "
        f"against running mean {c.running_mean:.3g}, variance {c.running_var:.3g}: shift {c.shift:.3g}, "
        f"|log variance ratio| {c.log_var_ratio:.3g})."
    )


def _values(values: list[float] | None) -> str:
    if not values:
        return "?"
    shown = ", ".join(f"{v:.3g}" for v in values[:4])
    return shown + (f", ... ({len(values)} channels)" if len(values) > 4 else "")


def _preprocessing_line(report: GapReport, ordered: list[LayerDrift]) -> str:
    first = ordered[0]
    later = ordered[1:]
    persists = (
        f", the drift persists through {sum(d.large for d in later)} of the {len(later)} later layers" if later else ""
    )
    text = (
        f"Suspect the input preprocessing before the statistics: the first BN layer ({first.name}) already sees "
        f"data unlike training in {first.broad * 100:.0f}% of its channels (mean shift {first.mean_shift:.2f}, "
        f"variance log-ratio {first.var_log_ratio:.2f}){persists}, and inspect finds the stored statistics "
        "mature."
    )
    if report.input_mean is not None:
        text += f" Input per channel: mean {_values(report.input_mean)}, std {_values(report.input_std)}"
        if report.implied_mean is not None:
            text += (
                f"; {first.name}'s running statistics imply about mean {_values(report.implied_mean)}, "
                f"std {_values(report.implied_std)}"
            )
        text += "."
    return text + (
        " Check --mean/--std, the value scale (0-1 or 0-255), the channel order (RGB/BGR) and the image size "
        "against the training pipeline; re-estimating the statistics on these inputs would fit them to the "
        "mismatch and hurt correctly preprocessed data. Only if the preprocessing matches training were the "
        f"statistics of {first.name} computed on other data."
    )


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]

"""The `invariance` report: its records, and the diagnosis in plain words.

Torch-free: `bnaudit.output` renders these records and imports this module; the
measurement that fills them is `bnaudit.runtime.invariance`, whose docstring defines
every figure (arrangements, deviation, changed predictions, KL, the noise screen and the
float64 floor).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from bnaudit.audit.checkpoint.report import FileReport
from bnaudit.audit.rules import Finding
from bnaudit.audit.statistics import RELATIVE_DEVIATION
from bnaudit.config import exit_code_for
from bnaudit.text import above_floor, listing, plural

# KL(reference || arrangement) below this many nats prints as "<1e-06": telling two output
# distributions that close apart takes about 1/KL = 10^6 samples, and float32 kernel noise
# gives ~1e-13 on a batch-independent model.
KL_FLOOR = 1e-6


@dataclass(frozen=True)
class ArrangementResult:
    """One arrangement: its batches, the largest deviation from the reference (over all
    samples, working precision), the coupled samples whose deviation in it exceeds the
    floor, the predictions that change (coupled samples only) and its accuracy."""

    name: str
    batch_size: int
    order: str
    batches: int
    max_deviation: float
    coupled: int
    changed: int | None
    accuracy: float | None


@dataclass(frozen=True)
class CouplingSite:
    """Where samples meet: a module (or a TorchScript graph call) and why."""

    module: str
    kind: str
    reason: str
    cause: str  # "batchnorm", "traced_training", "mixes_samples", "model_code"
    sample: str | None = None
    arrangement: str | None = None


@dataclass
class InvarianceReport:
    """The result of `measure_invariance` (module docstring for every statistic)."""

    kind: ClassVar[Literal["invariance"]] = "invariance"  # bnaudit.output.EMITTERS

    checkpoint: str
    model: str
    data: str
    samples: int
    batch_sizes: list[int]
    seed: int
    shuffle: bool
    device: str
    dtype: str
    reference: str
    arrangements: list[ArrangementResult]
    screen: float
    floor: float
    flagged: int
    cleared: int
    coupled: int
    float64: bool
    max_deviation: float
    max_deviation_sample: str | None
    classifier: bool
    changed: int | None
    max_kl: float | None
    mean_kl: float | None
    inspection: FileReport
    norm: str = f"{RELATIVE_DEVIATION.name}: {RELATIVE_DEVIATION.formula}"
    float64_noise: float | None = None
    kl_floor: float = KL_FLOOR
    float64_note: str | None = None
    sites: list[CouplingSite] = field(default_factory=list)
    failures: dict[str, str] = field(default_factory=dict)
    labelled: int = 0
    diagnosis: list[str] = field(default_factory=list)
    skipped: int = 0
    notes: list[str] = field(default_factory=list)
    fail_on: str | None = None
    exit_zero: bool = False

    @property
    def key(self) -> str | None:
        """The state dict measured: --key, or the one the reader chose in a container."""
        return self.inspection.key

    @property
    def prefix(self) -> str:
        """The wrapper prefix stripped from its keys ("" when none)."""
        return self.inspection.prefix

    @property
    def findings(self) -> list[Finding]:
        return self.inspection.findings

    @property
    def verdict(self) -> str:
        """ "coupled" when some sample's output depends on its companions (or the model
        cannot score one sample alone), else "invariant"."""
        return "coupled" if self.coupled or self.failures else "invariant"

    @property
    def changed_share(self) -> float | None:
        """Share of samples whose prediction changes with the arrangement."""
        if self.changed is None or not self.samples:
            return None
        return self.changed / self.samples

    def accuracy(self, order: str, batch_size: int | None = None) -> float | None:
        """The accuracy of the first arrangement of that order (and batch size)."""
        for a in self.arrangements:
            if a.order == order and (batch_size is None or a.batch_size == batch_size):
                return a.accuracy
        return None

    def exit_code(self, exit_zero: bool = False) -> int:
        """`bnaudit.config.exit_code_for`: 1 when coupled, or when an inspect finding is at or
        above `fail_on`; 0 otherwise, or with `exit_zero` (the argument or the field)."""
        return exit_code_for(
            (f.severity for f in self.findings),
            self.fail_on,
            failed=self.verdict == "coupled",
            exit_zero=exit_zero or self.exit_zero,
        )


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 100:.1f}%"


def diagnose(report: InvarianceReport) -> list[str]:
    """Plain-word conclusions: the verdict, where the coupling is and what to fix."""
    lines: list[str] = []
    sizes = ", ".join(str(s) for s in report.batch_sizes)
    for name, message in report.failures.items():
        lines.append(
            f"The model cannot score one sample alone ({name}: {message}): a deployment that sends one input at a "
            "time fails. The usual cause is BatchNorm normalising by batch statistics (no running statistics, "
            "or a graph traced in training mode), which needs more than one value per channel."
        )
    if report.verdict == "invariant":
        lines.append(
            f"Every output is the same alone and among other samples ({plural(report.samples, 'sample')}, batch "
            f"sizes {sizes}; largest deviation {above_floor(report.max_deviation, report.screen)}): predictions do "
            "not depend on their batch companions. Nothing to fix."
        )
        if report.cleared:
            lines.append(
                f"{plural(report.cleared, 'sample')} differed by more than the screen ({report.screen:.2g}) in "
                f"{report.dtype} but agreed in float64 (largest float64 deviation {above_floor(report.float64_noise or 0.0, report.floor)}, "
                f"floor {report.floor:.2g}): the summation order of the kernels, not the companions."
            )
        return lines
    if report.coupled:
        changed = ""
        if report.changed is not None:
            changed = f"; {plural(report.changed, 'prediction')} ({_pct(report.changed_share)}) change"
        lines.append(
            f"{report.coupled} of {plural(report.samples, 'sample')} get other outputs among other companions "
            f"(largest deviation {report.max_deviation:.3g} of the output's largest value{changed}): predictions "
            "depend on the batch they arrive in."
        )
        alone = report.accuracy("alone")
        batched = [a for a in report.arrangements if a.order == "natural" and a.accuracy is not None]
        if alone is not None and batched:
            best = batched[-1]
            lines.append(
                f"Accuracy alone {_pct(alone)} against {_pct(best.accuracy)} in batches of {best.batch_size}: a "
                "score measured in batches is not what single requests get."
            )
    fixes = {
        "batchnorm": "Fix: build it with track_running_stats=True and estimate its statistics (`bnaudit recalibrate`), "
        "or use a per-sample norm (GroupNorm, LayerNorm).",
        "traced_training": "Fix: call model.eval() before torch.jit.trace (or the export) and save it again.",
        "model_code": "Fix: keep the batch dimension apart (permute/transpose instead of reshape/view across it; no "
        "mean, sum or softmax over dim 0).",
        "mixes_samples": "Fix its forward: keep the batch dimension apart (permute/transpose instead of reshape/view "
        "across it; no mean, sum or softmax over dim 0).",
    }
    groups: dict[tuple[str, str], list[CouplingSite]] = {}
    for site in report.sites:
        # the same reason in several modules (a whole graph traced in training mode) said once
        groups.setdefault((site.cause, site.reason.replace(site.kind, "{kind}")), []).append(site)
    for (cause, _), group in groups.items():
        first = group[0]
        if cause == "model_code":
            where = f"{first.kind}.forward"
        else:
            where = listing([f"{s.module} ({s.kind})" for s in group], 4)
        reason = first.reason if len(group) == 1 else first.reason.replace(f"{first.kind} ", "")
        lines.append(f"{where}: {reason}. {fixes[cause]}")
    if report.verdict == "coupled" and not report.sites:
        lines.append(
            "The coupling could not be traced to one module"
            + (
                " (TorchScript runs no hooks and its graph calls no batch normalisation in training mode): pass the "
                "state dict with --arch MODULE:CALLABLE to locate it."
                if "TorchScript" in report.model
                else ": look for code that combines samples (statistics over the batch, reshapes across it)."
            )
        )
    if report.float64_note:
        lines.append(f"Float64 re-scoring was not possible ({report.float64_note}): the screen decided alone.")
    bn006 = [f.layer for f in report.findings if f.code == "BN006" and f.layer]
    if bn006 and not any(s.cause == "batchnorm" for s in report.sites):
        lines.append(f"inspect (BN006) finds no running statistics in {listing(bn006)}: they use batch statistics.")
    return lines

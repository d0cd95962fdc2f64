"""The `fold` report: per BN/producer pair, what folding and then int8, fp16 and bf16 do
(predicted from the statistics, `bnaudit.audit.fold.check`), and, with --arch and --data,
the accuracy measured for each target (`bnaudit.runtime.fold`).

Torch-free: `bnaudit.output` renders these records. Targets, in the order of the table:

  float32           the model in eval mode
  folded            every paired BN folded into its producer, float32
  int8_per_tensor   folded, the producers' weights fake-quantized to int8 with one scale per
                    tensor (activations float32)
  int8_per_channel  the same with one scale per output channel
  fp16, bf16        the whole (unfolded) model cast to the format

The per-pair drop is the accuracy of `folded` minus that with only this pair's producer
quantized per tensor (in percentage points when labelled, else the mean relative output
divergence from `folded`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from bnaudit.audit.fold.check import PairPrediction
from bnaudit.audit.rules import Finding
from bnaudit.config import SEVERITIES, Config, exit_code_for
from bnaudit.severity import Severity
from bnaudit.text import plural

TARGETS = ("float32", "folded", "int8_per_tensor", "int8_per_channel", "fp16", "bf16")


@dataclass(frozen=True)
class FoldMeasurement:
    """Accuracies (fractions 0-1 with labels; without labels the mean relative divergence of
    the outputs from float32 eval) per target, None where not measured (a dtype the CPU
    cannot run), and the per-pair drop by BN name."""

    labelled: bool
    samples: int
    results: dict[str, float | None]
    pair_drop: dict[str, float]
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class FoldReport:
    kind: ClassVar[Literal["fold"]] = "fold"  # bnaudit.output.EMITTERS
    path: str
    format: str
    pairs: tuple[PairPrediction, ...]
    unpaired: tuple[tuple[str, str], ...]  # (BN layer, why it cannot be folded)
    findings: tuple[Finding, ...]
    fail_on: Severity  # findings at or above it fail the run (the configuration's fail-on)
    settings: str = ""  # which eps was not read from the file (bnaudit.audit.settings.statement)
    measured: FoldMeasurement | None = None
    notes: tuple[str, ...] = field(default=())
    # the configuration the findings were judged with (SARIF describes the rules at its severities)
    config: Config | None = None

    @property
    def bn_layers(self) -> int:
        """The BN layers of the file: those paired with a producer and those not (a conv an
        exporter already folded is no BN layer)."""
        return sum(1 for p in self.pairs if p.paired_by != "folded") + len(self.unpaired)

    def not_audited(self) -> str:
        """Empty when every BN layer was paired and predicted; else how many were not, of how
        many, and why, the commonest reason first: "47 of 49 BN layers not audited (47: no
        Conv or Linear producer found by name)"."""
        if not self.unpaired:
            return ""
        reasons: dict[str, int] = {}
        for _, why in self.unpaired:
            short = why.split(":")[0]
            reasons[short] = reasons.get(short, 0) + 1
        ordered = sorted(reasons.items(), key=lambda kv: -kv[1])
        shown = "; ".join(f"{n}: {why}" for why, n in ordered[:3])
        more = f"; {len(ordered) - 3} other reasons" if len(ordered) > 3 else ""
        return f"{len(self.unpaired)} of {self.bn_layers} BN layers not audited ({shown}{more})"

    def summary(self) -> dict[str, int]:
        counts = {s: sum(1 for f in self.findings if f.severity == s) for s in SEVERITIES}
        return {
            "pairs": len(self.pairs),
            "unpaired": len(self.unpaired),
            "bn_layers": self.bn_layers,
            "errors": counts[Severity.ERROR],
            "warnings": counts[Severity.WARNING],
            "infos": counts[Severity.INFO],
        }

    def exit_code(self, exit_zero: bool = False) -> int:
        """`bnaudit.config.exit_code_for`: 1 when a finding is at or above `fail_on`."""
        return exit_code_for((f.severity for f in self.findings), self.fail_on, exit_zero=exit_zero)

    def verdicts(self) -> list[tuple[str, str]]:
        """One line per target: what the prediction (and the measurement) says; "ok" only
        where every BN layer was audited, else "ok for the N audited of M BN layers" and a
        line saying how many were not and why."""
        if not self.pairs:
            reason = self.not_audited() or "no BN paired with a producer"
            return [(t, f"not audited: {reason}") for t in ("int8", "fp16", "bf16")]
        lines = self._target_verdicts()
        missing = self.not_audited()
        if not missing:
            return lines
        audited = self.bn_layers - len(self.unpaired)
        partial = f"ok for the {audited} audited of {self.bn_layers} BN layers"
        shown = [(t, partial + words[2:] if words == "ok" or words.startswith("ok (") else words) for t, words in lines]
        return shown + [("not audited", missing)]

    def _target_verdicts(self) -> list[tuple[str, str]]:
        live = [p for p in self.pairs if p.live_collapsed]
        coarse = [p for p in self.pairs if p.coarse]
        overflow = [p for p in self.pairs if p.fp16_overflow]
        flush = [p for p in self.pairs if p.live_flush]
        fp16_c = [p for p in self.pairs if p.fp16_cancellation]
        bf16_c = [p for p in self.pairs if p.bf16_cancellation]
        lines = [
            (
                "int8 per-tensor",
                f"fails: {plural(len(live), 'pair')} with collapsed live channels"
                if live
                else (f"degraded: {plural(len(coarse), 'pair')} with coarse channels" if coarse else "ok"),
            ),
            ("int8 per-channel", "ok"),
            (
                "fp16",
                "fails: overflow in " + plural(len(overflow), "pair")
                if overflow
                else (
                    "degraded: "
                    + ", ".join(
                        part
                        for part in (
                            f"flush in {plural(len(flush), 'pair')}" if flush else "",
                            f"cancellation in {plural(len(fp16_c), 'pair')}" if fp16_c else "",
                        )
                        if part
                    )
                    if flush or fp16_c
                    else "ok"
                ),
            ),
            ("bf16", f"degraded: cancellation in {plural(len(bf16_c), 'pair')}" if bf16_c else "ok"),
        ]
        m = self.measured
        if m is None:
            return lines
        keys = ("int8_per_tensor", "int8_per_channel", "fp16", "bf16")
        measured = []
        for (target, words), key in zip(lines, keys):
            value, base = m.results.get(key), m.results.get("float32")
            if value is None or base is None:
                measured.append((target, f"{words} (not measured)"))
            elif m.labelled:
                measured.append((target, f"{words} (measured {value:.1%}, float32 {base:.1%})"))
            else:
                measured.append((target, f"{words} (measured divergence {value:.3g})"))
        return measured

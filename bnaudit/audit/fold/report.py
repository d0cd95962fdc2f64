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

    def summary(self) -> dict[str, int]:
        counts = {s: sum(1 for f in self.findings if f.severity == s) for s in SEVERITIES}
        return {
            "pairs": len(self.pairs),
            "unpaired": len(self.unpaired),
            "errors": counts[Severity.ERROR],
            "warnings": counts[Severity.WARNING],
            "infos": counts[Severity.INFO],
        }

    def exit_code(self, exit_zero: bool = False) -> int:
        """`bnaudit.config.exit_code_for`: 1 when a finding is at or above `fail_on`."""
        return exit_code_for((f.severity for f in self.findings), self.fail_on, exit_zero=exit_zero)

    def verdicts(self) -> list[tuple[str, str]]:
        """One line per target: what the prediction (and the measurement) says."""
        if not self.pairs:
            return [(t, "not audited: no BN paired with a producer") for t in ("int8", "fp16", "bf16")]
        live = [p for p in self.pairs if p.live_collapsed]
        coarse = [p for p in self.pairs if p.coarse]
        overflow = [p for p in self.pairs if p.fp16_overflow]
        flush = [p for p in self.pairs if p.fp16_flush]
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

"""The parity table: one row per BN layer in execution order (floor, deviation, ratio,
verdict), the outputs' agreement, the findings (their codes: the diagnosis says what they
say; JSON, SARIF and the CI formats carry their messages) and the diagnosis.

A deviation within PARITY_FACTOR x its noise floor is float rounding, whose digits differ
between CPUs: it prints as "<threshold" (`bnaudit.text.above_floor`), its ratio as "<10";
JSON keeps the numbers."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from bnaudit.audit.statistics import PARITY_FACTOR
from bnaudit.output.table.common import bordered, cell, diagnosis_bullets, fit_width
from bnaudit.text import above_floor, plural

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from bnaudit.audit.parity import LayerParity
    from bnaudit.reports.parity import ParityReport


def _ratio(layer: LayerParity) -> str:
    if not layer.diverges:
        return f"<{PARITY_FACTOR}"
    ratio = layer.ratio
    return f"{ratio:.3g}" if math.isfinite(ratio) else str(ratio)


def _layers_table(report: ParityReport) -> Table:
    first = report.first_divergent
    table = bordered("BN layers in execution order")
    for name, justify in (
        ("layer", "left"),
        ("floor", "right"),
        ("deviation", "right"),
        ("ratio", "right"),
        ("verdict", "left"),
    ):
        table.add_column(name, justify=justify, overflow="fold")  # type: ignore[arg-type]  # rich's JustifyMethod literal
    for layer in report.layers:
        if layer is first:
            verdict, style = "first divergent", "bold red"
        elif layer.diverges:
            verdict, style = "diverges", "red"
        else:
            verdict, style = "ok", ""
        calls = f" (x{layer.calls})" if layer.calls > 1 else ""
        table.add_row(
            cell(layer.name + calls),
            f"{layer.floor:.0e}",
            above_floor(layer.relative, PARITY_FACTOR * layer.floor, ".3g"),
            _ratio(layer),
            verdict,
            style=style,
        )
    return table


def render_parity(report: ParityReport, console: Console, quiet: bool = False) -> None:
    """The report: what was compared, the layers (unless quiet), the outputs, findings, diagnosis."""
    title = cell(report.checkpoint, style="bold")
    title.append(f"  ({report.model})", style="dim")
    console.print(title)
    console.print(cell(f"against {report.target.describe()}", style="bold"))
    console.print(
        cell(
            f"compared on {plural(report.samples, 'sample')} in {plural(report.batches, 'batch', 'batches')} "
            f"({report.device})",
            style="dim",
        )
    )
    for note in report.notes:
        console.print(cell(f"note: {note}", style="dim"))
    console.print()
    if report.layers and not quiet:
        console.print(fit_width(_layers_table(report), console.width))
        console.print(
            cell(
                "floor: float32 rounding at the layer (eager float32 vs float64), up to a power of ten; deviation: "
                f"max over channels of max|target - eager| / max|eager|; ratio: deviation / floor, beyond {PARITY_FACTOR}: "
                "diverges",
                style="dim",
            )
        )
        console.print()
    o = report.outputs
    threshold = PARITY_FACTOR * o.floor
    words = f"outputs: largest relative deviation {above_floor(o.relative, threshold, '.3g')}"
    if o.deviates:  # below the threshold the largest change is rounding: it differs between CPUs
        words += f", max |change| {o.max_abs:.3g}"
    words += f", top-1 agreement {o.top1_agreement:.1%}" + ("  DEVIATE" if o.deviates else "")
    console.print(cell(words, style="bold red" if o.deviates else ""))
    if report.unseen:
        names = ", ".join(u.name for u in report.unseen)
        console.print(cell(f"not shown by the target, not compared: {names} (BN403)", style="dim"))
    console.print()
    if report.findings:  # the diagnosis says what they say: their codes and names here (--ignore, the rules' pages)
        codes = "; ".join(
            f"{f.code} {f.name} ({f.severity})" + (f" at {f.layer}" if f.layer else "") for f in report.findings
        )
        errors = any(f.severity == "error" for f in report.findings)
        console.print(cell(f"findings: {codes}", style="bold red" if errors else ""))
        console.print()
    diagnosis_bullets(console, report.diagnosis())

"""The fold table: one row per BN/producer pair, worst range ratio first; then, when
measured, the accuracy per target; the findings; one verdict line per target."""

from __future__ import annotations

from typing import TYPE_CHECKING

from bnaudit.output.table.common import Column, Row, bordered, cell, fit_width, g3, percent, print_fitted
from bnaudit.text import plural

if TYPE_CHECKING:
    from rich.console import Console

    from bnaudit.audit.fold.check import PairPrediction
    from bnaudit.audit.fold.report import FoldReport


def _count(channels: tuple[int, ...]) -> str:
    return str(len(channels)) if channels else "-"


def _order(p: PairPrediction) -> float:
    return p.worst_range_ratio if p.worst_range_ratio is not None else 2.0


def _pairs_columns(report: FoldReport) -> list[Column]:
    """bn and producer are names (shortened at segment boundaries, never wrapped); numbers
    never wrap; the producer goes first where the width is short."""
    columns = [
        Column("bn", name=True),
        Column("producer", name=True, drop=1),
        Column("C", "right"),
        Column("ratio", "right"),
        Column("int8/T", "right"),
        Column("int8/C", "right"),
        Column("fp16", "right"),
        Column("bf16", "right"),
    ]
    if report.measured is not None:
        columns.append(Column("drop (pt)" if report.measured.labelled else "drop", "right"))
    return columns


def _pairs_rows(report: FoldReport) -> list[Row]:
    measured = report.measured
    rows = []
    for p in sorted(report.pairs, key=_order):
        style = "bold red" if p.live_collapsed or p.fp16_overflow else ("yellow" if p.coarse else "")
        row = [
            p.bn,
            p.producer,
            str(p.channels),
            g3(p.worst_range_ratio),
            f"{_count(p.collapsed)}/{_count(p.coarse)}",
            _count(p.per_channel_collapsed),
            f"{_count(p.fp16_overflow)}/{_count(p.fp16_flush)}/{_count(p.fp16_cancellation)}",
            _count(p.bf16_cancellation),
        ]
        if measured is not None:
            drop = measured.pair_drop.get(p.bn)
            row.append(_points(drop) if measured.labelled else g3(drop))
        rows.append(Row(tuple(row), style))
    return rows


_LEGEND = (
    "ratio: min_c max|W'_c| / max|W'| after folding; int8/T: per-tensor collapsed/coarse channels; "
    "int8/C: per-channel collapsed; fp16: overflow/flush/cancellation channels; bf16: cancellation channels"
)


def _points(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:+.1f}"


def concise_fold_lines(report: FoldReport) -> list[str]:
    """`--quiet`: `path: layer: CODE name: message` per finding, then one line of counts and
    one of the verdicts (no table)."""
    lines = []
    for f in report.findings:
        where = f"{report.path}: {f.layer}: " if f.layer is not None else f"{report.path}: "
        lines.append(f"{where}{f.code} {f.name}: {f.message}")
    s = report.summary()
    lines.append(
        f"{plural(s['pairs'], 'pair')} of {plural(s['bn_layers'], 'BN layer')}: {plural(s['errors'], 'error')}, "
        f"{plural(s['warnings'], 'warning')}, {plural(s['infos'], 'info')}"
    )
    lines.append("verdict: " + "; ".join(f"{target}: {words}" for target, words in report.verdicts()))
    return lines


def render_fold(report: FoldReport, console: Console, quiet: bool = False) -> None:
    """The report: title, pairs table, measured targets, findings, verdicts; `quiet`: one
    line per finding and the verdict (`concise_fold_lines`)."""
    from rich.text import Text

    from bnaudit.output.table.common import print_findings

    if quiet:
        for line in concise_fold_lines(report):
            console.print(cell(line), soft_wrap=True)
        return
    title = cell(report.path, style="bold")
    how = ", ".join(sorted({p.paired_by for p in report.pairs})) or "none"
    missing = f"; {len(report.unpaired)} of {report.bn_layers} BN layers not audited" if report.unpaired else ""
    title.append(f"  ({report.format}; {plural(len(report.pairs), 'pair')}, paired by {how}{missing})", style="dim")
    console.print(title)
    if report.settings:
        console.print(cell(report.settings, style="dim"))
    for note in report.notes:
        console.print(cell(f"note: {note}", style="dim"))
    console.print()
    if report.pairs:
        print_fitted(console, _pairs_columns(report), _pairs_rows(report), "pairs, smallest range ratio first")
        console.print(cell(_LEGEND, style="dim"))
        console.print()
    if report.unpaired:
        console.print(cell(f"not folded: {', '.join(name for name, _ in report.unpaired)} (BN207)", style="dim"))
        console.print()
    m = report.measured
    if m is not None:
        measured = bordered(
            f"measured on {plural(m.samples, 'sample')}: " + ("accuracy" if m.labelled else "divergence from float32")
        )
        for target in m.results:
            measured.add_column(target, justify="right")
        measured.add_row(*((percent(v) if m.labelled else g3(v)) for v in m.results.values()))
        console.print(fit_width(measured, console.width))
        for note in m.notes:
            console.print(cell(f"note: {note}", style="dim"))
        console.print()
    if report.findings:
        print_findings(console, list(report.findings))
        console.print()
    console.print(Text("verdict", style="bold"))
    for target, words in report.verdicts():
        console.print(cell(f"  {target}: {words}"))

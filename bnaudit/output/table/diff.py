"""The diff table: both sides, one row per changed layer, the export check (folded
layers, output parity), findings, summary by verdict and the diagnosis."""

from __future__ import annotations

from typing import TYPE_CHECKING

from bnaudit.audit.statistics import MAX_MEAN_SHIFT, MAX_VAR_LOG_RATIO
from bnaudit.output.table.common import (
    SEVERITY_STYLE,
    Column,
    Row,
    cell,
    diagnosis_bullets,
    g3,
    indented,
    prefix_note,
    print_findings,
    print_fitted,
    source_words,
)
from bnaudit.text import above_floor, plural, printable

if TYPE_CHECKING:
    from rich.console import Console

    from bnaudit.audit.diff.checkpoints import DiffReport
    from bnaudit.audit.diff.layers import LayerDiff
    from bnaudit.audit.export.diff import ExportCheck, ParityResult


def _delta(x: float | None, identical: bool) -> str:
    """A change for the diff table: "=" when bit-identical, "-" when not comparable."""
    if identical:
        return "="
    return g3(x)


def _batches_delta(d: LayerDiff) -> str:
    change = d.batches_change
    if change is None:
        return "-"
    return f"{change:+d}"


VERDICT_STYLE = {
    "differs from checkpoint": "red",
    "frozen but updating": "yellow",
    "stale statistics": "yellow",
    "re-estimated": "cyan",
    "trained": "",
    "unchanged": "dim",
}


def concise_diff_lines(report: DiffReport) -> list[str]:
    """`diff -q`: `path: layer: CODE name: message` per finding (`path: CODE name: message`
    for one about no layer), as `inspect -q` writes them, the path being the side the
    findings are about (B, or the export); the output comparison in one line when it
    passed (a deviation is BN114's line); then the summary line. Not collapsed: grep and problem matchers want one location a line.
    Unprintable characters are escaped by the caller, once."""
    path = report.b.path
    if report.export is not None and report.export.export_side == "a":
        path = report.a.path
    lines = [
        f"{path}: {f.layer}: {f.code} {f.name}: {f.message}"
        if f.layer is not None
        else f"{path}: {f.code} {f.name}: {f.message}"
        for f in report.findings
    ]
    parity = report.export.parity if report.export is not None else None
    if parity is not None and not any(f.code == "BN114" for f in report.findings):  # a deviation is BN114's line
        lines.append(f"{path}: {_parity_words(parity)}")
    lines.append(_summary_line(report))
    return lines


def _summary_line(report: DiffReport) -> str:
    s = report.summary()
    folded = f", {plural(s['folded'], 'folded layer')}" if "folded" in s else ""
    return (
        f"{plural(s['matched'], 'matched BN layer')}{folded}: {plural(s['errors'], 'error')}, "
        f"{plural(s['warnings'], 'warning')}, {plural(s['infos'], 'info')}"
    )


def _parity_words(p: ParityResult) -> str:
    fixed = f", fixed batch size {p.batch_size} ({p.padded} padding samples)" if p.batch_size else ""
    verdict = "outputs deviate beyond float32 rounding" if p.deviates else "outputs agree within float32 rounding"
    return (
        f"outputs (torch eval vs onnxruntime CPU) on {plural(p.samples, 'sample')}{fixed}: argmax agreement "
        f"{p.agreement * 100:.1f}%, largest relative deviation {above_floor(p.max_deviation, p.floor, '.3g')} "
        f"(float32 floor {g3(p.floor)}): {verdict}"
    )


def render_diff(report: DiffReport, console: Console, quiet: bool = False) -> None:
    """Rich rendering of a DiffReport: both sides, one row per layer that changed
    (unchanged layers folded into one line), one-side-only and reshaped layers, the
    findings (identical ones on several layers as one row, `fit.collapse`), a summary by
    verdict with its layer groups, and the diagnosis. `quiet`: `concise_diff_lines`."""
    from rich.text import Text

    s = report.summary()
    worst = "error" if s["errors"] else "warning" if s["warnings"] else "ok"
    if quiet:
        *lines, summary = concise_diff_lines(report)
        for line in lines:
            console.print(cell(line), soft_wrap=True)
        console.print(Text(summary, style=SEVERITY_STYLE[worst]), soft_wrap=True)
        return
    _sides(report, console)
    changed = [d for d in report.layers if d.verdict != "unchanged"]
    unchanged = [d.name for d in report.layers if d.verdict == "unchanged"]
    every = [d.name for d in report.layers]
    if changed:
        _layers_table(changed, console, every)
    if unchanged:
        from bnaudit.audit.diff.layers import describe_group

        console.print(
            cell(
                f"{plural(len(unchanged), 'unchanged layer')} "
                f"({'equal to the checkpoint' if report.export else 'bit-identical'}): {describe_group(unchanged, every)}",
                style="dim",
            )
        )
    if report.export is not None:
        _export_body(report.export, console)
    _unmatched_findings_and_summary(report, console)
    console.print(Text(_summary_line(report), style=SEVERITY_STYLE[worst]), soft_wrap=True)


def _sides(report: DiffReport, console: Console) -> None:
    """The two files, the settings and provenance notes, how an export was matched."""
    for label, side in (("A", report.a), ("B", report.b)):
        title = cell(f"{label}: {side.path}", style="bold")
        where = f"{source_words(side.format, side.key, side.prefix)}, {plural(side.layers, 'BN layer')}"
        title.append(printable(f"  ({where})"), style="dim")
        console.print(title)
    names = [d.name for d in report.layers]
    for label, side, own in (("A", report.a, report.only_a), ("B", report.b, report.only_b)):
        bare = prefix_note(side.prefix, [*names, *own])
        if bare:
            console.print(indented(f"{label}: {bare}", style="dim"))
    averaged = [(label, side.averaging) for label, side in (("A", report.a), ("B", report.b)) if side.averaging]
    if len(averaged) == 2 and averaged[0][1] == averaged[1][1]:
        averaged = [("A and B", averaged[0][1])]
    for label, averaging in averaged:
        console.print(indented(f"{label}: {averaging.describe()}", style="dim"))
    if report.settings:
        console.print(indented(f"{report.settings}", style="dim"))
    if report.provenance:
        console.print(indented(f"B: statistics written by {report.provenance}", style="dim"))
    if report.export is not None:
        _export_header(report.export, console)
    console.print()


# Least telling first: the batch counter's change, the channel count, the weight and
# bias changes (the statistics' changes and the verdict stay).
_LAYER_COLUMNS = (
    Column("layer", name=True),
    Column("C", "right", drop=2),
    Column("Δweight", "right", drop=3),
    Column("Δbias", "right", drop=4),
    Column(MAX_MEAN_SHIFT.column, "right"),
    Column(MAX_VAR_LOG_RATIO.column, "right"),
    Column("Δbatches", "right", drop=1),
    Column("verdict", wrap=True),
)


def _layers_table(changed: list[LayerDiff], console: Console, every: list[str]) -> None:
    """One row per layer that changed: the changes (`bnaudit.audit.diff.layers`) and the verdict."""
    from rich.text import Text

    rows = [
        Row(
            (
                d.name,
                str(d.num_features),
                _delta(d.weight_change, d.weight_identical),
                _delta(d.bias_change, d.bias_identical),
                _delta(d.max_mean_shift, d.mean_identical and d.var_identical),
                _delta(d.max_var_log_ratio, d.var_identical),
                _batches_delta(d),
                Text(d.verdict, style=VERDICT_STYLE[d.verdict]),
            )
        )
        for d in changed
    ]
    print_fitted(console, _LAYER_COLUMNS, rows, context=every)


def _unmatched_findings_and_summary(report: DiffReport, console: Console) -> None:
    """Reshaped and one-side-only layers, the findings, the summary by verdict and the diagnosis."""
    from rich.text import Text

    for name, ca, cb in report.reshaped:
        console.print(cell(f"channel count changed: {name} ({ca} -> {cb})", style="yellow"))
    for label, names in (("A", report.only_a), ("B", report.only_b)):
        if names:
            shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
            console.print(cell(f"only in {label}: {plural(len(names), 'layer')}: {shown}", style="dim"))
    console.print()
    if report.findings:
        print_findings(console, report.findings, context=[d.name for d in report.layers])
        console.print()
    groups = report.groups()
    if report.layers:
        console.print(Text("summary by verdict", style="bold"))
    for verdict, names in report.layers_by_verdict().items():
        if names:
            console.print(
                indented(f"{verdict}: {plural(len(names), 'layer')}, {groups[verdict]}", style=VERDICT_STYLE[verdict])
            )
    if report.layers:
        console.print()
    diagnosis_bullets(console, report.diagnosis())
    console.print()


def _export_header(check: ExportCheck, console: Console) -> None:
    """How a checkpoint was matched with its export, under the two sides' lines."""
    side = check.export_side.upper()
    facts = [f"{side} is {check.kind}" + (f" by {check.producer}" if check.producer else "")]
    if check.opset is not None:
        facts.append(f"opset {check.opset}")
    if check.matching:
        facts.append(f"{check.node_word}s matched by {check.matching}")
    if check.pairing:
        facts.append(f"folded layers paired by {check.pairing}")
    console.print(indented("; ".join(facts), style="dim"))


# the node a layer was folded into goes first, then the channel count and the shift error
_FOLDED_COLUMNS = (
    Column("folded layer", name=True),
    Column("into", name=True, drop=1),
    Column("C", "right", drop=2),
    Column("scale err", "right"),
    Column("shift err", "right", drop=3),
    Column("implied eps", "right"),
    Column("status", wrap=True),
)


def _export_body(check: ExportCheck, console: Console) -> None:
    """The folded layers (one row each), the unpaired ones and the output comparison."""
    from rich.text import Text

    if check.folded:
        rows = []
        for f in check.folded:
            c = f.check
            status = (
                Text("matches, gamma 0" if c.zero_gamma else "matches", style="green")
                if c.matches
                else Text(f"matches at eps {f.fits_eps:.2g}", style="yellow")
                if f.fits_eps is not None
                else Text("MISMATCH", style="red")
            )
            rows.append(
                Row(
                    (
                        f.name,
                        f.node,
                        str(c.channels),
                        g3(c.scale_error),
                        g3(c.shift_error),
                        "-" if c.implied_eps is None else f"{c.implied_eps:.2g}",
                        status,
                    )
                )
            )
        print_fitted(console, _FOLDED_COLUMNS, rows)
    p = check.parity
    if p is not None:
        console.print(cell(_parity_words(p), style="red" if p.deviates else "green"))

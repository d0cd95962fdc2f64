"""The gap table: the two modes, the gap with its interval, per-layer drift, findings, diagnosis."""

from __future__ import annotations

from typing import TYPE_CHECKING

from bnaudit.audit.statistics import MAX_MEAN_SHIFT, MEAN_SHIFT, RELATIVE_L2, VAR_LOG_RATIO
from bnaudit.output.table.common import (
    Column,
    Row,
    batches_text,
    bordered,
    cell,
    drift_value,
    findings_and_diagnosis,
    fit_width,
    measurement_header,
    percent,
    print_fitted,
    span,
)
from bnaudit.text import plural

if TYPE_CHECKING:
    from rich.console import Console

    from bnaudit.reports.gap import GapReport, LayerDrift


def render_gap(report: GapReport, console: Console, quiet: bool = False) -> None:
    """Rich rendering: header, the two modes, per-layer drift (worst first), findings, diagnosis."""
    from rich.text import Text

    measurement_header(console, report.checkpoint, report.model, report.data, report.notes, report.key, report.prefix)
    order = f"shuffled with seed {report.seed}" if report.shuffle else "file order, --no-shuffle"
    skipped = f", {plural(report.skipped, 'unreadable image')} skipped" if report.skipped else ""
    console.print(
        cell(
            f"{batches_text(report.samples, report.batches, report.batch_size, report.skipped)} "
            f"({order}), device {report.device}{skipped}"
        )
    )
    console.print()

    modes = bordered()
    modes.add_column("mode")
    modes.add_column("BatchNorm normalises with")
    modes.add_column("accuracy", justify="right")
    modes.add_column("95% CI (Wilson)", justify="right")
    modes.add_row("train", "batch statistics", percent(report.train_accuracy), span(report.train_interval))
    modes.add_row("eval", "running statistics", percent(report.eval_accuracy), span(report.eval_interval))
    console.print(fit_width(modes, console.width))
    parts = []
    if report.gap is not None:
        significant = report.gap_significant is not False
        style = "bold red" if report.gap > 0.01 and significant else "green"
        words = f"gap {report.gap * 100:+.1f} points (95% CI {span(report.gap_interval, signed=True)}, n = {report.labelled}"
        # on a line of its own: with its interval it leaves no room for the other measures
        console.print(Text(words + (")" if significant else ", not significant)"), style=style))
    if report.agreement is not None:
        parts.append(Text(f"agreement {percent(report.agreement)}"))
    if report.divergence is not None:
        kind = "KL(eval || train)" if report.divergence_kind == "kl" else RELATIVE_L2.column
        parts.append(Text(f"divergence {report.divergence:.4g} ({kind})"))
    if parts:
        console.print(Text("  ·  ").join(parts))
    console.print()

    unmeasured = [d for d in report.layers if d.note == "not measured (TorchScript)"]
    if report.layers and not quiet and len(unmeasured) == len(report.layers):
        console.print(cell(_scripted_line(len(report.layers)), style="dim"))
        console.print()
    elif report.layers and not quiet:
        _drift_table(report.layers, console)
        console.print()

    findings_and_diagnosis(console, report.findings, report.diagnosis, [d.name for d in report.layers], quiet)


def _scripted_line(layers: int) -> str:
    return (
        f"per-layer drift: not measured for the {plural(layers, 'BN layer')}: TorchScript modules run no hooks; "
        "pass the state dict with --arch MODULE:CALLABLE to see it"
    )


def _worst_channel(d: LayerDrift) -> str:
    """`index: shift_c + log_var_c` of the layer's worst channel (bnaudit.runtime.attribution)."""
    if not d.worst:
        return "-"
    c = d.worst[0]
    return f"{c.index}: {drift_value(c.score)}"


# Least telling first: the kind (BatchNorm2d nearly everywhere), the channel count, the
# worst channel, then the largest channel shift (the mean shift and the drift stay).
_DRIFT_COLUMNS = (
    Column("layer", name=True),
    Column("#", "right"),
    Column("kind", drop=1),
    Column("C", "right", drop=2),
    Column(MEAN_SHIFT.column, "right", drop=5),
    Column(MAX_MEAN_SHIFT.column, "right", drop=4),
    Column(VAR_LOG_RATIO.column, "right", drop=6),
    Column("drift", "right"),
    Column("worst ch", "right", drop=3),
)


def _drift_table(layers: list[LayerDrift], console: Console) -> None:
    """Per-layer drift, origins first (their # marked *), then by the worst channel's drift;
    "worst ch" is `index: shift_c + log_var_c` of that channel."""
    rows = []
    for d in layers:
        if d.drift is None:
            style = "dim"
        elif d.origin:
            style = "bold red"
        elif d.large:
            style = "yellow"
        else:
            style = ""
        cells = (
            d.name,
            f"{d.position + 1}{'*' if d.origin else ''}",
            cell(d.kind),
            str(d.channels),
            drift_value(d.mean_shift),
            drift_value(d.max_mean_shift),
            drift_value(d.var_log_ratio),
            drift_value(d.drift) if d.drift is not None else cell(d.note or "-"),
            _worst_channel(d),
        )
        rows.append(Row(cells, style))
    title = "per-layer drift: eval-mode inputs against running statistics; * origin of the drift"
    print_fitted(console, _DRIFT_COLUMNS, rows, title)

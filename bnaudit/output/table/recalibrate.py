"""The recalibrate table: what was written, per-layer drift before -> after, the layers
kept, and with --eval-data the gap of both checkpoints side by side; and merge's table: the
statistics files merged and the same per-layer drift against the merged statistics."""

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
    fit_width,
    indented,
    percent,
    print_fitted,
    source_words,
    span,
)
from bnaudit.text import plural, printable

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from bnaudit.reports.gap import GapReport
    from bnaudit.reports.merge import MergeReport
    from bnaudit.reports.recalibrate import LayerChange, RecalibrationReport


def _arrow(before: float | None, after: float | None) -> Text:
    from rich.text import Text

    text = Text(drift_value(before), style="yellow" if before is not None and before >= 0.5 else "")
    text.append(" -> ", style="dim")
    text.append(drift_value(after), style="yellow" if after is not None and after >= 0.5 else "green")
    return text


def render_recalibrate(report: RecalibrationReport, console: Console, quiet: bool = False) -> None:
    """Rich rendering: what was written, the per-layer before/after drift, skipped
    layers, and with --eval-data the two gap reports side by side."""

    title = cell(report.input, style="bold")
    title.append(" -> ", style="dim")
    title.append(
        printable(" + ".join(p for p in (report.output, report.stats_out) if p is not None)), style="bold green"
    )
    title.append(printable(f"  ({source_words(report.format, report.key, report.prefix)})"), style="dim")
    console.print(title)
    console.print(cell(f"model: {report.model}", style="dim"))
    console.print(cell(f"data: {report.data}", style="dim"))
    order = f"shuffled with seed {report.seed}" if report.shuffle else "file order (--no-shuffle)"
    ranks = f" on {report.world_size} ranks" if report.world_size > 1 else ""
    ranks += f", shard {report.shard}" if report.shard is not None else ""
    console.print(
        cell(
            f"method {report.method}: {batches_text(report.samples, report.batches, report.batch_size, None)} "
            f"({order}), device {report.device}{ranks}"
        )
    )
    console.print()

    if not quiet:
        _layers_table(report, console)
        console.print()
    if report.skipped:
        console.print(
            cell(
                f"{plural(len(report.skipped), 'layer')} kept {'its' if len(report.skipped) == 1 else 'their'} statistics:",
                style="bold",
            )
        )
        for s in report.skipped:
            console.print(indented(f"{s.name}: {s.reason}", style="dim"))
        console.print()
    before, after = report.eval_before, report.eval_after
    if before is not None and after is not None:
        console.print(cell(f"held-out data: {after.data}", style="dim"))
        console.print(fit_width(_held_out_table(before, after), console.width))
        console.print()
    if report.output is not None:
        console.print(cell(f"wrote {report.output}: {plural(len(report.layers), 'layer')} recalibrated", style="green"))
    if report.stats_out is not None:
        console.print(
            cell(
                f"wrote {report.stats_out}: statistics of {plural(len(report.layers), 'layer')} "
                f"(merge with `bnaudit merge`)",
                style="green",
            )
        )


# Least telling first: values per channel, the channel count, the largest channel shift
# (the mean shift and the variance ratio, before -> after, stay).
_LAYER_COLUMNS = (
    Column("layer", name=True),
    Column("C", "right", drop=2),
    Column("values/ch", "right", drop=1),
    Column(MEAN_SHIFT.column, "right"),
    Column(MAX_MEAN_SHIFT.column, "right", drop=3),
    Column(VAR_LOG_RATIO.column, "right"),
)


def _layers_table(
    report: RecalibrationReport | MergeReport,
    console: Console,
    title: str = "per-layer drift against the calibration data: old -> new statistics",
) -> None:
    """Per layer: the drift of the old and of the new statistics against the calibration data."""
    layers: list[LayerChange] = report.layers
    rows = [
        Row(
            (
                c.name,
                str(c.channels),
                str(c.values),
                _arrow(c.before.mean_shift, c.after.mean_shift),
                _arrow(c.before.max_mean_shift, c.after.max_mean_shift),
                _arrow(c.before.var_log_ratio, c.after.var_log_ratio),
            )
        )
        for c in layers
    ]
    print_fitted(console, _LAYER_COLUMNS, rows, title)


def _held_out_table(before: GapReport, after: GapReport) -> Table:
    """The gap reports of the old and the new checkpoint on --eval-data, side by side."""
    table = bordered("gap on the held-out data: old -> new checkpoint")
    table.add_column("", justify="left")
    table.add_column("old", justify="right")
    table.add_column("95% CI (Wilson)", justify="right")
    table.add_column("new", justify="right")
    table.add_column("95% CI (Wilson)", justify="right")
    table.add_row(
        "eval-mode accuracy",
        percent(before.eval_accuracy),
        span(before.eval_interval),
        percent(after.eval_accuracy),
        span(after.eval_interval),
    )
    table.add_row(
        "train-mode accuracy",
        percent(before.train_accuracy),
        span(before.train_interval),
        percent(after.train_accuracy),
        span(after.train_interval),
    )
    table.add_row(
        "gap (points)",
        "-" if before.gap is None else f"{before.gap * 100:+.1f}",
        span(before.gap_interval, signed=True),
        "-" if after.gap is None else f"{after.gap * 100:+.1f}",
        span(after.gap_interval, signed=True),
    )
    table.add_row("agreement", percent(before.agreement), "", percent(after.agreement), "")
    kind = "KL(eval || train)" if after.divergence_kind == "kl" else RELATIVE_L2.column
    table.add_row(
        f"divergence ({kind})",
        "-" if before.divergence is None else f"{before.divergence:.3g}",
        "",
        "-" if after.divergence is None else f"{after.divergence:.3g}",
        "",
    )
    if after.labelled:
        table.caption = f"n = {after.labelled} labelled samples"
        table.caption_justify = "left"
        table.caption_style = "dim"
    return table


_FILE_COLUMNS = (
    Column("statistics file", name=True),
    Column("shard", "right"),
    Column("samples", "right"),
    Column("batches", "right", drop=2),
    Column("ranks", "right", drop=1),
)


def render_merge(report: MergeReport, console: Console, quiet: bool = False) -> None:
    """Rich rendering of `bnaudit merge`: the files merged and the per-layer drift of the old
    and the new statistics against the merged ones (not with `quiet`), what was written."""
    title = cell(f"{report.checkpoint} + {plural(len(report.files), 'statistics file')}", style="bold")
    title.append(" -> ", style="dim")
    title.append(printable(report.output), style="bold green")
    title.append(printable(f"  ({source_words(report.format, report.key, report.prefix)})"), style="dim")
    console.print(title)
    for data in dict.fromkeys(f.data for f in report.files):
        console.print(cell(f"data: {data}", style="dim"))
    console.print(
        cell(
            f"method {report.method}: {plural(report.samples, 'sample')} in {plural(report.batches, 'batch', 'batches')}, "
            "merged with Chan's formulas"
        )
    )
    console.print()
    if not quiet:
        rows = [
            Row((f.path, f.shard or "all", str(f.samples), str(f.batches), str(f.world_size))) for f in report.files
        ]
        print_fitted(console, _FILE_COLUMNS, rows, None)
        console.print()
        _layers_table(report, console, "per-layer drift against the merged statistics: old -> new statistics")
        console.print()
    files = plural(len(report.files), "statistics file")
    console.print(
        cell(f"wrote {report.output}: {plural(len(report.layers), 'layer')} recalibrated from {files}", style="green")
    )

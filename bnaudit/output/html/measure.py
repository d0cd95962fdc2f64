"""The pages of the measurements on data: `gap`, `recalibrate` and `invariance` with `--format html`.

gap          per BN layer in forward order, how far the stored statistics are from the data
             reaching the layer in eval mode (`bnaudit.reports.gap`: the channel-mean shift and
             variance log-ratio, stacked into the drift, and the layer's worst channel), against
             DRIFT_LARGE and PEAK_LARGE, the origin of the drift marked; the accuracy of train
             and eval mode with their 95% intervals.
recalibrate  per recalibrated layer, the drift of the old and of the new statistics against
             the calibration data; with --eval-data, the held-out accuracies of the old and
             the new checkpoint.
invariance   per arrangement, the largest output deviation against the float32 noise screen,
             and the accuracy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from bnaudit.audit.statistics import MAX_MEAN_SHIFT, MEAN_SHIFT, VAR_LOG_RATIO
from bnaudit.output.html import charts
from bnaudit.output.html.charts import COLOURS, Charts
from bnaudit.output.html.markup import (
    Header,
    Html,
    bullets,
    cell,
    counts_line,
    document,
    facts,
    figure_with_table,
    findings_table,
    join,
    num,
    row,
    section,
    table,
    tag,
)
from bnaudit.output.table.common import batches_text, percent, source_words
from bnaudit.reports.gap import DRIFT_LARGE, PEAK_LARGE
from bnaudit.text import plural

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from bnaudit.audit.rules import Finding
    from bnaudit.reports.gap import GapReport, LayerDrift
    from bnaudit.reports.invariance import InvarianceReport
    from bnaudit.reports.recalibrate import RecalibrationReport

OLD, NEW = "#b0473f", "#3d8b5a"


def _counts(findings: Sequence[Finding]) -> Html:
    by = {s: sum(1 for f in findings if f.severity == s) for s in ("error", "warning", "info")}
    return counts_line([(by["error"], "error"), (by["warning"], "warning"), (by["info"], "info")])


def _header_facts(
    checkpoint: str, model: str, key: str | None, prefix: str | None, data: str, extra: Sequence[tuple[str, object]]
) -> Html:
    return facts([("checkpoint", f"{checkpoint} ({source_words(model, key, prefix)})"), ("data", data), *extra])


# --- gap ------------------------------------------------------------------------------------


def gap_to_html(report: GapReport) -> str:
    """The gap report as one self-contained page."""
    charts.require()
    drawing = Charts()
    order = f"shuffled with seed {report.seed}" if report.shuffle else "file order (--no-shuffle)"
    plan = f"{batches_text(report.samples, report.batches, report.batch_size, report.skipped)} ({order})"
    body: list[Any] = [
        _header_facts(
            report.checkpoint,
            report.model,
            report.key,
            report.prefix,
            report.data,
            [("samples", plan), ("device", report.device), ("notes", "; ".join(report.notes))],
        )
    ]
    body.append(section("Train vs eval mode", _modes(report, drawing)))
    ordered = sorted(report.layers, key=lambda d: d.position)
    if any(d.drift is not None for d in ordered):
        body.append(
            section(
                "Per-layer drift",
                figure_with_table(
                    drawing.draw(_drift_alt(ordered), charts.strip_width(len(ordered)), 3.6, _paint_drift, ordered),
                    f"Per BN layer in forward order: the channel-mean shift |mu_data - mu_running| / sqrt(var_running "
                    f"+ eps) and the mean variance log-ratio, stacked into the layer's drift; diamond: its worst "
                    f"channel's drift. A layer whose shift or log-ratio reaches {DRIFT_LARGE:g}, or whose worst "
                    f"channel reaches {PEAK_LARGE:g}, has statistics that do not describe the data (shaded); the "
                    "origin of the drift is marked.",
                    _drift_table(ordered),
                    stacked=True,
                ),
            )
        )
    elif ordered:
        body.append(section("Per-layer drift", tag("p", "Not measured: " + (ordered[0].note or "no hook ran"))))
    body.append(section("Inspect findings for this checkpoint", findings_table(report.findings, caption="")))
    body.append(section("Diagnosis", bullets(report.diagnosis)))
    return document("bnaudit gap", _counts(report.findings), body)


def _modes(report: GapReport, drawing: Charts) -> Html:
    """The accuracy of both modes with their intervals (a chart when labelled), and the gap."""
    rows = [
        row(
            "train",
            "batch statistics",
            num(report.train_accuracy, percent(report.train_accuracy)),
            *_interval_cells(report.train_interval),
            data_mode="train",
        ),
        row(
            "eval",
            "running statistics",
            num(report.eval_accuracy, percent(report.eval_accuracy)),
            *_interval_cells(report.eval_interval),
            data_mode="eval",
        ),
    ]
    numbers = table(["mode", "normalises with", "accuracy", ("CI low", "95% Wilson"), ("CI high", "95% Wilson")], rows)
    gap_low, gap_high = report.gap_interval if report.gap_interval is not None else (None, None)
    more = [
        ("gap", num(report.gap, "-" if report.gap is None else f"{report.gap * 100:+.1f} points")),
        ("gap 95% CI low", num(gap_low, "-" if gap_low is None else f"{gap_low * 100:+.1f} points")),
        ("gap 95% CI high", num(gap_high, "-" if gap_high is None else f"{gap_high * 100:+.1f} points")),
        ("agreement", num(report.agreement, percent(report.agreement))),
        (
            f"divergence ({'KL(eval || train)' if report.divergence_kind == 'kl' else 'relative L2'})",
            num(report.divergence),
        ),
        ("labelled samples", num(report.labelled)),
    ]
    numbers = join(numbers, table(["measure", "value"], [row(k, v, data_measure=k.split(" (")[0]) for k, v in more]))
    if report.train_accuracy is None or report.eval_accuracy is None:
        return numbers
    modes = [
        ("train (batch statistics)", report.train_accuracy, report.train_interval),
        ("eval (running statistics)", report.eval_accuracy, report.eval_interval),
    ]
    gap_words = "" if report.gap is None else f" Gap {report.gap * 100:+.1f} points"
    if report.gap_interval is not None:
        gap_words += f" (95% CI {report.gap_interval[0] * 100:+.1f} to {report.gap_interval[1] * 100:+.1f})."
    chart = drawing.draw(
        f"Accuracy in train mode {percent(report.train_accuracy)} and eval mode {percent(report.eval_accuracy)}.{gap_words}",
        charts.BESIDE,
        1.9,
        _paint_accuracies,
        modes,
    )
    caption = f"Accuracy of each mode on {plural(report.labelled, 'labelled sample')}, 95% Wilson intervals.{gap_words}"
    return figure_with_table(chart, caption, numbers)


def _interval_cells(pair: tuple[float, float] | None) -> list[Html]:
    if pair is None:
        return [num(None), num(None)]
    return [num(pair[0], percent(pair[0])), num(pair[1], percent(pair[1]))]


def _paint_accuracies(fig: Figure, modes: Sequence[tuple[str, float | None, tuple[float, float] | None]]) -> None:
    ax = fig.subplots()
    ys = list(range(len(modes)))
    values = [(v or 0.0) * 100 for _, v, _ in modes]
    colours = [NEW if i == 0 else OLD for i in ys] if len(modes) == 2 else [COLOURS["line"]] * len(modes)
    ax.barh(ys, values, color=colours, height=0.55)
    for y, (_, v, interval) in zip(ys, modes):
        if interval is not None and v is not None:
            ax.errorbar(
                v * 100,
                y,
                xerr=[[v * 100 - interval[0] * 100], [interval[1] * 100 - v * 100]],
                color="#222",
                capsize=4,
                linewidth=1.2,
            )
        end = max(v or 0.0, interval[1] if interval is not None else 0.0) * 100
        ax.annotate(percent(v), (end, y), xytext=(6, 0), textcoords="offset points", va="center", fontsize=8.5)
    ax.set_yticks(ys, [m for m, _, _ in modes])
    ax.set_xlim(0, 100)
    ax.set_xlabel("accuracy (%)")
    ax.invert_yaxis()
    ax.grid(axis="y", visible=False)


def _drift_alt(ordered: list[LayerDrift]) -> str:
    origin = next((d for d in ordered if d.origin), None)
    large = sum(1 for d in ordered if d.large)
    where = f"; drift starts at {origin.name} (layer {origin.position + 1})" if origin else ""
    return f"Drift of {plural(len(ordered), 'BN layer')} in forward order, {large} large{where}."


def _paint_drift(fig: Figure, ordered: list[LayerDrift]) -> None:
    ax = fig.subplots()
    xs = list(range(len(ordered)))
    shift = [d.mean_shift if d.mean_shift is not None else math.nan for d in ordered]
    ratio = [d.var_log_ratio if d.var_log_ratio is not None else math.nan for d in ordered]
    for x, d in zip(xs, ordered):
        if d.origin:
            ax.axvspan(x - 0.5, x + 0.5, color=COLOURS["error"], alpha=0.12, linewidth=0)
        elif d.large:
            ax.axvspan(x - 0.5, x + 0.5, color=COLOURS["warning"], alpha=0.10, linewidth=0)
    ax.bar(xs, shift, 0.7, color=COLOURS["line"], label=MEAN_SHIFT.column)
    ax.bar(
        xs,
        ratio,
        0.7,
        bottom=[0.0 if s != s else s for s in shift],
        color=COLOURS["second"],
        label=VAR_LOG_RATIO.column,
    )
    peaks = [(x, d.peak) for x, d in zip(xs, ordered) if d.peak is not None and math.isfinite(d.peak)]
    ax.scatter(
        [x for x, _ in peaks], [p for _, p in peaks], marker="D", s=16, color="#222", zorder=3, label="worst channel"
    )
    ax.axhline(DRIFT_LARGE, color=COLOURS["warning"], linestyle="--", linewidth=1.0, label=f"large: {DRIFT_LARGE:g}")
    ax.axhline(
        PEAK_LARGE,
        color=COLOURS["threshold"],
        linestyle=":",
        linewidth=1.0,
        label=f"worst channel large: {PEAK_LARGE:g}",
    )
    for x, d in zip(xs, ordered):
        if d.origin:
            ax.annotate(
                "origin",
                (x, 1.0),
                xycoords=("data", "axes fraction"),
                xytext=(0, 3),
                textcoords="offset points",
                ha="center",
                va="bottom",
                color=COLOURS["error"],
                fontweight="bold",
                fontsize=8.5,
            )
    ax.set_ylabel("drift")
    ax.set_ylim(bottom=0)
    ax.margins(y=0.15)
    charts.legend(ax)
    charts.layer_axis(ax, [d.name for d in ordered])


def _drift_table(ordered: list[LayerDrift]) -> Html:
    rows = []
    for d in ordered:
        worst = d.worst[0] if d.worst else None
        state = "origin" if d.origin else "large" if d.large else ("-" if d.drift is None else "")
        rows.append(
            row(
                num(d.position + 1),
                cell(d.name, class_="name"),
                cell(d.kind),
                num(d.channels),
                num(d.values),
                num(d.mean_shift),
                num(d.max_mean_shift),
                num(d.var_log_ratio),
                num(d.drift),
                num(d.peak),
                num(None if worst is None else worst.index),
                cell(d.note or state),
                data_layer=d.name,
                class_="layer origin" if d.origin else "layer",
            )
        )
    headers: list[Header] = [
        "#",
        "layer",
        "kind",
        "C",
        ("values/ch", "values per channel that reached the layer in eval mode"),
        (MEAN_SHIFT.column, MEAN_SHIFT.formula),
        (MAX_MEAN_SHIFT.column, MAX_MEAN_SHIFT.formula),
        (VAR_LOG_RATIO.column, VAR_LOG_RATIO.formula),
        ("drift", "mean shift + var log-ratio"),
        ("worst ch drift", "the largest channel drift: shift_c + |log variance ratio_c|"),
        ("worst ch", "the channel with the largest drift"),
        "",
    ]
    return table(
        headers, rows, caption=f"{plural(len(ordered), 'BN layer')}, forward order", scroll=True, class_="layers"
    )


# --- recalibrate ----------------------------------------------------------------------------


def recalibrate_to_html(report: RecalibrationReport) -> str:
    """The recalibrate report as one self-contained page."""
    charts.require()
    drawing = Charts()
    order = f"shuffled with seed {report.seed}" if report.shuffle else "file order (--no-shuffle)"
    body: list[Any] = [
        _header_facts(
            report.input,
            report.model,
            report.key,
            report.prefix,
            report.data,
            [
                ("written", f"{report.output} ({report.format})"),
                (
                    "method",
                    f"{report.method}: {batches_text(report.samples, report.batches, report.batch_size, None)} "
                    f"({order}), device {report.device}",
                ),
                ("warnings", "; ".join(report.warnings)),
            ],
        )
    ]
    if report.layers:
        layers = report.layers
        body.append(
            section(
                "Per-layer drift against the calibration data",
                figure_with_table(
                    drawing.draw(
                        f"Drift of the old and the new statistics of {plural(len(layers), 'recalibrated layer')} "
                        "against the calibration data.",
                        charts.strip_width(2 * len(layers)),
                        3.6,
                        _paint_recalibrated,
                        layers,
                    ),
                    "Per recalibrated layer: the channel-mean shift and the variance log-ratio of the old (before) and "
                    "the new (after) running statistics against the calibration data's statistics.",
                    _recalibrated_table(report),
                    stacked=True,
                ),
            )
        )
    if report.skipped:
        rows = [row(cell(s.name, class_="name"), s.reason) for s in report.skipped]
        body.append(section("Left as they were", table(["layer", "why"], rows)))
    before, after = report.eval_before, report.eval_after
    if before is not None and after is not None:
        body.append(section("Held-out data: old -> new checkpoint", _held_out(before, after, drawing)))
    title = f"{plural(len(report.layers), 'layer')} recalibrated"
    return document("bnaudit recalibrate", tag("p", title, class_="counts"), body)


def _paint_recalibrated(fig: Figure, layers: Sequence[Any]) -> None:
    shift_ax, ratio_ax = fig.subplots(1, 2)
    xs = list(range(len(layers)))
    width = 0.38
    for ax, what, label in (
        (shift_ax, "mean_shift", MEAN_SHIFT.column),
        (ratio_ax, "var_log_ratio", VAR_LOG_RATIO.column),
    ):
        old = [_value(getattr(c.before, what)) for c in layers]
        new = [_value(getattr(c.after, what)) for c in layers]
        ax.bar([x - width / 2 for x in xs], old, width, color=OLD, label="old statistics")
        ax.bar([x + width / 2 for x in xs], new, width, color=NEW, label="new statistics")
        ax.set_title(label)
        charts.layer_axis(ax, [c.name for c in layers], limit=16)
    charts.legend(ratio_ax)


def _value(x: float | None) -> float:
    return math.nan if x is None else x


def _recalibrated_table(report: RecalibrationReport) -> Html:
    rows = [
        row(
            cell(c.name, class_="name"),
            num(c.channels),
            num(c.values),
            num(c.batches),
            num(c.before.mean_shift),
            num(c.after.mean_shift),
            num(c.before.max_mean_shift),
            num(c.after.max_mean_shift),
            num(c.before.var_log_ratio),
            num(c.after.var_log_ratio),
            data_layer=c.name,
        )
        for c in report.layers
    ]
    headers: list[Header] = [
        "layer",
        "C",
        ("values/ch", "calibration values per channel"),
        "batches",
        "mean shift old",
        "mean shift new",
        "max shift old",
        "max shift new",
        "var log-ratio old",
        "var log-ratio new",
    ]
    return table(headers, rows, caption=plural(len(report.layers), "recalibrated layer"), scroll=True, class_="layers")


def _held_out(before: GapReport, after: GapReport, drawing: Charts) -> Html:
    def cells(report: GapReport) -> list[Html]:
        return [
            num(report.eval_accuracy, percent(report.eval_accuracy)),
            num(report.train_accuracy, percent(report.train_accuracy)),
            num(report.gap, "-" if report.gap is None else f"{report.gap * 100:+.1f}"),
            num(report.agreement, percent(report.agreement)),
            num(report.divergence),
        ]

    rows = [row("old", *cells(before), data_side="old"), row("new", *cells(after), data_side="new")]
    numbers = table(["checkpoint", "eval accuracy", "train accuracy", "gap (points)", "agreement", "divergence"], rows)
    if before.eval_accuracy is None or after.eval_accuracy is None:
        return numbers
    modes = [
        ("old, eval mode", before.eval_accuracy, before.eval_interval),
        ("new, eval mode", after.eval_accuracy, after.eval_interval),
        ("train mode", after.train_accuracy, after.train_interval),
    ]
    chart = drawing.draw(
        f"Eval-mode accuracy on the held-out data: old {percent(before.eval_accuracy)}, new "
        f"{percent(after.eval_accuracy)} (train mode {percent(after.train_accuracy)}).",
        charts.BESIDE,
        2.2,
        _paint_accuracies,
        modes,
    )
    return figure_with_table(chart, "Held-out accuracy, 95% Wilson intervals.", numbers)


# --- invariance -----------------------------------------------------------------------------


def invariance_to_html(report: InvarianceReport) -> str:
    """The invariance report as one self-contained page."""
    charts.require()
    drawing = Charts()
    body: list[Any] = [
        _header_facts(
            report.checkpoint,
            report.model,
            report.key,
            report.prefix,
            report.data,
            [
                ("samples", f"{report.samples}, batch sizes {', '.join(map(str, report.batch_sizes))}"),
                ("device", f"{report.device}, {report.dtype} outputs"),
                ("verdict", f"{report.coupled} of {report.samples} samples depend on their batch companions"),
                ("deviation", report.norm),
                ("notes", "; ".join(report.notes)),
            ],
        )
    ]
    arrangements = report.arrangements
    rows = [
        row(
            cell(a.name, class_="name"),
            num(a.batch_size),
            a.order,
            num(a.batches),
            num(a.max_deviation),
            num(a.coupled),
            num(a.changed),
            num(a.accuracy, percent(a.accuracy)),
            data_arrangement=a.name,
        )
        for a in arrangements
    ]
    numbers = table(
        ["arrangement", "batch size", "order", "batches", "max deviation", "coupled", "changed", "accuracy"],
        rows,
        caption=f"against the reference ({report.reference}); noise screen {report.screen:.2g}",
        class_="arrangements",
    )
    if arrangements:
        numbers_chart = drawing.draw(
            f"Largest output deviation of {plural(len(arrangements), 'arrangement')} against the reference, "
            f"with the float32 noise screen {report.screen:.2g}.",
            charts.BESIDE,
            2.6,
            _paint_arrangements,
            report,
        )
        body.append(
            section(
                "Arrangements",
                figure_with_table(
                    numbers_chart,
                    "Per arrangement: the largest deviation of any sample's outputs from the reference, on a log "
                    "axis; below the noise screen the difference is float32 rounding.",
                    numbers,
                ),
            )
        )
    if report.sites:
        site_rows = [row(cell(s.module, class_="name"), s.kind, s.reason) for s in report.sites]
        body.append(section("Where samples meet", table(["module", "kind", "why"], site_rows)))
    body.append(section("Inspect findings for this checkpoint", findings_table(report.findings, caption="")))
    body.append(section("Diagnosis", bullets(report.diagnosis)))
    return document("bnaudit invariance", _counts(report.findings), body)


def _paint_arrangements(fig: Figure, report: InvarianceReport) -> None:
    ax: Axes = fig.subplots()
    arrangements = [a for a in report.arrangements if a.order != "alone"] or report.arrangements
    ys = list(range(len(arrangements)))
    floor = report.screen / 10
    values = [max(a.max_deviation, floor) if math.isfinite(a.max_deviation) else math.nan for a in arrangements]
    colours = [COLOURS["error"] if a.max_deviation > report.screen else COLOURS["ok"] for a in arrangements]
    ax.hlines(ys, floor, values, colors=colours, linewidth=2.0)
    ax.scatter(values, ys, color=colours, zorder=3, s=24)
    ax.axvline(report.screen, color=COLOURS["eps"], linestyle="--", linewidth=1.0, label="noise screen")
    ax.set_yticks(ys, [charts.short(a.name, 28) for a in arrangements])
    ax.invert_yaxis()
    charts.log_axis(ax, "x")
    ax.set_xlabel("max deviation")
    ax.grid(axis="y", visible=False)
    charts.legend(ax)

"""`bnaudit diff --format html`: how each layer changed between the two sides, verdicts coloured.

The chart, one column per matched layer in A's file order: the largest mean shift (B's
running_mean against A's, in A's running standard deviations: `max_mean_shift`) and the
largest variance ratio either way, e^max_var_log_ratio, both on log axes, each layer in its
verdict's colour. A statistic that did not move at all is drawn at the axis floor, hollow.
Beside it the layer table with every number the JSON report holds per layer. A checkpoint
against its export adds the folded layers and the output comparison as tables.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from bnaudit.audit.statistics import MAX_MEAN_SHIFT, MAX_VAR_LOG_RATIO
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
from bnaudit.output.table.common import source_words
from bnaudit.text import plural

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from bnaudit.audit.diff.checkpoints import DiffReport, Side
    from bnaudit.audit.diff.layers import LayerDiff
    from bnaudit.audit.export.diff import ExportCheck

# A verdict's colour in the chart and the table (the terminal's VERDICT_STYLE, as colours).
VERDICT_COLOURS = {
    "differs from checkpoint": COLOURS["error"],
    "frozen but updating": COLOURS["warning"],
    "stale statistics": "#e65100",
    "re-estimated": COLOURS["info"],
    "trained": "#4f8a55",
    "unchanged": COLOURS["muted"],
}
FLOOR = 1e-4  # the axes' floor: a statistic that moved less (or not at all) is drawn here


def diff_to_html(report: DiffReport) -> str:
    """The diff report as one self-contained page."""
    charts.require()
    drawing = Charts()
    s = report.summary()
    subtitle = join(
        counts_line([(s["errors"], "error"), (s["warnings"], "warning"), (s["infos"], "info")]),
        tag("p", f"{plural(s['matched'], 'matched BN layer')}", class_="quiet"),
    )
    body: list[Any] = [
        section(
            "Sides",
            facts([("A", _side_words(report.a)), ("B", _side_words(report.b)), ("settings", report.settings)]),
            facts(
                [
                    ("provenance", report.provenance),
                    ("channel count changed", ", ".join(f"{n} ({a} -> {b})" for n, a, b in report.reshaped)),
                    ("only in A", ", ".join(report.only_a)),
                    ("only in B", ", ".join(report.only_b)),
                ]
            ),
        )
    ]
    if report.layers:
        body.append(
            section(
                "Layers",
                figure_with_table(
                    drawing.draw(_alt(report), charts.strip_width(len(report.layers)), 4.2, _paint, report.layers),
                    "Per matched layer, in A's file order: the largest mean shift of B's running_mean against A's "
                    "(in A's running standard deviations) and the largest variance ratio between the sides, either "
                    f"way (e^max var log-ratio), on log axes; a statistic that did not move is drawn hollow at "
                    f"{FLOOR:g}. Colour: the layer's verdict.",
                    _layers_table(report.layers),
                    stacked=True,
                ),
            )
        )
    if report.export is not None:
        body.append(_export_section(report.export))
    body.append(section("Findings", findings_table(report.findings, caption="")))
    groups = report.groups()
    verdicts = [
        tag(
            "li",
            tag("span", v, class_="verdict", style=f"color:{VERDICT_COLOURS[v]}"),
            f": {plural(len(n), 'layer')}, {groups[v]}",
        )
        for v, n in report.layers_by_verdict().items()
        if n
    ]
    if verdicts:
        body.append(section("Summary by verdict", tag("ul", *verdicts)))
    body.append(section("Diagnosis", bullets(report.diagnosis())))
    return document("bnaudit diff", subtitle, body)


def _side_words(side: Side) -> str:
    words = f"{side.path} ({source_words(side.format, side.key, side.prefix)}, {plural(side.layers, 'BN layer')})"
    if side.averaging is not None:
        words += f"; {side.averaging.describe()}"
    return words


def _alt(report: DiffReport) -> str:
    counts = ", ".join(f"{len(n)} {v}" for v, n in report.layers_by_verdict().items() if n)
    return (
        f"Largest mean shift and variance ratio of {plural(len(report.layers), 'matched layer')} between "
        f"{report.a.path} and {report.b.path}, coloured by verdict: {counts}."
    )


def variance_ratio(d: LayerDiff) -> float | None:
    """e^max_var_log_ratio: the largest factor between the sides' variances (+ eps)."""
    x = d.max_var_log_ratio
    return None if x is None or math.isnan(x) else math.exp(min(x, 700.0))


def _paint(fig: Figure, layers: list[LayerDiff]) -> None:
    shift_ax, ratio_ax = fig.subplots(2, 1, sharex=True)
    colours = [VERDICT_COLOURS[d.verdict] for d in layers]
    xs = list(range(len(layers)))
    shifts = [d.max_mean_shift for d in layers]
    ratios = [variance_ratio(d) for d in layers]
    # the ratio axis starts at 1 (no change): its floor is 1 + FLOOR
    for ax, values, base in ((shift_ax, shifts, FLOOR), (ratio_ax, ratios, 1.0 + FLOOR)):
        drawn = [max(v, base) if v is not None and math.isfinite(v) else math.nan for v in values]
        moved = [v is not None and math.isfinite(v) and v > base for v in values]
        charts.segments(ax, xs, [base] * len(xs), drawn, colours, 1.4 if len(xs) <= 80 else 0.8)
        charts.marks(ax, xs, [y if m else math.nan for y, m in zip(drawn, moved)], colours)
        still = [x for x, m in zip(xs, moved) if not m]
        ax.scatter(
            still,
            [base] * len(still),
            s=22 if len(xs) <= 80 else 6,
            facecolors="none",
            edgecolors=[colours[x] for x in still],
            zorder=3,
            linewidths=1.0,
        )
        charts.log_axis(ax)
    shift_ax.set_ylabel("max mean shift")
    ratio_ax.set_ylabel("max var ratio")
    for verdict, colour in VERDICT_COLOURS.items():
        if any(d.verdict == verdict for d in layers):
            shift_ax.scatter([], [], color=colour, label=verdict, s=22)
    charts.legend(shift_ax)
    charts.layer_axis(ratio_ax, [d.name for d in layers])


def _layers_table(layers: list[LayerDiff]) -> Html:
    rows = []
    for position, d in enumerate(layers, 1):
        ratio = variance_ratio(d)
        rows.append(
            row(
                num(position),
                cell(d.name, class_="name"),
                cell(d.verdict, class_="verdict", style=f"color:{VERDICT_COLOURS[d.verdict]}"),
                num(d.num_features),
                num(d.weight_change, "=" if d.weight_identical else None),
                num(d.bias_change, "=" if d.bias_identical else None),
                num(d.max_mean_shift, "=" if d.mean_identical else None),
                num(d.max_var_log_ratio, "=" if d.var_identical else None),
                num(ratio, "-" if ratio is None else f"{ratio:.3g}x"),
                num(d.batches_a),
                num(d.batches_b),
                num(d.batches_change, "-" if d.batches_change is None else f"{d.batches_change:+d}"),
                num(d.eps_a),
                num(d.eps_b),
                num(d.momentum_a),
                num(d.momentum_b),
                data_layer=d.name,
                class_="layer",
            )
        )
    headers: list[Header] = [
        "#",
        "layer",
        "verdict",
        "C",
        ("Δweight", "max |gamma_b - gamma_a| / scale (=: bit-identical)"),
        ("Δbias", "max |beta_b - beta_a| / scale (=: bit-identical)"),
        (MAX_MEAN_SHIFT.column, MAX_MEAN_SHIFT.formula),
        (MAX_VAR_LOG_RATIO.column, MAX_VAR_LOG_RATIO.formula),
        ("var ratio", "e^max var log-ratio: the largest factor between the sides' variances"),
        ("batches A", "num_batches_tracked of A"),
        ("batches B", "num_batches_tracked of B"),
        ("Δbatches", "B's counter minus A's"),
        "eps A",
        "eps B",
        "momentum A",
        "momentum B",
    ]
    return table(headers, rows, caption=plural(len(layers), "matched layer"), scroll=True, class_="layers")


def _export_section(check: ExportCheck) -> Html:
    """A checkpoint against its export: how they were matched, the folded layers, the outputs."""
    parts: list[Any] = [
        facts(
            [
                ("export", f"side {check.export_side.upper()}: {check.kind}"),
                ("producer", check.producer),
                ("opset", check.opset),
                ("matched by", check.matching),
                ("folded layers paired by", check.pairing),
            ]
        )
    ]
    if check.folded:
        rows = [
            row(
                cell(f.name, class_="name"),
                cell(f.node, class_="name"),
                num(f.check.channels),
                num(f.check.scale_error),
                num(f.check.shift_error),
                num(f.check.implied_eps),
                num(f.eps),
                "matches" if f.check.matches else ("fits another eps" if f.fits_eps is not None else "mismatch"),
                data_layer=f.name,
            )
            for f in check.folded
        ]
        headers = ["folded layer", "into", "C", "scale error", "shift error", "implied eps", "eps", "status"]
        parts.append(table(headers, rows, caption="folded layers"))
    if check.unpaired:
        parts.append(table(["layer or node", "why unpaired"], [row(u.name, u.reason) for u in check.unpaired]))
    p = check.parity
    if p is not None:
        verdict = "deviate beyond float32 rounding" if p.deviates else "agree within float32 rounding"
        rows = [
            row("samples", num(p.samples)),
            row("argmax agreement", num(p.agreement, f"{p.agreement * 100:.1f}%")),
            row("largest relative deviation", num(p.max_deviation)),
            row("float32 floor", num(p.floor)),
        ]
        parts.append(table(["outputs (torch eval vs onnxruntime CPU)", verdict], rows))
    return section("Export", *parts)

"""`bnaudit parity --format html`: each BN layer's deviation against its noise floor, in
execution order, the first divergent layer marked.

The chart, one column per compared layer in the order a forward first calls them: the
layer's channel_relative deviation of the target from eager PyTorch and the line at
PARITY_FACTOR times its float32 noise floor (bnaudit.audit.statistics), on a log axis; a
layer above its line diverges, the first one is the place the deployed artifact starts to
compute something else. Beside it the layer table with every number the JSON report holds
per layer, then the final outputs, the layers the target does not show, the findings and
the diagnosis.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from bnaudit.audit.statistics import PARITY_FACTOR
from bnaudit.output.html import charts
from bnaudit.output.html.charts import COLOURS, Charts
from bnaudit.output.html.markup import (
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
from bnaudit.text import plural

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from bnaudit.audit.parity import LayerParity
    from bnaudit.reports.parity import ParityReport

FLOOR = 1e-12  # the axis' floor: a layer the target computes bit for bit is drawn here, hollow


def parity_to_html(report: ParityReport) -> str:
    """The parity report as one self-contained page."""
    charts.require()
    drawing = Charts()
    s = report.summary()
    first = report.first_divergent
    verdict = f"first divergent layer: {first.name}" if first is not None else "no layer diverges"
    subtitle = join(
        counts_line([(s["errors"], "error"), (s["warnings"], "warning"), (s["infos"], "info")]),
        tag("p", f"{plural(s['layers'], 'BN layer')} compared; {verdict}", class_="quiet"),
    )
    body: list[Any] = [
        section(
            "Compared",
            facts(
                [
                    ("checkpoint", f"{report.checkpoint} ({report.model})"),
                    ("target", report.target.describe()),
                    ("data", f"{plural(report.samples, 'sample')} in {plural(report.batches, 'batch', 'batches')}"),
                    ("device", report.device),
                    ("notes", "; ".join(report.notes)),
                ]
            ),
        )
    ]
    if report.layers:
        body.append(
            section(
                "Layers",
                figure_with_table(
                    drawing.draw(_alt(report), charts.strip_width(len(report.layers)), 3.4, _paint, report),
                    "Per BN layer, in execution order: the largest relative deviation of the target's output from "
                    f"eager PyTorch's over its channels, and the line at {PARITY_FACTOR}x its float32 noise floor "
                    "(log axis). A layer above its line diverges; the first one is marked. A layer the target "
                    f"computes bit for bit is drawn hollow at {FLOOR:g}.",
                    _layers_table(report.layers),
                    stacked=True,
                ),
            )
        )
    body.append(section("Outputs", _outputs_table(report)))
    if report.unseen:
        rows = [row(cell(u.name, class_="name"), u.reason, data_layer=u.name) for u in report.unseen]
        body.append(section("Not compared", table(["layer", "why"], rows, caption="layers the target does not show")))
    body.append(section("Findings", findings_table(report.findings, caption="")))
    body.append(section("Diagnosis", bullets(report.diagnosis())))
    return document("bnaudit parity", subtitle, body)


def _alt(report: ParityReport) -> str:
    first = report.first_divergent
    where = f"the first divergent layer is {first.name}" if first is not None else "no layer exceeds its line"
    return (
        f"Relative deviation of {plural(len(report.layers), 'BN layer')} of {report.target.describe()} from eager "
        f"PyTorch, in execution order, against {PARITY_FACTOR}x each layer's noise floor: {where}."
    )


def _colour(layer: LayerParity, first: LayerParity | None) -> str:
    if layer is first:
        return COLOURS["error"]
    return COLOURS["warning"] if layer.diverges else COLOURS["ok"]


def _paint(fig: Figure, report: ParityReport) -> None:
    ax = fig.subplots()
    layers = list(report.layers)
    first = report.first_divergent
    xs = list(range(len(layers)))
    colours = [_colour(layer, first) for layer in layers]
    shown = [max(layer.relative, FLOOR) if math.isfinite(layer.relative) else math.nan for layer in layers]
    moved = [math.isfinite(layer.relative) and layer.relative > FLOOR for layer in layers]
    charts.segments(ax, xs, [FLOOR] * len(xs), shown, colours, 1.4 if len(xs) <= 80 else 0.8)
    charts.marks(ax, xs, [y if m else math.nan for y, m in zip(shown, moved)], colours)
    still = [x for x, m in zip(xs, moved) if not m]
    ax.scatter(still, [FLOOR] * len(still), s=22, facecolors="none", edgecolors=[colours[x] for x in still], zorder=3)
    limits = [PARITY_FACTOR * layer.floor for layer in layers]
    ax.step(xs, limits, where="mid", color=COLOURS["threshold"], linestyle="--", linewidth=1.0)
    ax.plot([], [], color=COLOURS["threshold"], linestyle="--", label=f"{PARITY_FACTOR}x noise floor")
    if first is not None:
        at = layers.index(first)
        ax.axvline(at, color=COLOURS["error"], linewidth=0.8, alpha=0.5)
        ax.scatter([], [], color=COLOURS["error"], label="first divergent", s=22)
    charts.log_axis(ax)
    ax.set_ylabel("relative deviation")
    charts.legend(ax)
    charts.layer_axis(ax, [layer.name for layer in layers])


def _layers_table(layers: tuple[LayerParity, ...]) -> Html:
    rows = []
    for position, layer in enumerate(layers, 1):
        rows.append(
            row(
                num(position),
                cell(layer.name, class_="name"),
                cell(layer.site),
                num(layer.channels),
                num(layer.calls),
                num(layer.floor),
                num(layer.max_abs),
                num(layer.relative),
                num(layer.ratio),
                cell("diverges" if layer.diverges else "within", class_="verdict"),
                num(layer.worst_channel),
                data_layer=layer.name,
                class_="layer",
            )
        )
    headers: list[Any] = [
        "#",
        "layer",
        "read at",
        "C",
        ("calls", "how often one forward calls the layer"),
        ("floor", "the float32 noise floor of the layer's output (float64 eager against float32 eager)"),
        ("max |Δ|", "max |target - eager| over every value"),
        ("relative", "the largest channel_relative deviation over the channels"),
        ("ratio", "relative / floor"),
        ("verdict", f"diverges above {PARITY_FACTOR}x the floor"),
        ("worst ch", "the channel of the largest deviation"),
    ]
    return table(headers, rows, caption=plural(len(layers), "compared layer"), scroll=True, class_="layers")


def _outputs_table(report: ParityReport) -> Html:
    o = report.outputs
    verdict = "deviate beyond the noise floor" if o.deviates else "agree within the noise floor"
    rows = [
        row("samples", num(o.samples)),
        row("largest relative deviation", num(o.relative)),
        row("max |change| of an output", num(o.max_abs)),
        row("noise floor", num(o.floor)),
        row("top-1 agreement", num(o.top1_agreement, f"{o.top1_agreement * 100:.1f}%")),
    ]
    return table(["final outputs", verdict], rows, class_="outputs")

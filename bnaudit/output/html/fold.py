"""`bnaudit fold --format html`: what folding, int8 and half precision do, pair by pair.

- The summary chart, one column per BN/producer pair in file order: the share of its output
  channels that collapse to zero under int8 with one scale per tensor, that keep fewer than 8
  levels (coarse), and the rest; below it, per pair, how many channels each fp16/bf16 hazard
  hits (overflow, flush to zero, cancellation). Beside it the pairs table with the numbers
  of the JSON report (counts of its channel lists, the int8 scale and the channel that sets
  it with its BN numbers).
- Each pair with a collapsed, coarse or hazardous channel, drawn channel by channel: which
  channels each hazard hits, and the channel that sets the per-tensor scale (definitions:
  `bnaudit.audit.fold.check`); at most MAX_EXPANDED pairs, the worst first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from bnaudit.output.html import charts
from bnaudit.output.html.charts import COLOURS, Charts
from bnaudit.output.html.markup import (
    Header,
    Html,
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
from bnaudit.output.table.common import percent
from bnaudit.text import listing, plural

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from bnaudit.audit.fold.check import PairPrediction
    from bnaudit.audit.fold.report import FoldReport

MAX_EXPANDED = 24
LISTED = 64  # channel indices listed per hazard in a pair's table

# (label, colour, the pair's channels): the hazards, in the order of the charts
_HAZARDS: tuple[tuple[str, str], ...] = (
    ("int8 collapsed", COLOURS["error"]),
    ("int8 coarse", COLOURS["warning"]),
    ("fp16 overflow", "#8e24aa"),
    ("fp16 flush", "#5e35b1"),
    ("fp16 cancellation", "#3949ab"),
    ("bf16 cancellation", "#00838f"),
)


def _hazards(p: PairPrediction) -> list[tuple[str, str, tuple[int, ...]]]:
    lists = (p.collapsed, p.coarse, p.fp16_overflow, p.fp16_flush, p.fp16_cancellation, p.bf16_cancellation)
    return [(name, colour, channels) for (name, colour), channels in zip(_HAZARDS, lists)]


def fold_to_html(report: FoldReport) -> str:
    """The fold report as one self-contained page."""
    charts.require()
    drawing = Charts()
    s = report.summary()
    how = ", ".join(sorted({p.paired_by for p in report.pairs})) or "none"
    subtitle = join(
        counts_line([(s["errors"], "error"), (s["warnings"], "warning"), (s["infos"], "info")]),
        tag("p", f"{report.path} ({report.format}; {plural(s['pairs'], 'pair')}, paired by {how})", class_="quiet"),
    )
    body: list[Any] = [facts([("settings", report.settings), ("notes", "; ".join(report.notes))])]
    verdicts = [row(cell(target, class_="name"), words) for target, words in report.verdicts()]
    body.append(section("Verdict", table(["target", "verdict"], verdicts)))
    if report.pairs:
        pairs = list(report.pairs)
        body.append(
            section(
                "Pairs",
                figure_with_table(
                    drawing.draw(_alt(pairs), charts.strip_width(len(pairs)), 4.6, _paint_summary, pairs),
                    "Per BN/producer pair, in file order. Top: the share of output channels that collapse to zero "
                    "under int8 with one scale per tensor, that keep fewer than 8 levels (coarse), and the rest. "
                    "Bottom: how many channels each fp16/bf16 hazard hits.",
                    _pairs_table(report),
                    stacked=True,
                ),
            )
        )
    if report.measured is not None:
        m = report.measured
        rows = [row(cell(k, class_="name"), num(v, percent(v) if m.labelled else None)) for k, v in m.results.items()]
        what = "accuracy" if m.labelled else "mean relative divergence from float32"
        body.append(section("Measured", table(["target", what], rows, caption=f"{m.samples} samples")))
    if report.unpaired:
        rows = [row(cell(name, class_="name"), why) for name, why in report.unpaired]
        body.append(section("Not folded", table(["BN layer", "why"], rows)))
    body.append(section("Findings", findings_table(list(report.findings), caption="")))
    body.append(_expanded(report, drawing))
    return document("bnaudit fold", subtitle, body)


def _alt(pairs: list[PairPrediction]) -> str:
    collapsed = sum(1 for p in pairs if p.live_collapsed)
    coarse = sum(1 for p in pairs if p.coarse)
    return (
        f"int8 per-tensor channel shares and fp16/bf16 hazards of {plural(len(pairs), 'BN/producer pair')}: "
        f"{plural(collapsed, 'pair')} with collapsed live channels, {plural(coarse, 'pair')} with coarse channels."
    )


def _paint_summary(fig: Figure, pairs: list[PairPrediction]) -> None:
    share_ax, hazard_ax = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3.0, 2.0]})
    xs = list(range(len(pairs)))
    collapsed = [len(p.collapsed) / p.channels if p.channels else 0.0 for p in pairs]
    coarse = [len(p.coarse) / p.channels if p.channels else 0.0 for p in pairs]
    rest = [1.0 - a - b for a, b in zip(collapsed, coarse)]
    width = 0.75
    share_ax.bar(xs, collapsed, width, color=COLOURS["error"], label="collapsed (0 levels)")
    share_ax.bar(xs, coarse, width, bottom=collapsed, color=COLOURS["warning"], label="coarse (< 8 levels)")
    share_ax.bar(
        xs, rest, width, bottom=[a + b for a, b in zip(collapsed, coarse)], color=COLOURS["fill"], label=">= 8 levels"
    )
    share_ax.set_ylim(0, 1)
    share_ax.set_ylabel("int8 per-tensor\nshare of channels")
    charts.legend(share_ax)
    for row_index, (_name, colour) in enumerate(_HAZARDS[2:]):
        counts = [len(_hazards(p)[row_index + 2][2]) for p in pairs]
        hit = [(x, n) for x, n in zip(xs, counts) if n]
        sizes = [min(16 + 10 * n**0.5, 120) for _, n in hit]
        hazard_ax.scatter([x for x, _ in hit], [row_index] * len(hit), s=sizes, color=colour, zorder=3)
        if len(pairs) <= 40:
            for x, n in hit:
                hazard_ax.annotate(str(n), (x, row_index), xytext=(6, 3), textcoords="offset points", fontsize=7)
    hazard_ax.set_yticks(range(len(_HAZARDS) - 2), [name for name, _ in _HAZARDS[2:]])
    hazard_ax.set_ylim(-0.6, len(_HAZARDS) - 2 - 0.4)
    hazard_ax.invert_yaxis()
    charts.layer_axis(hazard_ax, [p.bn for p in pairs])


def _pairs_table(report: FoldReport) -> Html:
    measured = report.measured
    rows = []
    for position, p in enumerate(report.pairs, 1):
        setter = p.scale_set_by
        drop = None if measured is None else measured.pair_drop.get(p.bn)
        worst = "error" if p.live_collapsed or p.fp16_overflow else "warning" if p.coarse else None
        rows.append(
            row(
                num(position),
                cell(p.bn, class_="name"),
                cell(p.producer, class_="name"),
                p.paired_by,
                num(p.channels),
                num(p.int8_scale),
                num(len(p.collapsed)),
                num(len(p.coarse)),
                num(None if setter is None else setter.channel),
                num(None if setter is None else setter.running_var),
                num(None if setter is None else setter.gamma),
                num(None if setter is None else setter.gain),
                num(len(p.per_channel_collapsed)),
                num(len(p.fp16_overflow)),
                num(len(p.fp16_flush)),
                num(len(p.fp16_cancellation)),
                num(len(p.bf16_cancellation)),
                num(drop),
                data_layer=p.bn,
                class_=f"layer flagged sev-{worst}" if worst else "layer",
            )
        )
    headers: list[Header] = [
        "#",
        "BN",
        "producer",
        "paired by",
        "C",
        ("int8 scale", "S = max_c M'_c / 127, one scale per tensor"),
        ("collapsed", "channels whose folded weights all round to 0 under int8 per tensor"),
        ("coarse", "channels whose largest folded weight gets fewer than 8 int8 levels"),
        ("scale set by", "the channel c* with M'_c* = 127 S"),
        ("its var", "running_var of the scale-setting channel"),
        ("its gamma", "gamma of the scale-setting channel"),
        ("its gain", "|gamma| / sqrt(var + eps) of the scale-setting channel"),
        ("int8/C collapsed", "channels all zero even with one scale per channel"),
        "fp16 overflow",
        "fp16 flush",
        "fp16 cancel.",
        "bf16 cancel.",
        ("drop", "measured: accuracy of folded minus with only this pair quantized per tensor"),
    ]
    return table(headers, rows, caption=plural(len(report.pairs), "pair"), scroll=True, class_="layers")


def _flagged(report: FoldReport) -> list[tuple[int, PairPrediction]]:
    """(position, pair) with any hazard, the worst first (collapsed live channels and
    overflow, then coarse, then the others), ties in file order."""
    found = []
    for position, p in enumerate(report.pairs, 1):
        if not any(channels for _, _, channels in _hazards(p)):
            continue
        rank = 0 if p.live_collapsed or p.fp16_overflow else 1 if p.coarse else 2
        found.append((rank, position, p))
    found.sort(key=lambda t: (t[0], t[1]))
    return [(position, p) for _, position, p in found]


def _expanded(report: FoldReport, drawing: Charts) -> Html:
    flagged = _flagged(report)
    if not flagged:
        return Html("")
    shown = flagged[:MAX_EXPANDED]
    parts: list[Any] = [
        tag(
            "p",
            f"{plural(len(flagged), 'pair')} with a collapsed, coarse or half-precision hazard channel, drawn channel "
            "by channel"
            + (f"; the worst {len(shown)} are drawn, the table lists all" if len(shown) < len(flagged) else "")
            + ".",
            class_="quiet",
        )
    ]
    for position, p in sorted(shown, key=lambda t: t[0]):
        chart = drawing.draw(
            f"Channels of {p.bn} (folded into {p.producer}) hit by each int8 and half-precision hazard",
            charts.BESIDE,
            2.6,
            _paint_pair,
            p,
        )
        caption = (
            f"Each of the {p.channels} output channels of {p.producer} with {p.bn} folded in: the channels each "
            "hazard hits, and (dashed) the channel whose folded weights set the int8 per-tensor scale."
        )
        parts.append(
            tag(
                "div",
                tag("h4", join(f"#{position} ", p.bn, tag("span", f" into {p.producer}", class_="quiet"))),
                figure_with_table(chart, caption, _pair_table(p)),
                class_="expanded",
                id=f"pair-{position}",
            )
        )
    return section("Pairs with hazards", *parts, level=3)


def _runs(channels: Sequence[int]) -> list[tuple[int, int]]:
    """Consecutive channels as (start, length) runs: one rectangle each."""
    runs: list[tuple[int, int]] = []
    for c in sorted(channels):
        if runs and runs[-1][0] + runs[-1][1] == c:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((c, 1))
    return runs


def _paint_pair(fig: Figure, p: PairPrediction) -> None:
    ax = fig.subplots()
    hazards = _hazards(p)
    for index, (_name, colour, channels) in enumerate(hazards):
        runs = [(start - 0.45, length - 0.1) for start, length in _runs(channels)]
        if runs:
            ax.broken_barh(runs, (index - 0.35, 0.7), facecolors=colour)
    if p.scale_set_by is not None:
        ax.axvline(
            p.scale_set_by.channel,
            color=COLOURS["eps"],
            linestyle="--",
            linewidth=1.0,
            label=f"sets the int8 scale: channel {p.scale_set_by.channel}",
        )
        charts.legend(ax)
    ax.set_yticks(range(len(hazards)), [name for name, _, _ in hazards])
    ax.set_ylim(-0.6, len(hazards) - 0.4)
    ax.invert_yaxis()
    ax.set_xlim(-0.5, p.channels - 0.5)
    ax.set_xlabel("output channel")
    ax.grid(axis="y", visible=False)


def _pair_table(p: PairPrediction) -> Html:
    rows = [
        row(name, num(len(channels)), cell(listing(channels, LISTED) if channels else "-", class_="name"))
        for name, _, channels in _hazards(p)
    ]
    rows.append(
        row(
            "int8 per-channel collapsed",
            num(len(p.per_channel_collapsed)),
            cell(listing(p.per_channel_collapsed, LISTED) or "-", class_="name"),
        )
    )
    setter = p.scale_set_by
    if setter is not None:
        words = f"channel {setter.channel}"
        if setter.running_var is not None:
            words += f": running_var {setter.running_var:.3g}, gamma {setter.gamma:.3g}, gain {setter.gain:.3g}"
        rows.append(row("sets the int8 scale", num(setter.channel), words))
    return table(["hazard", "channels", "which"], rows, caption=f"{p.channels} output channels")

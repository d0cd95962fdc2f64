"""`bnaudit inspect --format html`: per file, a summary strip of every layer, and the
flagged layers drawn channel by channel.

Per file with layers:

- the summary strip, one column per layer in file order: running_var min-max (median
  dotted) on a log axis against eps and the near-eps limit (BN004's near-eps-factor x eps);
  the largest eval gain |gamma| / sqrt(var + eps) against max-gain; and, where a layer is
  young, the weight its initial values still hold, (1 - m)^t (`formulas.initial_weight`,
  BN003's measure) against max-init-weight. Beside it: the layer table, one row per layer
  with every number the JSON report holds for it.
- the findings, their rule pages linked.
- each flagged layer (a finding on it, or near-eps channels) expanded: every channel's
  running_var and eval gain (`LayerSummary.channels`, which the CLI asks inspect to keep for
  this format), the near-eps channels marked; beside it, the channels that matter.

Large models stay usable: the strip is one chart whatever the layer count, a per-channel
series past `charts.MAX_POINTS` channels is drawn as its min-max envelope, and at most
MAX_EXPANDED flagged layers are drawn per file (the worst first; the table lists them all).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from bnaudit.audit.checkpoint.report import FileReport, InspectReport, LayerChannels, LayerSummary
from bnaudit.audit.formulas import initial_weight
from bnaudit.config import severity_rank
from bnaudit.output.fit import summary_line
from bnaudit.output.html import charts
from bnaudit.output.html.charts import COLOURS, Charts
from bnaudit.output.html.markup import (
    Header,
    Html,
    anchor_for,
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
    severity_badge,
    table,
    tag,
)
from bnaudit.output.table.common import source_words
from bnaudit.output.table.inspect import file_status
from bnaudit.text import plural

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from bnaudit.config import Config

# Flagged layers drawn channel by channel, per file (the worst first): each is a chart of
# bounded size, so a model whose every layer is flagged still makes a page of a few MB.
MAX_EXPANDED = 24
# Channels listed in a flagged layer's table: its near-eps channels, then the largest gains.
LISTED_NEAR_EPS = 32
LISTED_GAINS = 5
# Below this initial-value weight in every layer the maturity panel says nothing (0.9^100).
YOUNG = 1e-4


def inspect_to_html(report: InspectReport) -> str:
    """The inspect report as one self-contained page."""
    charts.require()
    drawing = Charts()
    s = report.summary()
    subtitle = join(
        counts_line([(s["errors"], "error"), (s["warnings"], "warning"), (s["infos"], "info")]),
        tag("p", summary_line(report), class_="quiet"),
    )
    body: list[Html] = []
    if len(report.files) > 1:
        body.append(section("Files", _files_table(report.files), anchor="files"))
    for index, file in enumerate(report.files, 1):
        body.append(_file_section(file, index, report.config, drawing))
    return document("bnaudit inspect", subtitle, body)


def _files_table(files: list[FileReport]) -> Html:
    rows = []
    for index, f in enumerate(files, 1):
        audited = not (f.error or f.excluded)
        gains = [x.max_eval_gain for x in f.layers if x.max_eval_gain is not None]
        status = file_status(f)
        rows.append(
            row(
                cell(tag("a", f.shown, href=f"#{anchor_for('file', index)}"), class_="name"),
                f.format or "-",
                num(len(f.layers) if audited else None),
                num(max(gains) if audited and gains else None),
                cell(severity_badge(status) if status in ("error", "warning", "info", "ok") else status),
                data_file=f.shown,
            )
        )
    return table(["file", "format", "layers", ("worst gain", "largest eval gain of any layer"), "status"], rows)


def _file_section(file: FileReport, index: int, config: Config, drawing: Charts) -> Html:
    anchor = anchor_for("file", index)
    about = facts(
        [
            ("read as", source_words(file.format, file.key, file.prefix)),
            ("other state dicts", ", ".join(file.other_keys) if file.other_keys else None),
            ("settings", file.settings),
            ("provenance", file.provenance),
            ("averaging", file.averaging.describe() if file.averaging is not None else None),
            ("unreadable", file.error),
            ("excluded", file.excluded),
            ("skipped", f"{file.skipped}: {file.skip_reason}" if file.skipped else None),
        ]
    )
    notes = [*file.notes, *file.not_loaded]
    parts: list[Any] = [about, tag("ul", *(tag("li", n) for n in notes), class_="notes") if notes else None]
    if file.error or file.excluded or file.skipped:
        return section(file.shown, *parts, anchor=anchor)
    if not file.layers:
        parts.append(tag("p", "No BatchNorm layers found.", class_="quiet"))
        return section(file.shown, *parts, findings_table(file.findings), anchor=anchor)
    statuses = [file.layer_status(s.name) for s in file.layers]
    parts.append(
        figure_with_table(
            drawing.draw(_strip_alt(file), *_strip_size(file), _paint_strip, file, config),
            _strip_caption(file, config),
            _layer_table(file, statuses, index),
            stacked=True,
        )
    )
    parts.append(findings_table(file.findings, caption="findings"))
    parts.append(_expanded(file, statuses, index, config, drawing))
    return section(file.shown, *parts, anchor=anchor)


# --- the summary strip --------------------------------------------------------------------


def _weights(file: FileReport) -> list[float | None]:
    """Each layer's initial-value weight (1 - m)^t, None where the counter does not give it."""
    out: list[float | None] = []
    for s in file.layers:
        t, m = s.num_batches_tracked, s.momentum
        valid = t is not None and t >= 0 and (m is None or 0.0 < m < 1.0)
        out.append(initial_weight(m, t) if valid and t is not None else None)
    return out


def _young(file: FileReport) -> bool:
    return any(w is not None and w >= YOUNG for w in _weights(file))


def _strip_size(file: FileReport) -> tuple[float, float]:
    """Inches: narrower for a few layers (each column keeps a readable width either way)."""
    return charts.strip_width(len(file.layers)), (5.6 if _young(file) else 4.2)


def _strip_alt(file: FileReport) -> str:
    flagged = sum(1 for s in file.layers if file.layer_status(s.name) != "ok")
    return (
        f"Summary of {plural(len(file.layers), 'BN layer')} of {file.shown}: running_var range and largest eval "
        f"gain per layer on log axes{', initial-value weight' if _young(file) else ''}; "
        f"{plural(flagged, 'layer')} with findings in colour."
    )


def _strip_caption(file: FileReport, config: Config) -> str:
    text = (
        "Per layer, in file order: running_var from its smallest to its largest channel (dash: median) against "
        f"eps and the near-eps limit ({config.near_eps_factor:g} x eps); the largest eval gain |gamma| / sqrt(var + "
        f"eps) against max-gain {config.max_gain:g}. Colour: the layer's worst finding."
    )
    if _young(file):
        text += (
            " Bottom: the weight the initial values (mean 0, var 1) still hold, (1 - momentum)^num_batches_tracked, "
            f"against max-init-weight {config.max_init_weight:g}."
        )
    return text


def _paint_strip(fig: Figure, file: FileReport, config: Config) -> None:
    layers = file.layers
    names = [s.name for s in layers]
    colours = [
        COLOURS[file.layer_status(name)] if file.layer_status(name) != "ok" else COLOURS["line"] for name in names
    ]
    young = _young(file)
    ratios = [3.0, 2.0, 1.6] if young else [3.0, 2.0]
    axes = fig.subplots(len(ratios), 1, sharex=True, gridspec_kw={"height_ratios": ratios})
    var_ax, gain_ax = axes[0], axes[1]
    xs = range(len(layers))
    positive = [v for s in layers for v in (s.var_min, s.eps) if v is not None and v > 0 and math.isfinite(v)]
    floor = min(positive, default=1e-8) / 10
    lows = [max(s.var_min, floor) if s.var_min is not None else math.nan for s in layers]
    highs = [max(s.var_max, floor) if s.var_max is not None else math.nan for s in layers]
    medians = [max(s.var_median, floor) if s.var_median is not None else math.nan for s in layers]
    thick = 2.4 if len(layers) <= 80 else 1.0
    charts.segments(var_ax, xs, lows, highs, colours, thick)
    charts.marks(var_ax, xs, medians, ["#222"] * len(xs), "_")
    eps = [s.eps for s in layers]
    charts.level(var_ax, eps, "eps", COLOURS["eps"], "--")
    charts.level(var_ax, [config.near_eps_factor * e for e in eps], "near-eps limit", COLOURS["threshold"], ":")
    charts.log_axis(var_ax)
    var_ax.set_ylabel("running_var")
    charts.legend(var_ax)
    gains = [s.max_eval_gain if s.max_eval_gain is not None else math.nan for s in layers]
    # lollipops from gain 1 (eval mode passes the deviation on unscaled): up amplifies, down damps
    charts.segments(gain_ax, xs, [1.0] * len(xs), gains, colours, thick)
    charts.marks(gain_ax, xs, gains, colours)
    gain_ax.axhline(1.0, color=COLOURS["muted"], linewidth=0.8)
    charts.threshold(gain_ax, config.max_gain, f"max-gain {config.max_gain:g}")
    charts.log_axis(gain_ax)
    gain_ax.set_ylabel("max eval gain")
    charts.legend(gain_ax)
    last = gain_ax
    if young:
        weight_ax = axes[2]
        weights = [w if w is not None else math.nan for w in _weights(file)]
        weight_ax.bar(xs, weights, color=colours, width=0.7)
        charts.threshold(weight_ax, config.max_init_weight, f"max-init-weight {config.max_init_weight:g}")
        weight_ax.set_ylim(0, 1)
        weight_ax.set_ylabel("initial weight")
        charts.legend(weight_ax)
        last = weight_ax
    charts.layer_axis(last, names)


def _layer_table(file: FileReport, statuses: list[str], file_index: int) -> Html:
    weights = _weights(file)
    expanded = {s.name for _, s in _flagged(file, statuses)[:MAX_EXPANDED]}
    rows = []
    for position, (s, status, w) in enumerate(zip(file.layers, statuses, weights), 1):
        name = s.name
        if name in expanded:
            name_cell = cell(tag("a", name, href=f"#{_layer_anchor(file_index, position)}"), class_="name")
        else:
            name_cell = cell(name, class_="name")
        rows.append(
            row(
                num(position),
                name_cell,
                cell(severity_badge(status)),
                cell(s.kind),
                num(s.num_features),
                num(s.num_batches_tracked),
                num(s.eps),
                num(s.momentum),
                num(s.mean_min),
                num(s.mean_max),
                num(s.var_min),
                num(s.var_median),
                num(s.var_max),
                num(s.near_eps_channels),
                num(s.max_eval_gain),
                num(w, "-" if w is None else f"{w * 100:.3g}%"),
                data_layer=s.name,
                class_=f"layer flagged sev-{status}" if status != "ok" else "layer",
            )
        )
    headers: list[Header] = [
        "#",
        "layer",
        "status",
        "kind",
        "C",
        ("batches", "num_batches_tracked"),
        "eps",
        "momentum",
        "mean min",
        "mean max",
        "var min",
        "var median",
        "var max",
        ("near-eps", "channels with running_var < near-eps-factor x eps"),
        ("max gain", "largest eval gain |gamma| / sqrt(var + eps)"),
        ("init. weight", "(1 - momentum)^num_batches_tracked: the initial values' share"),
    ]
    return table(headers, rows, caption=f"{plural(len(file.layers), 'BN layer')}", scroll=True, class_="layers")


# --- flagged layers, channel by channel ---------------------------------------------------


def _flagged(file: FileReport, statuses: list[str]) -> list[tuple[int, LayerSummary]]:
    """(position, layer) of the layers with a finding or near-eps channels, the worst first
    (severity, then eval gain), ties in file order."""
    found = [
        (position, s, status)
        for position, (s, status) in enumerate(zip(file.layers, statuses), 1)
        if status != "ok" or s.near_eps_channels
    ]
    found.sort(key=lambda t: (-severity_rank(t[2]) if t[2] != "ok" else 1, -(t[1].max_eval_gain or 0.0), t[0]))
    return [(position, s) for position, s, _ in found]


def _layer_anchor(file_index: int, position: int) -> str:
    return f"file-{file_index}-layer-{position}"


def _expanded(file: FileReport, statuses: list[str], file_index: int, config: Config, drawing: Charts) -> Html:
    flagged = _flagged(file, statuses)
    if not flagged:
        return Html("")
    shown = flagged[:MAX_EXPANDED]
    parts: list[Any] = [
        tag(
            "p",
            f"{plural(len(flagged), 'flagged layer')} (a finding or near-eps channels), drawn channel by channel"
            + (f"; the worst {len(shown)} are drawn, the table lists all" if len(shown) < len(flagged) else "")
            + ".",
            class_="quiet",
        )
    ]
    for position, s in sorted(shown):
        status = file.layer_status(s.name)
        heading = join(tag("span", f"#{position} "), s.name, " ", severity_badge(status))
        body: list[Any] = [tag("h4", heading)]
        findings = [f for f in file.findings if f.layer == s.name]
        if s.channels is None:  # a report built without its channels (bnaudit.inspect(channels=False))
            body.append(tag("p", "Per-channel values not kept in this report.", class_="quiet"))
        else:
            channels = s.channels
            body.append(
                figure_with_table(
                    drawing.draw(
                        f"running_var and eval gain of each of the {s.num_features} channels of {s.name}",
                        charts.BESIDE,
                        3.6,
                        _paint_channels,
                        s,
                        channels,
                        config,
                    ),
                    _channels_caption(s, channels, config),
                    _channels_table(s, channels),
                )
            )
        if findings:
            body.append(findings_table(findings, caption=f"findings of {s.name}"))
        parts.append(tag("div", *body, id=_layer_anchor(file_index, position), class_="expanded"))
    return section("Flagged layers", *parts, level=3)


def _channels_caption(s: LayerSummary, channels: LayerChannels, config: Config) -> str:
    per = charts.buckets(len(channels.running_var))
    drawn = f" (each step: min-max of {per} channels)" if per > 1 else ""
    zero = sum(1 for v in channels.running_var if v == 0)
    return (
        f"Top: running_var of every channel{drawn} on a log axis, eps {s.eps:g} dashed, the near-eps limit "
        f"{config.near_eps_factor:g} x eps dotted, near-eps channels marked. Bottom: each channel's eval gain "
        f"|gamma| / sqrt(var + eps) against max-gain {config.max_gain:g}."
        + (f" {plural(zero, 'channel')} with running_var 0 drawn at the axis floor." if zero else "")
    )


def _paint_channels(fig: Figure, s: LayerSummary, channels: LayerChannels, config: Config) -> None:
    var_ax, gain_ax = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3.0, 2.0]})
    var = channels.running_var
    positive = [v for v in var if v > 0 and math.isfinite(v)]
    floor = min([*positive, s.eps], default=1e-8) / 10
    charts.channel_series(var_ax, var, COLOURS["line"], floor, "running_var")
    charts.threshold(var_ax, s.eps, "eps", COLOURS["eps"], "--")
    charts.threshold(var_ax, config.near_eps_factor * s.eps, "near-eps", COLOURS["threshold"], ":")
    near = channels.near_eps[:256]
    if near:
        var_ax.scatter(
            near,
            [max(var[c], floor) for c in near],
            s=18,
            color=COLOURS["error"],
            zorder=4,
            label=f"near eps ({len(channels.near_eps)})",
        )
    charts.log_axis(var_ax)
    var_ax.set_ylabel("running_var")
    charts.legend(var_ax)
    gains = channels.eval_gain
    charts.channel_series(gain_ax, gains, COLOURS["second"], 1e-12, "eval gain")
    charts.threshold(gain_ax, config.max_gain, f"max-gain {config.max_gain:g}")
    high = [c for c, g in enumerate(gains) if g >= config.max_gain][:256]
    if high:
        gain_ax.scatter(high, [gains[c] for c in high], s=18, color=COLOURS["error"], zorder=4)
    charts.log_axis(gain_ax)
    gain_ax.set_ylabel("eval gain")
    gain_ax.set_xlabel("channel")
    gain_ax.set_xlim(-0.5, len(var) - 0.5)
    charts.legend(gain_ax)


def _channels_table(s: LayerSummary, channels: LayerChannels) -> Html:
    """The channels that matter: the near-eps ones, then the largest gains."""
    listed: dict[int, str] = dict.fromkeys(channels.near_eps[:LISTED_NEAR_EPS], "near eps")
    finite_gains = sorted(
        ((g, c) for c, g in enumerate(channels.eval_gain) if math.isfinite(g)), key=lambda t: (-t[0], t[1])
    )
    for _, c in finite_gains[:LISTED_GAINS]:
        listed.setdefault(c, "largest gain")
    rows = [
        row(num(c), num(channels.running_var[c]), num(channels.eval_gain[c]), why, data_channel=str(c))
        for c, why in sorted(listed.items())
    ]
    more = len(channels.near_eps) - LISTED_NEAR_EPS
    caption = f"channels of {s.num_features}" + (f" ({more} more near-eps channels not listed)" if more > 0 else "")
    return table(["channel", "running_var", "eval gain", "why listed"], rows, caption=caption, class_="channels")

"""Rich tables for the terminal: one renderer per report kind, and the rules listing.

Every string that came from a file, a model or the data (paths, layer and module names,
model descriptions, messages that quote them) goes through `printable` here, where it is
drawn (`_cell`), so that an escape sequence in a layer name is shown, not obeyed.
Numbers and the fixed words of the tables are ours.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

from bnaudit.audit.report import FileReport, InspectReport, LayerSummary
from bnaudit.audit.rules import RULES, Finding
from bnaudit.output.fit import FindingRow, collapse, concise_lines, shorten_middle, summary_line
from bnaudit.output.grid import SEVERITY_STYLE, layout_grid
from bnaudit.text import above_floor, plural, printable


def _bordered(title: str | None = None) -> Any:
    """The one table style of bnaudit's reports: header rule and column lines, no outer
    edge, a bold header and a bold left-aligned title."""
    from rich.table import Table

    return Table(
        title=title, title_justify="left", title_style="bold", show_edge=False, pad_edge=False, header_style="bold"
    )


def render_rules(console: Any, overrides: dict[str, str] | None = None) -> None:
    """`bnaudit rules`: one row per rule, severities as configured."""

    from bnaudit.audit.ruledocs import shown_severity

    rows = [(rule.code, rule.name, shown_severity(rule, overrides), rule.summary) for rule in RULES.values()]
    table = _bordered()
    # min_width: rich would otherwise squeeze these to "BN0…" at 80 columns before
    # wrapping the summaries, which wrap at spaces
    for i, header in enumerate(("code", "name")):
        table.add_column(header, no_wrap=True, min_width=max(len(header), *(len(row[i]) for row in rows)))
    table.add_column("severity")  # "error / warning / info" may wrap at its spaces
    table.add_column("fires when", overflow="fold")
    for row in rows:
        table.add_row(*row)
    console.print(_fit(table, console.width))
    console.print(f"bnaudit rules CODE explains a rule ({len(RULES)} rules).")


def _fit(table: Any, width: int) -> Any:
    """`table` with column widths chosen so that it wraps only at spaces within `width`.

    rich narrows the widest wrapping column first and, past that, every column evenly, down
    to folding a word inside ("track_running_stats=Fal / se:") or cutting a number ("0.006…").
    Here a wrapping column keeps at least its longest word (header included) and the widest
    ones give way first; `no_wrap` columns keep their width. Where even that does not fit,
    rich's own narrowing is left to do what it can. Grids and tables that fit are untouched.
    """
    if getattr(table, "box", None) is None:  # a fast grid (grid.py, a Text) or a bullet grid
        return table  # before importing rich.table: the layer grid of inspect must not pay for it
    from rich.cells import cell_len
    from rich.table import Table
    from rich.text import Text

    if not isinstance(table, Table):
        return table

    def plain(cell: Any) -> str:
        return cell.plain if isinstance(cell, Text) else str(cell)

    columns = table.columns
    widest: list[int] = []
    least: list[int] = []
    for column in columns:
        texts = [plain(column.header), *(plain(c) for c in column._cells)]
        lines = [line for t in texts for line in t.splitlines()]
        most = max(map(cell_len, lines), default=1)
        word = max((cell_len(w) for t in texts for w in t.split()), default=1)
        if column.max_width is not None:
            most = min(most, max(column.max_width, word))
        widest.append(most)
        least.append(most if column.no_wrap else max(word, column.min_width or 0))
    extra = table._extra_width + sum(table._get_padding_width(i) for i in range(len(columns)))
    if sum(widest) + extra <= width or sum(least) + extra > width:
        return table
    widths = list(widest)
    while sum(widths) + extra > width:
        i = max(range(len(widths)), key=lambda j: (widths[j] - least[j] > 0, widths[j]))
        widths[i] -= 1
    for column, w in zip(columns, widths):
        if not column.no_wrap:
            column.width = w
            column.min_width = None
            column.max_width = None
    return table


def _cell(text: str, style: str = "") -> Any:
    """A table cell that shows `text` as is: plain strings would be parsed as rich markup."""
    from rich.text import Text

    return Text(printable(text), style=style)


def _indented(text: str, style: str = "dim") -> Any:
    """A note under a title: two spaces in, and its wrapped lines keep them."""
    from rich.padding import Padding

    return Padding(_cell(text, style=style), (0, 0, 0, 2), expand=False)


def _g(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.3g}" if math.isfinite(x) else str(x)


_Column = tuple[str, Callable[[LayerSummary], str]]  # header, cell of a layer

_C: _Column = ("C", lambda s: str(s.num_features))
_BATCHES: _Column = ("batches", lambda s: "-" if s.num_batches_tracked is None else str(s.num_batches_tracked))
_MEAN: _Column = ("mean range", lambda s: f"[{_g(s.mean_min)}, {_g(s.mean_max)}]")
_VAR: _Column = ("var min / med / max", lambda s: f"{_g(s.var_min)} / {_g(s.var_median)} / {_g(s.var_max)}")
_VAR_MIN: _Column = ("var min", lambda s: _g(s.var_min))
_NEAR: _Column = ("near-eps", lambda s: str(s.near_eps_channels))
_GAIN: _Column = ("max gain", lambda s: _g(s.max_eval_gain))
# Widest first; each next one leaves out the least telling of what is left: the mean
# range, then the counter and the median / max of the variance (near-eps and the gain
# already say what a small variance does).
_LAYOUTS: tuple[tuple[tuple[_Column, ...], tuple[str, ...]], ...] = (
    ((_C, _BATCHES, _MEAN, _VAR, _NEAR, _GAIN), ()),
    ((_C, _BATCHES, _VAR, _NEAR, _GAIN), ("mean range",)),
    ((_C, _VAR_MIN, _NEAR, _GAIN), ("mean range", "batches", "var median / max")),
)
_NAME_MIN = 24  # the layer column gets at least this much before columns are dropped


def _layer_layout(files: list[FileReport], width: int) -> tuple[tuple[_Column, ...], tuple[str, ...]]:
    """The widest layout whose layer table fits `width` for every file of the run (one
    choice for all, so the tables of a run line up and drop the same columns), and the
    columns it leaves out."""
    for columns, dropped in _LAYOUTS:
        needed = 0
        for file in files:
            longest = max(len(s.name) for s in file.layers)
            statuses = [file.layer_status(s.name) for s in file.layers]
            cells = [[cell(s) for s in file.layers] for _, cell in columns]
            total = min(longest, _NAME_MIN) + max(6, *map(len, statuses)) + 3 * (len(columns) + 1)
            total += sum(max(len(header), *map(len, col)) for (header, _), col in zip(columns, cells))
            needed = max(needed, total)
        if needed <= width:
            return columns, dropped
    return _LAYOUTS[-1]


def _layer_table(file: FileReport, console: Any, columns: tuple[_Column, ...] | None = None) -> Any:
    """One row per layer with `columns` (default: the widest that fit); numbers are never
    folded across lines, and a name too long for what is left is shortened in the middle."""
    if columns is None:
        columns = _layer_layout([file], console.width)[0]
    headers = ["layer", *(header for header, _ in columns), "status"]
    statuses = {s.name: file.layer_status(s.name) for s in file.layers}
    rows = [[printable(s.name), *(printable(cell(s)) for _, cell in columns), statuses[s.name]] for s in file.layers]
    rest = sum(max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers) if i) + 3 * (len(headers) - 1)
    room = max(console.width - rest, _NAME_MIN // 2, len(headers[0]))
    for row in rows:
        row[0] = shorten_middle(row[0], room)
    longest = max(len(row[0]) for row in rows)
    grid = layout_grid(headers, rows, console, min(longest, _NAME_MIN))
    if grid is not None:
        return grid
    from rich.text import Text

    table = _bordered()
    table.add_column("layer", overflow="fold", min_width=min(longest, _NAME_MIN))
    for header in headers[1:-1]:
        table.add_column(header, justify="right", no_wrap=True)
    table.add_column("status", no_wrap=True)
    for row in rows:
        # Text: "[inf, inf]" or a name from the file would otherwise parse as rich markup
        table.add_row(*map(Text, row[:-1]), Text(row[-1], style=SEVERITY_STYLE[row[-1]]))
    return table


def file_status(file: FileReport) -> str:
    """A file's worst finding ("error", "warning", "info"), "ok", or "unreadable"."""
    if file.error:
        return "unreadable"
    if file.excluded:
        return "excluded"
    if file.skipped:
        return "skipped"
    severities = {f.severity for f in file.findings}
    return next((s for s in ("error", "warning", "info") if s in severities), "ok")


def _worst_gain(file: FileReport) -> str:
    gains = [s.max_eval_gain for s in file.layers if s.max_eval_gain is not None]
    return _g(max(gains)) if gains else "-"


def _files_table(files: list[FileReport], console: Any) -> Any:
    """One line per file: path, format, BN layers, worst eval gain, status."""
    from rich.text import Text

    rows = [
        [
            printable(f.path),
            printable(f.format or "-"),
            "-" if f.error or f.excluded else str(len(f.layers)),
            "-" if f.error or f.excluded else _worst_gain(f),
            file_status(f),
        ]
        for f in files
    ]
    headers = ["file", "format", "layers", "worst gain", "status"]
    rest = sum(max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers) if i) + 3 * (len(headers) - 1)
    room = max(console.width - rest, 12)
    table = _bordered()
    for i, header in enumerate(headers):
        table.add_column(header, justify="right" if i in (2, 3) else "left", no_wrap=True)
    styles = {**SEVERITY_STYLE, "unreadable": "bold red", "excluded": "dim", "skipped": "dim"}
    for row in rows:
        table.add_row(
            Text(shorten_middle(row[0], room)), Text(row[1]), row[2], row[3], Text(row[4], style=styles[row[4]])
        )
    return table


def _file_detail(file: FileReport, console: Any, columns: tuple[_Column, ...]) -> None:
    """A file's title, its notes, its layer table and its findings."""
    from rich.text import Text

    title = _cell(file.path, style="bold")
    where = f"{file.format}" + (f", key '{file.key}'" if file.key else "")
    if file.prefix:
        where += f", prefix '{file.prefix}' stripped"
    title.append(printable(f"  ({where})"), style="dim")
    console.print(title)
    if file.other_keys:
        console.print(_indented(f"other state dicts: {', '.join(file.other_keys)} (choose with --key)", style="dim"))
    if file.settings:
        console.print(_indented(f"{file.settings}", style="dim"))
    if file.provenance:
        console.print(_indented(f"{file.provenance}", style="dim"))
    for note in [*file.notes, *file.not_loaded]:
        console.print(_indented(f"{note}", style="dim"))
    if file.layers:
        console.print(_fit(_layer_table(file, console, columns), console.width))
    else:
        console.print(Text("  no BatchNorm layers found", style="dim"))
    if file.findings:
        console.print(_fit(_findings_table(file.findings), console.width))
    console.print()


def render_inspect(report: InspectReport, console: Any, quiet: bool = False, all_layers: bool = False) -> None:
    """The inspect table.

    One file: its layer table and findings. Several: a files table (one line per file),
    then the layer tables of the files with findings (of every file with `all_layers`).
    `quiet`: one line per finding (`fit.concise_lines`) and the summary.
    """
    from rich.text import Text

    s = report.summary()
    worst = "error" if s["errors"] or s["unreadable"] else "warning" if s["warnings"] else "ok"
    if quiet:
        *lines, summary = concise_lines(report)
        for line in lines:
            console.print(_cell(line), soft_wrap=True)
        console.print(Text(summary, style=SEVERITY_STYLE[worst]), soft_wrap=True)
        return
    several = len(report.files) > 1
    shown = [
        f
        for f in report.files
        if not f.error and not f.excluded and not f.skipped and (not several or all_layers or f.findings)
    ]
    columns, dropped = _layer_layout([f for f in shown if f.layers], console.width)
    if several:
        console.print(_fit(_files_table(report.files, console), console.width))
        console.print()
    for file in report.files:
        if file.error:
            continue  # said once, on stderr (output.emit_diagnostics)
        if file.excluded:
            console.print(_cell(f"{file.path}: {file.excluded}", style="dim"), soft_wrap=True)
        elif file.skipped:
            console.print(
                _cell(f"{file.path}: skipped: {file.skipped}: not model weights", style="dim"), soft_wrap=True
            )
        elif any(file is f for f in shown):
            _file_detail(file, console, columns)
    if several and not all_layers and len(shown) < s["files"] - s["unreadable"]:
        console.print(Text("files without findings are one line each; --layers shows their layer tables", style="dim"))
    if dropped and any(f.layers for f in shown):
        console.print(
            Text(
                f"dropped to fit {console.width} columns: {', '.join(dropped)}",
                style="dim",
            )
        )
    console.print(Text(summary_line(report), style=SEVERITY_STYLE[worst]), soft_wrap=True)


def _percent(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.1f}%"


def _f2(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}" if abs(x) < 10 else f"{x:.1f}"


Justify = Literal["left", "right"]


def _findings_table(findings: list[Finding], title: str | None = None) -> Any:
    """Findings, identical ones on several layers as one row (`fit.collapse`): words are
    wrapped whole, codes and severities never, long layer names shortened in the middle."""

    table = _bordered(title)
    table.add_column("code", no_wrap=True)
    table.add_column("severity", no_wrap=True)
    table.add_column("layer", max_width=_NAME_MIN + 4)
    table.add_column("message", overflow="fold")  # fold: only a word longer than the column
    for row in collapse(findings):
        shortened = FindingRow(
            row.code, row.name, row.severity, tuple(shorten_middle(n, _NAME_MIN) for n in row.layers), row.message
        )
        table.add_row(
            _cell(f"{row.code} {row.name}"),
            _cell(row.severity, style=SEVERITY_STYLE[row.severity]),
            _cell(shortened.where()),
            _cell(row.message),
        )
    return table


def render_gap(report: Any, console: Any, quiet: bool = False) -> None:
    """Rich rendering: header, the two modes, per-layer drift (worst first), findings, diagnosis."""
    from rich.text import Text

    title = _cell(report.checkpoint, style="bold")
    title.append(printable(f"  ({report.model})"), style="dim")
    console.print(title)
    console.print(_cell(f"data: {report.data}", style="dim"))
    for note in getattr(report, "notes", []):
        console.print(_cell(f"note: {note}", style="dim"))
    order = f"shuffled with seed {report.seed}" if report.shuffle else "file order, --no-shuffle"
    skipped = f", {plural(report.skipped, 'unreadable image')} skipped" if report.skipped else ""
    console.print(
        _cell(
            f"{plural(report.samples, 'sample')} in {plural(report.batches, 'batch', 'batches')} of {report.batch_size} "
            f"({order}), device {report.device}{skipped}"
        )
    )
    console.print()

    modes = _bordered()
    modes.add_column("mode")
    modes.add_column("BatchNorm normalises with")
    modes.add_column("accuracy", justify="right")
    modes.add_column("95% CI (Wilson)", justify="right")
    modes.add_row("train", "batch statistics", _percent(report.train_accuracy), _span(report.train_interval))
    modes.add_row("eval", "running statistics", _percent(report.eval_accuracy), _span(report.eval_interval))
    console.print(_fit(modes, console.width))
    parts = []
    if report.gap is not None:
        significant = report.gap_significant is not False
        style = "bold red" if report.gap > 0.01 and significant else "green"
        words = f"gap {report.gap * 100:+.1f} points (95% CI {_span(report.gap_interval, signed=True)}, n = {report.labelled}"
        # on a line of its own: with its interval it leaves no room for the other measures
        console.print(Text(words + (")" if significant else ", not significant)"), style=style))
    if report.agreement is not None:
        parts.append(Text(f"agreement {_percent(report.agreement)}"))
    if report.divergence is not None:
        kind = "KL(eval || train)" if report.divergence_kind == "kl" else "relative L2"
        parts.append(Text(f"divergence {report.divergence:.4g} ({kind})"))
    if parts:
        console.print(Text("  ·  ").join(parts))
    console.print()

    unmeasured = [d for d in report.layers if d.note == "not measured (TorchScript)"]
    if report.layers and not quiet and len(unmeasured) == len(report.layers):
        console.print(_cell(_scripted_line(len(report.layers)), style="dim"))
        console.print()
    elif report.layers and not quiet:
        console.print(_fit(_drift_table(report.layers), console.width))
        console.print()

    _findings_and_diagnosis(console, report.findings, report.diagnosis)


def render_invariance(report: Any, console: Any, quiet: bool = False) -> None:
    """Rich rendering: header, verdict, one row per arrangement, the noise floor, the
    coupling sites, findings, diagnosis."""
    from rich.text import Text

    title = _cell(report.checkpoint, style="bold")
    title.append(printable(f"  ({report.model})"), style="dim")
    console.print(title)
    console.print(_cell(f"data: {report.data}", style="dim"))
    for note in report.notes:
        console.print(_cell(f"note: {note}", style="dim"))
    order = f"shuffled with seed {report.seed}" if report.shuffle else "file order, --no-shuffle"
    skipped = f", {plural(report.skipped, 'unreadable image')} skipped" if report.skipped else ""
    sizes = ", ".join(str(s) for s in report.batch_sizes)
    console.print(
        _cell(
            f"{plural(report.samples, 'sample')} ({order}), batch sizes {sizes}, "
            f"{plural(len(report.arrangements), 'arrangement')}, device {report.device}, "
            f"{report.dtype} outputs{skipped}"
        )
    )
    console.print()
    if report.verdict == "coupled":
        words = f"coupled: {report.coupled} of {plural(report.samples, 'sample')} depend on their batch companions"
        if report.failures:
            words += (
                " (and the model cannot score one sample alone)"
                if report.coupled
                else (": the model cannot score one sample alone")
            )
        console.print(Text(words, style="bold red"))
    else:
        console.print(Text("invariant: no output depends on its batch companions", style="bold green"))
    console.print()

    if not quiet:
        table = _bordered(f"outputs against the reference ({report.reference}), per arrangement")
        columns: tuple[tuple[str, Justify], ...] = (
            ("arrangement", "left"),
            ("batches", "right"),
            ("max deviation", "right"),
            ("coupled", "right"),
            ("changed", "right"),
            ("accuracy", "right"),
        )
        for col, justify in columns:
            table.add_column(col, justify=justify)
        for a in report.arrangements:
            reference = a.name == report.reference
            table.add_row(
                a.name + (" *" if reference else ""),
                str(a.batches),
                "-" if reference else above_floor(a.max_deviation, report.screen),
                "-" if reference else str(a.coupled),
                "-" if reference or a.changed is None else str(a.changed),
                _percent(a.accuracy),
                style="red" if a.coupled else "",
            )
        console.print(_fit(table, console.width))
        console.print(Text("* reference; deviation: " + report.norm, style="dim"))
        for name, message in report.failures.items():
            console.print(_cell(f"{name}: failed: {message}", style="red"))
        console.print()

    # below the screen, which sample deviates most is kernel noise too: not named
    below_screen = report.max_deviation < report.screen
    where = f" ({report.max_deviation_sample})" if report.max_deviation_sample and not below_screen else ""
    parts = [Text(f"largest deviation {above_floor(report.max_deviation, report.screen, '.3g')}{where}")]
    if report.changed is not None:
        parts.append(Text(f"predictions changed {report.changed} ({_percent(report.changed_share)})"))
    if report.max_kl is not None:
        kl_max, kl_mean = (above_floor(kl, report.kl_floor, ".3g") for kl in (report.max_kl, report.mean_kl))
        parts.append(Text(f"KL(reference || arrangement) max {kl_max}, mean {kl_mean}"))
    console.print(Text("  ·  ").join(parts))
    rescored = (
        f"{report.flagged} flagged, {report.cleared} cleared by float64 re-scoring"
        if report.float64
        else f"{report.flagged} flagged" + (", not re-scored in float64" if report.flagged else "")
    )
    noise64 = report.float64_noise
    noise = f", largest float64 noise {above_floor(noise64, report.floor)}" if noise64 is not None else ""
    console.print(
        _cell(
            f"noise floor: screen {report.screen:.2g} ({report.dtype}), float64 floor {report.floor:.2g}; "
            f"{rescored}{noise}",
            style="dim",
        )
    )
    console.print()

    if report.sites:
        sites = _bordered("where samples meet")
        sites.add_column("module", overflow="fold")
        sites.add_column("kind")
        sites.add_column("why", overflow="fold")
        groups: dict[str, list[Any]] = {}
        for site in report.sites:
            # one row per reason: a whole graph traced in training mode is one finding
            groups.setdefault(site.reason.replace(site.kind, "{kind}"), []).append(site)
        for group in groups.values():
            kinds = list(dict.fromkeys(s.kind for s in group))
            reason = group[0].reason if len(group) == 1 else group[0].reason.replace(f"{group[0].kind} ", "")
            sites.add_row(_cell(", ".join(s.module for s in group)), _cell(", ".join(kinds)), _cell(reason))
        console.print(_fit(sites, console.width))
        console.print()

    _findings_and_diagnosis(console, report.findings, report.diagnosis)


def _span(pair: tuple[float, float] | None, signed: bool = False) -> str:
    """A 95% interval in percent (points when `signed`)."""
    if pair is None:
        return "-"
    if signed:
        return f"{pair[0] * 100:+.1f} to {pair[1] * 100:+.1f}"
    return f"{pair[0] * 100:.1f}-{pair[1] * 100:.1f}%"


def _scripted_line(layers: int) -> str:
    return (
        f"per-layer drift: not measured for the {plural(layers, 'BN layer')}: TorchScript modules run no hooks; "
        "pass the state dict with --arch MODULE:CALLABLE to see it"
    )


def _worst_channel(d: Any) -> str:
    """`index: shift_c + log_var_c` of the layer's worst channel (bnaudit.runtime.attribution)."""
    if not d.worst:
        return "-"
    c = d.worst[0]
    return f"{c.index}: {_f2(c.score)}"


def _drift_table(layers: list[Any]) -> Any:
    """Per-layer drift, origins first (their # marked *), then by the worst channel's drift;
    "worst ch" is `index: shift_c + log_var_c` of that channel."""

    table = _bordered("per-layer drift: eval-mode inputs against running statistics; * origin of the drift")
    columns: tuple[tuple[str, Justify], ...] = (
        ("layer", "left"),
        ("#", "right"),
        ("kind", "left"),
        ("C", "right"),
        ("mean shift", "right"),
        ("max shift", "right"),
        ("var log-ratio", "right"),
        ("drift", "right"),
        ("worst ch", "right"),
    )
    for col, justify in columns:
        table.add_column(col, justify=justify, overflow="fold")
    for d in layers:
        if d.drift is None:
            style = "dim"
        elif d.origin:
            style = "bold red"
        elif d.large:
            style = "yellow"
        else:
            style = ""
        table.add_row(
            _cell(d.name),
            f"{d.position + 1}{'*' if d.origin else ''}",
            _cell(d.kind),
            str(d.channels),
            _f2(d.mean_shift),
            _f2(d.max_mean_shift),
            _f2(d.var_log_ratio),
            _f2(d.drift) if d.drift is not None else _cell(d.note or "-"),
            _worst_channel(d),
            style=style,
        )
    return table


def _arrow(before: float | None, after: float | None) -> Any:
    from rich.text import Text

    text = Text(_f2(before), style="yellow" if before is not None and before >= 0.5 else "")
    text.append(" -> ", style="dim")
    text.append(_f2(after), style="yellow" if after is not None and after >= 0.5 else "green")
    return text


def render_recalibrate(report: Any, console: Any, quiet: bool = False) -> None:
    """Rich rendering: what was written, the per-layer before/after drift, skipped
    layers, and with --eval-data the two gap reports side by side."""

    title = _cell(report.input, style="bold")
    title.append(" -> ", style="dim")
    title.append(printable(report.output), style="bold green")
    title.append(printable(f"  ({report.format}" + (f", key '{report.key}'" if report.key else "") + ")"), style="dim")
    console.print(title)
    console.print(_cell(f"model: {report.model}", style="dim"))
    console.print(_cell(f"data: {report.data}", style="dim"))
    order = f"shuffled with seed {report.seed}" if report.shuffle else "file order (--no-shuffle)"
    ranks = f" on {report.world_size} ranks" if report.world_size > 1 else ""
    console.print(
        _cell(
            f"method {report.method}: {plural(report.samples, 'sample')} in {plural(report.batches, 'batch', 'batches')} of "
            f"{report.batch_size} ({order}), device {report.device}{ranks}"
        )
    )
    console.print()

    if not quiet:
        table = _bordered("per-layer drift against the calibration data: old -> new statistics")
        columns: tuple[tuple[str, Justify], ...] = (
            ("layer", "left"),
            ("C", "right"),
            ("values/ch", "right"),
            ("mean shift", "right"),
            ("max shift", "right"),
            ("var log-ratio", "right"),
        )
        for col, justify in columns:
            table.add_column(col, justify=justify, overflow="fold")
        for c in report.layers:
            table.add_row(
                _cell(c.name),
                str(c.channels),
                str(c.values),
                _arrow(c.before.mean_shift, c.after.mean_shift),
                _arrow(c.before.max_mean_shift, c.after.max_mean_shift),
                _arrow(c.before.var_log_ratio, c.after.var_log_ratio),
            )
        console.print(_fit(table, console.width))
        console.print()
    if report.skipped:
        console.print(
            _cell(
                f"{plural(len(report.skipped), 'layer')} kept {'its' if len(report.skipped) == 1 else 'their'} statistics:",
                style="bold",
            )
        )
        for s in report.skipped:
            console.print(_indented(f"{s.name}: {s.reason}", style="dim"))
        console.print()

    before, after = report.eval_before, report.eval_after
    if before is not None and after is not None:
        console.print(_cell(f"held-out data: {after.data}", style="dim"))
        table = _bordered("gap on the held-out data: old -> new checkpoint")
        table.add_column("", justify="left")
        table.add_column("old", justify="right")
        table.add_column("95% CI (Wilson)", justify="right")
        table.add_column("new", justify="right")
        table.add_column("95% CI (Wilson)", justify="right")
        table.add_row(
            "eval-mode accuracy",
            _percent(before.eval_accuracy),
            _span(before.eval_interval),
            _percent(after.eval_accuracy),
            _span(after.eval_interval),
        )
        table.add_row(
            "train-mode accuracy",
            _percent(before.train_accuracy),
            _span(before.train_interval),
            _percent(after.train_accuracy),
            _span(after.train_interval),
        )
        table.add_row(
            "gap (points)",
            "-" if before.gap is None else f"{before.gap * 100:+.1f}",
            _span(before.gap_interval, signed=True),
            "-" if after.gap is None else f"{after.gap * 100:+.1f}",
            _span(after.gap_interval, signed=True),
        )
        table.add_row("agreement", _percent(before.agreement), "", _percent(after.agreement), "")
        kind = "KL(eval || train)" if after.divergence_kind == "kl" else "relative L2"
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
        console.print(_fit(table, console.width))
        console.print()
    console.print(_cell(f"wrote {report.output}: {plural(len(report.layers), 'layer')} recalibrated", style="green"))


def _delta(x: float | None, identical: bool) -> str:
    """A change for the diff table: "=" when bit-identical, "-" when not comparable."""
    if identical:
        return "="
    return _g(x)


def _batches_delta(d: Any) -> str:
    change = d.batches_change
    if change is None:
        return "-"
    return f"{change:+d}"


def render_diff(report: Any, console: Any, quiet: bool = False) -> None:
    """Rich rendering of a DiffReport: both sides, one row per layer that changed
    (unchanged layers folded into one line), one-side-only and reshaped layers, the
    findings, a summary by verdict with its layer groups, and the diagnosis."""
    from rich.text import Text

    for label, side in (("A", report.a), ("B", report.b)):
        title = _cell(f"{label}: {side.path}", style="bold")
        where = f"{side.format}" + (f", key '{side.key}'" if side.key else "")
        if side.prefix:
            where += f", prefix '{side.prefix}' stripped"
        where += f", {plural(side.layers, 'BN layer')}"
        title.append(printable(f"  ({where})"), style="dim")
        console.print(title)
    if report.settings:
        console.print(_indented(f"{report.settings}", style="dim"))
    if report.provenance:
        console.print(_indented(f"B: statistics written by {report.provenance}", style="dim"))
    if report.export is not None:
        _export_header(report.export, console)
    console.print()
    verdict_style = {
        "differs from checkpoint": "red",
        "frozen but updating": "yellow",
        "stale statistics": "yellow",
        "re-estimated": "cyan",
        "trained": "",
        "unchanged": "dim",
    }
    changed = [d for d in report.layers if d.verdict != "unchanged"]
    unchanged = [d.name for d in report.layers if d.verdict == "unchanged"]
    if changed and not quiet:
        table = _bordered()
        table.add_column("layer", overflow="fold", min_width=min(24, max(len(d.name) for d in changed)))
        for header in ("C", "Δweight", "Δbias", "mean shift", "var log-ratio", "Δbatches"):
            table.add_column(header, justify="right")  # headers wrap at spaces, numbers have none
        table.add_column("verdict")
        for d in changed:
            table.add_row(
                _cell(d.name),
                str(d.num_features),
                _delta(d.weight_change, d.weight_identical),
                _delta(d.bias_change, d.bias_identical),
                _delta(d.mean_shift, d.mean_identical and d.var_identical),
                _delta(d.var_log_ratio, d.var_identical),
                _batches_delta(d),
                Text(d.verdict, style=verdict_style[d.verdict]),
            )
        console.print(_fit(table, console.width))
    every = [d.name for d in report.layers]
    if unchanged and not quiet:
        from bnaudit.audit.layerdiff import describe_group

        console.print(
            _cell(
                f"{plural(len(unchanged), 'unchanged layer')} "
                f"({'equal to the checkpoint' if report.export else 'bit-identical'}): {describe_group(unchanged, every)}",
                style="dim",
            )
        )
    if report.export is not None and not quiet:
        _export_body(report.export, console)
    if not quiet:
        if report.reshaped:
            for name, ca, cb in report.reshaped:
                console.print(_cell(f"channel count changed: {name} ({ca} -> {cb})", style="yellow"))
        for side, names in (("A", report.only_a), ("B", report.only_b)):
            if names:
                shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
                console.print(_cell(f"only in {side}: {plural(len(names), 'layer')}: {shown}", style="dim"))
        console.print()
        if report.findings:
            console.print(_fit(_findings_table(report.findings), console.width))
            console.print()
        by = report.layers_by_verdict()
        groups = report.groups()
        if report.layers:
            console.print(Text("summary by verdict", style="bold"))
        for verdict, names in by.items():
            if names:
                console.print(
                    _indented(
                        f"{verdict}: {plural(len(names), 'layer')}, {groups[verdict]}", style=verdict_style[verdict]
                    )
                )
        if report.layers:
            console.print()
        _diagnosis(console, report.diagnosis())
        console.print()
    errors = [f for f in report.findings if f.severity == "error"]
    if quiet and errors:  # -q: a CI log still shows what failed
        console.print(_fit(_findings_table(errors), console.width))
    s = report.summary()
    folded = f", {plural(s['folded'], 'folded layer')}" if "folded" in s else ""
    line = (
        f"{plural(s['matched'], 'matched BN layer')}{folded}: {plural(s['errors'], 'error')}, "
        f"{plural(s['warnings'], 'warning')}, {plural(s['infos'], 'info')}"
    )
    worst = "error" if s["errors"] else "warning" if s["warnings"] else "ok"
    console.print(Text(line, style=SEVERITY_STYLE[worst]), soft_wrap=True)


def _export_header(check: Any, console: Any) -> None:
    """How a checkpoint was matched with its export, under the two sides' lines."""
    side = check.export_side.upper()
    facts = [f"{side} is an ONNX export" + (f" by {check.producer}" if check.producer else "")]
    if check.opset is not None:
        facts.append(f"opset {check.opset}")
    if check.matching:
        facts.append(f"BatchNormalization nodes matched by {check.matching}")
    if check.pairing:
        facts.append(f"folded layers paired by {check.pairing}")
    console.print(_indented("; ".join(facts), style="dim"))


def _export_body(check: Any, console: Any) -> None:
    """The folded layers (one row each), the unpaired ones and the output comparison."""
    from rich.text import Text

    if check.folded:
        table = _bordered()
        table.add_column("folded layer", overflow="fold", min_width=min(24, max(len(f.name) for f in check.folded)))
        table.add_column("into", overflow="fold")
        for header in ("C", "scale err", "shift err", "implied eps"):
            table.add_column(header, justify="right")
        table.add_column("status")
        for f in check.folded:
            c = f.check
            table.add_row(
                _cell(f.name),
                _cell(f.node),
                str(c.channels),
                _g(c.scale_error),
                _g(c.shift_error),
                "-" if c.implied_eps is None else f"{c.implied_eps:.2g}",
                Text("matches", style="green") if c.matches else Text("MISMATCH", style="red"),
            )
        console.print(_fit(table, console.width))
    p = check.parity
    if p is not None:
        style = "red" if p.deviates else "green"
        fixed = f", fixed batch size {p.batch_size} ({p.padded} padding samples)" if p.batch_size else ""
        console.print(
            _cell(
                f"outputs (torch eval vs onnxruntime CPU) on {plural(p.samples, 'sample')}{fixed}: argmax agreement "
                f"{p.agreement * 100:.1f}%, largest relative deviation {above_floor(p.max_deviation, p.floor, '.3g')} (float32 floor {_g(p.floor)})",
                style=style,
            )
        )


def _findings_and_diagnosis(console: Any, findings: list[Finding], diagnosis: list[str]) -> None:
    """The end of a measurement's report (gap, invariance): the checkpoint's inspect
    findings, then the diagnosis."""
    if findings:
        console.print(_fit(_findings_table(findings, "inspect findings for this checkpoint"), console.width))
        console.print()
    _diagnosis(console, diagnosis)


def _diagnosis(console: Any, lines: list[str]) -> None:
    from rich.table import Table
    from rich.text import Text

    console.print(Text("diagnosis", style="bold"))
    # A grid keeps wrapped lines indented under their bullet.
    bullets = Table.grid(padding=(0, 1))
    bullets.add_column(width=3, justify="right")
    bullets.add_column()
    for line in lines:
        bullets.add_row("-", _cell(line))
    console.print(bullets)

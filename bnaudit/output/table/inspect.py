"""The inspect table: a layer table per file (as wide as the console allows), a files
table for several files, the findings, the summary line."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from bnaudit.audit.checkpoint.report import FileReport, InspectReport, LayerSummary
from bnaudit.output.fit import concise_lines, summary_line
from bnaudit.output.names import shorten_names
from bnaudit.output.table.common import (
    NAME_MIN,
    SEVERITY_STYLE,
    bordered,
    cell,
    fit_width,
    g3,
    indented,
    prefix_note,
    print_findings,
    source_words,
)
from bnaudit.text import printable

if TYPE_CHECKING:
    from rich.console import Console

_Column = tuple[str, Callable[[LayerSummary], str]]  # header, cell of a layer

_C: _Column = ("C", lambda s: str(s.num_features))
_BATCHES: _Column = ("batches", lambda s: "-" if s.num_batches_tracked is None else str(s.num_batches_tracked))
_MEAN: _Column = ("mean range", lambda s: f"[{g3(s.mean_min)}, {g3(s.mean_max)}]")
_VAR: _Column = ("var min / med / max", lambda s: f"{g3(s.var_min)} / {g3(s.var_median)} / {g3(s.var_max)}")
_VAR_MIN: _Column = ("var min", lambda s: g3(s.var_min))
_NEAR: _Column = ("near-eps", lambda s: str(s.near_eps_channels))
_GAIN: _Column = ("max gain", lambda s: g3(s.max_eval_gain))
# Widest first; each next one leaves out the least telling of what is left: the mean
# range, then the counter and the median / max of the variance (near-eps and the gain
# already say what a small variance does).
# A layout that drops a column the findings cite (`_CITED`) comes after those that keep it:
# the counter BN003 speaks of stays beside it, near-eps beside BN004's channels.
_LAYOUTS: tuple[tuple[tuple[_Column, ...], tuple[str, ...]], ...] = (
    ((_C, _BATCHES, _MEAN, _VAR, _NEAR, _GAIN), ()),
    ((_C, _BATCHES, _VAR, _NEAR, _GAIN), ("mean range",)),
    ((_C, _BATCHES, _VAR_MIN, _NEAR, _GAIN), ("mean range", "var median / max")),
    ((_C, _VAR_MIN, _NEAR, _GAIN), ("mean range", "batches", "var median / max")),  # the narrowest
    ((_C, _BATCHES, _VAR_MIN, _GAIN), ("mean range", "var median / max", "near-eps")),
)
# The columns whose numbers a finding of each code cites.
_CITED = {
    "BN003": "batches",
    "BN009": "batches",
    "BN010": "batches",
    "BN004": "near-eps",
}


def _cited(files: list[FileReport]) -> set[str]:
    """The columns the findings of `files` cite (`_CITED`)."""
    return {_CITED[f.code] for file in files for f in file.findings if f.code in _CITED}


def _layer_layout(files: list[FileReport], width: int) -> tuple[tuple[_Column, ...], tuple[str, ...]]:
    """The layout whose layer table fits `width` for every file of the run (one choice for
    all, so the tables of a run line up and drop the same columns), and the columns it
    leaves out: of those that fit, the one dropping fewest of the columns the findings cite,
    then the widest; where none fits, the narrowest (names are then shortened further)."""
    cited = _cited(files)
    ranked = sorted(_LAYOUTS, key=lambda layout: len(cited & set(layout[1])))  # stable: widest first
    for columns, dropped in ranked:
        needed = 0
        for file in files:
            statuses = [file.layer_status(s.name) for s in file.layers]
            cells = [[cell(s) for s in file.layers] for _, cell in columns]
            rest = max(6, *map(len, statuses)) + 3 * (len(columns) + 1)
            rest += sum(max(len(header), *map(len, col)) for (header, _), col in zip(columns, cells))
            names = [printable(s.name) for s in file.layers]
            longest = max(map(len, names))
            # a column leaving less than NAME_MIN to the names goes, before names are cut further
            room = width - rest
            name = min(longest, NAME_MIN) if room < min(longest, NAME_MIN) else _name_width(names, room)
            needed = max(needed, rest + name)
        if needed <= width:
            return columns, dropped
    return _LAYOUTS[3]


def _name_width(names: list[str], room: int) -> int:
    return max(len(v) for v in shorten_names(names, max(room, len("layer"))).values())


def _layer_table(file: FileReport, console: Console, columns: tuple[_Column, ...] | None = None) -> Any:
    """One row per layer with `columns` (default: the widest that fit); numbers are never
    folded across lines, and a name too long for what is left is shortened in the middle."""
    if columns is None:
        columns = _layer_layout([file], console.width)[0]
    headers = ["layer", *(header for header, _ in columns), "status"]
    statuses = {s.name: file.layer_status(s.name) for s in file.layers}
    rows = [[printable(s.name), *(printable(cell(s)) for _, cell in columns), statuses[s.name]] for s in file.layers]
    rest = sum(max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers) if i) + 3 * (len(headers) - 1)
    room = max(console.width - rest, NAME_MIN // 2, len(headers[0]))
    shown = shorten_names([row[0] for row in rows], room)
    for row in rows:
        row[0] = shown[row[0]]
    longest = max(len(row[0]) for row in rows)  # names whole: never folded
    from rich.text import Text

    table = bordered()
    table.add_column("layer", no_wrap=True, min_width=longest)
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
    return g3(max(gains)) if gains else "-"


_FILE_STYLE = {**SEVERITY_STYLE, "unreadable": "bold red", "excluded": "dim", "skipped": "dim"}


def _files_table(files: list[FileReport], console: Console) -> Any:
    """One line per file: path, format, BN layers, worst eval gain, status."""
    from rich.text import Text

    rows = [
        [
            printable(f.shown),
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
    shown = shorten_names([row[0] for row in rows], room, separators="/")
    for row in rows:
        row[0] = shown[row[0]]
    table = bordered()
    for i, header in enumerate(headers):
        table.add_column(header, justify="right" if i in (2, 3) else "left", no_wrap=True)
    for row in rows:
        table.add_row(Text(row[0]), Text(row[1]), row[2], row[3], Text(row[4], style=_FILE_STYLE[row[4]]))
    return table


def _file_detail(file: FileReport, console: Console, columns: tuple[_Column, ...]) -> None:
    """A file's title, its notes, its layer table and its findings."""
    from rich.text import Text

    title = cell(file.shown, style="bold")
    title.append(printable(f"  ({source_words(file.format, file.key, file.prefix)})"), style="dim")
    console.print(title)
    bare = prefix_note(file.prefix, [s.name for s in file.layers])
    if bare:
        console.print(indented(bare, style="dim"))
    if file.other_keys:
        console.print(indented(f"other state dicts: {', '.join(file.other_keys)} (choose with --key)", style="dim"))
    if file.settings:
        console.print(indented(f"{file.settings}", style="dim"))
    if file.provenance:
        console.print(indented(f"{file.provenance}", style="dim"))
    if file.averaging is not None:
        console.print(indented(file.averaging.describe(), style="dim"))
    for note in [*file.notes, *file.not_loaded]:
        console.print(indented(f"{note}", style="dim"))
    if file.layers:
        console.print(fit_width(_layer_table(file, console, columns), console.width))
    elif any(f.code == "BN014" and "a quantized graph" in f.message for f in file.findings):
        console.print(Text("  no BatchNorm layers found: a quantized graph (BN014)", style="dim"))
    elif any(f.code == "BN014" for f in file.findings):
        console.print(Text("  no BatchNorm layers found: folded into convolutions (BN014)", style="dim"))
    else:
        console.print(Text("  no BatchNorm layers found", style="dim"))
    if file.findings:
        print_findings(console, file.findings, context=[s.name for s in file.layers])
    console.print()


def render_inspect(report: InspectReport, console: Console, quiet: bool = False, all_layers: bool = False) -> None:
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
            console.print(cell(line), soft_wrap=True)
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
        console.print(fit_width(_files_table(report.files, console), console.width))
        console.print()
    for file in report.files:
        if file.error:
            continue  # said once, on stderr (output.emit_diagnostics)
        if file.excluded:
            console.print(cell(f"{file.shown}: {file.excluded}", style="dim"), soft_wrap=True)
        elif file.skipped:
            console.print(cell(file.skipped_line(), style="dim"), soft_wrap=True)
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

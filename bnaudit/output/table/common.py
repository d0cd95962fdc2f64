"""What every table renderer shares: the one table style, fitting a table to the width,
cells that show untrusted text as is, number formats, the findings table and the diagnosis.

Every string that came from a file, a model or the data (paths, layer and module names,
model descriptions, messages that quote them) goes through `printable` where it is drawn
(`cell`), so that an escape sequence in a layer name is shown, not obeyed. Numbers and
the fixed words of the tables are ours.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal

from bnaudit.audit.rules import Finding
from bnaudit.output.fit import FindingRow, collapse, shorten_middle
from bnaudit.output.grid import SEVERITY_STYLE
from bnaudit.text import printable

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

NAME_MIN = 24  # the layer column gets at least this much before columns are dropped

Justify = Literal["left", "right"]


def bordered(title: str | None = None) -> Table:
    """The one table style of bnaudit's reports: header rule and column lines, no outer
    edge, a bold header and a bold left-aligned title."""
    from rich.table import Table

    return Table(
        title=title, title_justify="left", title_style="bold", show_edge=False, pad_edge=False, header_style="bold"
    )


def fit_width(table: Any, width: int) -> Any:
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


def cell(text: str, style: str = "") -> Any:
    """A table cell that shows `text` as is: plain strings would be parsed as rich markup."""
    from rich.text import Text

    return Text(printable(text), style=style)


def indented(text: str, style: str = "dim") -> Any:
    """A note under a title: two spaces in, and its wrapped lines keep them."""
    from rich.padding import Padding

    return Padding(cell(text, style=style), (0, 0, 0, 2), expand=False)


def g3(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.3g}" if math.isfinite(x) else str(x)


def percent(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.1f}%"


def drift_value(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}" if abs(x) < 10 else f"{x:.1f}"


def span(pair: tuple[float, float] | None, signed: bool = False) -> str:
    """A 95% interval in percent (points when `signed`)."""
    if pair is None:
        return "-"
    if signed:
        return f"{pair[0] * 100:+.1f} to {pair[1] * 100:+.1f}"
    return f"{pair[0] * 100:.1f}-{pair[1] * 100:.1f}%"


def findings_table(findings: list[Finding], title: str | None = None) -> Any:
    """Findings, identical ones on several layers as one row (`fit.collapse`): words are
    wrapped whole, codes and severities never, long layer names shortened in the middle."""

    table = bordered(title)
    table.add_column("code", no_wrap=True)
    table.add_column("severity", no_wrap=True)
    table.add_column("layer", max_width=NAME_MIN + 4)
    table.add_column("message", overflow="fold")  # fold: only a word longer than the column
    for row in collapse(findings):
        shortened = FindingRow(
            row.code, row.name, row.severity, tuple(shorten_middle(n, NAME_MIN) for n in row.layers), row.message
        )
        table.add_row(
            cell(f"{row.code} {row.name}"),
            cell(row.severity, style=SEVERITY_STYLE[row.severity]),
            cell(shortened.where()),
            cell(row.message),
        )
    return table


def source_words(what: str | None, key: str | None, prefix: str | None) -> str:
    """Where a command's input came from, said the same way by every command:
    "torch-zip, key 'state_dict_ema', prefix 'module.' stripped" (`what`: the format, or
    the model that ran it)."""
    parts = [what] if what else []
    if key:
        parts.append(f"key '{key}'")
    if prefix:
        parts.append(f"prefix '{prefix}' stripped")
    return ", ".join(parts)


def measurement_header(
    console: Console,
    checkpoint: str,
    model: str,
    data: str,
    notes: list[str],
    key: str | None = None,
    prefix: str | None = None,
) -> None:
    """The first lines of a measurement's report (gap, invariance): the checkpoint, the
    model that ran it and the state dict measured (`key`, `prefix`: `source_words`), the
    data, and what the reader noted about the data."""
    title = cell(checkpoint, style="bold")
    title.append(printable(f"  ({source_words(model, key, prefix)})"), style="dim")
    console.print(title)
    console.print(cell(f"data: {data}", style="dim"))
    for note in notes:
        console.print(cell(f"note: {note}", style="dim"))


def findings_and_diagnosis(console: Console, findings: list[Finding], lines: list[str]) -> None:
    """The end of a measurement's report (gap, invariance): the checkpoint's inspect
    findings, then the diagnosis."""
    if findings:
        console.print(fit_width(findings_table(findings, "inspect findings for this checkpoint"), console.width))
        console.print()
    diagnosis_bullets(console, lines)


def diagnosis_bullets(console: Console, lines: list[str]) -> None:
    """The "diagnosis" heading and one bullet per line, wrapped lines indented under it."""
    from rich.table import Table
    from rich.text import Text

    console.print(Text("diagnosis", style="bold"))
    # A grid keeps wrapped lines indented under their bullet.
    bullets = Table.grid(padding=(0, 1))
    bullets.add_column(width=3, justify="right")
    bullets.add_column()
    for line in lines:
        bullets.add_row("-", cell(line))
    console.print(bullets)

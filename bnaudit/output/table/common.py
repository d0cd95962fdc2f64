"""What every table renderer shares: the one table style, fitting a table to the width,
cells that show untrusted text as is, number formats, the findings table and the diagnosis.

Every string that came from a file, a model or the data (paths, layer and module names,
model descriptions, messages that quote them) goes through `printable` where it is drawn
(`cell`), so that an escape sequence in a layer name is shown, not obeyed. Numbers and
the fixed words of the tables are ours.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from bnaudit.audit.rules import Finding
from bnaudit.output.fit import FindingRow, collapse, shorten_middle
from bnaudit.output.names import shorten_names
from bnaudit.text import plural, printable

# The style of a status or severity word in every table.
SEVERITY_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan", "ok": "green"}

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
    if getattr(table, "box", None) is None:  # a bullet grid or plain text: nothing to fit
        return table
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


@dataclass(frozen=True)
class Column:
    """A column of a table that `fitted_table` lays out.

    `drop`: 0 never dropped; else dropped to fit the width, lowest first (least telling).
    `name`: cells are names from the file (strings), shortened at segment boundaries
    (`bnaudit.output.names`) and never wrapped. `wrap`: prose that wraps at its spaces
    (a header always may); other cells are never wrapped."""

    header: str
    justify: Justify = "left"
    drop: int = 0
    name: bool = False
    wrap: bool = False
    max_width: int | None = None


@dataclass(frozen=True)
class Row:
    """One row of a table: its cells, and the style of the whole row."""

    cells: tuple[Any, ...]  # str or rich Text; a name column's cells are str
    style: str = ""


NAME_FLOOR = 12  # a name column is not shortened below this while other columns can go
MESSAGE_MIN = 30  # the message column of a findings table gets at least this much


def _least(text: Any, wrap: bool) -> int:
    """The narrowest a cell can be drawn: its longest line, or its longest word if it wraps."""
    from rich.cells import cell_len

    plain = text.plain if hasattr(text, "plain") else str(text)
    pieces = plain.split() if wrap else plain.splitlines()
    return max(map(cell_len, pieces), default=0)


def fitted_table(
    columns: Sequence[Column],
    rows: Sequence[Row],
    width: int,
    title: str | None = None,
    context: Sequence[str] = (),
) -> tuple[Any, list[str]]:
    """The table drawn within `width` columns without breaking a name or a word, and the
    headers of the columns it dropped to get there.

    The one rule of every table: a name column gets min(its longest name, NAME_MIN)
    characters; where the other columns leave less, the columns with the lowest `drop`
    go first; then names are shortened at segment boundaries so that different names
    stay different (never below what keeps them unique; never folded), words wrap at
    spaces only (`fit_width`). What was dropped is said under the table (`dropped_note`).
    `context`: the model's layer names where the rows show some of them (a shortened name
    then stands for no other layer of the model either).
    """
    names = [i for i, c in enumerate(columns) if c.name]
    kept = list(range(len(columns)))

    cells = {i: max([_least(r.cells[i], columns[i].wrap) for r in rows] or [0]) for i in kept}
    fixed = {i: max(_least(columns[i].header, True), cells[i]) for i in kept if i not in names}
    longest = {i: max([len(printable(r.cells[i])) for r in rows] or [0]) for i in names}
    shown: dict[int, dict[str, str]] = {}
    while True:
        others = sum(fixed[i] for i in kept if i not in names) + 3 * (len(kept) - 1)
        room = (width - others) // max(len(names), 1)
        droppable = [i for i in kept if columns[i].drop]
        if droppable and any(room < min(longest[i], NAME_MIN) for i in names):
            kept.remove(min(droppable, key=lambda i: columns[i].drop))
            continue
        shown = {
            i: shorten_names(
                [printable(r.cells[i]) for r in rows],
                max(room, NAME_FLOOR, len(columns[i].header)),
                context=[printable(n) for n in context],
            )
            for i in names
        }
        need = others + sum(max([len(v) for v in shown[i].values()] or [0]) for i in names)
        if need <= width or not droppable:
            break
        kept.remove(min(droppable, key=lambda i: columns[i].drop))
    table = bordered(title)
    for i in kept:
        c = columns[i]
        if c.name:
            wide = max([len(columns[i].header), *(len(v) for v in shown[i].values())])
            table.add_column(c.header, justify=c.justify, no_wrap=True, min_width=wide)
        else:
            # headers wrap at their spaces; cells only where `wrap`, else min_width keeps them whole
            table.add_column(
                c.header,
                justify=c.justify,
                min_width=None if c.wrap else cells[i],
                max_width=c.max_width,
                overflow="fold",
            )
    for r in rows:
        drawn = [cell(shown[i][printable(r.cells[i])]) if i in names else _as_cell(r.cells[i]) for i in kept]
        table.add_row(*drawn, style=r.style)
    return fit_width(table, width), [columns[i].header for i in range(len(columns)) if i not in kept]


def _as_cell(value: Any) -> Any:
    return cell(value) if isinstance(value, str) else value


def prefix_note(prefix: str | None, names: Sequence[str]) -> str | None:
    """Where bare layer names came from, said once: after a wrapper prefix is stripped,
    a name such as "1" (an nn.Sequential's child) says little, and grep finds
    "model.1.running_mean", not "1". None where no name starts with an index."""
    bare = next((n for n in names if n.split(".", 1)[0].isdigit()), None)
    if not prefix or bare is None:
        return None
    return f"layer names without the prefix '{prefix}': layer {bare} is '{prefix}{bare}' in the file"


def dropped_note(dropped: Sequence[str], width: int) -> Any:
    """The dim line under a table that had to leave columns out."""
    from rich.text import Text

    return Text(f"dropped to fit {width} columns: {', '.join(dropped)}", style="dim")


def print_fitted(
    console: Console,
    columns: Sequence[Column],
    rows: Sequence[Row],
    title: str | None = None,
    context: Sequence[str] = (),
) -> list[str]:
    """`fitted_table` at the console's width, printed, with the dropped-columns note."""
    table, dropped = fitted_table(columns, rows, console.width, title, context)
    console.print(table)
    if dropped:
        console.print(dropped_note(dropped, console.width))
    return dropped


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


_FINDING_COLUMNS = (
    Column("code", wrap=True),  # "BN109 eps-mismatch" may wrap at its space
    Column("severity"),  # never dropped: it decides the exit code (the rule's name goes first)
    Column("layer", wrap=True, max_width=NAME_MIN + 4),  # names shortened before (a row may list several)
    Column("message", wrap=True),
)
# Said under a findings table whose rule names were left out to keep the severity.
RULE_NAMES = "rule names (bnaudit rules CODE)"


def batches_text(samples: int, batches: int, size: int, skipped: int | None) -> str:
    """ "100 samples in 2 batches of 64, the last of 36": the plan of runtime/batching.py,
    consecutive batches of `size` whose last holds what is left (a last batch of one sample
    joins the one before it, so it may hold size + 1). With unreadable samples skipped, or
    an unknown number skipped (None), the batches need not cut evenly: only their number
    and size are said."""
    if batches == 1:
        return f"{plural(samples, 'sample')} in 1 batch"
    text = f"{plural(samples, 'sample')} in {plural(batches, 'batch', 'batches')} of {size}"
    last = samples - (batches - 1) * size
    if skipped is None or skipped or not 1 <= last <= size + 1 or last == size:
        return text
    return f"{text}, the last of {last}"


def findings_table(
    findings: list[Finding], width: int, title: str | None = None, context: Sequence[str] = ()
) -> tuple[Any, list[str]]:
    """Findings, identical ones on several layers as one row (`fit.collapse`): words are
    wrapped whole, codes and severities never; layer names shortened at segment
    boundaries, all the table's names together so that different layers stay different
    (`bnaudit.output.names`), as far as the other columns leave room. The severity column
    always stays (it decides the exit code): where code, severity, a layer name and a
    message of MESSAGE_MIN cannot share `width`, the rule names are left out first (the
    code names the rule). The table and the columns dropped to fit `width`; `context` as
    for `fitted_table`."""
    rows = collapse(findings)
    every = [printable(n) for row in rows for n in row.layers]
    code = max((len(w) for row in rows for w in f"{row.code} {row.name}".split()), default=0)
    message = max((len(w) for row in rows for w in printable(row.message).split()), default=0)
    severity = max([len("severity"), *(len(r.severity) for r in rows)])
    layer_least = min(max((len(w) for n in every for w in n.split()), default=1), NAME_FLOOR)
    named = code + severity + layer_least + min(message, MESSAGE_MIN) + 3 * 3 <= width
    if not named:
        code = max((len(r.code) for r in rows), default=0)
    room = max(width - code - severity - min(message, MESSAGE_MIN) - 3 * 3, NAME_FLOOR)
    shown = shorten_names(every, min(room, NAME_MIN), context=[printable(n) for n in context]) if every else {}
    wheres = [
        FindingRow(r.code, r.name, r.severity, tuple(shown[printable(n)] for n in r.layers), r.message).where()
        for r in rows
    ]
    layer = max((len(w) for where in wheres for w in where.split()), default=0)
    # drawn whole: narrower than the message
    code = max((len(f"{r.code} {r.name}" if named else r.code) for r in rows), default=0)
    # a name quoted in a message (an ONNX node's path) longer than the message column can
    # be: shortened there at segment boundaries like any name; JSON and -q keep it whole
    words = max(width - code - severity - layer - 3 * 3, MESSAGE_MIN)
    table_rows = [
        Row(
            (
                cell(f"{r.code} {r.name}" if named else r.code),
                cell(r.severity, style=SEVERITY_STYLE[r.severity]),
                cell(where),
                cell(_fit_words(printable(r.message), words)),
            )
        )
        for r, where in zip(rows, wheres)
    ]
    table, dropped = fitted_table(_FINDING_COLUMNS, table_rows, width, title)
    return table, dropped if named else [RULE_NAMES, *dropped]


def _fit_words(text: str, width: int) -> str:
    """`text` with each word longer than `width` shortened at its segment boundaries
    (quotes and trailing punctuation kept around it)."""
    out = []
    for word in text.split(" "):
        if len(word) > width:
            core = word.strip("'\"(),:;")
            at = word.index(core) if core else 0
            short = shorten_middle(core, max(width - (len(word) - len(core)), 1))
            word = word[:at] + short + word[at + len(core) :]
        out.append(word)
    return " ".join(out)


def print_findings(
    console: Console, findings: list[Finding], title: str | None = None, context: Sequence[str] = ()
) -> None:
    """The findings table at the console's width, with the dropped-columns note."""
    table, dropped = findings_table(findings, console.width, title, context)
    console.print(table)
    if dropped:
        console.print(dropped_note(dropped, console.width))


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


def findings_and_diagnosis(
    console: Console, findings: list[Finding], lines: list[str], context: Sequence[str] = (), quiet: bool = False
) -> None:
    """The end of a measurement's report (gap, invariance): the checkpoint's inspect
    findings, then the diagnosis; `quiet`: one line per finding (`layer: CODE name:
    message`), as every command's -q."""
    if findings and quiet:
        for f in findings:
            where = f"{f.layer}: " if f.layer is not None else ""
            console.print(cell(f"{where}{f.code} {f.name}: {f.message}"), soft_wrap=True)
        console.print()
    elif findings:
        print_findings(console, findings, "inspect findings for this checkpoint", context)
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

"""The inspect layer and files tables laid out by hand, as rich.Table would draw them (see `layout_grid`)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

SEVERITY_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan", "ok": "green"}


def layout_grid(
    headers: list[str],
    rows: list[list[str]],
    console: Any,
    min_first: int,
    right: Collection[int] | None = None,
    styles: Mapping[str, str] = SEVERITY_STYLE,
) -> Any:
    """The table exactly as the rich.Table of `table.inspect` draws it, as one Text.

    rich measures and renders every cell on its own, about 70 us a cell: 38 ms for
    ResNet-50's 53 rows, half of what a pre-commit run may take, and as much for the
    files table of a 50-file folder. Both tables are a fixed grid (the first column
    never folded, every cell on one line, a status last), so they are laid out here;
    tests/test_report.py compares both, styles included. `right`: the columns whose
    cells are right-justified (default: all but the first and the last); `styles`: the
    style of a status cell by its word. None where rich would have to shrink more than
    the first column (a very narrow terminal) or a name is wider than the first column
    leaves (names are shortened, never folded).
    """
    from rich.cells import cell_len
    from rich.text import Text

    widths = [max(cell_len(header), *(cell_len(row[i]) for row in rows)) for i, header in enumerate(headers)]
    rest = sum(widths[1:]) + 3 * (len(headers) - 1)
    first = min(widths[0], console.width - rest)
    if first < max(min_first, cell_len(headers[0])):
        return None
    widths[0] = first
    last = len(widths) - 1
    justified = range(1, last) if right is None else right
    flush = [i in justified for i in range(len(widths))]
    out = Text()

    # Segment for segment what rich emits: a header cell and the spaces beside its bars
    # carry the header style, a body cell its own (status) style, the bars none.
    def line(cells: list[str], bar: str, pad_style: str, cell_styles: list[str]) -> None:
        if len(out):
            out.append("\n")
        for i, (cell, width, style) in enumerate(zip(cells, widths, cell_styles)):
            if i:
                out.append(" ", pad_style)
                out.append(bar)
                out.append(" ", pad_style)
            pad = " " * (width - cell_len(cell))
            out.append(pad + cell if flush[i] else cell + pad, style)

    line(headers, "┃", "bold", ["bold"] * len(headers))
    out.append("\n" + "╇".join("━" * (w + (1 if i in (0, last) else 2)) for i, w in enumerate(widths)))
    plain = [""] * last
    for row in rows:
        if cell_len(row[0]) > first:  # a name is never folded (bnaudit.output.names shortens it)
            return None
        line(row, "│", "", [*plain, styles[row[-1]]])
    return out

"""The inspect layer table laid out by hand, as rich.Table would draw it (see `layout_grid`)."""

from __future__ import annotations

from typing import Any

SEVERITY_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan", "ok": "green"}


def layout_grid(headers: list[str], rows: list[list[str]], console: Any, min_first: int) -> Any:
    """The layer table exactly as the rich.Table of `table.py`'s layer table draws it, as one Text.

    rich measures and renders every cell on its own, about 70 us a cell: 38 ms for
    ResNet-50's 53 rows, half of what a pre-commit run may take. The layer table is
    a fixed grid (first column folded, numbers right-justified, status last), so it
    is laid out here; tests/test_report.py compares both, styles included. None where
    rich would have to shrink more than the first column (a very narrow terminal) or a
    name is wider than the first column leaves (names are shortened, never folded).
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
    out = Text()

    # Segment for segment what rich emits: a header cell and the spaces beside its bars
    # carry the header style, a body cell its own (status) style, the bars none.
    def line(cells: list[str], bar: str, pad_style: str, styles: list[str]) -> None:
        if len(out):
            out.append("\n")
        for i, (cell, width, style) in enumerate(zip(cells, widths, styles)):
            if i:
                out.append(" ", pad_style)
                out.append(bar)
                out.append(" ", pad_style)
            pad = " " * (width - cell_len(cell))
            out.append(pad + cell if 0 < i < last else cell + pad, style)

    line(headers, "┃", "bold", ["bold"] * len(headers))
    out.append("\n" + "╇".join("━" * (w + (1 if i in (0, last) else 2)) for i, w in enumerate(widths)))
    plain = [""] * last
    for row in rows:
        if cell_len(row[0]) > first:  # a name is never folded (bnaudit.output.names shortens it)
            return None
        line(row, "│", "", [*plain, SEVERITY_STYLE[row[-1]]])
    return out

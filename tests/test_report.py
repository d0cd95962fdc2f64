"""The layer table's own grid draws what rich.Table draws, byte for byte, colours included.

`report._grid` lays the layer table out itself because rich.Table costs about 70 us a
cell (half the start-up budget on a ResNet-50). The reference here is rich.Table, set up
as `_layer_table` sets it up when the grid declines, rendered by the same console.
"""
from __future__ import annotations

import io
import itertools

import pytest
from rich.console import Console
from rich.table import Table
from rich.text import Text

from bnaudit.output import grid as report

NAMES = [
    "bn", "layer1.0.bn1", "x" * 23, "y" * 24, "z" * 25,
    "encoder.blocks.12.attention.output.norm_layer_with_a_long_name",
    "a name with spaces that wraps at words", "日本語のレイヤー名.bn", "\\x1b[31m (escaped)",
]
STATUSES = ["ok", "error", "warning", "info"]


def rich_table(headers: list[str], rows: list[list[str]], min_first: int) -> Table:
    table = Table(show_edge=False, pad_edge=False, header_style="bold")
    table.add_column(headers[0], overflow="fold", min_width=min_first)
    for header in headers[1:-1]:
        table.add_column(header, justify="right", no_wrap=True)
    table.add_column(headers[-1], no_wrap=True)
    for row in rows:
        table.add_row(*map(Text, row[:-1]), Text(row[-1], style=report.SEVERITY_STYLE[row[-1]]))
    return table


def console(width: int, terminal: bool) -> Console:
    return Console(file=io.StringIO(), width=width, force_terminal=terminal,
                   color_system="truecolor" if terminal else None, highlight=False, markup=False, emoji=False)


def cases():
    headers = ["layer", "C", "var min / med / max", "near-eps", "max gain", "status"]
    for i, (width, terminal) in enumerate(itertools.product((40, 61, 80, 97, 120, 200), (False, True))):
        names = [NAMES[(i + k) % len(NAMES)] for k in range(4)]
        rows = [[name, str(2 ** (k + 3)), f"{0.01 * (k + 1):.3g} / 1 / {k + 2}", str(k), f"{316.2 / (k + 1):.3g}",
                 STATUSES[(i + k) % 4]] for k, name in enumerate(names)]
        yield width, terminal, headers, rows


@pytest.mark.parametrize("width,terminal,headers,rows", list(cases()))
def test_grid_output_equals_rich_tables(width, terminal, headers, rows):
    min_first = min(max(len(r[0]) for r in rows), 24)
    grid = report.layout_grid(headers, rows, console(width, terminal), min_first)
    if grid is None:  # declined: only where rich must shrink more than the layer column
        rest = sum(max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers) if i) + 3 * (len(headers) - 1)
        assert width - rest < max(min_first, len("layer"))
        return
    drawn = {}
    for what, renderable in (("rich", rich_table(headers, rows, min_first)), ("grid", grid)):
        out = console(width, terminal)
        out.print(renderable)
        drawn[what] = out.file.getvalue()
    assert drawn["grid"] == drawn["rich"]


def test_most_cases_take_the_grid_and_names_fold_in_it():
    taken = [report.layout_grid(h, r, console(w, t), min(max(len(x[0]) for x in r), 24)) is not None
             for w, t, h, r in cases()]
    assert sum(taken) >= len(taken) // 2
    rows = [["encoder.blocks.12.attention.output.norm_layer_with_a_long_name", "8", "1", "ok"]]
    grid = report.layout_grid(["layer", "C", "var", "status"], rows, console(45, False), 24)
    assert grid is not None and len(grid.plain.splitlines()) > 3  # the name took several lines

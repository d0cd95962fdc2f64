"""Rich tables for the terminal: one renderer module per report kind (inspect, diff, gap,
invariance, recalibrate), the rules listing, and what they share (`common`).

`render` picks the renderer by the report's type. The record modules are imported only
as far as the check needs: an inspect report is recognised before any measurement's
record module is imported, so `inspect` stays torch-free and quick.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console

    from bnaudit.output import Report


def render(report: Report, console: Console, *, quiet: bool = False, all_layers: bool = False) -> None:
    """Draw `report` on `console`; `quiet` shortens every table, `all_layers` (inspect's
    --layers) gives every file of an inspect report its layer table."""
    from bnaudit.audit.checkpoint.report import InspectReport

    if isinstance(report, InspectReport):
        from bnaudit.output.table.inspect import render_inspect

        render_inspect(report, console, quiet=quiet, all_layers=all_layers)
        return
    from bnaudit.audit.diff.checkpoints import DiffReport

    if isinstance(report, DiffReport):
        from bnaudit.output.table.diff import render_diff

        render_diff(report, console, quiet=quiet)
        return
    from bnaudit.reports.gap import GapReport

    if isinstance(report, GapReport):
        from bnaudit.output.table.gap import render_gap

        render_gap(report, console, quiet=quiet)
        return
    from bnaudit.reports.invariance import InvarianceReport

    if isinstance(report, InvarianceReport):
        from bnaudit.output.table.invariance import render_invariance

        render_invariance(report, console, quiet=quiet)
        return
    from bnaudit.reports.recalibrate import RecalibrationReport

    if isinstance(report, RecalibrationReport):
        from bnaudit.output.table.recalibrate import render_recalibrate

        render_recalibrate(report, console, quiet=quiet)
        return
    from bnaudit.audit.fold.report import FoldReport

    if isinstance(report, FoldReport):
        from bnaudit.output.table.fold import render_fold

        render_fold(report, console, quiet=quiet)
        return
    raise ValueError(f"no 'table' emitter for a {type(report).__name__} report")

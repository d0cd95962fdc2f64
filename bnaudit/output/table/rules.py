"""`bnaudit rules`: the rules listing as a table."""

from __future__ import annotations

from typing import TYPE_CHECKING

from bnaudit.audit.rules import RULES
from bnaudit.output.table.common import bordered, fit_width

if TYPE_CHECKING:
    from rich.console import Console


def render_rules(console: Console, overrides: dict[str, str] | None = None) -> None:
    """`bnaudit rules`: one row per rule, severities as configured."""

    from bnaudit.audit.ruledocs import shown_severity

    rows = [(rule.code, rule.name, shown_severity(rule, overrides), rule.summary) for rule in RULES.values()]
    table = bordered()
    # min_width: rich would otherwise squeeze these to "BN0…" at 80 columns before
    # wrapping the summaries, which wrap at spaces
    for i, header in enumerate(("code", "name")):
        table.add_column(header, no_wrap=True, min_width=max(len(header), *(len(row[i]) for row in rows)))
    table.add_column("severity")  # "error / warning / info" may wrap at its spaces
    table.add_column("fires when", overflow="fold")
    for row in rows:
        table.add_row(*row)
    console.print(fit_width(table, console.width))
    console.print(f"bnaudit rules CODE explains a rule ({len(RULES)} rules).")

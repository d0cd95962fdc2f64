"""The fed table: the global checkpoint and its clients, one row per BN layer with its class,
the worst severity and the codes of its findings and what they mean (the layer table is the findings' table; -q
prints the findings table instead), then the commands of the exact fix."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from bnaudit.output.table.common import (
    SEVERITY_STYLE,
    Column,
    Row,
    cell,
    indented,
    print_findings,
    print_fitted,
)
from bnaudit.severity import Severity
from bnaudit.text import plural

if TYPE_CHECKING:
    from rich.console import Console

    from bnaudit.audit.fed.classify import FedLayer
    from bnaudit.audit.fed.report import FedReport

# A class's style: exact statistics green, wrong ones as a warning, unknown as info.
_STYLE = {
    "pooled": SEVERITY_STYLE["ok"],
    "recalibrated": SEVERITY_STYLE["ok"],
    "averaged": SEVERITY_STYLE["warning"],
    "copied": SEVERITY_STYLE["warning"],
    "initial": SEVERITY_STYLE["warning"],
    "other": SEVERITY_STYLE["info"],
}

_COLUMNS = (
    Column("layer", name=True),
    Column("C", "right", drop=1),
    Column("statistics", "left"),
    Column("severity", "left"),  # never dropped: it decides the exit code
    Column("finding", "left"),
    Column("how", "left", wrap=True),
)


def percent_of(fraction: float | None) -> str:
    """A share in percent with two significant digits (0.012%, 9.6%)."""
    return f"{(fraction or 0.0) * 100:.2g}%"


def _weights(layer: FedLayer) -> str:
    w = layer.weighting
    if w is None:
        return ""
    if w.source == "plain mean":
        return "plain mean"
    return f"weighted by {w.source} (" + ", ".join(f"{x:.3g}" for x in w.weights) + ")"


def _how(layer: FedLayer, clients: tuple[str, ...]) -> str:
    if layer.kind == "copied" and layer.client is not None:
        how = f"client {layer.client + 1}'s, bit for bit ({os.path.basename(clients[layer.client])})"
    elif layer.kind == "averaged":
        how = (
            f"{_weights(layer)}: var lacks the between-client term, up to {percent_of(layer.understated_fraction)} "
            "of the pooled variance"
        )
    elif layer.kind == "pooled":
        how = f"{_weights(layer)}, between-client term included"
    elif layer.kind == "initial":
        how = "0 and 1: never aggregated"
    elif layer.kind == "recalibrated":
        how = "its bnaudit recalibrate/merge record matches"
    else:
        how = layer.reason
    counter = layer.counter
    if counter is not None:
        how += f"; counter {counter.dtype} {counter.value:g}"
    return how


def render_fed(report: FedReport, console: Console, quiet: bool = False) -> None:
    """The report: the files, the layer table (quiet: the findings table), the fix."""
    from rich.text import Text

    title = cell(report.path, style="bold")
    title.append(f"  ({report.format}) against {plural(len(report.clients), 'client')}", style="dim")
    console.print(title)
    for i, client in enumerate(report.clients):
        counts = f"  (counts: {report.statistics[i]})" if report.statistics else ""
        console.print(cell(f"client {i + 1}: {client}{counts}", style="dim"))
    console.print()
    if quiet:
        if report.findings:
            print_findings(console, list(report.findings), context=[layer.name for layer in report.layers])
            console.print()
    else:
        codes: dict[str, list[str]] = {}
        worst: dict[str, Severity] = {}
        for finding in report.findings:
            if finding.layer is not None:
                codes.setdefault(finding.layer, []).append(finding.code)
                worst[finding.layer] = max(worst.get(finding.layer, finding.severity), finding.severity)
        rows = [
            Row(
                (
                    layer.name,
                    str(layer.channels),
                    cell(layer.kind, style=_STYLE[layer.kind]),
                    cell(worst[layer.name], style=SEVERITY_STYLE[worst[layer.name]]) if layer.name in worst else "-",
                    cell(", ".join(codes.get(layer.name, [])) or "-"),
                    cell(_how(layer, report.clients)),
                )
            )
            for layer in report.layers
        ]
        print_fitted(console, _COLUMNS, rows, None)
        console.print()
    summary = report.summary()
    kinds = ", ".join(
        f"{summary[k]} {k}" for k in ("pooled", "recalibrated", "averaged", "copied", "initial", "other") if summary[k]
    )
    findings = f"{summary['errors']} errors, {summary['warnings']} warnings, {summary['infos']} infos"
    console.print(Text(f"{plural(len(report.layers), 'BN layer')}: {kinds}; {findings}", style="bold"))
    if report.fix:
        console.print(Text("fix: the exact statistics of the clients' union, no data moved", style="bold"))
        for line in report.fix:
            console.print(indented(line, style=""))

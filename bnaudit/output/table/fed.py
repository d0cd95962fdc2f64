"""The fed table: the global checkpoint and its clients, one row per BN layer with its class
and what it means, the findings, and the commands of the exact fix."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from bnaudit.output.table.common import SEVERITY_STYLE, Column, Row, cell, g3, print_findings, print_fitted
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
    Column("how", "left", wrap=True),
)


def _weights(layer: FedLayer) -> str:
    w = layer.weighting
    if w is None:
        return ""
    if w.source == "plain mean":
        return "plain mean"
    return f"weighted by {w.source} (" + ", ".join(f"{x:.3g}" for x in w.weights) + ")"


def _how(layer: FedLayer, clients: tuple[str, ...]) -> str:
    if layer.kind == "copied" and layer.client is not None:
        return f"client {layer.client + 1}'s, bit for bit ({os.path.basename(clients[layer.client])})"
    if layer.kind == "averaged":
        return (
            f"{_weights(layer)} of mean and var: var understated by up to {(layer.understated_fraction or 0):.1%} "
            f"(between-client term, mean {g3(layer.understated_mean)})"
        )
    if layer.kind == "pooled":
        return f"{_weights(layer)}, between-client term included"
    if layer.kind == "initial":
        return "0 and 1: never aggregated"
    if layer.kind == "recalibrated":
        return "bnaudit recalibrate/merge record matches"
    return layer.reason


def render_fed(report: FedReport, console: Console, quiet: bool = False) -> None:
    """The report: the files, the layer table (unless quiet), the findings, the fix."""
    from rich.text import Text

    title = cell(report.path, style="bold")
    title.append(f"  ({report.format}), {plural(len(report.clients), 'client')}", style="dim")
    console.print(title)
    for i, client in enumerate(report.clients):
        counts = f"  (counts: {report.statistics[i]})" if report.statistics else ""
        console.print(cell(f"client {i + 1}: {client}{counts}", style="dim"))
    console.print()
    if not quiet:
        rows = [
            Row(
                (
                    layer.name,
                    str(layer.channels),
                    cell(layer.kind, style=_STYLE[layer.kind]),
                    cell(_how(layer, report.clients)),
                )
            )
            for layer in report.layers
        ]
        print_fitted(console, _COLUMNS, rows, "BN statistics of the global model")
        console.print()
    if report.findings:
        print_findings(console, list(report.findings), context=[layer.name for layer in report.layers])
        console.print()
    summary = report.summary()
    kinds = ", ".join(
        f"{summary[k]} {k}" for k in ("pooled", "recalibrated", "averaged", "copied", "initial", "other") if summary[k]
    )
    console.print(Text(f"{plural(len(report.layers), 'layer')}: {kinds}", style="bold"))
    if report.fix:
        console.print(Text("fix (exact statistics of the union, no data moved):", style="bold"))
        for line in report.fix:
            console.print(cell(f"  {line}"))

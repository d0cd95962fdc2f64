"""Output that grows with the problems, not with the model: the pieces every renderer of
inspect shares, as plain strings (no rich here).

    shorten_middle(text, width)   "backbone.layer3.0.bn1" -> "…layer3.0.bn1"
    collapse(findings)            identical findings on many layers -> one row naming them
    concise_lines(report)         `--quiet`: one line per finding, the format linters use
    summary_line(report)          the last line of every inspect table
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from bnaudit.audit.rules import Finding
from bnaudit.output.names import ELLIPSIS, shorten_names
from bnaudit.text import listing, plural

if TYPE_CHECKING:  # `bnaudit rules` renders through this module and audits nothing
    from bnaudit.audit.checkpoint.report import InspectReport


def shorten_middle(text: str, width: int) -> str:
    """`text` cut to `width` characters at segment boundaries ("." and "/"), the parts
    left out written "…" (`bnaudit.output.names`): "backbone.layer3.0.bn1" -> "…layer3.0.bn1".

    Names differ at both ends: the top-level module says where in the network, the leaf
    which norm. Only a single segment longer than `width` is cut inside, in its middle;
    a column of several names goes through `names.shorten_names`, which keeps them distinct.
    """
    shown = shorten_names([text], width)[text]
    if len(shown) <= width:
        return shown
    if width <= 1:
        return ELLIPSIS[:width]
    keep = width - 1
    tail = keep // 2
    head = keep - tail
    return text[:head] + ELLIPSIS + (text[-tail:] if tail else "")


@dataclass(frozen=True)
class FindingRow:
    """One row of the findings table: a finding, or identical findings of several layers.

    `layers` lists the layers in report order (empty for a file-level finding)."""

    code: str
    name: str
    severity: str
    layers: tuple[str, ...]
    message: str

    def where(self, limit: int = 3) -> str:
        """ "-", "conv1.bn", or "53 layers (conv1.bn, layer1.0.bn1, layer1.0.bn2 and 50 more)"."""
        if not self.layers:
            return "-"
        if len(self.layers) == 1:
            return self.layers[0]
        return f"{plural(len(self.layers), 'layer')} ({listing(self.layers, limit)})"


def collapse(findings: list[Finding]) -> list[FindingRow]:
    """Findings with the same code, severity and message on several layers, as one row
    (at the place of the first); file-level findings and unique ones stay rows of their own.
    A finding's `group_as` stands for its message here (the words its layers share, where the
    message also names something of the layer alone, an exported node).

    Channel lists are not compared: a message names the channels it is about, so two
    findings with the same message concern the same channels.
    """
    rows: list[FindingRow] = []
    index: dict[tuple[str, str, str], int] = {}
    for f in findings:
        if f.layer is None:
            rows.append(FindingRow(f.code, f.name, f.severity, (), f.message))
            continue
        key = (f.code, f.severity, f.group_as or f.message)
        if key in index:
            row = rows[index[key]]
            rows[index[key]] = FindingRow(row.code, row.name, row.severity, (*row.layers, f.layer), key[2])
        else:
            index[key] = len(rows)
            rows.append(FindingRow(f.code, f.name, f.severity, (f.layer,), f.message))
    return rows


def concise_lines(report: InspectReport) -> list[str]:
    """`path: layer: CODE name: message` per finding (`path: CODE name: message` for a
    file-level one, `path: excluded ...` for an excluded one), then the summary; an
    unreadable file is said on stderr (`output.emit_diagnostics`).

    Not collapsed: a hook's log, grep and editors' problem matchers want one location a line.
    Unprintable characters are escaped by the caller, once.
    """
    lines: list[str] = []
    for file in report.files:
        if file.error:
            continue
        if file.excluded:
            lines.append(f"{file.shown}: {file.excluded}")
            continue
        for f in file.findings:
            where = f"{file.shown}: {f.layer}: " if f.layer is not None else f"{file.shown}: "
            lines.append(f"{where}{f.code} {f.name}: {f.message}")
    lines.append(summary_line(report))
    return lines


def summary_line(report: InspectReport) -> str:
    """ "2 files, 6 BN layers: 1 error, 3 warnings, 0 infos" (and the unreadable files);
    "1 file (2 state dicts), ..." where a container's state dicts were each audited."""
    s = report.summary()
    files = plural(s["files"], "file")
    if any(f.entry for f in report.files):  # a container's state dicts, each audited
        files += f" ({plural(s['state_dicts'], 'state dict')})"
    line = (
        f"{files}, {plural(s['layers'], 'BN layer')}: {plural(s['errors'], 'error')}, "
        f"{plural(s['warnings'], 'warning')}, {plural(s['infos'], 'info')}"
    )
    if s["unreadable"]:
        line += f", {plural(s['unreadable'], 'unreadable file')}"
    if s["excluded"]:
        line += f", {plural(s['excluded'], 'excluded file')}"
    if report.skipped:
        reasons: dict[str, int] = {}
        for file in report.skipped:
            reasons[file.skip_reason] = reasons.get(file.skip_reason, 0) + 1
        why = next(iter(reasons)) if len(reasons) == 1 else "; ".join(f"{n} {r}" for r, n in reasons.items())
        line += f", {len(report.skipped)} skipped ({why})"
    return line

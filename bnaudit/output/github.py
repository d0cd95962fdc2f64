"""`--format github`: GitHub Actions workflow commands, one annotation per finding.

    ::error file=models/a.pt,line=1,title=BN004 near-eps-variance::a.bn: 1 channel ...

  command   error (severity error), warning, notice (info)
  file      the checkpoint, relative to the current directory (the checkout, where the
            runner resolves it); line=1 because a checkpoint is binary and has no lines
  title     "CODE name" of the rule
  message   "layer: message" (the message alone for a file-level finding)

A file that cannot be read is an `error` annotation titled "unreadable". Files skipped or
excluded are not annotated (they are no findings). The last line is plain text: the
counts, and where GitHub's limit hides annotations, that SARIF has them all: GitHub shows
at most 10 error, 10 warning and 10 notice annotations per step (and 50 per job).

Untrusted strings (paths, layer names, messages) are made printable first (control
characters as escapes: the log viewer interprets ANSI sequences), then escaped as the
Actions toolkit escapes them (packages/core/src/command.ts): in the message, `%` -> %25,
CR -> %0D, LF -> %0A; in property values also `:` -> %3A and `,` -> %2C, so no name can
end a property or the command early.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from bnaudit.output.checked import checked_files, counts
from bnaudit.severity import Severity
from bnaudit.text import plural, printable

if TYPE_CHECKING:
    from bnaudit.output import Report

COMMANDS = {Severity.ERROR: "error", Severity.WARNING: "warning", Severity.INFO: "notice"}

# What GitHub shows per step of each annotation kind (more are dropped from the UI).
SHOWN_PER_STEP = 10


def escape_data(text: str) -> str:
    """The message of a workflow command, as the toolkit's escapeData writes it."""
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def escape_property(text: str) -> str:
    """A property value (file, title), as the toolkit's escapeProperty writes it."""
    return escape_data(text).replace(":", "%3A").replace(",", "%2C")


def command(kind: str, message: str, **properties: str) -> str:
    """`::kind key=value,...::message`, every value and the message escaped."""
    props = ",".join(f"{key}={escape_property(value)}" for key, value in properties.items())
    return f"::{kind} {props}::{escape_data(message)}" if props else f"::{kind}::{escape_data(message)}"


def to_github(report: Report) -> str:
    """The workflow commands of an inspect or a diff report, then one summary line."""
    lines = []
    findings = []
    unreadable = 0
    files = checked_files(report)
    for file in files:
        where = printable(file.location)
        if file.error is not None:
            unreadable += 1
            lines.append(command("error", printable(file.error), file=where, line="1", title="unreadable"))
            continue
        for f in file.findings:
            findings.append(f)
            text = f"{f.layer}: {f.message}" if f.layer is not None else f.message
            title = f"{f.code} {f.name}"
            kind = COMMANDS[Severity.parse(f.severity)]
            lines.append(command(kind, printable(text), file=where, line="1", title=printable(title)))
    lines.append(_summary(len(files), counts(findings), unreadable))
    return "\n".join(lines) + "\n"


def _summary(files: int, by_severity: dict[Severity, int], unreadable: int) -> str:
    said = (
        f"bnaudit: {plural(by_severity[Severity.ERROR], 'error')}, "
        f"{plural(by_severity[Severity.WARNING], 'warning')}, "
        f"{plural(by_severity[Severity.INFO], 'info')} in {plural(files, 'file')}"
    )
    if unreadable:
        said += f", {unreadable} unreadable"
    errors = by_severity[Severity.ERROR] + unreadable
    hidden = sum(
        max(0, n - SHOWN_PER_STEP) for n in (errors, by_severity[Severity.WARNING], by_severity[Severity.INFO])
    )
    if hidden:
        said += (
            f"; GitHub shows at most {SHOWN_PER_STEP} annotations of each kind per step, so {hidden} are in this log "
            "only: upload --format sarif to code scanning for all of them"
        )
    return said

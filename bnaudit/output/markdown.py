"""`--format markdown`: a summary for a CI job's page (GitHub's `$GITHUB_STEP_SUMMARY`).

    ## bnaudit inspect
    **1 error, 2 warnings, 0 infos** in 3 files (1 unreadable, 1 without findings); fail-on: warning

    ### models/a.pt
    | severity | rule | layer | message |
    | --- | --- | --- | --- |
    | warning | BN004 near-eps-variance | a.bn | 1 channel ... |

One table per file with findings, one line per unreadable file; files without findings,
skipped or excluded are counted in the summary line only. GitHub refuses a step summary
over 1 MiB, so the document stays under LIMIT bytes (UTF-8) whatever the number of files:
when the next row would not fit, it stops and ends with a line saying how many findings of
how many files were left out (`--format sarif` or `json` hold them all).

Untrusted strings are made printable (one line each), then the characters Markdown or
GitHub would read as markup are escaped with a backslash: `\\ ` * _ [ ] < > | ~ & $ @ #`
(`|` ends a table cell, `<` starts HTML, `$` starts math, `@` a mention).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from bnaudit.output.checked import CheckedFile, checked_files, counts, fail_on
from bnaudit.output.checked import title as command_title
from bnaudit.severity import Severity
from bnaudit.text import plural, printable

if TYPE_CHECKING:
    from bnaudit.output import Report

LIMIT = 1024 * 1024  # GitHub's limit of one step summary, bytes
_FOOTER_ROOM = 1024  # kept free for the line that says what was left out

_MARKUP = re.compile(r"([\\`*_\[\]<>|~&$@#])")
_HEADER = "| severity | rule | layer | message |\n| --- | --- | --- | --- |\n"


def md(text: str) -> str:
    """`text` as literal Markdown inline text (printable, markup characters escaped)."""
    return _MARKUP.sub(r"\\\1", printable(text))


def to_markdown(report: Report, limit: int = LIMIT) -> str:
    """The Markdown summary of an inspect or a diff report, at most `limit` bytes."""
    files = checked_files(report)
    findings = [f for file in files for f in file.findings]
    by_severity = counts(findings)
    unreadable = sum(1 for file in files if file.error is not None)
    skipped = sum(1 for file in files if file.skipped is not None)
    clean = sum(1 for file in files if file.error is None and file.skipped is None and not file.findings)
    title = command_title(report)
    notes = [
        f"{n} {what}"
        for n, what in ((unreadable, "unreadable"), (skipped, "skipped"), (clean, "without findings"))
        if n
    ]
    head = [f"## {title}\n\n"]
    if files and files[0].compared is not None:
        head.append(f"{md(files[0].compared)} compared with {md(files[0].path)}\n\n")
    head.append(
        f"**{plural(by_severity[Severity.ERROR], 'error')}, {plural(by_severity[Severity.WARNING], 'warning')}, "
        f"{plural(by_severity[Severity.INFO], 'info')}** in {plural(len(files), 'file')}"
        + (f" ({', '.join(notes)})" if notes else "")
        + f"; fail-on: {fail_on(report)}\n"
    )
    out = _Budget(limit - _FOOTER_ROOM)
    for part in head:
        out.add(part)
    shown = [file for file in files if file.error is not None or file.findings]
    for index, file in enumerate(shown):
        if not _file(out, file):
            left = shown[index:]
            rows_left = sum(len(f.findings) for f in left) - out.rows_of_current
            out.parts.append(
                f"\n_{plural(rows_left, 'finding')} in {plural(len(left), 'file')} left out: "
                f"a step summary holds at most {limit // 1024} KiB; --format sarif or json has them all._\n"
            )
            break
    return "".join(out.parts)


class _Budget:
    """Parts of a document and their size in UTF-8 bytes, refusing what would not fit."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.size = 0
        self.parts: list[str] = []
        self.rows_of_current = 0  # rows of the file being written that made it in

    def add(self, text: str) -> bool:
        size = len(text.encode("utf-8", "surrogatepass"))
        if self.size + size > self.limit:
            return False
        self.parts.append(text)
        self.size += size
        return True


def _file(out: _Budget, file: CheckedFile) -> bool:
    """Add `file`'s heading and table (or its error); False where the budget ran out
    (what fitted stays: the footer counts the rest)."""
    out.rows_of_current = 0
    if not out.add(f"\n### {md(file.location)}\n\n"):
        return False
    if file.error is not None:
        return out.add(f"unreadable: {md(file.error)}\n")
    if not out.add(_HEADER):
        return False
    for f in file.findings:
        layer = md(f.layer) if f.layer is not None else "(file)"
        if not out.add(f"| {f.severity} | {f.code} {md(f.name)} | {layer} | {md(f.message)} |\n"):
            return False
        out.rows_of_current += 1
    return True

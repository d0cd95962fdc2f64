"""`--format gitlab`: a GitLab Code Quality report (`artifacts:reports:codequality`).

A JSON array, one issue per finding, in the subset of the Code Climate format GitLab reads
(every entry valid against GitLab's own schema, app/validators/json_schemas/codeclimate.json,
which its parser checks each entry against):

  type          "issue" (Code Climate's; GitLab ignores it)
  check_name    the rule code (BN004)
  description   "CODE name: layer: message" (GitLab shows the description, not check_name)
  fingerprint   sha256 of file, layer and rule (`bnaudit.output.checked.fingerprints`):
                stable across runs, different for each layer; GitLab compares pipelines
                by it, and an entry repeating a fingerprint would replace the earlier one
  severity      info -> "info", warning -> "minor", error -> "major"; a file that could
                not be read -> "critical" (nothing of it was audited: worse than any one
                finding); "blocker" is not used
  location      {"path": the checkpoint relative to the current directory (the project
                folder in a GitLab job), "lines": {"begin": 1}}: a checkpoint is binary

Files skipped or excluded are no issues. Names stay exact (a consumer matches layer names
against the state dict); the JSON encoder writes control and non-ASCII characters as
\\u escapes.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

from bnaudit.output.checked import CheckedFile, checked_files, fingerprints
from bnaudit.severity import Severity

if TYPE_CHECKING:
    from bnaudit.output import Report

SEVERITIES = {Severity.INFO: "info", Severity.WARNING: "minor", Severity.ERROR: "major"}
UNREADABLE = "critical"
UNREADABLE_CHECK = "unreadable"


def to_gitlab(report: Report) -> list[dict[str, Any]]:
    """The Code Quality issues of an inspect or a diff report."""
    issues = []
    for file in checked_files(report):
        if file.error is not None:
            issues.append(_unreadable(file))
            continue
        for finding, fingerprint in zip(file.findings, fingerprints(file), strict=True):
            where = f"{finding.layer}: " if finding.layer is not None else ""
            issues.append(
                _issue(
                    finding.code,
                    f"{finding.code} {finding.name}: {where}{finding.message}",
                    fingerprint,
                    SEVERITIES[Severity.parse(finding.severity)],
                    file.location,
                )
            )
    return issues


def _unreadable(file: CheckedFile) -> dict[str, Any]:
    fingerprint = hashlib.sha256(f"{file.location}\0{UNREADABLE_CHECK}".encode("utf-8", "surrogatepass")).hexdigest()
    description = f"{UNREADABLE_CHECK}: {file.error}"
    return _issue(UNREADABLE_CHECK, description, fingerprint, UNREADABLE, file.location)


def _issue(check: str, description: str, fingerprint: str, severity: str, path: str) -> dict[str, Any]:
    return {
        "type": "issue",
        "check_name": check,
        "description": description,
        "fingerprint": fingerprint,
        "severity": severity,
        "location": {"path": path, "lines": {"begin": 1}},
    }

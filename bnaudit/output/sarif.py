"""SARIF 2.1.0 rendering of an inspect, a diff, a fold or a parity report, in the subset GitHub code scanning reads.

One run; `tool.driver` describes bnaudit and every registered rule (text from
`bnaudit.docs`, the source `bnaudit rules` prints). Each finding becomes a result:

  ruleId, ruleIndex   the rule code and its index in driver.rules
  level               error -> "error", warning -> "warning", info -> "note"
  message.text        "<layer>: <message>" (the message alone for file-level findings)
  locations[0]        physicalLocation.artifactLocation: the checkpoint path relative to
                      the base folder (the current directory), uriBaseId %SRCROOT%;
                      logicalLocations: the layer name
  partialFingerprints {"bnauditFinding/v1": sha256(code, path, layer)[:32]}

A checkpoint is binary, so a result has no `region`: a line number would be invented,
and the GitHub upload action computes line-hash fingerprints only for results with a
line, so it does not read gigabyte checkpoints as text. Our own fingerprint keeps the
findings of one rule in different layers of one file apart. Files that could not be read
become error notifications of the invocation, whose `executionSuccessful` is then false.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from bnaudit import __version__
from bnaudit.audit.checkpoint.report import InspectReport
from bnaudit.audit.ruledocs import explain_rule, worst_severity
from bnaudit.audit.rules import RULES, Finding
from bnaudit.config import Config
from bnaudit.output.checked import location

if TYPE_CHECKING:
    from bnaudit.audit.diff.checkpoints import DiffReport
    from bnaudit.audit.fed.report import FedReport
    from bnaudit.audit.fold.report import FoldReport
    from bnaudit.reports.parity import ParityReport

SCHEMA_URI = "https://docs.oasis-open.org/sarif/sarif/v2.1.0/errata01/os/schemas/sarif-schema-2.1.0.json"


# The project's home page (the SARIF driver must name an absolute URI); the README's
# pre-commit snippet names the same repository.
INFORMATION_URI = "https://github.com/bnaudit/bnaudit"


LEVELS = {"error": "error", "warning": "warning", "info": "note"}


def _artifact_location(path: str, base: str) -> dict[str, str]:
    where = location(path, base)  # the CI formats' path, as a URI
    if os.path.isabs(where):
        return {"uri": Path(where).as_uri()}
    # the path's own bytes, percent-encoded: a file name that is not UTF-8 (kept by
    # surrogateescape) is a valid URI of exactly that file
    return {"uri": quote(os.fsencode(where), safe="/"), "uriBaseId": "%SRCROOT%"}


def _fingerprint(finding: Finding, uri: str) -> str:
    key = "\0".join((finding.code, uri, finding.layer or ""))
    # a layer name may hold a lone surrogate (a pickle allows one): hashed as it is, not refused
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def rule_descriptor(code: str, overrides: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A SARIF reportingDescriptor; its default level honours the configured severity."""
    rule = RULES[code]
    return {
        "id": rule.code,
        # SARIF's place for the former codes of a rule (bnaudit's aliases)
        **({"deprecatedIds": list(rule.aliases)} if rule.aliases else {}),
        "name": rule.name,
        "shortDescription": {"text": rule.summary},
        "fullDescription": {"text": rule.explanation},
        "help": {
            "text": explain_rule(rule, overrides=overrides),
            "markdown": explain_rule(rule, markdown=True, overrides=overrides),
        },
        "defaultConfiguration": {"level": LEVELS[worst_severity(rule, overrides)]},
        "properties": {"tags": ["batchnorm", "pytorch", "checkpoint"]},
    }


def inspect_to_sarif(report: InspectReport, base: str | None = None) -> dict[str, Any]:
    """The SARIF log of an inspect report; paths are made relative to `base` (default: cwd)."""
    base = os.path.abspath(base or os.getcwd())
    codes = list(RULES)
    results = []
    notifications = []
    for file in report.files:
        location = _artifact_location(file.path, base)
        if file.excluded:
            notifications.append(
                {
                    "level": "note",
                    "message": {"text": f"{file.shown}: {file.excluded}"},
                    "locations": [{"physicalLocation": {"artifactLocation": location}}],
                }
            )
            continue
        if file.error:
            notifications.append(
                {
                    "level": "error",
                    "message": {"text": f"{file.shown}: {file.error}"},
                    "locations": [{"physicalLocation": {"artifactLocation": location}}],
                }
            )
            continue
        if file.skipped:
            notifications.append(
                {
                    "level": "note",
                    "message": {"text": file.skipped_line()},
                    "locations": [{"physicalLocation": {"artifactLocation": location}}],
                }
            )
            continue
        results += [_result(finding, location, codes) for finding in file.findings]
    return _log(base, codes, report.config, notifications, results, {"config": report.config.as_dict()})


def _result(finding: Finding, location: dict[str, str], codes: list[str]) -> dict[str, Any]:
    """One SARIF result: the finding at its file, the layer as a logical location."""
    where: dict[str, Any] = {"physicalLocation": {"artifactLocation": location}}
    if finding.layer is not None:
        where["logicalLocations"] = [{"name": finding.layer, "fullyQualifiedName": finding.layer, "kind": "module"}]
    result: dict[str, Any] = {
        "ruleId": finding.code,
        "level": LEVELS[finding.severity],
        "message": {"text": f"{finding.layer}: {finding.message}" if finding.layer else finding.message},
        "locations": [where],
        "partialFingerprints": {"bnauditFinding/v1": _fingerprint(finding, location["uri"])},
    }
    if finding.code in RULES:
        result["ruleIndex"] = codes.index(finding.code)
    if finding.channels:
        result["properties"] = {"channels": list(finding.channels)}
    return result


def _log(
    base: str,
    codes: list[str],
    config: Config,
    notifications: list[dict[str, Any]],
    results: list[dict[str, Any]],
    properties: dict[str, Any],
) -> dict[str, Any]:
    """A SARIF 2.1.0 log of one run: the driver describes every rule of the registry at
    its configured severity; the run failed when a notification is an error."""
    return {
        "$schema": SCHEMA_URI,
        "version": "2.1.0",
        "runs": [
            {
                "tool": {
                    "driver": {
                        "name": "bnaudit",
                        "version": __version__,
                        "semanticVersion": __version__,
                        "informationUri": INFORMATION_URI,
                        "rules": [rule_descriptor(code, config.severity) for code in codes],
                    }
                },
                "invocations": [
                    {
                        "executionSuccessful": not any(n["level"] == "error" for n in notifications),
                        "toolExecutionNotifications": notifications,
                    }
                ],
                "originalUriBaseIds": {"%SRCROOT%": {"uri": Path(base).as_uri().rstrip("/") + "/"}},
                "results": results,
                "properties": properties,
            }
        ],
    }


def diff_to_sarif(report: DiffReport, base: str | None = None) -> dict[str, Any]:
    """The SARIF log of a diff report: as inspect's (the driver describes every rule of the
    registry), with side B, the checkpoint under review, as every result's artifact."""
    compared = {"compared": {"a": report.a.path, "b": report.b.path}}
    return _one_file_log(report.b.path, report.findings, report.config, base, compared)


def fold_to_sarif(report: FoldReport, base: str | None = None) -> dict[str, Any]:
    """The SARIF log of a fold report: as inspect's, with the checkpoint whose BN layers
    fold as every result's artifact."""
    return _one_file_log(report.path, report.findings, report.config or Config(), base, {})


def fed_to_sarif(report: FedReport, base: str | None = None) -> dict[str, Any]:
    """The SARIF log of a fed report: as inspect's, with the global checkpoint as every
    result's artifact and the clients among the run's properties."""
    return _one_file_log(
        report.path, report.findings, report.config or Config(), base, {"clients": list(report.clients)}
    )


def parity_to_sarif(report: ParityReport, base: str | None = None) -> dict[str, Any]:
    """The SARIF log of a parity report: every result at the artifact under review (the
    checkpoint for a compiled target), the checkpoint and the target in the run's properties."""
    target = {"kind": report.target.kind, "path": report.target.path, "backend": report.target.backend}
    extra = {"checkpoint": report.checkpoint, "target": target}
    return _one_file_log(report.path, report.findings, report.config, base, extra)


def _one_file_log(
    path: str, findings: Iterable[Finding], config: Config, base: str | None, extra: dict[str, Any]
) -> dict[str, Any]:
    """A log whose every result is at `path` (diff, fold); `extra` joins the run's properties."""
    base = os.path.abspath(base or os.getcwd())
    codes = list(RULES)
    location = _artifact_location(path, base)
    results = [_result(finding, location, codes) for finding in findings]
    return _log(base, codes, config, [], results, {"config": config.as_dict(), **extra})

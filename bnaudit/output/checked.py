"""The checked files of an inspect, a diff, a fold, a fed or a parity report, in the one shape the CI formats
(github, gitlab, junit, markdown) render: each file with its location, its layers, its
findings, or why it was not audited.

An inspect report checks every file it names or finds; a diff report checks one file,
side B (the checkpoint under review, as in SARIF), compared with side A. Locations are
paths relative to a base folder (the current directory: a CI job runs from the checkout,
where GitHub and GitLab resolve annotation paths), in POSIX form, or absolute when the
file lies outside the base; a Hugging Face cache file is `repo@revision/file`, the same on
every runner. Strings stay exact here; each emitter makes them safe for
its format.
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from bnaudit.audit.rules import Finding
from bnaudit.severity import Severity

if TYPE_CHECKING:
    from bnaudit.output import Report


@dataclass(frozen=True)
class CheckedFile:
    """One file of a report.

    path       the path as the report holds it (what the user typed or a scan found)
    location   `path` relative to the base folder, POSIX separators (absolute outside it);
               `repo@revision/file` for a file of the Hugging Face cache
    layers     the BN layers checked, in file order, then any layer only a finding names
    findings   the findings of the file, in report order
    error      why the file could not be read (None when it was)
    skipped    why the file was not audited: excluded by the configuration, or not model
               weights (optimizer state, ...); never a finding nor an exit code
    compared   for a diff, side A's path (the file B was compared with)
    """

    path: str
    location: str
    layers: tuple[str, ...] = ()
    findings: tuple[Finding, ...] = ()
    error: str | None = None
    skipped: str | None = None
    compared: str | None = None


def location(path: str, base: str | None = None) -> str:
    """`path` relative to `base` (default: the current directory) with `/` separators, or
    the absolute path when it lies outside `base`."""
    base = os.path.abspath(base or os.getcwd())
    absolute = os.path.abspath(path)
    relative = os.path.relpath(absolute, base)
    if relative == ".." or relative.startswith(".." + os.sep):
        return Path(absolute).as_posix()
    return Path(relative).as_posix()


def _layers(names: Iterable[str], findings: Iterable[Finding]) -> tuple[str, ...]:
    ordered = dict.fromkeys(names)
    ordered.update(dict.fromkeys(f.layer for f in findings if f.layer is not None))
    return tuple(ordered)


def checked_files(report: Report, base: str | None = None) -> list[CheckedFile]:
    """The files of an inspect, a diff or a fold report (see the module docstring)."""
    if report.kind == "inspect":
        files = []
        for file in report.files:
            # a Hugging Face cache file by repo@revision/file: its snapshot path holds the
            # runner's cache folder and would differ between machines
            where = file.shown if file.hub is not None else location(file.path, base)
            if file.excluded is not None or file.skipped is not None:
                why = f"excluded: {file.excluded}" if file.excluded is not None else f"skipped: {file.skipped}"
                files.append(CheckedFile(file.path, where, skipped=why))
            elif file.error:
                files.append(CheckedFile(file.path, where, error=file.error))
            else:
                layers = _layers((layer.name for layer in file.layers), file.findings)
                files.append(CheckedFile(file.path, where, layers, tuple(file.findings)))
        return files
    if report.kind == "diff":
        names = [d.name for d in report.layers] + report.only_a + report.only_b + [n for n, _, _ in report.reshaped]
        where = location(report.b.path, base)
        return [
            CheckedFile(
                report.b.path, where, _layers(names, report.findings), tuple(report.findings), compared=report.a.path
            )
        ]
    if report.kind == "fold":  # one file: the checkpoint whose BN layers fold
        names = [p.bn for p in report.pairs] + [name for name, _ in report.unpaired]
        return [CheckedFile(report.path, location(report.path, base), _layers(names, report.findings), report.findings)]
    if report.kind == "fed":  # one file: the global checkpoint whose layers were classified
        names = [layer.name for layer in report.layers]
        return [CheckedFile(report.path, location(report.path, base), _layers(names, report.findings), report.findings)]
    if report.kind == "parity":  # one file: the artifact under review, compared with the checkpoint
        names = [layer.name for layer in report.layers] + [u.name for u in report.unseen]
        return [
            CheckedFile(
                report.path,
                location(report.path, base),
                _layers(names, report.findings),
                report.findings,
                compared=report.checkpoint if report.target.path else None,
            )
        ]
    raise ValueError(f"no findings at locations in a {type(report).__name__} report")


def fail_on(report: Report) -> Severity:
    """The severity from which a finding fails the run (the configuration's fail-on)."""
    if report.kind in ("inspect", "diff"):
        return Severity.parse(report.config.fail_on)
    if report.kind in ("fold", "fed"):
        return report.fail_on
    if report.kind == "parity":
        return Severity.parse(report.config.fail_on)
    raise ValueError(f"no findings at locations in a {type(report).__name__} report")


def title(report: Report) -> str:
    """The command that made the report, as the CI formats name it ("bnaudit inspect")."""
    return f"bnaudit {report.kind}"


def counts(findings: Iterable[Finding]) -> dict[Severity, int]:
    """Findings per severity, every severity present (0 when none)."""
    found = Counter(Severity.parse(f.severity) for f in findings)
    return {severity: found[severity] for severity in Severity}


def fingerprints(file: CheckedFile) -> list[str]:
    """One fingerprint per finding of `file`, in order: sha256 over the file's location,
    the layer (or none: a file-level finding) and the rule code, hex.

    The message is left out on purpose: it carries numbers (a gain, a count) that change
    between runs while the problem stays the same, and a consumer (GitLab's Code Quality
    diff between two pipelines) must see it as the same problem. Two findings with the same
    key in one file (a rule that speaks twice) get the key's occurrence number mixed in, so
    that fingerprints stay unique within a report and stable across runs.
    """
    seen: Counter[tuple[str, str]] = Counter()
    out = []
    for finding in file.findings:
        layer = "layer:" + finding.layer if finding.layer is not None else "file"
        key = (finding.code, layer)
        parts = [file.location, layer, finding.code] + ([str(seen[key])] if seen[key] else [])
        seen[key] += 1
        out.append(hashlib.sha256("\0".join(parts).encode("utf-8", "surrogatepass")).hexdigest())
    return out

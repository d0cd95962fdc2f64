"""`inspect`: path(s) -> checkpoint -> layers -> rules -> InspectReport.

A directory expands to every file under it whose name ends in a checkpoint suffix;
a file named explicitly is read whatever its name. One unreadable file becomes a
FileReport with `error` set; the others are still audited.
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from fnmatch import fnmatch

from bnaudit.checkpoint import CHECKPOINT_SUFFIXES, read_checkpoint
from bnaudit.config import Config
from bnaudit.errors import BnauditError
from bnaudit.layers import DEFAULT_EPS, DEFAULT_MOMENTUM, discover_layers
from bnaudit.report import FileReport, InspectReport, LayerSummary
from bnaudit.rules import RuleContext, run_rules


def expand_paths(paths: Iterable[str], exclude: Iterable[str] = ()) -> list[str]:
    """Files to audit, in the order given; directories walked in sorted order."""
    exclude = tuple(exclude)
    out: list[str] = []
    for path in paths:
        if os.path.isdir(path):
            found: list[str] = []
            # A folder that cannot be listed is kept as an entry of its own, so it is
            # reported (as unreadable) instead of silently contributing nothing.
            for root, dirs, files in os.walk(path, onerror=lambda err: found.append(err.filename)):
                dirs.sort()
                found += [os.path.join(root, f) for f in sorted(files) if f.lower().endswith(CHECKPOINT_SUFFIXES)]
            if not found:
                raise BnauditError(f"{path}: directory holds no checkpoint files ({' '.join(CHECKPOINT_SUFFIXES)})")
            out += found
        else:
            out.append(path)
    return [p for p in out if not any(fnmatch(p, pattern) for pattern in exclude)]


def audit_file(
    path: str, config: Config, key: str | None = None, trust_pickle: bool = False, debug: bool = False,
) -> FileReport:
    """Audit one checkpoint; a problem with it becomes `FileReport.error`.

    An unexpected exception (a bug met on this file) is recorded the same way so
    the other files are still audited; `debug=True` lets it propagate instead.
    """
    report = FileReport(path)
    try:
        ckpt = read_checkpoint(path, key=key, trust_pickle=trust_pickle)
        discovery = discover_layers(ckpt, eps=config.eps, momentum=config.momentum,
                                    momentum_given=config.momentum is not None)
        findings = run_rules(RuleContext(discovery, config, is_ema=ckpt.is_ema))
    except BnauditError as exc:
        report.error = str(exc).removeprefix(f"{path}: ")
        return report
    except Exception as exc:
        if debug:
            raise
        report.error = f"internal error: {type(exc).__name__}: {exc} (run with --debug for the traceback)"
        return report
    report.format, report.key, report.other_keys = ckpt.format, ckpt.key, ckpt.other_keys
    report.prefix, report.is_ema = ckpt.prefix, ckpt.is_ema
    report.layers = [LayerSummary.of(layer, config.near_eps_factor) for layer in discovery.layers]
    report.findings = findings
    if any(layer.settings_assumed for layer in discovery.layers):
        eps = config.eps if config.eps is not None else DEFAULT_EPS
        momentum = config.momentum if config.momentum is not None else DEFAULT_MOMENTUM
        given = "given" if config.eps is not None or config.momentum is not None else "assumed"
        report.settings = (f"eps {eps:g} and momentum {momentum:g} {given}: a state dict does not store them "
                           "(set --eps/--momentum)")
    return report


def inspect(
    paths: str | os.PathLike | Iterable[str | os.PathLike],
    config: Config | None = None,
    key: str | None = None,
    trust_pickle: bool = False,
    debug: bool = False,
) -> InspectReport:
    """Audit checkpoints (files or directories) and return the report.

    >>> report = inspect("sample_models/")      # doctest: +SKIP
    >>> report.exit_code(), report.summary()    # doctest: +SKIP
    """
    config = config or Config()
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files: list[FileReport] = []
    for path in [os.fspath(p) for p in paths]:
        try:
            expanded = expand_paths([path], config.exclude)
        except BnauditError as exc:
            files.append(FileReport(path, error=str(exc).removeprefix(f"{path}: ")))
            continue
        files += [audit_file(p, config, key=key, trust_pickle=trust_pickle, debug=debug) for p in expanded]
    return InspectReport(files, config)

"""`diff`: two checkpoints -> BN layers of each -> per-layer changes -> verdicts -> DiffReport.

Both sides are read exactly as `inspect` reads them (every format and container, wrapper
prefixes stripped, only the BN tensors read), so the cost does not grow with the rest of
the checkpoint. Layers are matched by name. The numbers and verdicts are defined in
`bnaudit.audit.layerdiff`; the findings come from the diff rules (BN1xx) of the registry.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import ClassVar

from bnaudit.audit.layerdiff import (
    FROZEN_BUT_UPDATING,
    RE_ESTIMATED,
    STALE,
    TRAINED,
    UNCHANGED,
    VERDICTS,
    DiffContext,
    LayerDiff,
    compare_layers,
    describe_group,
)
from bnaudit.audit.layers import BNLayer, discover_layers
from bnaudit.audit.rules import Finding, run_diff_rules
from bnaudit.config import DEFAULT_EPS, SEVERITIES, Config, severity_rank
from bnaudit.errors import BnauditError
from bnaudit.formats.model import Checkpoint, recalibration_record
from bnaudit.formats.read import read_checkpoint
from bnaudit.text import plural


@dataclass(frozen=True)
class Side:
    """Where one side's layers came from."""

    path: str
    format: str
    key: str | None
    prefix: str
    is_ema: bool
    layers: int


@dataclass
class DiffReport:
    kind: ClassVar[str] = "diff"  # which emitter of bnaudit.output renders it

    a: Side
    b: Side
    config: Config
    layers: list[LayerDiff] = field(default_factory=list)  # matched layers, in A's file order
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    reshaped: list[tuple[str, int, int]] = field(default_factory=list)  # name, C on A, C on B
    findings: list[Finding] = field(default_factory=list)
    settings: str = ""  # set when eps was assumed for a side without modules
    provenance: str = ""  # bnaudit's recalibration record of side B, in words

    def layers_by_verdict(self) -> dict[str, list[str]]:
        """Verdict -> layer names, for every verdict (empty lists included), in VERDICTS order."""
        out: dict[str, list[str]] = {v: [] for v in VERDICTS}
        for d in self.layers:
            out[d.verdict].append(d.name)
        return out

    def groups(self) -> dict[str, str]:
        """Verdict -> a short description of its layers (`backbone.*`), non-empty verdicts only."""
        every = [d.name for d in self.layers]
        return {v: describe_group(names, every) for v, names in self.layers_by_verdict().items() if names}

    def summary(self) -> dict[str, int]:
        counts = {s: sum(1 for f in self.findings if f.severity == s) for s in SEVERITIES}
        by_verdict = {v: len(names) for v, names in self.layers_by_verdict().items()}
        return {
            "matched": len(self.layers),
            **{v.replace(" ", "_").replace("-", "_"): n for v, n in by_verdict.items()},
            "only_a": len(self.only_a),
            "only_b": len(self.only_b),
            "reshaped": len(self.reshaped),
            "errors": counts["error"],
            "warnings": counts["warning"],
            "infos": counts["info"],
        }

    def diagnosis(self) -> list[str]:
        """What happened, in plain words, one line per verdict that needs one."""
        by = self.layers_by_verdict()
        every = [d.name for d in self.layers]
        lines = []
        if by[FROZEN_BUT_UPDATING]:
            lines.append(
                f"{plural(len(by[FROZEN_BUT_UPDATING]), 'layer')} ({describe_group(by[FROZEN_BUT_UPDATING], every)}) "
                "kept their weights but updated their running statistics: they ran in training mode while "
                "frozen. Put frozen modules in eval() after every model.train(), or accept the new statistics."
            )
        if by[STALE]:
            lines.append(
                f"{plural(len(by[STALE]), 'layer')} ({describe_group(by[STALE], every)}) "
                f"{'has' if len(by[STALE]) == 1 else 'have'} new weights but the "
                "old statistics: averaged (EMA/SWA) or edited weights; run update_bn or bnaudit recalibrate."
            )
        if by[RE_ESTIMATED]:
            how = f" by {self.provenance}" if self.provenance else ""
            lines.append(
                f"{plural(len(by[RE_ESTIMATED]), 'layer')} ({describe_group(by[RE_ESTIMATED], every)}) had their "
                f"statistics re-estimated{how}."
            )
        if any(f.code == "BN104" for f in self.findings):
            lines.append(
                "Some layers counted more batches than others during the same run: see BN104 "
                "(a ratio of exactly 2 is activation checkpointing re-running BN forwards)."
            )
        if any(f.code == "BN106" and f.severity == "error" for f in self.findings):
            lines.append("eps changed: side B evaluates another function than side A was trained as.")
        if by[TRAINED] and not lines:
            lines.append(
                f"{plural(len(by[TRAINED]), 'layer')} trained normally (weights, statistics and counter moved)."
            )
        if not self.layers:
            lines.append("No BN layer is present on both sides.")
        elif len(by[UNCHANGED]) == len(self.layers):
            lines.append("Every matched layer is bit-identical on both sides.")
        return lines

    def exit_code(self, fail_on: str | None = None) -> int:
        """1 if a finding is at or above fail_on (default: the configuration's), else 0.

        An unreadable side is a BnauditError (exit 2 at the CLI), never a report."""
        threshold = severity_rank(fail_on or self.config.fail_on)
        return 1 if any(severity_rank(f.severity) >= threshold for f in self.findings) else 0


def _side(ckpt: Checkpoint, layers: list[BNLayer]) -> Side:
    return Side(ckpt.path, ckpt.format, ckpt.key, ckpt.prefix, ckpt.is_ema, len(layers))


def _recalibration(ckpt: Checkpoint) -> tuple[frozenset[str], str]:
    record = recalibration_record(ckpt.metadata)
    names = record.get("recalibrated_layers") if record else None
    if record is None or not isinstance(names, list):
        return frozenset(), ""
    described = (
        f"bnaudit recalibrate (method {record.get('method')}, {record.get('samples')} samples, {record.get('date')})"
    )
    return frozenset(n for n in names if isinstance(n, str)), described


def diff_checkpoints(a: Checkpoint, b: Checkpoint, config: Config) -> DiffReport:
    """Compare two opened checkpoints layer by layer (see bnaudit.audit.layerdiff)."""
    layers_a = discover_layers(a, eps=config.eps, momentum=config.momentum).layers
    layers_b = discover_layers(b, eps=config.eps, momentum=config.momentum).layers
    by_name_b = {layer.name: layer for layer in layers_b}
    names_a = {layer.name for layer in layers_a}
    recalibrated, provenance = _recalibration(b)
    report = DiffReport(_side(a, layers_a), _side(b, layers_b), config, provenance=provenance)
    counters_meaningful = not (a.is_ema or b.is_ema)  # an EMA copy's counter counts nothing
    for la in layers_a:
        lb = by_name_b.get(la.name)
        if lb is None:
            report.only_a.append(la.name)
        elif la.num_features != lb.num_features:
            report.reshaped.append((la.name, la.num_features, lb.num_features))
        else:
            report.layers.append(
                compare_layers(la, lb, recalibrated=la.name in recalibrated, counter_meaningful=counters_meaningful)
            )
    report.only_b = [layer.name for layer in layers_b if layer.name not in names_a]
    context = DiffContext(report.layers, config, report.only_a, report.only_b, report.reshaped, provenance=provenance)
    report.findings = run_diff_rules(context)
    if any(layer.settings_assumed for layer in layers_a + layers_b):
        eps = config.eps if config.eps is not None else DEFAULT_EPS
        given = "given" if config.eps is not None else "assumed"
        report.settings = f"eps {eps:g} {given} where a side holds no modules (set --eps)"
    return report


def diff(
    path_a: str | os.PathLike[str],
    path_b: str | os.PathLike[str],
    config: Config | None = None,
    key_a: str | None = None,
    key_b: str | None = None,
    trust_pickle: bool = False,
) -> DiffReport:
    """What happened to the BatchNorm state between two checkpoints.

    Raises BnauditError when a side cannot be read or holds no BN layer.

    >>> report = diff("pretrained.pt", "finetuned.pt")   # doctest: +SKIP
    >>> report.groups()                                  # doctest: +SKIP
    {'frozen but updating': 'features.*', 'trained': 'head.*'}
    """
    config = config or Config()
    sides = []
    for path, key in ((os.fspath(path_a), key_a), (os.fspath(path_b), key_b)):
        ckpt = read_checkpoint(path, key=key, trust_pickle=trust_pickle)
        sides.append(ckpt)
    report = diff_checkpoints(sides[0], sides[1], config)
    for side in (report.a, report.b):
        if side.layers == 0:
            raise BnauditError(
                f"{side.path}: no BatchNorm layers found" + (f" under key '{side.key}'" if side.key else "")
            )
    return report

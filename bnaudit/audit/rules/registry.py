"""The rule registry: a rule is code + name + severity + documentation + check, in one place.

Rules register themselves with the `rule` decorator when their module is imported; the
package (`bnaudit.audit.rules`) imports every rule module, and `RULES` is kept in code
order: BN001-BN014 (inspect) then BN101-BN114 (diff), whatever the import order. `run_rules` and
`run_diff_rules` apply the configuration: `select`/`ignore`, per-layer ignores and the
`severity` table.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

from bnaudit.config import Config
from bnaudit.severity import Severity

if TYPE_CHECKING:
    from bnaudit.audit.layerdiff import DiffContext
    from bnaudit.audit.layers import Discovery, ModuleFacts


@dataclass(frozen=True)
class Finding:
    code: str
    name: str
    severity: Severity
    layer: str | None  # None for file-level findings
    message: str
    channels: tuple[int, ...] = ()


@dataclass(frozen=True)
class RuleContext:
    discovery: Discovery
    config: Config
    is_ema: bool = False
    # Set when a module is available (--arch, TorchScript, pickled module): BN001 is
    # then exact, and BN006 / BN007 / BN011 can speak.
    module: ModuleFacts | None = None
    # Layers whose statistics `bnaudit recalibrate` wrote (population statistics, not
    # an EMA: their counter is the number of calibration batches).
    recalibrated: frozenset[str] = frozenset()
    # Exported graphs (ONNX, .pt2): BN nodes whose statistics are not constants (or not
    # read), one note each, the evidence of BN folded into Conv nodes (Checkpoint.folded),
    # and of BN decomposed into elementwise arithmetic (Checkpoint.decomposed).
    unauditable: tuple[str, ...] = ()
    folded: str | None = None
    decomposed: str | None = None


@dataclass(frozen=True)
class Rule:
    code: str
    name: str
    severities: tuple[Severity, ...]  # what its findings can be, worst first
    summary: str
    explanation: str
    fix: str
    # a RuleContext for inspect's rules, a layerdiff.DiffContext for diff's
    check: Callable[[Any], Iterable[Finding]] = field(repr=False)
    settings: tuple[str, ...] = ()  # configuration keys (config.KEYS) that tune the rule
    command: str = "inspect"  # the command whose reports the rule speaks in: "inspect" or "diff"

    @property
    def severity(self) -> str:
        """The severities as `bnaudit rules` shows them: "error / warning" when it depends on the case."""
        return " / ".join(self.severities)

    @property
    def worst_severity(self) -> Severity:
        return max(self.severities)

    def finding(self, severity: Severity, layer: str | None, message: str, channels: Iterable[int] = ()) -> Finding:
        return Finding(self.code, self.name, severity, layer, message, tuple(int(c) for c in channels))


RULES: dict[str, Rule] = {}

_Check = TypeVar("_Check", bound=Callable[[Any], Iterable[Finding]])


def rule(
    code: str,
    name: str,
    severity: Severity | tuple[Severity, ...],
    summary: str,
    explanation: str,
    fix: str,
    settings: tuple[str, ...] = (),
    command: str = "inspect",
) -> Callable[[_Check], _Check]:
    severities = severity if isinstance(severity, tuple) else (severity,)

    def register(check: _Check) -> _Check:
        RULES[code] = Rule(code, name, severities, summary, explanation, fix, check, settings, command)
        # code order, whatever order the rule modules were imported in: the order of
        # `bnaudit rules` and of every report's findings
        ordered = sorted(RULES.items())
        RULES.clear()
        RULES.update(ordered)
        return check

    return register


def three_digits(x: float) -> str:
    """A number in findings' messages: three significant digits."""
    return f"{x:.3g}"


def _selected(code: str, cfg: Config) -> bool:
    if cfg.select and not any(code.startswith(s) for s in cfg.select):
        return False
    return not any(code.startswith(i) for i in cfg.ignore)


def _ignored_for_layer(finding: Finding, cfg: Config) -> bool:
    if finding.layer is None:
        return False
    return any(
        fnmatch.fnmatchcase(finding.layer, pattern) and any(finding.code.startswith(c) for c in codes)
        for pattern, codes in cfg.per_layer_ignores.items()
    )


def run_rules(ctx: RuleContext) -> list[Finding]:
    """Every selected inspect rule's findings, in rule order, at the configured severity."""
    return _run_command_rules("inspect", ctx, ctx.config)


def _run_command_rules(command: str, ctx: Any, config: Config) -> list[Finding]:
    """The findings of the selected rules of `command` (inspect, diff), in rule order, with
    per-layer ignores applied and `[tool.bnaudit.severity]` overrides in force."""
    findings: list[Finding] = []
    overrides = config.severity
    for code, r in RULES.items():
        if r.command == command and _selected(code, config):
            found = [f for f in r.check(ctx) if not _ignored_for_layer(f, config)]
            if code in overrides:
                found = [replace(f, severity=Severity.parse(overrides[code])) for f in found]
            findings.extend(found)
    return findings


def run_diff_rules(ctx: DiffContext) -> list[Finding]:
    """Every selected diff rule's findings, in rule order, at the configured severity."""
    return _run_command_rules("diff", ctx, ctx.config)

"""The rule registry: a rule is code + name + severity + documentation + check, in one place.

Rules register themselves with the `rule` decorator when their module is imported; the
package (`bnaudit.audit.rules`) imports every rule module, and `RULES` is kept in code
order: BN001-BN014 (inspect), BN101-BN114 (diff), BN201- (fold), BN301- (fed), then BN401- (parity), whatever
the import order. `run_rules`, `run_diff_rules`, `run_fold_rules`, `run_fed_rules` and `run_parity_rules` apply the configuration: `select`/`ignore`, per-layer ignores and the
`severity` table.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

from bnaudit.config import Config
from bnaudit.severity import Severity

if TYPE_CHECKING:
    from bnaudit.audit.diff.layers import DiffContext
    from bnaudit.audit.fed.classify import FedContext
    from bnaudit.audit.fold.check import FoldContext
    from bnaudit.audit.layers import BNLayer, Discovery, ModuleFacts
    from bnaudit.audit.parity import ParityContext
    from bnaudit.audit.producers import ProducerFilter
    from bnaudit.formats.ema import EmaSchedule
    from bnaudit.formats.model import Averaging, TensorRef
    from bnaudit.formats.peft import AdapterInfo


@dataclass(frozen=True)
class Finding:
    """One fact a rule reports: at a layer (or the file, `layer` None), and on which channels.

    `group_as`: the message a table shows for one row grouping the layers with this fact,
    where `message` names something of this layer alone (an exported node's name); "" when
    `message` itself is the same for every layer with the fact."""

    code: str
    name: str
    severity: Severity
    layer: str | None  # None for file-level findings
    message: str
    channels: tuple[int, ...] = ()
    group_as: str = ""


@dataclass(frozen=True)
class RuleContext:
    """What the inspect rules read: the layers of one checkpoint, the configuration, and what
    else is known about the file (its modules, how it was exported, averaged or recalibrated)."""

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
    unauditable_layers: Mapping[str, str] = field(default_factory=dict)  # note -> its layer, where known
    folded: str | None = None
    folded_ambiguous: bool = False  # Checkpoint.folded_ambiguous: a net without BN looks the same
    quantized: str | None = None  # Checkpoint.quantized: integer convolutions not examined
    # a PEFT adapter composed with its base (formats.peft.AdapterInfo): BN001 checks its modules_to_save
    adapter: AdapterInfo | None = None
    decomposed: str | None = None
    # An averaged copy (is_ema): what averaged it (formats.model.Averaging), and the BN
    # layers of its live model by name when the same container holds it.
    averaging: Averaging | None = None
    live_layers: Mapping[str, BNLayer] | None = None
    # the EMA schedule the container's training arguments record (formats.ema.EmaSchedule)
    ema_schedule: EmaSchedule | None = None
    # Every tensor of the checkpoint by name: the layers that feed the BN layers (BN004
    # consults their filters, bnaudit.audit.producers).
    tensors: Mapping[str, TensorRef] = field(default_factory=dict)
    # BN layer -> the Conv/Linear module feeding it (bnaudit.audit.producers: from the model's
    # graph with --arch, else from the names; possibly lazy)
    producers: Mapping[str, str] = field(default_factory=dict)
    # the producers among them that are ConvTranspose (output channels on the weight's axis 1)
    transposed: frozenset[str] = frozenset()
    # Exported graphs (ONNX with BN nodes kept, .pt2): BN layer -> the weight of the node
    # feeding it, paired as `fold` pairs them (bnaudit.audit.fold.graph.exported_producers);
    # possibly lazy (bnaudit.audit.producers.LazyProducers)
    graph_producers: Mapping[str, ProducerFilter] = field(default_factory=dict)


@dataclass(frozen=True)
class Rule:
    """One rule: its code, documentation and checks.

    A rule reports one fact under one code, whichever command sees it: `check` speaks in
    inspect's reports, `diff_check` in diff's (a training-mode export node is BN012 in
    both). `aliases` are former codes of the same fact, accepted wherever a code is
    (select, ignore, per-layer-ignores, severity) when written in full.
    """

    code: str
    name: str
    severities: tuple[Severity, ...]  # what its findings can be, worst first
    summary: str
    explanation: str
    fix: str
    check: Callable[[RuleContext], Iterable[Finding]] | None = field(default=None, repr=False)
    diff_check: Callable[[DiffContext], Iterable[Finding]] | None = field(default=None, repr=False)
    fold_check: Callable[[FoldContext], Iterable[Finding]] | None = field(default=None, repr=False)
    settings: tuple[str, ...] = ()  # configuration keys (config.KEYS) that tune the rule
    aliases: tuple[str, ...] = ()
    fed_check: Callable[[FedContext], Iterable[Finding]] | None = field(default=None, repr=False)
    parity_check: Callable[[ParityContext], Iterable[Finding]] | None = field(default=None, repr=False)

    @property
    def severity(self) -> str:
        """The severities as `bnaudit rules` shows them: "error / warning" when it depends on the case."""
        return " / ".join(self.severities)

    @property
    def worst_severity(self) -> Severity:
        return max(self.severities)

    @property
    def commands(self) -> tuple[str, ...]:
        """The commands whose reports the rule speaks in: "inspect", "diff" (or both), "fold", "fed", "parity"."""
        return (
            ("inspect",) * (self.check is not None)
            + ("diff",) * (self.diff_check is not None)
            + ("fold",) * (self.fold_check is not None)
            + ("fed",) * (self.fed_check is not None)
            + ("parity",) * (self.parity_check is not None)
        )

    @property
    def command(self) -> str:
        """The first of `commands`."""
        return self.commands[0]

    def named_by(self, code: str) -> bool:
        """Whether a code or code prefix from the configuration names this rule: a prefix of
        its code, or one of its aliases in full (a prefix of an alias would drag a fact into
        another family: ignoring "BN1" must not silence inspect's BN012)."""
        return self.code.startswith(code) or code in self.aliases

    def configured_severity(self, overrides: Mapping[str, str]) -> Severity | None:
        """The severity the configuration's `severity` table sets for this rule, under its
        code or else under an alias; None when it sets none."""
        configured = next((overrides[c] for c in (self.code, *self.aliases) if c in overrides), None)
        return None if configured is None else Severity.parse(configured)

    def finding(
        self, severity: Severity, layer: str | None, message: str, channels: Iterable[int] = (), group_as: str = ""
    ) -> Finding:
        return Finding(self.code, self.name, severity, layer, message, tuple(int(c) for c in channels), group_as)


RULES: dict[str, Rule] = {}
# former code -> the code of the rule that now reports its fact
ALIASES: dict[str, str] = {}

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
    aliases: tuple[str, ...] = (),
) -> Callable[[_Check], _Check]:
    """Register a rule whose check speaks in `command`'s reports ("inspect", "diff", "fold", "fed" or "parity")."""
    severities = severity if isinstance(severity, tuple) else (severity,)

    def register(check: _Check) -> _Check:
        checks = {name: check if name == command else None for name in ("inspect", "diff", "fold", "fed", "parity")}
        _register(
            Rule(
                code, name, severities, summary, explanation, fix,
                checks["inspect"], checks["diff"], checks["fold"], settings, aliases,
                fed_check=checks["fed"], parity_check=checks["parity"],
            )
        )  # fmt: skip
        return check

    return register


def also_in(code: str, command: str) -> Callable[[_Check], _Check]:
    """Give the registered rule `code` a check for another command: the same fact seen
    from `command`'s reports, under the same code."""

    def register(check: _Check) -> _Check:
        existing = RULES[code]
        if command == "inspect":
            _register(replace(existing, check=check))
        else:
            _register(replace(existing, diff_check=check))
        return check

    return register


def _register(r: Rule) -> None:
    RULES[r.code] = r
    ALIASES.update(dict.fromkeys(r.aliases, r.code))
    # code order, whatever order the rule modules were imported in: the order of
    # `bnaudit rules` and of every report's findings
    ordered = sorted(RULES.items())
    RULES.clear()
    RULES.update(ordered)


def accepted_codes() -> list[str]:
    """Every code the configuration may name: the rules' codes and their aliases, in order."""
    return sorted([*RULES, *ALIASES])


def rule_for(code: str) -> Rule | None:
    """The rule `code` names (exactly, or as an alias), or None."""
    code = code.strip().upper()
    return RULES.get(ALIASES.get(code, code))


def three_digits(x: float) -> str:
    """A number in findings' messages: three significant digits."""
    return f"{x:.3g}"


def _selected(r: Rule, cfg: Config) -> bool:
    if cfg.select and not any(r.named_by(s) for s in cfg.select):
        return False
    return not any(r.named_by(i) for i in cfg.ignore)


@dataclass(frozen=True)
class _Planned:
    """A rule a command runs under a configuration, and what the configuration does to its
    findings: the severity it sets for the rule (None: the rule's own) and the layer-name
    globs whose findings of this rule are not reported."""

    rule: Rule
    check: Callable[[Any], Iterable[Finding]]
    severity: Severity | None
    ignored_layers: tuple[str, ...]


# command's check attribute -> (configuration, rules then registered, its plan): a folder scan
# audits every file under the same configuration, so the plan is made once
_PLANS: dict[str, tuple[Config, tuple[Rule, ...], list[_Planned]]] = {}


def _plan(check_attr: str, config: Config) -> list[_Planned]:
    """The selected rules that have a `check_attr` check, in rule order, as `config` applies them."""
    rules = tuple(RULES.values())
    cached = _PLANS.get(check_attr)
    if cached is not None and cached[0] is config and cached[1] == rules:
        return cached[2]
    plan = [
        _Planned(
            r,
            check,
            r.configured_severity(config.severity),
            tuple(p for p, codes in config.per_layer_ignores.items() if any(r.named_by(c) for c in codes)),
        )
        for r in rules
        if (check := getattr(r, check_attr)) is not None and _selected(r, config)
    ]
    _PLANS[check_attr] = (config, rules, plan)
    return plan


def _in_force(planned: _Planned, found: Iterable[Finding]) -> list[Finding]:
    """A rule's findings with per-layer ignores applied and the configuration's severity
    for the rule (set under its code, else under an alias) in force."""
    kept = [
        f for f in found if f.layer is None or not any(fnmatch.fnmatchcase(f.layer, p) for p in planned.ignored_layers)
    ]
    if planned.severity is None:
        return kept
    return [replace(f, severity=planned.severity) for f in kept]


def _run(check_attr: str, ctx: Any, config: Config) -> list[Finding]:
    """Every selected rule's findings for one command (`check_attr` names that command's
    check), in rule order, at the configured severity."""
    findings: list[Finding] = []
    for planned in _plan(check_attr, config):
        findings += _in_force(planned, planned.check(ctx))
    return findings


def run_rules(ctx: RuleContext) -> list[Finding]:
    """Every selected inspect rule's findings, in rule order, at the configured severity."""
    return _run("check", ctx, ctx.config)


def run_fold_rules(ctx: FoldContext) -> list[Finding]:
    """Every selected fold rule's findings, in rule order, at the configured severity."""
    return _run("fold_check", ctx, ctx.config)


def run_fed_rules(ctx: FedContext) -> list[Finding]:
    """Every selected fed rule's findings, in rule order, at the configured severity."""
    return _run("fed_check", ctx, ctx.config)


def run_diff_rules(ctx: DiffContext) -> list[Finding]:
    """Every selected diff rule's findings, in rule order, at the configured severity."""
    return _run("diff_check", ctx, ctx.config)


def run_parity_rules(ctx: ParityContext) -> list[Finding]:
    """Every selected parity rule's findings, in rule order, at the configured severity."""
    return _run("parity_check", ctx, ctx.config)

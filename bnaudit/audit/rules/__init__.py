"""The rules of bnaudit: the registry (`registry`) and one module of rules per subject.

Importing this package registers every rule: the inspect rules of a checkpoint's layers
(`checkpoint`, BN001-BN011, and `immature`, BN003) and of an exported graph (`graph`, BN012-BN014), the diff
rules between two checkpoints (`diff`, BN101-BN107) and between a checkpoint and its
export (`export`, BN108-BN114), what folding BN into its producer and then int8 or
half precision do (`fold`, BN201-BN207, `bnaudit fold`), how a federated server combined its
clients' statistics (`fed`, BN301-BN305, `bnaudit fed`), and where a deployed target stops
computing what the checkpoint computes (`parity`, BN401-BN403, `bnaudit parity`). The order of
the imports does not matter: `RULES` is kept in code order, the order of `bnaudit rules` and of
every report's findings.
"""

from bnaudit.audit.rules import checkpoint, diff, export, fed, fold, graph, immature, parity
from bnaudit.audit.rules.registry import (
    ALIASES,
    RULES,
    Finding,
    Rule,
    RuleContext,
    accepted_codes,
    rule,
    rule_for,
    run_diff_rules,
    run_fed_rules,
    run_fold_rules,
    run_parity_rules,
    run_rules,
)

__all__ = [
    "ALIASES",
    "RULES",
    "Finding",
    "Rule",
    "RuleContext",
    "accepted_codes",
    "checkpoint",
    "diff",
    "export",
    "fed",
    "fold",
    "graph",
    "immature",
    "parity",
    "rule",
    "rule_for",
    "run_diff_rules",
    "run_fed_rules",
    "run_fold_rules",
    "run_parity_rules",
    "run_rules",
]

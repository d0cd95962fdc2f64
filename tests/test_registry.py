"""The rule registry (bnaudit.audit.rules): complete and in code order whichever rule module
is imported first, every rule with a check, every alias naming a rule."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO

from bnaudit.audit.rules import ALIASES, RULES

pytestmark = pytest.mark.torchfree  # runs without torch (conftest.py)

MODULES = ("checkpoint", "graph", "diff", "export", "parity")


def test_rules_are_in_code_order():
    assert list(RULES) == sorted(RULES)
    assert list(RULES)[:3] == ["BN001", "BN002", "BN003"] and list(RULES)[-1] == "BN403"


def test_the_order_does_not_depend_on_which_rule_module_is_imported_first():
    expected = list(RULES)
    for first in reversed(MODULES):
        code = f"import bnaudit.audit.rules.{first}\nfrom bnaudit.audit.rules import RULES\nprint(' '.join(RULES))"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
        assert out.stdout.split() == expected, first


def test_every_rule_has_a_check_and_every_alias_a_rule():
    for code, rule in RULES.items():
        assert rule.code == code and rule.commands, code
    for alias, code in ALIASES.items():
        assert alias not in RULES and alias in RULES[code].aliases


def _two_layer_context(config):
    """Layers `a.bn` (near-eps channels: BN004) and `b.bn` (a NaN mean: BN005) under `config`."""
    import math

    from bnaudit.audit.layers import BNLayer, Discovery
    from bnaudit.audit.rules import RuleContext
    from bnaudit.audit.settings import stated_settings

    def layer(name, mean, var):
        return BNLayer(name, "BatchNorm", mean, var, [1.0] * 3, None, 100, "float32", stated_settings(None, None))

    near = layer("a.bn", [0.0, 0.0, 0.0], [0.0, 1e-7, 1.0])
    bad = layer("b.bn", [math.nan, 0.0, 0.0], [1.0, 1.0, 1.0])
    return RuleContext(Discovery([near, bad], [], []), config)


def test_each_configuration_gets_its_own_rules_severities_and_layer_ignores():
    """The rules, severities and per-layer ignores in force follow the configuration of each
    run, also when runs under different configurations alternate (the registry keeps what a
    configuration selects: kept for another, findings would be wrongly kept or dropped)."""
    import dataclasses

    from bnaudit.audit.rules import run_rules
    from bnaudit.config import Config
    from bnaudit.severity import Severity

    plain = Config()
    base = run_rules(_two_layer_context(plain))
    assert [(f.code, f.layer) for f in base] == [("BN004", "a.bn"), ("BN005", "b.bn")]
    configs = {
        "plain": (plain, base),
        "severity": (
            Config(severity={"BN005": Severity.INFO}),
            [dataclasses.replace(f, severity=Severity.INFO) if f.code == "BN005" else f for f in base],
        ),
        "layer ignore": (Config(per_layer_ignores={"a.*": ("BN004",)}), [f for f in base if f.code != "BN004"]),
        "other layer": (Config(per_layer_ignores={"b.*": ("BN004",)}), base),
        "select": (Config(select=("BN005",)), [f for f in base if f.code == "BN005"]),
        "ignore": (Config(ignore=("BN00",)), []),
    }
    for order in (list(configs), list(reversed(configs)), list(configs) * 2):
        for name in order:
            config, expected = configs[name]
            assert run_rules(_two_layer_context(config)) == expected, name

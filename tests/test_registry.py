"""The rule registry (bnaudit.audit.rules): complete and in code order whichever rule module
is imported first, every rule with a check, every alias naming a rule."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO

from bnaudit.audit.rules import ALIASES, RULES

MODULES = ("checkpoint", "graph", "diff", "export")


def test_rules_are_in_code_order():
    assert list(RULES) == sorted(RULES)
    assert list(RULES)[:3] == ["BN001", "BN002", "BN003"] and list(RULES)[-1] == "BN207"


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

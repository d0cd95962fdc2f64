"""Severity is a type: ordered by rank (info < warning < error), not by the alphabet, while
it still reads, compares and serialises as its name."""

from __future__ import annotations

import json

import pytest

from bnaudit.audit.rules import RULES, Finding
from bnaudit.config import Config, load_config, severity_rank
from bnaudit.errors import BnauditError
from bnaudit.severity import Severity

pytestmark = pytest.mark.torchfree  # runs without torch (conftest.py)


def test_severities_order_by_rank_not_by_name():
    # as strings "error" < "info" < "warning"; as severities info < warning < error
    assert sorted(["error", "info", "warning"]) == ["error", "info", "warning"]
    assert sorted([Severity.ERROR, Severity.INFO, Severity.WARNING]) == [
        Severity.INFO,
        Severity.WARNING,
        Severity.ERROR,
    ]
    assert max([Severity.INFO, Severity.ERROR, Severity.WARNING]) is Severity.ERROR
    assert Severity.WARNING > "info" and Severity.WARNING < "error"
    assert "info" < Severity.WARNING  # noqa: SIM300  a plain name on the left: the reflected comparison
    assert [s.rank for s in Severity] == [0, 1, 2]
    assert severity_rank("warning") == 1 and severity_rank(Severity.ERROR) == 2


def test_a_severity_reads_and_serialises_as_its_name():
    assert Severity.ERROR == "error" and str(Severity.WARNING) == "warning" and f"{Severity.INFO}" == "info"
    assert json.dumps({"severity": Severity.ERROR}) == '{"severity": "error"}'
    assert {"error": 1}[Severity.ERROR] == 1  # hashes as its name: dicts keyed by names still work


def test_parse_names_the_choices():
    assert Severity.parse("info") is Severity.INFO
    for bad in ("fatal", "Error", 2, None):
        with pytest.raises(ValueError, match="expected one of error, warning, info"):
            Severity.parse(bad)


def test_rules_and_configuration_hold_severities():
    assert RULES["BN003"].severities == (Severity.ERROR, Severity.WARNING)
    assert RULES["BN003"].severity == "error / warning"  # what `bnaudit rules` shows
    assert RULES["BN004"].worst_severity is Severity.ERROR and RULES["BN009"].worst_severity is Severity.INFO
    config = load_config({"--fail-on": "error"}, isolated=True, rule_codes=RULES)
    assert config.fail_on is Severity.ERROR and Config().fail_on is Severity.WARNING
    finding = RULES["BN008"].finding(Severity.WARNING, "bn", "m")
    assert isinstance(finding, Finding) and finding.severity is Severity.WARNING
    with pytest.raises(BnauditError, match="--fail-on: expected one of error, warning, info, got 'fatal'"):
        load_config({"--fail-on": "fatal"}, isolated=True, rule_codes=RULES)

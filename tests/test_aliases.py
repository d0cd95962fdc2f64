"""One code per fact: a training-mode export node is BN012 in inspect and in diff (diff's
former BN111 is an alias of it), and statistics that are not constants are BN013 in both.

The alias is accepted wherever a rule code is (select, ignore, per-layer-ignores, the
severity table, --select/--ignore), shown by `bnaudit rules`, and only in full: a prefix
of the alias ("BN1", "BN11") does not reach the inspect rule.
"""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
from conftest import REPO
from onnx import helper

from bnaudit.api import inspect
from bnaudit.audit.diff.checkpoints import diff
from bnaudit.audit.rules import ALIASES, RULES, accepted_codes
from bnaudit.config import Config, load_config
from bnaudit.errors import BnauditError
from bnaudit.severity import Severity

pytestmark = pytest.mark.torchfree  # runs without torch (conftest.py)

SAMPLES = Path(REPO) / "sample_models"
TRAINING = str(SAMPLES / "onnx" / "digits_training.onnx")  # healthy.pt exported in training mode
EVAL = SAMPLES / "onnx" / "digits.onnx"  # the same model exported in eval mode
CHECKPOINT = str(SAMPLES / "healthy.pt")
LAYERS = ["features.1", "features.4", "head.2"]  # the model's BN layers


def found(report) -> list[tuple[str, str, str | None]]:
    files = getattr(report, "files", None)
    findings = files[0].findings if files is not None else report.findings
    return [(f.code, f.severity, f.layer) for f in findings]


def test_bn111_is_an_alias_of_bn012_reported_by_both_commands():
    assert ALIASES == {"BN111": "BN012"}
    assert "BN111" not in RULES and RULES["BN012"].aliases == ("BN111",)
    assert RULES["BN012"].commands == ("inspect", "diff") and RULES["BN013"].commands == ("inspect", "diff")
    assert RULES["BN113"].severities == (Severity.WARNING,)  # its info part is BN013's now
    assert "BN111" in accepted_codes() and "BN012" in accepted_codes()


def test_inspect_and_diff_report_a_training_mode_node_under_one_code():
    inspected = [c for c in found(inspect(TRAINING, Config())) if c[0] == "BN012"]
    diffed = [c for c in found(diff(CHECKPOINT, TRAINING, Config())) if c[0] in ("BN012", "BN111")]
    assert inspected == diffed == [("BN012", "error", layer) for layer in LAYERS]


def test_the_alias_ignores_and_selects_the_rule_in_both_commands():
    for run in (lambda c: inspect(TRAINING, c), lambda c: diff(CHECKPOINT, TRAINING, c)):
        assert not [c for c in found(run(Config(ignore=("BN111",)))) if c[0] == "BN012"]
        assert {c[0] for c in found(run(Config(select=("BN111",))))} == {"BN012"}
        kept = found(run(Config(per_layer_ignores={"features.*": ("BN111",)})))
        assert [c for c in kept if c[0] == "BN012"] == [("BN012", "error", "head.2")]
        lowered = found(run(Config(severity={"BN111": Severity.WARNING})))
        assert [c for c in lowered if c[0] == "BN012"] == [("BN012", "warning", layer) for layer in LAYERS]


def test_a_prefix_of_the_alias_does_not_reach_the_inspect_rule():
    # "BN1" ignores diff's rules (BN101-BN114); BN012 is an inspect code and stays
    assert [c[0] for c in found(inspect(TRAINING, Config(ignore=("BN1",))))] == ["BN012"] * 3
    assert [c[0] for c in found(diff(CHECKPOINT, TRAINING, Config(ignore=("BN11",))))].count("BN012") == 3


def test_the_configuration_accepts_the_alias_and_still_refuses_unknown_codes(tmp_path):
    path = tmp_path / "bnaudit.toml"
    path.write_text('ignore = ["BN111"]\nper-layer-ignores = {"head.*" = ["BN111"]}\n[severity]\nBN111 = "info"\n')
    config = load_config(config_file=path, rule_codes=accepted_codes())
    assert config.ignore == ("BN111",) and config.severity == {"BN111": "info"}
    with pytest.raises(BnauditError, match="unknown rule code 'BN115'"):
        load_config({"--ignore": ["BN115"]}, isolated=True, rule_codes=accepted_codes())


def test_cli_select_ignore_and_severity_through_the_alias(cli, tmp_path):
    result = cli("inspect", TRAINING, "--isolated", "--ignore", "BN111")
    assert result.exit_code == 0, result.stdout
    result = cli("diff", CHECKPOINT, TRAINING, "--isolated", "--select", "BN111", "--format", "json")
    assert result.exit_code == 1
    assert [f["code"] for f in json.loads(result.stdout)["findings"]] == ["BN012"] * 3
    config = tmp_path / "bnaudit.toml"
    config.write_text('[severity]\nBN111 = "info"\n')
    result = cli("inspect", TRAINING, "--config", str(config), "--fail-on", "warning", "--format", "json")
    assert result.exit_code == 0  # the only findings, BN012, are info through the alias
    assert {f["severity"] for f in json.loads(result.stdout)["files"][0]["findings"]} == {"info"}


def test_rules_lists_the_alias_and_explains_it_as_its_rule(cli):
    listing = cli("rules", width=400).stdout.splitlines()
    (row,) = [line for line in listing if line.startswith("BN111")]
    assert [c.strip() for c in row.split("│")][:3] == ["BN111", "alias of BN012", "error / warning"]
    explained = cli("rules", "bn111", width=120)
    assert explained.exit_code == 0
    assert explained.stdout.startswith("BN012 training-mode-export\ndefault severity: error / warning\nalias: BN111 ")


def test_statistics_that_are_not_constants_are_bn013_in_diff_too(tmp_path):
    model = onnx.load(str(EVAL))
    node = next(n for n in model.graph.node if n.op_type == "BatchNormalization")
    name = node.input[3]  # input_mean of the first BN node becomes a graph input
    tensor = next(t for t in model.graph.initializer if t.name == name)
    model.graph.initializer.remove(tensor)
    model.graph.input.append(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, list(tensor.dims)))
    path = tmp_path / "fed.onnx"
    onnx.save(model, str(path))
    inspected = [c for c in found(inspect(str(path), Config())) if c[0] == "BN013"]
    diffed = found(diff(CHECKPOINT, str(path), Config()))
    assert (
        inspected == [c for c in diffed if c[0] == "BN013"] == [("BN013", "info", "features.1")]
    )  # the layer named (issue 21)
    # BN113 keeps its own fact only: the checkpoint layer that could not be paired
    assert [c for c in diffed if c[0] == "BN113"] == [("BN113", "warning", "features.1")]

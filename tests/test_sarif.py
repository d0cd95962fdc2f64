"""`--format sarif`: a SARIF 2.1.0 log valid against the OASIS schema, in the shape GitHub
code scanning reads (driver and rules, results with level, message, physical and logical
locations, fingerprints), with paths relative to the current directory.

tests/data/sarif-schema-2.1.0.json is the OASIS schema, errata01 (oasis-tcs/sarif-spec,
Schemata/sarif-schema-2.1.0.json), committed so the test needs no network.
"""

from __future__ import annotations

import copy
import json
import os
from urllib.parse import urlparse

import jsonschema
import pytest
import torch
from conftest import bn_entries, save_safetensors, save_torch

from bnaudit import __version__
from bnaudit.api import inspect
from bnaudit.audit.rules import RULES
from bnaudit.config import Config
from bnaudit.output.sarif import inspect_to_sarif

SCHEMA_PATH = os.path.join(os.path.dirname(__file__), "data", "sarif-schema-2.1.0.json")


@pytest.fixture(scope="module")
def validator():
    with open(SCHEMA_PATH, encoding="utf-8") as fh:
        schema = json.load(fh)
    jsonschema.Draft4Validator.check_schema(schema)
    return jsonschema.Draft4Validator(schema, format_checker=jsonschema.FormatChecker())


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    """models/two bad.pt: BN004 in two layers (one near-eps channel each, gain 316: warning)
    and BN010 (counters 100 and 1000: a file-level info); models/good.safetensors: healthy;
    models/junk.pt: unreadable (a zip that breaks off: it claims a format, so a folder scan
    reports it instead of skipping it). The current directory is the workspace."""
    models = tmp_path / "models"
    models.mkdir()
    var = torch.tensor([0.0, 1.0, 1.0])
    mean = torch.tensor([0.0, 0.5, -0.5])  # channel 0 dead: mean 0 and var 0
    save_torch(
        {
            **bn_entries("a.bn", 3, mean=mean, var=var, weight=torch.ones(3), counter=100),
            **bn_entries("b.bn", 3, mean=mean, var=var, weight=torch.ones(3), counter=100),
            **bn_entries("c.bn", 3, counter=1000),
        },
        models / "two bad.pt",
    )
    save_safetensors(bn_entries("bn", 4, counter=1000), models / "good.safetensors")
    (models / "junk.pt").write_bytes(b"PK\x03\x04not a checkpoint")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def sarif_of(*paths: str, config: Config | None = None) -> dict:
    return inspect_to_sarif(inspect(list(paths), config or Config()))


def uris(node, key=None):
    """Every (key, value) of a URI-valued property in a SARIF log."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from uris(v, k)
    elif isinstance(node, list):
        for v in node:
            yield from uris(v, key)
    elif key in ("uri", "informationUri", "$schema"):
        yield key, node


def test_log_is_valid_against_the_sarif_schema(workspace, validator):
    log = sarif_of("models")
    errors = sorted(validator.iter_errors(log), key=str)
    assert errors == []
    assert log["version"] == "2.1.0" and len(log["runs"]) == 1
    # jsonschema checks "uri" formats only with an optional package: check them here
    found = list(uris(log))
    assert {k for k, _ in found} == {"uri", "informationUri", "$schema"}
    for key, value in found:
        assert not any(c.isspace() or c == "\\" for c in value), value
        if key != "uri":
            assert urlparse(value).scheme == "https" and urlparse(value).netloc, value


def test_schema_validation_is_live(workspace, validator):
    log = sarif_of("models")
    broken = copy.deepcopy(log)
    broken["runs"][0]["results"][0]["level"] = "info"  # SARIF calls it "note"
    assert not validator.is_valid(broken)
    broken = copy.deepcopy(log)
    del broken["runs"][0]["tool"]["driver"]["name"]
    assert not validator.is_valid(broken)


def test_driver_describes_bnaudit_and_every_rule(workspace):
    driver = sarif_of("models")["runs"][0]["tool"]["driver"]
    assert driver["name"] == "bnaudit" and driver["version"] == __version__
    assert driver["informationUri"].startswith("https://")
    assert [r["id"] for r in driver["rules"]] == list(RULES)
    levels = {"error": "error", "warning": "warning", "info": "note"}
    for descriptor in driver["rules"]:
        rule = RULES[descriptor["id"]]
        assert descriptor["name"] == rule.name
        assert descriptor["shortDescription"]["text"] == rule.summary
        assert descriptor["fullDescription"]["text"] == rule.explanation
        assert (
            rule.fix.split()[0] in descriptor["help"]["text"] and "How to silence it" in descriptor["help"]["markdown"]
        )
        first = rule.severity.split("/")[0].strip()  # the rules list their worst severity first
        assert descriptor["defaultConfiguration"]["level"] == levels[first]
    by_id = {r["id"]: r for r in driver["rules"]}
    assert by_id["BN004"]["defaultConfiguration"]["level"] == "error"  # a live channel's gain
    assert by_id["BN009"]["defaultConfiguration"]["level"] == "note"
    assert by_id["BN001"]["defaultConfiguration"]["level"] == "error"


def test_results_carry_rule_level_message_and_locations(workspace):
    run = sarif_of("models")["runs"][0]
    results = run["results"]
    assert [(r["ruleId"], r["level"]) for r in results] == [
        ("BN004", "warning"),
        ("BN004", "warning"),
        ("BN010", "note"),
    ]
    rule_ids = [r["id"] for r in run["tool"]["driver"]["rules"]]
    assert all(rule_ids[r["ruleIndex"]] == r["ruleId"] for r in results)
    for result in results:
        (location,) = result["locations"]
        assert location["physicalLocation"]["artifactLocation"] == {
            "uri": "models/two%20bad.pt",
            "uriBaseId": "%SRCROOT%",
        }
        assert "region" not in location["physicalLocation"]  # a binary file has no lines
    a, b, counters = results
    assert a["locations"][0]["logicalLocations"] == [{"name": "a.bn", "fullyQualifiedName": "a.bn", "kind": "module"}]
    assert b["locations"][0]["logicalLocations"][0]["name"] == "b.bn"
    assert a["message"]["text"].startswith("a.bn: 1 channel with running_var < 10*eps")
    assert a["properties"] == {"channels": [0]}
    assert "logicalLocations" not in counters["locations"][0]  # a file-level finding
    assert counters["message"]["text"].startswith("num_batches_tracked differs between layers")
    fingerprints = [r["partialFingerprints"]["bnauditFinding/v1"] for r in results]
    assert len(set(fingerprints)) == 3  # same rule, same file, different layers: distinct alerts
    assert fingerprints == [
        r["partialFingerprints"]["bnauditFinding/v1"] for r in sarif_of("models")["runs"][0]["results"]
    ]
    assert run["originalUriBaseIds"]["%SRCROOT%"]["uri"] == workspace.as_uri() + "/"


def test_unreadable_file_is_a_failed_execution_notification(workspace):
    invocation = sarif_of("models")["runs"][0]["invocations"][0]
    assert invocation["executionSuccessful"] is False
    (notification,) = invocation["toolExecutionNotifications"]
    assert notification["level"] == "error" and notification["message"]["text"].startswith("models/junk.pt: ")
    assert notification["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] == "models/junk.pt"
    healthy = sarif_of("models/good.safetensors")["runs"][0]
    assert healthy["invocations"][0] == {"executionSuccessful": True, "toolExecutionNotifications": []}
    assert healthy["results"] == []


def test_path_outside_the_current_directory_is_an_absolute_file_uri(workspace, tmp_path_factory, validator):
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    path = save_torch(bn_entries("x.bn", 2, counter=3), elsewhere / "young.pt")  # BN003
    log = sarif_of(path)
    (result,) = log["runs"][0]["results"]
    assert result["locations"][0]["physicalLocation"]["artifactLocation"] == {"uri": (elsewhere / "young.pt").as_uri()}
    assert validator.is_valid(log)


def test_effective_config_is_recorded_and_selection_applies(workspace):
    config = Config(ignore=("BN010",), max_gain=500.0)
    run = sarif_of("models", config=config)["runs"][0]
    assert run["properties"]["config"]["ignore"] == ["BN010"] and run["properties"]["config"]["max-gain"] == 500.0
    # gain 316 < 500: BN004 drops to info, which SARIF calls note; BN010 is ignored
    assert [(r["ruleId"], r["level"]) for r in run["results"]] == [("BN004", "note"), ("BN004", "note")]


def test_cli_format_sarif_and_exit_codes(cli, workspace, validator):
    result = cli("inspect", "models/two bad.pt", "--format", "sarif", "--isolated")
    assert result.exit_code == 1  # BN004 warnings at fail-on warning
    log = json.loads(result.stdout)
    assert validator.is_valid(log) and len(log["runs"][0]["results"]) == 3
    assert cli("inspect", "models/two bad.pt", "--format", "sarif", "--exit-zero").exit_code == 0
    # issue #12: --exit-zero is 0 for an unreadable file a folder scan found (still reported
    # as an error notification), 2 for an unreadable file the user named
    unreadable = cli("inspect", "models", "--format", "sarif", "--exit-zero")
    assert unreadable.exit_code == 0 and validator.is_valid(log := json.loads(unreadable.stdout))
    assert [n["level"] for n in log["runs"][0]["invocations"][0]["toolExecutionNotifications"]] == ["error"]
    assert log["runs"][0]["invocations"][0]["executionSuccessful"] is False
    assert cli("inspect", "models", "--format", "sarif").exit_code == 2
    named = cli("inspect", "models/junk.pt", "--format", "sarif", "--exit-zero")
    assert named.exit_code == 2 and validator.is_valid(json.loads(named.stdout))


def test_severity_overrides_set_result_and_rule_levels(workspace):
    # the configuration re-rates BN004 (warning by its own logic here) and BN010 (info)
    config = Config(severity={"BN004": "info", "BN010": "error"})
    run = sarif_of("models", config=config)["runs"][0]
    assert [(r["ruleId"], r["level"]) for r in run["results"]] == [
        ("BN004", "note"),
        ("BN004", "note"),
        ("BN010", "error"),
    ]
    by_id = {r["id"]: r for r in run["tool"]["driver"]["rules"]}
    assert by_id["BN004"]["defaultConfiguration"]["level"] == "note"
    assert by_id["BN010"]["defaultConfiguration"]["level"] == "error"
    assert "configured severity: error" in by_id["BN010"]["help"]["text"]
    assert run["properties"]["config"]["severity"] == {"BN004": "info", "BN010": "error"}


def test_fold_log_is_valid_and_puts_every_finding_at_the_checkpoint(tmp_path, monkeypatch, validator, cli):
    """`bnaudit fold --format sarif`: a schema-valid log whose results are the fold findings
    (BN201-BN207) at the checkpoint's file, the driver's levels at the configured severities."""
    from bnaudit.audit.fold.predict import predict_fold

    monkeypatch.chdir(tmp_path)
    # one channel with var 1e-6 beside channels of var 1: its eval gain 1/sqrt(1e-6 + 1e-5)
    # = 302 sets the int8 scale of the folded conv, which collapses the others
    state = {"conv.weight": torch.full((4, 3, 1, 1), 0.1)}
    state.update(bn_entries("bn", 4, var=torch.tensor([1e-6, 1.0, 1.0, 1.0]), counter=1000))
    path = save_torch(state, tmp_path / "model.pt")
    config = Config(severity={"BN201": "info"})
    report = predict_fold(path, config)
    assert report.findings, "the fixture must give fold findings"
    log = to_sarif_of(report)
    assert validator.is_valid(log), sorted(validator.iter_errors(log), key=str)[:1]
    run = log["runs"][0]
    assert [r["ruleId"] for r in run["results"]] == [f.code for f in report.findings]
    assert {r["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] for r in run["results"]} == {"model.pt"}
    levels = {rule["id"]: rule["defaultConfiguration"]["level"] for rule in run["tool"]["driver"]["rules"]}
    assert levels["BN201"] == "note"
    result = cli("fold", "model.pt", "--format", "sarif", "--isolated")
    assert result.exit_code == 1, result.output
    assert [r["ruleId"] for r in json.loads(result.stdout)["runs"][0]["results"]] == [
        f.code for f in predict_fold(path, Config()).findings
    ]


def to_sarif_of(report) -> dict:
    from bnaudit.output import emitter

    return emitter(report, "sarif")(report)

"""inspect, diff, rules and fold's prediction on the committed samples, end to end through
the CLI: part of the torch-free tier (marker `torchfree`), which CI also runs on Python 3.12
and 3.13 in environments without torch.

Each sample was broken in one known way by sample_models/generate.py (its name says how):
the reports must name exactly that, and the machine-read formats must hold the same
findings, valid for their consumers.
"""

from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET

import jsonschema
import pytest
from conftest import REPO

pytestmark = pytest.mark.torchfree

# sample (under sample_models/) -> the rules its report names: the defect generate.py gave it,
# none for the healthy ones and their exports. The files of a training-run folder that are not
# model weights (optimizer, scheduler, RNG state, arguments) and the data files are skipped.
EXPECTED = {
    "converted.safetensors": {"BN009"},  # counter 0 beside trained statistics
    "dead_channel.safetensors": {"BN004"},
    "ema_container.pth": set(),
    "finetuned.pt": set(),  # its defect is relative to pretrained: `diff` finds it
    "fp16_buffers.safetensors": {"BN008"},
    "healthy.pt": set(),
    "healthy.safetensors": set(),
    "immature.pt": {"BN003"},
    "inception_channel.safetensors": {"BN004"},
    "missing_var.pt": {"BN001"},
    "nan_stats.pt": {"BN005"},
    "partially_frozen.pt": {"BN010"},
    "pretrained.safetensors": set(),
    "reset_stats.pt": {"BN002"},
    "traced_train.pt": {"BN012"},  # traced in training mode
    "checkpoint-3/model.safetensors": set(),
    "dcp": set(),
    "lightning/last.ckpt": set(),
    "onnx/digits.onnx": set(),
    "onnx/digits_training.onnx": {"BN012"},
    "onnx/folded.onnx": {"BN014"},
    "pt2/eval.pt2": set(),
    "pt2/training.pt2": {"BN012"},
    "sharded/model.safetensors.index.json": set(),
    "swa/live.pt": set(),
    "swa/swa.pt": set(),
    "swa/swa_bn.pt": set(),
    # federated learning: two clients and a global that averaged them (`fed` finds how)
    "federated/client1.safetensors": set(),
    "federated/client2.safetensors": set(),
    "federated/global.safetensors": set(),
}
SKIPPED = {
    "checkpoint-3/optimizer.pt",
    "checkpoint-3/rng_state.pth",
    "checkpoint-3/scheduler.pt",
    "checkpoint-3/training_args.bin",
    "data/digits_calib.safetensors",
    "data/digits_val.safetensors",
    "federated/client1_data.safetensors",
    "federated/client2_data.safetensors",
}
SEVERITY = {
    ("reset_stats.pt", "BN002"): "error",
    ("dead_channel.safetensors", "BN004"): "error",
    ("fp16_buffers.safetensors", "BN008"): "warning",
    ("converted.safetensors", "BN009"): "info",
}


@pytest.fixture
def run(cli, monkeypatch):
    """The CLI run from the repository root, so that reports name `sample_models/...`."""
    monkeypatch.chdir(REPO)
    return cli


def findings_by_file(report: dict) -> dict[str, set[str]]:
    return {
        f["path"].removeprefix("sample_models/"): {x["code"] for x in f["findings"]}
        for f in report["files"]
        if f["skipped"] is None
    }


def test_inspect_names_each_samples_defect_and_skips_what_is_not_model_weights(run):
    result = run("inspect", "sample_models", "--format", "json")
    assert result.exit_code == 1, result.output  # errors among the findings
    report = json.loads(result.stdout)
    assert findings_by_file(report) == EXPECTED
    skipped = {f["path"].removeprefix("sample_models/") for f in report["files"] if f["skipped"] is not None}
    assert skipped == SKIPPED
    assert not any(f["error"] for f in report["files"])
    severity = {
        (f["path"].removeprefix("sample_models/"), x["code"]): x["severity"]
        for f in report["files"]
        for x in f["findings"]
    }
    assert {at: severity[at] for at in SEVERITY} == SEVERITY
    # every reader took part: torch.save zip, TorchScript, safetensors, shards, DCP, ONNX, .pt2
    formats = {f["format"] for f in report["files"] if f["skipped"] is None}
    assert formats == {"torch-zip", "torchscript", "safetensors", "dcp", "onnx", "pt2"}
    assert run("inspect", "sample_models", "--format", "json", "--exit-zero").exit_code == 0


def test_inspect_reports_in_sarif_gitlab_and_junit_hold_the_same_findings(run):
    with open(os.path.join(REPO, "tests", "data", "sarif-schema-2.1.0.json"), encoding="utf-8") as fh:
        sarif_schema = json.load(fh)
    with open(os.path.join(REPO, "tests", "data", "gitlab-codeclimate-schema.json"), encoding="utf-8") as fh:
        gitlab_schema = json.load(fh)
    expected = sorted((f"sample_models/{path}", code) for path, codes in EXPECTED.items() for code in codes)
    report = json.loads(run("inspect", "sample_models", "--format", "json", "--exit-zero").stdout)
    severity = {(f["path"], x["code"]): x["severity"] for f in report["files"] for x in f["findings"]}

    sarif = json.loads(run("inspect", "sample_models", "--format", "sarif", "--exit-zero").stdout)
    jsonschema.Draft4Validator(sarif_schema).validate(sarif)
    (sarif_run,) = sarif["runs"]
    results = {
        (r["locations"][0]["physicalLocation"]["artifactLocation"]["uri"], r["ruleId"]): r["level"]
        for r in sarif_run["results"]
    }
    assert sorted(results) == expected
    assert results == {at: {"info": "note"}.get(level, level) for at, level in severity.items()}

    gitlab = json.loads(run("inspect", "sample_models", "--format", "gitlab", "--exit-zero").stdout)
    validator = jsonschema.Draft7Validator(gitlab_schema)
    for issue in gitlab:
        validator.validate(issue)
    assert sorted({(i["location"]["path"], i["check_name"]) for i in gitlab}) == expected

    junit = ET.fromstring(run("inspect", "sample_models", "--format", "junit", "--exit-zero").stdout)
    failed = {(case.get("classname"), f.get("type")) for case in junit.iter("testcase") for f in case.iter("failure")}
    # fail-on warning: errors and warnings are failures, infos only test output
    assert sorted(failed) == sorted(at for at, level in severity.items() if level != "info")
    assert set(severity.values()) == {"error", "warning", "info"}


def test_diff_finds_the_frozen_backbone_whose_statistics_kept_updating(run):
    result = run("diff", "sample_models/pretrained.safetensors", "sample_models/finetuned.pt", "--format", "json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert [(f["code"], f["layer"]) for f in report["findings"]] == [("BN101", "features.1"), ("BN101", "features.4")]
    assert report["summary"]["frozen_but_updating"] == 2 and report["summary"]["trained"] == 1
    # a checkpoint against its own ONNX export: nothing changed
    same = run("diff", "sample_models/healthy.pt", "sample_models/onnx/digits.onnx", "--format", "json")
    assert same.exit_code == 0, same.output
    assert json.loads(same.stdout)["findings"] == []


def test_fold_predicts_the_int8_range_one_collapsed_channel_takes(run):
    # dead_channel: channel 3 of features.4 has running_var 2e-07, so after folding its gain
    # sets the per-tensor int8 scale and the other 15 channels keep too few levels
    result = run("fold", "sample_models/dead_channel.safetensors", "--format", "json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    coarse = [f for f in report["findings"] if f["code"] == "BN202"]
    assert [(f["layer"], f["channels"]) for f in coarse] == [("features.4", [c for c in range(16) if c != 3])]
    assert "set by channel 3" in coarse[0]["message"]
    healthy = run("fold", "sample_models/healthy.pt", "--format", "json")
    assert healthy.exit_code == 0, healthy.output
    assert json.loads(healthy.stdout)["findings"] == []


def test_rules_lists_every_code_the_reports_use_and_explains_one(run):
    listing = run("rules", width=200)
    assert listing.exit_code == 0, listing.output
    for code in {c for codes in EXPECTED.values() for c in codes} | {"BN101", "BN202"}:
        assert f"\n{code} " in listing.stdout, code
    page = run("rules", "BN004")
    assert page.exit_code == 0 and "near-eps-variance" in page.stdout

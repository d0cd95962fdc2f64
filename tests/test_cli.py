"""The inspect command end to end: table, JSON document, exit codes, several files."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import REPO, SAMPLES, bn_entries, save_safetensors, save_torch

from bnaudit import __version__


@pytest.fixture
def hand_made(tmp_path):
    """One layer whose every table cell is hand arithmetic: C=3, t=10 (0.9^10 = 34.9%: a
    BN003 warning), mean in [-1, 2], var 0 / 1 / 4, one dead near-eps channel (mean 0 and
    var 0: a BN004 warning) with gain 1/sqrt(1e-5) = 316."""
    state = bn_entries(
        "encoder.bn",
        3,
        mean=torch.tensor([0.0, -1.0, 2.0]),
        var=torch.tensor([0.0, 1.0, 4.0]),
        weight=torch.ones(3),
        bias=torch.tensor([0.1, 0.2, 0.3]),
        counter=10,
    )
    return save_torch(state, tmp_path / "hand.pt")


def test_table_shows_each_statistic_of_the_layer(cli, hand_made):
    result = cli("inspect", hand_made, width=200)
    assert result.exit_code == 1
    out = result.stdout
    row = next(line for line in out.splitlines() if line.startswith("encoder.bn"))
    cells = [c.strip() for c in row.split("│")]
    assert cells[:8] == ["encoder.bn", "3", "10", "[-1, 2]", "0 / 1 / 4", "1", "316", "warning"]
    assert "BN003 immature-stats" in out and "34.9%" in out
    assert "BN004 near-eps-variance" in out and "gain 316.2" in out
    assert "eps 1e-05 and momentum 0.1 assumed" in out
    assert "1 file, 1 BN layer: 0 errors, 2 warnings, 0 infos" in out


def test_json_document_has_the_documented_shape(cli, hand_made):
    result = cli("inspect", hand_made, "--format", "json")
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert doc["version"] == __version__
    assert doc["summary"] == {
        "files": 1,
        "state_dicts": 1,
        "layers": 1,
        "errors": 0,
        "warnings": 2,
        "infos": 0,
        "unreadable": 0,
        "excluded": 0,
    }
    (file,) = doc["files"]
    assert file["path"] == hand_made and file["format"] == "torch-zip" and file["key"] is None and file["error"] is None
    (layer,) = file["layers"]
    assert layer["name"] == "encoder.bn" and layer["num_features"] == 3 and layer["num_batches_tracked"] == 10
    assert layer["eps"] == 1e-5 and layer["momentum"] == 0.1
    assert layer["mean"] == {"min": -1.0, "max": 2.0}
    assert layer["var"] == {"min": 0.0, "median": 1.0, "max": 4.0}
    assert layer["near_eps_channels"] == 1
    assert layer["max_eval_gain"] == pytest.approx(1 / (1e-5) ** 0.5, rel=1e-6)
    assert [(f["code"], f["name"], f["severity"], f["layer"]) for f in file["findings"]] == [
        ("BN003", "immature-stats", "warning", "encoder.bn"),
        ("BN004", "near-eps-variance", "warning", "encoder.bn"),
    ]
    assert file["findings"][1]["channels"] == [0]
    assert doc["config"]["fail-on"] == "warning"


def test_json_writes_non_finite_numbers_as_null(cli, tmp_path):
    state = bn_entries("bn", 2, mean=torch.tensor([float("nan"), float("nan")]), var=torch.tensor([float("inf"), 1.0]))
    result = cli("inspect", save_torch(state, tmp_path / "n.pt"), "--format", "json")

    def reject(constant):
        raise AssertionError(f"non-strict JSON constant {constant}")

    layer = json.loads(result.stdout, parse_constant=reject)["files"][0]["layers"][0]
    assert layer["mean"] == {"min": None, "max": None} and layer["var"]["max"] is None
    assert result.exit_code == 1


@pytest.mark.parametrize("fail_on,expected", [("error", 0), ("warning", 1), ("info", 1)])
def test_fail_on_sets_the_threshold(cli, hand_made, fail_on, expected):
    assert cli("inspect", hand_made, "--fail-on", fail_on).exit_code == expected


def test_info_findings_fail_only_with_fail_on_info(cli, tmp_path):
    path = save_torch(bn_entries("a", 4, counter=0), tmp_path / "c.pt")  # BN009 info only
    assert cli("inspect", path).exit_code == 0
    assert cli("inspect", path, "--fail-on", "info").exit_code == 1


def test_exit_zero_overrides_findings_but_not_errors(cli, hand_made, tmp_path):
    assert cli("inspect", hand_made, "--exit-zero").exit_code == 0
    assert cli("inspect", hand_made, str(tmp_path / "missing.pt"), "--exit-zero").exit_code == 2


def test_unreadable_file_is_reported_and_the_others_still_audited(cli, hand_made, tmp_path):
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"this is not a checkpoint")
    healthy = save_safetensors(bn_entries("bn", 4), tmp_path / "ok.safetensors")
    result = cli("inspect", str(junk), healthy, hand_made, "--format", "json")
    assert result.exit_code == 2  # 2 wins over the findings' 1
    doc = json.loads(result.stdout)
    assert [f["error"] is not None for f in doc["files"]] == [True, False, False]
    assert "not a checkpoint" in doc["files"][0]["error"]
    assert len(doc["files"][2]["findings"]) == 2
    assert result.stderr == ""  # said once: in the document


def test_directory_expands_to_checkpoint_suffixes_in_sorted_order(cli, tmp_path):
    (tmp_path / "sub").mkdir()
    save_torch(bn_entries("a", 2), tmp_path / "b.pth")
    save_safetensors(bn_entries("a", 2), tmp_path / "sub" / "a.safetensors")
    save_torch(bn_entries("a", 2), tmp_path / "c.ckpt")
    (tmp_path / "notes.txt").write_text("not audited")
    doc = json.loads(cli("inspect", str(tmp_path), "--format", "json").stdout)
    assert [os.path.relpath(f["path"], tmp_path) for f in doc["files"]] == [
        "b.pth",
        "c.ckpt",
        os.path.join("sub", "a.safetensors"),
    ]


def test_explicit_file_is_read_whatever_its_name(cli, tmp_path):
    path = save_torch(bn_entries("a", 2), tmp_path / "weights.data")
    doc = json.loads(cli("inspect", path, "--format", "json").stdout)
    assert doc["files"][0]["layers"][0]["name"] == "a"


def test_key_option_chooses_the_state_dict(cli, tmp_path):
    path = save_torch({"model": bn_entries("a", 2), "model_ema": bn_entries("b", 2)}, tmp_path / "c.pth")
    doc = json.loads(cli("inspect", path, "--key", "model_ema", "--format", "json").stdout)
    assert doc["files"][0]["key"] == "model_ema" and doc["files"][0]["layers"][0]["name"] == "b"
    assert doc["files"][0]["other_keys"] == ["model"]


@pytest.mark.parametrize(
    "option,value,problem",
    [
        ("--eps", "-1", "expected a positive number, got -1.0"),
        ("--eps", "0", "expected a positive number, got 0.0"),
        ("--eps", "nan", "expected a finite number, got nan"),
        ("--momentum", "1.5", "expected a number in [0, 1], got 1.5"),
        ("--momentum", "-0.1", "expected a number in [0, 1], got -0.1"),
    ],
)
def test_bad_option_values_are_one_line_errors(cli, hand_made, option, value, problem):
    # checked where the configuration parses them, with the words a bnaudit.toml value gets
    result = cli("inspect", hand_made, option, value)
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [f"bnaudit: error: {option}: {problem}"]
    as_json = cli("inspect", hand_made, option, value, "--format", "json")
    assert as_json.exit_code == 2 and json.loads(as_json.stdout) == {"error": f"{option}: {problem}"}


def test_a_bad_fail_on_is_refused(cli, hand_made):
    assert cli("inspect", hand_made, "--fail-on", "fatal").exit_code == 2


def test_version_and_help(cli):
    assert cli("--version").stdout.strip() == f"bnaudit {__version__}"
    assert "inspect" in cli("--help").stdout


def test_sample_models_show_every_rule(cli):
    doc = json.loads(cli("inspect", SAMPLES, "--format", "json").stdout)
    by_file = {os.path.basename(f["path"]): {x["code"] for x in f["findings"]} for f in doc["files"]}
    assert by_file["healthy.pt"] == set() and by_file["healthy.safetensors"] == set()
    assert by_file["ema_container.pth"] == set()
    assert by_file["missing_var.pt"] == {"BN001"}
    assert by_file["reset_stats.pt"] == {"BN002"}
    assert by_file["immature.pt"] == {"BN003"}
    assert by_file["dead_channel.safetensors"] == {"BN004"}
    assert by_file["inception_channel.safetensors"] == {"BN004"}  # bnaudit fold's sample
    assert by_file["nan_stats.pt"] == {"BN005"}
    assert by_file["fp16_buffers.safetensors"] == {"BN008"}
    assert by_file["converted.safetensors"] == {"BN009"}
    assert by_file["partially_frozen.pt"] == {"BN010"}
    assert by_file["digits.onnx"] == set()  # sample_models/onnx/: the healthy model exported in eval mode
    assert by_file["digits_training.onnx"] == {"BN012"}  # ... and in training mode
    assert by_file["eval.pt2"] == set()  # sample_models/pt2/: torch.export.export(model.eval())
    assert by_file["training.pt2"] == {"BN012"}  # ... and from model.train()


@pytest.mark.slow
def test_installed_executable_runs_in_a_subprocess(hand_made):
    exe = shutil.which("bnaudit")
    if exe is None:
        pytest.skip("bnaudit is not installed on PATH (pip install -e .)")
    proc = subprocess.run([exe, "inspect", hand_made, "--format", "json"], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 1
    assert json.loads(proc.stdout)["summary"]["warnings"] == 2


@pytest.mark.slow
def test_python_dash_m_runs_in_a_subprocess(tmp_path):
    path = save_safetensors(bn_entries("bn", 4), tmp_path / "ok.safetensors")
    proc = subprocess.run([sys.executable, "-m", "bnaudit", "inspect", path], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert "0 errors, 0 warnings" in proc.stdout


@pytest.mark.parametrize(
    "width,headers",
    [
        (140, ["layer", "C", "batches", "mean range", "var min / med / max", "near-eps", "max gain", "status"]),
        (90, ["layer", "C", "batches", "var min / med / max", "near-eps", "max gain", "status"]),
        (60, ["layer", "C", "var min", "near-eps", "max gain", "status"]),
    ],
)
def test_narrow_terminals_drop_columns_instead_of_folding_numbers(cli, hand_made, width, headers):
    lines = cli("inspect", hand_made, width=width).stdout.splitlines()
    header = next(line for line in lines if line.startswith("layer"))
    assert [h.strip() for h in header.split("┃")] == headers
    assert all(len(line) <= width for line in lines[:-1])  # the summary is one line, whatever the width
    row = next(line for line in lines if line.startswith("encoder.bn"))
    assert row.split("│")[-2].strip() == "316"  # the max gain cell, whole

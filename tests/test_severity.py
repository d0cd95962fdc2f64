"""Severities that match the damage: BN003 and BN004 levels on trained models, and the
configuration's per-rule severity overrides (validated, shown by `bnaudit rules`,
honoured by --fail-on)."""

from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch
from conftest import SAMPLES, train_classifier
from safetensors.torch import load_file, save_file

from bnaudit.api import inspect
from bnaudit.audit.rules import RULES
from bnaudit.config import Config, load_config
from bnaudit.errors import BnauditError

CALIB = os.path.join(SAMPLES, "data", "digits_calib.safetensors")
CHANNEL = 5  # of features.4 (16 channels)


def _digits_net():
    spec = importlib.util.spec_from_file_location("digits_net_for_severity", os.path.join(SAMPLES, "digits_net.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.digits_net()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """DigitsNet trained on the bundled digits, then two copies of its state dict:
    live.safetensors, features.4 channel 5's running_var overwritten with 1e-9 (its mean
    stays what training measured); dead.safetensors, that channel's conv filter zeroed and
    every BN's statistics re-estimated on the same data, so the channel sees only zeros
    (mean 0, var 0, as a channel that died in training)."""
    root = tmp_path_factory.mktemp("severity")
    data = load_file(CALIB)
    torch.manual_seed(0)
    model = train_classifier(_digits_net(), data["inputs"], data["labels"], steps=60)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    live = dict(state)
    live["features.4.running_var"] = state["features.4.running_var"].clone()
    live["features.4.running_var"][CHANNEL] = 1e-9
    save_file(live, root / "live.safetensors")

    with torch.no_grad():
        model.features[3].weight[CHANNEL] = 0.0
        bns = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
        for bn in bns:
            bn.reset_running_stats()
            bn.momentum = None  # cumulative: the population statistics of the batches below
        model.train()
        for start in range(0, 300, 10):  # 30 batches: 0.9^30 = 4.2% < 5%, no BN003
            model(data["inputs"][start : start + 10])
    save_file({k: v.clone() for k, v in model.state_dict().items()}, root / "dead.safetensors")
    return root


def _bn004(path, config=None):
    (file,) = inspect(str(path), config or Config()).files
    return [f for f in file.findings if f.code == "BN004"]


def test_bn004_error_for_a_live_channel_with_a_broken_variance(trained):
    state = load_file(trained / "live.safetensors")
    mean = float(state["features.4.running_mean"][CHANNEL])
    gamma = float(state["features.4.weight"][CHANNEL])
    gain = abs(gamma) / math.sqrt(1e-9 + 1e-5)  # independent of bnaudit's arithmetic
    assert abs(mean) >= math.sqrt(1e-9 + 1e-5) and gain > 100  # live, and above the bound
    (f,) = _bn004(trained / "live.safetensors")
    assert (f.severity, f.layer, f.channels) == ("error", "features.4", (CHANNEL,))
    assert f"gain {gain:.1f}" in f.message and f"ch {CHANNEL} is live" in f.message
    # above the configured bound it is no longer an error, only the warning of max-gain
    (f,) = _bn004(trained / "live.safetensors", Config(max_live_gain=gain + 1))
    assert f.severity == "warning"


def test_bn004_warning_for_a_dead_channel_with_the_same_gain(trained):
    state = load_file(trained / "dead.safetensors")
    mean, var = float(state["features.4.running_mean"][CHANNEL]), float(state["features.4.running_var"][CHANNEL])
    assert mean == 0.0 and var == 0.0  # only zeros reached it
    gain = abs(float(state["features.4.weight"][CHANNEL])) / math.sqrt(1e-5)
    (f,) = _bn004(trained / "dead.safetensors")
    assert f.channels == (CHANNEL,) and f"gain {gain:.1f}" in f.message
    assert f.severity == ("warning" if gain >= 100 else "info")


def test_bn004_error_on_the_dead_channel_sample_whose_mean_is_live():
    # generate.py overwrote a trained channel's var with 2e-7; its mean 0.356 stayed
    report = inspect(os.path.join(SAMPLES, "dead_channel.safetensors"), Config())
    (f,) = report.findings
    assert (f.code, f.severity, f.channels) == ("BN004", "error", (3,))
    assert report.exit_code("error") == 1


def test_bn003_error_at_half_weight_or_more_on_the_immature_sample():
    report = inspect(os.path.join(SAMPLES, "immature.pt"), Config())
    # 3 updates at momentum 0.1: 0.9^3 = 72.9% >= 50%
    assert {(f.code, f.severity) for f in report.findings} == {("BN003", "error")}
    assert all("72.9% after 3 updates" in f.message for f in report.findings)
    assert report.exit_code("error") == 1
    # momentum 0.2 (given): 0.8^3 = 51.2% still an error; momentum 0.25: 42.2%, a warning
    assert {f.severity for f in inspect(os.path.join(SAMPLES, "immature.pt"), Config(momentum=0.2)).findings} == {
        "error"
    }
    lighter = inspect(os.path.join(SAMPLES, "immature.pt"), Config(momentum=0.25)).findings
    assert {f.severity for f in lighter} == {"warning"} and "42.2%" in lighter[0].message


def write(path, text):
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "table,problem",
    [
        ('severity = {BN04 = "error"}', "severity: unknown rule code 'BN04'"),
        ('severity = {BN004 = "fatal"}', "severity: BN004: expected one of error, warning, info, got 'fatal'"),
        ('severity = "error"', "severity: expected a table of rule codes to severities"),
    ],
)
def test_severity_overrides_are_validated_like_every_key(tmp_path, table, problem):
    config = write(tmp_path / "bnaudit.toml", table + "\n")
    with pytest.raises(BnauditError) as err:
        load_config(config_file=config, rule_codes=RULES)
    assert str(err.value).startswith(f"{config}: {problem}")


def test_severity_override_decides_fail_on_and_is_shown_by_rules(cli, tmp_path, trained, monkeypatch):
    monkeypatch.chdir(tmp_path)
    dead = str(trained / "dead.safetensors")
    assert cli("inspect", dead, "--fail-on", "error").exit_code == 0  # a dead channel warns
    write(tmp_path / "pyproject.toml", '[tool.bnaudit.severity]\nbn004 = "error"\n')
    result = cli("inspect", dead, "--fail-on", "error", "--format", "json")
    assert result.exit_code == 1
    assert '"severity": "error"' in result.stdout
    listing = cli("rules").stdout
    (row,) = [line for line in listing.splitlines() if line.startswith("BN004")]
    assert "error (configured)" in row
    assert "configured severity: error" in cli("rules", "BN004").stdout
    assert "configured" not in cli("rules", "--isolated").stdout

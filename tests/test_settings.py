"""eps and momentum: one resolver (bnaudit.audit.settings) decides each value and where it
comes from, and no comparison raises an error or a warning against an assumed value.

The model of the consequences is shaped like a Keras port (torchcrepe: eps 1e-3): six
conv + BatchNorm blocks, statistics from real train-mode forwards, saved as a plain state
dict (which cannot hold eps or momentum) and exported correctly with torch.onnx.export.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import warnings

import onnx
import pytest
import torch
from conftest import bn_entries, save_torch
from torch import nn

from bnaudit.audit.diff.checkpoints import diff
from bnaudit.audit.settings import Setting, Source, resolve, settings_stated_by, stated_settings
from bnaudit.config import Config, load_config
from bnaudit.formats.model import ModuleInfo
from bnaudit.normkinds import DEFAULT_EPS, DEFAULT_MOMENTUM

BLOCKS = 6


def keras_like(eps: float = 1e-3, momentum: float = 0.1) -> nn.Sequential:
    """Six conv + BN blocks whose running statistics moved away from 0 / 1 in train mode."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    channels = 1
    for _ in range(BLOCKS):
        layers += [nn.Conv2d(channels, 4, 3, padding=1), nn.BatchNorm2d(4, eps=eps, momentum=momentum), nn.ReLU()]
        channels = 4
    model = nn.Sequential(*layers).train()
    with torch.no_grad():
        for _ in range(5):
            model(torch.randn(8, 1, 8, 8))
    return model.eval()


BN_NAMES = {str(3 * i + 1) for i in range(BLOCKS)}


def export_kept(model: nn.Module, path) -> str:
    """The legacy exporter without constant folding: one BatchNormalization node per layer."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.zeros(2, 1, 8, 8),), str(path), dynamo=False, do_constant_folding=False)
    return str(path)


def script(model: nn.Module, path) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.jit.script(model).save(str(path))
    return str(path)


def node_attribute(path, name: str) -> list[float]:
    return [
        a.f
        for n in onnx.load(str(path)).graph.node
        if n.op_type == "BatchNormalization"
        for a in n.attribute
        if a.name == name
    ]


def found(report) -> list[tuple[str, str, str | None]]:
    return sorted((f.code, f.severity, f.layer) for f in report.findings)


@pytest.fixture(scope="module")
def keras(tmp_path_factory):
    """(folder, model): the eps-1e-3 model as a state dict, its export, TorchScript copies."""
    folder = tmp_path_factory.mktemp("keras")
    model = keras_like()
    save_torch(model.state_dict(), folder / "model.pt")
    export_kept(model, folder / "model.onnx")
    script(model, folder / "scripted.pt")
    wrong = copy.deepcopy(model)
    for m in wrong.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.eps = 1e-5
    script(wrong, folder / "scripted_1e-5.pt")
    return folder, model


# ----------------------------------------------------------------------------- the resolver


def test_the_file_wins_setting_by_setting_and_none_is_a_known_momentum():
    stated = stated_settings(None, None)
    assert stated.eps == Setting(DEFAULT_EPS, Source.DEFAULT) and stated.eps.assumed
    assert stated.momentum == Setting(DEFAULT_MOMENTUM, Source.DEFAULT)
    assert resolve(None, stated) is stated
    cumulative = resolve(ModuleInfo("BatchNorm2d", eps=1e-3, momentum=None), stated)
    assert cumulative.eps == Setting(1e-3, Source.MODULE) and cumulative.eps.known
    # momentum=None (cumulative average) is a known value, not the unknown default
    assert cumulative.momentum == Setting(None, Source.MODULE) and not cumulative.momentum.assumed
    assert cumulative.from_file
    unreadable = resolve(ModuleInfo("BatchNorm2d", eps=1e-3, momentum=None, momentum_known=False), stated)
    assert unreadable.eps.known and unreadable.momentum == stated.momentum and not unreadable.from_file
    node = resolve(ModuleInfo("BatchNormalization", eps=1e-3, momentum=0.01, source="node 'bn'"), stated)
    assert node.eps == Setting(1e-3, Source.NODE, "node 'bn'") and node.momentum.value == 0.01


def test_options_and_the_configuration_file_are_given_not_assumed(tmp_path):
    (tmp_path / "bnaudit.toml").write_text("eps = 1e-3\nmomentum = 0.01\n")
    config = load_config({"--momentum": 0.02}, start=tmp_path, rule_codes=())
    stated = settings_stated_by(config)
    assert stated.eps == Setting(1e-3, Source.CONFIG, str(tmp_path / "bnaudit.toml"))
    assert stated.momentum == Setting(0.02, Source.OPTION, "--momentum")
    assert stated.eps.given and stated.momentum.given and not (stated.eps.assumed or stated.momentum.assumed)
    # a Config built by a caller of the API states its values too
    assert settings_stated_by(Config(eps=1e-3)).eps == Setting(1e-3, Source.OPTION, "--eps")


# ----------------------------------------------------------------------------- consequences


def test_assumed_eps_against_a_correct_export_is_a_note_not_an_error(keras, cli):
    folder, _ = keras
    assert node_attribute(folder / "model.onnx", "epsilon") == [pytest.approx(1e-3)] * BLOCKS  # the test's reading
    report = diff(str(folder / "model.pt"), str(folder / "model.onnx"), Config())
    assert found(report) == sorted(("BN109", "info", name) for name in BN_NAMES)
    assert report.exit_code() == 0
    message = report.findings[0].message
    assert "0.001" in message and "1e-05 assumed" in message and "--eps 0.001" in message and "--arch" in message
    assert not any("differs" in line for line in report.diagnosis())
    assert cli("diff", str(folder / "model.pt"), str(folder / "model.onnx"), "--isolated").exit_code == 0


def test_given_or_known_eps_against_the_export_is_still_an_error(keras, cli):
    folder, _ = keras
    a, b = str(folder / "model.pt"), str(folder / "model.onnx")
    given = diff(a, b, Config(eps=1e-5))
    assert found(given) == sorted(("BN109", "error", name) for name in BN_NAMES)
    assert "eps 1e-05 (given by --eps) in the checkpoint" in given.findings[0].message
    assert "assumed" not in given.findings[0].message
    assert diff(a, b, Config(eps=1e-3)).findings == []
    assert cli("diff", a, b, "--isolated", "--eps", "1e-5").exit_code == 1
    # TorchScript carries the modules' real eps: the right one matches, the wrong one is an error
    assert diff(str(folder / "scripted.pt"), b, Config()).findings == []
    known = diff(str(folder / "scripted_1e-5.pt"), b, Config())
    assert found(known) == sorted(("BN109", "error", name) for name in BN_NAMES)
    assert known.exit_code() == 1


def test_assumed_momentum_against_the_export_is_a_note(tmp_path):
    model = keras_like(eps=1e-5, momentum=0.01)  # a Keras port's momentum: ONNX stores 0.99
    path = export_kept(model, tmp_path / "m.onnx")
    assert node_attribute(path, "momentum") == [pytest.approx(0.99)] * BLOCKS
    checkpoint = save_torch(model.state_dict(), tmp_path / "m.pt")
    report = diff(checkpoint, path, Config())
    assert found(report) == sorted(("BN110", "info", name) for name in BN_NAMES)
    assert report.exit_code() == 0
    assert "0.1 assumed" in report.findings[0].message and "--momentum 0.01" in report.findings[0].message
    assert diff(checkpoint, path, Config(momentum=0.01)).findings == []
    given = diff(checkpoint, path, Config(momentum=0.1))
    assert found(given) == sorted(("BN110", "warning", name) for name in BN_NAMES)


def test_diff_uses_the_configured_momentum(tmp_path, monkeypatch, cli):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pyproject.toml").write_text("[tool.bnaudit]\nmomentum = 0.01\n")
    a = save_torch(bn_entries("bn", 4), tmp_path / "a.pt")
    b = save_torch(bn_entries("bn", 4, counter=200), tmp_path / "b.pt")
    doc = json.loads(cli("diff", a, b, "--format", "json").stdout)
    assert doc["layers"][0]["momentum"] == {"a": 0.01, "b": 0.01, "source": {"a": "config", "b": "config"}}
    doc = json.loads(cli("diff", a, b, "--format", "json", "--momentum", "0.02").stdout)
    assert doc["layers"][0]["momentum"] == {"a": 0.02, "b": 0.02, "source": {"a": "option", "b": "option"}}
    # against an export of a default-momentum model (ONNX 0.9), the configured 0.01 is the
    # user's statement: expected ONNX momentum 0.99, so BN110 warns
    model = keras_like(eps=1e-5)
    onnx_path = export_kept(model, tmp_path / "m.onnx")
    checkpoint = save_torch(model.state_dict(), tmp_path / "m.pt")
    result = cli("diff", checkpoint, onnx_path, "--format", "json")
    findings = json.loads(result.stdout)["findings"]
    assert sorted((f["code"], f["severity"]) for f in findings) == [("BN110", "warning")] * BLOCKS
    assert result.exit_code == 1


def test_eps_between_a_known_and_an_assumed_checkpoint_is_a_note(keras):
    folder, _ = keras
    a, b = str(folder / "scripted.pt"), str(folder / "model.pt")
    report = diff(a, b, Config())
    assert found(report) == sorted(("BN106", "info", name) for name in BN_NAMES)
    assert "1e-05 assumed" in report.findings[0].message and "--eps 0.001" in report.findings[0].message
    assert report.exit_code() == 0
    assert found(diff(a, b, Config(eps=1e-5))) == sorted(("BN106", "error", name) for name in BN_NAMES)
    assert diff(a, b, Config(eps=1e-3)).findings == []


def test_the_set_eps_hint_disappears_once_eps_is_given(keras, cli):
    folder, _ = keras
    path = str(folder / "model.pt")
    doc = json.loads(cli("inspect", path, "--format", "json", "--isolated").stdout)
    assert (
        doc["files"][0]["settings"] == "eps 1e-05 and momentum 0.1 assumed (not in a state dict; set --eps/--momentum)"
    )
    doc = json.loads(cli("inspect", path, "--format", "json", "--isolated", "--eps", "1e-3").stdout)
    settings = doc["files"][0]["settings"]
    assert "eps 0.001 given by --eps" in settings and "set --eps" not in settings and "set --momentum" in settings
    doc = json.loads(cli("inspect", path, "-f", "json", "--isolated", "--eps", "1e-3", "--momentum", "0.1").stdout)
    assert "set " not in doc["files"][0]["settings"]
    report = diff(path, str(folder / "model.onnx"), Config(eps=1e-3))
    assert "set --eps" not in report.settings and "eps 0.001 given by --eps" in report.settings
    assert "set --momentum" in report.settings


def test_assumed_eps_against_a_folded_export_is_a_note(keras, tmp_path):
    folder, model = keras
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.zeros(2, 1, 8, 8),), str(tmp_path / "folded.onnx"), dynamo=True)
    path = str(tmp_path / "folded.onnx")
    assert not any(n.op_type == "BatchNormalization" for n in onnx.load(path).graph.node)  # all folded
    checkpoint = str(folder / "model.pt")
    report = diff(checkpoint, path, Config())
    assert found(report) == sorted(("BN112", "info", name) for name in BN_NAMES)
    assert report.exit_code() == 0
    assert "1e-05 assumed" in report.findings[0].message and "--eps 0.001" in report.findings[0].message
    assert not any("differs" in line for line in report.diagnosis())
    given = diff(checkpoint, path, Config(eps=1e-5))
    assert found(given) == sorted(("BN112", "error", name) for name in BN_NAMES)
    assert "eps 0.001 instead of 1e-05" in given.findings[0].message
    assert diff(checkpoint, path, Config(eps=1e-3)).findings == []


ARCH_FILE = """
from torch import nn


def build(eps=1e-3):
    layers = []
    channels = 1
    for _ in range(6):
        layers += [nn.Conv2d(channels, 4, 3, padding=1), nn.BatchNorm2d(4, eps=eps), nn.ReLU()]
        channels = 4
    return nn.Sequential(*layers)
"""


def test_arch_gives_the_real_eps_against_the_export(keras, tmp_path, cli):
    folder, _ = keras
    (tmp_path / "arch.py").write_text(ARCH_FILE)
    arch = f"{tmp_path / 'arch.py'}:build"
    a, b = str(folder / "model.pt"), str(folder / "model.onnx")
    right = cli("diff", a, b, "--arch", arch, "--isolated", "-f", "json")
    assert right.exit_code == 0 and json.loads(right.stdout)["findings"] == []
    wrong = cli("diff", a, b, "--arch", arch, "--arch-kwargs", '{"eps": 1e-5}', "--isolated", "-f", "json")
    doc = json.loads(wrong.stdout)
    assert wrong.exit_code == 1
    assert sorted((f["code"], f["severity"]) for f in doc["findings"]) == [("BN109", "error")] * BLOCKS
    assert {n["eps"]["checkpoint_source"] for n in doc["export"]["nodes"]} == {"module"}

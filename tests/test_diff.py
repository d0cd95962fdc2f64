"""`bnaudit diff`: each verdict produced the way users produce it, by real training on the
digits that ship with the repo, and checked against the test's own computation of the
deltas (torch arithmetic on the two state dicts, not bnaudit's)."""

from __future__ import annotations

import json
import math
import os
import sys
import warnings

import jsonschema
import pytest
import torch
from conftest import REPO, SAMPLES, bn_entries, save_safetensors, save_torch, train_classifier
from safetensors.torch import load_file
from torch import nn

from bnaudit.audit.diff.checkpoints import diff
from bnaudit.audit.diff.layers import bit_identical
from bnaudit.config import Config
from bnaudit.output.sarif import diff_to_sarif
from bnaudit.runtime.models import ModelSpec

sys.path.insert(0, SAMPLES)
from digits_net import digits_net

EPS = 1e-5
BACKBONE = ("features.1", "features.4")


@pytest.fixture(scope="module")
def digits():
    data = load_file(os.path.join(SAMPLES, "data", "digits_calib.safetensors"))
    return data["inputs"], data["labels"]


def state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def pretrained(digits):
    torch.manual_seed(0)
    x, y = digits
    return state(train_classifier(digits_net(), x, y, steps=40))


def fine_tune(model, x, y, steps: int, backbone_eval: bool, seed: int = 5):
    """Fine-tune the head with the backbone's requires_grad=False, as users do: model.train()
    every step, and (backbone_eval) the backbone put back in eval() after it."""
    for p in model.features.parameters():
        p.requires_grad_(False)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.01)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model.train()
        if backbone_eval:
            model.features.eval()
        idx = torch.randperm(len(x), generator=g)[:32]
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return state(model)


def expected_numbers(a: dict, b: dict, name: str) -> dict:
    """The deltas of one layer, computed here in float64 torch arithmetic."""
    ma, mb = a[f"{name}.running_mean"].double(), b[f"{name}.running_mean"].double()
    va, vb = a[f"{name}.running_var"].double(), b[f"{name}.running_var"].double()
    wa, wb = a[f"{name}.weight"].double(), b[f"{name}.weight"].double()
    ba, bb = a[f"{name}.bias"].double(), b[f"{name}.bias"].double()
    scale = max(wa.abs().max().item(), 1e-3)
    return {
        "weight_change": ((wb - wa).abs().max() / scale).item(),
        "bias_change": ((bb - ba).abs().max() / scale).item(),
        "max_mean_shift": ((mb - ma).abs() / (va + EPS).sqrt()).max().item(),
        "max_var_log_ratio": ((vb + EPS) / (va + EPS)).log().abs().max().item(),
        "batches": int(b[f"{name}.num_batches_tracked"]) - int(a[f"{name}.num_batches_tracked"]),
    }


def assert_numbers(d, expected: dict) -> None:
    for key in ("weight_change", "bias_change", "max_mean_shift", "max_var_log_ratio"):
        assert getattr(d, key) == pytest.approx(expected[key], rel=1e-9, abs=1e-15), key
    assert d.batches_change == expected["batches"]


def by_name(report):
    return {d.name: d for d in report.layers}


@pytest.fixture(scope="module")
def frozen_pair(tmp_path_factory, pretrained, digits):
    """pretrained.safetensors -> finetuned.pt with the backbone frozen by requires_grad only."""
    folder = tmp_path_factory.mktemp("frozen")
    model = digits_net()
    model.load_state_dict(pretrained)
    tuned = fine_tune(model, *digits, steps=20, backbone_eval=False)
    a = save_safetensors(pretrained, folder / "pretrained.safetensors")
    b = save_torch(tuned, folder / "finetuned.pt")
    return a, b, pretrained, tuned


def test_requires_grad_false_in_train_mode_is_frozen_but_updating(frozen_pair):
    a, b, sa, sb = frozen_pair
    report = diff(a, b)
    layers = by_name(report)
    for name in BACKBONE:
        d = layers[name]
        assert torch.equal(sa[f"{name}.weight"], sb[f"{name}.weight"])  # the test's premise
        assert d.verdict == "frozen but updating" and d.params_identical and not d.stats_identical
        assert_numbers(d, expected_numbers(sa, sb, name))
        assert d.batches_change == 20 and d.max_mean_shift > 0
    assert layers["head.2"].verdict == "trained"
    assert_numbers(layers["head.2"], expected_numbers(sa, sb, "head.2"))
    found = {(f.code, f.severity, f.layer) for f in report.findings}
    assert found == {("BN101", "warning", "features.1"), ("BN101", "warning", "features.4")}
    assert report.groups() == {"frozen but updating": "features.*", "trained": "head.*"}
    assert report.exit_code() == 1 and report.exit_code("error") == 0
    # intent makes it an error
    strict = diff(a, b, Config(expect_frozen=("features.*",)))
    assert {(f.code, f.severity) for f in strict.findings} == {("BN101", "error")}


def test_backbone_in_eval_mode_stays_unchanged(tmp_path, pretrained, digits):
    model = digits_net()
    model.load_state_dict(pretrained)
    tuned = fine_tune(model, *digits, steps=20, backbone_eval=True)
    a = save_safetensors(pretrained, tmp_path / "a.safetensors")
    b = save_safetensors(tuned, tmp_path / "b.safetensors")
    report = diff(a, b, Config(expect_frozen=("features.*",), expect_trained=("head.*",)))
    layers = by_name(report)
    for name in BACKBONE:
        assert layers[name].verdict == "unchanged" and layers[name].moved == []
        assert expected_numbers(pretrained, tuned, name)["batches"] == 0
    assert layers["head.2"].verdict == "trained"
    assert_numbers(layers["head.2"], expected_numbers(pretrained, tuned, "head.2"))
    assert report.findings == [] and report.exit_code("info") == 0
    # the same expectations against the frozen-but-updating pair: statistics moved
    other = diff(a, b, Config(expect_frozen=("head.*",)))
    [finding] = other.findings
    assert finding.code == "BN105" and finding.layer == "head.2" and finding.severity == "error"
    assert "weight, bias, running_mean, running_var, num_batches_tracked moved" in finding.message


def test_averaged_model_without_update_bn_is_stale_then_re_estimated(tmp_path, pretrained, digits):
    """The live model against its AveragedModel copy (a checkpoint's state_dict vs its
    SWA/EMA state dict): AveragedModel(use_buffers=False) copies the live model's buffers
    at each update_parameters, so the averaged weights carry statistics measured with
    other (the live) weights."""
    from torch.optim.swa_utils import AveragedModel, update_bn

    x, y = digits
    model = digits_net()
    model.load_state_dict(pretrained)
    swa = AveragedModel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(9)
    model.train()
    for step in range(30):
        idx = torch.randperm(len(x), generator=g)[:32]
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 5 == 4:
            swa.update_parameters(model)
    live, averaged = state(model), state(swa.module)
    container = {"state_dict": live, "state_dict_ema": averaged, "epoch": 3}
    a = b = save_torch(container, tmp_path / "last.ckpt")
    report = diff(a, b, key_a="state_dict", key_b="state_dict_ema")
    assert (report.a.key, report.b.key) == ("state_dict", "state_dict_ema")
    severities = {}
    for name, d in by_name(report).items():
        expected = expected_numbers(live, averaged, name)
        assert d.verdict == "stale statistics" and d.stats_identical and not d.params_identical
        assert_numbers(d, expected)
        worst = max(expected["weight_change"], expected["bias_change"])
        severities[name] = "error" if worst > 0.1 else "warning"
    assert {f.layer: f.severity for f in report.findings if f.code == "BN102"} == severities
    # a lower threshold turns every one into an error, a higher one none
    low = diff(a, b, Config(stale_max_change=1e-9), key_a="state_dict", key_b="state_dict_ema")
    high = diff(a, b, Config(stale_max_change=1e9), key_a="state_dict", key_b="state_dict_ema")
    assert {f.severity for f in high.findings} == {"warning"} and len(high.findings) == 3
    assert {f.severity for f in low.findings} == {"error"} and len(low.findings) == 3

    loader = torch.utils.data.DataLoader(x[:128], batch_size=32)
    update_bn(loader, swa)
    recomputed = state(swa.module)
    b = save_safetensors(averaged, tmp_path / "swa.safetensors")
    c = save_safetensors(recomputed, tmp_path / "swa_bn.safetensors")
    after = diff(b, c)
    for name, d in by_name(after).items():
        assert d.verdict == "re-estimated" and d.params_identical
        assert d.batches_b == 4  # update_bn resets the counter, then counts its 4 batches
        assert_numbers(d, expected_numbers(averaged, recomputed, name))
    assert {(f.code, f.severity) for f in after.findings} == {("BN103", "info")}
    assert all("such as update_bn" in f.message for f in after.findings)


class CheckpointedMLP(nn.Module):
    """Three Linear-BN1d-ReLU blocks; the middle one runs under torch.utils.checkpoint."""

    def __init__(self, use_reentrant: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(64 if i == 0 else 32, 32), nn.BatchNorm1d(32), nn.ReLU()) for i in range(3)
        )
        self.out = nn.Linear(32, 10)
        self.use_reentrant = use_reentrant

    def forward(self, x):
        h = x.flatten(1)
        for i, block in enumerate(self.blocks):
            if i == 1:
                h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=self.use_reentrant)
            else:
                h = block(h)
        return self.out(h)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_activation_checkpointing_counts_twice(tmp_path, digits, use_reentrant):
    torch.manual_seed(3)
    model = CheckpointedMLP(use_reentrant)
    before = state(model)
    x, y = digits
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        after = state(train_classifier(model, x, y, steps=15))
    increments = {
        f"blocks.{i}.1": int(after[f"blocks.{i}.1.num_batches_tracked"] - before[f"blocks.{i}.1.num_batches_tracked"])
        for i in range(3)
    }
    # the recomputation during backward really runs BN in training mode a second time
    assert increments == {"blocks.0.1": 15, "blocks.1.1": 30, "blocks.2.1": 15}
    report = diff(save_torch(before, tmp_path / "a.pt"), save_torch(after, tmp_path / "b.pt"))
    assert all(d.verdict == "trained" for d in report.layers)
    assert {d.name: d.batches_change for d in report.layers} == increments
    [finding] = [f for f in report.findings if f.code == "BN104"]
    assert finding.severity == "warning" and finding.layer is None
    assert "+15 in 2 layers (blocks.0.*, blocks.2.*)" in finding.message
    assert "+30 in 1 layer (blocks.1.*): exactly 2x" in finding.message


def test_recalibrate_output_against_its_input_is_re_estimated_with_provenance(tmp_path):
    from bnaudit import DataOptions, recalibrate_checkpoint

    source = os.path.join(SAMPLES, "healthy.safetensors")
    out = str(tmp_path / "recal.safetensors")
    options = DataOptions(path=os.path.join(SAMPLES, "data", "digits_calib.safetensors"), batch_size=50)
    recalibrate_checkpoint(ModelSpec(source, arch=os.path.join(SAMPLES, "digits_net.py") + ":digits_net"), out, options)
    report = diff(source, out)
    sa, sb = load_file(source), load_file(out)
    assert report.provenance.startswith("bnaudit recalibrate (method exact, 300 samples")
    for name, d in by_name(report).items():
        assert d.verdict == "re-estimated" and d.recalibrated and d.params_identical
        assert_numbers(d, expected_numbers(sa, sb, name))
    assert len(report.findings) == 3
    for f in report.findings:
        assert f.code == "BN103" and f.message.startswith("re-estimated by bnaudit recalibrate (method exact")


def test_eps_changed_between_torchscript_exports_is_an_error(tmp_path, pretrained, cli):
    model = digits_net()
    model.load_state_dict(pretrained)
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.jit.script(model).save(str(tmp_path / "a.pt"))
        model.head[2].eps = 1e-3
        model.features[1].momentum = 0.2
        torch.jit.script(model).save(str(tmp_path / "b.pt"))
    report = diff(tmp_path / "a.pt", tmp_path / "b.pt")
    assert all(d.verdict == "unchanged" and d.settings_known for d in report.layers)
    assert [(f.code, f.severity, f.layer) for f in report.findings] == [
        ("BN106", "info", "features.1"),
        ("BN106", "error", "head.2"),
    ]
    assert report.findings[0].message == "momentum changed from 0.1 to 0.2"
    assert "eps changed from 1e-05 to 0.001" in report.findings[1].message
    result = cli("diff", str(tmp_path / "a.pt"), str(tmp_path / "b.pt"), "--format", "json")
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert doc["layers"][2]["eps"] == {"a": 1e-05, "b": 0.001, "known": True, "source": {"a": "module", "b": "module"}}


def test_json_document(frozen_pair, cli):
    a, b, sa, sb = frozen_pair
    result = cli("diff", a, b, "--format", "json", "--isolated")
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert set(doc) == {
        "version", "config", "a", "b", "settings", "provenance", "layers", "only_a", "only_b",
        "reshaped", "export", "groups", "findings", "diagnosis", "summary",
    }  # fmt: skip
    assert doc["export"] is None  # set only for a checkpoint against its ONNX export
    assert doc["a"] == {"path": a, "format": "safetensors", "key": None, "prefix": None, "averaging": None, "layers": 3}
    assert doc["b"]["format"] == "torch-zip"
    layer = doc["layers"][0]
    assert layer["name"] == "features.1" and layer["verdict"] == "frozen but updating"
    assert layer["identical"] == {"weight": True, "bias": True, "running_mean": False, "running_var": False}
    assert layer["num_batches_tracked"] == {
        "a": int(sa["features.1.num_batches_tracked"]),
        "b": int(sb["features.1.num_batches_tracked"]),
        "change": 20,
    }
    expected = expected_numbers(sa, sb, "features.1")
    assert layer["max_mean_shift"] == pytest.approx(expected["max_mean_shift"], rel=1e-12)
    assert layer["max_var_log_ratio"] == pytest.approx(expected["max_var_log_ratio"], rel=1e-12)
    assert doc["groups"] == {"frozen but updating": "features.*", "trained": "head.*"}
    assert doc["summary"]["frozen_but_updating"] == 2 and doc["summary"]["warnings"] == 2
    assert [f["code"] for f in doc["findings"]] == ["BN101", "BN101"]
    assert doc["config"]["stale-max-change"] == 0.1


def test_sarif_is_valid_and_points_at_side_b(frozen_pair, tmp_path, monkeypatch):
    a, b, _, _ = frozen_pair
    schema_path = os.path.join(REPO, "tests", "data", "sarif-schema-2.1.0.json")
    with open(schema_path, encoding="utf-8") as fh:
        schema = json.load(fh)
    monkeypatch.chdir(os.path.dirname(b))
    log = diff_to_sarif(diff(a, b, Config(expect_frozen=("features.*",))))
    jsonschema.Draft4Validator(schema, format_checker=jsonschema.FormatChecker()).validate(log)
    run = log["runs"][0]
    ids = [r["id"] for r in run["tool"]["driver"]["rules"]]
    assert [(r["ruleId"], r["level"]) for r in run["results"]] == [("BN101", "error"), ("BN101", "error")]
    for r in run["results"]:
        assert ids[r["ruleIndex"]] == r["ruleId"]
        assert r["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] == "finetuned.pt"
    assert r["locations"][0]["logicalLocations"][0]["name"] == "features.4"


def test_cli_exit_codes_and_config_keys(frozen_pair, tmp_path, cli, monkeypatch):
    a, b, _, _ = frozen_pair
    assert cli("diff", a, b, "--isolated").exit_code == 1  # warnings fail by default
    assert cli("diff", a, b, "--isolated", "--exit-zero").exit_code == 0
    assert cli("diff", a, b, "--isolated", "--fail-on", "error").exit_code == 0
    assert cli("diff", a, b, "--isolated", "--fail-on", "error", "--expect-frozen", "features.*").exit_code == 1
    assert cli("diff", a, b, "--isolated", "--ignore", "BN101").exit_code == 0
    table = cli("diff", a, b, "--isolated", width=100).stdout
    assert "frozen but updating: 2 layers, features.*" in table and "trained: 1 layer, head.*" in table
    (tmp_path / "pyproject.toml").write_text('[tool.bnaudit]\nfail-on = "error"\nexpect-frozen = ["features.*"]\n')
    monkeypatch.chdir(tmp_path)
    result = cli("diff", a, b, "--format", "json")
    assert result.exit_code == 1
    assert {f["severity"] for f in json.loads(result.stdout)["findings"]} == {"error"}
    (tmp_path / "pyproject.toml").write_text('[tool.bnaudit]\nexpect-frozen = "features.*"\n')
    bad = cli("diff", a, b)
    assert bad.exit_code == 2 and "expect-frozen" in bad.stderr and "Traceback" not in bad.output
    missing = cli("diff", a, str(tmp_path / "nope.pt"), "--isolated")
    assert missing.exit_code == 2 and missing.stderr.count("\n") == 1 and "bnaudit: error:" in missing.stderr


def test_layers_on_one_side_and_channel_changes_are_listed(tmp_path):
    a = {**bn_entries("enc.bn1"), **bn_entries("enc.bn2"), **bn_entries("old.bn")}
    b = {**bn_entries("enc.bn1"), **bn_entries("enc.bn2", channels=6), **bn_entries("new.bn")}
    report = diff(save_torch(a, tmp_path / "a.pt"), save_torch(b, tmp_path / "b.pt"))
    assert [d.name for d in report.layers] == ["enc.bn1"] and report.layers[0].verdict == "unchanged"
    assert report.only_a == ["old.bn"] and report.only_b == ["new.bn"]
    assert report.reshaped == [("enc.bn2", 4, 6)]
    assert [(f.code, f.severity, f.layer) for f in report.findings] == [
        ("BN107", "warning", "enc.bn2"),
        ("BN107", "info", None),
        ("BN107", "info", None),
    ]


def test_prefixes_are_stripped_before_matching(tmp_path):
    """A DDP checkpoint (`module.` on every key) matches the plain one layer by layer."""
    plain = bn_entries("bn")
    wrapped = {f"module.{k}": v for k, v in plain.items()}
    report = diff(save_torch(plain, tmp_path / "a.pt"), save_torch(wrapped, tmp_path / "b.pt"))
    assert report.b.prefix == "module." and [d.verdict for d in report.layers] == ["unchanged"]


def test_identical_means_bit_identical():
    assert bit_identical([1.0, 2.0], [1.0, 2.0]) and bit_identical(None, None)
    assert not bit_identical([0.0], [-0.0])  # == would call these equal
    nan = float("nan")
    assert bit_identical([nan], [nan])  # the same NaN: nothing moved
    assert not bit_identical([1.0], [math.nextafter(1.0, 2.0)])
    assert not bit_identical([1.0], None) and not bit_identical([1.0], [1.0, 1.0])


def test_committed_sample_pair_is_frozen_but_updating():
    """sample_models/generate.py's pair, shown in the README: weights identical in features.*"""
    a, b = os.path.join(SAMPLES, "pretrained.safetensors"), os.path.join(SAMPLES, "finetuned.pt")
    report = diff(a, b)
    sa, sb = load_file(a), torch.load(b, weights_only=True)
    for name in BACKBONE:
        assert_numbers(by_name(report)[name], expected_numbers(sa, sb, name))
    assert report.groups() == {"frozen but updating": "features.*", "trained": "head.*"}


def test_live_against_its_ema_copy_ignores_the_ema_counter(tmp_path, pretrained, digits):
    """An EMA copy (AveragedModel with an EMA average and use_buffers=True) averages the
    statistics too, and leaves its counter at 1: the counter must not make the copy look
    re-estimated; chosen by container key, the EMA side is known as such."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    x, y = digits
    model = digits_net()
    model.load_state_dict(pretrained)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(11)
    model.train()
    for _ in range(10):
        idx = torch.randperm(len(x), generator=g)[:32]
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        ema.update_parameters(model)
    live, averaged = state(model), state(ema.module)
    assert int(averaged["head.2.num_batches_tracked"]) < int(live["head.2.num_batches_tracked"])
    path = save_torch({"model": live, "model_ema": averaged}, tmp_path / "ckpt.pth")
    report = diff(path, path, key_a="model", key_b="model_ema")
    for name, d in by_name(report).items():
        assert d.verdict == "trained" and not d.counter_meaningful
        assert_numbers(d, expected_numbers(live, averaged, name))
    assert report.findings == []


def test_sarif_rule_levels_follow_the_configured_severity(frozen_pair):
    """`[tool.bnaudit.severity]` re-rates diff rules in the driver's rule descriptors too,
    as it does for inspect's (a code-scanning UI reads the default level from there)."""
    a, b, _, _ = frozen_pair
    log = diff_to_sarif(diff(a, b, Config(severity={"BN101": "info"})))
    run = log["runs"][0]
    by_id = {r["id"]: r for r in run["tool"]["driver"]["rules"]}
    assert by_id["BN101"]["defaultConfiguration"]["level"] == "note"
    assert {r["level"] for r in run["results"] if r["ruleId"] == "BN101"} == {"note"}

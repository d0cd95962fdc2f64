"""`bnaudit gap`: both modes against an independent computation, buffers untouched,
drift against hooks written here, the diagnosis, the JSON document and every bad input."""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import train_classifier
from safetensors.torch import save_file
from torch import nn
from typer.testing import CliRunner

from bnaudit.cli import app
from bnaudit.errors import BnauditError
from bnaudit.runtime.data import DataOptions, make_loader
from bnaudit.runtime.gap import measure_gap, measure_model_gap
from bnaudit.runtime.models import ModelSpec, load_runnable

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]

MODEL_SOURCE = '''
import torch
from torch import nn


class TinyNet(nn.Module):
    def __init__(self, classes=3, width=4):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            nn.AdaptiveAvgPool2d(2),
        )
        self.head = nn.Sequential(
            nn.Flatten(), nn.Linear(4 * width, 8, bias=False), nn.BatchNorm1d(8), nn.ReLU(),
            nn.Dropout(0.5), nn.Linear(8, classes),
        )

    def forward(self, x):
        return self.head(self.features(x))


def tiny_net(classes=3, width=4):
    return TinyNet(classes, width)


def sign_net():
    """BN1d(1) then a linear layer whose logit difference is 2 * the normalised input."""
    net = nn.Sequential(nn.BatchNorm1d(1), nn.Linear(1, 2))
    with torch.no_grad():
        net[1].weight.copy_(torch.tensor([[-1.0], [1.0]]))
        net[1].bias.zero_()
    return net


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(3)
        self.out = nn.Linear(3, 1)

    def forward(self, x):
        return self.out(self.bn(x))
'''


def _namespace(path: Path | None = None) -> dict:
    """The model code as the test's own module (from a real file when TorchScript needs source)."""
    if path is None:
        ns: dict = {}
        exec(compile(MODEL_SOURCE, "tinynet_reference", "exec"), ns)
        return ns
    spec = importlib.util.spec_from_file_location("tinynet_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return vars(module)


def _bn_modules(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}


def _make_data(n_per_class: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Three classes of 6x6 images: a fixed template per class plus noise, class-sorted."""
    g = torch.Generator().manual_seed(seed)
    templates = torch.rand(3, 1, 6, 6, generator=torch.Generator().manual_seed(99)) * 2
    xs, ys = [], []
    for c in range(3):
        xs.append(templates[c] + 0.4 * torch.randn(n_per_class, 1, 6, 6, generator=g))
        ys.append(torch.full((n_per_class,), c, dtype=torch.int64))
    return torch.cat(xs), torch.cat(ys)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A trained TinyNet (healthy, reset and shifted copies) and class-sorted validation data."""
    root = tmp_path_factory.mktemp("gap")
    (root / "tinynet.py").write_text(MODEL_SOURCE)
    (root / "reference.py").write_text(MODEL_SOURCE)
    ns = _namespace(root / "reference.py")
    torch.manual_seed(0)
    model = ns["tiny_net"]()
    x_train, y_train = _make_data(60, seed=1)
    train_classifier(model, x_train, y_train)
    healthy = {k: v.clone() for k, v in model.state_dict().items()}
    save_file(healthy, root / "healthy.safetensors")
    reset = copy.deepcopy(model)
    for m in _bn_modules(reset).values():
        m.reset_running_stats()
    save_file(reset.state_dict(), root / "reset.safetensors")
    shifted = {k: v.clone() for k, v in healthy.items()}
    # Only the second BN layer's statistics move: drift starts there.
    shifted["features.4.running_mean"] += 3 * shifted["features.4.running_var"].sqrt()
    save_file(shifted, root / "shifted.safetensors")
    x_val, y_val = _make_data(40, seed=3)
    save_file({"inputs": x_val, "labels": y_val}, root / "val.safetensors")
    save_file({"inputs": x_val}, root / "unlabelled.safetensors")
    return {
        "root": root,
        "arch": f"{root / 'tinynet.py'}:tiny_net",
        "healthy": healthy,
        "x": x_val,
        "y": y_val,
        "ns": ns,
    }


def _batches(n: int, batch_size: int, seed: int = 0) -> list[list[int]]:
    """The documented sample order, written out here: randperm(seed), chunks, a last
    batch of one joins the previous."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    chunks = [order[i : i + batch_size] for i in range(0, n, batch_size)]
    if len(chunks) > 1 and len(chunks[-1]) == 1:
        chunks[-2] = chunks[-2] + chunks.pop()
    return chunks


def _reference(ns: dict, state: dict, x: torch.Tensor, y: torch.Tensor, batches: list[list[int]]) -> dict:
    """Eval mode on all samples at once; train mode per batch on a deep copy whose BN
    modules alone are in training mode (Dropout stays off)."""
    model = ns["tiny_net"]()
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        eval_out = model(x).double()
        train_out = torch.empty_like(eval_out)
        for idx in batches:
            copy_ = copy.deepcopy(model)
            for m in _bn_modules(copy_).values():
                m.train()
            train_out[idx] = copy_(x[idx]).double()
    logp_e, logp_t = eval_out.log_softmax(1), train_out.log_softmax(1)
    kl = (logp_e.exp() * (logp_e - logp_t)).sum(1)
    return {
        "eval_acc": (eval_out.argmax(1) == y).double().mean().item(),
        "train_acc": (train_out.argmax(1) == y).double().mean().item(),
        "agreement": (eval_out.argmax(1) == train_out.argmax(1)).double().mean().item(),
        "kl": kl.mean().item(),
    }


def _gap(world, ckpt: str = "healthy.safetensors", **options):
    options.setdefault("path", str(world["root"] / "val.safetensors"))
    options.setdefault("batch_size", 16)
    return measure_gap(ModelSpec(str(world["root"] / ckpt), arch=world["arch"]), DataOptions(**options))


# ----------------------------------------------------------------------------- the measurement


def test_accuracy_in_each_mode_matches_an_independent_computation(world):
    report = _gap(world, batch_size=16)
    ref = _reference(world["ns"], world["healthy"], world["x"], world["y"], _batches(120, 16))
    assert report.samples == 120 and report.batches == 8 and report.batch_size == 16
    assert report.eval_accuracy == pytest.approx(ref["eval_acc"], abs=1e-12)
    assert report.train_accuracy == pytest.approx(ref["train_acc"], abs=1e-12)
    assert report.gap == pytest.approx(ref["train_acc"] - ref["eval_acc"], abs=1e-12)
    assert report.agreement == pytest.approx(ref["agreement"], abs=1e-12)
    assert report.divergence_kind == "kl"
    assert report.divergence == pytest.approx(ref["kl"], rel=1e-4, abs=1e-9)
    assert ref["eval_acc"] > 0.9  # the fixture really trained a model


@pytest.mark.parametrize("train_first", [True, False])
def test_buffers_unchanged_whichever_pass_runs_first(world, train_first):
    runnable = load_runnable(ModelSpec(str(world["root"] / "healthy.safetensors"), arch=world["arch"]))
    stream = make_loader(DataOptions(path=str(world["root"] / "val.safetensors"), batch_size=16))
    report = measure_model_gap(runnable, stream, train_first=train_first)
    after = runnable.module.state_dict()
    for name, value in world["healthy"].items():
        assert torch.equal(after[name], value), name
    ref = _reference(world["ns"], world["healthy"], world["x"], world["y"], _batches(120, 16))
    assert report.eval_accuracy == pytest.approx(ref["eval_acc"], abs=1e-12)
    assert report.train_accuracy == pytest.approx(ref["train_acc"], abs=1e-12)
    # Modes restored: eval mode everywhere, as load_runnable left it.
    assert not any(m.training for m in runnable.module.modules())


def test_drift_matches_hooks_written_in_the_test(world):
    report = _gap(world, "shifted.safetensors", batch_size=32)
    model = world["ns"]["tiny_net"]()
    shifted = {k: v.clone() for k, v in world["healthy"].items()}
    shifted["features.4.running_mean"] += 3 * shifted["features.4.running_var"].sqrt()
    model.load_state_dict(shifted)
    model.eval()
    seen: dict[str, list[torch.Tensor]] = {}
    for name, m in _bn_modules(model).items():
        m.register_forward_pre_hook(lambda mod, args, name=name: seen.setdefault(name, []).append(args[0].detach()))
    with torch.no_grad():
        model(world["x"])
    by_name = {d.name: d for d in report.layers}
    assert set(by_name) == {"features.1", "features.4", "head.2"}
    for name, m in _bn_modules(model).items():
        x = torch.cat(seen[name]).double()
        flat = x.transpose(0, 1).reshape(x.shape[1], -1)  # (C, values)
        mu, var = flat.mean(1), flat.var(1, unbiased=True)
        mu_r, var_r, eps = m.running_mean.double(), m.running_var.double(), m.eps
        z = (mu - mu_r).abs() / (var_r + eps).sqrt()
        ratio = ((var + eps) / (var_r + eps)).log().abs()
        d = by_name[name]
        assert d.values == flat.shape[1]
        assert d.mean_shift == pytest.approx(z.mean().item(), rel=1e-9)
        assert d.max_mean_shift == pytest.approx(z.max().item(), rel=1e-9)
        assert d.var_log_ratio == pytest.approx(ratio.mean().item(), rel=1e-9)
        # per channel: the worst channels are the largest shift_c + log_var_c, in order
        score = z + ratio
        top = score.argsort(descending=True)[: len(d.worst)]
        assert [c.index for c in d.worst] == top.tolist()
        assert [c.score for c in d.worst] == pytest.approx(score[top].tolist(), rel=1e-9)
        assert d.peak == pytest.approx(score.max().item(), rel=1e-9)
    # Ranked origins first (the shifted layer, where the drift starts), then by the worst
    # channel's drift.
    assert [d.name for d in report.layers if d.origin] == ["features.4"]
    assert report.layers[0].name == "features.4"
    peaks = [d.peak for d in report.layers[1:]]
    assert peaks == sorted(peaks, reverse=True)
    assert [d.drift for d in report.layers] == [d.mean_shift + d.var_log_ratio for d in report.layers]
    # The moved running_mean (3 running stds) shows as the largest mean shift; the first
    # layer, untouched, stays small.
    assert max(report.layers, key=lambda d: d.mean_shift).name == "features.4"
    assert by_name["features.4"].mean_shift > 2.5 and not by_name["features.1"].large


def test_shuffling_matters_on_a_class_sorted_set(tmp_path):
    (tmp_path / "sign.py").write_text(MODEL_SOURCE)
    ns = _namespace()
    save_file(ns["sign_net"]().state_dict(), tmp_path / "sign.safetensors")
    g = torch.Generator().manual_seed(5)
    x = torch.cat([-1 + 0.1 * torch.randn(64, 1, generator=g), 1 + 0.1 * torch.randn(64, 1, generator=g)])
    y = torch.cat([torch.zeros(64, dtype=torch.int64), torch.ones(64, dtype=torch.int64)])
    save_file({"inputs": x, "labels": y}, tmp_path / "sorted.safetensors")
    arch = f"{tmp_path / 'sign.py'}:sign_net"
    common = dict(path=str(tmp_path / "sorted.safetensors"), batch_size=16)
    shuffled = measure_gap(ModelSpec(str(tmp_path / "sign.safetensors"), arch=arch), DataOptions(**common))
    in_order = measure_gap(
        ModelSpec(str(tmp_path / "sign.safetensors"), arch=arch), DataOptions(**common, shuffle=False)
    )
    # running stats 0/1 fit the mixture: eval mode is perfect either way
    assert shuffled.eval_accuracy == 1.0 and in_order.eval_accuracy == 1.0
    # one-class batches normalise the class signal away; mixed batches keep it
    assert shuffled.train_accuracy > 0.9
    assert in_order.train_accuracy < 0.7
    assert any("--no-shuffle" in line for line in in_order.diagnosis)
    # a different seed gives different batches, the same seed the same
    again = measure_gap(ModelSpec(str(tmp_path / "sign.safetensors"), arch=arch), DataOptions(**common))
    assert again.train_accuracy == shuffled.train_accuracy and again.divergence == shuffled.divergence


def test_non_classifier_output_uses_relative_l2(tmp_path):
    (tmp_path / "reg.py").write_text(MODEL_SOURCE)
    ns = _namespace()
    torch.manual_seed(3)
    model = ns["Regressor"]()
    with torch.no_grad():
        model.bn.running_mean.copy_(torch.tensor([0.5, -1.0, 2.0]))
        model.bn.running_var.copy_(torch.tensor([1.0, 4.0, 0.25]))
    save_file(model.state_dict(), tmp_path / "reg.safetensors")
    x = torch.randn(40, 3, generator=torch.Generator().manual_seed(4))
    save_file({"inputs": x}, tmp_path / "x.safetensors")
    report = measure_gap(
        ModelSpec(str(tmp_path / "reg.safetensors"), arch=f"{tmp_path / 'reg.py'}:Regressor"),
        DataOptions(path=str(tmp_path / "x.safetensors"), batch_size=10),
    )
    model.eval()
    with torch.no_grad():
        y_e = model(x).double()
        y_t = torch.empty_like(y_e)
        for idx in _batches(40, 10):
            copy_ = copy.deepcopy(model)
            copy_.bn.train()
            y_t[idx] = copy_(x[idx]).double()
    expected = ((y_e - y_t).norm(dim=1) / y_e.norm(dim=1)).mean().item()
    assert report.divergence_kind == "relative_l2"
    assert report.divergence == pytest.approx(expected, rel=1e-5)
    assert report.train_accuracy is None and report.eval_accuracy is None and report.gap is None
    assert report.agreement is None


def test_torchscript_and_pickled_module_give_the_reference_accuracy(world, tmp_path):
    model = world["ns"]["tiny_net"]()
    model.load_state_dict(world["healthy"])
    model.eval()
    torch.jit.script(model).save(str(tmp_path / "scripted.pt"))
    ref = _reference(world["ns"], world["healthy"], world["x"], world["y"], _batches(120, 16))
    options = DataOptions(path=str(world["root"] / "val.safetensors"), batch_size=16)
    scripted = measure_gap(str(tmp_path / "scripted.pt"), options)
    assert scripted.eval_accuracy == pytest.approx(ref["eval_acc"], abs=1e-12)
    assert scripted.train_accuracy == pytest.approx(ref["train_acc"], abs=1e-12)
    assert all(d.note == "not measured (TorchScript)" for d in scripted.layers)
    assert any("TorchScript" in line for line in scripted.diagnosis)
    # the scripted module's buffers are restored too
    reloaded = torch.jit.load(str(tmp_path / "scripted.pt"))
    runnable = load_runnable(str(tmp_path / "scripted.pt"))
    measure_model_gap(runnable, make_loader(options))
    for (name, a), (_, b) in zip(runnable.module.state_dict().items(), reloaded.state_dict().items()):
        assert torch.equal(a, b), name
    # a whole pickled module built from torch.nn classes only
    seq = nn.Sequential(nn.Flatten(), nn.Linear(36, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3))
    seq.eval()
    torch.save(seq, tmp_path / "whole.pt")
    pickled = measure_gap(str(tmp_path / "whole.pt"), options)
    with torch.no_grad():
        expected = (seq(world["x"]).argmax(1) == world["y"]).double().mean().item()
    assert pickled.eval_accuracy == pytest.approx(expected, abs=1e-12)
    assert [d.name for d in pickled.layers] == ["2"]


# ----------------------------------------------------------------------------- diagnosis


def test_reset_statistics_are_diagnosed_with_recalibrate(world):
    report = _gap(world, "reset.safetensors")
    assert {f.code for f in report.findings} >= {"BN002"}
    assert report.gap is not None and report.gap > 0.05
    text = " ".join(report.diagnosis)
    assert "initial statistics" in text and "recalibrate" in text


def test_drift_that_starts_at_a_later_layer_is_named(world):
    report = _gap(world, "shifted.safetensors")
    assert any(line.startswith("Drift starts at features.4") for line in report.diagnosis)


def _variant(world, tmp_path, name: str, edit) -> str:
    state = {k: v.clone() for k, v in world["healthy"].items()}
    edit(state)
    save_file(state, tmp_path / name)
    return str(tmp_path / name)


def test_dead_channel_where_drift_starts_is_blamed(world, tmp_path):
    def kill_channel(state):
        state["features.4.running_var"][1] = 1e-7

    path = _variant(world, tmp_path, "dead.safetensors", kill_channel)
    report = measure_gap(
        ModelSpec(path, arch=world["arch"]), DataOptions(path=str(world["root"] / "val.safetensors"), batch_size=32)
    )
    assert [f.layer for f in report.findings if f.code == "BN004"] == ["features.4"]
    assert any(line.startswith("Drift starts at features.4, where BN004") for line in report.diagnosis)


def test_drift_from_the_first_layer_on_suspects_the_input_first(world, tmp_path):
    # Every channel of the first layer off by one ratio, the later layers inheriting it:
    # what wrong preprocessing looks like. Mature statistics (no BN003): the input is the
    # suspect, and re-estimating the statistics is not the advice (issue #13).
    def scale_first(state):
        state["features.1.running_var"] *= 8.0  # the counter stays high: no BN003

    path = _variant(world, tmp_path, "stale.safetensors", scale_first)
    report = measure_gap(
        ModelSpec(path, arch=world["arch"]), DataOptions(path=str(world["root"] / "val.safetensors"), batch_size=32)
    )
    assert "BN003" not in {f.code for f in report.findings}
    first = next(d for d in report.layers if d.name == "features.1")
    assert first.var_log_ratio == pytest.approx(math.log(8.0), abs=0.3)  # var_data ~ var_run / 8
    assert report.preprocessing_mismatch
    assert report.diagnosis[0].startswith("Suspect the input preprocessing before the statistics")
    assert not any("recalibrat" in line.lower() for line in report.diagnosis)


def test_healthy_model_needs_nothing(world):
    report = _gap(world, batch_size=32)
    assert abs(report.gap) <= 0.01
    assert all(not d.large for d in report.layers)
    assert report.diagnosis[-1].startswith("The stored statistics describe this data")


def test_eval_better_than_train_blames_batch_noise(world):
    report = _gap(world, batch_size=2, num_samples=60)
    assert report.gap < -0.01
    assert any("noisy" in line for line in report.diagnosis)


# ----------------------------------------------------------------------------- CLI


def _cli(*args: str):
    return CliRunner().invoke(app, ["gap", *args])


def test_cli_json_document(world):
    result = _cli(
        str(world["root"] / "healthy.safetensors"),
        "--arch",
        world["arch"],
        "--data",
        str(world["root"] / "val.safetensors"),
        "--batch-size",
        "16",
        "--format",
        "json",
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    for key in (
        "checkpoint",
        "data",
        "samples",
        "batch_size",
        "batches",
        "seed",
        "train_mode",
        "eval_mode",
        "gap",
        "agreement",
        "divergence",
        "divergence_kind",
        "layers",
        "findings",
        "diagnosis",
    ):
        assert key in doc, key
    ref = _reference(world["ns"], world["healthy"], world["x"], world["y"], _batches(120, 16))
    assert doc["samples"] == 120 and doc["batch_size"] == 16 and doc["batches"] == 8 and doc["seed"] == 0
    assert doc["eval_mode"]["accuracy"] == pytest.approx(ref["eval_acc"])
    assert doc["train_mode"]["accuracy"] == pytest.approx(ref["train_acc"])
    assert 0 <= doc["agreement"] <= 1
    assert {"name", "mean_shift", "max_mean_shift", "var_log_ratio"} <= set(doc["layers"][0])
    assert isinstance(doc["diagnosis"], list) and doc["diagnosis"]


def test_cli_table_prints_batches_and_diagnosis(world):
    result = _cli(
        str(world["root"] / "reset.safetensors"),
        "--arch",
        world["arch"],
        "--data",
        str(world["root"] / "val.safetensors"),
        "--batch-size",
        "16",
    )
    assert result.exit_code == 0, result.output
    assert "120 samples in 8 batches of 16" in result.stdout
    assert "BN002" in result.stdout and "diagnosis" in result.stdout
    assert result.stderr == ""  # no progress bar outside a terminal


def test_cli_findings_follow_the_project_configuration(world, tmp_path, monkeypatch):
    (tmp_path / "bnaudit.toml").write_text('ignore = ["BN002"]\n')
    monkeypatch.chdir(tmp_path)
    result = _cli(
        str(world["root"] / "reset.safetensors"),
        "--arch",
        world["arch"],
        "--data",
        str(world["root"] / "val.safetensors"),
        "--format",
        "json",
    )
    doc = json.loads(result.stdout)
    assert result.exit_code == 0 and doc["findings"] == []
    assert doc["gap"] > 0.05  # the measurement itself does not depend on the configuration


def test_cli_max_gap_sets_exit_code(world):
    base = [
        str(world["root"] / "reset.safetensors"),
        "--arch",
        world["arch"],
        "--data",
        str(world["root"] / "val.safetensors"),
        "--batch-size",
        "16",
    ]
    assert _cli(*base, "--max-gap", "0.01").exit_code == 1
    assert _cli(*base, "--max-gap", "0.99").exit_code == 0
    unlabelled = _cli(
        str(world["root"] / "healthy.safetensors"),
        "--arch",
        world["arch"],
        "--data",
        str(world["root"] / "unlabelled.safetensors"),
        "--max-gap",
        "0.1",
        "--format",
        "json",
    )
    assert unlabelled.exit_code == 2
    assert "labelled" in json.loads(unlabelled.stdout)["error"]


def test_cli_findings_fail_only_when_fail_on_is_stated_and_every_configuration_option_applies(
    world, tmp_path, monkeypatch
):
    # reset.safetensors carries BN002 (an error): context for the measurement, so it fails
    # the run only when the user states a fail-on, on the command line or in the configuration
    monkeypatch.chdir(tmp_path)
    base = [
        str(world["root"] / "reset.safetensors"),
        "--arch",
        world["arch"],
        "--data",
        str(world["root"] / "val.safetensors"),
        "--batch-size",
        "16",
        "--format",
        "json",
    ]
    plain = _cli(*base)
    assert plain.exit_code == 0, plain.output
    assert "BN002" in {f["code"] for f in json.loads(plain.stdout)["findings"]}
    (tmp_path / "pyproject.toml").write_text('[tool.bnaudit]\nfail-on = "info"\n')
    assert _cli(*base).exit_code == 1
    assert _cli(*base, "--exit-zero").exit_code == 0
    assert _cli(*base, "--isolated").exit_code == 0  # the pyproject.toml is not read
    assert _cli(*base, "--isolated", "--fail-on", "error").exit_code == 1
    quiet = tmp_path / "ci.toml"
    quiet.write_text('fail-on = "info"\nignore = ["BN"]\n')
    named = _cli(*base, "--config", str(quiet))  # read instead of the pyproject.toml
    assert named.exit_code == 0 and json.loads(named.stdout)["findings"] == []


def test_cli_exit_zero_passes_a_gap_above_max_gap_but_not_a_usage_error(world):
    base = [
        str(world["root"] / "reset.safetensors"),
        "--arch",
        world["arch"],
        "--data",
        str(world["root"] / "val.safetensors"),
        "--batch-size",
        "16",
    ]
    assert _cli(*base, "--max-gap", "0.01", "--exit-zero").exit_code == 0
    assert _cli(*base, "--max-gap", "5", "--exit-zero").exit_code == 2


def test_exit_code_of_a_report_whose_max_gap_cannot_be_checked_is_2_not_an_exception(world):
    # measure_gap refuses --max-gap on unlabelled data; a report built without it (the
    # model-level API) and given a limit afterwards still answers with an exit code
    runnable = load_runnable(ModelSpec(str(world["root"] / "healthy.safetensors"), arch=world["arch"]))
    stream = make_loader(DataOptions(path=str(world["root"] / "unlabelled.safetensors"), batch_size=16))
    report = measure_model_gap(runnable, stream)
    assert report.gap is None
    report.max_gap = 0.1
    assert report.exit_code() == 2
    assert report.exit_code(exit_zero=True) == 2


def _assert_one_line_error(world, args: list[str], *fragments: str) -> None:
    table = _cli(*args)
    assert table.exit_code == 2, table.output
    lines = table.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bnaudit: error: "), table.stderr
    assert "Traceback" not in table.output
    as_json = _cli(*args, "--format", "json")
    assert as_json.exit_code == 2
    message = json.loads(as_json.stdout)["error"]
    for fragment in fragments:
        assert fragment in message, message


def test_shape_the_model_rejects_names_the_layer(world, tmp_path):
    save_file({"inputs": torch.rand(10, 3, 6, 6)}, tmp_path / "rgb.safetensors")
    _assert_one_line_error(
        world,
        [
            str(world["root"] / "healthy.safetensors"),
            "--arch",
            world["arch"],
            "--data",
            str(tmp_path / "rgb.safetensors"),
            "--batch-size",
            "4",
        ],
        "batch 0",
        "layer 'features.0' (Conv2d)",
        "[4, 3, 6, 6]",
    )


def test_nan_in_a_batch_names_the_batch(world, tmp_path):
    x = world["x"].clone()
    x[7, 0, 2, 2] = float("nan")
    save_file({"inputs": x, "labels": world["y"]}, tmp_path / "nan.safetensors")
    _assert_one_line_error(
        world,
        [
            str(world["root"] / "healthy.safetensors"),
            "--arch",
            world["arch"],
            "--data",
            str(tmp_path / "nan.safetensors"),
            "--batch-size",
            "16",
            "--no-shuffle",
        ],
        "batch 0",
        "NaN or Inf",
        "nan.safetensors[7]",
    )


def test_labels_beyond_the_outputs_are_an_error(world, tmp_path):
    save_file({"inputs": world["x"][:8], "labels": torch.arange(8)}, tmp_path / "many.safetensors")
    _assert_one_line_error(
        world,
        [
            str(world["root"] / "healthy.safetensors"),
            "--arch",
            world["arch"],
            "--data",
            str(tmp_path / "many.safetensors"),
            "--batch-size",
            "4",
            "--no-shuffle",
        ],
        "labels range over",
        "3 outputs",
    )


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--batch-size", "1"], "--batch-size must be at least 2"),
        (["--num-samples", "0"], "--num-samples must be at least 1"),
        (["--device", "tpu"], "--device must be"),
        (["--image-size", "8"], "image folders only"),
        (["--max-gap", "5"], "--max-gap"),
    ],
)
def test_bad_options_are_one_line_errors(world, args, fragment):
    _assert_one_line_error(
        world,
        [
            str(world["root"] / "healthy.safetensors"),
            "--arch",
            world["arch"],
            "--data",
            str(world["root"] / "val.safetensors"),
            *args,
        ],
        fragment,
    )


def test_missing_data_and_missing_arch_are_one_line_errors(world):
    _assert_one_line_error(
        world, [str(world["root"] / "healthy.safetensors"), "--arch", world["arch"]], "--data PATH", "--dataset"
    )
    _assert_one_line_error(
        world,
        [str(world["root"] / "healthy.safetensors"), "--data", str(world["root"] / "val.safetensors")],
        "pass --arch",
    )
    _assert_one_line_error(
        world,
        [
            str(world["root"] / "healthy.safetensors"),
            "--arch",
            world["arch"],
            "--data",
            str(world["root"] / "nothing-here"),
        ],
        "no such file or folder",
    )


def test_cuda_device_is_refused_cleanly_without_a_gpu(world):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: this test needs a machine without CUDA")
    _assert_one_line_error(
        world,
        [
            str(world["root"] / "healthy.safetensors"),
            "--arch",
            world["arch"],
            "--data",
            str(world["root"] / "val.safetensors"),
            "--device",
            "cuda",
        ],
        "no CUDA device",
    )


def test_auto_device_runs_on_what_is_there(world):
    report = _gap(world, batch_size=32)
    auto = measure_gap(
        ModelSpec(str(world["root"] / "healthy.safetensors"), arch=world["arch"], device="auto"),
        DataOptions(path=str(world["root"] / "val.safetensors"), batch_size=32),
    )
    assert auto.device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert auto.eval_accuracy == report.eval_accuracy


@pytest.mark.slow
def test_python_m_bnaudit_gap_end_to_end(world):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bnaudit",
            "gap",
            str(world["root"] / "reset.safetensors"),
            "--arch",
            world["arch"],
            "--data",
            str(world["root"] / "val.safetensors"),
            "--batch-size",
            "16",
            "--format",
            "json",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["gap"] == pytest.approx(doc["train_mode"]["accuracy"] - doc["eval_mode"]["accuracy"])
    assert not math.isnan(doc["divergence"])


def test_measure_gap_refuses_batches_of_one(world):
    runnable = load_runnable(ModelSpec(str(world["root"] / "healthy.safetensors"), arch=world["arch"]))
    stream = make_loader(DataOptions(path=str(world["root"] / "val.safetensors"), batch_size=1))
    with pytest.raises(BnauditError, match="at least 2"):
        measure_model_gap(runnable, stream)


INSTANCE_SOURCE = """
from torch import nn


def instance_net():
    return nn.Sequential(
        nn.Conv2d(1, 3, 3, padding=1), nn.InstanceNorm2d(3, affine=True, track_running_stats=True, momentum=0.01), nn.ReLU(),
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2),
    )
"""


def _offset_images(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Images whose brightness varies between samples (offset of std 1.5) more than within
    one (noise of std 1): per-instance variances are well below the pooled one."""
    y = torch.randint(0, 2, (n,), generator=g)
    x = 1.5 * torch.randn(n, 1, 1, 1, generator=g) + torch.randn(n, 1, 8, 8, generator=g)
    x[:, :, :4] += y[:, None, None, None].float()  # the class shows in the top half
    return x, y


def test_a_tracked_instance_norm_is_compared_with_the_mean_of_per_instance_variances(tmp_path):
    # InstanceNorm's running_var averages the unbiased variance of each instance (sample,
    # channel) over its H*W values; the variance pooled over the batch adds the spread of the
    # instance means. On data like training's, the tracked statistics describe the data
    # and the layer is no drift origin.
    (tmp_path / "inet.py").write_text(INSTANCE_SOURCE)
    ns: dict = {}
    exec(INSTANCE_SOURCE, ns)
    torch.manual_seed(0)
    model = ns["instance_net"]()
    g = torch.Generator().manual_seed(3)
    x_train, y_train = _offset_images(256, g)
    train_classifier(model, x_train, y_train, steps=60)
    model.train()
    with torch.no_grad():  # let the running statistics (momentum 0.01) settle on the final weights
        for _ in range(300):
            model(x_train[torch.randperm(256, generator=g)[:32]])
    model.eval()
    save_file(model.state_dict(), tmp_path / "inet.safetensors")
    x_val, y_val = _offset_images(256, g)
    save_file({"inputs": x_val, "labels": y_val}, tmp_path / "val.safetensors")

    # independent: every instance's mean and unbiased variance at the InstanceNorm input
    seen: list[torch.Tensor] = []
    handle = model[1].register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach().double()))
    with torch.no_grad():
        model(x_val)
    handle.remove()
    inputs = seen[0].flatten(2)  # (N, C, H*W)
    per_instance_var = inputs.var(dim=2, unbiased=True).mean(dim=0)
    per_instance_mean = inputs.mean(dim=2).mean(dim=0)
    pooled_var = inputs.transpose(0, 1).reshape(3, -1).var(dim=1)
    assert float((pooled_var / per_instance_var).log().mean()) > 0.8  # the pooled statistic is far off

    runnable = load_runnable(
        ModelSpec(str(tmp_path / "inet.safetensors"), arch=str(tmp_path / "inet.py") + ":instance_net")
    )
    stream = make_loader(DataOptions(path=str(tmp_path / "val.safetensors"), batch_size=32))
    report = measure_model_gap(runnable, stream)
    layer = next(d for d in report.layers if d.name == "1")
    assert layer.kind == "InstanceNorm2d" and layer.values == 256 * 64
    for channel in layer.worst:
        assert channel.data_var == pytest.approx(float(per_instance_var[channel.index]), rel=1e-9)
        assert channel.data_mean == pytest.approx(float(per_instance_mean[channel.index]), rel=1e-9, abs=1e-12)
    assert layer.var_log_ratio < 0.2 and not layer.large and not layer.origin

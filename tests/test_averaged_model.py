"""SWA and EMA copies as `torch.optim.swa_utils.AveragedModel` writes them: `n_averaged`
beside `module.<name>` for every other key. Built with AveragedModel itself (both
use_buffers settings, SWA and EMA averaging functions) around a model trained on the
digits that ship with the repo; the expected numbers come from torch arithmetic on the
state dicts and from `swa_utils.update_bn`, not from bnaudit."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from conftest import SAMPLES, save_safetensors, save_torch, train_classifier
from safetensors.torch import load_file
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn, get_swa_multi_avg_fn, update_bn

from bnaudit.audit.checkpoint.inspect import audit_checkpoint
from bnaudit.audit.diff.checkpoints import diff
from bnaudit.config import Config
from bnaudit.formats.read import read_checkpoint
from bnaudit.runtime.models import ModelSpec

sys.path.insert(0, SAMPLES)
from digits_net import digits_net

BN = ("features.1", "features.4", "head.2")
STEPS, EVERY = 30, 5  # update_parameters after steps 5, 10, ..., 30
N_AVERAGED = STEPS // EVERY  # 6, by hand
CALIB = os.path.join(SAMPLES, "data", "digits_calib.safetensors")
ARCH = os.path.join(SAMPLES, "digits_net.py") + ":digits_net"

# name -> (AveragedModel keyword arguments, use_buffers)
VARIANTS = {
    "swa": ({}, False),
    "swa_buffers": ({"use_buffers": True}, True),
    "swa_multi": ({"multi_avg_fn": get_swa_multi_avg_fn()}, False),
    "ema": ({"multi_avg_fn": get_ema_multi_avg_fn(0.9)}, False),
    "ema_buffers": ({"multi_avg_fn": get_ema_multi_avg_fn(0.9), "use_buffers": True}, True),
}
COPIED = [name for name, (_, use_buffers) in VARIANTS.items() if not use_buffers]
AVERAGED = [name for name, (_, use_buffers) in VARIANTS.items() if use_buffers]


def state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.fixture(scope="module")
def digits():
    data = load_file(CALIB)
    return data["inputs"], data["labels"]


@pytest.fixture(scope="module")
def files(tmp_path_factory, digits):
    """live.pt and one AveragedModel state dict per variant, all from the same training
    run (the averages updated every EVERY steps); swa_bn.pt: swa after update_bn."""
    folder = tmp_path_factory.mktemp("averaged")
    x, y = digits
    torch.manual_seed(0)
    model = train_classifier(digits_net(), x, y, steps=40)
    averaged = {name: AveragedModel(model, **kwargs) for name, (kwargs, _) in VARIANTS.items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(9)
    model.train()
    for step in range(1, STEPS + 1):
        idx = torch.randperm(len(x), generator=g)[:32]
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % EVERY == 0:
            for avg in averaged.values():
                avg.update_parameters(model)
    paths = {"live": save_torch(state(model), folder / "live.pt")}
    states = {"live": state(model)}
    for name, avg in averaged.items():
        states[name] = state(avg)
        paths[name] = save_torch(avg.state_dict(), folder / f"{name}.pt")
    paths["swa_safetensors"] = save_safetensors(states["swa"], folder / "swa.safetensors")
    update_bn(torch.utils.data.DataLoader(x[:128], batch_size=32), averaged["swa"])
    states["swa_bn"] = state(averaged["swa"])
    paths["swa_bn"] = save_torch(averaged["swa"].state_dict(), folder / "swa_bn.pt")
    return paths, states


def weight_change(live: dict, averaged: dict, name: str) -> float:
    """max_c |gamma_b - gamma_a| / max(max_c |gamma_a|, 1e-3), in float64 torch arithmetic."""
    wa, wb = live[f"{name}.weight"].double(), averaged[f"module.{name}.weight"].double()
    return ((wb - wa).abs().max() / max(wa.abs().max().item(), 1e-3)).item()


@pytest.mark.parametrize("variant", [*VARIANTS, "swa_safetensors"])
def test_every_averaged_model_state_dict_is_read_as_one_layout(files, variant):
    paths, states = files
    ckpt = read_checkpoint(paths[variant])
    assert ckpt.prefix == "module." and ckpt.is_ema
    assert "n_averaged" not in ckpt.tensors
    assert set(ckpt.tensors) == {k.removeprefix("module.") for k in states[variant.split("_safe")[0]]} - {"n_averaged"}
    assert ckpt.averaging is not None
    assert (ckpt.averaging.kind, ckpt.averaging.n_averaged, ckpt.averaging.buffers) == (
        "AveragedModel",
        N_AVERAGED,
        "unknown",  # use_buffers is not saved, and 6 models were averaged
    )
    report = audit_checkpoint(ckpt, Config())
    assert [layer.name for layer in report.layers] == list(BN)
    assert report.averaging == ckpt.averaging
    # the copy's counter is not judged as a live model's (BN003 immaturity, BN010 unevenness)
    assert not [f for f in report.findings if f.code in ("BN003", "BN010")]


def test_what_the_counter_of_each_copy_holds(files):
    """What the layout's buffers are, checked against torch 2.13's AveragedModel: with
    use_buffers=False the copy's buffers are the live model's (counter included); with
    use_buffers=True they are averaged, and the counter falls behind the live one."""
    _, states = files
    live = states["live"]
    for name in COPIED:
        for leaf in ("running_mean", "running_var", "num_batches_tracked"):
            assert torch.equal(states[name][f"module.head.2.{leaf}"], live[f"head.2.{leaf}"]), (name, leaf)
    for name in AVERAGED:
        assert not torch.equal(states[name]["module.head.2.running_mean"], live["head.2.running_mean"])
        assert int(states[name]["module.head.2.num_batches_tracked"]) < int(live["head.2.num_batches_tracked"])
    assert all(int(states[name]["n_averaged"]) == N_AVERAGED for name in VARIANTS)


@pytest.mark.parametrize("variant", COPIED)
def test_diff_live_against_a_copy_with_the_live_buffers_pairs_every_layer_as_stale(files, variant):
    paths, states = files
    report = diff(paths["live"], paths[variant])
    assert report.summary()["matched"] == 3 and not report.only_a and not report.only_b
    assert [d.name for d in report.layers] == list(BN)
    for d in report.layers:
        assert d.verdict == "stale statistics" and d.stats_identical and not d.params_identical
        assert d.weight_change == pytest.approx(weight_change(states["live"], states[variant], d.name), rel=1e-9)
    assert sorted(f.layer for f in report.findings if f.code == "BN102") == sorted(BN)
    assert report.exit_code() == 1
    # statistics bit-identical to the live model's in every layer: the buffers were copied
    assert report.b.averaging is not None and report.b.averaging.buffers == "copied"
    assert report.b.averaging.describe() == "AveragedModel of 6 models, buffers copied from the live model"


@pytest.mark.parametrize("variant", AVERAGED)
def test_diff_live_against_averaged_buffers_ignores_the_averaged_counter(files, variant):
    """The averaged counter is below the live one: read as a count it would make every
    layer look re-estimated (counter fell); it is an average, so the layers moved."""
    paths, _ = files
    report = diff(paths["live"], paths[variant])
    assert [d.name for d in report.layers] == list(BN)
    assert all(d.verdict == "trained" and not d.counter_meaningful for d in report.layers)
    assert report.findings == []
    assert report.b.averaging is not None and report.b.averaging.buffers == "unknown"
    assert any("averaged copy (AveragedModel of 6 models" in line for line in report.diagnosis())


def test_diff_against_the_copy_after_update_bn_is_re_estimated(files):
    paths, states = files
    report = diff(paths["swa"], paths["swa_bn"])
    assert [d.name for d in report.layers] == list(BN)
    for d in report.layers:
        assert d.verdict == "re-estimated" and d.params_identical and not d.stats_identical
        assert d.batches_b == 4  # update_bn resets the counter, then counts its 4 batches of 32
        before, after = states["swa"], states["swa_bn"]
        ma, mb = before[f"module.{d.name}.running_mean"].double(), after[f"module.{d.name}.running_mean"].double()
        va = before[f"module.{d.name}.running_var"].double()
        assert d.max_mean_shift == pytest.approx(((mb - ma).abs() / (va + 1e-5).sqrt()).max().item(), rel=1e-9)
    assert {(f.code, f.severity) for f in report.findings} == {("BN103", "info")}


@pytest.mark.parametrize(("source", "output"), [("swa", "swa.recal.pt"), ("swa_safetensors", "swa.recal.safetensors")])
def test_recalibrate_writes_the_layout_back_and_equals_update_bn(files, digits, tmp_path, source, output):
    """recalibrate --method cumulative is update_bn's arithmetic: on the same batches the
    statistics agree to float32 accumulation; the file loads into AveragedModel strictly,
    with n_averaged and every other tensor as they were (torch file, safetensors file)."""
    from bnaudit import DataOptions, recalibrate_checkpoint

    paths, states = files
    out = str(tmp_path / output)
    options = DataOptions(path=CALIB, batch_size=50, shuffle=False)
    recalibrate_checkpoint(ModelSpec(paths[source], arch=ARCH), out, options, method="cumulative")
    written = load_file(out) if out.endswith(".safetensors") else torch.load(out, weights_only=True)
    loaded = AveragedModel(digits_net())
    loaded.load_state_dict(written, strict=True)
    assert int(written["n_averaged"]) == N_AVERAGED
    reference = AveragedModel(digits_net())
    reference.load_state_dict(states["swa"], strict=True)
    x, _ = digits
    update_bn(torch.utils.data.DataLoader(x, batch_size=50), reference)
    expected = reference.state_dict()
    stats = ("running_mean", "running_var", "num_batches_tracked")
    for key, value in written.items():
        if key.endswith(stats):
            continue
        assert torch.equal(value, states["swa"][key]), key
    for name in BN:
        ours, theirs = loaded.module.get_submodule(name), reference.module.get_submodule(name)
        assert torch.allclose(ours.running_mean, theirs.running_mean, rtol=1e-5, atol=1e-6), name
        assert torch.allclose(ours.running_var, theirs.running_var, rtol=1e-5), name
        assert int(written[f"module.{name}.num_batches_tracked"]) == int(expected[f"module.{name}.num_batches_tracked"])
    # and diff reads it as the same layout, re-estimated by bnaudit
    after = diff(paths[source], out)
    assert all(d.verdict == "re-estimated" and d.recalibrated for d in after.layers)


def test_arch_lines_the_layout_up_with_the_model(files):
    from bnaudit.runtime.models import load_runnable

    paths, _ = files
    runnable = load_runnable(ModelSpec(paths["swa"], arch=ARCH))
    assert runnable.facts.missing == () and runnable.facts.unexpected == ()
    assert runnable.checkpoint.averaging is not None


def test_one_update_means_the_buffers_are_the_one_model_s(tmp_path):
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    model.train()
    model(torch.randn(8, 4))
    avg = AveragedModel(model, use_buffers=True)
    avg.update_parameters(model)
    ckpt = read_checkpoint(save_torch(avg.state_dict(), tmp_path / "one.pt"))
    assert ckpt.averaging is not None and (ckpt.averaging.n_averaged, ckpt.averaging.buffers) == (1, "copied")
    assert set(ckpt.tensors) == {"0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean", "1.running_var",
                                 "1.num_batches_tracked"}  # fmt: skip


def test_a_pickled_averaged_model_says_what_use_buffers_was(tmp_path):
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    for use_buffers, expected in ((False, "copied"), (True, "averaged")):
        avg = AveragedModel(model, use_buffers=use_buffers)
        for _ in range(3):
            model.train()
            model(torch.randn(8, 4))
            avg.update_parameters(model)
        ckpt = read_checkpoint(save_torch(avg, tmp_path / f"whole{use_buffers}.pt"), trust_pickle=True)
        assert ckpt.averaging is not None and (ckpt.averaging.n_averaged, ckpt.averaging.buffers) == (3, expected)
        assert "1" in ckpt.modules and ckpt.prefix == "module."


def test_not_every_n_averaged_is_an_averaged_model(tmp_path):
    """A key named n_averaged beside keys without `module.` is an ordinary state dict."""
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    plain = {**model.state_dict(), "n_averaged": torch.tensor(3)}
    ckpt = read_checkpoint(save_torch(plain, tmp_path / "plain.pt"))
    assert ckpt.averaging is None and "n_averaged" in ckpt.tensors and ckpt.prefix == ""
    # timm ModelEmaV3 / DDP: every key under module., no n_averaged: a wrapper prefix only
    wrapped = {f"module.{k}": v for k, v in model.state_dict().items()}
    ckpt = read_checkpoint(save_torch(wrapped, tmp_path / "wrapped.pt"))
    assert ckpt.averaging is None and ckpt.prefix == "module." and not ckpt.is_ema


def test_lightning_swa_checkpoint_keeps_its_state_dict(tmp_path):
    """Lightning's StochasticWeightAveraging keeps its AveragedModel's state under
    callbacks (skipped); the model's state_dict is audited as before."""
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    avg = AveragedModel(model)
    avg.update_parameters(model)
    container = {
        "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
        "callbacks": {"StochasticWeightAveraging": {"average_model_state": avg.state_dict(), "n_averaged": 1}},
        "pytorch-lightning_version": "2.5.0",
    }
    ckpt = read_checkpoint(save_torch(container, tmp_path / "last.ckpt"))
    assert ckpt.key == "state_dict" and ckpt.prefix == "model." and ckpt.averaging is None


def test_cli_reports_the_averaging(files, cli):
    paths, _ = files
    result = cli("inspect", paths["swa"], "--isolated")
    assert "AveragedModel of 6 models, buffers copied or averaged: unknown" in " ".join(result.stdout.split())
    doc = json.loads(cli("diff", paths["live"], paths["swa"], "--format", "json", "--isolated").stdout)
    assert doc["b"]["averaging"]["n_averaged"] == 6 and doc["b"]["averaging"]["buffers"] == "copied"
    assert doc["a"]["averaging"] is None
    assert doc["summary"]["matched"] == 3 and doc["summary"]["stale_statistics"] == 3

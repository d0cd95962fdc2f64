"""The EMA copy people ship: timm's train.py loop (ModelEmaV3 updated with step=num_updates,
decay 0.998, no warm-up) saved by timm's CheckpointSaver with its `args`. A folder scan audits
both state dicts of each file; BN003 computes the initial values' weight from the schedule the
args record (51.6% after 288 updates at BN momentum 0.1), which the test checks two ways: its
own recursion, and the library itself (a second run whose initial statistics are shifted by
1: the EMA is affine in them, so the copy moves by exactly the weight). Also: a counter the
statistics contradict (TF-converted weights), and a copy bnaudit recalibrated."""

from __future__ import annotations

import argparse
import importlib.util
import os
import re

import pytest
import torch
from conftest import SAMPLES, bn_entries, save_safetensors
from safetensors.torch import load_file
from timm_support import import_timm

from bnaudit.api import inspect
from bnaudit.config import Config

DECAY, STEPS, MOMENTUM = 0.998, 288, 0.1
CALIB = os.path.join(SAMPLES, "data", "digits_calib.safetensors")
ARCH = os.path.join(SAMPLES, "digits_net.py") + ":digits_net"


def _schedule_weight(steps: int, decay: float, momentum: float) -> float:
    """The test's own recursion of timm's ModelEmaV3 schedule: update 1 copies the live model
    (decay 0), every later one keeps `decay`; the live buffers hold (1 - m)^k of their initial
    values after k updates (one BN forward per optimizer step)."""
    weight = 1.0
    for k in range(1, steps + 1):
        d = 0.0 if k == 1 else decay
        weight = d * weight + (1 - d) * (1 - momentum) ** k
    return weight


def _digits_net() -> torch.nn.Module:
    spec = importlib.util.spec_from_file_location("digits_net_for_schedule", os.path.join(SAMPLES, "digits_net.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.digits_net()


def _train(shift: float = 0.0) -> tuple[torch.nn.Module, torch.nn.Module, argparse.Namespace, torch.optim.Optimizer]:
    """timm's train.py loop: one optimizer step per batch, then model_ema.update(model,
    step=num_updates). `shift`: added to every BN's initial running_mean and running_var
    before training (train-mode forwards never read them, so training is unchanged)."""
    timm = import_timm()
    torch.manual_seed(0)
    model = _digits_net()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.running_mean += shift
                m.running_var += shift
    args = argparse.Namespace(
        model="digits_net", model_ema=True, model_ema_decay=DECAY, model_ema_warmup=False, bn_momentum=None
    )
    ema = timm.utils.ModelEmaV3(model, decay=args.model_ema_decay, use_warmup=args.model_ema_warmup)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = load_file(CALIB)
    g = torch.Generator().manual_seed(1)
    model.train()
    for num_updates in range(1, STEPS + 1):  # train.py counts optimizer updates from 1
        idx = torch.randint(0, len(data["inputs"]), (32,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(data["inputs"][idx]), data["labels"][idx])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        ema.update(model, step=num_updates)
    return model.eval(), ema, args, optimizer


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    timm = import_timm()
    model, ema, args, optimizer = _train()
    folder = tmp_path_factory.mktemp("output")
    saver = timm.utils.CheckpointSaver(
        model, optimizer, args=args, model_ema=ema, checkpoint_dir=str(folder), recovery_dir=str(folder)
    )
    saver.save_checkpoint(epoch=0, metric=0.5)
    shifted = _train(shift=1.0)[1].module
    return {
        "folder": str(folder),
        "last": str(folder / "last.pth.tar"),
        "model": model,
        "ema": ema.module,
        "shifted": shifted,
    }


def _bn_names(model: torch.nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]


def test_the_schedule_gives_51_6_percent_and_the_library_agrees(saved):
    """The premise, two ways: the recursion, and timm's own EMA (the copy moved by exactly
    the weight when the initial statistics moved by 1)."""
    expected = _schedule_weight(STEPS, DECAY, MOMENTUM)
    assert f"{expected * 100:.1f}" == "51.6"
    for name in _bn_names(saved["ema"]):
        moved = (
            saved["shifted"].get_submodule(name).running_var.double()
            - saved["ema"].get_submodule(name).running_var.double()
        )
        assert torch.allclose(moved, torch.full_like(moved, expected), atol=2e-5), name


def test_bn003_gives_the_schedules_weight_in_every_layer(saved):
    (live, copy_) = inspect(saved["last"]).files
    assert (live.key, copy_.key) == ("state_dict", "state_dict_ema")
    assert not [f for f in live.findings if f.code == "BN003"]
    found = {f.layer: f for f in copy_.findings if f.code == "BN003"}
    assert set(found) == set(_bn_names(saved["ema"]))
    weight = _schedule_weight(STEPS, DECAY, MOMENTUM)
    for f in found.values():
        assert f.severity == "error"  # more than half of the statistics are the initial 0/1
        (shown,) = re.findall(
            r"initial values weigh ([0-9.]+)% of its statistics, computed from the EMA schedule", f.message
        )
        assert shown == f"{weight * 100:.1f}"
        assert "model_ema_decay=0.998" in f.message and f"{STEPS} updates" in f.message
        assert "one BN update per EMA update" in f.message and "BN momentum 0.1 assumed" in f.message


def test_without_args_the_weight_is_worded_as_an_estimate(saved, tmp_path):
    state = torch.load(saved["last"], weights_only=False)
    del state["args"]
    path = str(tmp_path / "no_args.pth")
    torch.save(state, path)
    (_, copy_) = inspect(path).files
    messages = [f.message for f in copy_.findings if f.code == "BN003"]
    assert messages and all("estimated against the live model" in m and "about" in m for m in messages)
    assert not [m for m in messages if "computed from the EMA schedule" in m]


def test_a_checkpoint_saver_folder_fails_on_its_broken_ema_copies(saved, cli):
    report = inspect(saved["folder"])
    shown = [f.shown for f in report.files]
    for name in ("checkpoint-0.pth.tar", "last.pth.tar", "model_best.pth.tar"):
        for key in ("state_dict", "state_dict_ema"):
            assert os.path.join(saved["folder"], f"{name}:{key}") in shown
    summary = report.summary()
    assert (summary["files"], summary["state_dicts"]) == (3, 6) and report.exit_code() == 1
    result = cli("inspect", saved["folder"], "-q", width=80)
    assert result.exit_code == 1
    lines = result.output.splitlines()
    assert all(":state_dict_ema: " in line for line in lines if "BN003" in line) and any("BN003" in x for x in lines)
    assert lines[-1].startswith("3 files (6 state dicts), ")


def test_a_converted_placeholder_counter_is_info_not_an_error(tmp_path):
    """transnetv2-like: TF-converted statistics with num_batches_tracked = 1. One update at
    momentum 0.1 leaves running_var >= 0.9; most channels are far below it, so the counter is
    no count of updates. A layer that really saw one update keeps its error."""
    g = torch.Generator().manual_seed(0)
    state = {}
    for i in range(6):
        var = torch.rand(64, generator=g) * 0.8 + 0.01  # every channel below 0.9
        state.update(bn_entries(f"converted{i}", 64, var=var, counter=1))
    real = 0.9 + 0.1 * (torch.rand(32, generator=g) * 3)  # 0.9 * 1 + 0.1 * a batch's variance
    state.update(bn_entries("young", 32, var=real, mean=0.1 * torch.randn(32, generator=g), counter=1))
    (file,) = inspect(save_safetensors(state, tmp_path / "m.safetensors")).files
    found = {f.layer: f for f in file.findings if f.code == "BN003"}
    for i in range(6):
        f = found[f"converted{i}"]
        assert f.severity == "info" and "64 of 64 channels are below it" in f.message
        assert "the counter or the momentum is not real" in f.message
    assert found["young"].severity == "error" and "90.0% after 1 update" in found["young"].message
    assert file.findings and not [f for f in file.findings if f.severity == "error" and f.layer != "young"]


@pytest.mark.slow
def test_a_recalibrated_copy_is_not_relabelled_by_its_counters(saved, tmp_path):
    from bnaudit.runtime.data import DataOptions
    from bnaudit.runtime.models import ModelSpec
    from bnaudit.runtime.recalibrate.command import recalibrate_checkpoint

    out = str(tmp_path / "recalibrated.pth")
    recalibrate_checkpoint(ModelSpec(saved["last"], arch=ARCH, key="state_dict_ema"), out, DataOptions(path=CALIB))
    (_, copy_) = inspect(out).files
    assert copy_.key == "state_dict_ema" and copy_.averaging is not None
    assert copy_.averaging.kind == "EMA copy recalibrated by bnaudit" and "ModelEmaV2" not in copy_.averaging.describe()
    assert not [f for f in copy_.findings if f.code == "BN003"]
    from bnaudit.audit.diff.checkpoints import diff

    report = diff(out, out, Config(), key_a="state_dict", key_b="state_dict_ema")
    assert report.b.averaging is not None and report.b.averaging.kind == "EMA copy recalibrated by bnaudit"
    assert "ModelEmaV2" not in " ".join(report.diagnosis())


@pytest.mark.slow
def test_timm_resnet10t_saved_by_checkpoint_saver(tmp_path, cli):
    """The issue's own run: timm resnet10t, ModelEmaV3(decay 0.998) stepped as train.py steps
    it, 288 updates, saved by CheckpointSaver: the folder fails on its EMA copies, each layer
    at the schedule's 51.6%."""
    timm = import_timm()
    torch.manual_seed(0)
    model = timm.create_model("resnet10t", pretrained=False, num_classes=4)
    args = argparse.Namespace(model="resnet10t", model_ema_decay=DECAY, model_ema_warmup=False, pretrained=False)
    ema = timm.utils.ModelEmaV3(model, decay=DECAY)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 3, 16, 16, generator=g) * 0.5 + 1.0, torch.randint(0, 4, (64,), generator=g)
    model.train()
    for step in range(1, STEPS + 1):
        idx = torch.randint(0, 64, (4,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        ema.update(model, step=step)
    saver = timm.utils.CheckpointSaver(
        model.eval(), optimizer, args=args, model_ema=ema, checkpoint_dir=str(tmp_path), recovery_dir=str(tmp_path)
    )
    saver.save_checkpoint(epoch=0, metric=0.5)
    result = cli("inspect", str(tmp_path), "-q")
    assert result.exit_code == 1
    bn003 = [line for line in result.output.splitlines() if "BN003" in line]
    layers = _bn_names(model)
    assert len(bn003) == 3 * len(layers) and all(":state_dict_ema: " in line for line in bn003)
    weight = f"{_schedule_weight(STEPS, DECAY, MOMENTUM) * 100:.1f}%"
    assert all(f"initial values weigh {weight} of its statistics" in line for line in bn003)

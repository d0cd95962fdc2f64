"""Immature EMA copies made by timm's own ModelEmaV2 / ModelEmaV3 (decay 0.999, no warmup,
100 steps) and saved by timm's CheckpointSaver: after 100 updates the copy's buffers still
hold 0.999^100 = 90.5% of the initial 0/1, which eval mode pays for. inspect finds them,
gap diagnoses them, recalibrate repairs them without a flag, diff names the copy."""

from __future__ import annotations

import copy
import importlib.util
import os
import re

import pytest
import torch
from conftest import SAMPLES
from safetensors.torch import load_file
from timm_support import import_timm

from bnaudit.api import inspect
from bnaudit.config import Config
from bnaudit.runtime.models import ModelSpec

pytestmark = pytest.mark.slow

DECAY, STEPS = 0.999, 100
INITIAL_WEIGHT = DECAY**STEPS  # 0.9048: the initial values' share in the copy, by construction
CALIB = os.path.join(SAMPLES, "data", "digits_calib.safetensors")
VAL = os.path.join(SAMPLES, "data", "digits_val.safetensors")
ARCH = os.path.join(SAMPLES, "digits_net.py") + ":digits_net"


def _digits_net() -> torch.nn.Module:
    spec = importlib.util.spec_from_file_location("digits_net_for_ema", os.path.join(SAMPLES, "digits_net.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.digits_net()


def _accuracy(model: torch.nn.Module, train_mode: bool = False) -> float:
    val = load_file(VAL)
    model = copy.deepcopy(model).train(train_mode)
    with torch.no_grad():
        return (model(val["inputs"]).argmax(1) == val["labels"]).float().mean().item()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """DigitsNet trained 100 SGD steps with a ModelEmaV3 and a ModelEmaV2 copy updated after
    each; both saved by timm's CheckpointSaver ({"state_dict", "state_dict_ema", ...})."""
    timm = import_timm()
    from timm.utils import CheckpointSaver, ModelEmaV2, ModelEmaV3

    root = tmp_path_factory.mktemp("ema")
    data = load_file(CALIB)
    torch.manual_seed(0)
    model = _digits_net()
    v3, v2 = ModelEmaV3(model, decay=DECAY), ModelEmaV2(model, decay=DECAY)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    model.train()
    for _ in range(STEPS):
        idx = torch.randperm(len(data["inputs"]), generator=g)[:32]
        loss = torch.nn.functional.cross_entropy(model(data["inputs"][idx]), data["labels"][idx])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        v3.update(model)
        v2.update(model)
    model.eval()
    paths = {}
    for name, ema in (("v3", v3), ("v2", v2)):
        folder = root / name
        folder.mkdir()
        saver = CheckpointSaver(model, optimizer, model_ema=ema, checkpoint_dir=str(folder), recovery_dir=str(folder))
        saver.save_checkpoint(epoch=0, metric=0.5)
        paths[name] = str(folder / "last.pth.tar")
    assert timm.__version__
    return {"model": model, "v3": v3.module, "v2": v2.module, **{f"{k}_path": p for k, p in paths.items()}}


def _bn003(path: str, key: str) -> dict[str, object]:
    (file,) = inspect(path, Config(), key=key).files
    assert file.error is None, file.error
    return {"file": file, "findings": {f.layer: f for f in file.findings if f.code == "BN003"}}


@pytest.mark.parametrize("kind", ["v3", "v2"])
def test_inspect_finds_the_immature_ema_copy(trained, kind):
    model, ema = trained["model"], trained[kind]
    assert _accuracy(model) > 0.9 and _accuracy(ema) < 0.3  # the premise: the copy's eval mode collapses
    seen = _bn003(trained[f"{kind}_path"], "state_dict_ema")
    file, found = seen["file"], seen["findings"]
    assert file.is_ema and file.averaging.kind == {"v3": "timm ModelEmaV3", "v2": "timm ModelEmaV2"}[kind]
    names = [n for n, m in ema.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    assert set(found) == set(names)
    for name in names:
        f = found[name]
        assert f.severity == "error" and "recalibrate it, or use the live statistics" in f.message
        # the estimate against the live copy, within 5 points of the weight by construction
        (share,) = re.findall(r"still weigh about (\d+)%", f.message)
        assert abs(int(share) / 100 - INITIAL_WEIGHT) < 0.05, f.message
        # the factor against the test's own medians of the two copies' variances
        ema_var = ema.get_submodule(name).running_var.double()
        live_var = model.get_submodule(name).running_var.double()
        ratio = ((ema_var + 1e-5) / (live_var + 1e-5)).median().item()
        (shown,) = re.findall(r"running_var about ([0-9.]+)x the live model's", f.message)
        assert float(shown) == pytest.approx(ratio, rel=0.1)
    # a ModelEmaV2 copy's counter is 0: not "converted weights or momentum 0"
    assert not [f for f in file.findings if f.code == "BN009"]
    # the live model in the same file is mature: nothing
    assert _bn003(trained[f"{kind}_path"], "state_dict")["findings"] == {}


def test_counter_meaning_per_kind(trained):
    v3 = _bn003(trained["v3_path"], "state_dict_ema")["file"].averaging
    v2 = _bn003(trained["v2_path"], "state_dict_ema")["file"].averaging
    # timm/utils/model_ema.py: V3 copies integer buffers, V2 averages and truncates them
    assert trained["v3"].features[1].num_batches_tracked.item() == STEPS
    assert trained["v2"].features[1].num_batches_tracked.item() == 0
    assert "copied from the live model" in v3.counter_meaning
    assert "averaged" in v2.counter_meaning and "truncated" in v2.counter_meaning
    assert v3.buffers == v2.buffers == "averaged"


def test_v3_excluding_buffers_is_a_copy_of_the_live_statistics_and_not_immature(tmp_path):
    timm = import_timm()
    model = _digits_net()
    ema = timm.utils.ModelEmaV3(model, decay=DECAY, exclude_buffers=True)
    data = load_file(CALIB)
    model.train()
    with torch.no_grad():
        for batch in data["inputs"][:160].split(32):
            model(batch)
            ema.update(model)
    path = str(tmp_path / "c.pth")
    torch.save({"state_dict": model.state_dict(), "state_dict_ema": ema.module.state_dict()}, path)
    (file,) = inspect(path, Config(), key="state_dict_ema").files
    # counters and statistics both equal the live ones: copied buffers, whichever EMA it was
    assert file.averaging.kind == "EMA (unknown kind)" and file.averaging.buffers == "copied"
    assert [f.code for f in file.findings if f.code == "BN003"] == []


def test_gap_diagnoses_the_immature_copy_instead_of_the_preprocessing(trained):
    from bnaudit.runtime.data import DataOptions
    from bnaudit.runtime.gap import measure_gap

    report = measure_gap(ModelSpec(trained["v3_path"], arch=ARCH, key="state_dict_ema"), DataOptions(path=VAL))
    assert report.eval_accuracy == pytest.approx(_accuracy(trained["v3"]), abs=1e-6)
    assert report.train_accuracy > report.eval_accuracy + 0.2  # batch statistics keep much of it
    assert not report.preprocessing_mismatch
    text = " ".join(report.diagnosis)
    assert "Suspect the input preprocessing" not in text
    assert "EMA copy" in text and "recalibrate it, or use the live statistics" in text


def test_recalibrate_repairs_the_immature_copy_without_a_flag(trained, tmp_path):
    from bnaudit.runtime.data import DataOptions
    from bnaudit.runtime.recalibrate.command import recalibrate_checkpoint

    out = str(tmp_path / "ema.recal.pt")
    recalibrate_checkpoint(ModelSpec(trained["v3_path"], arch=ARCH, key="state_dict_ema"), out, DataOptions(path=CALIB))
    # the test's own repair: the copy's statistics recomputed as population statistics of the
    # calibration data (cumulative average over one pass in training mode), then evaluated
    own = copy.deepcopy(trained["v3"])
    for m in own.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.reset_running_stats()
            m.momentum = None
    own.train()
    with torch.no_grad():
        for batch in load_file(CALIB)["inputs"].split(32):
            own(batch)
    own.eval()
    repaired = _digits_net()
    state = torch.load(out, weights_only=True)
    state = state.get("state_dict_ema", state) if isinstance(state, dict) else state
    repaired.load_state_dict(state)
    before, after, expected = _accuracy(trained["v3"]), _accuracy(repaired), _accuracy(own)
    assert after > before + 0.3
    assert after == pytest.approx(expected, abs=0.03)


@pytest.mark.parametrize("kind", ["v3", "v2"])
def test_diff_names_the_copy_its_counter_and_its_immature_statistics(trained, kind):
    from bnaudit.audit.diff.checkpoints import diff

    path = trained[f"{kind}_path"]
    report = diff(path, path, Config(), key_a="state_dict", key_b="state_dict_ema")
    assert report.b.is_ema and not report.a.is_ema
    text = " ".join(report.diagnosis())
    assert "trained normally" not in text
    expected = "copied from the live model" if kind == "v3" else "truncated to an integer"
    assert f"Side B is an EMA copy (timm ModelEmaV{kind[1]})" in text and expected in text
    # the live counter is 100; the copy's is 100 (V3 copies it) or 0 (V2's truncated average)
    assert {d.batches_b - d.batches_a for d in report.layers} == {0 if kind == "v3" else -STEPS}
    found = {f.layer: f for f in report.findings if f.code == "BN003"}
    names = [n for n, m in trained[kind].named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    assert set(found) == set(names) and {f.severity for f in found.values()} == {"error"}
    assert all("side B, an EMA copy" in f.message for f in found.values())
    assert not [f for f in report.findings if f.code == "BN009"]

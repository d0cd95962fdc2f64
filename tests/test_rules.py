"""Each rule: fires, stays quiet, and each of its guards; numbers against hand arithmetic."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import bn_entries, save_safetensors, save_torch

from bnaudit import inspect
from bnaudit.audit.rules import RULES
from bnaudit.config import Config


def findings(tmp_path, state, config=None, name="m.pt", **kw):
    path = save_torch(state, tmp_path / name)
    report = inspect(path, config or Config(), **kw)
    assert report.files[0].error is None, report.files[0].error
    return report.files[0].findings


def codes(found):
    return sorted((f.code, f.severity, f.layer) for f in found)


def test_registry_has_the_documented_codes_and_names():
    assert {c: r.name for c, r in RULES.items()} == {
        "BN001": "missing-buffers",
        "BN002": "initial-values",
        "BN003": "immature-stats",
        "BN004": "near-eps-variance",
        "BN005": "invalid-values",
        "BN006": "batch-dependent-eval",
        "BN007": "stats-update-config",
        "BN008": "low-precision-buffers",
        "BN009": "counter-zero",
        "BN010": "uneven-counters",
        "BN011": "load-mismatch",
        "BN012": "training-mode-export",
        "BN013": "stats-not-constant",
        "BN014": "folded-export",
        "BN101": "frozen-but-updating",
        "BN102": "stale-statistics",
        "BN103": "re-estimated",
        "BN104": "uneven-counting",
        "BN105": "expectation-violated",
        "BN106": "settings-changed",
        "BN107": "layers-changed",
        "BN108": "export-tensors-differ",
        "BN109": "export-eps-differs",
        "BN110": "export-momentum-unconverted",
        "BN112": "folded-mismatch",
        "BN113": "export-unpaired",
        "BN114": "export-output-deviates",
        "BN201": "int8-per-tensor-collapse",
        "BN202": "int8-per-tensor-coarse",
        "BN203": "int8-per-channel-collapse",
        "BN204": "fp16-overflow",
        "BN205": "fp16-flush",
        "BN206": "half-cancellation",
        "BN207": "bn-not-paired",
        "BN301": "fed-copied-statistics",
        "BN302": "fed-averaged-variance",
        "BN303": "fed-initial-statistics",
        "BN304": "fed-unmatched-statistics",
        "BN305": "fed-averaged-counter",
        "BN401": "parity-layer-diverges",
        "BN402": "parity-outputs-deviate",
        "BN403": "parity-layer-unseen",
    }


def test_healthy_layers_give_no_findings(tmp_path):
    state = {**bn_entries("a", 8), **bn_entries("b", 16)}
    assert findings(tmp_path, state) == []


# BN001 ------------------------------------------------------------------------


def test_bn001_error_when_a_layer_lacks_one_statistic(tmp_path):
    state = {**bn_entries("a", 4), **bn_entries("b", 4)}
    del state["b.running_mean"]
    assert codes(findings(tmp_path, state)) == [("BN001", "error", "b")]


def test_bn001_warning_for_bn_named_parameters_without_any_statistics(tmp_path):
    state = {"bn1.weight": torch.rand(4), "bn1.bias": torch.rand(4), "conv.weight": torch.rand(4, 3, 1, 1)}
    (f,) = findings(tmp_path, state)
    assert (f.code, f.severity, f.layer) == ("BN001", "warning", None)
    assert "bn1" in f.message and "LayerNorm" in f.message


def test_bn001_quiet_for_layernorms_with_ordinary_names(tmp_path):
    state = {"encoder.ln.weight": torch.rand(4), "encoder.ln.bias": torch.rand(4)}
    assert findings(tmp_path, state) == []


# BN002 ------------------------------------------------------------------------


def test_bn002_error_for_identity_statistics_with_trained_weights(tmp_path):
    state = {**bn_entries("a", 4, mean=torch.zeros(4), var=torch.ones(4), counter=0), **bn_entries("b", 4)}
    (f,) = [f for f in findings(tmp_path, state) if f.code == "BN002"]
    assert (f.severity, f.layer) == ("error", "a") and "trained" in f.message


def test_bn002_says_untrained_when_weights_are_initial_too(tmp_path):
    state = bn_entries(
        "a", 4, mean=torch.zeros(4), var=torch.ones(4), weight=torch.ones(4), bias=torch.zeros(4), counter=0
    )
    (f,) = findings(tmp_path, state)
    assert f.code == "BN002" and f.severity == "error" and "untrained" in f.message


def test_bn002_quiet_when_one_channel_differs_by_one_ulp(tmp_path):
    var = torch.ones(4)
    var[2] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    state = bn_entries("a", 4, mean=torch.zeros(4), var=var, counter=0)
    assert [f.code for f in findings(tmp_path, state)] == ["BN009"]


def test_bn002_folded_frozen_bn_is_info(tmp_path):
    state = {
        **bn_entries("a", 4, mean=torch.zeros(4), var=torch.ones(4), counter=None),
        **bn_entries("b", 4, mean=torch.zeros(4), var=torch.ones(4), counter=None),
    }
    (f,) = findings(tmp_path, state)
    assert (f.code, f.severity, f.layer) == ("BN002", "info", None) and "folded" in f.message


def test_bn002_not_folded_when_one_layer_has_real_statistics(tmp_path):
    state = {
        **bn_entries("a", 4, mean=torch.zeros(4), var=torch.ones(4), counter=None),
        **bn_entries("b", 4, counter=None),
    }
    assert codes(findings(tmp_path, state)) == [("BN002", "error", "a")]


# BN003 ------------------------------------------------------------------------


@pytest.mark.parametrize("t", [1, 3, 6, 7, 10, 28, 29, 100])
def test_bn003_fires_iff_initial_weight_above_5_percent(tmp_path, t):
    weight = 0.9**t  # hand arithmetic: 0.9^28 = 5.23%, 0.9^29 = 4.71%
    found = [f for f in findings(tmp_path, bn_entries("a", 4, counter=t)) if f.code == "BN003"]
    if weight > 0.05:
        (f,) = found
        # error from 50% on: 0.9^6 = 53.1% is an error, 0.9^7 = 47.8% a warning
        assert f"{weight * 100:.1f}%" in f.message and f.severity == ("error" if t <= 6 else "warning")
    else:
        assert found == []
    assert (t <= 28) == bool(found)


def test_bn003_message_for_three_updates_is_72_9_percent(tmp_path):
    (f,) = findings(tmp_path, bn_entries("a", 4, counter=3))
    assert "72.9%" in f.message and "momentum 0.1" in f.message


def test_bn003_threshold_and_momentum_are_configurable(tmp_path):
    state = bn_entries("a", 4, counter=100)
    assert findings(tmp_path, state) == []
    # momentum 0.01 (a Keras port): 0.99^100 = 36.6%
    (f,) = findings(tmp_path, state, Config(momentum=0.01))
    assert f"{0.99**100 * 100:.1f}%" == "36.6%" and "36.6%" in f.message
    assert findings(tmp_path, bn_entries("a", 4, counter=3), Config(max_init_weight=0.8)) == []


def test_bn003_skipped_for_ema_copies(tmp_path):
    state = bn_entries("a", 4, counter=2)
    path = save_torch({"model": bn_entries("a", 4), "model_ema": state}, tmp_path / "c.pth")
    ema = inspect(path, key="model_ema").files[0]
    assert ema.is_ema and [f.code for f in ema.findings] == []
    plain = inspect(save_torch(state, tmp_path / "p.pt")).files[0]
    assert [f.code for f in plain.findings] == ["BN003"]


def test_bn003_skipped_for_cumulative_momentum_none(tmp_path):
    from torch import nn

    bn = nn.BatchNorm1d(3, momentum=None)
    bn.train()
    bn(torch.randn(8, 3))
    # the pickled module is available, so BN007 reports the cumulative momentum (info)
    assert codes(findings(tmp_path, nn.Sequential(bn))) == [("BN007", "info", "0")]


# BN004 ------------------------------------------------------------------------


def test_bn004_warning_with_eval_gain_316_for_a_dead_channel(tmp_path):
    var = torch.tensor([0.5, 0.0, 2e-5, 1.0])
    weight = torch.tensor([1.0, 1.0, 1.0, 1.0])
    # dead: |mean| < sqrt(var + eps) (0.00316 and 0.00548), so plausible, not an error
    mean = torch.tensor([0.3, 0.0, -0.005, 0.2])
    (f,) = findings(tmp_path, bn_entries("a", 4, mean=mean, var=var, weight=weight))
    assert (f.code, f.severity, f.channels) == ("BN004", "warning", (1, 2))
    gain_1 = 1 / math.sqrt(0 + 1e-5)  # 316.2
    gain_2 = 1 / math.sqrt(2e-5 + 1e-5)  # 182.6
    assert f"gain {gain_1:.1f}" in f.message and f"gain {gain_2:.1f}" in f.message
    assert "316.2" in f.message


def test_bn004_info_when_small_gamma_mutes_the_channels(tmp_path):
    var = torch.tensor([0.5, 0.0, 1.0])
    weight = torch.tensor([1.0, 0.01, 1.0])  # gain 0.01/sqrt(1e-5) = 3.2
    (f,) = findings(tmp_path, bn_entries("a", 3, var=var, weight=weight))
    assert (f.code, f.severity, f.channels) == ("BN004", "info", (1,))
    assert f"{0.01 / math.sqrt(1e-5):.1f}" in f.message


def test_bn004_thresholds_follow_eps_and_config(tmp_path):
    var = torch.tensor([5e-4, 1.0])  # below 10*eps only when eps = 1e-4
    state = bn_entries("a", 2, var=var, weight=torch.ones(2))
    assert findings(tmp_path, state) == []
    (f,) = findings(tmp_path, state, Config(eps=1e-4))
    assert f.channels == (0,) and f.severity == "info"  # gain 1/sqrt(6e-4) = 40.8 < 100
    (f,) = findings(tmp_path, state, Config(eps=1e-4, max_gain=40))
    assert f.severity == "warning"
    assert findings(tmp_path, state, Config(near_eps_factor=1000))[0].channels == (0,)


def test_bn004_without_affine_uses_gamma_one(tmp_path):
    state = {
        "a.running_mean": torch.zeros(2) + 0.3,
        "a.running_var": torch.tensor([0.0, 1.0]),
        "a.num_batches_tracked": torch.tensor(50),
    }
    (f,) = findings(tmp_path, state)
    assert f.code == "BN004" and "316.2" in f.message


# BN005 ------------------------------------------------------------------------


def test_bn005_nan_inf_negative_and_counter(tmp_path):
    var = torch.tensor([1.0, float("nan"), -0.5, float("inf")])
    mean = torch.tensor([0.1, 0.2, float("-inf"), 0.0])
    (f,) = [f for f in findings(tmp_path, bn_entries("a", 4, var=var, mean=mean, counter=-3)) if f.code == "BN005"]
    assert f.severity == "error" and f.channels == (1, 2, 3)
    assert "running_var has 1 NaN and 1 Inf" in f.message and "negative in 1 channel" in f.message
    assert "running_mean has 1 Inf" in f.message and "num_batches_tracked is negative (-3)" in f.message


def test_bn005_shape_disagreement(tmp_path):
    (f,) = findings(tmp_path, bn_entries("a", 4, bias=torch.zeros(5)))
    assert f.code == "BN005" and "bias has 5 values but the statistics have 4" in f.message


def test_bn005_nan_in_weight(tmp_path):
    (f,) = findings(tmp_path, bn_entries("a", 3, weight=torch.tensor([1.0, float("nan"), 1.0])))
    assert f.code == "BN005" and f.channels == (1,)


# BN008 / BN009 / BN010 --------------------------------------------------------


@pytest.mark.parametrize(
    "dtype,fires", [(torch.float16, True), (torch.bfloat16, True), (torch.float32, False), (torch.float64, False)]
)
def test_bn008_low_precision(tmp_path, dtype, fires):
    path = save_safetensors(bn_entries("a", 4, dtype=dtype), tmp_path / "m.safetensors")
    found = [f for f in inspect(path).files[0].findings if f.code == "BN008"]
    assert bool(found) == fires


def test_bn009_counter_zero_with_real_statistics_is_info(tmp_path):
    (f,) = findings(tmp_path, bn_entries("a", 4, counter=0))
    assert (f.code, f.severity) == ("BN009", "info")


def test_bn010_uneven_counters_name_the_groups(tmp_path):
    state = {
        **bn_entries("backbone.layer1.bn", 4, counter=5000),
        **bn_entries("backbone.layer2.bn", 4, counter=5000),
        **bn_entries("head.bn", 4, counter=800),
    }
    (f,) = findings(tmp_path, state)
    assert (f.code, f.severity, f.layer) == ("BN010", "info", None)
    assert "5000 in 2 layers (backbone.*)" in f.message and "800 in 1 layer (head.*)" in f.message


def test_bn010_quiet_for_equal_counters_and_missing_counters(tmp_path):
    state = {**bn_entries("a", 4, counter=70), **bn_entries("b", 4, counter=70), **bn_entries("c", 4, counter=None)}
    assert findings(tmp_path, state) == []


# select / ignore / per-layer-ignores -------------------------------------------


def test_select_ignore_and_per_layer_ignores_filter_findings(tmp_path):
    state = {
        **bn_entries("backbone.bn", 4, counter=3),
        **bn_entries("head.bn", 4, counter=3, mean=torch.tensor([0.0, 1, 1, 1]), var=torch.tensor([0.0, 1, 1, 1])),
    }
    all_codes = codes(findings(tmp_path, state))
    # 0.9^3 = 72.9% >= 50%: BN003 errors; head.bn's channel 0 is dead (mean 0): BN004 warns
    assert ("BN003", "error", "backbone.bn") in all_codes and ("BN004", "warning", "head.bn") in all_codes
    assert {c for c, _, _ in codes(findings(tmp_path, state, Config(select=("BN004",))))} == {"BN004"}
    assert "BN003" not in {c for c, _, _ in codes(findings(tmp_path, state, Config(ignore=("BN003",))))}
    kept = codes(findings(tmp_path, state, Config(per_layer_ignores={"backbone.*": ("BN003",)})))
    assert ("BN003", "error", "backbone.bn") not in kept and ("BN003", "error", "head.bn") in kept


def test_bn007_translates_momentum_only_for_exported_nodes(tmp_path):
    """A scripted module whose class happens to be called BatchNormalization keeps PyTorch's
    convention: only an exported node (ModuleInfo.source) had its momentum translated."""
    from torch import nn

    from bnaudit.api import inspect

    class BatchNormalization(nn.BatchNorm2d):
        pass

    model = nn.Sequential(nn.Conv2d(1, 2, 1), BatchNormalization(2, momentum=0.9)).eval()
    path = str(tmp_path / "scripted.pt")
    torch.jit.save(torch.jit.script(model), path)
    [bn007] = [f for f in inspect(path).findings if f.code == "BN007"]
    assert bn007.message.startswith("momentum 0.9: each batch replaces 90.0%")  # not "ONNX momentum 0.1 = ..."

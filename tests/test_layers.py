"""Layer discovery by what a prefix holds: real BN variants found, look-alikes skipped."""

from __future__ import annotations

import numpy as np
import torch
from conftest import bn_entries, save_safetensors, save_torch
from torch import nn

from bnaudit.audit.layers import discover_layers
from bnaudit.audit.settings import stated_settings
from bnaudit.formats.read import read_checkpoint


def discover(tmp_path, state, name="m.pt"):
    return discover_layers(read_checkpoint(save_torch(state, tmp_path / name)))


def test_every_batchnorm_kind_of_torch_nn_is_found(tmp_path):
    model = nn.Sequential(
        nn.BatchNorm1d(3),
        nn.BatchNorm2d(4),
        nn.BatchNorm3d(5),
        nn.SyncBatchNorm(6),
        nn.InstanceNorm2d(7, track_running_stats=True),
        nn.BatchNorm2d(8, affine=False),
    )
    found = discover(tmp_path, model.state_dict())
    assert [(l.name, l.num_features) for l in found.layers] == [
        ("0", 3),
        ("1", 4),
        ("2", 5),
        ("3", 6),
        ("4", 7),
        ("5", 8),
    ]
    assert found.layers[5].weight is None and found.layers[5].bias is None
    assert all(l.num_batches_tracked == 0 for l in found.layers)


def test_whole_module_gives_kind_eps_and_momentum(tmp_path):
    model = nn.Sequential(nn.InstanceNorm2d(7, track_running_stats=True, eps=1e-3), nn.BatchNorm2d(2, momentum=None))
    found = discover(tmp_path, model)
    assert [(l.kind, l.eps, l.momentum, l.settings_assumed) for l in found.layers] == [
        ("InstanceNorm2d", 1e-3, 0.1, False),
        ("BatchNorm2d", 1e-5, None, False),
    ]


def test_frozen_bn_without_counter_quantized_and_fused_qat_are_layers(tmp_path):
    state = {}
    state.update(bn_entries("backbone.frozen", 4, counter=None))  # FrozenBatchNorm2d: no counter
    state.update(bn_entries("q.bn", 4))
    state["q.bn.scale"] = torch.tensor(0.1)
    state["q.bn.zero_point"] = torch.tensor(0)
    state.update(bn_entries("convbn.bn", 4))  # fused QAT ConvBn2d keeps bn.* sub-keys
    state["convbn.weight"] = torch.randn(4, 3, 3, 3)
    found = discover(tmp_path, state)
    kinds = {l.name: (l.kind, l.num_batches_tracked) for l in found.layers}
    assert kinds == {
        "backbone.frozen": ("BatchNorm (no counter)", None),
        "q.bn": ("QuantizedBatchNorm", 100),
        "convbn.bn": ("BatchNorm", 100),
    }


def test_look_alikes_are_skipped_without_crashing(tmp_path):
    state = {
        # e3nn-style norm: statistics of different lengths
        "e3nn.running_mean": torch.zeros(3),
        "e3nn.running_var": torch.ones(5),
        # RL observation normaliser: float64 with a count
        "obs_rms.running_mean": torch.zeros(6, dtype=torch.float64),
        "obs_rms.running_var": torch.ones(6, dtype=torch.float64),
        "obs_rms.count": torch.tensor(1e4, dtype=torch.float64),
        # BatchRenorm: running_std instead of running_var
        "renorm.running_mean": torch.zeros(4),
        "renorm.running_std": torch.ones(4),
        # 2-D "statistics" and integer statistics
        "odd.running_mean": torch.zeros(2, 2),
        "odd.running_var": torch.ones(2, 2),
        "ints.running_mean": torch.zeros(3, dtype=torch.int64),
        "ints.running_var": torch.ones(3, dtype=torch.int64),
    }
    state.update(bn_entries("real", 4))
    found = discover(tmp_path, state)
    assert [l.name for l in found.layers] == ["real"]
    assert found.incomplete == []


def test_weight_length_disagreeing_with_statistics_is_still_a_layer(tmp_path):
    state = bn_entries("bn", 4, weight=torch.ones(3))
    found = discover(tmp_path, state)
    assert len(found.layers) == 1 and found.layers[0].weight == [1.0, 1.0, 1.0]


def test_incomplete_groups_and_parameters_without_buffers(tmp_path):
    state = bn_entries("a", 4)
    del state["a.running_var"]
    found = discover(tmp_path, state, "a.pt")
    assert [(g.name, g.missing) for g in found.incomplete] == [("a", ("running_var",))]
    assert found.suspected_without_buffers == []  # statistics exist in the file
    params_only = {
        "layer1.0.bn1.weight": torch.ones(4),
        "layer1.0.bn1.bias": torch.zeros(4),
        "layer1.0.downsample.1.weight": torch.ones(4),
        "layer1.0.downsample.1.bias": torch.zeros(4),
        "layer1.0.conv1.weight": torch.ones(4, 4, 3, 3),
        "fc.weight": torch.ones(4),
        "fc.bias": torch.ones(4),
    }
    found = discover(tmp_path, params_only, "b.pt")
    assert found.suspected_without_buffers == ["layer1.0.bn1", "layer1.0.downsample.1"]


def test_eps_and_momentum_options_replace_assumed_defaults(tmp_path):
    ckpt = read_checkpoint(save_safetensors(bn_entries("bn", 2), tmp_path / "m.safetensors"))
    default = discover_layers(ckpt).layers[0]
    assert (default.eps, default.momentum, default.settings_assumed) == (1e-5, 0.1, True)
    assert default.settings.eps.assumed and default.settings.momentum.assumed
    given = discover_layers(ckpt, stated_settings(1e-3, 0.01)).layers[0]
    assert (given.eps, given.momentum) == (1e-3, 0.01)
    assert given.settings.eps.given and given.settings.momentum.given and given.settings_assumed


def test_low_precision_statistics_keep_their_stored_dtype(tmp_path):
    state = bn_entries("bn", 3, dtype=torch.float16)
    layer = discover_layers(read_checkpoint(save_safetensors(state, tmp_path / "h.safetensors"))).layers[0]
    assert layer.stats_dtype == "float16"
    np.testing.assert_array_equal(layer.running_var, state["bn.running_var"].double().numpy())


def _layer_with(var, weight, eps):
    """A BNLayer built directly (no file): what the cached figures are computed from."""
    from bnaudit.audit.layers import BNLayer
    from bnaudit.audit.settings import stated_settings

    return BNLayer(
        name="bn",
        kind="BatchNorm",
        running_mean=[0.5] * len(var),
        running_var=var,
        weight=weight,
        bias=None,
        num_batches_tracked=10,
        stats_dtype="float32",
        settings=stated_settings(eps, None),
    )


def test_a_layers_figures_equal_the_formulas_whatever_is_asked_first():
    """The figures a layer keeps (gains, near-eps channels per factor, smallest variance) are
    the formulas' own answers, also when several factors are asked of one layer in turn (a
    cache kept for the first factor would answer the second wrongly)."""
    import math
    import random

    from bnaudit.audit.checkpoint.report import LayerSummary
    from bnaudit.audit.formulas import all_finite, eval_gains, near_eps_channels

    rng = random.Random(3)
    specials = [0.0, -0.0, 1e-7, 5e-5, 1e-3, -0.5, math.nan, math.inf, 2.0]
    for case in range(400):
        n = rng.choice([0, 1, 2, 5, 33])
        var = [rng.choice(specials) if rng.random() < 0.3 else rng.uniform(0, 3) for _ in range(n)]
        weight = rng.choice([None, [rng.gauss(1, 1) for _ in range(n)], [1.0] * max(n - 1, 0)])
        eps = rng.choice([1e-5, 1e-3, 0.0])
        factors = rng.sample([1.0, 10.0, 1000.0, 1e6], 3)
        layer = _layer_with(var, weight, eps)
        for factor in factors:
            expected = near_eps_channels(var, eps, factor)
            assert layer.near_eps(factor) == expected, (case, factor)
            assert LayerSummary.of(layer, factor).near_eps_channels == len(expected)
        gains = eval_gains(weight, var, eps)
        assert [repr(g) for g in layer.gains] == [repr(g) for g in gains], case
        finite = all_finite(var)
        assert layer.var_floor == (min(var, default=math.inf) if finite else None)

"""bnaudit.audit.formulas against hand arithmetic: each BN formula, its units and its edges
(the values in the comments are worked out by hand, not read from the program)."""

from __future__ import annotations

import math

import pytest

from bnaudit.audit.formulas import (
    eval_gain,
    eval_gains,
    folded_bias,
    folded_conv,
    folded_scale,
    implied_eps,
    initial_weight,
    near_eps_channels,
    pytorch_momentum,
    retained_fraction,
)

pytestmark = pytest.mark.torchfree  # runs without torch (conftest.py)


def test_eval_gain_of_a_dead_channel_at_the_default_eps_is_316():
    # 1 / sqrt(0 + 1e-5) = 1 / 0.0031622777 = 316.22777
    assert eval_gain(1.0, 0.0, 1e-5) == pytest.approx(316.22777, rel=1e-7)
    # |gamma| counts, not its sign: 2 / sqrt(3 + 1) = 1
    assert eval_gain(-2.0, 3.0, 1.0) == 1.0


def test_eval_gain_edges_follow_ieee_and_invalid_statistics_have_none():
    assert math.isnan(eval_gain(1.0, -1.0, 1e-5))  # negative variance: BN005, no gain
    assert math.isnan(eval_gain(1.0, math.inf, 1e-5))
    assert math.isnan(eval_gain(1.0, math.nan, 1e-5))
    assert eval_gain(1.0, 0.0, 0.0) == math.inf  # 1 / 0
    assert math.isnan(eval_gain(0.0, 0.0, 0.0))  # 0 / 0


def test_eval_gains_per_channel_take_gamma_1_without_a_matching_weight():
    # var (0, 3) at eps 1: 1/sqrt(1) = 1 and 1/sqrt(4) = 0.5
    assert eval_gains(None, [0.0, 3.0], 1.0) == [1.0, 0.5]
    assert eval_gains([4.0, 4.0, 4.0], [0.0, 3.0], 1.0) == [1.0, 0.5]  # 3 weights for 2 channels
    assert eval_gains([4.0, -4.0], [0.0, 3.0], 1.0) == [4.0, 2.0]
    # the per-value path (a NaN variance) gives the same numbers for the valid channels
    gains = eval_gains([4.0, -4.0], [math.nan, 3.0], 1.0)
    assert math.isnan(gains[0]) and gains[1] == 2.0


def test_folded_scale_and_bias():
    # s = gamma / sqrt(var + eps), signed: -2 / sqrt(3 + 1) = -1
    assert folded_scale(-2.0, 3.0, 1.0) == -1.0
    # t = beta + (b - mean) * s = 0.5 + (0.25 - 1) * 2 = -1
    assert folded_bias(0.5, 0.25, 1.0, 2.0) == -1.0
    # var + eps = 0: x/0 = +-inf; var + eps < 0: NaN (sqrt of a negative)
    assert folded_scale(-1.0, -1e-5, 1e-5) == -math.inf
    assert math.isnan(folded_scale(1.0, -1.0, 1e-5))


def test_folded_conv_per_channel():
    # gamma (2, 1), beta (0.5, -1), mean (1, 0), var (3, 0.25), eps 1, conv bias (0.25, none: 0)
    scales, shifts = folded_conv([2.0, 1.0], [0.5, -1.0], [1.0, 0.0], [3.0, 0.25], 1.0, [0.25, 0.0])
    # s = 2/sqrt(4) = 1, 1/sqrt(1.25); t = 0.5 + (0.25 - 1)*1 = -0.25, -1 + (0 - 0)*s = -1
    assert scales == [1.0, pytest.approx(1 / math.sqrt(1.25), rel=1e-15)]
    assert shifts == [-0.25, -1.0]
    # without affine parameters and conv bias: gamma 1, beta 0, b 0
    scales, shifts = folded_conv(None, None, [2.0], [3.0], 1.0, None)
    assert scales == [0.5] and shifts == [-1.0]  # 1/sqrt(4); 0 + (0 - 2) * 0.5


def test_implied_eps_inverts_the_folded_scale():
    # (gamma / s)^2 - var = (2 / 1)^2 - 3 = 1
    assert implied_eps(2.0, 1.0, 3.0) == 1.0
    # a Keras eps recovered from a scale folded at 1e-3: 1 / sqrt(0.01 + 0.001)
    assert implied_eps(1.0, 1 / math.sqrt(0.011), 0.01) == pytest.approx(1e-3, rel=1e-9)


def test_initial_weight_is_one_minus_momentum_to_the_t():
    assert initial_weight(0.1, 10) == pytest.approx(0.3486784401, rel=1e-12)  # 0.9^10
    assert initial_weight(0.1, 2) == pytest.approx(0.81, rel=1e-15)
    assert initial_weight(0.1, 0) == 1.0  # never updated: all initial values
    assert initial_weight(0.0, 1000) == 1.0  # momentum 0: the buffers never move
    # momentum None (cumulative average): the first batch has factor 1/1 and replaces them
    assert initial_weight(None, 0) == 1.0
    assert initial_weight(None, 1) == 0.0 and initial_weight(None, 7) == 0.0


def test_near_eps_channels():
    # factor 10 at eps 1e-5: var < 1e-4; 1e-4 itself is not below, NaN and negatives are not near-eps
    assert near_eps_channels([0.0, 5e-5, 1e-4, math.nan, -1.0, 2.0], 1e-5, 10.0) == [0, 1]
    assert near_eps_channels([1.0, 2.0], 1e-5, 10.0) == []


def test_momentum_conventions_translate_both_ways_and_have_one_definition():
    import bnaudit.normkinds as normkinds

    # ONNX/Keras keep r of the old statistics, PyTorch weighs the new batch by m = 1 - r:
    # ONNX 0.9 = PyTorch 0.1, Keras 0.99 = PyTorch 0.01, HF MobileNetV2's 0.997 = 1 - 0.003
    assert pytorch_momentum(0.9) == pytest.approx(0.1, abs=1e-15)
    assert pytorch_momentum(0.99) == pytest.approx(0.01, abs=1e-15)
    assert retained_fraction(0.1) == pytest.approx(0.9, abs=1e-15)
    assert retained_fraction(0.003) == pytest.approx(0.997, abs=1e-15)
    assert retained_fraction(0.0) == 1.0 and pytorch_momentum(1.0) == 0.0
    for m in (0.0, 0.125, 0.25, 0.5, 0.75, 1.0):  # dyadic, so 1 - m is exact and the round trip too
        assert pytorch_momentum(retained_fraction(m)) == m
    # one home: formulas re-exports the readers' definitions (formats/ cannot import audit/)
    assert pytorch_momentum is normkinds.pytorch_momentum
    assert retained_fraction is normkinds.retained_fraction

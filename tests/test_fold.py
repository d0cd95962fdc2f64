"""bnaudit.audit.export.folded against hand arithmetic: small folds whose scale, shift and eps are
worked out in the comments, without torch or an exporter."""

from __future__ import annotations

import math

import pytest

from bnaudit.audit.export.folded import best_implied_eps, fold_layer, recover_scales
from bnaudit.audit.formulas import folded_conv

pytestmark = pytest.mark.torchfree  # runs without torch (conftest.py)

# One BN layer of 2 channels: gamma (2, 1), beta (0.5, -1), mean (1, 0), var (3, 0.01), eps 1e-5.
GAMMA, BETA, MEAN, VAR, EPS = [2.0, 1.0], [0.5, -1.0], [1.0, 0.0], [3.0, 0.01], 1e-5
W = [[1.0, -2.0, 0.5], [0.0, 4.0, -1.0]]  # conv weights per output channel


def folded(eps: float = EPS, mean=MEAN, var=VAR):
    """The export an exact fold writes: W'_c = s_c W_c, b'_c = beta_c - mu_c s_c (no conv bias)."""
    s = [g / math.sqrt(v + eps) for g, v in zip(GAMMA, var)]
    rows = [[s[c] * x for x in W[c]] for c in range(2)]
    bias = [BETA[c] - mean[c] * s[c] for c in range(2)]
    return rows, bias


def test_expected_fold_is_gamma_over_sqrt_var_plus_eps():
    s, t = folded_conv(GAMMA, BETA, MEAN, VAR, EPS, conv_bias=[0.25, 0.0])
    # channel 0: 2 / sqrt(3.00001); shift 0.5 + (0.25 - 1) * s0
    assert s[0] == pytest.approx(2 / math.sqrt(3.00001), rel=1e-15)
    assert t[0] == pytest.approx(0.5 - 0.75 * 2 / math.sqrt(3.00001), rel=1e-15)
    # channel 1: 1 / sqrt(0.01001); shift -1 + 0 * s1
    assert s[1] == pytest.approx(1 / math.sqrt(0.01001), rel=1e-15) and t[1] == -1.0


def test_recover_scales_by_least_squares():
    scales, residual = recover_scales([[2.0, -4.0, 1.0], [0.0, 2.0, -0.5]], W)
    assert scales == [2.0, 0.5] and residual == 0.0
    # one weight off by 0.1: s = <e, c>/<c, c> = (2.1 + 8 + 0.5) / 5.25, residual from the peak 4
    scales, residual = recover_scales([[2.1, -4.0, 1.0]], [W[0]])
    s = 10.6 / 5.25
    assert scales[0] == pytest.approx(s, rel=1e-15)
    worst = max(abs(2.1 - s), abs(-4.0 + 2 * s), abs(1.0 - 0.5 * s))
    assert residual == pytest.approx(worst / 4.0, rel=1e-12)


def test_all_zero_channels():
    scales, residual = recover_scales([[0.0, 0.0]], [[0.0, 0.0]])
    assert scales == [None] and residual == 0.0  # nothing to recover, nothing wrong
    scales, residual = recover_scales([[1.0, 0.0]], [[0.0, 0.0]])
    assert scales == [None] and residual == math.inf  # not a scaled copy


def test_an_exact_fold_matches_and_implies_its_eps():
    rows, bias = folded()
    check = fold_layer(rows, bias, W, None, GAMMA, BETA, MEAN, VAR, EPS)
    assert check.matches and check.cause == ""
    assert check.scale_error < 1e-15 and check.shift_error < 1e-15
    # channel 1 (var 0.01) pins eps: (1 / s1)^2 - 0.01 = 1e-5
    assert check.implied_eps == pytest.approx(1e-5, rel=1e-6) and "channel 1" in check.eps_note


def test_another_eps_is_named():
    rows, bias = folded(eps=1e-3)
    check = fold_layer(rows, bias, W, None, GAMMA, BETA, MEAN, VAR, EPS)
    # channel 1: s = 1/sqrt(0.011) against 1/sqrt(0.01001): relative error sqrt(0.01001/0.011) - 1
    assert check.scale_error == pytest.approx(1 - math.sqrt(0.01001 / 0.011), rel=1e-9)
    assert not check.matches and check.implied_eps == pytest.approx(1e-3, rel=1e-9)
    assert "eps 0.001 instead of 1e-05" in check.cause


def test_identity_statistics_folded_in():
    rows, bias = folded(mean=[0.0, 0.0], var=[1.0, 1.0])
    check = fold_layer(rows, bias, W, None, GAMMA, BETA, MEAN, VAR, EPS)
    assert not check.matches and "identity statistics" in check.cause


def test_other_statistics_folded_in():
    rows, bias = folded(mean=[0.9, 0.1], var=[2.5, 0.02])
    check = fold_layer(rows, bias, W, None, GAMMA, BETA, MEAN, VAR, EPS)
    assert not check.matches and "not the checkpoint's" in check.cause


def test_weights_that_are_not_a_scaled_copy():
    rows, bias = folded()
    rows[0][1] += 0.5
    check = fold_layer(rows, bias, W, None, GAMMA, BETA, MEAN, VAR, EPS)
    assert not check.scaled_copy and not check.matches and "not the checkpoint conv's scaled" in check.cause


def test_eps_not_determinable_when_variances_dwarf_it():
    eps_hat, how, consistent = best_implied_eps([1 / math.sqrt(1e4 + 1e-5)], [1.0], [1e4], 1e-5)
    assert eps_hat is None and "not determinable" in how and consistent

"""BatchNorm arithmetic: every formula bnaudit applies to a layer's statistics, defined once.

Torch- and numpy-free (plain Python floats), like the rest of audit/. The conventions are
PyTorch's `nn/modules/batchnorm.py`, per channel c (gamma_c = 1 and beta_c = 0 without
affine parameters):

  training forward  y = (x - E[x]) / sqrt(Var[x] + eps) * gamma + beta, with the batch's
                    mean and its biased variance (divided by n, the N*H*W values of c)
  running update    running = (1 - m) * running + m * batch, with the batch's unbiased
                    variance (divided by n - 1); m = momentum, the weight of the new batch
                    (ONNX and Keras store the retained fraction 1 - m instead:
                    `retained_fraction`, `pytorch_momentum`);
                    momentum None: cumulative average, m = 1 / num_batches_tracked
  eval forward      y = (x - running_mean) / sqrt(running_var + eps) * gamma + beta

Units: mean in the units of x, var and eps in squared units of x, a scale (gain) in units
of gamma per unit of x, weights (initial weight) dimensionless.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence

# Defined in bnaudit.normkinds (formats/ needs them and must not import audit/); re-exported
# so every BN formula can be found here.
from bnaudit.normkinds import pytorch_momentum, retained_fraction

__all__ = [
    "COARSE_LEVELS",
    "COLLAPSE_LEVELS",
    "FP16_FLUSH",
    "FP16_OVERFLOW",
    "INT8_LEVELS",
    "SILENT_FLOOR",
    "UNIT_ROUNDOFF",
    "all_finite",
    "channel_signal",
    "ema_decays",
    "ema_initial_weight",
    "eval_gain",
    "eval_gains",
    "folded_bias",
    "folded_conv",
    "folded_scale",
    "implied_data_value",
    "implied_eps",
    "initial_weight",
    "near_eps_channels",
    "pytorch_momentum",
    "retained_fraction",
    "valid_eval_gains",
    "variance_overstatement",
]

# What the number formats a folded layer is deployed in do to its values (bnaudit.audit.fold.check
# applies them; the fold rules' documentation quotes them).
INT8_LEVELS = 127  # symmetric int8: the scale S maps the largest magnitude to 127 levels
# A weight at or below this many scales rounds to 0 (round half to even sends 0.5 to 0).
COLLAPSE_LEVELS = 0.5
# Below this many levels for its largest weight a channel keeps fewer than 4 bits.
COARSE_LEVELS = 8.0
# A channel whose float output varies by at most this fraction of the layer's loudest
# channel's (`channel_signal`), or whose folded weights are at most this fraction of the
# layer's largest, carries nothing in float already: int8 cannot take from it what it does not
# carry (a slimmed network's gamma ~1e-9, a channel whose input never varies).
SILENT_FLOOR = 1e-6
# The smallest magnitude float16 rounds to inf (65504 + half its last step of 32).
FP16_OVERFLOW = 65520.0
# The largest magnitude float16 rounds to 0 (half its smallest subnormal 2^-24).
FP16_FLUSH = 2.0**-25
# Unit roundoff: half the distance from 1 to the next number of the format.
UNIT_ROUNDOFF = {"fp16": 2.0**-11, "bf16": 2.0**-8}


def folded_scale(gamma: float, var: float, eps: float) -> float:
    """s = gamma / sqrt(var + eps): the factor eval mode applies to x - running_mean, and
    the per-output-channel factor an exporter multiplies a preceding conv's weights by
    (W' = W * s). Signed, in units of gamma per unit of x. IEEE float64 where the
    denominator vanishes (x/0 = +-inf, 0/0 or NaN/0 = NaN) and NaN where var + eps < 0
    (the square root of a negative), instead of Python's exceptions."""
    denominator = var + eps
    if denominator > 0:
        return gamma / math.sqrt(denominator)
    if denominator == 0 and gamma != 0 and not math.isnan(gamma):
        return math.copysign(math.inf, gamma)
    return math.nan


def folded_bias(beta: float, conv_bias: float, mean: float, scale: float) -> float:
    """t = beta + (b - mean) * s: the bias of a conv (own bias b, 0 without one) with the BN
    after it folded in, s = folded_scale(gamma, var, eps). In the units of y."""
    return beta + (conv_bias - mean) * scale


def folded_conv(
    gamma: Sequence[float] | None,
    beta: Sequence[float] | None,
    mean: Sequence[float],
    var: Sequence[float],
    eps: float,
    conv_bias: Sequence[float] | None,
) -> tuple[list[float], list[float]]:
    """(s_c, t_c) for every channel: folded_scale and folded_bias, what a conv followed by
    this BN becomes when an exporter folds them (gamma 1 and beta 0 without affine
    parameters, b 0 without a conv bias)."""
    n = len(mean)
    g = list(gamma) if gamma is not None else [1.0] * n
    bt = list(beta) if beta is not None else [0.0] * n
    b = list(conv_bias) if conv_bias is not None else [0.0] * n
    scales = [folded_scale(g[c], var[c], eps) for c in range(n)]
    return scales, [folded_bias(bt[c], b[c], mean[c], scales[c]) for c in range(n)]


def implied_eps(gamma: float, scale: float, var: float) -> float:
    """eps' = (gamma / s)^2 - var: the eps at which folded_scale(gamma, var, eps') = s, the
    inverse of folded_scale (in squared units of x). Its uncertainty grows with var + eps:
    a channel whose variance dwarfs eps cannot tell eps apart from 0."""
    return (gamma / scale) ** 2 - var


def eval_gain(gamma: float, var: float, eps: float) -> float:
    """g = |s| = |gamma| / sqrt(var + eps): the factor by which eval mode multiplies a
    channel's deviation from running_mean (a dead channel, var 0 and gamma 1, at eps 1e-5
    gets 1 / sqrt(1e-5) = 316.2x). NaN where var is NaN, infinite or negative: invalid
    statistics have no gain; otherwise |folded_scale|."""
    if not math.isfinite(var) or var < 0:
        return math.nan
    return abs(folded_scale(gamma, var, eps))


def eval_gains(gamma: Sequence[float] | None, var: Sequence[float], eps: float) -> list[float]:
    """eval_gain of every channel; gamma None (no affine weight) or of another length than
    var (BN005 reports it) counts as 1."""
    if eps > 0 and all_finite(var) and min(var, default=0.0) >= 0:  # every denominator > 0
        return valid_eval_gains(gamma, var, eps)
    gains = gamma if gamma is not None and len(gamma) == len(var) else [1.0] * len(var)
    return [eval_gain(g, v, eps) for g, v in zip(gains, var)]


def valid_eval_gains(gamma: Sequence[float] | None, var: Sequence[float], eps: float) -> list[float]:
    """eval_gains where the caller knows eps > 0 and every var finite and >= 0 (no test per channel)."""
    gains = gamma if gamma is not None and len(gamma) == len(var) else [1.0] * len(var)
    sqrt = math.sqrt  # a local: a quarter faster than a chain of maps over operator's builtins
    return [abs(g) / sqrt(v + eps) for g, v in zip(gains, var)]


def near_eps_channels(var: Sequence[float], eps: float, factor: float) -> list[int]:
    """Indices of the near-eps channels, 0 <= var_c < factor * eps (NaN is not near-eps)."""
    limit = factor * eps
    if all_finite(var) and min(var, default=limit) >= limit:  # the common case: none
        return []
    return [c for c, v in enumerate(var) if 0 <= v < limit]  # NaN compares False


def initial_weight(momentum: float | None, updates: int) -> float:
    """w = (1 - m)^t: the share the initial values (running_mean 0, running_var 1) still
    hold in the running buffers after t = num_batches_tracked updates at momentum m
    (dimensionless, 0 to 1): 0.9^10 = 0.349 at PyTorch's default 0.1. Momentum None
    (cumulative average) replaces them entirely with the first batch (its factor 1/1):
    w = 1 before any update, 0 after."""
    if momentum is None:
        return 1.0 if updates <= 0 else 0.0
    return float((1.0 - momentum) ** updates)


def channel_signal(gamma: float, var: float, eps: float) -> float:
    """sigma_c = |gamma_c| sqrt(var_c / (var_c + eps)): how much channel c's eval output varies
    in float, in the units of the BN's output (the standard deviation of gamma (x - mean) /
    sqrt(var + eps) for x of variance var_c); 0 for a channel whose input never varies (var 0)
    or whose gamma is 0. NaN for invalid statistics."""
    v = max(var, 0.0) if var == var else var
    denominator = v + eps
    if not denominator > 0:
        return 0.0 if v == 0 else math.nan
    return abs(gamma) * math.sqrt(v / denominator)


def ema_decays(
    updates: int, decay: float, warmup: bool, zero_first: bool, gamma: float = 1.0, power: float = 2 / 3
) -> Iterator[float]:
    """d_1 .. d_T, the decay of each of an EMA's `updates` updates, in order (dimensionless):

    timm ModelEmaV3, update(model, step=k) (`zero_first`)
                d_k = 0 for k = 1 (the copy takes the live values), else `decay`, or with
                `warmup` min(decay, 1 - (1 + (k - 1) / gamma)^-power) (clamped at 0)
    a constant EMA (timm ModelEma/ModelEmaV2, update(model))
                d_k = `decay` for every k"""
    for k in range(1, updates + 1):
        if zero_first and k == 1:
            yield 0.0
        elif warmup and zero_first:
            yield max(min(decay, 1.0 - (1.0 + (k - 1) / gamma) ** -power), 0.0)
        else:
            yield decay


def ema_initial_weight(decays: Iterable[float], momentum: float | None, per_update: int = 1) -> float:
    """W: the share the initial values (running_mean 0, running_var 1) hold in an EMA copy's
    running buffers after its updates (dimensionless, 0 to 1). The copy starts as the
    untrained model (W_0 = 1); update k lerps it toward the live model's buffers, whose
    initial values then weigh w_k = initial_weight(m, k * per_update) (`per_update` BN
    forwards per EMA update):

      W_k = d_k W_{k-1} + (1 - d_k) w_k,   W = W_T

    (the EMA is affine in both buffers, and the live buffers are w_k * initial + (1 - w_k) *
    data). ModelEmaV3 (decay 0 at update 1, then 0.998), momentum 0.1, 288 updates: 0.516."""
    weight = 1.0
    for k, d in enumerate(decays, start=1):
        live = initial_weight(momentum, k * per_update)
        weight = d * weight + (1.0 - d) * live
        if weight < 1e-15 and live < 1e-15:
            break  # both only shrink from here (d_k <= 1, w_k decreasing): W is below 1e-15
    return weight


def implied_data_value(stored: float, initial: float, weight: float) -> float:
    """x = (stored - w * initial) / (1 - w): what the data contributed to a running buffer
    that still holds its initial value (running_mean 0, running_var 1) with the weight
    w = initial_weight(m, t), since stored = w * initial + (1 - w) * x. For running_var, x is
    the momentum-weighted mean of the batches' unbiased variances (weights m * (1 - m)^(t-k),
    summing to 1 - w); for running_mean, of the batch means. In the buffer's units; NaN
    where w >= 1 (the buffer has seen no data)."""
    if not weight < 1.0:
        return math.nan
    return (stored - weight * initial) / (1.0 - weight)


def variance_overstatement(stored_var: float, data_var: float, eps: float) -> float:
    """q = (stored + eps) / (max(data, 0) + eps): how many times the variance eval mode
    divides by exceeds the data's (dimensionless; eval mode scales the channel by
    sqrt(1 / q) relative to normalising by the data's variance; q < 1: understated). A
    negative implied data variance (the stored value below w * 1) counts as 0."""
    return (stored_var + eps) / (max(data_var, 0.0) + eps)


def all_finite(values: Sequence[float]) -> bool:
    """No NaN or Inf among the values: one C-speed sum (a sum that overflows only sends
    the caller down its slower per-value path)."""
    return math.isfinite(sum(values))

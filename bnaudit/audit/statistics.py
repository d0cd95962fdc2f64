"""Every statistic bnaudit reports about statistics and outputs, each defined once: one
name (the JSON field), one table header, one formula. Torch-free; the vectorised
implementations in `bnaudit.runtime` compute exactly these (tests/test_statistics.py
checks them against the plain ones here).

Channels. For one BN layer with channels c = 1..C, a compared pair of per-channel
statistics (mu_c, var_c) against reference statistics (mu_ref,c, var_ref,c), and the
layer's eps:

  gap, recalibrate   compared: the data reaching the layer (mean and unbiased variance
                     over every value, float64, `bnaudit.runtime.stats`); reference: the
                     running statistics (recalibrate: the old and the new ones in turn)
  diff               compared: side B's running statistics; reference: side A's

  shift_c      |mu_c - mu_ref,c| / sqrt(var_ref,c + eps)     (in reference standard deviations)
  log_var_c    |ln((var_c + eps) / (var_ref,c + eps))|        (natural log: 0.69 is a factor 2
                                                              either way; 0 when they agree)

Layer aggregates, over the channels:

  mean_shift          mean_c shift_c
  max_mean_shift      max_c shift_c
  var_log_ratio       mean_c log_var_c
  max_var_log_ratio   max_c log_var_c

gap and recalibrate report mean_shift, max_mean_shift and var_log_ratio (a layer whose
statistics no longer describe the data moves on average); diff reports the two maxima
(one channel changed between two checkpoints is what it looks for). The same name is
always the same aggregate.

Outputs. For one sample with output y and reference output r (any shape, read as K
values y_k, r_k):

  relative_deviation   max_k |y_k - r_k| / max(max_k |r_k|, TINY)
                       the infinity norm of the change relative to the largest reference
                       value: one logit that moves counts in full whatever the number of
                       classes, and the measure does not depend on the output's scale.
                       Equal values count 0, also equal infinities and NaN against NaN; any
                       other difference involving a non-finite value is inf. The reference
                       scale max_k |r_k| runs over the finite r_k. Used by invariance (r:
                       the sample alone, y: the sample in an arrangement) and by diff's
                       export parity (r: torch eval mode, y: onnxruntime; its float32
                       floor: r a float64 copy of the model, y the float32 model).
  relative_l2          ||y - r||_2 / max(||r||_2, TINY)
                       the Euclidean norm instead: every value's change weighs in. gap's
                       divergence for outputs that are not class scores (r: eval mode,
                       y: train mode), averaged over the samples.

Layer outputs (`bnaudit parity`). For one BN layer with channels c, the target's output of
the layer y (what the deployed artifact computes there) and eager PyTorch's float32 output
r, over every sample and position of the run, and eager's float64 output w (a float64 copy
of the model) on the first samples:

  channel_deviation_c  max |y_c - r_c| / max(max |r_c|, TINY)
                       the largest change of channel c relative to the channel's largest
                       value: a channel counts in full whatever its scale.
  channel_relative     max_c channel_deviation_c                     (JSON `relative`)
  rounding             max_c max |r_c - w_c| / max(max |r_c|, TINY): what float32 rounding
                       alone does to the layer (for outputs: the largest relative_deviation
                       of the float32 outputs from the float64 ones)
  noise floor          10^ceil(log10(rounding)), at least NOISE_MIN = 1e-7 (about float32's
                       unit roundoff, 6e-8): rounded up to a power of ten, so that the floor
                       printed and every decision against it are the same on every CPU
  ratio                channel_relative / noise floor
  diverges             ratio > PARITY_FACTOR = 10 (`exceeds_floor`): the same factor diff's
                       output comparison (BN114) applies to its outputs (`parity_floor`
                       = PARITY_FACTOR x the noise floor)

TINY is the smallest normal float64 (2.2e-308): a reference of zeros leaves any change
huge, not a division by zero.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass

TINY = sys.float_info.min
NOISE_MIN = 1e-7
PARITY_FACTOR = 10


@dataclass(frozen=True)
class Statistic:
    """A reported statistic: `name` its JSON field, `column` its table header, `formula`
    its definition (module docstring)."""

    name: str
    column: str
    formula: str


MEAN_SHIFT = Statistic("mean_shift", "mean shift", "mean_c |mu_c - mu_ref,c| / sqrt(var_ref,c + eps)")
MAX_MEAN_SHIFT = Statistic("max_mean_shift", "max shift", "max_c |mu_c - mu_ref,c| / sqrt(var_ref,c + eps)")
VAR_LOG_RATIO = Statistic("var_log_ratio", "var log-ratio", "mean_c |ln((var_c + eps) / (var_ref,c + eps))|")
MAX_VAR_LOG_RATIO = Statistic("max_var_log_ratio", "max var log-ratio", "max_c |ln((var_c + eps) / (var_ref,c + eps))|")
RELATIVE_DEVIATION = Statistic("relative_deviation", "relative deviation", "||y - y_ref||_inf / ||y_ref||_inf")
RELATIVE_L2 = Statistic("relative_l2", "relative L2", "||y - y_ref||_2 / ||y_ref||_2")
CHANNEL_RELATIVE = Statistic("channel_relative", "deviation", "max_c max|y_c - r_c| / max|r_c|")

STATISTICS: dict[str, Statistic] = {
    s.name: s
    for s in (
        MEAN_SHIFT,
        MAX_MEAN_SHIFT,
        VAR_LOG_RATIO,
        MAX_VAR_LOG_RATIO,
        RELATIVE_DEVIATION,
        RELATIVE_L2,
        CHANNEL_RELATIVE,
    )
}


@dataclass(frozen=True)
class Drift:
    """How far reference statistics are from compared ones (module docstring: in gap the
    running statistics against the data reaching the layer; in recalibrate the old and
    the new statistics against the calibration data): `mean_shift`, `max_mean_shift` and
    `var_log_ratio` as defined there. All three are 0 when the stored statistics describe
    the data exactly; None where a value is not finite (a NaN or negative running_var)."""

    mean_shift: float | None
    max_mean_shift: float | None
    var_log_ratio: float | None


def channel_shift(mu: float, mu_ref: float, var_ref: float, eps: float) -> float:
    """shift_c = |mu - mu_ref| / sqrt(var_ref + eps); NaN where var_ref + eps is not
    positive or a mean is NaN (the shift has no meaning)."""
    denominator = var_ref + eps
    if not denominator > 0 or math.isnan(mu) or math.isnan(mu_ref):
        return math.nan
    return abs(mu - mu_ref) / math.sqrt(denominator)


def channel_log_var_ratio(var: float, var_ref: float, eps: float) -> float:
    """log_var_c = |ln((var + eps) / (var_ref + eps))|; NaN where either side plus eps is
    not a positive finite number."""
    compared, reference = var + eps, var_ref + eps
    if not (compared > 0 and reference > 0) or math.isinf(compared) or math.isinf(reference):
        return math.nan
    return abs(math.log(compared / reference))


def relative_deviation(y: Sequence[float], reference: Sequence[float]) -> float:
    """relative_deviation of one sample (module docstring), y and reference flattened to
    the same number of values."""
    if len(y) != len(reference):
        raise ValueError(f"{len(y)} values against {len(reference)}")
    scale = max((abs(r) for r in reference if math.isfinite(r)), default=0.0)
    worst = 0.0
    for a, b in zip(y, reference):
        if a == b or (math.isnan(a) and math.isnan(b)):
            continue
        change = abs(a - b)
        worst = max(worst, change if math.isfinite(change) else math.inf)
    return worst / max(scale, TINY)


def relative_l2(y: Sequence[float], reference: Sequence[float]) -> float:
    """relative_l2 of one sample (module docstring)."""
    if len(y) != len(reference):
        raise ValueError(f"{len(y)} values against {len(reference)}")
    change = math.sqrt(sum((a - b) ** 2 for a, b in zip(y, reference)))
    return change / max(math.sqrt(sum(b * b for b in reference)), TINY)


def channel_relative(changes: Sequence[float], scales: Sequence[float]) -> float:
    """channel_relative (module docstring) from each channel's max |y_c - r_c| and max |w_c|;
    NaN where a change is NaN, 0 for a layer without channels."""
    worst = 0.0
    for change, scale in zip(changes, scales, strict=True):
        value = change / max(scale, TINY)
        if math.isnan(value):
            return math.nan
        worst = max(worst, value)
    return worst


def _power_of_ten_above(x: float, shift: int = 0) -> float:
    """10^(ceil(log10 x) + shift), the double nearest it, as a user types it."""
    return float(f"1e{math.ceil(math.log10(x)) + shift}")


def noise_floor(rounding: float) -> float:
    """The noise floor of a measured float32 `rounding` (module docstring): rounded up to a
    power of ten, at least NOISE_MIN; NaN stays NaN (every deviation then exceeds it)."""
    if not (math.isfinite(rounding) and rounding > NOISE_MIN):
        return max(rounding, NOISE_MIN)
    return _power_of_ten_above(rounding)


def parity_floor(rounding: float) -> float:
    """diff's output floor (BN114): PARITY_FACTOR x `noise_floor(rounding)`, between 10x and
    100x the rounding, at least PARITY_FACTOR x NOISE_MIN = 1e-6."""
    if not (math.isfinite(rounding) and rounding > NOISE_MIN):
        return max(PARITY_FACTOR * rounding, PARITY_FACTOR * NOISE_MIN)
    return _power_of_ten_above(rounding, 1)  # PARITY_FACTOR = 10: one more power of ten


def exceeds_floor(relative: float, floor: float) -> bool:
    """relative > PARITY_FACTOR x floor (a NaN on either side exceeds it)."""
    return not relative <= PARITY_FACTOR * floor

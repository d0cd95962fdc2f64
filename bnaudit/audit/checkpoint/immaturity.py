"""How young a layer's running statistics are, judged by what they do rather than by the counter.

Torch-free. Three estimates, all per channel and summarised by the median over a layer's
channels (a few odd channels, dead or constant, must not decide for the layer):

  implied_damage   a live model with t = num_batches_tracked updates at momentum m: the
                   initial values weigh w = (1 - m)^t, so the data's statistics are
                   implied, (stored - w * init) / (1 - w), and compared with the stored ones
  against_live     an averaged copy (EMA) beside its live model: the copy's statistics sit
                   between the initial 1/0 and the live ones, so the initial values' weight
                   is w_c = (var_ema - var_live) / (1 - var_live) (channels whose live
                   variance is not near 1) and w_c = (mean_live - mean_ema) / mean_live
                   (channels whose live mean is not near 0); the damage is the copy's
                   statistics against the live ones
  unmoved_fraction without a trustworthy counter or a live copy: the share of channels whose
                   running_var is still the initial 1 within float32 rounding
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bnaudit.audit.formulas import implied_data_value, variance_overstatement
from bnaudit.text import plural

if TYPE_CHECKING:  # the rules import this module: `bnaudit rules` reads no layers
    from bnaudit.audit.layers import BNLayer


@dataclass(frozen=True)
class ImpliedDamage:
    """What a layer's immature buffers do to eval mode, median over its channels.

    var_ratio   q = (var_stored + eps) / (var_data + eps) (formulas.variance_overstatement)
    mean_shift  |mean_stored - mean_data| / sqrt(var_data + eps), in data standard deviations
    worst_channel, worst_ratio  the channel whose q is furthest from 1, and its q
    """

    var_ratio: float
    mean_shift: float
    channels: int
    worst_channel: int
    worst_ratio: float

    def describe(self) -> str:
        parts = []
        if max(self.var_ratio, 1.0 / self.var_ratio) >= 1.5:
            parts.append(f"stored running_var about {_factor(self.var_ratio)} the data's")
        if self.mean_shift >= 0.5:
            parts.append(f"running_mean {self.mean_shift:.2g} data standard deviations off")
        where = f"median of {plural(self.channels, 'channel')}"
        if self.channels > 1 and self.worst_ratio != self.var_ratio:
            where += f"; worst ch {self.worst_channel}: {_factor(self.worst_ratio)}"
        return f"{' and '.join(parts) or 'small implied error'} ({where})"


def _factor(q: float) -> str:
    return f"{q:.0f}x" if q >= 10 else f"{q:.2g}x"


def implied_damage(layer: BNLayer, weight: float) -> ImpliedDamage | None:
    """The data's statistics the stored ones imply, w = (1 - m)^t being the initial values'
    weight (formulas.implied_data_value), compared with the stored ones; None when no
    channel has finite statistics."""
    import statistics  # here: it imports decimal, fractions and random, which most inspects never need

    from bnaudit.audit.statistics import channel_shift  # here: an inspect that finds nothing young never needs it

    ratios: list[tuple[float, int]] = []
    shifts: list[float] = []
    for c, (mean, var) in enumerate(zip(layer.running_mean, layer.running_var)):
        if not (math.isfinite(mean) and math.isfinite(var)) or var < 0:
            continue  # BN005's
        data_var = implied_data_value(var, 1.0, weight)
        data_mean = implied_data_value(mean, 0.0, weight)
        ratios.append((variance_overstatement(var, data_var, layer.eps), c))
        shifts.append(channel_shift(mean, data_mean, max(data_var, 0.0), layer.eps))
    if not ratios:
        return None
    worst_ratio, worst_channel = max(ratios, key=lambda qc: max(qc[0], 1.0 / qc[0]))
    return ImpliedDamage(
        var_ratio=statistics.median(q for q, _ in ratios),
        mean_shift=statistics.median(shifts),
        channels=len(ratios),
        worst_channel=worst_channel,
        worst_ratio=worst_ratio,
    )


# A live variance within this of 1 (or a live mean within this many standard deviations of
# 0) says nothing about how far the copy has moved from its initial value.
_SEPARATION = 0.1


@dataclass(frozen=True)
class LiveComparison:
    """An averaged copy's layer against the live model's, medians over its channels.

    initial_weight  w, the initial values' share in the copy's statistics (see the module
                    docstring); None when no channel's live statistics are far enough from
                    the initial 1/0 to tell
    var_ratio       (var_copy + eps) / (var_live + eps)
    mean_shift      |mean_copy - mean_live| / sqrt(var_live + eps), in live standard deviations
    """

    initial_weight: float | None
    var_ratio: float
    mean_shift: float
    channels: int

    def describe(self) -> str:
        parts = []
        if max(self.var_ratio, 1.0 / self.var_ratio) >= 1.5:
            parts.append(f"running_var about {_factor(self.var_ratio)} the live model's")
        if self.mean_shift >= 0.5:
            parts.append(f"running_mean {self.mean_shift:.2g} live standard deviations off")
        return f"{' and '.join(parts) or 'statistics close to the live model'} (median of {plural(self.channels, 'channel')})"


def against_live(copy: BNLayer, live: BNLayer) -> LiveComparison | None:
    """The copy's statistics against the live model's (see `LiveComparison`); None when the
    layers differ in channels or no channel has finite, non-negative statistics."""
    if copy.num_features != live.num_features:
        return None
    import statistics  # here: see implied_damage

    from bnaudit.audit.statistics import channel_shift

    eps = copy.eps
    weights: list[float] = []
    ratios: list[float] = []
    shifts: list[float] = []
    for c in range(copy.num_features):
        m_copy, v_copy = copy.running_mean[c], copy.running_var[c]
        m_live, v_live = live.running_mean[c], live.running_var[c]
        if not all(math.isfinite(x) for x in (m_copy, v_copy, m_live, v_live)) or min(v_copy, v_live) < 0:
            continue
        ratios.append(variance_overstatement(v_copy, v_live, eps))
        shifts.append(channel_shift(m_copy, m_live, max(v_live, 0.0), eps))
        if abs(1.0 - v_live) >= _SEPARATION:
            weights.append((v_copy - v_live) / (1.0 - v_live))
        if abs(m_live) >= _SEPARATION * math.sqrt(v_live + eps):
            weights.append((m_live - m_copy) / m_live)
    if not ratios:
        return None
    return LiveComparison(
        initial_weight=statistics.median(weights) if weights else None,
        var_ratio=statistics.median(ratios),
        mean_shift=statistics.median(shifts),
        channels=len(ratios),
    )


# float32 resolves 2^-23 at 1: a variance this close to 1 never moved (or moved by rounding)
_ROUNDING = 8 * 2.0**-23


def unmoved_fraction(layer: BNLayer) -> float:
    """The share of the layer's channels whose running_var is within float32 rounding of the
    initial 1 (|var - 1| <= 8 * 2^-23), 0 to 1."""
    if not layer.num_features:
        return 0.0
    return sum(1 for v in layer.running_var if abs(v - 1.0) <= _ROUNDING) / layer.num_features


def has_identity_stats(layer: BNLayer) -> bool:
    """running_mean == 0 and running_var == 1 in every channel of a layer that has channels
    (the initial values; BN002's case). A 0-channel layer holds no statistics to lose:
    "every channel" must not be vacuous."""
    return layer.num_features > 0 and _all_equal(layer.running_mean, 0.0) and _all_equal(layer.running_var, 1.0)


def has_initial_affine(layer: BNLayer) -> bool:
    """weight 1 and bias 0 in every channel (or absent): the affine parameters as initialised."""
    return (layer.weight is None or _all_equal(layer.weight, 1.0)) and (
        layer.bias is None or _all_equal(layer.bias, 0.0)
    )


def _all_equal(values: list[float], value: float) -> bool:
    # the first value first: trained statistics differ there, and count scans them all
    # count: == in C (NaN never equal, -0.0 == 0.0)
    return (not values or values[0] == value) and values.count(value) == len(values)

"""Which channels drift, which layer the drift starts at, and whether the input is to blame.

Per channel c of a BN layer, with mu_d, var_d the mean and unbiased variance of the data
reaching the layer in eval mode and mu_r, var_r its running statistics:

  shift_c        |mu_d - mu_r| / sqrt(var_r + eps)           (in running standard deviations)
  log_var_c      |log((var_d + eps) / (var_r + eps))|         (0: the variances agree)
  score_c        shift_c + log_var_c                          (a channel's drift)

A layer's `worst` channels are those with the largest score_c; its `peak` is the largest
score_c. Averages over channels (`bnaudit.audit.statistics.Drift`) hide one broken channel among 64; the peak
does not, so the ranking uses it.

Origin rule. Drift propagates: a broken channel makes every later layer's inputs drift,
often by more than its own. Layers are walked in forward (registration) order; a layer is
*large* when its channel-mean drift reaches DRIFT_LARGE or its peak reaches PEAK_LARGE. A
large layer is an ORIGIN when its drift is not explained by the layers before it:

  - no earlier measured layer is large (the first place the data stops matching), or
  - its peak exceeds ORIGIN_JUMP times the largest peak of all earlier layers (a new,
    much stronger source than anything upstream could pass on).

A healthy model has no large layer, so no origin; a globally shifted input (wrong
preprocessing) makes the first layer the only origin, because later layers' peaks stay
within a factor ORIGIN_JUMP of what they inherit.

Preprocessing rule. The first BN layer sees the input after one linear stage: when most
of its channels drift (at least BROAD_FRACTION with score_c >= DRIFT_LARGE, unlike one
broken channel) and the drift persists (at least half of the later measured layers are
large), the likeliest cause is input preprocessing that differs from training, not stale
statistics; this is only concluded when inspect finds the statistics mature (no BN002
reset, no BN003 immature), since reset statistics drift from the first layer on too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from bnaudit.reports.gap import DRIFT_LARGE, ChannelDrift

# A later large layer whose peak exceeds this multiple of every earlier peak is a new origin.
ORIGIN_JUMP = 30.0

# Share of the first layer's channels that must drift for a preprocessing diagnosis.
BROAD_FRACTION = 0.5

# Channels kept per layer in the report (the table shows the first, JSON all of them).
TOP_CHANNELS = 5


@dataclass(frozen=True)
class ChannelScores:
    """Every channel's score of one layer, and its worst channels (largest score first)."""

    worst: tuple[ChannelDrift, ...]
    peak: float | None
    broad: float  # fraction of channels with score_c >= DRIFT_LARGE


def channel_scores(data_mean: Any, data_var: Any, run_mean: Any, run_var: Any, eps: float) -> ChannelScores:
    """Per-channel drift of one layer (arrays of shape (C,), computed in float64).
    A channel whose score is not finite (NaN running statistics) counts as worst."""
    mu_d, var_d, mu_r, var_r = (np.asarray(a, dtype=np.float64) for a in (data_mean, data_var, run_mean, run_var))
    with np.errstate(all="ignore"):
        shift = np.abs(mu_d - mu_r) / np.sqrt(var_r + eps)
        log_var = np.abs(np.log((var_d + eps) / (var_r + eps)))
        score = shift + log_var
    ranked = np.where(np.isfinite(score), score, np.inf)
    order = np.argsort(-ranked, kind="stable")[:TOP_CHANNELS]
    worst = tuple(
        ChannelDrift(
            int(c),
            float(mu_d[c]),
            float(var_d[c]),
            float(mu_r[c]),
            float(var_r[c]),
            float(shift[c]),
            float(log_var[c]),
        )
        for c in order
    )
    finite = score[np.isfinite(score)]
    peak = float(finite.max()) if finite.size else None
    broad = float(np.mean(ranked >= DRIFT_LARGE)) if ranked.size else 0.0
    return ChannelScores(worst, peak, broad)


def find_origins(large: Sequence[bool], peaks: Sequence[float | None]) -> list[bool]:
    """Which layers (given in forward order) are origins of drift (the module's rule)."""
    origins = []
    upstream_large = False
    upstream_peak = 0.0
    for is_big, peak in zip(large, peaks, strict=True):
        p = peak if peak is not None else 0.0
        origins.append(is_big and (not upstream_large or p > ORIGIN_JUMP * upstream_peak))
        upstream_large = upstream_large or is_big
        upstream_peak = max(upstream_peak, p)
    return origins


def first_layer_mismatch(large: Sequence[bool], broad_first: float) -> bool:
    """The preprocessing pattern (module docstring): `large` in forward order, the first
    entry being the first BN layer; `broad_first` its share of drifting channels."""
    if not large or not large[0] or broad_first < BROAD_FRACTION:
        return False
    later = list(large[1:])
    return not later or sum(later) * 2 >= len(later)


def implied_input(
    input_mean: Sequence[float],
    input_std: Sequence[float],
    response: tuple[Any, Any] | None,
    data_mean: Any,
    data_var: Any,
    run_mean: Any,
    run_var: Any,
) -> tuple[list[float], list[float]] | None:
    """The input mean and std per channel that the first BN layer's running statistics
    imply, assuming the inputs differ from the expected ones by one affine map x -> a*x + b
    (wrong --mean/--std, a 0-255 scale) and the path to that layer is affine in the input.

    `response` = (z0, s): the first BN layer's per-channel input mean for an all-zero input,
    and its change per unit added to every input value (measured by `probe_first_layer`).
    Then a = median_c sqrt(var_r / var_d) (variances scale by a^2) and b minimises
    sum_c (a*(mu_d - z0) + z0 + b*s - mu_r)^2; expected mean = a*mean_x + b, std = a*std_x.
    None when the response is unknown or degenerate.
    """
    if response is None:
        return None
    z0, s = (np.asarray(v, dtype=np.float64) for v in response)
    mu_d, var_d, mu_r, var_r = (np.asarray(a, dtype=np.float64) for a in (data_mean, data_var, run_mean, run_var))
    with np.errstate(all="ignore"):
        ratios = np.sqrt(var_r / var_d)
    ratios = ratios[np.isfinite(ratios) & (ratios > 0)]
    denom = float(np.sum(s * s))
    if not ratios.size or not math.isfinite(denom) or denom == 0:
        return None
    a = float(np.median(ratios))
    b = float(np.sum(s * (mu_r - z0 - a * (mu_d - z0))) / denom)
    if not (math.isfinite(a) and math.isfinite(b)):
        return None
    return [a * m + b for m in input_mean], [a * sd for sd in input_std]

"""Verify a BatchNorm that an exporter folded into the preceding Conv (or Linear).

Torch- and numpy-free (plain Python floats), like the rest of audit/. Both torch
exporters fold eval-mode BN into the layer before it by default, so the export holds

    W'_c = s_c * W_c          (every weight of output channel c scaled by one factor)
    b'_c = t_c

with, for the checkpoint's BN (gamma, beta, running mean mu, running variance var, eps)
and the conv's own bias b (0 without one), the folded scale and bias of
bnaudit.audit.formulas (`folded_conv`):

    expected scale   s_c = gamma_c / sqrt(var_c + eps)
    expected shift   t_c = beta_c + (b_c - mu_c) * s_c

Definitions of what `fold_layer` reports:

  recovered scale  s^_c = <W'_c, W_c> / <W_c, W_c>: the least-squares factor over all the
                   weights of channel c. Least squares rather than the ratio at one weight:
                   it uses every weight, so float32 rounding of single weights averages
                   out, and a small weight (whose ratio is all rounding) cannot dominate.
                   A channel whose checkpoint weights are all 0 has no recoverable scale
                   (skipped when the export's are 0 too; otherwise not a scaled copy).
  residual         max_c max_k |W'_c,k - s^_c W_c,k| / max_k |W'_c,k|: 0 for an exact
                   per-channel scaling; above WEIGHT_RTOL the export's weights are not the
                   checkpoint conv's scaled per channel (another checkpoint, or a wrong pair).
  scale error      max_c |s^_c - s_c| / |s_c|       (relative; float32 folding gives ~1e-7)
  shift error      max_c |t^_c - t_c| / (|beta_c| + |(b_c - mu_c) s_c| + |s_c|)
                   (t^_c the export's bias; the denominator is the size of the terms the
                   exporter added, so rounding stays ~1e-7 whatever the channel's scale)
  implied eps      eps^_c = (gamma_c / s^_c)^2 - var_c (formulas.implied_eps), from the channel where it is best
                   determined: its uncertainty is about 2 (var_c + eps) * SCALE_PRECISION (1e-6), so a
                   channel whose variance dwarfs eps cannot tell eps apart from 0. The eps
                   is "not determinable" when no channel pins it within a factor 2.

A layer whose gamma is 0 in every channel (timm's `zero_init_last` starts the last BN of each
residual block so) folds to zero weights, W' = 0, and b' = beta: its fold carries no
statistics (`zero_gamma`; nothing implies an eps), and it matches when the export's weights
are zero and its bias is beta.

A folded layer matches when the residual, the scale error and the shift error are all at
most FOLD_RTOL (1e-5, about 80 float32 ulps: float32 folding stays below 1e-6, while
another eps (1e-3 against 1e-5) moves the scale of a channel of variance 1 by 5e-4).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from bnaudit.audit.formulas import folded_conv, implied_eps

WEIGHT_RTOL = 1e-5
FOLD_RTOL = 1e-5
# The precision of a recovered scale s^_c: float32 folding and least squares give ~1e-7
# (measured on both torch exporters' output); 1e-6 keeps a margin.
SCALE_PRECISION = 1e-6


def float32(x: float) -> float:
    """x rounded to the nearest float32 (as a Python float); inf beyond float32's range."""
    try:
        return float(struct.unpack("<f", struct.pack("<f", x))[0])
    except OverflowError:
        return math.copysign(math.inf, x)


@dataclass(frozen=True)
class FoldCheck:
    """The numbers of one folded layer (definitions in the module docstring)."""

    channels: int
    scaled_copy: bool  # the export's weights are the checkpoint's scaled per channel
    residual: float
    scale_error: float | None  # None when no channel had a recoverable scale
    shift_error: float | None
    implied_eps: float | None
    eps_note: str  # how the implied eps was determined, or why it was not
    matches: bool
    cause: str  # "" when it matches: what the numbers point to otherwise
    worst_channel: int | None = None
    zero_gamma: bool = False  # gamma 0 in every channel: the fold holds zeros, no statistics


def recover_scales(
    export_rows: Sequence[Sequence[float]], checkpoint_rows: Sequence[Sequence[float]]
) -> tuple[list[float | None], float]:
    """Per-channel least-squares scale s^_c = <W'_c, W_c> / <W_c, W_c> (None for a channel
    whose checkpoint weights are all 0) and the largest relative residual (inf when a
    channel is not a scaled copy at all: checkpoint weights 0, export weights not)."""
    scales: list[float | None] = []
    residual = 0.0
    for e, c in zip(export_rows, checkpoint_rows):
        cc = math.fsum(x * x for x in c)
        peak = max((abs(x) for x in e), default=0.0)
        if cc == 0:
            scales.append(None)
            if peak > 0:
                residual = math.inf
            continue
        s = math.fsum(x * y for x, y in zip(e, c)) / cc
        scales.append(s)
        if peak > 0:
            worst = max(abs(x - s * y) for x, y in zip(e, c))
            residual = max(residual, worst / peak)
    return scales, residual


def best_implied_eps(
    scales: Sequence[float | None], gamma: Sequence[float] | None, var: Sequence[float], eps: float
) -> tuple[float | None, str, bool]:
    """(eps^, how, consistent): eps^_c = formulas.implied_eps(gamma_c, s^_c, var_c) from the channel that
    determines it best (smallest var_c + eps: uncertainty ~2 (var_c + eps) SCALE_PRECISION);
    `consistent` is False when the determinable channels disagree beyond their
    uncertainties (no single eps explains the folded scales: the statistics differ)."""
    n = len(var)
    g = list(gamma) if gamma is not None else [1.0] * n
    estimates: list[tuple[float, float, int]] = []  # (uncertainty, estimate, channel)
    for c in range(n):
        s = scales[c]
        if s is None or s == 0 or g[c] == 0 or not math.isfinite(var[c]) or var[c] < 0:
            continue
        estimate = implied_eps(g[c], s, var[c])
        uncertainty = 2 * (var[c] + max(eps, abs(estimate))) * SCALE_PRECISION
        estimates.append((uncertainty, estimate, c))
    if not estimates:
        return None, "not determinable: no channel with a recoverable scale and a non-zero gamma", True
    determinable = [(u, e, c) for u, e, c in estimates if abs(e) > 2 * u]
    if not determinable:
        bound = min(u for u, _, _ in estimates) * 2
        return None, f"not determinable: every channel's variance dwarfs eps (|eps| < {bound:.2g} fits)", True
    u, best, channel = min(determinable)
    consistent = all(abs(e - best) <= 2 * (u + ue) + 0.01 * abs(best) for ue, e, _ in determinable)
    return best, f"from channel {channel} (var {var[channel]:.3g}, uncertainty {u:.1g})", consistent


def fold_layer(
    export_rows: Sequence[Sequence[float]],
    export_bias: Sequence[float] | None,
    checkpoint_rows: Sequence[Sequence[float]],
    conv_bias: Sequence[float] | None,
    gamma: Sequence[float] | None,
    beta: Sequence[float] | None,
    mean: Sequence[float],
    var: Sequence[float],
    eps: float,
) -> FoldCheck:
    """Whether the export's conv (rows of W' and bias b' per output channel) is the
    checkpoint's conv (rows of W, bias b) with the checkpoint's BN folded in at `eps`
    (definitions and tolerance in the module docstring)."""
    n = len(mean)
    scales, residual = recover_scales(export_rows, checkpoint_rows)
    if not residual <= WEIGHT_RTOL:
        return FoldCheck(
            n, False, residual, None, None, None, "", False,
            f"the exported weights are not the checkpoint conv's scaled per channel (residual {residual:.2g})",
        )  # fmt: skip
    s_exp, t_exp = folded_conv(gamma, beta, mean, var, eps, conv_bias)
    shifts = list(export_bias) if export_bias is not None else [0.0] * n
    g = list(gamma) if gamma is not None else [1.0] * n
    bt = list(beta) if beta is not None else [0.0] * n
    b = list(conv_bias) if conv_bias is not None else [0.0] * n
    scale_errors: list[float] = []
    shift_error = 0.0
    worst_channel: int | None = None
    worst = -1.0
    for c in range(n):
        s = scales[c]
        s_err = 0.0
        if s is not None:
            s_err = abs(s - s_exp[c]) / abs(s_exp[c]) if s_exp[c] != 0 else (0.0 if s == 0 else math.inf)
            s_err = math.inf if math.isnan(s_err) else s_err
            scale_errors.append(s_err)
        size = abs(bt[c]) + abs((b[c] - mean[c]) * s_exp[c]) + abs(s_exp[c])
        t_err = abs(shifts[c] - t_exp[c]) / size if size > 0 else abs(shifts[c] - t_exp[c])
        t_err = math.inf if math.isnan(t_err) else t_err
        shift_error = max(shift_error, t_err)
        if max(s_err, t_err) > worst:
            worst, worst_channel = max(s_err, t_err), c
    scale_error = max(scale_errors) if scale_errors else None
    eps_hat, how, consistent = best_implied_eps(scales, gamma, var, eps)
    zero_gamma = n > 0 and gamma is not None and all(x == 0 for x in g)
    if zero_gamma:
        how = "gamma is 0 in every channel: the fold is zero weights and beta, it carries no statistics"
    matches = (scale_error is None or scale_error <= FOLD_RTOL) and shift_error <= FOLD_RTOL
    cause = ""
    if not matches:
        cause = _cause(scales, shifts, g, bt, b, mean, var, eps, eps_hat, consistent, scale_error)
    return FoldCheck(
        n,
        True,
        residual,
        scale_error,
        shift_error,
        eps_hat,
        how,
        matches,
        cause,
        None if matches else worst_channel,
        zero_gamma,
    )


def _close(x: float, y: float) -> bool:
    return abs(x - y) <= FOLD_RTOL * max(abs(x), abs(y), 1e-30)


def _cause(
    scales: list[float | None],
    shifts: list[float],
    gamma: list[float],
    beta: list[float],
    conv_bias: list[float],
    mean: Sequence[float],
    var: Sequence[float],
    eps: float,
    eps_hat: float | None,
    consistent: bool,
    scale_error: float | None,
) -> str:
    """What a mismatch points to: identity statistics folded in, another eps, or other
    statistics (stale, or another checkpoint's)."""
    n = len(mean)
    s_id, t_id = folded_conv(gamma, beta, [0.0] * n, [1.0] * n, eps, conv_bias)
    if all(s is None or _close(s, e) for s, e in zip(scales, s_id)) and all(
        abs(t - e) <= FOLD_RTOL * (abs(e) + abs(s) + 1e-30) for t, e, s in zip(shifts, t_id, s_id)
    ):
        return "the export folded identity statistics (mean 0, var 1): statistics reset or never loaded before export"
    scale_ok = scale_error is None or scale_error <= FOLD_RTOL
    if not scale_ok and eps_hat is not None and consistent and not _close(eps_hat, eps):
        # the scales fit one eps: do the shifts fit it too (same statistics, another eps)?
        s_e, t_e = folded_conv(gamma, beta, mean, var, eps_hat, conv_bias)
        if all(abs(t - e) <= 1e-4 * (abs(e) + abs(s) + 1e-30) for t, e, s in zip(shifts, t_e, s_e)):
            return f"the export folded these statistics with eps {eps_hat:.3g} instead of {eps:g}"
    if scale_ok:
        return "scale matches but the shift does not: running_mean, beta or the conv bias differ from the checkpoint's"
    return "the folded statistics are not the checkpoint's (stale statistics, or another checkpoint's)"

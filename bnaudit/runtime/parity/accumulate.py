"""Per-layer and output deviation statistics of `bnaudit parity`, accumulated batch by batch:
memory grows with the number of channels, never with the data (definitions in
`bnaudit.audit.statistics`: channel_deviation, channel_relative, rounding, noise floor).

Per channel c of a layer, over every call, sample and position seen (y the target's values,
r eager's float32, w eager's float64 where a float64 pass ran):

  change_c     max |y_c - r_c|        (a NaN or infinite change only where y and r are not
                                       the same value: `bnaudit.runtime.deviation.changes`)
  rounding_c   max |r_c - w_c|        (float32 rounding, float64 arithmetic)
  scale_c      max |r_c|
  fit sums     n, sum r, sum r^2, sum d, sum r d, sum d^2 with d = y - r, in float64, kept
               from the first batch in which a channel exceeds PARITY_FACTOR x the noise
               floor measured so far (a healthy layer never pays for them): the
               least-squares line d = (a - 1) r + b, i.e. y = a r + b, of the values seen
               since (`Fit`; residual share sqrt(SSE / sum d^2))
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from bnaudit.audit.parity import Fit
from bnaudit.audit.statistics import PARITY_FACTOR, TINY, noise_floor
from bnaudit.runtime.deviation import changes, relative_deviations

# the fits a layer reports: its worst channels above the threshold
MAX_FITS = 8


def _channel_dims(t: Any) -> list[int]:
    """Every dimension but the channel dimension 1 (a (N,) tensor is one channel)."""
    return [d for d in range(t.dim()) if d != 1]


def _per_channel(t: Any) -> Any:
    """`t` as (N, C, rest...) -> (C, values); a 1-D tensor is one channel."""
    if t.dim() == 1:
        return t.reshape(1, -1)
    return t.transpose(0, 1).reshape(t.shape[1], -1)


@dataclass(frozen=True)
class LayerNumbers:
    """One layer's accumulated statistics (module docstring), on the CPU, float64."""

    channels: int
    change: Any
    rounding: Any
    scale: Any
    max_abs: float
    fits: tuple[Fit, ...]
    dtype: str

    @property
    def channel_deviation(self) -> Any:
        return self.change / self.scale.clamp_min(TINY)

    @property
    def relative(self) -> float:
        """channel_relative: the largest channel_deviation (NaN if any is NaN)."""
        values = self.channel_deviation
        if bool(torch.isnan(values).any()):
            return math.nan
        return float(values.max()) if len(values) else 0.0

    @property
    def rounding_relative(self) -> float:
        return float((self.rounding / self.scale.clamp_min(TINY)).max()) if len(self.rounding) else 0.0


class LayerDeviation:
    """The statistics of one layer's values, batch by batch (module docstring)."""

    def __init__(self) -> None:
        self.change: Any = None
        self.rounding: Any = None
        self.scale: Any = None
        self.sums: Any = None  # (6, C): n, r, r^2, d, r d, d^2 per channel
        self.dtype = ""

    def update(self, y: Any, r: Any, w: Any | None) -> None:
        """Add one call's values: y the target's, r eager's float32, w eager's float64 (one
        shape; None where no float64 pass ran)."""
        dims = _channel_dims(r)
        self.dtype = self.dtype or str(y.dtype).removeprefix("torch.")
        y = y.to(r.dtype)
        diff = (y - r).abs_()
        change = diff.amax(dims) if dims else diff
        if not bool(torch.isfinite(change).all()):  # NaN or inf somewhere: equal values count 0
            change = changes(y, r).amax(dims) if dims else changes(y, r)
        scale = (torch.maximum(r.amax(dims), -r.amin(dims)) if dims else r.abs()).double()
        change = change.double()
        if self.change is None:
            self.change, self.scale = change, scale
            self.rounding = torch.zeros_like(change)
        else:
            self.change = torch.maximum(self.change, change)
            self.scale = torch.maximum(self.scale, scale)
        if w is not None:
            rounding = (w - r).abs_().amax(dims) if dims else (w - r).abs_()
            self.rounding = torch.maximum(self.rounding, rounding.double())
        floor = noise_floor(float((self.rounding / self.scale.clamp_min(TINY)).max()))
        over = ~((self.change / self.scale.clamp_min(TINY)) <= PARITY_FACTOR * floor)
        if bool(over.any()):
            self._fit_sums(y, r)

    def _fit_sums(self, y: Any, r: Any) -> None:
        r64 = _per_channel(r).double()
        d64 = _per_channel(y).double() - r64
        d64 = torch.nan_to_num(d64, nan=0.0, posinf=0.0, neginf=0.0)
        r64 = torch.nan_to_num(r64, nan=0.0, posinf=0.0, neginf=0.0)
        count = torch.full((r64.shape[0],), float(r64.shape[1]), dtype=torch.float64, device=r64.device)
        sums = torch.stack([count, r64.sum(1), (r64 * r64).sum(1), d64.sum(1), (r64 * d64).sum(1), (d64 * d64).sum(1)])
        self.sums = sums if self.sums is None else self.sums + sums

    def numbers(self) -> LayerNumbers:
        change, rounding, scale = (t.cpu() for t in (self.change, self.rounding, self.scale))
        max_abs = float(change.max()) if len(change) else 0.0
        if bool(torch.isnan(change).any()):
            max_abs = math.nan
        return LayerNumbers(
            len(change), change, rounding, scale, max_abs, self._fits(change, rounding, scale), self.dtype
        )

    def _fits(self, change: Any, rounding: Any, scale: Any) -> tuple[Fit, ...]:
        if self.sums is None:
            return ()
        relative = change / scale.clamp_min(TINY)
        floor = noise_floor(float((rounding / scale.clamp_min(TINY)).max()))
        over = [int(c) for c in torch.argsort(relative.nan_to_num(nan=math.inf), descending=True)]
        over = [c for c in over if not relative[c] <= PARITY_FACTOR * floor][:MAX_FITS]
        sums = self.sums.cpu()
        return tuple(fit for c in over if (fit := _fit(c, [float(v) for v in sums[:, c]])) is not None)


def _fit(channel: int, sums: list[float]) -> Fit | None:
    """The line y = a r + b of one channel from its fit sums (module docstring)."""
    n, sr, srr, sd, srd, sdd = sums
    if n < 2 or sdd <= 0:
        return None
    mean_r, mean_d = sr / n, sd / n
    var_r = srr - n * mean_r * mean_r
    cov = srd - n * mean_r * mean_d
    slope = cov / var_r if var_r > 0 else 0.0
    shift = mean_d - slope * mean_r
    sse = max(sdd - n * mean_d * mean_d - slope * cov, 0.0)
    return Fit(channel, 1.0 + slope, shift, math.sqrt(sse / sdd))


@dataclass(frozen=True)
class OutputNumbers:
    """The final outputs' statistics: samples, max |y - r|, the largest relative_deviation
    (target against eager float32) and rounding (eager float32 against float64), argmax
    agreements."""

    samples: int
    max_abs: float
    relative: float
    rounding: float
    agree: int


class OutputDeviation:
    """The final outputs, batch by batch: per sample relative_deviation of the target's
    output y against eager's float32 r, and of r against the float64 w (float32 rounding)."""

    def __init__(self) -> None:
        self.samples = self.agree = 0
        self.max_abs = self.relative = self.rounding = 0.0

    def update(self, y: Any, r: Any, w: Any | None) -> None:
        if y.shape != r.shape:
            from bnaudit.errors import BnauditError

            raise BnauditError(f"the target's output has shape {list(y.shape)}, the model's {list(r.shape)}")
        y = y.float()
        r = r.float()
        self.relative = max(self.relative, float(relative_deviations(y, r).max()))
        if w is not None:
            self.rounding = max(self.rounding, float(relative_deviations(r, w).max()))
        self.max_abs = max(self.max_abs, float(changes(y, r).max()) if y.numel() else 0.0)
        if y.dim() >= 1 and y.numel():
            self.agree += int((y.reshape(len(y), -1).argmax(1) == r.reshape(len(r), -1).argmax(1)).sum())
        self.samples += len(y) if y.dim() else 1

    def numbers(self) -> OutputNumbers:
        return OutputNumbers(self.samples, self.max_abs, self.relative, self.rounding, self.agree)

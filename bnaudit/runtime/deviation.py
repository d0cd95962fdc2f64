"""`relative_deviation` and `relative_l2` (`bnaudit.audit.statistics` defines both) of
output tensors, sample by sample, in float64: the one implementation that invariance,
diff's export parity and gap use."""

from __future__ import annotations

import math
from typing import Any

import torch

from bnaudit.audit.statistics import TINY


def changes(y: Any, reference: Any) -> Any:
    """|y - reference| elementwise, with equal values (equal infinities and NaN against
    NaN too) as 0 and any other non-finite difference as inf."""
    diff = (y - reference).abs()
    same = (y == reference) | (torch.isnan(y) & torch.isnan(reference))
    return torch.where(same, torch.zeros_like(diff), diff.nan_to_num(nan=math.inf))


def relative_deviations(y: Any, reference: Any) -> Any:
    """relative_deviation of each sample, (N,) float64: row i of `y` against row i of
    `reference` (both (N, ...), each row read as its values)."""
    n = reference.shape[0]
    ref = reference.to(torch.float64).reshape(n, -1)
    flat = y.to(torch.float64).reshape(n, -1)
    scale = ref.abs().nan_to_num(nan=0.0, posinf=0.0).amax(dim=1).clamp_min(TINY)
    return changes(flat, ref).amax(dim=1) / scale


def relative_deviation(y: Any, reference: Any) -> float:
    """relative_deviation of one output (every value of `y` against `reference`)."""
    return float(relative_deviations(y.reshape(1, -1), reference.reshape(1, -1))[0])


def relative_l2s(y: Any, reference: Any) -> Any:
    """relative_l2 of each sample, (N,) float64 (rows as in `relative_deviations`)."""
    n = reference.shape[0]
    ref = reference.to(torch.float64).reshape(n, -1)
    change = (y.to(torch.float64).reshape(n, -1) - ref).norm(dim=1)
    return change / ref.norm(dim=1).clamp_min(TINY)

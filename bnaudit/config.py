"""Thresholds and switches of an audit, with their defaults in one place."""
from __future__ import annotations

from dataclasses import dataclass, field

SEVERITIES = ("info", "warning", "error")


def severity_rank(severity: str) -> int:
    return SEVERITIES.index(severity)


@dataclass(frozen=True)
class Config:
    """Effective settings of one run.

    near_eps_factor  BN004 fires for channels with running_var < near_eps_factor * eps
    max_gain         BN004 is a warning when some such channel's eval gain >= max_gain
    max_init_weight  BN003 fires when (1 - momentum)^num_batches_tracked > max_init_weight
    eps, momentum    used where the file holds no modules (None: PyTorch's 1e-5, 0.1)
    """

    fail_on: str = "warning"
    near_eps_factor: float = 10.0
    max_gain: float = 100.0
    max_init_weight: float = 0.05
    eps: float | None = None
    momentum: float | None = None
    select: tuple[str, ...] = ()
    ignore: tuple[str, ...] = ()
    per_layer_ignores: dict[str, tuple[str, ...]] = field(default_factory=dict)
    exclude: tuple[str, ...] = ()

    def as_dict(self) -> dict:
        return {
            "fail-on": self.fail_on,
            "near-eps-factor": self.near_eps_factor,
            "max-gain": self.max_gain,
            "max-init-weight": self.max_init_weight,
            "eps": self.eps,
            "momentum": self.momentum,
            "select": list(self.select),
            "ignore": list(self.ignore),
            "per-layer-ignores": {k: list(v) for k, v in self.per_layer_ignores.items()},
            "exclude": list(self.exclude),
        }

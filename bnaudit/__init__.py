"""bnaudit: audit the BatchNorm running statistics of PyTorch checkpoints.

Public API (the CLI is a thin layer over it):

    bnaudit.inspect(paths, config=None, key=None, trust_pickle=False) -> InspectReport
"""
from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "inspect", "Config", "BnauditError"]


def __getattr__(name: str):
    # Lazy: `bnaudit --help` must not pay for numpy/torch imports it does not use.
    if name == "inspect":
        from bnaudit.audit import inspect

        return inspect
    if name == "Config":
        from bnaudit.config import Config

        return Config
    if name == "BnauditError":
        from bnaudit.errors import BnauditError

        return BnauditError
    raise AttributeError(f"module 'bnaudit' has no attribute {name!r}")

"""bnaudit: audit the BatchNorm running statistics of PyTorch checkpoints.

Public API (the CLI is a thin layer over it):

    bnaudit.inspect(paths, config=None, key=None, trust_pickle=False) -> InspectReport
    bnaudit.diff(path_a, path_b, config=None, key_a=None, key_b=None, trust_pickle=False) -> DiffReport
    bnaudit.measure_gap(ModelSpec(checkpoint, arch=...), DataOptions(path=...), config=..., max_gap=...)
        -> GapReport
    bnaudit.measure_invariance(ModelSpec(checkpoint, arch=...), DataOptions(path=...), batch_sizes=[1, 8, 64])
        -> InvarianceReport
    bnaudit.recalibrate_checkpoint(ModelSpec(checkpoint, arch=...), output, DataOptions(path=...), config=...)
        -> RecalibrationReport
    bnaudit.recalibrate_module(model, batches, method="exact") -> Calibration   (an nn.Module in place)
    bnaudit.merge_statistics(["s0.bnstats", "s1.bnstats"], checkpoint, output) -> MergeReport
        (statistics files of `recalibrate_checkpoint(..., stats_out=...)`, merged exactly)
    bnaudit.audit_federation(global_path, client_paths, config) -> FedReport   (torch-free)
    bnaudit.predict_fold(path, config) -> FoldReport        (folding, int8, fp16, bf16: predicted)
    bnaudit.measure_fold(ModelSpec(checkpoint, arch=...), DataOptions(path=...), config) -> FoldReport  (and measured)

A `ModelSpec` names the model a measuring command runs (checkpoint, arch, arch_kwargs, key,
trust_pickle, forward, device); a checkpoint path alone stands for `ModelSpec(path)`.

inspect, diff, predict_fold and Config need no torch; the others need the `torch` extra.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = [
    "BnauditError",
    "Config",
    "DataOptions",
    "ModelSpec",
    "__version__",
    "audit_federation",
    "diff",
    "inspect",
    "measure_fold",
    "measure_gap",
    "measure_invariance",
    "merge_statistics",
    "predict_fold",
    "recalibrate_checkpoint",
    "recalibrate_module",
]

# Lazy: `bnaudit --help` must not pay for numpy/torch imports it does not use.
_LAZY = {
    "inspect": ("bnaudit.api", "inspect"),
    "diff": ("bnaudit.audit.diff.checkpoints", "diff"),
    "measure_gap": ("bnaudit.runtime.gap", "measure_gap"),
    "measure_invariance": ("bnaudit.runtime.invariance", "measure_invariance"),
    "recalibrate_checkpoint": ("bnaudit.runtime.recalibrate.command", "recalibrate_checkpoint"),
    "recalibrate_module": ("bnaudit.runtime.recalibrate.methods", "recalibrate_module"),
    "predict_fold": ("bnaudit.audit.fold.predict", "predict_fold"),
    "measure_fold": ("bnaudit.runtime.fold", "measure_fold"),
    "merge_statistics": ("bnaudit.runtime.recalibrate.merge", "merge_statistics"),
    "audit_federation": ("bnaudit.audit.fed.federation", "audit_federation"),
    "Config": ("bnaudit.config", "Config"),
    "DataOptions": ("bnaudit.runtime.sources", "DataOptions"),
    "ModelSpec": ("bnaudit.runtime.models", "ModelSpec"),
    "BnauditError": ("bnaudit.errors", "BnauditError"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        from bnaudit.errors import missing_dependency

        module, attr = _LAZY[name]
        try:
            return getattr(importlib.import_module(module), attr)
        except ModuleNotFoundError as exc:
            # the names that run a model need the torch extra: say so, as the CLI does
            message = missing_dependency(exc)
            if message is None:
                raise
            raise ModuleNotFoundError(f"bnaudit.{name}: {message}", name=exc.name) from exc
    raise AttributeError(f"module 'bnaudit' has no attribute {name!r}")

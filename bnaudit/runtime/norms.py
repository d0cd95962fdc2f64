"""Which modules are BatchNorm (the table of `bnaudit.normkinds`, applied to live modules)
and how to switch them between statistics: the one place in bnaudit's runtime that
decides these.

Definitions (every other runtime module asks the functions here):

  BatchNorm layer   a module of kind "batch norm" in the one table, `bnaudit.normkinds`
                    (`norm_kind`, `is_batchnorm`): an eager module by its class and base
                    classes, and among torch's `_BatchNorm` (BatchNorm1d/2d/3d, their
                    Lazy variants, SyncBatchNorm and every subclass), whose forward the
                    switching below relies on; a TorchScript module by the name of its
                    original class, or where the table does not know it, by the
                    normalisation its code calls (`class MyBN(nn.BatchNorm2d)` scripts
                    to a `MyBN` that calls F.batch_norm). For channel c it computes

                      y = (x - mu_c) / sqrt(var_c + eps) * weight_c + bias_c

                    with mu_c and the biased variance var_c of the batch in training mode
                    (it then updates running_mean / running_var by momentum, storing the
                    unbiased variance), and running_mean_c / running_var_c in eval mode.
  norm layer        a BatchNorm layer or an InstanceNorm (kind "instance norm"; eager, a
                    torch `_NormBase`): every layer whose output depends on the mode
                    (`is_norm`, `norm_modules`). gap switches them all.
  recalibratable    a BatchNorm layer that keeps running statistics (`classify_layers`);
                    frozen BN (statistics as buffers of a module without a training mode),
                    tracked InstanceNorm (its running_var averages per-instance variances)
                    and track_running_stats=False are left alone and listed.

Modes: `batch_statistics` (chosen norm layers normalise by batch statistics, everything
else eval, every buffer restored, SyncBatchNorm as plain BatchNorm per process) is the one
switch; gap, invariance and recalibrate all run through it.

Which samples share a batch is `bnaudit.runtime.batching`'s.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.modules import batchnorm as _torch_batchnorm

from bnaudit.normkinds import (
    NormKind,
    batch_norm_ops_with_training_argument,
    class_kind,
    classify,
    norm_calls,
    own_method_calls,
)
from bnaudit.reports.recalibrate import SkippedLayer

# torch's private base classes: the switching below relies on their forward (every
# BatchNorm*, SyncBatchNorm and user subclass derives from them); read here only.
_BATCHNORM = _torch_batchnorm._BatchNorm
_NORM_BASE = _torch_batchnorm._NormBase


def is_script(module: Any) -> bool:
    return isinstance(module, torch.jit.ScriptModule)


def _script_class(module: Any) -> str:
    return getattr(module, "original_name", "") or ""


@functools.lru_cache(maxsize=256)
def _eager_kind(cls: type) -> NormKind:
    bases = tuple(f"{c.__module__}.{c.__qualname__}" for c in cls.__mro__[1:] if c is not object)
    return classify(cls.__name__, bases)


def _script_kind(module: Any) -> NormKind:
    # TorchScript keeps the original class's name, not its bases: a name the table does
    # not know is classified by the normalisation its code calls, when it holds (or could
    # hold) running statistics, as the archive reader does (formats/torchscript.py)
    name = _script_class(module)
    known = class_kind([name])
    if known is not None:
        return known
    own = dict(module.named_buffers(recurse=False))
    if "running_mean" not in own and not hasattr(module, "track_running_stats"):
        return NormKind.NOT_NORM
    return classify(name, calls=norm_calls(_own_code(module)))


_MAX_OWN_METHODS = 32


def _own_code(module: Any) -> str:
    """The code of a scripted module's forward and of the own methods it calls (an
    InstanceNorm's forward calls `_apply_instance_norm`, which calls F.instance_norm)."""
    pending: list[str] = ["forward"]
    seen: set[str] = set()
    parts: list[str] = []
    while pending and len(seen) < _MAX_OWN_METHODS:
        method = pending.pop(0)
        seen.add(method)
        try:
            code = getattr(module, method).code
        except Exception:  # a module without a compiled forward, or an attribute that is no method
            continue
        parts.append(code)
        pending += [m for m in own_method_calls(code) if m not in seen and m not in pending]
    return "\n".join(parts)


def norm_kind(module: Any) -> NormKind:
    """The kind of a module in `bnaudit.normkinds`'s table (see the module docstring). An
    eager module the table calls BatchNorm (InstanceNorm) that does not derive from torch's
    `_BatchNorm` (`_NormBase`) counts as no norm: its mode cannot be switched here."""
    if is_script(module):
        return _script_kind(module)
    cls: type = type(module)
    kind = _eager_kind(cls)
    if kind is NormKind.BATCH_NORM and not isinstance(module, _BATCHNORM):
        return NormKind.NOT_NORM
    if kind is NormKind.INSTANCE_NORM and not isinstance(module, _NORM_BASE):
        return NormKind.NOT_NORM
    return kind


def is_batchnorm(module: Any) -> bool:
    """A BatchNorm layer (see the module docstring)."""
    return norm_kind(module) is NormKind.BATCH_NORM


def is_norm(module: Any) -> bool:
    """A norm layer: BatchNorm or InstanceNorm, whose output depends on the mode."""
    return norm_kind(module).switches_with_mode


def batchnorm_modules(model: Any) -> dict[str, Any]:
    """Name -> module of every BatchNorm layer, in registration (forward) order."""
    return {name: m for name, m in model.named_modules() if is_batchnorm(m)}


def norm_modules(model: Any) -> dict[str, Any]:
    """Name -> module of every norm layer, in registration (forward) order."""
    return {name: m for name, m in model.named_modules() if is_norm(m)}


def has_stock_forward(model: Any, module: Any) -> bool:
    """An eager BatchNorm layer whose forward is PyTorch's own (so code that reproduces
    that forward, `plain_batchnorm_forward` and the fused recalibration pass, may stand
    in for it). SyncBatchNorm counts: under `batch_statistics` it runs as plain BatchNorm."""
    if is_script(model) or not isinstance(module, _BATCHNORM) or "forward" in vars(module):
        return False
    return type(module).forward is _BATCHNORM.forward or isinstance(module, torch.nn.SyncBatchNorm)


def plain_batchnorm_forward(module: Any, x: Any) -> Any:
    """PyTorch's BatchNorm forward on `module` (SyncBatchNorm without its collective)."""
    return _BATCHNORM.forward(module, x)


@contextlib.contextmanager
def batch_statistics(model: Any, layers: Mapping[str, Any] | None = None) -> Iterator[dict[str, Any]]:
    """`layers` (name -> module; None: every norm layer, `norm_modules`) normalise by the
    statistics of their batch, every other module is in eval mode; on exit the model is
    as it was. Yields the switched layers. The one way bnaudit switches modes:

      modes     the chosen layers in training mode, every other module in eval mode
                (Dropout and other mode-dependent modules stay off, so a difference to
                eval mode is the chosen layers' alone); `layers={}` is the model as
                deployed, everything in eval mode
      buffers   every buffer of the model is snapshot on entry and copied back on exit:
                the training-mode forward of BatchNorm and of a tracked InstanceNorm
                updates running_mean, running_var and num_batches_tracked, and so does a
                TorchScript graph traced in training mode on every call, in eval mode too
      SyncBN    a SyncBatchNorm layer runs as plain BatchNorm on this process's batch:
                bnaudit measures what one process measures and merges the ranks'
                statistics exactly itself; SyncBatchNorm's per-forward all-reduce would
                give other numbers, hang when ranks hold different numbers of batches,
                and refuses CPU tensors under gloo

    Modes, buffers and forwards are restored also after an error or Ctrl-C.
    """
    chosen = norm_modules(model) if layers is None else dict(layers)
    modes = [(m, m.training) for m in model.modules()]
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    patched = [(m, vars(m).get("forward")) for m in chosen.values() if isinstance(m, torch.nn.SyncBatchNorm)]
    try:
        model.eval()
        for m in chosen.values():
            m.train()
        for m, _ in patched:
            m.forward = types.MethodType(_BATCHNORM.forward, m)  # type: ignore[method-assign]
        yield chosen
    finally:
        for m, previous in patched:
            if previous is None:
                vars(m).pop("forward", None)
            else:
                m.forward = previous  # type: ignore[method-assign]
        with torch.no_grad():
            for buf, copy in saved:
                buf.copy_(copy)
        for m, training in modes:
            m.training = training


def classify_layers(model: Any) -> tuple[dict[str, Any], list[SkippedLayer]]:
    """Recalibratable BatchNorm layers, and the other layers with running statistics,
    left alone and listed with the reason (see the module docstring).

    In TorchScript a BatchNorm layer must hold running_mean, running_var and
    num_batches_tracked; any other scripted module with running statistics counts as
    frozen.
    """
    targets: dict[str, Any] = {}
    skipped: list[SkippedLayer] = []
    script = is_script(model)
    for name, module in model.named_modules():
        label = name or "(root)"
        own = dict(module.named_buffers(recurse=False))
        has_stats = "running_mean" in own and "running_var" in own
        cls = _script_class(module) if script else type(module).__name__
        if script:
            if not has_stats:
                continue
            if is_batchnorm(module):
                if "num_batches_tracked" in own:
                    targets[name] = module
                else:
                    skipped.append(SkippedLayer(label, f"{cls}: frozen statistics, left alone"))
            elif is_norm(module):
                skipped.append(SkippedLayer(label, f"{cls}: not BatchNorm, left alone"))
            else:
                skipped.append(SkippedLayer(label, f"{cls}: frozen statistics, left alone"))
        elif is_script(module):
            # a scripted part of an eager model: its mode cannot be switched from here
            if has_stats:
                skipped.append(SkippedLayer(label, f"{cls}: frozen statistics, left alone"))
        elif is_batchnorm(module):
            if module.track_running_stats and module.running_mean is not None and module.running_var is not None:
                targets[name] = module
            else:
                skipped.append(SkippedLayer(label, f"{cls} with track_running_stats=False: no running statistics"))
        elif is_norm(module):
            if module.track_running_stats:
                skipped.append(SkippedLayer(label, f"{cls}: not BatchNorm, left alone"))
        elif has_stats:
            skipped.append(SkippedLayer(label, f"{cls}: frozen statistics, left alone"))
    return targets, skipped


def num_features(module: Any) -> int:
    """Channels of a layer with running statistics (the length of running_mean)."""
    return int(module.running_mean.shape[0])


def batch_statistics_reason(module: Any) -> str | None:
    """Why a module normalises by the statistics of its batch in the mode it is in now
    (None: it does not, or it is no BatchNorm layer).

    Eager BatchNorm uses batch statistics when `training` is set or when it keeps no
    running statistics (`track_running_stats=False`, or running_mean / running_var
    None): PyTorch's forward passes `training or running_mean is None` to the kernel. A
    scripted BatchNorm without a running_mean buffer does the same.
    """
    if not is_batchnorm(module):
        return None
    cls = _script_class(module) if is_script(module) else type(module).__name__
    if is_script(module):
        if "running_mean" not in dict(module.named_buffers(recurse=False)):
            return f"{cls} without running statistics normalises by the statistics of the batch, in eval mode too"
        return None
    if not module.track_running_stats or module.running_mean is None or module.running_var is None:
        return (
            f"{cls} with track_running_stats=False: it keeps no running statistics, so it normalises by the "
            "statistics of the batch in eval mode too"
        )
    if module.training:
        return f"{cls} in training mode normalises by the statistics of the batch"
    return None


# aten operators that normalise by batch statistics when their `training` argument is
# true (bnaudit.normkinds): node kind -> index of that argument
_BATCH_NORM_OPS = {op.name: op.training_arg for op in batch_norm_ops_with_training_argument()}


@dataclass(frozen=True)
class ScriptedBatchStatCall:
    """A batch-normalisation call in a TorchScript graph whose `training` argument is the
    constant True: `.eval()` cannot change it (tracing in training mode bakes it in)."""

    module: str
    kind: str
    op: str


def scripted_batch_stat_calls(model: Any) -> list[ScriptedBatchStatCall]:
    """The graph nodes of every (sub)module of a TorchScript model that call batch
    normalisation with training=True as a constant, in module registration order."""
    calls: list[ScriptedBatchStatCall] = []
    if not is_script(model):
        return calls
    for name, module in model.named_modules():
        try:
            graph = module.graph
        except Exception:  # a module without a compiled forward
            continue
        nodes = [(n, arg) for op, arg in _BATCH_NORM_OPS.items() for n in graph.findAllNodes(op, True)]  # in blocks too
        for node, training_arg in nodes:
            args = list(node.inputs())
            if training_arg is None or len(args) <= training_arg:
                continue
            training = args[training_arg]
            if training.node().kind() == "prim::Constant" and training.toIValue() is True:
                calls.append(ScriptedBatchStatCall(name or "(model)", _script_class(module), node.kind()))
    return calls

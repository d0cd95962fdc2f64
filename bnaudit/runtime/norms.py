"""TODO docstring. From: stats, models, recalibrate"""
from __future__ import annotations

import contextlib
import re
import types
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SkippedLayer:
    """A normalisation layer whose statistics were left as they are, and why."""

    name: str
    reason: str


def is_batchnorm(module: Any) -> bool:
    """A module that normalises with running statistics: nn BatchNorm/SyncBatchNorm/
    tracked InstanceNorm (any subclass of _NormBase) with track_running_stats."""
    from torch.nn.modules.batchnorm import _NormBase

    return isinstance(module, _NormBase)


def bn_modules(model: Any) -> dict[str, Any]:
    """Name -> module of every _NormBase module, in registration (forward) order."""
    return {name: m for name, m in model.named_modules() if is_batchnorm(m)}


_NORM_SCRIPT_NAMES = re.compile(r"(BatchNorm|InstanceNorm)\w*$")


def norm_modules(model: Any) -> dict[str, Any]:
    """Name -> module of every module that normalises with running or batch statistics
    (torch's _NormBase: BatchNorm*, SyncBatchNorm, InstanceNorm*), in registration order;
    in a TorchScript module, those whose original class has such a name."""
    from torch.nn.modules.batchnorm import _NormBase

    found = {}
    for name, module in model.named_modules():
        if isinstance(module, _NormBase):
            found[name] = module
        elif is_script(module) and _NORM_SCRIPT_NAMES.match(getattr(module, "original_name", "")):
            found[name] = module
    return found


def is_script(module: Any) -> bool:
    import torch

    return isinstance(module, torch.jit.ScriptModule)


@contextlib.contextmanager
def eval_mode(model: Any) -> Iterator[Any]:
    """Every module in eval mode; the previous modes restored on exit."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for m, training in modes:
            m.training = training


@contextlib.contextmanager
def batch_stats_mode(model: Any, norms: dict[str, Any] | None = None) -> Iterator[dict[str, Any]]:
    """BN layers normalise by batch statistics (training mode), everything else eval.

    Dropout and other mode-dependent modules stay in eval mode, so a difference to
    eval mode is BatchNorm's alone. The training-mode forward updates running_mean,
    running_var and num_batches_tracked; they are snapshot on entry and copied back on
    exit (also on error), so the model's buffers are bit-identical afterwards, and so
    are all modules' modes. Yields the norm modules.
    """
    import torch

    norms = norm_modules(model) if norms is None else norms
    modes = [(m, m.training) for m in model.modules()]
    saved = [
        (buf, buf.detach().clone())
        for m in norms.values()
        for buf in (getattr(m, n, None) for n in ("running_mean", "running_var", "num_batches_tracked"))
        if isinstance(buf, torch.Tensor)
    ]
    model.eval()
    for m in norms.values():
        m.train()
    try:
        yield norms
    finally:
        with torch.no_grad():
            for buf, copy in saved:
                buf.copy_(copy)
        for m, training in modes:
            m.training = training


def classify_layers(model: Any) -> tuple[dict[str, Any], list[SkippedLayer]]:
    """BN layers whose statistics can be re-estimated, and the others that are left alone.

    Recalibrated: BatchNorm1d/2d/3d, SyncBatchNorm and subclasses (TorchScript: the
    scripted versions) with tracked running statistics. Left alone and listed:
    frozen BN (running statistics as buffers of a module without a training mode:
    torchvision/detectron2 FrozenBatchNorm2d), tracked InstanceNorm (its running_var
    is a mean of per-instance variances, a different quantity), and BN layers with
    track_running_stats=False (no statistics to store).
    """
    from torch.nn.modules.batchnorm import _BatchNorm, _NormBase

    targets: dict[str, Any] = {}
    skipped: list[SkippedLayer] = []
    script = is_script(model)
    for name, module in model.named_modules():
        label = name or "(root)"
        if script:
            own = dict(module.named_buffers(recurse=False))
            cls = getattr(module, "original_name", type(module).__name__)
            if "running_mean" not in own or "running_var" not in own:
                continue
            if "InstanceNorm" in cls:
                skipped.append(SkippedLayer(label, f"{cls}: not BatchNorm, left alone"))
            elif "BatchNorm" in cls and "Frozen" not in cls and "num_batches_tracked" in own:
                targets[name] = module
            else:
                skipped.append(SkippedLayer(label, f"{cls}: frozen statistics, left alone"))
            continue
        if isinstance(module, _BatchNorm):
            if module.track_running_stats and module.running_mean is not None and module.running_var is not None:
                targets[name] = module
            else:
                skipped.append(SkippedLayer(
                    label, f"{type(module).__name__} with track_running_stats=False: no running statistics"))
        elif isinstance(module, _NormBase):
            if module.track_running_stats:
                skipped.append(SkippedLayer(label, f"{type(module).__name__}: not BatchNorm, left alone"))
        else:
            own = dict(module.named_buffers(recurse=False))
            if "running_mean" in own and "running_var" in own:
                skipped.append(SkippedLayer(label, f"{type(module).__name__}: frozen statistics, left alone"))
    return targets, skipped


def batch_len(batch: Any) -> int:
    """Number of samples in a batch: a tensor's first dimension, a `data.Batch`'s
    size, else that of the first tensor found in a tuple/list/dict batch."""
    if hasattr(batch, "shape") and len(batch.shape) > 0:
        return int(batch.shape[0])
    if isinstance(getattr(batch, "size", None), int):  # bnaudit.data.Batch
        return batch.size
    if isinstance(batch, Mapping):
        items = list(batch.values())
    elif isinstance(batch, (list, tuple)):
        items = list(batch)
    else:
        items = []
    for item in items:
        n = batch_len(item)
        if n:
            return n
    return 0


def _concat(a: Any, b: Any) -> Any:
    """Join two batches of the same structure along the sample dimension (None: a
    structure this does not know, left to its producer)."""
    import torch

    if isinstance(a, torch.Tensor):
        return torch.cat([a, b.to(a.device)])
    if isinstance(a, Mapping):
        joined = {k: _concat(a[k], b[k]) for k in a}
        return None if any(v is None for v in joined.values()) else joined
    if isinstance(a, tuple):
        joined = [_concat(x, y) for x, y in zip(a, b)]
        if any(j is None for j in joined):
            return None
        return type(a)(*joined) if hasattr(a, "_fields") else tuple(joined)
    if isinstance(a, list):
        if a and len(a) == len(b) and all(isinstance(x, torch.Tensor) for x in a):
            return [_concat(x, y) for x, y in zip(a, b)]
        return a + b  # a list of per-sample items (file names, strings)
    if isinstance(a, (int, float, str, bytes)) or a is None:
        return a  # a per-batch constant
    return None


def merge_trailing_singleton(batches: Iterable[Any]) -> Iterator[Any]:
    """Yield the batches, with a last batch of one sample merged into the one before.

    A batch of one sample cannot run BatchNorm1d in training mode (one value per
    channel has no variance). Streams with two batches of lookahead.
    """
    held: list[Any] = []  # the last two batches, not yet yielded
    for batch in batches:
        held.append(batch)
        if len(held) == 3:
            yield held.pop(0)
    if len(held) == 2 and batch_len(held[1]) == 1:
        joined = _concat(held[0], held[1])
        if joined is not None:
            held = [joined]
    yield from held


@contextlib.contextmanager
def regime(model: Any, batch_stat_layers: Iterable[Any]) -> Iterator[None]:
    """Eval mode everywhere except `batch_stat_layers`, which normalise by batch
    statistics without touching their buffers.

    Eager BN: training=True with track_running_stats=False (PyTorch then passes no
    buffers to the kernel and does not count the batch); SyncBatchNorm runs as plain
    BN on its rank's batch. TorchScript BN cannot change
    that constant: its buffers are restored afterwards. Modes and buffers are restored
    on exit, also after an error or Ctrl-C.
    """
    import torch

    script = is_script(model)
    modes = [(m, m.training) for m in model.modules()]
    layers = list(batch_stat_layers)
    tracking = [(m, m.track_running_stats) for m in layers] if not script else []
    saved = {n: b.detach().clone() for n, b in model.named_buffers()} if script and layers else {}
    patched = []
    try:
        model.eval()
        for m in layers:
            m.train()
            if not script:
                m.track_running_stats = False
            if isinstance(m, torch.nn.SyncBatchNorm):
                # normalise by this rank's batch, as plain BN does: bnaudit merges the
                # ranks' statistics exactly itself, and a per-forward collective would
                # hang when ranks hold different numbers of batches (and gloo has none)
                m.forward = types.MethodType(torch.nn.modules.batchnorm._BatchNorm.forward, m)
                patched.append(m)
        yield
    finally:
        for m in patched:
            del m.forward
        for m, track in tracking:
            m.track_running_stats = track
        if saved:
            with torch.no_grad():
                for n, b in model.named_buffers():
                    if n in saved:
                        b.copy_(saved[n])
        for m, mode in modes:
            m.training = mode


def num_features(module: Any) -> int:
    return int(module.running_mean.shape[0])

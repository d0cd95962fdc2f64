"""Re-estimate BatchNorm running statistics on calibration data.

For every BN layer with tracked statistics that is recalibrated, bnaudit observes the
values x that reach each channel (n = N*H*W values per batch for a 2-D map) and
stores, per channel:

exact (default)
    One pass; every recalibrated BN layer normalises by batch statistics (as in
    training), everything else is in eval mode (Dropout off). Over ALL samples,
    accumulated in float64 and merged with Chan's formulas (bnaudit.stats):
        running_mean = mu      = (1/n) sum x
        running_var  = s^2     = sum (x - mu)^2 / (n - 1)        (unbiased)
    The population statistic: it includes the spread of the batch means (unlike an
    average of per-batch variances), it is exact when the mean dwarfs the spread
    (unlike E[x^2] - E[x]^2), and it does not depend on the order of the samples.

sequential
    Layer by layer in forward order: the statistics of layer k are measured with
    every earlier BN layer already recalibrated and in eval mode, with the same
    formulas. Afterwards the eval-mode input of every layer over the calibration set
    has exactly the stored mean and unbiased variance; the result depends neither on
    batch size, nor on order, nor on sharding. One pass per layer (each pass stops
    after the layer being calibrated).

cumulative
    The arithmetic of `torch.optim.swa_utils.update_bn` (reset, momentum None): over
    the B calls of the layer, with m_b and v_b the batch mean and unbiased batch
    variance,
        running_mean = (1/B) sum_b m_b,   running_var = (1/B) sum_b v_b
    (misses the spread of the batch means), but with everything except BN in eval
    mode, as in `exact`.

In every method num_batches_tracked becomes the number of batches (forward passes)
that reached the layer, summed over ranks. Layers left out by `include`/`exclude`
keep their statistics and normalise with them (eval mode) during the passes.

Under torch.distributed (torchrun) every rank feeds its own, disjoint, samples; the
counts, means and squared deviations are all-gathered and Chan-merged exactly
(`stats.all_gather_merge`), the batch counts summed, so every rank ends with the
same statistics.

Eager modules are observed with forward pre-hooks. TorchScript modules cannot take
hooks; their BN calls are observed at the dispatcher (a TorchDispatchMode that
recognises each layer's batch-norm op by its running_mean buffer), with the
optimising executor off so that no BN op is fused away. A layer that is observed
while it normalises by batch statistics (exact, cumulative, the layer being
calibrated in sequential) measures its input once: it normalises with the float64
batch statistics just measured (`_normalise`; eager layers through `_fuse`,
TorchScript ones at the dispatcher) rather than computing them a second time.
"""
from __future__ import annotations

import contextlib
import fnmatch
import types
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bnaudit.errors import BnauditError
from bnaudit.stats import ChannelStats, Drift, drift

METHODS = ("exact", "sequential", "cumulative")
# Wu & Johnson (2021) find 10^3-10^4 samples enough for population statistics.
MIN_SAMPLES = 1000
MIN_VALUES_PER_CHANNEL = 1000


@dataclass(frozen=True)
class LayerCalibration:
    """The measured and the stored statistics of one recalibrated layer (float64).

    data_mean / data_var: population mean and unbiased variance of the values that
    reached the layer during its calibration pass (all methods). new_mean / new_var:
    what the method stores (equal to data_* for exact and sequential).
    """

    name: str
    num_features: int
    eps: float
    count: int  # values per channel, all ranks
    batches: int  # batches that reached the layer, all ranks: the new num_batches_tracked
    calls_per_batch: int  # >1: the module runs several times per forward (pooled)
    old_mean: np.ndarray
    old_var: np.ndarray
    old_num_batches_tracked: int | None
    data_mean: np.ndarray
    data_var: np.ndarray
    new_mean: np.ndarray
    new_var: np.ndarray
    stats_dtype: str


@dataclass(frozen=True)
class SkippedLayer:
    """A normalisation layer whose statistics were left as they are, and why."""

    name: str
    reason: str


@dataclass(frozen=True)
class Calibration:
    method: str
    samples: int
    batches: int
    batch_size: int | None  # the largest batch seen (the last one may differ)
    world_size: int
    layers: list[LayerCalibration]
    skipped: list[SkippedLayer]
    warnings: list[str] = field(default_factory=list)

    def buffers(self) -> dict[str, Any]:
        """State-dict entries (module-relative names) of the new statistics, as float64/int64 tensors."""
        import torch

        out: dict[str, Any] = {}
        for layer in self.layers:
            out[f"{layer.name}.running_mean"] = torch.from_numpy(layer.new_mean)
            out[f"{layer.name}.running_var"] = torch.from_numpy(layer.new_var)
            out[f"{layer.name}.num_batches_tracked"] = torch.tensor(layer.batches, dtype=torch.int64)
        return out


# ----------------------------------------------------------------------------- layers


def _is_script(model: Any) -> bool:
    import torch

    return isinstance(model, torch.jit.ScriptModule)


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
    script = _is_script(model)
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


def select_layers(
    targets: dict[str, Any], include: Iterable[str] = (), exclude: Iterable[str] = ()
) -> tuple[dict[str, Any], list[SkippedLayer]]:
    """Apply `--layers GLOB` (any may match; none given: all) and `--exclude GLOB`."""
    include, exclude = tuple(include), tuple(exclude)
    for pattern in include:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in targets):
            shown = ", ".join(list(targets)[:6]) + (" ..." if len(targets) > 6 else "")
            raise BnauditError(f"--layers {pattern!r} matches no BatchNorm layer (layers: {shown or 'none'})")
    chosen: dict[str, Any] = {}
    left: list[SkippedLayer] = []
    for name, module in targets.items():
        wanted = not include or any(fnmatch.fnmatchcase(name, p) for p in include)
        if wanted and not any(fnmatch.fnmatchcase(name, p) for p in exclude):
            chosen[name] = module
        else:
            left.append(SkippedLayer(name, "not selected (--layers/--exclude): statistics kept"))
    return chosen, left


# ----------------------------------------------------------------------------- batches


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


def default_forward(model: Any, batch: Any, device: Any = None) -> Any:
    """model(x) for a tensor batch, model(x) for (x, label, ...), model(**batch) for a dict."""
    def move(x: Any) -> Any:
        return x.to(device, non_blocking=True) if device is not None and hasattr(x, "to") else x

    if isinstance(batch, Mapping):
        return model(**{k: move(v) for k, v in batch.items()})
    if isinstance(batch, (list, tuple)):
        return model(move(batch[0]))
    return model(move(batch))


# ----------------------------------------------------------------------------- modes


@contextlib.contextmanager
def _regime(model: Any, batch_stat_layers: Iterable[Any]) -> Iterator[None]:
    """Eval mode everywhere except `batch_stat_layers`, which normalise by batch
    statistics without touching their buffers.

    Eager BN: training=True with track_running_stats=False (PyTorch then passes no
    buffers to the kernel and does not count the batch); SyncBatchNorm runs as plain
    BN on its rank's batch. TorchScript BN cannot change
    that constant: its buffers are restored afterwards. Modes and buffers are restored
    on exit, also after an error or Ctrl-C.
    """
    import torch

    script = _is_script(model)
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


# ----------------------------------------------------------------------------- observation


class _StopForward(Exception):
    """Raised from an observer to end a forward pass early (sequential method)."""


_BN_OPS = {
    "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
    "_native_batch_norm_legit_functional", "cudnn_batch_norm", "miopen_batch_norm",
    "_batch_norm_with_update", "_batch_norm_with_update_functional", "_batch_norm_no_update",
    "batch_norm", "_batch_norm_impl_index",
}


@contextlib.contextmanager
def _observe(model: Any, layers: dict[str, Any], callback: Callable[[str, Any], Any],
             fused: Collection[str] = ()) -> Iterator[None]:
    """Call `callback(name, input)` each time one of `layers` normalises an input.

    TorchScript layers named in `fused` (normalising by batch statistics) take the
    `ChannelStats` the callback returns as their batch statistics (`_normalise`)."""
    if not layers:
        yield
        return
    if not _is_script(model):
        def hook(name: str) -> Callable[[Any, tuple], None]:
            def observe(_module: Any, args: tuple) -> None:
                callback(name, args[0])  # returns None: a pre-hook's return value replaces the input

            return observe

        handles = [module.register_forward_pre_hook(hook(name)) for name, module in layers.items()]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
        return

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    by_buffer = {module.running_mean.data_ptr(): name for name, module in layers.items()}

    class BatchNormCalls(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            if func.overloadpacket.__name__ in _BN_OPS and len(args) > 3 and isinstance(args[3], torch.Tensor):
                name = by_buffer.get(args[3].data_ptr())
                if name is not None:
                    batch = callback(name, args[0])
                    # native_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps)
                    if (name in fused and func is torch.ops.aten.native_batch_norm.default and len(args) == 8
                            and args[5] is True and not kwargs):
                        out = _normalise(args[0], batch, args[1], args[2], args[7], args[3].dtype)
                        if out is not None:
                            return out
            return func(*args, **(kwargs or {}))

    # The optimising executor may fuse BN into other kernels, out of the dispatcher's sight.
    with torch.jit.optimized_execution(False), BatchNormCalls():
        yield


def _normalise(x: Any, batch: ChannelStats, weight: Any, bias: Any, eps: float, stats_dtype: Any) -> Any:
    """Training-mode batch norm of `x` with the batch statistics already measured
    (`batch`: exact float64 mean mu and M2 over the n = batch.count values per channel):

        y = (x - mu) / sqrt(M2 / n + eps) * weight + bias

    computed by the eval-form batch_norm with mu and the biased variance M2 / n
    rounded to the statistics' dtype, so the statistics pass that training mode
    would run is not run a second time. Equal to PyTorch's training-mode output up
    to that rounding. Returns the eval op's output (a tensor, or for the
    dispatcher the tuple of native_batch_norm), or None where the shortcut does not
    apply and PyTorch's own training-mode forward must run: one value per channel
    (PyTorch raises), reduced precision or mixed dtypes, a 0-channel input.
    """
    import torch

    if (batch.count <= 1 or batch.mean is None or x.dtype != stats_dtype
            or x.dtype not in (torch.float32, torch.float64)):
        return None
    mean = batch.mean.to(stats_dtype)
    var = (batch.m2 / batch.count).to(stats_dtype)
    return torch.ops.aten.native_batch_norm.default(x, weight, bias, mean, var, False, 0.0, eps)


def _stock_forward(model: Any, module: Any) -> bool:
    """An eager BN layer whose forward is PyTorch's own (`_fuse` reproduces it)."""
    import torch
    from torch.nn.modules.batchnorm import _BatchNorm

    if _is_script(model) or not isinstance(module, _BatchNorm) or "forward" in vars(module):
        return False
    return type(module).forward is _BatchNorm.forward or isinstance(module, torch.nn.SyncBatchNorm)


@contextlib.contextmanager
def _fuse(layers: dict[str, Any], observe: Callable[[str, Any], ChannelStats]) -> Iterator[None]:
    """While the block runs, each eager BN layer of `layers` (normalising by batch
    statistics, see `_regime`) measures its input with `observe(name, x)` and
    normalises it with that measurement (`_normalise`), instead of a forward
    pre-hook followed by PyTorch's training-mode forward, which would compute the
    batch statistics a second time. Where `_normalise` does not apply, PyTorch's
    forward runs after the measurement. Instance forwards are restored on exit."""
    from torch.nn.modules.batchnorm import _BatchNorm

    def make(name: str, module: Any) -> Callable[[Any], Any]:
        def forward(x: Any) -> Any:
            batch = observe(name, x)
            module._check_input_dim(x)
            out = _normalise(x, batch, module.weight, module.bias, module.eps, module.running_mean.dtype)
            return _BatchNorm.forward(module, x) if out is None else out[0]

        return forward

    # _regime may have set an instance forward (SyncBatchNorm): put back what was there
    saved = [(m, vars(m).get("forward")) for m in layers.values()]
    try:
        for name, module in layers.items():
            module.forward = make(name, module)
        yield
    finally:
        for module, previous in saved:
            if previous is None:
                vars(module).pop("forward", None)
            else:
                module.forward = previous


@dataclass
class _LayerRecord:
    stats: ChannelStats = field(default_factory=ChannelStats)
    mean_sum: Any = None  # cumulative: sum of batch means (float64)
    var_sum: Any = None  # cumulative: sum of unbiased batch variances
    calls: int = 0  # BN calls (cumulative's B)
    batches: int = 0  # forwards that reached the layer
    max_calls: int = 0


@dataclass
class _Pass:
    records: dict[str, _LayerRecord]
    samples: int = 0
    batches: int = 0
    max_batch: int = 0


def _run_pass(
    model: Any,
    batches: Iterable[Any],
    forward: Callable[[Any, Any], Any],
    observed: dict[str, Any],
    batch_stat_layers: Iterable[Any],
    cumulative: bool = False,
    stop_after: str | None = None,
    autocast: Any = None,
    progress: Callable[[], None] | None = None,
) -> _Pass:
    """One pass over `batches` that records the inputs of `observed` layers."""
    import torch

    result = _Pass({name: _LayerRecord() for name in observed})
    calls_now: dict[str, int] = {}
    stopped: list[str] = []
    expected = {name: _num_features(m) for name, m in observed.items()}
    # One fixed shift per layer (its old running_mean): the sums then do not depend on
    # which sample comes first, so any batching or sharding agrees to float64 rounding.
    shifts = {}
    for name, m in observed.items():
        old = m.running_mean.detach().float()
        # float64 once here, not on every call (the value is the float32 one either way)
        shifts[name] = torch.where(torch.isfinite(old), old, torch.zeros_like(old)).double()

    def on_input(name: str, x: Any) -> ChannelStats:
        if x.dim() < 2 or x.shape[1] != expected[name]:
            raise BnauditError(
                f"layer {name}: expects {expected[name]} channels in dimension 1, got input of shape {tuple(x.shape)}")
        record = result.records[name]
        batch = ChannelStats(shift=shifts[name])
        batch.update(x)
        record.stats.merge(batch.count, batch.mean, batch.m2)
        if cumulative:
            var = batch.m2 / (batch.count - 1) if batch.count > 1 else torch.full_like(batch.m2, float("nan"))
            record.mean_sum = batch.mean if record.mean_sum is None else record.mean_sum + batch.mean
            record.var_sum = var if record.var_sum is None else record.var_sum + var
        record.calls += 1
        calls_now[name] = calls_now.get(name, 0) + 1
        if name == stop_after:
            stopped.append(name)
            raise _StopForward
        return batch

    layers = list(batch_stat_layers)
    # observed layers that normalise by batch statistics use the ones measured here
    fused = {name: m for name, m in observed.items() if any(m is b for b in layers)}
    eager = {name: m for name, m in fused.items() if _stock_forward(model, m)}
    hooked = {name: m for name, m in observed.items() if name not in eager}
    with (_regime(model, layers), _fuse(eager, on_input), _observe(model, hooked, on_input, fused),
          torch.no_grad()):
        for index, batch in enumerate(merge_trailing_singleton(batches)):
            calls_now.clear()
            n = batch_len(batch)
            try:
                with autocast if autocast is not None else contextlib.nullcontext():
                    forward(model, batch)
            except Exception as exc:
                # TorchScript re-raises an exception from the dispatcher as its own
                # error: whether the pass stopped on purpose is known from `stopped`.
                if stopped:
                    stopped.clear()
                elif isinstance(exc, ValueError) and "Expected more than 1 value per channel" in str(exc):
                    raise BnauditError(
                        f"batch {index}: {n} sample(s) give one value per channel, which a BatchNorm "
                        "layer cannot normalise in training mode; use --batch-size 2 or more "
                        "(or --method sequential)") from None
                elif isinstance(exc, BnauditError):
                    raise
                else:
                    raise _rejected(index, exc) from exc
            for name, calls in calls_now.items():
                record = result.records[name]
                record.batches += 1
                record.max_calls = max(record.max_calls, calls)
            result.samples += n
            result.batches += 1
            result.max_batch = max(result.max_batch, n)
            if progress is not None:
                progress()
    return result


def _rejected(index: int, exc: BaseException) -> BnauditError:
    """The model (or --forward) fails on a batch: the user's to fix, in one line."""
    from bnaudit.gap import _reason

    return BnauditError(f"batch {index}: the model rejects the batch: {_reason(exc)}")


def _num_features(module: Any) -> int:
    return int(module.running_mean.shape[0])


# ----------------------------------------------------------------------------- distributed


def _distributed() -> tuple[int, int]:
    """(rank, world size) when torch.distributed is initialised, else (0, 1)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@contextlib.contextmanager
def _together() -> Iterator[None]:
    """Under torch.distributed, a failure on one rank ends the work on every rank
    (rather than leaving the others waiting in the next collective)."""
    import torch
    import torch.distributed as dist

    if _distributed()[1] == 1:
        yield
        return
    failure: BaseException | None = None
    try:
        yield
    except Exception as exc:
        failure = exc
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    flag = torch.tensor([int(failure is not None)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if failure is not None:
        raise failure
    if int(flag.item()):
        raise BnauditError("another rank failed (its error is in that rank's output)")


def _reduce_pass(result: _Pass, observed: dict[str, Any], cumulative: bool) -> _Pass:
    """Combine every rank's pass exactly (collective; same layer order on every rank)."""
    import torch
    import torch.distributed as dist

    from bnaudit.stats import all_gather_merge

    if _distributed()[1] == 1:
        return result
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    names = list(observed)
    counts = torch.tensor(
        [[result.samples, result.batches]] + [[result.records[n].batches, result.records[n].calls] for n in names],
        dtype=torch.int64, device=device)
    dist.all_reduce(counts)
    maxima = torch.tensor([result.max_batch] + [result.records[n].max_calls for n in names],
                          dtype=torch.int64, device=device)
    dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
    merged = _Pass({}, int(counts[0, 0]), int(counts[0, 1]), int(maxima[0]))
    for i, name in enumerate(names):
        record = result.records[name]
        channels = _num_features(observed[name])
        new = _LayerRecord(all_gather_merge(record.stats, channels),
                           batches=int(counts[i + 1, 0]), calls=int(counts[i + 1, 1]), max_calls=int(maxima[i + 1]))
        if cumulative:
            sums = torch.zeros(2, channels, dtype=torch.float64, device=device)
            if record.mean_sum is not None:
                sums[0], sums[1] = record.mean_sum.to(device), record.var_sum.to(device)
            dist.all_reduce(sums)
            new.mean_sum, new.var_sum = sums[0].cpu(), sums[1].cpu()
        merged.records[name] = new
    return merged


# ----------------------------------------------------------------------------- methods


def _numpy(t: Any) -> np.ndarray:
    return t.detach().to("cpu").double().numpy().copy()


def _store(name: str, module: Any, mean: np.ndarray, var: np.ndarray, batches: int) -> None:
    """Write float64 statistics into the module's buffers (in their dtype); refuse non-finite."""
    import torch

    rm, rv = module.running_mean, module.running_var
    new_mean = torch.from_numpy(mean).to(rm.device, rm.dtype)
    new_var = torch.from_numpy(var).to(rv.device, rv.dtype)
    for what, value in (("running_mean", new_mean), ("running_var", new_var)):
        bad = int((~torch.isfinite(value)).sum())
        if bad:
            raise BnauditError(
                f"layer {name}: the new {what} is not finite in {bad} of {value.numel()} channel(s) "
                f"(in {str(value.dtype).removeprefix('torch.')}); nothing written: check the data and the "
                "model for NaN/Inf activations")
    with torch.no_grad():
        rm.copy_(new_mean)
        rv.copy_(new_var)
        if getattr(module, "num_batches_tracked", None) is not None:
            module.num_batches_tracked.fill_(batches)


def _finish_layer(name: str, module: Any, record: _LayerRecord, method: str, eps: float) -> LayerCalibration:
    """Turn one layer's merged record into its new statistics (see module docstring)."""
    stats = record.stats
    if stats.count < 2:
        raise BnauditError(
            f"layer {name}: only {stats.count} value(s) per channel reached it; the variance needs at least 2")
    data_mean, data_var = _numpy(stats.mean), _numpy(stats.var)
    if method == "cumulative":
        new_mean = _numpy(record.mean_sum) / record.calls
        new_var = _numpy(record.var_sum) / record.calls
    else:
        new_mean, new_var = data_mean, data_var
    nbt = getattr(module, "num_batches_tracked", None)
    return LayerCalibration(
        name=name,
        num_features=_num_features(module),
        eps=eps,
        count=stats.count,
        batches=record.batches,
        calls_per_batch=record.max_calls,
        old_mean=_numpy(module.running_mean),
        old_var=_numpy(module.running_var),
        old_num_batches_tracked=int(nbt.item()) if nbt is not None else None,
        data_mean=data_mean,
        data_var=data_var,
        new_mean=new_mean,
        new_var=new_var,
        stats_dtype=str(module.running_var.dtype).removeprefix("torch."),
    )


def _eps(module: Any) -> float:
    eps = getattr(module, "eps", None)
    return float(eps) if isinstance(eps, (int, float)) else 1e-5


def _forward_order(
    model: Any, batches: Iterable[Any], forward: Callable[[Any, Any], Any], layers: dict[str, Any], autocast: Any
) -> tuple[list[str], dict[str, int]]:
    """`layers` in the order one eval-mode forward (first batch) first calls them, and
    how often each is called in it. Layers that batch did not reach follow in
    registration order."""
    import torch

    calls: dict[str, int] = {}

    def count(name: str, _x: Any) -> None:
        calls[name] = calls.get(name, 0) + 1

    first = next(iter(merge_trailing_singleton(batches)), None)
    if first is not None:
        with _regime(model, ()), _observe(model, layers, count), torch.no_grad():
            with autocast if autocast is not None else contextlib.nullcontext():
                try:
                    forward(model, first)
                except BnauditError:
                    raise
                except Exception as exc:
                    raise _rejected(0, exc) from exc
    order = list(calls) + [name for name in layers if name not in calls]
    return order, calls


def _agree_order(order: list[str], calls: dict[str, int]) -> tuple[list[str], dict[str, int]]:
    if _distributed()[1] > 1:
        # every rank must calibrate the layers in the same order (one collective
        # each): rank 0's order wins; a layer's call count is the largest any saw
        import torch.distributed as dist

        shared: list[Any] = [order, calls]
        dist.broadcast_object_list(shared, src=0)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, calls)
        order = shared[0]
        calls = {name: max(c.get(name, 0) for c in gathered) for name in order}
    return order, calls


def recalibrate_module(
    model: Any,
    batches: Iterable[Any],
    method: str = "exact",
    include: Iterable[str] = (),
    exclude: Iterable[str] = (),
    forward: Callable[[Any, Any], Any] | None = None,
    autocast: Any = None,
    progress: Callable[[int, int], None] | None = None,
) -> Calibration:
    """Re-estimate the running statistics of `model`'s BN layers in place.

    `batches`: an iterable of batches (tensors, tuples, dicts), on this rank only
    under torch.distributed; `sequential` iterates it once per layer, so it must be
    re-iterable (a list or a DataLoader, not a generator). `forward(model, batch)`
    runs the model (default: `default_forward`). `progress(done, total)` is called
    after every batch of every pass (total 0 when `batches` has no length). Only
    running_mean, running_var and num_batches_tracked of recalibrated layers change;
    the model's modes are restored.
    """
    if method not in METHODS:
        raise BnauditError(f"unknown method {method!r} (choose from {', '.join(METHODS)})")
    forward = forward or default_forward
    if method == "sequential" and iter(batches) is batches:
        raise BnauditError("the sequential method needs re-iterable batches (a list or DataLoader), not an iterator")
    targets, skipped = classify_layers(model)
    chosen, left = select_layers(targets, include, exclude)
    skipped = left + skipped
    world = _distributed()[1]
    warnings: list[str] = []
    passes = len(chosen) if method == "sequential" else 1
    planned = len(batches) * passes if hasattr(batches, "__len__") else 0
    done = 0

    def tick() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, max(planned, done))

    samples = n_batches = max_batch = 0

    if method in ("exact", "cumulative"):
        with _together():
            result = _run_pass(model, batches, forward, chosen, chosen.values(), cumulative=method == "cumulative",
                               autocast=autocast, progress=tick)
        result = _reduce_pass(result, chosen, method == "cumulative")
        samples, n_batches, max_batch = result.samples, result.batches, result.max_batch
        calibrated = []
        for name, module in chosen.items():
            record = result.records[name]
            if record.stats.count == 0:
                skipped.append(SkippedLayer(name, "never reached by the data: statistics kept"))
                continue
            calibrated.append(_finish_layer(name, module, record, method, _eps(module)))
        for layer in calibrated:  # all checked before any buffer changes
            _store(layer.name, chosen[layer.name], layer.new_mean, layer.new_var, layer.batches)
    else:
        calibrated = []
        with _together():
            order, calls = _forward_order(model, batches, forward, chosen, autocast)
        order, calls = _agree_order(order, calls)
        for step, name in enumerate(order):
            module = chosen[name]
            # A pass stops at the layer's first call; a layer called several times per
            # forward needs the whole forward, in which it and the layers not yet
            # calibrated normalise by batch statistics.
            pending = [chosen[n] for n in order[step:]]
            with _together():
                result = _run_pass(model, batches, forward, {name: module}, pending,
                                   stop_after=name if calls.get(name, 1) <= 1 else None,
                                   autocast=autocast, progress=tick)
            result = _reduce_pass(result, {name: module}, False)
            samples, n_batches, max_batch = result.samples, result.batches, result.max_batch
            record = result.records[name]
            if record.stats.count == 0:
                skipped.append(SkippedLayer(name, "never reached by the data: statistics kept"))
                continue
            layer = _finish_layer(name, module, record, method, _eps(module))
            _store(name, module, layer.new_mean, layer.new_var, layer.batches)
            calibrated.append(layer)
        calibrated.sort(key=lambda layer: list(chosen).index(layer.name))

    if samples == 0:
        raise BnauditError("the calibration data yielded no samples")
    if samples < MIN_SAMPLES:
        warnings.append(
            f"only {samples} calibration samples: Wu & Johnson (2021) report 10^3-10^4 as enough for "
            "population statistics")
    few = [layer.name for layer in calibrated if layer.count < MIN_VALUES_PER_CHANNEL]
    if few:
        warnings.append(
            f"fewer than {MIN_VALUES_PER_CHANNEL} values per channel reached {len(few)} layer(s) "
            f"({', '.join(few[:5])}{' ...' if len(few) > 5 else ''}): their statistics are noisy")
    for layer in calibrated:
        if layer.calls_per_batch > 1:
            warnings.append(
                f"layer {layer.name} runs {layer.calls_per_batch} times per forward: its statistics pool "
                "the inputs of every call (one set of buffers serves them all)")
    return Calibration(method, samples, n_batches, max_batch or None, world, calibrated, skipped, warnings)


# ----------------------------------------------------------------------------- report


@dataclass(frozen=True)
class LayerChange:
    """One recalibrated layer: drift of the old and of the new (stored) statistics
    against the calibration data's statistics `data_mean`, `data_var` (see
    `LayerCalibration`)."""

    name: str
    channels: int
    values: int
    batches: int
    before: Drift
    after: Drift


@dataclass
class RecalibrationReport:
    input: str
    output: str
    format: str
    key: str | None
    model: str
    data: str
    method: str
    samples: int
    batches: int
    batch_size: int
    seed: int
    shuffle: bool
    device: str
    world_size: int
    layers: list[LayerChange]
    skipped: list[SkippedLayer]
    warnings: list[str]
    provenance: dict[str, Any]
    eval_before: Any = None  # bnaudit.gap.GapReport with --eval-data
    eval_after: Any = None


def layer_changes(calibration: Calibration, model: Any) -> list[LayerChange]:
    """Before/after drift of every recalibrated layer; `after` uses the statistics as
    stored (in the buffers' dtype), read back from `model`."""
    changes = []
    modules = dict(model.named_modules())  # get_submodule does not work on TorchScript
    for layer in calibration.layers:
        module = modules[layer.name]
        stored_mean, stored_var = _numpy(module.running_mean), _numpy(module.running_var)
        changes.append(LayerChange(
            name=layer.name,
            channels=layer.num_features,
            values=layer.count,
            batches=layer.batches,
            before=drift(layer.data_mean, layer.data_var, layer.old_mean, layer.old_var, layer.eps),
            after=drift(layer.data_mean, layer.data_var, stored_mean, stored_var, layer.eps),
        ))
    return changes


# ----------------------------------------------------------------------------- entry point


def shard_plan(plan: list[list[int]], batch_size: int, rank: int, world: int) -> list[list[int]]:
    """This rank's batches: every `world`-th sample of the global order (no sample on
    two ranks, none left out), cut into batches, a last batch of one sample merged."""
    order = [index for batch in plan for index in batch]
    mine = order[rank::world]
    batches = [mine[i:i + batch_size] for i in range(0, len(mine), batch_size)]
    if len(batches) >= 2 and len(batches[-1]) == 1:
        batches[-2].extend(batches.pop())
    return batches


@contextlib.contextmanager
def process_group(device: Any) -> Iterator[tuple[int, int]]:
    """Under torchrun (WORLD_SIZE > 1): join the process group (nccl for CUDA, gloo for
    the CPU) for the block and yield (rank, world size); otherwise (0, 1)."""
    import os

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        yield 0, 1
        return
    import torch.distributed as dist

    if dist.is_initialized():  # the caller set it up
        yield dist.get_rank(), dist.get_world_size()
        return
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        yield dist.get_rank(), dist.get_world_size()
    finally:
        dist.destroy_process_group()


def _device_for_rank(device: Any) -> Any:
    """Under torchrun each rank takes its own GPU (LOCAL_RANK)."""
    import os

    import torch

    if device.type == "cuda" and device.index is None and "LOCAL_RANK" in os.environ:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % max(torch.cuda.device_count(), 1))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def run_recalibrate(
    checkpoint: str,
    output: str,
    data: Any,
    method: str = "exact",
    arch: str | None = None,
    arch_kwargs: Any = None,
    key: str | None = None,
    trust_pickle: bool = False,
    forward: str | None = None,
    device: str = "cpu",
    amp: bool = False,
    include: Iterable[str] = (),
    exclude: Iterable[str] = (),
    force: bool = False,
    eval_data: Any = None,
    config: Any = None,
    progress: Callable[[int, int], None] | None = None,
    warn: Callable[[str], None] | None = None,
) -> RecalibrationReport | None:
    """Load the model, re-estimate its BN statistics on `data` (a `data.DataOptions`),
    write `output` in the input's format, and report. Returns None on ranks other
    than 0 under torchrun (rank 0 writes and reports).

    >>> from bnaudit.data import DataOptions                              # doctest: +SKIP
    >>> run_recalibrate("model.pt", "model.recal.pt", DataOptions(path="calib/"),
    ...                 arch="mypkg.models:net").layers[0].after       # doctest: +SKIP
    """
    import datetime

    import torch

    from bnaudit import __version__
    from bnaudit.checkpoint import check_output, save_like
    from bnaudit.data import make_loader
    from bnaudit.models import forward as run_forward
    from bnaudit.models import load_forward, load_runnable, resolve_device, to_device

    warn = warn or (lambda _message: None)
    if method not in METHODS:
        raise BnauditError(f"unknown --method {method!r} (choose from {', '.join(METHODS)})")
    check_output(output, checkpoint, force)
    data.validate()
    protect_inputs(output, [("--data", data.path), ("--eval-data", eval_data.path if eval_data is not None else None),
                            *((option, _spec_file(spec)) for option, spec in
                              (("--arch", arch), ("--dataset", data.dataset), ("--forward", forward)))])
    if data.batch_size < 2 and method != "sequential":
        raise BnauditError(
            f"--batch-size {data.batch_size}: the {method} method normalises by batch statistics, which a batch of "
            "one sample does not have (one value per channel in a BatchNorm1d layer); use --batch-size 2 or more, "
            "or --method sequential")
    if eval_data is not None:
        eval_data.validate()
        if _same_data(data, eval_data):
            raise BnauditError("--eval-data must be held-out data, not the calibration data (--data)")
    target = resolve_device(device)
    forward_fn = load_forward(forward)
    with process_group(target) as (rank, world):
        target = _device_for_rank(target)
        autocast = None
        if amp:
            if target.type == "cuda":
                autocast = torch.autocast("cuda", dtype=torch.float16)
            elif rank == 0:
                warn("--amp applies on CUDA only: ignored on the CPU")
        runnable = load_runnable(checkpoint, arch=arch, arch_kwargs=arch_kwargs, key=key, trust_pickle=trust_pickle)
        ckpt = runnable.checkpoint
        # A layer whose buffers the file lacks cannot be written back without new keys.
        absent = [name for name in classify_layers(runnable.module)[0]
                  if f"{name}.running_mean" not in ckpt.tensors or f"{name}.running_var" not in ckpt.tensors]
        stream = make_loader(_replace(data, pin_memory=target.type == "cuda"))
        batches: Any = stream
        if world > 1:
            plan = shard_plan(stream.plan, data.batch_size, rank, world)
            batches = _replace(stream, plan=plan) if plan else []
        eval_before = None
        model = runnable.module
        if eval_data is not None and rank == 0:
            eval_before = _measure(runnable, eval_data, target, forward_fn, config)
        model.to(target)

        def run(module: Any, batch: Any) -> Any:
            inputs = batch.inputs if hasattr(batch, "inputs") else batch
            return run_forward(module, to_device(inputs, target), forward_fn)

        calibration = recalibrate_module(model, batches, method=method, include=include,
                                         exclude=tuple(exclude) + tuple(absent), forward=run,
                                         autocast=autocast, progress=progress)
        skipped = [SkippedLayer(s.name, "its buffers are not in the checkpoint: left out (no new keys are written)")
                   if s.name in absent else s for s in calibration.skipped]
        if not calibration.layers:
            unreached = forward is not None and any(s.reason.startswith("never reached") for s in skipped)
            raise BnauditError("no BatchNorm layer was recalibrated (see the skipped layers: "
                               + "; ".join(f"{s.name}: {s.reason}" for s in skipped[:4]) + ")"
                               + (f"; does --forward {forward} call the model on the batch?" if unreached else ""))
        if rank != 0:
            return None
        updates = {name: value for name, value in calibration.buffers().items() if name in ckpt.tensors}
        provenance = {
            "method": method,
            "samples": calibration.samples,
            "batches": calibration.batches,
            "batch_size": data.batch_size,
            "seed": data.seed,
            "shuffle": data.shuffle,
            "data": stream.description,
            "world_size": world,
            "layers": len(calibration.layers),
            # inspect reads this back: these layers hold population statistics, not an
            # EMA, so their num_batches_tracked (= batches) says nothing about maturity
            "recalibrated_layers": [layer.name for layer in calibration.layers],
            "bnaudit_version": __version__,
            "date": datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat(),
        }
        save_like(ckpt, updates, output, force=force, provenance=provenance, trust_pickle=trust_pickle)
        eval_after = None
        if eval_data is not None:
            written = load_runnable(output, arch=arch, arch_kwargs=arch_kwargs, key=key, trust_pickle=trust_pickle)
            eval_after = _measure(written, eval_data, target, forward_fn, config)
        return RecalibrationReport(
            input=checkpoint,
            output=output,
            format=ckpt.format,
            key=ckpt.key,
            model=runnable.describe(),
            data=stream.description,
            method=method,
            samples=calibration.samples,
            batches=calibration.batches,
            batch_size=data.batch_size,
            seed=data.seed,
            shuffle=data.shuffle,
            device=str(target),
            world_size=world,
            layers=layer_changes(calibration, model),
            skipped=skipped,
            warnings=calibration.warnings,
            provenance=provenance,
            eval_before=eval_before,
            eval_after=eval_after,
        )


def protect_inputs(output: str, inputs: Iterable[tuple[str, str | None]]) -> None:
    """Refuse an output that would replace an input file (even with --force: the data,
    held-out data or the model's source) or land inside a data folder (it would change
    the data set the next run reads)."""
    import os

    landing = os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(output))), os.path.basename(output))
    for option, path in inputs:
        if not path or not os.path.exists(path):
            continue
        if os.path.isdir(path):
            root = os.path.realpath(path)
            if os.path.commonpath([root, landing]) == root:
                raise BnauditError(f"{output}: lies inside the {option} folder {path}; write the checkpoint elsewhere")
        elif os.path.exists(output) and os.path.samefile(output, path):
            raise BnauditError(f"{output}: is the {option} file; write the new checkpoint to another file")


def _spec_file(spec: str | None) -> str | None:
    """The file of a `path/to/file.py:CALLABLE` spec (None for MODULE:CALLABLE)."""
    import os

    where = (spec or "").rpartition(":")[0]
    return where if where.endswith(".py") or "/" in where or os.sep in where else None


def _replace(obj: Any, **changes: Any) -> Any:
    import dataclasses

    return dataclasses.replace(obj, **changes)


def _same_data(a: Any, b: Any) -> bool:
    import os

    if a.path is not None and b.path is not None and os.path.exists(a.path) and os.path.exists(b.path):
        return os.path.samefile(a.path, b.path)
    return a.dataset is not None and a.dataset == b.dataset


def _measure(runnable: Any, options: Any, device: Any, forward_fn: Any, config: Any) -> Any:
    """The gap report of a model on held-out data (bnaudit.gap)."""
    import dataclasses

    from bnaudit.data import make_loader

    try:
        from bnaudit.gap import measure_gap
    except ImportError:  # pragma: no cover - gap lands with its own branch
        raise BnauditError("--eval-data needs the gap measurement (bnaudit.gap), not in this build") from None
    stream = make_loader(dataclasses.replace(options, pin_memory=device.type == "cuda"))
    return measure_gap(runnable, stream, device, forward_fn, config)

"""Re-estimating BatchNorm running statistics of a module in place (`recalibrate_module`).

For the values x_1..x_n that reach channel c of a recalibrated layer during its pass
(float64, merged exactly as `bnaudit.runtime.stats` defines; under torchrun over all
ranks), the three methods store

  exact        running_mean = mu_c, running_var = M2_c / (n - 1): the population statistics,
               in one pass in which every recalibrated layer normalises by batch statistics
               (the regime the stored statistics were meant to replace in training)
  sequential   the same formulas, one layer at a time in forward order, each pass with the
               layers already done in eval mode (their new statistics) and the rest by batch
               statistics: each layer's statistics describe the inputs it gets in eval mode
  cumulative   the average over the B batch calls of the batch mean and of the unbiased
               batch variance, as torch.optim.swa_utils.update_bn (momentum=None) does; it
               misses the spread of the batch means, so it underestimates the variance

and num_batches_tracked = the batches that reached the layer. Only these buffers of the
recalibrated layers change; the modes are restored. A last batch of one sample joins the
previous one (`batching.merge_trailing_singleton`).
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sized
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from bnaudit.errors import BnauditError
from bnaudit.normkinds import DEFAULT_EPS
from bnaudit.reports.recalibrate import SkippedLayer
from bnaudit.runtime.batching import batch_len, merge_trailing_singleton
from bnaudit.runtime.distributed import distributed, together
from bnaudit.runtime.norms import (
    batch_statistics,
    classify_layers,
    has_stock_forward,
    num_features,
    plain_batchnorm_forward,
)
from bnaudit.runtime.recalibrate.distributed import LayerRecord, PassResult, reduce_pass
from bnaudit.runtime.sites import forward_order, observe_batchnorm, rejected
from bnaudit.runtime.stats import ChannelStats
from bnaudit.text import plural

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
    # What a statistics file keeps (bnaudit.formats.bnstats): M2 itself (data_var = M2 / (n - 1)),
    # the BN calls (cumulative's B) and, for cumulative, the sums its averages divide by B.
    data_m2: np.ndarray | None = None
    calls: int = 0
    batch_mean_sum: np.ndarray | None = None
    batch_var_sum: np.ndarray | None = None


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
        out: dict[str, Any] = {}
        for layer in self.layers:
            out[f"{layer.name}.running_mean"] = torch.from_numpy(layer.new_mean)
            out[f"{layer.name}.running_var"] = torch.from_numpy(layer.new_var)
            out[f"{layer.name}.num_batches_tracked"] = torch.tensor(layer.batches, dtype=torch.int64)
        return out


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


def default_forward(model: Any, batch: Any, device: Any = None) -> Any:
    """model(x) for a tensor batch, model(x) for (x, label, ...), model(**batch) for a dict."""

    def move(x: Any) -> Any:
        return x.to(device, non_blocking=True) if device is not None and hasattr(x, "to") else x

    if isinstance(batch, Mapping):
        return model(**{k: move(v) for k, v in batch.items()})
    if isinstance(batch, (list, tuple)):
        return model(move(batch[0]))
    return model(move(batch))


class _StopForward(Exception):
    """Raised from an observer to end a forward pass early (sequential method)."""


@contextlib.contextmanager
def _observe(
    model: Any, layers: dict[str, Any], callback: Callable[[str, Any], Any], fused: Collection[str] = ()
) -> Iterator[None]:
    """Call `callback(name, input)` each time one of `layers` normalises an input
    (`bnaudit.runtime.sites.observe_batchnorm`).

    TorchScript layers named in `fused` (normalising by batch statistics) take the
    `ChannelStats` the callback returns as their batch statistics (`_normalise`)."""

    def replace(name: str, batch: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # native_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps)
        if (
            name in fused
            and func is torch.ops.aten.native_batch_norm.default
            and len(args) == 8
            and args[5] is True
            and not kwargs
        ):
            return _normalise(args[0], batch, args[1], args[2], args[7], args[3].dtype)
        return None

    with observe_batchnorm(model, layers, callback, replace if fused else None):
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
    if (
        batch.count <= 1
        or batch.mean is None
        or x.dtype != stats_dtype
        or x.dtype not in (torch.float32, torch.float64)
    ):
        return None
    mean = batch.mean.to(stats_dtype)
    var = (batch.m2 / batch.count).to(stats_dtype)
    return torch.ops.aten.native_batch_norm.default(x, weight, bias, mean, var, False, 0.0, eps)


@contextlib.contextmanager
def _fuse(layers: dict[str, Any], observe: Callable[[str, Any], ChannelStats]) -> Iterator[None]:
    """While the block runs, each eager BN layer of `layers` (normalising by batch
    statistics, see `norms.batch_statistics`) measures its input with `observe(name, x)` and
    normalises it with that measurement (`_normalise`), instead of a forward
    pre-hook followed by PyTorch's training-mode forward, which would compute the
    batch statistics a second time. Where `_normalise` does not apply, PyTorch's
    forward runs after the measurement. Instance forwards are restored on exit."""

    def make(name: str, module: Any) -> Callable[[Any], Any]:
        def forward(x: Any) -> Any:
            batch = observe(name, x)
            module._check_input_dim(x)
            out = _normalise(x, batch, module.weight, module.bias, module.eps, module.running_mean.dtype)
            return plain_batchnorm_forward(module, x) if out is None else out[0]

        return forward

    # batch_statistics may have set an instance forward (SyncBatchNorm): put back what was there
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


def _run_pass(
    model: Any,
    batches: Iterable[Any],
    forward: Callable[[Any, Any], Any],
    observed: dict[str, Any],
    batch_stat_layers: Mapping[str, Any],
    cumulative: bool = False,
    stop_after: str | None = None,
    autocast: Any = None,
    progress: Callable[[], None] | None = None,
) -> PassResult:
    """One pass over `batches` that records the inputs of `observed` layers."""
    result = PassResult({name: LayerRecord() for name in observed})
    calls_now: dict[str, int] = {}
    stopped: list[str] = []
    expected = {name: num_features(m) for name, m in observed.items()}
    shifts = _shifts(observed)

    def on_input(name: str, x: Any) -> ChannelStats:
        if x.dim() < 2 or x.shape[1] != expected[name]:
            raise BnauditError(
                f"layer {name}: expects {expected[name]} channels in dimension 1, got input of shape {tuple(x.shape)}"
            )
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

    # observed layers that normalise by batch statistics use the ones measured here
    fused = {name: m for name, m in observed.items() if name in batch_stat_layers}
    eager = {name: m for name, m in fused.items() if has_stock_forward(model, m)}
    hooked = {name: m for name, m in observed.items() if name not in eager}
    with (
        batch_statistics(model, batch_stat_layers),
        _fuse(eager, on_input),
        _observe(model, hooked, on_input, fused),
        torch.no_grad(),
    ):
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
                    raise _one_value_per_channel(index, n) from None
                elif isinstance(exc, BnauditError):
                    raise
                else:
                    raise rejected(index, exc) from exc
            _count_batch(result, calls_now, n)
            if progress is not None:
                progress()
    return result


def _shifts(observed: dict[str, Any]) -> dict[str, Any]:
    """One fixed shift per layer (its old running_mean, 0 where not finite), in float64."""
    # The sums then do not depend on which sample comes first, so any batching or
    # sharding agrees to float64 rounding.
    shifts = {}
    for name, m in observed.items():
        old = m.running_mean.detach().float()
        # float64 once here, not on every call (the value is the float32 one either way)
        shifts[name] = torch.where(torch.isfinite(old), old, torch.zeros_like(old)).double()
    return shifts


def _count_batch(result: PassResult, calls_now: dict[str, int], n: int) -> None:
    """Add one forward of `n` samples to the pass's counts; `calls_now`: how often each
    observed layer ran in it."""
    for name, calls in calls_now.items():
        record = result.records[name]
        record.batches += 1
        record.max_calls = max(record.max_calls, calls)
    result.samples += n
    result.batches += 1
    result.max_batch = max(result.max_batch, n)


def _one_value_per_channel(index: int, n: int) -> BnauditError:
    """Training-mode BN on a batch that gives one value per channel (PyTorch's ValueError)."""
    return BnauditError(
        f"batch {index}: {plural(n, 'sample')} {'gives' if n == 1 else 'give'} one value per channel, which a BatchNorm "
        "layer cannot normalise in training mode; use --batch-size 2 or more "
        "(or --method sequential)"
    )


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A float64 numpy copy of a tensor, on the CPU."""
    return t.detach().to("cpu").double().numpy().copy()


def _store(name: str, module: Any, mean: np.ndarray, var: np.ndarray, batches: int) -> None:
    """Write float64 statistics into the module's buffers (in their dtype); refuse non-finite."""
    rm, rv = module.running_mean, module.running_var
    new_mean = torch.from_numpy(mean).to(rm.device, rm.dtype)
    new_var = torch.from_numpy(var).to(rv.device, rv.dtype)
    for what, value in (("running_mean", new_mean), ("running_var", new_var)):
        bad = int((~torch.isfinite(value)).sum())
        if bad:
            raise BnauditError(
                f"layer {name}: the new {what} is not finite in {bad} of {plural(value.numel(), 'channel')} "
                f"(in {str(value.dtype).removeprefix('torch.')}); nothing written: check the data and the "
                "model for NaN/Inf activations"
            )
    with torch.no_grad():
        rm.copy_(new_mean)
        rv.copy_(new_var)
        if getattr(module, "num_batches_tracked", None) is not None:
            module.num_batches_tracked.fill_(batches)


def stored_statistics(record: LayerRecord, method: str) -> tuple[np.ndarray, np.ndarray]:
    """What `method` stores for a layer's merged record (module docstring), float64:
    exact and sequential mu and M2 / (n - 1); cumulative the sums of the batch means and
    of the unbiased batch variances divided by the B calls."""
    if method == "cumulative":
        return to_numpy(record.mean_sum) / record.calls, to_numpy(record.var_sum) / record.calls
    return to_numpy(record.stats.mean), to_numpy(record.stats.var)


def _finish_layer(name: str, module: Any, record: LayerRecord, method: str, eps: float) -> LayerCalibration:
    """Turn one layer's merged record into its new statistics (see module docstring)."""
    stats = record.stats
    if stats.count < 2:
        raise BnauditError(
            f"layer {name}: only {plural(stats.count, 'value')} per channel reached it; the variance needs at least 2"
        )
    data_mean, data_var = to_numpy(stats.mean), to_numpy(stats.var)
    new_mean, new_var = stored_statistics(record, method)
    cumulative = method == "cumulative"
    nbt = getattr(module, "num_batches_tracked", None)
    return LayerCalibration(
        name=name,
        num_features=num_features(module),
        eps=eps,
        count=stats.count,
        batches=record.batches,
        calls_per_batch=record.max_calls,
        old_mean=to_numpy(module.running_mean),
        old_var=to_numpy(module.running_var),
        old_num_batches_tracked=int(nbt.item()) if nbt is not None else None,
        data_mean=data_mean,
        data_var=data_var,
        new_mean=new_mean,
        new_var=new_var,
        stats_dtype=str(module.running_var.dtype).removeprefix("torch."),
        data_m2=to_numpy(stats.m2),
        calls=record.calls,
        batch_mean_sum=to_numpy(record.mean_sum) if cumulative else None,
        batch_var_sum=to_numpy(record.var_sum) if cumulative else None,
    )


def _eps(module: Any) -> float:
    """The module's own eps; PyTorch's default (bnaudit.audit.settings) for a norm class without one."""
    eps = getattr(module, "eps", None)
    return float(eps) if isinstance(eps, (int, float)) else DEFAULT_EPS


def _agree_order(order: list[str], calls: dict[str, int]) -> tuple[list[str], dict[str, int]]:
    if distributed()[1] > 1:
        # every rank must calibrate the layers in the same order (one collective
        # each): rank 0's order wins; a layer's call count is the largest any saw
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
    world = distributed()[1]
    passes = len(chosen) if method == "sequential" else 1
    planned = len(batches) * passes if isinstance(batches, Sized) else 0
    done = 0

    def tick() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, max(planned, done))

    if method in ("exact", "cumulative"):
        calibrated, counts = _calibrate_together(model, batches, forward, chosen, method, autocast, tick, skipped)
    else:
        calibrated, counts = _calibrate_in_order(model, batches, forward, chosen, autocast, tick, skipped)
    samples, n_batches, max_batch = counts
    if samples == 0:
        raise BnauditError("the calibration data yielded no samples")
    warnings = calibration_warnings(samples, calibrated)
    return Calibration(method, samples, n_batches, max_batch or None, world, calibrated, skipped, warnings)


def _calibrate_together(
    model: Any,
    batches: Iterable[Any],
    forward: Callable[[Any, Any], Any],
    chosen: dict[str, Any],
    method: str,
    autocast: Any,
    tick: Callable[[], None],
    skipped: list[SkippedLayer],
) -> tuple[list[LayerCalibration], tuple[int, int, int]]:
    """exact and cumulative: every chosen layer measured in one pass in which all of them
    normalise by batch statistics (module docstring). Layers the data never reached go to `skipped`. Returns the
    calibrated layers and the pass's (samples, batches, largest batch)."""
    with together():
        result = _run_pass(
            model,
            batches,
            forward,
            chosen,
            chosen,
            cumulative=method == "cumulative",
            autocast=autocast,
            progress=tick,
        )
    result = reduce_pass(result, chosen, method == "cumulative")
    calibrated = []
    for name, module in chosen.items():
        record = result.records[name]
        if record.stats.count == 0:
            skipped.append(SkippedLayer(name, "never reached by the data: statistics kept"))
            continue
        calibrated.append(_finish_layer(name, module, record, method, _eps(module)))
    for layer in calibrated:  # all checked before any buffer changes
        _store(layer.name, chosen[layer.name], layer.new_mean, layer.new_var, layer.batches)
    return calibrated, (result.samples, result.batches, result.max_batch)


def _calibrate_in_order(
    model: Any,
    batches: Iterable[Any],
    forward: Callable[[Any, Any], Any],
    chosen: dict[str, Any],
    autocast: Any,
    tick: Callable[[], None],
    skipped: list[SkippedLayer],
) -> tuple[list[LayerCalibration], tuple[int, int, int]]:
    """sequential: one pass per chosen layer in forward order, each stored before the
    next pass runs (module docstring). Layers the data never reached go to `skipped`.
    Returns the calibrated layers in registration order and the last pass's (samples,
    batches, largest batch); zeros when no pass ran."""
    samples = n_batches = max_batch = 0
    calibrated = []
    with together():
        order, calls = forward_order(model, batches, forward, chosen, autocast)
    order, calls = _agree_order(order, calls)
    for step, name in enumerate(order):
        module = chosen[name]
        # A pass stops at the layer's first call; a layer called several times per
        # forward needs the whole forward, in which it and the layers not yet
        # calibrated normalise by batch statistics.
        pending = {n: chosen[n] for n in order[step:]}
        with together():
            result = _run_pass(
                model,
                batches,
                forward,
                {name: module},
                pending,
                stop_after=name if calls.get(name, 1) <= 1 else None,
                autocast=autocast,
                progress=tick,
            )
        result = reduce_pass(result, {name: module}, False)
        samples, n_batches, max_batch = result.samples, result.batches, result.max_batch
        record = result.records[name]
        if record.stats.count == 0:
            skipped.append(SkippedLayer(name, "never reached by the data: statistics kept"))
            continue
        layer = _finish_layer(name, module, record, "sequential", _eps(module))
        _store(name, module, layer.new_mean, layer.new_var, layer.batches)
        calibrated.append(layer)
    calibrated.sort(key=lambda layer: list(chosen).index(layer.name))
    return calibrated, (samples, n_batches, max_batch)


def calibration_warnings(samples: int, calibrated: list[LayerCalibration], counts: bool = True) -> list[str]:
    """What makes the new statistics doubtful: few samples, few values per channel (unless
    not `counts`: a shard's statistics, whose merge is what counts), a layer whose buffers
    pool several calls per forward."""
    warnings: list[str] = []
    if counts and samples < MIN_SAMPLES:
        warnings.append(
            f"only {samples} calibration samples: Wu & Johnson (2021) report 10^3-10^4 as enough for "
            "population statistics"
        )
    few = [layer.name for layer in calibrated if counts and layer.count < MIN_VALUES_PER_CHANNEL]
    if few:
        warnings.append(
            f"fewer than {MIN_VALUES_PER_CHANNEL} values per channel reached {plural(len(few), 'layer')} "
            f"({', '.join(few[:5])}{' ...' if len(few) > 5 else ''}): their statistics are noisy"
        )
    for layer in calibrated:
        if layer.calls_per_batch > 1:
            warnings.append(
                f"layer {layer.name} runs {layer.calls_per_batch} times per forward: its statistics pool "
                "the inputs of every call (one set of buffers serves them all)"
            )
    return warnings

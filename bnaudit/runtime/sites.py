"""Where a running model's BatchNorm layers are seen: the one observer of their calls, and the
order one forward first calls them in (execution order).

  batchnorm_calls   every batch-norm operator the dispatcher runs (`bnaudit.normkinds`'s
                    table of aten ops), attributed to a layer by the storage of its
                    running_mean argument (or, for a layer without running statistics, its
                    weight): the only way into TorchScript and torch.export modules, whose
                    submodules take no hooks, and the level at which a deployed artifact
                    computes BN (the operator's output, before any activation a module's
                    own forward adds: timm's BatchNormAct2d)
  batchnorm_outputs on_output(name, value) with each call's output of each layer's
                    batch-norm operator: a forward hook where the module's forward is
                    PyTorch's own, `batchnorm_calls` otherwise
  observe_batchnorm callback(name, input) on each call of chosen layers: a forward pre-hook
                    on eager modules; `batchnorm_calls` on TorchScript
  forward_order     the chosen layers in the order an eval-mode forward of the first batch
                    first calls them, and how often each is called in it; layers that batch
                    does not reach follow in registration order

recalibrate (its passes and its sequential order) and parity (the layers compared, and their
order) observe through here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bnaudit.errors import BnauditError
from bnaudit.normkinds import NormKind, op_kind
from bnaudit.runtime.batching import merge_trailing_singleton
from bnaudit.runtime.norms import batch_statistics, has_stock_forward, is_script
from bnaudit.text import exception_line

# every aten batch-norm operator takes (input, weight, bias, running_mean, running_var, ...)
_WEIGHT, _RUNNING_MEAN = 1, 3


def rejected(index: int, exc: BaseException) -> BnauditError:
    """The model (or --forward) fails on a batch: the user's to fix, in one line."""
    return BnauditError(f"batch {index}: the model rejects the batch: {exception_line(exc)}")


def layer_storages(model: Any, layers: Mapping[str, Any] | None = None) -> dict[int, str]:
    """data_ptr -> layer name of the running_mean (else the weight) of each BN layer:
    `layers` (name -> module), or every module of `model` that holds a running_mean
    buffer of its own (a TorchScript or torch.export module, whose classes are gone)."""
    if layers is None:
        found: dict[int, str] = {}
        for name, module in model.named_modules():
            own = dict(module.named_buffers(recurse=False))
            if isinstance(own.get("running_mean"), torch.Tensor):
                found[own["running_mean"].data_ptr()] = name
        return found
    storages = {}
    for name, module in layers.items():
        tensor = getattr(module, "running_mean", None)
        if not isinstance(tensor, torch.Tensor):
            tensor = getattr(module, "weight", None)
        if isinstance(tensor, torch.Tensor):
            storages[tensor.data_ptr()] = name
    return storages


def _layer_of(args: tuple[Any, ...], storages: Mapping[int, str]) -> str | None:
    for index in (_RUNNING_MEAN, _WEIGHT):
        if len(args) > index and isinstance(args[index], torch.Tensor):
            name = storages.get(args[index].data_ptr())
            if name is not None:
                return name
    return None


class _BatchNormCalls(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch: TorchDispatchMode.__init_subclass__ is unannotated
    """The dispatcher-level observer of `batchnorm_calls`. One class for every use: a class
    made per call lives in reference cycles (as every class does) that would keep its
    closure, and with it each batch's recorded outputs, until a full garbage collection."""

    def __init__(self, storages: Mapping[int, str], around: Callable[..., Any]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch: TorchDispatchMode.__init__ is unannotated
        self.storages = storages
        self.around = around

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        name = _layer_of(args, self.storages) if op_kind(func.name()) is NormKind.BATCH_NORM else None
        if name is None:
            return func(*args, **(kwargs or {}))
        return self.around(name, lambda: func(*args, **(kwargs or {})), func, args, kwargs or {})


@contextlib.contextmanager
def batchnorm_calls(
    storages: Mapping[int, str], around: Callable[[str, Callable[[], Any], Any, tuple[Any, ...], dict[str, Any]], Any]
) -> Iterator[None]:
    """While the block runs, each batch-norm operator of a layer in `storages`
    (`layer_storages`) is run as `around(name, run, func, args, kwargs)`: `run()` runs the
    operator and returns its output (a tensor, or native_batch_norm's tuple, output first);
    `around` returns what the operator returns. Other operators run untouched."""
    with _BatchNormCalls(storages, around):
        yield


@contextlib.contextmanager
def batchnorm_outputs(
    model: Any, layers: Mapping[str, Any] | None, on_output: Callable[[str, Any], None]
) -> Iterator[None]:
    """`on_output(name, value)` with each call's output of each BN layer's batch-norm operator,
    as the forward makes it. `layers` (name -> module): a forward hook on each when every one
    is an eager module whose forward is PyTorch's own (its output is the operator's, and the
    dispatcher, with the compiler machinery it imports on first use, is left alone);
    otherwise, and for a TorchScript or torch.export module (`layers` None: the modules that
    hold a running_mean), the dispatcher's operators (`batchnorm_calls`)."""
    if layers is not None and not is_script(model) and all(has_stock_forward(model, m) for m in layers.values()):

        def hook(name: str) -> Callable[[Any, Any, Any], None]:
            def observe(_module: Any, _args: Any, output: Any) -> None:
                on_output(name, output)

            return observe

        handles = [module.register_forward_hook(hook(name)) for name, module in layers.items()]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
        return

    def around(name: str, run: Callable[[], Any], _func: Any, _args: Any, _kwargs: Any) -> Any:
        out = run()
        on_output(name, out[0] if isinstance(out, (tuple, list)) else out)
        return out

    with batchnorm_calls(layer_storages(model, layers), around):
        yield


@contextlib.contextmanager
def observe_batchnorm(
    model: Any,
    layers: Mapping[str, Any],
    callback: Callable[[str, Any], Any],
    replace: Callable[[str, Any, Any, tuple[Any, ...], dict[str, Any]], Any] | None = None,
) -> Iterator[None]:
    """Call `callback(name, input)` each time one of `layers` normalises an input.

    On TorchScript, `replace(name, observed, func, args, kwargs)` (given the callback's
    return value and the operator's call) may return the operator's output instead of
    running it (None: it runs)."""
    if not layers:
        yield
        return
    if not is_script(model):

        def hook(name: str) -> Callable[[Any, tuple[Any, ...]], None]:
            def observe(_module: Any, args: tuple[Any, ...]) -> None:
                callback(name, args[0])  # returns None: a pre-hook's return value replaces the input

            return observe

        handles = [module.register_forward_pre_hook(hook(name)) for name, module in layers.items()]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
        return

    def around(name: str, run: Callable[[], Any], func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        observed = callback(name, args[0])
        out = replace(name, observed, func, args, kwargs) if replace is not None else None
        return run() if out is None else out

    storages = {module.running_mean.data_ptr(): name for name, module in layers.items()}
    # The optimising executor may fuse BN into other kernels, out of the dispatcher's sight.
    with (
        torch.jit.optimized_execution(False),  # type: ignore[attr-defined]  # public torch.jit API missing from torch.jit.__all__
        batchnorm_calls(storages, around),
    ):
        yield


def forward_order(
    model: Any, batches: Iterable[Any], forward: Callable[[Any, Any], Any], layers: Mapping[str, Any], autocast: Any
) -> tuple[list[str], dict[str, int]]:
    """`layers` in the order one eval-mode forward (first batch) first calls them, and
    how often each is called in it. Layers that batch did not reach follow in
    registration order."""
    calls: dict[str, int] = {}

    def count(name: str, _x: Any) -> None:
        calls[name] = calls.get(name, 0) + 1

    first = next(iter(merge_trailing_singleton(batches)), None)
    if first is not None:
        with (
            batch_statistics(model, {}),
            observe_batchnorm(model, layers, count),
            torch.no_grad(),
            autocast if autocast is not None else contextlib.nullcontext(),
        ):
            try:
                forward(model, first)
            except BnauditError:
                raise
            except Exception as exc:
                raise rejected(0, exc) from exc
    order = list(calls) + [name for name in layers if name not in calls]
    return order, calls

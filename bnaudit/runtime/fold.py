"""`bnaudit fold --arch --data`: measure what folding, int8 and half precision cost.

One read of the data: every batch is run through each target in turn (definitions of the
targets in `bnaudit.audit.fold.report`):

  float32           the model as loaded, eval mode
  folded            `fold_model`: every pair's BN folded into its producer in float64
                    (W' = W s, b' = beta + (b - mean) s, s = gamma / sqrt(var + eps), the
                    module's own eps; a ConvTranspose's output channels are its weight's
                    axis 1), stored as float32, the BN replaced by Identity. A BN subclass
                    with a forward of its own (timm's BatchNormAct2d: BN, then dropout and
                    an activation) keeps its module, made the identity normalisation
                    (weight 1, bias 0, mean 0, var 1, eps 0), so what it applies after the
                    BN stays: folded only where a probe shows its forward is that
                    (`applies_after_batchnorm`)
  int8_per_tensor   folded, each folded producer's weight through
                    torch.fake_quantize_per_tensor_affine(W', max|W'| / 127, 0, -127, 127)
                    (activations float32, biases float32)
  int8_per_channel  the same with fake_quantize_per_channel_affine, scale max|W'_c| / 127
  fp16, bf16        the unfolded model and its inputs cast to the dtype, outputs compared
                    in float32; None where the CPU cannot run the dtype (a note says why)

Per pair, the folded model with only that pair's producer quantized per tensor (the
weight swapped in and restored around each batch). With labels each result is the top-1
accuracy (fraction); without, the mean over samples of ||y - y_float32|| / ||y_float32||.
The drop of a pair is accuracy(folded) - accuracy(pair quantized), or its divergence minus
the folded model's. Under torchrun (`python -m torch.distributed.run`) every rank scores its
share of whole batches on the CPU and every rank returns the report of all the samples.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from bnaudit.audit.fold.check import PairPrediction
from bnaudit.audit.fold.predict import predict_checkpoint
from bnaudit.audit.fold.report import TARGETS, FoldMeasurement, FoldReport
from bnaudit.config import Config
from bnaudit.errors import BnauditError
from bnaudit.runtime.data import make_loader
from bnaudit.runtime.distributed import gather_objects, together, torchrun
from bnaudit.runtime.models import (
    ModelSpec,
    as_model_spec,
    forward,
    graph_producers,
    load_forward,
    load_runnable,
    output_tensor,
    producer_out_axis,
    resolve_model,
)
from bnaudit.runtime.norms import has_stock_forward, plain_batchnorm_forward
from bnaudit.runtime.sources import DataOptions


def _module(model: nn.Module, name: str) -> Any:
    """The submodule `name` (Any: its parameters are read and replaced by attribute)."""
    return model.get_submodule(name)


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


# The probe input's trailing sizes by BatchNorm class: (N, C) or (N, C, L); (N, C, H, W); (N, C, D, H, W).
_PROBE_SHAPES = ((nn.BatchNorm3d, (2, 2, 2)), (nn.BatchNorm2d, (3, 3)), (nn.BatchNorm1d, (3,)))


@torch.no_grad()
def _neutralise(bn: Any) -> None:
    """Make a BatchNorm's eval normalisation the identity: (x - 0) / sqrt(1 + 0) * 1 + 0 = x."""
    if bn.weight is not None:
        bn.weight.fill_(1.0)
    if bn.bias is not None:
        bn.bias.fill_(0.0)
    bn.running_mean.zero_()
    bn.running_var.fill_(1.0)
    bn.eps = 0.0


@torch.no_grad()
def applies_after_batchnorm(bn: Any) -> bool:
    """A BatchNorm subclass whose eval forward is PyTorch's BatchNorm followed by something
    that does not read the BN's parameters or buffers (timm's BatchNormAct2d: dropout, then
    an activation): on a probe input, forward(x) equals the neutralised module applied to
    BatchNorm(x). Only then may the statistics move into the producer and the module stay."""
    trailing = next((shape for cls, shape in _PROBE_SHAPES if isinstance(bn, cls)), None)
    if trailing is None or bn.running_var is None:
        return False
    probe = copy.deepcopy(bn).eval()
    generator = torch.Generator().manual_seed(0)
    weight = probe.running_var if probe.weight is None else probe.weight
    x = torch.randn(2, probe.num_features, *trailing, generator=generator).to(weight.dtype) * 3 + 1
    try:
        expected = probe(x)
        normalised = plain_batchnorm_forward(probe, x)
        _neutralise(probe)
        return bool(torch.allclose(probe(normalised), expected, rtol=1e-5, atol=1e-6))
    except Exception:  # a forward of its own that cannot take the probe: not folded
        return False


def foldable(model: nn.Module, pairs: Iterable[PairPrediction]) -> list[PairPrediction]:
    """The pairs whose modules are a Conv/Linear/ConvTranspose and a tracked BatchNorm with
    PyTorch's forward, or one that applies something after it (`applies_after_batchnorm`)."""
    found = []
    for p in pairs:
        try:
            producer, bn = _module(model, p.producer), _module(model, p.bn)
        except AttributeError:
            continue
        if producer_out_axis(producer) is None or getattr(bn, "running_var", None) is None:
            continue
        # folding reproduces PyTorch's own eval forward: a BN with a forward of its own is left
        if has_stock_forward(model, bn) or applies_after_batchnorm(bn):
            found.append(p)
    return found


def _along(values: torch.Tensor, axis: int, dims: int) -> torch.Tensor:
    """A per-output-channel vector shaped to broadcast along `axis` of a `dims`-D weight."""
    shape = [1] * dims
    shape[axis] = -1
    return values.reshape(shape)


@torch.no_grad()
def fold_model(model: nn.Module, pairs: Iterable[PairPrediction]) -> nn.Module:
    """A copy of `model` with every pair's BN folded into its producer (module docstring)."""
    folded = copy.deepcopy(model).eval()
    for p in foldable(folded, pairs):
        producer, bn = _module(folded, p.producer), _module(folded, p.bn)
        axis = producer_out_axis(producer) or 0
        w = producer.weight.detach().double()
        n = w.shape[axis]
        gamma = bn.weight.detach().double() if bn.weight is not None else torch.ones(n, dtype=torch.float64)
        beta = bn.bias.detach().double() if bn.bias is not None else torch.zeros(n, dtype=torch.float64)
        b = producer.bias.detach().double() if producer.bias is not None else torch.zeros(n, dtype=torch.float64)
        s = gamma / torch.sqrt(bn.running_var.double() + bn.eps)
        producer.weight = nn.Parameter((w * _along(s, axis, w.dim())).to(producer.weight.dtype))
        producer.bias = nn.Parameter((beta + (b - bn.running_mean.double()) * s).to(producer.weight.dtype))
        if has_stock_forward(folded, bn):
            _set_submodule(folded, p.bn, nn.Identity())
        else:
            _neutralise(bn)
    return folded


def quantize_per_tensor(w: torch.Tensor, axis: int = 0) -> torch.Tensor:
    """Symmetric int8 fake-quantization with one scale max|W| / 127 (zero point 0, [-127, 127])."""
    peak = float(w.abs().max())
    return w if peak == 0 else torch.fake_quantize_per_tensor_affine(w, peak / 127, 0, -127, 127)


def quantize_per_channel(w: torch.Tensor, axis: int = 0) -> torch.Tensor:
    """Symmetric int8 fake-quantization with one scale max|W_c| / 127 per output channel
    (the weight's `axis`: 1 for a ConvTranspose)."""
    peaks = w.abs().transpose(0, axis).flatten(1).amax(1).float()
    scales = torch.where(peaks > 0, peaks / 127, torch.ones_like(peaks))
    zeros = torch.zeros(w.shape[axis], dtype=torch.int32)
    return torch.fake_quantize_per_channel_affine(w, scales, zeros, axis, -127, 127)


@torch.no_grad()
def quantized(
    folded: nn.Module, pairs: Iterable[PairPrediction], how: Callable[[torch.Tensor, int], torch.Tensor]
) -> nn.Module:
    """A copy of the folded model with each pair's producer weight quantized by `how`."""
    model = copy.deepcopy(folded)
    for p in pairs:
        producer = _module(model, p.producer)
        producer.weight.copy_(how(producer.weight, producer_out_axis(producer) or 0))
    return model


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_cast(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast(v, dtype) for k, v in value.items()}
    return value


class _Scores:
    """Correct predictions (labelled) or summed relative divergence per target."""

    def __init__(self) -> None:
        self.total: dict[str, float] = {}

    def add(self, target: str, out: torch.Tensor, reference: torch.Tensor, labels: Any) -> None:
        out = out.float().reshape(out.shape[0], -1)
        if labels is not None:
            value = float((out.argmax(1) == labels).sum())
        else:
            ref = reference.float().reshape(reference.shape[0], -1)
            value = float(((out - ref).norm(dim=1) / ref.norm(dim=1).clamp_min(1e-30)).sum())
        self.total[target] = self.total.get(target, 0.0) + value


_HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _score(
    stream: Iterable[Any],
    model: nn.Module,
    folded: nn.Module,
    models: dict[str, nn.Module | None],
    pairs: list[PairPrediction],
    labelled: bool,
    forward_fn: Callable[[Any, Any], Any] | None,
    notes: list[str],
) -> tuple[_Scores, int, set[str]]:
    """One pass over `stream`: every target and every pair quantized alone, per batch (the
    module docstring); the half-precision targets the CPU could not run."""
    scores, samples = _Scores(), 0
    unsupported: set[str] = set()
    with torch.no_grad():
        for batch in stream:
            labels = batch.labels if labelled else None
            reference = output_tensor(forward(model, batch.inputs, forward_fn))
            for target, m in models.items():
                if m is None or target in unsupported:
                    continue
                inputs = _cast(batch.inputs, _HALF[target]) if target in _HALF else batch.inputs
                try:
                    out = reference if m is model else output_tensor(forward(m, inputs, forward_fn))
                except (RuntimeError, NotImplementedError) as exc:
                    if target not in _HALF:
                        raise
                    notes.append(f"{target}: not measured, the CPU cannot run it ({str(exc).splitlines()[0]})")
                    unsupported.add(target)
                    continue
                scores.add(target, out, reference, labels)
            for p in pairs:
                producer = _module(folded, p.producer)
                kept = producer.weight.detach().clone()
                producer.weight.copy_(quantize_per_tensor(kept))
                scores.add(f"pair:{p.bn}", output_tensor(forward(folded, batch.inputs, forward_fn)), reference, labels)
                producer.weight.copy_(kept)
            samples += batch.size
    return scores, samples, unsupported


def _gathered(
    totals: dict[str, float], samples: int, unsupported: set[str], notes: list[str]
) -> tuple[dict[str, float], int, set[str], list[str]]:
    """Every rank's totals combined, in rank order (under torchrun each rank scored its share
    of whole batches); the values themselves in one process. Collective."""
    combined: dict[str, float] = {}
    count, missing, words = 0, set(), []
    for total, n, absent, said in gather_objects((totals, samples, unsupported, notes)):
        for k, v in total.items():
            combined[k] = combined.get(k, 0.0) + v
        count += n
        missing |= absent
        words += [w for w in said if w not in words]
    return combined, count, missing, words


def measure_fold(spec: ModelSpec | str, options: DataOptions, config: Config) -> FoldReport:
    """The prediction for the model's checkpoint (with the model's own eps) and the
    measurement on the data `options` describe (module docstring)."""
    options.validate()
    spec = as_model_spec(spec)
    forward_fn = load_forward(spec.forward)
    spec = resolve_model(spec, config)
    runnable = load_runnable(spec)
    if runnable.scripted:
        raise BnauditError(
            f"{spec.checkpoint}: a TorchScript module cannot be folded here: pass the state dict with --arch"
        )
    producers = graph_producers(runnable.module)
    report = predict_checkpoint(runnable.checkpoint, config, producers)
    if producers.by != "graph":
        report = dataclasses.replace(report, notes=(*report.notes, "the forward cannot be traced: paired by name"))
    model = runnable.module.eval()
    pairs = foldable(model, report.pairs)
    folded = fold_model(model, pairs)
    models: dict[str, nn.Module | None] = {
        "float32": model,
        "folded": folded,
        "int8_per_tensor": quantized(folded, pairs, quantize_per_tensor),
        "int8_per_channel": quantized(folded, pairs, quantize_per_channel),
        "fp16": copy.deepcopy(model).half(),
        "bf16": copy.deepcopy(model).to(torch.bfloat16),
    }
    notes: list[str] = []
    stream = make_loader(options)
    labelled = bool(stream.has_labels)
    with torchrun(torch.device("cpu")) as ranks, together():
        shard = stream.shard(ranks.rank, ranks.world)
        scores, samples, unsupported = _score(shard, model, folded, models, pairs, labelled, forward_fn, notes)
    totals, samples, unsupported, notes = _gathered(scores.total, samples, unsupported, notes)
    for target in unsupported:
        models[target] = None
    mean = {k: v / samples for k, v in totals.items()} if samples else {}
    results: dict[str, float | None] = {t: mean.get(t) if models[t] is not None else None for t in TARGETS}
    base = mean.get("folded", 0.0)
    drops = {
        p.bn: (base - mean[f"pair:{p.bn}"]) if labelled else (mean[f"pair:{p.bn}"] - base)
        for p in pairs
        if f"pair:{p.bn}" in mean
    }
    skipped = len(report.pairs) - len(pairs)
    if skipped:
        notes.append(f"{skipped} pairs are not a Conv/Linear module followed by a BatchNorm module: not folded")
    measurement = FoldMeasurement(labelled, samples, results, drops, tuple(notes))
    return dataclasses.replace(report, measured=measurement)

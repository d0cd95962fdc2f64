"""Fold predictions for an exported graph (ONNX): pairs from the graph, folded convs as they are.

Torch-free (the graph is the parsed `bnaudit.formats.onnx.OnnxModel`; nodes are read by
attribute). Two cases, per node:

  BN node kept      the BatchNormalization node's input X is the output of one Conv, Gemm or
                    MatMul node with a constant weight, and nothing else reads X: paired_by
                    "graph", predicted from the node's statistics and the conv's weight as
                    for a checkpoint (`bnaudit.audit.fold.check.predict_pair`). A BN node
                    fed by anything else (an Add, a Concat, a pooling, a graph input, a
                    conv output read twice) cannot be folded: listed as unpaired.
  conv folded       a Conv node with constant weight and bias whose BN the exporter folded
                    (the graph has no BatchNormalization node at all, or the weight is one
                    the legacy exporter's constant folding computed, `onnx::Conv_N`) and
                    that feeds no BN node: paired_by "folded", its weights W' and bias b'
                    audited directly (`predict_folded`, without the BN's numbers).

A Gemm's weight is (N, K) with transB=1 (torch's Linear) and (K, N) otherwise; its alpha and
beta scale weight and bias. A MatMul (torch's Linear without bias, exported) has a (K, N)
weight and no bias. A ConvTranspose's weight is (C_in, C_out / group, k...): with group 1 its
output channels are axis 1; a grouped one is not paired.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bnaudit.audit.fold.check import PairPrediction, channel_maxima, predict_folded, predict_pair
from bnaudit.audit.layers import BNLayer
from bnaudit.audit.producers import ProducerFilter
from bnaudit.config import Config
from bnaudit.formats.model import Checkpoint, TensorRef
from bnaudit.formats.onnx import OnnxModel, batchnorm_layer_name, constant
from bnaudit.normkinds import NormKind, onnx_op_kind

PRODUCER_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")


def _attribute(node: Any, name: str, default: float) -> float:
    for a in node.attribute:
        if a.name == name:
            return float(a.i) if a.type == 2 else float(a.f)  # AttributeProto.INT = 2
    return default


def _out_axis(node: Any) -> int:
    """The weight's axis of output channels: 1 for a (K, N) weight (MatMul, Gemm without
    transB) and a ConvTranspose's (C_in, C_out, k...), else 0."""
    if node.op_type in ("MatMul", "ConvTranspose"):
        return 1
    return 1 if node.op_type == "Gemm" and _attribute(node, "transB", 0) != 1 else 0


def _weight_maxima(node: Any, weight: TensorRef, out_axis: int) -> list[float]:
    """max_k |W_c,k| per output channel, with the weight's layout and Gemm's alpha."""
    alpha = abs(_attribute(node, "alpha", 1.0)) if node.op_type == "Gemm" else 1.0
    return [alpha * m for m in channel_maxima(weight, None, out_axis)]


def _out_channels(node: Any, weight: TensorRef, out_axis: int) -> int | None:
    """The number of output channels of the producer's weight; None for a layout not paired
    (a grouped ConvTranspose, a MatMul weight of other than two dimensions)."""
    if len(weight.shape) < 2:
        return None
    if node.op_type == "ConvTranspose" and _attribute(node, "group", 1) != 1:
        return None
    if node.op_type in ("MatMul", "Gemm") and out_axis == 1 and len(weight.shape) != 2:
        return None
    return weight.shape[out_axis]


def _weight(model: OnnxModel, node: Any, producer_of: dict[str, Any]) -> tuple[TensorRef | None, int]:
    """(the producer's constant weight, its axis of output channels). A MatMul's
    weight may come through a Transpose of a constant (torch's Linear without bias,
    exported without constant folding): the constant is then (N, K), outputs first."""
    name = node.input[1] if len(node.input) > 1 else ""
    weight = constant(model, name) if name else None
    if weight is not None or node.op_type != "MatMul":
        return weight, _out_axis(node)
    transpose = producer_of.get(name)
    if transpose is None or transpose.op_type != "Transpose" or not transpose.input:
        return None, 1
    perm = [a for a in transpose.attribute if a.name == "perm"]
    source = constant(model, transpose.input[0])
    if source is None or len(source.shape) != 2 or (perm and list(perm[0].ints) != [1, 0]):
        return None, 1
    return source, 0


def _bias(model: OnnxModel, node: Any, channels: int) -> list[float] | None:
    if node.op_type == "MatMul":
        return None  # a MatMul has no bias (one added after it is an Add node: not paired)
    ref = constant(model, node.input[2]) if len(node.input) > 2 and node.input[2] else None
    if ref is None or ref.shape != (channels,):
        return None
    beta = _attribute(node, "beta", 1.0) if node.op_type == "Gemm" else 1.0
    return [beta * v for v in ref.read()]


@dataclass(frozen=True)
class _GraphPair:
    """A BN node's producer: its node, the tensor it writes (the BN's X), constant weight and
    the weight's axis of output channels."""

    layer: BNLayer
    node: Any
    x: str
    weight: TensorRef
    out_axis: int


def _graph_producers(
    model: OnnxModel, layers: Sequence[BNLayer]
) -> tuple[list[_GraphPair], list[tuple[str, str]], set[str]]:
    """(the BN nodes paired with their producer, (BN layer, why) for the others, the names
    every BN node reads as input X): the pairing in the module docstring."""
    nodes = list(model.nodes())
    producer_of: dict[str, Any] = {}
    readers: dict[str, int] = {}
    for _, node in nodes:
        for out in node.output:
            producer_of[out] = node
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    by_name = {layer.name: layer for layer in layers}
    seen: set[str] = set()
    pairs: list[_GraphPair] = []
    unpaired: list[tuple[str, str]] = []
    bn_inputs: set[str] = set()
    for index, (_, node) in enumerate(nodes):
        if node.domain not in ("", "ai.onnx") or onnx_op_kind(node.op_type) is not NormKind.BATCH_NORM:
            continue
        if node.input:
            bn_inputs.add(node.input[0])
        name = batchnorm_layer_name(node, index)
        name = f"{name}#{index}" if name in seen else name
        layer = by_name.get(name)
        if layer is None:
            continue  # statistics that are not constants: inspect's BN013
        seen.add(name)
        x = node.input[0] if node.input else ""
        source = producer_of.get(x)
        if source is None or source.op_type not in PRODUCER_OPS:
            what = "a graph input" if source is None else f"a {source.op_type} node"
            unpaired.append((name, f"follows {what}: stays a standalone BatchNormalization"))
            continue
        if readers.get(x, 0) != 1:
            unpaired.append((name, f"its {source.op_type} node's output is read by other nodes too"))
            continue
        weight, out_axis = _weight(model, source, producer_of)
        if source.op_type == "ConvTranspose" and _attribute(source, "group", 1) != 1:
            unpaired.append((name, "follows a grouped ConvTranspose node: not audited"))
            continue
        if weight is None or _out_channels(source, weight, out_axis) != layer.num_features:
            unpaired.append((name, f"its {source.op_type} node has no constant weight of {layer.num_features} outputs"))
            continue
        pairs.append(_GraphPair(layer, source, x, weight, out_axis))
    return pairs, unpaired, bn_inputs


def _producer_name(pair: _GraphPair) -> str:
    return pair.node.name or f"{pair.node.op_type} node writing {pair.x}"


def graph_pairs(
    model: OnnxModel, layers: Sequence[BNLayer], config: Config
) -> tuple[list[PairPrediction], list[tuple[str, str]]]:
    """Predictions for the BN nodes paired through the graph and for the convs already
    folded; (BN layer, why) for every BN node that cannot be folded."""
    nodes = list(model.nodes())
    pairs, unpaired, bn_inputs = _graph_producers(model, layers)
    predictions: list[PairPrediction] = []
    for pair in pairs:
        maxima = _weight_maxima(pair.node, pair.weight, pair.out_axis)
        bias = _bias(model, pair.node, pair.layer.num_features)
        predictions.append(predict_pair(pair.layer, _producer_name(pair), maxima, bias, config, "graph"))
    any_bn = bool(bn_inputs) or bool(layers)
    for index, (_, node) in enumerate(nodes):
        if node.op_type != "Conv" or node.domain not in ("", "ai.onnx") or len(node.input) < 3 or not node.input[2]:
            continue
        if any(out in bn_inputs for out in node.output):
            continue
        weight = constant(model, node.input[1])
        channels = _out_channels(node, weight, 0) if weight is not None else None
        computed = node.input[1].startswith("onnx::")
        if weight is None or channels is None or (any_bn and not computed):
            continue
        bias = _bias(model, node, channels)
        if bias is None:
            continue
        conv = node.name or f"Conv_{index}"
        predictions.append(predict_folded(conv, conv, "folded", _weight_maxima(node, weight, 0), bias, None, config))
    return predictions, unpaired


def _program_producers(path: str, layers: Sequence[BNLayer]) -> tuple[list[tuple[BNLayer, Any]], list[tuple[str, str]]]:
    """(BN layer, its producer: bnaudit.formats.pt2.GraphProducer) for the BN layers of a
    torch.export archive (`.pt2`) paired through its program (`batchnorm_producers`), (BN
    layer, why) for the others."""
    from bnaudit.formats.pt2 import batchnorm_producers

    producers = batchnorm_producers(path)
    pairs: list[tuple[BNLayer, Any]] = []
    unpaired: list[tuple[str, str]] = []
    for layer in layers:
        found = producers.get(layer.name)
        if found is None or found.weight is None:
            unpaired.append((layer.name, found.why_not if found is not None else "no batch-norm node found for it"))
        elif len(found.weight.shape) < 2 or found.weight.shape[found.out_axis] != layer.num_features:
            unpaired.append((layer.name, f"its producer {found.name} has no weight of {layer.num_features} outputs"))
        else:
            pairs.append((layer, found))
    return pairs, unpaired


def program_pairs(
    path: str, layers: Sequence[BNLayer], config: Config
) -> tuple[list[PairPrediction], list[tuple[str, str]]]:
    """Predictions for the BN layers of a torch.export archive (`.pt2`) paired through its
    program: the node feeding each batch-norm node (`bnaudit.formats.pt2.batchnorm_producers`)."""
    pairs, unpaired = _program_producers(path, layers)
    predictions: list[PairPrediction] = []
    for layer, found in pairs:
        stored_bias = found.bias
        ok = stored_bias is not None and stored_bias.shape == (layer.num_features,)
        bias = stored_bias.read() if stored_bias is not None and ok else None
        maxima = channel_maxima(found.weight, None, found.out_axis)
        predictions.append(predict_pair(layer, found.name, maxima, bias, config, "graph"))
    return predictions, unpaired


def program_folded_pairs(path: str, config: Config) -> list[PairPrediction]:
    """Predictions for the convolutions of a folded torch.export program (no batch-norm node,
    `Checkpoint.folded`): every conv with a stored weight and bias, audited as it is (paired_by
    "folded", as an ONNX export's folded convs)."""
    from bnaudit.formats.pt2 import stored_convolutions

    predictions = []
    for conv in stored_convolutions(path):
        channels = conv.weight.shape[0]
        if conv.bias is None or conv.feeds_batchnorm or conv.bias.shape != (channels,):
            continue
        name = conv.weight_name.removesuffix(".weight")
        maxima = channel_maxima(conv.weight)
        predictions.append(predict_folded(name, name, "folded", maxima, conv.bias.read(), None, config))
    return predictions


def exported_producers(ckpt: Checkpoint, layers: Sequence[BNLayer]) -> dict[str, ProducerFilter]:
    """BN layer -> the stored weight of its producer, for an exported graph (ONNX with BN
    nodes kept, `.pt2`), by the same pairing as `graph_pairs` / `program_pairs`; empty for
    any other format (a state dict's producers are found by name: bnaudit.audit.producers)."""
    if ckpt.format == "onnx" and ckpt.graph is not None:
        pairs, _, _ = _graph_producers(ckpt.graph, layers)
        return {p.layer.name: ProducerFilter(_producer_name(p), p.weight, p.out_axis) for p in pairs}
    if ckpt.format == "pt2":
        found, _ = _program_producers(ckpt.path, layers)
        return {layer.name: ProducerFilter(g.name, g.weight, g.out_axis) for layer, g in found}
    return {}

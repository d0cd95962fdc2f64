"""Which layer feeds a BN layer, from the model's graph or state-dict naming conventions,
and which of its output channels are constant.

Torch-free. A BN layer's producer is the convolution or linear layer whose output it
normalises: the model's graph names it where the model is known (`--arch`:
runtime.models.bn_producers); otherwise a state dict's names are all there is, and
`producer_candidates` lists the names the producer may go by (the one home of these
conventions: BN004's constant-channel check and `bnaudit fold` both pair through it).

Exported graphs (ONNX with BatchNormalization nodes kept, torch.export `.pt2`) name the
producer in the graph: the node feeding the BN node, as `bnaudit fold` pairs them
(bnaudit.audit.fold.graph.exported_producers gives a `ProducerFilter` per BN layer). An ONNX
MatMul, or Gemm without transB, stores its weight (K, N), output channels last.

`producer_weight` (BN004) accepts a candidate only when its weight has at least 2
dimensions and one output channel per BN channel (shape[0] == C). An output channel whose
filter is all zero outputs its bias alone: a constant, so the BN channel's input always
equals its running_mean, its running variance is 0, and eval mode multiplies a zero deviation by whatever gain it has.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the rules import this module: `bnaudit rules` reads no tensors
    from bnaudit.formats.model import TensorRef

_PAIRED = re.compile(r"^(.*?)(bn)(\d*)$")
# timm's EfficientNet/MobileNetV3/MixNet stems and heads: conv_stem feeds bn1, conv_head bn2.
_TIMM_STEM_HEAD = {"bn1": "conv_stem", "bn2": "conv_head"}


def producer_candidates(bn: str) -> list[str]:
    """The module names that may hold the producer of BN `bn` (the layer whose output it
    normalises), in priority order, each once. With P = `bn`, parent.leaf its last name part:

      Sequential index    parent.i <- parent.(i-1) for i >= 1: torchvision
                          Conv2dNormActivation (`features.3.0`/`.1`), ResNet `downsample.0`/`.1`
      paired names        parent.<pre>bnK <- parent.<pre>convK (K digits or none, <pre> any
                          prefix): torchvision and timm ResNet `conv1`/`bn1`, the `conv`/`bn`
                          siblings of mmcv ConvModule and timm ConvNormAct. Not `normK` <-
                          `convK`: pre-activation blocks (torchvision DenseNet's denselayers,
                          timm ResNetV2) put normK before convK, and where the channel counts
                          happen to agree the pair would name the wrong conv
      stem and head       parent.bn1 <- parent.conv_stem, parent.bn2 <- parent.conv_head: timm
                          EfficientNet, MobileNetV3 (tried after conv1/conv2)
      transformers        parent.normalization <- parent.convolution: transformers ResNet,
                          RegNet, MobileNetV2 `*ConvLayer`

    Names only propose: each caller checks a candidate's weight (one output channel per BN
    channel)."""
    parent, _, leaf = bn.rpartition(".")
    base = f"{parent}." if parent else ""
    found: list[str] = []
    if leaf.isdigit() and int(leaf) > 0:
        found.append(f"{base}{int(leaf) - 1}")
    paired = _PAIRED.match(leaf)
    if paired:
        found.append(f"{base}{paired.group(1)}conv{paired.group(3)}")
    if leaf in _TIMM_STEM_HEAD:
        found.append(base + _TIMM_STEM_HEAD[leaf])
    if leaf == "normalization":
        found.append(f"{base}convolution")
    return list(dict.fromkeys(found))


def producer_weight(
    bn_name: str, channels: int, tensors: Mapping[str, TensorRef], known: str | None = None
) -> TensorRef | None:
    """The weight of the layer that feeds `bn_name`: `known` (the producing module from the
    model's graph) when given, else the first of `producer_candidates`; None when none fits
    (a floating weight of 2 or more dimensions with shape[0] == `channels`)."""
    names = [known] if known is not None else producer_candidates(bn_name)
    for name in names:
        ref = tensors.get(f"{name}.weight")
        if ref is not None and len(ref.shape) >= 2 and ref.shape[0] == channels and ref.is_floating:
            return ref
    return None


@dataclass(frozen=True)
class ProducerFilter:
    """The stored weight of the node feeding a BN layer in an exported graph: output channels
    first (Conv, Linear, Gemm with transB), or last (`out_last`: (K, N), ONNX MatMul and Gemm
    without transB)."""

    name: str
    weight: TensorRef
    out_last: bool = False


class LazyProducers(Mapping[str, ProducerFilter]):
    """BN layer -> ProducerFilter, computed by `load` on first lookup: BN004 asks only when a
    channel would otherwise be called live, so most files never pair their graph."""

    def __init__(self, load: Callable[[], Mapping[str, ProducerFilter]]) -> None:
        self._load = load
        self._found: Mapping[str, ProducerFilter] | None = None

    def _mapping(self) -> Mapping[str, ProducerFilter]:
        if self._found is None:
            self._found = self._load()
        return self._found

    def __getitem__(self, key: str) -> ProducerFilter:
        return self._mapping()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._mapping())

    def __len__(self) -> int:
        return len(self._mapping())


def zero_filter_channels(weight: TensorRef, channels: Iterable[int], out_last: bool = False) -> set[int]:
    """The output channels among `channels` whose filter (weight[c], every input and tap; with
    `out_last`, the column weight[:, c] of a (K, N) weight) is all zero."""
    wanted = sorted(set(channels))
    if not wanted:
        return set()
    values = weight.read()
    if out_last:
        k, n = weight.shape
        return {c for c in wanted if 0 <= c < n and not any(values[i * n + c] for i in range(k))}
    per_channel = math.prod(weight.shape[1:])
    return {c for c in wanted if 0 <= c < weight.shape[0] and not any(values[c * per_channel : (c + 1) * per_channel])}

"""Which layer feeds a BN layer, from the model's graph or state-dict naming conventions,
and which of its output channels are constant.

Torch-free. A BN layer's producer is the convolution or linear layer whose output it
normalises: the model's graph names it where the model is known (`--arch`:
runtime.models.bn_producers); otherwise its weight is found by the conventions that
torchvision, timm and mmcv name their modules by (first match wins):

  Sequential    `features.4` is fed by `features.3` (also `downsample.1` by `downsample.0`)
  paired names  `bn1` by `conv1`, `bn` by `conv`, `norm2` by `conv2` in the same parent

A candidate counts only when its weight has at least 2 dimensions and one output channel
per BN channel (shape[0] == C). An output channel whose filter is all zero outputs its bias
alone: a constant, so the BN channel's input always equals its running_mean, its running
variance is 0, and eval mode multiplies a zero deviation by whatever gain it has.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping

from bnaudit.formats.model import TensorRef

_PAIRED = re.compile(r"^(.*?)(bn|norm)(\d*)$")


def producer_weight(
    bn_name: str, channels: int, tensors: Mapping[str, TensorRef], known: str | None = None
) -> TensorRef | None:
    """The weight of the layer that feeds `bn_name`: `known` (the producing module from the
    model's graph) when given, else by the conventions above; None when none fits."""
    parent, _, leaf = bn_name.rpartition(".")
    base = f"{parent}." if parent else ""
    candidates = [f"{known}.weight"] if known is not None else []
    if known is None and leaf.isdigit() and int(leaf) > 0:
        candidates.append(f"{base}{int(leaf) - 1}.weight")
    paired = _PAIRED.match(leaf) if known is None else None
    if paired:
        candidates.append(f"{base}{paired.group(1)}conv{paired.group(3)}.weight")
    for name in candidates:
        ref = tensors.get(name)
        if ref is not None and len(ref.shape) >= 2 and ref.shape[0] == channels and ref.is_floating:
            return ref
    return None


def zero_filter_channels(weight: TensorRef, channels: Iterable[int]) -> set[int]:
    """The output channels among `channels` whose filter (weight[c], every input and tap)
    is all zero."""
    wanted = sorted(set(channels))
    if not wanted:
        return set()
    values = weight.read()
    per_channel = math.prod(weight.shape[1:])
    return {c for c in wanted if 0 <= c < weight.shape[0] and not any(values[c * per_channel : (c + 1) * per_channel])}

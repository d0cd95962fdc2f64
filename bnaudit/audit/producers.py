"""Which layer feeds a BN layer: THE producer finder's policy, and which of a producer's
output channels are constant.

Torch-free. A BN layer's producer is the convolution or linear layer whose output it
normalises. Every command that needs one (BN004's constant channels, `bnaudit fold`'s pairs,
`bnaudit diff`'s pairing of a checkpoint with its folded export) asks this module, and gets
a `Producers`:

  from a graph  where the model is known (`--arch`): the torch side traces its forward
                (bnaudit.runtime.models.graph_producers) and hands each BN call over as a
                `BNCall`; `producers_from_calls` applies the one policy. A BN fed by a
                Conv/Linear module is *fed* by it; it cannot be folded into it when the
                producer's output is read by other nodes too (folding would change what they
                read), when the BN is called more than once (which call would the fold
                serve?), or when something else feeds it (an add, a concat, a pooling: the
                BN stays a standalone op, which some backends refuse).
  from names    a state dict's names are all there is (`producers_from_names`): the first of
                `producer_candidates` whose weight fits, else the module stored right before
                the BN (modules register their parameters in definition order, a conv before
                its BN) when its weight fits; never a module that is itself a BN. A weight
                fits when it is floating, has two or more dimensions and one output channel
                per BN channel (shape[0] == C).

Exported graphs (ONNX with BatchNormalization nodes kept, torch.export `.pt2`) name the
producer in their own graph: the node feeding the BN node, as `bnaudit fold` pairs them
(bnaudit.audit.fold.graph.exported_producers gives a `ProducerFilter` per BN layer). An ONNX
MatMul, or Gemm without transB, stores its weight (K, N), output channels last.

An output channel whose filter is all zero outputs its bias alone: a constant, so the BN
channel's input always equals its running_mean, its running variance is 0, and eval mode
multiplies a zero deviation by whatever gain it has (BN004 calls such a channel constant).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

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


def weight_fits(ref: TensorRef | None, channels: int) -> bool:
    """A producer's weight for a BN of `channels` channels: floating, two or more dimensions,
    one output channel per BN channel (shape[0] == channels)."""
    return ref is not None and ref.is_floating and len(ref.shape) >= 2 and ref.shape[0] == channels


# Why a BN layer has no producer, where the names are all there is.
NO_PRODUCER_BY_NAME = "no Conv or Linear producer found by name: not folded, not audited"


@dataclass(frozen=True)
class BNCall:
    """One call of a BN module in a traced forward (the torch side builds these; the policy
    that judges them is `producers_from_calls`).

    bn       the BN module's name
    source   the Conv/Linear module whose output is the BN's input, None when something
             else is (see `follows`)
    follows  what feeds the BN when `source` is None ("add", "cat", "an input"), in words
    shared   the source's output is read by other nodes too
    """

    bn: str
    source: str | None
    follows: str = ""
    shared: bool = False


@dataclass(frozen=True)
class Producers:
    """Which layer feeds each BN layer (module docstring).

    feeds     BN layer -> the module whose output it normalises
    unpaired  BN layer -> why it has no producer to fold into (a BN in `feeds` may be here
              too: a producer whose output other nodes read feeds it, but cannot take it)
    by        "graph" (a traced forward) or "name" (a state dict's names)
    """

    feeds: Mapping[str, str]
    unpaired: Mapping[str, str]
    by: str

    @property
    def foldable(self) -> dict[str, str]:
        """BN layer -> the producer it can be folded into."""
        return {bn: producer for bn, producer in self.feeds.items() if bn not in self.unpaired}


def producers_from_calls(calls: Iterable[BNCall]) -> Producers:
    """The producers of a traced forward's BN calls, under the one policy (module docstring)."""
    feeds: dict[str, str] = {}
    unpaired: dict[str, str] = {}
    seen: set[str] = set()
    for call in calls:
        if call.bn in seen:
            feeds.pop(call.bn, None)
            unpaired[call.bn] = "called more than once in the forward"
            continue
        seen.add(call.bn)
        if call.source is None:
            unpaired[call.bn] = f"follows {call.follows or 'an input'}: stays a standalone BatchNorm"
            continue
        feeds[call.bn] = call.source
        if call.shared:
            unpaired[call.bn] = f"its producer {call.source}'s output is read by other nodes too"
    return Producers(feeds, unpaired, "graph")


def producers_from_names(tensors: Mapping[str, TensorRef], channels: Mapping[str, int]) -> Producers:
    """The producers a state dict's names give its BN layers (`channels`: BN layer -> its
    channel count), as the module docstring says: the first of `producer_candidates` whose
    weight fits, else the module stored right before the BN."""
    order = _modules_in_order(tensors)
    position = {name: i for i, name in enumerate(order)}
    feeds: dict[str, str] = {}
    unpaired: dict[str, str] = {}
    for bn, count in channels.items():

        def fits(name: str | None, count: int = count) -> bool:
            return name is not None and name not in channels and weight_fits(tensors.get(f"{name}.weight"), count)

        found = next((name for name in producer_candidates(bn) if fits(name)), None)
        if found is None and bn in position:
            before = [name for name in order[: position[bn]] if f"{name}.weight" in tensors]
            found = before[-1] if before and fits(before[-1]) else None
        if found is None:
            unpaired[bn] = NO_PRODUCER_BY_NAME
        else:
            feeds[bn] = found
    return Producers(feeds, unpaired, "name")


def _modules_in_order(tensors: Mapping[str, TensorRef]) -> list[str]:
    """The module names of a state dict's keys (`a.b.weight` -> `a.b`), each once, in the
    order their first tensor is stored."""
    return list(dict.fromkeys(key.rpartition(".")[0] for key in tensors))


@dataclass(frozen=True)
class ProducerFilter:
    """The stored weight of the node feeding a BN layer in an exported graph: output channels
    first (Conv, Linear, Gemm with transB), or last (`out_last`: (K, N), ONNX MatMul and Gemm
    without transB)."""

    name: str
    weight: TensorRef
    out_last: bool = False


V = TypeVar("V")


class LazyProducers(Mapping[str, V]):
    """BN layer -> its producer (a name, a ProducerFilter), computed by `load` on first
    lookup: BN004 asks only when a channel would otherwise be called live, so most files
    never pair their layers."""

    def __init__(self, load: Callable[[], Mapping[str, V]]) -> None:
        self._load = load
        self._found: Mapping[str, V] | None = None

    def _mapping(self) -> Mapping[str, V]:
        if self._found is None:
            self._found = self._load()
        return self._found

    def __getitem__(self, key: str) -> V:
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

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
  from names    a state dict's names are all there is (`producers_from_names`), tried in
                this order, never a module that is itself a BN:
                1. a block layout recognised by its sibling keys (`timm_block_producers`):
                   timm's EfficientNet/MobileNet blocks name their convs by role, and the
                   same `bn1` follows another conv in each block type
                2. the first of `producer_candidates` whose weight fits
                3. the module stored right before the BN (modules register their parameters
                   in definition order, a conv before its BN), only where that is
                   unambiguous: the file keeps definition order (a file whose keys are all
                   sorted, as safetensors writes them, says nothing by adjacency), the
                   module's weight fits and no other BN is paired with it
                A weight fits when it is floating, has two or more dimensions and one output
                channel per BN channel (shape[0] == C).
  ConvTranspose a transposed convolution stores its weight (C_in, C_out / groups, k...): its
                output channels are axis 1 (`Producers.transposed`; folding scales, BN004's
                zero filters and the int8 scale read that axis). Only a graph tells it (the
                module's type under --arch, an ONNX ConvTranspose node, a .pt2 transposed
                convolution): names cannot tell a (C, C, k, k) ConvTranspose from a Conv, and a
                state dict pairs no weight whose first dimension is not C.

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
# timm's space-to-depth stem of a block: conv_s2d feeds bn_s2d.
_TIMM_S2D = {"bn_s2d": "conv_s2d"}


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
    if leaf in _TIMM_S2D:
        found.append(base + _TIMM_S2D[leaf])
    if leaf == "normalization":
        found.append(f"{base}convolution")
    return list(dict.fromkeys(found))


def weight_fits(ref: TensorRef | None, channels: int, out_axis: int = 0) -> bool:
    """A producer's weight for a BN of `channels` channels: floating, two or more dimensions,
    one output channel per BN channel (shape[out_axis] == channels: axis 0 for a Conv or
    Linear, 1 for a ConvTranspose)."""
    return ref is not None and ref.is_floating and len(ref.shape) >= 2 and ref.shape[out_axis] == channels


# Why a BN layer has no producer, where the names are all there is.
NO_PRODUCER_BY_NAME = "no Conv or Linear producer found by name: not folded, not audited"

# timm's EfficientNet / MobileNet / MixNet blocks (timm/models/_efficientnet_blocks.py), by the
# convs a block holds: which conv feeds which BN. The same `bn1` follows conv_pw in an
# InvertedResidual but conv_dw in a DepthwiseSeparableConv, where both convs may have as
# many output channels: only the block type tells them apart.
#   InvertedResidual (and CondConvResidual)  conv_pw -> bn1, conv_dw -> bn2, conv_pwl -> bn3
#   DepthwiseSeparableConv                   conv_dw -> bn1, conv_pw -> bn2
#   EdgeResidual                             conv_exp -> bn1, conv_pwl -> bn2
#   ConvBnAct                                conv -> bn1
# A layout is taken only when its depthwise conv is one: a weight (C, 1, k, k).
TIMM_BLOCKS: tuple[tuple[str, frozenset[str], dict[str, str]], ...] = (
    (
        "InvertedResidual",
        frozenset({"conv_pw", "conv_dw", "conv_pwl"}),
        {"bn1": "conv_pw", "bn2": "conv_dw", "bn3": "conv_pwl"},
    ),
    ("DepthwiseSeparableConv", frozenset({"conv_dw", "conv_pw"}), {"bn1": "conv_dw", "bn2": "conv_pw"}),
    ("EdgeResidual", frozenset({"conv_exp", "conv_pwl"}), {"bn1": "conv_exp", "bn2": "conv_pwl"}),
    ("ConvBnAct", frozenset({"conv"}), {"bn1": "conv"}),
)
_BLOCK_CONVS = frozenset().union(*(convs for _, convs, _ in TIMM_BLOCKS))
# timm's CondConv blocks keep a bank of expert kernels, (num_experts, C_out * C_in * k * k), mixed
# per sample by `routing_fn`: there is no one weight to fold a BN into.
_CONDCONV_ROUTING = "routing_fn"
CONDCONV = "a CondConv block: its conv holds a bank of expert kernels mixed per sample, no one weight to fold into"


@dataclass(frozen=True)
class BNCall:
    """One call of a BN module in a traced forward (the torch side builds these; the policy
    that judges them is `producers_from_calls`).

    bn       the BN module's name
    source      the Conv/Linear module whose output is the BN's input, None when something
                else is (see `follows`)
    follows     what feeds the BN when `source` is None ("add", "cat", "an input"), in words
    shared      the source's output is read by other nodes too
    transposed  the source is a ConvTranspose (output channels on its weight's axis 1)
    """

    bn: str
    source: str | None
    follows: str = ""
    shared: bool = False
    transposed: bool = False


@dataclass(frozen=True)
class Producers:
    """Which layer feeds each BN layer (module docstring).

    feeds       BN layer -> the module whose output it normalises
    unpaired    BN layer -> why it has no producer to fold into (a BN in `feeds` may be here
                too: a producer whose output other nodes read feeds it, but cannot take it)
    by          "graph" (a traced forward) or "name" (a state dict's names)
    transposed  the producers whose weight holds the output channels on axis 1 (ConvTranspose)
    """

    feeds: Mapping[str, str]
    unpaired: Mapping[str, str]
    by: str
    transposed: frozenset[str] = frozenset()

    def out_axis(self, producer: str) -> int:
        """The axis of `producer`'s weight that holds its output channels: 1 for a
        ConvTranspose, else 0."""
        return 1 if producer in self.transposed else 0

    @property
    def foldable(self) -> dict[str, str]:
        """BN layer -> the producer it can be folded into."""
        return {bn: producer for bn, producer in self.feeds.items() if bn not in self.unpaired}


def producers_from_calls(calls: Iterable[BNCall]) -> Producers:
    """The producers of a traced forward's BN calls, under the one policy (module docstring)."""
    feeds: dict[str, str] = {}
    unpaired: dict[str, str] = {}
    transposed: set[str] = set()
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
        if call.transposed:
            transposed.add(call.source)
        if call.shared:
            unpaired[call.bn] = f"its producer {call.source}'s output is read by other nodes too"
    return Producers(feeds, unpaired, "graph", frozenset(transposed))


def producers_from_names(tensors: Mapping[str, TensorRef], channels: Mapping[str, int]) -> Producers:
    """The producers a state dict's names give its BN layers (`channels`: BN layer -> its
    channel count), as the module docstring says: a recognised block layout, else the first
    of `producer_candidates` whose weight fits, else the module stored right before the BN
    where that is unambiguous."""

    def fits(name: str | None, count: int) -> bool:
        return name is not None and name not in channels and weight_fits(tensors.get(f"{name}.weight"), count)

    blocks, block_unpaired = timm_block_producers(tensors, channels)
    feeds: dict[str, str] = {}
    unpaired: dict[str, str] = dict(block_unpaired)
    for bn, count in channels.items():
        if bn in unpaired:
            continue
        found = blocks.get(bn)
        if found is None:
            found = next((name for name in producer_candidates(bn) if fits(name, count)), None)
        if found is not None:
            feeds[bn] = found
    # adjacency last, and only where it is unambiguous (module docstring)
    order = _modules_in_order(tensors)
    definition_order = order != sorted(order)
    position = {name: i for i, name in enumerate(order)}
    claimed = set(feeds.values())
    for bn, count in channels.items():
        if bn in feeds or bn in unpaired:
            continue
        found = None
        if definition_order and bn in position:
            before = next((name for name in reversed(order[: position[bn]]) if f"{name}.weight" in tensors), None)
            found = before if before not in claimed and fits(before, count) else None
        if found is None:
            unpaired[bn] = NO_PRODUCER_BY_NAME
        else:
            feeds[bn] = found
            claimed.add(found)
    return Producers({bn: feeds[bn] for bn in channels if bn in feeds}, unpaired, "name")


def _is_depthwise(ref: TensorRef | None, channels: int) -> bool:
    """A depthwise conv's weight for `channels` channels: (C, 1, k, k) (one input per filter)."""
    return ref is not None and len(ref.shape) == 4 and ref.shape[0] == channels and ref.shape[1] == 1


def timm_block_producers(
    tensors: Mapping[str, TensorRef], channels: Mapping[str, int]
) -> tuple[dict[str, str], dict[str, str]]:
    """(BN layer -> its conv, BN layer -> why it has none) for the BN layers of the timm blocks
    (`TIMM_BLOCKS`) a state dict holds, recognised by the convs beside the BN layers: the
    block type whose convs are all there and no other role's (an InvertedResidual has a
    conv_pwl, a DepthwiseSeparableConv none); its depthwise conv (conv_dw, where the block
    has one) must be (C, 1, k, k) for the BN it feeds, and every pair's weight must fit.
    A block whose conv holds expert kernels (CondConv: a `routing_fn` beside them) pairs
    none of its BN layers."""
    parents: dict[str, set[str]] = {}
    for key in tensors:
        module, _, leaf = key.rpartition(".")
        if leaf == "weight":
            parent, _, name = module.rpartition(".")
            if name in _BLOCK_CONVS or name == _CONDCONV_ROUTING:
                parents.setdefault(parent, set()).add(name)
    feeds: dict[str, str] = {}
    unpaired: dict[str, str] = {}
    for parent, convs in parents.items():
        base = f"{parent}." if parent else ""
        roles = convs - {_CONDCONV_ROUTING}
        layout = next((pairs for _, need, pairs in TIMM_BLOCKS if roles == need), None)
        if layout is None:
            continue
        bns = {base + bn: base + conv for bn, conv in layout.items() if base + bn in channels}
        if not bns:
            continue
        if _CONDCONV_ROUTING in convs:
            unpaired.update(dict.fromkeys(bns, CONDCONV))
            continue
        dw = next((bn for bn, conv in bns.items() if conv.endswith(".conv_dw") or conv == "conv_dw"), None)
        if dw is not None and not _is_depthwise(tensors.get(bns[dw] + ".weight"), channels[dw]):
            continue  # named like a timm block, shaped otherwise: the other rules decide
        if all(weight_fits(tensors.get(conv + ".weight"), channels[bn]) for bn, conv in bns.items()):
            feeds.update(bns)
    return feeds, unpaired


def _modules_in_order(tensors: Mapping[str, TensorRef]) -> list[str]:
    """The module names of a state dict's keys (`a.b.weight` -> `a.b`), each once, in the
    order their first tensor is stored."""
    return list(dict.fromkeys(key.rpartition(".")[0] for key in tensors))


@dataclass(frozen=True)
class ProducerFilter:
    """The stored weight of the node feeding a BN layer in an exported graph, and the axis
    holding its output channels: 0 (Conv, Linear, Gemm with transB) or 1 (`out_axis` 1: an
    ONNX MatMul's or transB-less Gemm's (K, N), a ConvTranspose's (C_in, C_out, k...))."""

    name: str
    weight: TensorRef
    out_axis: int = 0


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


def zero_filter_channels(weight: TensorRef, channels: Iterable[int], out_axis: int = 0) -> set[int]:
    """The output channels among `channels` whose filter (weight[c], every input and tap; with
    `out_axis` 1, weight[:, c], of a (K, N) or (C_in, C_out, k...) weight) is all zero."""
    wanted = sorted(set(channels))
    if not wanted:
        return set()
    values = weight.read()
    if out_axis == 1:
        k, n = weight.shape[0], weight.shape[1]
        taps = math.prod(weight.shape[2:])
        return {
            c
            for c in wanted
            if 0 <= c < n and not any(any(values[(i * n + c) * taps : (i * n + c + 1) * taps]) for i in range(k))
        }
    per_channel = math.prod(weight.shape[1:])
    return {c for c in wanted if 0 <= c < weight.shape[0] and not any(values[c * per_channel : (c + 1) * per_channel])}

"""A checkpoint against its export: the part of `bnaudit diff` that knows about ONNX and .pt2.

Torch- and numpy-free, like the rest of audit/: the export's tensors come from
`bnaudit.formats.onnx` (`read_onnx` for the BatchNormalization nodes, `load_onnx` for the
Conv/Gemm nodes that folding left), the checkpoint's from any reader.

Three things are checked (the rules BN108-BN114 of the registry judge the records here),
after pairing (`bnaudit.audit.export.pairing`, the one home of which node is which layer):

  kept nodes     every BatchNormalization node matched to a checkpoint layer (by name:
                 exporters keep `layer1.0.bn1.running_mean` as initializer names; then by
                 exporter scope (`/layer1/layer1.0/bn1/...` node names); then by order and
                 channel count among the layers left): its tensors against the checkpoint's
                 beyond float32 rounding, its epsilon against the checkpoint's eps, its
                 momentum against the converted one, its training_mode.
  folded layers  every checkpoint BN layer without a node: the conv that feeds it (the
                 model graph with --arch, else the checkpoint's key order: the last weight
                 with C output channels before the layer), that conv's node in the export
                 (initializer name, exporter scope, else order among convs of that shape),
                 and the folding itself (bnaudit.audit.export.folded).
  unpaired       layers and export convs that could not be paired, and why.

A torch.export program (.pt2) keeps BN as a node, or as arithmetic on buffers that keep the
module's names (formats/pt2.py), so such a layer is a kept node matched by name; a program
folded before export (`torch.fx.experimental.optimization.fuse`) has convs whose stored
weights are named after the checkpoint's (`program_conv_nodes`), verified as an ONNX
export's folded convs. Its momentum is
PyTorch's own (no ONNX convention to check), and an eps the program does not show (arithmetic
of a shape formats/pt2.py does not recognise) is not compared.

"Equal beyond float32 rounding": both values rounded to float32 are the same float32 (NaN
equals NaN), so a float64 checkpoint exported in float32 is equal, a float16 export is not.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from bnaudit.audit.export.folded import FoldCheck, float32, fold_layer
from bnaudit.audit.export.pairing import ConvNode, conv_nodes, pair_convs
from bnaudit.audit.formulas import retained_fraction
from bnaudit.audit.layers import BNLayer
from bnaudit.audit.producers import producers_from_names
from bnaudit.audit.settings import Setting, Settings
from bnaudit.formats.model import Checkpoint, TensorRef
from bnaudit.text import listing


@dataclass(frozen=True)
class TensorMismatch:
    """One tensor of a kept node that differs from the checkpoint's beyond float32 rounding.

    channels   how many channels differ
    max_abs    max_c |export_c - checkpoint_c|
    max_rel    max_c |export_c - checkpoint_c| / max(|checkpoint_c|, 1e-30)
    rounding   the export's values are the checkpoint's rounded to the export's dtype
               (float16 statistics): precision lost, not other values
    initial    the export holds the initial value in every channel (mean/bias 0, var/weight 1)
    """

    tensor: str
    export_dtype: str
    channels: int
    max_abs: float
    max_rel: float
    rounding: bool
    initial: bool


@dataclass(frozen=True)
class KeptNode:
    """A BatchNormalization node of the export matched to a checkpoint BN layer.

    checkpoint: the checkpoint layer's eps and momentum with their provenance
    (bnaudit.audit.settings: its module's, given, or PyTorch's defaults assumed), which
    `eps_checkpoint` / `momentum_checkpoint` read. momentum_onnx is the node's own
    attribute (ONNX convention: the retained fraction, 1 - PyTorch momentum: formulas.retained_fraction)."""

    name: str
    node: str
    source: str
    matched_by: str
    eps_export: float
    momentum_onnx: float | None
    checkpoint: Settings
    training_mode: bool
    mismatches: tuple[TensorMismatch, ...]
    training_reason: str = ""  # what in the node says training ("training_mode=1", "is_test absent")
    eps_known: bool = True  # the export shows its eps (a decomposed .pt2 training program may not)
    output: str | None = None  # the value the node writes, where a runtime reads it (main graph only)

    @property
    def eps_checkpoint(self) -> float:
        return self.checkpoint.eps_value

    @property
    def momentum_checkpoint(self) -> float | None:
        return self.checkpoint.momentum.value

    @property
    def settings_assumed(self) -> bool:
        """The checkpoint's eps or momentum not read from its file (given or assumed)."""
        return not self.checkpoint.from_file

    @property
    def eps_differs(self) -> bool:
        """The node's epsilon is not the checkpoint's eps, both as float32 (the attribute's type)."""
        return self.eps_known and float32(self.eps_export) != float32(self.eps_checkpoint)


@dataclass(frozen=True)
class FoldedLayer:
    """A checkpoint BN layer folded into an export conv (numbers: bnaudit.audit.export.folded)."""

    name: str
    conv: str  # the checkpoint conv (module name)
    node: str  # the export node
    pairing: str  # how the conv was found, and how its node
    eps_setting: Setting  # the checkpoint's eps it was checked against, with its provenance
    check: FoldCheck
    # where the checkpoint's eps is only assumed and the folding does not match it: the
    # implied eps when folding at that eps matches exactly (the export is right, the
    # assumption is not), else None
    fits_eps: float | None = None
    output: str | None = None  # the value the conv node writes (the BN's output, folded), main graph only

    @property
    def eps(self) -> float:
        value = self.eps_setting.value
        return float(value) if value is not None else math.nan


@dataclass(frozen=True)
class Unpaired:
    name: str  # a checkpoint layer, or an export node ("node X")
    reason: str


@dataclass(frozen=True)
class ParityResult:
    """Outputs of the checkpoint (torch, eval mode) and the export (onnxruntime, CPU) on the
    same samples.

    relative deviation of a sample  max_k |y_onnx,k - y_torch,k| / max_k |y_torch,k|
    floor                           FLOOR_FACTOR x the largest relative deviation of the
                                    float32 torch outputs from a float64 re-run of the same
                                    model (what float32 rounding alone gives), rounded up
                                    to a power of ten (the same on every CPU), at least 1e-6
    agreement                       share of samples whose argmax is the same
    """

    samples: int
    batches: int
    agreement: float
    max_deviation: float
    floor: float
    batch_size: int | None  # the export's fixed batch size, None when dynamic
    padded: int  # samples added (copies of a batch's last one) to fill fixed-size batches

    @property
    def deviates(self) -> bool:
        return not self.max_deviation <= self.floor


@dataclass
class ExportCheck:
    """What `diff` found comparing a checkpoint with its export (ONNX model or .pt2 program)."""

    export_side: str  # "a" or "b"
    producer: str
    opset: int | None
    matching: str  # how kept nodes were matched: "names", "order and shape", ... or "" (none kept)
    pairing: str  # how convs were paired with folded layers
    nodes: list[KeptNode] = field(default_factory=list)
    folded: list[FoldedLayer] = field(default_factory=list)
    unpaired: list[Unpaired] = field(default_factory=list)
    unauditable: list[str] = field(default_factory=list)
    unauditable_layers: dict[str, str] = field(default_factory=dict)  # note -> its layer, where known
    parity: ParityResult | None = None
    kind: str = "an ONNX export"  # the export in words: "an ONNX export", "a torch.export program"

    @property
    def node_word(self) -> str:
        """What the export's BN nodes are called: ONNX's op type, or torch.export's batch-norm ops."""
        return "BatchNormalization node" if self.kind == "an ONNX export" else "batch-norm node"

    def explanation(self) -> str:
        """Whether the BatchNormalization nodes (or the folding) explain an output deviation."""
        causes = self.causes()
        if causes:
            return causes[0]
        return "the BatchNormalization nodes and the folding match the checkpoint: the deviation comes from other operators"

    def causes(self) -> list[str]:
        """What in the export's BN arithmetic differs from the checkpoint, weightiest first."""
        training = [n.name for n in self.nodes if n.training_mode]
        # an assumed eps says nothing about the export: only a known or given one can be its cause
        eps = [n.name for n in self.nodes if n.eps_differs and not n.checkpoint.eps.assumed]
        stats = [n.name for n in self.nodes if n.mismatches]
        folded = [f.name for f in self.folded if not f.check.matches and f.fits_eps is None]
        causes = []
        if training:
            causes.append(
                f"{len(training)} {self.node_word}(s) run in training mode ({listing(training)}): "
                f"{'onnxruntime' if self.kind == 'an ONNX export' else 'the program'} normalises with each "
                "batch's own statistics"
            )
        if eps:
            causes.append(f"{self.node_word}s with another eps: {listing(eps)}")
        if stats:
            causes.append(f"{self.node_word}s whose tensors differ from the checkpoint's: {listing(stats)}")
        if folded:
            causes.append(f"layers folded with other statistics or eps: {listing(folded)}")
        return causes


# ----------------------------------------------------------------------------- tensors


def _rows(values: list[float], shape: tuple[int, ...], out_last: bool) -> list[list[float]]:
    """Per-output-channel rows of a weight: (O, ...) row-major, or (I, O) when `out_last`."""
    if out_last:
        out = shape[-1]
        return [values[c::out] for c in range(out)]
    out = shape[0]
    size = len(values) // out if out else 0
    return [values[c * size : (c + 1) * size] for c in range(out)]


def _f32_equal(a: float, b: float) -> bool:
    x, y = float32(a), float32(b)
    return x == y or (math.isnan(x) and math.isnan(y))


def _round_to(value: float, dtype: str) -> float:
    import struct

    if dtype == "float16":
        try:
            return float(struct.unpack("<e", struct.pack("<e", value))[0])
        except OverflowError:
            return math.copysign(math.inf, value)
    if dtype == "bfloat16":
        bits = struct.unpack("<I", struct.pack("<f", float32(value)))[0]
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000  # round half to even
        return float(struct.unpack("<f", struct.pack("<I", bits))[0])
    return float32(value)


def compare_tensor(
    tensor: str, checkpoint: list[float] | None, export: list[float] | None, export_dtype: str
) -> TensorMismatch | None:
    """None when equal beyond float32 rounding (both absent counts as equal; an absent
    affine parameter counts as its initial value, as ONNX requires scale and B)."""
    initial = 1.0 if tensor in ("weight", "running_var") else 0.0
    if checkpoint is None and export is None:
        return None
    n = len(export if export is not None else checkpoint or [])
    a = checkpoint if checkpoint is not None else [initial] * n
    b = export if export is not None else [initial] * n
    if len(a) != len(b):
        return TensorMismatch(tensor, export_dtype, max(len(a), len(b)), math.inf, math.inf, False, False)
    differ = [c for c in range(len(a)) if not _f32_equal(a[c], b[c])]
    if not differ:
        return None
    max_abs = max(abs(b[c] - a[c]) for c in differ)
    max_rel = max(abs(b[c] - a[c]) / max(abs(a[c]), 1e-30) for c in differ)
    rounding = all(_f32_equal(_round_to(a[c], export_dtype), b[c]) for c in range(len(a)))
    return TensorMismatch(
        tensor, export_dtype, len(differ), max_abs, max_rel, rounding, bool(b) and all(v == initial for v in b)
    )


# ----------------------------------------------------------------------------- kept nodes


def kept_node(ref: BNLayer, node: BNLayer, info: Any, matched_by: str) -> KeptNode:
    """Compare one matched BatchNormalization node with its checkpoint layer."""
    mismatches = []
    for tensor, a, b in (
        ("weight", ref.weight, node.weight),
        ("bias", ref.bias, node.bias),
        ("running_mean", ref.running_mean, node.running_mean),
        ("running_var", ref.running_var, node.running_var),
    ):
        found = compare_tensor(tensor, a, b, node.stats_dtype)
        if found is not None:
            mismatches.append(found)
    momentum = getattr(info, "momentum", None)
    return KeptNode(
        name=ref.name,
        node=node.name,
        source=str(getattr(info, "source", None) or node.name),
        matched_by=matched_by,
        eps_export=node.eps,
        momentum_onnx=None if momentum is None else retained_fraction(momentum),
        checkpoint=ref.settings,
        training_mode=bool(getattr(info, "training_mode", False)),
        mismatches=tuple(mismatches),
        training_reason=str(getattr(info, "training_reason", None) or ""),
        output=getattr(info, "output", None),
    )


# ----------------------------------------------------------------------------- folded layers


def fold_checks(
    ckpt: Checkpoint,
    layers: list[BNLayer],
    model: Any,
    producers: Mapping[str, str] | None = None,
    every_layer: list[BNLayer] | None = None,
    nodes: list[ConvNode] | None = None,
) -> tuple[list[FoldedLayer], list[Unpaired], list[BNLayer], str]:
    """Verify the folding of checkpoint BN `layers` that have no node in the export (`model`,
    an ONNX graph, or its convs as `nodes`: a .pt2 program's, `program_conv_nodes`).

    `producers` (BN layer -> conv module name, from the model graph with --arch) replaces
    the key-order guess. Returns the folded layers, the layers and export convs that could
    not be paired (with why), the layers whose conv still feeds a BatchNormalization node
    in the export (a renamed node, left for matching by order), and how pairing was done.
    `every_layer`: all the checkpoint's BN layers (default `layers`), whose convs are the
    only ones a BN can have been folded into."""
    how_conv = "the model graph (--arch)" if producers is not None else "the checkpoint's names and key order"
    feeding = (
        dict(producers)
        if producers is not None
        else producers_from_names(ckpt.tensors, {layer.name: layer.num_features for layer in layers}).feeds
    )
    nodes = conv_nodes(model) if nodes is None else nodes
    convs = [feeding[layer.name] for layer in layers if layer.name in feeding]
    convs = [c for c in dict.fromkeys(convs) if c + ".weight" in ckpt.tensors]
    paired, why = pair_convs(convs, ckpt, nodes)
    folded: list[FoldedLayer] = []
    unpaired: list[Unpaired] = []
    kept_elsewhere: list[BNLayer] = []
    for layer in layers:
        conv = feeding.get(layer.name)
        if conv is None:
            unpaired.append(
                Unpaired(layer.name, f"no BatchNormalization node, and no conv with {layer.num_features} output "
                         f"channels feeds it ({how_conv})")
            )  # fmt: skip
            continue
        if conv + ".weight" not in ckpt.tensors:
            unpaired.append(Unpaired(layer.name, f"its conv {conv} has no weight in the checkpoint"))
            continue
        if conv not in paired:
            reason = why.get(conv, "no export conv found")
            unpaired.append(Unpaired(layer.name, f"no BatchNormalization node; its conv {conv}: {reason}"))
            continue
        node, how_node = paired[conv]
        if node.feeds_batchnorm:
            kept_elsewhere.append(layer)  # not folded: a BatchNormalization node follows, under another name
            continue
        folded.append(_fold(ckpt, layer, conv, node, f"conv by {how_conv}, its node by {how_node}"))
    used = {paired[c][0].name for c in paired}
    every = every_layer if every_layer is not None else layers
    all_feeding = (
        dict(producers)
        if producers is not None
        else producers_from_names(ckpt.tensors, {layer.name: layer.num_features for layer in every}).feeds
    )
    folds_into = {conv + ".weight" for conv in all_feeding.values()}
    left = [n for n in nodes if n.name not in used and not n.feeds_batchnorm]
    unpaired.extend(_unexplained_nodes(ckpt, left, folds_into))
    return folded, unpaired, kept_elsewhere, how_conv


def _fold(ckpt: Checkpoint, layer: BNLayer, conv: str, node: ConvNode, pairing: str) -> FoldedLayer:
    weight_ref = ckpt.tensors[conv + ".weight"]
    bias_ref = ckpt.tensors.get(conv + ".bias")
    export_rows = _rows(node.weight.read(), node.weight.shape, node.out_last)
    if node.weight_factor != 1.0:
        export_rows = [[x * node.weight_factor for x in row] for row in export_rows]
    export_bias = node.bias.read() if node.bias is not None else None
    if export_bias is not None and node.bias_factor != 1.0:
        export_bias = [x * node.bias_factor for x in export_bias]
    if export_bias is not None and len(export_bias) != layer.num_features:
        export_bias = None if len(export_bias) != 1 else export_bias * layer.num_features
    checkpoint_rows = _rows(weight_ref.read(), weight_ref.shape, False)
    conv_bias = bias_ref.read() if bias_ref is not None and bias_ref.shape == (layer.num_features,) else None

    def check_at(eps: float) -> FoldCheck:
        return fold_layer(
            export_rows,
            export_bias,
            checkpoint_rows,
            conv_bias,
            layer.weight,
            layer.bias,
            layer.running_mean,
            layer.running_var,
            eps,
        )

    check = check_at(layer.eps)
    fits = None
    implied = check.implied_eps
    if not check.matches and layer.settings.eps.assumed and implied is not None and implied > 0:
        # an assumed eps cannot make a correct export wrong: does the export's own eps explain it all?
        fits = implied if check_at(implied).matches else None
    return FoldedLayer(layer.name, conv, node.name, pairing, layer.settings.eps, check, fits, node.output)


def _unexplained_nodes(ckpt: Checkpoint, nodes: list[ConvNode], folds_into: set[str]) -> Iterator[Unpaired]:
    """Export convs paired with no folded layer whose weight is not a checkpoint weight
    (same shape, equal beyond float32 rounding). Folded from a BN the checkpoint does not
    pair only where a checkpoint weight of that shape feeds a BN (`folds_into`: the
    weights of the convs that feed the checkpoint's BN layers); a layer no BN follows (a
    classifier after the last BN) has nothing folded into it: its weights simply differ
    (an export of other weights, such as the EMA copy of a live checkpoint)."""
    by_shape: dict[tuple[int, ...], list[tuple[str, TensorRef]]] = {}
    for key, ref in ckpt.tensors.items():
        if key.endswith("weight") and len(ref.shape) >= 2:
            by_shape.setdefault(ref.shape, []).append((key, ref))
    for node in nodes:
        candidates = by_shape.get(node.out_shape, [])
        if not candidates:
            continue  # no checkpoint weight of that shape: another layer type, nothing to say
        rows = _rows(node.weight.read(), node.weight.shape, node.out_last)
        values = [x * node.weight_factor for row in rows for x in row]
        if any(all(map(_f32_equal, ref.read(), values)) for _, ref in candidates):
            continue
        if any(key in folds_into for key, _ in candidates):
            yield Unpaired(
                f"node {node.name}",
                f"export conv with weight shape {list(node.out_shape)} equals no checkpoint weight and feeds no "
                "BatchNormalization node: folded from a BN it could not be paired with",
            )
            continue
        names = listing(key.removesuffix(".weight") for key, _ in candidates)
        yield Unpaired(
            f"node {node.name}",
            f"weight of shape {list(node.out_shape)} equals no checkpoint weight of that shape ({names}), and no BN "
            "follows that layer in the checkpoint, so nothing was folded into it: the export holds other weights "
            "than the checkpoint (another copy, such as the EMA weights?)",
        )

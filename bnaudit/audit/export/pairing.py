"""How a checkpoint's BN layers pair with an export's nodes, and where a runtime reads each
layer's output: the one home of both, for `bnaudit diff` (which compares the paired
tensors, `bnaudit.audit.export.diff`) and `bnaudit parity` (which runs the export and reads
the paired nodes' outputs).

Torch- and numpy-free. Pairing, in this order:

  kept nodes     a BatchNormalization (or .pt2 batch-norm) node by the checkpoint layer's
                 name (exporters keep `layer1.0.bn1.running_mean` as initializer names), then
                 by the exporter's scope in the node's name (`/layer1/layer1.0/bn1/...`), then
                 what is left on both sides by order when channel counts agree one to one
                 (`match_layers`, `match_by_order`)
  folded layers  a layer without a node: the conv that feeds it (the model graph with
                 --arch, else the checkpoint's key order), then that conv's node in the
                 export: initializer name, exporter scope, else order among convs of that
                 weight shape (`pair_convs`)

The result is `bnaudit.audit.export.diff.ExportCheck` (its kept nodes and folded layers);
`export_sites` reads from it where each layer's output is: the kept node's output, or the
output of the conv it was folded into (which folding makes the BN's output), each a value
of the main graph; layers inside a function or subgraph, and layers paired with nothing,
have none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from bnaudit.audit.layers import BNLayer
from bnaudit.formats.model import Checkpoint, TensorRef
from bnaudit.formats.onnx import constant
from bnaudit.normkinds import NormKind, onnx_op_kind

if TYPE_CHECKING:  # the record pairing fills; diff.py imports this module
    from bnaudit.audit.export.diff import ExportCheck

CONV_OPS = ("Conv", "Gemm", "MatMul")

# pairing words, said in the report
BY_NAME = "names"
BY_SCOPE = "exporter scopes"
BY_ORDER = "order and shape"


# ----------------------------------------------------------------------------- kept nodes


def _scope_parts(name: str) -> list[str]:
    """`/layer1/layer1.0/bn1/BatchNormalization` -> the parts a module name can be among."""
    return [p for p in name.split("/") if p]


def scope_module(name: str) -> str:
    """The module name an exporter scope path stands for: each part is named relative to the
    module the part before it is in, unless it extends that part (Sequential children repeat
    their parent's name): `/layer1/layer1.0/conv1/Conv` -> `layer1.0.conv1`,
    `/features/features.1/conv/conv.0/conv.0.0/Conv` -> `features.1.conv.0.0`."""
    full, base, last = "", "", ""
    for part in _scope_parts(name)[:-1]:
        if not (last and part.startswith(last + ".")):
            base = f"{full}." if full else ""
        full, last = base + part, part
    return full


def _scope_name(name: str, candidates: set[str]) -> str | None:
    """The module name the exporter's scope path (legacy exporter node names such as
    `/features/features.1/BatchNormalization`) names among `candidates`, if any."""
    parts = _scope_parts(name)
    if len(parts) < 2:
        return None
    found = [p for p in parts if p in candidates]
    if found:
        return found[-1]
    joined = ".".join(parts[:-1])
    return joined if joined in candidates else None


def match_layers(
    checkpoint: list[BNLayer], export: list[BNLayer]
) -> tuple[list[tuple[BNLayer, BNLayer, str]], list[BNLayer], list[BNLayer]]:
    """(pairs with how each was matched, checkpoint layers left, export layers left).

    Names first, then the exporter's scope in the export layer's name (`read_onnx` names a
    layer after its node where no initializer kept the module name), then whatever is
    left on both sides by order when the channel counts agree one to one."""
    by_name = {layer.name: layer for layer in checkpoint}
    pairs: list[tuple[BNLayer, BNLayer, str]] = []
    used: set[str] = set()
    left_export: list[BNLayer] = []
    for layer in export:
        own = by_name.get(layer.name)
        if own is not None and own.name not in used:
            pairs.append((own, layer, BY_NAME))
            used.add(own.name)
        else:
            left_export.append(layer)
    still: list[BNLayer] = []
    for layer in left_export:
        scope = _scope_name(layer.name, set(by_name) - used)
        if scope is not None:
            pairs.append((by_name[scope], layer, BY_SCOPE))
            used.add(scope)
        else:
            still.append(layer)
    left_checkpoint = [layer for layer in checkpoint if layer.name not in used]
    return pairs, left_checkpoint, still


def match_by_order(
    left_checkpoint: list[BNLayer], left_export: list[BNLayer]
) -> tuple[list[tuple[BNLayer, BNLayer, str]], list[BNLayer], list[BNLayer]]:
    """Pairs by position when both sides have as many layers left and each pair agrees in
    channel count; otherwise no pair (a guess would hide a renamed layer's problem)."""
    same = left_export and len(left_checkpoint) == len(left_export)
    if same and all(a.num_features == b.num_features for a, b in zip(left_checkpoint, left_export)):
        return [(a, b, BY_ORDER) for a, b in zip(left_checkpoint, left_export)], [], []
    return [], left_checkpoint, left_export


# ----------------------------------------------------------------------------- folded layers


@dataclass(frozen=True)
class ConvNode:
    """A Conv / Gemm / MatMul node of the export with a constant weight."""

    name: str
    weight_name: str
    weight: TensorRef
    out_last: bool  # weight laid out (I, O): Gemm without transB, MatMul
    bias: TensorRef | None
    weight_factor: float  # Gemm's alpha
    bias_factor: float  # Gemm's beta
    feeds_batchnorm: bool
    output: str | None = None  # the value it writes (an Add's for MatMul + bias), main graph only

    @property
    def out_shape(self) -> tuple[int, ...]:
        """The weight's shape with the output channels first (as torch stores it)."""
        s = self.weight.shape
        return (s[-1], *s[:-1]) if self.out_last else s


def _attribute(node: Any, name: str, default: float) -> float:
    for a in node.attribute:
        if a.name == name:
            return float(a.i) if a.type == 2 else float(a.f)  # AttributeProto.INT = 2
    return default


def conv_nodes(model: Any) -> list[ConvNode]:
    """The export's Conv, Gemm and MatMul nodes whose weight is a constant, in graph order
    (a MatMul's bias is the constant of the Add that consumes it, where there is one)."""
    nodes = list(model.nodes())
    consumers: dict[str, list[Any]] = {}
    for _, node in nodes:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    found = []
    for where, node in nodes:
        if node.op_type not in CONV_OPS or len(node.input) < 2:
            continue
        # through Identity nodes: the legacy exporter shares equal folded weights (the zeros of
        # every BN with gamma 0) as one initializer read through an Identity node per conv
        weight = constant(model, node.input[1])
        if weight is None or len(weight.shape) < 2:
            continue
        if node.op_type == "MatMul" and len(weight.shape) != 2:
            continue
        bias_name = node.input[2] if len(node.input) > 2 and node.input[2] else None
        out_last = node.op_type == "MatMul" or (node.op_type == "Gemm" and _attribute(node, "transB", 0) == 0)
        outputs = list(node.output)
        after = [c for o in outputs for c in consumers.get(o, [])]
        if node.op_type == "MatMul":
            for c in after:
                if c.op_type == "Add":
                    other = [i for i in c.input if i not in outputs]
                    if other and model.initializer(other[0]) is not None:
                        bias_name = other[0]
                        outputs = list(c.output)
                        after = [x for o in outputs for x in consumers.get(o, [])]
                    break
        bias = constant(model, bias_name) if bias_name else None
        name = node.name or f"{node.op_type} node writing {outputs[0] if outputs else '?'}"
        if where != "main":
            name = f"{name} ({where})"
        gemm = node.op_type == "Gemm"
        found.append(
            ConvNode(
                name=name,
                weight_name=node.input[1],
                weight=weight,
                out_last=out_last,
                bias=bias,
                weight_factor=_attribute(node, "alpha", 1.0) if gemm else 1.0,
                bias_factor=_attribute(node, "beta", 1.0) if gemm else 1.0,
                feeds_batchnorm=any(onnx_op_kind(c.op_type) is NormKind.BATCH_NORM for c in after),
                output=outputs[0] if where == "main" and outputs else None,
            )
        )
    return found


def program_conv_nodes(path: str) -> list[ConvNode]:
    """The convolution and linear nodes of a torch.export archive with stored weights, as
    the folded convs of an export (bnaudit.formats.pt2.stored_convolutions): a weight named
    after the module it belongs to (`layer1.0.conv1.weight`), output channels first."""
    from bnaudit.formats.pt2 import stored_convolutions

    return [
        ConvNode(c.node, c.weight_name, c.weight, False, c.bias, 1.0, 1.0, c.feeds_batchnorm)
        for c in stored_convolutions(path)
    ]


def pair_convs(
    convs: list[str], ckpt: Checkpoint, nodes: list[ConvNode]
) -> tuple[dict[str, tuple[ConvNode, str]], dict[str, str]]:
    """Checkpoint conv -> (its export node, how found), and conv -> why none was found: the
    initializer named `conv.weight`, then the exporter's scope in a node's name, then order
    among the export convs of the conv's weight shape when as many are left on both sides."""
    paired: dict[str, tuple[ConvNode, str]] = {}
    taken: set[int] = set()
    by_weight = {n.weight_name: i for i, n in enumerate(nodes)}
    for conv in convs:
        i = by_weight.get(conv + ".weight")
        if i is not None and i not in taken:
            paired[conv] = (nodes[i], "initializer name")
            taken.add(i)
    for conv in convs:
        if conv in paired:
            continue
        for i, n in enumerate(nodes):
            if i not in taken and (conv in _scope_parts(n.name) or conv == scope_module(n.name)):
                paired[conv] = (n, "exporter scope")
                taken.add(i)
                break
    why: dict[str, str] = {}
    left = [c for c in convs if c not in paired]
    shapes = {c: ckpt.tensors[c + ".weight"].shape for c in left}
    for shape in dict.fromkeys(shapes.values()):
        group = [c for c in left if shapes[c] == shape]
        free = [i for i, n in enumerate(nodes) if i not in taken and n.out_shape == shape]
        if len(free) == len(group):
            for c, i in zip(group, free):
                paired[c] = (nodes[i], "order among convs of that shape")
                taken.add(i)
        else:
            for c in group:
                why[c] = (
                    f"{len(group)} checkpoint conv(s) of shape {list(shape)} left to pair, "
                    f"{len(free)} export conv(s) of that shape"
                )
    return paired, why


# ----------------------------------------------------------------------------- sites


@dataclass(frozen=True)
class Site:
    """Where a runtime reads checkpoint layer `layer`'s output in an export: `value` (an ONNX
    value name: a node's output), `node` the node that writes it, `folded` when that node is
    the conv the layer was folded into."""

    layer: str
    value: str
    node: str
    folded: bool = False

    @property
    def words(self) -> str:
        if self.folded:
            return f"output of conv node {self.node}, BN folded into it"
        return f"output of BatchNormalization node {self.node}"


def export_sites(check: ExportCheck) -> tuple[list[Site], dict[str, str]]:
    """The sites of the layers `check` paired (kept nodes, then folded layers), and layer ->
    why it has none (paired inside a function or subgraph; not paired: its reason)."""
    sites: list[Site] = []
    none: dict[str, str] = {}
    for node in check.nodes:
        if node.output:
            sites.append(Site(node.name, node.output, node.node))
        else:
            none[node.name] = f"its node {node.node} lies inside a function or subgraph: no graph output to read"
    for folded in check.folded:
        if folded.output:
            sites.append(Site(folded.name, folded.output, folded.node, folded=True))
        else:
            none[folded.name] = f"folded into {folded.node}, inside a function or subgraph: no graph output to read"
    for unpaired in check.unpaired:
        if not unpaired.name.startswith("node "):
            none.setdefault(unpaired.name, unpaired.reason)
    return sites, none


def named_layers(check: ExportCheck) -> dict[str, str]:
    """Export layer name -> checkpoint layer name of every kept node `check` paired (a .pt2
    program's batch-norm nodes are named by their buffers: a runtime finds them by them)."""
    return {node.node: node.name for node in check.nodes}

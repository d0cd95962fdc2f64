"""torch.export programs (`.pt2`): the BatchNorm of an exported graph as a `Checkpoint`.

BatchNorm is found from the graph, not from names: every node whose target is a batch-norm
operator of `bnaudit.normkinds.OPS` (`aten.batch_norm`, `_native_batch_norm_legit_no_training`,
`_native_batch_norm_legit(_functional)`, `cudnn_batch_norm`, ...). Its weight, bias,
running_mean and running_var arguments are resolved through the graph signature's input
specs to the parameter and buffer names (`p_1_weight` -> `1.weight`), so a layer carries
its module's own name (`1`), and its tensors come from the archive's raw payloads
(bnaudit.formats.pt2archive). The node's own arguments give:

  eps        `eps` (cudnn/miopen: `epsilon`): the real value, a known setting
  momentum   `momentum` (`exponential_average_factor`), PyTorch's convention. An eval-mode
             node of a module built with momentum=None carries 0.0 (BatchNorm.forward's
             exponential_average_factor): 0 in an eval node is therefore not known.
  training   the operator's statistics (`normkinds.Statistics`): batch, running, or its
             `training` argument (index `training_arg`)

A program without any batch-norm node and without BN buffers whose convolutions take a stored
weight and bias (`torch.fx.experimental.optimization.fuse` before `torch.export`, or any other
fold) is folded: `Checkpoint.folded` names the convolutions (`stored_convolutions`), and, as
for ONNX, a network that never had BatchNorm looks the same (`folded_ambiguous`).

A program without any batch-norm node whose signature still feeds `P.running_mean` and
`P.running_var` buffers was decomposed (`run_decompositions` with a batch-norm table): BN
became sub/mul/rsqrt. Those layers are read from their buffers all the same; eps comes
from the arithmetic (eval: `add(running_var, eps)`; training: `add(var, eps)` on the batch
variance of the `var_mean` whose value is written back into running_var), training mode
and momentum from the buffer mutations the signature writes back (`running_mean * (1 - m)`),
and `Checkpoint.decomposed` says what was seen. An eps the arithmetic does not show is None
(not known). Nothing in an archive is unpickled (see pt2archive).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from bnaudit.formats.model import Checkpoint, ModuleInfo, TensorRef
from bnaudit.formats.pt2archive import Payload, Pt2Archive, open_pt2
from bnaudit.normkinds import NormKind, NormOp, Statistics, norm_op, pytorch_momentum
from bnaudit.text import listing, plural

_LEAVES = ("weight", "bias", "running_mean", "running_var")
# argument names of the statistics' settings across the batch-norm operators' schemas
_EPS_ARGS = ("eps", "epsilon")
_MOMENTUM_ARGS = ("momentum", "exponential_average_factor")
# what a training-mode node's finding says to do
_EVAL_FIX = "exported in train mode: call model.eval() before torch.export.export"
# ops that pass a tensor through unchanged in value (decomposed BN casts its buffers)
_PASS_THROUGH = ("_to_copy", "clone", "alias", "detach", "contiguous", "to")


@dataclass(frozen=True)
class _Input:
    """A graph placeholder: what the signature says it is (`parameter`, `buffer`,
    `tensor_constant`, `user_input`, ...) and the state-dict name it stands for."""

    kind: str
    fqn: str | None


def _signature_inputs(signature: dict[str, Any]) -> dict[str, _Input]:
    found: dict[str, _Input] = {}
    for spec in signature.get("input_specs") or []:
        if not isinstance(spec, dict) or len(spec) != 1:
            continue
        kind, body = next(iter(spec.items()))
        if not isinstance(body, dict):
            continue
        arg = body.get("arg")
        name = arg.get("name") if isinstance(arg, dict) else None
        if isinstance(arg, dict) and isinstance(arg.get("as_tensor"), dict):
            name = arg["as_tensor"].get("name")
        fqn = body.get("parameter_name") or body.get("buffer_name") or body.get("tensor_constant_name")
        if isinstance(name, str):
            found[name] = _Input(kind, fqn if isinstance(fqn, str) else None)
    return found


def _mutations(signature: dict[str, Any]) -> dict[str, str]:
    """buffer FQN -> the graph value written back to it (training-mode bookkeeping)."""
    out: dict[str, str] = {}
    for spec in signature.get("output_specs") or []:
        body = spec.get("buffer_mutation") if isinstance(spec, dict) else None
        if isinstance(body, dict) and isinstance(body.get("buffer_name"), str):
            arg = body.get("arg")
            out[body["buffer_name"]] = arg.get("name", "") if isinstance(arg, dict) else ""
    return out


def _tensor_name(arg: Any) -> str | None:
    """The graph value an argument names (`as_tensor`, or an optional tensor that is set)."""
    if not isinstance(arg, dict):
        return None
    if isinstance(arg.get("as_optional_tensor"), dict):
        arg = arg["as_optional_tensor"]
    tensor = arg.get("as_tensor")
    return tensor.get("name") if isinstance(tensor, dict) and isinstance(tensor.get("name"), str) else None


def _is_none(arg: Any) -> bool:
    if isinstance(arg, dict) and isinstance(arg.get("as_optional_tensor"), dict):
        arg = arg["as_optional_tensor"]
    return isinstance(arg, dict) and "as_none" in arg


def _number(arg: Any) -> float | None:
    if not isinstance(arg, dict):
        return None
    for key in ("as_float", "as_int"):
        value = arg.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def _args(node: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    """(by name, in order) of a serialized node's inputs."""
    named: dict[str, Any] = {}
    ordered: list[Any] = []
    for item in node.get("inputs") or []:
        if isinstance(item, dict):
            ordered.append(item.get("arg"))
            if isinstance(item.get("name"), str):
                named[item["name"]] = item.get("arg")
    return named, ordered


def _first(named: dict[str, Any], keys: tuple[str, ...]) -> Any:
    return next((named[k] for k in keys if k in named), None)


def _nodes(program: dict[str, Any]) -> list[dict[str, Any]]:
    graph = program["graph_module"].get("graph")
    nodes = graph.get("nodes") if isinstance(graph, dict) else None
    return [n for n in nodes if isinstance(n, dict)] if isinstance(nodes, list) else []


def _training(op: NormOp, named: dict[str, Any], ordered: list[Any]) -> tuple[bool | None, str]:
    """Whether the node normalises with the batch's statistics, and what says so."""
    if op.statistics is Statistics.BATCH:
        return True, f"{op.name} always normalises with batch statistics"
    if op.statistics is Statistics.RUNNING:
        return False, f"{op.name} (eval)"
    arg = named.get("training")
    if arg is None and op.training_arg is not None and op.training_arg < len(ordered):
        arg = ordered[op.training_arg]
    value = arg.get("as_bool") if isinstance(arg, dict) else None
    if not isinstance(value, bool):
        return None, "training argument not a constant"
    return value, f"training={value}"


def _layer_name(fqns: dict[str, str | None], fallback: str) -> str:
    """The module's name from the statistics' state-dict names (`1.running_mean` -> `1`),
    else from weight/bias, else the node's name."""
    for a, b in (("running_mean", "running_var"), ("weight", "bias")):
        x, y = fqns.get(a), fqns.get(b)
        if x and y and x.endswith("." + a) and y.endswith("." + b):
            prefix = x.removesuffix("." + a)
            if prefix == y.removesuffix("." + b):
                return prefix
    return fallback


@dataclass
class _Found:
    tensors: dict[str, TensorRef]
    modules: dict[str, ModuleInfo]
    unauditable: list[str]
    notes: list[str]
    bn_nodes: int = 0


def read_pt2(path: str) -> Checkpoint:
    """The BatchNorm layers of every program in a .pt2 archive as one Checkpoint (format "pt2").

    A node whose statistics are pickled, computed in the graph or graph inputs is listed in
    `Checkpoint.unauditable`; every pickle and compiled artefact in `Checkpoint.not_loaded`."""
    archive = open_pt2(path)
    found = _Found({}, {}, [], [])
    producers = []
    convs: list[StoredConv] = []
    for model, program in archive.programs.items():
        prefix = f"{model}:" if len(archive.programs) > 1 else ""
        _read_program(archive, model, program, prefix, found)
        convs += _stored_convolutions(archive, model, program, prefix)
        version = program.get("torch_version")
        if isinstance(version, str):
            producers.append(f"torch {version}")
    ckpt = Checkpoint(
        path,
        "pt2",
        found.tensors,
        modules=found.modules,
        holds_module=True,
        metadata={
            "pt2.producer": ", ".join(dict.fromkeys(producers)),
            "pt2.programs": ", ".join(archive.programs),
        },
        not_loaded=list(archive.not_read),
        unauditable=found.unauditable,
    )
    ckpt.notes = found.notes
    decomposed = [n for n, info in found.modules.items() if info.class_name == DECOMPOSED]
    if decomposed:
        ckpt.decomposed = (
            f"no batch-norm node: {plural(len(decomposed), 'layer')} ({listing(decomposed)}) "
            "computed as elementwise arithmetic on their buffers (run_decompositions)"
        )
    with_bias = [c.node for c in convs if c.bias is not None]
    if found.bn_nodes == 0 and not found.tensors and with_bias:
        # a linear node (a classifier head) is counted with the convolutions, but not called one
        kind = (
            "convolution or linear node" if any(c.linear for c in convs if c.bias is not None) else "convolution node"
        )
        ckpt.folded = (
            f"no batch-norm node; {plural(len(with_bias), kind)} ({listing(with_bias)}) with stored weights and bias"
        )
        ckpt.folded_ambiguous = True
    if not archive.programs:
        ckpt.unauditable.append("an AOTInductor package without an exported program: no graph to audit")
    return ckpt


@dataclass(frozen=True)
class StoredConv:
    """A convolution or linear node of a program whose weight (and bias, where it has one)
    the archive stores: `weight_name` its state-dict name (`layer1.0.conv1.weight`), `feeds_batchnorm`
    whether a batch-norm node reads its output."""

    node: str
    weight_name: str
    weight: TensorRef
    bias: TensorRef | None
    feeds_batchnorm: bool
    linear: bool = False  # an aten.linear node, not a convolution


def stored_convolutions(path: str) -> list[StoredConv]:
    """The convolution and linear nodes (transposed ones left out) of every program of the
    archive with a stored weight, in graph order."""
    archive = open_pt2(path)
    found: list[StoredConv] = []
    for model, program in archive.programs.items():
        found += _stored_convolutions(archive, model, program, f"{model}:" if len(archive.programs) > 1 else "")
    return found


def _stored_convolutions(archive: Pt2Archive, model: str, program: dict[str, Any], prefix: str) -> list[StoredConv]:
    gm = program["graph_module"]
    signature = gm.get("signature") if isinstance(gm.get("signature"), dict) else {}
    inputs = _signature_inputs(signature)
    payloads = archive.payloads.get(model, {})
    nodes = _nodes(program)
    readers: dict[str, list[str]] = {}
    for node in nodes:
        for arg in _args(node)[1]:
            value = _tensor_name(arg)
            if value is not None:
                readers.setdefault(value, []).append(str(node.get("target")))
    found: list[StoredConv] = []
    for index, node in enumerate(nodes):
        target = str(node.get("target"))
        if not any(p in target for p in _PRODUCER_OPS):
            continue
        named, ordered = _args(node)
        flag = named.get("transposed")
        if isinstance(flag, dict) and flag.get("as_bool"):
            continue
        fqn, weight = _stored(named.get("weight", ordered[1] if len(ordered) > 1 else None), inputs, payloads)
        if weight is None or fqn is None:
            continue
        bias = _stored(named.get("bias", ordered[2] if len(ordered) > 2 else None), inputs, payloads)[1]
        outputs = [_tensor_name(item) for item in node.get("outputs") or []]
        read_by = [t for out in outputs if out is not None for t in readers.get(out, [])]
        feeds_bn = any((op := norm_op(t)) is not None and op.kind is NormKind.BATCH_NORM for t in read_by)
        label = node.get("name") if isinstance(node.get("name"), str) else f"node_{index}"
        found.append(StoredConv(prefix + str(label), prefix + fqn, weight, bias, feeds_bn, "aten.linear." in target))
    return found


DECOMPOSED = "BatchNorm (decomposed)"


def _read_program(archive: Pt2Archive, model: str, program: dict[str, Any], prefix: str, found: _Found) -> None:
    gm = program["graph_module"]
    signature = gm.get("signature") if isinstance(gm.get("signature"), dict) else {}
    inputs = _signature_inputs(signature)
    payloads = archive.payloads.get(model, {})
    used_stats: set[str] = set()
    nodes_before = found.bn_nodes
    for index, node in enumerate(_nodes(program)):
        target = node.get("target")
        op = norm_op(target) if isinstance(target, str) else None
        if op is None or op.kind is not NormKind.BATCH_NORM:
            continue
        found.bn_nodes += 1
        name = node.get("name")
        label = name if isinstance(name, str) else f"node_{index}"
        where = f"node '{label}' ({target!s}) in program '{model}'"
        _read_node(op, node, where, label, inputs, payloads, prefix, found, used_stats)
    if found.bn_nodes == nodes_before:
        _read_decomposed(program, model, inputs, payloads, prefix, signature, found, used_stats)


def _read_node(
    op: NormOp,
    node: dict[str, Any],
    where: str,
    label: str,
    inputs: dict[str, _Input],
    payloads: dict[str, Payload],
    prefix: str,
    found: _Found,
    used_stats: set[str],
) -> None:
    named, ordered = _args(node)
    fqns: dict[str, str | None] = {}
    refs: dict[str, TensorRef] = {}
    problems: list[str] = []
    absent: list[str] = []
    for position, leaf in enumerate(_LEAVES, start=1):
        arg = named.get(leaf, ordered[position] if position < len(ordered) else None)
        if arg is None or _is_none(arg):
            absent.append(leaf)
            continue
        value = _tensor_name(arg)
        source = inputs.get(value or "")
        if value is None or source is None or source.fqn is None:
            what = "a graph input" if source is not None else "computed in the graph"
            problems.append(f"{leaf} '{value!s}' is {what}")
            continue
        fqns[leaf] = source.fqn
        payload = payloads.get(source.fqn)
        if payload is None or payload.ref is None:
            why = payload.why_not if payload is not None else "not in the archive's weights or constants"
            problems.append(f"{leaf} '{source.fqn}': {why}")
            continue
        refs[leaf] = payload.ref
    training, reason = _training(op, named, ordered)
    if training:
        reason += f"; {_EVAL_FIX}"
    if "running_mean" in absent and "running_var" in absent:
        # track_running_stats=False: batch statistics in every mode, nothing stored to audit
        name = prefix + _layer_name(fqns, label)
        found.modules[name] = ModuleInfo(
            op.name, _number(_first(named, _EPS_ARGS)), None, track_running_stats=False,
            momentum_known=False, source=where, calls=(op.name,),
        )  # fmt: skip
        return
    if problems:
        found.unauditable.append(f"{where}: {'; '.join(problems)}: cannot be audited")
        return
    if any(len(refs[s].shape) != 1 for s in ("running_mean", "running_var") if s in refs):
        found.unauditable.append(f"{where}: statistics that are not 1-D vectors: not audited")
        return
    name = prefix + _layer_name(fqns, label)
    if name in found.modules:
        name = f"{name}#{label}"
    for leaf, ref in refs.items():
        found.tensors[f"{name}.{leaf}"] = ref.renamed(f"{name}.{leaf}")
    layer = name.removeprefix(prefix)
    counter = payloads.get(f"{layer}.num_batches_tracked")
    if counter is not None and counter.ref is not None and fqns.get("running_mean") == f"{layer}.running_mean":
        found.tensors[f"{name}.num_batches_tracked"] = counter.ref.renamed(f"{name}.num_batches_tracked")
    used_stats.update(v for v in fqns.values() if v)
    momentum = _number(_first(named, _MOMENTUM_ARGS))
    # an eval node of a momentum=None module carries 0.0: indistinguishable from momentum 0
    momentum_known = momentum is not None and not (training is False and momentum == 0.0)
    if op.name in ("aten::cudnn_batch_norm", "aten::miopen_batch_norm"):
        found.notes.append(f"{name}: {op.name} ({op.note}): the program was exported on a GPU")
    found.modules[name] = ModuleInfo(
        class_name=str(node.get("target")),
        eps=_number(_first(named, _EPS_ARGS)),
        momentum=momentum if momentum_known else None,
        track_running_stats=True,
        momentum_known=momentum_known,
        training_mode=training,
        source=where,
        training_reason=reason,
        calls=(op.name,),
    )


def _producers(nodes: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    for node in nodes:
        for item in node.get("outputs") or []:
            value = _tensor_name(item)
            if value is not None:
                out[value] = node
    return out


def _traces_to(value: str | None, target: str, producers: dict[str, dict[str, Any]]) -> bool:
    """`value` is `target` itself or a cast/copy of it."""
    for _ in range(8):
        if value is None:
            return False
        if value == target:
            return True
        node = producers.get(value)
        op = str(node.get("target", "")) if node else ""
        if not any(f"aten.{p}." in op for p in _PASS_THROUGH):
            return False
        _, ordered = _args(node)  # type: ignore[arg-type]
        value = _tensor_name(ordered[0]) if ordered else None
    return False


def _batch_variance(written: str | None, producers: dict[str, dict[str, Any]]) -> str | None:
    """The batch variance a decomposed training-mode BN writes into running_var: walking back
    from the written value (running_var*(1-m) + var*n/(n-1)*m) to output 0 of `aten.var_mean`,
    whose `add(var, eps)` then normalises the batch."""
    stack: list[str | None] = [written]
    seen: set[str] = set()
    while stack and len(seen) < 64:
        value = stack.pop()
        node = producers.get(value or "")
        if value is None or value in seen or node is None:
            continue
        seen.add(value)
        if str(node.get("target", "")).startswith("torch.ops.aten.var_mean."):
            outputs = [_tensor_name(o) for o in node.get("outputs") or []]
            return value if outputs and outputs[0] == value else None
        _, ordered = _args(node)
        stack.extend(_tensor_name(a) for a in ordered)
    return None


def _arithmetic(nodes: list[dict[str, Any]], placeholder: str, op_name: str) -> Iterator[float]:
    """Constants c of `op_name(placeholder or its cast, c)` nodes."""
    producers = _producers(nodes)
    for node in nodes:
        if not str(node.get("target", "")).startswith(f"torch.ops.aten.{op_name}."):
            continue
        _, ordered = _args(node)
        if len(ordered) >= 2 and _traces_to(_tensor_name(ordered[0]), placeholder, producers):
            value = _number(ordered[1])
            if value is not None:
                yield value


def _read_decomposed(
    program: dict[str, Any],
    model: str,
    inputs: dict[str, _Input],
    payloads: dict[str, Payload],
    prefix: str,
    signature: dict[str, Any],
    found: _Found,
    used_stats: set[str],
) -> None:
    """Layers of a program without batch-norm nodes, from the buffers its arithmetic uses."""
    placeholders = {i.fqn: name for name, i in inputs.items() if i.kind == "buffer" and i.fqn}
    mutated = _mutations(signature)
    nodes = _nodes(program)
    for fqn in placeholders:
        if not fqn.endswith(".running_mean") or fqn in used_stats:
            continue
        layer = fqn.removesuffix(".running_mean")
        if f"{layer}.running_var" not in placeholders:
            continue
        leaves = {leaf: payloads.get(f"{layer}.{leaf}") for leaf in (*_LEAVES, "num_batches_tracked")}
        unread = [p for p in leaves.values() if p is not None and p.ref is None]
        where = f"buffers of '{layer}' in program '{model}', no batch-norm node"
        if unread or leaves["running_mean"] is None or leaves["running_var"] is None:
            why = "; ".join(p.why_not for p in unread) or "statistics not in the archive's weights"
            found.unauditable.append(f"{where}: {why}: cannot be audited")
            continue
        name = prefix + layer
        for leaf, payload in leaves.items():
            if payload is not None and payload.ref is not None:
                found.tensors[f"{name}.{leaf}"] = payload.ref.renamed(f"{name}.{leaf}")
        training = fqn in mutated
        var_placeholder = placeholders[f"{layer}.running_var"]
        if training:
            batch_var = _batch_variance(mutated.get(f"{layer}.running_var"), _producers(nodes))
            eps = None if batch_var is None else next(_arithmetic(nodes, batch_var, "add"), None)
        else:
            eps = next(_arithmetic(nodes, var_placeholder, "add"), None)
        retained = next(_arithmetic(nodes, placeholders[fqn], "mul"), None) if training else None
        momentum = None if retained is None else float(f"{pytorch_momentum(retained):.12g}")
        found.modules[name] = ModuleInfo(
            class_name=DECOMPOSED,
            eps=eps,
            momentum=momentum,
            track_running_stats=True,
            momentum_known=momentum is not None,
            training_mode=training,
            source=where if eps is None else f"{where}, eps from add({'var' if training else 'running_var'}, {eps:g})",
            training_reason=(
                f"the program writes {fqn} back as a buffer mutation; {_EVAL_FIX}" if training else "running statistics"
            ),
            # what the arithmetic computes, so that normkinds classifies the layer as BatchNorm
            calls=("aten::batch_norm",),
        )


# The operators a BatchNorm folds into: their output channels are the first dimension of
# their weight (aten.convolution with transposed=True is not one: its weight is (C_in, C_out/g, ...)).
_PRODUCER_OPS = ("aten.conv1d.", "aten.conv2d.", "aten.conv3d.", "aten.linear.", "aten.convolution.")
_TRANSPOSED_OPS = ("aten.conv_transpose1d.", "aten.conv_transpose2d.", "aten.conv_transpose3d.")


@dataclass(frozen=True)
class GraphProducer:
    """What feeds a BN node of a program: the Conv/Linear node it folds into (`name` its
    module's name from its weight's state-dict name, `weight`, `bias`, `out_axis` the
    weight's axis of output channels: 1 for a transposed convolution), or, where it cannot
    be folded, `why_not` (what feeds it instead)."""

    name: str
    weight: TensorRef | None
    bias: TensorRef | None
    why_not: str = ""
    out_axis: int = 0


def _stored(arg: Any, inputs: dict[str, _Input], payloads: dict[str, Payload]) -> tuple[str | None, TensorRef | None]:
    """(state-dict name, stored tensor) of the placeholder an argument names; None where not."""
    source = inputs.get(_tensor_name(arg) or "")
    payload = payloads.get(source.fqn) if source is not None and source.fqn else None
    return (source.fqn if source is not None else None), (payload.ref if payload is not None else None)


def batchnorm_producers(path: str) -> dict[str, GraphProducer]:
    """For every batch-norm node of the archive's programs, by the layer name `read_pt2`
    gives it: the node whose output is its input, when that is a Conv or Linear operator
    with a stored weight and nothing else reads that output."""
    archive = open_pt2(path)
    found: dict[str, GraphProducer] = {}
    for model, program in archive.programs.items():
        prefix = f"{model}:" if len(archive.programs) > 1 else ""
        gm = program["graph_module"]
        signature = gm.get("signature") if isinstance(gm.get("signature"), dict) else {}
        inputs = _signature_inputs(signature)
        payloads = archive.payloads.get(model, {})
        nodes = _nodes(program)
        producers = _producers(nodes)
        readers: dict[str, int] = {}
        for node in nodes:
            for arg in _args(node)[1]:
                value = _tensor_name(arg)
                if value is not None:
                    readers[value] = readers.get(value, 0) + 1

        for index, node in enumerate(nodes):
            target = node.get("target")
            op = norm_op(target) if isinstance(target, str) else None
            if op is None or op.kind is not NormKind.BATCH_NORM:
                continue
            named, ordered = _args(node)
            fqns = {
                leaf: _stored(named.get(leaf, ordered[i] if i < len(ordered) else None), inputs, payloads)[0]
                for i, leaf in enumerate(_LEAVES, start=1)
            }
            label = node.get("name") if isinstance(node.get("name"), str) else f"node_{index}"
            name = prefix + _layer_name(fqns, str(label))
            name = f"{name}#{label}" if name in found else name
            x = _tensor_name(named.get("input", ordered[0] if ordered else None))
            source_node = producers.get(x or "")
            source_target = str(source_node.get("target")) if source_node is not None else ""
            if source_node is None or not any(p in source_target for p in (*_PRODUCER_OPS, *_TRANSPOSED_OPS)):
                what = "a graph input" if source_node is None else f"{source_target}"
                found[name] = GraphProducer("", None, None, f"follows {what}: stays a standalone batch norm")
                continue
            p_named, p_ordered = _args(source_node)
            flag = p_named.get("transposed")
            transposed = any(p in source_target for p in _TRANSPOSED_OPS) or (
                isinstance(flag, dict) and bool(flag.get("as_bool"))
            )
            groups = _number(p_named.get("groups"))
            if transposed and groups not in (None, 1.0):
                found[name] = GraphProducer("", None, None, "follows a grouped transposed convolution: not audited")
                continue
            if readers.get(x or "", 0) != 1:
                found[name] = GraphProducer("", None, None, "its producer's output is read by other nodes too")
                continue
            fqn, weight = _stored(p_named.get("weight", p_ordered[1] if len(p_ordered) > 1 else None), inputs, payloads)
            bias = _stored(p_named.get("bias", p_ordered[2] if len(p_ordered) > 2 else None), inputs, payloads)[1]
            if weight is None:
                found[name] = GraphProducer("", None, None, "its producer's weight is not stored in the archive")
                continue
            module = fqn.removesuffix(".weight") if fqn else str(source_node.get("name") or "producer")
            found[name] = GraphProducer(prefix + module, weight, bias, out_axis=1 if transposed else 0)
    return found

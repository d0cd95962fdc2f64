"""ONNX models: the BatchNormalization nodes of a `.onnx` file as a `Checkpoint`.

`load_onnx` parses the ModelProto without loading external data and validates every
external-data location before anything is read; `read_onnx` turns each
BatchNormalization node whose scale, B, input_mean and input_var are constants
(initializers, Constant nodes, through Identity nodes) into a layer
`L.weight / L.bias / L.running_mean / L.running_var` with a `ModuleInfo` that carries
the node's real epsilon, its momentum translated to PyTorch's convention and whether it
normalises with batch statistics.

Conventions, from the operator's definition (onnx.defs.get_schema("BatchNormalization", v)):

  momentum     ONNX stores the retained fraction: running = running*m + batch*(1 - m), so
               PyTorch's momentum (the weight of the new batch) is 1 - m: ONNX 0.9 = PyTorch 0.1
               (bnaudit.normkinds.pytorch_momentum).
  epsilon      default 1e-5; attributes are float32, so eps and momentum are reported as the
               shortest decimal that rounds to the same float32 (9.99999975e-06 -> 1e-05).
  training     BatchNormalization-14/15: `training_mode` (default 0). -7 and -9: no attribute,
               the number of outputs says it (Y alone: test mode; Y, mean, var, ...: training).
               -1 and -6: `is_test` (default 0, i.e. training when absent).

Model files are never executed: no custom-operator library is loaded, `onnx.checker` is not
called (it resolves external paths), and external bytes are read here, from validated paths
inside the model's folder, one tensor's byte range at a time. The `onnx` package (an optional
extra) is imported inside the functions: it imports numpy, which `inspect` of other formats
never needs.
"""

from __future__ import annotations

import math
import os
import stat
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from bnaudit.errors import BnauditError
from bnaudit.formats.hfcache import in_blobs
from bnaudit.formats.model import STORAGE_ITEMSIZE, Checkpoint, ModuleInfo, TensorRef, decode_values, read_into
from bnaudit.formats.onnxgraph import all_graphs, call_sites, with_function_nodes
from bnaudit.normkinds import NormKind, onnx_op, pytorch_momentum
from bnaudit.text import exception_line, listing, plural

ONNX_EXTRA = 'pip install "bnaudit[onnx]"'

# protobuf refuses messages of 2 GiB and more; larger models keep their weights as external data
PROTOBUF_LIMIT = 2**31 - 1

# TensorProto.DataType -> torch-style dtype name (the types a BN statistic can have)
_ONNX_DTYPES = {
    1: "float32",
    2: "uint8",
    3: "int8",
    4: "uint16",
    5: "int16",
    6: "int32",
    7: "int64",
    9: "bool",
    10: "float16",
    11: "float64",
    12: "uint32",
    13: "uint64",
    16: "bfloat16",
}
_ITEMSIZE = {**STORAGE_ITEMSIZE, "uint16": 2, "uint32": 4, "uint64": 8}
_EXTERNAL = 1  # TensorProto.DataLocation.EXTERNAL

# BatchNormalization's inputs after X, under the names of the PyTorch tensors they hold
_BN_INPUTS = (("weight", "scale"), ("bias", "B"), ("running_mean", "input_mean"), ("running_var", "input_var"))


def _import_onnx() -> Any:
    try:
        import onnx
    except ImportError:
        raise BnauditError(f"reading .onnx files needs the onnx extra: {ONNX_EXTRA}") from None
    return onnx


@dataclass(frozen=True)
class OnnxModel:
    """A parsed ONNX model; its tensors are read only when asked.

    `opset` is the default-domain opset the model imports; `producer` is
    "producer_name producer_version"; `initializer(name)` finds a constant by name among the
    initializers of every graph (main graph first, then subgraphs) and the outputs of Constant
    nodes; `nodes()` yields (graph path, node) for the main graph, its subgraphs
    ("main/If_3.then_branch") and local functions ("function:Foo").
    """

    path: str
    opset: int | None
    proto: Any = field(repr=False)
    producer: str = ""
    _constants: dict[str, Callable[[], TensorRef]] = field(default_factory=dict, repr=False, compare=False)

    def initializer(self, name: str) -> TensorRef | None:
        make = self._constants.get(name)
        return None if make is None else make()

    def nodes(self) -> Iterator[tuple[str, Any]]:
        yield from with_function_nodes(self.proto)


def load_onnx(path: str) -> OnnxModel:
    """Parse `path` as an ONNX ModelProto without loading external data.

    Every external-data location is validated first: absolute paths, `..` and symlinks that
    leave the model's folder are refused (BnauditError, one line), as are files larger than
    protobuf's 2 GiB limit and bytes that do not parse.
    """
    proto = _parse(path)
    folder = os.path.dirname(os.path.abspath(path))
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)
    constants: dict[str, Callable[[], TensorRef]] = {}
    for _where, graph in all_graphs(proto.graph):
        for tensor in graph.initializer:
            _add_constant(constants, path, folder, tensor.name, tensor)
    for _where, node in with_function_nodes(proto):
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and len(node.output) == 1:
            _add_constant_node(constants, path, folder, node)
    producer = " ".join(p for p in (proto.producer_name, proto.producer_version) if p)
    return OnnxModel(path, int(opset) if opset is not None else None, proto, producer, constants)


def _parse(path: str) -> Any:
    """The ModelProto of `path` (external data not loaded): files over protobuf's limit,
    bytes that do not parse and a model without a graph are refused with one line."""
    onnx = _import_onnx()
    try:
        size = os.stat(path).st_size
        if size > PROTOBUF_LIMIT:
            raise BnauditError(
                f"{path}: {size} bytes, more than protobuf's 2 GiB limit for one ONNX file "
                "(large models keep their weights as external data): refused"
            )
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise BnauditError(f"{path}: cannot open ({exc.strerror or exc})") from None
    try:
        proto = onnx.ModelProto.FromString(data)
    except Exception as exc:  # DecodeError, RecursionError from nesting: a malformed file
        raise BnauditError(f"{path}: malformed ONNX protobuf ({exception_line(exc, with_type=False)})") from None
    if not proto.HasField("graph"):
        raise BnauditError(f"{path}: malformed ONNX model (no graph)")
    return proto


def _add_constant(
    constants: dict[str, Callable[[], TensorRef]], path: str, folder: str, name: str, tensor: Any
) -> None:
    if name in constants:
        return  # the main graph's (or the first) constant of that name wins
    reader = _tensor_reader(path, folder, name, tensor)
    constants[name] = reader


def _add_constant_node(constants: dict[str, Callable[[], TensorRef]], path: str, folder: str, node: Any) -> None:
    name = node.output[0]
    for attr in node.attribute:
        if attr.name == "value" and attr.HasField("t"):
            _add_constant(constants, path, folder, name, attr.t)
        elif attr.name == "value_float":
            value = [float(attr.f)]
            constants.setdefault(name, _values_ref(name, (), "float32", value))
        elif attr.name == "value_floats":
            values = [float(v) for v in attr.floats]
            constants.setdefault(name, _values_ref(name, (len(values),), "float32", values))


def _values_ref(name: str, shape: tuple[int, ...], dtype: str, values: list[float]) -> Callable[[], TensorRef]:
    return lambda: TensorRef(name, shape, dtype, lambda: list(values))


def _tensor_reader(path: str, folder: str, name: str, tensor: Any) -> Callable[[], TensorRef]:
    """A maker of the TensorRef of one TensorProto; external locations are validated now,
    the bytes are read when the TensorRef is read."""
    shape = tuple(int(d) for d in tensor.dims)
    if any(d < 0 for d in shape):
        raise BnauditError(f"{path}: tensor '{name}' has a negative dimension {list(shape)}")
    dtype = _ONNX_DTYPES.get(tensor.data_type)
    count = math.prod(shape)
    external = _external_entry(path, folder, name, tensor) if tensor.data_location == _EXTERNAL else None
    if dtype is None:
        return lambda: _unsupported(path, name, tensor.data_type, shape)
    if external is not None:
        location, offset, length = external
        nbytes = count * _ITEMSIZE[dtype]
        if length is not None and length != nbytes:
            raise BnauditError(
                f"{path}: tensor '{name}' claims {length} bytes of external data for shape {list(shape)} ({dtype})"
            )
        real_folder = os.path.realpath(folder)
        return lambda: _external_ref(path, real_folder, location, name, offset, nbytes, dtype, shape)
    return lambda: TensorRef(name, shape, dtype, lambda: _embedded_values(path, name, tensor, dtype, count))


def _unsupported(path: str, name: str, data_type: int, shape: tuple[int, ...]) -> TensorRef:
    def fail() -> list[float]:
        raise BnauditError(f"{path}: tensor '{name}' has ONNX data type {data_type}, not a number bnaudit reads")

    return TensorRef(name, shape, f"onnx-type-{data_type}", fail)


def _external_entry(path: str, folder: str, name: str, tensor: Any) -> tuple[str, int, int | None]:
    """(real path of the data file, offset, length or None) of an external tensor, the path
    checked to stay inside the model's folder."""
    entries = {e.key: e.value for e in tensor.external_data}
    location = entries.get("location", "")
    shown = location[:200]
    if not location or "\x00" in location:
        raise BnauditError(f"{path}: tensor '{name}' has external data without a usable location")
    parts = location.replace("\\", "/").split("/")
    if os.path.isabs(location) or location.startswith(("/", "\\")) or (len(location) > 1 and location[1] == ":"):
        raise BnauditError(f"{path}: external data location '{shown}' is an absolute path: refused")
    if ".." in parts:
        raise BnauditError(f"{path}: external data location '{shown}' leaves the model's folder (..): refused")
    real_folder = os.path.realpath(folder)
    target = os.path.realpath(os.path.join(real_folder, *[p for p in parts if p not in ("", ".")]))
    # a Hugging Face cache snapshot's files are links into its repo's blobs/: that far only
    if os.path.commonpath([real_folder, target]) != real_folder and not in_blobs(folder, target):
        raise BnauditError(f"{path}: external data location '{shown}' resolves outside the model's folder: refused")
    try:
        offset = int(entries.get("offset", "0") or "0")
        length = int(entries["length"]) if entries.get("length") else None
    except ValueError:
        raise BnauditError(f"{path}: tensor '{name}' has a malformed external data offset or length") from None
    if offset < 0 or (length is not None and length < 0):
        raise BnauditError(f"{path}: tensor '{name}' has a negative external data offset or length")
    return target, offset, length


def _open_inside(folder: str, target: str) -> int:
    """A read-only descriptor of `target` opened component by component from `folder`, every
    component with O_NOFOLLOW: the path was checked when the model was loaded (`target` is
    its real path, so it holds no symlink then); a folder swapped for a symlink since fails
    to open (ELOOP / ENOTDIR) instead of leading outside. Where the platform has no dir_fd,
    the descriptor's own path is checked once it is open."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
    parts = os.path.relpath(target, folder).split(os.sep)
    if os.open not in os.supports_dir_fd or not hasattr(os, "O_DIRECTORY"):
        fd = os.open(target, flags)
        real = os.path.realpath(target)
        if os.path.commonpath([folder, real]) != folder or not os.path.samestat(os.fstat(fd), os.stat(real)):
            os.close(fd)
            raise OSError(0, "the path changed since it was checked")
        return fd
    directory = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in parts[:-1]:
            inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=directory)
            os.close(directory)
            directory = inner
        return os.open(parts[-1], flags, dir_fd=directory)
    finally:
        os.close(directory)


def _external_ref(
    path: str, folder: str, location: str, name: str, offset: int, nbytes: int, dtype: str, shape: tuple[int, ...]
) -> TensorRef:
    def raw() -> bytearray:
        try:
            fd = _open_inside(folder, location)
        except OSError as exc:
            raise BnauditError(
                f"{path}: external data of '{name}' cannot be opened inside the model's folder ({exc.strerror or exc})"
            ) from None
        with os.fdopen(fd, "rb", buffering=0) as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise BnauditError(f"{path}: external data of '{name}' is not a regular file")
            if offset + nbytes > info.st_size:
                raise BnauditError(
                    f"{path}: external data of '{name}' lies past the end of its file "
                    f"(bytes {offset}..{offset + nbytes}, file has {info.st_size})"
                )
            data = bytearray(nbytes)
            if nbytes:
                read_into(f, offset, memoryview(data), location)
        return data

    return TensorRef(name, shape, dtype, lambda: decode_values(raw(), dtype), location=None)


def _embedded_values(path: str, name: str, tensor: Any, dtype: str, count: int) -> list[float]:
    """The values of a tensor stored inside the protobuf: raw little-endian bytes, or the
    typed repeated fields (float_data, int32_data holding float16/bfloat16 bit patterns, ...)."""
    if tensor.HasField("raw_data"):
        raw = tensor.raw_data
        if len(raw) != count * _ITEMSIZE[dtype]:
            raise BnauditError(f"{path}: tensor '{name}' has {len(raw)} bytes for {count} values of {dtype}")
        return decode_values(raw, dtype)
    if dtype == "float32":
        values: list[float] = [float(v) for v in tensor.float_data]
    elif dtype == "float64":
        values = [float(v) for v in tensor.double_data]
    elif dtype in ("float16", "bfloat16"):
        bits = struct.pack(f"<{len(tensor.int32_data)}H", *(v & 0xFFFF for v in tensor.int32_data))
        values = decode_values(bits, dtype)
    elif dtype == "int64":
        values = [int(v) for v in tensor.int64_data]
    elif dtype in ("uint32", "uint64"):
        values = [int(v) for v in tensor.uint64_data]
    else:
        values = [int(v) for v in tensor.int32_data]
    if len(values) != count:
        raise BnauditError(f"{path}: tensor '{name}' has {len(values)} values for shape {list(tensor.dims)}")
    return values


def external_data_files(path: str) -> set[str]:
    """Real paths of the external-data files an ONNX model refers to (inside its folder),
    so that a directory scan does not audit them as checkpoints of their own; empty when
    the model cannot be read (its own report says why)."""
    try:
        proto = _parse(path)
    except BnauditError:  # unreadable here: reported when the model itself is read
        return set()
    folder = os.path.dirname(os.path.abspath(path))
    found: set[str] = set()
    tensors: list[Any] = []
    for _where, graph in all_graphs(proto.graph):
        tensors += graph.initializer
    for _where, node in with_function_nodes(proto):
        tensors += [a.t for a in node.attribute if a.HasField("t")]
    for tensor in tensors:
        if tensor.data_location == _EXTERNAL:
            try:
                found.add(_external_entry(path, folder, tensor.name, tensor)[0])
            except BnauditError:
                continue
    return found


def _f32(x: float) -> float:
    """The shortest decimal that rounds to the same float32 as `x` (attributes are float32:
    9.99999975e-06 is eps 1e-05 as written)."""
    if not math.isfinite(x):
        return x
    try:
        packed = struct.pack("<f", x)
    except OverflowError:
        return x
    for digits in range(1, 10):
        candidate = float(f"{x:.{digits}g}")
        if struct.pack("<f", candidate) == packed:
            return candidate
    return x


def _attributes(node: Any) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for attr in node.attribute:
        if attr.type == 1:  # FLOAT
            values[attr.name] = float(attr.f)
        elif attr.type == 2:  # INT
            values[attr.name] = int(attr.i)
    return values


@dataclass(frozen=True)
class _Mode:
    training: bool
    why: str  # "training_mode=1", "is_test absent (BatchNormalization-6 defaults to 0: training)"


def _training_mode(node: Any, attrs: dict[str, Any], version: int) -> _Mode:
    """Whether the node normalises with the batch's statistics, by what its version defines."""
    if version >= 14:
        value = attrs.get("training_mode")
        if value is None:
            return _Mode(False, "training_mode absent (default 0)")
        return _Mode(value != 0, f"training_mode={value}")
    if version >= 7:
        outputs = sum(1 for o in node.output if o)
        if outputs > 1:
            return _Mode(True, f"{outputs} outputs (Y, mean, var, ...: the training-mode output case)")
        return _Mode(False, "one output (test mode)")
    value = attrs.get("is_test")
    if value is None:
        return _Mode(True, f"is_test absent (BatchNormalization-{version} defaults to 0: training)")
    return _Mode(value == 0, f"is_test={value}")


def _layer_name(node: Any, inputs: list[str], fallback: str) -> str:
    """The PyTorch module name where the exporter kept it in the statistics' names
    (`layer1.0.bn1.running_mean` -> `layer1.0.bn1`), else the node's name."""
    mean, var = inputs[3], inputs[4]
    if mean.endswith(".running_mean") and var.endswith(".running_var"):
        prefix = mean.removesuffix(".running_mean")
        if prefix == var.removesuffix(".running_var") and prefix:
            return prefix
    scale = inputs[1]
    if scale.endswith(".weight") and inputs[2] == scale.removesuffix(".weight") + ".bias":
        return scale.removesuffix(".weight")
    return node.name or fallback


def batchnorm_layer_name(node: Any, index: int) -> str:
    """The layer name `read_onnx` gives BatchNormalization node `node`, the `index`-th of
    `OnnxModel.nodes()` (before a repeated name gets its `#index` suffix)."""
    return _layer_name(node, list(node.input), node.name or f"BatchNormalization_{index}")


def constant(model: OnnxModel, name: str) -> TensorRef | None:
    """The constant `name` stands for, through Identity nodes (see `_identity_sources`), or None."""
    return model.initializer(_resolve(name, _identity_sources(model)))


def _identity_sources(model: OnnxModel) -> dict[str, str]:
    """output -> input of every Identity node (the legacy exporter shares equal initializers
    through Identity nodes: `bn.running_var = Identity(bn.weight)`)."""
    return {
        node.output[0]: node.input[0]
        for _where, node in model.nodes()
        if node.op_type == "Identity" and node.domain in ("", "ai.onnx") and node.input and node.output
    }


def _resolve(name: str, identities: dict[str, str]) -> str:
    seen: set[str] = set()
    while name in identities and name not in seen:
        seen.add(name)
        name = identities[name]
    return name


def _graph_inputs(model: OnnxModel) -> set[str]:
    names: set[str] = set()
    for _where, graph in all_graphs(model.proto.graph):
        names |= {i.name for i in graph.input}
    for function in model.proto.functions:
        names |= set(function.input)
    return names


def _bn_version(onnx: Any, opset: int | None) -> int:
    """The BatchNormalization version an opset implies (its schema's since_version)."""
    try:
        return int(onnx.defs.get_schema("BatchNormalization", opset if opset is not None else 15).since_version)
    except Exception:  # an opset older than 1 or newer than the installed onnx knows
        return 15 if (opset or 15) >= 15 else 1


def _function_opsets(model: OnnxModel) -> dict[str, int]:
    opsets: dict[str, int] = {}
    for function in model.proto.functions:
        version = next((o.version for o in function.opset_import if o.domain in ("", "ai.onnx")), None)
        if version is not None:
            opsets[f"function:{function.name}"] = int(version)
    return opsets


def _graph_words(where: str) -> str:
    if where == "main":
        return "main graph"
    if where.startswith("function:"):
        return f"function {where.removeprefix('function:')}"
    return f"subgraph {where}"


def read_onnx(path: str) -> Checkpoint:
    """The BatchNormalization nodes of an ONNX model as a Checkpoint (format "onnx").

    One layer per node whose four statistics inputs are constants; nodes fed by graph inputs
    or computed values are listed in `Checkpoint.unauditable`. `Checkpoint.folded` describes
    the evidence that an exporter folded BN into Conv nodes: the graph has no
    BatchNormalization node but Conv nodes with constant weights and bias, or (in any graph)
    Conv nodes whose weights torch's legacy exporter computed by constant folding (named
    `onnx::Conv_N` instead of the module's parameter).
    """
    onnx = _import_onnx()
    model = load_onnx(path)
    identities = _identity_sources(model)
    inputs_of_graphs = _graph_inputs(model)
    function_opsets = _function_opsets(model)
    tensors: dict[str, TensorRef] = {}
    modules: dict[str, ModuleInfo] = {}
    unauditable: list[str] = []
    unauditable_layers: dict[str, str] = {}
    bn_nodes = 0
    convs: list[str] = []  # Conv nodes whose weight and bias are constants
    computed: list[str] = []  # ... whose weight the exporter computed by constant folding
    quantized: list[str] = []  # integer convolutions and matmuls (a quantized graph)
    for index, (where, node) in enumerate(call_sites(model.proto)):
        if node.op_type in QUANTIZED_OPS and node.domain in ("", "ai.onnx", "com.microsoft"):
            quantized.append(node.name or f"{node.op_type}_{index}")
            continue
        if node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type == "Conv":
            if (
                len(node.input) >= 3
                and node.input[2]
                and all(model.initializer(_resolve(n, identities)) is not None for n in node.input[1:3])
            ):
                convs.append(node.name or f"Conv_{index}")
                # torch's legacy exporter names the tensors its constant folding computed
                # "onnx::Conv_17": a weight that is no module parameter, folded BN's signature
                if _resolve(node.input[1], identities).startswith("onnx::"):
                    computed.append(node.name or f"Conv_{index}")
            continue
        op = onnx_op(node.op_type)
        if op is None or op.kind is not NormKind.BATCH_NORM:
            continue
        bn_nodes += 1
        opset = function_opsets.get(where.split("/")[0], model.opset)
        version = _bn_version(onnx, opset)
        label = node.name or f"BatchNormalization_{index}"
        node_words = f"node '{label}' in {_graph_words(where)}"
        source = f"{node_words}, BatchNormalization-{version}, opset {opset if opset is not None else '?'}"
        inputs = list(node.input)
        if len(inputs) < 5:
            unauditable.append(f"{node_words}: {len(inputs)} inputs instead of 5 (X, scale, B, mean, var)")
            unauditable_layers[unauditable[-1]] = label
            continue
        name = _layer_name(node, inputs, label)
        refs: dict[str, TensorRef] = {}
        missing: list[str] = []
        for (leaf, onnx_name), input_name in zip(_BN_INPUTS, inputs[1:5]):
            ref = model.initializer(_resolve(input_name, identities)) if input_name else None
            if ref is None:
                fed = (
                    "a graph input" if _resolve(input_name, identities) in inputs_of_graphs else "computed in the graph"
                )
                missing.append(f"{onnx_name} '{input_name}' is {fed}")
            else:
                refs[leaf] = ref
        if missing:
            unauditable.append(f"{node_words}: {'; '.join(missing)}: not constants, cannot be audited")
            unauditable_layers[unauditable[-1]] = name
            continue
        if name in modules:
            name = f"{name}#{index}"
        if any(len(r.shape) != 1 for r in (refs["running_mean"], refs["running_var"])):
            unauditable.append(
                f"{node_words}: statistics of shape {list(refs['running_var'].shape)} (spatial=0, per activation): "
                "not audited"
            )
            unauditable_layers[unauditable[-1]] = name
            continue
        attrs = _attributes(node)
        eps = _f32(attrs.get("epsilon", 1e-5))
        onnx_momentum = _f32(attrs.get("momentum", 0.9))
        mode = _training_mode(node, attrs, version)
        for leaf, ref in refs.items():
            tensors[f"{name}.{leaf}"] = ref.renamed(f"{name}.{leaf}")
        modules[name] = ModuleInfo(
            class_name=node.op_type,
            eps=eps,
            momentum=_f32(pytorch_momentum(onnx_momentum)),
            track_running_stats=True,
            training_mode=mode.training,
            source=source,
            training_reason=mode.why,
            calls=(op.name,),
            output=node.output[0] if where == "main" and node.output else None,
        )
    ckpt = Checkpoint(
        path,
        "onnx",
        tensors,
        modules=modules,
        holds_module=True,
        metadata={"onnx.producer": model.producer, "onnx.opset": str(model.opset) if model.opset is not None else ""},
        unauditable=unauditable,
        unauditable_layers=unauditable_layers,
        graph=model,
    )
    if quantized:
        ckpt.quantized = (
            f"{plural(len(quantized), 'quantized convolution or matmul node')} ({listing(quantized)}) with integer "
            "weights"
        )
    if computed:
        ckpt.folded = f"{_conv_list(computed)} with weights computed by the exporter's constant folding (onnx::Conv_*)"
        if bn_nodes == 0:
            ckpt.folded = f"no BatchNormalization node; {ckpt.folded}"
    elif bn_nodes == 0 and convs:
        ckpt.folded = f"no BatchNormalization node; {_conv_list(convs)} with constant weights and bias"
        ckpt.folded_ambiguous = True
    return ckpt


# Integer convolutions and matmuls of a quantized graph (onnxruntime's quantize_dynamic writes
# ConvInteger / MatMulInteger after DynamicQuantizeLinear; static quantization QLinearConv):
# a BN folded into them is in their integer weights and scales, which bnaudit does not read.
QUANTIZED_OPS = ("ConvInteger", "MatMulInteger", "QLinearConv", "QLinearMatMul")


def _conv_list(names: list[str]) -> str:
    return f"{plural(len(names), 'Conv node')} ({listing(names)})"

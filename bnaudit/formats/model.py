"""The records every reader returns: lazy tensors, module settings, a checkpoint.

`TensorRef` is the contract between readers and everything after them. It holds a
tensor's `name`, `shape` and `dtype` (torch's name of the stored type) and reads
nothing until asked:

  read()       the values as a flat row-major list of Python numbers, exactly (every
               stored float type widens exactly to a double); torch-free, so `inspect`
               of a safetensors file never imports torch or numpy
  to_torch()   a torch tensor of the stored dtype and shape that the caller may write
               to; the file is never changed
  location     (offset, nbytes) of the raw little-endian row-major bytes in the file it
               came from, or None (a tensor inside a pickle): lets a data reader stream
               rows without parsing the file a second time

A failed read raises `BnauditError` naming the tensor. Separate from the readers so that
audit/ and runtime/ depend on these records, not on any file format.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from bnaudit.errors import BnauditError

_T = TypeVar("_T")


@dataclass(frozen=True)
class TensorRef:
    """A tensor that is read only when `read()` or `to_torch()` is called.

    `dtype` is the torch-style name (`float32`, `bfloat16`, `int64`, ...) of the
    stored type. `read()` returns the values as a flat row-major list of Python
    numbers (floats exact: every stored float type widens exactly to a double), so
    that inspecting a safetensors file needs neither torch nor numpy.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    _reader: Callable[[], list[float]] = field(repr=False, compare=False)
    # Builds the torch tensor directly (whole weights for --arch): None means from read().
    _torch: Callable[[], Any] | None = field(default=None, repr=False, compare=False)
    # (offset, nbytes) of the raw little-endian, row-major bytes in the file the tensor was
    # read from, for readers that stream it in slices; None where they lie otherwise.
    location: tuple[int, int] | None = field(default=None, compare=False)
    # The storage view a pickle rebuilt it from (formats/views.StorageView): a writer rebuilds
    # the file's tensors over shared storages from it, as torch.load does; None elsewhere.
    view: Any = field(default=None, repr=False, compare=False)

    def __setstate__(self, state: Any) -> None:
        # a pickle's BUILD would replace what reading returns (frozen is no guard against it)
        raise TypeError("a tensor record takes no pickled state")

    @property
    def is_floating(self) -> bool:
        return self.dtype.startswith(("float", "bfloat"))

    @property
    def is_integer(self) -> bool:
        return self.dtype.startswith(("int", "uint"))

    def read(self) -> list[float]:
        try:  # `_guarded` inlined: an audit reads every BN tensor of every file
            return self._reader()
        except BnauditError:
            raise
        except Exception as exc:  # a torn file or exotic storage: say which tensor
            raise BnauditError(f"cannot read tensor '{self.name}': {exc}") from exc

    def to_torch(self) -> Any:
        """The tensor with its stored dtype and shape; writing to it never reaches the file."""
        if self._torch is not None:
            return self._guarded(self._torch)
        import torch

        values = self.read()
        return torch.tensor(values, dtype=getattr(torch, self.dtype)).reshape(self.shape)

    def renamed(self, name: str) -> TensorRef:
        # a copy of the fields, not dataclasses.replace nor the frozen __init__ (a third of the
        # cost): a folder scan renames every tensor of every file
        new = _new(TensorRef)
        fields = new.__dict__
        fields.update(self.__dict__)
        fields["name"] = name
        return new

    def _guarded(self, reader: Callable[[], _T]) -> _T:
        try:
            return reader()
        except BnauditError:
            raise
        except Exception as exc:  # a torn file or exotic storage: say which tensor
            raise BnauditError(f"cannot read tensor '{self.name}': {exc}") from exc


_new = object.__new__


def lazy_ref(
    name: str,
    shape: tuple[int, ...],
    dtype: str,
    reader: Callable[[], list[float]],
    to_torch: Callable[[], Any] | None = None,
    location: tuple[int, int] | None = None,
    view: Any = None,
) -> TensorRef:
    """`TensorRef(name, shape, dtype, reader, to_torch, location, view)`, its fields set without
    the frozen __init__ (a third of the cost): a folder scan builds one for every tensor of
    every file."""
    new = _new(TensorRef)
    fields = new.__dict__
    fields["name"], fields["shape"], fields["dtype"] = name, shape, dtype
    fields["_reader"], fields["_torch"], fields["location"], fields["view"] = reader, to_torch, location, view
    return new


@dataclass(frozen=True)
class ModuleInfo:
    """What a pickled or scripted module (or an exported graph's node) says about one
    normalisation layer.

    `momentum` is always in PyTorch's convention (the weight of the new batch); an ONNX
    node's retained fraction m is stored as 1 - m. `training_mode` (exported graphs only):
    the node normalises with the batch's statistics, `training_reason` says what in the node
    says so ("training_mode=1"). `source` names where the settings came from ("node 'X' in
    main graph, BatchNormalization-15, opset 17"). None: the format cannot say.

    What `bnaudit.normkinds.module_kind` classifies it by: `class_name` (a TorchScript
    module's original class, an ONNX node's op type), `bases` (the qualified names of its
    base classes, nearest first, where the class itself is known: a pickled module) and
    `calls` (the normalisation operators its own code calls, canonical names: a
    TorchScript module, whose base classes are lost).
    """

    class_name: str
    eps: float | None
    momentum: float | None  # None: cumulative average (momentum=None)
    track_running_stats: bool | None = None
    momentum_known: bool = True
    training_mode: bool | None = None
    source: str | None = None
    training_reason: str | None = None
    bases: tuple[str, ...] = ()
    calls: tuple[str, ...] = ()
    # TorchScript: the saved module's training flag, which torch.jit.load restores (a
    # model saved in training mode is loaded in training mode until .eval()); None: unknown
    saved_training: bool | None = None
    # exported graphs: the value the node writes (an ONNX node of the main graph: its first
    # output), where a runtime reads the layer's output (`bnaudit parity`); None: none to read
    output: str | None = None


@dataclass(frozen=True)
class Averaging:
    """What a file says about an averaged copy of a model (SWA or EMA weights).

    `kind`: "AveragedModel" (torch.optim.swa_utils), "timm ModelEmaV2", "timm ModelEmaV3",
    "EMA (unknown kind)", "EMA copy recalibrated by bnaudit". `n_averaged`: how many models
    were averaged into the copy (AveragedModel's `n_averaged` buffer), None where the file
    does not say. `buffers`: what the copy's BN buffers are: "copied" (the live model's, as
    of the last update: AveragedModel(use_buffers=False)), "averaged" (averaged like the
    weights: use_buffers=True, timm EMA), "recalibrated" (population statistics `bnaudit
    recalibrate` wrote), or "unknown" (the file cannot tell). `counter_meaning`:
    one line saying what the copy's `num_batches_tracked` counts (an averaged counter
    counts no batches; a copied one is the live model's training counter).
    """

    kind: str
    n_averaged: int | None
    buffers: str  # "copied", "averaged", "recalibrated", "unknown"
    counter_meaning: str

    def describe(self) -> str:
        """One line: "AveragedModel of 20 models, buffers copied from the live model"."""
        count = "" if self.n_averaged is None else f" of {self.n_averaged} model{'' if self.n_averaged == 1 else 's'}"
        buffers = {
            "copied": "buffers copied from the live model",
            "averaged": "buffers averaged",
            "recalibrated": "statistics re-estimated by bnaudit recalibrate",
        }.get(
            self.buffers,
            "buffers copied or averaged: unknown (use_buffers is not saved; diff against the live model "
            "tells: copied ones equal its own)",
        )
        return f"{self.kind}{count}, {buffers}"


@dataclass
class Checkpoint:
    """One checkpoint as a reader opened it: its state dict as lazy tensors by name, and what
    the file says about the layout around them (container key, prefix, modules, shards)."""

    path: str
    format: str
    tensors: dict[str, TensorRef]
    key: str | None = None
    other_keys: list[str] = field(default_factory=list)
    prefix: str = ""
    # Where the tensors are stored in the container when that is not `key` (`stored_key`):
    # ema-pytorch's `ema_model` and `online_model` are two models of one stored state dict,
    # their names carried in `prefix` ("ema_model.").
    stored_at: str | None = None
    is_ema: bool = False
    # An averaged copy (SWA / EMA weights): how it was averaged, None for a live model.
    averaging: Averaging | None = None
    # An averaged copy's live model, when the same container holds it beside the copy
    # (timm's {"state_dict", "state_dict_ema"}): its tensors, names stripped alike; the
    # copy's statistics are judged against its (bnaudit.audit.rules.checkpoint BN003).
    live_tensors: dict[str, TensorRef] | None = field(default=None, repr=False, compare=False)
    # An averaged copy's EMA schedule as the container's training arguments record it
    # (formats.ema.EmaSchedule), None where they record none.
    ema_schedule: Any = None
    modules: dict[str, ModuleInfo] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    holds_module: bool = False
    # A PEFT adapter folder composed with its base (formats.peft.AdapterInfo), else None.
    adapter: Any = None
    # Objects outside the state dict left unloaded by the stand-in reader, one note each
    # ("hyper_parameters holds omegaconf.DictConfig: not loaded").
    not_loaded: list[str] = field(default_factory=list)
    # Sharded layouts (formats/shards.py): how many files an index joined into this
    # checkpoint (0: one file), or (k, N) for one shard read without its index.
    shards: int = 0
    shard_of: tuple[int, int] | None = None
    # Exported graphs (formats/onnx.py): BatchNormalization nodes whose statistics are not
    # constants, one printable note each; and, for a graph without any BatchNormalization
    # node, the evidence that an exporter folded BN into its Conv nodes (else None).
    unauditable: list[str] = field(default_factory=list)
    # note -> the layer it is about, where the reader knows it (its findings name the layer)
    unauditable_layers: dict[str, str] = field(default_factory=dict)
    folded: str | None = None
    # True when `folded` rests on convolutions with constant weights and bias alone, which a
    # network that never had BN shows as well (no weight the exporter computed)
    folded_ambiguous: bool = False
    # An ONNX graph's quantized convolutions (ConvInteger, QLinearConv, ...), in words: their
    # integer weights are not examined (None where the graph has none).
    quantized: str | None = None
    # torch.export programs (formats/pt2.py): what says BN was decomposed into elementwise
    # arithmetic (no batch-norm node left), else None; and notes on the program's nodes
    # (a cuDNN node: exported on a GPU), printed with the report.
    decomposed: str | None = None
    notes: list[str] = field(default_factory=list)
    # The parsed graph of an ONNX model (formats.onnx.OnnxModel): diff pairs folded convs
    # from it without parsing the file again.
    graph: Any = field(default=None, repr=False, compare=False)


def stored_key(ckpt: Checkpoint) -> str | None:
    """The key path of the mapping that stores `ckpt`'s tensors in its container (writers
    replace entries there, under `ckpt.prefix` + name): `ckpt.stored_at`, else `ckpt.key`."""
    return ckpt.stored_at if ckpt.stored_at is not None else ckpt.key


def torch_ref(name: str, tensor: Any) -> TensorRef:
    dtype = str(tensor.dtype).removeprefix("torch.")

    def read() -> list[float]:
        values: list[float] = tensor.detach().reshape(-1).tolist()  # Python floats: exact for every float dtype
        return values

    # torch.load(mmap=True) maps the file privately: a write to the tensor stays in memory
    return TensorRef(name, tuple(int(s) for s in tensor.shape), dtype, read, tensor.detach)


def file_slice_ref(path: str, name: str, offset: int, length: int, dtype: str, shape: tuple[int, ...]) -> TensorRef:
    def raw() -> bytearray:
        data = bytearray(length)  # ours and writable: torch.frombuffer can share it, no copy
        if length:
            with open(path, "rb", buffering=0) as f:
                read_into(f, offset, memoryview(data), path)
        return data

    def to_torch() -> Any:
        import torch

        if length == 0:
            return torch.empty(shape, dtype=getattr(torch, dtype))
        return torch.frombuffer(raw(), dtype=getattr(torch, dtype)).reshape(shape)

    return TensorRef(name, shape, dtype, lambda: decode_values(raw(), dtype), to_torch, location=(offset, length))


def read_into(f: Any, offset: int, target: memoryview, path: str) -> None:
    """Fill `target` with the bytes of the unbuffered file `f` at `offset`: a single read
    returns at most about 2 GiB, so loop; the file ending first is a truncated tensor."""
    f.seek(offset)
    while len(target):
        n = f.readinto(target)
        if not n:
            raise BnauditError(f"{path}: truncated tensor data")
        target = target[n:]


def _typecode(codes: str, size: int) -> str:
    """The array typecode of that item size: C's int widths are the platform's."""
    return next(c for c in codes if array(c).itemsize == size)


_ARRAY_CODES = {
    "float64": "d",
    "float32": "f",
    **{f"int{8 * n}": _typecode("bhilq", n) for n in (1, 2, 4, 8)},
    **{f"uint{8 * n}": _typecode("BHILQ", n) for n in (1, 2, 4, 8)},
}


# How many elements a view may claim beyond its storage's: only zero strides (a buffer
# saved as `x.expand(n)`, which torch.load reads) can claim more, and decoding allocates
# the claim, so a forged 2**40 stays refused while any real BN vector fits.
EXPANDED_LIMIT = 1 << 20


def claim_too_large(numel: int, stored: int) -> bool:
    """A view of `numel` elements over a storage of `stored`: more than the storage holds
    and more than EXPANDED_LIMIT."""
    return numel > stored and numel > EXPANDED_LIMIT


def decode_values(raw: bytes | bytearray, dtype: str) -> list[float]:
    """Little-endian bytes of `dtype` -> flat list of Python numbers, exactly.

    float16 through struct's IEEE half format; bfloat16 by placing its two bytes as
    the high half of a float32 (which is what bfloat16 is).
    """
    if dtype == "bool":
        return [b != 0 for b in raw]
    if dtype == "float16":
        return list(struct.unpack(f"<{len(raw) // 2}e", raw))
    if dtype == "bfloat16":
        widened = bytearray(2 * len(raw))
        widened[2::4], widened[3::4] = raw[0::2], raw[1::2]
        raw, dtype = bytes(widened), "float32"
    code = _ARRAY_CODES.get(dtype)
    if code is None:
        raise BnauditError(f"{dtype} tensors cannot be decoded without torch")
    values: array[float] = array(code)
    values.frombytes(raw)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


STORAGE_ITEMSIZE = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}

# Element types a torch.save file can also hold (complex, unsigned, float8, quantized): their
# sizes bound a view like any other's; only torch decodes their values (`to_torch`).
OTHER_ITEMSIZE = {
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "complex32": 4,
    "complex64": 8,
    "complex128": 16,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "qint8": 1,
    "quint8": 1,
    "qint32": 4,
    "quint4x2": 1,
    "quint2x4": 1,
}


STORAGE_DTYPES = {
    "FloatStorage": "float32",
    "DoubleStorage": "float64",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
}

# Storage classes of the element types in OTHER_ITEMSIZE (torch.save names them so).
OTHER_STORAGE_DTYPES = {
    "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128",
    "QInt8Storage": "qint8",
    "QUInt8Storage": "quint8",
    "QInt32Storage": "qint32",
    "QUInt4x2Storage": "quint4x2",
    "QUInt2x4Storage": "quint2x4",
}

"""What each global a pickle names becomes, by mode: the policy of the restricted unpickler.

formats/unpickle.py interprets the opcodes; everything an opcode asks of a global (GLOBAL,
REDUCE, NEWOBJ, BUILD, a persistent id) is answered by a `Policy` here. The modes, one per
kind of pickle bnaudit reads:

  TORCH_SAVE    a torch.save file's object (zip `data.pkl`, a legacy file's main pickle,
                Lightning hparams included), to audit: tensors as lazy views, `torch.nn`
                modules as `PickledModule`s, plain data (containers, argparse.Namespace,
                defaultdict with a dict/list/set/int factory, Counter, bytearray, complex,
                _codecs.encode), torch's constants as records (Size, dtypes, device, layouts,
                qschemes, memory formats, TorchVersion), numpy's plain-data globals as
                recorded calls, tensor kinds bnaudit does not read (quantized, sparse,
                nested, meta, wrapper subclasses, a tensor subclass of the user's) as calls
                recorded and not loaded; any other global a `StandIn`, refused when the
                pickle calls it (formats/standins.py then refuses a stand-in inside the
                audited state dict)
  TENSORS       tensors and plain containers only (a DCP chunk or object, a data file): any
                other global is refused
  TORCHSCRIPT   a TorchScript archive's `data.pkl`: `__torch__` classes as `ScriptObject`s,
                torch.jit's list builders, tensors; any other global is refused
  DCP_METADATA  torch.distributed.checkpoint's `.metadata`: its dataclasses as `Record`s,
                torch.Size, dtypes, layouts, memory-format codes, pathlib paths as text;
                any other global a `StandIn` (refused when called; formats/dcp.py refuses
                any it finds)
  PLAIN         no global at all (a legacy file's header pickles)
  SCAN          inert: every global a `StandIn`, every call and instance recorded, nothing
                refused but malformed bytes (the globals a pickle names, for a refusal)

BUILD sets state on records only, and on a dict only torch's `_metadata` (any other
attribute, `items` or `keys`, would change what reading the dict through it returns).

Bounds: at most `MAX_OBJECTS` objects per pickle (counted by the interpreter and here, ~100
bytes each at most); a dict key or set element (hashed) is a scalar, a record, or tuples of
at most `MAX_KEY_NODES` nodes counted with sharing expanded (a tuple that holds itself twice
level by level hashes in exponential time); a tensor view may claim more elements than its
storage only through zero strides, at most `model.EXPANDED_LIMIT` each and `MAX_EXPANDED`
in all (decoding allocates the claim).
"""

from __future__ import annotations

import argparse
import collections
import enum
import math
import pickle
from collections.abc import Callable
from typing import Any

from bnaudit.formats.model import OTHER_STORAGE_DTYPES, STORAGE_DTYPES, TensorRef
from bnaudit.formats.pickled import (
    NumpyCall,
    PickledModule,
    Record,
    ScriptObject,
    StandIn,
    StandInObject,
    TorchDevice,
    TorchSize,
    TorchValue,
    TorchVersion,
)
from bnaudit.formats.views import ITEMSIZE, Storage, as_parameter, lazy_tensor, storage_record
from bnaudit.text import shown_value

MAX_OBJECTS = 1 << 21  # objects one pickle may build
MAX_KEY_NODES = 4096
MAX_EXPANDED = 1 << 22


class Mode(enum.Enum):
    TORCH_SAVE = "torch.save"
    TENSORS = "tensors"
    TORCHSCRIPT = "TorchScript"
    DCP_METADATA = "DCP metadata"
    PLAIN = "plain data"
    SCAN = "scan"


class Refused(Exception):
    """The pickle does something its mode does not allow, or is malformed: one line."""


class RefusedGlobal(Refused):
    """The pickle names a global its mode refuses (`name`)."""

    def __init__(self, name: str) -> None:
        super().__init__(f"names the global {name}")
        self.name = name


class CalledStandIn(Refused):
    """The pickle calls (or builds through) a global that was not loaded (`name`)."""

    def __init__(self, name: str) -> None:
        super().__init__(f"the file calls {name}")
        self.name = name


class Storages:
    """Where a pickle's storages lie (formats/torchsave.py, legacy.py, torchscript.py give
    one): `storage` resolves a persistent id's fields; `big_endian`, the elements' order."""

    big_endian = False

    def storage(self, dtype: str, key: str, numel: int, view: Any) -> Storage:
        raise Refused("this pickle holds no storages")

    def module(self, pid: tuple[Any, ...]) -> Any:
        raise Refused("a persistent id of a pickled class (torch < 1.6 whole-model pickles)")

    def retyped(self, storage: Storage, dtype: str) -> Storage:
        """An untyped storage (bytes) read as elements of `dtype` (`_rebuild_tensor_v3`)."""
        itemsize = ITEMSIZE[dtype]
        return storage_record(storage.path, dtype, storage.numel // itemsize, storage.start, storage.entry)


# ----------------------------------------------------------------------------- what globals are


class Builder:
    """An allow-listed global that builds plain data: `call` for REDUCE, `new` for NEWOBJ
    (None: refused)."""

    __slots__ = ("call", "name", "new")

    def __init__(self, name: str, call: Callable[..., Any] | None, new: Callable[..., Any] | None = None) -> None:
        self.name, self.call, self.new = name, call, new

    def __repr__(self) -> str:
        return f"<{self.name}>"


class ClassRecord:
    """A class a pickle names that is instantiated only as a record: `kind` says which
    ("module", "script", "record", "numpy", "tensor class", "unread")."""

    __slots__ = ("kind", "name")

    def __init__(self, kind: str, name: str) -> None:
        self.kind, self.name = kind, name

    def __repr__(self) -> str:
        return f"<{self.name}>"


class _StorageClass:
    __slots__ = ("dtype", "untyped")

    def __init__(self, dtype: str, untyped: bool = False) -> None:
        self.dtype, self.untyped = dtype, untyped


_NN_MODULE_PREFIXES = ("torch.nn.modules.", "torch.ao.nn.", "torch.nn.intrinsic.", "torch.nn.quantized.")
_NUMPY = {
    "numpy.dtype",
    "numpy.ndarray",
    "numpy.core.multiarray.scalar",
    "numpy._core.multiarray.scalar",
    "numpy.core.multiarray._reconstruct",
    "numpy._core.multiarray._reconstruct",
}
# torch's tensor kinds bnaudit does not read: recorded, not loaded (a stand-in inside a state dict)
_UNREAD_TENSORS = {
    f"torch._utils.{name}"
    for name in (
        "_rebuild_qtensor",
        "_rebuild_sparse_tensor",
        "_rebuild_nested_tensor",
        "_rebuild_meta_tensor_no_storage",
        "_rebuild_wrapper_subclass",
        "_rebuild_device_tensor_from_numpy",
        "_rebuild_device_tensor_from_cpu_tensor",
    )
}
_QSCHEMES = {f"per_{kind}" for kind in ("tensor_affine", "tensor_symmetric", "channel_affine", "channel_symmetric")}
_QSCHEMES.add("per_channel_affine_float_qparams")
_MEMORY_FORMATS = {"contiguous_format", "channels_last", "channels_last_3d", "preserve_format"}
_DTYPES = {*ITEMSIZE, "complex32", "cfloat", "cdouble", "half", "float", "double", "long", "int", "short", "uint1"}
# defaultdict factories read as data (omegaconf 2.0 pickles `defaultdict(dict)`)
_FACTORIES = {"builtins.dict": dict, "builtins.list": list, "builtins.set": set, "builtins.int": int}
# Python 2 names a protocol 2 pickle may use, as pickle maps them (those torch files meet)
_PY2_MODULES = {"__builtin__": "builtins", "copy_reg": "copyreg", "exceptions": "builtins"}
_PY2_NAMES = {"long": "int", "unicode": "str", "xrange": "range", "basestring": "str", "unichr": "chr"}
_DCP = "torch.distributed.checkpoint."
_DCP_RECORDS = {
    **{
        f"{_DCP}metadata.{name}": name
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "BytesStorageMetadata",
            "MetadataIndex",
            "StorageMeta",
        )
    },
    f"{_DCP}filesystem._StorageInfo": "_StorageInfo",
}


def _count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _counts(values: Any) -> bool:
    return isinstance(values, (tuple, list)) and all(_count(v) for v in values)


def _small_key(key: Any) -> bool:
    """A value safe to hash: a scalar or record, or tuples of at most MAX_KEY_NODES nodes."""
    todo, seen = [key], 0
    while todo:
        value = todo.pop()
        seen += 1
        if seen > MAX_KEY_NODES:
            return False
        if isinstance(value, (tuple, frozenset)):
            todo.extend(value)
        elif isinstance(value, (list, dict, set, bytearray)):
            return False  # unhashable: refused by the caller's check, not by a TypeError
    return True


def dict_key(key: Any) -> Any:
    """`key`, checked before it is hashed (a dict key, a set element)."""
    if type(key) in (str, int, float, bool, bytes) or key is None or _small_key(key):
        return key
    raise Refused(f"a dict key or set element too large to hash ({shown_value(key, 40)})")


def set_elements(items: Any) -> list[Any]:
    """The elements of a set being built, each checked before it is hashed."""
    if not isinstance(items, (list, tuple, set, frozenset)):
        raise Refused("a set built from something that is not a list")
    return [dict_key(item) for item in items]


def _ordered_dict(*args: Any) -> collections.OrderedDict[Any, Any]:
    if not args:
        return collections.OrderedDict()
    if (
        len(args) != 1
        or not isinstance(args[0], list)
        or not all(isinstance(p, (tuple, list)) and len(p) == 2 for p in args[0])
    ):
        raise Refused("OrderedDict built from something that is not a list of pairs")
    return collections.OrderedDict((dict_key(k), v) for k, v in args[0])


def _defaultdict(factory: Any = None, *rest: Any) -> collections.defaultdict[Any, Any]:
    if rest or not (factory is None or (isinstance(factory, StandIn) and factory.name in _FACTORIES)):
        # a factory that could run code (it is called for every missing key)
        raise CalledStandIn(getattr(factory, "name", None) or "collections.defaultdict")
    return collections.defaultdict(None if factory is None else _FACTORIES[factory.name])


def _counter(mapping: Any = None) -> collections.Counter[Any]:
    if mapping is not None and type(mapping) is not dict:
        raise Refused("Counter built from something that is not a dict")
    return collections.Counter(mapping or {})


def _bytearray(source: Any = b"", encoding: Any = None) -> bytearray:
    # bytearray(n) would allocate n bytes: only text or bytes, as pickle writes them
    if isinstance(source, str) and encoding in ("latin-1", "latin1"):
        return bytearray(source.encode("latin-1"))
    if isinstance(source, bytes) and encoding is None:
        return bytearray(source)
    raise Refused("bytearray built from something that is not bytes")


def _complex(real: Any = 0.0, imag: Any = 0.0) -> complex:
    if not all(type(v) in (int, float) for v in (real, imag)):
        raise Refused("complex built from something that is not a number")
    return complex(real, imag)


def _codecs_encode(text: Any, encoding: Any = "utf-8", *rest: Any) -> bytes:
    # protocol 2 pickles bytes as _codecs.encode(str, "latin1"); nothing else is accepted
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1") or rest:
        raise Refused("_codecs.encode called with something other than latin1 text")
    return text.encode("latin1")


def _namespace(*args: Any, **kwargs: Any) -> argparse.Namespace:
    if args or not all(isinstance(k, str) for k in kwargs):
        raise Refused("argparse.Namespace built with positional arguments")
    return argparse.Namespace(**kwargs)


def _size(dims: Any = ()) -> TorchSize:
    if not _counts(dims):
        raise Refused(f"malformed torch.Size {shown_value(dims)}")
    return TorchSize(dims)


def _device(kind: Any, index: Any = None) -> TorchDevice:
    if not isinstance(kind, str) or not (index is None or _count(index)):
        raise Refused(f"malformed torch.device {shown_value(kind)}")
    return TorchDevice(kind[:100], index)


def _layout(name: Any) -> TorchValue:
    if not isinstance(name, str):
        raise Refused("malformed layout")
    return TorchValue("layout", name.removeprefix("torch.")[:100])


def _version(text: Any = "") -> TorchVersion:
    if not isinstance(text, str):
        raise Refused("malformed TorchVersion")
    return TorchVersion(text)


def _memory_format_code(value: Any) -> int:
    if not _count(value):
        raise Refused("malformed memory format")
    return int(value)


def _path(*parts: Any) -> str:
    """pathlib's reduce: (cls, parts); kept as text only."""
    if not all(isinstance(p, str) for p in parts):
        raise Refused("malformed path")
    return "/".join(parts)


def _jit_list(items: Any) -> list[Any]:
    if not isinstance(items, list):
        raise Refused("a TorchScript list built from something that is not a list")
    return list(items)


def _type_tag(value: Any, tag: Any = None) -> Any:
    return value


def _plain(name: str) -> Any | None:
    """The plain-data builder of an allow-listed global, or None."""
    table: dict[str, Builder] = {
        "collections.OrderedDict": Builder(name, _ordered_dict, lambda: collections.OrderedDict()),
        "collections.defaultdict": Builder(name, _defaultdict),
        "collections.Counter": Builder(name, _counter, lambda: collections.Counter()),
        "builtins.set": Builder(name, lambda items=(): set(set_elements(items))),
        "builtins.frozenset": Builder(name, lambda items=(): frozenset(set_elements(items))),
        "builtins.bytearray": Builder(name, _bytearray),
        "builtins.complex": Builder(name, _complex),
        "_codecs.encode": Builder(name, _codecs_encode),
        "argparse.Namespace": Builder(name, _namespace, _namespace),
    }
    return table.get(name)


# ----------------------------------------------------------------------------- the policy


def torch_save_allows(full: str) -> bool:
    """Whether `Mode.TORCH_SAVE` rebuilds the global `full` (else: a stand-in)."""
    module, _, name = full.rpartition(".")
    return Policy(Mode.TORCH_SAVE, Storages()).known(full, module, name) is not None


class Policy:
    """The answers of one mode for one pickle, and the budgets it spends."""

    def __init__(self, mode: Mode, storages: Storages) -> None:
        self.mode, self.storages = mode, storages
        self.proto = 0
        self.budget = MAX_OBJECTS
        self.expanded = MAX_EXPANDED
        self.stand_ins: dict[str, StandIn] = {}
        self.storage_cache: dict[Any, Storage] = {}

    def spend(self, n: int = 1) -> None:
        self.budget -= n
        if self.budget < 0:
            raise Refused(f"builds more than {MAX_OBJECTS} objects")

    def find(self, module: str, name: str) -> Any:
        if self.proto < 3:  # Python 2 names (torch.save writes protocol 2): __builtin__.exec is builtins.exec
            module = _PY2_MODULES.get(module, module)
            if module == "builtins":
                name = _PY2_NAMES.get(name, name)
        full = f"{module}.{name}"
        mode = self.mode
        if mode is Mode.SCAN or mode is Mode.PLAIN:
            if mode is Mode.PLAIN:
                raise RefusedGlobal(full)
            return self.stand_in(full)
        found = self.known(full, module, name)
        if found is not None:
            return found
        if mode is Mode.TORCH_SAVE or mode is Mode.DCP_METADATA:
            return self.stand_in(full)
        raise RefusedGlobal(full)

    def stand_in(self, full: str) -> StandIn:
        if full not in self.stand_ins:
            self.spend()
            self.stand_ins[full] = StandIn(full)
        return self.stand_ins[full]

    def known(self, full: str, module: str, name: str) -> Any:
        """What `full` is in this mode, or None (a stand-in or a refusal)."""
        mode = self.mode
        if mode is Mode.DCP_METADATA:
            if full in _DCP_RECORDS:
                return ClassRecord("record", _DCP_RECORDS[full])
            if module == "pathlib" and name.endswith("Path"):
                return Builder(full, _path)
            dcp_functions: dict[str, Callable[..., Any]] = {
                "torch.Size": _size,
                "torch.serialization._get_layout": _layout,
                f"{_DCP}metadata._MEM_FORMAT_ENCODING": _memory_format_code,
            }
            if full in dcp_functions:
                return Builder(full, dcp_functions[full])
            return TorchValue("dtype", name) if module == "torch" and name in _DTYPES else None
        if module == "torch" and name in STORAGE_DTYPES:
            return _StorageClass(STORAGE_DTYPES[name])
        if module == "torch" and name in OTHER_STORAGE_DTYPES:
            return _StorageClass(OTHER_STORAGE_DTYPES[name])
        if full == "torch.storage.UntypedStorage":
            return _StorageClass("uint8", untyped=True)
        tensors: dict[str, Callable[..., Any]] = {
            "torch._utils._rebuild_tensor_v2": self.rebuild_tensor,
            "torch._utils._rebuild_tensor": self.rebuild_tensor,
            "torch._utils._rebuild_tensor_v3": self.rebuild_tensor_v3,
        }
        if full in tensors:
            return Builder(full, tensors[full])
        if full == "collections.OrderedDict":
            return _plain(full)
        if mode is Mode.TORCHSCRIPT:
            if module.startswith("__torch__"):
                return ClassRecord("script", full)
            if module == "torch.jit._pickle" and name.startswith("build_"):
                return Builder(full, _jit_list)
            return Builder(full, _type_tag) if full == "torch.jit._pickle.restore_type_tag" else None
        if full in ("torch._utils._rebuild_parameter", "torch._utils._rebuild_parameter_with_state"):
            return Builder(full, _rebuild_parameter)
        if full == "_codecs.encode":
            return _plain(full)
        if mode is Mode.TENSORS:
            return None
        if full in ("torch.Tensor", "torch.nn.parameter.Parameter"):
            return ClassRecord("tensor class", full)
        if full == "torch._tensor._rebuild_from_type_v2":
            return Builder(full, self.rebuild_from_type)
        if full in _UNREAD_TENSORS:
            return ClassRecord("unread", full)
        if full.startswith(_NN_MODULE_PREFIXES) and name.isidentifier():
            return ClassRecord("module", full)
        if module == "torch":
            torch_values = {"dtype": _DTYPES, "qscheme": _QSCHEMES, "memory_format": _MEMORY_FORMATS}
            for kind, names in torch_values.items():
                if name in names:
                    return TorchValue(kind, name)
            if name in ("Size", "device"):
                return Builder(full, _size if name == "Size" else _device)
        if full == "torch.serialization._get_layout":
            return Builder(full, _layout)
        if full == "torch.torch_version.TorchVersion":
            return Builder(full, _version, _version)
        if full in _NUMPY or (module == "numpy.dtypes" and name.endswith("DType")):
            return ClassRecord("numpy", full)
        return _plain(full)

    def call(self, func: Any, args: Any) -> Any:
        """REDUCE: `func(*args)` for an allow-listed callable; a recorded call for numpy's
        and for tensor kinds not read; a refusal for anything else."""
        if type(args) is not tuple:
            raise Refused("REDUCE with arguments that are not a tuple")
        self.spend()
        if isinstance(func, Builder) and func.call is not None:
            return func.call(*args)
        if isinstance(func, ClassRecord) and func.kind == "numpy":
            return NumpyCall(func.name, args)
        if (isinstance(func, ClassRecord) and func.kind == "unread") or self.mode is Mode.SCAN:
            return StandInObject(getattr(func, "name", type(func).__name__), args)
        raise CalledStandIn(getattr(func, "name", None) or type(func).__name__)

    def new(self, cls: Any, args: Any, kwargs: dict[Any, Any]) -> Any:
        """NEWOBJ: an instance of `cls` as a record (its state comes with BUILD)."""
        if type(args) is not tuple:
            raise Refused("NEWOBJ with arguments that are not a tuple")
        self.spend()
        if isinstance(cls, StandIn) or self.mode is Mode.SCAN:
            return StandInObject(getattr(cls, "name", type(cls).__name__), args)
        if isinstance(cls, ClassRecord) and not (args or kwargs):
            makers: dict[str, Callable[[str], Any]] = {
                "module": PickledModule,
                "script": ScriptObject,
                "record": Record,
            }
            if cls.kind in makers:
                return makers[cls.kind](cls.name)
        if isinstance(cls, ClassRecord) and cls.kind == "numpy":
            return NumpyCall(cls.name, args, new=True)
        if isinstance(cls, ClassRecord) and cls.name == "torch.nn.parameter.Parameter" and args and not kwargs:
            return as_parameter(args[0], args[1] if len(args) > 1 else True)
        if isinstance(cls, Builder) and cls.new is not None:
            return cls.new(*args, **kwargs)
        raise CalledStandIn(getattr(cls, "name", None) or type(cls).__name__)

    def build(self, inst: Any, state: Any) -> None:
        """BUILD: state kept as data on a record; on a dict, torch's `_metadata` only."""
        if isinstance(inst, (StandInObject, NumpyCall, Record)):
            inst.state = state
        elif isinstance(inst, PickledModule):
            if type(state) is not dict:
                raise Refused(f"the state of {inst.class_name} is not a dict")
            inst.state = state
        elif isinstance(inst, ScriptObject):
            inst.attrs = state if type(state) is dict else {"__state__": state}
        elif type(inst) is collections.OrderedDict:
            # torch.save keeps a state dict's `_metadata` this way; any other attribute on a
            # dict (`items`, `keys`, `get`) would change what reading it through them returns
            if type(state) is not dict or any(k != "_metadata" for k in state):
                names = ", ".join(shown_value(k, 30) for k in list(state)[:3]) if type(state) is dict else "?"
                raise Refused(f"sets attributes ({names}) on a dict: only a state dict's _metadata is read")
            inst._metadata = state.get("_metadata")  # type: ignore[attr-defined]
        elif type(inst) is argparse.Namespace:
            if type(state) is not dict or not all(isinstance(k, str) for k in state):
                raise Refused("argparse.Namespace state that is not a dict of names")
            vars(inst).update(state)
        elif isinstance(inst, (StandIn, Builder, ClassRecord, _StorageClass)):
            # setting attributes of a class or a function (a stand-in, an allowed global) is no data
            raise CalledStandIn(getattr(inst, "name", None) or type(inst).__name__)
        elif self.mode is not Mode.SCAN:
            what = "a tensor record" if isinstance(inst, TensorRef) else f"a {type(inst).__name__}"
            raise Refused(f"sets state on {what} (BUILD): refused")

    def persistent(self, pid: Any) -> Any:
        if self.mode is Mode.SCAN:
            return pid
        if self.mode in (Mode.DCP_METADATA, Mode.PLAIN):
            raise Refused(f"unexpected persistent id {shown_value(pid)}")
        if isinstance(pid, tuple) and pid and pid[0] == "module":
            return self.storages.module(pid)
        if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage"):
            raise Refused(f"unexpected persistent id {shown_value(pid)}")
        kind, key, numel = pid[1], pid[2], pid[4]
        if not isinstance(kind, _StorageClass) or not isinstance(key, str) or not _count(numel):
            raise Refused(f"malformed storage record {shown_value(pid)}")
        view = pid[5] if len(pid) > 5 else None
        # cached by the view's key (a string), never by the tuple a file built: it is not hashed
        view_key = view[0] if type(view) is tuple and view and type(view[0]) is str else None
        cached = self.storage_cache.get((key, view_key)) if view is None or view_key is not None else None
        if cached is None:
            self.spend(8)
            cached = self.storages.storage(kind.dtype, key, numel, view)
            self.storage_cache[(key, view_key)] = cached
        if cached.dtype != kind.dtype:
            raise Refused(f"storage {shown_value(key, 40)} named with two element types")
        return cached

    # -- tensors

    def rebuild_tensor(
        self, storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any = False, *rest: Any
    ) -> TensorRef:
        """torch._utils._rebuild_tensor_v2 (and torch < 0.4's _rebuild_tensor): a lazy view."""
        self.spend(8)
        try:
            ref = lazy_tensor(storage, offset, size, stride, self.storages.big_endian, requires_grad)
        except pickle.UnpicklingError as exc:
            raise Refused(str(exc)) from None
        numel = math.prod(size)
        if numel > storage.numel:  # an expanded view (zero strides): decoding allocates the claim
            self.expanded -= numel
            if self.expanded < 0:
                raise Refused(f"expanded views claim more than {MAX_EXPANDED} elements in all")
        return ref

    def rebuild_tensor_v3(
        self, storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any, dtype: Any, *rest: Any
    ) -> TensorRef:
        """torch._utils._rebuild_tensor_v3: a view of an untyped storage read as `dtype`."""
        if not (isinstance(storage, Storage) and storage.dtype == "uint8" and isinstance(dtype, TorchValue)):
            raise Refused("malformed tensor record (v3)")
        if dtype.name not in ITEMSIZE:
            raise Refused(f"a tensor of {dtype.name[:40]}, a type bnaudit does not read")
        key = (storage, dtype.name)
        typed = self.storage_cache.get(key)
        if typed is None:
            typed = self.storages.retyped(storage, dtype.name)
            self.storage_cache[key] = typed
        return self.rebuild_tensor(typed, offset, size, stride, requires_grad)

    def rebuild_from_type(self, func: Any, new_type: Any, args: Any, state: Any = None) -> Any:
        """torch._tensor._rebuild_from_type_v2: a tensor (or Parameter) rebuilt by `func`; a
        subclass of the user's is recorded, not loaded."""
        if not (isinstance(func, Builder) and func.call is not None and type(args) is tuple):
            raise CalledStandIn(getattr(func, "name", None) or type(func).__name__)
        if isinstance(new_type, StandIn):
            return StandInObject(new_type.name, (func.name, args))
        if not (isinstance(new_type, ClassRecord) and new_type.kind == "tensor class"):
            raise CalledStandIn(getattr(new_type, "name", None) or type(new_type).__name__)
        tensor = func.call(*args)
        return as_parameter(tensor, False) if new_type.name.endswith("Parameter") else tensor


def _rebuild_parameter(data: Any, requires_grad: Any = False, *rest: Any) -> Any:
    """torch._utils._rebuild_parameter(_with_state): the tensor, marked a Parameter."""
    try:
        return as_parameter(data, requires_grad)
    except pickle.UnpicklingError as exc:
        raise Refused(str(exc)) from None


DICTS = {dict, collections.OrderedDict, collections.defaultdict, collections.Counter}

"""What the restricted unpickler (formats/unpickle.py) builds instead of running a pickle: records.

Nothing of a class a file names is imported or called; each global becomes one of these
plain records, holding what the pickle gave it as data:

  PickledModule   a `torch.nn` module (`torch.save(model)`): its class name and `__dict__`
  StandIn         any other global: its dotted name, nothing else; calling it is refused
  StandInObject   an instance of a stand-in class (NEWOBJ), or a call recorded and not run
                  (a tensor kind bnaudit does not read): its arguments and BUILD state
  NumpyCall       a call of one of numpy's plain-data globals, recorded: numpy is imported
                  only by a writer that needs the real object (formats/torchobjects.py)
  TorchValue      a torch dtype, layout, qscheme or memory format (`kind`, `name`)
  TorchDevice     `torch.device(type, index)`
  TorchSize       `torch.Size`: a tuple of counts
  TorchVersion    `torch.torch_version.TorchVersion`: a version string
  ScriptObject    an instance of a TorchScript `__torch__` class: its attributes
  Record          an instance of a torch.distributed.checkpoint dataclass: its BUILD state

`PickledModule` answers what `nn.Module` would: `named_modules()` (each module once, as
torch's does), `state_dict()` (parameters, then persistent buffers, then each child's, as
`Module.state_dict` orders them) and attribute lookup (`__dict__`, then `_parameters`,
`_buffers`, `_modules`, as `Module.__getattr__` falls back). Its mappings are read through
their type (`dict.items(d)`), never through attributes a pickle could have set.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any

from bnaudit.errors import BnauditError
from bnaudit.text import shown_value

# A forged pickle can share one module under two names at every level, so that the
# paths a state dict walks double per level: the walk is bounded, as TorchScript's is.
_MAX_VISITS = 100_000


def mapping_items(mapping: Mapping[Any, Any]) -> Any:
    """The items of a mapping read through its type (`type(m).items(m)`): its own entries,
    whatever attributes (`items`, `keys`) a pickle set on the instance."""
    return type(mapping).items(mapping)


class PickledModule:
    """An instance of a `torch.nn` class from a pickle: `qualname` and the state its
    BUILD opcode set (the module's `__dict__`), as data."""

    def __init__(self, qualname: str) -> None:
        self.qualname = qualname
        self.state: dict[Any, Any] = {}

    @property
    def class_name(self) -> str:
        return self.qualname.rsplit(".", 1)[-1]

    def _dict(self, name: str) -> Mapping[Any, Any]:
        value = dict.get(self.state, name, {})
        if not isinstance(value, Mapping):
            raise BnauditError(f"module attribute {name} of {self.class_name} is not a mapping")
        return value

    def has(self, name: str) -> bool:
        """`hasattr(module, name)` of the unpickled module."""
        return dict.__contains__(self.state, name) or any(
            _contains(self._dict(d), name) for d in ("_parameters", "_buffers", "_modules")
        )

    def attribute(self, name: str, default: Any = None) -> Any:
        """`getattr(module, name, default)` of the unpickled module."""
        if dict.__contains__(self.state, name):
            return dict.__getitem__(self.state, name)
        for holder in ("_parameters", "_buffers", "_modules"):
            values = self._dict(holder)
            if _contains(values, name):
                return dict.__getitem__(values, name) if isinstance(values, dict) else values[name]
        return default

    def children(self) -> list[tuple[str, PickledModule]]:
        out = []
        for name, child in mapping_items(self._dict("_modules")):
            if child is None:
                continue
            if not isinstance(child, PickledModule) or not isinstance(name, str):
                raise BnauditError(f"child {shown_value(name, 40)} of {self.class_name} is not a module")
            out.append((name, child))
        return out

    def named_modules(self) -> list[tuple[str, PickledModule]]:
        """(dotted name, module) of this module and every descendant, each once, depth first."""
        found: list[tuple[str, PickledModule]] = []
        seen: set[int] = set()

        def walk(module: PickledModule, prefix: str) -> None:
            if id(module) in seen:
                return
            seen.add(id(module))
            found.append((prefix, module))
            for name, child in module.children():
                walk(child, f"{prefix}.{name}" if prefix else name)

        walk(self, "")
        return found

    def state_dict(self) -> dict[str, Any]:
        """name -> value of every parameter and persistent buffer that is not None, in
        `Module.state_dict`'s order (a shared module under each of its names)."""
        out: dict[str, Any] = {}
        budget = [_MAX_VISITS]

        def walk(module: PickledModule, prefix: str) -> None:
            budget[0] -= 1
            if budget[0] < 0:
                raise BnauditError(f"more than {_MAX_VISITS} modules (forged nesting?)")
            transient = module.attribute("_non_persistent_buffers_set", set())
            for holder in ("_parameters", "_buffers"):
                for name, value in mapping_items(module._dict(holder)):
                    if value is not None and isinstance(name, str):
                        if holder == "_buffers" and isinstance(transient, (set, frozenset)) and name in transient:
                            continue
                        out[prefix + name] = value
            for name, child in module.children():
                walk(child, f"{prefix}{name}.")

        walk(self, "")
        return out

    def __repr__(self) -> str:
        return f"<pickled {self.qualname}>"


def _contains(mapping: Mapping[Any, Any], key: str) -> bool:
    return dict.__contains__(mapping, key) if isinstance(mapping, dict) else key in mapping


class StandIn:
    """A global the file names and bnaudit does not allow: its name, nothing else."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<not loaded: {self.name}>"


class StandInObject:
    """An instance of a stand-in class as pickled data: `args` of NEWOBJ, `state` of
    BUILD, and the items or elements a dict or list subclass appended. Nothing of the
    user's class runs: these are plain containers."""

    def __init__(self, name: str, args: tuple[Any, ...]) -> None:
        self.name, self.args = name, args
        self.state: Any = None
        self.items: dict[Any, Any] = {}
        self.elements: list[Any] = []

    def __repr__(self) -> str:
        return f"<not loaded: {self.name} object>"


class NumpyCall:
    """A call of one of numpy's allow-listed plain-data globals (`name`), recorded with its
    arguments and the state a BUILD gave the result; `new`: a NEWOBJ (`cls.__new__`)."""

    def __init__(self, name: str, args: tuple[Any, ...], new: bool = False) -> None:
        self.name, self.args, self.new = name, args, new
        self.state: Any = None

    def __repr__(self) -> str:
        return f"<numpy {self.name.rsplit('.', 1)[-1]}>"


# numpy dtype codes whose scalars are plain numbers: kind -> struct format by item size
_SCALAR_FORMATS = {
    "f": {2: "e", 4: "f", 8: "d"},
    "i": {1: "b", 2: "h", 4: "i", 8: "q"},
    "u": {1: "B", 2: "H", 4: "I", 8: "Q"},
    "b": {1: "?"},
}


def numpy_number(value: Any) -> float | int | bool | None:
    """The number a recorded numpy scalar holds (`numpy.core.multiarray.scalar(dtype, raw)`),
    decoded without numpy: a real kind (float, signed, unsigned, bool) of a standard size in
    the byte order its dtype's state gives; None for anything else."""
    if not (isinstance(value, NumpyCall) and value.name.endswith("multiarray.scalar") and len(value.args) == 2):
        return None
    dtype, raw = value.args
    if not (isinstance(dtype, NumpyCall) and dtype.name == "numpy.dtype" and dtype.args and isinstance(raw, bytes)):
        return None
    code = dtype.args[0]
    if not isinstance(code, str) or len(code) < 2 or not code[1:].isdigit():
        return None
    fmt = _SCALAR_FORMATS.get(code[0], {}).get(int(code[1:]))
    state = dtype.state
    order = state[1] if isinstance(state, tuple) and len(state) > 1 and state[1] in ("<", ">", "|", "=") else "<"
    if fmt is None or len(raw) != struct.calcsize(fmt):
        return None
    result: float | int | bool = struct.unpack(("<" if order in "<|=" else ">") + fmt, raw)[0]
    return result


class TorchValue:
    """A torch constant a pickle names: `kind` "dtype", "layout", "qscheme" or
    "memory_format", and its `name` ("float16", "strided", ...)."""

    __slots__ = ("kind", "name")

    def __init__(self, kind: str, name: str) -> None:
        self.kind, self.name = kind, name

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TorchValue) and (self.kind, self.name) == (other.kind, other.name)

    def __hash__(self) -> int:
        return hash((self.kind, self.name))

    def __repr__(self) -> str:
        return f"torch.{self.name}"


class TorchDevice:
    """`torch.device(type, index)` as data."""

    __slots__ = ("index", "type")

    def __init__(self, type_: str, index: int | None) -> None:
        self.type, self.index = type_, index

    def __repr__(self) -> str:
        return f"device({self.type!r}{'' if self.index is None else f', {self.index}'})"


class TorchSize(tuple):  # type: ignore[type-arg]
    """`torch.Size` as a tuple of counts."""

    __slots__ = ()


class TorchVersion(str):
    """`torch.torch_version.TorchVersion` as its string (comparing it needs no torch)."""

    __slots__ = ()


class ScriptObject:
    """An instance of a TorchScript `__torch__` class: `qualname` and the attributes its
    BUILD state set."""

    def __init__(self, qualname: str) -> None:
        self.qualname = qualname
        self.attrs: dict[Any, Any] = {}


class Record:
    """An instance of one of torch.distributed.checkpoint's dataclasses (`kind`, its class
    name): BUILD's state kept as is (a dict of fields; TensorProperties pickles a tuple)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.state: Any = None

"""Inert stand-ins for the classes a torch.save file pickles outside its state dict.

A Lightning checkpoint keeps `hyper_parameters` (an omegaconf.DictConfig, a dataclass,
a class of the user's project) next to a state dict of plain tensors; a timm or
torchvision one keeps an `args` object. `torch.load(weights_only=True)` refuses the
whole file for that one object. `read_with_stand_ins` unpickles the archive's
`data.pkl` with bnaudit's own restricted unpickler instead:

  allow-listed globals      tensors (lazy `TensorRef`s read from the zip entries, so
                            only the tensors audited are ever read), OrderedDict and
                            the plain-data names of allowlist.py
  every other global        a `StandIn` holding its dotted name: never imported,
                            never called
  NEWOBJ on a stand-in      a `StandInObject` (the class name and its arguments as data)
  BUILD on such an object   its state kept as data; no `__setstate__` of anyone runs
  REDUCE on a stand-in, or BUILD/NEWOBJ on anything stand-in shaped that is not the
                            plain pattern above: `CalledStandIn`, never a call

`read_legacy_with_stand_ins` does the same for a legacy (pre-1.6) file, its tensors
slices of the file at the places `legacy.legacy_layout` found. `check_stand_ins` then refuses the file when a stand-in sits inside the state dict
being audited, and otherwise lists the ones skipped ("hyper_parameters holds
omegaconf.DictConfig: not loaded").
"""

from __future__ import annotations

import _compat_pickle
import math
import pickle
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from bnaudit.errors import BnauditError
from bnaudit.formats.legacy import LegacyLayout, LegacyStorage, whole_model_refusal
from bnaudit.formats.model import STORAGE_ITEMSIZE, Checkpoint, TensorRef, file_slice_ref
from bnaudit.formats.torchscript import ArchiveUnpickler, check_tensor_record, open_archive_pickle
from bnaudit.text import exception_line


class StandIn:
    """A global the file names and bnaudit does not allow: its name, nothing else."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise CalledStandIn(self.name)

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

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise CalledStandIn(self.name)

    def __setitem__(self, key: Any, value: Any) -> None:
        self.items[key] = value

    def append(self, value: Any) -> None:
        self.elements.append(value)

    def extend(self, values: Any) -> None:
        self.elements.extend(values)

    def __repr__(self) -> str:
        return f"<not loaded: {self.name} object>"


class DeferredGlobal:
    """An allow-listed global not imported yet (numpy's, ~60 ms): a call to it is recorded
    as a `StandInObject` (its name and arguments as data), and nothing runs. For a reader
    that reads the file again with the real global when the values turn out to matter
    (formats/read.py)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, *args: Any) -> StandInObject:
        return StandInObject(self.name, args)

    def __repr__(self) -> str:
        return f"<not imported: {self.name}>"


class CalledStandIn(pickle.UnpicklingError):
    """The pickle tried to call (or rebuild through) a global that was not loaded."""

    def __init__(self, name: str) -> None:
        super().__init__(f"the file calls {name}")
        self.name = name


_STAND_IN_TYPES = (StandIn, StandInObject)


class StandInUnpickler(ArchiveUnpickler):
    # pickle._Unpickler's opcode table, with the four opcodes that call or rebuild replaced
    dispatch: ClassVar[dict[int, Callable[[Any], None]]] = dict(ArchiveUnpickler.dispatch)

    stack: list[Any]  # pickle._Unpickler's, set by load()
    proto: int

    def __init__(self, data: bytes, archive: Any, root: str, allowed: Callable[[str], Any]) -> None:
        super().__init__(data, archive, root)
        self.allowed = allowed
        self.stand_ins: dict[str, StandIn] = {}

    def find_class(self, module: str, name: str) -> Any:
        if self.proto < 3:  # Python 2 names (torch.save writes protocol 2): __builtin__.exec is builtins.exec
            if (module, name) in _compat_pickle.NAME_MAPPING:
                module, name = _compat_pickle.NAME_MAPPING[(module, name)]
            module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        full = f"{module}.{name}"
        if full == "torch._utils._rebuild_parameter":
            return _rebuild_parameter
        if not module.startswith("__torch__"):
            try:
                return super().find_class(module, name)  # storages, tensors, OrderedDict
            except pickle.UnpicklingError:
                pass
            obj = self.allowed(full)
            if obj is not None:
                return obj
        if full not in self.stand_ins:
            self.stand_ins[full] = StandIn(full)
        return self.stand_ins[full]

    def load_reduce(self) -> None:
        func = self.stack[-2]
        if isinstance(func, _STAND_IN_TYPES):
            raise CalledStandIn(func.name)
        super().load_reduce()  # type: ignore[misc]  # pickle._Unpickler's opcode handler

    def load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        self.append(_new_object(cls, args, {}))  # type: ignore[attr-defined]

    def load_newobj_ex(self) -> None:
        kwargs = self.stack.pop()
        args = self.stack.pop()
        cls = self.stack.pop()
        self.append(_new_object(cls, args, kwargs))  # type: ignore[attr-defined]

    def load_build(self) -> None:
        inst = self.stack[-2]
        if isinstance(inst, StandInObject):
            inst.state = self.stack.pop()
            return
        # state goes onto plain instances only: setting attributes of a class or a function
        # (a stand-in, an allowed global, bnaudit's own rebuild helpers) is not data
        if isinstance(inst, (StandIn, TensorRef, type)) or callable(inst):
            raise CalledStandIn(getattr(inst, "name", None) or type(inst).__name__)
        super().load_build()  # type: ignore[misc]  # pickle._Unpickler's opcode handler

    def _instantiate(self, klass: Any, args: Any) -> None:  # INST and OBJ (protocols 0 and 1)
        if isinstance(klass, _STAND_IN_TYPES):
            raise CalledStandIn(klass.name)
        super()._instantiate(klass, args)  # type: ignore[misc]

    dispatch[pickle.REDUCE[0]] = load_reduce
    dispatch[pickle.NEWOBJ[0]] = load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = load_newobj_ex
    dispatch[pickle.BUILD[0]] = load_build


def _rebuild_parameter(data: Any, requires_grad: Any = None, hooks: Any = None, *rest: Any) -> Any:
    return data  # an nn.Parameter's tensor is what a state dict holds


def _new_object(cls: Any, args: Any, kwargs: Any) -> Any:
    if isinstance(cls, StandIn):
        return StandInObject(cls.name, tuple(args) if isinstance(args, tuple) else (args,))
    if isinstance(cls, StandInObject) or not isinstance(cls, type):
        raise CalledStandIn(getattr(cls, "name", type(cls).__name__))
    return cls.__new__(cls, *args, **kwargs)


def _called_refusal(path: str, name: str) -> BnauditError:
    return BnauditError(
        f"{path}: refused to unpickle: it calls a global that could run code ({name}); "
        "if you trust this file, pass --trust-pickle; safer still, save a state dict or a .safetensors file"
    )


def read_with_stand_ins(path: str, allowed: Callable[[str], Any]) -> Any:
    """The object a torch.save zip archive holds, every global that `allowed` (a dotted
    name -> object or None) does not give replaced by a `StandIn`, tensors as lazy
    `TensorRef`s. A pickle that calls a stand-in is refused, naming it."""

    def load() -> Any:
        archive, root, data = open_archive_pickle(path)
        return StandInUnpickler(data, archive, root, allowed).load()

    return _unpickled(path, load)


class _PlainStandInUnpickler(StandInUnpickler):
    """The stand-in unpickler over a plain pickle (no archive, no persistent ids): only
    the globals `allowed` gives are real; torch's tensor and storage records are not."""

    def __init__(self, data: bytes, allowed: Callable[[str], Any]) -> None:
        super().__init__(data, None, "", allowed)

    def find_class(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"
        obj = self.allowed(full)
        if obj is not None:
            return obj
        return self.stand_ins.setdefault(full, StandIn(full))

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError(f"unexpected persistent id {str(pid)[:80]}")


def read_pickle_with_stand_ins(path: str, data: bytes, allowed: Callable[[str], Any]) -> Any:
    """The object the plain pickle `data` (read from `path`) holds: every global that
    `allowed` does not give replaced by a `StandIn`; a pickle that calls one is refused,
    naming it (torch.distributed.checkpoint's `.metadata`, formats/dcp.py)."""
    return _unpickled(path, lambda: _PlainStandInUnpickler(data, allowed).load())


def _unpickled(path: str, load: Callable[[], Any]) -> Any:
    """`load()`, its failures as one line each: a call of a stand-in names the global."""
    try:
        return load()
    except BnauditError:
        raise
    except CalledStandIn as exc:
        raise _called_refusal(path, exc.name) from None
    except Exception as exc:  # forged bytes fail anywhere in the pickle machine
        raise BnauditError(f"{path}: cannot unpickle safely ({exception_line(exc, with_type=False)})") from None


_MAX_NOTES = 20


def stand_ins_in(obj: Any, max_depth: int = 8) -> list[tuple[str, str]]:
    """(where, class name) of every stand-in object in a loaded container, in order;
    `where` joins mapping keys and list indices with '/'. Stand-ins are not searched
    further: what they hold was never loaded as anything but data."""
    found: list[tuple[str, str]] = []
    seen: set[int] = set()
    # depth first, in order; a loop, not a nested recursive function (it would refer to
    # itself: a cycle left for the collector)
    stack: list[tuple[Any, str, int]] = [(obj, "", 0)]
    while stack:
        value, where, depth = stack.pop()
        if isinstance(value, _STAND_IN_TYPES):
            found.append((where or "the file's root", value.name))
            continue
        if depth >= max_depth or id(value) in seen or isinstance(value, (str, bytes, TensorRef)):
            continue
        seen.add(id(value))
        if isinstance(value, Mapping):
            items: Any = value.items()
        elif isinstance(value, (list, tuple)):
            items = enumerate(value)
        else:
            continue
        # a state dict is mostly tensors: no path built for them
        children = [
            (item, f"{where}/{key}" if where else str(key), depth + 1)
            for key, item in items
            if not isinstance(item, _LEAVES)
        ]
        stack.extend(reversed(children))
    return found


# Values that hold nothing further and are never stand-ins.
_LEAVES = (TensorRef, str, bytes, int, float, type(None))


def check_stand_ins(path: str, obj: Any, ckpt: Checkpoint) -> list[str]:
    """Refuse the file when a stand-in sits inside the state dict `ckpt` audits (its
    `_metadata` included); otherwise one note per stand-in skipped elsewhere."""
    target = obj
    for part in ckpt.key.split("/") if ckpt.key else []:
        target = target[part]
    in_target = stand_ins_in(target)
    inside = list(in_target)
    metadata = getattr(target, "_metadata", None)
    if metadata is not None:
        inside += stand_ins_in(metadata)
    if inside:
        where, name = inside[0]
        at = f"'{ckpt.key}/{where}'" if ckpt.key else f"'{where}'"
        raise BnauditError(
            f"{path}: refused to unpickle: the state dict holds {name} at {at}, a class that could run "
            "code; if you trust this file, pass --trust-pickle; safer still, save a state dict or a .safetensors file"
        )
    found = in_target if target is obj else stand_ins_in(obj)  # the same walk when the root is audited
    notes = [f"{where} holds {name}: not loaded" for where, name in found[:_MAX_NOTES]]
    if len(found) > _MAX_NOTES:
        notes.append(f"and {len(found) - _MAX_NOTES} more objects of classes not loaded")
    return notes


def with_stand_ins_checked(path: str, obj: Any, build: Callable[[], Checkpoint]) -> Checkpoint:
    """`build()` (the checkpoint of `obj`) with its stand-in notes, or the refusal of
    `check_stand_ins`; a file whose only state dict was left unloaded is refused, naming it."""
    try:
        ckpt = build()
    except BnauditError:
        found = stand_ins_in(obj)
        if not found:
            raise
        where, name = found[0]
        raise BnauditError(
            f"{path}: refused to unpickle: {where} holds {name}, a class that could run code, and no plain "
            "state dict was found outside it; if you trust this file, pass --trust-pickle; safer still, save a "
            "state dict or a .safetensors file"
        ) from None
    ckpt.not_loaded = check_stand_ins(path, obj, ckpt)
    return ckpt


class _LegacyStandInUnpickler(StandInUnpickler):
    """The stand-in unpickler over the main pickle of a legacy torch.save file: storages
    are the file ranges `legacy_layout` found, tensors lazy slices of the file."""

    def __init__(self, path: str, layout: LegacyLayout, allowed: Callable[[str], Any]) -> None:
        super().__init__(layout.pickle, None, "", allowed)
        self.path, self.storages = path, layout.storages

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and pid and pid[0] == "module":
            raise whole_model_refusal(self.path)
        if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unexpected persistent id {str(pid)[:80]}")
        storage = self.storages.get(str(pid[2]))
        if storage is None or storage.dtype != pid[1] or (len(pid) > 5 and pid[5] is not None):
            raise pickle.UnpicklingError(f"malformed storage record {str(pid)[:80]}")
        return storage

    def _rebuild_tensor(self, storage: Any, offset: Any, size: Any, stride: Any, *_: Any) -> TensorRef:
        check_tensor_record(storage, offset, size, stride, LegacyStorage)
        numel = math.prod(size)
        if numel and offset + numel > storage.numel:
            raise pickle.UnpicklingError("tensor runs past its storage")
        itemsize = STORAGE_ITEMSIZE[storage.dtype]
        contiguous, step = True, 1
        for extent, st in zip(reversed(size), reversed(stride)):
            contiguous = contiguous and (extent <= 1 or st == step)
            step *= extent
        if not contiguous:
            name = f"a strided view in {self.path}"

            def refuse() -> list[float]:
                raise BnauditError(f"{name}: not contiguous; read it with --trust-pickle")

            return TensorRef("", tuple(size), storage.dtype, refuse)
        start = storage.offset + offset * itemsize
        return file_slice_ref(self.path, "", start, numel * itemsize, storage.dtype, tuple(size))


def read_legacy_with_stand_ins(path: str, layout: LegacyLayout, allowed: Callable[[str], Any]) -> Any:
    """`read_with_stand_ins` for a legacy torch.save file taken apart by `legacy_layout`."""
    return _unpickled(path, lambda: _LegacyStandInUnpickler(path, layout, allowed).load())

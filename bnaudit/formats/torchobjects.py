"""torch objects from what the restricted unpickler read: for the commands that write or run them.

`recalibrate` writes a torch.save container back and `gap` runs a pickled model: they need
torch tensors and `nn.Module`s, not records. `load_torch_save` reads the file once with the
restricted unpickler (formats/torchsave.py) and `torch_objects` rebuilds what it read, as
`torch.load(weights_only=True)` would have built it:

  TensorRef          a tensor over its storage (each storage read once and shared by every
                     view of it, as torch's own rebuild shares it); an `nn.Parameter` where
                     the pickle rebuilt one, `requires_grad` as pickled
  PickledModule      its `torch.nn` class (imported from torch, never from the file, and a
                     subclass of `nn.Module`), `__new__` then `__setstate__(state)`
  NumpyCall          numpy's allow-listed global called with the recorded arguments, then
                     `__setstate__` with the recorded state (an array's shape checked
                     against its bytes first)
  TorchValue, TorchDevice, TorchSize, TorchVersion   the torch objects they name
  containers         the same types (an OrderedDict with its `_metadata`), shared objects
                     kept shared

A stand-in (a class of the user's, a tensor kind bnaudit does not read) cannot be written
back: the file is refused, naming it. torch.load runs only with `--trust-pickle`
(`torch.load(weights_only=False)`: the file's pickle may run any code).
"""

from __future__ import annotations

import argparse
import collections
import importlib
import math
import os
import sys
from typing import Any

from bnaudit.errors import BnauditError
from bnaudit.formats.allowed import ClassRecord
from bnaudit.formats.model import EXPANDED_LIMIT, TensorRef
from bnaudit.formats.pickled import (
    NumpyCall,
    PickledModule,
    StandIn,
    StandInObject,
    TorchDevice,
    TorchSize,
    TorchValue,
    TorchVersion,
    mapping_items,
)
from bnaudit.formats.standins import unsafe_globals_error
from bnaudit.formats.torchsave import read_torch_save
from bnaudit.formats.views import Storage, StorageView, storage_bytes
from bnaudit.text import exception_line

_NN_MODULE_PREFIXES = ("torch.nn.modules.", "torch.ao.nn.", "torch.nn.intrinsic.", "torch.nn.quantized.")


def load_torch_save(path: str, fmt: str, trust_pickle: bool = False, hint: str = "") -> Any:
    """The object of a torch.save file (`fmt` "torch-zip" or "torch-legacy") as torch
    objects. `trust_pickle`: torch.load(weights_only=False), the user's opt-out. Otherwise
    read by the restricted unpickler and rebuilt (module docstring); a file holding objects
    of globals it does not allow is refused listing them, `hint` ending the refusal."""
    if trust_pickle:
        return _load_trusted(path)
    read = read_torch_save(path, fmt == "torch-legacy")
    return torch_objects(read.value, path, hint, list(read.stand_ins))


def _load_trusted(path: str) -> Any:
    """`torch.load` without limits (--trust-pickle): the file's pickle runs as it likes."""
    import torch

    # the pickled classes are imported by module name: from the working tree too, as --arch does
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        try:
            path.encode("utf-8")
            return torch.load(path, map_location="cpu", weights_only=False)
        except UnicodeEncodeError:
            # torch's C++ reader takes UTF-8 paths only: a name that is not (bytes kept by
            # surrogateescape) is read through an open file
            with open(path, "rb") as handle:
                return torch.load(handle, map_location="cpu", weights_only=False)
    except ModuleNotFoundError as exc:
        raise BnauditError(
            f"{path}: cannot load: its pickled classes need the module '{exc.name}', which is neither "
            f"installed nor found from {cwd}; install it, or run from the project's folder or add "
            "that folder to PYTHONPATH"
        ) from None
    except Exception as exc:
        raise BnauditError(f"{path}: cannot load: {exception_line(exc, with_type=False)}") from exc


def torch_objects(obj: Any, path: str, hint: str = "", stand_ins: list[str] | None = None) -> Any:
    """`obj` (what the restricted unpickler read from `path`) as torch objects (module
    docstring); a record that cannot be rebuilt is refused in one line, a stand-in naming
    `stand_ins` (every global the file's pickle left unloaded)."""
    try:
        return _Rebuild(path, hint, stand_ins or []).value(obj)
    except BnauditError:
        raise
    except RecursionError:
        raise BnauditError(f"{path}: nested too deeply to rebuild") from None
    except Exception as exc:  # a forged record that torch or numpy refuse to rebuild
        raise BnauditError(f"{path}: cannot rebuild its objects ({exception_line(exc)})") from None


class _Rebuild:
    def __init__(self, path: str, hint: str, stand_ins: list[str]) -> None:
        import torch

        self.torch, self.path, self.hint, self.stand_ins = torch, path, hint, stand_ins
        self.done: dict[int, Any] = {}
        self.storages: dict[int, Any] = {}

    def value(self, value: Any) -> Any:
        if value is None or type(value) in (str, bytes, int, float, bool, complex):
            return value
        done = self.done.get(id(value))
        if done is not None:
            return done
        result = self.build(value)
        self.done[id(value)] = result
        return result

    def build(self, value: Any) -> Any:
        torch = self.torch
        if isinstance(value, TensorRef):
            return self.tensor(value)
        if type(value) in (dict, collections.OrderedDict, collections.defaultdict, collections.Counter):
            return self.mapping(value)
        if type(value) is list:
            out: list[Any] = []
            self.done[id(value)] = out  # a list may hold itself
            out.extend(self.value(v) for v in value)
            return out
        if isinstance(value, TorchSize):
            return torch.Size(value)
        if type(value) in (tuple, set, frozenset):
            return type(value)(self.value(v) for v in value)
        if isinstance(value, PickledModule):
            return self.module(value)
        if isinstance(value, NumpyCall):
            return self.numpy(value)
        if isinstance(value, TorchValue):
            found = getattr(torch, value.name, None)
            kinds = {"dtype": torch.dtype, "layout": torch.layout, "qscheme": torch.qscheme}
            if value.kind in kinds and not isinstance(found, kinds[value.kind]):
                raise BnauditError(f"{self.path}: names torch.{value.name[:40]}, which is no torch {value.kind}")
            return found
        if isinstance(value, TorchDevice):
            return torch.device(value.type) if value.index is None else torch.device(value.type, value.index)
        if isinstance(value, TorchVersion):
            from torch.torch_version import TorchVersion as Version

            return Version(str(value))
        if type(value) is argparse.Namespace:
            space = argparse.Namespace()
            self.done[id(value)] = space
            vars(space).update({k: self.value(v) for k, v in vars(value).items()})
            return space
        if type(value) is bytearray:
            return bytearray(value)
        if isinstance(value, ClassRecord) and value.kind == "numpy":
            module_name, _, attr = value.name.rpartition(".")
            return getattr(importlib.import_module(module_name), attr)
        if isinstance(value, (StandIn, StandInObject)):
            names = self.stand_ins if value.name in self.stand_ins else [value.name]
            raise unsafe_globals_error(self.path, names, self.hint)
        raise BnauditError(f"{self.path}: holds a {type(value).__name__}, which bnaudit cannot write back")

    def mapping(self, value: Any) -> Any:
        kind = type(value)
        out: Any = collections.defaultdict(value.default_factory) if kind is collections.defaultdict else kind()
        self.done[id(value)] = out
        for key, item in mapping_items(value):
            out[self.value(key)] = self.value(item)
        metadata = getattr(value, "_metadata", None) if kind is collections.OrderedDict else None
        if metadata is not None:
            out._metadata = self.value(metadata)
        return out

    def tensor(self, ref: TensorRef) -> Any:
        torch = self.torch
        view = ref.view
        if not isinstance(view, StorageView):
            return ref.to_torch()
        dtype = getattr(torch, view.storage.dtype)
        tensor = torch.empty(0, dtype=dtype).set_(
            self.storage(view.storage, view.big_endian), view.offset, view.size, view.stride
        )
        if view.parameter:
            return torch.nn.Parameter(tensor, requires_grad=view.requires_grad)
        return tensor.requires_grad_(True) if view.requires_grad else tensor

    def storage(self, storage: Storage, big_endian: bool) -> Any:
        """One torch storage per stored one: every view of it shares it, as torch.load's do."""
        found = self.storages.get(id(storage))
        if found is None:
            raw = storage_bytes(storage, big_endian)
            torch = self.torch
            found = torch.frombuffer(raw, dtype=torch.uint8).untyped_storage() if raw else torch.UntypedStorage(0)
            self.storages[id(storage)] = found
        return found

    def module(self, value: PickledModule) -> Any:
        module_name, _, class_name = value.qualname.rpartition(".")
        cls = None
        if value.qualname.startswith(_NN_MODULE_PREFIXES):
            try:
                cls = getattr(importlib.import_module(module_name), class_name, None)
            except ImportError:
                cls = None
        if not (isinstance(cls, type) and issubclass(cls, self.torch.nn.Module)):
            raise unsafe_globals_error(self.path, [value.qualname], self.hint)
        instance = cls.__new__(cls)
        self.done[id(value)] = instance
        instance.__setstate__(self.value(value.state))  # type: ignore[no-untyped-call]  # torch's
        return instance

    def numpy(self, value: NumpyCall) -> Any:
        import numpy

        module_name, _, attr = value.name.rpartition(".")
        func = getattr(importlib.import_module(module_name), attr)
        args = [self.value(a) for a in value.args]
        if attr == "_reconstruct" and (len(args) < 2 or not _small_shape(args[1])):
            raise BnauditError(f"{self.path}: a numpy array claims a shape before its data: refused")
        result = func.__new__(func, *args) if value.new else func(*args)
        if value.state is not None:
            state = self.value(value.state)
            if isinstance(result, numpy.ndarray):
                _check_array_state(self.path, state)
            result.__setstate__(state)
        return result


def _small_shape(shape: Any) -> bool:
    return (
        isinstance(shape, tuple)
        and all(type(n) is int and n >= 0 for n in shape)
        and math.prod(shape) <= EXPANDED_LIMIT
    )


def _check_array_state(path: str, state: Any) -> None:
    """An ndarray's pickled state (version, shape, dtype, fortran, data): the shape must be
    no more than its data holds, checked before numpy allocates it."""
    import numpy

    if not (isinstance(state, tuple) and len(state) == 5 and isinstance(state[2], numpy.dtype)):
        raise BnauditError(f"{path}: malformed numpy array state")
    _, shape, dtype, _, data = state
    if not (isinstance(shape, tuple) and all(type(n) is int and n >= 0 for n in shape)):
        raise BnauditError(f"{path}: malformed numpy array shape")
    count = math.prod(shape)
    holds = (
        len(data) if isinstance(data, list) else len(data) // max(dtype.itemsize, 1) if isinstance(data, bytes) else -1
    )
    if count > holds:
        raise BnauditError(f"{path}: a numpy array claims {count} elements, its data holds {holds}")

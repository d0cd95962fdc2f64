"""`torch.load` without running the file's code: the allow-list of globals and its loader.

`torch.load(weights_only=True)` refuses every class it does not know; real checkpoints
also carry plain data (argparse.Namespace, numpy scalars) and whole nn.Modules. Those
names, and only those, are allowed, resolved from the installed packages and never from
the file; anything else is refused with the list of globals the file would need and the
advice to pass `--trust-pickle` (the user's explicit opt-out). Legacy files are checked
first by `legacy.check_legacy_claims`; this module owns the policy, legacy.py the parsing.

Readers that take lazy tensors (inspect, diff, shards) get the file through
`torchsave.read_torch_free` under the same policy, without importing torch; torch.load
reads only for `--trust-pickle`, for callers that need torch tensors (writing, running a
model, data files) and for files naming torch globals that reader does not rebuild.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from bnaudit.errors import BnauditError
from bnaudit.formats.legacy import NotTorchSave, check_legacy_claims, legacy_layout, whole_model_refusal
from bnaudit.formats.standins import read_legacy_with_stand_ins, read_with_stand_ins
from bnaudit.text import exception_line

if TYPE_CHECKING:
    import zipfile

# Plain-data globals that real checkpoints carry (torchvision/timm `args`, numpy
# scalars and arrays). Each only rebuilds data; none calls anything it is handed.
_PLAIN_GLOBALS = {
    "argparse.Namespace",
    "numpy.dtype",
    "numpy.ndarray",
    "numpy.core.multiarray.scalar",
    "numpy._core.multiarray.scalar",
    "numpy.core.multiarray._reconstruct",
    "numpy._core.multiarray._reconstruct",
    "builtins.set",
    "builtins.frozenset",
    "torch.torch_version.TorchVersion",
}


_NUMPY_DTYPE_RE = re.compile(r"^numpy\.dtypes\.\w+DType$")


_NN_MODULE_PREFIXES = ("torch.nn.modules.", "torch.ao.nn.", "torch.nn.intrinsic.", "torch.nn.quantized.")


def _resolve(name: str) -> Any:
    module, _, attr = name.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def _allowed_global(name: str) -> Any | None:
    """The object for an allow-listed global name, or None if it is not allowed.

    torch.nn module classes are allowed (unpickling one only restores attributes);
    they are imported from torch itself, never from the file.
    """
    if name in _PLAIN_GLOBALS or _NUMPY_DTYPE_RE.match(name):
        try:
            return _resolve(name)
        except (ImportError, AttributeError):
            return None
    if name.startswith(_NN_MODULE_PREFIXES):
        import torch

        try:
            obj = _resolve(name)
        except (ImportError, AttributeError, ValueError):
            return None
        if isinstance(obj, type) and issubclass(obj, torch.nn.Module):
            return obj
    return None


def _unsafe_globals_error(path: str, unsafe: list[str], hint: str = "") -> BnauditError:
    shown = ", ".join(unsafe[:8]) + (f" and {len(unsafe) - 8} more" if len(unsafe) > 8 else "")
    return BnauditError(
        f"{path}: refused to unpickle: it needs globals that could run code ({shown}); "
        "if you trust this file, pass --trust-pickle; safer still, save a state dict "
        "or a .safetensors file" + (f"; {hint}" if hint else "")
    )


def _plain_allowlist(numpy_names: bool) -> list[Any]:
    """The allowed objects of _PLAIN_GLOBALS, numpy's or the others: numpy is imported
    only for a file that names it (it costs start-up time in every other run)."""
    names = sorted(n for n in _PLAIN_GLOBALS if n.startswith("numpy.") == numpy_names)
    allowed = [o for o in map(_allowed_global, names) if o is not None]
    if numpy_names and "numpy" in sys.modules:
        # numpy.dtype's reduce rebuilds through these classes without naming them as globals
        dtypes = getattr(sys.modules["numpy"], "dtypes", None)
        if dtypes is not None:
            allowed += [getattr(dtypes, n) for n in dir(dtypes) if n.endswith("DType")]
    return allowed


def _names_numpy(names: list[str]) -> bool:
    return any(n.startswith("numpy.") for n in names)


_MISSING_GLOBAL_RES = (re.compile(r"GLOBAL ([\w.]+)"), re.compile(r"got <class '([\w.]+)'>"))


def load_torch_object(
    path: str,
    trust_pickle: bool = False,
    mmap: bool = True,
    hint: str = "",
    stand_ins: bool = False,
    lazy: bool = False,
    opened: zipfile.ZipFile | None = None,
    numpy_declined: list[str] | None = None,
) -> Any:
    """`torch.load` a torch.save file without running pickled code.

    Only allow-listed globals are accepted; anything else is refused with the list of
    globals the file would need. `trust_pickle=True` is the user's explicit opt-out.
    `mmap` is True for the zip format and False for a legacy file (as sniffed), whose
    storage claims are checked against the file size first. `hint` ends a refusal with
    the caller's advice. `stand_ins=True` (reading to audit, not to write back): a zip
    archive that needs other globals is read by `standins.read_with_stand_ins` instead,
    those globals left as inert stand-ins and its tensors as lazy `TensorRef`s.
    `lazy=True` (implied by `stand_ins`): the caller takes lazy `TensorRef`s and
    `PickledModule`s (formats/torchsave.py) instead of torch tensors and modules, so a file
    of tensors, plain containers and torch.nn modules is read without importing torch.
    `opened`: the zip archive of `path` that `sniff.sniff_opening` just parsed, for the
    torch-free reader to take (the caller closes it). `numpy_declined` (a list): the
    torch-free reader does not import numpy for the allow-listed numpy globals but leaves
    each a `standins.DeferredGlobal` (its calls recorded as data) and appends its name, for a
    caller that may not need the values and reads again without the list if it does.
    """
    legacy = not mmap
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        # torch's C++ reader takes UTF-8 paths only; a file name that is not (bytes
        # kept by surrogateescape) is read through an open file object, without mmap.
        with open(path, "rb") as handle:
            return _load_torch_object(
                path, handle, trust_pickle, False, legacy, hint, stand_ins, lazy, opened, numpy_declined
            )
    return _load_torch_object(path, path, trust_pickle, mmap, legacy, hint, stand_ins, lazy, opened, numpy_declined)


def _load_torch_object(
    path: str,
    source: Any,
    trust_pickle: bool,
    mmap: bool,
    legacy: bool,
    hint: str = "",
    stand_ins: bool = False,
    lazy: bool = False,
    opened: zipfile.ZipFile | None = None,
    numpy_declined: list[str] | None = None,
) -> Any:
    if trust_pickle:
        return _load_trusted(path, source)
    if legacy:
        _check_legacy(path)
    if stand_ins or lazy:
        from bnaudit.formats.torchsave import NeedsTorch, read_torch_free

        given = _stand_in_allowed if numpy_declined is None else _deferring_numpy(numpy_declined)
        try:
            return read_torch_free(path, legacy, given, stand_ins, opened)
        except NeedsTorch:  # a file only torch rebuilds (or refuses): its loader reads it, as always
            if numpy_declined is not None:
                numpy_declined.clear()  # nothing deferred: torch's loader imports what it needs
    import torch

    allowed = _plain_allowlist(numpy_names=False)
    with_numpy = False
    if legacy:
        if stand_ins:
            layout = legacy_layout(path)
            unsafe = [
                n for n in layout.globals if _allowed_global(n) is None and n not in _torch_weights_only_globals()
            ]
            if unsafe:
                return read_legacy_with_stand_ins(path, layout, _stand_in_allowed)
    else:
        try:
            needed = torch.serialization.get_unsafe_globals_in_checkpoint(_rewound(source))
        except Exception as exc:
            raise BnauditError(f"{path}: damaged torch.save archive ({exception_line(exc, with_type=False)})") from exc
        unsafe = [n for n in needed if _allowed_global(n) is None]
        if unsafe and stand_ins:
            return read_with_stand_ins(path, _stand_in_allowed)
        if unsafe:
            raise _unsafe_globals_error(path, unsafe, hint)
        allowed += [_allowed_global(n) for n in needed]
        if _names_numpy(needed):
            allowed, with_numpy = allowed + _plain_allowlist(numpy_names=True), True
    return _load_allowing(path, source, allowed, with_numpy, mmap, hint)


def _rewound(source: Any) -> Any:
    """`source` ready to be read from its start: a path as is, an open file sought to 0."""
    if not isinstance(source, str):
        source.seek(0)
    return source


def _load_trusted(path: str, source: Any) -> Any:
    """`torch.load` without limits (--trust-pickle): the file's pickle runs as it likes."""
    import torch

    # the pickled classes are imported by module name: from the working tree too, as --arch does
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        return torch.load(_rewound(source), map_location="cpu", weights_only=False)
    except ModuleNotFoundError as exc:
        raise BnauditError(
            f"{path}: cannot load: its pickled classes need the module '{exc.name}', which is neither "
            f"installed nor found from {cwd}; install it, or run from the project's folder or add "
            "that folder to PYTHONPATH"
        ) from None
    except Exception as exc:
        raise BnauditError(f"{path}: cannot load: {exception_line(exc, with_type=False)}") from exc


def _check_legacy(path: str) -> None:
    """A legacy file's storage claims against its size (`legacy.check_legacy_claims`); a
    file that is no torch.save file and names globals outside the allow-list is refused
    with the allow-list's refusal."""
    try:
        check_legacy_claims(path)
    except NotTorchSave as exc:
        unsafe = list(
            dict.fromkeys(
                n for n in exc.globals if _allowed_global(n) is None and n not in _torch_weights_only_globals()
            )
        )
        if unsafe:  # say what it would have run, and what to do instead
            refusal = str(_unsafe_globals_error(path, unsafe)).removeprefix(f"{path}: ")
            raise BnauditError(f"{exc}; {refusal}") from None
        raise


def _load_allowing(path: str, source: Any, allowed: list[Any], with_numpy: bool, mmap: bool, hint: str) -> Any:
    """`torch.load(weights_only=True)` with the `allowed` globals, widened by each refused
    allow-listed global until the file loads (at most 64 attempts); a refused global
    outside the allow-list ends it with the refusal."""
    import pickle

    import torch

    # A legacy pickle cannot be scanned up front (and a zip one may name classes only
    # while it is built): load, and let each refused global either join the allow
    # list (an allow-listed name) or end the attempt with a refusal.
    for _ in range(64):
        try:
            with torch.serialization.safe_globals(allowed):
                return torch.load(_rewound(source), map_location="cpu", weights_only=True, mmap=mmap)
        except pickle.UnpicklingError as exc:
            text = str(exc)
            if "persistent_load" in text:
                # torch < 1.6 pickled a whole model with its classes' source code:
                # rebuilding it means running the file's pickle without limits.
                raise whole_model_refusal(path) from None
            missing = [m if "." in m else f"builtins.{m}" for rx in _MISSING_GLOBAL_RES for m in rx.findall(text)]
            if not missing:
                raise BnauditError(f"{path}: cannot unpickle safely ({_unpickling_reason(text)})") from None
            extra = [_allowed_global(n) for n in missing]
            refused = [n for n, o in zip(missing, extra) if o is None or o in allowed]
            if refused:
                raise _unsafe_globals_error(path, refused, hint) from None
            allowed += extra
            if _names_numpy(missing) and not with_numpy:
                allowed, with_numpy = allowed + _plain_allowlist(numpy_names=True), True
        except BnauditError:
            raise
        except Exception as exc:
            raise BnauditError(
                f"{path}: not a readable torch.save file ({exception_line(exc, with_type=False)})"
            ) from None
    raise BnauditError(f"{path}: needs too many distinct classes to unpickle safely")


def _stand_in_allowed(name: str) -> Any | None:
    """The plain-data globals the stand-in reader rebuilds for real. torch.nn classes
    are left as stand-ins there: a module holding lazy tensors could not give a state dict."""
    return None if name.startswith(_NN_MODULE_PREFIXES) else _allowed_global(name)


def _deferring_numpy(declined: list[str]) -> Callable[[str], Any]:
    """_stand_in_allowed, with numpy's allow-listed globals left unimported: a DeferredGlobal
    each, its name noted in `declined`. numpy's other globals stay plain stand-ins, refused
    when called, as always."""
    from bnaudit.formats.standins import DeferredGlobal

    def given(name: str) -> Any:
        if name.startswith("numpy.") and (name in _PLAIN_GLOBALS or _NUMPY_DTYPE_RE.match(name)):
            declined.append(name)
            return DeferredGlobal(name)
        return _stand_in_allowed(name)

    return given


def _torch_weights_only_globals() -> set[str]:
    """What torch.load(weights_only=True) rebuilds by itself (tensors, OrderedDict, ...)."""
    try:
        from torch._weights_only_unpickler import _get_allowed_globals

        return set(_get_allowed_globals())
    except Exception:  # a private API: without it, every name is listed
        return set()


def _unpickling_reason(text: str) -> str:
    """The informative line of torch's long weights_only message."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in text.splitlines()]
    for i, line in enumerate(lines):
        if "WeightsUnpickler error" in line:
            rest = line.split("WeightsUnpickler error:", 1)[-1].strip()
            following = [x for x in lines[i + 1 :] if x]
            return rest or (following[0] if following else line)
    return next((x for x in lines if x), "unknown reason")

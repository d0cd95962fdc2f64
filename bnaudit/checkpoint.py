"""Read checkpoints of every format and container without running their code.

A reader turns one file into a `Checkpoint`: the chosen state dict as a mapping of
names to lazy `TensorRef`s (nothing is read until a rule needs it), the container key
it came from, the other candidate state dicts, and what the file says about the BN
modules themselves when it holds them (eps, momentum).

Formats are sniffed from the bytes, never from the extension:
  safetensors   8-byte little-endian header length, then a JSON header; read by a
                small validating reader of our own (torch-free, per-tensor reads, no
                allocation of what a hostile header claims)
  torch-zip     `torch.save` zip archive; `torch.load(weights_only=True, mmap=True)`
  torch-legacy  pre-1.6 `torch.save` pickle stream; `torch.load(weights_only=True)`
  torchscript   `torch.jit.save` archive; unpickled by a restricted unpickler that
                builds inert records and never runs the archive's code
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import math
import numbers
import os
import re
import stat
import struct
import sys
import zipfile
from array import array
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from bnaudit.errors import BnauditError

CHECKPOINT_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin", ".tar", ".safetensors")

# Header size above which a safetensors file is refused before reading the header:
# real headers are kilobytes to a few megabytes; a hostile one claims petabytes.
MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024


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
    _reader: Callable[[], list] = field(repr=False, compare=False)
    # Builds the torch tensor directly (whole weights for --arch): None means from read().
    _torch: Callable[[], Any] | None = field(default=None, repr=False, compare=False)

    @property
    def is_floating(self) -> bool:
        return self.dtype.startswith(("float", "bfloat"))

    @property
    def is_integer(self) -> bool:
        return self.dtype.startswith(("int", "uint"))

    def read(self) -> list:
        return self._guarded(self._reader)

    def to_torch(self) -> Any:
        """The tensor with its stored dtype and shape; writing to it never reaches the file."""
        if self._torch is not None:
            return self._guarded(self._torch)
        import torch

        values = self.read()
        return torch.tensor(values, dtype=getattr(torch, self.dtype)).reshape(self.shape)

    def renamed(self, name: str) -> TensorRef:
        return dataclasses.replace(self, name=name)

    def _guarded(self, reader: Callable[[], Any]) -> Any:
        try:
            return reader()
        except BnauditError:
            raise
        except Exception as exc:  # a torn file or exotic storage: say which tensor
            raise BnauditError(f"cannot read tensor '{self.name}': {exc}") from exc


@dataclass(frozen=True)
class ModuleInfo:
    """What a pickled or scripted module says about one normalisation layer."""

    class_name: str
    eps: float | None
    momentum: float | None  # None: cumulative average (momentum=None)
    track_running_stats: bool | None = None
    momentum_known: bool = True


@dataclass
class Checkpoint:
    path: str
    format: str
    tensors: dict[str, TensorRef]
    key: str | None = None
    other_keys: list[str] = field(default_factory=list)
    prefix: str = ""
    is_ema: bool = False
    modules: dict[str, ModuleInfo] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    holds_module: bool = False


def recalibration_record(metadata: Mapping[str, str]) -> dict[str, Any] | None:
    """The `bnaudit` provenance entry `recalibrate` writes into safetensors metadata,
    or None. Metadata is untrusted: anything but a JSON object is ignored."""
    raw = metadata.get("bnaudit")
    if not isinstance(raw, str) or len(raw) > 10_000_000:
        return None
    try:
        record = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return record if isinstance(record, dict) else None


# ----------------------------------------------------------------------------- sniff


def sniff_format(path: str) -> str:
    """Return the format of `path` from its first bytes (see module docstring)."""
    try:
        # stat first: open() on a FIFO blocks until a writer appears, and a device
        # (/dev/zero, /dev/urandom) never ends; neither is a checkpoint.
        mode = os.stat(path).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(path)
        if not stat.S_ISREG(mode):
            raise BnauditError(f"{path}: not a regular file (a pipe, socket or device)")
        with open(path, "rb") as f:
            head = f.read(16)
    except IsADirectoryError:
        if not os.access(path, os.R_OK | os.X_OK):
            raise BnauditError(f"{path}: directory cannot be listed (permission denied)") from None
        raise BnauditError(f"{path}: is a directory") from None
    except FileNotFoundError:
        raise BnauditError(f"{path}: no such file") from None
    except PermissionError:
        raise BnauditError(f"{path}: permission denied") from None
    except OSError as exc:
        raise BnauditError(f"{path}: cannot open ({exc.strerror or exc})") from None
    if not head:
        raise BnauditError(f"{path}: empty file, not a checkpoint")
    if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
        return _sniff_zip(path)
    if len(head) >= 9 and head[8:9] == b"{":
        return "safetensors"
    if head[:1] == b"\x80":
        return "torch-legacy"
    raise BnauditError(
        f"{path}: not a checkpoint (neither torch.save, TorchScript nor safetensors)"
    )


def _sniff_zip(path: str) -> str:
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
            check_zip_sizes(path, archive)
    except BnauditError:
        raise
    except Exception as exc:  # zipfile parsing forged bytes: BadZipFile, NotImplementedError, struct.error, ...
        raise BnauditError(f"{path}: damaged zip archive ({_first_line(exc)})") from None
    if any(n.endswith("/constants.pkl") or "/code/" in n for n in names):
        return "torchscript"
    if any(n.endswith("data.pkl") for n in names):
        return "torch-zip"
    raise BnauditError(f"{path}: zip archive without data.pkl, not a torch.save file")


def check_zip_sizes(path: str, archive: zipfile.ZipFile) -> None:
    """Refuse an archive whose entries claim more bytes than the whole file holds.

    torch.save and torch.jit.save store their records uncompressed, so a real
    entry is never larger than the archive; a compressed entry that inflates past
    it is a zip bomb, and reading it would allocate what it claims.
    """
    size = os.path.getsize(path)
    for info in archive.infolist():
        if info.file_size > size:
            raise BnauditError(
                f"{path}: zip entry '{info.filename}' claims {info.file_size} bytes, "
                f"more than the whole file ({size}): refused"
            )


# ----------------------------------------------------------------------------- read


def read_checkpoint(
    path: str, key: str | None = None, trust_pickle: bool = False
) -> Checkpoint:
    """Open `path` read-only and return its (chosen) state dict as lazy tensors."""
    fmt = sniff_format(path)
    if fmt == "safetensors":
        tensors, metadata = read_safetensors(path)
        if key is not None:
            raise BnauditError(f"{path}: --key does not apply to safetensors files")
        ckpt = Checkpoint(path, fmt, tensors, metadata=metadata)
        return _strip_wrapper_prefix(ckpt)
    if fmt == "torchscript":
        from bnaudit.unpickle import read_torchscript

        tensors, modules = read_torchscript(path)
        if key is not None:
            raise BnauditError(f"{path}: --key does not apply to TorchScript archives")
        return Checkpoint(path, fmt, tensors, modules=modules, holds_module=True)
    obj = load_torch_object(path, trust_pickle=trust_pickle, mmap=fmt == "torch-zip")
    return checkpoint_from_object(path, fmt, obj, key)


def checkpoint_from_object(path: str, fmt: str, obj: Any, key: str | None) -> Checkpoint:
    """Find the state dict inside a loaded container and wrap it as a `Checkpoint`."""
    candidates = find_state_dicts(obj)
    if not candidates:
        raise BnauditError(f"{path}: holds no state dict (no mapping of names to tensors)")
    chosen = choose_state_dict(path, candidates, key)
    return _strip_wrapper_prefix(wrap_candidate(path, fmt, candidates, chosen))


def wrap_candidate(path: str, fmt: str, candidates: dict[str, Any], chosen: str) -> Checkpoint:
    """A `Checkpoint` of `candidates[chosen]` (a state dict or an nn.Module, whose
    module settings are kept), names as they are; the other candidates are listed."""
    source = candidates[chosen]
    modules: dict[str, ModuleInfo] = {}
    if _is_module(source):
        try:
            modules = module_infos(source)
            source = source.state_dict()
        except Exception as exc:  # attributes come from the file: a forged module breaks here
            raise BnauditError(f"{path}: malformed pickled module ({_first_line(exc)})") from None
    tensors = {name: _torch_ref(name, t) for name, t in source.items() if isinstance(name, str) and _is_tensor(t)}
    return Checkpoint(
        path,
        fmt,
        tensors,
        key=None if chosen == "" else chosen,
        other_keys=[k for k in candidates if k != chosen],
        is_ema=_is_ema_key(chosen),
        modules=modules,
        holds_module=bool(modules) or _is_module(candidates[chosen]),
    )


# ----------------------------------------------------------------------------- containers

# Subtrees that hold tensors but never the model's state dict.
_SKIP_KEYS = {
    "optimizer", "optimizers", "optimizer_states", "optimizer_state_dict", "optim",
    "opt", "lr_scheduler", "lr_schedulers", "scheduler", "schedulers", "scaler",
    "grad_scaler", "amp", "loops", "callbacks", "message_hub", "rng_state",
}
# Known state-dict keys, most likely first (torchvision, timm, Lightning, DeepSpeed, pycls, ...).
_PREFERRED_KEYS = ("state_dict", "model", "model_state_dict", "module", "net", "model_state", "params")
_EMA_RE = re.compile(r"(^|[_/])ema($|[_/])|_ema$|^ema_", re.IGNORECASE)


def _is_ema_key(key: str) -> bool:
    return bool(key) and bool(_EMA_RE.search(key))


def _is_tensor(value: Any) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "dtype") and hasattr(value, "shape")


def _is_module(value: Any) -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return False
    return isinstance(value, torch.nn.Module)


def _is_tensor_mapping(value: Any) -> bool:
    if not isinstance(value, Mapping) or not value:
        return False
    if not all(isinstance(k, str) for k in value):
        return False
    n_tensors = sum(1 for v in value.values() if _is_tensor(v))
    return n_tensors > 0 and n_tensors * 2 >= len(value)


def find_state_dicts(obj: Any, max_depth: int = 4) -> dict[str, Any]:
    """Every state dict (or nn.Module) in a container, keyed by '/'-joined path.

    The root itself has path "". Optimizer, scheduler and similar subtrees are
    skipped; a state dict's own entries are not searched further.
    """
    found: dict[str, Any] = {}

    def walk(value: Any, path: str, depth: int) -> None:
        if _is_module(value) or _is_tensor_mapping(value):
            found[path] = value
            return
        if depth >= max_depth or not isinstance(value, Mapping):
            return
        for k, v in value.items():
            if not isinstance(k, str) or k.lower() in _SKIP_KEYS:
                continue
            walk(v, f"{path}/{k}" if path else k, depth + 1)

    walk(obj, "", 0)
    return found


def choose_state_dict(path: str, candidates: dict[str, Any], key: str | None) -> str:
    if key is not None:
        if key in candidates:
            return key
        listed = ", ".join(repr(k) for k in candidates if k) or "only the root"
        raise BnauditError(f"{path}: no state dict under key '{key}' (found: {listed})")
    if "" in candidates:
        return ""
    non_ema = [k for k in candidates if not _is_ema_key(k)] or list(candidates)

    def rank(k: str) -> tuple[int, int, int]:
        parts = k.split("/")
        known = min((_PREFERRED_KEYS.index(p) for p in parts if p in _PREFERRED_KEYS), default=99)
        return (known, len(parts), -len(candidates[k]) if isinstance(candidates[k], Mapping) else 0)

    return min(non_ema, key=rank)


_WRAPPER_PREFIXES = ("module.", "_orig_mod.", "model.")


def _strip_wrapper_prefix(ckpt: Checkpoint) -> Checkpoint:
    """Strip DDP / torch.compile / Lightning prefixes, only when every key has one."""
    stripped = ""
    names = list(ckpt.tensors)
    changed = True
    # Bounded: real files nest at most a few wrappers, and a forged name of
    # thousands of "module." would otherwise cost quadratic time.
    for _ in range(8):
        if not (names and changed):
            break
        changed = False
        for prefix in _WRAPPER_PREFIXES:
            if all(n.startswith(prefix) for n in names):
                names = [n[len(prefix):] for n in names]
                stripped += prefix
                changed = True
                break
    if stripped:
        cut = len(stripped)
        ckpt.tensors = {
            name[cut:]: ref.renamed(name[cut:])
            for name, ref in ckpt.tensors.items()
        }
        ckpt.modules = {
            name[cut:] if name.startswith(stripped) else name: info
            for name, info in ckpt.modules.items()
        }
        ckpt.prefix = stripped
    return ckpt


# ----------------------------------------------------------------------------- torch.load


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


def allowed_global(name: str) -> Any | None:
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


def _refusal(path: str, unsafe: list[str], hint: str = "") -> BnauditError:
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
    allowed = [o for o in map(allowed_global, names) if o is not None]
    if numpy_names and "numpy" in sys.modules:
        # numpy.dtype's reduce rebuilds through these classes without naming them as globals
        dtypes = getattr(sys.modules["numpy"], "dtypes", None)
        if dtypes is not None:
            allowed += [getattr(dtypes, n) for n in dir(dtypes) if n.endswith("DType")]
    return allowed


def _names_numpy(names: list[str]) -> bool:
    return any(n.startswith("numpy.") for n in names)


_MISSING_GLOBAL_RES = (re.compile(r"GLOBAL ([\w.]+)"), re.compile(r"got <class '([\w.]+)'>"))


def load_torch_object(path: str, trust_pickle: bool = False, mmap: bool = True, hint: str = "") -> Any:
    """`torch.load` a torch.save file without running pickled code.

    Only allow-listed globals are accepted; anything else is refused with the list of
    globals the file would need. `trust_pickle=True` is the user's explicit opt-out.
    `mmap` is True for the zip format and False for a legacy file (as sniffed), whose
    storage claims are checked against the file size first. `hint` ends a refusal with
    the caller's advice.
    """
    legacy = not mmap
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        # torch's C++ reader takes UTF-8 paths only; a file name that is not (bytes
        # kept by surrogateescape) is read through an open file object, without mmap.
        with open(path, "rb") as handle:
            return _load_torch_object(path, handle, trust_pickle, mmap=False, legacy=legacy, hint=hint)
    return _load_torch_object(path, path, trust_pickle, mmap, legacy, hint)


def _load_torch_object(path: str, source: Any, trust_pickle: bool, mmap: bool, legacy: bool, hint: str = "") -> Any:
    import pickle

    import torch

    def rewound() -> Any:
        if not isinstance(source, str):
            source.seek(0)
        return source

    if trust_pickle:
        try:
            return torch.load(rewound(), map_location="cpu", weights_only=False)
        except Exception as exc:
            raise BnauditError(f"{path}: cannot load: {_first_line(exc)}") from exc
    allowed = _plain_allowlist(numpy_names=False)
    with_numpy = False
    if legacy:
        from bnaudit.unpickle import check_legacy_claims

        check_legacy_claims(path)
    else:
        try:
            needed = torch.serialization.get_unsafe_globals_in_checkpoint(rewound())
        except Exception as exc:
            raise BnauditError(f"{path}: damaged torch.save archive ({_first_line(exc)})") from exc
        unsafe = [n for n in needed if allowed_global(n) is None]
        if unsafe:
            raise _refusal(path, unsafe, hint)
        allowed += [allowed_global(n) for n in needed]
        if _names_numpy(needed):
            allowed, with_numpy = allowed + _plain_allowlist(numpy_names=True), True
    # A legacy pickle cannot be scanned up front (and a zip one may name classes only
    # while it is built): load, and let each refused global either join the allow
    # list (an allow-listed name) or end the attempt with a refusal.
    for _ in range(64):
        try:
            with torch.serialization.safe_globals(allowed):
                return torch.load(rewound(), map_location="cpu", weights_only=True, mmap=mmap)
        except pickle.UnpicklingError as exc:
            text = str(exc)
            if "persistent_load" in text:
                # torch < 1.6 pickled a whole model with its classes' source code:
                # rebuilding it means running the file's pickle without limits.
                raise BnauditError(
                    f"{path}: a legacy (pre-1.6) whole-model pickle cannot be read without running "
                    "its code; if you trust this file, pass --trust-pickle; safer still, save a "
                    "state dict or a .safetensors file"
                ) from None
            missing = [m if "." in m else f"builtins.{m}" for rx in _MISSING_GLOBAL_RES for m in rx.findall(text)]
            if not missing:
                raise BnauditError(f"{path}: cannot unpickle safely ({_unpickling_reason(text)})") from None
            extra = [allowed_global(n) for n in missing]
            refused = [n for n, o in zip(missing, extra) if o is None or o in allowed]
            if refused:
                raise _refusal(path, refused, hint) from None
            allowed += extra
            if _names_numpy(missing) and not with_numpy:
                allowed, with_numpy = allowed + _plain_allowlist(numpy_names=True), True
        except BnauditError:
            raise
        except Exception as exc:
            raise BnauditError(f"{path}: not a readable torch.save file ({_first_line(exc)})") from None
    raise BnauditError(f"{path}: needs too many distinct classes to unpickle safely")


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
            following = [x for x in lines[i + 1:] if x]
            return rest or (following[0] if following else line)
    return next((x for x in lines if x), "unknown reason")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return re.sub(r"\x1b\[[0-9;]*m", "", text[0]) if text else type(exc).__name__


def _torch_ref(name: str, tensor: Any) -> TensorRef:
    dtype = str(tensor.dtype).removeprefix("torch.")

    def read() -> list:
        return tensor.detach().reshape(-1).tolist()  # Python floats: exact for every float dtype

    # torch.load(mmap=True) maps the file privately: a write to the tensor stays in memory
    return TensorRef(name, tuple(int(s) for s in tensor.shape), dtype, read, tensor.detach)


def module_infos(model: Any) -> dict[str, ModuleInfo]:
    """eps / momentum / tracking of every normalisation module of an nn.Module."""
    infos: dict[str, ModuleInfo] = {}
    for name, mod in model.named_modules():
        if hasattr(mod, "running_mean") or hasattr(mod, "track_running_stats"):
            momentum = getattr(mod, "momentum", None)
            tracking = getattr(mod, "track_running_stats", None)
            infos[name] = ModuleInfo(
                class_name=type(mod).__name__,
                eps=_real(getattr(mod, "eps", None)),
                momentum=_real(momentum),
                track_running_stats=tracking if isinstance(tracking, bool) else None,
                # a momentum that is neither a number nor None (cumulative) says nothing
                momentum_known=hasattr(mod, "momentum") and (momentum is None or _real(momentum) is not None),
            )
    return infos


def _real(value: Any) -> float | None:
    """A module attribute as a float if it is a real number (not bool), else None.

    The attributes of an unpickled or scripted module come from the file, so a
    string, a tensor or a numpy scalar can stand where a float belongs.
    """
    # numbers.Real: numpy registers its scalar types there, so they pass without importing numpy
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        return float(value)
    except (OverflowError, ValueError):
        return None


# ----------------------------------------------------------------------------- safetensors

_ST_DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2),
    "BF16": ("bfloat16", 2), "I64": ("int64", 8), "I32": ("int32", 4),
    "I16": ("int16", 2), "I8": ("int8", 1), "U8": ("uint8", 1), "BOOL": ("bool", 1),
    "U16": ("uint16", 2), "U32": ("uint32", 4), "U64": ("uint64", 8),
    "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1),
}


def read_safetensors(path: str) -> tuple[dict[str, TensorRef], dict[str, str]]:
    """Validate a safetensors header and return lazy per-tensor readers.

    Every claim of the header (header length, offsets, shapes, dtypes) is checked
    against the file's real size before anything is allocated.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise BnauditError(f"{path}: truncated safetensors file")
        n = int.from_bytes(head, "little")
        if n > size - 8 or n > MAX_SAFETENSORS_HEADER:
            raise BnauditError(
                f"{path}: corrupt safetensors header (claims {n} bytes, file has {size})"
            )
        try:
            header = json.loads(f.read(n))
        except (ValueError, RecursionError) as exc:  # bad UTF-8/JSON, 5000-digit ints, deep nesting
            raise BnauditError(f"{path}: corrupt safetensors header ({_first_line(exc)})") from None
    if not isinstance(header, dict):
        raise BnauditError(f"{path}: corrupt safetensors header (not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise BnauditError(f"{path}: corrupt safetensors metadata (not a JSON object)")
    data_start = 8 + n
    data_size = size - data_start
    tensors: dict[str, TensorRef] = {}
    for name, info in header.items():
        try:
            st_dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise BnauditError(f"{path}: corrupt safetensors entry '{name}'") from None
        if not isinstance(st_dtype, str) or st_dtype not in _ST_DTYPES:
            raise BnauditError(f"{path}: tensor '{name}' has unknown dtype {str(st_dtype)[:40]!r}")
        if not (isinstance(shape, list) and all(_is_count(s) for s in shape)):
            raise BnauditError(f"{path}: tensor '{name}' has an invalid shape {str(shape)[:80]}")
        dtype, itemsize = _ST_DTYPES[st_dtype]
        if not (_is_count(begin) and _is_count(end) and begin <= end <= data_size):
            raise BnauditError(f"{path}: tensor '{name}' lies outside the file (offsets {begin}..{end})")
        if math.prod(shape) * itemsize != end - begin:
            raise BnauditError(f"{path}: tensor '{name}' has {end - begin} bytes for shape {shape}")
        tensors[name] = _file_slice_ref(path, name, data_start + begin, end - begin, dtype, tuple(shape))
    return tensors, {str(k): str(v) for k, v in metadata.items()}


def _is_count(value: Any) -> bool:
    """A non-negative JSON integer (True and False are ints to Python, not here)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _file_slice_ref(path: str, name: str, offset: int, length: int, dtype: str, shape: tuple[int, ...]) -> TensorRef:
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

    return TensorRef(name, shape, dtype, lambda: decode_values(raw(), dtype), to_torch)


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
    "float64": "d", "float32": "f",
    **{f"int{8 * n}": _typecode("bhilq", n) for n in (1, 2, 4, 8)},
    **{f"uint{8 * n}": _typecode("BHILQ", n) for n in (1, 2, 4, 8)},
}


def decode_values(raw: bytes | bytearray, dtype: str) -> list:
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
    values = array(code)
    values.frombytes(raw)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


# ----------------------------------------------------------------------------- write

# The only tensors bnaudit ever writes: the running statistics of a BN layer.
WRITABLE_LEAVES = ("running_mean", "running_var", "num_batches_tracked")
_AT_FDCWD, _AT_EMPTY_PATH = -100, 0x1000


def save_like(
    ckpt: Checkpoint,
    updates: Mapping[str, Any],
    output: str,
    force: bool = False,
    provenance: Mapping[str, Any] | None = None,
    trust_pickle: bool = False,
) -> None:
    """Write `ckpt`'s file again, in its own format, to `output`, with `updates` applied.

    `updates` maps names of the chosen state dict (as `ckpt.tensors` names them, the
    wrapper prefix stripped) to new values for `running_mean`, `running_var` and
    `num_batches_tracked` buffers; each is cast to the stored dtype and must keep the
    stored shape. Everything else stays as it is:

      safetensors   the header with `__metadata__` kept plus a `bnaudit` entry (the
                    provenance as JSON); the data section copied byte for byte, then
                    only the updated tensors' bytes overwritten in place
      torch-zip/legacy  the whole container reloaded (same allow-list as reading) and
                    saved in the same serialization; only the selected state dict's
                    entries replaced; no new keys
      torchscript   the archive loaded, buffers set, saved with its extra files

    Written atomically (see `atomic_write`); the input is never opened for writing.
    Non-finite statistics are refused, naming the layer.
    """
    check_output(output, ckpt.path, force)
    prepared = _prepare_updates(ckpt, updates)
    if ckpt.format == "safetensors":
        def write(f: Any) -> None:
            _write_safetensors_like(ckpt, prepared, provenance, f)
    elif ckpt.format in ("torch-zip", "torch-legacy"):
        obj = load_torch_object(ckpt.path, trust_pickle=trust_pickle, mmap=ckpt.format == "torch-zip")
        _apply_to_container(ckpt, obj, prepared)

        def write(f: Any) -> None:
            import torch

            torch.save(obj, f, _use_new_zipfile_serialization=ckpt.format == "torch-zip")
    elif ckpt.format == "torchscript":
        module, extra = _load_script_for_rewrite(ckpt.path)
        buffers = dict(module.named_buffers())
        for name, value in prepared.items():
            buffers[name].copy_(value)

        def write(f: Any) -> None:
            import torch

            torch.jit.save(module, f, _extra_files=extra)
    else:  # pragma: no cover - read_checkpoint knows no other format
        raise BnauditError(f"{ckpt.path}: cannot write format {ckpt.format}")
    atomic_write(output, write, force=force)


def _prepare_updates(ckpt: Checkpoint, updates: Mapping[str, Any]) -> dict[str, Any]:
    """Validate `updates` against the checkpoint and cast them to the stored dtypes."""
    import torch

    prepared: dict[str, Any] = {}
    for name, value in updates.items():
        layer, _, leaf = name.rpartition(".")
        if leaf not in WRITABLE_LEAVES:
            raise ValueError(f"save_like only writes {', '.join(WRITABLE_LEAVES)}, not {name!r}")
        ref = ckpt.tensors.get(name)
        if ref is None:
            raise ValueError(f"{name!r} is not a tensor of {ckpt.path}")
        dtype = getattr(torch, ref.dtype)
        tensor = torch.as_tensor(value).detach().to("cpu")
        if tuple(tensor.shape) != ref.shape:
            if leaf == "num_batches_tracked" and tensor.numel() == 1 == math.prod(ref.shape):
                tensor = tensor.reshape(ref.shape)
            else:
                raise ValueError(f"{name!r}: new shape {tuple(tensor.shape)} differs from stored {ref.shape}")
        cast = tensor.to(dtype)
        if cast.is_floating_point() and not bool(torch.isfinite(cast).all()):
            bad = int((~torch.isfinite(cast)).sum())
            raise BnauditError(
                f"layer {layer}: refusing to write a non-finite {leaf} ({bad} of {cast.numel()} channel(s) "
                f"NaN or Inf in {ref.dtype})")
        prepared[name] = cast.contiguous()
    return prepared


def tensor_bytes(tensor: Any) -> bytes:
    """A tensor's bytes in memory order (little-endian here), without the numpy bridge
    (which would import numpy: start-up time)."""
    import ctypes

    t = tensor.detach().cpu().contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()) if t.numel() else b""


def _write_safetensors_like(ckpt: Checkpoint, prepared: dict[str, Any], provenance: Mapping[str, Any] | None,
                            f: Any) -> None:
    if sys.byteorder != "little":  # pragma: no cover - safetensors is little-endian
        raise BnauditError("writing safetensors needs a little-endian machine")
    with open(ckpt.path, "rb") as src:
        n = int.from_bytes(src.read(8), "little")
        header = json.loads(src.read(n))
        metadata = dict(header.pop("__metadata__", None) or {})
        if provenance is not None:
            metadata["bnaudit"] = json.dumps(dict(provenance), sort_keys=True)
        new_header = {"__metadata__": metadata, **header} if metadata else header
        raw = json.dumps(new_header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)  # keep the data section 8-byte aligned, as safetensors does
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        data_start = f.tell()
        while chunk := src.read(16 * 1024 * 1024):
            f.write(chunk)
    for name, tensor in prepared.items():
        begin, end = header[ckpt.prefix + name]["data_offsets"]
        data = tensor_bytes(tensor)
        if len(data) != end - begin:  # pragma: no cover - _prepare_updates checked shape and dtype
            raise ValueError(f"{name}: {len(data)} bytes for a slot of {end - begin}")
        f.seek(data_start + begin)
        f.write(data)
    f.seek(0, os.SEEK_END)


def _apply_to_container(ckpt: Checkpoint, obj: Any, prepared: dict[str, Any]) -> None:
    """Replace the updated entries of the state dict at `ckpt.key` inside `obj`."""
    import torch

    target = obj
    for part in ckpt.key.split("/") if ckpt.key else []:
        target = target[part]
    if isinstance(target, torch.nn.Module):
        with torch.no_grad():
            for name, value in prepared.items():
                target.get_buffer(ckpt.prefix + name).copy_(value)
        return
    for name, value in prepared.items():
        full = ckpt.prefix + name
        old = target[full]
        # a new tensor rather than an in-place copy: storage shared with other
        # entries (an EMA copy, a tied buffer) must not change with it
        target[full] = value.to(old.device)


def _load_script_for_rewrite(path: str) -> tuple[Any, dict[str, bytes]]:
    """A TorchScript archive as a module, with its extra files (kept on save)."""
    import torch

    with zipfile.ZipFile(path) as archive:
        names = [n.split("/extra/", 1)[1] for n in archive.namelist()
                 if "/extra/" in n and n.count("/") >= 2 and not n.endswith("/")]
    extra = {name: b"" for name in names}
    try:
        module = torch.jit.load(path, map_location="cpu", _extra_files=extra)
    except Exception as exc:
        raise BnauditError(f"{path}: cannot load TorchScript archive ({_first_line(exc)})") from None
    return module, extra


def check_output(output: str, source: str | None = None, force: bool = False) -> None:
    """Refuse, before any work, an output that is the input, a folder, in a missing
    or read-only folder, or that exists (without `force`)."""
    if not output:
        raise BnauditError("the output path is empty")
    directory = os.path.dirname(os.path.abspath(output))
    if source is not None and os.path.exists(output) and os.path.exists(source) and os.path.samefile(output, source):
        raise BnauditError(f"{output}: is the input checkpoint; write the new one to another file")
    if os.path.isdir(output):
        raise BnauditError(f"{output}: is a directory")
    if not os.path.isdir(directory):
        raise BnauditError(f"{output}: folder {directory} does not exist")
    # access() also answers EROFS for root on a read-only mount: fail before the work,
    # not after it (atomic_write still reports a refusal that comes later).
    if not os.access(directory, os.W_OK | os.X_OK):
        raise BnauditError(f"{output}: folder {directory} is not writable")
    if os.path.lexists(output) and not force:
        raise BnauditError(f"{output}: already exists (pass --force to overwrite)")


def atomic_write(output: str, write: Callable[[Any], None], force: bool = False) -> None:
    """Create `output` from `write(fileobj)` all at once, or not at all.

    The bytes go to an unnamed file (O_TMPFILE) in the target folder, are flushed and
    fsynced, and only then get a name: linked to `output` directly (which fails if
    it exists: no race with another writer), or, with `force`, linked to a
    temporary name and renamed over `output`. A crash, Ctrl-C or kill at any point
    before leaves no file behind. Where O_TMPFILE is unavailable a hidden temporary
    file `.NAME.bnaudit-PID.tmp` is used and removed on any error or Ctrl-C.
    """
    output = os.fspath(output)
    check_output(output, force=force)
    directory = os.path.dirname(os.path.abspath(output))
    base = os.path.basename(output)
    try:
        fd = _open_unnamed(directory)
        if fd is not None:
            with os.fdopen(fd, "w+b") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
                if not _name_unnamed(f.fileno(), output, directory, base, force):
                    # no way to give the unnamed file a name here: copy it into a named one
                    f.seek(0)
                    _write_named(output, directory, base, force, lambda g: _copy_file(f, g))
        else:
            _write_named(output, directory, base, force, write)
        _fsync_dir(directory)
    except FileExistsError:
        raise BnauditError(f"{output}: already exists (pass --force to overwrite)") from None
    except OSError as exc:
        raise BnauditError(f"cannot write {output}: {exc.strerror or exc}") from None


def _copy_file(src: Any, dst: Any) -> None:
    import shutil

    shutil.copyfileobj(src, dst, 16 * 1024 * 1024)


def _open_unnamed(directory: str) -> int | None:
    flag = getattr(os, "O_TMPFILE", None)
    if flag is None:
        return None
    umask = os.umask(0)
    os.umask(umask)
    try:
        return os.open(directory, flag | os.O_RDWR, 0o666 & ~umask)
    except OSError as exc:
        import errno

        if exc.errno in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT):
            return None  # the filesystem does not support it
        raise


def _link_fd(fd: int, target: str) -> bool:
    """Give the unnamed file `fd` the name `target`; FileExistsError if it exists,
    False if this system offers no way to do it."""
    import ctypes
    import errno

    try:
        os.link(f"/proc/self/fd/{fd}", target, follow_symlinks=True)
        return True
    except FileExistsError:
        raise
    except OSError:
        pass  # e.g. EXDEV where /proc is not the host's: try linkat(AT_EMPTY_PATH)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        result = libc.linkat(fd, b"", _AT_FDCWD, os.fsencode(target), _AT_EMPTY_PATH)
    except (OSError, AttributeError):
        return False
    if result == 0:
        return True
    if ctypes.get_errno() == errno.EEXIST:
        raise FileExistsError(errno.EEXIST, "File exists", target)
    return False


def _name_unnamed(fd: int, output: str, directory: str, base: str, force: bool) -> bool:
    if not force:
        return _link_fd(fd, output)
    temp = os.path.join(directory, f".{base}.bnaudit-{os.getpid()}-{os.urandom(4).hex()}.tmp")
    if not _link_fd(fd, temp):
        return False
    try:
        os.replace(temp, output)
    except BaseException:
        _unlink_quietly(temp)
        raise
    return True


def _write_named(output: str, directory: str, base: str, force: bool, write: Callable[[Any], None]) -> None:
    import tempfile

    fd, temp = tempfile.mkstemp(dir=directory, prefix=f".{base}.bnaudit-{os.getpid()}-", suffix=".tmp")
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temp, 0o666 & ~umask)
        with os.fdopen(fd, "w+b") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if force:
            os.replace(temp, output)
        else:
            os.link(temp, output)  # fails if output appeared meanwhile
            os.unlink(temp)
    except BaseException:
        _unlink_quietly(temp)
        raise


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _fsync_dir(directory: str) -> None:
    """Make the new name itself durable (POSIX: fsync the folder)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)

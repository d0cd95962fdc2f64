"""Finding the model's state dict inside whatever a torch.save file holds.

Training frameworks wrap the state dict (`{"state_dict": ...}`, `{"model": ...,
"optimizer": ...}`, EMA copies, a whole pickled nn.Module) and prefix its keys (DDP's
`module.`, torch.compile's `_orig_mod.`, Lightning's `model.`). This module decides
which mapping is the model (known keys first, optimizer subtrees skipped, an EMA copy
only when it is the only one or `--key` names it) and strips the prefixes. It works on
objects already loaded: it opens no file.

ema-pytorch's `EMA` module saves one state dict holding two models: `ema_model.*` (the
average) and `online_model.*` (the trained model, unless `include_online_model=False`)
beside its `initted` and `step` buffers. It is read as two state dicts, `ema_model` (an
averaged copy) and `online_model` (its live model), never as one mixed set of layers.
"""

from __future__ import annotations

import math
import numbers
import re
import sys
from collections.abc import Mapping
from typing import Any

from bnaudit.errors import BnauditError
from bnaudit.formats.model import Averaging, Checkpoint, ModuleInfo, TensorRef, torch_ref
from bnaudit.formats.pickled import PickledModule, mapping_items, numpy_number
from bnaudit.formats.provenance import MODULE_RECORD_ATTRIBUTE, RECORD_KEY, record_from_state_dict_metadata
from bnaudit.normkinds import NormKind, classify
from bnaudit.text import exception_line


def checkpoint_from_object(
    path: str, fmt: str, obj: Any, key: str | None, candidates: dict[str, Any] | None = None
) -> Checkpoint:
    """Find the state dict inside a loaded container and wrap it as a `Checkpoint`;
    `candidates`: `find_state_dicts(obj)` where the caller has it."""
    if candidates is None:
        candidates = find_state_dicts(obj)
    if not candidates:
        raise BnauditError(f"{path}: holds no state dict (no mapping of names to tensors)")
    chosen = choose_state_dict(path, candidates, key)
    ckpt = strip_wrapper_prefix(wrap_candidate(path, fmt, candidates, chosen))
    source = candidates[chosen]
    if isinstance(source, EmaPytorchPart):  # stored as one state dict, its names under the part's prefix
        ckpt.stored_at, ckpt.prefix = source.stored_at, source.prefix + ckpt.prefix
        if source.is_ema:
            from bnaudit.formats.ema import ema_pytorch_averaging

            ckpt.averaging = ema_pytorch_averaging(source.step)
    if ckpt.is_ema:
        live = live_counterpart(candidates, chosen)
        if live is not None:
            ckpt.live_tensors = strip_wrapper_prefix(wrap_candidate(path, fmt, candidates, live)).tensors
        from bnaudit.formats.ema import ema_averaging, ema_schedule

        if ckpt.averaging is None:
            ckpt.averaging = ema_averaging(ckpt.tensors, ckpt.live_tensors)
        ckpt.ema_schedule = ema_schedule(obj)
    return ckpt


def live_counterpart(candidates: dict[str, Any], chosen: str) -> str | None:
    """The live model beside an averaged copy `chosen` in the same container: the state dict
    `choose_state_dict` would pick among the candidates that are not EMA copies, or None
    (ema-pytorch's `ema_model` has its own `online_model`)."""
    part = candidates[chosen]
    if isinstance(part, EmaPytorchPart):
        online = part.sibling
        return online if online in candidates else None
    others = {k: v for k, v in candidates.items() if k != chosen and not _is_ema_candidate(k, v)}
    if not others:
        return None
    return choose_state_dict("", others, None)


def wrap_candidate(path: str, fmt: str, candidates: dict[str, Any], chosen: str) -> Checkpoint:
    """A `Checkpoint` of `candidates[chosen]` (a state dict or an nn.Module, whose
    module settings are kept), names as they are; the other candidates are listed."""
    source = candidates[chosen]
    modules: dict[str, ModuleInfo] = {}
    metadata = record_from_state_dict_metadata(getattr(source, "_metadata", None))
    if _is_module(source):
        record = _attribute(source, MODULE_RECORD_ATTRIBUTE)
        metadata = {RECORD_KEY: record} if isinstance(record, str) else {}
        try:
            modules = module_infos(source)
            source = source.state_dict()
        except Exception as exc:  # attributes come from the file: a forged module breaks here
            raise BnauditError(f"{path}: malformed pickled module ({exception_line(exc, with_type=False)})") from None
    tensors: dict[str, TensorRef] = {}
    for name, t in mapping_items(source):
        if isinstance(name, str):
            if isinstance(t, TensorRef):  # most of them: no further call to tell it
                tensors[name] = t.renamed(name)
            elif _is_tensor(t):
                tensors[name] = torch_ref(name, t)
    return Checkpoint(
        path,
        fmt,
        tensors,
        metadata=metadata,
        key=None if chosen == "" else chosen,
        other_keys=[k for k in candidates if k != chosen],
        is_ema=_is_ema_candidate(chosen, candidates[chosen]),
        averaging=_pickled_averaged_model(candidates[chosen]),
        modules=modules,
        holds_module=bool(modules) or _is_module(candidates[chosen]),
    )


# torch.optim.swa_utils.AveragedModel registers the buffer `n_averaged` beside the model it
# wraps as `module`: its state dict is `n_averaged` and `module.<name>` for every other key,
# whatever the averaging function (SWA, EMA, single or multi-tensor) and use_buffers.
AVERAGED_COUNT = "n_averaged"
_AVERAGED_MODULE = "module."

_COUNTER_MEANINGS = {
    "copied": "num_batches_tracked is the live model's training counter at the last update_parameters "
    "(copied with the buffers)",
    "averaged": "num_batches_tracked is an average of the live model's counters (truncated to an integer "
    "at every update): it counts no batches",
    "unknown": "num_batches_tracked is the live model's counter (buffers copied, use_buffers=False) or an "
    "average of its counters (use_buffers=True): not a count of this copy's batches",
}


def averaged_model_record(n_averaged: int | None, buffers: str) -> Averaging:
    """The `Averaging` of an AveragedModel state dict. `buffers` "unknown" unless decided:
    use_buffers is not saved, and after more than one update copied and averaged buffers
    look alike (a copy's are bit-identical to the live model's: `diff` decides it)."""
    return Averaging("AveragedModel", n_averaged, buffers, _COUNTER_MEANINGS[buffers])


def recognise_averaged_model(ckpt: Checkpoint) -> Checkpoint:
    """Read an AveragedModel state dict as one: `n_averaged` (one integer) beside keys that
    all start with `module.`. The count leaves the tensors for `ckpt.averaging` (writers
    keep it: they rewrite only BN buffers of the stored container), the copy is marked
    `is_ema`, and `strip_wrapper_prefix` then strips `module.` like any wrapper's.

    With `n_averaged` <= 1 the buffers are the one model's (copied and averaged agree)."""
    ref = ckpt.tensors.get(AVERAGED_COUNT)
    if ref is None:
        return ckpt
    others = [n for n in ckpt.tensors if n != AVERAGED_COUNT]
    if not others or not ref.is_integer or math.prod(ref.shape) != 1:
        return ckpt
    if not all(n.startswith(_AVERAGED_MODULE) for n in others):
        return ckpt
    try:
        [value] = ref.read()
        count: int | None = int(value) if value >= 0 else None
    except (BnauditError, ValueError, TypeError):  # a torn or forged counter: the layout holds anyway
        count = None
    if ckpt.averaging is not None:  # a pickled AveragedModel said what use_buffers was
        buffers = ckpt.averaging.buffers
    else:
        buffers = "copied" if count is not None and count <= 1 else "unknown"
    ckpt.tensors = {n: ckpt.tensors[n] for n in others}
    ckpt.averaging = averaged_model_record(count, buffers)
    ckpt.is_ema = True
    return ckpt


def _pickled_averaged_model(value: Any) -> Averaging | None:
    """A pickled AveragedModel keeps `use_buffers`: its buffers are known averaged or copied."""
    use_buffers = getattr(value, "use_buffers", None) if type(value).__name__ == "AveragedModel" else None
    if not isinstance(use_buffers, bool) or not _is_module(value):
        return None
    return averaged_model_record(None, "averaged" if use_buffers else "copied")


# Subtrees that hold tensors but never the model's state dict.
_SKIP_KEYS = {
    "optimizer",
    "optimizers",
    "optimizer_states",
    "optimizer_state_dict",
    "optim",
    "opt",
    "lr_scheduler",
    "lr_schedulers",
    "scheduler",
    "schedulers",
    "scaler",
    "grad_scaler",
    "amp",
    "loops",
    "callbacks",
    "message_hub",
    "rng_state",
}


# Known state-dict keys, most likely first (torchvision, timm, Lightning, DeepSpeed, pycls, ...).
_PREFERRED_KEYS = ("state_dict", "model", "model_state_dict", "module", "net", "model_state", "params")


_EMA_RE = re.compile(r"(^|[_/])ema($|[_/])|_ema$|^ema_", re.IGNORECASE)


def _is_ema_key(key: str) -> bool:
    return bool(key) and bool(_EMA_RE.search(key))


def _is_ema_candidate(key: str, value: Any) -> bool:
    """An averaged copy: an ema-pytorch `ema_model` part, else by its key's name (an
    ema-pytorch `online_model` is live whatever its container is called)."""
    if isinstance(value, EmaPytorchPart):
        return value.is_ema
    return _is_ema_key(key)


class EmaPytorchPart(dict[str, Any]):
    """One of the two models of an ema-pytorch `EMA` state dict, its names without the
    `ema_model.` / `online_model.` prefix: `is_ema` for the average, `step` the EMA's update
    counter (`step` buffer, None where unreadable), `sibling` the other part's key,
    `stored_at` and `prefix` where its tensors are stored (the EMA state dict's key path and
    "ema_model." / "online_model."). The average keeps the stored dict's `_metadata` (where
    `bnaudit recalibrate` records what it re-estimated: the average is what it repairs)."""

    def __init__(
        self, items: dict[str, Any], is_ema: bool, step: int | None, sibling: str, stored_at: str, prefix: str
    ) -> None:
        super().__init__(items)
        self.is_ema, self.step, self.sibling = is_ema, step, sibling
        self.stored_at, self.prefix = stored_at, prefix
        self._metadata: Any = None


_EMA_PYTORCH_PARTS = ("ema_model.", "online_model.")


def split_ema_pytorch(key: str, value: Any) -> dict[str, Any] | None:
    """The two state dicts of an ema-pytorch `EMA` state dict (module docstring) under
    `key/ema_model` and `key/online_model`, or None when `value` is not one: `initted` and
    `step` beside keys that all start with `ema_model.` or `online_model.`, some `ema_model.`."""
    if not isinstance(value, Mapping):
        return None
    items = [(k, v) for k, v in mapping_items(value) if isinstance(k, str)]
    names = {k for k, _ in items}
    if not {"initted", "step"} <= names or not any(k.startswith("ema_model.") for k in names):
        return None
    if not all(k in ("initted", "step") or k.startswith(_EMA_PYTORCH_PARTS) for k in names):
        return None
    step_ref = dict(items)["step"]
    step: int | None = None
    try:
        if isinstance(step_ref, TensorRef) and step_ref.is_integer and math.prod(step_ref.shape) == 1:
            step = int(step_ref.read()[0])
        elif _is_tensor(step_ref) and step_ref.numel() == 1:
            step = int(step_ref.item())
    except (BnauditError, ValueError, TypeError):
        step = None
    base = f"{key}/" if key else ""
    parts: dict[str, Any] = {}
    for prefix, is_ema in (("online_model.", False), ("ema_model.", True)):  # the live model first
        own = {k[len(prefix) :]: v for k, v in items if k.startswith(prefix)}
        if own:
            other = "online_model" if is_ema else "ema_model"
            part = EmaPytorchPart(own, is_ema, step, base + other, key, prefix)
            if is_ema:
                part._metadata = getattr(value, "_metadata", None)
            parts[base + prefix[:-1]] = part
    return parts


def _is_tensor(value: Any) -> bool:
    if isinstance(value, TensorRef):  # read lazily by the stand-in reader (formats/standins.py)
        return True
    return type(value).__module__.startswith("torch") and hasattr(value, "dtype") and hasattr(value, "shape")


def _is_module(value: Any) -> bool:
    if isinstance(value, PickledModule):  # read without torch (formats/torchsave.py)
        return True
    # a torch module exists only where torch was imported: never import it to ask
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.nn.Module)


def _attribute(module: Any, name: str) -> Any:
    """`getattr(module, name, None)` of a torch module or a `PickledModule`."""
    return module.attribute(name) if isinstance(module, PickledModule) else getattr(module, name, None)


def _has(module: Any, name: str) -> bool:
    return module.has(name) if isinstance(module, PickledModule) else hasattr(module, name)


def _class_facts(module: Any) -> tuple[str, tuple[str, ...]]:
    """(class name, qualified base class names nearest first) of a module. A pickled one's
    bases are unknown without importing its class: its name decides (`normkinds.CLASSES`)."""
    if isinstance(module, PickledModule):
        return module.class_name, ()
    cls = type(module)
    return cls.__name__, tuple(f"{c.__module__}.{c.__qualname__}" for c in cls.__mro__[1:] if c is not object)


def _is_tensor_mapping(value: Any) -> bool:
    if not isinstance(value, Mapping) or not value:
        return False
    if not all(isinstance(k, str) for k in value):
        return False
    n_tensors = sum(1 for _, v in mapping_items(value) if isinstance(v, TensorRef) or _is_tensor(v))
    return n_tensors > 0 and n_tensors * 2 >= len(value)


def find_state_dicts(obj: Any, max_depth: int = 4) -> dict[str, Any]:
    """Every state dict (or nn.Module) in a container, keyed by '/'-joined path.

    The root itself has path "". Optimizer, scheduler and similar subtrees are
    skipped; a state dict's own entries are not searched further.
    """
    found: dict[str, Any] = {}
    # depth first, in the container's order; a loop, not a nested recursive function, which
    # would refer to itself: a cycle keeping `found`, the whole checkpoint, until a collection
    stack: list[tuple[Any, str, int]] = [(obj, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if _is_module(value) or _is_tensor_mapping(value):
            parts = split_ema_pytorch(path, value) if not _is_module(value) else None
            found.update(parts if parts is not None else {path: value})
            continue
        if depth >= max_depth or not isinstance(value, Mapping):
            continue
        children = [
            (v, f"{path}/{k}" if path else k, depth + 1)
            for k, v in mapping_items(value)
            if isinstance(k, str) and k.lower() not in _SKIP_KEYS
        ]
        stack.extend(reversed(children))
    return found


def choose_state_dict(path: str, candidates: dict[str, Any], key: str | None) -> str:
    if key is not None:
        if key in candidates:
            return key
        listed = ", ".join(repr(k) for k in candidates if k) or "only the root"
        raise BnauditError(f"{path}: no state dict under key '{key}' (found: {listed})")
    if "" in candidates:
        return ""
    non_ema = [k for k, v in candidates.items() if not _is_ema_candidate(k, v)] or list(candidates)

    def rank(k: str) -> tuple[int, int, int]:
        parts = k.split("/")
        known = min((_PREFERRED_KEYS.index(p) for p in parts if p in _PREFERRED_KEYS), default=99)
        return (known, len(parts), -len(candidates[k]) if isinstance(candidates[k], Mapping) else 0)

    return min(non_ema, key=rank)


_WRAPPER_PREFIXES = ("module.", "_orig_mod.", "model.")


def strip_wrapper_prefix(ckpt: Checkpoint) -> Checkpoint:
    """Strip DDP / torch.compile / Lightning / AveragedModel prefixes, only when every key
    has one (an AveragedModel's `n_averaged` set aside first: `recognise_averaged_model`)."""
    ckpt = recognise_averaged_model(ckpt)
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
                names = [n[len(prefix) :] for n in names]
                stripped += prefix
                changed = True
                break
    if stripped:
        cut = len(stripped)
        ckpt.tensors = {name[cut:]: ref.renamed(name[cut:]) for name, ref in ckpt.tensors.items()}
        ckpt.modules = {name[cut:] if name.startswith(stripped) else name: info for name, info in ckpt.modules.items()}
        ckpt.prefix = stripped
    return ckpt


def module_infos(model: Any) -> dict[str, ModuleInfo]:
    """eps / momentum / tracking of every module of an nn.Module (or a `PickledModule`) that holds or could hold
    running statistics: a normalisation module of the table (`bnaudit.normkinds`), or any
    other module with a running_mean (BN001 checks those too)."""
    infos: dict[str, ModuleInfo] = {}
    for name, mod in model.named_modules():
        class_name, bases = _class_facts(mod)
        known = classify(class_name, bases) is not NormKind.NOT_NORM
        if known or _has(mod, "running_mean") or _has(mod, "track_running_stats"):
            momentum = _attribute(mod, "momentum")
            tracking = _attribute(mod, "track_running_stats")
            infos[name] = ModuleInfo(
                class_name=class_name,
                bases=bases,
                eps=real_or_none(_attribute(mod, "eps")),
                momentum=real_or_none(momentum),
                track_running_stats=tracking if isinstance(tracking, bool) else None,
                # a momentum that is neither a number nor None (cumulative) says nothing
                momentum_known=_has(mod, "momentum") and (momentum is None or real_or_none(momentum) is not None),
            )
    return infos


def real_or_none(value: Any) -> float | None:
    """A module attribute as a float if it is a real number (not bool), else None.

    The attributes of an unpickled or scripted module come from the file, so a
    string, a tensor or a numpy scalar can stand where a float belongs.
    """
    # numbers.Real: numpy registers its scalar types there, so they pass without importing numpy;
    # a numpy scalar the restricted reader recorded is decoded from its bytes
    recorded = numpy_number(value)
    if recorded is not None:
        value = recorded
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        return float(value)
    except (OverflowError, ValueError):
        return None

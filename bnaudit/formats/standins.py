"""Stand-ins for the classes a torch.save file pickles outside its state dict: checked here.

A Lightning checkpoint keeps `hyper_parameters` (an omegaconf.DictConfig, a dataclass,
a class of the user's project) next to a state dict of plain tensors; a timm or
torchvision one keeps an `args` object. `torch.load(weights_only=True)` refuses the
whole file for that one object. The restricted unpickler (formats/unpickle.py) reads the
file instead with every global it does not allow replaced by an inert `StandIn`
(formats/pickled.py: never imported, never called; an instance of one is a
`StandInObject` holding its arguments and state as data; a call of one is refused).

`check_stand_ins` then refuses the file when a stand-in sits inside the state dict
being audited, and otherwise lists the ones skipped ("hyper_parameters holds
omegaconf.DictConfig: not loaded").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from bnaudit.errors import BnauditError
from bnaudit.formats.model import Checkpoint, TensorRef, stored_key
from bnaudit.formats.pickled import StandIn, StandInObject, mapping_items

_STAND_IN_TYPES = (StandIn, StandInObject)


def called_refusal(path: str, name: str) -> BnauditError:
    """The refusal of a file whose pickle calls (or builds through) the global `name`."""
    return BnauditError(
        f"{path}: refused to unpickle: it calls a global that could run code ({name}); "
        "if you trust this file, pass --trust-pickle; safer still, save a state dict or a .safetensors file"
    )


def unsafe_globals_error(path: str, unsafe: list[str], hint: str = "") -> BnauditError:
    """The refusal of a file that needs globals outside what its reader allows."""
    shown = ", ".join(unsafe[:8]) + (f" and {len(unsafe) - 8} more" if len(unsafe) > 8 else "")
    return BnauditError(
        f"{path}: refused to unpickle: it needs globals that could run code ({shown}); "
        "if you trust this file, pass --trust-pickle; safer still, save a state dict "
        "or a .safetensors file" + (f"; {hint}" if hint else "")
    )


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
            items: Any = mapping_items(value)
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
    key = stored_key(ckpt)
    for part in key.split("/") if key else []:
        target = dict.__getitem__(target, part) if isinstance(target, dict) else target[part]
    in_target = stand_ins_in(target)
    inside = list(in_target)
    metadata = getattr(target, "_metadata", None)
    if metadata is not None:
        inside += stand_ins_in(metadata)
    if inside:
        where, name = inside[0]
        at = f"'{key}/{where}'" if key else f"'{where}'"
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

"""A pickled `torch.nn` module as data: what `torch.save(model)` stores, read without torch.

`torch.save(model)` pickles each module as its class (a global of `torch.nn.modules.*`)
and its `__dict__`: `_parameters`, `_buffers` and `_modules` (ordered name -> value
mappings), `_non_persistent_buffers_set`, and plain attributes (`eps`, `momentum`,
`track_running_stats`, ...). The torch-free reader (formats/torchsave.py) keeps the
class's name and that dict; nothing of the class is imported or run. This module answers
what `nn.Module` would: `named_modules()` (each module once, as torch's does),
`state_dict()` (parameters, then persistent buffers, then each child's, as
`Module.state_dict` orders them) and attribute lookup (`__dict__`, then `_parameters`,
`_buffers`, `_modules`, as `Module.__getattr__` falls back).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bnaudit.errors import BnauditError

# A forged pickle can share one module under two names at every level, so that the
# paths a state dict walks double per level: the walk is bounded, as TorchScript's is.
_MAX_VISITS = 100_000


class PickledModule:
    """An instance of a `torch.nn` class from a pickle: `qualname` and the state its
    BUILD opcode set (the module's `__dict__`), as data."""

    def __init__(self, qualname: str) -> None:
        self.qualname = qualname
        self.state: Any = {}

    @property
    def class_name(self) -> str:
        return self.qualname.rsplit(".", 1)[-1]

    def _dict(self, name: str) -> Mapping[Any, Any]:
        value = self.state.get(name, {}) if isinstance(self.state, Mapping) else {}
        if not isinstance(value, Mapping):
            raise BnauditError(f"module attribute {name} of {self.class_name} is not a mapping")
        return value

    def has(self, name: str) -> bool:
        """`hasattr(module, name)` of the unpickled module."""
        return (isinstance(self.state, Mapping) and name in self.state) or any(
            name in self._dict(d) for d in ("_parameters", "_buffers", "_modules")
        )

    def attribute(self, name: str, default: Any = None) -> Any:
        """`getattr(module, name, default)` of the unpickled module."""
        if isinstance(self.state, Mapping) and name in self.state:
            return self.state[name]
        for holder in ("_parameters", "_buffers", "_modules"):
            values = self._dict(holder)
            if name in values:
                return values[name]
        return default

    def children(self) -> list[tuple[str, PickledModule]]:
        out = []
        for name, child in self._dict("_modules").items():
            if child is None:
                continue
            if not isinstance(child, PickledModule) or not isinstance(name, str):
                raise BnauditError(f"child {str(name)[:40]!r} of {self.class_name} is not a module")
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
                for name, value in module._dict(holder).items():
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

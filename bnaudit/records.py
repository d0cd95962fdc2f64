"""`dataclass` for bnaudit's records: the standard library's, defined at a quarter of the cost.

Python 3.11 compiles every method it generates for a dataclass on its own: a frozen record
costs ~0.5 ms to define, and `bnaudit inspect x.safetensors` defines 35 of them, a sixth of
its run. Here the standard library still collects the fields (`__dataclass_fields__`, the
`Field`s, `__match_args__`: all that `dataclasses.fields`, `replace`, `asdict` and pattern
matching read), but only `__init__` is compiled, since records are built by the thousand in
a folder scan; `__repr__`, `__eq__`, `__hash__` and a frozen record's `__setattr__` /
`__delattr__` are closures over the field names, with the results of the generated ones.
`tests/test_records.py` compares every record class of the package with its twin made by
the standard library.

A class this does not cover (a dataclass base, `__post_init__`, `InitVar`, `kw_only`,
`init=False` fields, options other than `frozen`) is handed to `dataclasses.dataclass`
whole. Type checkers see `dataclasses.dataclass` itself.
"""

from __future__ import annotations

import _thread
import dataclasses
import inspect  # dataclasses imports it: no cost
import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

__all__ = ["dataclass"]

if TYPE_CHECKING:
    from dataclasses import dataclass as dataclass
else:

    def dataclass(cls: type | None = None, /, *, frozen: bool = False, **options: Any) -> Any:
        def wrap(cls: type) -> type:
            if options:  # order, slots, kw_only, ...: the standard library's own
                return dataclasses.dataclass(cls, frozen=frozen, **options)
            return _record(cls, frozen)

        return wrap if cls is None else wrap(cls)


class _FactorySentinel:
    """The default of a parameter whose field has a default_factory (shown as <factory>)."""

    def __repr__(self) -> str:
        return "<factory>"


_HAS_DEFAULT_FACTORY = _FactorySentinel()
_PARAMS: dict[bool, Any] = {}  # frozen -> the standard library's __dataclass_params__


def _record(cls: type, frozen: bool) -> type:
    if not _covered(cls):
        return dataclasses.dataclass(cls, frozen=frozen)
    had_doc = bool(cls.__dict__.get("__doc__"))
    # fields, defaults as class attributes, __match_args__: nothing compiled
    cls = dataclasses.dataclass(cls, init=False, repr=False, eq=False)
    fields = dataclasses.fields(cls)
    cls.__dataclass_params__ = _params(frozen)  # type: ignore[attr-defined]
    _set(cls, "__init__", _init(cls, fields, frozen))
    _set(cls, "__repr__", _repr(tuple(f.name for f in fields if f.repr)))
    _set(cls, "__eq__", _eq(tuple(f.name for f in fields if f.compare)))
    # the standard library's hash rule for eq=True, unsafe_hash=False
    explicit = cls.__dict__.get("__hash__", dataclasses.MISSING)
    explicit_hash = not (explicit is dataclasses.MISSING or (explicit is None and "__eq__" in cls.__dict__))
    if frozen:
        for name in ("__setattr__", "__delattr__"):
            if name in cls.__dict__:
                raise TypeError(f"Cannot overwrite attribute {name} in class {cls.__name__}")
        names = frozenset(f.name for f in fields)
        cls.__setattr__ = _frozen_setattr(cls, names)  # type: ignore[assignment]
        cls.__delattr__ = _frozen_delattr(cls, names)  # type: ignore[assignment]
        if not explicit_hash:
            hashed = tuple(f.name for f in fields if (f.compare if f.hash is None else f.hash))
            cls.__hash__ = _hash(hashed)  # type: ignore[assignment]
    elif not explicit_hash:
        cls.__hash__ = None  # type: ignore[assignment]
    if not had_doc:
        cls.__doc__ = cls.__name__ + str(inspect.signature(cls)).replace(" -> None", "")
    return cls


def _covered(cls: type) -> bool:
    """Whether `_record` makes this class as the standard library would: plain fields in
    order (a default after a default), on a class with no dataclass base."""
    if hasattr(cls, "__post_init__") or any(dataclasses.is_dataclass(base) for base in cls.__mro__[1:]):
        return False
    seen_default = False
    for name, annotation in inspect.get_annotations(cls).items():
        text = annotation if isinstance(annotation, str) else repr(annotation)
        if "ClassVar" in text:
            continue
        if "InitVar" in text or "KW_ONLY" in text:
            return False
        value = cls.__dict__.get(name, dataclasses.MISSING)
        if isinstance(value, dataclasses.Field):
            if not value.init or value.kw_only is True:
                return False
            has_default = value.default is not dataclasses.MISSING or value.default_factory is not dataclasses.MISSING
        else:
            has_default = value is not dataclasses.MISSING
        if seen_default and not has_default:
            return False  # the standard library's TypeError, in its words
        seen_default = seen_default or has_default
    return True


def _params(frozen: bool) -> Any:
    if frozen not in _PARAMS:
        probe: Any = dataclasses.dataclass(frozen=frozen)(type("_Probe", (), {"__doc__": "params"}))
        _PARAMS[frozen] = probe.__dataclass_params__
    return _PARAMS[frozen]


def _set(cls: type, name: str, value: Any) -> None:
    if name not in cls.__dict__:  # like the standard library: a method the class defines stays
        setattr(cls, name, value)


def _init(cls: type, fields: tuple[dataclasses.Field[Any], ...], frozen: bool) -> Callable[..., None]:
    """__init__ as the standard library writes it, compiled once."""
    names = {"__dataclass_builtins_object__": object, "_HAS_DEFAULT_FACTORY": _HAS_DEFAULT_FACTORY}
    params, lines = ["self"], []
    for f in fields:
        value = f.name
        if f.default_factory is not dataclasses.MISSING:
            names[f"_dflt_{f.name}"] = f.default_factory
            params.append(f"{f.name}=_HAS_DEFAULT_FACTORY")
            value = f"_dflt_{f.name}() if {f.name} is _HAS_DEFAULT_FACTORY else {f.name}"
        elif f.default is not dataclasses.MISSING:
            names[f"_dflt_{f.name}"] = f.default
            params.append(f"{f.name}=_dflt_{f.name}")
        else:
            params.append(f.name)
        if frozen:
            lines.append(f"__dataclass_builtins_object__.__setattr__(self, {f.name!r}, {value})")
        else:
            lines.append(f"self.{f.name} = {value}")
    body = "\n".join(f"  {line}" for line in lines or ["pass"])
    source = f"def __init__({', '.join(params)}):\n{body}\n"
    scope: dict[str, Any] = {}
    exec(source, names, scope)
    init: Callable[..., None] = scope["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__annotations__ = {**{f.name: f.type for f in fields}, "return": None}
    return init


def _getter(names: tuple[str, ...]) -> Callable[[Any], tuple[Any, ...]]:
    """obj -> the tuple of its `names` (attrgetter gives a bare value for one name)."""
    if not names:
        return lambda obj: ()
    if len(names) == 1:
        one = operator.attrgetter(names[0])
        return lambda obj: (one(obj),)
    return operator.attrgetter(*names)


def _repr(names: tuple[str, ...]) -> Callable[[Any], str]:
    running: set[tuple[int, int]] = set()

    def __repr__(self: Any) -> str:
        key = (id(self), _thread.get_ident())
        if key in running:  # a record that holds itself: the standard library prints ...
            return "..."
        running.add(key)
        try:
            shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in names)
        finally:
            running.discard(key)
        return f"{self.__class__.__qualname__}({shown})"

    return __repr__


def _eq(names: tuple[str, ...]) -> Callable[[Any, Any], Any]:
    values = _getter(names)

    def __eq__(self: Any, other: Any) -> Any:
        if other.__class__ is self.__class__:
            return values(self) == values(other)
        return NotImplemented

    return __eq__


def _hash(names: tuple[str, ...]) -> Callable[[Any], int]:
    values = _getter(names)

    def __hash__(self: Any) -> int:
        return hash(values(self))

    return __hash__


def _frozen_setattr(cls: type[Any], names: frozenset[str]) -> Callable[[Any, str, Any], None]:
    def __setattr__(self: Any, name: str, value: Any) -> None:
        if type(self) is cls or name in names:
            raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")
        super(cls, self).__setattr__(name, value)

    return __setattr__


def _frozen_delattr(cls: type[Any], names: frozenset[str]) -> Callable[[Any, str], None]:
    def __delattr__(self: Any, name: str) -> None:
        if type(self) is cls or name in names:
            raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")
        super(cls, self).__delattr__(name)

    return __delattr__

"""bnaudit.records.dataclass against the standard library: every record class of the package
has a twin made by `dataclasses.dataclass` from the same fields, and the two agree on what a
caller can see (signature, fields, params, repr, equality, hash, frozenness, replace, asdict,
pickling)."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import operator
import pickle
import pkgutil
import types
from pathlib import Path

import pytest
from conftest import REPO

import bnaudit
from bnaudit.records import dataclass

_MADE_HERE = ("__init__", "__repr__", "__eq__", "__hash__", "__setattr__", "__delattr__")
_STDLIB_ATTRS = ("__dataclass_fields__", "__dataclass_params__", "__match_args__", "__dict__", "__weakref__")


class Value:
    """A field value that is equal only to a Value of its name, hashable, picklable, and kept
    by deepcopy (asdict copies values)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Value) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)

    def __repr__(self) -> str:
        return f"<{self.name}>"

    def __deepcopy__(self, memo: dict) -> Value:
        return self


def _records() -> list[type]:
    found = []
    for info in pkgutil.walk_packages(bnaudit.__path__, "bnaudit."):
        if info.name == "bnaudit.__main__":  # runs the CLI
            continue
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if (
                isinstance(value, type)
                and value.__module__ == module.__name__
                and dataclasses.is_dataclass(value)
                and getattr(value.__eq__, "__module__", None) == "bnaudit.records"
            ):
                found.append(value)
    return found


RECORDS = _records()


def _twin(cls: type) -> type:
    """The class as the standard library makes it from the same body."""
    namespace = {k: v for k, v in cls.__dict__.items() if k not in _MADE_HERE + _STDLIB_ATTRS}
    for f in dataclasses.fields(cls):
        namespace[f.name] = dataclasses.field(
            default=f.default,
            default_factory=f.default_factory,
            repr=f.repr,
            hash=f.hash,
            compare=f.compare,
            metadata=f.metadata or None,
        )
    made = types.new_class(cls.__name__, cls.__bases__, {}, lambda ns: ns.update(namespace))
    made.__qualname__ = cls.__qualname__
    return dataclasses.dataclass(frozen=cls.__dataclass_params__.frozen)(made)


def _outcome(action, *args):
    try:
        return ("value", action(*args))
    except Exception as exc:  # the same exception, in the same words, counts as the same
        return ("raised", type(exc).__name__, str(exc))


def test_the_package_defines_its_records_here():
    assert len(RECORDS) >= 90
    names = {c.__qualname__ for c in RECORDS}
    assert {"Finding", "FileReport", "LayerSummary", "Config", "TensorRef", "Checkpoint"} <= names


def test_no_module_takes_dataclass_from_the_standard_library():
    """A record defined with dataclasses.dataclass costs four times as much at start-up."""
    offenders = []
    for path in sorted(Path(REPO, "bnaudit").rglob("*.py")):
        if path.name == "records.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module == "dataclasses":
                offenders += [f"{path.name}: {a.name}" for a in node.names if a.name == "dataclass"]
            if isinstance(node, ast.Attribute) and ast.unparse(node) == "dataclasses.dataclass":
                offenders.append(f"{path.name}: dataclasses.dataclass")
    assert offenders == []


@pytest.mark.parametrize("cls", RECORDS, ids=lambda c: f"{c.__module__}.{c.__qualname__}")
def test_each_record_behaves_as_its_standard_library_twin(cls):
    twin = _twin(cls)
    assert str(inspect.signature(cls)) == str(inspect.signature(twin))
    assert cls.__init__.__annotations__ == twin.__init__.__annotations__
    assert cls.__match_args__ == twin.__match_args__
    assert repr(cls.__dataclass_params__) == repr(twin.__dataclass_params__)
    ours_fields, their_fields = (
        [(f.name, f.type, f.default, f.default_factory, f.init, f.repr, f.hash, f.compare) for f in fields]
        for fields in (dataclasses.fields(cls), dataclasses.fields(twin))
    )
    assert ours_fields == their_fields
    assert (cls.__hash__ is None) == (twin.__hash__ is None)

    required = [p.name for p in inspect.signature(cls).parameters.values() if p.default is inspect.Parameter.empty]
    args = {name: Value(name) for name in required}
    ours, theirs, again = cls(**args), twin(**args), cls(**args)
    assert repr(ours) == repr(theirs)
    assert _outcome(lambda: ours == again) == _outcome(lambda: theirs == twin(**args)) == ("value", True)
    assert (ours == theirs) is False  # another class: NotImplemented both ways
    assert _outcome(lambda: hash(ours)) == _outcome(lambda: hash(theirs))
    assert _outcome(lambda: dataclasses.asdict(ours)) == _outcome(lambda: dataclasses.asdict(theirs))
    for f in dataclasses.fields(cls):
        changed = {**args, f.name: Value("other")}
        assert _outcome(operator.eq, ours, cls(**changed)) == _outcome(operator.eq, theirs, twin(**changed))
        assert repr(dataclasses.replace(ours, **{f.name: Value("other")})) == repr(
            dataclasses.replace(theirs, **{f.name: Value("other")})
        )
        assert _outcome(setattr, ours, f.name, 1) == _outcome(setattr, theirs, f.name, 1)
        assert _outcome(delattr, cls(**args), f.name) == _outcome(delattr, twin(**args), f.name)
    assert _outcome(lambda: setattr(ours, "not_a_field", 1)) == _outcome(lambda: setattr(theirs, "not_a_field", 1))
    refuses = {"__setstate__", "__reduce__", "__reduce_ex__"} & set(cls.__dict__)  # records that refuse BUILD
    if "<locals>" not in cls.__qualname__ and not refuses:  # pickle finds a class by its module and name
        assert pickle.loads(pickle.dumps(ours)) == ours


def test_what_records_does_not_cover_goes_to_the_standard_library():
    @dataclass(frozen=True)
    class Base:
        a: int

    @dataclass(frozen=True)
    class Derived(Base):  # a dataclass base
        b: int = 2

    @dataclass
    class Later:
        a: int

        def __post_init__(self) -> None:
            self.a += 1

    @dataclass
    class Hidden:
        a: int
        b: list[int] = dataclasses.field(init=False, default_factory=list)

    @dataclass(frozen=True, order=True)
    class Ordered:  # an option besides frozen
        a: int

    assert Ordered(1) < Ordered(2) and getattr(Ordered.__eq__, "__module__", None) != "bnaudit.records"
    assert getattr(Derived.__eq__, "__module__", None) != "bnaudit.records"
    assert Derived(1) == Derived(1, 2) and hash(Derived(1)) == hash(Derived(1))
    assert Later(1).a == 2
    assert Hidden(1).b == [] and "b" not in inspect.signature(Hidden).parameters
    with pytest.raises(TypeError, match="non-default argument 'b' follows default argument"):

        @dataclass
        class Disordered:
            a: int = 1
            b: int


def test_a_record_without_a_docstring_is_documented_as_the_standard_library_does():
    @dataclass(frozen=True)
    class Plain:
        a: int
        b: str = "x"

    assert Plain.__doc__ == "Plain(a: 'int', b: 'str' = 'x')"


def test_a_record_that_holds_itself_prints_dots_as_the_standard_library_does():
    @dataclass
    class Node:
        """A node."""

        child: object = None

    node = Node()
    node.child = node
    assert (
        repr(node)
        == "test_a_record_that_holds_itself_prints_dots_as_the_standard_library_does.<locals>.Node(child=...)"
    )

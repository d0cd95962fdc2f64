"""Coerce plain CLI values without pydantic, so running a command starts fast.

typer 0.29 converts every non-flag parameter through a pydantic `TypeAdapter`
(`typer.core.build_runtime_param`). Importing pydantic and building the adapters
costs about as much as importing typer and rich together, and `bnaudit inspect` runs
in pre-commit hooks on every commit. For the plain annotations bnaudit's commands
use (`str`, `int`, `float`, `bool`, an `Enum`, or a list of one of these, with no parser and
no min/max) the conversion is trivial and done here; every other annotation, and
every value this fast path does not accept as obviously valid (a malformed number, an
unknown choice), goes through typer's own conversion, so results and error messages
stay typer's. `install()` does nothing when typer's internals are not the expected
ones (another typer version): the CLI then behaves as before, only slower.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, get_args, get_origin

# Strings that int() / float() and pydantic's lax mode convert to the same number.
# Anything else (underscores, 'inf', hex, whitespace) is left to typer and pydantic.
_INT_RE = re.compile(r"[+-]?[0-9]+")
_FLOAT_RE = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


class _Fallback(Exception):
    """The fast path declines this value: typer's own conversion decides."""


def _leaf_converter(annotation: Any, parameter_info: Any) -> Callable[[Any], Any] | None:
    """A converter for one plain value, or None when typer must handle the type."""
    if annotation is str:
        def to_str(value: Any) -> str:
            if isinstance(value, str):
                return value
            raise _Fallback

        return to_str
    if annotation is bool:
        def to_bool(value: Any) -> bool:
            if isinstance(value, bool):
                return value
            raise _Fallback  # 'yes', '0', ...: typer's rules

        return to_bool
    if annotation is int or annotation is float:
        pattern = _INT_RE if annotation is int else _FLOAT_RE

        def to_number(value: Any) -> Any:
            if isinstance(value, str) and pattern.fullmatch(value):
                return annotation(value)
            if type(value) is annotation:  # a default value of the right type
                return value
            raise _Fallback

        return to_number
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        case_sensitive = parameter_info.case_sensitive

        def to_choice(value: Any) -> Any:
            if isinstance(value, annotation):
                return value
            if isinstance(value, str):
                wanted = value if case_sensitive else value.casefold()
                for member in annotation:
                    text = str(member.value)
                    if (text if case_sensitive else text.casefold()) == wanted:
                        return member
            raise _Fallback  # typer names the valid choices in its error

        return to_choice
    return None


def install() -> bool:
    """Route plain parameters of every typer command through the fast path.

    Returns True when installed (idempotent), False when typer is not the expected version.
    """
    try:
        from typer import core
        from typer._coercion import RuntimeParam
    except ImportError:
        return False
    original = getattr(core, "build_runtime_param", None)
    if original is None or not isinstance(RuntimeParam, type):
        return False
    if getattr(original, "_bnaudit_fast", False):
        return True

    @dataclass(frozen=True)
    class PlainRuntimeParam(RuntimeParam):  # type: ignore[misc, valid-type]
        descriptor: Any
        convert: Callable[[Any], Any]
        is_list: bool

        def _coerce_value(self, value: Any, param: Any, ctx: Any) -> Any:
            try:
                if self.is_list:
                    items = value if isinstance(value, (list, tuple)) else [value]
                    return [self.convert(item) for item in items]
                return self.convert(value)
            except _Fallback:
                return original(self.descriptor)._coerce_value(value, param=param, ctx=ctx)

    def build_runtime_param(descriptor: Any) -> Any:
        info = descriptor.parameter_info
        annotation = descriptor.annotation
        is_list = get_origin(annotation) is list
        leaf = get_args(annotation)[0] if is_list else annotation
        plain = (
            descriptor.file_annotation is None
            and getattr(info, "parser", None) is None
            and getattr(info, "min", None) is None
            and getattr(info, "max", None) is None
        )
        convert = _leaf_converter(leaf, info) if plain else None
        if convert is None:
            return original(descriptor)
        return PlainRuntimeParam(
            parameter_info=info, annotation=annotation, descriptor=descriptor,
            convert=convert, is_list=is_list,
        )

    build_runtime_param._bnaudit_fast = True  # type: ignore[attr-defined]
    core.build_runtime_param = build_runtime_param
    return True

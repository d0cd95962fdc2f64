"""bnaudit's own typer command classes: plain values converted without pydantic, so running
a command starts fast, and argument metavars shown as written.

typer 0.29 converts every non-flag parameter through a pydantic `TypeAdapter`, built the
first time the parameter converts a value (`_TyperParameter.get_runtime_param`).
Importing pydantic and building the adapters costs about as much as importing typer and
rich together, and `bnaudit inspect` runs in pre-commit hooks on every commit. For the
plain annotations bnaudit's commands use (`str`, `int`, `float`, `bool`, an `Enum`, or a
list of one of these, with no parser and no min/max) the conversion is trivial and done
here; any other annotation, and any value this fast path does not recognise as obviously
valid, goes through typer's own conversion. A value neither accepts is a
`typer.BadParameter` in our words ("expected a number"), whichever path refused it.

Nothing in typer is patched. `FastCommand` and `FastGroup` (typer's `cls=`) set the
conversion of each of their own parameters when typer builds them, so another typer app in
the same process (a test, a user's --arch module that uses typer) runs exactly as it would
without bnaudit.

This leans on typer internals, and bnaudit does not pin typer (a pre-commit hook with
`language: system` runs in the user's environment, with the user's typer). So the fast
path is taken only when typer is the minor version it was written and tested against
(`TESTED_TYPER`) and every internal it touches is present with the expected shape
(`coercion_internals_supported`); `lean_group_supported()` does the same for the
single-command group `bnaudit.cli.main` builds. Otherwise the commands are plain typer
commands: the same results, only slower, and value errors in typer's words.

Set the environment variable `BNAUDIT_PLAIN_TYPER=1` (any value but empty or `0`) to
force plain typer even where the fast path would be safe, e.g. to tell whether a
problem comes from it.
"""

from __future__ import annotations

import inspect
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields, is_dataclass
from enum import Enum
from typing import Any, Optional, get_args, get_origin

import typer
import typer.core

PLAIN_TYPER_ENV = "BNAUDIT_PLAIN_TYPER"
# The typer (major, minor) whose internals this module was written against. A new minor
# may move or reshape them without notice; the checks below are a second line of defence.
TESTED_TYPER = (0, 29)

# Strings that int() / float() and pydantic's lax mode convert to the same number.
# Anything else (underscores, 'inf', hex, whitespace) is left to typer and pydantic.
_INT_RE = re.compile(r"[+-]?[0-9]+")
_FLOAT_RE = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


class _Fallback(Exception):
    """The fast path declines this value: typer's own conversion decides."""


# How one plain value converts: a function that raises `_Fallback` to let typer decide,
# and `problem(value)`, the words of the error when typer refuses the value too (None:
# typer's).
Leaf = tuple[Callable[[Any], Any], Optional[Callable[[Any], str]]]


def _leaf(annotation: Any, parameter_info: Any) -> Leaf | None:
    """The conversion of one plain value, or None when typer must handle the type."""
    if annotation is str:

        def to_str(value: Any) -> str:
            if isinstance(value, str):
                return value
            raise _Fallback

        return to_str, None
    if annotation is bool:

        def to_bool(value: Any) -> bool:
            if isinstance(value, bool):
                return value
            raise _Fallback  # 'yes', '0', ...: typer's rules

        return to_bool, None
    if annotation is int or annotation is float:
        pattern = _INT_RE if annotation is int else _FLOAT_RE
        words = "expected a whole number" if annotation is int else "expected a number"

        def to_number(value: Any) -> Any:
            if isinstance(value, str) and pattern.fullmatch(value):
                return annotation(value)
            if type(value) is annotation:  # a default value of the right type
                return value
            raise _Fallback

        return to_number, lambda _value: words
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        case_sensitive = parameter_info.case_sensitive
        choices = [str(member.value) for member in annotation]

        def to_choice(value: Any) -> Any:
            if isinstance(value, annotation):
                return value
            if isinstance(value, str):
                wanted = value if case_sensitive else value.casefold()
                for member, text in zip(annotation, choices):
                    if (text if case_sensitive else text.casefold()) == wanted:
                        return member
            raise _Fallback

        return to_choice, lambda value: f"{value!r} is not one of {', '.join(map(repr, choices))}"
    return None


def plain_typer_requested() -> bool:
    """True when the user asked, through BNAUDIT_PLAIN_TYPER, for plain typer."""
    return os.environ.get(PLAIN_TYPER_ENV, "") not in ("", "0")


def typer_is_tested_version() -> bool:
    """True when the installed typer is the minor version in `TESTED_TYPER`."""
    match = re.match(r"(\d+)\.(\d+)", str(getattr(typer, "__version__", "")))
    return match is not None and (int(match[1]), int(match[2])) == TESTED_TYPER


def _parameter_names(function: Any) -> list[str] | None:
    try:
        return list(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return None


def _has_fields(cls: Any, names: set[str]) -> bool:
    return is_dataclass(cls) and names <= {f.name for f in fields(cls)}


def coercion_internals_supported() -> bool:
    """True when typer's conversion internals are the ones `FastCommand` relies on.

    A parameter (`core._TyperParameter`) keeps its conversion in `_runtime_param` (None
    until `get_runtime_param()` builds it with `core.build_runtime_param(descriptor)`,
    which the fast path calls for the values it declines); the conversion subclasses
    `core.RuntimeParam` (a dataclass of `parameter_info` and `annotation` whose
    `_coerce_value(value, param, ctx)` does the work); the parameter's `type_descriptor`
    carries `annotation`, `parameter_info` and `file_annotation`; and the parameter info
    has `parser`, `min`, `max` and `case_sensitive`.
    """
    core, models = typer.core, typer.models
    build = getattr(core, "build_runtime_param", None)
    runtime_param = getattr(core, "RuntimeParam", None)
    parameter = getattr(core, "_TyperParameter", None)
    if not callable(build) or not isinstance(runtime_param, type) or not isinstance(parameter, type):
        return False
    return (
        _parameter_names(build) == ["descriptor"]
        and _parameter_names(getattr(parameter, "get_runtime_param", None)) == ["self"]
        and "_runtime_param" in getattr(parameter, "__annotations__", {})
        and _has_fields(runtime_param, {"parameter_info", "annotation"})
        and _parameter_names(getattr(runtime_param, "_coerce_value", None)) == ["self", "value", "param", "ctx"]
        and _has_fields(getattr(core, "TypeDescriptor", None), {"annotation", "parameter_info", "file_annotation"})
        and {"parser", "min", "max", "case_sensitive"} <= set(_parameter_names(models.ParameterInfo) or ())
    )


_checked: dict[tuple[Any, ...], bool] = {}


def fast_path_available() -> bool:
    """True when `FastCommand` converts plain values itself (see the module docstring).

    Remembered for the typer objects it checked (each command built asks), asked again
    when one changes.
    """
    core = typer.core
    key = (
        os.environ.get(PLAIN_TYPER_ENV),
        getattr(typer, "__version__", None),
        *(getattr(core, name, None) for name in ("build_runtime_param", "RuntimeParam", "TypeDescriptor")),
        tuple(getattr(getattr(core, "_TyperParameter", None), "__annotations__", {})),
        typer.models.ParameterInfo,
    )
    if key not in _checked:
        _checked[key] = not plain_typer_requested() and typer_is_tested_version() and coercion_internals_supported()
    return _checked[key]


def lean_group_supported(app: Any) -> bool:
    """True when `bnaudit.cli.main` may build, from `app`, a group of only the command it runs.

    It uses `typer.main.get_group(typer_instance)`, the app's `registered_callback` and
    `registered_commands`, and a `CommandInfo`'s `name`.
    """
    if plain_typer_requested() or not typer_is_tested_version():
        return False
    main = getattr(typer, "main", None)
    return (
        _parameter_names(getattr(main, "get_group", None)) == ["typer_instance"]
        and isinstance(getattr(app, "registered_commands", None), list)
        and hasattr(app, "registered_callback")
        and "name" in set(_parameter_names(getattr(typer.models, "CommandInfo", None)) or ())
    )


def _plain_runtime_param(descriptor: Any) -> Any:
    """A conversion of `descriptor`'s values without pydantic, or None for typer's own."""
    info = descriptor.parameter_info
    annotation = descriptor.annotation
    is_list = get_origin(annotation) is list
    if (
        descriptor.file_annotation is not None
        or getattr(info, "parser", None) is not None
        or getattr(info, "min", None) is not None
        or getattr(info, "max", None) is not None
    ):
        return None
    leaf = _leaf(get_args(annotation)[0] if is_list else annotation, info)
    if leaf is None:
        return None
    return _PlainRuntimeParam(parameter_info=info, annotation=annotation, descriptor=descriptor, leaf=leaf)


def _plain_runtime_param_class() -> type:
    @dataclass(frozen=True)
    class PlainRuntimeParam(typer.core.RuntimeParam):  # type: ignore[misc, name-defined]  # a dataclass base mypy cannot follow
        """Converts plain values itself; typer's own conversion for the values it declines."""

        descriptor: Any
        leaf: Leaf

        def _coerce_value(self, value: Any, param: Any, ctx: Any) -> Any:
            is_list = get_origin(self.descriptor.annotation) is list
            items = (value if isinstance(value, (list, tuple)) else [value]) if is_list else [value]
            converted = []
            for item in items:
                try:
                    converted.append(self.leaf[0](item))
                except _Fallback:
                    return self._typers_own(value, item, param, ctx)
            return converted if is_list else converted[0]

        def _typers_own(self, value: Any, item: Any, param: Any, ctx: Any) -> Any:
            """typer's conversion of `value`; when it refuses `item`, the refusal in our words."""
            try:
                typers = typer.core.build_runtime_param(self.descriptor)  # type: ignore[attr-defined]  # not re-exported
                return typers._coerce_value(value, param=param, ctx=ctx)
            except typer.BadParameter as exc:
                problem = self.leaf[1]
                if problem is None:
                    raise
                raise typer.BadParameter(problem(item), ctx=ctx, param=param) from exc

    return PlainRuntimeParam


_PlainRuntimeParam: Any = _plain_runtime_param_class() if coercion_internals_supported() else None


def speed_up(params: Iterable[Any]) -> None:
    """Give each plain parameter of one of bnaudit's commands the pydantic-free
    conversion, and each argument with a metavar its metavar as written; nothing on a
    typer other than the tested one (see the module docstring)."""
    if not typer_is_tested_version():
        return
    fast = fast_path_available() and _PlainRuntimeParam is not None
    for param in params:
        if isinstance(param, typer.core.TyperArgument) and param.metavar is not None:
            param.__class__ = MetavarArgument
        descriptor = getattr(param, "type_descriptor", None)
        if fast and descriptor is not None and getattr(param, "_runtime_param", ...) is None:
            converter = _plain_runtime_param(descriptor)
            if converter is not None:
                param._runtime_param = converter


class MetavarArgument(typer.core.TyperArgument):
    """An argument shown by its metavar as written ("PATHS...").

    typer 0.29 appends the Python type to an argument's metavar in help ("PATHS...
    <list[str]>") and wraps it in braces in the usage line ("{PATHS...}..."): words about
    our code, not about what to type.
    """

    def display_type_rich(self, ctx: Any) -> Any:
        return None

    def _usage_display_name(self) -> str:
        return str(self.metavar) if self.required else f"[{self.metavar}]"


class FastCommand(typer.core.TyperCommand):
    """A typer command whose own parameters take the fast path (`speed_up`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        speed_up(self.params)

    def get_help_option(self, ctx: Any) -> Any:
        option = super().get_help_option(ctx)  # built on first use, outside `params`
        if option is not None:
            speed_up([option])
        return option


class FastGroup(typer.core.TyperGroup):
    """A typer group whose own parameters take the fast path (`speed_up`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        speed_up(self.params)

    def get_help_option(self, ctx: Any) -> Any:
        option = super().get_help_option(ctx)  # built on first use, outside `params`
        if option is not None:
            speed_up([option])
        return option

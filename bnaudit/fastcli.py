"""Coerce plain CLI values without pydantic, so running a command starts fast.

typer 0.29 converts every non-flag parameter through a pydantic `TypeAdapter`
(`typer.core.build_runtime_param`). Importing pydantic and building the adapters
costs about as much as importing typer and rich together, and `bnaudit inspect` runs
in pre-commit hooks on every commit. For the plain annotations bnaudit's commands
use (`str`, `int`, `float`, `bool`, an `Enum`, or a list of one of these, with no parser and
no min/max) the conversion is trivial and done here; every other annotation, and
every value this fast path does not accept as obviously valid (a malformed number, an
unknown choice), goes through typer's own conversion, so results and error messages
stay typer's.

This leans on typer internals, and bnaudit does not pin typer (a pre-commit hook with
`language: system` runs in the user's environment, with the user's typer). So the fast
path is taken only when typer is the minor version it was written and tested against
(`TESTED_TYPER`) and every internal it touches is present with the expected signature:
`install()` checks that before patching anything, and `lean_group_supported()` does the
same for the single-command group `bnaudit.cli.main` builds. Otherwise the CLI runs on
plain typer: the same answers, only slower.

Set the environment variable `BNAUDIT_PLAIN_TYPER=1` (any value but empty or `0`) to
force plain typer even where the fast path would be safe, e.g. to tell whether a
problem comes from it.
"""

from __future__ import annotations

import inspect
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, fields, is_dataclass
from enum import Enum
from typing import Any, get_args, get_origin

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


def plain_typer_requested() -> bool:
    """True when the user asked, through BNAUDIT_PLAIN_TYPER, for plain typer."""
    return os.environ.get(PLAIN_TYPER_ENV, "") not in ("", "0")


def typer_is_tested_version() -> bool:
    """True when the installed typer is the minor version in `TESTED_TYPER`."""
    import typer

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
    """True when typer's conversion internals are the ones `install()` patches.

    `core.build_runtime_param(descriptor)` is replaced; its result subclasses
    `core.RuntimeParam` (a dataclass of `parameter_info` and `annotation` whose
    `_coerce_value(value, param, ctx)` does the work); the descriptor carries
    `annotation`, `parameter_info` and `file_annotation`; and the parameter info has
    `parser`, `min`, `max` and `case_sensitive`.
    """
    try:
        from typer import core, models
    except ImportError:
        return False
    build = getattr(core, "build_runtime_param", None)
    runtime_param = getattr(core, "RuntimeParam", None)
    if not callable(build) or not isinstance(runtime_param, type):
        return False
    return (
        _parameter_names(build) == ["descriptor"]
        and _has_fields(runtime_param, {"parameter_info", "annotation"})
        and _parameter_names(getattr(runtime_param, "_coerce_value", None)) == ["self", "value", "param", "ctx"]
        and _has_fields(getattr(core, "TypeDescriptor", None), {"annotation", "parameter_info", "file_annotation"})
        and {"parser", "min", "max", "case_sensitive"} <= set(_parameter_names(models.ParameterInfo) or ())
    )


def lean_group_supported(app: Any) -> bool:
    """True when `bnaudit.cli.main` may build, from `app`, a group of only the command it runs.

    It uses `typer.main.get_group(typer_instance)`, `typer.main.get_command_name(name)`,
    the app's `registered_callback` and `registered_commands`, and a `CommandInfo`'s
    `name` and `callback`.
    """
    if plain_typer_requested() or not typer_is_tested_version():
        return False
    import typer

    main = getattr(typer, "main", None)
    return (
        _parameter_names(getattr(main, "get_group", None)) == ["typer_instance"]
        and _parameter_names(getattr(main, "get_command_name", None)) == ["name"]
        and isinstance(getattr(app, "registered_commands", None), list)
        and hasattr(app, "registered_callback")
        and {"name", "callback"} <= set(_parameter_names(getattr(typer.models, "CommandInfo", None)) or ())
    )


def metavars_as_given() -> bool:
    """Show an argument's metavar as written ("PATHS...") in help and usage lines.

    typer 0.29 appends the Python type to an argument's metavar in help ("PATHS...
    <list[str]>") and wraps it in braces in the usage line ("{PATHS...}..."): words about
    our code, not about what to type. Only on the typer this was checked against; True
    when applied (idempotent).
    """
    if not typer_is_tested_version():
        return False
    from typer import core

    argument = getattr(core, "TyperArgument", None)
    if argument is None or not all(hasattr(argument, n) for n in ("display_type_rich", "_usage_display_name")):
        return False
    if getattr(argument.display_type_rich, "_bnaudit_metavar", False):
        return True
    type_of, usage_of = argument.display_type_rich, argument._usage_display_name

    def display_type_rich(self: Any, ctx: Any) -> Any:
        return None if self.metavar is not None else type_of(self, ctx)

    def usage_display_name(self: Any) -> Any:
        if self.metavar is None:
            return usage_of(self)
        return self.metavar if self.required else f"[{self.metavar}]"

    display_type_rich._bnaudit_metavar = True  # type: ignore[attr-defined]
    argument.display_type_rich = display_type_rich
    argument._usage_display_name = usage_display_name
    return True


def install() -> bool:
    """Route plain parameters of every typer command through the fast path.

    Returns True when installed (idempotent). Returns False, and changes nothing, when
    plain typer was requested or typer is not the version and shape this was written for.
    """
    if plain_typer_requested() or not typer_is_tested_version() or not coercion_internals_supported():
        return False
    from typer import core

    original = core.build_runtime_param  # type: ignore[attr-defined]  # typer.core imports it from typer._coercion without re-exporting it
    if getattr(original, "_bnaudit_fast", False):
        return True
    RuntimeParam = core.RuntimeParam  # type: ignore[attr-defined]  # typer.core imports it from typer._coercion without re-exporting it

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
            parameter_info=info,
            annotation=annotation,
            descriptor=descriptor,
            convert=convert,
            is_list=is_list,
        )

    build_runtime_param._bnaudit_fast = True  # type: ignore[attr-defined]
    build_runtime_param.__wrapped__ = original  # type: ignore[attr-defined]  # for tests comparing with typer's own
    core.build_runtime_param = build_runtime_param  # type: ignore[attr-defined]  # patched where typer.core looks it up; not re-exported
    return True

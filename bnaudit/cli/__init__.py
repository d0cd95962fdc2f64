"""The typer app: parse options, call one core function, `bnaudit.output.emit`, exit code.

Report on stdout, diagnostics on stderr. Every `BnauditError` (and any unexpected
exception, unless --debug) ends as one line on stderr and exit code 2. Values are checked
where they are used (`load_config`, `DataOptions.validate`, the core functions), so that
the library and the CLI refuse the same things with the same words.

One module per command family (`inspect`: inspect and rules; `measure`: gap and
invariance; `recalibrate`; `diff`), the options several of them share in `options`, the
error boundary in `boundary`; this module builds the typer app of them (`typer_app`; `app`
with every command) and runs it (`main`, which imports the module of the command it runs).

Neither this module nor `inspect` has `from __future__ import annotations`: typer reads
the annotations of the command it runs (get_type_hints), and as strings each would be
compiled and evaluated, every typer.Option built again, in every start-up.
"""

import copy
import os
import sys
from collections.abc import Callable, Iterable
from typing import Annotated, Any, Optional

import typer

from bnaudit import __version__, fastcli, output
from bnaudit.errors import OutputClosed

_APP_SETTINGS: dict[str, Any] = dict(
    name="bnaudit",
    # typer would import pydantic to convert each option; plain ones do not need it. Only
    # bnaudit's own group and commands take that path (fastcli): no typer internal is patched.
    cls=fastcli.FastGroup,
    help="Audit the BatchNorm running statistics of PyTorch models before they ship.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    # help uses the terminal's whole width (click's default stops at 80 columns)
    context_settings={"max_content_width": 10_000},
)
# The commands in the order of `bnaudit --help`.
COMMANDS = ("inspect", "rules", "gap", "invariance", "recalibrate", "merge", "diff", "fold", "parity", "fed")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"bnaudit {__version__}")
        raise typer.Exit()


def _root(
    version: Annotated[
        Optional[bool], typer.Option("--version", callback=_version, is_eager=True, help="Show the version and exit.")
    ] = None,
) -> None:
    """Audit the BatchNorm running statistics of PyTorch models before they ship."""


def _function(command: str) -> Callable[..., Any]:
    """The function of `command`. Its module is imported here, so that a run imports the
    module of the command it runs only (gap's dozens of options are not `inspect`'s)."""
    if command in ("inspect", "rules"):
        from bnaudit.cli import inspect

        return inspect.inspect if command == "inspect" else inspect.rules_command
    if command in ("gap", "invariance"):
        from bnaudit.cli import measure

        return measure.gap if command == "gap" else measure.invariance
    if command == "recalibrate":
        from bnaudit.cli import recalibrate

        return recalibrate.recalibrate
    if command == "diff":
        from bnaudit.cli import diff

        return diff.diff_command
    if command == "merge":
        from bnaudit.cli import merge

        return merge.merge_command
    if command == "fed":
        from bnaudit.cli import fed

        return fed.fed_command
    if command == "parity":
        from bnaudit.cli import parity

        return parity.parity_command
    from bnaudit.cli import fold

    return fold.fold_command


def typer_app(commands: Iterable[str] = COMMANDS) -> typer.Typer:
    """A typer app of bnaudit's group with `commands` (names of COMMANDS, in its order)."""
    built = typer.Typer(**_APP_SETTINGS)
    built.callback()(_root)
    wanted = set(commands)
    for name in COMMANDS:
        if name in wanted:
            built.command(name, cls=fastcli.FastCommand)(_function(name))
    return built


def __getattr__(name: str) -> Any:
    # `app`, the whole typer app, is built when first asked for (`bnaudit.cli.app`, `from
    # bnaudit.cli import app`): `main` builds an app of the one command it runs instead
    if name == "app":
        return _whole_app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _whole_app() -> typer.Typer:
    whole = globals().get("app")
    if whole is None:
        whole = globals()["app"] = typer_app()
    return whole


def main() -> None:
    """The `bnaudit` executable: one line for a usage error, quiet when the reader of
    stdout goes away, the command's exit code otherwise."""
    try:
        code = _dispatch()
    except OutputClosed:
        # `bnaudit inspect ... | head -1`: the reader has what it wanted. Point stdout at
        # devnull so that the interpreter's final flush cannot fail a second time.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        code = 0
    sys.exit(code)


def usage_error_line(exc: typer.TyperException) -> str:
    """A command-line parsing error as one line: the option and the problem (a value error
    names the option first, not "Invalid value for ..."), and where the help is."""
    message = exc.format_message()
    # a bad value (not one of BadParameter's subclasses with their own wording, such as a
    # missing argument)
    plain_bad_value = type(exc).format_message is typer.BadParameter.format_message
    if isinstance(exc, typer.BadParameter) and plain_bad_value and exc.param_hint is None and exc.param is not None:
        opts = [o for o in getattr(exc.param, "opts", ()) if o.startswith("--")]
        name = opts[0] if opts else exc.param.get_error_hint()
        message = f"{name}: {exc.message}"
    ctx = getattr(exc, "ctx", None)
    path = getattr(ctx, "command_path", None) or "bnaudit"
    return f"{message.rstrip('.')} (see {path} --help)"


def _dispatch() -> int:
    """Run the command line; the exit code."""
    command = _command()
    try:
        result = command.main(prog_name="bnaudit", standalone_mode=False)
    except typer.Exit as exc:
        return int(exc.exit_code)
    except typer.Abort:
        output.emit_interrupted(sys.stderr)
        return 130
    except typer.TyperException as exc:  # the parser's errors: usage, bad values, unknown options
        show = getattr(exc, "show", None)
        if len(sys.argv) <= 1 and callable(show):
            show()  # `bnaudit` alone (no_args_is_help): the error is the help, as typer prints it
        else:
            output.emit_error(usage_error_line(exc), sys.stderr)
        return int(exc.exit_code)
    return result if isinstance(result, int) else 0


def _command() -> Any:
    # typer builds the options of every command before it runs one (gap and recalibrate
    # have dozens, built on each pre-commit run of inspect). When the first argument names
    # a command, the group is built with that command alone (and only its module
    # imported); anything else (--help, a typo that deserves "did you mean") gets the
    # whole group. The lean group is built from typer internals, so only on the typer
    # they were checked against (fastcli).
    args = sys.argv[1:]
    listing = set(args) <= {"--help", "--version"}
    lean = typer_app(() if listing or args[0] not in COMMANDS else args[:1])
    if not fastcli.lean_group_supported(lean):
        return typer.main.get_command(_whole_app())
    if listing:
        # `bnaudit`, `bnaudit --help`, `bnaudit --version` exit before any command runs;
        # the group's help lists each command by its name and docstring only, so the
        # commands are listed without building their options (half of `--help`'s time)
        lean.registered_commands = [_listed_only(c) for c in _whole_app().registered_commands]
    if not lean.registered_commands:
        return typer.main.get_command(_whole_app())
    return typer.main.get_group(lean)  # a group even with one command, as the full app


def _listed_only(command: Any) -> Any:
    """A copy of the registered `command` whose callback has its docstring and no parameters."""

    def unreachable() -> None:  # the group's eager --help / --version exit first
        raise AssertionError(f"{command.name}: listed for the help only")

    unreachable.__doc__ = command.callback.__doc__
    listed = copy.copy(command)
    listed.callback = unreachable
    return listed


if __name__ == "__main__":
    main()

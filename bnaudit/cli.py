"""The typer app: parse options, call one core function, render, choose the exit code.

Report on stdout, diagnostics on stderr. Every `BnauditError` (and any unexpected
exception, unless --debug) ends as one line on stderr and exit code 2.
"""
from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from enum import Enum
from typing import Annotated, Optional

import typer

from bnaudit import __version__
from bnaudit.errors import BnauditError

app = typer.Typer(
    name="bnaudit",
    help="Audit the BatchNorm running statistics of PyTorch models before they ship.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


class Format(str, Enum):
    table = "table"
    json = "json"


class Severity(str, Enum):
    error = "error"
    warning = "warning"
    info = "info"


def _version(value: bool) -> None:
    if value:
        typer.echo(f"bnaudit {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        Optional[bool], typer.Option("--version", callback=_version, is_eager=True, help="Show the version and exit.")
    ] = None,
) -> None:
    """Audit the BatchNorm running statistics of PyTorch models before they ship."""


@contextlib.contextmanager
def user_errors(debug: bool, json_output: bool = False) -> Iterator[None]:
    """The one boundary where errors become a line on stderr and exit code 2."""
    try:
        yield
    except BnauditError as exc:
        _fail(str(exc), json_output)
    except KeyboardInterrupt:
        typer.echo("bnaudit: interrupted", err=True)
        raise typer.Exit(130) from None
    except typer.Exit:
        raise
    except Exception as exc:  # a bug: one line unless the user asks for the traceback
        if debug:
            raise
        _fail(f"internal error: {type(exc).__name__}: {exc} (run with --debug for the traceback)", json_output)


def _fail(message: str, json_output: bool) -> None:
    from bnaudit.report import printable

    message = printable(" ".join(message.split()))  # paths and names come from outside
    if json_output:
        typer.echo(json.dumps({"error": message}))
    typer.echo(f"bnaudit: error: {message}", err=True)
    raise typer.Exit(2)


def _console(stderr: bool = False):
    from rich.console import Console

    return Console(stderr=stderr, highlight=False, soft_wrap=False)


DebugOpt = Annotated[bool, typer.Option("--debug", help="Show tracebacks instead of one-line errors.")]


@app.command()
def inspect(
    paths: Annotated[list[str], typer.Argument(help="Checkpoint files or directories (searched for .pt .pth .ckpt .bin .tar .safetensors).")],
    output_format: Annotated[Format, typer.Option("--format", "-f", help="Report format.")] = Format.table,
    fail_on: Annotated[Severity, typer.Option(help="Exit 1 when a finding is at or above this severity.")] = Severity.warning,
    exit_zero: Annotated[bool, typer.Option("--exit-zero", help="Exit 0 even when findings are at or above --fail-on.")] = False,
    key: Annotated[Optional[str], typer.Option(help="Container key of the state dict to audit (e.g. model_ema).")] = None,
    eps: Annotated[Optional[float], typer.Option(help="BN eps where the file holds no modules (default 1e-5).")] = None,
    momentum: Annotated[Optional[float], typer.Option(help="BN momentum where the file holds no modules (default 0.1).")] = None,
    trust_pickle: Annotated[bool, typer.Option("--trust-pickle", help="Unpickle arbitrary classes: runs code from the file. Only for files you trust.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print findings and the summary only.")] = False,
    debug: DebugOpt = False,
) -> None:
    """Audit every BatchNorm layer of checkpoints, without code or data."""
    from bnaudit.audit import inspect as run_inspect
    from bnaudit.config import Config
    from bnaudit.report import inspect_to_json, printable, render_inspect

    json_output = output_format is Format.json
    with user_errors(debug, json_output):
        if eps is not None and not eps > 0:
            raise BnauditError(f"--eps must be positive, got {eps}")
        if momentum is not None and not 0 <= momentum <= 1:
            raise BnauditError(f"--momentum must lie in [0, 1], got {momentum}")
        config = Config(fail_on=fail_on.value, eps=eps, momentum=momentum)
        report = run_inspect(paths, config, key=key, trust_pickle=trust_pickle, debug=debug)
        # rendering stays inside the boundary: the values it prints come from the files
        if json_output:
            typer.echo(json.dumps(inspect_to_json(report), indent=2, allow_nan=False))
        else:
            render_inspect(report, _console(), quiet=quiet)
    for file in report.files:
        if file.error:
            typer.echo(f"bnaudit: error: {printable(file.path)}: {printable(file.error)}", err=True)
    code = report.exit_code()
    raise typer.Exit(0 if exit_zero and code == 1 else code)


def main() -> None:
    app(prog_name="bnaudit")


if __name__ == "__main__":
    sys.exit(main())

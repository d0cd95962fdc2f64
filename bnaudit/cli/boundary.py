"""Where a command's errors become one line on stderr and exit code 2, and the garbage
collector setting of the commands that run a model."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import typer

from bnaudit import output
from bnaudit.errors import BnauditError, OutputClosed, missing_dependency


@contextlib.contextmanager
def user_errors(debug: bool, json_output: bool = False) -> Iterator[None]:
    """The one boundary where errors become a line on stderr and exit code 2 (with
    `json_output`, also an `{"error": ...}` document on stdout).

    torch (and Pillow) are left out of the base install, so their absence is the user's
    to fix, not a bug: wherever a command imports them, the same line says what to install.
    A command enters this boundary before it imports anything of `bnaudit.runtime`."""
    try:
        yield
    except BnauditError as exc:
        fail(str(exc), json_output)
    except KeyboardInterrupt:
        output.emit_interrupted(sys.stderr)
        raise typer.Exit(130) from None
    except (typer.Exit, OutputClosed):
        raise  # OutputClosed: the reader left (`| head`); main() ends quietly
    except Exception as exc:  # a bug: one line unless the user asks for the traceback
        missing = missing_dependency(exc)
        if missing is not None:
            fail(missing, json_output)
        if debug:
            raise
        fail(f"internal error: {type(exc).__name__}: {exc} (run with --debug for the traceback)", json_output)


def fail(message: str, json_output: bool) -> None:
    output.emit_error(message, sys.stderr, json_stream=sys.stdout if json_output else None)
    raise typer.Exit(2)


@contextlib.contextmanager
def frozen_imports() -> Iterator[None]:
    """Import torch, then, while the block runs, leave every object alive at that point out
    of the cyclic garbage collector's walks.

    gap and recalibrate allocate many short-lived objects per batch, and every so often
    that triggers a full collection, which walks every tracked object: torch's, typer's
    and bnaudit's modules, classes and functions (several walks per run),
    none of which can become garbage before the command ends. `gc.freeze` moves them to
    a generation the collector does not walk; reference counting still frees them, and
    objects created in the block are collected as before. Unfrozen on exit (the CLI may
    run inside another process: tests, `CliRunner`).
    """
    import gc

    import torch  # noqa: F401  (the bulk of them; the command needs it next anyway)

    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()

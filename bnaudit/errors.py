"""The one exception type users see as a message.

Anything a user can cause (a bad path, an unreadable file, a bad option) raises
`BnauditError`; `cli.main` turns it into one line on stderr and exit code 2.
Everything else is a bug and keeps its traceback, but for the absence of a package the
base install leaves out (`missing_dependency`): installing it is the user's to do.
"""

from __future__ import annotations

from bnaudit.text import single_line


class BnauditError(Exception):
    """A user-facing error: `str(err)` is the whole message, one line."""

    def __init__(self, message: str) -> None:
        super().__init__(single_line(message))


class OutputClosed(Exception):
    """The reader of the report went away (`bnaudit inspect ... | head -1`).

    Not an OSError: typer turns a broken pipe into exit code 1 on its own, while the
    CLI's entry point ends quietly with 0 (the reader has what it wanted).
    """


# Packages the base install leaves out (pyproject's `torch` extra): the commands and options
# that run a model import them, and nothing else does. The message names what to install.
_TORCH_INSTALL = (
    "torch is not installed, and this builds a model with it (reading checkpoints does not: "
    "inspect, diff, rules and fold's prediction run without torch). On a CPU-only machine: "
    "pip install torch --index-url https://download.pytorch.org/whl/cpu; on a GPU machine: the "
    'command https://pytorch.org/get-started/locally/ gives; then pip install "bnaudit[torch]"'
)
_MISSING_EXTRA = {
    "torch": _TORCH_INSTALL,
    "PIL": 'Pillow is not installed, and reading an image folder needs it: pip install "bnaudit[torch]" (or pip install pillow)',
}


def missing_dependency(exc: BaseException) -> str | None:
    """The one-line message for `exc` when it is the import of a package the base install
    leaves out (torch, Pillow), else None.

    Only the top-level package counts: a module missing inside an installed torch
    (`torch.distributed` on a build without it) is not solved by installing torch.
    """
    if isinstance(exc, ModuleNotFoundError) and exc.name is not None:
        return _MISSING_EXTRA.get(exc.name)
    return None

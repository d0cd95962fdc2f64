"""The one exception type users see as a message.

Anything a user can cause (a bad path, an unreadable file, a bad option) raises
`BnauditError`; `cli.main` turns it into one line on stderr and exit code 2.
Everything else is a bug and keeps its traceback.
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

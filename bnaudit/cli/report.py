"""Where a command's report goes: stdout, or the file `--output` names, written at once.

`Destination` is made before any work, so that a report that could not be written (an output
that is an input, a folder, in a read-only folder, existing without `--force`: `check_output`)
or a format whose extra is missing (`--format html` without matplotlib) fails in one line,
exit 2, before a measurement runs for minutes. The report is rendered into memory and
written with `bnaudit.formats.atomic.atomic_write`, like a recalibrated checkpoint: the file
appears complete or not at all, and `--force` replaces an existing one in one rename.
"""

from __future__ import annotations

import io
import sys
from collections.abc import Sequence
from typing import IO, Annotated, Optional

import typer

ReportOutputOpt = Annotated[
    Optional[str],
    typer.Option(
        "--output",
        "-o",
        metavar="FILE",
        help="Write the report to FILE (all at once) instead of stdout, e.g. report.html with --format html.",
    ),
]
ReportForceOpt = Annotated[bool, typer.Option("--force", help="Overwrite --output if it exists.")]


class Destination:
    """stdout, or a file written when the report is complete (`finish`)."""

    def __init__(self, fmt: str, path: str | None, force: bool = False, inputs: Sequence[str] = ()) -> None:
        if fmt == "html":
            from bnaudit.output.html import require

            require()
        self.path = path
        self.force = force
        self._buffer: io.StringIO | None = None
        if path is not None:
            from bnaudit.formats.atomic import check_output

            sources: list[str | None] = [*inputs] or [None]
            for source in sources:
                check_output(path, source, force=force)
            self._buffer = io.StringIO()

    @property
    def stream(self) -> IO[str]:
        return self._buffer if self._buffer is not None else sys.stdout

    def finish(self) -> None:
        """Write the file (nothing to do for stdout)."""
        if self.path is None or self._buffer is None:
            return
        from bnaudit.formats.atomic import atomic_write

        data = self._buffer.getvalue().encode("utf-8")
        atomic_write(self.path, lambda f: f.write(data), force=self.force)

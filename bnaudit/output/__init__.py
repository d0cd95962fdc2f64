"""One emitter interface for every report kind; the only place that knows rich, JSON and SARIF.

    emit(report, fmt, stream)          inspect, diff: table / json / sarif and the CI formats
                                       github / gitlab / junit / markdown; gap, invariance,
                                       recalibrate: table / json
    emit_diagnostics(report, stream)   what a report has to say on stderr (unreadable files, warnings)
    emit_error / emit_warning          the CLI's one-line messages
    render_rules(stream, code)         `bnaudit rules` and `bnaudit rules CODE`
    progress(description, stream)      a progress bar while gap or recalibrate runs

The emitters are chosen by the report's type (`formats_of`, `table.render`,
`json.to_json`, `sarif.to_sarif`, and one module per CI format: `github.to_github`,
`gitlab.to_gitlab`, `junit.to_junit`, `markdown.to_markdown`, which read the files of a
report through `checked.checked_files`). The records live in torch-free modules
(`bnaudit.audit` for inspect and diff, `bnaudit.reports` for gap, invariance and
recalibrate), so this package never imports the torch-heavy modules that measure:
`--help`, `rules` and `inspect` of a safetensors file stay torch-free.

Strings from files and models (names, paths, messages, model descriptions) are untrusted:
the table renderers pass each through `bnaudit.text.printable` where they draw it, and the
one-line messages here pass theirs once; the CI formats make them safe for their consumer
(GitHub's command escaping, XML, Markdown). JSON, SARIF and GitLab's JSON keep them exact (a consumer matches
layer names against the state dict) and safe: the encoder writes every control and
non-ASCII character as a \\u escape.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import IO, TYPE_CHECKING, Any

from bnaudit.errors import OutputClosed
from bnaudit.text import printable

if TYPE_CHECKING:
    from bnaudit.audit.checkpoint.report import InspectReport
    from bnaudit.audit.diff.checkpoints import DiffReport
    from bnaudit.audit.fold.report import FoldReport
    from bnaudit.reports.gap import GapReport
    from bnaudit.reports.invariance import InvarianceReport
    from bnaudit.reports.recalibrate import RecalibrationReport

    Report = InspectReport | DiffReport | GapReport | InvarianceReport | RecalibrationReport | FoldReport


FINDINGS_FORMATS = ("table", "json", "sarif", "github", "gitlab", "junit", "markdown")


def formats_of(report: object) -> tuple[str, ...]:
    """The formats `report`'s type has emitters for: inspect and diff reports table, JSON,
    SARIF and the CI formats (findings at locations); the measurements table and JSON;
    anything else none.
    Each record module is imported only when the types before it did not match (see
    `bnaudit.output.table.render`)."""
    from bnaudit.audit.checkpoint.report import InspectReport

    if isinstance(report, InspectReport):
        return FINDINGS_FORMATS
    from bnaudit.audit.diff.checkpoints import DiffReport

    if isinstance(report, DiffReport):
        return FINDINGS_FORMATS
    from bnaudit.reports.gap import GapReport
    from bnaudit.reports.invariance import InvarianceReport
    from bnaudit.reports.recalibrate import RecalibrationReport

    if isinstance(report, (GapReport, InvarianceReport, RecalibrationReport)):
        return ("table", "json")
    from bnaudit.audit.fold.report import FoldReport

    if isinstance(report, FoldReport):
        return FINDINGS_FORMATS
    return ()


def console(stream: IO[str], width: int | None = None) -> Any:
    """A rich console writing to `stream` (colour only when it is a terminal).

    Markup and emoji off: names and messages come from untrusted files and are printed
    as they are ("bn[/x]" would otherwise crash the renderer); it also renders faster.
    """
    from rich.console import Console

    out = Console(file=stream, width=width, highlight=False, soft_wrap=False, markup=False, emoji=False)
    out.on_broken_pipe = _reader_left  # type: ignore[method-assign]  # rich would exit 1; the CLI ends with 0
    return out


def _reader_left() -> None:
    """The reader of the stream went away (`bnaudit inspect ... | head -1`)."""
    raise OutputClosed()


def emit(
    report: Report,
    fmt: str,
    stream: IO[str],
    *,
    quiet: bool = False,
    width: int | None = None,
    all_layers: bool = False,
) -> None:
    """Write `report` to `stream` in `fmt`; `quiet` and `width` apply to tables only, and
    `all_layers` (inspect's --layers: a layer table for every file) to inspect's table."""
    if fmt not in formats_of(report):
        raise ValueError(f"no {fmt!r} emitter for a {type(report).__name__} report")  # a bug in the caller
    if fmt == "table":
        from bnaudit.output.table import render

        render(report, console(stream, width), quiet=quiet, all_layers=all_layers)
        return
    if fmt in ("github", "junit", "markdown"):
        _write(stream, _ci_text(report, fmt))
        return
    document: object
    if fmt == "sarif":
        from bnaudit.output.sarif import to_sarif

        document = to_sarif(report)
    elif fmt == "gitlab":
        from bnaudit.output.gitlab import to_gitlab

        document = to_gitlab(report)
    else:
        from bnaudit.output.json import to_json

        document = to_json(report)
    import json as jsonlib  # here: --help and tables do without it (not `json`: the submodule)

    _write(stream, jsonlib.dumps(document, indent=2, allow_nan=False) + "\n")


def _ci_text(report: Report, fmt: str) -> str:
    if fmt == "github":
        from bnaudit.output.github import to_github

        return to_github(report)
    if fmt == "junit":
        from bnaudit.output.junit import to_junit

        return to_junit(report)
    from bnaudit.output.markdown import to_markdown

    return to_markdown(report)


def _write(stream: IO[str], text: str) -> None:
    try:
        stream.write(text)
        stream.flush()
    except BrokenPipeError:
        raise OutputClosed() from None


def _line(stream: IO[str], text: str) -> None:
    stream.write(text + "\n")
    stream.flush()


def one_line(message: str) -> str:
    """`message` as one printable line: whitespace runs (newlines too) become one space."""
    return printable(" ".join(message.split()))


def emit_error(message: str, stream: IO[str], *, json_stream: IO[str] | None = None) -> None:
    """An error said once: `bnaudit: error: MESSAGE` on `stream`, or, with `json_stream`
    (--format json), only `{"error": MESSAGE}` there, so that a JSON consumer reads a
    document whatever happened (and `2>&1` still parses)."""
    if json_stream is not None:  # JSON escapes what it must itself: the names stay exact there
        import json as jsonlib  # here: see emit

        _line(json_stream, jsonlib.dumps({"error": " ".join(message.split())}))
        return
    _line(stream, f"bnaudit: error: {one_line(message)}")


def emit_warning(message: str, stream: IO[str]) -> None:
    _line(stream, f"bnaudit: warning: {one_line(message)}")


def emit_interrupted(stream: IO[str]) -> None:
    _line(stream, "bnaudit: interrupted")


def emit_diagnostics(report: Report, stream: IO[str], fmt: str = "table") -> None:
    """What a report has to say besides itself, one line each: the files inspect could
    not read and recalibrate's warnings.

    An unreadable file is said once: with a table, here (the table marks the file
    `unreadable`, and stderr is where a hook's log and a terminal show errors); with any
    other format, in the document only (JSON `files[].error`, a SARIF notification, an
    annotation, a Code Quality issue, a JUnit error, a line of the summary)."""
    from bnaudit.audit.checkpoint.report import InspectReport

    if isinstance(report, InspectReport):
        if fmt == "table":
            for file in report.files:
                if file.error:
                    emit_error(f"{file.shown}: {file.error}", stream)
        return
    from bnaudit.reports.recalibrate import RecalibrationReport

    if isinstance(report, RecalibrationReport):
        for message in report.warnings:
            emit_warning(message, stream)


def render_rules(
    stream: IO[str], code: str | None = None, *, width: int | None = None, overrides: Mapping[str, str] | None = None
) -> None:
    """`bnaudit rules`: one row per rule; with `code`, that rule explained (an unknown
    code is a BnauditError). `overrides`: the configuration's rule -> severity table."""
    if code is not None:
        from bnaudit.audit.ruledocs import explain_rule, find_rule

        stream.write(explain_rule(find_rule(code), overrides=overrides))
        stream.flush()
        return
    from bnaudit.output.table.rules import render_rules as render_table

    render_table(console(stream, width), overrides)


@contextlib.contextmanager
def progress(description: str, stream: IO[str], *, quiet: bool = False) -> Iterator[Callable[[int, int], None] | None]:
    """A transient progress bar on `stream`, or None when quiet or `stream` is not a terminal.

    Yields a callback `update(done, total)`.
    """
    if quiet:  # no console at all: rich costs an import that --format json and -q never use
        yield None
        return
    bar_console = console(stream)
    if not bar_console.is_terminal:
        yield None
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=bar_console,
        transient=True,
    ) as bar:
        task = bar.add_task(printable(description), total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update

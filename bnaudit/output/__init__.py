"""One emitter interface for every report kind; the only place that knows rich, JSON and SARIF.

    emit(report, fmt, stream)          inspect, diff: table / json / sarif and the CI formats
                                       github / gitlab / junit / markdown; gap, invariance,
                                       recalibrate: table / json
    emit_diagnostics(report, stream)   what a report has to say on stderr (unreadable files, warnings)
    emit_error / emit_warning          the CLI's one-line messages
    render_rules(stream, code)         `bnaudit rules` and `bnaudit rules CODE`
    progress(description, stream)      a progress bar while gap or recalibrate runs

The emitters are chosen in one table, `EMITTERS`: a report's `kind` (a class attribute of
every report record) and a format name the function that renders it, imported only when
used (a `bnaudit inspect` loads neither the measurements' records nor their renderers). The
CI formats (`github.to_github`, `gitlab.to_gitlab`, `junit.to_junit`,
`markdown.to_markdown`) serve every report of findings at locations, whose files they read
through `checked.checked_files`. The records live in torch-free modules (`bnaudit.audit`
for inspect, diff and fold, `bnaudit.reports` for gap, invariance and recalibrate), so this
package never imports the torch-heavy modules that measure: `--help`, `rules` and `inspect`
of a safetensors file stay torch-free.

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
from bnaudit.text import printable, single_line

if TYPE_CHECKING:
    from bnaudit.audit.checkpoint.report import InspectReport
    from bnaudit.audit.diff.checkpoints import DiffReport
    from bnaudit.audit.fed.report import FedReport
    from bnaudit.audit.fold.report import FoldReport
    from bnaudit.reports.gap import GapReport
    from bnaudit.reports.invariance import InvarianceReport
    from bnaudit.reports.merge import MergeReport
    from bnaudit.reports.parity import ParityReport
    from bnaudit.reports.recalibrate import RecalibrationReport

    Report = (
        InspectReport
        | DiffReport
        | GapReport
        | InvarianceReport
        | RecalibrationReport
        | FoldReport
        | MergeReport
        | FedReport
        | ParityReport
    )


# The formats every report of findings at locations has (inspect, diff, fold): its own table,
# JSON and SARIF, and the CI formats, which read any such report alike.
_CI_FORMATS = {
    "github": "bnaudit.output.github:to_github",
    "gitlab": "bnaudit.output.gitlab:to_gitlab",
    "junit": "bnaudit.output.junit:to_junit",
    "markdown": "bnaudit.output.markdown:to_markdown",
}

# report kind -> the record class of that kind, and format -> "module:function". A table
# renderer draws on a rich console; the others return a JSON-able document ("json",
# "sarif", "gitlab") or text. A report is dispatched by its record's `kind`, and only if it
# is an instance of that very class (checked by name: nothing is imported to check it).
EMITTERS: dict[str, dict[str, str]] = {
    "inspect": {
        "record": "bnaudit.audit.checkpoint.report:InspectReport",
        "table": "bnaudit.output.table.inspect:render_inspect",
        "json": "bnaudit.output.json:inspect_to_json",
        "sarif": "bnaudit.output.sarif:inspect_to_sarif",
        "html": "bnaudit.output.html.inspect:inspect_to_html",
        **_CI_FORMATS,
    },
    "diff": {
        "record": "bnaudit.audit.diff.checkpoints:DiffReport",
        "table": "bnaudit.output.table.diff:render_diff",
        "json": "bnaudit.output.json:diff_to_json",
        "sarif": "bnaudit.output.sarif:diff_to_sarif",
        "html": "bnaudit.output.html.diff:diff_to_html",
        **_CI_FORMATS,
    },
    "fold": {
        "record": "bnaudit.audit.fold.report:FoldReport",
        "table": "bnaudit.output.table.fold:render_fold",
        "json": "bnaudit.output.json:fold_to_json",
        "sarif": "bnaudit.output.sarif:fold_to_sarif",
        "html": "bnaudit.output.html.fold:fold_to_html",
        **_CI_FORMATS,
    },
    "fed": {
        "record": "bnaudit.audit.fed.report:FedReport",
        "table": "bnaudit.output.table.fed:render_fed",
        "json": "bnaudit.output.json:fed_to_json",
        "sarif": "bnaudit.output.sarif:fed_to_sarif",
        **_CI_FORMATS,
    },
    "parity": {
        "record": "bnaudit.reports.parity:ParityReport",
        "table": "bnaudit.output.table.parity:render_parity",
        "json": "bnaudit.output.measured_json:parity_to_json",
        "sarif": "bnaudit.output.sarif:parity_to_sarif",
        "html": "bnaudit.output.html.parity:parity_to_html",
        **_CI_FORMATS,
    },
    "gap": {
        "record": "bnaudit.reports.gap:GapReport",
        "table": "bnaudit.output.table.gap:render_gap",
        "json": "bnaudit.output.measured_json:gap_to_json",
        "html": "bnaudit.output.html.measure:gap_to_html",
    },
    "invariance": {
        "record": "bnaudit.reports.invariance:InvarianceReport",
        "table": "bnaudit.output.table.invariance:render_invariance",
        "json": "bnaudit.output.measured_json:invariance_to_json",
        "html": "bnaudit.output.html.measure:invariance_to_html",
    },
    "recalibrate": {
        "record": "bnaudit.reports.recalibrate:RecalibrationReport",
        "table": "bnaudit.output.table.recalibrate:render_recalibrate",
        "json": "bnaudit.output.measured_json:recalibrate_to_json",
        "html": "bnaudit.output.html.measure:recalibrate_to_html",
    },
    "merge": {
        "record": "bnaudit.reports.merge:MergeReport",
        "table": "bnaudit.output.table.recalibrate:render_merge",
        "json": "bnaudit.output.measured_json:merge_to_json",
    },
}
_DOCUMENTS = ("json", "sarif", "gitlab")  # written as JSON; the other non-table formats are text


def _emitters(report: object) -> dict[str, str]:
    """`report`'s row of EMITTERS; empty for anything that is not that row's record."""
    row = EMITTERS.get(getattr(type(report), "kind", None) or "", {})
    record = f"{type(report).__module__}:{type(report).__qualname__}"
    return {fmt: target for fmt, target in row.items() if fmt != "record"} if row.get("record") == record else {}


def formats_of(report: object) -> tuple[str, ...]:
    """The formats `report` has emitters for (none for an object that is no report)."""
    return tuple(_emitters(report))


def emitter(report: object, fmt: str) -> Callable[..., Any]:
    """The function that renders `report` in `fmt` (EMITTERS), imported now."""
    target = _emitters(report).get(fmt)
    if target is None:
        raise ValueError(f"no {fmt!r} emitter for a {type(report).__name__} report")  # a bug in the caller
    import importlib

    module, _, name = target.partition(":")
    function: Callable[..., Any] = getattr(importlib.import_module(module), name)
    return function


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
    render = emitter(report, fmt)
    if fmt == "table":
        options = {"all_layers": True} if all_layers else {}  # inspect's --layers
        render(report, console(stream, width), quiet=quiet, **options)
        return
    if fmt not in _DOCUMENTS:
        _write(stream, render(report))
        return
    import json as jsonlib  # here: --help and tables do without it (not `json`: the submodule)

    _write(stream, jsonlib.dumps(render(report), indent=2, allow_nan=False) + "\n")


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
    return printable(single_line(message))


def emit_error(message: str, stream: IO[str], *, json_stream: IO[str] | None = None) -> None:
    """An error said once: `bnaudit: error: MESSAGE` on `stream`, or, with `json_stream`
    (--format json), only `{"error": MESSAGE}` there, so that a JSON consumer reads a
    document whatever happened (and `2>&1` still parses)."""
    if json_stream is not None:  # JSON escapes what it must itself: the names stay exact there
        import json as jsonlib  # here: see emit

        _line(json_stream, jsonlib.dumps({"error": single_line(message)}))
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
    if report.kind == "inspect":
        if fmt == "table":
            for file in report.files:
                if file.error:
                    emit_error(f"{file.shown}: {file.error}", stream)
    elif report.kind == "recalibrate":
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

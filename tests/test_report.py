"""The layer and files tables' own grid draws what rich.Table draws, byte for byte, colours
included; the emitter renders each report kind in its formats, torch-free.

`output.grid.layout_grid` lays the layer table and a folder's files table out itself because
rich.Table costs about 70 us a cell (half the start-up budget on a ResNet-50, as much again
for a 50-file folder). The reference here is rich.Table, set up as `output.table` sets it up
when the grid declines, rendered by the same console.
"""

from __future__ import annotations

import io
import itertools
import random

import pytest
from rich.cells import cell_len
from rich.console import Console
from rich.table import Table
from rich.text import Text

from bnaudit.output import grid as report

pytestmark = pytest.mark.torchfree  # runs without torch (conftest.py)

NAMES = [
    "bn",
    "layer1.0.bn1",
    "x" * 23,
    "y" * 24,
    "z" * 25,
    "encoder.blocks.12.attention.output.norm_layer_with_a_long_name",
    "a name with spaces that wraps at words",
    "日本語のレイヤー名.bn",
    "\\x1b[31m (escaped)",
]
STATUSES = ["ok", "error", "warning", "info"]


def rich_table(headers: list[str], rows: list[list[str]], min_first: int) -> Table:
    table = Table(show_edge=False, pad_edge=False, header_style="bold")
    table.add_column(headers[0], overflow="fold", min_width=min_first)
    for header in headers[1:-1]:
        table.add_column(header, justify="right", no_wrap=True)
    table.add_column(headers[-1], no_wrap=True)
    for row in rows:
        table.add_row(*map(Text, row[:-1]), Text(row[-1], style=report.SEVERITY_STYLE[row[-1]]))
    return table


def console(width: int, terminal: bool) -> Console:
    return Console(
        file=io.StringIO(),
        width=width,
        force_terminal=terminal,
        color_system="truecolor" if terminal else None,
        highlight=False,
        markup=False,
        emoji=False,
    )


def cases():
    headers = ["layer", "C", "var min / med / max", "near-eps", "max gain", "status"]
    for i, (width, terminal) in enumerate(itertools.product((40, 61, 80, 97, 120, 200), (False, True))):
        names = [NAMES[(i + k) % len(NAMES)] for k in range(4)]
        rows = [
            [
                name,
                str(2 ** (k + 3)),
                f"{0.01 * (k + 1):.3g} / 1 / {k + 2}",
                str(k),
                f"{316.2 / (k + 1):.3g}",
                STATUSES[(i + k) % 4],
            ]
            for k, name in enumerate(names)
        ]
        yield width, terminal, headers, rows


@pytest.mark.parametrize("width,terminal,headers,rows", list(cases()))
def test_grid_output_equals_rich_tables(width, terminal, headers, rows):
    min_first = min(max(len(r[0]) for r in rows), 24)
    grid = report.layout_grid(headers, rows, console(width, terminal), min_first)
    if grid is None:  # declined: only where rich must shrink more than the layer column
        rest = sum(max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers) if i) + 3 * (len(headers) - 1)
        assert width - rest < max(min_first, len("layer"))
        return
    drawn = {}
    for what, renderable in (("rich", rich_table(headers, rows, min_first)), ("grid", grid)):
        out = console(width, terminal)
        out.print(renderable)
        drawn[what] = out.file.getvalue()
    assert drawn["grid"] == drawn["rich"]


def test_most_cases_take_the_grid_and_no_name_is_folded():
    taken = [
        report.layout_grid(h, r, console(w, t), min(max(len(x[0]) for x in r), 24)) is not None
        for w, t, h, r in cases()
    ]
    assert sum(taken) >= len(taken) // 2
    rows = [["encoder.blocks.12.attention.output.norm_layer_with_a_long_name", "8", "1", "ok"]]
    # a name wider than the column left: declined (the caller shortens names; never folded)
    assert report.layout_grid(["layer", "C", "var", "status"], rows, console(45, False), 24) is None
    assert report.layout_grid(["layer", "C", "var", "status"], rows, console(100, False), 24) is not None


# ----------------------------------------------------------------------------- the files table

FILE_STYLE = {**report.SEVERITY_STYLE, "unreadable": "bold red", "excluded": "dim", "skipped": "dim"}
SEGMENTS = ["tmp", "runs", "exp-2024-01-01_resnet50_lr0.1", "0", "日本語", "x" * 40, "with space", "esc\\x1b[31m"]
FILE_NAMES = ["model.safetensors", "ckpt_000.pt", "pytorch_model.bin", "a"]
FORMATS = ["torch-zip", "safetensors", "torch-legacy", "-", "torchscript", "gguf-ish"]
GAINS = ["-", "1", "2.05", "316", "1e+06", "0.001"]
FILES_HEADERS = ["file", "format", "layers", "worst gain", "status"]


def files_rows(rng: random.Random, count: int) -> list[list[str]]:
    rows = []
    for k in range(count):
        path = "/".join([*(rng.choice(SEGMENTS) for _ in range(rng.randint(0, 3))), f"{k}_{rng.choice(FILE_NAMES)}"])
        status = rng.choice(sorted(FILE_STYLE))
        audited = status not in ("unreadable", "excluded")
        layers, gain = (str(rng.choice([0, 1, 11, 161, 2048])), rng.choice(GAINS)) if audited else ("-", "-")
        rows.append([path, rng.choice(FORMATS), layers, gain, status])
    return rows


def rich_files_table(rows: list[list[str]]) -> Table:
    """The files table as rich draws it: every column on one line, numbers right-justified."""
    table = Table(show_edge=False, pad_edge=False, header_style="bold")
    for header, justify in zip(FILES_HEADERS, ["left", "left", "right", "right", "left"]):
        table.add_column(header, justify=justify, no_wrap=True)
    for row in rows:
        table.add_row(Text(row[0]), Text(row[1]), row[2], row[3], Text(row[4], style=FILE_STYLE[row[4]]))
    return table


def files_cases():
    rng = random.Random(20261201)
    for width in (40, 60, 80, 100, 120, 200):
        for colour in ("none", "terminal", "NO_COLOR"):
            for count in (1, 2, 7, 50):
                yield width, colour, files_rows(rng, count)


@pytest.mark.parametrize("width,colour,rows", list(files_cases()))
def test_files_grid_equals_the_rich_files_table(width, colour, rows, monkeypatch):
    if colour == "NO_COLOR":
        monkeypatch.setenv("NO_COLOR", "1")
    longest = max(cell_len(row[0]) for row in rows)
    grid = report.layout_grid(FILES_HEADERS, rows, console(width, colour != "none"), longest, (2, 3), FILE_STYLE)
    if grid is None:  # declined: only where the table does not fit and rich shrinks every column
        widest = [max(cell_len(h), *(cell_len(r[i]) for r in rows)) for i, h in enumerate(FILES_HEADERS)]
        assert sum(widest) + 3 * (len(widest) - 1) > width
        return
    drawn = {}
    for what, renderable in (("rich", rich_files_table(rows)), ("grid", grid)):
        out = console(width, colour != "none")
        out.print(renderable)
        drawn[what] = out.file.getvalue()
    assert drawn["grid"] == drawn["rich"]


def test_most_files_tables_take_the_grid():
    taken = [
        report.layout_grid(
            FILES_HEADERS, r, console(w, False), max(map(cell_len, (x[0] for x in r))), (2, 3), FILE_STYLE
        )
        for w, _, r in files_cases()
    ]
    assert sum(t is not None for t in taken) >= len(taken) // 3


def _file_report(rng: random.Random, k: int):
    from bnaudit.audit.checkpoint.report import FileReport, LayerSummary
    from bnaudit.audit.rules.registry import Finding

    path = "/".join([*(rng.choice(SEGMENTS) for _ in range(rng.randint(0, 6))), f"{k}_{rng.choice(FILE_NAMES)}"])
    file = FileReport(path, format=rng.choice([None, "torch-zip", "safetensors"]))
    kind = rng.random()
    if kind < 0.1:
        file.error = "cannot read"
    elif kind < 0.18:
        file.excluded = "excluded by the configuration"
    elif kind < 0.25:
        file.skipped = "optimizer state"
    else:
        gains = [rng.choice([None, 1.0, 2.05, 316.2, 1e6]) for _ in range(rng.randint(0, 3))]
        file.layers = [
            LayerSummary(f"layer{i}.bn", "BatchNorm2d", 64, 10, 1e-5, 0.1, "float32", -1, 1, 0.01, 0.5, 2, 0, gain)
            for i, gain in enumerate(gains)
        ]
        if file.layers and rng.random() < 0.5:
            severity = rng.choice(["error", "warning", "info"])
            file.findings = [Finding("BN001", "x", severity, file.layers[0].name, "message")]
    return file


def test_inspect_of_a_folder_prints_what_the_rich_files_table_printed(monkeypatch):
    # The whole inspect table of folder reports, with the files grid and with rich's table
    # (the grid refused: what `render_inspect` draws wherever the grid declines).
    from bnaudit.audit.checkpoint.report import InspectReport
    from bnaudit.config import Config
    from bnaudit.output.table import inspect as table

    grid = table.layout_grid
    taken = []

    def files_grid(*args, **kwargs):
        drawn = grid(*args, **kwargs)
        if args[0] == FILES_HEADERS:
            taken.append(drawn is not None)
        return drawn

    for seed in range(24):
        rng = random.Random(seed)
        files = [_file_report(rng, k) for k in range(rng.choice([2, 3, 12, 50]))]
        width, colour = rng.choice([60, 80, 100, 120, 200]), rng.choice(["none", "terminal", "NO_COLOR"])
        monkeypatch.delenv("NO_COLOR", raising=False)
        if colour == "NO_COLOR":
            monkeypatch.setenv("NO_COLOR", "1")
        drawn = {}
        for what, layout in (("grid", files_grid), ("rich", lambda *args, **kwargs: None)):
            monkeypatch.setattr(table, "layout_grid", layout)
            out = console(width, colour != "none")
            table.render_inspect(InspectReport(files, Config()), out)
            drawn[what] = out.file.getvalue()
        assert drawn["grid"] == drawn["rich"], (seed, width, colour)
    assert len(taken) == 24 and sum(taken) >= 8


# ----------------------------------------------------------------------------- the emitter

EMIT_PROBE = """
import io, json, sys
from bnaudit import output
from bnaudit.api import inspect
from bnaudit.config import Config

report = inspect([sys.argv[1]], Config())
printed = {}
for fmt in ("table", "json", "sarif"):
    stream = io.StringIO()
    output.emit(report, fmt, stream, width=100)
    printed[fmt] = stream.getvalue()
printed["loaded"] = sorted(m for m in ("torch", "numpy", "bnaudit.runtime") if m in sys.modules)
print(json.dumps(printed))
"""


@pytest.mark.slow
def test_emit_renders_an_inspect_report_in_each_format_without_the_runtime():
    # A fresh interpreter: what emitting imports is what `inspect` of a safetensors file pays.
    import json
    import os
    import subprocess
    import sys

    from conftest import REPO, SAMPLES

    proc = subprocess.run(
        [sys.executable, "-c", EMIT_PROBE, os.path.join(SAMPLES, "healthy.safetensors")],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    printed = json.loads(proc.stdout)
    assert printed["loaded"] == []
    table = printed["table"].splitlines()
    assert table[-1] == "1 file, 3 BN layers: 0 errors, 0 warnings, 0 infos"
    assert max(map(len, table)) <= 100 and any(line.startswith("head.2 ") for line in table)
    document = json.loads(printed["json"])
    assert [layer["name"] for layer in document["files"][0]["layers"]] == ["features.1", "features.4", "head.2"]
    sarif = json.loads(printed["sarif"])
    assert sarif["version"] == "2.1.0" and sarif["runs"][0]["results"] == []


def _gap_report(layers=()):
    """A gap report built by hand: the records are plain data in a torch-free module."""
    from bnaudit.audit.checkpoint.report import FileReport
    from bnaudit.reports.gap import GapReport

    return GapReport(
        checkpoint="m.pt",
        model="net",
        data="val",
        samples=4,
        batch_size=2,
        batches=2,
        seed=0,
        shuffle=True,
        device="cpu",
        train_accuracy=1.0,
        eval_accuracy=0.5,
        gap=0.5,
        agreement=0.5,
        divergence=0.25,
        divergence_kind="kl",
        layers=list(layers),
        inspection=FileReport("m.pt"),
    )


def _recalibration_report():
    from bnaudit.reports.recalibrate import RecalibrationReport

    return RecalibrationReport(
        "a.pt", "b.pt", "torch", None, "net", "val", "exact", 4, 2, 2, 0, True, "cpu", 1, [], [], [], {}
    )


def _inspect_report():
    from bnaudit.audit.checkpoint.report import InspectReport
    from bnaudit.config import Config

    return InspectReport([], Config())


class _NotAReport:
    kind = "inspect"  # a string attribute no longer chooses the emitter: the type does


@pytest.mark.parametrize(
    "make,fmt,name",
    [
        (_gap_report, "sarif", "GapReport"),
        (_recalibration_report, "sarif", "RecalibrationReport"),
        (_NotAReport, "table", "_NotAReport"),
        (_NotAReport, "json", "_NotAReport"),
        (_inspect_report, "html", "InspectReport"),
    ],
)
def test_emit_refuses_a_format_the_report_type_does_not_have(make, fmt, name):
    from bnaudit import output

    stream = io.StringIO()
    with pytest.raises(ValueError, match=f"no '{fmt}' emitter for a {name} report"):
        output.emit(make(), fmt, stream)
    assert stream.getvalue() == ""


RECORDS_PROBE = """
import io, json, sys
from bnaudit import output
from bnaudit.audit.checkpoint.report import FileReport
from bnaudit.reports.gap import ChannelDrift, GapReport, LayerDrift

layer = LayerDrift("features.1", 0, "BatchNorm2d", 2, 50, 0.75, 1.25, 0.5,
                   worst=(ChannelDrift(1, 1.0, 4.0, 0.0, 1.0, 1.0, 1.5),), peak=2.5)
report = GapReport("m.pt", "net", "val", 4, 2, 2, 0, True, "cpu", 1.0, 0.5, 0.5, 0.5, 0.25, "kl", [layer],
                   FileReport("m.pt"))
printed = {}
for fmt in ("table", "json"):
    stream = io.StringIO()
    output.emit(report, fmt, stream, width=120)
    printed[fmt] = stream.getvalue()
printed["loaded"] = sorted(m for m in ("torch", "numpy", "bnaudit.runtime") if m in sys.modules)
print(json.dumps(printed))
"""


def test_a_gap_report_built_by_hand_is_emitted_without_torch():
    # The records and their emitters are torch-free: a consumer can load and render a
    # gap report (here built by hand) without the measuring runtime.
    import json
    import os
    import subprocess
    import sys

    from conftest import REPO

    proc = subprocess.run(
        [sys.executable, "-c", RECORDS_PROBE],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    printed = json.loads(proc.stdout)
    assert printed["loaded"] == []
    document = json.loads(printed["json"])
    (layer,) = document["layers"]
    assert layer["name"] == "features.1" and layer["drift"] == 0.75 + 0.5
    assert layer["worst_channels"][0]["drift"] == 1.0 + 1.5
    row = next(line for line in printed["table"].splitlines() if line.startswith("features.1"))
    # drift 1.25 (mean shift + var log-ratio); worst channel 1 scores 2.5
    assert "1.250" in row and "1: 2.500" in row

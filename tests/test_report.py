"""The emitter renders each report kind in its formats, torch-free, and refuses the formats a
report does not have."""

from __future__ import annotations

import io

import pytest

pytestmark = pytest.mark.torchfree  # runs without torch (conftest.py)


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
        (_inspect_report, "pdf", "InspectReport"),
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


def test_every_emitter_of_the_table_exists_and_each_record_names_its_own_kind():
    import importlib

    from bnaudit import output

    for kind, row in output.EMITTERS.items():
        module, _, name = row["record"].partition(":")
        record = getattr(importlib.import_module(module), name)
        assert record.kind == kind
        for fmt, target in row.items():
            module, _, name = target.partition(":")
            assert callable(getattr(importlib.import_module(module), name)), (kind, fmt)

"""A model's names reach the terminal inert: no command writes a control character it read.

The model is a plain `torch.save` of an nn.Sequential built from torch.nn classes only
(loaded without --trust-pickle) whose BatchNorm layer is named with an OSC sequence that
would retitle the terminal: ESC ] 0 ; owned BEL. Every command, in every format, must
write no C0 control but newline (and tab), no DEL and no C1 control, on stdout or stderr,
and must still show the name (escaped in tables and messages, exact in JSON documents).
"""

from __future__ import annotations

import importlib.util
import json
import re

import pytest
import torch
from conftest import SAMPLES
from torch import nn
from typer.testing import CliRunner

from bnaudit.cli import app

EVIL = "bn\x1b]0;owned\x07"
SHOWN = "bn\\x1b]0;owned\\x07"  # as bnaudit.text.printable writes it
CALIB = f"{SAMPLES}/data/digits_calib.safetensors"
VAL = f"{SAMPLES}/data/digits_val.safetensors"
# --format html where its extra (matplotlib) is installed
HTML = pytest.param(
    "html", marks=pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="no matplotlib")
)
# Bytes a terminal acts on: C0 but \t and \n, DEL, and C1 (U+0080-U+009F, two bytes in UTF-8).
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


@pytest.fixture(scope="module")
def evil_model(tmp_path_factory) -> str:
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("flatten", nn.Flatten())
    model.add_module("fc", nn.Linear(64, 4))  # the sample digits: 1 x 8 x 8 = 64 features
    model.add_module(EVIL, nn.BatchNorm1d(4))  # initial statistics: BN002 names it in findings too
    model.add_module("out", nn.Linear(4, 10))
    path = tmp_path_factory.mktemp("evil") / "evil.pt"
    torch.save(model.eval(), path)
    return str(path)


def run(*args: str):
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "100"})
    for name, text in (("stdout", result.stdout), ("stderr", result.stderr)):
        found = sorted(set(CONTROL.findall(text)))
        assert not found, f"{args[0]} wrote {found} on {name}"
    return result


def test_the_checker_sees_what_a_raw_name_would_write():
    # The pattern must catch the sequence itself and a C1 control, and pass ordinary text.
    assert CONTROL.findall(f"x {EVIL} \x9b y") == ["\x1b", "\x07", "\x9b"]
    assert CONTROL.findall("layer │ 0.5 -> 0.1\n\tok ·") == []


@pytest.mark.parametrize("fmt", ["table", "json", HTML])
def test_inspect_writes_the_name_inert(evil_model, fmt):
    result = run("inspect", evil_model, "--format", fmt)
    assert result.exit_code == 1, result.output  # BN002
    if fmt in ("table", "html"):
        assert SHOWN in result.stdout
    else:
        names = [layer["name"] for layer in json.loads(result.stdout)["files"][0]["layers"]]
        assert names == [EVIL]


@pytest.mark.parametrize("fmt", ["table", "json", HTML])
def test_gap_writes_the_name_inert(evil_model, fmt):
    result = run("gap", evil_model, "--data", VAL, "--num-samples", "128", "--format", fmt)
    assert result.exit_code == 0, result.output
    if fmt in ("table", "html"):
        # the drift table (folded at 100 columns, so the name's first part), the findings
        # and the diagnosis
        assert result.stdout.count("bn\\x1b]0;") >= 3 and SHOWN in result.stdout
    else:
        doc = json.loads(result.stdout)
        assert [d["name"] for d in doc["layers"]] == [EVIL]
        assert [f["layer"] for f in doc["findings"]] == [EVIL]


@pytest.mark.parametrize("fmt", ["table", "json", HTML])
def test_recalibrate_writes_the_name_inert(evil_model, tmp_path, fmt):
    result = run(
        "recalibrate",
        evil_model,
        "--data",
        CALIB,
        "--eval-data",
        VAL,
        "--num-samples",
        "128",
        "-o",
        str(tmp_path / "out.pt"),
        "--format",
        fmt,
    )
    assert result.exit_code == 0, result.output
    # the warning about few values per channel names the layer, on stderr
    assert SHOWN in result.stderr
    if fmt in ("table", "html"):
        assert "bn\\x1b]0;" in result.stdout
    else:
        doc = json.loads(result.stdout)
        assert [c["name"] for c in doc["layers"]] == [EVIL]


@pytest.mark.parametrize("fmt", ["table", "json"])
def test_an_error_that_quotes_the_name_is_one_inert_line(tmp_path, fmt):
    # Data the model rejects: the error names the layer that refused it.
    model = nn.Sequential()
    model.add_module(EVIL, nn.Linear(3, 4))
    model.add_module("bn", nn.BatchNorm1d(4))
    torch.save(model.eval(), tmp_path / "m.pt")
    result = run("gap", str(tmp_path / "m.pt"), "--data", VAL, "--num-samples", "16", "--format", fmt)
    assert result.exit_code == 2
    if fmt == "json":  # said once: in the document, the name exact (JSON's own escapes keep stdout inert)
        assert result.stderr == "" and EVIL in json.loads(result.stdout)["error"]
        assert "\x1b" not in result.stdout and "\x07" not in result.stdout
        return
    (line,) = result.stderr.splitlines()
    assert line.startswith("bnaudit: error: ") and SHOWN in line


# ----------------------------------------------------------------------------- undecodable names


def _bn_entries(prefix: str, var: float) -> dict:
    return {
        f"{prefix}.weight": torch.ones(3),
        f"{prefix}.bias": torch.zeros(3),
        f"{prefix}.running_mean": torch.zeros(3),
        f"{prefix}.running_var": torch.full((3,), var),
        f"{prefix}.num_batches_tracked": torch.tensor(5000),
    }


@pytest.fixture(scope="module")
def oddly_named(tmp_path_factory):
    """A folder of three checkpoints, each with a BN005 finding (NaN running_var): one whose
    layer name holds a lone surrogate (a pickle allows one), one whose file name is not UTF-8,
    one plain."""
    import os

    folder = tmp_path_factory.mktemp("names")
    torch.save(_bn_entries("bn\udc80x", float("nan")), folder / "surrogate.pt")
    torch.save(_bn_entries("bn", float("nan")), os.fsdecode(bytes(folder) + b"/caf\xe9.pt"))
    torch.save(_bn_entries("plain", float("nan")), folder / "plain.pt")
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["table", "json", "sarif", "github", "gitlab", "junit", "markdown", HTML])
def test_every_format_survives_a_lone_surrogate_and_an_undecodable_file_name(oddly_named, fmt):
    # a real process writing to a real pipe (UTF-8, strict): was, for sarif, "internal error:
    # UnicodeEncodeError" and exit 2 with no document at all
    import os
    import subprocess
    import sys

    from conftest import REPO

    proc = subprocess.run(
        [sys.executable, "-m", "bnaudit", "inspect", str(oddly_named), "--format", fmt],
        capture_output=True,
        env={**os.environ, "PYTHONPATH": REPO, "COLUMNS": "200", "NO_COLOR": "1"},
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr.decode("utf-8", "replace")  # findings, no error
    out = proc.stdout.decode("utf-8")  # valid UTF-8, whatever the names
    assert "internal error" not in proc.stderr.decode("utf-8")
    for name in ("plain.pt", "surrogate.pt"):
        assert name in out, (name, out[:500])
    assert "caf" in out  # the undecodable file's results are there too
    if fmt in ("json", "sarif", "gitlab"):
        document = json.loads(out)
        assert json.dumps(document).count("BN005") >= 3
    if fmt == "sarif":
        uris = {
            r["locations"][0]["physicalLocation"]["artifactLocation"]["uri"]
            for r in json.loads(out)["runs"][0]["results"]
        }
        assert any(u.endswith("caf%E9.pt") for u in uris), uris  # the file's own bytes, percent-encoded

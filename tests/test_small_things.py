"""Small things users hit, through the installed entry point (`python -m bnaudit`, the
same `main` as the `bnaudit` executable): usage errors in one line and our words, help
that uses the terminal and shows no Python types, a closed pipe, one message per error,
and one numbering of layers in gap's table and JSON."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import REPO, SAMPLES

HEALTHY = os.path.join(SAMPLES, "healthy.pt")
ARCH = ["--arch", "sample_models/digits_net.py:digits_net"]
VAL = "sample_models/data/digits_val.safetensors"


def bnaudit(*args: str, columns: int = 100, **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": str(columns), "NO_COLOR": "1"}
    options = {"capture_output": True, "text": True, **kwargs}
    return subprocess.run([sys.executable, "-m", "bnaudit", *args], cwd=REPO, env=env, timeout=300, **options)


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, line",
    [
        (
            ["inspect", HEALTHY, "--fail-on", "fatal"],
            "--fail-on: 'fatal' is not one of 'info', 'warning', 'error' (see bnaudit inspect --help)",
        ),
        (["inspect", HEALTHY, "--eps", "abc"], "--eps: expected a number (see bnaudit inspect --help)"),
        (["gap", HEALTHY, "--batch-size", "1.5"], "--batch-size: expected a whole number (see bnaudit gap --help)"),
        (["inspect", HEALTHY, "--zzz"], "No such option: --zzz (see bnaudit inspect --help)"),
        # click suggests a close option name (difflib); the line stays one line
        (
            ["inspect", HEALTHY, "--exitzero"],
            "No such option: --exitzero (Possible options: --exit-zero) (see bnaudit inspect --help)",
        ),
    ],
)
def test_usage_errors_are_one_line_in_our_words(args, line):
    proc = bnaudit(*args)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr.splitlines() == [f"bnaudit: error: {line}"]
    assert "Value error" not in proc.stderr and "Input should be" not in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("command", ["inspect", "rules", "gap", "invariance", "recalibrate"])
def test_help_uses_a_wide_terminal_and_shows_no_python_types(command):
    out = bnaudit(command, "--help", columns=250).stdout
    assert not re.search(r"<(list\[|int>|float>|str>|bool>)|\{[A-Z]+", out), out
    if command == "inspect":
        assert "Usage: bnaudit inspect [OPTIONS] PATHS..." in out
        # the longest help of the command, whole on one line (click stops at 80 columns)
        line = next(line for line in out.splitlines() if line.lstrip().startswith("--fail-on"))
        assert line.rstrip().endswith("(default: warning, or fail-on from the configuration).")
    narrow = bnaudit(command, "--help", columns=80).stdout
    assert all(len(line) <= 80 for line in narrow.splitlines())


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["table", "json"])
def test_a_closed_pipe_ends_quietly_with_exit_0(fmt):
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first byte, as `| head -0`
    try:
        proc = bnaudit("inspect", SAMPLES, "--format", fmt, stdout=write, capture_output=False, stderr=subprocess.PIPE)
    finally:
        os.close(write)
    assert (proc.returncode, proc.stderr) == (0, "")
    # the same run with a reader: findings, exit 1
    assert bnaudit("inspect", SAMPLES, "--format", fmt).returncode == 1


def bnaudit_error(path) -> str:
    """The problem bnaudit reports for an unreadable `path`, from its JSON document."""
    return json.loads(bnaudit("inspect", str(path), "--format", "json").stdout)["files"][0]["error"]


@pytest.mark.slow
def test_an_error_is_said_once_whatever_the_format(tmp_path):
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint")
    table = bnaudit("inspect", str(junk), HEALTHY, columns=250)
    # the files table marks it unreadable; the problem is said once, on stderr
    assert table.returncode == 2 and "not a checkpoint" not in table.stdout
    (row,) = [line for line in table.stdout.splitlines() if line.startswith(str(junk))]
    assert row.split("│")[-1].strip() == "unreadable"
    assert table.stderr.splitlines() == [f"bnaudit: error: {junk}: {bnaudit_error(junk)}"]
    as_json = bnaudit("inspect", str(junk), HEALTHY, "--format", "json")
    assert as_json.returncode == 2 and as_json.stderr == ""
    assert "not a checkpoint" in json.loads(as_json.stdout)["files"][0]["error"]
    fatal = bnaudit("inspect", HEALTHY, "--config", str(tmp_path / "missing.toml"), "--format", "json")
    assert fatal.returncode == 2 and fatal.stderr == ""
    assert json.loads(fatal.stdout) == {"error": f"{tmp_path / 'missing.toml'}: configuration file not found"}
    fatal = bnaudit("inspect", HEALTHY, "--config", str(tmp_path / "missing.toml"))
    assert fatal.stdout == "" and fatal.stderr.splitlines() == [
        f"bnaudit: error: {tmp_path / 'missing.toml'}: configuration file not found"
    ]


@pytest.mark.slow
def test_gap_json_position_and_the_table_number_use_the_same_base():
    args = ["gap", "sample_models/reset_stats.pt", *ARCH, "--data", VAL, "--batch-size", "64"]
    doc = json.loads(bnaudit(*args, "--format", "json").stdout)
    table = bnaudit(*args).stdout
    numbers = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.split("│")]
        if len(cells) > 2 and cells[1].rstrip("*").isdigit():  # "1*" marks the origin of the drift
            numbers[cells[0]] = int(cells[1].rstrip("*"))
    assert numbers == {layer["name"]: layer["position"] for layer in doc["layers"]}
    # the forward order: features.1 is the first BN layer of the digits network
    assert numbers["features.1"] == 1 and numbers["head.2"] == 3

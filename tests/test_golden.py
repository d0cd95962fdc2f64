"""Golden output: every table renderer at 100 columns without colour, as printed (float noise masked).

The comparison masks float noise (tools/noise_match.py): a figure may differ from its
golden text by one unit in its last printed digit, as another CPU's summation order can
move it; every other character is compared as printed, but for a run of spaces beside a
number (its padding). After an intended change of what a table prints, regenerate the
expected text with

    python tools/update_golden.py

and review the diff of tests/golden/ like any other change.

Each case runs the CLI on the sample models from a scratch folder that links
sample_models/, so every path it prints is relative and the same on every machine:
no path is normalised. gap and recalibrate run seeded on the CPU with one thread.
The expected text depends on rich's table drawing (see tools/update_golden.py).
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import pytest
from conftest import REPO, SAMPLES

sys.path.insert(0, os.path.join(REPO, "tools"))

from noise_match import difference

GOLDEN = Path(__file__).resolve().parent / "golden"
WIDTH = 100
ARCH = ["--arch", "sample_models/digits_net.py:digits_net"]
VAL = "sample_models/data/digits_val.safetensors"
CALIB = "sample_models/data/digits_calib.safetensors"

# name -> (arguments, exit code)
CASES: dict[str, tuple[list[str], int]] = {
    "inspect_healthy": (["inspect", "sample_models/healthy.pt"], 0),
    "diff": (["diff", "sample_models/pretrained.safetensors", "sample_models/finetuned.pt"], 1),
    "inspect_findings": (["inspect", "sample_models/dead_channel.safetensors"], 1),
    "inspect_several": (
        [
            "inspect",
            "sample_models/healthy.safetensors",
            "sample_models/immature.pt",
            "sample_models/nan_stats.pt",
            "sample_models/ema_container.pth",
        ],
        1,
    ),
    # issue #12: a sharded checkpoint through its folder, a Trainer folder with skipped files
    "inspect_layouts": (["inspect", "sample_models/sharded/", "sample_models/checkpoint-3/"], 0),
    "inspect_shard_alone": (["inspect", "sample_models/sharded/model-00001-of-00003.safetensors"], 0),
    "rules": (["rules"], 0),
    "gap": (["gap", "sample_models/reset_stats.pt", *ARCH, "--data", VAL, "--batch-size", "32"], 0),
    "parity": (
        [
            "parity",
            "sample_models/healthy.pt",
            *ARCH,
            "--data",
            VAL,
            "--against",
            "sample_models/onnx/digits_training.onnx",
        ],
        1,
    ),
    "invariance": (
        ["invariance", "sample_models/traced_train.pt", "--data", VAL, "--batch-sizes", "1,8,64"],
        1,
    ),
    "recalibrate": (
        [
            "recalibrate",
            "sample_models/reset_stats.pt",
            *ARCH,
            "--data",
            CALIB,
            "--eval-data",
            VAL,
            "--batch-size",
            "32",
            "-o",
            "recalibrated.pt",
        ],
        0,
    ),
    "merge": (
        [
            "merge",
            "sample_models/federated/client1.bnstats",
            "sample_models/federated/client2.bnstats",
            "--checkpoint",
            "sample_models/federated/global.safetensors",
            "-o",
            "merged.safetensors",
        ],
        0,
    ),
    "fed": (
        [
            "fed",
            "sample_models/federated/global.safetensors",
            "sample_models/federated/client1.safetensors",
            "sample_models/federated/client2.safetensors",
        ],
        1,
    ),
}
# The cases that run a model (torch, on one thread); the others are of the torch-free tier.
MEASURED = ("gap", "invariance", "recalibrate", "merge", "parity")  # the cases that run a model: torch


def render(name: str, workdir: Path) -> tuple[str, int]:
    """Run case `name` in `workdir` (created if needed): its stdout and exit code."""
    from typer.testing import CliRunner

    from bnaudit.cli import app

    workdir.mkdir(parents=True, exist_ok=True)
    link = workdir / "sample_models"
    if not link.exists():
        link.symlink_to(SAMPLES, target_is_directory=True)
    # an empty configuration here ends the search for one: the defaults, whatever lies above
    (workdir / "bnaudit.toml").write_text("")
    args, _ = CASES[name]
    with contextlib.ExitStack() as stack:
        if args[0] in MEASURED:
            stack.enter_context(one_thread())  # float sums in another order could move a last printed digit
        previous = os.getcwd()
        os.chdir(workdir)
        stack.callback(os.chdir, previous)
        result = CliRunner().invoke(app, args, env={"COLUMNS": str(WIDTH), "NO_COLOR": "1", "TERM": "dumb"})
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.stdout, result.exit_code


@contextlib.contextmanager
def one_thread():
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=() if args[0] in MEASURED else pytest.mark.torchfree) for n, (args, _) in CASES.items()],
)
def test_table_output_matches_the_golden_file(name, tmp_path):
    printed, code = render(name, tmp_path)
    assert code == CASES[name][1], printed
    expected = (GOLDEN / f"{name}.txt").read_text(encoding="utf-8")
    why = difference(expected, printed)
    if why is not None:
        pytest.fail(
            f"{name}: the output differs from golden/{name}.txt (intended? python tools/update_golden.py)\n{why}"
        )


def test_every_golden_file_has_a_case():
    # A renamed case would otherwise leave its old file behind, checked by nothing.
    assert sorted(p.stem for p in GOLDEN.glob("*.txt")) == sorted(CASES)

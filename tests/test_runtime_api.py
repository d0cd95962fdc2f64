"""The runtime's public functions: the project configuration reaches every finding they
report, and recalibrate_checkpoint's SIGTERM handler lives exactly as long as the call."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from conftest import SAMPLES

import bnaudit
from bnaudit.audit.rules import RULES
from bnaudit.config import load_config
from bnaudit.runtime.models import ModelSpec

ARCH = f"{SAMPLES}/digits_net.py:digits_net"
CALIB = f"{SAMPLES}/data/digits_calib.safetensors"
VAL = f"{SAMPLES}/data/digits_val.safetensors"
RESET = f"{SAMPLES}/reset_stats.pt"  # every BN layer holds (0, 1): BN002 in inspect's findings


def codes(report) -> set[str]:
    return {f.code for f in report.findings}


@pytest.fixture
def ignores_bn002(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A project folder as the working directory, whose bnaudit.toml ignores BN002."""
    (tmp_path / "bnaudit.toml").write_text('ignore = ["BN002"]\n')
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_recalibrate_eval_reports_follow_the_config_given(ignores_bn002: Path) -> None:
    options = bnaudit.DataOptions(path=CALIB, num_samples=64, batch_size=32)
    held_out = bnaudit.DataOptions(path=VAL, num_samples=64, batch_size=32)
    plain = bnaudit.recalibrate_checkpoint(
        ModelSpec(RESET, arch=ARCH), str(ignores_bn002 / "a.pt"), options, eval_data=held_out
    )
    assert "BN002" in codes(plain.eval_before)  # the control: the checkpoint really has reset statistics
    config = load_config(rule_codes=RULES)
    assert "BN002" in config.ignore
    configured = bnaudit.recalibrate_checkpoint(
        ModelSpec(RESET, arch=ARCH), str(ignores_bn002 / "b.pt"), options, eval_data=held_out, config=config
    )
    assert "BN002" not in codes(configured.eval_before) | codes(configured.eval_after)
    # the rest of the findings are the same: only the ignored code is gone
    assert codes(configured.eval_before) == codes(plain.eval_before) - {"BN002"}


def test_cli_recalibrate_eval_findings_follow_bnaudit_toml_as_gap_does(ignores_bn002: Path) -> None:
    from typer.testing import CliRunner

    from bnaudit.cli import app

    common = ["--arch", ARCH, "--num-samples", "64", "--batch-size", "32", "--format", "json"]
    gap = CliRunner().invoke(app, ["gap", RESET, "--data", VAL, *common])
    assert gap.exit_code == 0, gap.output
    assert "BN002" not in {f["code"] for f in json.loads(gap.stdout)["findings"]}
    recal = CliRunner().invoke(
        app, ["recalibrate", RESET, "--data", CALIB, "--eval-data", VAL, "-o", str(ignores_bn002 / "out.pt"), *common]
    )
    assert recal.exit_code == 0, recal.output
    evaluation = json.loads(recal.stdout)["eval"]
    for side in ("before", "after"):
        assert "BN002" not in {f["code"] for f in evaluation[side]["findings"]}, side


def sentinel(_signum: int, _frame: object) -> None:
    raise AssertionError("the sentinel SIGTERM handler must never run in this test")


@pytest.fixture
def sigterm_sentinel():
    previous = signal.signal(signal.SIGTERM, sentinel)
    yield sentinel
    signal.signal(signal.SIGTERM, previous)


def test_recalibrate_checkpoint_turns_sigterm_into_keyboardinterrupt_while_it_runs_only(
    sigterm_sentinel, tmp_path: Path
) -> None:
    during = []

    def progress(_done: int, _total: int) -> None:
        during.append(signal.getsignal(signal.SIGTERM))

    options = bnaudit.DataOptions(path=CALIB, num_samples=64, batch_size=32)
    bnaudit.recalibrate_checkpoint(ModelSpec(RESET, arch=ARCH), str(tmp_path / "out.pt"), options, progress=progress)
    assert during and all(h is during[0] for h in during)
    assert during[0] is not sigterm_sentinel and callable(during[0])
    with pytest.raises(KeyboardInterrupt):
        during[0](signal.SIGTERM, None)
    assert signal.getsignal(signal.SIGTERM) is sigterm_sentinel


def test_recalibrate_checkpoint_restores_the_sigterm_handler_after_a_failure(sigterm_sentinel, tmp_path: Path) -> None:
    options = bnaudit.DataOptions(path=CALIB, num_samples=64, batch_size=32)
    with pytest.raises(bnaudit.BnauditError):
        bnaudit.recalibrate_checkpoint(
            ModelSpec(RESET, arch=ARCH), str(tmp_path / "out.pt"), options, include=["no.such.layer"]
        )
    assert signal.getsignal(signal.SIGTERM) is sigterm_sentinel

    def interrupted(_done: int, _total: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        bnaudit.recalibrate_checkpoint(
            ModelSpec(RESET, arch=ARCH), str(tmp_path / "out2.pt"), options, progress=interrupted
        )
    assert signal.getsignal(signal.SIGTERM) is sigterm_sentinel
    assert not (tmp_path / "out2.pt").exists()


def test_cli_recalibrate_leaves_the_callers_sigterm_handler_in_place(sigterm_sentinel, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from bnaudit.cli import app

    result = CliRunner().invoke(
        app,
        [
            "recalibrate",
            RESET,
            "--arch",
            ARCH,
            "--data",
            CALIB,
            "--num-samples",
            "64",
            "--batch-size",
            "32",
            "-o",
            str(tmp_path / "out.pt"),
            "--format",
            "json",
        ],
    )
    assert result.exit_code == 0, result.output
    assert signal.getsignal(signal.SIGTERM) is sigterm_sentinel


# ----------------------------------------------------------------------------- --max-gap


@pytest.mark.parametrize("bad", [1.5, -1.01, float("nan")])
def test_measure_gap_refuses_a_max_gap_outside_minus_one_to_one_before_loading(bad: float) -> None:
    with pytest.raises(bnaudit.BnauditError, match=r"--max-gap is a fraction of samples in \[-1, 1\]"):
        bnaudit.measure_gap(ModelSpec("no-such-checkpoint.pt", arch=ARCH), bnaudit.DataOptions(path=VAL), max_gap=bad)


def test_measure_gap_stores_max_gap_and_exit_code_compares_the_measured_gap() -> None:
    options = bnaudit.DataOptions(path=VAL, num_samples=128, batch_size=32)
    free = bnaudit.measure_gap(ModelSpec(RESET, arch=ARCH), options)
    assert free.max_gap is None and free.exit_code() == 0
    assert free.gap > 0.2  # reset statistics cost accuracy: the limits below sit on either side
    tight = bnaudit.measure_gap(ModelSpec(RESET, arch=ARCH), options, max_gap=free.gap - 0.05)
    loose = bnaudit.measure_gap(ModelSpec(RESET, arch=ARCH), options, max_gap=free.gap + 0.05)
    assert tight.gap == loose.gap == free.gap  # same seed, same samples
    assert (tight.max_gap, tight.exit_code()) == (pytest.approx(free.gap - 0.05), 1)
    assert (loose.max_gap, loose.exit_code()) == (pytest.approx(free.gap + 0.05), 0)


def test_measure_gap_max_gap_needs_labels(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    unlabelled = tmp_path / "x.safetensors"
    save_file({"inputs": load_file(VAL)["inputs"][:64].contiguous()}, str(unlabelled))
    with pytest.raises(bnaudit.BnauditError, match="--max-gap needs labelled data"):
        bnaudit.measure_gap(
            ModelSpec(RESET, arch=ARCH), bnaudit.DataOptions(path=str(unlabelled), batch_size=32), max_gap=0.1
        )

"""Float noise: figures below their floor print as the floor, and shown outputs (README
examples, golden files) are compared with the remaining noise digits masked
(tools/noise_match.py), so the suite passes on a CPU whose kernels sum in another order."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "tools"))

import noise_match
import readme_examples

from bnaudit.audit.statistics import parity_floor
from bnaudit.text import above_floor

HEALTHY_INVARIANCE = (
    "bnaudit invariance sample_models/healthy.pt --arch sample_models/digits_net.py:digits_net "
    "--data sample_models/data/digits_val.safetensors --batch-sizes 1,8,64"
)
GOLDEN = Path(REPO) / "tests" / "golden"
TRAINING_EXPORT_PARITY = (
    "bnaudit diff sample_models/healthy.pt sample_models/onnx/digits_training.onnx --arch "
    "sample_models/digits_net.py:digits_net --data sample_models/data/digits_val.safetensors -q"
)
HEALTHY_EXPORT_PARITY = (
    "bnaudit diff sample_models/healthy.pt sample_models/onnx/digits.onnx --arch "
    "sample_models/digits_net.py:digits_net --data sample_models/data/digits_val.safetensors"
)


def test_a_value_below_its_floor_prints_as_the_floor():
    # the two CPUs of the report: 3.8e-07 and 4.7e-07 under the float32 screen 128 * 2^-23
    screen = 128 * 2.0**-23
    assert above_floor(3.8e-07, screen) == above_floor(4.7e-07, screen) == "<1.5e-05"
    assert above_floor(2.5e-05, screen) == "2.5e-05"
    assert above_floor(9.72, screen, ".3g") == "9.72"
    assert above_floor(float("nan"), screen) == "nan"  # a NaN output is never hidden as noise
    assert above_floor(1e-06, 1e-06) == "1e-06"  # at the floor is not below it


def test_the_export_parity_floor_is_the_same_on_both_cpus():
    # floors of 4.97e-06 and 5.26e-06 measured on two CPUs (10x the rounding): 1e-05 on both
    assert parity_floor(4.97e-07) == parity_floor(5.26e-07) == 1e-05
    assert parity_floor(1.2e-06) == 1e-04  # 1.2e-05 rounded up to a power of ten
    assert parity_floor(0.0) == parity_floor(1e-09) == 1e-06  # FLOOR_MIN
    assert parity_floor(0.23) == 10.0


@pytest.mark.parametrize(
    "shown, run",
    [
        ("0.164", "0.165"),  # a value on a rounding boundary, moved by noise
        ("0.12", "0.119"),  # "%g" dropped the zero of 0.120
        ("2e-07", "1.99e-07"),
        ("10", "9.99"),
        ("9.7", "9.6"),  # two significant digits
        ("+0.0", "-0.0"),
    ],
)
def test_last_digit_noise_matches(shown, run):
    assert noise_match.numbers_match(shown, run)


@pytest.mark.parametrize(
    "shown, run",
    [
        ("0.164", "0.166"),  # two units
        ("0.164", "0.170"),
        ("2e-07", "3e-07"),  # one digit, 50%
        ("216", "217"),  # counts are exact
        ("4.97e-06", "5.26e-06"),  # a measured floor printed at 3 digits is not noise-proof
        ("3.8e-07", "4.7e-07"),
    ],
)
def test_a_real_change_of_a_figure_does_not_match(shown, run):
    assert not noise_match.numbers_match(shown, run)


def test_padding_beside_a_number_is_not_layout():
    shown = "features.1 │     0.12 │ ok    \nhead.2     │    0.164 │ ok    "
    assert noise_match.difference(shown, "features.1 │    0.119 │ ok    \nhead.2     │    0.165 │ ok    ") is None
    assert noise_match.difference(shown, "features.1 │    0.119 │ error \nhead.2     │    0.165 │ ok    ")
    missing = noise_match.difference(shown, "features.1 │     0.12 │ ok    ")
    assert missing is not None and missing.startswith("2 lines shown, 1 printed\n--- shown\n+++ printed\n")
    assert "\n-head.2     │    0.164 │ ok    " in missing
    # names with digits and versions are text: features.1 is not features.2
    assert noise_match.difference("features.1 │ 2.13.0", "features.2 │ 2.13.0")
    assert noise_match.difference("pytorch 2.13.0", "pytorch 2.13.1")


def _neighbour(token: str) -> str:
    """`token` moved up by one unit in its last printed digit, printed with as many digits."""
    mantissa, e, exponent = token.partition("e")
    decimals = len(mantissa.partition(".")[2])
    moved = f"{float(mantissa) + 10.0**-decimals:.{decimals}f}"
    return f"{moved}{e}{exponent}"


def _noisy(body: str) -> tuple[str, int]:
    """`body` with every figure of two or more significant digits moved by one unit in its
    last digit (what another CPU's summation order can do to a value on a rounding
    boundary), and how many were moved."""
    moved = 0

    def move(m: re.Match[str]) -> str:
        nonlocal moved
        token = m.group()
        digits = len(token.lstrip("+-").partition("e")[0].replace(".", "").lstrip("0"))
        if not any(c in token for c in ".e") or digits < 2:
            return token
        moved += 1
        return _neighbour(token)

    return noise_match.NUMBER.sub(move, body), moved


# every document the check reads (README.md, then docs/), joined: the blocks of all of them
README_TEXT = ""
for _path in readme_examples.documents():
    with open(_path, encoding="utf-8") as _fh:
        README_TEXT += _fh.read()


def _check_with_runs(monkeypatch, capsys, runs: dict[str, str]) -> tuple[int, str]:
    """readme_examples --check over the README and docs/, with each example's run replaced by `runs`."""
    monkeypatch.setattr(readme_examples, "run_example", lambda command: runs[command])
    code = readme_examples.main(["--check"])
    return code, capsys.readouterr().err


def test_the_readme_check_passes_when_every_noise_digit_differs(monkeypatch, capsys):
    blocks = readme_examples.examples(README_TEXT)
    runs, moved = {}, 0
    for command, body in blocks:
        runs[command], n = _noisy(body)
        moved += n
    assert moved > 100  # the perturbation reaches most figures of the README
    assert sum(runs[c] != body for c, body in blocks) >= len(blocks) // 2
    assert _check_with_runs(monkeypatch, capsys, runs) == (0, "")


def _another_count(body: str) -> str:
    """The first integer shown below the command line, plus one."""
    shown = body.partition("\n$ ")[2].partition("\n")[2]
    m = next(m for m in noise_match.NUMBER.finditer(shown) if not any(c in m.group() for c in ".e"))
    return body.replace(shown, shown[: m.start()] + str(int(m.group()) + 1) + shown[m.end() :], 1)


def _another_figure(body: str) -> str:
    """The first figure with a decimal point moved by three units in its last digit."""
    m = next(m for m in noise_match.NUMBER.finditer(body) if "." in m.group() and "e" not in m.group())
    decimals = len(m.group().partition(".")[2])
    moved = f"{float(m.group()) + 3 * 10.0**-decimals:.{decimals}f}"
    return body[: m.start()] + moved + body[m.end() :]


def _another_finding(body: str) -> str:
    """The first rule code shown replaced by another."""
    code = re.search(r"BN(\d{3})", body)
    assert code is not None
    return body.replace(code.group(), f"BN{(int(code.group(1)) % 114) + 1:03d}", 1)


@pytest.mark.parametrize("change", [_another_count, _another_figure, _another_finding])
def test_the_readme_check_fails_on_a_real_change(monkeypatch, capsys, change):
    blocks = readme_examples.examples(README_TEXT)
    target = next(
        c for c, body in blocks if change is not _another_finding or re.search(r"BN\d{3}", body.partition("\n")[2])
    )
    runs = {c: change(body) if c == target else body for c, body in blocks}
    assert runs[target] != dict(blocks)[target]
    code, err = _check_with_runs(monkeypatch, capsys, runs)
    assert code == 1
    assert f"example {target}\nline " in err and "example output differs from a run" in err


def test_noise_printed_as_a_number_is_not_its_floor():
    # a value the program marks as below its floor prints identically everywhere; a number
    # there instead is a change of what the program says, not noise
    assert noise_match.difference("in batch (8) │ <1.5e-05 │ 0", "in batch (8) │ 3.8e-07 │ 0")
    assert noise_match.difference("in batch (8) │ <1.5e-05 │ 0", "in batch (8) │ <1.5e-05 │ 0") is None


# ------------------------------------------------------------- real runs, perturbed kernels

# sitecustomize of the perturbed runs: every float32 conv and linear output moved by up to
# one ulp, independently per call, as another CPU's summation order moves it
PERTURB = """
import torch
import torch.nn.functional as F

_g = torch.Generator().manual_seed(20)


def _perturbed(op):
    def run(*args, **kwargs):
        out = op(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.dtype == torch.float32:
            ulps = torch.randint(-1, 2, out.shape, generator=_g).to(out.dtype)
            out = out + ulps * torch.finfo(torch.float32).eps * out.abs()
        return out

    return run


F.linear = _perturbed(F.linear)
F.conv2d = _perturbed(F.conv2d)
"""


def _json(command: str, env: dict[str, str]) -> dict:
    words = command.split()[1:]
    proc = subprocess.run(
        [sys.executable, "-m", "bnaudit", *words, "--format", "json"],
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    return json.loads(proc.stdout)


@pytest.mark.slow
def test_examples_print_the_same_with_perturbed_kernel_noise(tmp_path, monkeypatch):
    (tmp_path / "sitecustomize.py").write_text(PERTURB)
    noisy = os.pathsep.join([str(tmp_path), REPO, os.environ.get("PYTHONPATH", "")])
    for command in (HEALTHY_INVARIANCE, TRAINING_EXPORT_PARITY, HEALTHY_EXPORT_PARITY):
        shown = readme_examples.run_example(command)
        with monkeypatch.context() as m:
            m.setenv("PYTHONPATH", noisy)
            run = readme_examples.run_example(command)
        assert noise_match.difference(shown, run) is None, command
        if command != TRAINING_EXPORT_PARITY:  # healthy: what is noise prints as its floor
            assert run == shown and re.search(r"<1(\.5)?e-05", run), command
    # the perturbation is real: the exact numbers (JSON) move, the verdict does not
    plain, perturbed = _json(HEALTHY_INVARIANCE, {}), _json(HEALTHY_INVARIANCE, {"PYTHONPATH": noisy})
    assert plain["verdict"] == perturbed["verdict"] == "invariant"
    assert plain["max_deviation"] != perturbed["max_deviation"]
    assert 0 < perturbed["max_deviation"] < perturbed["noise"]["screen"]


@pytest.mark.parametrize("name", sorted(p.stem for p in GOLDEN.glob("*.txt")))
def test_golden_files_compare_up_to_noise_only(name):
    expected = (GOLDEN / f"{name}.txt").read_text(encoding="utf-8")
    noisy, moved = _noisy(expected)
    assert noise_match.difference(expected, noisy) is None
    if moved:
        assert noise_match.difference(expected, _another_figure(expected))
    assert noise_match.difference(expected, expected.replace("\n", "\n ", 1))  # layout: a line indented
    assert noise_match.difference(expected, expected.rstrip("\n"))

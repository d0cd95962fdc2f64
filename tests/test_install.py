"""What `pip install bnaudit` installs, for real: a new virtual environment given exactly
bnaudit's declared requirements (pip resolves them from its index), with no torch.

There, inspect, diff, rules and fold's prediction print what they print beside torch (this
process's environment, running the checkout), byte for byte; the commands that build a
model end in one line naming the install for CPU and GPU machines, exit 2; and the
torch-free Python API works. typer and rich are held to this environment's releases (a
constraint, not a requirement): the comparison is about torch, not about their layouts.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, SAMPLES, package_copy, pip_cannot_download

pytestmark = pytest.mark.slow  # builds an environment and runs bnaudit in processes

# What reading the ONNX samples needs is the onnx extra, which this process has and the bare
# environment, by design, has not: the comparisons leave that folder out.
SAMPLE_PATHS = sorted(f"sample_models/{name}" for name in os.listdir(SAMPLES) if name not in ("onnx", "__pycache__"))
GAP = ["gap", "sample_models/immature.pt", "--arch", "sample_models/digits_net.py:digits_net"]
GAP += ["--data", "sample_models/data/digits_val.safetensors"]


@pytest.fixture(scope="module")
def bare(tmp_path_factory) -> str:
    """The bin folder of a new environment holding `pip install <this checkout>` and nothing else."""
    root = tmp_path_factory.mktemp("bare")
    reason = pip_cannot_download(root / "probe")
    if reason is not None:
        pytest.skip(reason)
    source = package_copy(root / "src")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    (root / "constraints.txt").write_text(
        "".join(f"{name}=={importlib.metadata.version(name)}\n" for name in ("typer", "rich"))
    )
    python = str(venv / "bin" / "python")
    installed = subprocess.run(
        [python, "-m", "pip", "install", "-q", "-c", str(root / "constraints.txt"), source],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr
    return str(venv / "bin")


def in_bare(bare: str, code: str, cwd: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [os.path.join(bare, "python"), "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def bnaudit_run(command: list[str], args: list[str]) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(COLUMNS="100", NO_COLOR="1", TERM="dumb")
    if command[0] == sys.executable:
        env["PYTHONPATH"] = REPO
    proc = subprocess.run([*command, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout, proc.stderr


def test_the_bare_install_holds_no_torch_and_declares_it_only_in_the_torch_extra(bare, tmp_path):
    probe = in_bare(
        bare,
        "import importlib.metadata as m, importlib.util as u, json\n"
        "print(json.dumps({'requires': m.requires('bnaudit'), 'torch': u.find_spec('torch') is not None,"
        " 'PIL': u.find_spec('PIL') is not None, 'bnaudit': u.find_spec('bnaudit').origin}))",
        cwd=str(tmp_path),
    )
    assert probe.returncode == 0, probe.stderr
    found = json.loads(probe.stdout)
    assert not found["torch"] and not found["PIL"]
    assert "site-packages" in found["bnaudit"]  # the installed copy, not the checkout
    requires = found["requires"]
    unconditional = [r for r in requires if ";" not in r]
    assert not [r for r in unconditional if r.lower().startswith(("torch", "pillow"))], unconditional
    assert {r.split(";")[0].strip() for r in requires if 'extra == "torch"' in r} == {"torch>=2.4", "pillow>=9"}
    assert any(r.startswith("typer") for r in unconditional)


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(["inspect", *SAMPLE_PATHS], id="inspect"),
        pytest.param(["inspect", *SAMPLE_PATHS, "--format", "json"], id="inspect-json"),
        pytest.param(["inspect", "-q", *SAMPLE_PATHS, "--format", "sarif", "--exit-zero"], id="inspect-sarif"),
        pytest.param(["diff", "sample_models/pretrained.safetensors", "sample_models/finetuned.pt"], id="diff"),
        pytest.param(
            ["diff", "sample_models/swa/live.pt", "sample_models/swa/swa.pt", "--format", "json"], id="diff-json"
        ),
        pytest.param(["rules"], id="rules"),
        pytest.param(["rules", "BN004"], id="rules-BN004"),
        pytest.param(["fold", "sample_models/inception_channel.safetensors"], id="fold"),
        pytest.param(["fold", "sample_models/dead_channel.safetensors", "--format", "json"], id="fold-json"),
    ],
)
def test_torch_free_commands_print_what_they_print_beside_torch(bare, args):
    without = bnaudit_run([os.path.join(bare, "bnaudit")], args)
    beside = bnaudit_run([sys.executable, "-m", "bnaudit"], args)
    assert without == beside
    assert without[1]  # a report, not an empty agreement


@pytest.mark.parametrize("fmt", ["table", "json"])
def test_a_command_that_builds_a_model_names_the_install_in_one_line(bare, fmt):
    code, stdout, stderr = bnaudit_run([os.path.join(bare, "bnaudit")], [*GAP, "--format", fmt])
    assert code == 2
    said = stderr if fmt == "table" else json.loads(stdout)["error"]
    if fmt == "table":
        assert stdout == "" and len(stderr.splitlines()) == 1
        said = said.removeprefix("bnaudit: error: ")
    else:
        assert stderr == ""
    assert said.startswith("torch is not installed")
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in said
    assert "https://pytorch.org/get-started/locally/" in said and 'pip install "bnaudit[torch]"' in said
    assert "Traceback" not in stdout + stderr


def test_the_torch_free_python_api_works_without_torch(bare, tmp_path):
    code = f"""
import sys
import bnaudit
report = bnaudit.inspect({os.path.join(SAMPLES, "reset_stats.pt")!r}, bnaudit.Config())
print(report.exit_code(), sorted({{f.code for f in report.findings}}))
diff = bnaudit.diff({os.path.join(SAMPLES, "pretrained.safetensors")!r}, {os.path.join(SAMPLES, "finetuned.pt")!r})
print(diff.exit_code())
fold = bnaudit.predict_fold({os.path.join(SAMPLES, "dead_channel.safetensors")!r}, bnaudit.Config())
print(sorted({{f.code for f in fold.findings}}))
try:
    bnaudit.measure_gap
except ModuleNotFoundError as exc:
    print(exc.name, str(exc))
print("torch" in sys.modules)
"""
    done = in_bare(bare, code, cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[:3] == ["1 ['BN002']", "1", "['BN202', 'BN206']"]
    assert lines[3].startswith("torch bnaudit.measure_gap: torch is not installed")
    assert lines[4] == "False"

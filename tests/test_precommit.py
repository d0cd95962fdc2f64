"""The pre-commit hooks for real: pre-commit clones a hook repository holding this repo's
`.pre-commit-hooks.yaml`, `git commit` runs the hook on the staged checkpoints, a broken
one blocks the commit with its findings printed, a healthy one goes through.

`bnaudit` is `language: python`: pre-commit pip-installs the hook repository (here a git
repository of this working tree's package files) into an environment of its own, which must
hold no torch. `bnaudit-system` is `language: system`: it runs the `bnaudit` on PATH, here a
two-line shim running this checkout (`python -m bnaudit` with the repo on PYTHONPATH), the
same code an installed bnaudit would be; pre-commit must then build no environment and
download nothing: the tests check that its cache holds no virtualenv.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import REPO, bn_entries, package_copy, pip_cannot_download, save_safetensors, save_torch

pytestmark = [
    pytest.mark.slow,  # git and the hook's bnaudit processes
    pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed"),
]


def healthy_state() -> dict[str, torch.Tensor]:
    # counter 5000 at momentum 0.1: the initial values weigh 0.9^5000 ~ 0, no BN003.
    return {**bn_entries("backbone.bn1", 8, counter=5000), **bn_entries("head.bn", 4, counter=5000)}


def reset_state() -> dict[str, torch.Tensor]:
    state = healthy_state()
    state["head.bn.running_mean"] = torch.zeros(4)
    state["head.bn.running_var"] = torch.ones(4)  # BN002: statistics reset, weights trained
    return state


@pytest.fixture
def env(tmp_path, bare_env):
    """An environment whose `bnaudit` is this checkout, with git and pre-commit isolated."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "bnaudit"
    shim.write_text(f'#!/bin/sh\nPYTHONPATH="{REPO}" exec "{sys.executable}" -m bnaudit "$@"\n')
    shim.chmod(0o755)
    return {**bare_env, "PATH": f"{bin_dir}{os.pathsep}{bare_env['PATH']}"}


@pytest.fixture
def bare_env(tmp_path):
    """git and pre-commit isolated, and no `bnaudit` of this checkout on PATH or PYTHONPATH."""
    (tmp_path / "gitconfig").write_text("")
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("GIT_", "PRE_COMMIT"))}
    path = environ.get("PATH", "").split(os.pathsep)
    environ.update(
        {
            "PATH": os.pathsep.join(d for d in path if d and not os.path.exists(os.path.join(d, "bnaudit"))),
            "PRE_COMMIT_HOME": str(tmp_path / "pre-commit-cache"),
            "GIT_CONFIG_GLOBAL": str(tmp_path / "gitconfig"),
            "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_AUTHOR_NAME": "t",
            "GIT_AUTHOR_EMAIL": "t@example.com",
            "GIT_COMMITTER_NAME": "t",
            "GIT_COMMITTER_EMAIL": "t@example.com",
            "COLUMNS": "120",
        }
    )
    environ.pop("PYTHONPATH", None)
    return environ


def run(args: list[str], cwd, env) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def git(cwd, env, *args: str) -> subprocess.CompletedProcess:
    proc = run(["git", *args], cwd, env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def commit_count(project, env) -> int:
    return int(git(project, env, "rev-list", "--count", "HEAD").stdout)


def hook_repository(path, env, package: bool = False) -> str:
    """A git repository at `path` holding this repo's `.pre-commit-hooks.yaml` (and with
    `package`, what pip installs bnaudit from): its commit, for `rev:`."""
    path.mkdir()
    if package:
        package_copy(path)
    shutil.copy(os.path.join(REPO, ".pre-commit-hooks.yaml"), path / ".pre-commit-hooks.yaml")
    git(path, env, "init", "-q")
    git(path, env, "add", "-A")
    git(path, env, "commit", "-q", "-m", "hooks")
    return git(path, env, "rev-parse", "HEAD").stdout.strip()


def project_using(path, env, hooks, rev: str, hook_id: str):
    """A git repository at `path` whose .pre-commit-config.yaml uses `hook_id` of `hooks`, installed."""
    (path / "models").mkdir(parents=True)
    git(path, env, "init", "-q")
    (path / ".pre-commit-config.yaml").write_text(
        f"repos:\n  - repo: {hooks}\n    rev: {rev}\n    hooks:\n      - id: {hook_id}\n"
    )
    installed = run([sys.executable, "-m", "pre_commit", "install"], path, env)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    git(path, env, "add", ".pre-commit-config.yaml")
    git(path, env, "commit", "-q", "-m", "pre-commit config")  # no checkpoint: hook skipped
    return path


@pytest.fixture
def project(tmp_path, env):
    """A git repository using this repo's `bnaudit-system` hook, installed."""
    hooks = tmp_path / "hook-repo"
    rev = hook_repository(hooks, env)
    return project_using(tmp_path / "project", env, hooks, rev, "bnaudit-system")


def test_hook_blocks_a_broken_checkpoint_and_passes_healthy_ones(project, env, tmp_path):
    save_safetensors(healthy_state(), project / "models" / "healthy.safetensors")
    (project / "notes.txt").write_text("not a checkpoint: the hook's file pattern skips it\n")
    git(project, env, "add", "-A")
    ok = run(["git", "commit", "-m", "healthy"], project, env)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "bnaudit (BatchNorm statistics of checkpoints)...." in ok.stderr and "Passed" in ok.stderr
    assert commit_count(project, env) == 2

    save_torch(reset_state(), project / "models" / "finetuned.pt")
    save_safetensors(healthy_state(), project / "models" / "other.SAFETENSORS")
    git(project, env, "add", "-A")
    blocked = run(["git", "commit", "-m", "broken"], project, env)
    output = blocked.stdout + blocked.stderr
    assert blocked.returncode != 0, output
    assert "Failed" in output and "exit code: 1" in output
    assert "models/finetuned.pt" in output and "BN002 initial-values" in output and "head.bn" in output
    # both staged checkpoints (the suffix matched in any case) went to one bnaudit call
    assert "2 files, 4 BN layers: 1 error, 0 warnings, 0 infos" in output
    assert commit_count(project, env) == 2  # the commit did not happen

    # pre-commit cloned the hook repository and built no environment for it
    cache = tmp_path / "pre-commit-cache"
    assert cache.is_dir()
    assert not [p for p in cache.rglob("*") if p.name.startswith("py_env") or p.name == "pyvenv.cfg"]


def test_hook_honours_the_projects_configuration(project, env):
    save_torch(reset_state(), project / "models" / "finetuned.pt")
    (project / "pyproject.toml").write_text('[tool.bnaudit]\nper-layer-ignores = {"head.*" = ["BN002"]}\n')
    git(project, env, "add", "-A")
    ok = run(["git", "commit", "-m", "reset head, ignored by configuration"], project, env)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert commit_count(project, env) == 2

    (project / "pyproject.toml").write_text("[tool.bnaudit]\nmax-gain = -1\n")
    save_safetensors(healthy_state(), project / "models" / "healthy.safetensors")
    git(project, env, "add", "-A")
    bad = run(["git", "commit", "-m", "bad configuration"], project, env)
    output = bad.stdout + bad.stderr
    assert bad.returncode != 0
    assert "pyproject.toml [tool.bnaudit]: max-gain: expected a positive number, got -1" in output
    assert "exit code: 2" in output


def test_quiet_hook_names_the_file_layer_and_rule_that_failed(project, env):
    config = (project / ".pre-commit-config.yaml").read_text()
    (project / ".pre-commit-config.yaml").write_text(config + "        args: [-q]\n")
    git(project, env, "add", ".pre-commit-config.yaml")
    git(project, env, "commit", "-q", "-m", "quiet hook")
    save_torch(reset_state(), project / "models" / "finetuned.pt")
    save_safetensors(healthy_state(), project / "models" / "healthy.safetensors")
    git(project, env, "add", "-A")
    blocked = run(["git", "commit", "-m", "broken"], project, env)
    output = blocked.stdout + blocked.stderr
    assert blocked.returncode != 0, output
    lines = output.splitlines()
    (finding,) = [line for line in lines if "BN002" in line]
    assert finding.startswith("models/finetuned.pt: head.bn: BN002 initial-values: running_mean is 0")
    assert "2 files, 4 BN layers: 1 error, 0 warnings, 0 infos" in lines
    assert not any("┃" in line for line in lines)  # no tables with -q
    assert commit_count(project, env) == 2  # the config commit only: the broken one was blocked


def test_hook_commits_a_trainer_folder_with_a_sharded_model(project, env):
    """Issue #12: a training-run folder (shards split a BN layer, optimizer / scheduler / RNG
    state next to them) is committed: one checkpoint audited through its staged index, the
    rest skipped, nothing blocks; a broken index does block."""
    import json
    import random

    import numpy as np

    folder = project / "models" / "checkpoint-500"
    folder.mkdir()
    state = healthy_state()
    names = list(state)
    cut = names.index("backbone.bn1.running_var")  # backbone.bn1 split across the two shards
    weight_map = {}
    for k, part in enumerate((names[:cut], names[cut:])):
        shard = f"model-{k + 1:05d}-of-00002.safetensors"
        save_safetensors({n: state[n] for n in part}, folder / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())}}
    index["weight_map"] = weight_map
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    params = [torch.nn.Parameter(torch.randn(4))]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    params[0].sum().backward()
    optimizer.step()
    save_torch(optimizer.state_dict(), folder / "optimizer.pt")
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    save_torch(rng, folder / "rng_state.pth")
    git(project, env, "add", "-A")
    ok = run(["git", "commit", "-m", "checkpoint-500"], project, env)
    output = ok.stdout + ok.stderr
    assert ok.returncode == 0, output
    assert commit_count(project, env) == 2
    # what the hook saw: the index (standing for both shards) and the two skipped files
    verbose = run([sys.executable, "-m", "pre_commit", "run", "--all-files", "--verbose"], project, env)
    assert verbose.returncode == 0, verbose.stdout + verbose.stderr
    summary = "3 files, 2 BN layers: 0 errors, 0 warnings, 0 infos, 2 skipped (not model weights)"
    assert summary in verbose.stdout and "model-00001-of-00002" not in verbose.stdout

    index["weight_map"]["head.bn.weight"] = "../../elsewhere.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    git(project, env, "add", "-A")
    blocked = run(["git", "commit", "-m", "broken index"], project, env)
    output = blocked.stdout + blocked.stderr
    assert blocked.returncode != 0 and "exit code: 2" in output
    assert "leaves the index's folder ('..')" in output
    assert commit_count(project, env) == 2


def test_python_hook_builds_its_environment_without_torch_and_blocks_a_broken_checkpoint(tmp_path, bare_env):
    """The default hook, `language: python`: pre-commit pip-installs bnaudit from the hook
    repository into an environment of its own, without torch, and that bnaudit decides."""
    reason = pip_cannot_download(tmp_path / "probe")
    if reason is not None:
        pytest.skip(reason)
    env = bare_env
    hooks = tmp_path / "hook-repo"
    rev = hook_repository(hooks, env, package=True)
    project = project_using(tmp_path / "project", env, hooks, rev, "bnaudit")

    save_safetensors(healthy_state(), project / "models" / "healthy.safetensors")
    git(project, env, "add", "-A")
    ok = run(["git", "commit", "-m", "healthy"], project, env)  # builds the hook's environment
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "bnaudit (BatchNorm statistics of checkpoints)...." in ok.stderr and "Passed" in ok.stderr
    assert commit_count(project, env) == 2

    save_torch(reset_state(), project / "models" / "finetuned.pt")
    git(project, env, "add", "-A")
    blocked = run(["git", "commit", "-m", "broken"], project, env)
    output = blocked.stdout + blocked.stderr
    assert blocked.returncode != 0, output
    assert "Failed" in output and "exit code: 1" in output and "BN002 initial-values" in output
    assert commit_count(project, env) == 2  # the commit did not happen

    # the same hook through `pre-commit try-repo`, on the staged file alone
    tried = run([sys.executable, "-m", "pre_commit", "try-repo", str(hooks), "bnaudit", "--ref", rev], project, env)
    output = tried.stdout + tried.stderr
    assert tried.returncode == 1, output
    assert "models/finetuned.pt" in output and "head.bn" in output and "BN002 initial-values" in output
    assert "1 file, 2 BN layers: 1 error, 0 warnings, 0 infos" in output, output

    # one environment, built from the hook repository: bnaudit in it, torch not
    (python,) = (tmp_path / "pre-commit-cache").glob("repo*/py_env-*/bin/python")
    probe = run(
        [
            str(python),
            "-c",
            "import importlib.util as u; print(u.find_spec('torch') is None, u.find_spec('bnaudit').origin)",
        ],
        tmp_path,
        env,
    )
    no_torch, origin = probe.stdout.split()
    assert no_torch == "True" and str(tmp_path / "pre-commit-cache") in origin, probe.stdout + probe.stderr

"""The README's example outputs are what the commands print (tools/readme_examples.py),
up to float noise (tools/noise_match.py; tests/test_noise.py perturbs it)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "tools"))

import readme_examples

with open(readme_examples.README, encoding="utf-8") as _fh:
    EXAMPLES = readme_examples.examples(_fh.read())


def test_the_readme_has_examples_at_a_stated_width():
    assert len(EXAMPLES) >= 3
    assert any(command.startswith("COLUMNS=80 ") for command, _ in EXAMPLES)


@pytest.mark.slow
def test_readme_examples_are_real_runs():
    # once, as CI and a contributor run it: every example in order (later ones read what
    # earlier ones wrote), each block compared with its run up to float noise
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "readme_examples.py"), "--check"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    assert proc.returncode == 0, f"{proc.stderr}\nrun python tools/readme_examples.py"
    assert f"{len(EXAMPLES)} examples are current" in proc.stdout


@pytest.mark.slow
def test_a_stale_example_is_rewritten():
    command, shown = EXAMPLES[0]
    stale = f"<!-- begin example {command} -->\n{shown.replace('BN', 'XX', 1)}<!-- end example -->"
    assert readme_examples.update(stale) == f"<!-- begin example {command} -->\n{shown}<!-- end example -->"

"""The example outputs of README.md and docs/ are what the commands print
(tools/readme_examples.py), up to float noise (tools/noise_match.py; tests/test_noise.py perturbs it)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "tools"))

import readme_examples


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as fh:
        return fh.read()


EXAMPLES = [example for path in readme_examples.documents() for example in readme_examples.examples(_read(path))]


def test_the_readme_and_docs_have_examples_at_a_stated_width():
    assert len(readme_examples.examples(_read(readme_examples.README))) >= 3
    assert any(command.startswith("COLUMNS=80 ") for command, _ in EXAMPLES)


def test_every_markdown_file_of_docs_is_scanned():
    scanned = {os.path.relpath(path, REPO) for path in readme_examples.documents()}
    on_disk = {
        os.path.relpath(os.path.join(folder, name), REPO)
        for folder, _, names in os.walk(os.path.join(REPO, "docs"))
        for name in names
        if name.endswith(".md")
    }
    assert "README.md" in scanned and on_disk and on_disk <= scanned
    # the sections that moved to docs/ keep their examples
    assert any("docs/commands/" in os.path.relpath(p, REPO) and readme_examples.examples(_read(p)) for p in scanned)


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
    current = re.findall(r": (\d+) examples are current$", proc.stdout, flags=re.M)
    assert sum(int(n) for n in current) == len(EXAMPLES), proc.stdout


@pytest.mark.slow
def test_a_stale_example_is_rewritten():
    command, shown = EXAMPLES[0]
    stale = f"<!-- begin example {command} -->\n{shown.replace('BN', 'XX', 1)}<!-- end example -->"
    assert readme_examples.update(stale) == f"<!-- begin example {command} -->\n{shown}<!-- end example -->"

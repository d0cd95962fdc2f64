"""The README's example outputs are what the commands print (tools/readme_examples.py)."""

from __future__ import annotations

import os
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


@pytest.mark.parametrize("command, shown", EXAMPLES, ids=[c for c, _ in EXAMPLES])
def test_readme_example_output_is_a_real_run(command, shown):
    for earlier in readme_examples.prerequisites(command, [c for c, _ in EXAMPLES]):
        readme_examples.run_example(earlier)  # writes the file this example reads
    assert shown == readme_examples.run_example(command), (
        "README.md shows other output than a run gives; run python tools/readme_examples.py"
    )


def test_a_stale_example_is_rewritten():
    command, shown = EXAMPLES[0]
    stale = f"<!-- begin example {command} -->\n{shown.replace('BN', 'XX', 1)}<!-- end example -->"
    assert readme_examples.update(stale) == f"<!-- begin example {command} -->\n{shown}<!-- end example -->"

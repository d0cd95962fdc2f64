"""The documentation: README.md is a front page, docs/ holds the rest; the generated parts
(rule pages, the configuration table) match the code, and every relative link resolves.

`python tools/update_docs.py` rewrites the generated parts, `--check` only compares."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "tools"))

import update_docs

from bnaudit.audit.ruledocs import GENERATED
from bnaudit.audit.rules import RULES

pytestmark = pytest.mark.torchfree  # runs without torch (conftest.py)

SCRIPT = os.path.join(REPO, "tools", "update_docs.py")


def read(path: str) -> str:
    with open(os.path.join(REPO, path), encoding="utf-8") as fh:
        return fh.read()


@pytest.fixture
def checkout(tmp_path):
    """A copy of README.md, docs/, LICENSE and sample_models/ (links point into them)."""
    for name in ("README.md", "LICENSE"):
        shutil.copy(os.path.join(REPO, name), tmp_path / name)
    shutil.copytree(os.path.join(REPO, "docs"), tmp_path / "docs")
    return tmp_path


def check(repo) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, SCRIPT, "--check", "--repo", str(repo)], capture_output=True, text=True)


def test_generated_docs_are_up_to_date():
    assert update_docs.missing_blocks() == [], "a generated block is missing from the docs"
    assert update_docs.stale() == {}, "docs are stale: run python tools/update_docs.py"


def test_every_rule_has_a_page_and_every_page_a_rule():
    pages = {name[:-3] for name in os.listdir(os.path.join(REPO, "docs", "rules")) if name.endswith(".md")}
    assert pages == {*RULES, "index"}
    index = read("docs/rules/index.md")
    for code in RULES:
        assert f"| [{code}]({code}.md) |" in index
        assert read(f"docs/rules/{code}.md").splitlines()[1] == f"# {code} {RULES[code].name}"


def test_rule_examples_name_real_rules_and_show_them():
    assert set(update_docs.RULE_EXAMPLES) <= set(RULES)
    for code, command in update_docs.RULE_EXAMPLES.items():
        page = read(f"docs/rules/{code}.md")
        shown = page[page.index(f"<!-- begin example {command} -->") : page.index("<!-- end example -->")]
        assert f"{code} {RULES[code].name}" in shown, code  # the run reports the rule


def test_check_reports_a_stale_page_a_missing_page_and_a_page_of_no_rule(checkout):
    assert check(checkout).returncode == 0
    page = checkout / "docs" / "rules" / "BN002.md"
    page.write_text(
        page.read_text(encoding="utf-8").replace("# BN002 initial-values", "# BN002 old-name"), encoding="utf-8"
    )
    (checkout / "docs" / "rules" / "BN003.md").unlink()
    (checkout / "docs" / "rules" / "BN999.md").write_text("# BN999 gone\n", encoding="utf-8")
    result = check(checkout)
    assert result.returncode == 1
    assert "docs/rules/BN002.md: out of date" in result.stderr
    assert "docs/rules/BN003.md: out of date" in result.stderr
    assert "docs/rules/BN999.md: no rule has this code" in result.stderr
    fix = subprocess.run([sys.executable, SCRIPT, "--repo", str(checkout)], capture_output=True, text=True)
    assert fix.returncode == 0, fix.stderr
    assert not (checkout / "docs" / "rules" / "BN999.md").exists()
    assert page.read_text(encoding="utf-8") == read("docs/rules/BN002.md")  # example output kept
    assert check(checkout).returncode == 0


def test_check_reports_a_stale_configuration_table(checkout):
    path = checkout / "docs" / "configuration.md"
    path.write_text(path.read_text(encoding="utf-8").replace("| `max-gain` | `100.0` |", "| `max-gain` | `50.0` |"))
    result = check(checkout)
    assert result.returncode == 1 and "docs/configuration.md: out of date" in result.stderr
    subprocess.run([sys.executable, SCRIPT, "--repo", str(checkout)], check=True, capture_output=True)
    assert path.read_text(encoding="utf-8") == read("docs/configuration.md")
    assert set(GENERATED) <= set(update_docs.generated_blocks(path.read_text(encoding="utf-8")))


def test_every_relative_link_resolves():
    assert update_docs.broken_links() == []


def test_a_broken_link_or_anchor_is_reported(checkout):
    readme = checkout / "README.md"
    text = readme.read_text(encoding="utf-8")
    readme.write_text(text + "\n[gone](docs/nowhere.md) [bad](docs/commands/gap.md#no-such-section)\n")
    gap = checkout / "docs" / "commands" / "gap.md"
    gap.write_text(gap.read_text(encoding="utf-8") + "\nsee [above](#which-channel-and-where-the-drift-start)\n")
    assert update_docs.broken_links(str(checkout)) == [
        "README.md: docs/nowhere.md: no such file",
        "README.md: docs/commands/gap.md#no-such-section: no such anchor",
        "docs/commands/gap.md: #which-channel-and-where-the-drift-start: no such anchor",
    ]
    result = check(checkout)
    assert result.returncode == 1 and "docs/nowhere.md: no such file" in result.stderr


def test_anchors_are_githubs():
    text = "# bnaudit gap\n## The model (`--arch`, TorchScript)\n```\n# not a heading\n```\n## The numbers\n## The numbers\n"
    assert update_docs.anchors(text) == {"bnaudit-gap", "the-model---arch-torchscript", "the-numbers", "the-numbers-1"}


def test_readme_is_a_front_page():
    text = read("README.md")
    assert len(text.splitlines()) < 600  # a front page: the budget the issue of merge and fed set
    # the Quickstart's install advice: torch for the machine first, PyPI's Linux wheel is CUDA
    quickstart = text[text.index("## Quickstart") : text.index("## The commands")]
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in quickstart
    assert "CUDA build" in quickstart
    assert "pip install -e . && bnaudit inspect sample_models/ --exit-zero" in quickstart
    assert 'pip install -e ".[torch,test]" && python -m pytest -q' in quickstart
    assert "python -m pytest -q -m 'torchfree and not slow'" in quickstart  # the tier CI runs without torch
    # the test command is the one CI runs
    assert re.search(r"^python -m pytest -q$", read(".ci/run"), re.MULTILINE)
    # one real example per command, and a link to its reference page
    for command in ("inspect", "gap", "invariance", "recalibrate", "merge", "diff", "fed", "rules"):
        assert re.search(rf"<!-- begin example (\S+=\S+ )*bnaudit {command} ", text), command
        assert f"](docs/commands/{command}.md)" in text, command
    assert "## Development" in text


@pytest.mark.parametrize("path", update_docs.documents())
def test_user_docs_carry_no_internal_notes(path):
    text = read(path)
    for pattern in (
        r"\bissues? \d",
        r"(?<![\w/&])#\d{1,3}\b",
        r"\bthis session\b",
        r"\bthis change\b",
        r"\bwas lent\b",
    ):
        assert not re.search(pattern, text, re.IGNORECASE), (path, pattern)


# Every bound a reader enforces on what a file claims (issue #32): the constant, its value,
# and the words that state it in docs/security.md. A bound changed in the code, or in the
# document, without the other fails here.
SECURITY_BOUNDS = [
    ("bnaudit.formats.allowed", "MAX_OBJECTS", 1 << 21, "at most 2^21 (2,097,152)"),
    ("bnaudit.formats.allowed", "MAX_KEY_NODES", 4096, "tuples of at most 4,096 nodes"),
    ("bnaudit.formats.model", "EXPANDED_LIMIT", 1 << 20, "at most 2^20 elements a tensor"),
    ("bnaudit.formats.allowed", "MAX_EXPANDED", 1 << 22, "and 2^22 a pickle"),
    ("bnaudit.formats.pickled", "_MAX_VISITS", 100_000, "at most 100,000 modules visited"),
    ("bnaudit.formats.torchscript", "_MAX_SCRIPT_VISITS", 100_000, "at most 100,000 modules visited"),
    ("bnaudit.formats.safetensors", "_MAX_HEADER", 100_000_000, "at most 100,000,000 bytes"),
    ("bnaudit.formats.safetensors", "_MAX_DEPTH", 127, "127 levels of JSON nesting"),
    ("bnaudit.formats.shards", "_MAX_INDEX_BYTES", 64 << 20, "at most 64 MiB"),
    ("bnaudit.formats.bnstats", "MAX_FILE_BYTES", 512 << 20, "size bounded (512 MiB)"),
    ("bnaudit.formats.onnx", "PROTOBUF_LIMIT", (2 << 30) - 1, "protobuf's 2 GiB"),
    ("bnaudit.formats.dcp", "_MAX_METADATA_BYTES", 1 << 30, "`.metadata` at most 1 GiB (2^30 bytes)"),
    ("bnaudit.formats.pt2archive", "_JSON_LIMIT", 512 << 20, "JSON record at most 512 MiB"),
    ("bnaudit.formats.peft", "_MAX_CONFIG_BYTES", 1 << 20, "`adapter_config.json` at most 1 MiB (2^20 bytes)"),
    ("bnaudit.formats.dcp", "_MAX_RECORD_BYTES", 10_000_000, "archive) at most 10,000,000 bytes"),
    ("bnaudit.formats.torchscript", "_MAX_RECORD_BYTES", 10_000_000, "archive) at most 10,000,000 bytes"),
    ("bnaudit.formats.provenance", "_MAX_RECORD", 10_000_000, "record at most 10,000,000 characters"),
    ("bnaudit.formats.hfcache", "_MAX_REF_BYTES", 256, "`refs/` file: its first 256 bytes"),
    ("bnaudit.normkinds", "_MAX_CALL_CHARS", 10_000, "scanned over at most 10,000 characters"),
]


@pytest.mark.parametrize(("module", "name", "value", "stated"), SECURITY_BOUNDS, ids=lambda x: str(x)[:40])
def test_security_doc_states_each_bound_the_readers_enforce(module, name, value, stated):
    import importlib

    assert getattr(importlib.import_module(module), name) == value
    assert stated in " ".join(read("docs/security.md").split())


def test_security_doc_states_the_bound_on_values_shown_in_messages():
    import inspect

    from bnaudit.text import shown_value

    defaults = {k: p.default for k, p in inspect.signature(shown_value).parameters.items() if k != "value"}
    assert defaults == {"limit": 80, "depth": 3}
    assert "| a value shown in a message | at most 80 characters, 3 levels deep |" in read("docs/security.md")

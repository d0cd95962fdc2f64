"""Rule documentation: `bnaudit rules`, `bnaudit rules CODE`, the rule pages of docs/rules/ and the
configuration table of docs/configuration.md all come from rules.RULES and config.KEYS and cannot drift."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys

import pytest
from conftest import REPO

from bnaudit.audit.ruledocs import generated_blocks
from bnaudit.audit.rules import RULES
from bnaudit.config import KEYS

pytestmark = pytest.mark.torchfree  # runs without torch (conftest.py)

DOCS = os.path.join(REPO, "docs")


def read_doc(path: str) -> str:
    with open(os.path.join(DOCS, path), encoding="utf-8") as fh:
        return fh.read()


def table_rows(markdown: str) -> list[list[str]]:
    rows = []
    for line in markdown.strip().splitlines()[2:]:
        cells = re.split(r"(?<!\\)\|", line.strip())[1:-1]
        rows.append([c.strip().replace("\\|", "|").replace("\\*", "*") for c in cells])
    return rows


def markdown_table(text: str) -> str:
    """The first Markdown table of a page."""
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("| "))
    return "\n".join(itertools.takewhile(lambda line: line.startswith("|"), lines[first:]))


def test_rule_index_lists_every_rule_as_registered():
    rows = table_rows(markdown_table(read_doc("rules/index.md")))
    assert rows == [
        [f"[{r.code}]({r.code}.md)", r.name, r.severity, f"`{r.command}`", r.summary] for r in RULES.values()
    ]


def test_config_table_lists_every_key():
    rows = table_rows(generated_blocks(read_doc("configuration.md"))["config-table"])
    assert [row[0] for row in rows] == [f"`{name}`" for name in KEYS]
    defaults = {row[0].strip("`"): row[1] for row in rows}
    assert defaults["fail-on"] == '`"warning"`' and defaults["max-gain"] == "`100.0`"
    assert defaults["eps"] == "`1e-05`" and defaults["momentum"] == "`0.1`" and defaults["select"] == "`[]`"


def test_rule_page_says_what_why_fix_and_configuration():
    page = read_doc("rules/BN004.md")
    flat = " ".join(page.replace("\\*", "*").split())
    rule = RULES["BN004"]
    assert page.splitlines()[1] == "# BN004 near-eps-variance"
    assert "Default severity: **error / warning / info**. Reported by `bnaudit inspect`." in page
    for title in ("What it checks", "Why it matters", "Example", "How to fix it", "Configuration"):
        assert f"\n## {title}\n" in page
    for text in (rule.summary, rule.explanation, rule.fix):
        assert " ".join(text.split()) in flat
    rows = table_rows(markdown_table(page[page.index("## Configuration") :]))
    assert [row[:2] for row in rows] == [
        ["`near-eps-factor`", "`10.0`"],
        ["`max-gain`", "`100.0`"],
        ["`max-live-gain`", "`100.0`"],
        ["`eps`", "`1e-05`"],
    ]
    assert "- for one run: bnaudit inspect --ignore BN004 ..." in page
    # the example is a real run (tools/readme_examples.py) that shows this rule
    assert "<!-- begin example bnaudit inspect -q sample_models/dead_channel.safetensors -->" in page
    assert "BN004 near-eps-variance: 1 channel with running_var < 10*eps" in page


def test_rules_lists_code_name_severity_and_summary(cli):
    result = cli("rules", width=400)
    assert result.exit_code == 0
    for rule in RULES.values():
        (line,) = [line for line in result.stdout.splitlines() if line.startswith(rule.code)]
        assert [c.strip() for c in line.split("│")] == [rule.code, rule.name, rule.severity, rule.summary]


def test_rules_code_explains_what_why_fix_and_silence(cli):
    result = cli("rules", "bn004", width=120)
    assert result.exit_code == 0
    out = result.stdout
    flat = " ".join(out.split())
    rule = RULES["BN004"]
    assert out.startswith("BN004 near-eps-variance\ndefault severity: error / warning / info\n")
    for title in ("What it detects", "Why it matters", "How to fix it", "How to silence it"):
        assert f"\n{title}\n" in out
    assert " ".join(rule.summary.split()) in flat and " ".join(rule.fix.split()) in flat
    assert "|gamma| / sqrt(var + eps): 1/sqrt(1e-5) = 316x" in flat  # the arithmetic
    assert "bnaudit inspect --ignore BN004" in flat
    assert 'ignore = ["BN004"] under [tool.bnaudit]' in flat
    assert 'per-layer-ignores = {"backbone.*" = ["BN004"]}' in flat
    assert "near-eps-factor = 10.0, max-gain = 100.0, max-live-gain = 100.0, eps = 1e-05" in flat
    # BN004 can be an error now (a live channel): re-rating it is the way to keep it from failing
    assert 'severity = {BN004 = "info"} under [tool.bnaudit]' in flat
    assert "a dead channel (its input always 0) has mean ~0 as well as var ~0" in flat  # the reasoning


def test_every_rule_has_an_explanation_and_names_real_settings(cli):
    for rule in RULES.values():
        assert set(rule.settings) <= set(KEYS), rule.code
        out = " ".join(cli("rules", rule.code).stdout.split())
        assert " ".join(rule.explanation.split()) in out
        assert f"--ignore {rule.code}" in out


def test_unknown_rule_is_one_line_and_exit_2(cli):
    result = cli("rules", "BN999")
    assert result.exit_code == 2
    assert result.stderr.strip() == f"bnaudit: error: unknown rule 'BN999' (known: {', '.join(RULES)})"


@pytest.mark.slow
def test_rules_command_does_not_import_torch():
    code = (
        "import sys\nfrom bnaudit.cli import main\nsys.argv = ['bnaudit', 'rules', 'BN003']\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\nprint('torch' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "False"

"""Two tiers: `pytest -q` runs the fast one, `pytest -q -m slow` the tests that start
bnaudit in processes of their own; CI (.ci/run) runs both."""

from __future__ import annotations

import ast
import itertools
import os
import re
import tomllib
from pathlib import Path

import pytest
from conftest import REPO

pytestmark = pytest.mark.torchfree  # runs without torch (conftest.py)

TESTS = Path(REPO) / "tests"


def test_pytest_runs_the_fast_tier_and_ci_runs_both():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as fh:
        options = tomllib.load(fh)["tool"]["pytest"]["ini_options"]
    assert options["addopts"] == "-m 'not slow'"
    assert any(marker.startswith("slow:") for marker in options["markers"])
    ci = Path(REPO, ".ci", "run").read_text(encoding="utf-8").splitlines()
    fast, slow = ci.index("python -m pytest -q"), ci.index("python -m pytest -q -m slow")
    assert fast < slow


def _starts_bnaudit(node: ast.AST) -> bool:
    """Whether `node`'s code starts bnaudit in a process: [..., "-m", "bnaudit", ...],
    shutil.which("bnaudit"), a torchrun launch (run_ranks) or a capped child (run_in_4_gib)."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.List):
            words = [e.value if isinstance(e, ast.Constant) else None for e in sub.elts]
            if any(a == "-m" and b == "bnaudit" for a, b in itertools.pairwise(words)):
                return True
        if isinstance(sub, ast.Call):
            name = ast.unparse(sub.func)
            if name in ("run_ranks", "run_in_4_gib") or (
                name == "shutil.which" and ast.unparse(sub.args[0]) == "'bnaudit'"
            ):
                return True
    return False


def _calls(node: ast.AST) -> set[str]:
    return {ast.unparse(sub.func) for sub in ast.walk(node) if isinstance(sub, ast.Call)}


def _marked_slow(decorators: list[ast.expr]) -> bool:
    return any("pytest.mark.slow" in ast.unparse(d) for d in decorators)


def test_every_test_that_starts_bnaudit_is_in_the_slow_tier():
    unmarked = []
    for path in sorted(TESTS.glob("test_*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        functions = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
        spawning = {f.name for f in functions if not f.name.startswith("test_") and _starts_bnaudit(f)}
        module_slow = any(
            isinstance(n, ast.Assign)
            and any(ast.unparse(t) == "pytestmark" for t in n.targets)
            and "pytest.mark.slow" in ast.unparse(n.value)
            for n in tree.body
        )
        for f in functions:
            if not f.name.startswith("test_") or module_slow or _marked_slow(f.decorator_list):
                continue
            # a fixture's processes count too: fixtures are looked up by argument name
            fixtures = {a.arg for a in f.args.args} & spawning
            if _starts_bnaudit(f) or _calls(f) & spawning or fixtures:
                unmarked.append(f"{path.name}::{f.name}")
    assert unmarked == []


def test_the_scan_sees_a_test_that_starts_bnaudit():
    code = (
        "def helper():\n    return subprocess.run([sys.executable, '-m', 'bnaudit', 'rules'])\n\n"
        "def test_a():\n    helper()\n\n"
        "@pytest.mark.slow\ndef test_b():\n    helper()\n"
    )
    tree = ast.parse(code)
    helper, test_a, test_b = tree.body
    assert _starts_bnaudit(helper) and not _starts_bnaudit(test_a)
    assert "helper" in _calls(test_a)
    assert _marked_slow(test_b.decorator_list) and not _marked_slow(test_a.decorator_list)


# What a module of the torch-free tier may not import at its top: it is collected where only
# bnaudit's own requirements and the test extra are installed.
NEEDS_TORCH = ("torch", "torchvision", "timm", "transformers", "lightning", "PIL", "safetensors.torch")


def torchfree_modules() -> list[Path]:
    return [p for p in sorted(TESTS.glob("test_*.py")) if "pytestmark = pytest.mark.torchfree" in p.read_text("utf-8")]


def top_level_imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module)
    return found


def test_modules_of_the_torchfree_tier_import_no_torch_when_collected():
    tier = {p.stem for p in torchfree_modules()}
    assert {"test_sample_commands", "test_report", "test_safetensors_reference", "test_formulas"} <= tier
    wrong = {}
    for path in torchfree_modules():
        imported = top_level_imports(path)
        bad = {m for m in imported if m.split(".")[0] in NEEDS_TORCH[:-1] or m in NEEDS_TORCH}
        # a test module it imports is collected with it, so it must be of the tier too
        bad |= {m for m in imported if m.startswith("test_") and m not in tier}
        if bad:
            wrong[path.name] = sorted(bad)
    assert wrong == {}


def test_the_scan_sees_a_torch_import():
    assert "torch" in top_level_imports(TESTS / "test_torchfree.py")
    assert "torch" not in top_level_imports(TESTS / "test_sample_commands.py")


def test_the_pythons_the_readme_names_are_those_ci_runs():
    ci = Path(REPO, ".ci", "run").read_text(encoding="utf-8")
    others = re.search(r"^for version in ([0-9. ]+); do$", ci, re.MULTILINE).group(1).split()
    assert '"$py" -m pytest -q -m "torchfree and not slow"' in ci
    readme = Path(REPO, "README.md").read_text(encoding="utf-8")
    claimed = re.search(r"CI tests Python 3\.11 with torch and ([0-9., and]+) without it", readme).group(1)
    assert re.findall(r"3\.\d+", claimed) == others

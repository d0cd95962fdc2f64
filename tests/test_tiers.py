"""Two tiers: `pytest -q` runs the fast one, `pytest -q -m slow` the tests that start
bnaudit in processes of their own; CI (.ci/run) runs both."""

from __future__ import annotations

import ast
import itertools
import os
import tomllib
from pathlib import Path

from conftest import REPO

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

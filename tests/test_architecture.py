"""The package boundary and the import graph (issue #11), pinned so they cannot erode.

- `formats/`, `audit/` and `reports/` (and config, text, output) import neither torch nor numpy:
  `--help`, `rules` and `inspect` of a safetensors file run in pre-commit hooks. What
  the commands themselves load is checked end to end in tests/test_startup.py; this
  file checks the modules, all of them, including those no command reaches yet.
- No module reaches for another module's private (`_x`) name.
- The import graph, function-level imports included, has no cycle, and no import runs up a
  floor (FLOORS): formats/ never imports audit/, audit/ never runtime/ or the CLI.
"""

from __future__ import annotations

import ast
import json
import os
import sys
from pathlib import Path

from conftest import REPO, run_python

PACKAGE = Path(REPO) / "bnaudit"

# The floors of the package, lowest first. A module imports modules of a lower floor, or of
# its own unit (a package, or a module standing alone); never a unit beside it on its own
# floor (runtime/ and output/ know nothing of each other) nor one above. The bottom floor's
# small modules (and the package root: a version and a lazy map) may import each other.
FLOORS = [
    ("bnaudit", "bnaudit.errors", "bnaudit.text", "bnaudit.severity", "bnaudit.normkinds"),
    ("bnaudit.config",),
    ("bnaudit.formats",),
    ("bnaudit.audit",),
    ("bnaudit.reports",),
    ("bnaudit.runtime", "bnaudit.output"),
    ("bnaudit.api", "bnaudit.fastcli"),  # the entry points that compose both sides
    ("bnaudit.cli",),
    ("bnaudit.__main__",),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def runtime_nodes(tree: ast.AST):
    """Every node that executes at some point: all of the tree but `if TYPE_CHECKING:` bodies."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def absolute(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package(module) else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str) -> list[tuple[str, ast.AST]]:
    """(imported bnaudit module, node) for each import; `from a import b` with b a
    submodule counts as importing a.b."""
    tree = ast.parse(MODULES[module].read_text(), str(MODULES[module]))
    found: list[tuple[str, ast.AST]] = []
    for node in runtime_nodes(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node) for alias in node.names if alias.name.split(".")[0] == "bnaudit"]
        elif isinstance(node, ast.ImportFrom):
            source = absolute(module, node)
            if source.split(".")[0] != "bnaudit":
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                found.append((sub if sub in MODULES else source, node))
    return [(target, node) for target, node in found if target in MODULES and target != module]


def import_graph() -> dict[str, set[str]]:
    return {module: {target for target, _ in imports_of(module)} for module in MODULES}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle_through_function_level_imports(tmp_path):
    # The checker itself must be able to fail: a two-module cycle, one side lazy.
    graph = {"a": {"b"}, "b": set(), "c": {"a"}}
    assert find_cycle(graph) is None
    graph["b"] = {"c"}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    source = "def f():\n    from bnaudit.formats import model\n"
    tree = ast.parse(source)
    assert any(isinstance(n, ast.ImportFrom) for n in runtime_nodes(tree))
    guarded = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import bnaudit.cli\n")
    assert not any(isinstance(n, ast.Import) for n in runtime_nodes(guarded))


def test_the_import_graph_has_no_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def floor_of(module: str) -> tuple[int, str]:
    """(floor, unit) of a module: the longest FLOORS entry it is or lies under."""
    found = [
        (floor, unit)
        for floor, units in enumerate(FLOORS)
        for unit in units
        if module == unit or (unit != "bnaudit" and module.startswith(unit + "."))
    ]
    assert found, f"{module} is on no floor: add it to FLOORS"
    return max(found, key=lambda pair: len(pair[1]))


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, targets in sorted(graph.items()):
        floor, unit = floor_of(module)
        for target in sorted(targets):
            target_floor, target_unit = floor_of(target)
            if target_floor > floor or (target_floor == floor and target_unit != unit and floor > 0):
                bad.append(f"{module} -> {target}")
    return bad


def test_no_import_runs_up_a_floor():
    assert upward_imports(import_graph()) == []


def test_the_floor_check_sees_an_upward_and_a_sideways_import():
    graph = {
        "bnaudit.audit.layers": {"bnaudit.formats.model", "bnaudit.config"},
        "bnaudit.config": {"bnaudit.audit.settings"},
        "bnaudit.output.json": {"bnaudit.runtime.gap", "bnaudit.reports.gap"},
    }
    assert upward_imports(graph) == [
        "bnaudit.config -> bnaudit.audit.settings",
        "bnaudit.output.json -> bnaudit.runtime.gap",
    ]


def private_name_uses(module: str) -> list[str]:
    """`from bnaudit.x import _y`, and `m._y` / `bnaudit.x._y` where m names another
    bnaudit module. Dunder names (`__version__`) are public."""
    tree = ast.parse(MODULES[module].read_text())
    aliases: dict[str, str] = {}  # local name -> bnaudit module it is bound to
    found: list[str] = []

    def private(name: str) -> bool:
        return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))

    for node in runtime_nodes(tree):
        if isinstance(node, ast.ImportFrom):
            source = absolute(module, node)
            if source.split(".")[0] != "bnaudit":
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if sub in MODULES:
                    aliases[alias.asname or alias.name] = sub
                elif private(alias.name) and source != module:
                    found.append(f"{module}:{node.lineno} imports {source}.{alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "bnaudit":
                    aliases[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else "bnaudit"
    for node in runtime_nodes(tree):
        if isinstance(node, ast.Attribute) and private(node.attr):
            chain = [node.attr]
            base = node.value
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in aliases:
                target = ".".join([aliases[base.id], *reversed(chain[1:])])
                if target in MODULES and target != module:
                    found.append(f"{module}:{node.lineno} uses {target}.{node.attr}")
    return found


def test_the_private_name_scan_sees_both_spellings(tmp_path, monkeypatch):
    fake = tmp_path / "bnaudit" / "fake.py"
    fake.parent.mkdir()
    fake.write_text(
        "from bnaudit.formats.model import _typecode\nimport bnaudit.formats.model as m\n"
        "from bnaudit.formats import sniff\nm._ARRAY_CODES\nsniff._x\nm.__name__\n"
    )
    monkeypatch.setitem(MODULES, "bnaudit.fake", fake)
    found = private_name_uses("bnaudit.fake")
    assert sorted(f.split(" ", 1)[1] for f in found) == [
        "imports bnaudit.formats.model._typecode",
        "uses bnaudit.formats.model._ARRAY_CODES",
        "uses bnaudit.formats.sniff._x",
    ]


def test_no_module_uses_a_private_name_of_another():
    found = [use for module in MODULES for use in private_name_uses(module)]
    assert not found, found


TORCH_FREE = sorted(
    m
    for m in MODULES
    if m.startswith(("bnaudit.formats", "bnaudit.audit", "bnaudit.reports", "bnaudit.output"))
    or m in ("bnaudit", "bnaudit.config", "bnaudit.text", "bnaudit.errors", "bnaudit.normkinds", "bnaudit.severity")
)


def test_the_torch_free_side_imports_neither_torch_nor_numpy():
    # A fresh interpreter: this test process has long imported both.
    probe = (
        "import importlib, json, sys\n"
        "for name in json.loads(sys.argv[1]): importlib.import_module(name)\n"
        "print(json.dumps({m: m in sys.modules for m in ('torch', 'numpy')}))\n"
    )
    proc = run_python(probe, json.dumps(TORCH_FREE))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"torch": False, "numpy": False}


def test_the_probe_notices_a_module_that_imports_numpy():
    probe = "import importlib, sys\nimportlib.import_module('bnaudit.runtime.data')\nprint('numpy' in sys.modules)\n"
    proc = run_python(probe)
    assert proc.stdout.strip() == "True", proc.stderr


def test_help_imports_neither_torch_nor_numpy():
    # `rules` and `inspect` of a safetensors file are probed in tests/test_startup.py, and
    # `--help` there for torch and pydantic: this adds numpy for `--help`, with the same probe.
    from test_startup import run_probe

    code, loaded = run_probe("--help")
    assert code == 0
    assert not loaded["torch"] and not loaded["numpy"]


# --- packaging: what pyproject.toml declares matches the package ----------------------


def pyproject() -> dict:
    import tomllib

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def test_every_subpackage_is_installed():
    # A non-editable install ships what setuptools is told to: a subpackage left out
    # imports in the clone and fails in the wheel.
    from setuptools import find_packages

    packages = pyproject()["tool"]["setuptools"]["packages"]
    declared = set(find_packages(REPO, **packages["find"]) if isinstance(packages, dict) else packages)
    on_disk = {m for m in MODULES if is_package(m)}
    assert on_disk <= declared, sorted(on_disk - declared)


def test_declared_python_matches_the_readme_and_tomllib():
    # config.py reads TOML with tomllib (standard library from 3.11 on).
    import re

    floor = pyproject()["project"]["requires-python"]
    assert floor == ">=3.11"
    assert "import tomllib" in (PACKAGE / "config.py").read_text()
    readme = (Path(REPO) / "README.md").read_text()
    assert re.findall(r"Python (3\.\d+) or newer", readme) == ["3.11"]


def test_declared_dependencies_are_what_bnaudit_imports():
    # A runtime dependency bnaudit/ never imports is a download for nothing; one it
    # imports but does not declare breaks a fresh install. Packages of a user-facing optional
    # extra (`onnx`) may be imported too: inside the functions that need them, which say
    # which extra to install when they are absent.
    import re

    def dist(spec: str) -> str:
        return re.match(r"[A-Za-z0-9_.-]+", spec).group(0).lower()

    names = {dist(d) for d in pyproject()["project"]["dependencies"]}
    extras = pyproject()["project"]["optional-dependencies"]
    optional = {dist(d) for extra, specs in extras.items() if extra not in ("test", "lint") for d in specs}
    imported: set[str] = set()
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                imported.add(node.module.split(".")[0])
    distribution = {"PIL": "pillow"}
    third_party = {
        distribution.get(m, m).lower()
        for m in imported
        if m not in sys.stdlib_module_names and m not in ("bnaudit", "__future__")
    }
    assert third_party - optional == names

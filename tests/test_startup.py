"""Start-up: which heavy modules a command imports (never how long it takes).

`bnaudit --help`, `bnaudit rules` and `bnaudit inspect` of a safetensors file run in
pre-commit hooks on every commit: they must not import torch (seconds) nor, through
typer's option conversion, pydantic, nor numpy (its import alone costs half of the start-up budget). Each command runs in a fresh interpreter that
reports afterwards which modules it loaded; the wall time is judged by benchmarks/run.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import REPO, bn_entries, save_torch
from safetensors.numpy import save_file

from bnaudit import fastcli

# Runs the CLI like `python -m bnaudit ARGS`, then prints the loaded heavy modules.
PROBE = """
import json, runpy, sys
sys.argv = ["bnaudit", *json.loads(sys.argv[1])]
code = 0
try:
    runpy.run_module("bnaudit", run_name="__main__")
except SystemExit as exc:
    code = exc.code
sys.stdout.flush()
loaded = {name: name in sys.modules for name in ("torch", "pydantic", "numpy", "safetensors")}
print("PROBE" + json.dumps({"exit": code, "loaded": loaded}), file=sys.stderr)
"""


def fast_path_env(**extra: str) -> dict[str, str]:
    """The environment of a CLI run on the fast path (bnaudit.fastcli), whatever the caller's."""
    env = {k: v for k, v in os.environ.items() if k != "BNAUDIT_PLAIN_TYPER"}
    # The caller's PYTHONPATH stays behind the repo's: a run against another typer reaches it.
    path = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    return {**env, "PYTHONPATH": path, **extra}


def run_probe(*args: str, stdout: list[str] | None = None) -> tuple[int, dict[str, bool]]:
    env = fast_path_env()
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(list(args))],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=120,
        check=False,
    )
    line = next(x for x in proc.stderr.splitlines() if x.startswith("PROBE"))
    report = json.loads(line.removeprefix("PROBE"))
    if stdout is not None:
        stdout.append(proc.stdout)
    return report["exit"], report["loaded"]


@pytest.fixture
def numpy_safetensors(tmp_path) -> str:
    """A healthy BN layer written with safetensors' numpy API (no torch involved)."""
    path = str(tmp_path / "model.safetensors")
    save_file(
        {
            "bn.weight": np.ones(4, np.float32),
            "bn.bias": np.zeros(4, np.float32),
            "bn.running_mean": np.array([0.1, -0.2, 0.3, 0.0], np.float32),
            "bn.running_var": np.array([0.5, 1.5, 2.0, 0.8], np.float32),
            "bn.num_batches_tracked": np.array(5000, np.int64),
        },
        path,
    )
    return path


@pytest.mark.slow
def test_help_imports_neither_torch_nor_pydantic():
    code, loaded = run_probe("--help")
    assert code == 0
    assert not loaded["torch"] and not loaded["pydantic"]


@pytest.mark.slow
def test_inspect_safetensors_imports_neither_torch_nor_numpy_nor_pydantic(numpy_safetensors):
    out: list[str] = []
    code, loaded = run_probe("inspect", numpy_safetensors, "--format", "json", "--eps", "1e-5", stdout=out)
    assert code == 0
    (layer,) = json.loads(out[0])["files"][0]["layers"]  # the audit really ran, on the values
    assert layer["var"] == {"min": pytest.approx(0.5), "median": pytest.approx(1.15), "max": pytest.approx(2.0)}
    assert not loaded["torch"] and not loaded["numpy"] and not loaded["pydantic"]
    # the package itself stays out too: its safe_open imports numpy; formats/safetensors.py reads the header
    assert not loaded["safetensors"]


@pytest.mark.slow
def test_inspect_torchscript_does_not_import_torch(tmp_path):
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.BatchNorm2d(4)).eval()
    path = str(tmp_path / "scripted.pt")
    torch.jit.save(torch.jit.script(model), path)
    code, loaded = run_probe("inspect", path, "--exit-zero")
    assert code == 0
    assert not loaded["torch"]


@pytest.mark.slow
def test_inspect_of_a_file_that_is_no_checkpoint_does_not_import_torch(tmp_path):
    path = tmp_path / "notes.pt"
    path.write_text("not a checkpoint\n")
    code, loaded = run_probe("inspect", str(path))
    assert code == 2
    assert not loaded["torch"]


@pytest.mark.slow
def test_inspect_torch_save_file_imports_neither_torch_nor_numpy(tmp_path):
    # A torch.save zip is read by bnaudit's own unpickler (formats/torchsave.py); the probe's
    # counterpart, --trust-pickle importing torch, is in test_torchfree.py.
    path = save_torch(bn_entries("bn"), tmp_path / "model.pt")
    code, loaded = run_probe("inspect", path, "--exit-zero")
    assert code == 0
    assert not loaded["torch"] and not loaded["numpy"]


@pytest.mark.slow
@pytest.mark.parametrize("args", [("rules",), ("rules", "BN004")])
def test_rules_command_imports_neither_torch_nor_numpy(args):
    code, loaded = run_probe(*args)
    assert code == 0
    assert not loaded["torch"] and not loaded["numpy"] and not loaded["pydantic"]


# --- the pydantic-free option conversion keeps typer's results and messages ------------


@pytest.mark.parametrize("text", ["1e-3", "0.5", ".5", "2", "+3.0E+2", "7"])
def test_float_options_are_parsed_like_python_float(cli, numpy_safetensors, text):
    result = cli("inspect", numpy_safetensors, "--format", "json", "--eps", text)
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["config"]["eps"] == float(text)


def test_enum_option_value_selects_the_member(cli, numpy_safetensors):
    result = cli("inspect", numpy_safetensors, "-f", "json", "--fail-on", "info")
    assert json.loads(result.output)["config"]["fail-on"] == "info"


@pytest.mark.parametrize(
    "args, message",
    [
        (("--eps", "abc"), "Invalid value for '--eps': expected a number"),
        (("--format", "JSON"), "'JSON' is not one of 'table', 'json', 'sarif'"),
    ],
)
def test_values_neither_path_converts_are_refused_in_our_words(cli, numpy_safetensors, args, message):
    result = cli("inspect", numpy_safetensors, *args)
    assert result.exit_code == 2
    if not fastcli.typer_is_tested_version():
        return  # no fast path on this typer: typer words its messages per version
    assert message in result.output


@pytest.mark.parametrize("text, value", [("1_0", 10.0), (" 1e-3", 1e-3)])
def test_values_the_fast_path_declines_are_typers_to_convert(cli, numpy_safetensors, monkeypatch, text, value):
    fast = cli("inspect", numpy_safetensors, "--format", "json", "--eps", text)
    monkeypatch.setenv(fastcli.PLAIN_TYPER_ENV, "1")  # read when typer builds the command
    plain = cli("inspect", numpy_safetensors, "--format", "json", "--eps", text)
    assert fast.exit_code == plain.exit_code == 0, fast.output
    assert json.loads(fast.stdout)["config"]["eps"] == json.loads(plain.stdout)["config"]["eps"] == value


# --- the console prints names from files verbatim (markup off is also the faster path) --


def test_layer_names_that_look_like_markup_are_printed_verbatim(cli, tmp_path):
    path = str(tmp_path / "odd.safetensors")
    save_file(
        {
            f"{p}.{leaf}": value
            for p in ("bn[/x]", "head[bold]:smile:")
            for leaf, value in (
                ("running_mean", np.zeros(2, np.float32) + 0.3),
                ("running_var", np.ones(2, np.float32) * 0.6),
                ("num_batches_tracked", np.array(9000, np.int64)),
            )
        },
        path,
    )
    result = cli("inspect", path, width=160)
    assert result.exit_code == 0, result.output
    assert "bn[/x]" in result.output and "head[bold]:smile:" in result.output


# --- `main` builds only the command it runs; typer's whole group answers the same ------


@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [
        ("inspect", "{st}", "--format", "json"),
        ("inspect", "{st}", "--bogus"),
        ("inspect",),
        ("inspect", "--help"),
        ("rules", "BN004"),
        ("gap", "--help"),
        ("recalibrate", "{st}"),
        ("inspekt", "{st}"),
        ("--version",),
    ],
)
def test_main_answers_as_the_whole_typer_group(numpy_safetensors, args):
    args = [a.format(st=numpy_safetensors) for a in args]
    env = fast_path_env(COLUMNS="100")
    # the same entry point (one-line usage errors, exit codes) with typer's whole group
    whole = (
        "import sys; from bnaudit import cli, fastcli; sys.argv[0] = 'bnaudit'; "
        "fastcli.lean_group_supported = lambda app: False; cli.main()"
    )
    runs = [
        subprocess.run(
            [sys.executable, *launch, *args],
            capture_output=True,
            text=True,
            cwd=REPO,
            env=env,
            timeout=120,
            check=False,
        )
        for launch in (["-m", "bnaudit"], ["-c", whole])
    ]
    assert (runs[0].returncode, runs[0].stdout, runs[0].stderr) == (runs[1].returncode, runs[1].stdout, runs[1].stderr)
    assert runs[0].stdout or runs[0].stderr


# --- what the start-up budget's commands import: the pins of the cuts ------------------

# Runs the CLI like `python -m bnaudit ARGS` and names which of the modules given as its
# first argument were loaded. Imports nothing itself (not even json) that it could report.
MODULES_PROBE = """
import runpy, sys
wanted = sys.argv[1].split(",")
sys.argv = ["bnaudit", *sys.argv[2:]]
try:
    runpy.run_module("bnaudit", run_name="__main__")
except SystemExit:
    pass
sys.stdout.flush()
print("LOADED " + ",".join(m for m in wanted if m in sys.modules), file=sys.stderr)
"""

# Never needed by a command that reads no tensors through torch, numpy or the safetensors package.
HEAVY = ("torch", "numpy", "pydantic", "safetensors", "onnx", "onnxruntime", "bnaudit.runtime", "importlib.metadata")
# Not needed to list the commands: the audit, the renderers, configuration and JSON.
NOT_FOR_HELP = (
    "bnaudit.audit.checkpoint.inspect",
    "bnaudit.audit.rules",
    "bnaudit.formats",
    "bnaudit.output.table",
    "rich.console",
    "tomllib",
    "json",
    "matplotlib",
    "bnaudit.output.html",
)
# Not needed to inspect a safetensors file: the other readers, the diff and fold (the rules
# of `diff` and `fold` are registered without them), the other commands' CLI modules, JSON
# output, and the standard modules only some paths use (statistics brings decimal and
# fractions).
NOT_FOR_INSPECT = (
    "bnaudit.audit.diff.checkpoints",
    "bnaudit.audit.diff.layers",
    "bnaudit.audit.statistics",
    "bnaudit.audit.fold.check",
    "bnaudit.cli.measure",
    "bnaudit.cli.recalibrate",
    "bnaudit.cli.diff",
    "bnaudit.cli.fold",
    "bnaudit.formats.torchsave",
    "bnaudit.formats.torchscript",
    "bnaudit.formats.onnx",
    "bnaudit.output.json",
    "statistics",  # (decimal, fractions and random come with rich.table, which inspect draws with)
    "zipfile",
    "matplotlib",  # --format html's charts (the html extra), and its pages
    "bnaudit.output.html",
    "bnaudit.formats.atomic",  # no --output: nothing to check or write
)
# Not needed to list the rules: no checkpoint is read, nothing audited.
NOT_FOR_RULES = (
    "bnaudit.formats",
    "bnaudit.audit.layers",
    "bnaudit.audit.checkpoint.report",
    "bnaudit.audit.checkpoint.inspect",
    "bnaudit.audit.diff.layers",
    "bnaudit.audit.fold.check",
    "bnaudit.cli.measure",
    "bnaudit.cli.recalibrate",
    "bnaudit.cli.diff",
    "bnaudit.cli.fold",
    "json",
)


def loaded_modules(modules: tuple[str, ...], *args: str, cwd: str = REPO) -> set[str]:
    proc = subprocess.run(
        [sys.executable, "-c", MODULES_PROBE, ",".join(modules), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=fast_path_env(),
        timeout=120,
        check=False,
    )
    line = next(x for x in proc.stderr.splitlines() if x.startswith("LOADED "))
    return {m for m in line.removeprefix("LOADED ").split(",") if m}


@pytest.mark.slow
def test_the_modules_probe_sees_what_a_command_loads(numpy_safetensors):
    # the probe must be able to fail: inspect does load the audit and the table renderer
    assert loaded_modules(("bnaudit.audit.checkpoint.inspect", "rich.console"), "inspect", numpy_safetensors) == {
        "bnaudit.audit.checkpoint.inspect",
        "rich.console",
    }


@pytest.mark.slow
@pytest.mark.parametrize("args", [("--help",), (), ("--version",)])
def test_help_loads_none_of_the_modules_it_does_not_need(args):
    assert loaded_modules(HEAVY + NOT_FOR_HELP, *args) == set()


@pytest.mark.slow
def test_inspect_of_a_safetensors_file_loads_none_of_the_modules_it_does_not_need(numpy_safetensors):
    assert loaded_modules(HEAVY + NOT_FOR_INSPECT, "inspect", numpy_safetensors) == set()


@pytest.mark.slow
def test_inspect_loads_matplotlib_and_the_html_pages_only_for_format_html(numpy_safetensors, tmp_path):
    pytest.importorskip("matplotlib")
    wanted = ("matplotlib", "bnaudit.output.html", "bnaudit.formats.atomic")
    page = str(tmp_path / "page.html")
    assert loaded_modules(wanted, "inspect", numpy_safetensors, "--format", "html", "-o", page) == set(wanted)
    assert os.path.getsize(page) > 0
    assert loaded_modules(wanted, "inspect", numpy_safetensors, "--format", "json") == set()


@pytest.mark.slow
def test_rules_loads_none_of_the_modules_it_does_not_need():
    assert loaded_modules(HEAVY + NOT_FOR_RULES, "rules") == set()


@pytest.mark.slow
def test_a_pyproject_naming_bnaudit_outside_tool_is_not_parsed(numpy_safetensors, tmp_path):
    # a project that depends on bnaudit and runs it: no [tool.bnaudit], so no TOML parser
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "x"\ndependencies = ["bnaudit>=0.1"]\n\n[project.scripts]\nbnaudit = "bnaudit.cli:main"\n'
    )
    assert loaded_modules(("tomllib",), "inspect", numpy_safetensors, cwd=str(tmp_path)) == set()
    (tmp_path / "pyproject.toml").write_text("[tool.bnaudit]\nmax-gain = 50\n")  # the probe can fail
    assert loaded_modules(("tomllib",), "inspect", numpy_safetensors, cwd=str(tmp_path)) == {"tomllib"}

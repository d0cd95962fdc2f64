"""bnaudit's typer speed-up is its own, taken only on the typer it was written for, and changes no answer.

`bnaudit.fastcli` gives bnaudit's own commands a pydantic-free conversion of their plain
parameters (typer's `cls=`, nothing patched) and `bnaudit.cli.main` builds a group from
typer internals. On another typer, or with BNAUDIT_PLAIN_TYPER=1, both must step aside
and leave plain typer to answer: these tests force that path and compare it with the
fast one, change typer's version and internals in-process to see that the commands are
then plain typer's, and check that another typer app in the process is left as it is.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from typing import Any

import pytest
import typer
import typer.core
import typer.main
import typer.models
from conftest import REPO

import bnaudit
from bnaudit import cli, fastcli

pytestmark = pytest.mark.torchfree  # runs without torch (conftest.py)

# The in-process tests change the internals of the typer fastcli was written for; on any
# other typer there is nothing of that shape to change (the subprocess comparisons still run).
on_tested_typer = pytest.mark.skipif(
    not fastcli.typer_is_tested_version(),
    reason=f"typer {typer.__version__} is not {fastcli.TESTED_TYPER}: plain typer",
)

# --- the fast path and plain typer give the same answers -------------------------------


def cli_env(*, plain: bool) -> dict[str, str]:
    """The environment of a CLI run on the fast path, or forced to plain typer."""
    env = {k: v for k, v in os.environ.items() if k != fastcli.PLAIN_TYPER_ENV}
    # The caller's PYTHONPATH stays behind the repo's: a run against another typer reaches it.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    if plain:
        env[fastcli.PLAIN_TYPER_ENV] = "1"
    return env


def run_cli(args: list[str], *, plain: bool) -> tuple[int, str, str]:
    env = cli_env(plain=plain)
    env.update(COLUMNS="100", NO_COLOR="1")
    proc = subprocess.run(
        [sys.executable, "-m", "bnaudit", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=120,
        check=False,
    )
    return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["inspect", "--help"],
        ["rules"],
        ["rules", "BN004"],
        ["inspect", "sample_models/healthy.safetensors"],
        ["inspect", "sample_models/reset_stats.pt", "--format", "json"],
        ["inspect", "sample_models/healthy.safetensors", "--format", "json", "--eps", "1e-3", "--fail-on", "info"],
        ["inspect", "sample_models/healthy.safetensors", "--eps", "1_0", "--format", "json"],
        ["inspect", "--bogus", "x"],
        ["inspeect"],
        ["--version"],
        ["gap"],
        ["invariance"],
    ],
)
def test_fast_path_answers_as_plain_typer(args):
    fast, plain = run_cli(args, plain=False), run_cli(args, plain=True)
    assert fast == plain
    assert fast[1] or fast[2]


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, words",
    [
        (["--eps", "abc"], "--eps: expected a number"),
        (
            ["--format", "JSON"],
            "--format: 'JSON' is not one of 'table', 'json', 'sarif', 'github', 'gitlab', 'junit', 'markdown', 'html'",
        ),
    ],
)
def test_a_refused_value_is_one_line_naming_the_option_on_both_paths(args, words):
    # The fast path refuses in our words; plain typer in its own (pydantic's), after the option name.
    runs = {
        plain: run_cli(["inspect", "sample_models/healthy.safetensors", *args], plain=plain) for plain in (False, True)
    }
    option = words.split(":")[0]
    for code, out, err in runs.values():
        assert (code, out) == (2, "")
        assert len(err.splitlines()) == 1 and err.startswith(f"bnaudit: error: {option}: "), err
        assert err.rstrip().endswith("(see bnaudit inspect --help)")
    if fastcli.typer_is_tested_version():
        assert runs[False][2] == f"bnaudit: error: {words} (see bnaudit inspect --help)\n"


@pytest.mark.slow
@on_tested_typer
def test_forcing_plain_typer_really_takes_typers_own_conversion():
    # The counterpart of the comparison above: without this, both runs could be the fast
    # path and the comparison would prove nothing. Plain typer converts --eps through pydantic.
    probe = (
        "import runpy, sys; sys.argv = ['bnaudit', 'inspect', 'sample_models/healthy.safetensors', "
        "'--eps', '1e-5', '--exit-zero']\ntry: runpy.run_module('bnaudit', run_name='__main__')\n"
        "except SystemExit: pass\nprint('pydantic' in sys.modules, file=sys.stderr)"
    )
    seen = {}
    for plain in (False, True):
        proc = subprocess.run(
            [sys.executable, "-c", probe],
            capture_output=True,
            text=True,
            cwd=REPO,
            env=cli_env(plain=plain),
            timeout=120,
            check=False,
        )
        seen[plain] = proc.stderr.splitlines()[-1]
    assert seen == {False: "False", True: "True"}


# --- bnaudit's speed-up is its own: another typer app in the process is left as it is ----

FOREIGN_APP = """
import json, sys
if sys.argv[1] == "with bnaudit":
    import bnaudit.cli  # noqa: F401
import typer
from typer.testing import CliRunner

app = typer.Typer(add_completion=False)


@app.command()
def greet(names: list[str] = typer.Argument(..., metavar="NAMES..."), count: int = 1) -> None:
    print(count, *names)


env = {"COLUMNS": "100", "NO_COLOR": "1"}
runs = [CliRunner().invoke(app, args, env=env) for args in (["--help"], ["a", "--count", "x"], ["a", "--count", "3"])]
# typer's own conversion of --count goes through pydantic
print(json.dumps([[r.exit_code, r.output] for r in runs] + ["pydantic" in sys.modules]))
"""


def test_importing_bnaudit_cli_leaves_another_typer_app_as_it_is():
    seen = {}
    for mode in ("without", "with bnaudit"):
        proc = subprocess.run(
            [sys.executable, "-c", FOREIGN_APP, mode],
            capture_output=True,
            text=True,
            cwd=REPO,
            env=cli_env(plain=False),
            timeout=120,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr
        seen[mode] = json.loads(proc.stdout)
    assert seen["with bnaudit"] == seen["without"]
    (help_code, help_text), (bad_code, _), (ok_code, ok_text), pydantic = seen["without"]
    assert (help_code, bad_code, ok_code, ok_text, pydantic) == (0, 2, 0, "3 a\n", True)
    assert "NAMES..." in help_text


# --- bnaudit's commands take the fast path only on the typer it was written for ---------


@pytest.fixture
def pristine(monkeypatch):
    """typer as installed, fastcli not forced off (monkeypatched internals restored afterwards)."""
    monkeypatch.delenv(fastcli.PLAIN_TYPER_ENV, raising=False)
    return monkeypatch


def inspect_command() -> Any:
    """`bnaudit inspect` as typer builds it (FastCommand)."""
    return typer.main.get_command(cli.app).commands["inspect"]


def conversions(command: Any) -> dict[str, Any]:
    """Each parameter's preset conversion (None: typer builds its own when a value comes)."""
    return {p.name: p._runtime_param for p in command.params}


@on_tested_typer
def test_commands_convert_plain_parameters_themselves_without_patching_typer(pristine):
    import typer._coercion

    major, minor = fastcli.TESTED_TYPER
    assert typer.__version__.startswith(f"{major}.{minor}.")
    command = inspect_command()
    preset = conversions(command)
    assert preset["eps"] is not None and preset["paths"] is not None
    assert typer.core.build_runtime_param is typer._coercion.build_runtime_param  # nothing patched
    (paths,) = [p for p in command.params if p.name == "paths"]
    assert isinstance(paths, fastcli.MetavarArgument)


@on_tested_typer
def test_preset_conversion_gives_typers_values_without_pydantic(pristine):
    (eps,) = [p for p in inspect_command().params if p.name == "eps"]
    conversion = eps._runtime_param
    typers_own = typer.core.build_runtime_param(eps.type_descriptor)
    assert type(conversion) is not type(typers_own)  # not typer's pydantic adapter
    for text in ("+3.0E+2", "1e-3", ".5"):
        assert conversion._coerce_value(text, param=eps, ctx=None) == float(text)
        assert typers_own._coerce_value(text, param=eps, ctx=None) == float(text)


def _untouched() -> None:
    assert fastcli.fast_path_available() is False
    assert all(value is None for value in conversions(inspect_command()).values())


@on_tested_typer
@pytest.mark.parametrize("version", ["0.30.0", "0.28.0", "1.29.0", "0.3.0", "", "unknown"])
def test_another_typer_version_gets_plain_commands(pristine, version):
    pristine.setattr(typer, "__version__", version)
    _untouched()
    (paths,) = [p for p in inspect_command().params if p.name == "paths"]
    assert type(paths) is typer.core.TyperArgument
    assert fastcli.lean_group_supported(cli.app) is False


@on_tested_typer
def test_forcing_plain_typer_gets_plain_commands(pristine):
    pristine.setenv(fastcli.PLAIN_TYPER_ENV, "1")
    _untouched()
    assert fastcli.lean_group_supported(cli.app) is False


@on_tested_typer
def test_plain_commands_when_typers_conversion_function_is_gone(pristine):
    pristine.delattr(typer.core, "build_runtime_param")
    assert fastcli.coercion_internals_supported() is False


@on_tested_typer
def test_plain_commands_when_typers_conversion_function_takes_other_parameters(pristine):
    typers_own = typer.core.build_runtime_param

    def build_runtime_param(descriptor, strict=False):  # a typer that grew an option
        return typers_own(descriptor)

    pristine.setattr(typer.core, "build_runtime_param", build_runtime_param)
    _untouched()


@on_tested_typer
def test_plain_commands_when_the_runtime_param_contract_changed(pristine):
    @dataclasses.dataclass(frozen=True)
    class RuntimeParam(typer.core.RuntimeParam):
        def _coerce_value(self, value, ctx):  # no `param` any more
            return value

    pristine.setattr(typer.core, "RuntimeParam", RuntimeParam)
    _untouched()


@on_tested_typer
def test_plain_commands_when_the_parameter_no_longer_keeps_its_conversion(pristine):
    pristine.setattr(typer.core._TyperParameter, "__annotations__", {"type_descriptor": Any})
    _untouched()


@on_tested_typer
def test_plain_commands_when_the_descriptor_lost_a_field(pristine):
    @dataclasses.dataclass(frozen=True)
    class TypeDescriptor:
        annotation: Any
        parameter_info: Any

    pristine.setattr(typer.core, "TypeDescriptor", TypeDescriptor)
    _untouched()


@on_tested_typer
def test_plain_commands_when_parameter_info_lost_an_attribute(pristine):
    class ParameterInfo:
        def __init__(self, default=None, parser=None, min=None, max=None):  # no case_sensitive
            pass

    pristine.setattr(typer.models, "ParameterInfo", ParameterInfo)
    _untouched()


# --- main() builds its lean group only from the internals it was checked against --------


def _record_groups(monkeypatch, get_group):
    """Replace typer.main.get_group with `get_group`; return the Typer instances it builds from."""
    built: list[Any] = []
    original = typer.main.get_group

    def record(typer_instance):
        built.append(typer_instance)
        return original(typer_instance)

    monkeypatch.setattr(typer.main, "get_group", get_group(record))
    return built


def _run_main(monkeypatch, capsys, *args: str) -> tuple[object, str]:
    monkeypatch.setattr(sys, "argv", ["bnaudit", *args])
    with pytest.raises(SystemExit) as exc:
        cli.main()
    return exc.value.code, capsys.readouterr().out


@on_tested_typer
def test_main_builds_a_group_of_the_one_command_it_runs(monkeypatch, capsys):
    monkeypatch.delenv(fastcli.PLAIN_TYPER_ENV, raising=False)
    built = _record_groups(monkeypatch, lambda record: lambda typer_instance: record(typer_instance))
    code, out = _run_main(monkeypatch, capsys, "rules", "BN004")
    assert code == 0 and out.startswith("BN004")
    (lean,) = built
    assert lean is not cli.app and [c.name for c in lean.registered_commands] == ["rules"]


def test_main_runs_the_whole_app_when_get_group_changed(monkeypatch, capsys):
    monkeypatch.delenv(fastcli.PLAIN_TYPER_ENV, raising=False)
    built = _record_groups(monkeypatch, lambda record: lambda typer_instance, lazy=False: record(typer_instance))
    code, out = _run_main(monkeypatch, capsys, "rules", "BN004")
    assert code == 0 and out.startswith("BN004")
    assert built == [cli.app]


def test_main_runs_the_whole_app_when_forced_to_plain_typer(monkeypatch, capsys):
    monkeypatch.setenv(fastcli.PLAIN_TYPER_ENV, "1")
    built = _record_groups(monkeypatch, lambda record: lambda typer_instance: record(typer_instance))
    code, out = _run_main(monkeypatch, capsys, "rules", "BN004")
    assert code == 0 and out.startswith("BN004")
    assert built == [cli.app]


def test_the_whole_app_is_built_once_on_first_use_with_every_command():
    # `main` builds an app of the one command it runs; `bnaudit.cli.app` stays the whole one
    assert cli.app is cli.app
    assert [c.name for c in cli.app.registered_commands] == list(cli.COMMANDS)
    assert [c.name for c in cli.typer_app(["fold", "inspect"]).registered_commands] == ["inspect", "fold"]
    with pytest.raises(AttributeError):
        cli.no_such_attribute  # noqa: B018  # module attributes other than `app` are not conjured up


def test_plain_typer_is_requested_by_any_value_but_empty_or_zero(monkeypatch):
    for value, requested in (("1", True), ("yes", True), ("0", False), ("", False)):
        monkeypatch.setenv(fastcli.PLAIN_TYPER_ENV, value)
        assert fastcli.plain_typer_requested() is requested


@on_tested_typer
@pytest.mark.parametrize("args, code", [(("--help",), 0), ((), 2)])  # alone: the help, as a usage error
def test_help_lists_every_command_without_building_its_options(monkeypatch, capsys, args, code):
    # `bnaudit --help` (and `bnaudit` alone) lists the commands by name and docstring; typer
    # builds a command's options from its annotations (get_type_hints on dozens of
    # Annotated options), which was half of --help's time.
    monkeypatch.delenv(fastcli.PLAIN_TYPER_ENV, raising=False)
    monkeypatch.setenv("COLUMNS", "100")
    built = _record_groups(monkeypatch, lambda record: lambda typer_instance: record(typer_instance))

    def run() -> tuple[object, str]:
        monkeypatch.setattr(sys, "argv", ["bnaudit", *args])
        with pytest.raises(SystemExit) as exc:
            cli.main()
        captured = capsys.readouterr()
        return exc.value.code, captured.out + "|" + captured.err

    lean_code, lean_help = run()
    (lean,) = built
    assert lean_code == code and lean is not cli.app
    group = typer.main.get_group(lean)
    names = [c.name for c in cli.app.registered_commands]
    assert list(group.commands) == names
    assert all(command.params == [] for command in group.commands.values())
    assert all(f"  {name} " in lean_help for name in names)
    # the same help, to the byte, as the whole app's, whose commands have all their options
    full = typer.main.get_command(cli.app)
    assert all(full.commands[name].params for name in names)
    monkeypatch.setenv(fastcli.PLAIN_TYPER_ENV, "1")
    assert run() == (lean_code, lean_help)


@on_tested_typer
def test_version_is_answered_by_the_group_of_listed_commands(monkeypatch, capsys):
    monkeypatch.delenv(fastcli.PLAIN_TYPER_ENV, raising=False)
    code, out = _run_main(monkeypatch, capsys, "--version")
    assert (code, out) == (0, f"bnaudit {bnaudit.__version__}\n")

"""The typer start-up patch is taken only on the typer it was written for, and changes no answer.

`bnaudit.fastcli` replaces a typer internal (the option conversion) and `bnaudit.cli.main`
builds a group from typer internals. On another typer, or with BNAUDIT_PLAIN_TYPER=1,
both must step aside and leave plain typer to answer: these tests force that path
and compare it with the fast one, and change typer's version and internals in-process
to see that nothing gets patched.
"""

from __future__ import annotations

import dataclasses
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

from bnaudit import cli, fastcli

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
        ["inspect", "sample_models/healthy.safetensors", "--eps", "abc"],
        ["inspect", "sample_models/healthy.safetensors", "--format", "JSON"],
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


# --- install() patches only the typer it was written for --------------------------------


@pytest.fixture
def pristine(monkeypatch):
    """typer as it is before bnaudit.cli installs the fast path (restored afterwards)."""
    import typer._coercion

    monkeypatch.delenv(fastcli.PLAIN_TYPER_ENV, raising=False)
    monkeypatch.setattr(typer.core, "build_runtime_param", typer._coercion.build_runtime_param)
    return monkeypatch


@pytest.fixture
def typers_own() -> Any:
    """typer's conversion function, which install() must leave in place when it declines."""
    import typer._coercion

    return typer._coercion.build_runtime_param


@on_tested_typer
def test_install_patches_typers_conversion_on_the_tested_version(pristine, typers_own):
    major, minor = fastcli.TESTED_TYPER
    assert typer.__version__.startswith(f"{major}.{minor}.")
    assert fastcli.install() is True
    assert typer.core.build_runtime_param is not typers_own
    patched = typer.core.build_runtime_param
    assert fastcli.install() is True and typer.core.build_runtime_param is patched  # idempotent


@on_tested_typer
def test_patched_conversion_gives_typers_values_without_pydantic(pristine, typers_own):
    assert fastcli.install()
    descriptor = typer.core.TypeDescriptor(
        annotation=float, parameter_info=typer.models.OptionInfo(), file_annotation=None
    )
    runtime_param = typer.core.build_runtime_param(descriptor)
    assert type(runtime_param) is not type(typers_own(descriptor))  # not typer's pydantic adapter
    for text in ("+3.0E+2", "1e-3", ".5"):
        assert runtime_param._coerce_value(text, param=None, ctx=None) == float(text)


def _untouched(expected: Any) -> None:
    assert fastcli.install() is False
    assert getattr(typer.core, "build_runtime_param", None) is expected


@on_tested_typer
@pytest.mark.parametrize("version", ["0.30.0", "0.28.0", "1.29.0", "0.3.0", "", "unknown"])
def test_install_declines_another_typer_version(pristine, version, typers_own):
    pristine.setattr(typer, "__version__", version)
    _untouched(typers_own)
    assert fastcli.lean_group_supported(cli.app) is False


@on_tested_typer
def test_install_declines_when_forced_to_plain_typer(pristine, typers_own):
    pristine.setenv(fastcli.PLAIN_TYPER_ENV, "1")
    _untouched(typers_own)
    assert fastcli.lean_group_supported(cli.app) is False


@on_tested_typer
def test_install_declines_when_the_patched_function_is_gone(pristine):
    pristine.delattr(typer.core, "build_runtime_param")
    _untouched(None)


@on_tested_typer
def test_install_declines_when_the_patched_function_takes_other_parameters(pristine, typers_own):
    def build_runtime_param(descriptor, strict=False):  # a typer that grew an option
        return typers_own(descriptor)

    pristine.setattr(typer.core, "build_runtime_param", build_runtime_param)
    _untouched(build_runtime_param)


@on_tested_typer
def test_install_declines_when_the_runtime_param_contract_changed(pristine, typers_own):
    @dataclasses.dataclass(frozen=True)
    class RuntimeParam(typer.core.RuntimeParam):
        def _coerce_value(self, value, ctx):  # no `param` any more
            return value

    pristine.setattr(typer.core, "RuntimeParam", RuntimeParam)
    _untouched(typers_own)


@on_tested_typer
def test_install_declines_when_the_descriptor_lost_a_field(pristine, typers_own):
    @dataclasses.dataclass(frozen=True)
    class TypeDescriptor:
        annotation: Any
        parameter_info: Any

    pristine.setattr(typer.core, "TypeDescriptor", TypeDescriptor)
    _untouched(typers_own)


@on_tested_typer
def test_install_declines_when_parameter_info_lost_an_attribute(pristine, typers_own):
    class ParameterInfo:
        def __init__(self, default=None, parser=None, min=None, max=None):  # no case_sensitive
            pass

    pristine.setattr(typer.models, "ParameterInfo", ParameterInfo)
    _untouched(typers_own)


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


def test_plain_typer_is_requested_by_any_value_but_empty_or_zero(monkeypatch):
    for value, requested in (("1", True), ("yes", True), ("0", False), ("", False)):
        monkeypatch.setenv(fastcli.PLAIN_TYPER_ENV, value)
        assert fastcli.plain_typer_requested() is requested

"""Configuration: discovery from the current directory upward, precedence of the command
line, validation of every key, and what select / ignore / per-layer-ignores / exclude and
the thresholds do to an audit."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from conftest import bn_entries, save_safetensors, save_torch

from bnaudit.audit.rules import RULES
from bnaudit.config import KEYS, Config, exit_code_for, find_config_file, load_config, measurement_fail_on
from bnaudit.errors import BnauditError


def write(path, text: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# ----------------------------------------------------------------------------- discovery


def test_nearest_pyproject_is_found_from_a_subfolder(tmp_path):
    pyproject = write(tmp_path / "proj" / "pyproject.toml", "[project]\nname = 'x'\n\n[tool.bnaudit]\nmax-gain = 50\n")
    (tmp_path / "proj" / "models" / "resnet").mkdir(parents=True)
    config = load_config(rule_codes=RULES, start=tmp_path / "proj" / "models" / "resnet")
    assert config.max_gain == 50.0 and config.near_eps_factor == 10.0
    assert config.source == str(pyproject.resolve())


def test_pyproject_without_tool_table_is_passed_over(tmp_path):
    dedicated = write(tmp_path / "outer" / "bnaudit.toml", "max-gain = 7\n")
    write(tmp_path / "outer" / "inner" / "pyproject.toml", "[tool.ruff]\nline-length = 100\n")
    assert find_config_file(tmp_path / "outer" / "inner") == (dedicated.resolve(), {"max-gain": 7})
    assert load_config(rule_codes=RULES, start=tmp_path / "outer" / "inner").max_gain == 7.0


def test_pyproject_of_another_tool_is_not_judged_but_one_naming_bnaudit_is(tmp_path):
    """A pyproject.toml that cannot hold [tool.bnaudit] is not parsed (its TOML is not ours
    to judge, nor to pay for); one that mentions bnaudit is parsed, and its errors reported."""
    dedicated = write(tmp_path / "outer" / "bnaudit.toml", "max-gain = 7\n")
    inner = write(tmp_path / "outer" / "inner" / "pyproject.toml", "[tool.ruff\nline-length = \n")
    assert find_config_file(tmp_path / "outer" / "inner") == (dedicated.resolve(), {"max-gain": 7})
    write(inner, "[tool.bnaudit\nmax-gain = 3\n")
    with pytest.raises(BnauditError, match=r"pyproject.toml: invalid TOML"):
        find_config_file(tmp_path / "outer" / "inner")
    inner.write_bytes(b"[tool.bnaudit]\nname = '\xff'\n")  # not UTF-8: one line, not a traceback
    with pytest.raises(BnauditError, match=r"pyproject.toml: invalid TOML"):
        find_config_file(tmp_path / "outer" / "inner")


# A pyproject.toml of a project that depends on bnaudit and has a console script named
# after it, but no [tool.bnaudit]: bnaudit's own pyproject.toml looks like this.
NAMES_BNAUDIT_ELSEWHERE = """[project]
name = "bnaudit-user"
dependencies = ["bnaudit>=0.1", 'bnaudit[onnx]']

[project.scripts]
bnaudit = "bnaudit.cli:main"

[tool.setuptools.packages.find]
include = ["bnaudit*"]
"""

# Every way TOML can spell the table tool.bnaudit (each with max-gain = 5), after the
# lines above that only mention bnaudit.
TOOL_TABLE_SPELLINGS = [
    "[tool.bnaudit]\nmax-gain = 5\n",
    "[ tool . bnaudit ]\nmax-gain = 5\n",
    "[\"tool\".'bnaudit']\nmax-gain = 5\n",
    "[tool]\nbnaudit = { max-gain = 5 }\n",
    '[tool]\n  "bnaudit".max-gain = 5\n',
    "[tool] # tools\nruff = {}\nbnaudit.max-gain = 5\n",
    "[tool]\r\nbnaudit = { max-gain = 5 }\r\n",
]
ROOT_SPELLINGS = [  # keys before any header
    "tool.bnaudit.max-gain = 5\n",
    "tool . bnaudit = { max-gain = 5 }\n",
    "tool = { ruff = {}, bnaudit = { max-gain = 5 } }\n",
    "tool = {bnaudit.max-gain = 5}\n",
]


@pytest.mark.parametrize("text", [NAMES_BNAUDIT_ELSEWHERE + t for t in TOOL_TABLE_SPELLINGS] + ROOT_SPELLINGS)
def test_every_spelling_of_the_tool_table_is_found(tmp_path, text):
    import tomllib

    assert tomllib.loads(text)["tool"]["bnaudit"] == {"max-gain": 5}  # the spelling is valid TOML
    pyproject = write(tmp_path / "pyproject.toml", text)
    assert find_config_file(tmp_path) == (pyproject.resolve(), {"max-gain": 5})


def test_pyproject_naming_bnaudit_outside_tool_is_not_judged(tmp_path):
    # Not parsed: its TOML is not ours to judge (this one's last line is invalid), nor to
    # pay for at every start-up (a dependency on bnaudit, a script named bnaudit).
    dedicated = write(tmp_path / "bnaudit.toml", "max-gain = 7\n")
    write(tmp_path / "inner" / "pyproject.toml", NAMES_BNAUDIT_ELSEWHERE + "[tool.ruff\nline-length = \n")
    assert find_config_file(tmp_path / "inner") == (dedicated.resolve(), {"max-gain": 7})


def test_nearest_file_wins_and_files_are_not_merged(tmp_path):
    write(tmp_path / "pyproject.toml", "[tool.bnaudit]\nmax-gain = 1\nnear-eps-factor = 3\n")
    write(tmp_path / "sub" / "pyproject.toml", "[tool.bnaudit]\nmax-gain = 2\n")
    config = load_config(rule_codes=RULES, start=tmp_path / "sub")
    assert config.max_gain == 2.0
    assert config.near_eps_factor == 10.0  # the outer file's key does not leak in


def test_bnaudit_toml_wins_over_pyproject_in_the_same_folder(tmp_path):
    write(tmp_path / "pyproject.toml", "[tool.bnaudit]\nmax-gain = 1\n")
    dedicated = write(tmp_path / "bnaudit.toml", "max-gain = 2\n")
    config = load_config(rule_codes=RULES, start=tmp_path)
    assert config.max_gain == 2.0 and config.source == str(dedicated.resolve())


def test_explicit_config_file_and_isolated(tmp_path):
    write(tmp_path / "pyproject.toml", "[tool.bnaudit]\nmax-gain = 1\n")
    ci = write(tmp_path / "ci" / "audit.toml", 'fail-on = "error"\n')
    named = load_config(rule_codes=RULES, config_file=ci, start=tmp_path)
    assert named.fail_on == "error" and named.max_gain == 100.0 and named.source == str(ci)
    as_pyproject = load_config(rule_codes=RULES, config_file=tmp_path / "pyproject.toml", start=tmp_path / "ci")
    assert as_pyproject.max_gain == 1.0
    assert load_config(rule_codes=RULES, isolated=True, start=tmp_path) == Config()
    with pytest.raises(BnauditError, match="configuration file not found"):
        load_config(rule_codes=RULES, config_file=tmp_path / "nope.toml")
    write(tmp_path / "other" / "pyproject.toml", "[project]\nname = 'x'\n")
    with pytest.raises(BnauditError, match=r"pyproject.toml: no \[tool.bnaudit\] table"):
        load_config(rule_codes=RULES, config_file=tmp_path / "other" / "pyproject.toml")


def test_cli_finds_the_configuration_of_the_current_directory(cli, tmp_path, monkeypatch):
    write(tmp_path / "pyproject.toml", '[tool.bnaudit]\nmax-gain = 50\nselect = ["BN00"]\n')
    path = save_safetensors(bn_entries("bn", 4), tmp_path / "ok.safetensors")
    monkeypatch.chdir(tmp_path)
    doc = json.loads(cli("inspect", path, "--format", "json").stdout)
    assert doc["config"]["max-gain"] == 50.0 and doc["config"]["select"] == ["BN00"]
    isolated = json.loads(cli("inspect", path, "--format", "json", "--isolated").stdout)
    assert isolated["config"] == Config().as_dict()


# ----------------------------------------------------------------------------- precedence


def test_command_line_overrides_the_file(tmp_path):
    write(tmp_path / "bnaudit.toml", 'fail-on = "error"\neps = 1e-3\nmomentum = 0.01\n')
    config = load_config({"--fail-on": "info", "--eps": 1e-4, "--momentum": None}, rule_codes=RULES, start=tmp_path)
    assert (config.fail_on, config.eps, config.momentum) == ("info", 1e-4, 0.01)


def test_select_replaces_and_ignore_extends_as_in_ruff(tmp_path):
    write(tmp_path / "bnaudit.toml", 'select = ["BN002", "BN003"]\nignore = ["BN003"]\n')
    from_file = load_config(rule_codes=RULES, start=tmp_path)
    assert (from_file.select, from_file.ignore) == (("BN002", "BN003"), ("BN003",))
    more_ignored = load_config({"--ignore": ["bn002"]}, rule_codes=RULES, start=tmp_path)
    assert (more_ignored.select, more_ignored.ignore) == (("BN002", "BN003"), ("BN003", "BN002"))
    reselected = load_config({"--select": ["BN004"]}, rule_codes=RULES, start=tmp_path)
    assert (reselected.select, reselected.ignore) == (("BN004",), ())
    both = load_config({"--select": ["BN0"], "--ignore": ["BN010"]}, rule_codes=RULES, start=tmp_path)
    assert (both.select, both.ignore) == (("BN0",), ("BN010",))


def test_cli_select_accepts_commas_and_repetition(cli, tmp_path):
    path = save_torch(bn_entries("bn", 4, counter=3), tmp_path / "young.pt")  # BN003 fires
    doc = json.loads(
        cli("inspect", path, "--isolated", "--format", "json", "--select", "BN002,BN004", "--select", "BN005").stdout
    )
    assert doc["config"]["select"] == ["BN002", "BN004", "BN005"]
    assert doc["files"][0]["findings"] == []


# ----------------------------------------------------------------------------- validation


def test_every_config_field_has_a_key():
    fields = {f.name for f in dataclasses.fields(Config)} - {"source", "from_file"}  # where values came from
    assert {key.field for key in KEYS.values()} == fields
    assert set(Config().as_dict()) == set(KEYS)


def test_every_key_is_read_from_the_file(tmp_path):
    write(
        tmp_path / "pyproject.toml",
        """[tool.bnaudit]
fail-on = "info"
near-eps-factor = 20
max-gain = 90.5
max-init-weight = 0.2
eps = 1e-3
momentum = 0.01
select = ["bn00", "BN010"]
ignore = ["BN009"]
per-layer-ignores = {"backbone.*" = ["BN003"], "head" = ["BN004", "BN002"]}
exclude = ["runs/*", "*.tmp.pt"]
""",
    )
    config = load_config(rule_codes=RULES, start=tmp_path)
    assert config == Config(
        fail_on="info",
        near_eps_factor=20.0,
        max_gain=90.5,
        max_init_weight=0.2,
        eps=1e-3,
        momentum=0.01,
        select=("BN00", "BN010"),
        ignore=("BN009",),
        per_layer_ignores={"backbone.*": ("BN003",), "head": ("BN004", "BN002")},
        exclude=("runs/*", "*.tmp.pt"),
    )


@pytest.mark.parametrize(
    "line,problem",
    [
        ('fail-on = "fatal"', "fail-on: expected one of error, warning, info, got 'fatal'"),
        ("fail-on = 1", "fail-on: expected one of error, warning, info, got 1"),
        ("near-eps-factor = 0", "near-eps-factor: expected a positive number, got 0"),
        ('near-eps-factor = "10"', "near-eps-factor: expected a number, got '10'"),
        ("near-eps-factor = true", "near-eps-factor: expected a number, got True"),
        ("max-gain = -1", "max-gain: expected a positive number, got -1"),
        ("max-gain = inf", "max-gain: expected a finite number, got inf"),
        ("max-init-weight = 1", "max-init-weight: expected a number between 0 and 1 (exclusive), got 1"),
        ("max-init-weight = 0.0", "max-init-weight: expected a number between 0 and 1 (exclusive), got 0.0"),
        ("eps = 0", "eps: expected a positive number, got 0"),
        ("eps = nan", "eps: expected a finite number, got nan"),
        ("momentum = 1.5", "momentum: expected a number in [0, 1], got 1.5"),
        ('select = "BN002"', "select: expected a list of rule codes, got 'BN002'"),
        ('select = ["BN999"]', "select: unknown rule code 'BN999' (known: BN001"),
        ('ignore = ["XX"]', "ignore: unknown rule code 'XX'"),
        ('ignore = [""]', "ignore: unknown rule code ''"),
        ('per-layer-ignores = ["a"]', "per-layer-ignores: expected a table of layer globs to rule codes"),
        (
            'per-layer-ignores = {"a.*" = "BN003"}',
            "per-layer-ignores: 'a.*': expected a list of rule codes, got 'BN003'",
        ),
        ('per-layer-ignores = {"a.*" = ["BN99"]}', "per-layer-ignores: 'a.*': unknown rule code 'BN99'"),
        ('exclude = "runs/*"', "exclude: expected a list of file globs, got 'runs/*'"),
        ("exclude = [1]", "exclude: expected a list of file globs, got [1]"),
        ('fail_on = "error"', "unknown key 'fail_on' (did you mean 'fail-on'?)"),
        ("max_gains = 3", "unknown key 'max_gains' (did you mean 'max-gain'?)"),
    ],
)
def test_bad_keys_and_values_name_the_key_and_the_file(tmp_path, line, problem):
    pyproject = write(tmp_path / "pyproject.toml", f"[tool.bnaudit]\n{line}\n")
    with pytest.raises(BnauditError) as exc:
        load_config(rule_codes=RULES, start=tmp_path)
    assert str(exc.value).startswith(f"{pyproject.resolve()} [tool.bnaudit]: {problem}")


def test_bnaudit_toml_errors_name_the_file(tmp_path):
    dedicated = write(tmp_path / "bnaudit.toml", "[tool.bnaudit]\nmax-gain = 3\n")
    with pytest.raises(BnauditError) as exc:
        load_config(rule_codes=RULES, start=tmp_path)
    assert str(exc.value).startswith(
        f"{dedicated.resolve()}: unknown key 'tool' (bnaudit.toml holds the keys at its top level"
    )
    write(tmp_path / "bnaudit.toml", "max-gain = \n")
    with pytest.raises(BnauditError, match=r"bnaudit.toml: invalid TOML"):
        load_config(rule_codes=RULES, start=tmp_path)


def test_bad_command_line_values_name_the_option(tmp_path):
    with pytest.raises(BnauditError, match=r"^--select: unknown rule code 'BN0X'"):
        load_config({"--select": ["BN0X"]}, rule_codes=RULES, isolated=True)


def test_configuration_error_is_one_line_and_exit_2(cli, tmp_path, monkeypatch):
    write(tmp_path / "pyproject.toml", "[tool.bnaudit]\nmax-gain = -1\n")
    path = save_safetensors(bn_entries("bn", 4), tmp_path / "ok.safetensors")
    monkeypatch.chdir(tmp_path)
    table = cli("inspect", path)
    assert table.exit_code == 2
    assert table.stderr.strip().splitlines() == [
        f"bnaudit: error: {(tmp_path / 'pyproject.toml').resolve()} [tool.bnaudit]: max-gain: "
        "expected a positive number, got -1"
    ]
    as_json = cli("inspect", path, "--format", "json")
    assert as_json.exit_code == 2 and "max-gain" in json.loads(as_json.stdout)["error"]
    sarif = cli("inspect", path, "--format", "sarif")
    assert sarif.exit_code == 2 and sarif.stdout == ""
    assert cli("inspect", path, "--ignore", "BN77").exit_code == 2


# ----------------------------------------------------------------------------- effects


@pytest.fixture
def two_layer_checkpoint(tmp_path):
    """backbone.0.bn and head.bn, both immature (t = 10: 0.9^10 = 34.9%, between 5% and 50%:
    a BN003 warning), and head.bn with one dead channel at mean 0, var 0 (BN004, gain
    1/sqrt(1e-5) = 316 >= 100: warning)."""
    state = {
        **bn_entries("backbone.0.bn", 4, counter=10),
        **bn_entries(
            "head.bn",
            4,
            mean=torch.tensor([0.0, 0.1, -0.2, 0.3]),
            var=torch.tensor([0.0, 1.0, 1.0, 1.0]),
            weight=torch.ones(4),
            counter=10,
        ),
    }
    return save_torch(state, tmp_path / "model.pt")


def findings(cli, path, *args) -> list[tuple[str, str]]:
    doc = json.loads(cli("inspect", path, "--format", "json", *args).stdout)
    return [(f["code"], f["layer"]) for f in doc["files"][0]["findings"]]


def test_select_ignore_and_per_layer_ignores_from_the_file(cli, tmp_path, monkeypatch, two_layer_checkpoint):
    monkeypatch.chdir(tmp_path)
    everything = [("BN003", "backbone.0.bn"), ("BN003", "head.bn"), ("BN004", "head.bn")]
    assert findings(cli, two_layer_checkpoint) == everything
    write(tmp_path / "bnaudit.toml", 'per-layer-ignores = {"backbone.*" = ["BN003"]}\n')
    assert findings(cli, two_layer_checkpoint) == [("BN003", "head.bn"), ("BN004", "head.bn")]
    write(tmp_path / "bnaudit.toml", 'select = ["BN004"]\n')
    assert findings(cli, two_layer_checkpoint) == [("BN004", "head.bn")]
    write(tmp_path / "bnaudit.toml", 'ignore = ["BN00"]\n')
    assert findings(cli, two_layer_checkpoint) == []
    assert findings(cli, two_layer_checkpoint, "--select", "BN003") == everything[:2]


def test_thresholds_from_the_file_move_the_rules(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # t = 30 at momentum 0.1: w = 0.9^30 = 0.0424, below the default 5%, above 4%.
    weight = 0.9**30
    assert 0.04 < weight < 0.05
    # one channel at var 1e-4 = 10 * eps: not below the default factor 10, below 20;
    # its gain 1/sqrt(1e-4 + 1e-5) = 95.3 is under the default max-gain 100, over 90.
    var = torch.tensor([1e-4, 1.0, 1.0, 1.0], dtype=torch.float64)
    path = save_torch(
        bn_entries("bn", 4, var=var, weight=torch.ones(4, dtype=torch.float64), counter=30, dtype=torch.float64),
        tmp_path / "m.pt",
    )
    assert findings(cli, path) == []
    write(tmp_path / "bnaudit.toml", "max-init-weight = 0.04\n")
    assert findings(cli, path) == [("BN003", "bn")]
    write(tmp_path / "bnaudit.toml", "near-eps-factor = 20\n")
    doc = json.loads(cli("inspect", path, "--format", "json").stdout)
    (finding,) = doc["files"][0]["findings"]
    assert (finding["code"], finding["severity"], finding["channels"]) == ("BN004", "info", [0])
    assert f"gain {1 / (1e-4 + 1e-5) ** 0.5:.1f}" in finding["message"]
    write(tmp_path / "bnaudit.toml", "near-eps-factor = 20\nmax-gain = 90\n")
    doc = json.loads(cli("inspect", path, "--format", "json").stdout)
    assert [(f["code"], f["severity"]) for f in doc["files"][0]["findings"]] == [("BN004", "warning")]


def test_eps_and_momentum_from_the_file(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # var 5e-3: near-eps only when eps is 1e-3 (5e-3 < 10 * 1e-3), not at 1e-5.
    # t = 100: 0.9^100 = 2.7e-5 (mature) at momentum 0.1, 0.99^100 = 0.366 (immature) at 0.01.
    assert 0.99**100 > 0.05 > 0.9**100
    path = save_torch(bn_entries("bn", 4, var=torch.tensor([5e-3, 1.0, 1.0, 1.0]), counter=100), tmp_path / "m.pt")
    assert findings(cli, path) == []
    write(tmp_path / "bnaudit.toml", "eps = 1e-3\nmomentum = 0.01\n")
    assert findings(cli, path) == [("BN003", "bn"), ("BN004", "bn")]
    doc = json.loads(cli("inspect", path, "--format", "json").stdout)
    assert doc["files"][0]["layers"][0]["eps"] == 1e-3 and doc["files"][0]["layers"][0]["momentum"] == 0.01


def test_exclude_globs_are_relative_to_the_configuration_file(cli, tmp_path, monkeypatch):
    write(tmp_path / "pyproject.toml", '[tool.bnaudit]\nexclude = ["runs/*", "*.tmp.pt", "scratch"]\n')
    for rel in ("runs/a.pt", "models/b.tmp.pt", "models/scratch/c.pt", "models/good.pt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        save_torch(bn_entries("bn", 4), tmp_path / rel)
    monkeypatch.chdir(tmp_path / "models")  # the configuration is one folder up
    doc = json.loads(cli("inspect", ".", os.path.join("..", "runs", "a.pt"), "--format", "json").stdout)
    # audited: good.pt; named on the command line but excluded: reported as such, not read
    assert [(f["path"], f["excluded"]) for f in doc["files"]] == [
        (os.path.join(".", "good.pt"), None),
        (
            os.path.join("..", "runs", "a.pt"),
            f'excluded by the configuration (exclude "runs/*" in {tmp_path / "pyproject.toml"})',
        ),
    ]
    assert doc["files"][1]["layers"] == [] and doc["summary"]["files"] == 1 and doc["summary"]["excluded"] == 1
    assert doc["config"]["exclude"] == ["runs/*", "*.tmp.pt", "scratch"]
    table = cli("inspect", os.path.join("..", "runs", "a.pt"), "-q")
    assert table.exit_code == 0
    assert table.stdout.splitlines() == [
        f'{os.path.join("..", "runs", "a.pt")}: excluded by the configuration (exclude "runs/*" in '
        f"{tmp_path / 'pyproject.toml'})",
        "0 files, 0 BN layers: 0 errors, 0 warnings, 0 infos, 1 excluded file",
    ]


def test_excludes_matches_components_and_relative_paths(tmp_path):
    config = Config(exclude=("experiments/*", "*.tmp.pt", "runs"), source=str(tmp_path / "bnaudit.toml"))
    assert config.root == str(tmp_path)
    assert config.excludes(str(tmp_path / "experiments" / "x" / "a.pt"))
    assert config.excludes(str(tmp_path / "deep" / "b.tmp.pt"))
    assert config.excludes(str(tmp_path / "a" / "runs" / "c.pt"))
    assert not config.excludes(str(tmp_path / "models" / "experiments.pt"))
    assert not config.excludes(str(tmp_path / "models" / "a.pt"))
    assert not Config().excludes("anything.pt")


# ----------------------------------------------------------------------------- exit codes


def test_exit_codes_with_fail_on_from_the_file_and_exit_zero(cli, tmp_path, monkeypatch, two_layer_checkpoint):
    monkeypatch.chdir(tmp_path)
    assert cli("inspect", two_layer_checkpoint).exit_code == 1  # warnings, fail-on warning
    assert cli("inspect", two_layer_checkpoint, "--exit-zero").exit_code == 0
    write(tmp_path / "bnaudit.toml", 'fail-on = "error"\n')
    assert cli("inspect", two_layer_checkpoint).exit_code == 0  # only warnings now
    assert cli("inspect", two_layer_checkpoint, "--fail-on", "warning").exit_code == 1  # the flag wins
    broken = write(tmp_path / "broken.pt", "not a checkpoint")
    assert cli("inspect", two_layer_checkpoint, str(broken), "--exit-zero").exit_code == 2


def test_quiet_prints_one_line_per_finding_errors_and_the_summary(cli, tmp_path, two_layer_checkpoint):
    broken = write(tmp_path / "broken.pt", "not a checkpoint")
    result = cli("inspect", two_layer_checkpoint, str(broken), "--quiet", "--isolated")
    lines = result.stdout.strip().splitlines()
    doc = json.loads(cli("inspect", two_layer_checkpoint, str(broken), "--format", "json", "--isolated").stdout)
    findings = doc["files"][0]["findings"]
    assert lines[:3] == [
        f"{two_layer_checkpoint}: {f['layer']}: {f['code']} {f['name']}: {f['message']}" for f in findings
    ]
    assert lines[3:] == ["2 files, 2 BN layers: 0 errors, 3 warnings, 0 infos, 1 unreadable file"]
    assert result.stderr.splitlines() == [f"bnaudit: error: {broken}: {doc['files'][1]['error']}"]
    assert result.exit_code == 2


# ----------------------------------------------------------------------------- the exit policy


@pytest.mark.parametrize(
    "severities, fail_on, flags, expected",
    [
        ([], "info", {}, 0),
        (["info"], "warning", {}, 0),
        (["info", "warning"], "warning", {}, 1),
        (["error"], "error", {}, 1),
        (["warning"], "error", {}, 0),
        (["error"], None, {}, 0),  # a measurement's findings without a stated fail-on
        ([], None, {"failed": True}, 1),
        (["error"], "info", {"exit_zero": True}, 0),
        ([], None, {"failed": True, "exit_zero": True}, 0),
        ([], None, {"error": True}, 2),
        ([], None, {"error": True, "exit_zero": True}, 2),  # a named unreadable file, a bad option
        (["error"], "info", {"found_error": True}, 2),  # 2 wins over 1
        (["error"], "info", {"found_error": True, "exit_zero": True}, 0),
    ],
)
def test_exit_code_policy(severities, fail_on, flags, expected):
    assert exit_code_for(severities, fail_on, **flags) == expected


def test_a_measurement_fails_on_findings_only_at_a_stated_fail_on(tmp_path):
    assert measurement_fail_on(None) is None
    assert measurement_fail_on(Config()) is None  # "warning" is only the audit's default
    assert measurement_fail_on(Config(), "error") == "error"
    write(tmp_path / "bnaudit.toml", 'fail-on = "info"\n')
    stated = load_config(rule_codes=RULES, start=tmp_path)
    assert stated.from_file == {"fail_on"}
    assert measurement_fail_on(stated) == "info"
    assert measurement_fail_on(stated, "error") == "error"  # the command line wins
    overridden = load_config({"--fail-on": "error"}, rule_codes=RULES, start=tmp_path)
    assert overridden.from_file == frozenset() and measurement_fail_on(overridden) is None

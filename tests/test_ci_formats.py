"""The formats CI systems read, for inspect and diff: `--format github` (workflow-command
annotations), `gitlab` (Code Quality JSON), `junit` (JUnit XML) and `markdown` (a step
summary), each checked against its consumer: GitLab's own schema, the standard library's
XML parser with the counts recomputed, the Actions runner's unescaping, GitHub's 1 MiB
limit of a step summary.

tests/data/gitlab-codeclimate-schema.json is GitLab's schema of one Code Quality entry,
app/validators/json_schemas/codeclimate.json of gitlab-org/gitlab (MIT; mirrored as
gitlabhq/gitlabhq, file as of commit f986ce9ffa56e25d0a3010c78d9481664742d766), which
GitLab's parser (Gitlab::Ci::Parsers::Codequality::CodeClimate) checks every entry of an
`artifacts:reports:codequality` file against; committed so the test needs no network.
It requires only description, fingerprint, severity and location; GitLab's documentation
adds check_name, location.path, location.lines.begin and the severity names, checked
here too.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import xml.etree.ElementTree as ET

import jsonschema
import pytest
import torch
from conftest import bn_entries, save_safetensors, save_torch

from bnaudit.api import inspect
from bnaudit.audit.checkpoint.report import FileReport, InspectReport
from bnaudit.audit.diff.checkpoints import diff
from bnaudit.audit.rules import Finding
from bnaudit.config import Config
from bnaudit.output.github import escape_data, escape_property, to_github
from bnaudit.output.gitlab import to_gitlab
from bnaudit.output.junit import to_junit
from bnaudit.output.markdown import LIMIT, to_markdown
from bnaudit.severity import Severity
from bnaudit.text import printable

SCHEMA_PATH = os.path.join(os.path.dirname(__file__), "data", "gitlab-codeclimate-schema.json")
FORMATS = ("table", "json", "sarif", "github", "gitlab", "junit", "markdown")
DEAD = torch.tensor([0.0, 1.0, 1.0])  # channel 0: running_var 0, a BN004 warning with weight 1 (gain 316)


def bad_layer(name: str, counter: int = 100, dead_var: float = 0.0) -> dict[str, torch.Tensor]:
    var = DEAD.clone()
    var[0] = dead_var
    return bn_entries(name, 3, mean=torch.tensor([0.0, 0.5, -0.5]), var=var, weight=torch.ones(3), counter=counter)


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    """models/two bad.pt: BN004 warnings in a.bn and b.bn, BN010 (counters 100 and 1000)
    as a file-level info, c.bn healthy; models/good.safetensors: healthy; models/junk.pt:
    unreadable. The current directory is the workspace."""
    models = tmp_path / "models"
    models.mkdir()
    save_torch({**bad_layer("a.bn"), **bad_layer("b.bn"), **bn_entries("c.bn", 3, counter=1000)}, models / "two bad.pt")
    save_safetensors(bn_entries("bn", 4, counter=1000), models / "good.safetensors")
    (models / "junk.pt").write_bytes(b"PK\x03\x04 a torn zip: claims a format and breaks it")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def run(*paths: str, **config) -> InspectReport:
    return inspect(list(paths), Config(**config))


# GitLab


@pytest.fixture(scope="module")
def gitlab_entry_validator():
    with open(SCHEMA_PATH, encoding="utf-8") as fh:
        schema = json.load(fh)
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def test_gitlab_report_validates_against_gitlabs_schema(workspace, gitlab_entry_validator):
    report = run("models")
    document = json.loads(json.dumps(to_gitlab(report)))  # what GitLab reads: the JSON text
    assert isinstance(document, list) and len(document) == 4  # 2 x BN004, BN010, the unreadable file
    for entry in document:
        gitlab_entry_validator.validate(entry)
        # the documented fields the schema leaves optional
        assert isinstance(entry["check_name"], str) and entry["check_name"]
        assert entry["severity"] in {"info", "minor", "major", "critical", "blocker"}
        assert isinstance(entry["location"]["path"], str)
        assert type(entry["location"]["lines"]["begin"]) is int and entry["location"]["lines"]["begin"] >= 1
    assert len({entry["fingerprint"] for entry in document}) == len(document)  # GitLab keys entries by it


def test_gitlab_entry_missing_a_required_field_is_refused(workspace, gitlab_entry_validator):
    """The schema is a real check: an entry without a fingerprint does not pass."""
    entry = to_gitlab(run("models/two bad.pt"))[0]
    del entry["fingerprint"]
    with pytest.raises(jsonschema.ValidationError):
        gitlab_entry_validator.validate(entry)


def test_gitlab_severities_locations_and_descriptions(workspace):
    document = to_gitlab(run("models"))
    by_check = {}
    for entry in document:
        by_check.setdefault(entry["check_name"], []).append(entry)
    assert {e["severity"] for e in by_check["BN004"]} == {"minor"}  # warning
    assert [e["severity"] for e in by_check["BN010"]] == ["info"]
    assert [e["severity"] for e in by_check["unreadable"]] == ["critical"]
    assert {e["location"]["path"] for e in by_check["BN004"]} == {"models/two bad.pt"}
    assert by_check["unreadable"][0]["location"]["path"] == "models/junk.pt"
    assert sorted(e["description"].split(": ")[1] for e in by_check["BN004"]) == ["a.bn", "b.bn"]
    assert all(e["description"].startswith("BN004 near-eps-variance: ") for e in by_check["BN004"])


def test_gitlab_error_finding_is_major(tmp_path, monkeypatch):
    """A BN002 error (statistics reset while weights are trained) maps to major."""
    monkeypatch.chdir(tmp_path)
    state = bn_entries("bn", 4, mean=torch.zeros(4), var=torch.ones(4), counter=5000)
    save_torch(state, tmp_path / "reset.pt")
    report = run("reset.pt")
    assert [f.severity for f in report.findings] == ["error"]
    assert [e["severity"] for e in to_gitlab(report)] == ["major"]


def gitlab_fingerprints(report) -> dict[tuple[str, str], str]:
    """(check, layer) -> fingerprint, the layer read back from the description."""
    out = {}
    for entry in to_gitlab(report):
        parts = entry["description"].split(": ")
        layer = parts[1] if entry["check_name"] == "BN004" else "(file)"
        out[(entry["check_name"], layer)] = entry["fingerprint"]
    return out


def test_fingerprints_are_stable_across_runs_and_differ_across_layers(workspace):
    first = gitlab_fingerprints(run("models/two bad.pt"))
    second = gitlab_fingerprints(run("models/two bad.pt"))
    assert first == second
    assert first[("BN004", "a.bn")] != first[("BN004", "b.bn")]
    # a hash of path, layer and rule, computed here independently of the emitter
    expected = hashlib.sha256(b"models/two bad.pt\0layer:a.bn\0BN004").hexdigest()
    assert first[("BN004", "a.bn")] == expected


def test_fingerprints_ignore_the_numbers_of_the_message(workspace):
    """The same problem with other numbers (another gain, other counters) keeps its
    fingerprint: GitLab's pipeline comparison must not see a new issue."""
    before = run("models/two bad.pt")
    save_torch(
        {
            **bad_layer("a.bn", counter=300, dead_var=1e-6),
            **bad_layer("b.bn", 300),
            **bn_entries("c.bn", 3, counter=900),
        },
        "models/two bad.pt",
    )
    after = run("models/two bad.pt")
    messages = lambda r: sorted(f.message for f in r.findings)  # noqa: E731
    assert messages(before) != messages(after)  # the numbers did change
    assert gitlab_fingerprints(before) == gitlab_fingerprints(after)


def test_fingerprints_differ_across_files(workspace):
    save_torch({**bad_layer("a.bn"), **bad_layer("b.bn"), **bn_entries("c.bn", 3, counter=1000)}, "models/copy.pt")
    document = to_gitlab(run("models/two bad.pt", "models/copy.pt"))
    assert len(document) == 6 and len({e["fingerprint"] for e in document}) == 6


def test_repeated_rule_in_one_layer_gets_distinct_fingerprints():
    """Two findings of one rule at one place (file-level here) stay two GitLab issues."""
    finding = Finding("BN010", "uneven-counters", Severity.INFO, None, "one")
    file = FileReport(
        "m.pt", layers=[], findings=[finding, Finding("BN010", "uneven-counters", Severity.INFO, None, "two")]
    )
    document = to_gitlab(InspectReport([file], Config()))
    assert len({e["fingerprint"] for e in document}) == 2
    assert document == to_gitlab(InspectReport([file], Config()))


# JUnit


def junit_counts(case: ET.Element) -> tuple[int, int, int]:
    return (len(case.findall("failure")), len(case.findall("error")), len(case.findall("skipped")))


@pytest.mark.parametrize("fail_on", ["info", "warning", "error"])
def test_junit_parses_and_its_counts_match_the_findings(workspace, fail_on):
    report = run("models", fail_on=fail_on)
    root = ET.fromstring(to_junit(report))
    assert root.tag == "testsuites"
    suites = {suite.get("name"): suite for suite in root.findall("testsuite")}
    assert set(suites) == {"models/two bad.pt", "models/good.safetensors", "models/junk.pt"}
    names = {name: [case.get("name") for case in suite.findall("testcase")] for name, suite in suites.items()}
    assert names["models/two bad.pt"] == ["(file)", "a.bn", "b.bn", "c.bn"]
    assert names["models/good.safetensors"] == ["(file)", "bn"]
    assert names["models/junk.pt"] == ["(file)"]
    for suite in suites.values():
        cases = suite.findall("testcase")
        assert int(suite.get("tests")) == len(cases)
        assert int(suite.get("failures")) == sum(1 for c in cases if junit_counts(c)[0])
        assert int(suite.get("errors")) == sum(1 for c in cases if junit_counts(c)[1])
        assert int(suite.get("skipped")) == sum(1 for c in cases if junit_counts(c)[2])
    for count in ("tests", "failures", "errors", "skipped"):
        assert int(root.get(count)) == sum(int(s.get(count)) for s in suites.values())
    # one <failure> per finding at or above fail-on, one system-out line per finding below
    threshold = Severity(fail_on)
    failures = root.findall(".//failure")
    at_or_above = [f for f in report.findings if Severity(f.severity) >= threshold]
    assert sorted(e.get("type") for e in failures) == sorted(f.code for f in at_or_above)
    out_lines = [line for e in root.findall(".//system-out") for line in e.text.splitlines()]
    assert len(out_lines) == len(report.findings) - len(at_or_above)
    expected_failures = {"info": 3, "warning": 2, "error": 0}[fail_on]  # 2 x BN004 warning, 1 BN010 info
    assert len(failures) == expected_failures
    assert int(root.get("errors")) == 1  # the unreadable file
    bad = suites["models/two bad.pt"]
    layer_a = next(c for c in bad.findall("testcase") if c.get("name") == "a.bn")
    assert [e.get("type") for e in layer_a.findall("failure")] == (["BN004"] if fail_on != "error" else [])


def test_junit_counts_test_cases_not_failure_elements():
    """Two findings of one layer are two <failure> elements of one failed test case."""
    findings = [
        Finding("BN004", "near-eps-variance", Severity.WARNING, "x", "one"),
        Finding("BN002", "initial-values", Severity.ERROR, "x", "two"),
        Finding("BN004", "near-eps-variance", Severity.WARNING, "y", "three"),
        Finding("BN010", "uneven-counters", Severity.INFO, None, "four"),
    ]
    root = ET.fromstring(to_junit(InspectReport([FileReport("m.pt", findings=findings)], Config())))
    (suite,) = root.findall("testsuite")
    assert [c.get("name") for c in suite.findall("testcase")] == ["(file)", "x", "y"]
    assert len(suite.findall(".//failure")) == 3
    assert (suite.get("tests"), suite.get("failures"), root.get("failures")) == ("3", "2", "2")
    assert suite.find("testcase/system-out").text == "info BN010 uneven-counters: four"


def test_junit_skipped_file_is_a_skipped_test(workspace):
    torch.save({"state": {}, "param_groups": [{"lr": 0.1, "params": []}]}, "models/optimizer.pt")
    root = ET.fromstring(to_junit(run("models")))
    suite = next(s for s in root.findall("testsuite") if s.get("name") == "models/optimizer.pt")
    assert suite.get("skipped") == "1" and suite.find("testcase/skipped") is not None
    assert root.get("skipped") == "1"


def test_junit_escapes_hostile_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    name = 'x<y>&"z\x1b[31m\ufffe'
    save_torch({**bad_layer(name), **bn_entries("ok", 3)}, tmp_path / "m.pt")
    root = ET.fromstring(to_junit(run("m.pt")))  # parses: escaped and XML 1.0 characters only
    names = [c.get("name") for c in root.iter("testcase")]
    assert printable(name).replace("\ufffe", "\\ufffe") in names
    assert not any("\x1b" in (n or "") for n in names)


# GitHub


def runner_unescape_property(text: str) -> str:
    """What the Actions runner does to a property value (ActionCommand.cs: %25 last)."""
    for escaped, raw in (("%0D", "\r"), ("%0A", "\n"), ("%3A", ":"), ("%2C", ","), ("%25", "%")):
        text = text.replace(escaped, raw)
    return text


def runner_unescape_data(text: str) -> str:
    for escaped, raw in (("%0D", "\r"), ("%0A", "\n"), ("%25", "%")):
        text = text.replace(escaped, raw)
    return text


def test_toolkit_escaping_rules():
    """The toolkit's escapeData and escapeProperty, character for character."""
    assert escape_data("100% a\r\nb::c,d") == "100%25 a%0D%0Ab::c,d"
    assert escape_property("100% a\r\nb::c,d") == "100%25 a%0D%0Ab%3A%3Ac%2Cd"
    assert escape_property("%3A") == "%253A"  # an escape in a name is not read as one
    for text in ("a%0Ab", "x\ny\r:,%", "%%::,,"):
        assert runner_unescape_property(escape_property(text)) == text
        assert runner_unescape_data(escape_data(text)) == text


ANNOTATION = re.compile(r"^::(error|warning|notice) file=([^:,]*),line=1,title=([^:,]*)::(.*)$")


def test_github_annotations_survive_hostile_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    layer = "evil\n::error file=x::pwned%0A,title=y"
    path = "we,ird:name 100%.pt"
    save_torch({**bad_layer(layer), **bn_entries("ok", 3)}, tmp_path / path)
    report = run(path)
    lines = to_github(report).splitlines()
    assert len(lines) == len(report.findings) + 1  # one line each, then the summary
    annotations = [ANNOTATION.match(line) for line in lines[:-1]]
    assert all(annotations), lines
    warning = next(m for m in annotations if m.group(1) == "warning")
    assert runner_unescape_property(warning.group(2)) == path
    assert runner_unescape_property(warning.group(3)) == "BN004 near-eps-variance"
    message = runner_unescape_data(warning.group(4))
    assert message.startswith(printable(layer) + ": 1 channel")  # the name printable, then exact
    assert "\n" not in message and lines[-1].startswith("bnaudit: ")


def test_github_kinds_and_summary(workspace):
    report = run("models")
    lines = to_github(report).splitlines()
    kinds = [ANNOTATION.match(line).group(1) for line in lines[:-1]]
    assert sorted(kinds) == ["error", "notice", "warning", "warning"]  # unreadable, BN010, 2 x BN004
    assert lines[-1] == "bnaudit: 0 errors, 2 warnings, 1 info in 3 files, 1 unreadable"


def test_github_summary_points_to_sarif_past_ten_annotations(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    state = {}
    for i in range(12):
        state.update(bad_layer(f"l{i}.bn"))
    save_torch(state, tmp_path / "many.pt")
    lines = to_github(run("many.pt")).splitlines()
    assert sum(line.startswith("::warning ") for line in lines) == 12  # every finding is written
    assert "2 are in this log only" in lines[-1] and "--format sarif" in lines[-1]


# Markdown


def cells(row: str) -> list[str]:
    return re.split(r"(?<!\\)\|", row.strip())[1:-1]


def test_markdown_tables_and_escaping(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    layer = "a|b <img src=x> *c* `d` $e$ @team"
    save_torch({**bad_layer(layer), **bn_entries("ok", 3)}, tmp_path / "m.pt")
    text = to_markdown(run("m.pt"))
    rows = [line for line in text.splitlines() if line.startswith("| warning ")]
    assert len(rows) == 1
    row = cells(rows[0])
    assert len(row) == 4  # the | of the name did not open a cell
    assert row[2].strip() == r"a\|b \<img src=x\> \*c\* \`d\` \$e\$ \@team"
    assert not re.search(r"(?<!\\)<", text)  # no HTML tag opens


def test_markdown_of_the_workspace(workspace):
    text = to_markdown(run("models"))
    assert text.startswith("## bnaudit inspect\n")
    assert "**0 errors, 2 warnings, 1 info** in 3 files (1 unreadable, 1 without findings)" in text
    assert "### models/junk.pt" in text and "### models/two bad.pt" in text
    assert "good.safetensors" not in text
    assert len([line for line in text.splitlines() if re.match(r"\| (warning|info|error) ", line)]) == 3
    assert "left out" not in text


def test_markdown_stays_under_one_mebibyte_with_many_files():
    """5,000 files of 4 findings with long messages (~2.6 MB of rows) fit in 1 MiB, and the
    last line counts what was left out: shown rows + left-out findings = all findings."""
    files = []
    for i in range(5000):
        findings = [
            Finding("BN004", "near-eps-variance", Severity.WARNING, f"block{i}.layer{j}.bn", "x" * 100)
            for j in range(4)
        ]
        files.append(FileReport(f"checkpoints/run{i:04d}/model.pt", findings=findings))
    report = InspectReport(files, Config())
    text = to_markdown(report)
    assert len(text.encode("utf-8")) <= LIMIT
    shown_rows = sum(1 for line in text.splitlines() if line.startswith("| warning "))
    headings = sum(1 for line in text.splitlines() if line.startswith("### "))
    footer = re.search(r"_(\d+) findings in (\d+) files left out", text.splitlines()[-1])
    assert footer, text.splitlines()[-1]
    left_findings, left_files = int(footer.group(1)), int(footer.group(2))
    assert shown_rows + left_findings == 20000
    assert 0 < shown_rows < 20000
    complete = shown_rows // 4  # every file has 4 rows; a partly shown file counts as left out
    assert left_files == 5000 - complete and headings in (complete, complete + 1)


def test_markdown_of_a_small_budget_is_cut_between_rows():
    findings = [Finding("BN004", "near-eps-variance", Severity.WARNING, f"l{j}", "m" * 50) for j in range(100)]
    report = InspectReport([FileReport("a.pt", findings=findings)], Config())
    text = to_markdown(report, limit=4096)
    assert len(text.encode()) <= 4096
    rows = sum(1 for line in text.splitlines() if line.startswith("| warning "))
    assert f"_{100 - rows} findings in 1 file left out" in text


# diff


@pytest.fixture
def diff_pair(tmp_path, monkeypatch):
    """b.pt kept a.safetensors' weights but its statistics moved (frozen but updating:
    BN101 warnings in both layers)."""
    monkeypatch.chdir(tmp_path)
    a = {**bn_entries("f.1", 4, counter=100), **bn_entries("f.2", 4, counter=100)}
    b = {k: v.clone() for k, v in a.items()}
    for layer in ("f.1", "f.2"):
        b[f"{layer}.running_mean"] = b[f"{layer}.running_mean"] + 0.5
        b[f"{layer}.num_batches_tracked"] = torch.tensor(120)
    save_safetensors(a, tmp_path / "a.safetensors")
    save_torch(b, tmp_path / "b.pt")
    return "a.safetensors", "b.pt"


def test_diff_findings_are_anchored_to_side_b(diff_pair, gitlab_entry_validator):
    a, b = diff_pair
    report = diff(a, b, Config())
    codes = sorted(f.code for f in report.findings)
    assert codes and all(f.layer in ("f.1", "f.2") for f in report.findings if f.code == "BN101")
    document = to_gitlab(report)
    for entry in document:
        gitlab_entry_validator.validate(entry)
    assert {e["location"]["path"] for e in document} == {"b.pt"}
    assert sorted(e["check_name"] for e in document) == codes
    root = ET.fromstring(to_junit(report))
    (suite,) = root.findall("testsuite")
    assert suite.get("name") == "b.pt"
    assert suite.find("properties/property").attrib == {"name": "compared-with", "value": "a.safetensors"}
    assert [c.get("name") for c in suite.findall("testcase")][:3] == ["(file)", "f.1", "f.2"]
    assert len(root.findall(".//failure")) == sum(1 for f in report.findings if Severity(f.severity) >= "warning")
    github = to_github(report).splitlines()
    assert all(ANNOTATION.match(line).group(2) == "b.pt" for line in github[:-1])
    markdown = to_markdown(report)
    assert markdown.startswith("## bnaudit diff\n") and "a.safetensors compared with b.pt" in markdown


# exit codes and the CLI


@pytest.mark.parametrize(
    "args, code",
    [
        (("models/two bad.pt",), 1),
        (("models/good.safetensors",), 0),
        (("models/junk.pt",), 2),
        (("models/two bad.pt", "--exit-zero"), 0),
        (("models/two bad.pt", "--fail-on", "error"), 0),
    ],
)
def test_exit_codes_do_not_depend_on_the_format(workspace, cli, args, code):
    for fmt in FORMATS:
        result = cli("inspect", *args, "--isolated", "--format", fmt)
        assert result.exit_code == code, (fmt, result.output)


def test_diff_exit_codes_do_not_depend_on_the_format(diff_pair, cli):
    a, b = diff_pair
    codes = {fmt: cli("diff", a, b, "--isolated", "--format", fmt).exit_code for fmt in FORMATS}
    assert set(codes.values()) == {1}, codes


def test_cli_writes_each_ci_format_on_stdout(workspace, cli):
    gitlab = cli("inspect", "models", "--isolated", "--format", "gitlab")
    assert len(json.loads(gitlab.stdout)) == 4 and gitlab.stderr == ""  # the unreadable file said once, in the report
    junit = cli("inspect", "models", "--isolated", "--format", "junit")
    assert ET.fromstring(junit.stdout).get("errors") == "1"
    github = cli("inspect", "models", "--isolated", "--format", "github")
    assert github.stdout.splitlines()[-1].startswith("bnaudit: ")
    markdown = cli("inspect", "models", "--isolated", "--format", "markdown")
    assert markdown.stdout.startswith("## bnaudit inspect")


def test_a_run_that_stops_leaves_stdout_empty_in_the_ci_formats(tmp_path, monkeypatch, cli):
    """A configuration error is one line on stderr, exit 2; stdout holds no half report
    that a CI system would read as "no findings"."""
    (tmp_path / "bnaudit.toml").write_text("max-gain = -1\n")
    path = save_safetensors(bn_entries("bn", 4), tmp_path / "ok.safetensors")
    monkeypatch.chdir(tmp_path)
    for fmt in ("github", "gitlab", "junit", "markdown"):
        result = cli("inspect", path, "--format", fmt)
        assert result.exit_code == 2 and result.stdout == "", fmt
        assert result.stderr.startswith("bnaudit: error: ") and "max-gain" in result.stderr


EMIT_PROBE = """
import io, sys
from bnaudit import output
from bnaudit.api import inspect
from bnaudit.config import Config

report = inspect([sys.argv[1]], Config())
for fmt in ("github", "gitlab", "junit", "markdown"):
    output.emit(report, fmt, io.StringIO())
print(sorted(m for m in ("torch", "numpy", "bnaudit.runtime") if m in sys.modules))
"""


@pytest.mark.slow
def test_ci_formats_do_not_import_the_runtime(tmp_path):
    import subprocess
    import sys

    from conftest import REPO

    path = save_safetensors(bn_entries("bn", 4), tmp_path / "ok.safetensors")
    proc = subprocess.run(
        [sys.executable, "-c", EMIT_PROBE, path],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"

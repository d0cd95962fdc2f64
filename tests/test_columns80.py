"""80 columns, the default terminal: every table keeps the columns its findings cite and the
severity (it decides the exit code); many layers with one finding are one row; names are
shortened, never wrapped; -q is one line per finding; a shortened path keeps its file name."""

from __future__ import annotations

import os
import re

import pytest
from conftest import SAMPLES
from test_wrap80 import check_wraps_at_spaces

PAIR = (os.path.join(SAMPLES, "pretrained.safetensors"), os.path.join(SAMPLES, "finetuned.pt"))


def _headers(output: str, first: str) -> list[list[str]]:
    """The header cells of every table whose first header is `first`."""
    return [
        [c.strip() for c in line.split("┃")]
        for line in output.splitlines()
        if "┃" in line and line.split("┃")[0].strip() == first
    ]


@pytest.mark.parametrize(
    "args",
    [
        ("inspect", os.path.join(SAMPLES, "immature.pt")),
        ("inspect", os.path.join(SAMPLES, "dead_channel.safetensors")),
        ("inspect", os.path.join(SAMPLES, "pt2", "training.pt2")),
        ("inspect", SAMPLES),
        ("diff", *PAIR),
        ("fold", os.path.join(SAMPLES, "inception_channel.safetensors")),
    ],
    ids=["immature", "dead-channel", "pt2-training", "folder", "diff", "fold"],
)
def test_the_findings_table_keeps_the_severity_at_80_columns(cli, args):
    result = cli(*args, width=80)
    tables = _headers(result.output, "code")
    assert tables, result.output
    assert all(t[1] == "severity" for t in tables), result.output
    assert all(len(line) <= 80 for line in result.output.splitlines() if "│" in line or "┃" in line)


def test_the_fed_table_keeps_each_layers_severity_at_80_columns(cli):
    fed = os.path.join(SAMPLES, "federated")
    clients = [os.path.join(fed, f"client{k}.safetensors") for k in (1, 2)]
    result = cli("fed", os.path.join(fed, "global.safetensors"), *clients, width=80)
    (layers,) = _headers(result.output, "layer")
    assert "severity" in layers, result.output
    column = layers.index("severity")
    rows = [line.split("│") for line in result.output.splitlines() if "│" in line and line.split("│")[0].strip()]
    assert [r[column].strip() for r in rows] == ["warning"] * 3, result.output  # BN302 and BN305 are warnings
    assert "0 errors, 6 warnings" in result.output
    assert all(len(line) <= 80 for line in result.output.splitlines() if "│" in line or "┃" in line)


def test_the_layer_table_keeps_the_counter_bn003_cites(cli):
    result = cli("inspect", os.path.join(SAMPLES, "immature.pt"), width=80)
    (layers,) = _headers(result.output, "layer")
    assert "batches" in layers and "after 3 updates" in " ".join(result.output.split())
    # narrower still, the columns no finding cites go first
    narrow = cli("inspect", os.path.join(SAMPLES, "immature.pt"), width=56)
    (layers,) = _headers(narrow.output, "layer")
    assert "batches" in layers and "near-eps" not in layers, narrow.output


def test_a_training_mode_program_groups_its_bn012_findings_into_one_row(cli):
    result = cli("inspect", os.path.join(SAMPLES, "pt2", "training.pt2"), width=80)
    rows = [line for line in result.output.splitlines() if line.startswith("BN012")]
    assert len(rows) == 1 and "3 layers" in rows[0], result.output
    quiet = cli("inspect", os.path.join(SAMPLES, "pt2", "training.pt2"), "-q", width=80)
    assert len([line for line in quiet.output.splitlines() if "BN012" in line]) == 3  # one line a finding


def test_fold_shortens_names_and_never_wraps_them(cli):
    check_wraps_at_spaces(cli, "fold", os.path.join(SAMPLES, "inception_channel.safetensors"))
    result = cli("fold", os.path.join(SAMPLES, "inception_channel.safetensors"), width=60)
    (pairs,) = _headers(result.output, "bn")
    rows = [line for line in result.output.splitlines() if "│" in line and not line.startswith(("BN", " "))]
    assert all(re.match(r"^(features\.\d|head\.\d|…)", line) for line in rows[: len(rows)]), result.output
    assert "bn" in pairs


def test_fold_quiet_prints_one_line_per_finding_and_no_table(cli):
    path = os.path.join(SAMPLES, "inception_channel.safetensors")
    result = cli("fold", path, "-q", width=80)
    lines = result.output.splitlines()
    assert not [line for line in lines if "│" in line or "┃" in line], result.output
    findings = [line for line in lines if re.match(rf"^{re.escape(path)}: \S+: BN2\d\d ", line)]
    assert len(findings) == 2 and lines[-2] == "3 pairs of 3 BN layers: 0 errors, 2 warnings, 0 infos"
    assert lines[-1].startswith("verdict: int8 per-tensor: degraded")


def test_a_shortened_path_keeps_its_file_name():
    from bnaudit.output.names import shorten_names

    names = ["sample_models/lightning/last.ckpt", "sample_models/pt2/eval.pt2", "sample_models/swa/swa.pt"]
    for width in range(8, 34):
        for name, shown in shorten_names(names, width, separators="/").items():
            assert shown.endswith(name.rsplit("/", 1)[1]), (width, shown)


def test_the_files_table_keeps_file_names_at_80_columns(cli):
    result = cli("inspect", SAMPLES, width=80)
    (files,) = _headers(result.output, "file")
    assert files[:2] == ["file", "format"]
    rows = [line.split("│")[0].strip() for line in result.output.splitlines() if line.count("│") == 4]
    # the whole name after the last separator or "…" (the parts left out, separators
    # included), whatever the checkout's path: a long one is shortened more
    names = {name for _, dirs, files in os.walk(SAMPLES) for name in (*dirs, *files)}
    assert rows
    for row in rows:
        leaf = re.split(r"[/…]", row)[-1].split(":")[0]
        assert leaf in names and re.search(r"\.(pt|pth|ckpt|safetensors|onnx|pt2|bin|json)$|^dcp$", leaf), row


def test_gap_quiet_prints_its_findings_one_per_line(cli):
    net = os.path.join(SAMPLES, "digits_net.py") + ":digits_net"
    data = os.path.join(SAMPLES, "data", "digits_val.safetensors")
    args = ("gap", os.path.join(SAMPLES, "dead_channel.safetensors"), "--arch", net, "--data", data)
    quiet = cli(*args, "-q", width=80)
    assert "features.4: BN004 near-eps-variance: " in quiet.output, quiet.output
    assert not _headers(quiet.output, "code"), quiet.output  # no findings table
    assert _headers(cli(*args, width=80).output, "code")[0][1] == "severity"

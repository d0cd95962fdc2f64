"""Output that grows with the problems, not with the model: identical findings collapse
into one row, healthy files are one line of a files table, `--quiet` prints one line per
finding, and tables fit 80 columns without breaking a word."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil

import pytest
import torch
from conftest import SAMPLES, train_classifier
from safetensors.torch import load_file, save_file
from torch import nn

from bnaudit.output.fit import shorten_middle

CALIB = os.path.join(SAMPLES, "data", "digits_calib.safetensors")
BLOCKS = 8


class DeepDigits(nn.Module):
    """Eight conv-BN-ReLU blocks under long, realistic names (timm-like nesting)."""

    def __init__(self) -> None:
        super().__init__()
        blocks = []
        for i in range(BLOCKS):
            blocks.append(
                nn.Sequential(
                    nn.Conv2d(1 if i == 0 else 8, 8, 3, padding=1, bias=False),
                    nn.BatchNorm2d(8),
                    nn.ReLU(),
                )
            )
        self.backbone_encoder_stages = nn.ModuleDict({"residual_stage_number_three": nn.Sequential(*blocks)})
        self.head = nn.Linear(8 * 64, 10)

    def forward(self, x):
        return self.head(self.backbone_encoder_stages["residual_stage_number_three"](x).flatten(1))


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """deep_short.safetensors: DeepDigits after 3 training steps on the bundled digits
    (every BN: 0.9^3 = 72.9%, with the first block's statistics copied into the others: the
    same BN003 finding 8 times); deep_long.safetensors: the
    same model trained 60 steps (no finding)."""
    root = tmp_path_factory.mktemp("volume")
    data = load_file(CALIB)
    torch.manual_seed(0)
    model = DeepDigits()
    train_classifier(model, data["inputs"], data["labels"], steps=3)
    short = {k: v.clone() for k, v in model.state_dict().items()}
    # BN003 states the damage its statistics imply; the same statistics in every block make
    # the 8 findings identical (what this file is about is how identical findings print)
    first = bn_names()[0]
    for name in bn_names()[1:]:
        for stat in ("running_mean", "running_var"):
            short[f"{name}.{stat}"] = short[f"{first}.{stat}"].clone()
    save_file(short, root / "deep_short.safetensors")
    train_classifier(model, data["inputs"], data["labels"], steps=57)
    save_file({k: v.clone() for k, v in model.state_dict().items()}, root / "deep_long.safetensors")
    return root


def bn_names() -> list[str]:
    return [f"backbone_encoder_stages.residual_stage_number_three.{i}.1" for i in range(BLOCKS)]


def test_identical_findings_collapse_into_one_row_and_json_keeps_each(cli, deep):
    path = str(deep / "deep_short.safetensors")
    doc = json.loads(cli("inspect", path, "--format", "json").stdout)
    findings = doc["files"][0]["findings"]
    assert [(f["code"], f["layer"]) for f in findings] == [("BN003", n) for n in bn_names()]
    lines = cli("inspect", path, width=200).stdout.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("BN003")]
    assert len(starts) == 1  # one row for 8 identical findings
    row = [[c.strip() for c in line.split("│")] for line in lines[starts[0] :] if "│" in line]
    layer_cell = " ".join(cells[2] for cells in row).replace("… ", "…")
    assert layer_cell.startswith("8 layers (") and layer_cell.endswith("and 5 more)")
    assert layer_cell.count("…") == 3  # three names shown, each shortened in the middle
    assert " ".join(cells[3] for cells in row if cells[3]) == findings[0]["message"]
    assert "72.9% after 3 updates" in findings[0]["message"]


def test_several_files_healthy_ones_are_a_line_of_the_files_table(cli, deep):
    healthy = os.path.join(SAMPLES, "healthy.pt")
    broken = os.path.join(SAMPLES, "nan_stats.pt")
    long = str(deep / "deep_long.safetensors")
    out = cli("inspect", healthy, broken, long, width=200).stdout
    lines = out.splitlines()
    header = [h.strip() for h in lines[0].split("┃")]
    assert header == ["file", "format", "layers", "worst gain", "status"]
    rows = {cells[0]: cells[1:] for cells in ([c.strip() for c in line.split("│")] for line in lines[2:5])}
    # worst gain: the largest |gamma|/sqrt(var+eps) over the file, computed here from the tensors
    state = load_file(long)
    gains = [
        (state[f"{n}.weight"].double().abs() / (state[f"{n}.running_var"].double() + 1e-5).sqrt()).max().item()
        for n in bn_names()
    ]
    assert rows[long] == ["safetensors", str(BLOCKS), f"{max(gains):.3g}", "ok"]
    assert rows[healthy][0] == "torch-zip" and rows[healthy][1:] == ["3", "7.48", "ok"]
    assert rows[broken][-1] == "error"
    # a layer table only for the file with findings
    titles = [line for line in lines if line.endswith(("(torch-zip)", "(safetensors)"))]
    assert titles == [f"{broken}  (torch-zip)"]
    assert "--layers shows their layer tables" in out
    every = cli("inspect", healthy, broken, long, "--layers", width=200).stdout
    titles = [line for line in every.splitlines() if line.endswith(("(torch-zip)", "(safetensors)"))]
    assert titles == [f"{healthy}  (torch-zip)", f"{broken}  (torch-zip)", f"{long}  (safetensors)"]
    # one file keeps its layer table, no files table
    one = cli("inspect", healthy, width=200).stdout.splitlines()
    assert one[0] == f"{healthy}  (torch-zip)" and not any(line.startswith("file ") for line in one)


def test_quiet_prints_one_concise_line_per_finding(cli, deep):
    short = str(deep / "deep_short.safetensors")
    broken = os.path.join(SAMPLES, "nan_stats.pt")
    healthy = os.path.join(SAMPLES, "healthy.pt")
    result = cli("inspect", healthy, short, broken, "-q")
    assert result.exit_code == 1
    doc = json.loads(cli("inspect", healthy, short, broken, "--format", "json").stdout)
    expected = [
        f"{file['path']}: {f['layer']}: {f['code']} {f['name']}: {f['message']}"
        for file in doc["files"]
        for f in file["findings"]
    ]
    assert len(expected) == BLOCKS + 1
    s = doc["summary"]
    summary = f"3 files, {s['layers']} BN layers: 9 errors, 0 warnings, 0 infos"
    assert result.stdout.splitlines() == [*expected, summary]


def segments_pattern(shown: str) -> re.Pattern[str]:
    """A shortened name as a pattern: each "…" one or more whole segments (with the
    separators around them), the rest as written."""
    parts = shown.split("…")
    regex = re.escape(parts[0])
    for before, part in itertools.pairwise(parts):
        regex += ("[./]" if before else "") + r"[^./]+(?:[./][^./]+)*" + ("[./]" if part else "") + re.escape(part)
    return re.compile(regex)


def test_tables_fit_80_columns_without_breaking_a_word(cli, deep, tmp_path):
    # a copy whose layer names are longer than any column can hold
    state = load_file(str(deep / "deep_short.safetensors"))
    renamed = {
        k.replace("backbone_encoder_stages", "model.backbone_encoder_stages_of_a_very_deep_network"): v
        for k, v in state.items()
    }
    long_names = save_path = tmp_path / "renamed.safetensors"
    save_file(renamed, save_path)
    shutil.copy(os.path.join(SAMPLES, "immature.pt"), tmp_path / "immature.pt")
    result = cli("inspect", str(long_names), str(tmp_path / "immature.pt"), width=80)
    lines = result.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines[:-1]), [line for line in lines if len(line) > 80]
    headers = [line for line in lines if line.startswith("layer ")]
    assert len(headers) == 2 and headers[0].split() == headers[1].split()  # the same columns in every file
    # immature.pt's BN003 cites its counter: batches stays (issue 34)
    assert "dropped to fit 80 columns: mean range, var median / max" in result.stdout
    # every word printed is whole: a layer name is either complete or shortened in the middle
    full = [
        n.replace("backbone_encoder_stages", "model.backbone_encoder_stages_of_a_very_deep_network") for n in bn_names()
    ]
    layer_rows = [line for line in lines if "│" in line and not line.startswith(("BN", " ")) and "-zip │" not in line]
    cells = [cell for cell in (line.split("│")[0].strip() for line in layer_rows) if "…" in cell]
    cells = [cell for cell in cells if not cell.endswith((".safetensors", ".pt"))]  # the files table's paths
    assert cells, "no layer name was shortened"
    for cell in cells:
        # whole segments around each "…", and the name of one layer only
        assert len([n for n in full if segments_pattern(cell).fullmatch(n)]) == 1, cell
    # the message column, read down its lines, is the message with whole words
    doc = json.loads(cli("inspect", str(long_names), "--format", "json").stdout)
    message = doc["files"][0]["findings"][0]["message"]
    start = next(i for i, line in enumerate(lines) if line.startswith("BN003"))
    column = []
    for line in lines[start:]:
        if "│" not in line:
            break
        column.append(line.split("│")[-1].strip())
    assert " ".join(c for c in column if c) == message


def test_shorten_middle_keeps_whole_segments():
    assert shorten_middle("backbone.layer3.0.bn1", 30) == "backbone.layer3.0.bn1"
    assert shorten_middle("backbone.layer3.0.bn1", 14) == "…layer3.0.bn1"
    assert shorten_middle("backbone.layer3.0.bn1", 11) == "backbone…"
    assert len(shorten_middle("x" * 100, 24)) == 24

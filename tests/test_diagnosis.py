"""Issue #13 part A: drift attributed to channels and to the layer where it starts, the
input suspected before the statistics (gap and recalibrate), confidence intervals, and
data the way people have it (.npy/.npz, uint8, wrong dtype or channel count, text labels).

Built on the sample digits CNN (trained by sample_models/generate.py) and its real data."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import count_data_reads
from safetensors.numpy import load_file

from bnaudit.errors import BnauditError
from bnaudit.runtime.attribution import ORIGIN_JUMP, find_origins
from bnaudit.runtime.confidence import difference_interval, wilson
from bnaudit.runtime.data import DataOptions, make_loader
from bnaudit.runtime.gap import measure_gap
from bnaudit.runtime.models import ModelSpec

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]
SAMPLES = REPO / "sample_models"
ARCH = f"{SAMPLES / 'digits_net.py'}:digits_net"
HEALTHY = str(SAMPLES / "healthy.pt")
VAL = str(SAMPLES / "data" / "digits_val.safetensors")
IMAGES = str(SAMPLES / "data" / "digits_images")


def _val_arrays():
    d = load_file(VAL)
    return d["inputs"], d["labels"]


def _gap(checkpoint, **data):
    return measure_gap(ModelSpec(checkpoint, arch=ARCH), DataOptions(batch_size=64, **data))


# ------------------------------------------------------------------ attribution


def test_one_broken_channel_in_layer_two_is_ranked_first_and_named(tmp_path):
    state = torch.load(HEALTHY)
    state["features.4.running_var"][5] = 1e-9
    torch.save(state, tmp_path / "broken.pt")
    report = _gap(str(tmp_path / "broken.pt"), path=VAL)
    by_name = {d.name: d for d in report.layers}
    # The trap: the layer after it drifts far more on average (it inherits an amplified
    # channel); ranking by that would blame head.2.
    assert by_name["head.2"].drift > 10 * by_name["features.4"].drift
    assert report.layers[0].name == "features.4" and report.layers[0].origin
    assert [d.name for d in report.layers if d.origin] == ["features.4"]
    worst = report.layers[0].worst[0]
    assert worst.index == 5
    assert worst.running_var == pytest.approx(1e-9)
    eps = 1e-5
    assert worst.log_var_ratio == pytest.approx(abs(math.log((worst.data_var + eps) / (1e-9 + eps))), rel=1e-9)
    drift_line = next(line for line in report.diagnosis if line.startswith("Drift starts at"))
    assert drift_line.startswith("Drift starts at features.4")
    assert "Worst channel of features.4: 5 " in drift_line
    assert not report.preprocessing_mismatch


def test_table_shows_the_worst_channel_and_json_the_top_channels(tmp_path, cli):
    state = torch.load(HEALTHY)
    state["features.4.running_var"][5] = 1e-9
    torch.save(state, tmp_path / "broken.pt")
    table = cli("gap", str(tmp_path / "broken.pt"), "--arch", ARCH, "--data", VAL, width=100)
    row = next(line for line in table.output.splitlines() if line.startswith("features.4"))
    assert "2*" in row and row.rstrip().split("│")[-1].strip().startswith("5: ")
    doc = json.loads(cli("gap", str(tmp_path / "broken.pt"), "--arch", ARCH, "--data", VAL, "-f", "json").output)
    layer = doc["layers"][0]
    assert layer["name"] == "features.4" and layer["origin"] is True
    assert layer["worst_channels"][0]["index"] == 5 and len(layer["worst_channels"]) == 5
    drifts = [c["drift"] for c in layer["worst_channels"]]
    assert drifts == sorted(drifts, reverse=True)


def test_origin_rule_on_healthy_globally_shifted_and_two_source_sequences():
    assert find_origins([False, False, False], [0.1, 0.2, 0.3]) == [False, False, False]
    # a global shift: every layer large, later peaks inherit (within ORIGIN_JUMP)
    assert find_origins([True, True, True], [3.0, 20.0, 60.0]) == [True, False, False]
    # a second, far stronger source downstream of a mild one
    assert find_origins([True, False, True], [2.5, 0.3, 2.5 * ORIGIN_JUMP + 1]) == [True, False, True]


def test_healthy_model_has_no_origin_and_no_preprocessing_suspicion():
    report = _gap(HEALTHY, path=VAL)
    assert not any(d.origin or d.large for d in report.layers)
    assert not report.preprocessing_mismatch
    assert report.findings == []


# ------------------------------------------------------------------ preprocessing


@pytest.mark.parametrize("how", ["mean-std", "x255"])
def test_wrong_preprocessing_is_diagnosed_before_the_statistics(tmp_path, how):
    if how == "mean-std":
        report = _gap(HEALTHY, path=IMAGES, grayscale=True, mean=(0.5,), std=(0.5,))
        expected_mean, expected_std = (
            [(m * 0.5 + 0.5) for m in report.input_mean],
            [s * 0.5 for s in report.input_std],
        )
    else:
        x, y = _val_arrays()
        np.savez(tmp_path / "x255.npz", inputs=x * 255.0, labels=y)
        report = _gap(HEALTHY, path=str(tmp_path / "x255.npz"))
        expected_mean = [float(x.mean())]
        expected_std = [float(x.std(ddof=1))]
    assert report.findings == []  # the checkpoint itself is healthy
    assert report.preprocessing_mismatch
    assert report.diagnosis[0].startswith("Suspect the input preprocessing before the statistics")
    assert not any("recalibrat" in line.lower() for line in report.diagnosis)
    assert report.layers[0].name == "features.1" and report.layers[0].origin
    # what the first layer's statistics imply is what the model was trained on
    assert report.implied_mean == pytest.approx(expected_mean, rel=0.1)
    assert report.implied_std == pytest.approx(expected_std, rel=0.1)
    line = report.diagnosis[0]
    assert f"mean {report.input_mean[0]:.3g}" in line and f"mean {report.implied_mean[0]:.3g}" in line


def test_preprocessing_diagnosis_through_the_cli(cli):
    result = cli(
        "gap", HEALTHY, "--arch", ARCH, "--data", IMAGES, "--grayscale", "--mean", "0.5", "--std", "0.5", width=100
    )
    assert result.exit_code == 0
    diagnosis = result.output.split("\ndiagnosis\n", 1)[1]
    assert diagnosis.split("-", 1)[1].lstrip().startswith("Suspect the input preprocessing")
    assert "recalibrat" not in diagnosis.lower()
    assert cli("inspect", HEALTHY).exit_code == 0


def test_recalibrate_refuses_the_mismatch_unless_allowed_and_never_a_reset_model(tmp_path, cli):
    wrong = ("--data", IMAGES, "--grayscale", "--mean", "0.5", "--std", "0.5")
    out = tmp_path / "recal.pt"
    refused = cli("recalibrate", HEALTHY, "--arch", ARCH, "-o", str(out), *wrong)
    assert refused.exit_code == 2 and not out.exists()
    assert "first BN layer features.1" in refused.stderr and "--allow-input-mismatch" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and "Traceback" not in refused.output
    allowed = cli("recalibrate", HEALTHY, "--arch", ARCH, "-o", str(out), *wrong, "--allow-input-mismatch", "-q")
    assert allowed.exit_code == 0 and out.exists()
    reset = tmp_path / "reset.recal.pt"
    fixed = cli("recalibrate", str(SAMPLES / "reset_stats.pt"), "--arch", ARCH, "-o", str(reset), *wrong, "-q")
    assert fixed.exit_code == 0 and reset.exists()
    # correctly preprocessed calibration data is never refused
    good = tmp_path / "good.pt"
    calib = str(SAMPLES / "data" / "digits_calib.safetensors")
    assert cli("recalibrate", HEALTHY, "--arch", ARCH, "-o", str(good), "--data", calib, "-q").exit_code == 0


# ------------------------------------------------------------------ confidence


@pytest.mark.parametrize("k,n", [(0, 10), (10, 10), (47, 100), (395, 400), (1, 3)])
def test_wilson_interval_solves_its_defining_quadratic(k, n):
    # Wilson's bounds are the p with |p_hat - p| = z sqrt(p (1 - p) / n): the roots of
    # (1 + z^2/n) p^2 - (2 p_hat + z^2/n) p + p_hat^2 = 0.
    z, p_hat = 1.96, k / n
    roots = sorted(np.roots([1 + z * z / n, -(2 * p_hat + z * z / n), p_hat * p_hat]).real)
    assert wilson(k, n) == pytest.approx((max(roots[0], 0.0), min(roots[1], 1.0)), abs=1e-12)


def test_gap_interval_and_counts_in_the_report():
    report = _gap(HEALTHY, path=VAL)
    n = report.labelled
    assert n == 400 == report.samples
    k_train, k_eval = round(report.train_accuracy * n), round(report.eval_accuracy * n)
    assert report.train_interval == wilson(k_train, n) and report.eval_interval == wilson(k_eval, n)
    low, high = difference_interval(k_train, k_eval, n)
    # Newcombe from the two Wilson intervals, written out here
    (l1, u1), (l2, u2) = wilson(k_train, n), wilson(k_eval, n)
    p1, p2 = k_train / n, k_eval / n
    assert low == pytest.approx(p1 - p2 - math.hypot(p1 - l1, u2 - p2), abs=1e-15)
    assert high == pytest.approx(p1 - p2 + math.hypot(u1 - p1, p2 - l2), abs=1e-15)
    assert report.gap_interval == (low, high) and report.gap_significant is False


def test_max_gap_is_not_tripped_by_an_insignificant_gap_unless_strict(tmp_path, cli):
    # 100 images: train- and eval-mode accuracies are equal (gap 0); a limit below 0 is
    # exceeded by a gap whose interval contains 0.
    args = ("gap", HEALTHY, "--arch", ARCH, "--data", IMAGES, "--grayscale", "--max-gap", "-0.005")
    loose = cli(*args)
    assert loose.exit_code == 0, loose.output
    assert "not significant" in loose.output
    assert "exceeds --max-gap -0.005 but its 95% interval contains 0" in " ".join(loose.output.split())
    assert cli(*args, "--strict").exit_code == 1
    state = torch.load(HEALTHY)
    state["features.4.running_var"][5] = 1e-9
    torch.save(state, tmp_path / "broken.pt")
    # a real, significant gap fails without --strict
    assert cli("gap", str(tmp_path / "broken.pt"), "--arch", ARCH, "--data", VAL, "--max-gap", "0.1").exit_code == 1


def test_torchscript_gap_prints_one_line_instead_of_empty_rows(tmp_path, cli):
    sys.path.insert(0, str(SAMPLES))
    try:
        from digits_net import digits_net
    finally:
        sys.path.remove(str(SAMPLES))
    model = digits_net()
    model.load_state_dict(torch.load(HEALTHY))
    model.eval()
    torch.jit.script(model).save(str(tmp_path / "scripted.pt"))
    result = cli("gap", str(tmp_path / "scripted.pt"), "--data", VAL, width=100)
    assert result.exit_code == 0
    lines = result.output.splitlines()
    assert not any(line.startswith(("features.1", "features.4", "head.2")) for line in lines)
    start = next(i for i, line in enumerate(lines) if line.startswith("per-layer drift: not measured"))
    assert "--arch" in lines[start] + lines[start + 1]


# ------------------------------------------------------------------ data


@pytest.mark.parametrize("kind", ["npy", "npz", "npz-xy", "npz-compressed", "npz-single"])
def test_numpy_files_read_batch_by_batch(tmp_path, monkeypatch, kind):
    x = np.arange(40 * 3 * 4, dtype=np.float32).reshape(40, 3, 4)
    y = np.arange(40) % 3
    path = tmp_path / ("d.npy" if kind == "npy" else "d.npz")
    if kind == "npy":
        np.save(path, x)
    elif kind == "npz":
        np.savez(path, inputs=x, labels=y)
    elif kind == "npz-xy":
        np.savez(path, x=x, y=y)
    elif kind == "npz-compressed":
        np.savez_compressed(path, inputs=x, labels=y)
    else:
        np.savez(path, images=x)
    read = count_data_reads(monkeypatch)
    stream = make_loader(DataOptions(path=str(path), batch_size=8, seed=3))
    batches = list(stream)
    inputs = torch.cat([b.inputs for b in batches])
    rows = inputs[:, 0, 0].long() // 12
    assert sorted(rows.tolist()) == list(range(40)) and rows.tolist() != list(range(40))
    assert torch.equal(inputs, torch.from_numpy(x)[rows])
    labelled = kind in ("npz", "npz-xy", "npz-compressed")
    assert stream.has_labels is labelled
    if labelled:
        assert torch.equal(torch.cat([b.labels for b in batches]), torch.from_numpy(y)[rows])
    if kind == "npz-compressed":
        assert read == []  # inflated whole: numpy cannot read it in place
    else:
        assert sum(read) == x.nbytes and all(n % (3 * 4 * 4) == 0 for n in read)  # whole rows, each once


def test_a_folder_of_numpy_shards(tmp_path):
    x, y = _val_arrays()
    (tmp_path / "shards").mkdir()
    np.savez(tmp_path / "shards" / "a.npz", inputs=x[:200], labels=y[:200])
    np.savez(tmp_path / "shards" / "b.npz", inputs=x[200:], labels=y[200:])
    sharded = _gap(HEALTHY, path=str(tmp_path / "shards"))
    whole = _gap(HEALTHY, path=VAL)
    assert sharded.eval_accuracy == whole.eval_accuracy and sharded.train_accuracy == whole.train_accuracy


def test_uint8_images_become_floats_in_0_1_with_a_note(tmp_path, cli):
    x, y = _val_arrays()
    as_bytes = np.round(x * 255).astype(np.uint8)
    np.savez(tmp_path / "u8.npz", inputs=as_bytes, labels=y)
    report = _gap(HEALTHY, path=str(tmp_path / "u8.npz"))
    np.savez(tmp_path / "f.npz", inputs=as_bytes.astype(np.float32) / 255, labels=y)
    reference = _gap(HEALTHY, path=str(tmp_path / "f.npz"))
    assert report.eval_accuracy == reference.eval_accuracy and report.train_accuracy == reference.train_accuracy
    assert report.notes == ["inputs are uint8: converted to float32 x / 255 in [0, 1]"] and reference.notes == []
    assert "note: inputs are uint8" in cli("gap", HEALTHY, "--arch", ARCH, "--data", str(tmp_path / "u8.npz")).output


def test_inputs_of_another_dtype_name_the_expected_one(tmp_path, cli):
    x, y = _val_arrays()
    np.savez(tmp_path / "i64.npz", inputs=(x * 255).astype(np.int64), labels=y)
    result = cli("gap", HEALTHY, "--arch", ARCH, "--data", str(tmp_path / "i64.npz"))
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        "bnaudit: error: batch 0: the model rejects the batch in train mode (batch statistics): "
        "layer 'features.0' (Conv2d) got input shape [64, 1, 8, 8]: the inputs are int64 but the model expects float32 (the dtype of its parameters): "
        "store the inputs as float32 (uint8 images are converted to [0, 1] by themselves)"
    ]


@pytest.mark.parametrize("command", ["gap", "invariance", "recalibrate"])
def test_channel_count_mismatch_names_both_counts_and_the_option(cli, tmp_path, command):
    extra = ("-o", str(tmp_path / "out.pt")) if command == "recalibrate" else ()
    rgb = cli(command, HEALTHY, "--arch", ARCH, "--data", IMAGES, *extra)
    assert rgb.exit_code == 2
    assert "the inputs have 3 channels but the model's first layer features.0 expects 1: pass --grayscale" in (
        rgb.stderr
    )
    assert len(rgb.stderr.strip().splitlines()) == 1 and not (tmp_path / "out.pt").exists()


def test_text_labels_in_a_custom_dataset_are_one_line(tmp_path, monkeypatch):
    (tmp_path / "textlabels.py").write_text(
        "import torch\n"
        "class D(torch.utils.data.Dataset):\n"
        "    def __len__(self): return 4\n"
        "    def __getitem__(self, i): return torch.zeros(3), ['cat', 'dog'][i % 2]\n"
        "def make(): return D()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(BnauditError) as info:
        make_loader(DataOptions(dataset="textlabels:make", batch_size=2))
    assert str(info.value) == (
        "--dataset textlabels:make: item 0 has the label 'cat': labels must be integer class indices "
        "(map the class names to 0..K-1 in the dataset)"
    )


def test_one_broken_channel_in_the_first_layer_is_not_called_preprocessing(tmp_path):
    # The first layer is large, but through one channel (1 of 8), not broadly: a broken
    # statistic, where re-estimating is the right advice.
    state = torch.load(HEALTHY)
    state["features.1.running_var"][3] = 1e-9
    torch.save(state, tmp_path / "first.pt")
    report = _gap(str(tmp_path / "first.pt"), path=VAL)
    assert report.layers[0].name == "features.1" and report.layers[0].origin
    assert report.layers[0].broad == pytest.approx(1 / 8)
    assert not report.preprocessing_mismatch
    assert any(line.startswith("Drift starts at features.1, where BN004") for line in report.diagnosis)

"""`bnaudit diff model.pt model.onnx`: real exports of a trained model with both torch
exporters (legacy dynamo=False and dynamo=True), BatchNormalization nodes kept and folded
(the default), then broken the ways users break them. Every expectation comes from the
test's own reading of the graph with the `onnx` package and its own numpy arithmetic."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import re
import sys
import warnings

import numpy as np
import onnx
import pytest
import torch
from conftest import SAMPLES, save_safetensors, save_torch, train_classifier
from onnx import numpy_helper
from safetensors.torch import load_file

from bnaudit.api import inspect
from bnaudit.audit.diff.checkpoints import diff
from bnaudit.config import Config

sys.path.insert(0, SAMPLES)
from digits_net import digits_net

torch.set_num_threads(1)
ARCH = os.path.join(SAMPLES, "digits_net.py") + ":digits_net"
BN_LAYERS = ("features.1", "features.4", "head.2")


@pytest.fixture(scope="module")
def digits():
    data = load_file(os.path.join(SAMPLES, "data", "digits_calib.safetensors"))
    return data["inputs"], data["labels"]


@pytest.fixture(scope="module")
def trained(digits):
    torch.manual_seed(0)
    return train_classifier(digits_net(), *digits, steps=30).eval()


def export(model, path, dynamo: bool, keep: bool, **kw) -> str:
    """torch.onnx.export in eval mode with a batch of 2; keep: BatchNormalization nodes kept."""
    x = torch.zeros(2, 1, 8, 8)
    options = dict(dynamo=dynamo, **kw)
    if keep:
        options["optimize" if dynamo else "do_constant_folding"] = False
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (x,), str(path), **options)
    return str(path)


@pytest.fixture(scope="module")
def folder(tmp_path_factory, trained):
    f = tmp_path_factory.mktemp("export")
    save_torch(trained.state_dict(), f / "model.pt")
    for dynamo in (False, True):
        for keep in (False, True):
            export(trained, f / f"{'dynamo' if dynamo else 'legacy'}_{'kept' if keep else 'folded'}.onnx", dynamo, keep)
    return f


def bn_nodes(path) -> list:
    return [n for n in onnx.load(str(path)).graph.node if n.op_type == "BatchNormalization"]


def codes(report) -> set[tuple[str, str, str | None]]:
    return {(f.code, f.severity, f.layer) for f in report.findings}


def rewrite(src, dst, edit) -> str:
    model = onnx.load(str(src))
    edit(model)
    onnx.save(model, str(dst))
    return str(dst)


def set_initializer(model, name, array) -> None:
    for i, t in enumerate(model.graph.initializer):
        if t.name == name:
            model.graph.initializer[i].CopyFrom(numpy_helper.from_array(array, name))
            return
    raise KeyError(name)


# ----------------------------------------------------------------------------- correct exports


@pytest.mark.parametrize("name", ["legacy_kept", "dynamo_kept", "legacy_folded", "dynamo_folded"])
def test_correct_export_reports_no_difference(folder, name):
    path = folder / f"{name}.onnx"
    report = diff(str(folder / "model.pt"), str(path), Config())
    kept = bn_nodes(path)
    assert report.findings == [] and report.exit_code() == 0
    assert report.export is not None and report.export.unpaired == []
    # the test's reading: the layers with a node are matched, every other BN layer is folded
    with_node = [layer for layer in BN_LAYERS if any(f"{layer}.running_var" in n.input for n in kept)]
    assert [n.name for n in report.export.nodes] == with_node
    folded = {f.name for f in report.export.folded}
    assert folded | {n.name for n in report.export.nodes} == set(BN_LAYERS)
    assert all(f.check.matches for f in report.export.folded)
    if name.endswith("kept"):
        assert len(kept) == 3 and folded == set()
    else:
        assert folded, "torch's default export folds BN into the conv before it"


def test_what_each_exporter_writes(folder):
    """Pinned premises (torch 2.13): the dynamo exporter folds all three BN layers (Linear+BN1d
    into Gemm too) and keeps initializer names; the legacy one folds the two conv BNs, keeps
    head.2 after its MatMul, and renames the folded weights (onnx::Conv_N)."""
    assert bn_nodes(folder / "dynamo_folded.onnx") == []
    legacy = onnx.load(str(folder / "legacy_folded.onnx"))
    assert [n.name for n in legacy.graph.node if n.op_type == "BatchNormalization"] == [
        "/head/head.2/BatchNormalization"
    ]
    conv_weights = [n.input[1] for n in legacy.graph.node if n.op_type == "Conv"]
    assert all(w.startswith("onnx::") for w in conv_weights)


def implied_eps_numpy(onnx_path, node_index, conv_weight, gamma, var):
    """The test's own solve: least-squares scale per channel, eps = (gamma/s)^2 - var on the
    channel of smallest variance."""
    model = onnx.load(str(onnx_path))
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    conv = [n for n in model.graph.node if n.op_type == "Conv"][node_index]
    w = inits[conv.input[1]].astype(np.float64).reshape(len(gamma), -1)
    c = conv_weight.double().numpy().reshape(len(gamma), -1)
    s = (w * c).sum(1) / (c * c).sum(1)
    k = int(np.argmin(var))
    return (gamma[k] / s[k]) ** 2 - var[k]


def test_folded_layers_report_the_eps_the_export_implies(folder, trained):
    report = diff(str(folder / "model.pt"), str(folder / "legacy_folded.onnx"))
    sd = trained.state_dict()
    by = {f.name: f for f in report.export.folded}
    for index, (bn, conv) in enumerate((("features.1", "features.0"), ("features.4", "features.3"))):
        expected = implied_eps_numpy(
            folder / "legacy_folded.onnx",
            index,
            sd[f"{conv}.weight"],
            sd[f"{bn}.weight"].double().numpy(),
            sd[f"{bn}.running_var"].double().numpy(),
        )
        assert by[bn].conv == conv
        assert by[bn].check.implied_eps == pytest.approx(expected, rel=1e-3)
        assert by[bn].check.implied_eps == pytest.approx(1e-5, rel=0.05)
    assert "names and key order" in report.export.pairing


# ----------------------------------------------------------------------------- broken kept nodes


def test_training_mode_export_is_bn012_on_every_node(folder, trained):
    """BN012, as inspect reports it (BN111, diff's former code, is its alias)."""
    path = export(
        copy.deepcopy(trained), folder / "training.onnx", False, True, training=torch.onnx.TrainingMode.TRAINING
    )
    flagged = [n.name for n in bn_nodes(path) if any(a.name == "training_mode" and a.i == 1 for a in n.attribute)]
    assert len(flagged) == 3  # the test's reading of the graph
    report = diff(str(folder / "model.pt"), path)
    assert {(c, layer) for c, s, layer in codes(report) if c in ("BN012", "BN111")} == {("BN012", n) for n in BN_LAYERS}


def test_a_differing_export_is_diagnosed_without_data(folder, trained, tmp_path):
    """Without --data (no outputs compared) the diagnosis still says what differs."""
    path = export(copy.deepcopy(trained), tmp_path / "t.onnx", False, True, training=torch.onnx.TrainingMode.TRAINING)
    report = diff(str(folder / "model.pt"), path)
    [line] = report.diagnosis()
    assert line.startswith("The export differs from the checkpoint: 3 BatchNormalization node(s) run in training mode")


def test_eps_rewritten_to_1e3_is_bn109(folder, tmp_path):
    def edit(model):
        for n in model.graph.node:
            if n.op_type == "BatchNormalization":
                for a in n.attribute:
                    if a.name == "epsilon":
                        a.f = 1e-3

    path = rewrite(folder / "legacy_kept.onnx", tmp_path / "eps.onnx", edit)
    # a state dict holds no eps: 1e-5 is only assumed, so the difference is a note
    report = diff(str(folder / "model.pt"), path)
    assert codes(report) == {("BN109", "info", layer) for layer in BN_LAYERS}
    assert "epsilon 0.001 in the export; the checkpoint holds no modules" in report.findings[0].message
    assert "(1e-05 assumed)" in report.findings[0].message
    # the eps given by --eps is what the user says the model uses: 1e-5 is contradicted
    given = diff(str(folder / "model.pt"), path, Config(eps=1e-5))
    assert codes(given) == {("BN109", "error", layer) for layer in BN_LAYERS}
    assert "epsilon 0.001 in the export, eps 1e-05 (given by --eps)" in given.findings[0].message
    # the module's own eps from --eps is the reference: 1e-3 then matches
    assert diff(str(folder / "model.pt"), path, Config(eps=1e-3)).findings == []


def test_momentum_written_in_pytorch_convention_is_bn110(folder, tmp_path):
    def edit(model):
        for n in model.graph.node:
            if n.op_type == "BatchNormalization":
                for a in n.attribute:
                    if a.name == "momentum":
                        a.f = 0.1

    path = rewrite(folder / "legacy_kept.onnx", tmp_path / "momentum.onnx", edit)
    # a state dict holds no momentum: 0.1 is only assumed, so the difference is a note
    report = diff(str(folder / "model.pt"), path)
    assert codes(report) == {("BN110", "info", layer) for layer in BN_LAYERS}
    assert "without conversion" in report.findings[0].message and "--momentum 0.9" in report.findings[0].message
    given = diff(str(folder / "model.pt"), path, Config(momentum=0.1))
    assert codes(given) == {("BN110", "warning", layer) for layer in BN_LAYERS}
    assert "without conversion" in given.findings[0].message


def test_bn110_and_bn007_are_different_facts(folder, tmp_path):
    """BN110 compares the node's momentum with the checkpoint's (known or given); BN007 judges
    the node's value alone (a PyTorch momentum above 0.5). Each fires where the other cannot,
    so they are two codes, not one fact under two names."""
    # a correctly converted default (ONNX 0.9 = PyTorch 0.1) against a model built with 0.01:
    # the expected ONNX value is 1 - 0.01 = 0.99, so BN110; the value 0.1 alone is ordinary
    kept = str(folder / "legacy_kept.onnx")
    mismatch = diff(str(folder / "model.pt"), kept, Config(momentum=0.01))
    assert codes(mismatch) == {("BN110", "warning", layer) for layer in BN_LAYERS}
    assert "expected 0.99 = 1 - PyTorch momentum 0.01" in mismatch.findings[0].message
    assert "BN007" not in {f.code for f in inspect(kept).findings}

    # ONNX 0.1 from a model really built with PyTorch 0.9 (1 - 0.9 = 0.1, converted): the
    # comparison agrees, yet the value alone reads as PyTorch 0.9 and BN007 warns
    def edit(model):
        for n in model.graph.node:
            if n.op_type == "BatchNormalization":
                for a in n.attribute:
                    if a.name == "momentum":
                        a.f = 0.1

    path = rewrite(folder / "legacy_kept.onnx", tmp_path / "momentum.onnx", edit)
    assert diff(str(folder / "model.pt"), path, Config(momentum=0.9)).findings == []
    bn007 = {(f.code, f.severity, f.layer) for f in inspect(path).findings}
    assert bn007 == {("BN007", "warning", layer) for layer in BN_LAYERS}


def test_one_reset_variance_is_bn108_on_that_layer_only(folder, tmp_path, trained):
    path = rewrite(
        folder / "legacy_kept.onnx",
        tmp_path / "reset.onnx",
        lambda m: set_initializer(m, "features.4.running_var", np.ones(16, np.float32)),
    )
    report = diff(str(folder / "model.pt"), path)
    assert codes(report) == {("BN108", "error", "features.4")}
    expected = (trained.state_dict()["features.4.running_var"].double() - 1).abs().max().item()
    assert f"max |difference| {expected:.3g}" in report.findings[0].message
    assert "1 in every channel" in report.findings[0].message
    by = {d.name: d for d in report.layers}
    assert by["features.4"].verdict == "differs from checkpoint" and by["features.1"].verdict == "unchanged"


def test_float16_statistics_are_a_rounding_warning(folder, tmp_path, trained):
    sd = trained.state_dict()

    def edit(model):
        for layer in BN_LAYERS:
            for t in ("running_mean", "running_var"):
                set_initializer(model, f"{layer}.{t}", sd[f"{layer}.{t}"].numpy().astype(np.float16))

    path = rewrite(folder / "legacy_kept.onnx", tmp_path / "fp16.onnx", edit)
    report = diff(str(folder / "model.pt"), path)
    found = codes(report)
    assert found and {c for c, _, _ in found} == {"BN108"} and {s for _, s, _ in found} == {"warning"}
    worst = max(
        float(np.max(np.abs(sd[f"{l}.running_var"].numpy().astype(np.float16).astype(np.float64) - sd[f"{l}.running_var"].double().numpy()) / np.abs(sd[f"{l}.running_var"].double().numpy())))
        for l in ("features.1",)
    )  # fmt: skip
    first = next(f for f in report.findings if f.layer == "features.1" and "running_var" in f.message)
    assert f"max relative error {worst:.3g}" in first.message


def test_renamed_nodes_are_matched_by_order(folder, tmp_path):
    def edit(model):
        renames = {}
        for i, n in enumerate(x for x in model.graph.node if x.op_type == "BatchNormalization"):
            n.name = f"bn_{i}"
            for j in range(1, 5):
                renames[n.input[j]] = f"t{i}_{j}"
                n.input[j] = f"t{i}_{j}"
        for t in model.graph.initializer:
            t.name = renames.get(t.name, t.name)

    path = rewrite(folder / "legacy_kept.onnx", tmp_path / "renamed.onnx", edit)
    report = diff(str(folder / "model.pt"), path)
    assert report.findings == []
    assert report.export.matching == "order and shape"
    assert [n.name for n in report.export.nodes] == list(BN_LAYERS)


def test_external_data_outside_the_folder_is_refused(folder, tmp_path, cli):
    from onnx.external_data_helper import convert_model_to_external_data

    model = onnx.load(str(folder / "legacy_kept.onnx"))
    convert_model_to_external_data(model, all_tensors_to_one_file=True, location="weights.bin", size_threshold=0)
    inner = tmp_path / "model"
    inner.mkdir()
    onnx.save(model, str(inner / "ext.onnx"))
    good = cli("diff", str(folder / "model.pt"), str(inner / "ext.onnx"), "--isolated")
    assert good.exit_code == 0, good.output
    for t in model.graph.initializer:
        if t.name == "features.4.running_var":
            for entry in t.external_data:
                if entry.key == "location":
                    entry.value = "../outside.bin"
    onnx.save_model(model, str(inner / "bad.onnx"))
    (tmp_path / "outside.bin").write_bytes(b"\0" * 64)
    result = cli("diff", str(folder / "model.pt"), str(inner / "bad.onnx"), "--isolated")
    assert result.exit_code == 2
    assert len(result.output.strip().splitlines()) == 1 and "outside.bin" in result.output


# ----------------------------------------------------------------------------- broken folding


@pytest.mark.parametrize("dynamo", [False, True])
def test_reset_statistics_folded_into_the_export_is_bn112(folder, trained, tmp_path, dynamo):
    model = copy.deepcopy(trained)
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.reset_running_stats()
    path = export(model, tmp_path / "reset.onnx", dynamo, False)
    report = diff(str(folder / "model.pt"), path)
    assert {("BN112", "error", "features.1"), ("BN112", "error", "features.4")} <= codes(report)
    message = next(f.message for f in report.findings if f.layer == "features.1")
    assert "identity statistics" in message


def test_stale_statistics_folded_into_the_export_is_bn112(folder, trained, tmp_path, digits):
    newer = copy.deepcopy(trained)
    newer.train()  # the checkpoint's statistics moved on after the export (weights unchanged)
    with torch.no_grad():
        newer(digits[0][:64])
    newer.eval()
    save_torch(newer.state_dict(), tmp_path / "newer.pt")
    path = export(trained, tmp_path / "old.onnx", False, False)
    report = diff(str(tmp_path / "newer.pt"), path)
    assert {"BN112"} <= {c for c, _, _ in codes(report)}
    by = {f.name: f for f in report.export.folded}
    assert not by["features.1"].check.matches and by["features.1"].check.scaled_copy
    assert "not the checkpoint's" in by["features.1"].check.cause


def test_another_eps_folded_is_bn112_with_the_implied_eps(folder, trained, tmp_path):
    model = copy.deepcopy(trained)
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.eps = 1e-3
    path = export(model, tmp_path / "eps.onnx", True, False)
    report = diff(str(folder / "model.pt"), path)
    by = {f.name: f for f in report.export.folded}
    for layer in ("features.1", "features.4"):
        assert not by[layer].check.matches
        assert by[layer].check.implied_eps == pytest.approx(1e-3, rel=0.01)
        assert "eps 0.001 instead of 1e-05" in by[layer].check.cause
    assert by["head.2"].check.matches  # BatchNorm1d kept its eps
    assert {c for c, _, _ in codes(report)} == {"BN112"}


# ----------------------------------------------------------------------------- CLI, --arch, parity


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    data = load_file(os.path.join(SAMPLES, "data", "digits_val.safetensors"))
    path = tmp_path_factory.mktemp("data") / "val.safetensors"
    return save_safetensors({"inputs": data["inputs"][:96], "labels": data["labels"][:96]}, path)


def test_arch_pairs_through_the_model_graph(folder, cli):
    result = cli(
        "diff", str(folder / "model.pt"), str(folder / "dynamo_folded.onnx"), "--arch", ARCH, "-f", "json", "--isolated"
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["export"]["pairing"] == "the model graph (--arch)"
    assert {f["name"]: f["conv"] for f in doc["export"]["folded"]} == {
        "features.1": "features.0",
        "features.4": "features.3",
        "head.2": "head.1",
    }
    assert all(f["matches"] for f in doc["export"]["folded"])


def test_parity_of_a_correct_export_is_within_float32_rounding(folder, data_file, cli):
    result = cli(
        "diff", str(folder / "model.pt"), str(folder / "legacy_kept.onnx"), "--arch", ARCH, "--data", data_file,
        "-f", "json", "--isolated",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    p = json.loads(result.stdout)["export"]["parity"]
    assert p["samples"] == 96 and p["agreement"] == 1.0
    assert p["max_deviation"] <= p["floor"] and not p["deviates"]
    assert p["batch_size"] == 2  # exported with a batch of 2 and no dynamic axes


def test_parity_of_a_training_mode_export_deviates_and_says_why(folder, trained, data_file, cli, tmp_path):
    correct = cli(
        "diff", str(folder / "model.pt"), str(folder / "legacy_kept.onnx"), "--arch", ARCH, "--data", data_file,
        "-f", "json", "--isolated",
    )  # fmt: skip
    floor = json.loads(correct.stdout)["export"]["parity"]["max_deviation"]
    path = export(copy.deepcopy(trained), tmp_path / "t.onnx", False, True, training=torch.onnx.TrainingMode.TRAINING)
    result = cli(
        "diff", str(folder / "model.pt"), path, "--arch", ARCH, "--data", data_file, "-f", "json", "--isolated"
    )
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    p = doc["export"]["parity"]
    assert p["deviates"] and p["max_deviation"] > 100 * max(floor, 1e-7)
    bn114 = [f for f in doc["findings"] if f["code"] == "BN114"]
    assert len(bn114) == 1 and "training mode" in bn114[0]["message"]


def test_cli_formats_and_usage_errors(folder, cli):
    a, b = str(folder / "model.pt"), str(folder / "legacy_folded.onnx")
    table = cli("diff", a, b, "--isolated")
    # the folded-layer table itself: its column header and a row's export node
    assert table.exit_code == 0 and "scale err" in table.stdout
    assert re.search(r"^\S+\s+│ \S*Conv\S* +│ +\d+ │.*│ matches\s*$", table.stdout, re.M)
    sarif = cli("diff", a, b, "-f", "sarif", "--isolated")
    assert sarif.exit_code == 0 and json.loads(sarif.stdout)["runs"][0]["results"] == []
    assert {"BN108", "BN112", "BN114"} <= {
        r["id"] for r in json.loads(sarif.stdout)["runs"][0]["tool"]["driver"]["rules"]
    }
    no_arch = cli("diff", a, b, "--data", "x.safetensors", "--isolated")
    assert no_arch.exit_code == 2 and "--data needs --arch" in no_arch.output


def test_export_as_side_a_is_compared_the_same_way(folder, tmp_path):
    path = rewrite(
        folder / "legacy_kept.onnx",
        tmp_path / "reset.onnx",
        lambda m: set_initializer(m, "features.1.running_var", np.ones(8, np.float32)),
    )
    report = diff(path, str(folder / "model.pt"))
    assert report.export.export_side == "a" and report.a.format == "onnx"
    assert codes(report) == {("BN108", "error", "features.1")}


def test_float64_checkpoint_equals_its_float32_export(folder, trained, tmp_path):
    save_torch(
        {k: v.double() if v.is_floating_point() else v for k, v in trained.state_dict().items()}, tmp_path / "f64.pt"
    )
    for name in ("legacy_kept", "dynamo_folded"):
        report = diff(str(tmp_path / "f64.pt"), str(folder / f"{name}.onnx"))
        assert report.findings == [], name


def test_layer_without_a_conv_to_pair_is_bn113(folder, trained, tmp_path):
    sd = {k: v for k, v in trained.state_dict().items() if k != "features.0.weight"}
    save_torch(sd, tmp_path / "no_conv.pt")
    report = diff(str(tmp_path / "no_conv.pt"), str(folder / "dynamo_folded.onnx"))
    assert codes(report) == {("BN113", "warning", "features.1")}
    assert "no conv with 8 output channels" in report.findings[0].message
    assert report.exit_code() == 1


def test_without_onnxruntime_parity_is_one_line_exit_2(folder, data_file, cli, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import onnxruntime raises ImportError
    result = cli(
        "diff",
        str(folder / "model.pt"),
        str(folder / "legacy_kept.onnx"),
        "--arch",
        ARCH,
        "--data",
        data_file,
        "--isolated",
    )
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and 'pip install "bnaudit[onnx]"' in result.output


def test_malformed_export_is_one_line_exit_2(folder, tmp_path, cli):
    data = (folder / "legacy_kept.onnx").read_bytes()
    (tmp_path / "torn.onnx").write_bytes(data[: len(data) // 2])
    result = cli("diff", str(folder / "model.pt"), str(tmp_path / "torn.onnx"), "--isolated")
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output

"""False alarms on shipped models, gone while the true findings stay: BN201 on channels that
carry nothing in float (a slimmed network's gamma ~1e-9, a channel whose input never varies),
BN002/BN007 on untrained modules (onnx's bundled PyTorch 0.3 test exports), and a quantized
ONNX graph that said nothing at all. Truth: the test's own float64 fold and rounding, the
files onnx ships."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import SAMPLES, bn_entries, save_safetensors

from bnaudit.api import inspect
from bnaudit.audit.fold.predict import predict_fold
from bnaudit.config import Config
from bnaudit.errors import BnauditError

EPS = 1e-5
C = 16
SLIMMED = list(range(6))  # gamma 1e-9: network slimming pruned them
SETTER = 15  # running_var 1e-10: a gain of ~316 sets the per-tensor scale


def _slimmed_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    gamma = torch.ones(C)
    gamma[SLIMMED] = 1e-9
    var = torch.ones(C)
    var[SETTER] = 1e-10
    return {
        "conv.weight": torch.randn(C, 8, 3, 3, generator=g),
        **bn_entries("bn", C, weight=gamma, var=var, mean=torch.zeros(C), bias=torch.zeros(C)),
    }


def _truth(state: dict[str, torch.Tensor]) -> tuple[list[int], list[int]]:
    """(collapsed channels with non-zero folded weights, those of them silent in float), by
    the test's own float64 fold, int8 fake-quantization and sigma_c = |gamma| sqrt(var / (var + eps))."""
    gamma, var = state["bn.weight"].double(), state["bn.running_var"].double()
    folded = state["conv.weight"].double() * (gamma / torch.sqrt(var + EPS)).reshape(-1, 1, 1, 1)
    q = torch.fake_quantize_per_tensor_affine(folded.float(), float(folded.abs().max()) / 127, 0, -127, 127)
    collapsed = [c for c in range(C) if bool((q[c] == 0).all()) and bool((folded[c] != 0).any())]
    sigma = gamma.abs() * torch.sqrt(var / (var + EPS))
    maxima = folded.abs().flatten(1).amax(1)
    silent = [
        c
        for c in collapsed
        if float(sigma[c]) <= 1e-6 * float(sigma.max()) or float(maxima[c]) <= 1e-6 * float(maxima.max())
    ]
    return collapsed, silent


def test_near_silent_channels_are_left_out_of_bn201_and_counted(tmp_path):
    state = _slimmed_state()
    collapsed, silent = _truth(state)
    assert silent == SLIMMED and len(collapsed) > len(silent)  # the premise: both kinds collapse
    report = predict_fold(save_safetensors(state, tmp_path / "m.safetensors"), Config())
    (pair,) = report.pairs
    assert list(pair.silent_collapsed) == silent
    assert list(pair.live_collapsed) == [c for c in collapsed if c not in silent]
    (f,) = [f for f in report.findings if f.code == "BN201"]
    live = len(collapsed) - len(silent)
    assert f.severity == "error" and f"{live} live channels of {C}" in f.message
    assert f"{len(silent)} near-silent channels left out (channels 0, 1, 2, 3, 4, 5:" in f.message


def test_a_slimmed_layer_whose_only_collapse_is_silent_is_no_error(tmp_path):
    """Without the scale setter the live channels keep their levels; the pruned ones round to
    0 in int8 as they are ~0 in float: info, and the int8 verdict is ok."""
    state = _slimmed_state()
    state["bn.running_var"][SETTER] = 1.0
    state["bn.weight"][SLIMMED] = torch.tensor([1e-9, 2e-9, 1e-9, 3e-9, 1e-9, 1e-9])
    collapsed, silent = _truth(state)
    assert collapsed == silent == SLIMMED
    report = predict_fold(save_safetensors(state, tmp_path / "m.safetensors"), Config())
    (f,) = [f for f in report.findings if f.code == "BN201"]
    assert f.severity == "info" and "6 near-silent channels left out" in f.message
    assert dict(report.verdicts())["int8 per-tensor"] == "ok"
    assert not [f for f in report.findings if f.code in ("BN201", "BN202") and f.severity != "info"]


def test_a_channel_whose_input_never_varies_is_silent(tmp_path):
    """running_var exactly 0 (the depthwise conv's input channel is constant): sigma_c = 0."""
    state = _slimmed_state()
    state["bn.weight"][SLIMMED] = 1.0
    state["bn.running_var"][0] = 0.0
    state["bn.weight"][0] = 1e-7  # gamma small enough not to set the scale itself
    collapsed, silent = _truth(state)
    assert 0 in collapsed and 0 in silent
    (pair,) = predict_fold(save_safetensors(state, tmp_path / "m.safetensors"), Config()).pairs
    assert 0 in pair.silent_collapsed and 0 not in pair.live_collapsed


def _onnx_test_model(name: str) -> str:
    import onnx.backend.test

    path = os.path.join(os.path.dirname(onnx.backend.test.__file__), "data", "pytorch-converted", name, "model.onnx")
    if not os.path.exists(path):
        pytest.skip(f"onnx ships no {name}")
    return path


@pytest.mark.parametrize(
    "name", ["test_BatchNorm2d_eval", "test_BatchNorm2d_momentum_eval", "test_BatchNorm3d_momentum_eval"]
)
def test_onnx_bundled_pytorch_exports_are_untrained_modules(name):
    pytest.importorskip("onnx")
    (file,) = inspect(_onnx_test_model(name)).files
    codes = {f.code: f for f in file.findings}
    assert "an untrained module" in codes["BN002"].message and "folded" not in codes["BN002"].message.split(":")[0]
    assert codes["BN002"].severity == "info"
    if "momentum" in name:  # momentum=0.8 / 0.7 in PyTorch, written correctly as ONNX 0.2 / 0.3
        assert codes["BN007"].severity == "info" and "on an untrained module" in codes["BN007"].message
        assert "written unconverted" not in codes["BN007"].message
    assert not [f for f in file.findings if f.severity in ("error", "warning")]


def _bn_node_model(tmp_path, momentum: float, mean: list[float], var: list[float], beta: list[float]) -> str:
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    def init(name, values):
        return numpy_helper.from_array(torch.tensor(values, dtype=torch.float32).numpy(), name)

    node = helper.make_node("BatchNormalization", ["x", "g", "b", "m", "v"], ["y"], name="bn", momentum=momentum)
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 2, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 2, 2])],
        [init("g", [0.5, 0.7, 0.9]), init("b", beta), init("m", mean), init("v", var)],
    )
    path = str(tmp_path / "bn.onnx")
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)]), path)
    return path


def test_the_true_findings_stay(tmp_path):
    # trained statistics with ONNX momentum 0.1 (PyTorch's 0.1 written unconverted): the warning stays
    (file,) = inspect(_bn_node_model(tmp_path, 0.1, [0.2, -0.1, 0.3], [0.5, 2.0, 1.5], [0.1, 0.0, -0.2])).files
    (f,) = [f for f in file.findings if f.code == "BN007"]
    assert f.severity == "warning" and "written unconverted" in f.message
    # identity statistics with a folded bias (beta - mean * gamma / sigma, not 0): still a fold
    (file,) = inspect(_bn_node_model(tmp_path, 0.9, [0.0] * 3, [1.0] * 3, [0.1, -0.3, 0.2])).files
    (f,) = [f for f in file.findings if f.code == "BN002"]
    assert "statistics folded into weight/bias" in f.message


def test_a_quantized_onnx_graph_says_its_convolutions_were_not_examined(tmp_path, cli):
    pytest.importorskip("onnxruntime")
    from onnxruntime.quantization import QuantType, quantize_dynamic

    path = str(tmp_path / "quantized.onnx")
    quantize_dynamic(os.path.join(SAMPLES, "onnx", "folded.onnx"), path, weight_type=QuantType.QUInt8)
    import onnx

    ops = {n.op_type for n in onnx.load(path).graph.node}
    assert {"ConvInteger", "DynamicQuantizeLinear"} <= ops  # the premise: a quantized graph
    (file,) = inspect(path).files
    (f,) = [f for f in file.findings if f.code == "BN014"]
    assert f.severity == "info" and "a quantized graph; its convolutions were not examined" in f.message
    result = cli("inspect", path, width=80)
    assert result.exit_code == 0 and "a quantized graph (BN014)" in result.output
    with pytest.raises(BnauditError, match="a quantized graph, its convolutions are not examined"):
        predict_fold(path, Config())


def _flush_truth(state: dict[str, torch.Tensor]) -> tuple[list[int], list[int]]:
    """(channels whose folded weights a real fp16 cast turns all to 0 while they were not 0,
    those of them silent in float), by the test's own float64 fold."""
    gamma, var = state["bn.weight"].double(), state["bn.running_var"].double()
    folded = state["conv.weight"].double() * (gamma / torch.sqrt(var + EPS)).reshape(-1, 1, 1, 1)
    half = folded.half()
    flushed = [c for c in range(C) if bool((half[c] == 0).all()) and bool((folded[c] != 0).any())]
    sigma = gamma.abs() * torch.sqrt(var / (var + EPS))
    maxima = folded.abs().flatten(1).amax(1)
    silent = [
        c
        for c in flushed
        if float(sigma[c]) <= 1e-6 * float(sigma.max()) or float(maxima[c]) <= 1e-6 * float(maxima.max())
    ]
    return flushed, silent


def test_a_slimmed_layer_whose_fp16_flush_is_only_near_silent_channels_is_info(tmp_path):
    state = _slimmed_state()
    state["bn.running_var"][SETTER] = 1.0  # no fp16 overflow beside it: the flush alone is looked at
    flushed, silent = _flush_truth(state)
    assert flushed == silent == SLIMMED  # the premise: the pruned channels, and only they, flush
    report = predict_fold(save_safetensors(state, tmp_path / "m.safetensors"), Config())
    (pair,) = report.pairs
    assert list(pair.fp16_flush) == flushed and list(pair.silent_flush) == silent and pair.live_flush == ()
    (f,) = [f for f in report.findings if f.code == "BN205"]
    assert f.severity == "info" and "all near-silent" in f.message
    assert dict(report.verdicts())["fp16"] == "ok"


def test_a_layer_whose_live_channels_flush_in_fp16_stays_a_warning(tmp_path):
    """Weights ~1e-8 in every channel (nothing near-silent against the rest), plus the pruned
    channels: the live ones are the warning, the pruned ones counted apart."""
    state = _slimmed_state()
    state["bn.running_var"][SETTER] = 1.0
    state["conv.weight"] = state["conv.weight"] * 4e-9
    flushed, silent = _flush_truth(state)
    live = [c for c in flushed if c not in silent]
    assert live and silent == SLIMMED  # the premise: both kinds flush
    report = predict_fold(save_safetensors(state, tmp_path / "m.safetensors"), Config())
    (pair,) = report.pairs
    assert list(pair.live_flush) == live and list(pair.silent_flush) == silent
    (f,) = [f for f in report.findings if f.code == "BN205"]
    assert f.severity == "warning" and f"{len(live)} live channels" in f.message
    assert f"{len(silent)} near-silent channels left out" in f.message
    assert dict(report.verdicts())["fp16"].startswith("degraded: flush in 1 pair")

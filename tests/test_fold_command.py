"""`bnaudit fold`: every prediction against an independent computation in torch (a real
fake-quantization, a real half-precision cast, a real bf16 BN forward)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import save_safetensors, save_torch

from bnaudit.audit.fold.predict import predict_fold
from bnaudit.audit.fold.report import FoldReport
from bnaudit.audit.producers import NO_PRODUCER_BY_NAME, producer_candidates
from bnaudit.config import Config
from bnaudit.runtime.models import ModelSpec

EPS = 1e-5
INCEPTION_VAR = 1.86e-14  # torchvision's InceptionV3 (vision issue 648)


class ConvBN(nn.Module):
    """torchvision's BasicConv2d: .conv/.bn siblings."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)))


class Block(nn.Module):
    """A ResNet basic block: conv1/bn1, conv2/bn2, downsample.0/.1."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.downsample(x))


class SmallCNN(nn.Module):
    """conv_stem/bn1 (timm), a Sequential with a conv bias, a block, a BasicConv2d, a BN
    after an addition (unpaired) and a Linear/BatchNorm1d head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv_stem = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.features = nn.Sequential(nn.Conv2d(8, 12, 3, padding=1), nn.BatchNorm2d(12), nn.ReLU())
        self.block = Block(12, 16)
        self.branch = ConvBN(16, 16)
        self.after_add = nn.BatchNorm2d(16)
        self.head = nn.Sequential(nn.Linear(16, 10), nn.BatchNorm1d(10))

    def forward(self, x):
        x = F.relu(self.bn1(self.conv_stem(x)))
        x = self.block(self.features(x))
        x = self.after_add(self.branch(x) + x)
        return self.head(x.mean((2, 3)))


PAIRS = {
    "bn1": "conv_stem",
    "features.1": "features.0",
    "block.bn1": "block.conv1",
    "block.bn2": "block.conv2",
    "block.downsample.1": "block.downsample.0",
    "branch.bn": "branch.conv",
    "head.1": "head.0",
}


@pytest.fixture(scope="module")
def trained() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = SmallCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = torch.randn(64, 3, 12, 12), torch.randint(0, 10, (64,))
    model.train()
    for step in range(30):
        batch = slice(16 * (step % 4), 16 * (step % 4 + 1))
        loss = F.cross_entropy(model(x[batch]), y[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _with_inception_channel(state: dict[str, torch.Tensor], bn: str, channel: int) -> dict[str, torch.Tensor]:
    state = {k: v.clone() for k, v in state.items()}
    state[f"{bn}.running_var"][channel] = INCEPTION_VAR
    state[f"{bn}.weight"][channel] = 1.0
    return state


def _folded(state: dict[str, torch.Tensor], bn: str, producer: str) -> tuple[torch.Tensor, torch.Tensor]:
    """W' and b' in float64, torch's own arithmetic (independent of bnaudit's)."""
    w = state[f"{producer}.weight"].double()
    b = state.get(f"{producer}.bias", torch.zeros(w.shape[0])).double()
    gamma, beta = state[f"{bn}.weight"].double(), state[f"{bn}.bias"].double()
    mean, var = state[f"{bn}.running_mean"].double(), state[f"{bn}.running_var"].double()
    s = gamma / torch.sqrt(var + EPS)
    return w * s.reshape(-1, *([1] * (w.dim() - 1))), beta + (b - mean) * s


def _fake_quant_zero_channels(w: torch.Tensor, per_channel: bool) -> list[int]:
    """Channels whose every weight a real int8 fake-quantization turns to 0."""
    wf = w.float()
    if per_channel:
        peaks = wf.abs().flatten(1).amax(1)
        scales = torch.where(peaks > 0, peaks / 127, torch.ones_like(peaks))
        q = torch.fake_quantize_per_channel_affine(wf, scales, torch.zeros_like(peaks, dtype=torch.int32), 0, -127, 127)
    else:
        q = torch.fake_quantize_per_tensor_affine(wf, float(w.abs().max() / 127), 0, -127, 127)
    return [c for c in range(w.shape[0]) if bool((q[c] == 0).all())]


def _predict(tmp_path, state, name="m.pt", config=None) -> FoldReport:
    path = save_torch(state, tmp_path / name)
    return predict_fold(path, config or Config())


def test_pairs_follow_the_libraries_naming_conventions(tmp_path, trained):
    report = _predict(tmp_path, trained)
    assert {p.bn: p.producer for p in report.pairs} == PAIRS
    assert all(p.paired_by == "name" for p in report.pairs)
    # a BN after an addition has no producer: listed, BN207
    assert report.unpaired == (("after_add", NO_PRODUCER_BY_NAME),)
    assert [(f.code, f.layer) for f in report.findings if f.code == "BN207"] == [("BN207", "after_add")]


def test_a_producer_of_another_channel_count_is_not_paired(tmp_path):
    state = {"0.weight": torch.randn(6, 3, 3, 3), **{f"1.{k}": v for k, v in nn.BatchNorm2d(4).state_dict().items()}}
    report = _predict(tmp_path, state)
    assert report.pairs == () and [name for name, _ in report.unpaired] == ["1"]


def test_transformers_convolution_normalization_names():
    assert producer_candidates("embedder.normalization") == ["embedder.convolution"]
    assert producer_candidates("layer.bn2") == ["layer.conv2", "layer.conv_head"]


def test_inception_channel_collapses_exactly_the_channels_fake_quantization_zeroes(tmp_path, trained):
    state = _with_inception_channel(trained, "block.bn2", 5)
    report = _predict(tmp_path, state)
    by_bn = {p.bn: p for p in report.pairs}
    for bn, producer in PAIRS.items():
        w, _ = _folded(state, bn, producer)
        p = by_bn[bn]
        assert list(p.collapsed) == _fake_quant_zero_channels(w, per_channel=False), bn
        assert p.int8_scale == pytest.approx(float(w.abs().max() / 127), rel=1e-12)
        # per channel: only an all-zero channel would collapse, and none is
        assert list(p.per_channel_collapsed) == _fake_quant_zero_channels(w, per_channel=True) == [], bn
    p = by_bn["block.bn2"]
    # the InceptionV3 channel takes the range: every other channel collapses or turns coarse
    assert p.collapsed and set(p.collapsed) | set(p.coarse) == set(range(16)) - {5}
    assert p.scale_set_by is not None and p.scale_set_by.channel == 5
    assert p.scale_set_by.running_var == pytest.approx(INCEPTION_VAR, rel=1e-6)
    assert p.scale_set_by.gain == pytest.approx(1 / (INCEPTION_VAR + EPS) ** 0.5, rel=1e-6)
    (f,) = [f for f in report.findings if f.code == "BN201"]
    assert (f.severity, f.layer, f.channels) == ("error", "block.bn2", p.collapsed)
    assert "channel 5 (running_var 1.86e-14, gamma 1" in f.message


def test_coarse_channels_are_those_with_fewer_than_8_levels(tmp_path, trained):
    state = _with_inception_channel(trained, "block.bn2", 5)
    for p in _predict(tmp_path, state).pairs:
        w, _ = _folded(state, p.bn, PAIRS[p.bn])
        q = torch.fake_quantize_per_tensor_affine(w.float(), float(w.abs().max() / 127), 0, -127, 127)
        levels = (q.flatten(1).abs().amax(1) / float(w.abs().max() / 127)).round()
        # a coarse channel's largest weight lands on 1..8 steps (7.5 to 8 rounds up to 8); every
        # channel that keeps 1..7 steps is coarse, and every other live channel keeps 8 or more
        for c in range(w.shape[0]):
            if c in p.coarse:
                assert 1 <= levels[c] <= 8, (p.bn, c)
            elif c not in p.collapsed:
                assert levels[c] >= 8, (p.bn, c)
        assert {c for c in range(w.shape[0]) if 1 <= levels[c] <= 7} <= set(p.coarse), p.bn
    assert any(p.coarse for p in _predict(tmp_path, state).pairs)


def test_healthy_trained_model_predicts_no_collapse_and_fake_quantization_agrees(tmp_path, trained):
    report = _predict(tmp_path, trained)
    for p in report.pairs:
        w, _ = _folded(trained, p.bn, PAIRS[p.bn])
        assert p.collapsed == () and _fake_quant_zero_channels(w, per_channel=False) == [], p.bn
        assert p.fp16_overflow == () and p.fp16_flush == ()
    assert not [f for f in report.findings if f.code in ("BN201", "BN204", "BN205")]


def test_fp16_overflow_where_a_real_half_cast_is_inf(tmp_path):
    torch.manual_seed(1)
    conv = nn.Conv2d(3, 8, 3)
    state = {"0.weight": conv.weight.detach(), "0.bias": conv.bias.detach()}
    var = torch.tensor([1.0, 65519.0, 65521.0, 0.5, 1.0, 2.0, 1.0, 1.0])
    gamma = torch.tensor([1.0, 1.0, 1.0, 1e3, 1.0, 1.0, 30.0, 1.0])
    mean = torch.tensor([0.0, 0.0, 0.0, 0.0, 7e4, 0.0, 0.0, 0.0])
    var[6] = 0.0  # gain 30 / sqrt(1e-5) = 9487: below 65520
    var[7] = 0.0
    gamma[7] = 300.0  # gain 94868: overflows
    state.update({"1.weight": gamma, "1.bias": torch.zeros(8), "1.running_mean": mean, "1.running_var": var})
    (p,) = _predict(tmp_path, state).pairs
    w, b = _folded(state, "1", "0")
    gain = state["1.weight"].double() / torch.sqrt(state["1.running_var"].double() + EPS)

    def inf(x: torch.Tensor) -> torch.Tensor:
        return torch.isinf(x.double().half()).reshape(x.shape[0], -1).any(1)

    expected = inf(state["1.running_var"]) | inf(w) | inf(b) | inf(gain)
    assert list(p.fp16_overflow) == [c for c in range(8) if expected[c]]
    assert set(p.fp16_overflow) >= {2, 7} and 1 not in p.fp16_overflow and 6 not in p.fp16_overflow


def test_fp16_flush_where_a_real_half_cast_zeroes_the_channel(tmp_path):
    torch.manual_seed(2)
    w = torch.randn(6, 4) * 0.5
    gamma = torch.tensor([1.0, 1e-9, 1e-7, 2.0**-26, 1.0, 0.0])
    state = {
        "fc.weight": w,
        "norm.weight": gamma,
        "norm.bias": torch.zeros(6),
        "norm.running_mean": torch.zeros(6),
        "norm.running_var": torch.ones(6),
    }
    state = {
        k.replace("fc.", "layer.convolution.").replace("norm.", "layer.normalization."): v for k, v in state.items()
    }
    (p,) = _predict(tmp_path, state).pairs
    folded, _ = _folded(state, "layer.normalization", "layer.convolution")
    half = folded.half()
    expected = [c for c in range(6) if bool((half[c] == 0).all()) and bool((folded[c] != 0).any())]
    assert list(p.fp16_flush) == expected and 1 in expected and 2 not in expected
    assert list(p.per_channel_collapsed) == [5]  # gamma 0: zero already (BN203, not a flush)


def _half_forward_error(mean: float, std: float, dtype=torch.bfloat16, n: int = 4096) -> float:
    """The largest error, in standard deviations, of a real half-precision eval-mode BN
    forward on samples of N(mean, std^2) against the float64 forward."""
    g = torch.Generator().manual_seed(3)
    x = mean + std * torch.randn(n, 1, generator=g, dtype=torch.float64)
    rm, rv = torch.tensor([mean], dtype=torch.float64), torch.tensor([std**2], dtype=torch.float64)
    exact = F.batch_norm(x, rm, rv, training=False, eps=EPS)
    half = F.batch_norm(x.to(dtype), rm.to(dtype), rv.to(dtype), training=False, eps=EPS)
    return float((half.double() - exact).abs().max())


def test_bf16_cancellation_flags_agree_with_a_real_bf16_forward(tmp_path):
    # |mean| / std from 0 to 1e4: e = |mean| 2^-8 / std from 0 to 39; well separated from 0.05
    ratios = [0.0, 0.5, 1.0, 2.0, 50.0, 200.0, 1000.0, 10000.0]
    stds = [1.0, 0.1, 3.0, 1.0, 1.0, 0.01, 2.0, 1.0]
    means = [r * s for r, s in zip(ratios, stds)]
    c = len(ratios)
    state = {
        "0.weight": torch.randn(c, 3),
        "1.weight": torch.ones(c),
        "1.bias": torch.zeros(c),
        "1.running_mean": torch.tensor(means),
        "1.running_var": torch.tensor([s**2 for s in stds]),
    }
    (p,) = _predict(tmp_path, state).pairs
    real = [_half_forward_error(m, s) > 0.05 for m, s in zip(means, stds)]
    assert list(p.bf16_cancellation) == [i for i in range(c) if real[i]]
    assert real == [False, False, False, False, True, True, True, True]  # both sides exercised
    # fp16 has 3 more bits: the threshold moves 8x up, and a real fp16 forward agrees
    real16 = [_half_forward_error(m, s, torch.float16) > 0.05 for m, s in zip(means, stds)]
    assert list(p.fp16_cancellation) == [i for i in range(c) if real16[i]]
    assert real16 == [False, False, False, False, False, True, True, True]


def test_eps_from_the_option_changes_the_fold(tmp_path, trained):
    state = _with_inception_channel(trained, "block.bn2", 5)
    path = save_safetensors(state, tmp_path / "m.safetensors")
    default = {p.bn: p for p in predict_fold(path, Config()).pairs}["block.bn2"]
    wide = {p.bn: p for p in predict_fold(path, Config(eps=1e-1)).pairs}["block.bn2"]
    assert default.scale_set_by is not None and wide.scale_set_by is not None
    assert default.scale_set_by.gain == pytest.approx(1 / (INCEPTION_VAR + 1e-5) ** 0.5, rel=1e-6)
    assert wide.scale_set_by.gain < 10  # at eps 0.1 no channel's gain exceeds 1/sqrt(0.1) * gamma


# CLI -----------------------------------------------------------------------------------


def test_cli_exit_codes_and_json_shape(tmp_path, trained, cli):
    bad = save_torch(_with_inception_channel(trained, "block.bn2", 5), tmp_path / "bad.pt")
    good = save_torch(trained, tmp_path / "good.pt")
    result = cli("fold", bad, "--format", "json", "--isolated")
    assert result.exit_code == 1, result.output
    doc = json.loads(result.stdout)
    assert set(doc) == {"pairs", "unpaired", "measured", "findings", "notes", "not_audited", "summary"}
    assert doc["measured"] is None and doc["unpaired"] == ["after_add"]
    pair = next(p for p in doc["pairs"] if p["bn"] == "block.bn2")
    assert set(pair) == {
        "bn", "producer", "paired_by", "channels", "int8_per_tensor", "int8_per_channel", "fp16", "bf16", "measured_drop",
    }  # fmt: skip
    assert set(pair["int8_per_tensor"]) == {"scale", "collapsed_channels", "coarse_channels", "scale_set_by"}
    assert set(pair["int8_per_channel"]) == {"collapsed_channels"}
    assert set(pair["fp16"]) == {
        "overflow_channels",
        "flush_channels",
        "silent_flush_channels",
        "cancellation_channels",
    }
    assert set(pair["bf16"]) == {"cancellation_channels"}
    w, _ = _folded(_with_inception_channel(trained, "block.bn2", 5), "block.bn2", "block.conv2")
    assert pair["int8_per_tensor"]["collapsed_channels"] == _fake_quant_zero_channels(w, per_channel=False)
    assert pair["int8_per_tensor"]["scale_set_by"]["channel"] == 5
    assert pair["measured_drop"] is None and pair["paired_by"] == "name"
    assert doc["summary"]["errors"] >= 1
    assert cli("fold", bad, "--isolated", "--exit-zero").exit_code == 0
    assert cli("fold", bad, "--isolated", "--ignore", "BN201,BN202,BN206").exit_code == 0
    assert cli("fold", bad, "--isolated", "--select", "BN201").exit_code == 1
    assert cli("fold", good, "--isolated", "--fail-on", "error").exit_code == 0
    missing = cli("fold", str(tmp_path / "nope.pt"), "--isolated", "--format", "json")
    assert missing.exit_code == 2 and "error" in json.loads(missing.stdout)


def test_cli_table_names_the_scale_setter(tmp_path, trained, cli):
    bad = save_torch(_with_inception_channel(trained, "block.bn2", 5), tmp_path / "bad.pt")
    result = cli("fold", bad, "--isolated", width=200)
    assert result.exit_code == 1
    assert "BN201 int8-per-tensor-collapse" in result.stdout
    assert "set by channel 5 (running_var 1.86e-14" in result.stdout
    assert "int8 per-tensor: fails" in result.stdout


# graphs ----------------------------------------------------------------------------------


def _model(state: dict[str, torch.Tensor]) -> SmallCNN:
    model = SmallCNN()
    model.load_state_dict(state)
    return model.eval()


def _export(model: nn.Module, path, keep: bool) -> str:
    import contextlib
    import io
    import warnings

    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.zeros(2, 3, 12, 12),), str(path), dynamo=False, do_constant_folding=not keep)
    return str(path)


def test_onnx_with_bn_nodes_pairs_through_the_graph(tmp_path, trained):
    pytest.importorskip("onnx")
    state = _with_inception_channel(trained, "block.bn2", 5)
    report = predict_fold(_export(_model(state), tmp_path / "kept.onnx", keep=True), Config())
    by_bn = {p.bn: p for p in report.pairs}
    assert set(by_bn) == set(PAIRS) and all(p.paired_by == "graph" for p in report.pairs)
    for bn, producer in PAIRS.items():
        w, _ = _folded(state, bn, producer)
        assert list(by_bn[bn].collapsed) == _fake_quant_zero_channels(w, per_channel=False), bn
    # the BN after the addition follows an Add node: it stays a standalone op
    assert [(name, "Add" in why) for name, why in report.unpaired] == [("after_add", True)]
    assert by_bn["block.bn2"].scale_set_by is not None and by_bn["block.bn2"].scale_set_by.channel == 5


def test_onnx_folded_export_audits_the_folded_weights(tmp_path, trained):
    onnx = pytest.importorskip("onnx")
    from onnx import numpy_helper

    state = _with_inception_channel(trained, "block.bn2", 5)
    path = _export(_model(state), tmp_path / "folded.onnx", keep=False)
    report = predict_fold(path, Config())
    proto = onnx.load(path)
    weights = {i.name: torch.from_numpy(numpy_helper.to_array(i).copy()) for i in proto.graph.initializer}
    convs = {n.name: n for n in proto.graph.node if n.op_type == "Conv"}
    folded = [p for p in report.pairs if p.paired_by == "folded"]
    assert {p.producer for p in folded} == set(convs)
    # BN after a Linear stays a node (the exporter folds only into Conv): paired through the graph
    assert [(p.bn, p.paired_by) for p in report.pairs if p not in folded] == [("head.1", "graph")]
    for p in folded:
        w = weights[convs[p.producer].input[1]].double()
        assert list(p.collapsed) == _fake_quant_zero_channels(w, per_channel=False), p.producer
        assert p.scale_set_by is not None and p.scale_set_by.running_var is None
    # the folded conv of block.bn2 collapses what the checkpoint's prediction said
    expected = {p.bn: p for p in predict_fold(save_torch(state, tmp_path / "m.pt"), Config()).pairs}["block.bn2"]
    assert any(p.collapsed == expected.collapsed and p.collapsed for p in report.pairs)


def test_torchscript_archive_pairs_by_name(tmp_path, trained):
    state = _with_inception_channel(trained, "block.bn2", 5)
    path = str(tmp_path / "m.jit")
    torch.jit.script(_model(state)).save(path)
    report = predict_fold(path, Config())
    scripted = {p.bn: p.collapsed for p in report.pairs}
    saved = {p.bn: p.collapsed for p in predict_fold(save_torch(state, tmp_path / "m.pt"), Config()).pairs}
    assert report.format == "torchscript" and scripted == saved and scripted["block.bn2"]
    assert report.settings == ""  # eps read from the scripted modules


# measured --------------------------------------------------------------------------------

ARCH = """
import torch.nn as nn


def build():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4), nn.BatchNorm1d(4),
    )
"""
SEQ_PAIRS = {"1": "0", "4": "3", "9": "8"}


@pytest.fixture(scope="module")
def measured_setup(tmp_path_factory):
    """A trained Sequential CNN with an InceptionV3 channel in BN '4', its builder, labelled data."""
    import importlib.util

    root = tmp_path_factory.mktemp("measured")
    (root / "arch.py").write_text(ARCH)
    spec = importlib.util.spec_from_file_location("fold_arch", root / "arch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(4)
    x = torch.randn(256, 3, 8, 8)
    y = (x[:, :, :4].mean((1, 2, 3)) > 0).long() + 2 * (x[:, 0].mean((1, 2)) > 0).long()
    model = module.build()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
    model.train()
    for step in range(60):
        batch = slice(32 * (step % 8), 32 * (step % 8 + 1))
        loss = F.cross_entropy(model(x[batch]), y[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state["4.running_var"][3] = INCEPTION_VAR
    state["4.weight"][3] = 1.0
    # as in InceptionV3, the channel carries nothing the model uses (there its input is
    # constant): eval mode keeps its accuracy, while its folded weights set the int8 range
    state["8.weight"][:, 3] = 0.0
    model.load_state_dict(state)
    model.eval()
    ckpt = save_torch(state, root / "model.pt")
    data = save_safetensors({"inputs": x, "labels": y}, root / "data.safetensors")
    return model, ckpt, data, f"{root / 'arch.py'}:build", x, y


def _own_folded(model: nn.Module, quantize=None, only=None) -> nn.Module:
    """The test's own fold (float64, then float32) and int8 weight fake-quantization."""
    import copy

    folded = copy.deepcopy(model).eval()
    with torch.no_grad():
        for bn_name, conv_name in SEQ_PAIRS.items():
            conv, bn = folded.get_submodule(conv_name), folded.get_submodule(bn_name)
            s = bn.weight.double() / torch.sqrt(bn.running_var.double() + bn.eps)
            w = conv.weight.double() * s.reshape(-1, *([1] * (conv.weight.dim() - 1)))
            b = conv.bias.double() if conv.bias is not None else torch.zeros(w.shape[0], dtype=torch.float64)
            conv.weight = nn.Parameter(w.float())
            conv.bias = nn.Parameter((bn.bias.double() + (b - bn.running_mean.double()) * s).float())
            setattr(folded, bn_name, nn.Identity())
            if quantize == "tensor" and only in (None, bn_name):
                conv.weight.copy_(
                    torch.fake_quantize_per_tensor_affine(
                        conv.weight, float(conv.weight.abs().max() / 127), 0, -127, 127
                    )
                )
            if quantize == "channel":
                peaks = conv.weight.abs().flatten(1).amax(1)
                conv.weight.copy_(
                    torch.fake_quantize_per_channel_affine(
                        conv.weight, peaks / 127, torch.zeros(len(peaks), dtype=torch.int32), 0, -127, 127
                    )
                )
    return folded


def _accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, dtype=torch.float32) -> float:
    with torch.no_grad():
        return float((model(x.to(dtype)).float().argmax(1) == y).float().mean())


@pytest.mark.slow
def test_measured_targets_equal_the_tests_own_folded_and_quantized_models(measured_setup):
    from bnaudit.runtime.fold import measure_fold
    from bnaudit.runtime.sources import DataOptions

    model, ckpt, data, arch, x, y = measured_setup
    report = measure_fold(ModelSpec(ckpt, arch=arch), DataOptions(path=data, batch_size=64), Config())
    m = report.measured
    assert m is not None and m.labelled and m.samples == 256
    assert {p.bn: (p.producer, p.paired_by) for p in report.pairs} == {b: (c, "graph") for b, c in SEQ_PAIRS.items()}
    assert m.results["float32"] == _accuracy(model, x, y)
    assert m.results["folded"] == m.results["float32"]
    assert m.results["int8_per_tensor"] == _accuracy(_own_folded(model, "tensor"), x, y)
    assert m.results["int8_per_channel"] == _accuracy(_own_folded(model, "channel"), x, y)
    for bn in SEQ_PAIRS:
        drop = _accuracy(_own_folded(model), x, y) - _accuracy(_own_folded(model, "tensor", only=bn), x, y)
        assert m.pair_drop[bn] == pytest.approx(drop, abs=1e-12), bn
    # the InceptionV3 channel costs the per-tensor target accuracy; per channel keeps it
    assert m.results["float32"] > 0.6  # trained: chance is 0.25
    assert m.results["int8_per_tensor"] < m.results["float32"] - 0.05
    assert m.pair_drop["4"] > 0.05
    assert abs(m.results["int8_per_channel"] - m.results["float32"]) < 0.03
    for target, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        if m.results[target] is not None:
            import copy

            assert m.results[target] == _accuracy(copy.deepcopy(model).to(dtype), x, y, dtype), target


def test_folded_model_equals_eval_mode_within_float32_rounding(measured_setup):
    from bnaudit.runtime.fold import fold_model

    model, ckpt, *_ = measured_setup
    report = predict_fold(ckpt, Config())
    folded = fold_model(model, report.pairs)
    assert not any(isinstance(m, nn.BatchNorm2d | nn.BatchNorm1d) for m in folded.modules())
    x = torch.randn(32, 3, 8, 8, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        eval_out, folded_out = model(x), folded(x)
    scale = eval_out.abs().max()
    assert float((folded_out - eval_out).abs().max() / scale) < 1e-5


@pytest.mark.slow
def test_cli_measures_with_arch_and_data(measured_setup, cli):
    model, ckpt, data, arch, x, y = measured_setup
    result = cli("fold", ckpt, "--arch", arch, "--data", data, "--format", "json", "--isolated", "--exit-zero")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert set(doc["measured"]) == {"float32", "folded", "int8_per_tensor", "int8_per_channel", "fp16", "bf16"}
    assert doc["measured"]["float32"] == _accuracy(model, x, y)
    assert {p["bn"]: p["measured_drop"] is not None for p in doc["pairs"]} == dict.fromkeys(SEQ_PAIRS, True)
    table = cli("fold", ckpt, "--arch", arch, "--data", data, "--isolated", width=160)
    assert table.exit_code == 1 and "measured on 256 samples: accuracy" in table.stdout
    assert cli("fold", ckpt, "--arch", arch, "--isolated").exit_code == 2  # --arch without data


@pytest.mark.slow
def test_pt2_program_pairs_through_the_graph(tmp_path, trained):
    import warnings

    state = _with_inception_channel(trained, "block.bn2", 5)
    path = str(tmp_path / "m.pt2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.export.save(torch.export.export(_model(state), (torch.zeros(2, 3, 12, 12),)), path)
    report = predict_fold(path, Config())
    assert report.format == "pt2"
    assert {p.bn: p.producer for p in report.pairs} == PAIRS and {p.paired_by for p in report.pairs} == {"graph"}
    for p in report.pairs:
        w, _ = _folded(state, p.bn, PAIRS[p.bn])
        assert list(p.collapsed) == _fake_quant_zero_channels(w, per_channel=False), p.bn
    assert [(name, "add" in why) for name, why in report.unpaired] == [("after_add", True)]
    assert {p.bn: p for p in report.pairs}["block.bn2"].collapsed


def test_a_traced_forward_pairs_exactly(trained):
    from bnaudit.runtime.models import graph_producers

    producers = graph_producers(_model(trained))
    assert producers.by == "graph" and producers.foldable == PAIRS
    assert list(producers.unpaired) == ["after_add"] and "add" in producers.unpaired["after_add"]


def test_an_untraceable_forward_is_paired_by_its_names():
    from bnaudit.runtime.models import graph_producers

    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)

        def forward(self, x):
            return self.bn(self.conv(x)) if x.sum() > 0 else x  # data-dependent: fx cannot trace it

    producers = graph_producers(Branchy())
    assert producers.by == "name" and producers.feeds == {"bn": "conv"}


@pytest.mark.slow
def test_torchrun_ranks_measure_what_one_process_measures(measured_setup, tmp_path):
    from conftest import run_ranks

    _, ckpt, data, arch, *_ = measured_setup
    args = ["-m", "bnaudit", "fold", ckpt, "--arch", arch, "--data", data, "--batch-size", "32", "-f", "json"]
    args += ["--isolated", "--exit-zero"]
    one, two = run_ranks(args, tmp_path, ranks=1), run_ranks(args, tmp_path, ranks=2)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-2000:]
    a, b = json.loads(one.stdout), json.loads(two.stdout)  # rank 0 alone printed one document
    assert a["measured"] == pytest.approx(b["measured"], abs=1e-12)
    assert [p["measured_drop"] for p in a["pairs"]] == pytest.approx(
        [p["measured_drop"] for p in b["pairs"]], abs=1e-12
    )


def test_onnx_linear_without_bias_pairs_through_its_transposed_matmul():
    pytest.importorskip("onnx")
    from conftest import SAMPLES

    exported = predict_fold(f"{SAMPLES}/onnx/digits.onnx", Config())
    saved = {p.bn: p for p in predict_fold(f"{SAMPLES}/healthy.pt", Config()).pairs}
    # head.1 is nn.Linear(bias=False): MatMul(x, Transpose(head.1.weight)) in the graph
    assert [(p.bn, p.paired_by) for p in exported.pairs] == [
        (b, "graph") for b in ("features.1", "features.4", "head.2")
    ]
    for p in exported.pairs:
        assert p.int8_scale == pytest.approx(saved[p.bn].int8_scale, rel=1e-6), p.bn
        assert p.scale_set_by.channel == saved[p.bn].scale_set_by.channel and p.coarse == saved[p.bn].coarse
    assert exported.unpaired == ()


def test_invalid_statistics_are_never_flagged_as_cancellation(tmp_path):
    state = {
        "0.weight": torch.randn(3, 2),
        "1.weight": torch.ones(3),
        "1.bias": torch.zeros(3),
        "1.running_mean": torch.tensor([5.0, float("nan"), 1.0]),
        "1.running_var": torch.tensor([float("nan"), 1.0, 1.0]),
    }
    (p,) = _predict(tmp_path, state).pairs
    assert p.bf16_cancellation == () and p.fp16_cancellation == ()  # NaN statistics: inspect's BN005


def test_a_weight_of_exactly_half_a_step_rounds_to_even_zero(tmp_path):
    # var + eps = 1: the folded weights are the conv's exactly, and S = 127 / 127 = 1
    w = torch.tensor([[127.0, 1.0], [0.5, -0.25], [-0.5000001, 0.0], [0.75, 0.1]])
    state = {
        "0.weight": w,
        "1.weight": torch.ones(4),
        "1.bias": torch.zeros(4),
        "1.running_mean": torch.zeros(4),
        "1.running_var": torch.full((4,), 0.75),
    }
    (p,) = _predict(tmp_path, state, config=Config(eps=0.25)).pairs
    assert p.int8_scale == 1.0
    assert list(p.collapsed) == _fake_quant_zero_channels(w.double(), per_channel=False) == [1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_weights_streamed_from_safetensors_give_the_channel_maxima(tmp_path, monkeypatch, dtype):
    from bnaudit.audit.fold import check as foldcheck
    from bnaudit.formats.read import read_checkpoint

    w = (torch.randn(7, 5, 3, 3) * torch.logspace(-3, 3, 7).reshape(-1, 1, 1, 1)).to(dtype)
    path = save_safetensors({"pad": torch.randn(3), "conv.weight": w}, tmp_path / "w.safetensors")
    ref = read_checkpoint(path).tensors["conv.weight"]
    assert ref.location is not None
    monkeypatch.setattr(foldcheck, "STREAM_VALUES", 90)  # two channels a chunk: 4 chunks
    streamed = foldcheck.channel_maxima(ref, path)
    assert streamed == foldcheck.channel_maxima(ref) == w.double().abs().flatten(1).amax(1).tolist()

    def whole_read():
        raise AssertionError("the weight was read whole")

    # streamed indeed: the tensor's own reader (all values at once) is never called
    assert foldcheck.channel_maxima(dataclasses.replace(ref, _reader=whole_read), path) == streamed


def test_ci_formats_name_the_collapsed_pair(tmp_path, trained, cli):
    import xml.etree.ElementTree as ET

    bad = save_torch(_with_inception_channel(trained, "block.bn2", 5), tmp_path / "bad.pt")
    github = cli("fold", bad, "--isolated", "-f", "github")
    assert github.exit_code == 1
    assert any(
        line.startswith("::error ") and "title=BN201 int8-per-tensor-collapse" in line and "::block.bn2: " in line
        for line in github.stdout.splitlines()
    )
    junit = ET.fromstring(cli("fold", bad, "--isolated", "-f", "junit").stdout)
    assert junit.get("name") == "bnaudit fold" and int(junit.get("failures")) >= 1
    issues = json.loads(cli("fold", bad, "--isolated", "-f", "gitlab").stdout)
    assert "BN201" in {i["check_name"] for i in issues}
    assert "bnaudit fold" in cli("fold", bad, "--isolated", "-f", "markdown").stdout

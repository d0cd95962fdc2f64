"""`bnaudit fold` on the models people ship: timm's MobileNetV3 and EfficientNet, whose blocks
name their convs by role (conv_pw / conv_dw / conv_pwl) and pair them with bn1/bn2/bn3
differently per block type, and whose BN layers are BatchNormAct2d (a BatchNorm2d subclass
with its activation inside). Truth: the conv whose output tensor is each BN's input in a real
forward (hooks), and the test's own float64 fold and int8 rounding."""

from __future__ import annotations

import pytest
import torch
from conftest import save_safetensors, save_torch
from timm_support import import_timm
from torch import nn

from bnaudit.audit.fold.predict import predict_checkpoint, predict_fold
from bnaudit.audit.producers import producers_from_names
from bnaudit.config import Config
from bnaudit.formats.model import torch_ref
from bnaudit.formats.read import read_checkpoint

EPS = 1e-5
MODELS = ("mobilenetv3_large_100", "efficientnet_b0")
# the depthwise BN given one channel of running_var 1e-10 (a gain of 1e5): its fold then sets
# the per-tensor int8 scale of the whole depthwise conv
COLLAPSING = "blocks.2.0.bn2"


def _model(name: str) -> nn.Module:
    timm = import_timm()
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=10)
    model.train()
    with torch.no_grad():  # running statistics that moved, as after training
        for _ in range(2):
            model(torch.randn(4, 3, 64, 64))
    return model.eval()


def feeding(model: nn.Module) -> dict[str, str]:
    """BN module -> the Conv/Linear module whose output tensor is the BN's input, in a real
    eval forward (the test's truth, independent of any naming)."""
    made: dict[int, str] = {}
    fed: dict[str, str | None] = {}
    hooks = []
    for name, m in model.named_modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            hooks.append(m.register_forward_hook(lambda _m, _i, out, name=name: made.__setitem__(id(out), name)))
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            hooks.append(
                m.register_forward_pre_hook(lambda _m, i, name=name: fed.__setitem__(name, made.get(id(i[0]))))
            )
    with torch.no_grad():
        model(torch.randn(1, 3, 64, 64))
    for h in hooks:
        h.remove()
    assert all(fed.values())
    return {bn: conv for bn, conv in fed.items() if conv is not None}


@pytest.fixture(scope="module", params=MODELS)
def timm_model(request, tmp_path_factory):
    model = _model(request.param)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    root = tmp_path_factory.mktemp(request.param)
    return {
        "name": request.param,
        "model": model,
        "state": state,
        "truth": feeding(model),
        "pt": save_torch(state, root / "m.pt"),
        # safetensors sorts its keys: no definition order to lean on, only the block layouts
        "safetensors": save_safetensors(state, root / "m.safetensors"),
    }


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_every_bn_layer_is_paired_with_the_conv_the_forward_feeds_it(timm_model, fmt):
    report = predict_fold(timm_model[fmt], Config())
    assert {p.bn: p.producer for p in report.pairs} == timm_model["truth"]
    assert report.unpaired == () and report.not_audited() == ""
    assert [words for _, words in report.verdicts()] == ["ok"] * 4


def test_a_depthwise_separable_block_whose_convs_have_equal_widths_pairs_by_block_type(timm_model):
    """blocks.0.0 is a DepthwiseSeparableConv of 16 -> 16 (efficientnet_b0: 32 -> 16): conv_dw
    feeds bn1 and conv_pw bn2, the other way round from an InvertedResidual's bn1."""
    state = timm_model["state"]
    assert state["blocks.0.0.conv_dw.weight"].shape[1] == 1  # depthwise: (C, 1, k, k)
    refs = {k: torch_ref(k, v) for k, v in sorted(state.items())}
    channels = {k[: -len(".running_var")]: v.shape[0] for k, v in state.items() if k.endswith(".running_var")}
    found = producers_from_names(refs, channels).feeds
    assert found["blocks.0.0.bn1"] == "blocks.0.0.conv_dw" and found["blocks.0.0.bn2"] == "blocks.0.0.conv_pw"
    assert found["blocks.1.0.bn1"] == "blocks.1.0.conv_pw" and found["blocks.1.0.bn2"] == "blocks.1.0.conv_dw"


def test_a_block_named_like_timm_but_shaped_otherwise_is_not_taken_for_one():
    """conv_dw that is not depthwise: no InvertedResidual layout; the layer stays unpaired
    rather than paired by a name rule."""
    state = {
        "b.conv_pw.weight": torch.randn(8, 4, 1, 1),
        "b.bn1.running_mean": torch.zeros(8),
        "b.bn1.running_var": torch.ones(8),
        "b.conv_dw.weight": torch.randn(8, 8, 3, 3),  # a full conv, not (C, 1, k, k)
        "b.bn2.running_mean": torch.zeros(8),
        "b.bn2.running_var": torch.ones(8),
        "b.conv_pwl.weight": torch.randn(4, 8, 1, 1),
        "b.bn3.running_mean": torch.zeros(4),
        "b.bn3.running_var": torch.ones(4),
    }
    refs = {k: torch_ref(k, v) for k, v in sorted(state.items())}
    found = producers_from_names(refs, {"b.bn1": 8, "b.bn2": 8, "b.bn3": 4})
    assert found.feeds == {} and set(found.unpaired) == {"b.bn1", "b.bn2", "b.bn3"}


def _collapse_truth(state: dict[str, torch.Tensor], bn: str, conv: str) -> list[int]:
    """Channels of conv's folded weights that symmetric per-tensor int8 fake-quantization
    turns to all zeros while they were not zero (the test's own fold, in float64)."""
    w = state[f"{conv}.weight"].double()
    s = state[f"{bn}.weight"].double() / torch.sqrt(state[f"{bn}.running_var"].double() + EPS)
    folded = w * s.reshape(-1, 1, 1, 1)
    q = torch.fake_quantize_per_tensor_affine(folded.float(), float(folded.abs().max()) / 127, 0, -127, 127)
    return [c for c in range(w.shape[0]) if bool((q[c] == 0).all()) and bool((folded[c] != 0).any())]


@pytest.fixture(scope="module")
def collapsing(timm_model, tmp_path_factory):
    state = {k: v.clone() for k, v in timm_model["state"].items()}
    state[f"{COLLAPSING}.running_var"][0] = 1e-10
    conv = timm_model["truth"][COLLAPSING]
    path = save_safetensors(state, tmp_path_factory.mktemp("collapse") / "m.safetensors")
    return {"state": state, "conv": conv, "path": path, "collapsed": _collapse_truth(state, COLLAPSING, conv)}


def test_the_per_tensor_collapse_is_the_one_the_test_computes(collapsing):
    collapsed = collapsing["collapsed"]
    channels = collapsing["state"][f"{COLLAPSING}.running_var"].shape[0]
    assert len(collapsed) > channels // 2  # the premise: one channel's gain wipes out most of the others
    report = predict_fold(collapsing["path"], Config())
    (pair,) = [p for p in report.pairs if p.bn == COLLAPSING]
    assert pair.producer == collapsing["conv"] and pair.scale_set_by is not None and pair.scale_set_by.channel == 0
    assert list(pair.live_collapsed) == collapsed
    (f,) = [f for f in report.findings if f.code == "BN201" and f.layer == COLLAPSING]
    assert f.severity == "error" and f"{len(collapsed)} live channels of {channels}" in f.message
    verdict = dict(report.verdicts())["int8 per-tensor"]
    assert verdict == "fails: 1 pair with collapsed live channels"
    assert report.exit_code() == 1


def test_bn_layers_left_unpaired_are_counted_where_the_verdict_is(tmp_path):
    """A BN no producer can be found for: the verdict is not a bare "ok"."""
    state = {
        "conv1.weight": torch.randn(4, 3, 3, 3),
        **{f"bn1.{k}": v for k, v in (("running_mean", torch.zeros(4)), ("running_var", torch.ones(4) * 2))},
        **{f"lonely.{k}": v for k, v in (("running_mean", torch.zeros(5)), ("running_var", torch.ones(5) * 2))},
    }
    report = predict_fold(save_safetensors(state, tmp_path / "m.safetensors"), Config())
    assert [p.bn for p in report.pairs] == ["bn1"] and [n for n, _ in report.unpaired] == ["lonely"]
    verdicts = dict(report.verdicts())
    assert verdicts["int8 per-tensor"] == "ok for the 1 audited of 2 BN layers"
    assert verdicts["not audited"] == "1 of 2 BN layers not audited (1: no Conv or Linear producer found by name)"
    assert report.summary()["bn_layers"] == 2 and report.summary()["unpaired"] == 1


def test_with_the_model_every_bn_is_paired_by_graph_and_batchnormact_folds_exactly(timm_model):
    """--arch traces the forward with BatchNormAct2d as a leaf: every BN paired with the conv
    the forward feeds it; folding keeps the activation BatchNormAct2d applies after its BN."""
    from bnaudit.runtime.fold import fold_model, foldable
    from bnaudit.runtime.models import graph_producers

    model = timm_model["model"]
    producers = graph_producers(model)
    assert producers.by == "graph" and producers.foldable == timm_model["truth"]
    ckpt = read_checkpoint(timm_model["pt"])
    report = predict_checkpoint(ckpt, Config(), producers)
    assert {p.bn: p.producer for p in report.pairs} == timm_model["truth"] and report.unpaired == ()
    assert len(foldable(model, report.pairs)) == len(report.pairs)
    folded = fold_model(model, report.pairs)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        expected, got = model(x), folded(x)
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.eps != 0 for m in folded.modules())
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))


def test_with_the_model_the_collapse_is_the_one_the_test_computes(timm_model, collapsing):
    """--arch pairs through the traced forward: the same collapse as from the names."""
    from bnaudit.runtime.models import graph_producers

    producers = graph_producers(timm_model["model"])
    report = predict_checkpoint(read_checkpoint(collapsing["path"]), Config(), producers)
    assert len(report.pairs) == len(timm_model["truth"]) and report.unpaired == ()
    (pair,) = [p for p in report.pairs if p.bn == COLLAPSING]
    assert pair.paired_by == "graph" and list(pair.live_collapsed) == collapsing["collapsed"]
    assert dict(report.verdicts())["int8 per-tensor"] == "fails: 1 pair with collapsed live channels"


class _Deconv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(4, 6, 2, stride=2)
        self.bn = nn.BatchNorm2d(6)

    def forward(self, x):
        return self.bn(self.up(x))


@pytest.fixture(scope="module")
def deconv(tmp_path_factory):
    torch.manual_seed(0)
    model = _Deconv()
    model.train()
    with torch.no_grad():
        for _ in range(20):
            model(torch.randn(8, 4, 5, 5))
        model.up.weight[:, 3] = 0.0  # output channel 3's filter (axis 1) all zero: a constant input
        model.bn.running_var[3] = 0.0
        model.bn.running_mean[3] = 5.0
        model.bn.running_var[0] = 1e-10  # sets the per-tensor scale
    model.eval()
    root = tmp_path_factory.mktemp("deconv")
    return {"model": model, "path": save_torch(model.state_dict(), root / "m.pt"), "root": root}


def _deconv_truth(model: _Deconv) -> list[int]:
    w = model.up.weight.detach().double()
    s = model.bn.weight.detach().double() / torch.sqrt(model.bn.running_var.double() + model.bn.eps)
    folded = w * s.reshape(1, -1, 1, 1)  # output channels on axis 1
    q = torch.fake_quantize_per_tensor_affine(folded.float(), float(folded.abs().max()) / 127, 0, -127, 127)
    return [c for c in range(6) if bool((q[:, c] == 0).all()) and bool((folded[:, c] != 0).any())]


def test_a_convtranspose_is_folded_along_its_output_axis(deconv):
    from bnaudit.runtime.fold import fold_model, quantize_per_channel
    from bnaudit.runtime.models import graph_producers

    model = deconv["model"]
    producers = graph_producers(model)
    assert producers.foldable == {"bn": "up"} and producers.transposed == frozenset({"up"})
    report = predict_checkpoint(read_checkpoint(deconv["path"]), Config(), producers)
    (pair,) = report.pairs
    assert list(pair.live_collapsed) == _deconv_truth(model) and pair.per_channel_collapsed == (3,)
    folded = fold_model(model, report.pairs)
    x = torch.randn(2, 4, 5, 5)
    with torch.no_grad():
        assert torch.allclose(folded(x), model(x), rtol=1e-4, atol=1e-3)
    w = folded.up.weight.detach()
    q = quantize_per_channel(w, 1)  # one scale per output channel of axis 1: every live channel kept
    assert [c for c in range(6) if bool((q[:, c] == 0).all())] == [3]


def test_names_alone_do_not_take_a_convtranspose_for_a_conv(deconv):
    report = predict_fold(deconv["path"], Config())
    assert report.pairs == () and [n for n, _ in report.unpaired] == ["bn"]


def test_bn004_reads_a_convtranspose_filter_on_axis_1(deconv, tmp_path):
    """With --arch the zero filter of output channel 3 (weight[:, 3]) makes the channel constant."""
    from bnaudit.api import inspect

    script = tmp_path / "deconv_arch.py"
    script.write_text(
        "from torch import nn\n"
        "class D(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.up = nn.ConvTranspose2d(4, 6, 2, stride=2)\n"
        "        self.bn = nn.BatchNorm2d(6)\n"
        "    def forward(self, x):\n"
        "        return self.bn(self.up(x))\n"
    )
    (file,) = inspect(deconv["path"], arch=f"{script}:D").files
    (f,) = [f for f in file.findings if f.code == "BN004"]
    assert 3 in f.channels and "ch 3: the producing layer's filter is all zero" in f.message
    # without the model, names cannot tell the ConvTranspose: channel 3 is not explained
    (file,) = inspect(deconv["path"]).files
    (f,) = [f for f in file.findings if f.code == "BN004"]
    assert "filter is all zero" not in f.message


@pytest.mark.slow
def test_exported_convtranspose_pairs_through_onnx_and_pt2_graphs(deconv):
    model, root = deconv["model"], deconv["root"]
    x = torch.randn(1, 4, 5, 5)
    onnx_path, pt2_path = str(root / "d.onnx"), str(root / "d.pt2")
    torch.onnx.export(
        model, (x,), onnx_path, dynamo=False, do_constant_folding=False, training=torch.onnx.TrainingMode.PRESERVE
    )
    torch.export.save(torch.export.export(model, (x,)), pt2_path)
    truth = _deconv_truth(model)
    for path in (onnx_path, pt2_path):
        report = predict_fold(path, Config())
        (pair,) = [p for p in report.pairs if p.paired_by == "graph"]
        assert list(pair.live_collapsed) == truth, path


@pytest.mark.slow
def test_cli_measures_a_timm_model_with_every_pair_folded(tmp_path, cli):
    """fold --arch --data on a timm MobileNetV3: every BN paired by the graph and folded (no
    pair left unfolded), the folded model scoring as the float32 one."""
    model = _model("mobilenetv3_large_100")
    path = save_torch(model.state_dict(), tmp_path / "m.pt")
    arch = tmp_path / "arch.py"
    arch.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(__import__('os').path.dirname(__file__))!r})\n"
        "from timm_support import import_timm\n"
        "def build():\n"
        "    return import_timm().create_model('mobilenetv3_large_100', pretrained=False, num_classes=10)\n"
    )
    data = save_safetensors(
        {"inputs": torch.randn(8, 3, 64, 64), "labels": torch.randint(0, 10, (8,))}, tmp_path / "d.safetensors"
    )
    result = cli("fold", path, "--arch", f"{arch}:build", "--data", data, "-f", "json")
    assert result.exit_code == 0, result.output
    import json

    doc = json.loads(result.output)
    assert doc["summary"]["pairs"] == 46 and doc["summary"]["unpaired"] == 0
    assert doc["not_audited"] is None and not [n for n in doc["notes"] if "not folded" in n]
    assert doc["measured"]["folded"] == doc["measured"]["float32"]

"""Programs folded before export: `torch.fx.experimental.optimization.fuse` then `torch.export`
(`.pt2`), and the legacy ONNX exporter's constant folding. No BN node is left: inspect says
"folded", fold audits the folded weights (exit 0), diff verifies every fold against the
checkpoint, including timm's zero-initialised last BN of each residual block (gamma 0, whose
fold carries no statistics). Truth: the test's own float64 fold of the checkpoint."""

from __future__ import annotations

import pytest
import torch
from conftest import save_torch
from torch import nn
from torch.fx.experimental.optimization import fuse

from bnaudit.api import inspect
from bnaudit.audit.diff.checkpoints import diff
from bnaudit.audit.fold.predict import predict_fold
from bnaudit.config import Config


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, bias=False), nn.BatchNorm2d(8)

    def forward(self, x):
        return self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))).mean((2, 3))


def _trained(model: nn.Module, shape: tuple[int, ...]) -> nn.Module:
    torch.manual_seed(0)
    model.train()
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(*shape))
    return model.eval()


def _folded_weights(state: dict[str, torch.Tensor], conv: str, bn: str) -> tuple[torch.Tensor, torch.Tensor]:
    """W' = W s and b' = beta + (b - mean) s, s = gamma / sqrt(var + 1e-5), in float64."""
    w = state[f"{conv}.weight"].double()
    b = state.get(f"{conv}.bias", torch.zeros(w.shape[0])).double()
    s = state[f"{bn}.weight"].double() / torch.sqrt(state[f"{bn}.running_var"].double() + 1e-5)
    return w * s.reshape(-1, 1, 1, 1), state[f"{bn}.bias"].double() + (b - state[f"{bn}.running_mean"].double()) * s


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    torch.manual_seed(0)
    model = _trained(Net(), (4, 3, 10, 10))
    with torch.no_grad():
        model.bn2.weight.zero_()  # a zero-initialised last BN (gamma 0 in every channel)
    root = tmp_path_factory.mktemp("small")
    x = torch.randn(1, 3, 10, 10)
    program = str(root / "folded.pt2")
    torch.export.save(torch.export.export(fuse(model), (x,)), program)
    return {"state": model.state_dict(), "ckpt": save_torch(model.state_dict(), root / "m.pt"), "program": program}


def test_the_program_stores_the_tests_own_fold(small):
    """The premise: fuse folded the statistics into the convs the program stores."""
    from bnaudit.formats.pt2 import stored_convolutions

    stored = {c.weight_name: c for c in stored_convolutions(small["program"])}
    for conv, bn in (("conv1", "bn1"), ("conv2", "bn2")):
        w, b = _folded_weights(small["state"], conv, bn)
        got = stored[f"{conv}.weight"]
        assert got.bias is not None
        assert torch.allclose(torch.tensor(got.weight.read(), dtype=torch.float64).reshape(w.shape), w, atol=1e-6)
        assert torch.allclose(torch.tensor(got.bias.read(), dtype=torch.float64), b, atol=1e-6)


def test_inspect_says_the_program_is_folded(small, cli):
    (file,) = inspect(small["program"]).files
    (f,) = [f for f in file.findings if f.code == "BN014"]
    assert "no batch-norm node; 2 convolution nodes" in f.message and "diff model.pt model.pt2" in f.message
    result = cli("inspect", small["program"])
    assert result.exit_code == 0 and "folded into convolutions (BN014)" in result.output


def test_fold_says_the_program_is_already_folded_and_audits_its_weights(small, cli):
    report = predict_fold(small["program"], Config())
    assert {p.producer for p in report.pairs} == {"conv1", "conv2"} and {p.paired_by for p in report.pairs} == {
        "folded"
    }
    assert report.unpaired == () and any(n.startswith("already folded") for n in report.notes)
    (conv2,) = [p for p in report.pairs if p.producer == "conv2"]
    assert conv2.per_channel_collapsed == tuple(range(8))  # gamma 0: every folded weight is 0 already
    assert report.exit_code() == 0
    assert cli("fold", small["program"]).exit_code == 0


def test_diff_verifies_each_fold_against_the_checkpoint(small):
    report = diff(small["ckpt"], small["program"], Config())
    check = report.export
    assert check is not None and not check.unpaired and not check.nodes
    folds = {f.name: f for f in check.folded}
    assert set(folds) == {"bn1", "bn2"} and all(f.check.matches for f in folds.values())
    assert folds["bn2"].check.zero_gamma and not folds["bn1"].check.zero_gamma
    assert folds["bn1"].check.implied_eps == pytest.approx(1e-5, rel=0.05)
    assert not [f for f in report.findings if f.severity in ("error", "warning")]
    text = " ".join(report.diagnosis())
    assert "2 layers folded exactly" in text and "1 of them with gamma 0" in text
    assert "momentum" not in report.settings and report.exit_code() == 0


def test_diff_with_an_unfolded_program_uses_the_eps_the_program_records(tmp_path):
    model = _trained(Net(), (4, 3, 10, 10))
    model.bn1.eps = 1e-3
    path = save_torch(model.state_dict(), tmp_path / "m.pt")
    program = str(tmp_path / "p.pt2")
    torch.export.save(torch.export.export(model, (torch.randn(1, 3, 10, 10),)), program)
    report = diff(path, program, Config())
    assert report.settings == ""  # nothing assumed: the program shows every eps
    nodes = {n.name: n for n in report.export.nodes}
    assert nodes["bn1"].eps_checkpoint == pytest.approx(1e-3) and nodes["bn1"].checkpoint.eps.known
    assert not nodes["bn1"].eps_differs and report.exit_code() == 0


@pytest.fixture(scope="module")
def timm_resnet(tmp_path_factory):
    from timm_support import import_timm

    timm = import_timm()
    torch.manual_seed(0)
    model = _trained(timm.create_model("resnet18", pretrained=False, num_classes=10), (4, 3, 64, 64))
    root = tmp_path_factory.mktemp("resnet")
    x = torch.randn(1, 3, 64, 64)
    program, onnx_path = str(root / "folded.pt2"), str(root / "folded.onnx")
    torch.export.save(torch.export.export(fuse(model), (x,)), program)
    torch.onnx.export(model, (x,), onnx_path, dynamo=False)  # constant folding: BN folded into the convs
    state = model.state_dict()
    bns = [k.removesuffix(".running_var") for k in state if k.endswith(".running_var")]
    zero = {bn for bn in bns if bool((state[f"{bn}.weight"] == 0).all())}
    return {"ckpt": save_torch(state, root / "m.pt"), "program": program, "onnx": onnx_path, "bns": bns, "zero": zero}


@pytest.mark.slow
@pytest.mark.parametrize("export", ["program", "onnx"])
def test_a_folded_timm_resnet_is_verified_fold_by_fold(timm_resnet, export):
    assert len(timm_resnet["bns"]) == 20 and len(timm_resnet["zero"]) == 8  # timm's zero_init_last
    report = diff(timm_resnet["ckpt"], timm_resnet[export], Config())
    check = report.export
    assert check is not None and check.unpaired == [] and len(check.folded) == 20
    assert all(f.check.matches for f in check.folded)
    assert {f.name for f in check.folded if f.check.zero_gamma} == timm_resnet["zero"]
    assert report.exit_code() == 0, report.findings


@pytest.mark.slow
def test_a_folded_program_with_a_linear_head_does_not_call_it_a_convolution(timm_resnet):
    """resnet18's fc is an aten.linear node with a stored bias: counted with the convolutions
    (the export alone cannot tell what had BN), but not called a convolution."""
    program = torch.export.load(timm_resnet["program"])
    targets = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    convs, linears = targets.count("aten.conv2d.default"), targets.count("aten.linear.default")
    assert (convs, linears) == (20, 1)  # the premise, from the program's own graph
    (file,) = inspect(timm_resnet["program"]).files
    (f,) = [f for f in file.findings if f.code == "BN014"]
    assert f"no batch-norm node; {convs + linears} convolution or linear nodes" in f.message

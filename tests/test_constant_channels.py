"""A channel whose producing conv has an all-zero filter receives the conv's bias alone:
its BN input is a constant equal to running_mean, so eval mode multiplies a zero deviation
by whatever gain it has. BN004 must not call it live; the producer is found by the state
dict's naming conventions (Sequential i-1 -> i, conv1 -> bn1, downsample.0 -> .1)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import save_torch
from torch import nn

from bnaudit.api import inspect

CHANNEL, BIAS = 2, 0.7


class _Paired(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3)
        self.bn1 = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn1(self.conv1(x))


class _Downsample(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.downsample = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.downsample(x)


def _models() -> dict[str, tuple[nn.Module, str, str]]:
    """model, its conv's name, its BN's name."""
    return {
        "sequential": (nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()), "0", "1"),
        "paired": (_Paired(), "conv1", "bn1"),
        "downsample": (_Downsample(), "downsample.0", "downsample.1"),
    }


def _zero_filter_and_measure(model: nn.Module, conv: str, bn: str) -> list[torch.Tensor]:
    """Zero one output filter of `conv` (its bias set to BIAS), then measure the BN's
    population statistics (cumulative average) over 10 random batches; the BN inputs the
    test saw, for its own check."""
    torch.manual_seed(0)
    seen: list[torch.Tensor] = []
    with torch.no_grad():
        layer = model.get_submodule(conv)
        layer.weight[CHANNEL] = 0.0
        layer.bias[CHANNEL] = BIAS
        norm = model.get_submodule(bn)
        norm.momentum = None
        norm.weight.fill_(1.0)
        hook = norm.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach().clone()))
        model.train()
        for _ in range(10):
            model(torch.randn(8, 3, 8, 8))
        hook.remove()
    return seen


@pytest.mark.parametrize("layout", ["sequential", "paired", "downsample"])
def test_a_zero_filter_channel_is_not_live(tmp_path, layout):
    model, conv, bn = _models()[layout]
    seen = _zero_filter_and_measure(model, conv, bn)
    inputs = torch.cat([x[:, CHANNEL].reshape(-1) for x in seen])
    assert torch.all(inputs == torch.tensor(BIAS))  # the test's own premise: a constant input
    norm = model.get_submodule(bn)
    mean, var = float(norm.running_mean[CHANNEL]), float(norm.running_var[CHANNEL])
    gain = 1.0 / math.sqrt(var + 1e-5)
    # what made it "live" before: |mean| >= sqrt(var + eps), gain above 100
    assert abs(mean) >= math.sqrt(var + 1e-5) and gain > 100
    (file,) = inspect(save_torch(model.state_dict(), tmp_path / "m.pt")).files
    (f,) = [f for f in file.findings if f.code == "BN004"]
    assert f.layer == bn and f.channels == (CHANNEL,)
    assert f.severity == "warning" and "filter is all zero" in f.message


def test_a_nonzero_filter_channel_with_a_broken_variance_stays_live(tmp_path):
    model, conv, bn = _models()["sequential"]
    _zero_filter_and_measure(model, conv, bn)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state[f"{conv}.weight"][CHANNEL] = 0.1  # the filter works: the input varies, its variance was lost
    (file,) = inspect(save_torch(state, tmp_path / "m.pt")).files
    (f,) = [f for f in file.findings if f.code == "BN004"]
    assert f.severity == "error" and f"ch {CHANNEL} is live" in f.message


def test_a_zero_filter_channel_is_not_live_in_a_torchscript_archive(tmp_path):
    model, conv, bn = _models()["paired"]
    _zero_filter_and_measure(model, conv, bn)
    path = str(tmp_path / "m.pt")
    torch.jit.save(torch.jit.script(model.eval()), path)
    (file,) = inspect(path).files
    (f,) = [f for f in file.findings if f.code == "BN004"]
    assert (f.layer, f.severity, f.channels) == (bn, "warning", (CHANNEL,)) and "filter is all zero" in f.message


_ODD_NAMES = '''
from torch import nn


class Odd(nn.Module):
    """Names no convention pairs, the BN stored before its producer (so the key order pairs
    nothing either): the producer is known from the graph only."""

    def __init__(self):
        super().__init__()
        self.normaliser = nn.BatchNorm2d(4)
        self.encoder = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        return self.normaliser(self.encoder(x))


def odd():
    return Odd()
'''


def test_a_zero_filter_channel_is_not_live_by_the_model_graph_with_arch(tmp_path):
    import importlib.util

    source = tmp_path / "odd_net.py"
    source.write_text(_ODD_NAMES)
    spec = importlib.util.spec_from_file_location("odd_net_for_constant", source)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.odd()
    _zero_filter_and_measure(model, "encoder", "normaliser")
    path = save_torch(model.state_dict(), tmp_path / "odd.pt")
    # without the model, neither a convention nor the key order names encoder: still called live
    (plain,) = [f for f in inspect(path).files[0].findings if f.code == "BN004"]
    assert plain.severity == "error"
    (f,) = [f for f in inspect(path, arch=f"{source}:odd").files[0].findings if f.code == "BN004"]
    assert (f.severity, f.channels) == ("warning", (CHANNEL,)) and "filter is all zero" in f.message


# Exported graphs (ONNX with BatchNormalization nodes kept, torch.export .pt2): the producer is
# the Conv/Gemm/MatMul node (conv/linear op) feeding the BN node, as `fold` pairs them.
CONTROL = 1  # nonzero filter, the same statistics as CHANNEL: still live


class _Exported(nn.Module):
    """Names no convention pairs, and a Linear without bias + BatchNorm1d (MatMul in ONNX)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Conv2d(3, 4, 3)
        self.normaliser = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 4, bias=False)  # exported as MatMul: a (K, N) weight
        self.headnorm = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.normaliser(self.encoder(x))).mean(dim=(2, 3))
        return self.headnorm(self.head(y))


def _exported_model() -> nn.Module:
    """Trained statistics, then CHANNEL's filter zeroed in both producers, and CHANNEL and
    CONTROL given a near-eps variance with |mean| far above sqrt(var + eps): "live" by the
    mean test, gain 1/sqrt(1e-7 + 1e-5) ~ 315 > 100."""
    torch.manual_seed(0)
    model = _Exported()
    model.train()
    with torch.no_grad():
        for _ in range(5):
            model(torch.randn(8, 3, 8, 8))
        for conv, norm in ((model.encoder, model.normaliser), (model.head, model.headnorm)):
            conv.weight[CHANNEL] = 0.0
            norm.running_var[[CHANNEL, CONTROL]] = 1e-7
            norm.running_mean[[CHANNEL, CONTROL]] = BIAS
    return model.eval()


def _assert_constant_not_live(path: str, layers: tuple[str, ...] = ("normaliser", "headnorm")) -> None:
    bn004 = {f.layer: f for f in inspect(path).files[0].findings if f.code == "BN004"}
    assert sorted(bn004) == sorted(layers)
    for f in bn004.values():
        assert set(f.channels) == {CHANNEL, CONTROL}
        assert f.severity == "error" and f"ch {CONTROL} is live" in f.message
        assert f"ch {CHANNEL}: the producing layer's filter is all zero" in f.message


@pytest.mark.parametrize(
    ("options", "layers"),
    [
        ({"dynamo": False, "do_constant_folding": False}, ("normaliser", "headnorm")),
        ({"dynamo": True, "optimize": False}, ("normaliser", "headnorm")),
        # constant folding folds the BatchNorm2d into its Conv and keeps the BatchNorm1d
        # after a MatMul whose weight is the folded transpose, (K, N): output channels last
        ({"dynamo": False}, ("headnorm",)),
    ],
    ids=["legacy", "dynamo", "legacy-matmul-kn"],
)
def test_a_zero_filter_channel_is_not_live_in_an_onnx_graph(tmp_path, options, layers):
    import warnings

    path = str(tmp_path / "m.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(_exported_model(), (torch.randn(2, 3, 8, 8),), path, **options)
    _assert_constant_not_live(path, layers)


def test_a_zero_filter_channel_is_not_live_in_a_pt2_archive(tmp_path):
    import warnings

    path = str(tmp_path / "m.pt2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.export.save(torch.export.export(_exported_model(), (torch.randn(2, 3, 8, 8),)), path)
    _assert_constant_not_live(path)

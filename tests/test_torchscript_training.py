"""`inspect` reads a TorchScript program's training mode from its code, torch-free: a
BatchNorm call whose training argument is the constant True (traced in training mode)
is BN012, the code of a training-mode ONNX node; a module saved in training mode with
its flag computed at run time is a BN012 warning; an eval-mode trace gets nothing."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from conftest import SAMPLES
from torch import nn

from bnaudit.api import inspect


def _constant_training_layers(path: str) -> set[str]:
    """The leaf modules whose TorchScript graph calls aten::batch_norm with a constant True
    training argument (its 6th input), found in their inlined graphs (the calls of scripted
    functions such as F.batch_norm expanded) with torch's own API."""
    model = torch.jit.load(path)
    found = set()
    for name, module in model.named_modules():
        if list(module.children()):
            continue
        try:
            graph = module.inlined_graph
        except RuntimeError:  # a module without a compiled forward of its own
            continue
        for node in graph.findAllNodes("aten::batch_norm", True):
            training = list(node.inputs())[5]
            if training.node().kind() == "prim::Constant" and training.toIValue() is True:
                found.add(name)
    return found


def _bn012(path: str) -> dict[str, str]:
    (file,) = inspect(path).files
    assert file.error is None, file.error
    return {f.layer: f.severity for f in file.findings if f.code == "BN012"}


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 8), nn.BatchNorm1d(8)
    )


def test_traced_train_sample_is_an_error_per_layer():
    path = os.path.join(SAMPLES, "traced_train.pt")
    layers = _constant_training_layers(path)
    assert layers  # the premise, by torch's graph
    (file,) = inspect(path).files
    found = [f for f in file.findings if f.code == "BN012"]
    assert {f.layer for f in found} == layers and {f.severity for f in found} == {"error"}
    assert all("training=True as a constant" in f.message and ".eval() cannot" in f.message for f in found)
    assert inspect(path).exit_code("error") == 1


def test_traced_in_training_mode_is_an_error_and_in_eval_mode_nothing(tmp_path):
    x = torch.randn(4, 3, 8, 8)
    net = _net().train()
    torch.jit.save(torch.jit.trace(net, x), str(tmp_path / "train.pt"))
    torch.jit.save(torch.jit.trace(_net().eval(), x), str(tmp_path / "eval.pt"))
    assert _constant_training_layers(str(tmp_path / "train.pt")) == {"1", "5"}
    assert _bn012(str(tmp_path / "train.pt")) == {"1": "error", "5": "error"}
    assert _constant_training_layers(str(tmp_path / "eval.pt")) == set()
    assert _bn012(str(tmp_path / "eval.pt")) == {}


class _AlwaysBatchStats(nn.BatchNorm2d):
    """A BatchNorm whose forward asks for the batch's statistics in every mode."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, True, 0.1, self.eps)


def test_scripted_in_training_mode_is_a_warning_and_a_constant_training_call_an_error(tmp_path):
    net = _net()
    torch.jit.save(torch.jit.script(net.train()), str(tmp_path / "train.pt"))
    torch.jit.save(torch.jit.script(_net().eval()), str(tmp_path / "eval.pt"))
    loaded = torch.jit.load(str(tmp_path / "train.pt"))
    assert loaded.training  # torch.jit.load restores the training flag it was saved with
    assert _bn012(str(tmp_path / "train.pt")) == {"1": "warning", "5": "warning"}
    assert _bn012(str(tmp_path / "eval.pt")) == {}

    scripted = torch.jit.script(nn.Sequential(nn.Conv2d(3, 4, 3), _AlwaysBatchStats(4)).eval())
    torch.jit.save(scripted, str(tmp_path / "always.pt"))
    assert _constant_training_layers(str(tmp_path / "always.pt")) == {"1"}
    assert _bn012(str(tmp_path / "always.pt")) == {"1": "error"}

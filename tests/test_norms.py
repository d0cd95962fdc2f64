"""norms.py is the one answer to "which modules are BatchNorm" and to switching them to batch
statistics and back."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from bnaudit.runtime.norms import (
    batchnorm_modules,
    classify_layers,
    is_batchnorm,
    norm_modules,
)

# torch.jit.script warns that TorchScript is deprecated; it is still a format users ship
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")


class Frozen(nn.Module):
    """detectron2-style frozen BN: statistics as buffers, no training mode of its own."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(n))
        self.register_buffer("running_var", torch.ones(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.running_mean[:, None, None]) / self.running_var[:, None, None].sqrt()


class MyBN(nn.BatchNorm2d):
    pass


def zoo() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 4, 1),
        nn.BatchNorm2d(4),
        MyBN(4),
        nn.InstanceNorm2d(4, track_running_stats=True),
        nn.BatchNorm2d(4, track_running_stats=False),
        Frozen(4),
        nn.InstanceNorm2d(4),
        nn.ReLU(),
    )


def test_batchnorm_and_norm_layers_of_an_eager_model() -> None:
    model = zoo()
    assert list(batchnorm_modules(model)) == ["1", "2", "4"]
    assert list(norm_modules(model)) == ["1", "2", "3", "4", "6"]  # not the frozen one: no mode to switch
    assert [is_batchnorm(m) for m in model] == [False, True, True, False, True, False, False, False]


def test_classify_layers_recalibrates_tracked_batchnorm_only_and_says_why_for_the_rest() -> None:
    targets, skipped = classify_layers(zoo())
    assert list(targets) == ["1", "2"]
    assert {s.name: s.reason for s in skipped} == {
        "3": "InstanceNorm2d: not BatchNorm, left alone",
        "4": "BatchNorm2d with track_running_stats=False: no running statistics",
        "5": "Frozen: frozen statistics, left alone",
    }


def test_torchscript_gets_the_same_answers_from_the_class_names_it_keeps() -> None:
    scripted = torch.jit.script(
        nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.InstanceNorm2d(4, track_running_stats=True), Frozen(4))
    )
    assert list(batchnorm_modules(scripted)) == ["1"]
    assert list(norm_modules(scripted)) == ["1", "2"]
    targets, skipped = classify_layers(scripted)
    assert list(targets) == ["1"]
    assert [(s.name, s.reason.split(":")[1].strip()) for s in skipped] == [
        ("2", "not BatchNorm, left alone"),
        ("3", "frozen statistics, left alone"),
    ]

"""The one producer finder (bnaudit.audit.producers): its policy for traced forwards, the
names of a state dict, and the torch side that traces a model (runtime.models.graph_producers).

Every expectation is the producer a reader of the model's code names by hand.
"""

from __future__ import annotations

import torch
from conftest import bn_entries
from torch import nn

from bnaudit.audit.producers import NO_PRODUCER_BY_NAME, BNCall, producers_from_calls, producers_from_names
from bnaudit.formats.model import torch_ref
from bnaudit.runtime.models import graph_producers


def refs(state: dict[str, torch.Tensor]):
    return {name: torch_ref(name, tensor) for name, tensor in state.items()}


def test_the_policy_on_traced_calls():
    producers = producers_from_calls(
        [
            BNCall("a.bn", "a.conv"),
            BNCall("b.bn", "b.conv", shared=True),  # the conv's output also feeds a shortcut
            BNCall("c.bn", None, follows="add"),
            BNCall("d.bn", "d.conv"),
            BNCall("d.bn", "e.conv"),  # the same BN module called twice
        ]
    )
    assert producers.by == "graph"
    assert producers.feeds == {"a.bn": "a.conv", "b.bn": "b.conv"}  # b.conv still feeds b.bn (BN004)
    assert producers.foldable == {"a.bn": "a.conv"}
    assert producers.unpaired == {
        "b.bn": "its producer b.conv's output is read by other nodes too",
        "c.bn": "follows add: stays a standalone BatchNorm",
        "d.bn": "called more than once in the forward",
    }


def test_names_then_the_module_stored_right_before():
    state = {
        "stem.conv1.weight": torch.randn(8, 3, 3, 3),
        **bn_entries("stem.bn1", 8),  # paired names: conv1 -> bn1
        "features.0.weight": torch.randn(16, 8, 3, 3),
        **bn_entries("features.1", 16),  # Sequential index: features.0 -> features.1
        "proj.weight": torch.randn(4, 16, 1, 1),
        **bn_entries("norm_after_proj", 4),  # no convention: the module stored before it
        "odd.weight": torch.randn(5, 4, 1, 1),
        **bn_entries("norm_after_odd", 6),  # stored right after a conv of 5 outputs: no producer
        **bn_entries("norm_after_norm", 6),  # stored right after another BN: never a producer
    }
    channels = {"stem.bn1": 8, "features.1": 16, "norm_after_proj": 4, "norm_after_odd": 6, "norm_after_norm": 6}
    producers = producers_from_names(refs(state), channels)
    assert producers.by == "name"
    assert producers.feeds == {"stem.bn1": "stem.conv1", "features.1": "features.0", "norm_after_proj": "proj"}
    assert producers.unpaired == {"norm_after_odd": NO_PRODUCER_BY_NAME, "norm_after_norm": NO_PRODUCER_BY_NAME}


class BatchNormAct(nn.BatchNorm2d):
    """A BatchNorm2d subclass defined outside torch.nn with its activation inside (as timm's
    BatchNormAct2d): torch.fx would trace into it, leaving no call of the BN module."""

    def forward(self, x):
        return torch.relu(super().forward(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3), BatchNormAct(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8)
        self.shortcut = nn.Conv2d(8, 8, 1)
        self.bn3 = nn.BatchNorm2d(8)

    def forward(self, x):
        x = self.bn1(self.conv1(x))
        y = self.conv2(x)
        return self.bn3(self.bn2(y) + y[:, :, :1, :1].mean() + self.shortcut(x)[:, :, 2:-2, 2:-2])


def test_a_traced_forward_keeps_bn_subclasses_whole_and_applies_the_policy():
    producers = graph_producers(Net())
    assert producers.by == "graph"
    assert producers.feeds == {"bn1": "conv1", "bn2": "conv2"}
    assert producers.foldable == {"bn1": "conv1"}  # conv2's output is read twice
    assert set(producers.unpaired) == {"bn2", "bn3"} and "add" in producers.unpaired["bn3"]

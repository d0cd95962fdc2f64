"""One home for the state-dict naming conventions that pair a BN layer with its producer
(bnaudit.audit.producers.producer_candidates): BN004's constant-channel check and
`bnaudit fold` must pair the same BN with the same producer, for every convention."""

from __future__ import annotations

import pytest
import torch
from conftest import save_torch

from bnaudit.api import inspect
from bnaudit.audit.fold.predict import predict_fold
from bnaudit.audit.producers import producer_candidates
from bnaudit.config import Config

# BN name as the library names it -> the candidate producers, in priority order
CANDIDATES = {
    # torchvision ResNet
    "bn1": ["conv1", "conv_stem"],
    "layer1.0.bn1": ["layer1.0.conv1", "layer1.0.conv_stem"],
    "layer1.0.bn2": ["layer1.0.conv2", "layer1.0.conv_head"],
    "layer4.2.bn3": ["layer4.2.conv3"],
    "layer2.0.downsample.1": ["layer2.0.downsample.0"],
    # torchvision MobileNetV2 (Conv2dNormActivation, InvertedResidual's conv Sequential)
    "features.0.1": ["features.0.0"],
    "features.1.conv.0.1": ["features.1.conv.0.0"],
    "features.1.conv.2": ["features.1.conv.1"],
    "features.0": [],  # index 0 has no predecessor
    # timm EfficientNet stem and head
    "bn2": ["conv2", "conv_head"],
    # .conv/.bn siblings (torchvision BasicConv2d, mmcv ConvModule, timm ConvNormAct)
    "Mixed_5b.branch1x1.bn": ["Mixed_5b.branch1x1.conv"],
    # normK/convK: not paired (DenseNet's norm1 comes before its conv1)
    "features.denseblock1.denselayer3.norm1": [],
    "block.norm": [],
    # transformers ResNet
    "resnet.embedder.embedder.normalization": ["resnet.embedder.embedder.convolution"],
    "resnet.encoder.stages.0.layers.0.shortcut.normalization": [
        "resnet.encoder.stages.0.layers.0.shortcut.convolution"
    ],
    "resnet.encoder.stages.0.layers.0.layer.1.normalization": ["resnet.encoder.stages.0.layers.0.layer.1.convolution"],
    # no convention
    "after_add": [],
}


@pytest.mark.parametrize("bn", sorted(CANDIDATES))
def test_candidates_of_each_convention(bn):
    assert producer_candidates(bn) == CANDIDATES[bn]


# (producer, BN) for each convention, all in one state dict
PAIRS = {
    "features.0.1": "features.0.0",
    "layer1.0.bn1": "layer1.0.conv1",
    "layer1.0.downsample.1": "layer1.0.downsample.0",
    "bn1": "conv_stem",
    "bn2": "conv_head",
    "stem.bn": "stem.conv",
    "embedder.normalization": "embedder.convolution",
}
C, DEAD = 4, 2


def _state() -> dict[str, torch.Tensor]:
    """Every BN: channel DEAD has running_var 0 and running_mean 5 (|mean| >= sqrt(var + eps),
    gain 1/sqrt(1e-5) = 316 > 100: live by the numbers), and its producer's filter DEAD is all
    zero: a constant input, not a live one."""
    torch.manual_seed(0)
    state: dict[str, torch.Tensor] = {}
    for bn, producer in PAIRS.items():
        weight = torch.randn(C, 3, 3, 3)
        weight[DEAD] = 0.0
        state[f"{producer}.weight"] = weight
        state[f"{bn}.weight"] = torch.ones(C)
        state[f"{bn}.bias"] = torch.zeros(C)
        state[f"{bn}.running_mean"] = torch.tensor([0.1, -0.2, 5.0, 0.3])
        state[f"{bn}.running_var"] = torch.tensor([1.0, 2.0, 0.0, 0.5])
        state[f"{bn}.num_batches_tracked"] = torch.tensor(100)
    return state


def test_fold_and_bn004_pair_each_convention_alike(tmp_path):
    path = save_torch(_state(), tmp_path / "m.pt")
    report = predict_fold(path, Config())
    assert {p.bn: p.producer for p in report.pairs} == PAIRS
    assert report.unpaired == ()
    (file,) = inspect(path).files
    bn004 = {f.layer: f for f in file.findings if f.code == "BN004"}
    assert sorted(bn004) == sorted(PAIRS)
    for bn, f in bn004.items():
        # the zero filter of the producer fold pairs it with makes the channel constant
        assert (f.severity, f.channels) == ("warning", (DEAD,)), bn
        assert "filter is all zero" in f.message, bn


def test_a_producer_of_another_channel_count_is_passed_over_by_both(tmp_path):
    """bn2 with conv2 of 3 output channels and conv_head of 4: both take conv_head."""
    state = {k: v for k, v in _state().items() if k.startswith("bn2.") or k == "conv_head.weight"}
    state["conv2.weight"] = torch.zeros(3, 3, 3, 3)
    path = save_torch(state, tmp_path / "m.pt")
    assert {p.bn: p.producer for p in predict_fold(path, Config()).pairs} == {"bn2": "conv_head"}
    (file,) = inspect(path).files
    (f,) = [f for f in file.findings if f.code == "BN004"]
    assert (f.layer, f.severity, f.channels) == ("bn2", "warning", (DEAD,))

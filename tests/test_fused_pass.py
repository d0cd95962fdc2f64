"""The exact pass measures each BN input once: chunked float64 sums, and the layer
normalises with the measured batch statistics instead of computing them again."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import bnaudit.runtime.stats as stats
from bnaudit.errors import BnauditError
from bnaudit.runtime.recalibrate.methods import recalibrate_module
from bnaudit.runtime.stats import shifted_sums


def split(x: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
    return [x[i : i + batch_size] for i in range(0, len(x), batch_size)]


@pytest.mark.parametrize("chunk_bytes", [8, 8 * 3 * 35 * 2, 1 << 19])
def test_chunked_sums_equal_one_float64_pass(monkeypatch: pytest.MonkeyPatch, chunk_bytes: int) -> None:
    # one, two and all 37 samples per chunk (a sample is 3 * 5 * 7 values)
    monkeypatch.setattr(stats, "CHUNK_BYTES", chunk_bytes)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(37, 3, 5, 7, generator=g) * 0.25 + 1000.0
    shift = torch.tensor([999.5, 1000.0, 0.0], dtype=torch.float64)
    s1, s2 = shifted_sums(x, shift)
    d = x.double() - shift.view(1, 3, 1, 1)
    assert torch.allclose(s1, d.sum(dim=(0, 2, 3)), rtol=1e-12, atol=0)
    assert torch.allclose(s2, (d * d).sum(dim=(0, 2, 3)), rtol=1e-12, atol=0)


class Capture(nn.Module):
    """Identity that keeps what it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.clone())
        return x


def test_pass_output_is_the_training_mode_output_to_rounding() -> None:
    torch.manual_seed(0)
    conv, bn, capture = nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), Capture()
    with torch.no_grad():
        bn.weight.copy_(torch.tensor([0.5, 2.0, -1.0]))
        bn.bias.copy_(torch.tensor([0.1, -3.0, 7.0]))
    model = nn.Sequential(conv, bn, capture, nn.BatchNorm2d(3))
    x = torch.randn(40, 2, 6, 6, generator=torch.Generator().manual_seed(1)) * 3 + 5
    recalibrate_module(model, split(x, 8))
    with torch.no_grad():
        for batch, seen in zip(split(x, 8), capture.seen):
            expected = F.batch_norm(conv(batch), None, None, bn.weight, bn.bias, True, 0.0, bn.eps)
            assert torch.allclose(seen, expected, rtol=1e-5, atol=1e-5)


class ScaledBN(nn.BatchNorm2d):
    """A subclass with its own forward: 2 * BN(x) + 1."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2 + 1


def test_a_bn_subclass_with_its_own_forward_keeps_it() -> None:
    first, second = ScaledBN(2), nn.BatchNorm2d(2)
    x = torch.randn(64, 2, 4, 4, generator=torch.Generator().manual_seed(2)) * 5 - 3
    recalibrate_module(nn.Sequential(first, second), [x])
    # the training-mode output of `first` has mean 0 and biased variance v / (v + eps)
    # per channel; scaled: mean 1, unbiased variance 4 * v / (v + eps) * n / (n - 1)
    v = x.double().transpose(0, 1).reshape(2, -1).var(1, unbiased=False)
    n = 64 * 16
    assert torch.allclose(second.running_mean.double(), torch.ones(2, dtype=torch.float64), atol=1e-5)
    assert torch.allclose(second.running_var.double(), 4 * v / (v + first.eps) * n / (n - 1), rtol=1e-5)


def test_layers_get_their_own_forward_back_also_after_an_error() -> None:
    class Fails(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] == 3:
                raise RuntimeError("bad batch")
            return x

    bns = [nn.BatchNorm1d(4), nn.SyncBatchNorm(4)]
    model = nn.Sequential(bns[0], Fails(), bns[1])
    batches = [torch.randn(5, 4), torch.randn(3, 4)]
    with pytest.raises(BnauditError, match="batch 1"):
        recalibrate_module(model, batches)
    assert all("forward" not in vars(bn) for bn in bns)
    recalibrate_module(model, [batches[0], batches[0] + 1])
    assert all("forward" not in vars(bn) for bn in bns)
    assert torch.allclose(bns[0].running_mean, batches[0].mean(0) + 0.5, atol=1e-6)

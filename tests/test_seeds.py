"""The seeds' hand arithmetic, reproduced with real BatchNorm layers and through bnaudit."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import save_torch
from torch import nn

from bnaudit import inspect
from bnaudit.runtime.stats import ChannelStats


def two_batch_layer() -> nn.BatchNorm1d:
    """Seed 002: batch means 3 then 7, unbiased batch variances 2 and 2 (batches (2,4), (6,8))."""
    bn = nn.BatchNorm1d(1)
    bn.train()
    with torch.no_grad():
        bn(torch.tensor([[2.0], [4.0]]))
        bn(torch.tensor([[6.0], [8.0]]))
    return bn


def test_two_batch_example_gives_097_and_119():
    bn = two_batch_layer()
    # 0.9*0 + 0.1*3 = 0.3; 0.9*0.3 + 0.1*7 = 0.97.  0.9*1 + 0.1*2 = 1.1; 0.9*1.1 + 0.1*2 = 1.19
    assert bn.running_mean.item() == pytest.approx(0.97, abs=1e-6)
    assert bn.running_var.item() == pytest.approx(1.19, abs=1e-6)
    assert bn.num_batches_tracked.item() == 2


def test_two_batch_checkpoint_is_reported_with_initial_weight_81_percent(tmp_path):
    path = save_torch(two_batch_layer().state_dict(), tmp_path / "two.pt")
    report = inspect(path)
    (file,) = report.files
    (layer,) = file.layers
    assert layer.mean_min == pytest.approx(0.97, abs=1e-6)
    assert layer.var_median == pytest.approx(1.19, abs=1e-6)
    assert layer.num_batches_tracked == 2
    (finding,) = [f for f in file.findings if f.code == "BN003"]
    assert f"{0.9**2 * 100:.1f}%" == "81.0%"
    assert "81.0%" in finding.message


def test_eval_and_train_normalise_six_differently():
    """Seed 002: eval gives (6 - 0.97)/sqrt(1.19) ~ 4.61; train on (6, 8) gives -1."""
    bn = two_batch_layer()
    bn.eval()
    with torch.no_grad():
        y_eval = bn(torch.tensor([[6.0], [8.0]]))[0].item()
    assert y_eval == pytest.approx((6 - 0.97) / math.sqrt(1.19 + bn.eps), rel=1e-5)
    assert y_eval == pytest.approx(4.61, abs=0.01)
    bn.train()
    with torch.no_grad():
        y_train = bn(torch.tensor([[6.0], [8.0]]))[0].item()
    assert y_train == pytest.approx(-1.0 / math.sqrt(1 + bn.eps / 1.0), rel=1e-5)


@pytest.mark.parametrize("split", [[4], [2, 2], [1, 3], [1, 1, 1, 1], [3, 1]])
def test_four_values_give_mean_5_and_unbiased_variance_20_over_3_whatever_the_batches(split):
    values = torch.tensor([2.0, 4.0, 6.0, 8.0]).view(4, 1)
    stats = ChannelStats()
    for chunk in values.split(split):
        stats.update(chunk)
    assert stats.count == 4
    assert stats.mean.item() == 5.0
    assert stats.var.item() == pytest.approx(20 / 3, rel=1e-15)
    assert stats.var_biased.item() == pytest.approx(5.0, rel=1e-15)


def test_channel_stats_stay_exact_when_the_mean_dwarfs_the_spread():
    """E[x^2] - E[x]^2 in float32 loses everything here; Chan merges in float64 do not."""
    base = torch.full((1000, 1), 1e4, dtype=torch.float32)
    x = base + torch.arange(1000, dtype=torch.float32).view(-1, 1) % 2  # 1e4 and 1e4+1 alternating
    stats = ChannelStats()
    for chunk in x.split(7):
        stats.update(chunk)
    assert stats.mean.item() == pytest.approx(1e4 + 0.5, rel=1e-15)
    assert stats.var.item() == pytest.approx(0.25 * 1000 / 999, rel=1e-12)
    naive = (x.square().mean() - x.mean().square()).item()
    assert abs(naive - 0.25) > 0.05  # the anchor tools' formula really fails on this input

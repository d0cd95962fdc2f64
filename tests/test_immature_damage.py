"""BN003 graded by the damage its immature buffers do: a short training on data of small
variance collapses eval mode with few initial values left, and BN003 says by how much
the stored variance overstates the data's, checked against the batch statistics the
test records itself while training."""

from __future__ import annotations

import copy
import re
import statistics

import pytest
import torch
from conftest import save_torch
from torch import nn

from bnaudit.api import inspect
from bnaudit.config import Config

STEPS, MOMENTUM, EPS = 20, 0.1, 1e-5  # 0.9^20 = 12.2% of initial values: a BN003 warning by the counter


def _blobs(scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """10 overlapping Gaussian classes in 32-D, multiplied by `scale`."""
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(10, 32, generator=g)
    y = torch.randint(0, 10, (2048,), generator=g)
    return (centres[y] + 0.7 * torch.randn(2048, 32, generator=g)) * scale, y


def _short_training(scale: float):
    """An MLP with two BN layers trained for STEPS Adam steps; the unbiased variance of every
    training batch that reached each BN, recorded by a hook (the data's statistics as
    PyTorch's running update sees them), and the accuracies in train and eval mode."""
    x, y = _blobs(scale)
    torch.manual_seed(1)
    net = nn.Sequential(
        nn.Linear(32, 64, bias=False),
        nn.BatchNorm1d(64),
        nn.ReLU(),
        nn.Linear(64, 64, bias=False),
        nn.BatchNorm1d(64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )
    seen: dict[str, list[torch.Tensor]] = {"1": [], "4": []}
    hooks = [
        net.get_submodule(name).register_forward_pre_hook(
            lambda module, args, name=name: seen[name].append(args[0].detach().var(0, unbiased=True))
        )
        for name in seen
    ]
    optimizer = torch.optim.Adam(net.parameters(), lr=0.02)
    g = torch.Generator().manual_seed(2)
    net.train()
    for _ in range(STEPS):
        idx = torch.randperm(len(x), generator=g)[:64]
        loss = nn.functional.cross_entropy(net(x[idx]), y[idx])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    for hook in hooks:
        hook.remove()
    with torch.no_grad():
        batch_mode = copy.deepcopy(net).train()
        train_accuracy = (batch_mode(x).argmax(1) == y).float().mean().item()
        net.eval()
        eval_accuracy = (net(x).argmax(1) == y).float().mean().item()
    return net, seen, train_accuracy, eval_accuracy


def _overstatement(net: nn.Module, batches: list[torch.Tensor], layer: str) -> float:
    """Median over channels of stored running_var / the data's variance, the data's being
    the momentum-weighted mean of the recorded batch variances (weights m(1-m)^(t-k),
    normalised to sum 1), eps added to both."""
    assert len(batches) == STEPS
    weights = torch.tensor([MOMENTUM * (1 - MOMENTUM) ** (STEPS - 1 - k) for k in range(STEPS)], dtype=torch.float64)
    data_var = (weights[:, None] * torch.stack(batches).double()).sum(0) / weights.sum()
    stored = net.get_submodule(layer).running_var.double()
    return statistics.median(((stored + EPS) / (data_var + EPS)).tolist())


def _factor(message: str) -> float:
    found = re.search(r"stored running_var about ([0-9.]+)x the data's", message)
    assert found, message
    return float(found.group(1))


def test_bn003_is_an_error_with_the_overstatement_when_small_data_collapses_eval_mode(tmp_path):
    net, seen, train_accuracy, eval_accuracy = _short_training(0.03)
    assert train_accuracy > 0.9 and eval_accuracy < 0.4  # the premise: eval mode collapses
    first = _overstatement(net, seen["1"], "1")
    second = _overstatement(net, seen["4"], "4")
    assert first > 20 and 0.5 < second < 2  # small inputs: only the first BN's data is small
    path = save_torch(net.state_dict(), tmp_path / "short.pt")
    by_layer = {f.layer: f for f in inspect(path, Config()).files[0].findings if f.code == "BN003"}
    assert set(by_layer) == {"1", "4"}
    assert by_layer["1"].severity == "error"
    assert "12.2% after 20 updates" in by_layer["1"].message
    # the message's two significant digits against the test's own computation
    assert _factor(by_layer["1"].message) == pytest.approx(first, rel=0.05)
    # the second layer's data has about unit variance: 12.2% of initial values do little
    assert by_layer["4"].severity == "warning" and "data's" not in by_layer["4"].message
    # the threshold is configurable: above the factor, the counter's warning again
    raised = inspect(path, Config(max_implied_var_ratio=first * 2, max_implied_mean_shift=100)).files[0]
    assert {f.severity for f in raised.findings if f.code == "BN003"} == {"warning"}


def test_bn003_stays_a_warning_after_a_short_run_on_unit_variance_data(tmp_path):
    net, seen, _, eval_accuracy = _short_training(1.0)
    assert eval_accuracy > 0.9  # nothing collapses
    assert all(0.5 < _overstatement(net, seen[layer], layer) < 2 for layer in seen)
    path = save_torch(net.state_dict(), tmp_path / "short.pt")
    found = [f for f in inspect(path, Config()).files[0].findings if f.code == "BN003"]
    assert [(f.layer, f.severity) for f in found] == [("1", "warning"), ("4", "warning")]
    assert all("data's" not in f.message and "12.2%" in f.message for f in found)


def test_unmoved_variance_without_a_counter_or_live_copy_is_a_warning(tmp_path):
    """An EMA copy saved alone, and a layer without a counter: 3 of 4 channels still hold
    running_var 1.0 exactly (the initial value) while the weights are trained."""
    from conftest import bn_entries

    unmoved = torch.tensor([1.0, 1.0, 1.0, 0.4])
    state = bn_entries("bn", 4, var=unmoved, counter=None)
    (f,) = inspect(save_torch(state, tmp_path / "plain.pt"), Config()).files[0].findings
    assert (f.code, f.severity, f.layer) == ("BN003", "warning", "bn") and "75%" in f.message
    ema = inspect(save_torch({"model_ema": bn_entries("bn", 4, var=unmoved)}, tmp_path / "ema.pt"), Config())
    (f,) = ema.files[0].findings
    assert ema.files[0].is_ema and (f.code, f.severity) == ("BN003", "warning") and "EMA copy" in f.message
    # a channel one float32 step above 1 (2^-23) still counts as unmoved; half the channels moved does not
    near = torch.tensor([1.0 + 2.0**-23, 1.0, 0.3, 0.4], dtype=torch.float32)
    (f,) = inspect(save_torch(bn_entries("bn", 4, var=near, counter=None), tmp_path / "n.pt")).files[0].findings
    assert "50%" in f.message
    moved = torch.tensor([1.0, 0.2, 0.3, 0.4])
    assert inspect(save_torch(bn_entries("bn", 4, var=moved, counter=None), tmp_path / "m.pt")).files[0].findings == []


def test_a_float_counter_is_a_counter_not_its_absence(tmp_path):
    """The no-counter check of BN003 (running_var still 1 in half the channels while the
    weights are trained) is for files without counters: a counter the file holds as a float
    (a converted checkpoint) is not absent, and the check says "no counter" only when it is."""
    from conftest import save_safetensors

    from bnaudit.audit.checkpoint.inspect import audit_file
    from bnaudit.config import Config

    state = {
        "a.running_mean": torch.zeros(2),
        "a.running_var": torch.tensor([0.5, 1.0]),  # half the channels still at the initial 1
        "a.weight": torch.tensor([0.7, 1.3]),  # trained
        "a.bias": torch.tensor([0.1, -0.2]),
    }
    without = audit_file(save_safetensors(state, tmp_path / "without.safetensors"), Config())
    assert [(f.code, f.layer) for f in without.findings if f.code == "BN003"] == [("BN003", "a")]
    assert "no counter" in next(f.message for f in without.findings if f.code == "BN003")
    state["a.num_batches_tracked"] = torch.tensor(3.0)
    with_float = audit_file(save_safetensors(state, tmp_path / "float.safetensors"), Config())
    assert [f.code for f in with_float.findings if f.code == "BN003"] == []

"""norms.py is the one answer to "which modules are BatchNorm" and to switching them to batch
statistics and back."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from bnaudit.runtime.norms import (
    batch_statistics,
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


class Mixed(nn.Module):
    """SyncBatchNorm, a tracked InstanceNorm, Dropout and a BatchNorm left in eval mode."""

    def __init__(self) -> None:
        super().__init__()
        self.sync = nn.SyncBatchNorm(3)
        self.inorm = nn.InstanceNorm2d(3, track_running_stats=True)
        self.drop = nn.Dropout(0.5)
        self.bn = nn.BatchNorm2d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.drop(self.inorm(self.sync(x))))


def _trained(model: nn.Module) -> nn.Module:
    model.train()
    with torch.no_grad():
        for i in range(5):
            model(torch.randn(4, 3, 5, 5, generator=torch.Generator().manual_seed(i)) * 2 + 1)
    return model


def test_batch_statistics_switches_the_chosen_layers_and_restores_modes_buffers_and_forwards() -> None:
    model = _trained(Mixed())
    model.train()
    model.bn.eval()  # a mixed starting state comes back as it was
    model.sync.forward = model.sync.forward  # an instance forward of the user's: kept
    own_forward = vars(model.sync)["forward"]
    modes = {n: m.training for n, m in model.named_modules()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(6, 3, 5, 5, generator=torch.Generator().manual_seed(9)) * 3 - 1
    chosen = {"sync": model.sync, "inorm": model.inorm}
    with batch_statistics(model, chosen) as switched, torch.no_grad():
        assert switched == chosen
        assert model.sync.training and model.inorm.training
        assert not model.drop.training and not model.bn.training and not model.training
        out = model(x)
        # the training-mode forwards ran: the InstanceNorm's buffers moved inside the block
        assert not torch.equal(model.inorm.running_mean, state["inorm.running_mean"])
    # by hand: batch statistics at sync (biased variance over N, H, W), each instance's own
    # at inorm, Dropout off, running statistics at bn
    mu, var = x.mean(dim=(0, 2, 3), keepdim=True), x.var(dim=(0, 2, 3), unbiased=False, keepdim=True)
    h = (x - mu) / torch.sqrt(var + 1e-5) * model.sync.weight.view(1, -1, 1, 1) + model.sync.bias.view(1, -1, 1, 1)
    m_i, v_i = h.mean(dim=(2, 3), keepdim=True), h.var(dim=(2, 3), unbiased=False, keepdim=True)
    h = (h - m_i) / torch.sqrt(v_i + 1e-5)
    rm, rv = state["bn.running_mean"].view(1, -1, 1, 1), state["bn.running_var"].view(1, -1, 1, 1)
    expected = (h - rm) / torch.sqrt(rv + 1e-5) * model.bn.weight.view(1, -1, 1, 1) + model.bn.bias.view(1, -1, 1, 1)
    assert torch.allclose(out, expected, atol=1e-5)
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert {n: m.training for n, m in model.named_modules()} == modes
    assert vars(model.sync)["forward"] is own_forward
    # restored after an error too; None: every norm layer
    del model.sync.forward
    with pytest.raises(RuntimeError), batch_statistics(model) as switched:
        assert list(switched) == ["sync", "inorm", "bn"]
        model(torch.randn(2, 4, 5, 5))
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert {n: m.training for n, m in model.named_modules()} == modes
    assert "forward" not in vars(model.sync)


def test_syncbatchnorm_runs_as_plain_batchnorm_in_a_process_group(tmp_path) -> None:
    # In a process group, SyncBatchNorm's training-mode forward would all-reduce the batch
    # statistics (and refuses CPU tensors); the switch runs it on this process's batch.
    import torch.distributed as dist

    model = _trained(nn.Sequential(nn.SyncBatchNorm(3))).eval()
    plain = nn.BatchNorm2d(3)
    plain.load_state_dict(model[0].state_dict())
    x = torch.randn(4, 3, 2, 2)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="SyncBatchNorm expected input tensor to be on GPU"), torch.no_grad():
            model.train()(x)
        model.eval()
        with batch_statistics(model), torch.no_grad():
            out = model(x)
    finally:
        dist.destroy_process_group()
    with torch.no_grad():
        assert torch.equal(out, plain.train()(x))

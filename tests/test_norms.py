"""norms.py is the one answer to "which modules are BatchNorm" and to the batch-joining rule."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from bnaudit.runtime.data import batch_indices
from bnaudit.runtime.distributed import shard_batches
from bnaudit.runtime.norms import (
    batchnorm_modules,
    classify_layers,
    concat_batches,
    is_batchnorm,
    merge_trailing_singleton,
    merge_trailing_singleton_plan,
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


@pytest.mark.parametrize(
    ("sizes", "expected"),
    [
        ([3, 3, 1], [3, 4]),
        ([3, 1, 3, 1], [3, 1, 4]),
        ([1], [1]),
        ([2, 2], [2, 2]),
        ([1, 1, 1], [1, 2]),
        ([], []),
    ],
)
def test_a_last_batch_of_one_joins_the_previous_one_in_streams_and_plans(sizes: list[int], expected: list[int]) -> None:
    tensors = [torch.full((n, 2), float(i)) for i, n in enumerate(sizes)]
    merged = list(merge_trailing_singleton(tensors))
    assert [len(b) for b in merged] == expected
    assert torch.equal(
        torch.cat(merged) if merged else torch.empty(0), torch.cat(tensors) if tensors else torch.empty(0)
    )
    start = 0
    plan = []
    for n in sizes:
        plan.append(list(range(start, start + n)))
        start += n
    assert [len(b) for b in merge_trailing_singleton_plan(plan)] == expected
    assert [i for b in merge_trailing_singleton_plan(plan) for i in b] == list(range(start))


def test_data_plans_join_a_last_batch_of_one_and_rank_shards_keep_whole_batches() -> None:
    # 9 samples in batches of 4: 4, 4, 1 -> 4, 5
    assert [len(b) for b in batch_indices(9, 4, shuffle=False)] == [4, 5]
    # 21 samples in batches of 4: 4, 4, 4, 4, 5; two ranks take 3 and 2 whole batches
    plan = batch_indices(21, 4, shuffle=False)
    assert shard_batches(plan, 0, 2) == (0, plan[:3])
    assert shard_batches(plan, 1, 2) == (3, plan[3:])
    for world in (1, 2, 3, 4, 7):
        shards = [shard_batches(plan, rank, world) for rank in range(world)]
        # the plan's own batches, each on exactly one rank, in order, numbered as in the plan
        assert [b for _, batches in shards for b in batches] == plan
        assert all(plan[first : first + len(batches)] == batches for first, batches in shards)
        sizes = [len(batches) for _, batches in shards]
        assert max(sizes) - min(sizes) <= 1 and sizes[0] >= 1
    # more ranks than batches: the last ranks have none
    assert [len(shard_batches(plan, rank, 7)[1]) for rank in range(7)] == [1, 1, 1, 1, 1, 0, 0]


def test_concat_batches_keeps_every_sample_of_both_halves() -> None:
    a = {"x": torch.zeros(2, 3), "names": ["a0", "a1"], "pair": (torch.zeros(2), torch.ones(2))}
    b = {"x": torch.ones(1, 3), "names": ["b0"], "pair": (torch.zeros(1), torch.ones(1))}
    joined = concat_batches(a, b)
    assert joined["x"].shape == (3, 3) and joined["x"][2].tolist() == [1, 1, 1]
    assert joined["names"] == ["a0", "a1", "b0"]
    assert [t.shape[0] for t in joined["pair"]] == [3, 3]
    assert concat_batches(object(), object()) is None  # unknown: left to the producer

"""batching.py is the one batch plan: which samples share a batch, and which rank runs it."""

from __future__ import annotations

import operator

import pytest
import torch

from bnaudit.runtime.batching import BatchPlan, concat_batches, merge_trailing_singleton


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
    cut = BatchPlan([list(b) for b in merge_trailing_singleton(plan, size=len, join=operator.add)])
    assert [len(b) for b in cut] == expected
    assert [i for b in cut for i in b] == list(range(start))
    if sizes and len(set(sizes[:-1])) <= 1 and sizes[-1] <= sizes[0]:
        # a plan cut from an order: the same rule
        assert BatchPlan.cut(range(start), sizes[0]).batches == cut.batches


def test_data_plans_join_a_last_batch_of_one_and_rank_shards_keep_whole_batches() -> None:
    # 9 samples in batches of 4: 4, 4, 1 -> 4, 5
    assert [len(b) for b in BatchPlan.draw(9, 4, shuffle=False).batches] == [4, 5]
    # 21 samples in batches of 4: 4, 4, 4, 4, 5; two ranks take 3 and 2 whole batches
    whole = BatchPlan.draw(21, 4, shuffle=False)
    plan = whole.batches
    assert whole.shard(0, 2) == BatchPlan(plan[:3], 0)
    assert whole.shard(1, 2) == BatchPlan(plan[3:], 3)
    for world in (1, 2, 3, 4, 7):
        shards = [(s.first, s.batches) for s in (whole.shard(rank, world) for rank in range(world))]
        # the plan's own batches, each on exactly one rank, in order, numbered as in the plan
        assert [b for _, batches in shards for b in batches] == plan
        assert all(plan[first : first + len(batches)] == batches for first, batches in shards)
        sizes = [len(batches) for _, batches in shards]
        assert max(sizes) - min(sizes) <= 1 and sizes[0] >= 1
    # more ranks than batches: the last ranks have none
    assert [len(whole.shard(rank, 7)) for rank in range(7)] == [1, 1, 1, 1, 1, 0, 0]
    # a shard of a shard numbers its batches as the whole plan does
    assert whole.shard(1, 2).shard(1, 2) == BatchPlan(plan[4:], 4)


def test_concat_batches_keeps_every_sample_of_both_halves() -> None:
    a = {"x": torch.zeros(2, 3), "names": ["a0", "a1"], "pair": (torch.zeros(2), torch.ones(2))}
    b = {"x": torch.ones(1, 3), "names": ["b0"], "pair": (torch.zeros(1), torch.ones(1))}
    joined = concat_batches(a, b)
    assert joined["x"].shape == (3, 3) and joined["x"][2].tolist() == [1, 1, 1]
    assert joined["names"] == ["a0", "a1", "b0"]
    assert [t.shape[0] for t in joined["pair"]] == [3, 3]
    assert concat_batches(object(), object()) is None  # unknown: left to the producer

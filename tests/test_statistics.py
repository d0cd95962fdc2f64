"""One name per statistic, one definition each (issue 20, question 6).

`bnaudit.audit.statistics` names every statistic of running statistics and outputs and
gives its formula. Here: the JSON fields of gap, recalibrate and diff are those names,
the same name is the same aggregate in every command (it used to mean the channel mean in
gap and the channel maximum in diff), and the relative output deviation of invariance and
of diff's export parity (and gap's relative L2) equal the definitions computed here by
hand.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from conftest import save_safetensors
from torch import nn

from bnaudit.audit import statistics
from bnaudit.audit.checkpoint.report import FileReport
from bnaudit.audit.diff.checkpoints import diff
from bnaudit.output.json import diff_to_json
from bnaudit.output.measured_json import gap_to_json
from bnaudit.reports.gap import GapReport, LayerDrift
from bnaudit.runtime.stats import drift

EPS = 1e-5
# One BN layer of three channels. A is the reference (diff's "before"; gap's running
# statistics), B the compared side (diff's "after"; gap's data reaching the layer).
MEAN_A, VAR_A = [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]
MEAN_B, VAR_B = [0.5, 0.0, 3.0], [1.0, 4.0, 1.0]


def by_hand() -> dict[str, float]:
    """The four channel aggregates of B against A, from the formulas of the issue."""
    shifts = [abs(b - a) / math.sqrt(v + EPS) for a, b, v in zip(MEAN_A, MEAN_B, VAR_A)]
    ratios = [abs(math.log((vb + EPS) / (va + EPS))) for va, vb in zip(VAR_A, VAR_B)]
    return {
        "mean_shift": sum(shifts) / 3,  # (0.5 + 0 + 3) / 3 / sqrt(1 + eps)
        "max_mean_shift": max(shifts),  # 3 / sqrt(1 + eps)
        "var_log_ratio": sum(ratios) / 3,  # ln(4) / 3, nearly
        "max_var_log_ratio": max(ratios),  # ln(4), nearly
    }


def bn_state(mean: list[float], var: list[float]) -> dict[str, torch.Tensor]:
    return {
        "bn.weight": torch.ones(3),
        "bn.bias": torch.zeros(3),
        "bn.running_mean": torch.tensor(mean),
        "bn.running_var": torch.tensor(var),
        "bn.num_batches_tracked": torch.tensor(100),
    }


def gap_layer_json() -> dict:
    """gap's JSON for the layer: the drift gap computes (`runtime.stats.drift`) of the
    data B against the running statistics A."""
    d = drift(MEAN_B, VAR_B, MEAN_A, VAR_A, EPS)
    layer = LayerDrift("bn", 0, "BatchNorm2d", 3, 1000, d.mean_shift, d.max_mean_shift, d.var_log_ratio)
    report = GapReport(
        "m.pt", "net", "val", 8, 4, 2, 0, True, "cpu", None, None, None, None, None, "relative_l2", [layer],
        FileReport("m.pt"),
    )  # fmt: skip
    return gap_to_json(report)["layers"][0]


def diff_layer_json(tmp_path) -> dict:
    a = save_safetensors(bn_state(MEAN_A, VAR_A), tmp_path / "a.safetensors")
    b = save_safetensors(bn_state(MEAN_B, VAR_B), tmp_path / "b.safetensors")
    return diff_to_json(diff(a, b))["layers"][0]


def test_the_definitions_module_names_each_statistic_once():
    names = [s.name for s in statistics.STATISTICS.values()]
    columns = [s.column for s in statistics.STATISTICS.values()]
    assert len(set(names)) == len(names) and len(set(columns)) == len(columns)
    for s in statistics.STATISTICS.values():
        assert s.name in statistics.__doc__ and s.formula


def test_one_name_is_one_aggregate_in_gap_and_diff(tmp_path):
    # The same data through both commands: B's statistics against A's. Every statistic a
    # document reports under a name of the definitions module must be that aggregate;
    # "mean_shift" was the channel maximum in diff and the channel mean in gap.
    expected = by_hand()
    assert expected["mean_shift"] != pytest.approx(expected["max_mean_shift"])  # the test can tell them apart
    documents = {"gap": gap_layer_json(), "diff": diff_layer_json(tmp_path)}
    reported = {}
    for command, layer in documents.items():
        named = {k: v for k, v in layer.items() if k in statistics.STATISTICS}
        assert named, command
        for name, value in named.items():
            assert value == pytest.approx(expected[name], rel=1e-6), (command, name)
            reported.setdefault(name, []).append(command)
    # gap reports channel means (and the largest shift), diff the channel maxima
    assert reported == {
        "mean_shift": ["gap"],
        "max_mean_shift": ["gap", "diff"],
        "var_log_ratio": ["gap"],
        "max_var_log_ratio": ["diff"],
    }


def test_no_document_reports_a_drift_statistic_under_another_name(tmp_path):
    # Field names that look like a statistic but are not one of the module's names.
    looks_like = ("shift", "log_ratio", "deviation", "relative")
    for layer in (gap_layer_json(), diff_layer_json(tmp_path)):
        for key in layer:
            if any(part in key for part in looks_like):
                assert key in statistics.STATISTICS, key


def test_the_plain_definitions_give_the_hand_values():
    e = by_hand()
    shifts = [statistics.channel_shift(b, a, v, EPS) for a, b, v in zip(MEAN_A, MEAN_B, VAR_A)]
    ratios = [statistics.channel_log_var_ratio(vb, va, EPS) for va, vb in zip(VAR_A, VAR_B)]
    assert max(shifts) == pytest.approx(e["max_mean_shift"], rel=1e-12)
    assert sum(ratios) / 3 == pytest.approx(e["var_log_ratio"], rel=1e-12)
    assert math.isnan(statistics.channel_shift(1.0, 0.0, -1.0, EPS))  # a negative variance
    # relative_deviation: 0.5 moved on a largest finite reference value of 2
    assert statistics.relative_deviation([-math.inf, 1.5, 2.0], [-math.inf, 1.0, 2.0]) == 0.25
    assert statistics.relative_deviation([math.nan, 1.0], [math.nan, 1.0]) == 0.0
    assert statistics.relative_deviation([math.nan, 1.0], [0.0, 1.0]) == math.inf
    assert statistics.relative_l2([3.0, 4.0], [0.0, 0.0]) == 5.0 / statistics.TINY
    assert statistics.relative_l2([1.0, 1.0], [0.0, 2.0]) == pytest.approx(math.sqrt(2) / 2)


# ----------------------------------------------------------------------------- outputs

# Reference outputs (torch, alone) and outputs to compare (onnxruntime, in a batch): row 0
# with -inf in the same place on both sides (a log-probability of 0), row 1 a plain change,
# row 2 NaN in the same place.
REFERENCE = [[-math.inf, 1.0, 2.0], [4.0, -8.0, 2.0], [math.nan, 3.0, 0.0]]
COMPARED = [[-math.inf, 1.5, 2.0], [4.0, -8.0, 2.5], [math.nan, 3.0, 0.0]]


def expected_deviations() -> list[float]:
    # by hand: 0.5 / 2 (the -inf is equal on both sides); 0.5 / 8; nothing moved
    return [0.25, 0.0625, 0.0]


def test_invariance_compares_outputs_by_the_definition():
    from bnaudit.runtime.invariance import compare_outputs

    got = compare_outputs([torch.tensor(COMPARED)], torch.tensor(REFERENCE)).deviations[0].tolist()
    assert got == expected_deviations()
    assert got == [statistics.relative_deviation(y, r) for y, r in zip(COMPARED, REFERENCE)]


class _Rows(nn.Module):
    """Outputs REFERENCE row i for an input holding i (any float32 rounding is exact here)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        table = torch.tensor(REFERENCE, dtype=x.dtype)
        return table[x[:, 0].long()]


class _Session:
    """An onnxruntime session stand-in that answers COMPARED row i for input i."""

    def get_inputs(self):
        return [SimpleNamespace(name="x", shape=["N", 1])]

    def run(self, _names, feed):
        rows = torch.from_numpy(feed["x"])[:, 0].long()
        return [torch.tensor(COMPARED, dtype=torch.float32)[rows].numpy()]


def test_export_parity_measures_the_relative_deviation_of_the_definition(tmp_path):
    # Row 0 has -inf and row 2 NaN on both sides: the old per-sample max |y - ref| / max |ref|
    # made them NaN, the batch's maximum NaN, and Python's max() then reported 0.
    from bnaudit.runtime.data import DataOptions
    from bnaudit.runtime.parity.onnx import measure_output_parity

    data = save_safetensors({"inputs": torch.tensor([[0.0], [1.0], [2.0]])}, tmp_path / "data.safetensors")
    result = measure_output_parity(_Session(), _Rows(), DataOptions(path=data, batch_size=3, shuffle=False))
    assert result.samples == 3
    assert result.max_deviation == max(expected_deviations())
    assert result.max_deviation == max(statistics.relative_deviation(y, r) for y, r in zip(COMPARED, REFERENCE))


def test_the_relative_l2_gap_uses_is_the_definition():
    # gap's divergence for outputs that are not class scores: relative_l2 of the
    # train-mode outputs against the eval-mode ones, averaged over the samples (measured
    # end to end in tests/test_gap.py::test_non_classifier_output_uses_relative_l2).
    from bnaudit.runtime.deviation import relative_l2s

    evals = torch.tensor([[3.0], [0.5]]).expand(2, 1)
    train = torch.tensor([[0.0], [1.0]])
    got = relative_l2s(train, evals).tolist()
    assert got == [statistics.relative_l2(t, e) for t, e in zip(train.tolist(), evals.tolist())] == [1.0, 1.0]

"""The notebook API: every public name resolves lazily and works without the CLI."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import REPO, SAMPLES

import bnaudit
from bnaudit.runtime.models import ModelSpec


def test_public_names_resolve():
    from bnaudit.api import inspect
    from bnaudit.runtime.gap import measure_gap
    from bnaudit.runtime.recalibrate.command import recalibrate_checkpoint
    from bnaudit.runtime.recalibrate.methods import recalibrate_module

    assert bnaudit.inspect is inspect and bnaudit.measure_gap is measure_gap
    assert bnaudit.recalibrate_checkpoint is recalibrate_checkpoint and bnaudit.recalibrate_module is recalibrate_module
    from bnaudit.audit.fed.federation import audit_federation
    from bnaudit.runtime.recalibrate.merge import merge_statistics

    assert bnaudit.merge_statistics is merge_statistics and bnaudit.audit_federation is audit_federation
    with pytest.raises(AttributeError):
        bnaudit.no_such_name  # noqa: B018


def test_importing_bnaudit_imports_neither_torch_nor_numpy():
    code = "import sys, bnaudit; print('torch' in sys.modules, 'numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO).stdout
    assert out.split() == ["False", "False"]


def test_recalibrate_module_on_the_seed_values():
    model = torch.nn.Sequential(torch.nn.BatchNorm1d(1))
    bnaudit.recalibrate_module(model, [torch.tensor([[2.0], [4.0]]), torch.tensor([[6.0], [8.0]])])
    assert model[0].running_mean.item() == 5.0
    assert model[0].running_var.item() == pytest.approx(20 / 3)


def test_measure_gap_from_python(tmp_path):
    report = bnaudit.measure_gap(
        ModelSpec(f"{SAMPLES}/reset_stats.pt", arch=f"{SAMPLES}/digits_net.py:digits_net"),
        bnaudit.DataOptions(path=f"{SAMPLES}/data/digits_val.safetensors"),
    )
    assert report.samples == 400 and report.gap == pytest.approx(report.train_accuracy - report.eval_accuracy)
    assert report.gap > 0.3  # reset statistics cost a large part of the accuracy

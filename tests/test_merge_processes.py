"""Shards run by independent processes, one of them under torchrun (2 ranks inside the shard
job), merged: equal to one process over all the data to float64 rounding (issue #36)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import SAMPLES, run_ranks

from bnaudit.formats.bnstats import read_statistics
from bnaudit.runtime.recalibrate.statsfiles import combine_statistics

pytestmark = pytest.mark.slow  # processes per shard and per rank

COMMON = [
    os.path.join(SAMPLES, "healthy.pt"),
    "--arch",
    os.path.join(SAMPLES, "digits_net.py") + ":digits_net",
    "--data",
    os.path.join(SAMPLES, "data", "digits_calib.safetensors"),
    "--batch-size",
    "16",
    "-q",
]


def test_a_torchrun_shard_job_and_plain_shard_processes_merge_to_one_process(tmp_path: Path) -> None:
    whole = tmp_path / "whole.bnstats"
    single = run_ranks(["-m", "bnaudit", "recalibrate", *COMMON, "--stats-out", str(whole)], tmp_path, ranks=1)
    assert single.returncode == 0, single.stderr[-3000:]
    parts = [tmp_path / f"shard{i}.bnstats" for i in range(3)]
    job = run_ranks(["-m", "bnaudit", "recalibrate", *COMMON, "--shard", "0/3", "--stats-out", str(parts[0])], tmp_path)
    assert job.returncode == 0, job.stderr[-3000:]
    for i in (1, 2):
        proc = run_ranks(
            ["-m", "bnaudit", "recalibrate", *COMMON, "--shard", f"{i}/3", "--stats-out", str(parts[i])],
            tmp_path,
            ranks=1,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
    files = [read_statistics(str(p)) for p in parts]
    assert files[0].world_size == 2 and files[1].world_size == 1
    reference = read_statistics(str(whole))
    merged = combine_statistics(files)
    for layer in reference.layers:
        record = merged[layer.name]
        assert record.stats.count == layer.count and record.batches == layer.batches
        scale = np.abs(np.asarray(layer.m2)).max()
        assert np.abs(record.stats.m2.numpy() - np.asarray(layer.m2)).max() <= 1e-12 * scale
        assert np.abs(record.stats.mean.numpy() - np.asarray(layer.mean)).max() <= 1e-12 * np.abs(layer.mean).max()
    out = tmp_path / "merged.pt"
    proc = run_ranks(
        ["-m", "bnaudit", "merge", *map(str, parts), "--checkpoint", COMMON[0], "-o", str(out)], tmp_path, ranks=1
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(torch.load(out)) == len(torch.load(COMMON[0]))

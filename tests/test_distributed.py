"""torchrun --nproc-per-node 2 with gloo: ranks split the samples and combine them exactly."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import run_ranks

from bnaudit.runtime.recalibrate.methods import recalibrate_module

pytestmark = pytest.mark.slow  # torchrun: processes per rank

torch.set_num_threads(1)

# The model and data of both sides; the first BN sees the raw input, so its statistics
# do not depend on any float32 computation that could vary with the batch. The
# SyncBatchNorm would need CUDA to sync under gloo: it runs per rank, as plain BN.
SHARED = textwrap.dedent("""
    import torch
    from torch import nn

    def build():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.BatchNorm2d(2), nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
            nn.Flatten(), nn.Linear(4 * 25, 6), nn.SyncBatchNorm(6), nn.Dropout(0.3), nn.Linear(6, 3),
        )

    def samples():
        g = torch.Generator().manual_seed(1)
        return torch.randn(90, 2, 5, 5, generator=g) * 3.0 + 100.0

    def batches(x, size=8):
        return [x[i:i + size] for i in range(0, len(x), size)]
""")

WORKER = SHARED + textwrap.dedent("""
    import sys
    import torch.distributed as dist
    from bnaudit.runtime.recalibrate.methods import recalibrate_module

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    shard = samples()[rank::world]          # disjoint: every sample on exactly one rank
    out = {}
    for method in ("exact", "sequential", "cumulative"):
        model = build()
        result = recalibrate_module(model, batches(shard), method=method)
        buffers = {k: v for k, v in model.state_dict().items() if "running" in k or "num_batches" in k}
        gathered = [None] * world
        dist.all_gather_object(gathered, buffers)
        same = all(torch.equal(g[k], buffers[k]) for g in gathered for k in buffers)
        out[method] = {
            "samples": result.samples, "batches": result.batches, "world": result.world_size, "same": same,
            "layers": {l.name: (l.new_mean, l.new_var, l.count, l.batches) for l in result.layers},
        }
    if rank == 0:
        torch.save(out, sys.argv[1])
    dist.destroy_process_group()
""")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict:
    folder = tmp_path_factory.mktemp("dist")
    script, result = folder / "worker.py", folder / "result.pt"
    script.write_text(WORKER)
    proc = run_ranks([str(script), str(result)], folder)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(result, weights_only=False)


def shared() -> dict:
    namespace: dict = {}
    exec(SHARED, namespace)
    return namespace


def single(method: str, batch_list: list[torch.Tensor]) -> dict:
    ns = shared()
    result = recalibrate_module(ns["build"](), batch_list, method=method)
    return {layer.name: (layer.new_mean, layer.new_var, layer.count, layer.batches) for layer in result.layers}


def shard_batches() -> list[torch.Tensor]:
    ns = shared()
    x = ns["samples"]()
    return ns["batches"](x[0::2]) + ns["batches"](x[1::2])


def test_every_rank_ends_with_the_same_statistics(ranks: dict) -> None:
    for method, out in ranks.items():
        assert out["same"], method
        assert out["world"] == 2 and out["samples"] == 90
        assert out["batches"] == len(shard_batches()) == 12


def test_exact_first_layer_equals_one_process_on_the_same_samples(ranks: dict) -> None:
    ns = shared()
    one = single("exact", ns["batches"](ns["samples"](), 16))  # other batching: the first layer does not care
    mean, var, count, _ = ranks["exact"]["layers"]["0"]
    assert count == one["0"][2] == 90 * 25
    # float64 rounding, amplified by the conditioning of a mean of 100 over a spread of 3
    # shifted by the fresh running_mean 0: (100 / 3)^2 * 1e-16 ~ 1e-13 per sum
    assert abs(mean - one["0"][0]).max() <= 1e-12 * abs(one["0"][0]).max()
    assert abs(var - one["0"][1]).max() <= 1e-10 * one["0"][1].max()
    # deeper layers normalised by per-rank batches: equal to one process fed the same batches
    same_batches = single("exact", shard_batches())
    for name in ("2", "6"):
        assert (
            abs(ranks["exact"]["layers"][name][1] - same_batches[name][1]).max() <= 1e-5 * same_batches[name][1].max()
        )
        assert ranks["exact"]["layers"][name][3] == 12


def test_sequential_equals_one_process_whatever_the_batches(ranks: dict) -> None:
    ns = shared()
    one = single("sequential", ns["batches"](ns["samples"](), 32))
    for name, (mean, var, count, _) in ranks["sequential"]["layers"].items():
        ref_mean, ref_var, ref_count, _ = one[name]
        assert count == ref_count
        # layer 0: float64 rounding (see above); later layers: float32 eval-mode forwards of different
        # batches round differently (a wrong merge, e.g. averaging the ranks' variances,
        # would be off by ~1e-3 here)
        tol = 1e-10 if name == "0" else 1e-5
        assert abs(var - ref_var).max() <= tol * ref_var.max(), name
        assert abs(mean - ref_mean).max() <= tol * (abs(ref_mean).max() + ref_var.max() ** 0.5), name


def test_cumulative_averages_over_the_batches_of_all_ranks(ranks: dict) -> None:
    same_batches = single("cumulative", shard_batches())
    mean, var, _, batches = ranks["cumulative"]["layers"]["0"]
    assert batches == 12
    assert abs(mean - same_batches["0"][0]).max() <= 1e-12 * abs(mean).max()
    assert abs(var - same_batches["0"][1]).max() <= 1e-10 * var.max()


def test_torchrun_cli_writes_once_what_one_process_writes(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    ns = shared()
    (tmp_path / "shared_model.py").write_text(SHARED)
    save_file(ns["build"]().state_dict(), str(tmp_path / "model.safetensors"))
    save_file({"inputs": ns["samples"]()}, str(tmp_path / "calib.safetensors"))
    common = [
        "recalibrate",
        "model.safetensors",
        "--arch",
        "shared_model.py:build",
        "--data",
        "calib.safetensors",
        "--method",
        "sequential",
        "--batch-size",
        "16",
    ]
    ranks = run_ranks(["-m", "bnaudit", *common, "-o", "ranks.safetensors", "--format", "json"], tmp_path)
    assert ranks.returncode == 0, ranks.stderr[-3000:]
    one = run_ranks(["-m", "bnaudit", *common, "-o", "one.safetensors"], tmp_path, ranks=1)
    assert one.returncode == 0, one.stderr[-3000:]
    import json

    doc = json.loads(ranks.stdout)  # rank 0 alone reports
    assert doc["world_size"] == 2 and doc["samples"] == 90 and doc["provenance"]["world_size"] == 2
    assert sorted(os.listdir(tmp_path)) == [
        "calib.safetensors",
        "model.safetensors",
        "one.safetensors",
        "ranks.safetensors",
        "shared_model.py",
    ]
    a, b = load_file(str(tmp_path / "ranks.safetensors")), load_file(str(tmp_path / "one.safetensors"))
    for name in a:
        if name.endswith("running_var"):
            assert torch.allclose(a[name], b[name], rtol=1e-5), name
        elif name.endswith("running_mean"):
            assert torch.allclose(a[name], b[name], rtol=1e-5, atol=1e-5), name
        elif not name.endswith("num_batches_tracked"):
            assert torch.equal(a[name], b[name]), name


def test_torchrun_exact_recalibration_runs_the_single_process_batches(tmp_path: Path) -> None:
    # Under `exact` every BN layer normalises by batch statistics during the pass, so deeper
    # layers see values that depend on which samples share a batch: the ranks must run the
    # single process's batches (whole-batch shards) to write its statistics.
    from safetensors.torch import load_file, save_file

    ns = shared()
    (tmp_path / "shared_model.py").write_text(SHARED)
    save_file(ns["build"]().state_dict(), str(tmp_path / "model.safetensors"))
    save_file({"inputs": ns["samples"]()}, str(tmp_path / "calib.safetensors"))
    common = ["recalibrate", "model.safetensors", "--arch", "shared_model.py:build", "--data", "calib.safetensors"]
    common += ["--method", "exact", "--batch-size", "16", "--quiet"]
    ranks = run_ranks(["-m", "bnaudit", *common, "-o", "ranks.safetensors"], tmp_path)
    assert ranks.returncode == 0, ranks.stderr[-3000:]
    one = run_ranks(["-m", "bnaudit", *common, "-o", "one.safetensors"], tmp_path, ranks=1)
    assert one.returncode == 0, one.stderr[-3000:]
    a, b = load_file(str(tmp_path / "ranks.safetensors")), load_file(str(tmp_path / "one.safetensors"))
    for name in a:
        if name.endswith(("running_mean", "running_var")):
            # float64 statistics of bit-identical float32 activations, merged in another
            # grouping, then stored as float32: equal to a float32 rounding (2^-23 ~ 1.2e-7)
            scale = float(b[name].abs().max())
            assert torch.allclose(a[name], b[name], rtol=2.5e-7, atol=2.5e-7 * scale), name

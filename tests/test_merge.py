"""Statistics that merge (issue #36): shards of one data set recalibrated by independent runs
(`recalibrate --shard I/N --stats-out`, or separate data files) and merged (`bnaudit merge`)
equal one `recalibrate --method exact` over all the data, to float64 rounding before the final
cast; a numpy recomputation of the pooled formulas from the files agrees; what cannot merge
is refused in one line, exit 2, nothing written.

The model is the committed sample network (sample_models/healthy.pt, trained on the digits)
on the committed calibration digits: 112 samples in 7 batches of 16, so that 7 shards get a
batch each.
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import SAMPLES
from safetensors import safe_open
from safetensors.numpy import load_file as load_numpy
from safetensors.torch import load_file, save_file

from bnaudit.formats.bnstats import Shard, read_statistics
from bnaudit.runtime.data import DataOptions
from bnaudit.runtime.models import ModelSpec
from bnaudit.runtime.recalibrate.command import recalibrate_checkpoint
from bnaudit.runtime.recalibrate.statsfiles import combine_statistics

ARCH = os.path.join(SAMPLES, "digits_net.py") + ":digits_net"
HEALTHY = os.path.join(SAMPLES, "healthy.pt")
CALIB = os.path.join(SAMPLES, "data", "digits_calib.safetensors")
LAYERS = ("features.1", "features.4", "head.2")
SAMPLES_USED, BATCH = 112, 16  # 7 batches


def run(output, stats_out=None, shard=None, data=CALIB, method="exact", shuffle=True, checkpoint=HEALTHY, layers=()):
    options = DataOptions(path=str(data), batch_size=BATCH, num_samples=SAMPLES_USED, shuffle=shuffle)
    return recalibrate_checkpoint(
        ModelSpec(str(checkpoint), arch=ARCH),
        None if output is None else str(output),
        options,
        stats_out=None if stats_out is None else str(stats_out),
        shard=shard,
        method=method,
        include=layers,
        force=True,
    )


def merge_cli(*args: str):
    from typer.testing import CliRunner

    from bnaudit.cli import app

    return CliRunner().invoke(app, ["merge", *args], env={"COLUMNS": "120", "NO_COLOR": "1"})


def relative(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The whole data in one run (checkpoint and statistics file), its shards by --shard for
    N = 1, 2, 3, 7, and the same samples split into N files at batch boundaries."""
    root = tmp_path_factory.mktemp("merge")
    out = {"root": root, "shards": {}, "folders": {}}
    run(root / "whole.pt", root / "whole.bnstats")
    run(root / "ordered.pt", root / "ordered.bnstats", shuffle=False)
    for n in (1, 2, 3, 7):
        files = []
        for i in range(n):
            files.append(root / f"shard-{i}-of-{n}.bnstats")
            run(None, files[-1], Shard(i, n))
        out["shards"][n] = files
    data = load_file(CALIB)
    x, y = data["inputs"][:SAMPLES_USED], data["labels"][:SAMPLES_USED]
    batches = SAMPLES_USED // BATCH
    for n in (2, 3, 7):
        files = []
        cuts = [round(i * batches / n) * BATCH for i in range(n + 1)]
        for i in range(n):
            folder = root / f"site-{i}-of-{n}"
            folder.mkdir()
            save_file(
                {"inputs": x[cuts[i] : cuts[i + 1]], "labels": y[cuts[i] : cuts[i + 1]]}, str(folder / "d.safetensors")
            )
            files.append(root / f"site-{i}-of-{n}.bnstats")
            run(None, files[-1], data=folder, shuffle=False)
        out["folders"][n] = files
    return out


def numpy_pooled(paths: list[Path]) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The pooled statistics of the files, read by the safetensors package, by the textbook
    formulas: N = sum n_k, mu = sum n_k mu_k / N, M2 = sum M2_k + sum n_k (mu_k - mu)^2."""
    parts = [load_numpy(str(p)) for p in paths]
    out = {}
    for layer in LAYERS:
        n = np.stack([p[f"{layer}.count"] for p in parts])
        mu_k = np.stack([p[f"{layer}.mean"] for p in parts])
        total = n.sum(axis=0)
        mu = (n * mu_k).sum(axis=0) / total
        m2 = np.stack([p[f"{layer}.m2"] for p in parts]).sum(axis=0) + (n * (mu_k - mu) ** 2).sum(axis=0)
        out[layer] = (total, mu, m2)
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 7])
def test_shards_merge_to_the_single_process_statistics_to_float64_rounding(runs: dict, n: int) -> None:
    whole = read_statistics(str(runs["root"] / "whole.bnstats"))
    files = [read_statistics(str(p)) for p in runs["shards"][n]]
    assert sum(f.samples for f in files) == whole.samples == SAMPLES_USED
    ranges = sorted(f.batch_range for f in files)
    assert ranges[0][0] == 0 and ranges[-1][1] == 7 and all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    merged = combine_statistics(files)
    pooled = numpy_pooled(runs["shards"][n])
    for layer in whole.layers:
        record = merged[layer.name]
        assert record.stats.count == layer.count == pooled[layer.name][0][0]
        assert record.batches == layer.batches == 7
        assert relative(record.stats.mean.numpy(), layer.mean) <= 1e-12
        assert relative(record.stats.m2.numpy(), layer.m2) <= 1e-12
        assert relative(pooled[layer.name][1], layer.mean) <= 1e-12
        assert relative(pooled[layer.name][2], layer.m2) <= 1e-12


@pytest.mark.parametrize("n", [2, 3, 7])
def test_separate_data_files_cut_at_batch_boundaries_merge_to_the_whole(runs: dict, n: int) -> None:
    whole = read_statistics(str(runs["root"] / "ordered.bnstats"))
    pooled = numpy_pooled(runs["folders"][n])
    merged = combine_statistics([read_statistics(str(p)) for p in runs["folders"][n]])
    for layer in whole.layers:
        assert relative(pooled[layer.name][1], layer.mean) <= 1e-12
        assert relative(pooled[layer.name][2], layer.m2) <= 1e-12
        assert relative(merged[layer.name].stats.m2.numpy(), layer.m2) <= 1e-12


def test_the_whole_run_measures_the_first_layer_input_exactly(runs: dict) -> None:
    """Independent of bnaudit's accumulation: the first BN's input (a convolution of the
    raw digits) captured with a hook and reduced by numpy in float64."""
    from safetensors.torch import load_file as load_torch

    whole = read_statistics(str(runs["root"] / "whole.bnstats"))
    x = load_torch(CALIB)["inputs"]
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))[:SAMPLES_USED]
    model = torch.nn.Sequential(*list(_healthy_model().features)[:1])
    with torch.no_grad():
        values = model(x[order]).double().numpy()
    values = values.transpose(1, 0, 2, 3).reshape(values.shape[1], -1)
    first = whole.layers[0]
    assert first.name == "features.1" and first.count == values.shape[1]
    assert relative(first.mean, values.mean(axis=1)) <= 1e-12
    m2 = ((values - values.mean(axis=1, keepdims=True)) ** 2).sum(axis=1)
    assert relative(first.m2, m2) <= 1e-10  # numpy's own float64 sum of 10^4 squares


def _healthy_model():
    import importlib.util

    spec = importlib.util.spec_from_file_location("digits_net_for_tests", os.path.join(SAMPLES, "digits_net.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.digits_net()
    model.load_state_dict(torch.load(HEALTHY))
    return model.eval()


def test_merge_order_does_not_matter(runs: dict, tmp_path: Path) -> None:
    files = [read_statistics(str(p)) for p in runs["shards"][7]]
    reference = combine_statistics(files)
    for order in itertools.islice(itertools.permutations(files), 1, 40, 7):
        merged = combine_statistics(list(order))
        for layer in LAYERS:
            assert relative(merged[layer].stats.mean.numpy(), reference[layer].stats.mean.numpy()) <= 1e-12
            assert relative(merged[layer].stats.m2.numpy(), reference[layer].stats.m2.numpy()) <= 1e-12
    paths = [str(p) for p in runs["shards"][7]]
    forward, backward = tmp_path / "forward.pt", tmp_path / "backward.pt"
    assert merge_cli(*paths, "--checkpoint", HEALTHY, "-o", str(forward)).exit_code == 0
    assert merge_cli(*paths[::-1], "--checkpoint", HEALTHY, "-o", str(backward)).exit_code == 0
    a, b = torch.load(forward), torch.load(backward)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("n", [2, 7])
def test_the_merged_checkpoint_equals_the_single_process_one_to_float32_rounding(
    runs: dict, n: int, tmp_path: Path
) -> None:
    out = tmp_path / "merged.pt"
    result = merge_cli(*map(str, runs["shards"][n]), "--checkpoint", HEALTHY, "-o", str(out), "--format", "json")
    assert result.exit_code == 0, result.output
    merged, single, original = torch.load(out), torch.load(runs["root"] / "whole.pt"), torch.load(HEALTHY)
    assert list(merged) == list(original)
    for key, value in merged.items():
        if key.endswith(("running_mean", "running_var")):
            assert value.dtype == torch.float32
            ulp = np.spacing(np.abs(single[key].numpy()))
            assert (np.abs(value.numpy() - single[key].numpy()) <= ulp).all(), key
        elif key.endswith("num_batches_tracked"):
            assert int(value) == int(single[key]) == 7
        else:
            assert torch.equal(value, original[key]), key  # only the statistics change
    record = json.loads(merged._metadata[""]["bnaudit"])
    assert [f["file"] for f in record["statistics_files"]] == [p.name for p in runs["shards"][n]]
    assert [f["samples"] for f in record["statistics_files"]] == [
        read_statistics(str(p)).samples for p in runs["shards"][n]
    ]
    assert record["samples"] == SAMPLES_USED and record["method"] == "exact"
    doc = json.loads(result.stdout)
    assert [f["shard"] for f in doc["files"]] == [f"{i}/{n}" for i in range(n)]
    from bnaudit.api import inspect

    assert "re-estimated by bnaudit recalibrate" in inspect([str(out)]).files[0].provenance


def test_cumulative_statistics_merge_like_one_process(tmp_path: Path) -> None:
    run(None, tmp_path / "whole.bnstats", method="cumulative")
    parts = [tmp_path / f"{i}.bnstats" for i in range(3)]
    for i, part in enumerate(parts):
        run(None, part, Shard(i, 3), method="cumulative")
    whole = read_statistics(str(tmp_path / "whole.bnstats"))
    merged = combine_statistics([read_statistics(str(p)) for p in parts])
    for layer in whole.layers:
        record = merged[layer.name]
        assert record.calls == layer.calls == 7
        assert relative(record.mean_sum.numpy(), layer.batch_mean_sum) <= 1e-12
        assert relative(record.var_sum.numpy(), layer.batch_var_sum) <= 1e-12
    out = tmp_path / "cumulative.pt"
    assert merge_cli(*map(str, parts), "--checkpoint", HEALTHY, "-o", str(out)).exit_code == 0
    single = tmp_path / "single.pt"
    run(single, method="cumulative")
    a, b = torch.load(out), torch.load(single)
    for key in a:
        if key.endswith("running_var"):
            assert (np.abs(a[key].numpy() - b[key].numpy()) <= np.spacing(np.abs(b[key].numpy()))).all()


def test_sequential_across_jobs_is_one_exact_round_per_layer(tmp_path: Path) -> None:
    """The recipe the refusal gives: per layer in forward order, every shard runs exact on that
    layer alone over the checkpoint fixed so far, and merge writes the next checkpoint."""
    result = run_refused(["--method", "sequential", "--stats-out", str(tmp_path / "s.bnstats")])
    assert "one round per layer" in result.stderr and not (tmp_path / "s.bnstats").exists()
    current = HEALTHY
    for step, layer in enumerate(LAYERS):
        parts = [tmp_path / f"{layer}-{i}.bnstats" for i in range(2)]
        for i, part in enumerate(parts):
            run(None, part, Shard(i, 2), checkpoint=current, layers=(layer,))
        nxt = tmp_path / f"round-{step}.pt"
        assert merge_cli(*map(str, parts), "--checkpoint", str(current), "-o", str(nxt)).exit_code == 0
        current = nxt
    single = tmp_path / "sequential.pt"
    run(single, method="sequential")
    a, b = torch.load(current), torch.load(single)
    for key in a:
        if key.endswith(("running_mean", "running_var")):
            assert (np.abs(a[key].numpy() - b[key].numpy()) <= np.spacing(np.abs(b[key].numpy()))).all(), key


def run_refused(extra: list[str], data: str = CALIB):
    from typer.testing import CliRunner

    from bnaudit.cli import app

    args = ["recalibrate", HEALTHY, "--arch", ARCH, "--data", data, "--num-samples", str(SAMPLES_USED)]
    result = CliRunner().invoke(app, args + ["--batch-size", str(BATCH), *extra], env={"COLUMNS": "120"})
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("bnaudit: error: ")
    return result


def test_shard_options_are_refused_when_they_cannot_work(tmp_path: Path) -> None:
    assert "give --stats-out" in run_refused(["--shard", "0/2", "-o", str(tmp_path / "x.pt")]).stderr
    assert "none of them for shard 7" in run_refused(["--shard", "7/8", "--stats-out", str(tmp_path / "s")]).stderr
    assert "0..N-1" in run_refused(["--shard", "2/2", "--stats-out", str(tmp_path / "s")]).stderr
    assert "I/N" in run_refused(["--shard", "two", "--stats-out", str(tmp_path / "s")]).stderr
    assert "nothing to write" in run_refused([]).stderr
    assert os.listdir(tmp_path) == []


def refused(tmp_path: Path, *args: str) -> str:
    """merge ARGS into tmp_path/out.pt: exit 2, one line, nothing written, inputs unchanged."""
    before = {p: p.read_bytes() for p in tmp_path.iterdir()}
    out = tmp_path / "out.pt"
    result = merge_cli(*args, "--checkpoint", HEALTHY, "-o", str(out))
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("bnaudit: error: ")
    assert not out.exists() and {p: p.read_bytes() for p in tmp_path.iterdir()} == before
    return result.stderr


def copy_to(tmp_path: Path, *paths: Path) -> list[str]:
    out = []
    for p in paths:
        (tmp_path / p.name).write_bytes(p.read_bytes())
        out.append(str(tmp_path / p.name))
    return out


def test_statistics_of_another_checkpoint_are_refused(runs: dict, tmp_path: Path) -> None:
    other = tmp_path / "other.bnstats"
    run(None, other, Shard(1, 2), checkpoint=os.path.join(SAMPLES, "finetuned.pt"))
    mine = copy_to(tmp_path, runs["shards"][2][0])
    assert "statistics of another checkpoint" in refused(tmp_path, mine[0], str(other))
    assert "statistics of another checkpoint" in refused(tmp_path, str(other))


def test_the_same_shard_twice_and_overlapping_shards_are_refused(runs: dict, tmp_path: Path) -> None:
    a, b, c = copy_to(tmp_path, runs["shards"][2][0], runs["shards"][2][1], runs["shards"][3][1])
    assert "given twice" in refused(tmp_path, a, b, a)
    twin = tmp_path / "twin.bnstats"
    twin.write_bytes(Path(a).read_bytes())
    assert "identical checksums" in refused(tmp_path, a, str(twin))
    again = tmp_path / "again.bnstats"
    run(None, again, Shard(0, 2))  # the same shard recomputed by another run: the same statistics
    assert "identical checksums" in refused(tmp_path, a, str(again))
    # shard 0/2 holds batches 0-3 of 7, shard 1/3 batches 3-4: batch 3 twice
    assert "overlapping shards" in refused(tmp_path, a, c) and "batches 3..3 counted twice" in refused(tmp_path, c, a)
    whole = copy_to(tmp_path, runs["root"] / "whole.bnstats")[0]
    assert "counted twice" in refused(tmp_path, whole, b)


def test_mixed_methods_and_layer_sets_are_refused(runs: dict, tmp_path: Path) -> None:
    exact = copy_to(tmp_path, runs["shards"][2][0])[0]
    cumulative = tmp_path / "cumulative.bnstats"
    run(None, cumulative, Shard(1, 2), method="cumulative")
    assert "statistics of one method merge" in refused(tmp_path, exact, str(cumulative))
    partial = tmp_path / "partial.bnstats"
    run(None, partial, Shard(1, 2), layers=("features.*",))
    assert "another layer set" in refused(tmp_path, exact, str(partial))


def test_shards_of_different_batch_plans_are_refused(runs: dict, tmp_path: Path) -> None:
    a = copy_to(tmp_path, runs["shards"][2][0])[0]
    other = tmp_path / "other-plan.bnstats"
    options = DataOptions(path=CALIB, batch_size=BATCH, num_samples=SAMPLES_USED, seed=5)
    recalibrate_checkpoint(ModelSpec(HEALTHY, arch=ARCH), None, options, stats_out=str(other), shard=Shard(1, 2))
    assert "different batch plans" in refused(tmp_path, a, str(other))


def test_a_truncated_or_edited_statistics_file_is_refused(runs: dict, tmp_path: Path) -> None:
    good = Path(copy_to(tmp_path, runs["shards"][2][0])[0])
    raw = good.read_bytes()
    truncated = tmp_path / "truncated.bnstats"
    truncated.write_bytes(raw[: len(raw) - 100])
    assert "not a complete statistics file" in refused(tmp_path, str(truncated))
    flipped = tmp_path / "flipped.bnstats"
    flipped.write_bytes(raw[:-9] + bytes([raw[-9] ^ 1]) + raw[-8:])
    assert "edited or damaged" in refused(tmp_path, str(flipped))
    # edited as a user would: read by the safetensors package, a value and a count changed, written back
    with safe_open(str(good), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has keys(), no iteration)
        metadata = dict(f.metadata())
    tensors["head.2.mean"] = tensors["head.2.mean"] * 1.01
    save_file(tensors, str(tmp_path / "edited.bnstats"), metadata=metadata)
    assert "edited or damaged" in refused(tmp_path, str(tmp_path / "edited.bnstats"))
    metadata["samples"] = str(int(metadata["samples"]) * 2)
    tensors["head.2.mean"] = tensors["head.2.mean"] / 1.01
    save_file(tensors, str(tmp_path / "recounted.bnstats"), metadata=metadata)
    assert "edited or damaged" in refused(tmp_path, str(tmp_path / "recounted.bnstats"))
    save_file({"x": torch.zeros(2)}, str(tmp_path / "plain.safetensors"))
    assert "not a bnaudit statistics file" in refused(tmp_path, str(tmp_path / "plain.safetensors"))


def test_the_statistics_file_is_the_documented_safetensors_file(runs: dict) -> None:
    path = str(runs["shards"][3][1])
    with safe_open(path, "np") as f:
        metadata = f.metadata()
        names = set(f.keys())
        tensors = {k: f.get_tensor(k) for k in names}
    assert names == {f"{layer}.{leaf}" for layer in LAYERS for leaf in ("count", "mean", "m2")}
    assert all(t.dtype == np.float64 and t.ndim == 1 for t in tensors.values())
    assert {"format", "format_version", "checkpoint_digest", "layers", "method", "batch_size", "seed", "data",
            "samples", "shard", "checksum"} <= set(metadata)  # fmt: skip
    assert metadata["format"] == "bnaudit statistics" and metadata["shard"] == "1/3"
    assert [entry["name"] for entry in json.loads(metadata["layers"])] == list(LAYERS)
    assert metadata["batch_size"] == str(BATCH) and metadata["method"] == "exact"
    counts = tensors["features.1.count"]
    assert (counts == counts[0]).all() and counts[0] == int(metadata["samples"]) * 8 * 8
    assert (tensors["features.1.m2"] >= 0).all()

"""`gap` under torchrun --nproc-per-node 2 (gloo, CPU): the ranks score the single-process
batches and their report is the single-process report."""

from __future__ import annotations

import copy
import json
import os
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_ranks
from safetensors.torch import save_file

from bnaudit.output.measured_json import gap_to_json
from bnaudit.runtime.batching import BatchPlan
from bnaudit.runtime.data import DataOptions
from bnaudit.runtime.gap import measure_gap
from bnaudit.runtime.models import ModelSpec

pytestmark = pytest.mark.slow  # torchrun: processes per rank

torch.set_num_threads(1)

# The architecture, importable by --arch in both the ranks and this process.
ARCH = textwrap.dedent("""
    import torch
    from torch import nn

    def build():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(),
            nn.Conv2d(6, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
        )
""")

# Runs `measure_gap` (the API, which joins the process group itself) on every rank and
# saves each rank's reports as JSON documents with their exit codes.
WORKER = textwrap.dedent("""
    import json
    import os

    import torch
    from bnaudit.output.measured_json import gap_to_json
    from bnaudit.runtime.data import DataOptions
    from bnaudit.runtime.gap import measure_gap
    from bnaudit.runtime.models import ModelSpec

    torch.set_num_threads(1)
    out = {}
    for name, size, count, fwd, limit in CONFIGS:
        options = DataOptions(path="val.safetensors", batch_size=size, num_samples=count)
        spec = ModelSpec("model.safetensors", arch="arch.py:build", forward=fwd)
        report = measure_gap(spec, options, max_gap=limit, strict=True)
        out[name] = {"json": gap_to_json(report), "exit": report.exit_code()}
    with open(f"rank{os.environ['RANK']}.json", "w") as f:
        json.dump(out, f)
""")

# (name, batch size, samples, --forward, --max-gap): 41 samples in batches of 8 (a failed
# check: exit 1); 3 samples in batches of 2 (one batch of 3: rank 1 has none); a head that
# is no classifier (relative L2, no accuracy).
CONFIGS = (
    ("odd", 8, None, None, 0.0),
    ("one_batch", 2, 3, None, None),
    ("regression", 8, None, "head.py:first_output", None),
)
WORKER = WORKER.replace("CONFIGS", repr(CONFIGS))
HEAD = "def first_output(model, inputs):\n    return model(inputs)[:, :1]\n"

SAMPLES = 41  # batches of 8: 8, 8, 8, 8, 8, 1 -> the last one joins: 8, 8, 8, 8, 9 (3 + 2 batches)


def _data(n: int, shift: float, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Four classes, each a different mean pattern over the three channels, plus noise."""
    labels = torch.randint(0, 4, (n,), generator=generator)
    patterns = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
    x = patterns[labels][:, :, None, None] * 1.5 + torch.randn(n, 3, 6, 6, generator=generator)
    return x * (1.0 + shift) + shift, labels


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model trained a little (so running statistics are real EMAs), held-out data from a
    shifted distribution (so eval mode and batch statistics disagree), and both ranks'
    results."""
    folder = tmp_path_factory.mktemp("distgap")
    (folder / "arch.py").write_text(ARCH)
    namespace: dict[str, Any] = {}
    exec(ARCH, namespace)
    model = namespace["build"]()
    g = torch.Generator().manual_seed(1)
    optimiser = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.train()
    for _ in range(60):
        x, y = _data(32, 0.0, g)
        optimiser.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimiser.step()
    save_file(model.state_dict(), str(folder / "model.safetensors"))
    x, y = _data(SAMPLES, 0.6, g)
    save_file({"inputs": x.contiguous(), "labels": y}, str(folder / "val.safetensors"))
    (folder / "worker.py").write_text(WORKER)
    (folder / "head.py").write_text(HEAD)
    proc = run_ranks(["worker.py"], folder)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return folder


def _ranks(folder: Path) -> list[dict[str, Any]]:
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in (0, 1)]


def _single(folder: Path, size: int, count: int | None, forward: str | None = None, limit: float | None = None) -> Any:
    cwd = os.getcwd()
    os.chdir(folder)  # --arch arch.py:build and the data paths are relative, as in the ranks
    try:
        options = DataOptions(path="val.safetensors", batch_size=size, num_samples=count)
        return measure_gap(
            ModelSpec("model.safetensors", arch="arch.py:build", forward=forward), options, max_gap=limit, strict=True
        )
    finally:
        os.chdir(cwd)


def _model_and_data(folder: Path) -> tuple[Any, torch.Tensor, torch.Tensor]:
    from safetensors.torch import load_file

    namespace: dict[str, Any] = {}
    exec(ARCH, namespace)
    model = namespace["build"]()
    model.load_state_dict(load_file(str(folder / "model.safetensors")))
    data = load_file(str(folder / "val.safetensors"))
    return model, data["inputs"], data["labels"]


def test_ranks_count_what_a_plain_loop_over_the_single_process_batches_counts(folder: Path) -> None:
    # independent of bnaudit's passes: plain train() / eval() forwards of the planned batches
    model, x, y = _model_and_data(folder)
    plan = BatchPlan.draw(SAMPLES, 8, None, shuffle=True, seed=0).batches
    assert [len(b) for b in plan] == [8, 8, 8, 8, 9]
    train_model, eval_model = copy.deepcopy(model).train(), copy.deepcopy(model).eval()
    correct_train = correct_eval = agree = 0
    with torch.no_grad():
        for batch in plan:
            pred_t = train_model(x[batch]).argmax(dim=1)
            pred_e = eval_model(x[batch]).argmax(dim=1)
            correct_train += int((pred_t == y[batch]).sum())
            correct_eval += int((pred_e == y[batch]).sum())
            agree += int((pred_t == pred_e).sum())
    assert correct_train != correct_eval  # the shifted data makes the two modes differ
    for rank in _ranks(folder):
        doc = rank["odd"]["json"]
        assert doc["samples"] == doc["labelled"] == SAMPLES and doc["batches"] == 5
        assert doc["train_mode"]["accuracy"] == correct_train / SAMPLES
        assert doc["eval_mode"]["accuracy"] == correct_eval / SAMPLES
        assert doc["agreement"] == agree / SAMPLES


def _assert_same_report(ranked: dict[str, Any], single: dict[str, Any]) -> None:
    # counts, accuracies, agreement, intervals: integers and functions of integers, exact
    for key in ("samples", "labelled", "batches", "skipped", "train_mode", "eval_mode", "gap", "agreement"):
        assert ranked[key] == single[key], key
    for key in ("train_mode_interval", "eval_mode_interval", "gap_interval", "gap_significant", "notes"):
        assert ranked[key] == single[key], key
    # a sum of per-sample float64 KL values added in another order: float64 rounding
    assert ranked["divergence"] == pytest.approx(single["divergence"], rel=1e-12, abs=0)
    # Each batch's float32 forward is the same computation in both runs (same samples, one
    # thread), so the BN inputs are bit-identical; only the float64 accumulation differs
    # (another shift, Chan merges grouped by rank). Its relative error is a few float64
    # epsilons (2.2e-16) times the values per channel merged (<= 41 * 36) times the
    # conditioning (mean / std)^2 (< 100 here): < 1e-10. A wrong merge (averaging the ranks'
    # variances, dropping a rank) is off by more than 1e-3.
    assert [layer["name"] for layer in ranked["layers"]] == [layer["name"] for layer in single["layers"]]
    for a, b in zip(ranked["layers"], single["layers"], strict=True):
        assert a["values"] == b["values"] and a["origin"] == b["origin"], a["name"]
        for key in ("mean_shift", "max_mean_shift", "var_log_ratio", "peak"):
            assert a[key] == pytest.approx(b[key], rel=1e-10, abs=1e-12), (a["name"], key)
        for ca, cb in zip(a["worst_channels"], b["worst_channels"], strict=True):
            assert ca["index"] == cb["index"]
            assert ca["data_var"] == pytest.approx(cb["data_var"], rel=1e-10), a["name"]
    for key in ("mean", "std"):
        assert ranked["input"][key] == pytest.approx(single["input"][key], rel=1e-10, abs=1e-12), key
    assert ranked["diagnosis"] == single["diagnosis"]


def test_two_ranks_report_what_one_process_reports(folder: Path) -> None:
    single = _single(folder, 8, None, limit=0.0)
    reference = gap_to_json(single)
    assert reference["batches"] == 5 and reference["samples"] == SAMPLES
    drifting = [layer for layer in reference["layers"] if layer["mean_shift"] is not None]
    assert len(drifting) == 2 and all(layer["mean_shift"] > 0.05 for layer in drifting)
    for rank in _ranks(folder):
        _assert_same_report(rank["odd"]["json"], reference)
        assert rank["odd"]["exit"] == single.exit_code() == 1  # the gap exceeds --max-gap 0


def test_a_rank_without_batches_still_joins_and_the_report_is_one_process_s(folder: Path) -> None:
    # 3 samples in batches of 2: 2, 1 -> one batch of 3; rank 1 scores nothing
    assert [len(b) for b in BatchPlan.draw(SAMPLES, 2, 3).batches] == [3]
    single = _single(folder, 2, 3)
    reference = gap_to_json(single)
    for rank in _ranks(folder):
        doc = rank["one_batch"]["json"]
        assert doc["samples"] == 3 and doc["batches"] == 1
        _assert_same_report(doc, reference)
        assert rank["one_batch"]["exit"] == single.exit_code()


def test_a_head_that_is_no_classifier_combines_its_relative_l2_divergence(folder: Path) -> None:
    reference = gap_to_json(_single(folder, 8, None, "head.py:first_output"))
    assert reference["divergence_kind"] == "relative_l2" and reference["agreement"] is None
    assert reference["divergence"] > 0.01  # the shifted data moves the output
    for rank in _ranks(folder):
        _assert_same_report(rank["regression"]["json"], reference)
        assert rank["regression"]["json"]["divergence_kind"] == "relative_l2"


def test_torchrun_cli_prints_one_report_equal_to_one_process_s(folder: Path) -> None:
    command = ["gap", "model.safetensors", "--arch", "arch.py:build", "--data", "val.safetensors", "--batch-size", "8"]
    ranks = run_ranks(["-m", "bnaudit", *command, "--format", "json", "--max-gap", "0", "--strict"], folder)
    # --max-gap 0 fails on both ranks; rank 0 still prints its whole report first
    assert ranks.returncode == 1, ranks.stderr[-3000:]
    doc = json.loads(ranks.stdout)  # one JSON document: rank 1 printed nothing
    one = run_ranks(["-m", "bnaudit", *command, "--format", "json", "--max-gap", "0", "--strict"], folder, ranks=1)
    assert one.returncode == 1, one.stderr[-3000:]
    _assert_same_report(doc, json.loads(one.stdout))


FORWARD = textwrap.dedent("""
    def refuse_marked(model, inputs):
        if float(inputs.abs().max()) > 1e3:
            raise ValueError("a marked sample")
        return model(inputs)
""")


def test_a_failure_on_one_rank_ends_every_rank_with_its_message(folder: Path) -> None:
    from safetensors.torch import load_file

    # one sample of batch 4 (rank 1's second batch) makes the --forward function fail
    (folder / "marked.py").write_text(FORWARD)
    data = load_file(str(folder / "val.safetensors"))
    marked = BatchPlan.draw(SAMPLES, 8, None, shuffle=True, seed=0).batches[4][0]
    data["inputs"][marked] = 1e4
    save_file(data, str(folder / "val_marked.safetensors"))
    command = ["gap", "model.safetensors", "--arch", "arch.py:build", "--data", "val_marked.safetensors"]
    command += ["--batch-size", "8", "--forward", "marked.py:refuse_marked", "--format", "json"]
    ranks = run_ranks(["-m", "bnaudit", *command], folder)
    one = run_ranks(["-m", "bnaudit", *command], folder, ranks=1)
    assert one.returncode == 2
    error = json.loads(one.stdout)["error"]
    assert error.startswith("batch 4: ") and "a marked sample" in error
    # rank 0 scored its batches without fault and prints the failing rank's message, with
    # the batch numbered as one process numbers it; both ranks exit 2 (torchrun: 1)
    assert ranks.returncode != 0
    assert json.loads(ranks.stdout) == {"error": f"rank 1: {error}"}
    # rank 1 says it in one line on stderr; torchrun's summary lists the exit code 2 (of the
    # rank that ended first: it stops the other, which has said its error by then)
    assert f"bnaudit: error: {error}\n" in ranks.stderr
    assert "exitcode  : 2" in ranks.stderr
    assert "[rank0]" not in ranks.stderr and "[rank1]" not in ranks.stderr  # no rank's traceback


# SyncBatchNorm, and a tracked InstanceNorm whose drift compares per-instance statistics
SYNC_ARCH = textwrap.dedent("""
    import torch
    from torch import nn

    def build():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Conv2d(3, 6, 3, padding=1), nn.SyncBatchNorm(6), nn.ReLU(),
            nn.Conv2d(6, 8, 3, padding=1), nn.InstanceNorm2d(8, affine=True, track_running_stats=True), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
        )
""")


def test_a_syncbatchnorm_model_runs_per_rank_as_plain_batchnorm_and_matches_one_process(
    folder: Path, tmp_path: Path
) -> None:
    # SyncBatchNorm in training mode would all-reduce its batch statistics across the ranks
    # (and refuses CPU tensors under gloo): bnaudit runs it as plain BatchNorm on the rank's
    # own batch, as one process does, so the report is the single process's (the
    # InstanceNorm's per-instance sums are added across the ranks)
    namespace: dict[str, Any] = {}
    exec(SYNC_ARCH, namespace)
    model = namespace["build"]()
    g = torch.Generator().manual_seed(1)
    optimiser = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.train()  # one process, no group: SyncBatchNorm trains as plain BatchNorm
    for _ in range(60):
        x, y = _data(32, 0.0, g)
        optimiser.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimiser.step()
    save_file(model.state_dict(), str(tmp_path / "model.safetensors"))
    (tmp_path / "val.safetensors").write_bytes((folder / "val.safetensors").read_bytes())
    (tmp_path / "arch.py").write_text(SYNC_ARCH)
    (tmp_path / "worker.py").write_text(WORKER.replace(repr(CONFIGS), repr(CONFIGS[:1])))
    proc = run_ranks(["worker.py"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    single = _single(tmp_path, 8, None, limit=0.0)
    reference = gap_to_json(single)
    assert [layer["kind"] for layer in reference["layers"]] == ["SyncBatchNorm", "InstanceNorm2d"]
    assert all(layer["values"] == SAMPLES * 36 and layer["mean_shift"] is not None for layer in reference["layers"])
    for r in (0, 1):
        rank = json.loads((tmp_path / f"rank{r}.json").read_text())
        _assert_same_report(rank["odd"]["json"], reference)
        assert rank["odd"]["exit"] == single.exit_code()

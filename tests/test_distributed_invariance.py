"""`invariance` under torchrun --nproc-per-node 2 (gloo, CPU): the ranks score whole batches
of every arrangement and their report is the single-process report."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_ranks
from safetensors.torch import save_file

from bnaudit.output.measured_json import invariance_to_json
from bnaudit.runtime.data import DataOptions
from bnaudit.runtime.invariance import measure_invariance, plan_arrangements
from bnaudit.runtime.models import ModelSpec

pytestmark = pytest.mark.slow  # torchrun: processes per rank

torch.set_num_threads(1)

# Three architectures, importable by --arch in the ranks and here: batch-independent in
# eval mode; coupled through a BatchNorm2d without running statistics (it still scores a
# sample alone: 36 values per channel); coupled through a BatchNorm1d without running
# statistics, which cannot score one sample alone (one value per channel).
ARCH = textwrap.dedent("""
    import torch
    from torch import nn

    def build(deep_stats=True, head_stats=True):
        torch.manual_seed(0)
        layers = [
            nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(),
            nn.Conv2d(6, 8, 3, padding=1), nn.BatchNorm2d(8, track_running_stats=deep_stats), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
        ]
        if not head_stats:
            layers.append(nn.BatchNorm1d(4, track_running_stats=False))
        return nn.Sequential(*layers)

    def invariant():
        return build()

    def deep():
        return build(deep_stats=False)

    def head():
        return build(head_stats=False)
""")

# (name, --arch, samples, batch sizes): 21 samples in batches of 4 are 4, 4, 4, 4, 5 (the
# last one of one joins); 3 samples in batches of 2 are one batch of 3, so rank 1 scores
# no batch of that arrangement and must still take part.
CASES = (
    ("invariant", "arch.py:invariant", 21, [1, 4]),
    ("deep", "arch.py:deep", 21, [1, 4, 8]),
    ("head", "arch.py:head", 21, [1, 4]),
    ("three", "arch.py:deep", 3, [1, 2]),
)

WORKER = textwrap.dedent("""
    import json
    import os
    import torch
    from bnaudit.output.measured_json import invariance_to_json
    from bnaudit.runtime.data import DataOptions
    from bnaudit.runtime.invariance import measure_invariance
    from bnaudit.runtime.models import ModelSpec

    torch.set_num_threads(1)
    out = {}
    for name, arch, count, sizes in CASES:
        options = DataOptions(path="val.safetensors", batch_size=4, num_samples=count)
        report = measure_invariance(ModelSpec("model.safetensors", arch=arch), options, batch_sizes=sizes)
        out[name] = {"json": invariance_to_json(report), "exit": report.exit_code()}
    with open(f"rank{os.environ['RANK']}.json", "w") as f:
        json.dump(out, f)
""").replace("CASES", repr(CASES))


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One trained state dict (the three architectures share its keys: BN layers without
    running statistics ignore them), labelled data, and both ranks' reports."""
    folder = tmp_path_factory.mktemp("distinv")
    (folder / "arch.py").write_text(ARCH)
    namespace: dict[str, Any] = {}
    exec(ARCH, namespace)
    model = namespace["invariant"]()
    g = torch.Generator().manual_seed(1)
    patterns = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 1.0, 0.0]])

    def data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        labels = torch.randint(0, 4, (n,), generator=g)
        return patterns[labels][:, :, None, None] * 1.5 + torch.randn(n, 3, 6, 6, generator=g), labels

    optimiser = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.train()
    for _ in range(40):
        x, y = data(32)
        optimiser.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimiser.step()
    save_file(model.state_dict(), str(folder / "model.safetensors"))
    x, y = data(21)
    save_file({"inputs": x.contiguous(), "labels": y}, str(folder / "val.safetensors"))
    (folder / "worker.py").write_text(WORKER)
    proc = run_ranks(["worker.py"], folder)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return folder


def _ranks(folder: Path) -> list[dict[str, Any]]:
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in (0, 1)]


def _single(folder: Path, arch: str, count: int, sizes: list[int]) -> Any:
    cwd = os.getcwd()
    os.chdir(folder)  # --arch arch.py:... and the data paths are relative, as in the ranks
    try:
        options = DataOptions(path="val.safetensors", batch_size=4, num_samples=count)
        return measure_invariance(ModelSpec("model.safetensors", arch=arch), options, batch_sizes=sizes)
    finally:
        os.chdir(cwd)


@pytest.mark.parametrize(("name", "arch", "count", "sizes"), CASES, ids=[c[0] for c in CASES])
def test_two_ranks_report_what_one_process_reports(
    folder: Path, name: str, arch: str, count: int, sizes: list[int]
) -> None:
    single = _single(folder, arch, count, sizes)
    reference = invariance_to_json(single)
    # Every row of every arrangement is scored by exactly one rank, in the batch the single
    # process forms, and the ranks' zero-filled tensors add zeros to it: the outputs, and so
    # every figure computed from them, are the single process's to the last bit.
    for rank in _ranks(folder):
        assert rank[name]["json"] == reference
        assert rank[name]["exit"] == single.exit_code()


def test_the_cases_test_what_they_name(folder: Path) -> None:
    # independent of the comparison above: verdicts and sites follow from the architectures
    docs = {name: doc["json"] for name, doc in _ranks(folder)[0].items()}
    assert docs["invariant"]["verdict"] == "invariant" and docs["invariant"]["coupled_samples"] == 0
    assert docs["deep"]["verdict"] == "coupled" and docs["deep"]["coupled_samples"] == 21
    assert [s["module"] for s in docs["deep"]["coupling"]] == ["4"]
    assert docs["head"]["verdict"] == "coupled" and docs["head"]["failures"]  # cannot score one sample alone
    arrangements = plan_arrangements(21, [1, 4], seed=0)
    assert [len(a.batches) for a in arrangements] == [21, 5, 5]
    assert [a["batches"] for a in docs["invariant"]["arrangements"]] == [21, 5, 5]
    assert [len(a.batches) for a in plan_arrangements(3, [1, 2], seed=0)] == [3, 1, 1]
    assert docs["three"]["samples"] == 3 and docs["three"]["verdict"] == "coupled"


def test_torchrun_cli_prints_one_invariance_report_equal_to_one_process_s(folder: Path) -> None:
    command = ["invariance", "model.safetensors", "--arch", "arch.py:deep", "--data", "val.safetensors"]
    command += ["--batch-sizes", "1,4", "--num-samples", "21", "--format", "json"]
    ranks = run_ranks(["-m", "bnaudit", *command], folder)
    assert ranks.returncode == 1, ranks.stderr[-3000:]  # coupled: exit 1, after rank 0 printed
    one = run_ranks(["-m", "bnaudit", *command], folder, ranks=1)
    assert one.returncode == 1, one.stderr[-3000:]
    assert json.loads(ranks.stdout) == json.loads(one.stdout)  # one document: rank 1 printed nothing


FORWARD = textwrap.dedent("""
    def refuse_marked_companions(model, inputs):
        if len(inputs) > 1 and float(inputs.abs().max()) > 1e3:
            raise ValueError("a marked sample among companions")
        return model(inputs)
""")


def test_a_failure_on_one_rank_ends_every_rank_with_its_message_as_gap_says_it(folder: Path) -> None:
    from safetensors.torch import load_file

    from bnaudit.runtime.batching import BatchPlan

    # the sample at position 20 (the stream's order) lies in batch 4 of "in batch (4)",
    # rank 1's second batch; alone it scores, so only that arrangement fails
    (folder / "marked.py").write_text(FORWARD)
    data = load_file(str(folder / "val.safetensors"))
    order = [i for batch in BatchPlan.draw(21, 4, 21, shuffle=True, seed=0) for i in batch]
    data["inputs"][order[20]] = 1e4
    save_file(data, str(folder / "val_marked.safetensors"))
    command = ["invariance", "model.safetensors", "--arch", "arch.py:invariant", "--data", "val_marked.safetensors"]
    command += ["--batch-sizes", "1,4", "--num-samples", "21", "--forward", "marked.py:refuse_marked_companions"]
    command += ["--format", "json"]
    ranks = run_ranks(["-m", "bnaudit", *command], folder)
    one = run_ranks(["-m", "bnaudit", *command], folder, ranks=1)
    assert one.returncode == 2, one.stderr[-3000:]
    error = json.loads(one.stdout)["error"]
    assert error.startswith("in batch (4), batch 4: ") and "a marked sample among companions" in error
    # rank 0 prints the failing rank's line, prefixed with its rank, as gap does; rank 1
    # says it on stderr in one line; no traceback
    assert ranks.returncode != 0
    assert json.loads(ranks.stdout) == {"error": f"rank 1: {error}"}
    assert f"bnaudit: error: {error}\n" in ranks.stderr
    assert "[rank0]" not in ranks.stderr and "[rank1]" not in ranks.stderr

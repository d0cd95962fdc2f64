"""`bnaudit invariance`: outputs alone and among other companions, against an independent
computation; the float64 noise floor; the coupling located in each kind of model the issue
names (a BN without running statistics, a graph traced in training mode, a module that
mixes samples, a regression head); buffers and files untouched; the CLI."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import warnings
from pathlib import Path

import pytest
import torch
from conftest import train_classifier
from safetensors.torch import save_file

from bnaudit.errors import BnauditError
from bnaudit.runtime import arrangements, invariance
from bnaudit.runtime.data import DataOptions, make_loader
from bnaudit.runtime.invariance import (
    FLOOR,
    measure_invariance,
    measure_model_invariance,
    plan_arrangements,
)
from bnaudit.runtime.models import ModelSpec, load_runnable

torch.set_num_threads(1)

MODEL_SOURCE = '''
import torch
from torch import nn


class BatchMixer(nn.Module):
    """The classic bug: reshape where a transpose was meant. (B, C) -> (C, B) -> t():
    each row then holds values of other samples (identity at batch size 1)."""

    def forward(self, x):
        return x.reshape(x.shape[1], x.shape[0]).t()


class InvNet(nn.Module):
    def __init__(self, classes=3, width=4, untracked=False, mixer=False):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width, track_running_stats=not untracked), nn.ReLU(),
            nn.AdaptiveAvgPool2d(2),
        )
        head = [nn.Flatten(), nn.Linear(4 * width, 8, bias=False), nn.BatchNorm1d(8), nn.ReLU()]
        if mixer:
            head.append(BatchMixer())
        head.append(nn.Linear(8, classes))
        self.head = nn.Sequential(*head)

    def forward(self, x):
        return self.head(self.features(x))


def net():
    return InvNet()


def untracked_net():
    return InvNet(untracked=True)


def mixer_net():
    return InvNet(mixer=True)


def regression_net():
    return InvNet(classes=1)


def regression_untracked_net():
    return InvNet(classes=1, untracked=True)


class RootMixer(nn.Module):
    """Mixes samples in its own forward, between submodules: a batch mean subtracted."""

    def __init__(self):
        super().__init__()
        self.body = InvNet().features
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(16, 3))

    def forward(self, x):
        h = self.body(x)
        return self.head(h - 0.5 * h.mean(dim=0, keepdim=True))


def root_mixer_net():
    return RootMixer()


def as_float32(model, inputs):
    """A --forward that insists on float32 inputs: no float64 run possible."""
    return model(inputs.float())


class KeywordNet(InvNet):
    """Takes its image as a keyword argument: batches are dicts."""

    def forward(self, image):
        return super().forward(image)


def keyword_net():
    return KeywordNet(untracked=True)


class DictItems(torch.utils.data.Dataset):
    def __init__(self):
        self.data = torch.load(__file__.replace("invnet.py", "dict_data.pt"))

    def __len__(self):
        return len(self.data["inputs"])

    def __getitem__(self, i):
        return {"image": self.data["inputs"][i], "label": int(self.data["labels"][i])}


def dict_items():
    return DictItems()


def flat_untracked_net():
    """BN1d without running statistics on (N, C) features: cannot score one sample."""
    return nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3, track_running_stats=False), nn.Linear(3, 2))
'''

N = 128  # samples per run: 2 batches of 64, 16 of 8, 128 alone
SIZES = [1, 8, 64]


def _data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Three classes of 6x6 images: a fixed template per class plus noise."""
    g = torch.Generator().manual_seed(seed)
    templates = torch.rand(3, 1, 6, 6, generator=torch.Generator().manual_seed(99)) * 2
    y = torch.randint(0, 3, (n,), generator=g)
    return templates[y] + 0.4 * torch.randn(n, 1, 6, 6, generator=g), y


def _load(path: Path) -> dict:
    spec = importlib.util.spec_from_file_location("invnet_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return vars(module)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Trained variants of one small CNN, their checkpoints and labelled validation data."""
    root = tmp_path_factory.mktemp("invariance")
    (root / "invnet.py").write_text(MODEL_SOURCE)
    (root / "reference.py").write_text(MODEL_SOURCE)
    ns = _load(root / "reference.py")
    x_train, y_train = _data(240, seed=1)
    models = {}
    for name in ("net", "untracked_net", "mixer_net"):
        torch.manual_seed(0)
        models[name] = train_classifier(ns[name](), x_train, y_train)
        save_file(models[name].state_dict(), root / f"{name}.safetensors")
    for name in ("regression_net", "regression_untracked_net"):
        torch.manual_seed(0)
        model = ns[name]()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.03)
        model.train()
        for _ in range(40):
            loss = (model(x_train[:32]).squeeze(1) - y_train[:32].double().float()).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        model.eval()
        models[name] = model
        save_file(model.state_dict(), root / f"{name}.safetensors")
    # traced in training mode (BN layers only: Dropout-free model), saved, then loaded as users do
    torch.manual_seed(0)
    traced_source = ns["net"]()
    traced_source.load_state_dict(models["net"].state_dict())
    traced_source.train()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TracerWarning: BN's batch-size check becomes a constant
        traced = torch.jit.trace(traced_source, x_train[:16], check_trace=False)
    torch.jit.save(traced, str(root / "traced_train.pt"))
    x, y = _data(N, seed=3)
    save_file({"inputs": x, "labels": y}, root / "val.safetensors")
    save_file({"inputs": x}, root / "unlabelled.safetensors")
    return {"root": root, "ns": ns, "models": models, "x": x, "y": y}


def _arch(world, name: str) -> str:
    return f"{world['root'] / 'invnet.py'}:{name}"


def _measure(world, name: str, ckpt: str | None = None, sizes=SIZES, data="val.safetensors", **kw):
    ckpt_path = world["root"] / (ckpt or f"{name}.safetensors")
    arch = None if ckpt and ckpt.endswith(".pt") else _arch(world, name)
    options = DataOptions(path=str(world["root"] / data), batch_size=64, num_samples=N, **kw)
    return measure_invariance(ModelSpec(str(ckpt_path), arch=arch), options, batch_sizes=sizes)


def _independent(model, x: torch.Tensor, sizes: list[int], seed: int = 0) -> dict:
    """The documented arrangements written out here, scored with the model directly:
    the order the loader draws (randperm(seed) of the file), then alone, natural chunks
    and chunks of a randperm(seed) of the positions; relative max-abs deviations."""
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x = x[order]
    n = len(x)
    with torch.no_grad():
        alone = torch.cat([model(x[i : i + 1]) for i in range(n)]).double()
        outs = []
        for b in sizes:
            if b == 1:
                continue
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
            for positions in (torch.arange(n), perm):
                out = torch.empty_like(alone)
                chunks = list(positions.split(b))
                if len(chunks) > 1 and len(chunks[-1]) == 1:
                    chunks[-2] = torch.cat([chunks[-2], chunks.pop()])
                for idx in chunks:
                    out[idx] = model(x[idx]).double()
                outs.append(out)
    scale = alone.reshape(n, -1).abs().amax(1)
    dev = torch.stack([(o - alone).reshape(n, -1).abs().amax(1) / scale for o in outs])
    changed = torch.stack([o.argmax(1) != alone.argmax(1) for o in outs]) if alone.shape[1] > 1 else None
    return {"order": order, "alone": alone, "outs": outs, "dev": dev, "changed": changed}


# ----------------------------------------------------------------------------- planning


def test_arrangements_cut_natural_and_seeded_orders_into_whole_batches():
    plan = plan_arrangements(9, [4, 1, 4], seed=5)
    assert [a.name for a in plan] == ["alone", "in batch (4)", "other companions (4)"]
    assert plan[0].batches == [[i] for i in range(9)]
    # 9 = 4 + 4 + 1: the last sample joins the batch before it
    assert plan[1].batches == [[0, 1, 2, 3], [4, 5, 6, 7, 8]]
    perm = torch.randperm(9, generator=torch.Generator().manual_seed(5)).tolist()
    assert plan[2].batches == [perm[:4], perm[4:]]
    for a in plan:
        assert sorted(i for b in a.batches for i in b) == list(range(9))


def test_shares_of_whole_batches_sum_to_the_single_run(world, monkeypatch):
    # what a split across processes relies on: each rank's share of whole batches (as
    # runtime.batching.BatchPlan.shard deals them) fills its rows, zeros elsewhere, and the
    # shares add up to one run's outputs exactly; the combining across ranks is left out
    # (one process: combine_rows passes a rank's rows through)
    runnable = load_runnable(
        ModelSpec(str(world["root"] / "untracked_net.safetensors"), arch=_arch(world, "untracked_net"))
    )
    stream = make_loader(DataOptions(path=str(world["root"] / "val.safetensors"), num_samples=40))
    samples = invariance.read_samples(stream)
    plan = plan_arrangements(len(samples), [1, 8], seed=0)
    model = runnable.module
    with torch.no_grad():
        whole, _ = invariance.score_arrangements(model, samples, plan)
        shares = []
        for rank in range(2):
            monkeypatch.setattr(invariance, "distributed", lambda r=rank: (r, 2))
            shares.append(invariance.score_arrangements(model, samples, plan)[0])
    for (arrangement, out), (_, a), (_, b) in zip(whole, *shares, strict=True):
        assert torch.equal(a + b, out), arrangement.name


# ----------------------------------------------------------------------------- invariant


def test_eval_mode_cnn_is_invariant_with_no_flagged_sample(world):
    report = _measure(world, "net")
    assert report.verdict == "invariant" and report.exit_code() == 0
    assert report.flagged == 0 and report.coupled == 0 and report.sites == []
    assert report.batch_sizes == SIZES and report.samples == N
    assert [a.name for a in report.arrangements] == [
        "alone",
        "in batch (8)",
        "other companions (8)",
        "in batch (64)",
        "other companions (64)",
    ]
    ref = _independent(world["models"]["net"], world["x"], SIZES)
    assert report.max_deviation == pytest.approx(float(ref["dev"].max()), abs=1e-9)
    assert report.max_deviation < report.screen
    y = world["y"][ref["order"]]
    assert report.accuracy("alone") == pytest.approx(float((ref["alone"].argmax(1) == y).double().mean()))
    assert report.accuracy("alone") > 0.9  # the fixture really trained a model
    assert report.changed == 0


def test_kernel_noise_flagged_by_a_zero_screen_is_cleared_in_float64(world, monkeypatch):
    # With no screen every sample that differs in float32 at all is re-scored in float64:
    # kernel-order noise must vanish there (a deviation far below the floor), and the
    # verdict stays invariant. The float32 run really differs somewhere (checked).
    monkeypatch.setattr(arrangements, "SCREEN_EPS", 0)
    report = _measure(world, "net")
    assert report.max_deviation > 0
    assert report.flagged > 0 and report.float64
    assert report.cleared == report.flagged and report.coupled == 0
    assert report.verdict == "invariant"
    assert report.float64_noise is not None and report.float64_noise < 1e-12 < FLOOR


# ----------------------------------------------------------------------------- coupled


def test_bn_without_running_statistics_is_named_and_deviations_match(world):
    report = _measure(world, "untracked_net")
    assert report.verdict == "coupled" and report.exit_code() == 1
    ref = _independent(world["models"]["untracked_net"], world["x"], SIZES)
    deviation = ref["dev"].amax(0)
    assert report.max_deviation == pytest.approx(float(deviation.max()), rel=1e-5)
    assert report.coupled == int((deviation > 1e-4).sum())
    changed = (ref["changed"] & (ref["dev"] > 1e-4)).any(0)
    assert report.changed == int(changed.sum())
    assert [s.module for s in report.sites] == ["features.4"]
    assert report.sites[0].cause == "batchnorm" and "track_running_stats=False" in report.sites[0].reason
    assert any("features.4" in line and "track_running_stats=True" in line for line in report.diagnosis)
    # BN006 of inspect sees the same layer in the checkpoint (no running statistics)
    assert any(f.code == "BN006" for f in report.findings)


def test_graph_traced_in_training_mode_is_coupled_after_eval_and_its_batch_norms_named(world):
    path = world["root"] / "traced_train.pt"
    before = _sha(path)
    runnable = load_runnable(str(path))
    state = {k: v.clone() for k, v in runnable.module.state_dict().items()}
    stream = make_loader(DataOptions(path=str(world["root"] / "val.safetensors"), num_samples=N))
    report = measure_model_invariance(runnable, stream, batch_sizes=SIZES)
    assert report.verdict == "coupled" and report.coupled > 0
    assert {s.module for s in report.sites} == {"features.1", "features.4", "head.2"}
    assert {s.cause for s in report.sites} == {"traced_training"}
    assert all("aten::batch_norm" in s.reason for s in report.sites)
    assert any("model.eval() before torch.jit.trace" in line for line in report.diagnosis)
    # the traced graph updates its running statistics on every call: all restored
    after = runnable.module.state_dict()
    assert set(after) == set(state)
    for name, value in state.items():
        assert torch.equal(after[name], value), name
    assert _sha(path) == before


def test_module_that_mixes_samples_is_named(world):
    report = _measure(world, "mixer_net")
    assert report.verdict == "coupled"
    assert [(s.module, s.kind, s.cause) for s in report.sites] == [("head.4", "BatchMixer", "mixes_samples")]
    ref = _independent(world["models"]["mixer_net"], world["x"], SIZES)
    assert report.max_deviation == pytest.approx(float(ref["dev"].max()), rel=1e-5)


def test_regression_head_reports_deviation_only(world):
    invariant = _measure(world, "regression_net")
    assert invariant.verdict == "invariant" and not invariant.classifier
    assert invariant.changed is None and invariant.max_kl is None and invariant.labelled == 0
    coupled = _measure(world, "regression_untracked_net")
    assert coupled.verdict == "coupled" and coupled.changed is None and coupled.max_kl is None
    ref = _independent(world["models"]["regression_untracked_net"], world["x"], SIZES)
    assert coupled.max_deviation == pytest.approx(float(ref["dev"].max()), rel=1e-5)
    assert [s.module for s in coupled.sites] == ["features.4"]


def test_model_that_cannot_score_one_sample_alone_is_coupled(world, tmp_path):
    torch.manual_seed(0)
    model = world["ns"]["flat_untracked_net"]()
    save_file(model.state_dict(), tmp_path / "flat.safetensors")
    save_file({"inputs": torch.randn(20, 4)}, tmp_path / "flat_data.safetensors")
    options = DataOptions(path=str(tmp_path / "flat_data.safetensors"), batch_size=8)
    report = measure_invariance(
        ModelSpec(str(tmp_path / "flat.safetensors"), arch=_arch(world, "flat_untracked_net")), options
    )
    assert report.verdict == "coupled" and list(report.failures) == ["alone"]
    assert report.reference == "in batch (8)"
    assert any("cannot score one sample alone" in line for line in report.diagnosis)


def test_mixing_in_the_models_own_forward_names_the_model(world, tmp_path):
    torch.manual_seed(0)
    model = world["ns"]["root_mixer_net"]()
    save_file(model.state_dict(), tmp_path / "root.safetensors")
    options = DataOptions(path=str(world["root"] / "val.safetensors"), batch_size=8, num_samples=32)
    report = measure_invariance(
        ModelSpec(str(tmp_path / "root.safetensors"), arch=_arch(world, "root_mixer_net")), options
    )
    assert report.verdict == "coupled"
    assert [(s.module, s.kind, s.cause) for s in report.sites] == [("(model)", "RootMixer", "model_code")]
    assert any(line.startswith("RootMixer.forward: ") for line in report.diagnosis)


def test_dict_batches_are_re_batched_sample_by_sample(world, monkeypatch):
    torch.save({"inputs": world["x"][:40], "labels": world["y"][:40]}, world["root"] / "dict_data.pt")
    monkeypatch.syspath_prepend(str(world["root"]))
    state = world["models"]["untracked_net"].state_dict()
    save_file(state, world["root"] / "keyword.safetensors")
    options = DataOptions(dataset="invnet:dict_items", batch_size=8)
    report = measure_invariance(
        ModelSpec(str(world["root"] / "keyword.safetensors"), arch=_arch(world, "keyword_net")), options
    )
    # the same model as untracked_net, fed by keyword: the same deviations as a direct run
    ref = _independent(world["models"]["untracked_net"], world["x"][:40], [1, 8])
    assert report.max_deviation == pytest.approx(float(ref["dev"].max()), rel=1e-5)
    assert report.accuracy("alone") == pytest.approx(
        float((ref["alone"].argmax(1) == world["y"][:40][ref["order"]]).double().mean())
    )
    assert [s.module for s in report.sites] == ["features.4"]


def test_without_batch_size_1_the_first_batching_is_the_reference(world):
    report = _measure(world, "untracked_net", sizes=[8, 64])
    assert report.reference == "in batch (8)" and report.accuracy("alone") is None
    assert [a.name for a in report.arrangements] == [
        "in batch (8)",
        "other companions (8)",
        "in batch (64)",
        "other companions (64)",
    ]
    assert report.verdict == "coupled" and [s.module for s in report.sites] == ["features.4"]


def test_without_a_float64_run_the_screen_decides_and_says_so(world):
    options = DataOptions(path=str(world["root"] / "val.safetensors"), batch_size=8, num_samples=32)
    report = measure_invariance(
        ModelSpec(
            str(world["root"] / "untracked_net.safetensors"),
            arch=_arch(world, "untracked_net"),
            forward=f"{world['root'] / 'invnet.py'}:as_float32",
        ),
        options,
    )
    assert not report.float64 and report.float64_note and "float64" in report.float64_note
    assert report.verdict == "coupled" and report.coupled == report.flagged > 0
    assert any("screen decided alone" in line for line in report.diagnosis)
    assert [s.module for s in report.sites] == ["features.4"]  # located in float32 against the screen


# ----------------------------------------------------------------------------- nothing changes


def test_checkpoint_and_model_state_are_bit_identical_afterwards(world):
    path = world["root"] / "untracked_net.safetensors"
    before = _sha(path)
    runnable = load_runnable(ModelSpec(str(path), arch=_arch(world, "untracked_net")))
    state = {k: v.clone() for k, v in runnable.module.state_dict().items()}
    stream = make_loader(DataOptions(path=str(world["root"] / "val.safetensors"), num_samples=N))
    measure_model_invariance(runnable, stream, batch_sizes=SIZES)
    for name, value in runnable.module.state_dict().items():
        assert torch.equal(value, state[name]), name
    assert not any(m.training for m in runnable.module.modules())
    assert _sha(path) == before


# ----------------------------------------------------------------------------- CLI


def test_cli_table_json_and_exit_codes(world, cli):
    root = world["root"]
    common = ["--data", str(root / "val.safetensors"), "--num-samples", "64", "--batch-sizes", "1,16"]
    ok = cli("invariance", str(root / "net.safetensors"), "--arch", _arch(world, "net"), *common)
    assert ok.exit_code == 0, ok.output
    assert "invariant: no output depends on its batch companions" in ok.stdout
    assert "other companions (16)" in ok.stdout and "float64 floor 1.5e-08" in ok.stdout
    bad = cli("invariance", str(root / "untracked_net.safetensors"), "--arch", _arch(world, "untracked_net"), *common)
    assert bad.exit_code == 1
    assert "coupled:" in bad.stdout and "features.4" in bad.stdout
    zero = cli(
        "invariance",
        str(root / "untracked_net.safetensors"),
        "--arch",
        _arch(world, "untracked_net"),
        *common,
        "--exit-zero",
    )
    assert zero.exit_code == 0
    # BN006 is a finding of the checkpoint: --fail-on info fails an invariant verdict on it
    doc = cli(
        "invariance",
        str(root / "untracked_net.safetensors"),
        "--arch",
        _arch(world, "untracked_net"),
        *common,
        "--format",
        "json",
    )
    data = json.loads(doc.stdout)
    assert doc.exit_code == 1 and data["verdict"] == "coupled"
    assert data["batch_sizes"] == [1, 16] and data["samples"] == 64
    assert [a["name"] for a in data["arrangements"]] == ["alone", "in batch (16)", "other companions (16)"]
    assert data["coupling"][0]["module"] == "features.4" and data["coupling"][0]["cause"] == "batchnorm"
    assert data["noise"]["floor"] == FLOOR and data["accuracy_alone"] is not None
    assert data["kl"]["max"] >= data["kl"]["mean"] >= 0


def test_cli_fail_on_counts_inspect_findings(world, cli, tmp_path):
    root = world["root"]
    state = dict(world["models"]["net"].state_dict())
    state["features.1.running_var"] = torch.full_like(state["features.1.running_var"], 1e-9)  # dead channels
    save_file(state, tmp_path / "dead.safetensors")
    args = ["invariance", str(tmp_path / "dead.safetensors"), "--arch", _arch(world, "net")]
    args += ["--data", str(root / "val.safetensors"), "--num-samples", "32", "--batch-sizes", "1,8"]
    assert cli(*args).exit_code == 0
    assert cli(*args, "--fail-on", "info").exit_code == 1


def test_cli_fail_on_of_the_configuration_file_counts_and_the_configuration_options_apply(
    world, cli, tmp_path, monkeypatch
):
    state = dict(world["models"]["net"].state_dict())
    state["features.1.running_var"] = torch.full_like(state["features.1.running_var"], 1e-9)  # dead channels
    save_file(state, tmp_path / "dead.safetensors")
    args = ["invariance", str(tmp_path / "dead.safetensors"), "--arch", _arch(world, "net")]
    args += ["--data", str(world["root"] / "val.safetensors"), "--num-samples", "32", "--batch-sizes", "1,8"]
    monkeypatch.chdir(tmp_path)
    assert cli(*args).exit_code == 0  # invariant; its findings fail only with a stated fail-on
    (tmp_path / "pyproject.toml").write_text('[tool.bnaudit]\nfail-on = "info"\n')
    assert cli(*args).exit_code == 1
    assert cli(*args, "--isolated").exit_code == 0
    quiet = tmp_path / "ci.toml"
    quiet.write_text('fail-on = "info"\nignore = ["BN"]\n')
    named = cli(*args, "--config", str(quiet), "--format", "json")
    assert named.exit_code == 0 and json.loads(named.stdout)["findings"] == []


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--batch-sizes", "1,x"], "--batch-sizes must be a comma-separated list of whole numbers"),
        (["--batch-sizes", "1"], "--batch-sizes needs a batch size of at least 2"),
        (["--batch-sizes", "0,4"], "--batch-sizes must list batch sizes of at least 1"),
        (["--num-samples", "0"], "--num-samples must be at least 1"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(world, cli, extra, words):
    root = world["root"]
    result = cli(
        "invariance",
        str(root / "net.safetensors"),
        "--arch",
        _arch(world, "net"),
        "--data",
        str(root / "val.safetensors"),
        *extra,
    )
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bnaudit: error: ") and words in lines[0]


def test_cli_errors_shared_with_gap(world, cli):
    root = world["root"]
    missing = cli("invariance", str(root / "net.safetensors"), "--arch", _arch(world, "net"), "--data", "nope.pt")
    gap = cli("gap", str(root / "net.safetensors"), "--arch", _arch(world, "net"), "--data", "nope.pt")
    assert missing.exit_code == gap.exit_code == 2
    assert missing.stderr == gap.stderr
    doc = cli("invariance", str(root / "net.safetensors"), "--data", str(root / "val.safetensors"), "-f", "json")
    assert doc.exit_code == 2 and "error" in json.loads(doc.stdout)
    assert "--arch" in json.loads(doc.stdout)["error"]


def test_library_refuses_a_single_sample(world, tmp_path):
    save_file({"inputs": world["x"][:1]}, tmp_path / "one.safetensors")
    with pytest.raises(BnauditError, match="at least 2 samples"):
        measure_invariance(
            ModelSpec(str(world["root"] / "net.safetensors"), arch=_arch(world, "net")),
            DataOptions(path=str(tmp_path / "one.safetensors")),
        )


def test_public_api_exports_measure_invariance():
    import bnaudit

    assert bnaudit.measure_invariance is measure_invariance
    assert "measure_invariance" in bnaudit.__all__

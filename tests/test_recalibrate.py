"""The three recalibration methods against hand arithmetic and independent float64 references."""

from __future__ import annotations

import copy
import io
import json
import os
from pathlib import Path

import pytest
import torch
from conftest import default_sigint, train_classifier
from torch import nn

from bnaudit.errors import BnauditError
from bnaudit.runtime.batching import merge_trailing_singleton
from bnaudit.runtime.recalibrate.methods import recalibrate_module

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]
# torch.jit.script/save/load warn that TorchScript is deprecated; it is still a format users ship
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")

FOUR = torch.tensor([[2.0], [4.0], [6.0], [8.0]])


def split(x: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
    return [x[i : i + batch_size] for i in range(0, len(x), batch_size)]


# ----------------------------------------------------------------------------- the seeds' example


@pytest.mark.parametrize("method", ["exact", "sequential"])
@pytest.mark.parametrize("batch_size", [2, 3, 4])
def test_four_values_give_mean_5_and_unbiased_variance_20_over_3(method: str, batch_size: int) -> None:
    # 2, 4, 6, 8: mean 5; squared deviations 9 + 1 + 1 + 9 = 20; unbiased 20 / 3.
    # batch size 3 leaves a last batch of one sample: it is merged, not a crash.
    bn = nn.BatchNorm1d(1)
    model = nn.Sequential(bn)
    result = recalibrate_module(model, split(FOUR, batch_size), method=method)
    assert bn.running_mean.item() == pytest.approx(5.0, abs=1e-6)
    assert bn.running_var.item() == pytest.approx(20 / 3, rel=1e-7)
    assert result.layers[0].data_var[0] == pytest.approx(20 / 3, rel=1e-15)
    assert bn.num_batches_tracked.item() == (2 if batch_size == 2 else 1)
    assert result.samples == 4


def test_cumulative_averages_batch_variances_like_update_bn() -> None:
    # batches (2, 4) and (6, 8): batch means 3 and 7, unbiased batch variances 2 and 2:
    # the average gives mean 5 but variance 2, missing the spread of the batch means.
    bn = nn.BatchNorm1d(1)
    recalibrate_module(nn.Sequential(bn), split(FOUR, 2), method="cumulative")
    assert bn.running_mean.item() == pytest.approx(5.0)
    assert bn.running_var.item() == pytest.approx(2.0)


def test_batch_size_one_cannot_run_batchnorm1d_in_training_mode_and_says_so() -> None:
    with pytest.raises(BnauditError, match="batch-size 2 or more"):
        recalibrate_module(nn.Sequential(nn.BatchNorm1d(1)), split(FOUR, 1), method="exact")


def test_sequential_needs_no_training_mode_forward_so_batch_size_one_works() -> None:
    bn = nn.BatchNorm1d(1)
    recalibrate_module(nn.Sequential(bn), split(FOUR, 1), method="sequential")
    assert bn.running_var.item() == pytest.approx(20 / 3)


def test_only_the_last_single_sample_batch_is_merged() -> None:
    batches = [torch.zeros(3, 1), torch.zeros(1, 1), torch.zeros(3, 1), torch.zeros(1, 1)]
    assert [len(b) for b in merge_trailing_singleton(batches)] == [3, 1, 4]
    pairs = [(torch.zeros(2, 1), torch.zeros(2)), (torch.ones(1, 1), torch.ones(1))]
    (merged,) = list(merge_trailing_singleton(pairs))
    assert merged[0].shape == (3, 1) and merged[1].tolist() == [0, 0, 1]


# ----------------------------------------------------------------------------- a deeper net


class Net(nn.Module):
    """conv-BN2d-ReLU-conv-BN2d-ReLU-pool-linear-BN1d-ReLU-Dropout-linear-BN1d."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(2, 4, 3, padding=1),
            nn.BatchNorm2d(4),
            nn.ReLU(),
            nn.Conv2d(4, 6, 3, padding=1),
            nn.BatchNorm2d(6),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(2),
        )
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Linear(24, 8),
            nn.BatchNorm1d(8),
            nn.ReLU(),
            nn.Dropout(0.5),
            nn.Linear(8, 5),
            nn.BatchNorm1d(5),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


BN_NAMES = ["features.1", "features.4", "head.2", "head.6"]


@pytest.fixture
def net() -> Net:
    torch.manual_seed(0)
    model = Net()
    # stale statistics, far from the data's: recalibration must replace them
    for name in BN_NAMES:
        bn = model.get_submodule(name)
        bn.running_mean.fill_(3.0)
        bn.running_var.fill_(0.01)
    return model


@pytest.fixture
def data() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    # a large common offset: E[x^2] - E[x]^2 in float32 would lose the spread
    return torch.randn(90, 2, 5, 5, generator=g) * 0.5 + 40.0


def capture_inputs(model: nn.Module, names: list[str], batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """All inputs of the named modules over all batches, one row per value, channel last."""
    seen: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    handles = [
        model.get_submodule(n).register_forward_pre_hook(
            lambda _m, args, n=n: seen[n].append(args[0].detach().transpose(0, 1).reshape(args[0].shape[1], -1).T)
        )
        for n in names
    ]
    with torch.no_grad():
        for b in batches:
            model(b.to(next(model.parameters()).dtype))
    for h in handles:
        h.remove()
    return {n: torch.cat(v) for n, v in seen.items()}


def reference_exact(model: Net, batches: list[torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """float64 copy; BN normalising by batch statistics (train mode), Dropout off; then the
    two-pass mean and unbiased variance of all captured values."""
    ref = copy.deepcopy(model).double().eval()
    for n in BN_NAMES:
        ref.get_submodule(n).train()
    values = capture_inputs(ref, BN_NAMES, batches)
    return {n: (v.mean(0), v.var(0, unbiased=True)) for n, v in values.items()}


def reference_sequential(model: Net, batches: list[torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """float64 copy in eval mode; layer by layer, full forwards, earlier layers already set."""
    ref = copy.deepcopy(model).double().eval()
    out = {}
    for n in BN_NAMES:
        v = capture_inputs(ref, [n], batches)[n]
        mean, var = v.mean(0), v.var(0, unbiased=True)
        bn = ref.get_submodule(n)
        bn.running_mean.copy_(mean)
        bn.running_var.copy_(var)
        out[n] = (mean, var)
    return out


def assert_stats_close(model: nn.Module, expected: dict, rel: float = 1e-5) -> None:
    for n, (mean, var) in expected.items():
        bn = model.get_submodule(n)
        scale = var.sqrt()
        assert torch.allclose(
            bn.running_mean.double(), mean, rtol=0, atol=rel * float(scale.max() + mean.abs().max())
        ), n
        assert torch.allclose(bn.running_var.double(), var, rtol=rel, atol=0), n


def test_exact_matches_an_independent_float64_reference_for_every_layer(net: Net, data: torch.Tensor) -> None:
    batches = split(data, 16)
    expected = reference_exact(net, batches)
    result = recalibrate_module(net, batches, method="exact")
    assert_stats_close(net, expected)
    assert [layer.name for layer in result.layers] == BN_NAMES
    assert all(net.get_submodule(n).num_batches_tracked.item() == 6 for n in BN_NAMES)
    assert result.batches == 6 and result.samples == 90 and result.batch_size == 16


def test_exact_first_layer_ignores_batch_size_and_order(net: Net, data: torch.Tensor) -> None:
    a, b = copy.deepcopy(net), copy.deepcopy(net)
    ra = recalibrate_module(a, split(data, 16))
    rb = recalibrate_module(b, split(data[torch.randperm(90, generator=torch.Generator().manual_seed(3))], 7))
    assert torch.allclose(torch.from_numpy(ra.layers[0].new_var), torch.from_numpy(rb.layers[0].new_var), rtol=1e-12)
    assert torch.allclose(torch.from_numpy(ra.layers[0].new_mean), torch.from_numpy(rb.layers[0].new_mean), rtol=1e-12)


def test_sequential_matches_an_independent_float64_reference(net: Net, data: torch.Tensor) -> None:
    batches = split(data, 16)
    expected = reference_sequential(net, batches)
    recalibrate_module(net, batches, method="sequential")
    assert_stats_close(net, expected)


def test_sequential_is_self_consistent_in_eval_mode(net: Net, data: torch.Tensor) -> None:
    # afterwards each layer's eval-mode input over the calibration set has exactly the
    # stored mean and unbiased variance
    batches = split(data, 16)
    recalibrate_module(net, batches, method="sequential")
    net.double().eval()
    values = capture_inputs(net, BN_NAMES, batches)
    for n in BN_NAMES:
        bn = net.get_submodule(n)
        assert torch.allclose(
            values[n].mean(0), bn.running_mean, rtol=0, atol=1e-5 * float(bn.running_var.max().sqrt())
        )
        assert torch.allclose(values[n].var(0), bn.running_var, rtol=1e-5)


def test_sequential_ignores_batch_size_and_order(net: Net, data: torch.Tensor) -> None:
    a, b = copy.deepcopy(net), copy.deepcopy(net)
    recalibrate_module(a, split(data, 16), method="sequential")
    recalibrate_module(b, split(data.flip(0), 5), method="sequential")
    for n in BN_NAMES:
        assert torch.allclose(a.get_submodule(n).running_var, b.get_submodule(n).running_var, rtol=1e-5)
        assert torch.allclose(a.get_submodule(n).running_mean, b.get_submodule(n).running_mean, rtol=1e-5, atol=1e-5)


def test_cumulative_equals_update_bn_before_dropout(net: Net, data: torch.Tensor) -> None:
    batches = split(data, 16)
    anchor = copy.deepcopy(net)
    torch.manual_seed(5)
    torch.optim.swa_utils.update_bn([(b, torch.zeros(len(b))) for b in batches], anchor)
    recalibrate_module(net, batches, method="cumulative")
    for n in ["features.1", "features.4", "head.2"]:  # head.6 comes after the Dropout
        ours, theirs = net.get_submodule(n), anchor.get_submodule(n)
        assert torch.allclose(ours.running_mean, theirs.running_mean, rtol=1e-5, atol=1e-5), n
        assert torch.allclose(ours.running_var, theirs.running_var, rtol=1e-4), n
    # update_bn leaves Dropout active, which changes what the last layer sees
    assert not torch.allclose(net.head[6].running_var, anchor.head[6].running_var, rtol=1e-2)


def test_only_bn_buffers_change_and_modes_are_restored(net: Net, data: torch.Tensor) -> None:
    net.train()
    net.head[4].eval()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    modes = [m.training for m in net.modules()]
    recalibrate_module(net, split(data, 16))
    after = net.state_dict()
    stat_keys = {f"{n}.{leaf}" for n in BN_NAMES for leaf in ("running_mean", "running_var", "num_batches_tracked")}
    for k in before:
        if k in stat_keys:
            assert not torch.equal(before[k], after[k]), k
        else:
            assert torch.equal(before[k], after[k]), k
    assert [m.training for m in net.modules()] == modes
    assert all(net.get_submodule(n).track_running_stats for n in BN_NAMES)


def test_excluded_layers_keep_their_statistics(net: Net, data: torch.Tensor) -> None:
    result = recalibrate_module(net, split(data, 16), include=["features.*"], exclude=["features.4"])
    assert [layer.name for layer in result.layers] == ["features.1"]
    for n in ["features.4", "head.2", "head.6"]:
        assert torch.all(net.get_submodule(n).running_mean == 3.0)
        assert net.get_submodule(n).num_batches_tracked.item() == 0
    assert {s.name for s in result.skipped} >= {"features.4", "head.2", "head.6"}
    with pytest.raises(BnauditError, match="matches no BatchNorm layer"):
        recalibrate_module(net, split(data, 16), include=["nothing*"])


def test_non_finite_statistics_are_refused_naming_the_layer_and_nothing_changes(net: Net, data: torch.Tensor) -> None:
    data = data.clone()
    data[3, 1, 2, 2] = float("inf")
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(BnauditError, match=r"layer features\.1: the new running_mean is not finite"):
        recalibrate_module(net, split(data, 16))
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())


def test_float16_overflow_is_refused() -> None:
    bn = nn.BatchNorm1d(2)
    bn.running_var = bn.running_var.half()  # a half-precision buffer: 65504 is its largest value
    x = torch.randn(64, 2) * 1000.0
    with pytest.raises(BnauditError, match=r"layer 0: the new running_var is not finite .*float16"):
        recalibrate_module(nn.Sequential(bn), split(x, 16))


# ----------------------------------------------------------------------------- odd modules


class Branchy(nn.Module):
    """A BN used twice per forward, a BN never reached, and layers that are not recalibrated."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.BatchNorm1d(3)
        self.unused = nn.BatchNorm1d(3)
        self.untracked = nn.BatchNorm1d(3, track_running_stats=False)
        self.inorm = nn.InstanceNorm1d(3, track_running_stats=True)
        self.frozen = FrozenBN(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.frozen(self.untracked(self.shared(x) + self.shared(2 * x + 1)))


class FrozenBN(nn.Module):
    """torchvision-style FrozenBatchNorm: statistics as buffers, no training mode."""

    def __init__(self, n: int) -> None:
        super().__init__()
        for name in ("weight", "bias", "running_mean", "running_var"):
            self.register_buffer(name, torch.ones(n) if name in ("weight", "running_var") else torch.zeros(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.running_mean) / self.running_var.sqrt() * self.weight + self.bias


def test_shared_unreached_frozen_and_untracked_layers_are_reported_and_handled() -> None:
    model = Branchy()
    x = torch.randn(40, 3)
    result = recalibrate_module(model, split(x, 10))
    # the shared layer pools both calls: values x and 2x + 1, each counted once
    both = torch.cat([x, 2 * x + 1]).double()
    assert torch.allclose(model.shared.running_mean.double(), both.mean(0), atol=1e-6)
    assert torch.allclose(model.shared.running_var.double(), both.var(0), rtol=1e-6)
    (layer,) = result.layers
    assert layer.calls_per_batch == 2 and layer.count == 80 and layer.batches == 4
    assert model.shared.num_batches_tracked.item() == 4
    assert any("shared runs 2 times per forward" in w for w in result.warnings)
    reasons = {s.name: s.reason for s in result.skipped}
    assert "never reached" in reasons["unused"]
    assert "track_running_stats=False" in reasons["untracked"]
    assert "not BatchNorm" in reasons["inorm"]
    assert "frozen" in reasons["frozen"]
    assert model.unused.num_batches_tracked.item() == 0 and torch.all(model.unused.running_var == 1)


def test_torchscript_model_gives_the_same_statistics_as_the_eager_one(net: Net, data: torch.Tensor) -> None:
    buffer = io.BytesIO()
    torch.jit.save(torch.jit.script(net), buffer)
    buffer.seek(0)
    scripted = torch.jit.load(buffer)
    for method in ("exact", "sequential"):
        eager = copy.deepcopy(net)
        script = torch.jit.load(io.BytesIO(buffer.getvalue()))
        recalibrate_module(eager, split(data, 16), method=method)
        result = recalibrate_module(script, split(data, 16), method=method)
        assert [layer.name for layer in result.layers] == BN_NAMES
        buffers = dict(script.named_buffers())
        for n in BN_NAMES:
            assert torch.allclose(buffers[f"{n}.running_var"], eager.get_submodule(n).running_var, rtol=1e-6), (
                method,
                n,
            )
            assert buffers[f"{n}.num_batches_tracked"].item() == 6
    assert scripted.training  # the loaded module's mode is untouched


def test_fewer_than_1000_samples_warns() -> None:
    result = recalibrate_module(nn.Sequential(nn.BatchNorm1d(1)), split(FOUR, 2))
    assert any("only 4 calibration samples" in w for w in result.warnings)
    assert any("fewer than 1000 values per channel" in w for w in result.warnings)


# ----------------------------------------------------------------------------- the command

MODEL_SOURCE = """
from torch import nn


def tiny_net(classes=3, width=4):
    return nn.Sequential(
        nn.Conv2d(1, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
        nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
        nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(4 * width, 8, bias=False), nn.BatchNorm1d(8),
        nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, classes),
    )
"""
TINY_BN = ["1", "4", "9"]


def make_images(n_per_class: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Three classes of 6x6 images: a template per class plus noise, with a large offset."""
    g = torch.Generator().manual_seed(seed)
    templates = torch.rand(3, 1, 6, 6, generator=torch.Generator().manual_seed(99)) * 2
    xs = [templates[c] + 0.4 * torch.randn(n_per_class, 1, 6, 6, generator=g) + 5.0 for c in range(3)]
    ys = [torch.full((n_per_class,), c, dtype=torch.int64) for c in range(3)]
    return torch.cat(xs), torch.cat(ys)


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        return (model(x).argmax(1) == y).double().mean().item()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A trained tiny net (healthy and reset copies), calibration and held-out data."""
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("recal")
    (root / "tinynet.py").write_text(MODEL_SOURCE)
    ns: dict = {}
    exec(MODEL_SOURCE, ns)
    torch.manual_seed(0)
    model = ns["tiny_net"]()
    x_train, y_train = make_images(60, seed=1)
    train_classifier(model, x_train, y_train)
    healthy = {k: v.clone() for k, v in model.state_dict().items()}
    reset = copy.deepcopy(model)
    for name in TINY_BN:
        reset.get_submodule(name).reset_running_stats()
    save_file(reset.state_dict(), str(root / "reset.safetensors"), metadata={"origin": "test"})
    torch.save(
        {
            "state_dict": {f"model.{k}": v for k, v in reset.state_dict().items()},
            "epoch": 7,
            "optimizer": {"state": {}, "param_groups": [{"lr": 0.03}]},
        },
        root / "reset.ckpt",
    )
    x_cal, y_cal = make_images(50, seed=3)
    x_val, y_val = make_images(40, seed=4)
    save_file({"inputs": x_cal, "labels": y_cal}, str(root / "calib.safetensors"))
    save_file({"inputs": x_val, "labels": y_val}, str(root / "val.safetensors"))
    return {
        "root": root,
        "arch": f"{root / 'tinynet.py'}:tiny_net",
        "ns": ns,
        "healthy": healthy,
        "reset": reset.state_dict(),
        "x_cal": x_cal,
        "x_val": x_val,
        "y_val": y_val,
        "healthy_acc": accuracy(model, x_val, y_val),
        "reset_acc": accuracy(reset, x_val, y_val),
    }


def run_cli(*args: str):
    from typer.testing import CliRunner

    from bnaudit.cli import app

    return CliRunner().invoke(app, ["recalibrate", *args], env={"COLUMNS": "120", "NO_COLOR": "1"})


def load_into(world: dict, state: dict) -> nn.Module:
    model = world["ns"]["tiny_net"]()
    model.load_state_dict(state)
    return model.eval()


def test_cli_writes_population_statistics_and_the_documented_json(world: dict) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    root = world["root"]
    out = root / "exact.safetensors"
    result = run_cli(
        str(root / "reset.safetensors"),
        "--arch",
        world["arch"],
        "--data",
        str(root / "calib.safetensors"),
        "--output",
        str(out),
        "--batch-size",
        "32",
        "--format",
        "json",
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert {"input", "output", "method", "samples", "batches", "batch_size", "layers", "eval"} <= set(doc)
    assert (doc["method"], doc["samples"], doc["batches"], doc["batch_size"], doc["eval"]) == (
        "exact",
        150,
        5,
        32,
        None,
    )
    assert [layer["name"] for layer in doc["layers"]] == TINY_BN
    written = load_file(str(out))
    # first BN layer: the input of layer 1 is conv0(x) whatever the mode and the batches
    conv = load_into(world, world["reset"])[0].double()
    with torch.no_grad():
        values = conv(world["x_cal"].double()).transpose(0, 1).reshape(4, -1)
    assert torch.allclose(written["1.running_mean"].double(), values.mean(1), rtol=0, atol=1e-5)
    assert torch.allclose(written["1.running_var"].double(), values.var(1), rtol=1e-5)
    assert written["1.num_batches_tracked"].item() == 5
    # before: the reset statistics (0, 1) against that data, as gap defines drift
    shift = (values.mean(1).abs() / (1 + 1e-5) ** 0.5).mean().item()
    log_ratio = ((values.var(1) + 1e-5) / (1 + 1e-5)).log().abs().mean().item()
    assert doc["layers"][0]["before"]["mean_shift"] == pytest.approx(shift, rel=1e-6)
    assert doc["layers"][0]["before"]["var_log_ratio"] == pytest.approx(log_ratio, rel=1e-6)
    assert doc["layers"][0]["after"]["mean_shift"] < 1e-6
    # every other tensor is the input's, bit for bit
    for name, tensor in world["reset"].items():
        if not any(name.startswith(f"{n}.running") or name.startswith(f"{n}.num_batches") for n in TINY_BN):
            assert torch.equal(written[name], tensor), name
    with safe_open(str(out), "pt") as f:
        metadata = f.metadata()
    assert metadata["origin"] == "test"
    provenance = json.loads(metadata["bnaudit"])
    assert (provenance["method"], provenance["samples"], provenance["batch_size"]) == ("exact", 150, 32)
    assert provenance["data"].startswith(str(root / "calib.safetensors"))
    assert provenance == doc["provenance"]


def test_cli_reset_model_recovers_its_healthy_accuracy_on_held_out_data(world: dict) -> None:
    from safetensors.torch import load_file

    root = world["root"]
    out = root / "recovered.safetensors"
    assert world["reset_acc"] < world["healthy_acc"] - 0.2  # the reset really hurts
    result = run_cli(
        str(root / "reset.safetensors"),
        "--arch",
        world["arch"],
        "--data",
        str(root / "calib.safetensors"),
        "--eval-data",
        str(root / "val.safetensors"),
        "-o",
        str(out),
        "--format",
        "json",
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    new_acc = accuracy(load_into(world, load_file(str(out))), world["x_val"], world["y_val"])
    assert doc["eval"]["before"]["eval_mode"]["accuracy"] == pytest.approx(world["reset_acc"])
    assert doc["eval"]["after"]["eval_mode"]["accuracy"] == pytest.approx(new_acc)
    assert new_acc >= world["healthy_acc"] - 0.03


def test_cli_takes_the_configuration_options_for_the_held_out_findings(
    world: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = world["root"]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bnaudit.toml").write_text('ignore = ["BN"]\n')
    quiet = tmp_path / "ci.toml"
    quiet.write_text('ignore = ["BN001", "BN003"]\n')
    codes = {}
    for name, extra in (("found", []), ("isolated", ["--isolated"]), ("named", ["--config", str(quiet)])):
        common = ["--arch", world["arch"], "--data", str(root / "calib.safetensors")]
        common += ["--eval-data", str(root / "val.safetensors"), "-o", str(tmp_path / f"{name}.safetensors")]
        result = run_cli(str(root / "reset.safetensors"), *common, "--format", "json", *extra)
        assert result.exit_code == 0, result.output
        codes[name] = {f["code"] for f in json.loads(result.stdout)["eval"]["before"]["findings"]}
    assert codes["found"] == set()  # bnaudit.toml ignores every rule
    assert "BN002" in codes["isolated"] and "BN002" in codes["named"]  # the reset is found again
    assert not codes["named"] & {"BN001", "BN003"}


def test_cli_table_shows_before_after_and_held_out_side_by_side(world: dict) -> None:
    root = world["root"]
    out = root / "table.safetensors"
    result = run_cli(
        str(root / "reset.safetensors"),
        "--arch",
        world["arch"],
        "--data",
        str(root / "calib.safetensors"),
        "--eval-data",
        str(root / "val.safetensors"),
        "-o",
        str(out),
        "--method",
        "sequential",
    )
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert "method sequential: 150 samples in 3 batches of 64" in text
    assert "old -> new statistics" in text and "eval-mode accuracy" in text
    assert f"{world['reset_acc'] * 100:.1f}%" in text
    assert f"wrote {out}: 3 layers recalibrated" in text
    assert "only 150 calibration samples" in result.stderr


def test_cli_container_keeps_its_keys_prefix_and_other_entries(world: dict) -> None:
    root = world["root"]
    out = root / "out.ckpt"
    result = run_cli(
        str(root / "reset.ckpt"),
        "--arch",
        world["arch"],
        "--data",
        str(root / "calib.safetensors"),
        "-o",
        str(out),
        "--layers",
        "1",
        "--layers",
        "4",
        "--exclude",
        "4",
    )
    assert result.exit_code == 0, result.output
    before = torch.load(root / "reset.ckpt", weights_only=True)
    after = torch.load(out, weights_only=True)
    assert after["epoch"] == 7 and after["optimizer"] == before["optimizer"]
    assert list(after["state_dict"]) == list(before["state_dict"])
    changed = {k for k in before["state_dict"] if not torch.equal(before["state_dict"][k], after["state_dict"][k])}
    assert changed == {"model.1.running_mean", "model.1.running_var", "model.1.num_batches_tracked"}


def test_cli_torchscript_in_torchscript_out(world: dict, tmp_path: Path) -> None:
    model = load_into(world, world["reset"])
    src, out = tmp_path / "scripted.pt", tmp_path / "out.pt"
    torch.jit.save(torch.jit.script(model), str(src))
    result = run_cli(
        str(src),
        "--data",
        str(world["root"] / "calib.safetensors"),
        "-o",
        str(out),
        "--batch-size",
        "32",
        "--no-shuffle",
    )
    assert result.exit_code == 0, result.output
    expected = copy.deepcopy(model)
    x = world["x_cal"]
    recalibrate_module(expected, [x[i : i + 32] for i in range(0, 150, 32)])
    loaded = torch.jit.load(str(out))
    buffers = dict(loaded.named_buffers())
    for n in TINY_BN:
        assert torch.allclose(buffers[f"{n}.running_var"], expected.get_submodule(n).running_var, rtol=1e-6)
    assert accuracy(loaded, world["x_val"], world["y_val"]) == accuracy(expected, world["x_val"], world["y_val"])


def test_cli_refuses_an_existing_output_without_force(world: dict, tmp_path: Path) -> None:
    root = world["root"]
    out = tmp_path / "taken.safetensors"
    out.write_bytes(b"keep")
    args = [
        str(root / "reset.safetensors"),
        "--arch",
        world["arch"],
        "--data",
        str(root / "calib.safetensors"),
        "-o",
        str(out),
    ]
    result = run_cli(*args)
    assert result.exit_code == 2 and out.read_bytes() == b"keep"
    assert result.stderr.strip() == f"bnaudit: error: {out}: already exists (pass --force to overwrite)"
    result = run_cli(*args, "--format", "json")
    assert json.loads(result.stdout) == {"error": f"{out}: already exists (pass --force to overwrite)"}
    assert run_cli(*args, "--force").exit_code == 0 and out.read_bytes()[:1] != b"k"


@pytest.mark.parametrize(
    "extra, fragment",
    [
        (["--eval-data", "calib.safetensors"], "--eval-data must be held-out data"),
        (["--method", "average"], "Invalid value for '--method'"),
        (["--layers", "nothing*"], "--layers 'nothing*' matches no BatchNorm layer"),
        (["--batch-size", "1"], "use --batch-size 2 or more"),
    ],
)
def test_cli_bad_requests_are_one_line_errors(
    world: dict, tmp_path: Path, extra: list[str], fragment: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(world["root"])
    out = tmp_path / "never.safetensors"
    result = run_cli(
        "reset.safetensors", "--arch", world["arch"], "--data", "calib.safetensors", "-o", str(out), *extra
    )
    assert result.exit_code == 2, result.output
    assert fragment in result.stderr
    assert not out.exists() and os.listdir(tmp_path) == []


@pytest.mark.slow
def test_python_m_bnaudit_recalibrate_end_to_end_and_ctrl_c_leaves_nothing(world: dict, tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys
    import time

    root = world["root"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    base = [sys.executable, "-m", "bnaudit", "recalibrate", str(root / "reset.safetensors"), "--arch", world["arch"]]
    proc = subprocess.run(
        [*base, "--data", str(root / "calib.safetensors"), "-o", str(tmp_path / "a.safetensors")],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "wrote" in proc.stdout and "bnaudit: warning: only 150 calibration samples" in proc.stderr
    # a dataset that blocks: interrupt the run while it calibrates
    (tmp_path / "slow_data.py").write_text(SLOW_DATASET.format(marker=str(tmp_path / "started")))
    out = tmp_path / "b.safetensors"
    proc = subprocess.Popen(
        [*base, "--dataset", "slow_data:dataset", "-o", str(out)],
        cwd=tmp_path,
        env={**env, "PYTHONPATH": f"{REPO}{os.pathsep}{tmp_path}"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_sigint,
    )
    deadline = time.monotonic() + 60
    while not (tmp_path / "started").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "interrupted" in stderr
    left = sorted(p for p in os.listdir(tmp_path) if p != "__pycache__")
    assert left == ["a.safetensors", "slow_data.py", "started"]


SLOW_DATASET = """
import time
import torch


class Slow(torch.utils.data.Dataset):
    def __len__(self):
        return 10000

    def __getitem__(self, i):
        open({marker!r}, "w").close()
        time.sleep(0.01)
        return torch.randn(1, 6, 6)


def dataset():
    return Slow()
"""


def test_cli_layer_whose_buffers_the_file_lacks_is_listed_and_no_key_is_added(world: dict, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    partial = {
        k: v for k, v in world["reset"].items() if not k.startswith("9.running") and k != "9.num_batches_tracked"
    }
    save_file(partial, str(tmp_path / "partial.safetensors"))
    out = tmp_path / "out.safetensors"
    result = run_cli(
        str(tmp_path / "partial.safetensors"),
        "--arch",
        world["arch"],
        "--data",
        str(world["root"] / "calib.safetensors"),
        "-o",
        str(out),
        "--format",
        "json",
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert [layer["name"] for layer in doc["layers"]] == ["1", "4"]
    assert {"name": "9", "reason": "its buffers are not in the checkpoint: left out (no new keys are written)"} in doc[
        "skipped"
    ]
    assert set(load_file(str(out))) == set(partial)


# ----------------------------------------------------------------------------- the sample models

SAMPLES = REPO / "sample_models"


def digits_accuracy(state: dict, x: torch.Tensor, y: torch.Tensor) -> float:
    import importlib.util

    spec = importlib.util.spec_from_file_location("digits_net_reference", SAMPLES / "digits_net.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.digits_net()
    model.load_state_dict(state)
    return accuracy(model, x, y)


@pytest.mark.parametrize("broken", ["reset_stats.pt", "immature.pt"])
def test_real_broken_model_recovers_its_healthy_accuracy(broken: str, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    val = load_file(str(SAMPLES / "data" / "digits_val.safetensors"))
    x, y = val["inputs"], val["labels"]
    healthy = digits_accuracy(torch.load(SAMPLES / "healthy.pt", weights_only=True), x, y)
    before = digits_accuracy(torch.load(SAMPLES / broken, weights_only=True), x, y)
    assert before < healthy - 0.3  # the broken statistics really cost accuracy
    out = tmp_path / "recalibrated.pt"
    # calibration split and validation split are disjoint (sample_models/generate.py)
    result = run_cli(
        str(SAMPLES / broken),
        "--arch",
        f"{SAMPLES / 'digits_net.py'}:digits_net",
        "--data",
        str(SAMPLES / "data" / "digits_calib.safetensors"),
        "--eval-data",
        str(SAMPLES / "data" / "digits_val.safetensors"),
        "-o",
        str(out),
        "--format",
        "json",
    )
    assert result.exit_code == 0, result.output
    after = digits_accuracy(torch.load(out, weights_only=True), x, y)
    assert after >= healthy - 0.01  # within 4 of 400 validation images of the healthy twin
    doc = json.loads(result.stdout)
    assert doc["eval"]["before"]["eval_mode"]["accuracy"] == pytest.approx(before)
    assert doc["eval"]["after"]["eval_mode"]["accuracy"] == pytest.approx(after)


@pytest.mark.slow
def test_inspect_trusts_the_provenance_of_recalibrated_layers_only(tmp_path: Path) -> None:
    """A recalibrated layer's counter is its number of calibration batches (5 here):
    BN003's (1-m)^t premise does not apply to it, but still does to an excluded layer."""
    import subprocess
    import sys

    from safetensors.torch import save_file

    from bnaudit import inspect
    from bnaudit.formats.read import read_checkpoint

    immature = torch.load(SAMPLES / "immature.pt", weights_only=True)
    source = tmp_path / "immature.safetensors"
    save_file({k: v.contiguous() for k, v in immature.items()}, str(source))
    out = tmp_path / "out.safetensors"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bnaudit",
            "recalibrate",
            str(source),
            "--arch",
            f"{SAMPLES}/digits_net.py:digits_net",
            "--data",
            f"{SAMPLES}/data/digits_calib.safetensors",
            "--exclude",
            "head.2",
            "-o",
            str(out),
            "-q",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr
    record = json.loads(read_checkpoint(str(out)).metadata["bnaudit"])
    assert record["recalibrated_layers"] == ["features.1", "features.4"] and record["batches"] == 5
    (file,) = inspect(str(out)).files
    assert [(f.code, f.layer) for f in file.findings] == [("BN003", "head.2")]  # 0.9^3: still immature
    assert "re-estimated by bnaudit recalibrate (method exact, 300 samples" in file.provenance
    before = inspect(str(source)).files[0]
    assert sorted(f.layer for f in before.findings if f.code == "BN003") == ["features.1", "features.4", "head.2"]


@pytest.mark.parametrize(
    "entry",
    ["not json", "[1, 2]", '{"recalibrated_layers": "features.1"}', '{"recalibrated_layers": [1, null]}', "{" * 100000],
)
def test_forged_provenance_is_ignored(tmp_path: Path, entry: str) -> None:
    from safetensors.torch import save_file

    from bnaudit import inspect

    immature = torch.load(SAMPLES / "immature.pt", weights_only=True)
    path = tmp_path / "forged.safetensors"
    save_file({k: v.contiguous() for k, v in immature.items()}, str(path), metadata={"bnaudit": entry})
    (file,) = inspect(str(path)).files
    assert file.error is None and file.provenance == ""
    assert sorted(f.layer for f in file.findings if f.code == "BN003") == ["features.1", "features.4", "head.2"]


def test_cli_keeps_imported_objects_out_of_gc_walks_only_while_it_runs(world: dict, tmp_path: Path) -> None:
    import gc

    log = tmp_path / "freeze_counts.txt"
    (tmp_path / "freeze_probe.py").write_text(
        "import gc\n"
        "def run(model, x):\n"
        f"    with open({str(log)!r}, 'a') as f:\n"
        "        f.write(f'{gc.get_freeze_count()}\\n')\n"
        "    return model(x)\n"
    )
    root = world["root"]
    assert gc.get_freeze_count() == 0
    result = run_cli(
        str(root / "reset.safetensors"),
        "--arch",
        world["arch"],
        "--data",
        str(root / "calib.safetensors"),
        "--output",
        str(tmp_path / "out.safetensors"),
        "--batch-size",
        "50",
        "--format",
        "json",
        "--forward",
        f"{tmp_path / 'freeze_probe.py'}:run",
    )
    assert result.exit_code == 0, result.output
    counts = [int(line) for line in log.read_text().split()]
    # one forward per batch (150 samples / 50): torch and everything imported were frozen
    assert len(counts) == 3 and min(counts) > 10_000
    assert gc.get_freeze_count() == 0  # and given back to the collector afterwards


def test_cli_table_shows_the_wilson_intervals_of_its_json(world: dict) -> None:
    """The --eval-data table shows each accuracy's 95% Wilson interval and the gap's
    interval, the numbers its JSON holds, and the sample count."""
    root = world["root"]
    common = (
        str(root / "reset.safetensors"),
        "--arch",
        world["arch"],
        "--data",
        str(root / "calib.safetensors"),
        "--eval-data",
        str(root / "val.safetensors"),
    )
    doc = json.loads(run_cli(*common, "-o", str(root / "ci.json.safetensors"), "--format", "json").stdout)
    result = run_cli(*common, "-o", str(root / "ci.table.safetensors"))
    assert result.exit_code == 0, result.output
    rows = {line.split("│")[0].strip(): line for line in result.stdout.splitlines() if "│" in line}
    for side in ("before", "after"):
        ev = doc["eval"][side]
        low, high = ev["eval_mode_interval"]
        assert f"{low * 100:.1f}-{high * 100:.1f}%" in rows["eval-mode accuracy"]
        low, high = ev["train_mode_interval"]
        assert f"{low * 100:.1f}-{high * 100:.1f}%" in rows["train-mode accuracy"]
        low, high = ev["gap_interval"]
        assert f"{low * 100:+.1f} to {high * 100:+.1f}" in rows["gap (points)"]
    assert "95% CI (Wilson)" in result.stdout
    assert f"n = {doc['eval']['after']['labelled']} labelled samples" in result.stdout


def test_record_date_follows_source_date_epoch(world: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SOURCE_DATE_EPOCH fixes the record's date (reproducible outputs, the README's examples)."""
    from safetensors import safe_open

    root = world["root"]
    dates = []
    for epoch in ("1764460800", "1700000000"):
        monkeypatch.setenv("SOURCE_DATE_EPOCH", epoch)
        out = tmp_path / f"{epoch}.safetensors"
        args = ("--arch", world["arch"], "--data", str(root / "calib.safetensors"), "-o", str(out))
        result = run_cli(str(root / "reset.safetensors"), *args)
        assert result.exit_code == 0, result.output
        with safe_open(str(out), "pt") as f:
            dates.append(json.loads(f.metadata()["bnaudit"])["date"])
    assert dates == ["2025-11-30T00:00:00+00:00", "2023-11-14T22:13:20+00:00"]


def test_one_batch_is_singular(world: dict, tmp_path: Path) -> None:
    root = world["root"]
    result = run_cli(
        str(root / "reset.safetensors"),
        "--arch",
        world["arch"],
        "--data",
        str(root / "calib.safetensors"),
        "--num-samples",
        "32",
        "--batch-size",
        "32",
        "-o",
        str(tmp_path / "one.safetensors"),
    )
    assert result.exit_code == 0, result.output
    assert "method exact: 32 samples in 1 batch (" in result.stdout

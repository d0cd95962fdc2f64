"""`bnaudit fed` (issue #36): a federated global checkpoint's BN statistics classified against
its clients'. The clients are real runs: the sample digits network (its healthy weights as the
previous global) trained a few Adam steps by each client on a class-skewed shard of the
digits, BatchNorm statistics updating as they do in training. The server's global is built
each way frameworks build it; every layer must be classified right, and the variance an
average understates must be the between-client term computed here with numpy.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import SAMPLES, run_python
from safetensors.torch import load_file, save_file

from bnaudit.audit.fed.federation import audit_federation
from bnaudit.errors import BnauditError

ARCH = os.path.join(SAMPLES, "digits_net.py") + ":digits_net"
LAYERS = ("features.1", "features.4", "head.2")  # no "bn" in any name: found by what they hold
SHARDS = ((0, 1, 2, 3), (4, 5, 6), (7, 8, 9))  # class-skewed clients
STEPS = (3, 5, 7)


def fed_cli(*args: str):
    from typer.testing import CliRunner

    from bnaudit.cli import app

    return CliRunner().invoke(app, ["fed", *args, "--isolated"], env={"COLUMNS": "160", "NO_COLOR": "1"})


def _digits_net():
    import importlib.util

    spec = importlib.util.spec_from_file_location("digits_net_fed", os.path.join(SAMPLES, "digits_net.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.digits_net()


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("fed")
    start = load_file(os.path.join(SAMPLES, "healthy.safetensors"))
    data = load_file(os.path.join(SAMPLES, "data", "digits_calib.safetensors"))
    clients, paths, data_paths = [], [], []
    for k, (classes, steps) in enumerate(zip(SHARDS, STEPS)):
        mask = torch.isin(data["labels"], torch.tensor(classes))
        x, y = data["inputs"][mask].contiguous(), data["labels"][mask].contiguous()
        torch.manual_seed(k)
        model = _digits_net()
        model.load_state_dict(start)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        model.train()
        g = torch.Generator().manual_seed(k)
        for _ in range(steps):
            idx = torch.randperm(len(y), generator=g)[:24]
            loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        state = {name: t.detach().clone().contiguous() for name, t in model.state_dict().items()}
        clients.append(state)
        paths.append(str(root / f"client{k}.safetensors"))
        save_file(state, paths[-1])
        data_paths.append(str(root / f"data{k}.safetensors"))
        save_file({"inputs": x, "labels": y}, data_paths[-1])
    return {"root": root, "clients": clients, "paths": paths, "data": data_paths}


def stats(clients: list[dict], layer: str) -> tuple[np.ndarray, np.ndarray]:
    """(K, C) float64 arrays of the clients' running_mean and running_var."""
    means = np.stack([c[f"{layer}.running_mean"].double().numpy() for c in clients])
    variances = np.stack([c[f"{layer}.running_var"].double().numpy() for c in clients])
    return means, variances


def counters(clients: list[dict], layer: str) -> np.ndarray:
    return np.array([int(c[f"{layer}.num_batches_tracked"]) for c in clients], dtype=np.float64)


def build(federation: dict, name: str, statistics) -> str:
    """A global: parameters FedAvg-averaged (float32, as a server does), BN buffers by
    `statistics(layer) -> {leaf: tensor}` (absent leaves: the plain mean in float32)."""
    clients = federation["clients"]
    out = {}
    for key in clients[0]:
        out[key] = (sum(c[key].float() for c in clients) / len(clients)).to(clients[0][key].dtype)
    for layer in LAYERS:
        out.update({f"{layer}.{leaf}": t for leaf, t in statistics(layer).items()})
    path = str(federation["root"] / f"{name}.safetensors")
    save_file({k: v.contiguous() for k, v in out.items()}, path)
    return path


def classify(federation: dict, path: str, **kwargs) -> dict:
    report = audit_federation(path, federation["paths"], **kwargs)
    return {layer.name: layer for layer in report.layers}, report


def test_the_first_clients_buffers_are_named_as_copied(federation: dict) -> None:
    first = federation["clients"][0]
    path = build(
        federation,
        "first",
        lambda layer: {
            leaf: first[f"{layer}.{leaf}"] for leaf in ("running_mean", "running_var", "num_batches_tracked")
        },
    )
    layers, report = classify(federation, path)
    assert [(layers[n].kind, layers[n].client) for n in LAYERS] == [("copied", 0)] * 3
    assert {f.code for f in report.findings} == {"BN301"}
    assert "client 1 (client0.safetensors)" in report.findings[0].message


def test_a_plain_mean_of_every_entry_is_averaged_and_understates_the_between_client_term(federation: dict) -> None:
    clients = federation["clients"]
    path = build(
        federation,
        "mean",
        lambda layer: {
            "num_batches_tracked": sum(c[f"{layer}.num_batches_tracked"].float() for c in clients) / len(clients)
        },
    )
    layers, report = classify(federation, path)
    stored = load_file(path)
    for name in LAYERS:
        layer = layers[name]
        assert layer.kind == "averaged" and layer.weighting.source == "plain mean"
        means, _ = stats(clients, name)
        between = ((means - means.mean(axis=0)) ** 2).mean(axis=0)  # sum_k (1/K) (m_k - mu)^2
        np.testing.assert_allclose(layer.understated, between, rtol=1e-9)
        var = stored[f"{name}.running_var"].double().numpy()
        assert layer.understated_fraction == pytest.approx((between / (var + between)).max(), rel=1e-9)
        assert layer.counter is not None and layer.counter.dtype == "float32"
        assert layer.counter.value == pytest.approx(counters(clients, name).mean())
    assert max(layers[n].understated_fraction for n in LAYERS) > 0.01  # non-IID clients: a real loss
    codes = [f.code for f in report.findings]
    assert codes.count("BN302") == 3 and codes.count("BN305") == 3
    assert report.exit_code() == 1 and report.fix


def pooled(clients: list[dict], layer: str, weights: np.ndarray) -> dict:
    means, variances = stats(clients, layer)
    w = (weights / weights.sum())[:, None]
    mu = (w * means).sum(axis=0)
    var = (w * (variances + (means - mu) ** 2)).sum(axis=0)
    return {
        "running_mean": torch.from_numpy(mu).float(),
        "running_var": torch.from_numpy(var).float(),
        "num_batches_tracked": torch.tensor(int(counters(clients, layer).sum())),
    }


def test_pooled_statistics_are_recognised_with_plain_and_counter_weights(federation: dict) -> None:
    clients = federation["clients"]
    plain = build(federation, "pooled-plain", lambda layer: pooled(clients, layer, np.ones(3)))
    counted = build(federation, "pooled-counted", lambda layer: pooled(clients, layer, counters(clients, layer)))
    for path, source in ((plain, "plain mean"), (counted, "num_batches_tracked")):
        layers, report = classify(federation, path)
        assert [(layers[n].kind, layers[n].weighting.source) for n in LAYERS] == [("pooled", source)] * 3
        assert report.findings == () and report.exit_code() == 0 and report.fix == ()
    result = fed_cli(counted, *federation["paths"], "--format", "json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    weights = counters(clients, "head.2") / counters(clients, "head.2").sum()
    assert doc["layers"][2]["weighting"]["weights"] == pytest.approx(weights.tolist(), rel=1e-12)


def test_a_count_weighted_average_in_float32_is_averaged_with_its_weights(federation: dict) -> None:
    clients = federation["clients"]

    def weighted(layer: str) -> dict:
        n = torch.tensor(counters(clients, layer), dtype=torch.float32)
        w = n / n.sum()
        return {
            leaf: sum(wk * c[f"{layer}.{leaf}"] for wk, c in zip(w, clients))
            for leaf in ("running_mean", "running_var")
        }

    layers, _ = classify(federation, build(federation, "weighted", weighted))
    for name in LAYERS:
        assert layers[name].kind == "averaged" and layers[name].weighting.source == "num_batches_tracked"
        means, _ = stats(clients, name)
        n = counters(clients, name)
        mu = (n[:, None] * means).sum(axis=0) / n.sum()
        between = (n[:, None] * (means - mu) ** 2).sum(axis=0) / n.sum()  # sum_k n_k (m_k - mu)^2 / N
        np.testing.assert_allclose(layers[name].understated, between, rtol=1e-6)


def test_initial_statistics_and_a_mixed_global_are_classified_layer_by_layer(federation: dict) -> None:
    clients = federation["clients"]
    initial = build(
        federation,
        "initial",
        lambda layer: {
            "running_mean": torch.zeros_like(clients[0][f"{layer}.running_mean"]),
            "running_var": torch.ones_like(clients[0][f"{layer}.running_var"]),
            "num_batches_tracked": torch.tensor(0),
        },
    )
    layers, report = classify(federation, initial)
    assert [layers[n].kind for n in LAYERS] == ["initial"] * 3 and {f.code for f in report.findings} == {"BN303"}
    ways = {
        "features.1": lambda layer: {k: clients[2][f"{layer}.{k}"] for k in ("running_mean", "running_var")},
        "features.4": lambda layer: pooled(clients, layer, np.ones(3)),
        "head.2": lambda layer: {"running_mean": clients[0][f"{layer}.running_mean"] * 1.5},
    }
    layers, report = classify(federation, build(federation, "mixed", lambda layer: ways[layer](layer)))
    assert [layers[n].kind for n in LAYERS] == ["copied", "pooled", "other"]
    assert layers["features.1"].client == 2
    assert [f.code for f in report.findings] == ["BN301", "BN304"]


def test_the_fix_is_the_merge_of_the_clients_statistics_files(federation: dict, tmp_path: Path) -> None:
    """At each client `recalibrate GLOBAL --stats-out`, at the server `merge`: the merged global
    holds the statistics of the union under the global weights, and fed says so. The files'
    sample counts weigh the clients."""
    from bnaudit.formats.bnstats import read_statistics
    from bnaudit.runtime.data import DataOptions
    from bnaudit.runtime.models import ModelSpec
    from bnaudit.runtime.recalibrate.command import recalibrate_checkpoint
    from bnaudit.runtime.recalibrate.merge import merge_statistics

    clients = federation["clients"]
    averaged = build(federation, "to-fix", lambda layer: {})
    files = []
    for k, data in enumerate(federation["data"]):
        files.append(str(tmp_path / f"client{k}.bnstats"))
        options = DataOptions(path=data, batch_size=32)
        recalibrate_checkpoint(ModelSpec(averaged, arch=ARCH), None, options, stats_out=files[-1])
    fixed = str(tmp_path / "fixed.safetensors")
    merge_statistics(files, averaged, fixed)
    layers, report = classify(federation, fixed, statistics=files)
    assert [layers[n].kind for n in LAYERS] == ["recalibrated"] * 3 and report.findings == ()
    samples = np.array([read_statistics(f).samples for f in files], dtype=np.float64)
    by_samples = build(federation, "pooled-samples", lambda layer: pooled(clients, layer, samples))
    layers, _ = classify(federation, by_samples, statistics=files)
    assert [(layers[n].kind, layers[n].weighting.source) for n in LAYERS] == [("pooled", "statistics files")] * 3


def test_the_command_line_reports_formats_and_exit_codes(federation: dict, tmp_path: Path) -> None:
    mean = build(federation, "cli-mean", lambda layer: {})  # statistics and counters: the plain mean
    table = fed_cli(mean, *federation["paths"])
    assert table.exit_code == 1, table.output
    assert "averaged" in table.stdout and "bnaudit merge client-*.bnstats" in table.stdout
    assert fed_cli(mean, *federation["paths"], "--fail-on", "error").exit_code == 0
    assert fed_cli(mean, *federation["paths"], "--ignore", "BN302").exit_code == 0
    assert fed_cli(mean, *federation["paths"], "--exit-zero").exit_code == 0
    sarif = json.loads(fed_cli(mean, *federation["paths"], "-f", "sarif").stdout)
    assert {r["ruleId"] for r in sarif["runs"][0]["results"]} == {"BN302"}
    assert "::warning" in fed_cli(mean, *federation["paths"], "-f", "github").stdout
    missing = fed_cli(mean, str(tmp_path / "nope.pt"), "--format", "json")
    assert missing.exit_code == 2 and "error" in json.loads(missing.stdout)
    twice = fed_cli(mean, federation["paths"][0], federation["paths"][0])
    assert twice.exit_code == 2 and "given twice" in twice.stderr
    counts = fed_cli(mean, *federation["paths"], "--stats", federation["paths"][0])
    assert counts.exit_code == 2 and "one statistics file per client" in counts.stderr


def test_a_global_without_batchnorm_is_refused(federation: dict, tmp_path: Path) -> None:
    path = str(tmp_path / "linear.safetensors")
    save_file({"fc.weight": torch.zeros(2, 2)}, path)
    with pytest.raises(BnauditError, match="no BatchNorm"):
        audit_federation(path, federation["paths"])


@pytest.mark.slow
def test_fed_imports_neither_torch_nor_numpy(federation: dict) -> None:
    mean = build(federation, "probe-mean", lambda layer: {})
    code = (
        "import sys, runpy\n"
        f"sys.argv = ['bnaudit', 'fed', {mean!r}, *{federation['paths']!r}, '--isolated', '-q']\n"
        "try:\n    runpy.run_module('bnaudit', run_name='__main__')\nexcept SystemExit as exc:\n    code = exc.code\n"
        "print('LOADED', code, 'torch' in sys.modules, 'numpy' in sys.modules)\n"
    )
    proc = run_python(code)
    assert proc.stdout.strip().splitlines()[-1] == "LOADED 1 False False", proc.stdout + proc.stderr

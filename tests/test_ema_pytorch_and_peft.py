"""Layouts written by ema-pytorch and PEFT, built with their own code.

ema-pytorch's `EMA` saves one state dict holding two models (`ema_model.*`, `online_model.*`,
`initted`, `step`): read as two state dicts, never one mixed set of layers. A PEFT adapter
folder (`adapter_config.json` + `adapter_model.safetensors`) is audited composed with its base
(`--base`, or `base_model_name_or_path` found in the Hugging Face cache); a BN layer in
`modules_to_save` whose statistics the adapter lacks (peft's own `save_as_lora` drops them) is
an error."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import save_torch
from safetensors import safe_open
from safetensors.torch import save_file
from timm_support import import_ema_pytorch, import_peft
from torch import nn

from bnaudit.api import inspect
from bnaudit.config import Config


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.fc(x.mean((2, 3)))


BNS = ["bn1", "bn2"]


def _batches(n: int = 20):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 3, 10, 10, generator=g) * 2 + 1 for _ in range(n)]


# ----------------------------------------------------------------------------- ema-pytorch


@pytest.fixture(scope="module")
def ema_files(tmp_path_factory):
    ema_pytorch = import_ema_pytorch()
    torch.manual_seed(0)
    net = CNN()
    ema = ema_pytorch.EMA(net, beta=0.99, update_after_step=0, update_every=1)
    net.train()
    with torch.no_grad():
        for x in _batches():
            net(x)
            ema.update()
    root = tmp_path_factory.mktemp("ema_pytorch")
    return {
        "ema": ema,
        "net": net,
        "alone": save_torch(ema.state_dict(), root / "ema.pt"),
        "trainer": save_torch({"model": net.state_dict(), "ema": ema.state_dict()}, root / "trainer.pt"),
        "root": root,
    }


def test_an_ema_pytorch_state_dict_is_read_as_its_two_models(ema_files):
    online, average = inspect(ema_files["alone"]).files
    assert (online.key, average.key) == ("online_model", "ema_model")
    assert [s.name for s in online.layers] == [s.name for s in average.layers] == BNS  # never one mixed entry
    assert online.averaging is None and average.is_ema
    assert average.averaging is not None and average.averaging.kind == "ema-pytorch EMA"
    assert "its step buffer counts 20 update() calls" in average.averaging.counter_meaning
    ema = ema_files["ema"]
    for summary, module in ((online, ema_files["net"]), (average, ema.ema_model)):
        for s in summary.layers:
            var = module.get_submodule(s.name).running_var
            assert s.var_max == pytest.approx(float(var.max()), rel=1e-6)
            assert s.num_batches_tracked == int(module.get_submodule(s.name).num_batches_tracked)
    (chosen,) = inspect(ema_files["alone"], key="ema_model").files
    assert chosen.is_ema and chosen.key == "ema_model"


def test_an_ema_pytorch_state_dict_inside_a_trainer_container(ema_files):
    report = inspect(ema_files["trainer"])
    assert [f.key for f in report.files] == ["model", "ema/online_model", "ema/ema_model"]
    assert [f.is_ema for f in report.files] == [False, False, True]
    assert report.summary()["files"] == 1 and report.summary()["state_dicts"] == 3


@pytest.mark.slow
def test_recalibrating_the_ema_model_writes_into_it_and_ema_pytorch_loads_it(ema_files):
    from bnaudit.runtime.data import DataOptions
    from bnaudit.runtime.models import ModelSpec
    from bnaudit.runtime.recalibrate.command import recalibrate_checkpoint

    root = ema_files["root"]
    (root / "arch.py").write_text(
        "import sys\n"
        f"sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
        "from test_ema_pytorch_and_peft import CNN\n"
        "def build():\n"
        "    return CNN()\n"
    )
    data = str(root / "data.safetensors")
    save_file({"inputs": torch.cat(_batches(8))}, data)
    out = str(root / "recalibrated.pt")
    spec = ModelSpec(ema_files["alone"], arch=f"{root / 'arch.py'}:build", key="ema_model")
    recalibrate_checkpoint(spec, out, DataOptions(path=data))
    before, after = torch.load(ema_files["alone"]), torch.load(out)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.startswith("ema_model.bn") for k in changed)
    reloaded = import_ema_pytorch().EMA(CNN(), beta=0.99, update_after_step=0, update_every=1)
    reloaded.load_state_dict(after)  # strict: the layout is ema-pytorch's own
    (_, average) = inspect(out).files
    assert average.averaging is not None and average.averaging.kind == "EMA copy recalibrated by bnaudit"


# ----------------------------------------------------------------------------- PEFT


def _peft_model(config_cls, **config):
    peft = import_peft()
    torch.manual_seed(0)
    base = CNN()
    base.name_or_path = "acme/tiny-cnn"  # what PeftModel records as base_model_name_or_path
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    model = peft.get_peft_model(base, getattr(peft, config_cls)(**config))
    model.train()
    with torch.no_grad():
        for x in _batches():
            model(x)
    return model, base_state


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    import_peft()
    from peft.tuners.lora.conversion import save_as_lora

    root = tmp_path_factory.mktemp("peft")
    made = {}
    with pytest.MonkeyPatch.context() as mp:
        # save_pretrained looks the base's config up on the hub by its name: nothing leaves this machine
        mp.setenv("HF_HUB_OFFLINE", "1")
        return _save_adapters(root, made, save_as_lora)


def _save_adapters(root, made, save_as_lora):
    for name, kwargs in (
        ("with", dict(r=2, target_modules=["conv1", "conv2"], modules_to_save=BNS)),
        ("without", dict(r=2, target_modules=["conv1", "conv2"])),
    ):
        model, base_state = _peft_model("LoraConfig", **kwargs)
        model.save_pretrained(str(root / name))
        made[name] = model
    # peft's own conversion of a LoHa adapter to LoRA keeps modules_to_save's parameters only
    model, base_state = _peft_model("LoHaConfig", r=2, target_modules=["fc"], modules_to_save=BNS)
    save_as_lora(str(root / "converted"), model, rank=2)
    made["converted"] = model
    base = save_torch(base_state, root / "base.pt")
    return {"root": root, "base": base, "models": made, "base_state": base_state}


def _trained_stats(model, bn: str) -> torch.Tensor:
    """The running_var training left in the PeftModel's copy of `bn` (modules_to_save) or in
    the base module itself."""
    module = model.base_model.model.get_submodule(bn)
    inner = getattr(module, "modules_to_save", None)
    return (inner["default"] if inner is not None else module).running_var


def test_an_adapter_is_audited_composed_with_its_base(adapters):
    root = adapters["root"]
    with safe_open(str(root / "with" / "adapter_model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "base_model.model.bn1.running_var" in names  # the premise: PEFT saved the statistics
    (file,) = inspect(str(root / "with"), base=adapters["base"]).files
    assert file.format == "peft" and file.error is None
    assert [s.name for s in file.layers] == BNS
    for s in file.layers:
        assert s.var_max == pytest.approx(float(_trained_stats(adapters["models"]["with"], s.name).max()), rel=1e-6)
    assert any("composed with its base" in n for n in file.notes)
    assert not [n for n in file.notes if "peft#1732" in n] and not [f for f in file.findings if f.code == "BN001"]


def test_statistics_outside_modules_to_save_are_the_bases_and_said_so(adapters):
    root = adapters["root"]
    (file,) = inspect(str(root / "without"), base=adapters["base"]).files
    assert any(
        n.startswith("2 BN layers outside the adapter's modules_to_save") and "peft#1732" in n for n in file.notes
    )
    trained = _trained_stats(adapters["models"]["without"], "bn1")
    base_var = adapters["base_state"]["bn1.running_var"]
    assert not torch.equal(trained, base_var)  # training moved them; the adapter does not hold them
    (s,) = [s for s in file.layers if s.name == "bn1"]
    assert s.var_max == pytest.approx(float(base_var.max()))
    assert [f.code for f in file.findings if f.layer == "bn1" and f.code == "BN002"] == ["BN002"]


def test_a_converted_adapter_without_the_statistics_of_its_modules_to_save_is_an_error(adapters, cli):
    path = str(adapters["root"] / "converted")
    config = json.loads((adapters["root"] / "converted" / "adapter_config.json").read_text())
    assert config["modules_to_save"] == BNS
    with safe_open(os.path.join(path, "adapter_model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "base_model.model.bn1.weight" in names and "base_model.model.bn1.running_var" not in names
    (file,) = inspect(path, base=adapters["base"]).files
    found = {f.layer: f for f in file.findings if f.code == "BN001"}
    assert set(found) == set(BNS) and {f.severity for f in found.values()} == {"error"}
    assert "holds no running_mean / running_var" in found["bn1"].message
    result = cli("inspect", path, "--base", adapters["base"], "-q")
    assert result.exit_code == 1 and "bn1: BN001 missing-buffers" in result.output


def test_the_base_is_found_in_the_hugging_face_cache(adapters, tmp_path, monkeypatch):
    repo = tmp_path / "hub" / "models--acme--tiny-cnn"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    save_file(adapters["base_state"], str(repo / "snapshots" / commit / "model.safetensors"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    folder = str(adapters["root"] / "without")
    assert (
        json.loads((adapters["root"] / "without" / "adapter_config.json").read_text())["base_model_name_or_path"]
        == "acme/tiny-cnn"
    )
    (file,) = inspect(folder).files
    assert [s.name for s in file.layers] == BNS
    assert any("composed with its base" in n and commit in n for n in file.notes)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    (alone,) = inspect(folder).files
    assert alone.layers == [] and any("read alone" in n and "acme/tiny-cnn" in n for n in alone.notes)


def test_a_scan_audits_an_adapter_folder_once(adapters):
    report = inspect(str(adapters["root"]), base=adapters["base"], config=Config())
    shown = [os.path.basename(f.path) for f in report.files]
    assert shown.count("with") == shown.count("converted") == shown.count("without") == 1
    assert "adapter_model.safetensors" not in shown

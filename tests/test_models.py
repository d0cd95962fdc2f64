"""Runnable models: every source (--arch module or file, TorchScript, pickled module),
strict key matching as findings, module-only rules, and the helpers that run a model."""

from __future__ import annotations

import json
import sys
import uuid

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from typer.testing import CliRunner

from bnaudit.api import inspect
from bnaudit.audit.checkpoint.inspect import audit_checkpoint
from bnaudit.cli import app
from bnaudit.config import Config
from bnaudit.errors import BnauditError
from bnaudit.runtime.models import ModelSpec, forward, load_runnable, output_tensor, resolve_device
from bnaudit.runtime.norms import batch_statistics

torch.set_num_threads(1)

NET_SOURCE = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, classes=3, width=4, eps=1e-5, momentum=0.1, track=True):
        super().__init__()
        self.conv = nn.Conv2d(1, width, 3, padding=1, bias=False)
        self.gate = nn.BatchNorm2d(width, eps=eps, momentum=momentum, track_running_stats=track)
        self.drop = nn.Dropout(0.5)
        self.fc = nn.Linear(width * 16, classes)

    def forward(self, x):
        return self.fc(self.drop(torch.relu(self.gate(self.conv(x)))).flatten(1))


def net(classes=3, width=4, eps=1e-5, momentum=0.1, track=True):
    return Net(classes, width, eps, momentum, track)


class Wrapper(nn.Module):
    """A wrapper whose own keys start with 'model.' (as Lightning modules' do)."""

    def __init__(self):
        super().__init__()
        self.model = Net()

    def forward(self, x):
        return self.model(x)


def needs_real_values():
    n = int(torch.ones(1).sum().item())  # fails on the meta device
    return Net(classes=n + 2)


def not_a_module():
    return {"weights": 1}


def broken():
    raise ValueError("no such variant")


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(2)

    def forward(self, a, b=None):
        return self.bn(a if b is None else a + b)
'''


@pytest.fixture
def pkg(tmp_path, monkeypatch):
    """A uniquely named package with the model code in a temporary current directory."""
    name = f"userpkg_{uuid.uuid4().hex[:8]}"
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text("")
    (tmp_path / name / "models.py").write_text(NET_SOURCE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    for mod in [m for m in sys.modules if m.startswith(name)]:
        del sys.modules[mod]


def _module(pkg: str):
    import importlib

    return importlib.import_module(f"{pkg}.models")


def _trained_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Non-trivial statistics: a few training-mode batches."""
    torch.manual_seed(0)
    model.train()
    with torch.no_grad():
        for _ in range(4):
            model(torch.randn(8, 1, 4, 4) * 2 + 1)
    model.eval()
    return {k: v.clone() for k, v in model.state_dict().items()}


def _codes(report) -> dict[str, list]:
    out: dict[str, list] = {}
    for f in report.findings:
        out.setdefault(f.code, []).append(f)
    return out


# ----------------------------------------------------------------------------- sources


def test_arch_module_callable_loads_the_state_dict(pkg, tmp_path):
    ref = _module(pkg).net()
    state = _trained_state(ref)
    save_file(state, tmp_path / "m.safetensors")
    runnable = load_runnable(ModelSpec(str(tmp_path / "m.safetensors"), arch=f"{pkg}.models:net"))
    assert runnable.source == "arch"
    for k, v in state.items():
        assert torch.equal(runnable.module.state_dict()[k], v), k
    x = torch.randn(5, 1, 4, 4)
    with torch.no_grad():
        assert torch.equal(runnable.module(x), ref(x))
    assert not runnable.module.training
    assert runnable.facts.missing == () and runnable.facts.unexpected == ()


def test_arch_file_path_with_kwargs_and_a_ddp_container(pkg, tmp_path):
    ref = _module(pkg).net(classes=5, width=2)
    state = _trained_state(ref)
    torch.save(
        {
            "state_dict": {f"module.{k}": v for k, v in state.items()},
            "epoch": 7,
            "optimizer": {"state": {}, "param_groups": []},
        },
        tmp_path / "ddp.pt",
    )
    runnable = load_runnable(
        ModelSpec(str(tmp_path / "ddp.pt"), arch=f"{pkg}/models.py:net", arch_kwargs='{"classes": 5, "width": 2}')
    )
    assert runnable.checkpoint.key == "state_dict" and runnable.checkpoint.prefix == "module."
    x = torch.randn(3, 1, 4, 4)
    with torch.no_grad():
        assert torch.equal(runnable.module(x), ref(x))


@pytest.mark.parametrize("outer", ["", "module."])
def test_model_whose_own_keys_start_with_model_gets_its_prefix_back(pkg, tmp_path, outer):
    ref = _module(pkg).Wrapper()
    state = _trained_state(ref)
    save_file({outer + k: v for k, v in state.items()}, tmp_path / "w.safetensors")
    runnable = load_runnable(ModelSpec(str(tmp_path / "w.safetensors"), arch=f"{pkg}.models:Wrapper"))
    assert runnable.facts.missing == () and runnable.facts.unexpected == ()
    assert runnable.checkpoint.prefix == outer
    assert torch.equal(runnable.module.state_dict()["model.gate.running_var"], state["model.gate.running_var"])


@pytest.mark.parametrize("outer", ["", "module."])
def test_arch_reads_a_safetensors_checkpoint_through_the_package(pkg, tmp_path, monkeypatch, outer):
    import bnaudit.runtime.safetensors_files as module

    ref = _module(pkg).Wrapper()
    state = _trained_state(ref)
    save_file({outer + k: v for k, v in state.items()}, tmp_path / "w.safetensors")
    read: list[str] = []
    real = module.safe_open

    class Handle:  # safe_open, recording the names of the tensors read through it
        def __init__(self, *args, **kwargs):
            self.handle = real(*args, **kwargs)

        def __enter__(self):
            self.file = self.handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

        def get_tensor(self, name):
            read.append(name)
            return self.file.get_tensor(name)

    monkeypatch.setattr(module, "safe_open", Handle)
    runnable = load_runnable(ModelSpec(str(tmp_path / "w.safetensors"), arch=f"{pkg}.models:Wrapper"))
    assert sorted(read) == sorted(outer + k for k in state)  # each by its stored name, once
    for k, v in state.items():
        assert torch.equal(runnable.module.state_dict()[k], v), k


def test_torchscript_runs_without_arch(pkg, tmp_path):
    ref = _module(pkg).net(momentum=None)
    _trained_state(ref)
    torch.jit.script(ref).save(str(tmp_path / "s.pt"))
    runnable = load_runnable(str(tmp_path / "s.pt"))
    assert runnable.source == "torchscript" and runnable.scripted
    x = torch.randn(4, 1, 4, 4)
    with torch.no_grad():
        assert torch.allclose(runnable.module(x), ref(x), atol=1e-6)
    assert runnable.facts.norms["gate"].momentum is None and runnable.facts.norms["gate"].momentum_known
    # inspect sees the module too: BN007 for the cumulative momentum
    report = inspect(str(tmp_path / "s.pt"))
    assert [f.layer for f in report.findings if f.code == "BN007"] == ["gate"]


def test_pickled_module_of_torch_nn_classes_loads_safely(tmp_path):
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2, eps=1e-3), nn.ReLU())
    _ = _trained_state(model)
    torch.save(model, tmp_path / "whole.pt")
    runnable = load_runnable(str(tmp_path / "whole.pt"))
    assert runnable.source == "pickle" and isinstance(runnable.module, nn.Sequential)
    x = torch.randn(2, 1, 4, 4)
    with torch.no_grad():
        assert torch.equal(runnable.module(x), model(x))
    assert runnable.facts.norms["1"].eps == 1e-3 and runnable.facts.batch_norms == {"1"}


def test_pickled_custom_module_is_refused_naming_the_class_unless_trusted(pkg, tmp_path):
    model = _module(pkg).net()
    torch.save(model, tmp_path / "custom.pt")
    with pytest.raises(BnauditError) as err:
        load_runnable(str(tmp_path / "custom.pt"))
    message = str(err.value)
    assert f"{pkg}.models.Net" in message
    assert "runs code" in message and "--trust-pickle" in message and "--arch" in message
    runnable = load_runnable(ModelSpec(str(tmp_path / "custom.pt"), trust_pickle=True))
    assert type(runnable.module).__name__ == "Net"


def test_state_dicts_without_arch_are_explained(tmp_path):
    state = nn.BatchNorm1d(2).state_dict()
    save_file(state, tmp_path / "s.safetensors")
    torch.save(state, tmp_path / "s.pt")
    with pytest.raises(BnauditError, match="not a model: pass --arch"):
        load_runnable(str(tmp_path / "s.safetensors"))
    with pytest.raises(BnauditError, match="holds a state dict, not a model: pass --arch"):
        load_runnable(str(tmp_path / "s.pt"))


# ----------------------------------------------------------------------------- key matching


def test_bn001_is_exact_with_the_model_whatever_the_layer_name(pkg, tmp_path):
    state = _trained_state(_module(pkg).net())
    for leaf in ("running_mean", "running_var", "num_batches_tracked"):
        del state[f"gate.{leaf}"]
    save_file(state, tmp_path / "nobuf.safetensors")
    # From the state dict alone 'gate' cannot be told from any other weight/bias pair.
    plain = inspect(str(tmp_path / "nobuf.safetensors"))
    assert "BN001" not in _codes(plain)
    exact = inspect(str(tmp_path / "nobuf.safetensors"), arch=f"{pkg}.models:net")
    bn001 = _codes(exact)["BN001"]
    assert [(f.layer, f.severity) for f in bn001] == [("gate", "error")]
    assert "running_mean or running_var" in bn001[0].message
    # the counter is not reported twice
    assert "BN011" not in _codes(exact) or all(
        "num_batches_tracked" not in f.message for f in _codes(exact)["BN011"] if f.severity == "error"
    )


def test_bn011_reports_missing_unexpected_and_counter_keys(pkg, tmp_path):
    state = _trained_state(_module(pkg).net())
    del state["fc.bias"]
    del state["gate.num_batches_tracked"]
    state["extra.weight"] = torch.ones(2)
    save_file(state, tmp_path / "odd.safetensors")
    runnable = load_runnable(ModelSpec(str(tmp_path / "odd.safetensors"), arch=f"{pkg}.models:net"))
    assert set(runnable.facts.missing) == {"fc.bias", "gate.num_batches_tracked"}
    assert runnable.facts.unexpected == ("extra.weight",)
    findings = audit_checkpoint(runnable.checkpoint, Config(), runnable.facts).findings
    bn011 = sorted((str(f.severity), f.message) for f in findings if f.code == "BN011")  # by name, not rank
    assert [s for s, _ in bn011] == ["error", "info", "warning"]
    assert "fc.bias" in bn011[0][1] and "gate" in bn011[1][1] and "extra.weight" in bn011[2][1]
    # the weights that were there are loaded
    assert torch.equal(runnable.module.state_dict()["fc.weight"], state["fc.weight"])


def test_shape_mismatch_refuses_to_run_but_inspect_reports_it(pkg, tmp_path):
    save_file(_trained_state(_module(pkg).net(classes=3)), tmp_path / "c3.safetensors")
    with pytest.raises(BnauditError, match=r"'fc.weight' has shape \[3, 64\] in the checkpoint but \[7, 64\]"):
        load_runnable(ModelSpec(str(tmp_path / "c3.safetensors"), arch=f"{pkg}.models:net", arch_kwargs={"classes": 7}))
    report = inspect(str(tmp_path / "c3.safetensors"), arch=f"{pkg}.models:net", arch_kwargs='{"classes": 7}')
    errors = [f for f in report.findings if f.code == "BN011" and f.severity == "error"]
    assert {f.layer for f in errors} == {"fc"}


def test_checkpoint_with_nothing_in_common_is_an_error(pkg, tmp_path):
    save_file({"encoder.w": torch.ones(3)}, tmp_path / "other.safetensors")
    with pytest.raises(BnauditError, match="none of its 1 keys"):
        load_runnable(ModelSpec(str(tmp_path / "other.safetensors"), arch=f"{pkg}.models:net"))


# ----------------------------------------------------------------------------- module-only rules


def test_bn006_bn007_and_real_eps(pkg, tmp_path):
    arch = f"{pkg}.models:net"
    cases = {
        "untracked": ({"track": False}, "BN006", "warning"),
        "cumulative": ({"momentum": None}, "BN007", "info"),
        "frozen": ({"momentum": 0.0}, "BN007", "info"),
        "keras": ({"momentum": 0.997}, "BN007", "warning"),
    }
    for name, (kwargs, code, severity) in cases.items():
        model = _module(pkg).net(**kwargs)
        save_file(_trained_state(model), tmp_path / f"{name}.safetensors")
        report = inspect(str(tmp_path / f"{name}.safetensors"), arch=arch, arch_kwargs=json.dumps(kwargs))
        found = [(f.code, f.severity, f.layer) for f in report.findings if f.code in ("BN006", "BN007")]
        assert found == [(code, severity, "gate")], name
        # without the module none of this can be known
        assert not [f for f in inspect(str(tmp_path / f"{name}.safetensors")).findings if f.code in ("BN006", "BN007")]
    save_file(_trained_state(_module(pkg).net(eps=1e-3)), tmp_path / "eps.safetensors")
    result = CliRunner().invoke(
        app,
        [
            "inspect",
            str(tmp_path / "eps.safetensors"),
            "--arch",
            arch,
            "--arch-kwargs",
            '{"eps": 0.001}',
            "--format",
            "json",
        ],
    )
    doc = json.loads(result.stdout)
    assert doc["files"][0]["layers"][0]["eps"] == 1e-3
    assert doc["files"][0]["settings"] is None  # nothing assumed any more


def test_inspect_arch_builds_constructors_that_fail_on_meta(pkg, tmp_path):
    save_file(_trained_state(_module(pkg).net()), tmp_path / "m.safetensors")
    report = inspect(str(tmp_path / "m.safetensors"), arch=f"{pkg}.models:needs_real_values")
    assert report.files[0].error is None and [layer.name for layer in report.files[0].layers] == ["gate"]


@pytest.mark.parametrize(
    "arch, kwargs, fragment",
    [
        ("nocolon", None, "must be MODULE:CALLABLE"),
        ("no_such_module_xyz:net", None, "no module named 'no_such_module_xyz'"),
        ("{pkg}.models:missing", None, "has no attribute 'missing'"),
        ("{pkg}.models:not_a_module", None, "returned dict, not a torch.nn.Module"),
        ("{pkg}.models:broken", None, "ValueError: no such variant"),
        ("{pkg}.models:net", "{bad json", "--arch-kwargs is not valid JSON"),
        ("{pkg}.models:net", "[1, 2]", "must be a JSON object"),
        ("{pkg}.models:net", '{"nope": 1}', "unexpected keyword argument 'nope'"),
        ("missing_dir/file.py:net", None, "no such file"),
    ],
)
def test_arch_errors_are_one_line(pkg, tmp_path, arch, kwargs, fragment):
    save_file(_trained_state(_module(pkg).net()), tmp_path / "m.safetensors")
    args = ["inspect", str(tmp_path / "m.safetensors"), "--arch", arch.format(pkg=pkg)]
    if kwargs is not None:
        args += ["--arch-kwargs", kwargs]
    result = CliRunner().invoke(app, args + ["--format", "json"])
    assert result.exit_code == 2, result.output
    assert fragment in json.loads(result.stdout)["error"]
    assert result.stderr == ""  # said once: in the document
    table = CliRunner().invoke(app, args)
    lines = table.stderr.strip().splitlines()
    assert table.stdout == "" and len(lines) == 1 and lines[0].startswith("bnaudit: error:") and fragment in lines[0]


# ----------------------------------------------------------------------------- running


def test_batch_statistics_restores_buffers_and_modes(pkg):
    model = _module(pkg).net()
    _trained_state(model)
    model.train()
    model.drop.eval()  # a mixed starting state must come back as it was
    before_modes = {n: m.training for n, m in model.named_modules()}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(6, 1, 4, 4) * 3 + 2
    with batch_statistics(model) as norms:
        assert list(norms) == ["gate"]
        assert model.gate.training and not model.drop.training and not model.training
        with torch.no_grad():
            out = model(x)
        assert model.gate.num_batches_tracked.item() == before["gate.num_batches_tracked"].item() + 1
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert {n: m.training for n, m in model.named_modules()} == before_modes
    # the output is the batch-normalised one, with Dropout off (computed by hand here)
    h = model.conv(x)
    mu = h.mean(dim=(0, 2, 3), keepdim=True)
    var = h.var(dim=(0, 2, 3), unbiased=False, keepdim=True)
    normed = (h - mu) / torch.sqrt(var + model.gate.eps) * model.gate.weight.view(1, -1, 1, 1) + model.gate.bias.view(
        1, -1, 1, 1
    )
    expected = model.fc(torch.relu(normed).flatten(1))
    assert torch.allclose(out, expected, atol=1e-5)
    # restored on error as well
    with pytest.raises(RuntimeError), batch_statistics(model):
        model(torch.randn(2, 5, 4, 4))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_forward_handles_tensors_tuples_dicts_and_a_function(pkg):
    pair = _module(pkg).Pair().eval()
    a, b = torch.randn(3, 2), torch.randn(3, 2)
    with torch.no_grad():
        assert torch.equal(forward(pair, a), pair(a))
        assert torch.equal(forward(pair, (a, b)), pair(a, b))
        assert torch.equal(forward(pair, {"a": a, "b": b}), pair(a, b))
        assert torch.equal(forward(pair, {"x": a}, lambda m, batch: m(batch["x"] * 2)), pair(a * 2))


def test_output_tensor_finds_the_logits():
    logits = torch.randn(2, 3)

    class Out:
        def __init__(self):
            self.logits = logits

    assert output_tensor(logits) is logits
    assert output_tensor((logits, torch.zeros(1))) is logits
    assert output_tensor({"aux": torch.zeros(1), "logits": logits}) is logits
    assert output_tensor(Out()) is logits
    with pytest.raises(BnauditError, match="--forward"):
        output_tensor("text")


def test_resolve_device():
    assert resolve_device("cpu").type == "cpu"
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(BnauditError, match="--device must be"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(BnauditError, match="no CUDA device"):
            resolve_device("cuda")

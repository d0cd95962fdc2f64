"""Pickled objects outside the state dict (issue #12): inert stand-ins, never imported or called.

The Lightning-style files pickle classes from a module the test writes, imports and then
deletes, as a user's project would be absent where the checkpoint is audited.
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
import sys
import tracemalloc
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import REPO, train_classifier
from typer.testing import CliRunner

from bnaudit.api import inspect
from bnaudit.cli import app
from bnaudit.errors import BnauditError
from bnaudit.formats.read import read_checkpoint

PROJECT_SOURCE = """
import dataclasses, os


@dataclasses.dataclass
class HParams:
    lr: float = 0.03
    depth: int = 2
    tags: tuple = ("bn", "audit")


class RunArgs:  # an argparse-free args object of the user's own
    def __init__(self):
        self.epochs = 5
        self.name = "run-1"

    def __setstate__(self, state):  # would leave a trace if bnaudit ever ran it
        open(os.environ["STANDIN_MARKER"], "w").write("setstate ran")
        self.__dict__.update(state)


class Extra:
    pass
"""


def cli(*args: str):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})


def one_error_line(result, path: str) -> str:
    assert result.exit_code == 2, (result.exit_code, result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"bnaudit: error: {path}: ")
    assert "Traceback" not in result.stdout + result.stderr
    return lines[0]


@pytest.fixture
def project(tmp_path, monkeypatch):
    """Imports a throw-away `standin_project` module, yields it, then deletes its file."""
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "standin_project.py").write_text(PROJECT_SOURCE)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv("STANDIN_MARKER", str(tmp_path / "marker"))
    importlib.invalidate_caches()
    module = importlib.import_module("standin_project")
    yield module
    sys.modules.pop("standin_project", None)


def trained_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    x = torch.randn(256, 4)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    train_classifier(model, x, y, steps=20)
    return model.state_dict()


def forget(project, tmp_path: Path) -> None:
    """The user's module is gone: neither importable nor imported."""
    (tmp_path / "project" / "standin_project.py").unlink()
    sys.modules.pop("standin_project", None)
    importlib.invalidate_caches()


def lightning_file(project, tmp_path: Path, legacy: bool = False) -> tuple[Path, dict[str, torch.Tensor]]:
    state = trained_state()
    path = tmp_path / "epoch=3-step=500.ckpt"
    torch.save(
        {
            "epoch": 3,
            "global_step": 500,
            "state_dict": {f"model.{k}": v for k, v in state.items()},
            "hyper_parameters": {"cfg": project.HParams(), "batch_size": 32},
            "args": project.RunArgs(),
            "optimizer_states": [],
        },
        path,
        _use_new_zipfile_serialization=not legacy,
    )
    return path, state


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_lightning_checkpoint_with_user_classes_is_audited_as_its_plain_state_dict(project, tmp_path, legacy):
    path, state = lightning_file(project, tmp_path, legacy)
    plain = tmp_path / "plain.pt"
    torch.save(state, plain)
    forget(project, tmp_path)

    report = inspect([str(path), str(plain)])
    file, reference = report.files
    assert file.error is None, file.error
    assert (file.format, file.key, file.prefix) == ("torch-legacy" if legacy else "torch-zip", "state_dict", "model.")
    assert file.not_loaded == [
        "hyper_parameters/cfg holds standin_project.HParams: not loaded",
        "args holds standin_project.RunArgs: not loaded",
    ]
    # the same layers, statistics and findings as the plain state dict of the same model
    assert file.layers == reference.layers
    assert [(f.code, f.layer, f.message) for f in file.findings] == [
        (f.code, f.layer, f.message) for f in reference.findings
    ]
    assert [layer.name for layer in file.layers] == ["1"]
    assert not (tmp_path / "marker").exists()  # RunArgs.__setstate__ never ran
    assert "standin_project" not in sys.modules

    ckpt = read_checkpoint(str(path))
    assert ckpt.tensors["1.running_var"].read() == pytest.approx(state["1.running_var"].tolist(), abs=0)
    assert ckpt.tensors["1.num_batches_tracked"].read() == [20]


def test_stand_in_notes_reach_table_and_json(project, tmp_path):
    path, _ = lightning_file(project, tmp_path)
    forget(project, tmp_path)
    table = cli("inspect", str(path))
    assert table.exit_code in (0, 1), table.stderr
    assert "  hyper_parameters/cfg holds standin_project.HParams: not loaded" in table.stdout
    assert "  args holds standin_project.RunArgs: not loaded" in table.stdout
    doc = json.loads(cli("inspect", "--format", "json", str(path)).stdout)
    assert doc["files"][0]["not_loaded"] == [
        "hyper_parameters/cfg holds standin_project.HParams: not loaded",
        "args holds standin_project.RunArgs: not loaded",
    ]


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_user_class_inside_the_state_dict_is_refused_naming_it(project, tmp_path, legacy):
    state = trained_state()
    state["extra_state"] = project.Extra()
    path = tmp_path / "inside.ckpt"
    torch.save(
        {"state_dict": state, "hyper_parameters": project.HParams()}, path, _use_new_zipfile_serialization=not legacy
    )
    forget(project, tmp_path)
    line = one_error_line(cli("inspect", str(path)), str(path))
    assert "standin_project.Extra" in line and "'state_dict/extra_state'" in line
    assert "--trust-pickle" in line and "refused" in line


def test_user_class_in_the_state_dicts_metadata_is_refused(project, tmp_path):
    state = trained_state()
    state._metadata[""]["note"] = project.Extra()
    path = tmp_path / "meta.pt"
    torch.save(state, path)
    forget(project, tmp_path)
    line = one_error_line(cli("inspect", str(path)), str(path))
    assert "standin_project.Extra" in line


def test_whole_pickled_user_model_is_refused_naming_its_class(tmp_path, monkeypatch):
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "usermodel.py").write_text(
        "import torch\nclass Net(torch.nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.bn = torch.nn.BatchNorm1d(2)\n"
    )
    monkeypatch.syspath_prepend(str(folder))
    module = importlib.import_module("usermodel")
    path = tmp_path / "whole.pt"
    torch.save({"model": module.Net()}, path)
    sys.modules.pop("usermodel")
    (folder / "usermodel.py").unlink()
    line = one_error_line(cli("inspect", str(path)), str(path))
    assert "usermodel.Net" in line and "--trust-pickle" in line


class Payload:
    def __init__(self, marker: Path) -> None:
        self.command = f"touch {marker}"

    def __reduce__(self):
        return (os.system, (self.command,))


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_payload_inside_a_stand_ins_state_still_runs_nothing(project, tmp_path, legacy):
    marker = tmp_path / "payload-ran"
    args = project.RunArgs()
    args.hook = Payload(marker)  # pickled as REDUCE posix.system inside the stand-in's BUILD state
    path = tmp_path / "evil.ckpt"
    torch.save({"state_dict": trained_state(), "args": args}, path, _use_new_zipfile_serialization=not legacy)
    forget(project, tmp_path)
    line = one_error_line(cli("inspect", str(path)), str(path))
    assert f"{os.system.__module__}.system" in line and "refused" in line
    assert not marker.exists()
    assert not (tmp_path / "marker").exists()


def handmade_archive(tmp_path: Path, pickle_bytes: bytes) -> Path:
    """A torch.save zip whose data.pkl is `pickle_bytes` (and a real BN state dict's
    storages, so the archive is otherwise well formed)."""
    src = tmp_path / "src.pt"
    torch.save(trained_state(), src)
    path = tmp_path / "handmade.pt"
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(path, "w") as zout:
        for name in zin.namelist():
            data = pickle_bytes if name.endswith("/data.pkl") else zin.read(name)
            zout.writestr(name, data)
    return path


def _global(module: str, name: str) -> bytes:
    return pickle.GLOBAL + f"{module}\n{name}\n".encode()


@pytest.mark.parametrize(
    "body",
    [
        # BUILD on the stand-in class itself: would set attributes of an imported class
        _global("standin_project", "Extra") + pickle.EMPTY_DICT + pickle.BUILD,
        # NEWOBJ on an instance of a stand-in: no class to construct
        _global("standin_project", "Extra") + pickle.EMPTY_TUPLE + pickle.NEWOBJ + pickle.EMPTY_TUPLE + pickle.NEWOBJ,
        # REDUCE on a stand-in: a call
        _global("standin_project", "Extra") + pickle.EMPTY_TUPLE + pickle.REDUCE,
        # builtins.eval through REDUCE
        _global("builtins", "eval") + pickle.MARK + pickle.BINUNICODE + (4).to_bytes(4, "little") + b"1+1"
        b" " + pickle.TUPLE + pickle.REDUCE,
    ],
    ids=["build-on-class", "newobj-on-instance", "reduce", "eval"],
)
def test_a_stand_in_that_the_pickle_tries_to_call_is_an_error_not_a_call(tmp_path, body):
    data = pickle.PROTO + b"\x02" + pickle.EMPTY_DICT + pickle.BINUNICODE + (1).to_bytes(4, "little") + b"x"
    data += body + pickle.SETITEM + pickle.STOP
    path = handmade_archive(tmp_path, data)
    with pytest.raises(BnauditError, match="refused to unpickle") as err:
        read_checkpoint(str(path))
    assert "standin_project" not in sys.modules
    assert ("Extra" in str(err.value)) or ("builtins.eval" in str(err.value))


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_only_bn_tensors_are_read_from_a_file_with_stand_ins(project, tmp_path, legacy):
    state = trained_state()
    state["0.weight"] = torch.randn(4096, 1024)  # 16 MiB that inspect has no reason to read
    path = tmp_path / "big.ckpt"
    torch.save(
        {"state_dict": state, "hyper_parameters": project.HParams()}, path, _use_new_zipfile_serialization=not legacy
    )
    forget(project, tmp_path)
    tracemalloc.start()
    try:
        report = inspect(str(path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert report.files[0].error is None and report.files[0].not_loaded
    assert peak < 4 << 20, peak


def test_trust_pickle_imports_the_users_classes_from_the_working_directory(project, tmp_path, monkeypatch):
    path, _ = lightning_file(project, tmp_path)
    sys.modules.pop("standin_project", None)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path / "project")])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    line = one_error_line(cli("inspect", "--trust-pickle", str(path)), str(path))
    assert "'standin_project'" in line and "PYTHONPATH" in line

    monkeypatch.chdir(tmp_path / "project")
    result = cli("inspect", "--trust-pickle", str(path))
    assert result.exit_code in (0, 1), result.stderr
    assert "not loaded" not in result.stdout  # trusted: everything was loaded
    sys.modules.pop("standin_project", None)


def test_recalibrate_refuses_before_any_work_to_write_back_objects_it_never_loaded(project, tmp_path, monkeypatch):
    import bnaudit.runtime.recalibrate.command as command

    state = torch.load(Path(REPO) / "sample_models" / "immature.pt", weights_only=True)
    path = tmp_path / "last.ckpt"
    torch.save({"state_dict": {f"model.{k}": v for k, v in state.items()}, "hyper_parameters": project.HParams()}, path)
    forget(project, tmp_path)
    monkeypatch.setattr(command, "make_loader", lambda *a, **k: pytest.fail("calibration data was opened"))
    out = tmp_path / "out.ckpt"
    result = cli(
        "recalibrate",
        str(path),
        "--arch",
        f"{REPO}/sample_models/digits_net.py:digits_net",
        "--data",
        f"{REPO}/sample_models/data/digits_calib.safetensors",
        "-o",
        str(out),
    )
    line = one_error_line(result, str(path))
    assert "hyper_parameters holds standin_project.HParams: not loaded" in line and "--trust-pickle" in line
    assert not out.exists()


def test_the_committed_lightning_sample_audits_with_its_project_classes_left_unloaded():
    """sample_models/lightning/last.ckpt pickles classes of a `myproject` package that
    does not exist here: the state dict is audited (prefix stripped) and the two objects
    are named as not loaded, without importing anything."""
    assert importlib.util.find_spec("myproject") is None
    report = inspect(os.path.join(REPO, "sample_models", "lightning", "last.ckpt"))
    (file,) = report.files
    assert file.error is None and file.key == "state_dict" and file.prefix == "model."
    assert [s.name for s in file.layers] == ["features.1", "features.4", "head.2"]
    assert file.findings == []
    assert file.not_loaded == [
        "hyper_parameters/config holds myproject.config.TrainConfig: not loaded",
        "args holds myproject.config.RunArgs: not loaded",
    ]
    assert "myproject" not in sys.modules and "myproject.config" not in sys.modules

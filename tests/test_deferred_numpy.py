"""numpy is never imported to audit: the restricted unpickler records numpy's plain-data
globals as calls (formats/pickled.NumpyCall) and decodes a numpy scalar's number from its
bytes where a value is read (a module's eps); only a writer rebuilds them with numpy. A
file without a state dict (a Trainer's rng_state.pth holds numpy's RNG state) is told apart
by its keys and name. The report must be the one a process that had numpy already
imported gives.

The test process has imported numpy, so each side runs in a fresh interpreter."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch
from conftest import run_python
from safetensors.torch import save_file
from torch import nn

_REPORT = """
import io, json, sys
if sys.argv[2] == "numpy first":
    import numpy
from bnaudit.api import inspect
from bnaudit.output import emit
text = io.StringIO()
emit(inspect(sys.argv[1], jobs=1), "json", text)
print(json.dumps({"report": json.loads(text.getvalue()), "numpy": "numpy" in sys.modules}))
"""


def _report(folder, mode: str) -> dict:
    done = run_python(_REPORT, str(folder), mode)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


class _CallsNumpyLoad:
    """Pickles as a call of numpy.load, a numpy global that is not plain data."""

    def __reduce__(self):
        return (np.load, ("/nonexistent.npy",))


def _trainer_folder(path) -> None:
    """What transformers' Trainer leaves in checkpoint-N/, the state files as it saves them."""
    path.mkdir()
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    model(torch.randn(8, 3, 8, 8))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path / "model.safetensors")
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    torch.save(rng, path / "rng_state.pth")
    torch.save(rng, path / "rng_state_1.pth", _use_new_zipfile_serialization=False)  # the legacy format
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(8, 3, 8, 8)).sum().backward()
    optimizer.step()
    torch.save(optimizer.state_dict(), path / "optimizer.pt")


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_a_trainer_folder_is_audited_without_numpy_and_reports_the_same(tmp_path, legacy):
    folder = tmp_path / "checkpoint-500"
    _trainer_folder(folder)
    if legacy:
        (folder / "rng_state.pth").unlink()
    deferred, first = _report(folder, "as needed"), _report(folder, "numpy first")
    assert deferred["report"] == first["report"]
    assert deferred["numpy"] is False and first["numpy"] is True
    skipped = {os.path.basename(f["path"]): f.get("skipped") for f in deferred["report"]["files"]}
    assert skipped["rng_state_1.pth"] == "RNG state (cpu, numpy, python)"
    assert skipped["optimizer.pt"] == "optimizer state (state, param_groups)"


def test_a_model_holding_numpy_values_is_audited_without_numpy_and_reports_the_same(tmp_path):
    """A timm-style checkpoint: a state dict beside numpy scalars and an array in its metadata
    (read once: numpy's values are recorded, never rebuilt, for an audit)."""
    folder = tmp_path / "run"
    folder.mkdir()
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    model(torch.randn(8, 3, 8, 8))
    checkpoint = {
        "state_dict": model.state_dict(),
        "metric": np.float64(0.75),
        "epoch": np.int64(3),
        "history": np.arange(4.0),
    }
    torch.save(checkpoint, folder / "model_best.pth.tar")
    deferred, first = _report(folder, "as needed"), _report(folder, "numpy first")
    assert deferred["report"] == first["report"]
    assert deferred["numpy"] is False
    assert [f["format"] for f in deferred["report"]["files"]] == ["torch-zip"]


@pytest.mark.parametrize("name", ["rng_state.pth", "stuff.pt"])
def test_a_numpy_global_that_is_not_data_is_refused_as_before(tmp_path, name):
    """numpy.load is no plain data: deferring numpy must not turn its call into a skipped
    file. Named like a Trainer's file it is skipped by its name, as before; named otherwise,
    with RNG-like keys, it stays refused (recorded as data, its keys would say RNG state)."""
    folder = tmp_path / "checkpoint-1"
    folder.mkdir()
    state = {"python": random.getstate(), "numpy": _CallsNumpyLoad(), "cpu": np.zeros(2)}
    torch.save(state, folder / name)
    deferred, first = _report(folder, "as needed"), _report(folder, "numpy first")
    assert deferred["report"] == first["report"]
    (only,) = deferred["report"]["files"]
    if name == "stuff.pt":
        assert "numpy.load" in only["error"] and only.get("skipped") is None
    else:
        assert only["skipped"] == "RNG state (pickled numpy.load, not loaded)"

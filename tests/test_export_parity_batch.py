"""The ONNX output comparison at the export's own batch dimension: a fixed-batch-2 export
and a dynamic one give the same agreement and largest deviation as running every sample
alone, while the torch model runs each data batch once (not once per 2 samples) and
onnxruntime is called once per sub-batch of the export's size."""

from __future__ import annotations

import contextlib
import io
import math
import os
import sys
import warnings

import pytest
import torch
from conftest import SAMPLES, save_safetensors, train_classifier
from safetensors.torch import load_file

from bnaudit.runtime.deviation import relative_deviations
from bnaudit.runtime.parity.onnx import measure_output_parity, open_session
from bnaudit.runtime.sources import DataOptions

ort = pytest.importorskip("onnxruntime")
sys.path.insert(0, SAMPLES)
from digits_net import digits_net  # noqa: E402

SAMPLES_N = 95  # odd: the last sub-batch of 2 of each data batch needs one padding sample
BATCH = 32  # data batches of 32, 32, 31


@pytest.fixture(scope="module")
def model():
    data = load_file(os.path.join(SAMPLES, "data", "digits_calib.safetensors"))
    torch.manual_seed(0)
    return train_classifier(digits_net(), data["inputs"], data["labels"], steps=30).eval()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    data = load_file(os.path.join(SAMPLES, "data", "digits_val.safetensors"))
    path = tmp_path_factory.mktemp("data") / "val.safetensors"
    return save_safetensors({"inputs": data["inputs"][:SAMPLES_N], "labels": data["labels"][:SAMPLES_N]}, path)


@pytest.fixture(scope="module")
def exports(tmp_path_factory, model):
    folder = tmp_path_factory.mktemp("exports")
    paths = {}
    for kind, axes in (("fixed", None), ("dynamic", {"x": {0: "n"}})):
        paths[kind] = str(folder / f"{kind}.onnx")
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            torch.onnx.export(
                model, (torch.zeros(2, 1, 8, 8),), paths[kind], dynamo=False, input_names=["x"], dynamic_axes=axes
            )
    return paths


def per_sample(model, path: str, x: torch.Tensor) -> tuple[float, float]:
    """Agreement and largest relative deviation with every sample run alone: torch on a
    batch of one, onnxruntime on a batch of one (dynamic) or of the sample twice (fixed 2)."""
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    fixed = session.get_inputs()[0].shape[0] == 2
    agree, worst = 0, 0.0
    with torch.no_grad():
        for i in range(len(x)):
            xi = x[i : i + 1]
            feed = torch.cat([xi, xi]) if fixed else xi
            y_onnx = torch.from_numpy(session.run(None, {"x": feed.numpy()})[0][:1])
            y_torch = model(xi)
            agree += int(y_onnx.argmax(1) == y_torch.argmax(1))
            worst = max(worst, float(relative_deviations(y_onnx, y_torch).max()))
    return agree / len(x), worst


class Counting:
    """Counts calls of a session's run (the rest as the session)."""

    def __init__(self, session):
        self.session, self.calls = session, 0

    def get_inputs(self):
        return self.session.get_inputs()

    def run(self, *args, **kwargs):
        self.calls += 1
        return self.session.run(*args, **kwargs)


@pytest.mark.parametrize("kind", ["fixed", "dynamic"])
def test_same_result_as_every_sample_alone(model, data, exports, kind):
    result = measure_output_parity(
        open_session(exports[kind]), model, DataOptions(path=data, batch_size=BATCH, shuffle=False)
    )
    x = load_file(data)["inputs"].float()
    agreement, worst = per_sample(model, exports[kind], x)
    assert result.samples == SAMPLES_N and result.batches == 3
    assert result.agreement == agreement
    # the same samples through the same kernels up to the batch they ran in: float32 rounding apart
    assert math.isclose(result.max_deviation, worst, rel_tol=0.5, abs_tol=1e-6)
    assert result.max_deviation <= result.floor
    assert result.batch_size == (2 if kind == "fixed" else None)
    assert result.padded == (1 if kind == "fixed" else 0)  # 32, 32, 31: one padding sample, in the last batch


@pytest.mark.parametrize("kind, runs", [("fixed", 16 + 16 + 16), ("dynamic", 3)])
def test_each_batch_runs_once_in_torch_and_at_the_exports_size_in_onnxruntime(model, data, exports, kind, runs):
    forwards = []
    # the float64 copy is a deep copy, hook included: only the float32 model's calls counted
    hook = lambda module, args, out: forwards.append(len(args[0])) if args[0].dtype == torch.float32 else None  # noqa: E731
    handle = model.register_forward_hook(hook)
    session = Counting(open_session(exports[kind]))
    try:
        measure_output_parity(session, model, DataOptions(path=data, batch_size=BATCH, shuffle=False))
    finally:
        handle.remove()
    assert forwards == [32, 32, 31]  # once per data batch, not once per 2 samples
    assert session.calls == runs

"""`bnaudit parity`: an injected fault in exactly one mid layer of a deployed target is found
at that layer, with every earlier layer within its noise floor, and healthy targets report
no divergence; for each target kind (torch.compile with a backend, ONNX in onnxruntime, a
.pt2 program, TorchScript).

Known truth: each fault changes one layer, chosen by the test; which layer a fault in the
k-th batch-norm call of a graph hits is found independently of bnaudit (forward hooks on the
eager model: the k-th BN module called). The models: torchvision's resnet18 layout, narrow
(tests/parity_models.py, 20 BN layers, statistics of its own activations), and the sample
digits CNN (3 BN layers)."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import os
import sys
import warnings

import jsonschema
import pytest
import torch
from conftest import REPO, SAMPLES, save_safetensors
from parity_models import resnet18, shared_bn, trained_looking

from bnaudit.audit.parity import implied_eps
from bnaudit.audit.statistics import PARITY_FACTOR, TINY, noise_floor
from bnaudit.runtime.models import ModelSpec
from bnaudit.runtime.parity.accumulate import LayerDeviation
from bnaudit.runtime.parity.measure import measure_parity
from bnaudit.runtime.sources import DataOptions

sys.path.insert(0, SAMPLES)  # digits_net, the samples' architecture
MODELS = os.path.join(REPO, "tests", "parity_models.py")
RESNET = f"{MODELS}:resnet18"
DIGITS = os.path.join(SAMPLES, "digits_net.py") + ":digits_net"
HEALTHY = os.path.join(SAMPLES, "healthy.pt")
VAL = os.path.join(SAMPLES, "data", "digits_val.safetensors")


@pytest.fixture(scope="module")
def resnet(tmp_path_factory):
    """The resnet's checkpoint and 64 inputs (two batches of 32)."""
    folder = tmp_path_factory.mktemp("resnet")
    model = trained_looking(resnet18())
    torch.save(model.state_dict(), folder / "model.pt")
    g = torch.Generator().manual_seed(3)
    data = save_safetensors({"inputs": torch.randn(64, 3, 32, 32, generator=g)}, folder / "data.safetensors")
    return {"folder": folder, "model": model, "checkpoint": str(folder / "model.pt"), "data": data}


def call_order(model, x) -> list[str]:
    """The BN modules of `model` in the order a forward calls them (forward hooks: the
    independent truth of which layer the k-th batch-norm call is)."""
    order: list[str] = []
    handles = [
        m.register_forward_hook(lambda _m, _i, _o, name=name: order.append(name))
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.BatchNorm2d)
    ]
    with torch.no_grad():
        model(x)
    for h in handles:
        h.remove()
    return order


def run(resnet, against: str, **kw):
    spec = ModelSpec(resnet["checkpoint"], arch=RESNET)
    return measure_parity(spec, against, DataOptions(path=resnet["data"], batch_size=32, **kw))


def assert_localised(report, layer: str):
    """`layer` is the first divergent one and every layer before it is within its floor."""
    names = [entry.name for entry in report.layers]
    first = report.first_divergent
    assert first is not None and first.name == layer, (first and first.name, layer)
    for entry in report.layers[: names.index(layer)]:
        assert not entry.diverges and entry.relative <= PARITY_FACTOR * entry.floor, entry
    assert first.ratio > PARITY_FACTOR
    assert report.exit_code() == 1


def assert_healthy(report):
    assert report.first_divergent is None, [(e.name, e.ratio) for e in report.layers if e.diverges]
    assert not report.outputs.deviates and report.outputs.top1_agreement == 1.0
    assert not report.unseen and report.exit_code() == 0
    assert all(e.ratio <= PARITY_FACTOR for e in report.layers)


def backend_file(folder, text: str) -> str:
    """A FILE.py holding `text`, under a name of its own (a file is imported once per path)."""
    path = folder / f"backend_{abs(hash(text)):x}.py"
    path.write_text(f"import sys\nsys.path.insert(0, {os.path.dirname(MODELS)!r})\nimport parity_models\n{text}\n")
    return str(path)


# ----------------------------------------------------------------------------- the numbers


def test_layer_statistics_are_the_definitions():
    # channel 0 changed by 3 in a value of 12, channel 1 unchanged; float64 eager 1e-6 off
    r = torch.tensor([[[1.0, -12.0], [2.0, 4.0]]]).reshape(1, 2, 2)
    y = r.clone()
    y[0, 0, 1] = -9.0
    acc = LayerDeviation()
    acc.update(y, r, r.double() + 1e-6)
    acc.update(r, r, None)  # a batch without a float64 pass: no rounding measured, none lost
    numbers = acc.numbers()
    assert numbers.change.tolist() == [3.0, 0.0]
    assert numbers.channel_deviation.tolist() == [3.0 / 12.0, 0.0]
    assert numbers.relative == 0.25
    assert numbers.rounding_relative == pytest.approx(max(1e-6 / 12.0, 1e-6 / 4.0), rel=1e-6)
    assert noise_floor(numbers.rounding_relative) == 1e-6


def test_a_fit_reads_a_scale_and_a_shift():
    g = torch.Generator().manual_seed(0)
    r = torch.randn(64, 3, 5, generator=g)
    y = r.clone()
    y[:, 1] = 0.5 * r[:, 1] + 0.25  # channel 1: scale 0.5, shift 0.25
    acc = LayerDeviation()
    acc.update(y, r, r.double())
    (fit,) = acc.numbers().fits
    assert fit.channel == 1 and fit.scale == pytest.approx(0.5) and fit.shift == pytest.approx(0.25)
    assert fit.unexplained < 1e-6


def test_an_eps_is_named_only_when_one_explains_every_channel():
    var = [0.001, 0.01, 0.5]
    scales = [(math.sqrt((v + 1e-5) / (v + 1e-3)), v) for v in var]
    assert implied_eps(scales, 1e-5) == pytest.approx(1e-3)
    assert implied_eps([(0.5, 1.0), (0.9, 1.0)], 1e-5) is None  # two channels, two different eps
    assert implied_eps([(1.0, 1.0)], 1e-5) is None  # no change: no other eps


def test_the_noise_floor_is_a_power_of_ten_and_the_factor_ten():
    assert noise_floor(4.97e-07) == noise_floor(5.26e-07) == 1e-06
    assert noise_floor(0.0) == 1e-07 and math.isnan(noise_floor(math.nan))
    assert PARITY_FACTOR == 10 and TINY > 0


# ----------------------------------------------------------------------------- torch.compile


def test_an_eps_changed_by_the_backend_is_found_at_its_layer(resnet):
    k = 9
    x = torch.randn(2, 3, 32, 32)
    layer = call_order(resnet["model"], x)[k]
    backend = backend_file(resnet["folder"], f"backend = parity_models.eps_backend({k})")
    report = run(resnet, f"compile:{backend}:backend")
    assert_localised(report, layer)
    first = report.first_divergent
    assert "eps 0.01 in the compiled graph, 1e-05 in the model" in first.evidence.static
    # the outputs alone say the same: one eps explains every channel's scale
    assert first.evidence.implied_eps == pytest.approx(0.01, rel=1e-3)
    assert [f.code for f in report.findings] == ["BN401", "BN402"]


def test_a_one_percent_change_of_one_layer_exceeds_the_threshold(resnet):
    k = 4
    layer = call_order(resnet["model"], torch.randn(2, 3, 32, 32))[k]
    backend = backend_file(resnet["folder"], f"backend = parity_models.scale_backend({k}, 1.01)")
    report = run(resnet, f"compile:{backend}:backend")
    assert_localised(report, layer)
    first = report.first_divergent
    assert first.relative == pytest.approx(0.01, rel=1e-3)
    assert first.ratio >= 100 * PARITY_FACTOR  # far above the threshold, not near it
    assert all(f.scale == pytest.approx(1.01, rel=1e-4) for f in first.evidence.fits)
    assert "scaled" in report.diagnosis()[1]


def test_the_visible_outputs_change_nothing_the_backend_computes(resnet):
    """aot_eager with every BN output a graph output: the same outputs as eager, bit for bit."""
    report = run(resnet, "compile:aot_eager", num_samples=32)
    assert_healthy(report)
    assert len(report.layers) == 20 and report.outputs.max_abs == 0.0
    assert all(e.relative == 0.0 for e in report.layers)


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 7, 14, 18])
def test_every_mid_layer_is_localised(resnet, k):
    layer = call_order(resnet["model"], torch.randn(2, 3, 32, 32))[k]
    backend = backend_file(resnet["folder"], f"backend = parity_models.eps_backend({k}, 0.1)")
    assert_localised(run(resnet, f"compile:{backend}:backend"), layer)


@pytest.mark.slow
def test_inductor_is_healthy():
    """The default backend (inductor compiles C++ on the CPU: tens of seconds)."""
    spec = ModelSpec(HEALTHY, arch=DIGITS)
    report = measure_parity(spec, "compile", DataOptions(path=VAL, batch_size=64, num_samples=128))
    assert report.target.backend == "inductor"
    assert_healthy(report)


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_fault_is_localised_and_aot_eager_is_healthy(resnet):
    spec = ModelSpec(resnet["checkpoint"], arch=RESNET, device="cuda")
    options = DataOptions(path=resnet["data"], batch_size=32)
    assert_healthy(measure_parity(spec, "compile:aot_eager", options))
    layer = call_order(resnet["model"], torch.randn(2, 3, 32, 32))[5]
    backend = backend_file(resnet["folder"], "backend = parity_models.eps_backend(5)")
    assert_localised(measure_parity(spec, f"compile:{backend}:backend", options), layer)


# ----------------------------------------------------------------------------- ONNX


def export_onnx(model, path, fold: bool) -> str:
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            (torch.zeros(2, 3, 32, 32),),
            str(path),
            dynamo=False,
            input_names=["x"],
            dynamic_axes={"x": {0: "n"}},
            do_constant_folding=fold,
            training=torch.onnx.TrainingMode.EVAL if fold else torch.onnx.TrainingMode.PRESERVE,
        )
    return str(path)


@pytest.fixture(scope="module")
def onnx_kept(resnet):
    pytest.importorskip("onnxruntime")
    return export_onnx(resnet["model"], resnet["folder"] / "kept.onnx", fold=False)


def edited(path: str, out: str, layer: str, edit) -> str:
    """A copy of the ONNX model at `path` with `edit(node, model)` applied to the
    BatchNormalization node whose statistics carry `layer`'s name."""
    import onnx

    model = onnx.load(path)
    (node,) = [
        n for n in model.graph.node if n.op_type == "BatchNormalization" and n.input[3] == f"{layer}.running_mean"
    ]
    edit(node, model)
    onnx.save(model, out)
    return out


def test_onnx_one_channel_variance_times_four_is_found_at_its_layer(resnet, onnx_kept):
    import onnx
    from onnx import numpy_helper

    layer = "layer2.1.bn1"

    def times_four(node, model):
        init = next(i for i in model.graph.initializer if i.name == node.input[4])
        values = numpy_helper.to_array(init).copy()
        values[3] *= 4
        init.CopyFrom(numpy_helper.from_array(values, init.name))

    path = edited(onnx_kept, str(resnet["folder"] / "var.onnx"), layer, times_four)
    report = run(resnet, path)
    assert_localised(report, layer)
    first = report.first_divergent
    assert first.channels_over == (3,)  # the one edited channel, no other
    assert any("running_var differs from the checkpoint's in 1 channel" in w for w in first.evidence.static)
    assert "output of BatchNormalization node" in first.site
    del onnx


def test_onnx_epsilon_changed_in_one_node_is_found_at_its_layer(resnet, onnx_kept):
    layer = "layer3.0.bn2"

    def eps(node, _model):
        for a in node.attribute:
            if a.name == "epsilon":
                a.f = 1e-2

    report = run(resnet, edited(onnx_kept, str(resnet["folder"] / "eps.onnx"), layer, eps))
    assert_localised(report, layer)
    assert any("epsilon 0.01 in the export, eps 1e-05" in w for w in report.first_divergent.evidence.static)


def test_onnx_correct_exports_kept_and_folded_are_healthy(resnet, onnx_kept):
    assert_healthy(run(resnet, onnx_kept))
    folded = export_onnx(resnet["model"], resnet["folder"] / "folded.onnx", fold=True)
    report = run(resnet, folded)
    assert_healthy(report)
    assert all("BN folded into it" in e.site for e in report.layers)  # read at each conv, paired as diff pairs


def test_onnx_with_external_data_runs_with_its_outputs_added():
    report = measure_parity(
        ModelSpec(HEALTHY, arch=DIGITS),
        os.path.join(SAMPLES, "onnx", "folded.onnx"),  # its weights in folded.onnx.data
        DataOptions(path=VAL, batch_size=64, num_samples=128),
    )
    assert_healthy(report)
    assert [e.name for e in report.layers] == ["features.1", "features.4", "head.2"]


@pytest.mark.slow
def test_onnx_dynamo_export_folded_under_the_convs_names_is_healthy(resnet):
    pytest.importorskip("onnxscript")
    path = str(resnet["folder"] / "dynamo.onnx")
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(resnet["model"], (torch.zeros(2, 3, 32, 32),), path, dynamo=True, input_names=["x"],
                          dynamic_shapes={"x": {0: torch.export.Dim("n")}})  # fmt: skip
    assert_healthy(run(resnet, path))


# ----------------------------------------------------------------------------- .pt2 and TorchScript


def test_pt2_one_buffer_changed_in_the_program_is_found_at_its_layer(resnet):
    layer = "layer2.0.downsample.1"
    model = copy.deepcopy(resnet["model"])  # the program's state is the model's own buffers
    program = torch.export.export(model, (torch.zeros(2, 3, 32, 32),), dynamic_shapes={"x": {0: torch.export.Dim("n")}})
    healthy = str(resnet["folder"] / "healthy.pt2")
    torch.export.save(program, healthy)
    assert_healthy(run(resnet, healthy, num_samples=32))
    program.state_dict[f"{layer}.running_var"][5] *= 4
    broken = str(resnet["folder"] / "broken.pt2")
    torch.export.save(program, broken)
    report = run(resnet, broken)
    assert_localised(report, layer)
    assert report.first_divergent.channels_over == (5,)


def test_torchscript_healthy_and_with_one_buffer_changed(resnet):
    layer = "layer1.0.bn2"
    traced = torch.jit.trace(copy.deepcopy(resnet["model"]), torch.zeros(2, 3, 32, 32))
    healthy = str(resnet["folder"] / "healthy.ts")
    traced.save(healthy)
    assert_healthy(run(resnet, healthy, num_samples=32))
    with torch.no_grad():
        dict(traced.named_buffers())[f"{layer}.running_mean"][2] += 1.0
    broken = str(resnet["folder"] / "broken.ts")
    traced.save(broken)
    report = run(resnet, broken)
    assert_localised(report, layer)
    assert report.first_divergent.channels_over == (2,)
    assert any("running_mean differ from the checkpoint's" in w for w in report.first_divergent.evidence.static)
    fit = report.first_divergent.evidence.fits[0]
    assert fit.scale == pytest.approx(1.0, abs=1e-4) and fit.shift != 0  # a shift: the mean


def test_a_layer_called_twice_is_compared_at_both_calls_and_one_never_called_is_listed(tmp_path):
    model = trained_looking(shared_bn(), shape=(3, 8, 8))
    torch.save(model.state_dict(), tmp_path / "model.pt")
    data = save_safetensors({"inputs": torch.randn(32, 3, 8, 8)}, tmp_path / "data.safetensors")
    traced = torch.jit.trace(copy.deepcopy(model), torch.zeros(2, 3, 8, 8))
    traced.save(str(tmp_path / "healthy.ts"))
    spec = ModelSpec(str(tmp_path / "model.pt"), arch=f"{MODELS}:shared_bn")
    options = DataOptions(path=data, batch_size=16)
    report = measure_parity(spec, str(tmp_path / "healthy.ts"), options)
    assert [(e.name, e.calls) for e in report.layers] == [("bn", 2)]
    assert [u.name for u in report.unseen] == ["spare"] and "never calls it" in report.unseen[0].reason
    assert [f.code for f in report.findings] == ["BN403"] and report.exit_code() == 0  # an info fails nothing
    with torch.no_grad():
        dict(traced.named_buffers())["bn.running_var"][1] *= 4
    traced.save(str(tmp_path / "broken.ts"))
    broken = measure_parity(spec, str(tmp_path / "broken.ts"), options)
    # the first call differs in channel 1 alone; the second normalises conv2 of it: every channel
    assert broken.first_divergent.name == "bn" and 1 in broken.first_divergent.channels_over


def test_a_torchscript_checkpoint_runs_eagerly_against_its_targets(tmp_path, cli):
    """The eager side may be a TorchScript archive (no --arch); torch.compile needs an eager model."""
    from digits_net import digits_net

    model = digits_net()
    model.load_state_dict(torch.load(HEALTHY, weights_only=True))
    traced = str(tmp_path / "digits.ts")
    torch.jit.trace(model.eval(), torch.zeros(2, 1, 8, 8)).save(traced)
    options = DataOptions(path=VAL, batch_size=64, num_samples=128)
    assert_healthy(measure_parity(ModelSpec(traced), os.path.join(SAMPLES, "onnx", "digits.onnx"), options))
    result = cli("parity", traced, "--data", VAL, "--num-samples", "64", "--against", "compile", "--isolated")
    assert result.exit_code == 2 and "is a TorchScript module, which torch.compile does not compile" in result.stderr


def test_without_onnxruntime_an_onnx_target_is_one_line_naming_the_extra(cli, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import onnxruntime raises ImportError
    against = os.path.join(SAMPLES, "onnx", "digits.onnx")
    result = cli("parity", HEALTHY, "--arch", DIGITS, "--data", VAL, "--against", against, "--isolated")
    assert result.exit_code == 2
    (line,) = result.stderr.strip().splitlines()
    assert 'pip install "bnaudit[onnx]"' in line


# ----------------------------------------------------------------------------- the command


def test_json_document_and_exit_codes(cli):
    training = os.path.join(SAMPLES, "onnx", "digits_training.onnx")
    args = ["parity", HEALTHY, "--arch", DIGITS, "--data", VAL, "--num-samples", "128", "--isolated"]
    result = cli(*args, "--against", training, "-f", "json")
    assert result.exit_code == 1, result.output
    doc = json.loads(result.stdout)
    assert doc["target"] == {"kind": "onnx", "path": training, "backend": None}
    assert [layer["name"] for layer in doc["layers"]] == ["features.1", "features.4", "head.2"]
    assert set(doc["layers"][0]) >= {"name", "floor", "max_abs", "relative", "diverges"}
    assert doc["first_divergent"] == "features.1" and doc["layers"][0]["diverges"] is True
    assert set(doc["outputs"]) >= {"max_abs", "top1_agreement"} and doc["outputs"]["top1_agreement"] < 1
    assert any("batch's statistics" in w for w in doc["layers"][0]["differs"])
    healthy = cli(*args, "--against", os.path.join(SAMPLES, "onnx", "digits.onnx"), "-f", "json")
    assert healthy.exit_code == 0 and json.loads(healthy.stdout)["first_divergent"] is None
    assert cli(*args, "--against", training, "--exit-zero").exit_code == 0


def test_ci_formats_name_the_first_divergent_layer(cli):
    training = os.path.join(SAMPLES, "onnx", "digits_training.onnx")
    args = [
        "parity",
        HEALTHY,
        "--arch",
        DIGITS,
        "--data",
        VAL,
        "--num-samples",
        "64",
        "--against",
        training,
        "--isolated",
    ]
    sarif = json.loads(cli(*args, "-f", "sarif").stdout)
    with open(os.path.join(REPO, "tests", "data", "sarif-schema-2.1.0.json"), encoding="utf-8") as fh:
        jsonschema.Draft4Validator(json.load(fh)).validate(sarif)
    results = sarif["runs"][0]["results"]
    assert [r["ruleId"] for r in results] == ["BN401", "BN402"]
    assert results[0]["locations"][0]["logicalLocations"][0]["name"] == "features.1"
    assert "features.1" in cli(*args, "-f", "github").stdout
    assert "BN401" in cli(*args, "-f", "junit").stdout and "bnaudit parity" in cli(*args, "-f", "markdown").stdout
    assert json.loads(cli(*args, "-f", "gitlab").stdout)[0]["check_name"].startswith("BN401")


@pytest.mark.parametrize(
    "against, words",
    [
        ("compile:no_such_backend", "--against compile:no_such_backend: no torch.compile backend of that name"),
        ("compile:{models}:no_such_function", "has no attribute 'no_such_function'"),
        ("compile:{models}:failing_backend", "the backend failed: RuntimeError: this backend cannot compile anything"),
        ("{corrupt}", "corrupt.onnx"),
        ("{missing}", "missing.pt2: no such file"),
        ("{healthy}", "a torch-zip file is no deployed target"),
    ],
)
def test_a_target_that_cannot_run_is_one_line_and_exit_2(cli, tmp_path, against, words):
    corrupt = tmp_path / "corrupt.onnx"
    corrupt.write_bytes(b"\x08\x07" + os.urandom(200))
    target = against.format(models=MODELS, corrupt=corrupt, missing=tmp_path / "missing.pt2", healthy=HEALTHY)
    result = cli(
        "parity", HEALTHY, "--arch", DIGITS, "--data", VAL, "--num-samples", "64", "--against", target, "--isolated"
    )
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("bnaudit: error: ") and words in line and "Traceback" not in result.output


def test_a_missing_backend_function_is_named_once(cli):
    """The line names the --against value as given, once, then what is wrong with it."""
    target = f"compile:{MODELS}:no_such_function"
    result = cli("parity", HEALTHY, "--arch", DIGITS, "--data", VAL, "--num-samples", "64", "--against", target)
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        f"bnaudit: error: --against {target}: '{MODELS}' has no attribute 'no_such_function'"
    )

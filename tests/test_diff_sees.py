"""Issue 21 for `diff`: trust nothing in the file, say what it sees, short output, say what
was measured. Each test builds its files the way users or real libraries do."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from conftest import SAMPLES, save_safetensors

from bnaudit.audit.diff.checkpoints import diff
from bnaudit.runtime.models import ModelSpec

sys.path.insert(0, SAMPLES)
from digits_net import digits_net

ARCH = os.path.join(SAMPLES, "digits_net.py") + ":digits_net"
CALIB = os.path.join(SAMPLES, "data", "digits_calib.safetensors")


def test_forged_recalibration_record_does_not_silence_bn101(tmp_path):
    """A real `recalibrate` record, copied into a fine-tuned checkpoint whose backbone
    updated its statistics while frozen: its digests do not match those statistics, so
    diff audits the layers as usual, exactly as inspect does (BN101 warnings, exit 1)."""
    from bnaudit import DataOptions, inspect, recalibrate_checkpoint

    pretrained = os.path.join(SAMPLES, "pretrained.safetensors")
    recal = str(tmp_path / "recal.safetensors")
    recalibrate_checkpoint(ModelSpec(pretrained, arch=ARCH), recal, DataOptions(path=CALIB, batch_size=50))
    from safetensors import safe_open

    with safe_open(recal, "pt") as f:
        record = f.metadata()["bnaudit"]
    assert json.loads(record)["recalibrated_layers"] == ["features.1", "features.4", "head.2"]
    tuned = torch.load(os.path.join(SAMPLES, "finetuned.pt"), weights_only=True)
    forged = save_safetensors(dict(tuned), tmp_path / "forged.safetensors", metadata={"bnaudit": record})

    report = diff(pretrained, forged)
    found = sorted((f.code, f.severity, f.layer) for f in report.findings)
    assert found == [("BN101", "warning", "features.1"), ("BN101", "warning", "features.4")]
    assert report.exit_code() == 1
    assert not any(d.recalibrated for d in report.layers)
    assert report.provenance == "" and any("does not match" in line for line in report.diagnosis())
    # the same record, judged the same way by inspect
    assert "does not match" in inspect(forged).files[0].provenance


# ----------------------------------------------------------------------------- ONNX external data


def bn_onnx(folder, location: str | None = None, name: str = "bn", opset: int = 15):
    """One BatchNormalization node (C=3) as torch's legacy exporter names it
    (`bn.running_mean` ...); with `location`, the four tensors are external data in that
    file, written at consecutive offsets as onnx's save_as_external_data does."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    values = {
        f"{name}.weight": np.array([1.0, 2.0, 3.0], np.float32),
        f"{name}.bias": np.array([0.1, 0.2, 0.3], np.float32),
        f"{name}.running_mean": np.array([0.5, -0.5, 0.25], np.float32),
        f"{name}.running_var": np.array([1.5, 2.5, 3.5], np.float32),
    }
    inits = []
    offset = 0
    blob = b""
    for key, array in values.items():
        tensor = numpy_helper.from_array(array, key)
        if location is not None:
            raw = array.tobytes()
            tensor.ClearField("raw_data")
            tensor.data_location = TensorProto.EXTERNAL
            for k, v in (("location", location), ("offset", str(offset)), ("length", str(len(raw)))):
                entry = tensor.external_data.add()
                entry.key, entry.value = k, v
            blob += raw
            offset += len(raw)
        inits.append(tensor)
    node = helper.make_node("BatchNormalization", ["x", *values], ["y"], name=f"/{name}/BatchNormalization")
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 2, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 2, 2])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="pytorch")
    path = folder / "model.onnx"
    onnx.save(model, str(path))
    if location is not None:
        target = folder / location
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(blob)
    return path, values


def test_external_data_folder_swapped_for_a_symlink_after_the_check_is_refused(tmp_path):
    """The location `sub/weights.bin` is checked when the model is loaded; `sub` is then
    replaced by a symlink to a folder outside (a TOCTOU swap): reading must not follow it."""
    from bnaudit.errors import BnauditError
    from bnaudit.formats.onnx import read_onnx

    folder = tmp_path / "model"
    folder.mkdir()
    path, _ = bn_onnx(folder, "sub/weights.bin")
    ckpt = read_onnx(str(path))  # checked here: sub/weights.bin lies inside the folder
    outside = tmp_path / "secret"
    outside.mkdir()
    blob = (folder / "sub" / "weights.bin").read_bytes()
    (outside / "weights.bin").write_bytes(blob[::-1])  # other bytes, the same size
    (folder / "sub" / "weights.bin").unlink()
    (folder / "sub").rmdir()
    (folder / "sub").symlink_to(outside, target_is_directory=True)
    with pytest.raises(BnauditError, match="external data of 'bn.running_var'"):
        ckpt.tensors["bn.running_var"].read()


def test_external_data_read_through_its_checked_path(tmp_path):
    """The walk that refuses a swapped folder still reads a nested location, and a symlink
    inside the folder that stays inside (resolved when loaded) keeps working."""
    from bnaudit.formats.onnx import read_onnx

    folder = tmp_path / "model"
    folder.mkdir()
    path, values = bn_onnx(folder, "sub/deeper/weights.bin")
    ckpt = read_onnx(str(path))
    assert ckpt.tensors["bn.running_var"].read() == [float(v) for v in values["bn.running_var"]]
    (folder / "alias").symlink_to(folder / "sub", target_is_directory=True)
    path, values = bn_onnx(folder, "alias/deeper/weights.bin")
    ckpt = read_onnx(str(path))
    assert ckpt.tensors["bn.weight"].read() == [1.0, 2.0, 3.0]


# ----------------------------------------------------------------------------- names exact in JSON


def conv_onnx(folder, conv_name: str, with_bias: bool = True):
    """A conv net exported without BatchNormalization nodes (constant weights, and a bias
    where `with_bias`), named as the exporter names its nodes."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.ones((2, 3, 1, 1), np.float32), "conv.weight")
    b = numpy_helper.from_array(np.zeros(2, np.float32), "conv.bias")
    inputs = ["x", "conv.weight", "conv.bias"] if with_bias else ["x", "conv.weight"]
    node = helper.make_node("Conv", inputs, ["y"], name=conv_name)
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 2, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 2, 2])],
        [w, b] if with_bias else [w],
    )
    path = folder / "model.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_json_keeps_onnx_names_exact_and_the_terminal_escapes_them(tmp_path, cli):
    name = "/conv\u202e\u200f1/Conv"  # a right-to-left override and mark, as a hostile export could carry
    path = conv_onnx(tmp_path, name)
    doc = json.loads(cli("inspect", str(path), "--format", "json").stdout)
    messages = [f["message"] for file in doc["files"] for f in file["findings"]]
    assert any(name in m for m in messages), messages
    table = cli("inspect", str(path), width=200).stdout
    assert "\u202e" not in table and "\u200f" not in table
    assert "/conv\\u202e\\u200f1/Conv" in table


@pytest.mark.parametrize(
    "char", ["\u200e", "\u200f", "\u061c", "\u202a", "\u202e", "\u2066", "\u2069", "\u2028", "\u2029"]
)
def test_printable_escapes_the_controls_a_terminal_honours(char):
    from bnaudit.text import printable

    assert printable(f"a{char}b") == f"a\\u{ord(char):04x}b"
    assert printable("layer.ÿ-é") == "layer.ÿ-é"  # printable non-ASCII stays as it is


# ----------------------------------------------------------------------------- ONNX local functions


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 3, 1, bias=False)
        self.bn = torch.nn.BatchNorm2d(3)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


def two_blocks() -> torch.nn.Module:
    """Two conv-BN blocks whose statistics differ (set as training would leave them)."""
    torch.manual_seed(3)
    model = torch.nn.Sequential(Block(), Block())
    g = torch.Generator().manual_seed(4)
    for block in model:
        block.bn.running_mean.copy_(torch.randn(3, generator=g))
        block.bn.running_var.copy_(torch.rand(3, generator=g) + 0.5)
        block.bn.weight.data.copy_(torch.rand(3, generator=g) + 0.5)
        block.bn.bias.data.copy_(torch.randn(3, generator=g))
        block.bn.num_batches_tracked.fill_(100)
    return model.eval()


def legacy_export(model, path, size: int = 4, **options) -> str:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.randn(1, 3, size, size),), str(path), dynamo=False, **options)
    return str(path)


def test_bn_in_a_function_called_twice_is_one_layer_per_call_site(tmp_path):
    """The legacy exporter's export_modules_as_functions={nn.BatchNorm2d}: one function
    BatchNorm2d, called by two nodes with their own initializers."""
    from bnaudit.formats.onnx import read_onnx

    model = two_blocks()
    path = legacy_export(
        model, tmp_path / "f.onnx", do_constant_folding=False, export_modules_as_functions={torch.nn.BatchNorm2d}
    )
    ckpt = read_onnx(path)
    assert sorted(ckpt.modules) == ["0.bn", "1.bn"]
    state = model.state_dict()
    for layer in ("0.bn", "1.bn"):
        for leaf in ("weight", "bias", "running_mean", "running_var"):
            expected = state[f"{layer}.{leaf}"].double().tolist()
            assert ckpt.tensors[f"{layer}.{leaf}"].read() == expected, (layer, leaf)
    checkpoint = tmp_path / "model.pt"
    torch.save(state, checkpoint)
    report = diff(str(checkpoint), path)
    assert [d.name for d in report.layers] == ["0.bn", "1.bn"]
    assert report.export is not None and report.export.unpaired == [] and report.only_b == []
    assert all(not n.mismatches for n in report.export.nodes)


def test_onnx_node_with_statistics_fed_at_run_time_names_its_layer(tmp_path, cli):
    """export_params=False: every parameter and buffer is a graph input; BN013 names the layer."""
    path = legacy_export(two_blocks(), tmp_path / "noparams.onnx", do_constant_folding=False, export_params=False)
    doc = json.loads(cli("inspect", path, "--format", "json").stdout)
    found = [(f["code"], f["layer"]) for file in doc["files"] for f in file["findings"] if f["code"] == "BN013"]
    assert sorted(found) == [("BN013", "0.bn"), ("BN013", "1.bn")]


# ----------------------------------------------------------------------------- diff says what it sees


def test_export_causes_name_every_layer_or_say_how_many_more(tmp_path):
    """Six conv-BN blocks exported in training mode: the diagnosis names three nodes and
    says how many more, in the table and in JSON (it used to name three and stop)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Block() for _ in range(6)]).eval()
    checkpoint = tmp_path / "model.pt"
    torch.save(model.state_dict(), checkpoint)
    path = legacy_export(
        model, tmp_path / "train.onnx", do_constant_folding=False, training=torch.onnx.TrainingMode.TRAINING
    )
    report = diff(str(checkpoint), path)
    assert len(report.export.nodes) == 6 and all(n.training_mode for n in report.export.nodes)
    [line] = [line for line in report.diagnosis() if "training mode" in line]
    assert "6 BatchNormalization node(s) run in training mode (0.bn, 1.bn, 2.bn and 3 more)" in line


def state_with(channels: dict[str, int], seed: int) -> dict[str, torch.Tensor]:
    from conftest import bn_entries

    state: dict[str, torch.Tensor] = {}
    for i, (name, c) in enumerate(channels.items()):
        g = torch.Generator().manual_seed(seed * 100 + i)
        state.update(bn_entries(name, c, mean=torch.randn(c, generator=g), var=torch.rand(c, generator=g) + 0.5))
    return state


def test_same_names_other_channel_counts_says_so(tmp_path):
    """Every layer present on both sides by name, none with the same channel count: not
    "No BN layer is present on both sides"."""
    from conftest import save_torch

    a = save_torch(state_with({"features.1": 8, "features.4": 16}, 1), tmp_path / "a.pt")
    b = save_torch(state_with({"features.1": 12, "features.4": 24}, 2), tmp_path / "b.pt")
    report = diff(a, b)
    assert report.reshaped == [("features.1", 8, 12), ("features.4", 16, 24)]
    lines = report.diagnosis()
    assert "No BN layer is present on both sides." not in lines
    assert any(
        "2 layers have the same names on both sides but other channel counts (features.1: 8 -> 12, "
        "features.4: 16 -> 24)" in line
        for line in lines
    ), lines


def paddle_like_onnx(path, channels: list[int], seed: int) -> str:
    """BN nodes named as paddle2onnx names them (`p2o.BatchNormalization.N`, tensors
    `batch_norm_N.w_0` ...): the names say nothing about the model."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    nodes, inits, inputs, outputs = [], [], [], []
    for i, c in enumerate(channels):
        tensors = [
            numpy_helper.from_array(rng.uniform(0.5, 1.5, c).astype(np.float32), f"batch_norm_{i}.w_0"),
            numpy_helper.from_array(rng.normal(size=c).astype(np.float32), f"batch_norm_{i}.b_0"),
            numpy_helper.from_array(rng.normal(size=c).astype(np.float32), f"batch_norm_{i}.w_1"),
            numpy_helper.from_array(rng.uniform(0.5, 2.0, c).astype(np.float32), f"batch_norm_{i}.w_2"),
        ]
        inits += tensors
        inputs.append(helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, [1, c, 4, 4]))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [1, c, 4, 4]))
        nodes.append(
            helper.make_node(
                "BatchNormalization",
                [f"x{i}", *(t.name for t in tensors)],
                [f"y{i}"],
                name=f"p2o.BatchNormalization.{i}",
            )
        )
    graph = helper.make_graph(nodes, "paddle", inputs, outputs, inits)
    onnx.save(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)], producer_name="PaddlePaddle"), str(path)
    )
    return str(path)


@pytest.mark.parametrize(
    ("channels_a", "channels_b", "why"),
    [
        ([16, 32, 64], [16, 32, 64, 96, 96, 128, 128, 256], "only 3 of 8 layers pair by name"),
        ([16, 32, 64, 128], [16, 24, 48, 96], "3 of the 4 layers that pair by name have other channel counts"),
    ],
)
def test_unrelated_models_sharing_generic_names_are_a_warning(tmp_path, channels_a, channels_b, why):
    a = paddle_like_onnx(tmp_path / "det.onnx", channels_a, 1)
    b = paddle_like_onnx(tmp_path / "rec.onnx", channels_b, 2)
    report = diff(a, b)
    [finding] = [f for f in report.findings if "different models" in f.message]
    assert finding.code == "BN107" and finding.severity == "warning" and finding.layer is None
    assert why in finding.message
    assert report.exit_code() == 1
    assert any("look like different models" in line for line in report.diagnosis())
    assert not any("trained normally" in line for line in report.diagnosis())


def test_a_checkpoint_and_its_fine_tuned_copy_are_not_different_models(tmp_path):
    """The warning's other side: a fine-tuned copy with one layer added pairs fully."""
    from conftest import save_torch

    a = save_torch(state_with({"a.bn": 8, "b.bn": 8, "c.bn": 16}, 1), tmp_path / "a.pt")
    b = save_torch(state_with({"a.bn": 8, "b.bn": 8, "c.bn": 16, "d.bn": 4}, 2), tmp_path / "b.pt")
    assert not any("different models" in f.message for f in diff(a, b).findings)


def test_bn014_without_checkpoint_tells_folding_from_no_bn_only_where_it_can(tmp_path):
    """facenet's PNet (conv + PReLU, never any BN) and a conv-BN net folded by the legacy
    exporter's constant folding: only the second shows the folding (weights the exporter
    computed, `onnx::Conv_N`); the first says the export alone cannot tell."""
    from bnaudit import inspect

    class PNet(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = torch.nn.Conv2d(3, 10, 3)
            self.prelu1 = torch.nn.PReLU(10)
            self.conv2 = torch.nn.Conv2d(10, 16, 3)
            self.prelu2 = torch.nn.PReLU(16)

        def forward(self, x):
            return self.prelu2(self.conv2(self.prelu1(self.conv1(x))))

    pnet = legacy_export(PNet().eval(), tmp_path / "pnet.onnx", size=12)
    folded = legacy_export(two_blocks(), tmp_path / "folded.onnx")  # constant folding on: BN folded

    def bn014(path: str) -> str:
        [finding] = [f for f in inspect(path).files[0].findings if f.code == "BN014"]
        return finding.message

    assert "cannot be told apart" in bn014(pnet)
    assert "cannot be told apart" not in bn014(folded) and "folded" in bn014(folded)


# ----------------------------------------------------------------------------- output volume and -q


class BasicBlock(torch.nn.Module):
    """torchvision's BasicBlock, its module names kept (conv1/bn1/conv2/bn2/downsample)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(cout)
        self.conv2 = torch.nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = torch.nn.Sequential(
                torch.nn.Conv2d(cin, cout, 1, stride, bias=False), torch.nn.BatchNorm2d(cout)
            )

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet18(torch.nn.Module):
    """torchvision's resnet18 layout (20 BN layers under the same names), narrower."""

    def __init__(self, widths=(8, 16, 32, 64), classes: int = 10) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, widths[0], 7, 2, 3, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(widths[0])
        cin = widths[0]
        for i, w in enumerate(widths):
            stride = 1 if i == 0 else 2
            self.add_module(f"layer{i + 1}", torch.nn.Sequential(BasicBlock(cin, w, stride), BasicBlock(w, w, 1)))
            cin = w
        self.fc = torch.nn.Linear(cin, classes)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        for i in range(4):
            x = getattr(self, f"layer{i + 1}")(x)
        return self.fc(x.mean((2, 3)))


@pytest.fixture(scope="module")
def resnet_freeze_bug(tmp_path_factory):
    """pretrained -> fine-tuned with the backbone frozen by requires_grad only (train() on
    every step): all 20 BN layers updated their statistics while their weights stayed."""
    folder = tmp_path_factory.mktemp("resnet")
    torch.manual_seed(0)
    model = ResNet18()
    g = torch.Generator().manual_seed(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(3):  # "pretraining"
        x, y = torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    a = folder / "pretrained.pt"
    torch.save(model.state_dict(), a)
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("fc."))
    opt = torch.optim.SGD(model.fc.parameters(), lr=0.05)
    for _ in range(4):
        model.train()
        x, y = torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    b = folder / "finetuned.pt"
    torch.save(model.state_dict(), b)
    bn_names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.BatchNorm2d)]
    return str(a), str(b), bn_names


def test_freeze_bug_on_resnet18_collapses_into_one_finding_row(resnet_freeze_bug, cli):
    a, b, bn_names = resnet_freeze_bug
    assert len(bn_names) == 20
    report = diff(a, b)
    assert sorted(f.layer for f in report.findings if f.code == "BN101") == sorted(bn_names)
    result = cli("diff", a, b, "--isolated", width=120)
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    rows = [line for line in lines if line.startswith("BN101")]
    assert len(rows) == 1 and "20 layers (bn1," in rows[0]
    # 20 table rows, one finding row and the summary: nowhere near 20 four-line findings
    assert len(lines) < 50, result.stdout


def test_diff_quiet_prints_one_greppable_line_per_finding(resnet_freeze_bug, cli):
    a, b, bn_names = resnet_freeze_bug
    result = cli("diff", a, b, "--isolated", "-q", width=80)
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    assert len(lines) == 21, result.stdout  # 20 findings and the summary line
    for line, name in zip(lines, bn_names):
        assert line.startswith(f"{b}: {name}: BN101 frozen-but-updating: weight and bias bit-identical")
    assert lines[-1] == "20 matched BN layers: 0 errors, 20 warnings, 0 infos"


def test_diff_quiet_says_the_output_comparison_in_one_line_when_it_passes(cli):
    args = [
        "diff",
        os.path.join(SAMPLES, "healthy.pt"),
        os.path.join(SAMPLES, "onnx", "folded.onnx"),
        "--arch",
        ARCH,
        "--data",
        os.path.join(SAMPLES, "data", "digits_val.safetensors"),
        "--num-samples",
        "64",
        "--isolated",
        "-q",
    ]
    result = cli(*args, width=80)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert len(lines) == 2, result.stdout
    assert lines[0].startswith(
        f"{os.path.join(SAMPLES, 'onnx', 'folded.onnx')}: outputs (torch eval vs onnxruntime CPU)"
    )
    assert "on 64 samples" in lines[0] and lines[0].endswith("outputs agree within float32 rounding")
    assert lines[1] == "0 matched BN layers, 3 folded layers: 0 errors, 0 warnings, 0 infos"


# ----------------------------------------------------------------------------- say what was measured


@pytest.fixture(scope="module")
def timm_checkpoint(tmp_path_factory):
    """What timm's CheckpointSaver writes with ModelEmaV3: the live weights under
    `state_dict`, the EMA copy under `state_dict_ema` (here with statistics that differ)."""
    folder = tmp_path_factory.mktemp("timm")
    live = torch.load(os.path.join(SAMPLES, "healthy.pt"), weights_only=True)
    ema = {k: (v * 0.9 if k.endswith("running_mean") else v.clone()) for k, v in live.items()}
    path = folder / "last.pth.tar"
    torch.save({"epoch": 9, "arch": "digits_net", "state_dict": live, "version": 2, "state_dict_ema": ema}, path)
    return str(path)


def test_gap_names_the_state_dict_it_measured(timm_checkpoint, cli):
    common = [
        "gap",
        timm_checkpoint,
        "--arch",
        ARCH,
        "--data",
        os.path.join(SAMPLES, "data", "digits_val.safetensors"),
        "--num-samples",
        "64",
        "--isolated",
    ]
    live = json.loads(cli(*common, "--format", "json").stdout)
    ema = json.loads(cli(*common, "--key", "state_dict_ema", "--format", "json").stdout)
    assert live["key"] == "state_dict" and ema["key"] == "state_dict_ema"
    assert live["prefix"] is None
    first_live = cli(*common, width=200).stdout.splitlines()[0]
    first_ema = cli(*common, "--key", "state_dict_ema", width=200).stdout.splitlines()[0]
    assert "key 'state_dict'" in first_live and "key 'state_dict_ema'" in first_ema


def test_every_command_names_key_and_prefix_the_same_way(tmp_path, cli):
    """A DDP container: inspect, diff and gap say `key 'model', prefix 'module.' stripped`."""
    state = torch.load(os.path.join(SAMPLES, "healthy.pt"), weights_only=True)
    path = tmp_path / "ddp.pt"
    torch.save({"model": {f"module.{k}": v for k, v in state.items()}, "epoch": 3}, path)
    words = "key 'model', prefix 'module.' stripped"
    assert words in cli("inspect", str(path), "--isolated", width=200).stdout
    assert words in cli("diff", str(path), str(path), "--isolated", width=200).stdout.splitlines()[0]
    gap = cli(
        "gap", str(path), "--arch", ARCH, "--data", os.path.join(SAMPLES, "data", "digits_val.safetensors"),
        "--num-samples", "32", "--isolated", width=200,
    )  # fmt: skip
    assert words in gap.stdout.splitlines()[0], gap.stdout


def test_linear_after_the_last_bn_is_not_called_folded(tmp_path):
    """The live checkpoint against an export of its EMA copy (timm's ModelEmaV3 weights
    exported with the legacy exporter's defaults: convs folded, BN1d kept): the classifier
    after the last BN differs from the live one, but nothing was folded into it."""
    live = torch.load(os.path.join(SAMPLES, "healthy.pt"), weights_only=True)
    model = digits_net()
    model.load_state_dict(live)
    other = digits_net()  # the EMA copy: decay 0.99 towards weights trained from another start
    with torch.no_grad():
        for p, q in zip(model.parameters(), other.parameters()):
            p.mul_(0.99).add_(q, alpha=0.01)
    model.eval()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.rand(1, 1, 8, 8),), str(tmp_path / "ema.onnx"), dynamo=False)
    report = diff(os.path.join(SAMPLES, "healthy.pt"), str(tmp_path / "ema.onnx"))
    about_fc = [f for f in report.findings if f.code == "BN113" and ("head.5" in f.message or "Gemm" in f.message)]
    assert about_fc, [f.message for f in report.findings]
    for f in about_fc:
        assert "folded from a BN" not in f.message
        assert "no BatchNorm" in f.message or "no BN" in f.message
    assert not any("folded from a BN" in f.message and "Gemm" in f.message for f in report.findings)

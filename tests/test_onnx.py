"""`inspect` of `.onnx` files (issue 16): real exports, broken the ways users break them.

Every model here is exported by torch.onnx.export from a small trained network, with both
exporters: the legacy one (dynamo=False; BatchNormalization nodes kept by
do_constant_folding=False) and the dynamo one (BN kept by optimize=False); both fold BN into
the Conv by default. The breaks are made with the onnx package, and the expected findings
are checked against the test's own reading of the graph (onnx.numpy_helper).
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import helper, numpy_helper
from typer.testing import CliRunner

from bnaudit.api import inspect
from bnaudit.cli import app
from bnaudit.formats.onnx import external_data_files, load_onnx, read_onnx
from bnaudit.formats.read import read_checkpoint
from bnaudit.formats.sniff import sniff_format

REPO = Path(__file__).resolve().parents[1]
torch.set_num_threads(1)

NEAR_EPS_CHANNEL = 2  # features.4's channel 2 has running_var 5e-3: near eps at 1e-3, not at 1e-5


class Net(torch.nn.Module):
    """conv-BN2d-ReLU, conv-BN2d-ReLU, pool, linear-BN1d-linear: the BN kinds an export holds."""

    def __init__(self) -> None:
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(1, 4, 3, padding=1, bias=False),
            torch.nn.BatchNorm2d(4),
            torch.nn.ReLU(),
            torch.nn.Conv2d(4, 6, 3, padding=1, bias=False),
            torch.nn.BatchNorm2d(6),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1),
        )
        self.head = torch.nn.Sequential(
            torch.nn.Flatten(), torch.nn.Linear(6, 8, bias=False), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3)
        )

    def forward(self, x):
        return self.head(self.features(x))


def trained_net() -> Net:
    torch.manual_seed(0)
    net = Net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    net.train()
    for _ in range(20):
        x = torch.randn(16, 1, 6, 6, generator=g) + 0.5
        y = torch.randint(0, 3, (16,), generator=g)
        loss = torch.nn.functional.cross_entropy(net(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    net.eval()
    with torch.no_grad():
        net.features[4].running_var[NEAR_EPS_CHANNEL] = 5e-3
    return net


EXAMPLE = (torch.randn(2, 1, 6, 6, generator=torch.Generator().manual_seed(3)),)


def export(net, path: Path, **kwargs) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, EXAMPLE, str(path), **kwargs)
    return path


@pytest.fixture(scope="module")
def net() -> Net:
    return trained_net()


@pytest.fixture(scope="module")
def exports(net, tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("exports")
    return {
        "legacy-kept": export(net, folder / "legacy_kept.onnx", dynamo=False, do_constant_folding=False),
        "legacy-folded": export(net, folder / "legacy_folded.onnx", dynamo=False),
        "legacy-training": export(
            copy.deepcopy(net),
            folder / "legacy_training.onnx",
            dynamo=False,
            do_constant_folding=False,
            training=torch.onnx.TrainingMode.TRAINING,
        ),
        "dynamo-kept": export(net, folder / "dynamo_kept.onnx", dynamo=True, optimize=False),
        "dynamo-folded": export(net, folder / "dynamo_folded.onnx", dynamo=True),
    }


BN_NAMES = ["features.1", "features.4", "head.2"]


# ----------------------------------------------------------------------------- the test's own reading


def own_bn_nodes(path: Path) -> list[dict]:
    """Each BatchNormalization node of the main graph, read with the onnx package: its
    attributes and its four statistics inputs as numpy arrays (Identity nodes followed)."""
    model = onnx.load(str(path))
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute[0].name == "value":
            inits[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
    identity = {n.output[0]: n.input[0] for n in model.graph.node if n.op_type == "Identity"}

    def value(name):
        while name in identity:
            name = identity[name]
        return inits[name]

    nodes = []
    for node in model.graph.node:
        if node.op_type == "BatchNormalization":
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            nodes.append(
                {
                    "name": node.name,
                    "epsilon": attrs.get("epsilon", 1e-5),
                    "momentum": attrs.get("momentum", 0.9),
                    "training_mode": attrs.get("training_mode", 0),
                    "stats": [value(n) for n in node.input[1:5]],
                    "inputs": list(node.input[1:5]),
                }
            )
    return nodes


def codes(report) -> list[tuple[str, str | None]]:
    return [(f.code, f.layer) for file in report.files for f in file.findings]


def cli(*args: str):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200", "NO_COLOR": "1"})


def one_line_error(result, *words: str) -> str:
    assert result.exit_code == 2, (result.exit_code, result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert "Traceback" not in result.stdout + result.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


# ----------------------------------------------------------------------------- correct exports


@pytest.mark.parametrize("which", ["legacy-kept", "dynamo-kept"])
def test_kept_bn_nodes_are_read_with_their_values_and_settings(net, exports, which):
    path = exports[which]
    nodes = own_bn_nodes(path)
    assert len(nodes) == 3
    ckpt = read_checkpoint(str(path))
    assert ckpt.format == "onnx" and sorted(ckpt.modules) == BN_NAMES
    state = net.state_dict()
    for name, node in zip(BN_NAMES, nodes):
        for leaf, expected in zip(("weight", "bias", "running_mean", "running_var"), node["stats"]):
            ref = ckpt.tensors[f"{name}.{leaf}"]
            assert ref.read() == expected.astype(np.float64).tolist()  # what the graph holds
            assert ref.read() == state[f"{name}.{leaf}"].double().tolist()  # = the module's buffers
        info = ckpt.modules[name]
        # float32 attributes read back as the decimals torch wrote: eps 1e-5, ONNX momentum 0.9
        assert np.float32(node["epsilon"]) == np.float32(1e-5) and info.eps == 1e-5
        assert np.float32(node["momentum"]) == np.float32(0.9) and info.momentum == 0.1
        assert info.training_mode is False and "BatchNormalization-15, opset" in info.source
    assert ckpt.metadata["onnx.producer"].startswith("pytorch")
    report = inspect(str(path))
    assert codes(report) == [] and report.exit_code() == 0
    layers = {layer.name: layer for layer in report.files[0].layers}
    assert sorted(layers) == BN_NAMES and layers["features.4"].eps == 1e-5


@pytest.mark.parametrize("which", ["legacy-folded", "dynamo-folded"])
def test_folded_exports_get_one_info_line(exports, which):
    path = exports[which]
    model = onnx.load(str(path))
    kept = [n for n in model.graph.node if n.op_type == "BatchNormalization"]
    # both exporters fold the BN after each Conv; the legacy one keeps BN1d after a Linear (a MatMul)
    assert [n.input[3] for n in kept] == (["head.2.running_mean"] if which == "legacy-folded" else [])
    convs = [n for n in model.graph.node if n.op_type == "Conv"]
    assert len(convs) == 2 and all(len(n.input) == 3 for n in convs)  # bias-free convs gained a bias
    report = inspect(str(path))
    assert codes(report) == [("BN014", None)]
    finding = report.files[0].findings[0]
    assert finding.severity == "info" and "2 Conv nodes" in finding.message
    if which == "legacy-folded":
        assert all(n.input[1].startswith("onnx::") for n in convs)
        assert "constant folding" in finding.message
        assert [layer.name for layer in report.files[0].layers] == ["head.2"]
    else:
        assert "no BatchNormalization node" in finding.message
    assert report.exit_code() == 0


def test_graph_without_bn_and_without_conv_has_no_finding(tmp_path):
    mlp = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(36, 3)).eval()
    path = export(mlp, tmp_path / "mlp.onnx", dynamo=False)
    assert codes(inspect(str(path))) == []


def test_untrained_export_shares_initializers_through_identity_nodes(tmp_path):
    # The legacy exporter deduplicates equal initializers: a fresh BN's running_var (ones)
    # becomes Identity(weight). Followed, the statistics are the initial 0/1: BN002.
    torch.manual_seed(0)
    path = export(Net().eval(), tmp_path / "untrained.onnx", dynamo=False, do_constant_folding=False)
    model = onnx.load(str(path))
    assert any(n.op_type == "Identity" for n in model.graph.node)
    nodes = own_bn_nodes(path)
    assert all((node["stats"][3] == 1).all() and (node["stats"][2] == 0).all() for node in nodes)
    assert sorted(c for c in codes(inspect(str(path)))) == [("BN002", n) for n in BN_NAMES]


# ----------------------------------------------------------------------------- broken exports


def test_training_mode_export_is_an_error_for_every_node(exports):
    path = exports["legacy-training"]
    nodes = own_bn_nodes(path)
    assert [n["training_mode"] for n in nodes] == [1, 1, 1]
    report = inspect(str(path))
    assert codes(report) == [("BN012", n) for n in BN_NAMES]
    assert all(f.severity == "error" and "training_mode=1" in f.message for f in report.files[0].findings)
    assert report.exit_code() == 1


def edited(source: Path, target: Path, edit) -> Path:
    model = onnx.load(str(source))
    edit(model)
    onnx.save(model, str(target))
    return target


def bn_node(model, index: int):
    return [n for n in model.graph.node if n.op_type == "BatchNormalization"][index]


def set_attr(node, name: str, value) -> None:
    for attr in list(node.attribute):
        if attr.name == name:
            node.attribute.remove(attr)
    node.attribute.append(helper.make_attribute(name, value))


def init(model, name: str):
    return next(t for t in model.graph.initializer if t.name == name)


def test_training_mode_set_on_one_node(exports, tmp_path):
    path = edited(exports["dynamo-kept"], tmp_path / "one.onnx", lambda m: set_attr(bn_node(m, 1), "training_mode", 1))
    assert [n["training_mode"] for n in own_bn_nodes(path)] == [0, 1, 0]
    assert codes(inspect(str(path))) == [("BN012", "features.4")]


def test_eps_rewritten_to_1e_3_reaches_the_near_eps_rule(exports, net, tmp_path):
    def eps(model):
        for i in range(3):
            set_attr(bn_node(model, i), "epsilon", 1e-3)

    path = edited(exports["legacy-kept"], tmp_path / "eps.onnx", eps)
    report = inspect(str(path))
    assert codes(report) == [("BN004", "features.4")]
    finding = report.files[0].findings[0]
    assert finding.channels == (NEAR_EPS_CHANNEL,)
    layer = next(l for l in report.files[0].layers if l.name == "features.4")
    assert layer.eps == 1e-3
    # eval gain at the node's eps, by hand: |gamma| / sqrt(var + eps)
    gamma = net.features[4].weight[NEAR_EPS_CHANNEL].item()
    var = float(np.float32(5e-3))
    assert f"gain {abs(gamma) / math.sqrt(var + 1e-3):.1f}" in finding.message
    assert "(0.01)" in finding.message  # 10 * eps with the node's eps, not PyTorch's default


def test_momentum_written_in_pytorch_convention_is_translated(exports, tmp_path):
    path = edited(exports["legacy-kept"], tmp_path / "m.onnx", lambda m: set_attr(bn_node(m, 0), "momentum", 0.1))
    assert np.float32(own_bn_nodes(path)[0]["momentum"]) == np.float32(0.1)
    report = inspect(str(path))
    assert codes(report) == [("BN007", "features.1")]
    assert "ONNX momentum 0.1 = PyTorch 0.9" in report.files[0].findings[0].message
    assert read_onnx(str(path)).modules["features.1"].momentum == 0.9


def test_reset_statistics_of_one_node(exports, tmp_path):
    def reset(model):
        node = bn_node(model, 2)
        for name, value in ((node.input[3], 0.0), (node.input[4], 1.0)):
            tensor = init(model, name)
            tensor.CopyFrom(numpy_helper.from_array(np.full(tensor.dims, value, np.float32), name))

    path = edited(exports["legacy-kept"], tmp_path / "reset.onnx", reset)
    assert (own_bn_nodes(path)[2]["stats"][3] == 1).all()
    assert codes(inspect(str(path))) == [("BN002", "head.2")]


def test_variance_alone_reset_is_read_as_ones(exports, tmp_path):
    def reset(model):
        tensor = init(model, bn_node(model, 0).input[4])
        tensor.CopyFrom(numpy_helper.from_array(np.ones(tensor.dims, np.float32), tensor.name))

    path = edited(exports["dynamo-kept"], tmp_path / "var.onnx", reset)
    layers = {layer.name: layer for layer in inspect(str(path)).files[0].layers}
    assert layers["features.1"].var_min == layers["features.1"].var_max == 1.0


def test_nan_and_negative_variance_in_a_node(exports, tmp_path):
    def corrupt(model):
        tensor = init(model, bn_node(model, 1).input[4])
        values = numpy_helper.to_array(tensor).copy()
        values[0], values[3] = np.nan, -0.5
        tensor.CopyFrom(numpy_helper.from_array(values, tensor.name))

    path = edited(exports["dynamo-kept"], tmp_path / "nan.onnx", corrupt)
    var = own_bn_nodes(path)[1]["stats"][3]
    bad = sorted(int(c) for c in np.flatnonzero(~np.isfinite(var) | (var < 0)))
    report = inspect(str(path))
    assert codes(report) == [("BN005", "features.4")]
    assert list(report.files[0].findings[0].channels) == bad == [0, 3]


def test_fp16_statistics_are_read_exactly_and_flagged(exports, tmp_path):
    def half(model):
        for name in bn_node(model, 1).input[1:5]:
            tensor = init(model, name)
            tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float16), name))

    path = edited(exports["legacy-kept"], tmp_path / "fp16.onnx", half)
    expected = own_bn_nodes(path)[1]["stats"][3]
    assert expected.dtype == np.float16
    ckpt = read_onnx(str(path))
    assert ckpt.tensors["features.4.running_var"].dtype == "float16"
    assert ckpt.tensors["features.4.running_var"].read() == expected.astype(np.float64).tolist()
    assert codes(inspect(str(path))) == [("BN008", "features.4")]


def test_typed_float_data_fields_are_read_like_raw_bytes(exports, tmp_path):
    def typed(model):
        for name in bn_node(model, 0).input[1:5]:
            tensor = init(model, name)
            values = numpy_helper.to_array(tensor)
            tensor.ClearField("raw_data")
            tensor.float_data.extend(values.tolist())

    path = edited(exports["legacy-kept"], tmp_path / "typed.onnx", typed)
    assert not init(onnx.load(str(path)), "features.1.running_var").raw_data
    assert read_onnx(str(path)).tensors["features.1.running_var"].read() == (
        own_bn_nodes(exports["legacy-kept"])[0]["stats"][3].astype(np.float64).tolist()
    )


def test_statistics_from_constant_nodes_are_audited(exports, tmp_path):
    def as_constant(model):
        name = bn_node(model, 0).input[4]
        tensor = init(model, name)
        model.graph.initializer.remove(tensor)
        model.graph.node.insert(0, helper.make_node("Constant", [], [name], value=tensor, name="stats_constant"))

    path = edited(exports["legacy-kept"], tmp_path / "const.onnx", as_constant)
    ckpt = read_onnx(str(path))
    assert ckpt.tensors["features.1.running_var"].read() == own_bn_nodes(path)[0]["stats"][3].tolist()
    assert codes(inspect(str(path))) == []


def test_statistics_fed_by_a_graph_input_cannot_be_audited(exports, tmp_path):
    def as_input(model):
        name = bn_node(model, 0).input[3]
        tensor = init(model, name)
        model.graph.initializer.remove(tensor)
        model.graph.input.append(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, list(tensor.dims)))

    path = edited(exports["legacy-kept"], tmp_path / "fed.onnx", as_input)
    report = inspect(str(path))
    assert codes(report) == [("BN013", "features.1")]  # the layer named in its field, not only the message
    message = report.files[0].findings[0].message
    assert "input_mean 'features.1.running_mean' is a graph input" in message
    assert sorted(layer.name for layer in report.files[0].layers) == ["features.4", "head.2"]


# ----------------------------------------------------------------------------- hand-built graphs


def bn_model(opset: int, attrs: dict, outputs: int = 1, *, where: str = "main") -> onnx.ModelProto:
    """A graph with one BatchNormalization node of the given opset, in the main graph, in an
    If's then-branch or in a local function; statistics as initializers."""
    c = 3
    inits = [
        numpy_helper.from_array(np.array([1.0, 2.0, 0.5], np.float32), "bn.weight"),
        numpy_helper.from_array(np.array([0.0, 0.1, -0.1], np.float32), "bn.bias"),
        numpy_helper.from_array(np.array([0.3, -0.2, 1.0], np.float32), "bn.running_mean"),
        numpy_helper.from_array(np.array([0.7, 1.3, 2.0], np.float32), "bn.running_var"),
    ]
    outs = ["Y"] + [f"extra{i}" for i in range(outputs - 1)]
    node = helper.make_node("BatchNormalization", ["X", *[t.name for t in inits]], outs, name="bn_node", **attrs)
    x = helper.make_tensor_value_info("X", onnx.TensorProto.FLOAT, [2, c, 4, 4])
    y = helper.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, [2, c, 4, 4])
    functions = []
    if where == "main":
        graph = helper.make_graph([node], "g", [x], [y], inits)
    elif where == "if":
        branch = helper.make_graph([node], "then", [], [y])
        other = helper.make_graph([helper.make_node("Identity", ["X"], ["Y"])], "else", [], [y])
        cond = helper.make_tensor_value_info("cond", onnx.TensorProto.BOOL, [])
        iff = helper.make_node("If", ["cond"], ["Y"], name="If_3", then_branch=branch, else_branch=other)
        graph = helper.make_graph([iff], "g", [cond, x], [y], inits)
    else:  # a local function whose statistics are Constant nodes inside it
        consts = [helper.make_node("Constant", [], [t.name], value=t) for t in inits]
        fn = helper.make_function("local", "Norm", ["X"], ["Y"], [*consts, node], [helper.make_opsetid("", opset)])
        functions = [fn]
        graph = helper.make_graph([helper.make_node("Norm", ["X"], ["Y"], domain="local")], "g", [x], [y])
    return helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("local", 1)],
        functions=functions,
        producer_name="hand",
    )


def save(model: onnx.ModelProto, path: Path) -> str:
    onnx.save(model, str(path))
    return str(path)


@pytest.mark.parametrize(
    "opset, attrs, outputs, training, reason",
    [
        (6, {}, 1, True, "is_test absent (BatchNormalization-6 defaults to 0: training)"),
        (6, {"is_test": 0}, 1, True, "is_test=0"),
        (6, {"is_test": 1}, 1, False, None),
        (7, {"spatial": 1}, 5, True, "5 outputs"),
        (9, {}, 1, False, None),
        (9, {}, 3, True, "3 outputs"),
        (13, {}, 1, False, None),  # opset 13 still means BatchNormalization-9
        (14, {"training_mode": 1}, 3, True, "training_mode=1"),
        (15, {}, 1, False, None),
    ],
)
def test_training_mode_by_operator_version(tmp_path, opset, attrs, outputs, training, reason):
    path = save(bn_model(opset, attrs, outputs), tmp_path / "bn.onnx")
    version = onnx.defs.get_schema("BatchNormalization", opset).since_version
    info = read_onnx(path).modules["bn"]
    assert info.training_mode is training
    assert f"BatchNormalization-{version}, opset {opset}" in info.source
    found = codes(inspect(path))
    assert found == ([("BN012", "bn")] if training else [])
    if reason:
        assert reason in inspect(path).files[0].findings[0].message


@pytest.mark.parametrize("where, graph", [("if", "subgraph main/If_3.then_branch"), ("function", "function Norm,")])
def test_bn_nodes_in_subgraphs_and_functions(tmp_path, where, graph):
    path = save(bn_model(15, {"epsilon": 1e-3, "momentum": 0.99}, where=where), tmp_path / "nested.onnx")
    ckpt = read_onnx(path)
    info = ckpt.modules["bn"]
    assert graph in info.source and info.eps == 1e-3 and info.momentum == 0.01
    assert ckpt.tensors["bn.running_var"].read() == [float(np.float32(v)) for v in (0.7, 1.3, 2.0)]
    paths = {where_ for where_, n in load_onnx(path).nodes() if n.op_type == "BatchNormalization"}
    assert paths == {"main/If_3.then_branch" if where == "if" else "function:Norm"}


# ----------------------------------------------------------------------------- external data and hostile files


@pytest.fixture
def external(exports, tmp_path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    model = onnx.load(str(exports["legacy-kept"]))
    onnx.save_model(
        model,
        str(folder / "model.onnx"),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="weights.bin",
        size_threshold=0,
    )
    return folder / "model.onnx"


def external_entries(model, name):
    return {e.key: e for e in init(model, name).external_data}


def test_external_data_is_read_and_not_audited_on_its_own(external, exports):
    assert (external.parent / "weights.bin").exists()
    expected = own_bn_nodes(exports["legacy-kept"])
    ckpt = read_onnx(str(external))
    for name, node in zip(BN_NAMES, expected):
        assert ckpt.tensors[f"{name}.running_var"].read() == node["stats"][3].astype(np.float64).tolist()
    assert external_data_files(str(external)) == {os.path.realpath(external.parent / "weights.bin")}
    report = inspect(str(external.parent))  # a directory scan: weights.bin belongs to the model
    assert [os.path.basename(f.path) for f in report.files] == ["model.onnx"]
    assert codes(report) == [] and report.exit_code() == 0
    # named together (a pre-commit hook passes every staged file): still audited once
    report = inspect([str(external), str(external.parent / "weights.bin")])
    assert [os.path.basename(f.path) for f in report.files] == ["model.onnx"]


def relocate(path: Path, location: str, name: str = "features.1.running_var") -> None:
    model = onnx.load(str(path), load_external_data=False)
    external_entries(model, name)["location"].value = location
    onnx.save(model, str(path))


def test_location_outside_the_folder_is_refused(external, tmp_path):
    (tmp_path / "outside.bin").write_bytes((external.parent / "weights.bin").read_bytes())
    relocate(external, "../outside.bin")
    one_line_error(cli("inspect", str(external)), "'../outside.bin' leaves the model's folder")


def test_absolute_location_is_refused(external, tmp_path):
    relocate(external, str(external.parent / "weights.bin"))
    one_line_error(cli("inspect", str(external)), "is an absolute path: refused")


def test_symlink_out_of_the_folder_is_refused(external, tmp_path):
    (tmp_path / "outside.bin").write_bytes((external.parent / "weights.bin").read_bytes())
    (external.parent / "link.bin").symlink_to(tmp_path / "outside.bin")
    relocate(external, "link.bin")
    one_line_error(cli("inspect", str(external)), "'link.bin' resolves outside the model's folder")


def test_external_range_past_the_end_of_the_file_is_refused(external):
    model = onnx.load(str(external), load_external_data=False)
    size = (external.parent / "weights.bin").stat().st_size
    external_entries(model, "head.2.running_mean")["offset"].value = str(size - 8)
    onnx.save(model, str(external))
    one_line_error(cli("inspect", str(external)), "past the end of its file")


def test_external_length_that_disagrees_with_the_shape_is_refused(external):
    model = onnx.load(str(external), load_external_data=False)
    external_entries(model, "head.2.running_mean")["length"].value = str(10**15)
    onnx.save(model, str(external))
    one_line_error(cli("inspect", str(external)), "claims 1000000000000000 bytes of external data")


def test_truncated_and_malformed_protobuf_is_one_line(exports, tmp_path):
    data = exports["legacy-kept"].read_bytes()
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(data[: len(data) // 2])
    assert sniff_format(str(truncated)) == "onnx"
    one_line_error(cli("inspect", str(truncated)), "malformed ONNX protobuf")
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(data[:40] + bytes(range(256)) * 4)
    one_line_error(cli("inspect", str(garbage)), "malformed ONNX")


def test_file_over_the_protobuf_limit_is_refused_without_reading(exports, tmp_path):
    big = tmp_path / "big.onnx"
    with open(big, "wb") as f:
        f.write(exports["legacy-kept"].read_bytes()[:64])
        f.truncate(2**31 + 10)  # sparse: nothing is written past the head
    one_line_error(cli("inspect", str(big)), "more than protobuf's 2 GiB limit")


def test_onnx_is_sniffed_from_its_bytes_not_its_name(exports, tmp_path):
    renamed = tmp_path / "model.pt"
    renamed.write_bytes(exports["dynamo-kept"].read_bytes())
    assert sniff_format(str(renamed)) == "onnx"
    not_onnx = tmp_path / "varint.onnx"
    not_onnx.write_bytes(b"\x08\x07\x00\x00 not a model")  # field 1 then field 0: no ModelProto
    one_line_error(cli("inspect", str(not_onnx)), "not a checkpoint")


@pytest.mark.slow
def test_without_the_onnx_package_one_line_names_the_extra(exports):
    code = (
        "import sys; sys.modules['onnx'] = None\n"
        "from bnaudit.cli import main\n"
        f"sys.argv = ['bnaudit', 'inspect', {str(exports['legacy-kept'])!r}]\n"
        "main()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert 'needs the onnx extra: pip install "bnaudit[onnx]"' in lines[0]


def test_key_does_not_apply_to_onnx(exports):
    one_line_error(cli("inspect", str(exports["legacy-kept"]), "--key", "model"), "--key does not apply")


# ----------------------------------------------------------------------------- output formats


def test_json_and_sarif_carry_onnx_layers_and_findings(exports):
    path = str(exports["legacy-training"])
    doc = json.loads(cli("inspect", path, "--format", "json").stdout)
    (file,) = doc["files"]
    assert file["format"] == "onnx" and [layer["name"] for layer in file["layers"]] == BN_NAMES
    assert [f["code"] for f in file["findings"]] == ["BN012"] * 3
    assert file["notes"] and "opset" in file["notes"][0]
    sarif = json.loads(cli("inspect", path, "--format", "sarif").stdout)
    results = sarif["runs"][0]["results"]
    assert [r["ruleId"] for r in results] == ["BN012"] * 3
    rules = {r["id"] for r in sarif["runs"][0]["tool"]["driver"]["rules"]}
    assert {"BN012", "BN013", "BN014"} <= rules


def test_rules_command_documents_the_onnx_rules():
    for code, words in (("BN012", "training_mode"), ("BN013", "graph inputs"), ("BN014", "fold")):
        out = cli("rules", code).stdout
        assert out.startswith(code) and words in out


# ----------------------------------------------------------------------------- other commands


SAMPLE_ONNX = str(REPO / "sample_models" / "onnx" / "digits.onnx")
SAMPLE_ARCH = f"{REPO / 'sample_models' / 'digits_net.py'}:digits_net"
SAMPLE_VAL = str(REPO / "sample_models" / "data" / "digits_val.safetensors")


@pytest.mark.parametrize("arch", [True, False])
def test_gap_and_recalibrate_refuse_an_onnx_model(tmp_path, arch):
    # read_checkpoint yields only the BN tensors of a graph: loaded into --arch they would
    # leave every conv at its random initial value
    extra = ["--arch", SAMPLE_ARCH] if arch else []
    one_line_error(cli("gap", SAMPLE_ONNX, *extra, "--data", SAMPLE_VAL), "an ONNX model cannot be run here")
    out = tmp_path / "out.pt"
    result = cli("recalibrate", SAMPLE_ONNX, *extra, "--data", SAMPLE_VAL, "-o", str(out))
    one_line_error(result, "an ONNX model cannot be run here")
    assert not out.exists()


def test_onnx_model_given_as_data_is_named(tmp_path):
    healthy = str(REPO / "sample_models" / "healthy.pt")
    result = cli("gap", healthy, "--arch", SAMPLE_ARCH, "--data", SAMPLE_ONNX)
    one_line_error(result, "an ONNX model, not a tensor file")


def test_inspect_arch_leaves_an_onnx_graph_to_its_own_nodes():
    path = str(REPO / "sample_models" / "onnx" / "digits_training.onnx")
    report = inspect(path, arch=SAMPLE_ARCH)
    assert codes(report) == [("BN012", n) for n in ("features.1", "features.4", "head.2")]  # no BN011 noise
    assert any("--arch not used" in note for note in report.files[0].notes)


def test_subgraphs_nested_past_protobufs_depth_limit_are_one_line(tmp_path):
    # written field by field: the onnx package itself refuses to build such a model
    def field(number: int, payload: bytes) -> bytes:
        def varint(n: int) -> bytes:
            out = b""
            while True:
                out += bytes([(n & 0x7F) | (0x80 if n > 0x7F else 0)])
                n >>= 7
                if not n:
                    return out

        return varint(number << 3 | 2) + varint(len(payload)) + payload

    graph = b""
    for _ in range(300):
        attribute = field(1, b"then_branch") + field(6, graph) + bytes([0xA0, 0x01, 5])  # name, g, type GRAPH
        graph = field(1, field(5, attribute))  # GraphProto.node{attribute}
    path = tmp_path / "deep.onnx"
    path.write_bytes(b"\x08\x08" + field(7, graph))  # ir_version 8, graph
    one_line_error(cli("inspect", str(path)), "malformed ONNX protobuf")

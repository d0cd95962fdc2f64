"""torch.export archives (`.pt2`, issue 23): read without torch, audited, diffed against checkpoints.

Every archive is written by torch.export.export + torch.export.save from a small trained
network holding BatchNorm1d, 2d (eps 1e-3, one dead channel) and 3d, in eval and training
mode, as exported and after run_decompositions() (the core-ATen one, which keeps a batch-norm
op, and one with a batch-norm decomposition table, which leaves none). Values are checked
against torch.export.load(...).state_dict and the loaded graph's own node arguments; breaks
(pickles, torn and inconsistent archives) are made by rewriting the zip.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import struct
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from bnaudit.api import inspect
from bnaudit.audit.diff.checkpoints import diff
from bnaudit.cli import app
from bnaudit.config import Config
from bnaudit.errors import BnauditError
from bnaudit.formats.read import read_checkpoint
from bnaudit.formats.sniff import sniff_format

REPO = Path(__file__).resolve().parents[1]
torch.set_num_threads(1)

BN3D, BN2D, BN1D = "1", "4", "8"
DEAD = 2  # BN2D's channel whose input is constant: running_var 0
EPS = {BN3D: 1e-5, BN2D: 1e-3, BN1D: 1e-5}
BN_TARGETS = ("batch_norm", "_native_batch_norm_legit")


def make_net() -> torch.nn.Sequential:
    return torch.nn.Sequential(
        torch.nn.Conv3d(2, 4, 3, padding=1),
        torch.nn.BatchNorm3d(4),
        torch.nn.ReLU(),
        torch.nn.Flatten(2, 3),  # (N, 4, D*H, W): a 4-D input for BatchNorm2d
        torch.nn.BatchNorm2d(4, eps=1e-3),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(4, 5),
        torch.nn.BatchNorm1d(5),
        torch.nn.Linear(5, 3),
    )


def trained_net() -> torch.nn.Sequential:
    torch.manual_seed(0)
    net = make_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    for _ in range(8):
        x = torch.randn(8, 2, 3, 4, 4, generator=g) + 0.5
        loss = torch.nn.functional.cross_entropy(net(x), torch.randint(0, 3, (8,), generator=g))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():  # a dead channel: its input never varied
        net[4].running_var[DEAD] = 0.0
    return net.eval()


EXAMPLE = torch.randn(2, 2, 3, 4, 4, generator=torch.Generator().manual_seed(2))


def full_decompositions() -> dict:
    from torch._decomp import get_decompositions

    aten = torch.ops.aten
    return get_decompositions(
        [
            aten._native_batch_norm_legit_no_training,
            aten._native_batch_norm_legit_functional,
            aten._native_batch_norm_legit,
            aten.batch_norm,
            aten.native_batch_norm,
        ]
    )


def export(
    model: torch.nn.Module, path: Path, training: bool = False, decompose: str | None = None, example=None
) -> Path:
    import copy

    model = copy.deepcopy(model).train(training)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.export.export(model, (EXAMPLE if example is None else example,))
        if decompose == "core":
            program = program.run_decompositions()
        elif decompose == "full":
            program = program.run_decompositions(full_decompositions())
        torch.export.save(program, str(path))
    return path


ARCHIVES = {
    "eval": (False, None),
    "training": (True, None),
    "eval-core": (False, "core"),
    "training-core": (True, "core"),
    "eval-full": (False, "full"),
    "training-full": (True, "full"),
}


@pytest.fixture(scope="module")
def net() -> torch.nn.Sequential:
    return trained_net()


@pytest.fixture(scope="module")
def folder(tmp_path_factory, net) -> Path:
    root = tmp_path_factory.mktemp("pt2")
    for name, (training, decompose) in ARCHIVES.items():
        export(net, root / f"{name}.pt2", training, decompose)
    torch.save(net.state_dict(), root / "state.pt")
    torch.save(net, root / "module.pt")
    return root


def loaded(path: Path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.export.load(str(path))


def graph_nodes(program) -> dict[str, dict]:
    """Layer -> the arguments of its batch-norm node, read from torch's own loaded graph."""
    sig = program.graph_signature
    names = {**sig.inputs_to_parameters, **sig.inputs_to_buffers}
    out = {}
    for node in program.graph.nodes:
        if node.op != "call_function" or not any(t in str(node.target) for t in BN_TARGETS):
            continue
        schema = [a.name for a in node.target._schema.arguments]
        args = {**dict(zip(schema, node.args)), **node.kwargs}
        layer = names[args["running_mean"].name].removesuffix(".running_mean")
        out[layer] = {
            "eps": args["eps"],
            "momentum": args["momentum"],
            "training": args.get("training", "no_training" not in str(node.target)),
            "fqns": {k: names[args[k].name] for k in ("weight", "bias", "running_mean", "running_var")},
        }
    return out


def findings(report) -> list[tuple[str, str, str | None]]:
    return [(f.code, str(f.severity), f.layer) for file in report.files for f in file.findings]


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


def rewrite(src: Path, dst: Path, change) -> Path:
    """Copy the archive entry by entry; `change(name, data)` returns new bytes, or None to drop."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = change(info.filename, zin.read(info.filename))
            if data is not None:
                zout.writestr(info.filename, data)
    return dst


def edit_json(suffix: str, edit):
    def change(name: str, data: bytes) -> bytes:
        if name.endswith(suffix):
            doc = json.loads(data)
            edit(doc)
            return json.dumps(doc).encode()
        return data

    return change


# ----------------------------------------------------------------------------- reading


@pytest.mark.slow
@pytest.mark.parametrize("name", ["eval", "training", "eval-core", "training-core"])
def test_bn_nodes_are_read_with_torchs_values_and_the_nodes_arguments(folder, net, name):
    path = folder / f"{name}.pt2"
    assert sniff_format(str(path)) == "pt2"
    ckpt = read_checkpoint(str(path))
    program = loaded(path)
    nodes = graph_nodes(program)
    assert sorted(nodes) == sorted(EPS)
    assert sorted(ckpt.modules) == sorted(EPS)
    for layer, node in nodes.items():
        for leaf, fqn in node["fqns"].items():
            assert fqn == f"{layer}.{leaf}"  # the signature gives the module's own names
            ref = ckpt.tensors[fqn]
            expected = program.state_dict[fqn].detach()
            assert ref.shape == tuple(expected.shape) and ref.dtype == "float32"
            assert ref.read() == expected.reshape(-1).tolist()
            assert ref.read() == net.state_dict()[fqn].reshape(-1).tolist()
        counter = ckpt.tensors[f"{layer}.num_batches_tracked"].read()
        assert counter == [int(program.state_dict[f"{layer}.num_batches_tracked"])] == [8]
        info = ckpt.modules[layer]
        assert info.eps == node["eps"] == EPS[layer]
        assert info.momentum == node["momentum"] == 0.1
        assert info.training_mode is node["training"] is (name.startswith("training"))
    assert ckpt.not_loaded == ["data/sample_inputs/model.pt: sample inputs (a pickle): not read"]
    assert ckpt.decomposed is None and ckpt.unauditable == []


@pytest.mark.slow
@pytest.mark.parametrize("name", ["eval-full", "training-full"])
def test_a_decomposed_program_is_read_from_its_buffers(folder, net, name):
    path = folder / f"{name}.pt2"
    program = loaded(path)
    assert not graph_nodes(program)  # no batch-norm node left
    ckpt = read_checkpoint(str(path))
    assert sorted(ckpt.modules) == sorted(EPS)
    for fqn, ref in ckpt.tensors.items():
        assert ref.read() == program.state_dict[fqn].detach().reshape(-1).tolist()
    training = name.startswith("training")
    for layer, info in ckpt.modules.items():
        assert info.training_mode is training
        # add(running_var, eps) in eval mode, add(batch variance, eps) in training mode
        assert info.eps == net[int(layer)].eps
        assert info.momentum == (0.1 if training else None)
    assert ckpt.decomposed is not None and "3 layers" in ckpt.decomposed


@pytest.mark.slow
def test_reading_imports_neither_torch_nor_numpy(folder):
    probe = (
        "import json, sys\n"
        "from bnaudit.formats.read import read_checkpoint\n"
        "from bnaudit.api import inspect\n"
        "for p in sys.argv[1:]:\n"
        "    c = read_checkpoint(p)\n"
        "    [t.read() for t in c.tensors.values()]\n"
        "    inspect(p)\n"
        "print(json.dumps({m: m in sys.modules for m in ('torch', 'numpy')}))\n"
    )
    paths = [str(folder / f"{n}.pt2") for n in ("eval", "training-full")]
    proc = subprocess.run(
        [sys.executable, "-c", probe, *paths],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"torch": False, "numpy": False}


# ----------------------------------------------------------------------------- inspect rules


def test_eval_program_gets_the_checkpoint_rules_with_the_real_eps(folder):
    report = inspect(str(folder / "eval.pt2"))
    (file,) = report.files
    assert file.format == "pt2" and file.error is None
    assert report.exit_code() == 1
    near = [f for f in file.findings if f.code == "BN004"]
    assert [(f.layer, f.channels) for f in near] == [(BN2D, (DEAD,))]
    assert "BN012" not in {f.code for f in file.findings}
    assert any("eps and momentum from its nodes" in n for n in file.notes)


@pytest.mark.parametrize("name", ["training", "training-core", "training-full"])
def test_training_mode_program_is_an_error_per_layer_with_the_fix(folder, name):
    report = inspect(str(folder / f"{name}.pt2"))
    training = [f for f in report.files[0].findings if f.code == "BN012"]
    assert sorted(f.layer for f in training) == sorted(EPS)
    for f in training:
        assert str(f.severity) == "error"
        assert "model.eval() before torch.export.export" in f.message


@pytest.mark.parametrize("name", ["eval-full", "training-full"])
def test_decomposed_program_is_said_once(folder, name):
    report = inspect(str(folder / f"{name}.pt2"))
    notes = [f for f in report.files[0].findings if f.code == "BN014"]
    assert len(notes) == 1 and str(notes[0].severity) == "info"
    assert "no batch-norm node" in notes[0].message and "run_decompositions" in notes[0].message


def test_folder_scan_picks_up_pt2(folder, tmp_path):
    scan = tmp_path / "exports"
    scan.mkdir()
    (scan / "model.pt2").write_bytes((folder / "eval.pt2").read_bytes())
    (scan / "state.pt").write_bytes((folder / "state.pt").read_bytes())
    report = inspect(str(scan))
    formats = {os.path.basename(f.path): f.format for f in report.files}
    assert formats == {"model.pt2": "pt2", "state.pt": "torch-zip"}


def test_sniffed_from_bytes_not_the_name(folder, tmp_path):
    renamed = tmp_path / "weights.bin"
    renamed.write_bytes((folder / "eval.pt2").read_bytes())
    assert sniff_format(str(renamed)) == "pt2"
    # archive_format saying something else: not a .pt2 (and not a torch.save file either)
    other = rewrite(
        folder / "eval.pt2", tmp_path / "other.pt2", lambda n, d: b"xyz" if n.endswith("/archive_format") else d
    )
    with pytest.raises(BnauditError):
        sniff_format(str(other))


def test_a_gpu_node_is_a_note_and_its_epsilon_is_read(folder, tmp_path):
    def to_cudnn(doc):
        for node in doc["graph_module"]["graph"]["nodes"]:
            if node["target"] == "torch.ops.aten.batch_norm.default":
                node["target"] = "torch.ops.aten.cudnn_batch_norm.default"
                renames = {"momentum": "exponential_average_factor", "eps": "epsilon"}
                node["inputs"] = [
                    {**i, "name": renames.get(i["name"], i["name"])}
                    for i in node["inputs"]
                    if i["name"] != "cudnn_enabled"
                ]

    path = rewrite(folder / "eval.pt2", tmp_path / "gpu.pt2", edit_json("models/model.json", to_cudnn))
    ckpt = read_checkpoint(str(path))
    assert {n: m.eps for n, m in ckpt.modules.items()} == EPS
    assert all(m.training_mode is False for m in ckpt.modules.values())
    report = inspect(str(path))
    gpu = [n for n in report.files[0].notes if "cudnn_batch_norm" in n]
    assert len(gpu) == 3 and all("exported on a GPU" in n for n in gpu)


# ----------------------------------------------------------------------------- never unpickled


class _Hostile:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.slow
def test_hostile_sample_inputs_and_pickled_weights_never_run(folder, tmp_path):
    marker = tmp_path / "marker"
    payload = pickle.dumps(_Hostile(str(marker)))
    # the payload is real: unpickling it creates its own marker
    proof = tmp_path / "proof"
    pickle.loads(pickle.dumps(_Hostile(str(proof))))
    assert proof.exists()

    def change(name: str, data: bytes) -> bytes:
        if name.endswith("data/sample_inputs/model.pt"):
            return payload
        if name.endswith("model_weights_config.json"):
            doc = json.loads(data)
            doc["config"][f"{BN2D}.running_var"]["use_pickle"] = True
            return json.dumps(doc).encode()
        return data

    hostile = rewrite(folder / "eval.pt2", tmp_path / "hostile.pt2", change)
    # the storage file the pickled entry names becomes the payload too
    ckpt = read_checkpoint(str(hostile))
    assert f"{BN2D}.running_var" not in ckpt.tensors and BN2D not in ckpt.modules
    assert sorted(ckpt.modules) == [BN3D, BN1D]
    assert any(f"{BN2D}.running_var" in n and "pickled tensor, not read" in n for n in ckpt.not_loaded)
    assert any("sample inputs (a pickle): not read" in n for n in ckpt.not_loaded)
    assert len(ckpt.unauditable) == 1 and "cannot be audited" in ckpt.unauditable[0]
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        report = inspect(str(hostile))
        assert ("BN013", "info", None) in findings(report)
        result = cli("inspect", str(hostile))
        assert result.exit_code in (0, 1)
        result = cli("diff", str(folder / "state.pt"), str(hostile))
        assert result.exit_code in (0, 1), result.stderr
        assert "BN013" in result.stdout  # the pickled node cannot be compared: the same code as in inspect
    finally:
        os.chdir(cwd)
    assert not marker.exists()
    assert not (tmp_path / "marker").exists()


# ----------------------------------------------------------------------------- torn archives


def _drop(suffix: str):
    return lambda n, d: None if n.endswith(suffix) else d


def _weights(edit):
    return edit_json("model_weights_config.json", edit)


def _escape(doc):
    doc["config"][f"{BN2D}.running_var"]["path_name"] = "../../../etc/passwd"


def _too_large(doc):
    doc["config"][f"{BN2D}.running_var"]["tensor_meta"]["sizes"] = [{"as_int": 1000}]


def _offset_past_end(doc):
    doc["config"][f"{BN2D}.running_var"]["tensor_meta"]["storage_offset"] = {"as_int": 2}


def _missing_storage(doc):
    doc["config"][f"{BN2D}.running_var"]["path_name"] = "weight_999"


TORN = {
    "path leaves the folder": (_weights(_escape), "not a file in its folder"),
    "sizes past the storage": (_weights(_too_large), "holds 4 float32 items"),
    "offset past the storage": (_weights(_offset_past_end), "reach item 5"),
    "storage file absent": (_weights(_missing_storage), "does not hold"),
    "no weights config": (_drop("model_weights_config.json"), "neither"),
    "graph not JSON": (lambda n, d: d[:100] if n.endswith("models/model.json") else d, "is not JSON"),
    "entry outside the root": (lambda n, d: d, "outside the root folder"),
}


@pytest.mark.parametrize("case", sorted(TORN))
def test_torn_or_inconsistent_archives_are_one_line_and_exit_2(folder, tmp_path, case):
    change, words = TORN[case]
    path = rewrite(folder / "eval.pt2", tmp_path / "torn.pt2", change)
    if case == "entry outside the root":
        with zipfile.ZipFile(path, "a") as zf:
            zf.writestr("elsewhere/data/x", b"1")
    one_line_error(cli("inspect", str(path)), words)
    one_line_error(cli("diff", str(folder / "state.pt"), str(path)), words)


def test_truncated_archive_is_one_line_and_exit_2(folder, tmp_path):
    data = (folder / "eval.pt2").read_bytes()
    path = tmp_path / "cut.pt2"
    path.write_bytes(data[: len(data) // 2])
    one_line_error(cli("inspect", str(path)))
    # the zip's directory intact but a statistic's storage bytes overwritten: its CRC fails, one line
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        infos = {i.filename: i for i in zf.infolist()}
        config = json.loads(zf.read(next(n for n in infos if n.endswith("model_weights_config.json"))))
    storage = config["config"][f"{BN2D}.running_var"]["path_name"]
    weight = infos[next(n for n in infos if n.endswith(f"data/weights/{storage}"))]
    # the local header's name and extra-field lengths (torch pads the extra field to align the data)
    name_len, extra_len = struct.unpack("<HH", data[weight.header_offset + 26 : weight.header_offset + 30])
    start = weight.header_offset + 30 + name_len + extra_len
    damaged = bytearray(data)
    damaged[start : start + weight.compress_size] = b"\x00" * weight.compress_size
    (tmp_path / "zeros.pt2").write_bytes(bytes(damaged))
    one_line_error(cli("inspect", str(tmp_path / "zeros.pt2")), f"{BN2D}.running_var", "CRC")


# ----------------------------------------------------------------------------- diff


@pytest.mark.slow
def test_diff_program_against_its_checkpoint(folder, net, tmp_path):
    state, module = str(folder / "state.pt"), str(folder / "module.pt")
    for a, b in ((module, folder / "eval.pt2"), (folder / "eval.pt2", module)):
        report = diff(str(a), str(b))
        assert report.export is not None and report.export.kind == "a torch.export program"
        assert sorted(n.name for n in report.export.nodes) == sorted(EPS)
        assert not report.findings, report.findings
        assert report.exit_code() == 0
        diagnosis = report.diagnosis()
        assert any(line.startswith("The export matches the checkpoint") for line in diagnosis), diagnosis
        assert not any("differs" in line for line in diagnosis), diagnosis
    # eps read from both sides differs: an error, in either order
    other = trained_net()
    other[4].eps = 1e-2
    wrong_eps = export(other, tmp_path / "eps.pt2")
    for a, b in ((module, wrong_eps), (wrong_eps, module)):
        report = diff(str(a), str(b))
        assert [(f.code, str(f.severity), f.layer) for f in report.findings] == [("BN109", "error", BN2D)]
        assert report.exit_code() == 1
    # the state dict holds no eps: the program traced the model's own modules, so its eps is the
    # checkpoint's (known, not assumed: issue 34), and nothing is left to compare
    report = diff(state, str(wrong_eps))
    assert report.findings == [] and report.settings == ""
    (node,) = [n for n in report.export.nodes if n.name == BN2D]
    assert node.eps_checkpoint == pytest.approx(1e-2) and node.checkpoint.eps.known
    # statistics that are not the checkpoint's
    other = trained_net()
    with torch.no_grad():
        other[8].running_mean.add_(0.5)
    stale = export(other, tmp_path / "stale.pt2")
    report = diff(module, str(stale))
    assert [(f.code, f.layer) for f in report.findings] == [("BN108", BN1D)]
    assert report.exit_code() == 1
    # training mode, kept node or decomposed
    for name in ("training", "training-core", "training-full"):
        report = diff(module, str(folder / f"{name}.pt2"))
        assert sorted(f.layer for f in report.findings if f.code == "BN012") == sorted(EPS)
        assert "BN109" not in {f.code for f in report.findings}
        assert report.exit_code() == 1


@pytest.mark.slow
def test_diff_a_decomposed_eval_program_checks_its_arithmetic_eps(folder, tmp_path):
    module = str(folder / "module.pt")
    report = diff(module, str(folder / "eval-full.pt2"))
    assert not report.findings and report.exit_code() == 0
    assert all(n.eps_known for n in report.export.nodes)
    other = trained_net()
    other[1].eps = 1e-3
    wrong = export(other, tmp_path / "wrong-full.pt2", decompose="full")
    report = diff(module, str(wrong))
    assert [(f.code, str(f.severity), f.layer) for f in report.findings] == [("BN109", "error", BN3D)]
    # the training arithmetic shows it too (on the batch variance)
    wrong = export(other, tmp_path / "wrong-training-full.pt2", training=True, decompose="full")
    report = diff(module, str(wrong))
    assert sorted((f.code, f.layer) for f in report.findings if f.code in ("BN109", "BN012")) == [
        *[("BN012", layer) for layer in sorted(EPS)],
        ("BN109", BN3D),
    ]


@pytest.mark.slow
def test_diff_reports_layers_on_one_side_only(folder, tmp_path):
    state = torch.load(folder / "state.pt")
    extra = {**state, **{f"extra.{k}": v.clone() for k, v in state.items() if k.startswith(f"{BN1D}.")}}
    torch.save(extra, tmp_path / "extra.pt")
    result = cli("diff", str(tmp_path / "extra.pt"), str(folder / "eval.pt2"))
    assert result.exit_code == 1
    report = diff(str(tmp_path / "extra.pt"), str(folder / "eval.pt2"))
    assert [(f.code, f.layer) for f in report.findings if f.code == "BN113"] == [("BN113", f"extra.{BN1D}")]
    # the program's extra layer (the checkpoint lost one): listed on the program's side
    fewer = {k: v for k, v in state.items() if not k.startswith(f"{BN1D}.")}
    torch.save(fewer, tmp_path / "fewer.pt")
    report = diff(str(tmp_path / "fewer.pt"), str(folder / "eval.pt2"))
    assert report.only_b == [BN1D]
    assert [(f.code, str(f.severity), f.layer) for f in report.findings if f.code != "BN109"] == [
        ("BN113", "warning", BN1D)
    ]
    result = cli("diff", "--format", "json", str(tmp_path / "fewer.pt"), str(folder / "eval.pt2"))
    assert result.exit_code == 1
    assert json.loads(result.stdout)["only_b"] == [BN1D]


def test_a_matching_export_is_not_said_to_differ():
    # the settings merge attached "The export differs ..." to the eps note's `if`: every
    # export diff with known settings said both "matches" and "differs"
    report = diff(
        str(REPO / "sample_models/healthy.pt"),
        str(REPO / "sample_models/onnx/digits.onnx"),
        config=Config(eps=1e-5, momentum=0.1),
    )
    assert not report.findings
    assert [line.split(":")[0] for line in report.diagnosis() if "export" in line] == [
        "The export matches the checkpoint"
    ]


@pytest.mark.slow
def test_json_and_sarif_of_a_program_diff():
    healthy, training = str(REPO / "sample_models/healthy.pt"), str(REPO / "sample_models/pt2/training.pt2")
    result = cli("diff", "--format", "json", healthy, training)
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert doc["b"]["format"] == "pt2" and doc["export"]["kind"] == "pt2"
    assert sorted((f["code"], f["layer"]) for f in doc["findings"]) == [
        ("BN012", "features.1"),
        ("BN012", "features.4"),
        ("BN012", "head.2"),
    ]
    result = cli("diff", "--format", "sarif", healthy, training)
    assert result.exit_code == 1
    sarif = json.loads(result.stdout)
    assert sorted(r["ruleId"] for r in sarif["runs"][0]["results"]) == ["BN012"] * 3


def test_legacy_weights_custom_objects_and_compiled_code_are_named_not_read(folder, tmp_path):
    pickled = pickle.dumps(_Hostile(str(tmp_path / "marker")))

    def change(name: str, data: bytes) -> bytes | None:
        if name.endswith("model_weights_config.json") or "/data/weights/weight_" in name:
            return None  # the legacy layout: one pickled data/weights/model.pt instead
        if name.endswith("model_constants_config.json"):
            entry = {"path_name": "custom_obj_0", "is_param": False, "use_pickle": True, "tensor_meta": None}
            return json.dumps({"config": {"packed": entry}}).encode()
        return data

    path = rewrite(folder / "eval.pt2", tmp_path / "legacy.pt2", change)
    root = zipfile.ZipFile(path).namelist()[0].split("/")[0]
    with zipfile.ZipFile(path, "a") as zf:
        zf.writestr(f"{root}/data/weights/model.pt", pickled)
        zf.writestr(f"{root}/data/constants/custom_obj_0", pickled)
        zf.writestr(f"{root}/data/aotinductor/model/model.so", b"\x7fELF")
    ckpt = read_checkpoint(str(path))
    assert ckpt.tensors == {} and ckpt.modules == {}
    notes = "\n".join(ckpt.not_loaded)
    assert "data/weights/model.pt: legacy weights (a pickle): not read" in notes
    assert "data/constants/custom_obj_0 (packed): a custom object, not read" in notes
    assert "data/aotinductor/ holds AOTInductor-compiled code and weights: not audited" in notes
    assert len(ckpt.unauditable) == 3  # one per BN node: its tensors are in the pickle
    assert all("cannot be audited" in u for u in ckpt.unauditable)
    result = cli("inspect", str(path))
    assert result.exit_code == 0, result.stdout  # infos only: nothing that could be read is wrong
    assert "BN013" in result.stdout and "AOTInductor" in result.stdout
    assert not (tmp_path / "marker").exists()


def test_a_program_without_its_graph_is_a_compiled_package(folder, tmp_path):
    path = rewrite(folder / "eval.pt2", tmp_path / "aoti.pt2", lambda n, d: None if "/models/" in n else d)
    root = zipfile.ZipFile(path).namelist()[0].split("/")[0]
    with zipfile.ZipFile(path, "a") as zf:
        zf.writestr(f"{root}/data/aotinductor/model/model.so", b"\x7fELF")
    ckpt = read_checkpoint(str(path))
    assert ckpt.modules == {} and any("without an exported program" in u for u in ckpt.unauditable)
    # without models/ and without compiled code it is no archive of a program at all
    bare = rewrite(folder / "eval.pt2", tmp_path / "bare.pt2", lambda n, d: None if "/models/" in n else d)
    one_line_error(cli("inspect", str(bare)), "no models/<name>.json")


def test_a_node_without_running_statistics_is_batch_dependent_not_training(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4, track_running_stats=False))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.export.save(torch.export.export(model.eval(), (torch.randn(2, 3),)), str(tmp_path / "nostats.pt2"))
    ckpt = read_checkpoint(str(tmp_path / "nostats.pt2"))
    assert ckpt.tensors == {} and ckpt.modules["1"].track_running_stats is False
    codes = {(f.code, str(f.severity), f.layer) for f in inspect(str(tmp_path / "nostats.pt2")).files[0].findings}
    assert codes == {("BN006", "warning", "1")}


def test_a_program_is_not_run_by_the_commands_that_run_checkpoints():
    program = str(REPO / "sample_models/pt2/eval.pt2")
    val = str(REPO / "sample_models/data/digits_val.safetensors")
    one_line_error(cli("gap", program, "--data", val), "torch.export program is not run here")
    arch = f"{REPO / 'sample_models/digits_net.py'}:digits_net"
    healthy = str(REPO / "sample_models/healthy.pt")
    one_line_error(cli("gap", healthy, "--arch", arch, "--data", program), "a torch.export archive")


@pytest.mark.parametrize("whole", [True, False])
def test_strided_views_of_a_shared_storage_are_read_element_by_element(tmp_path, monkeypatch, whole):
    from bnaudit.formats import pt2archive

    if not whole:  # the range read of large storages, on a small one
        monkeypatch.setattr(pt2archive, "_WHOLE_READ", 0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    storage = torch.rand(11) + 0.5
    model[1].running_var = storage[3::2]  # offset 3, stride 2 in an 11-item storage
    model[1].running_mean = storage[1:5]
    path = tmp_path / "strided.pt2"
    export(model, path, example=torch.randn(2, 3))
    ckpt = read_checkpoint(str(path))
    program = loaded(path)
    for leaf in ("running_mean", "running_var"):
        expected = program.state_dict[f"1.{leaf}"]
        assert ckpt.tensors[f"1.{leaf}"].read() == expected.reshape(-1).tolist()
    assert ckpt.tensors["1.running_var"].read() == storage[3::2].tolist()


def test_an_eval_node_of_a_cumulative_average_module_does_not_claim_momentum_zero(tmp_path):
    # BatchNorm.forward passes exponential_average_factor 0.0 in eval mode when momentum is None
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4, momentum=None))
    path = export(model, tmp_path / "cumulative.pt2", example=torch.randn(2, 3))
    assert graph_nodes(loaded(path))["1"]["momentum"] == 0.0
    info = read_checkpoint(str(path)).modules["1"]
    assert info.momentum_known is False and info.eps == 1e-5
    assert "BN007" not in {f.code for f in inspect(str(path)).files[0].findings}


def test_json_keeps_program_names_exact_and_the_terminal_escapes_them(tmp_path, cli):
    # the reader keeps names as the archive has them; only output/ escapes, for terminals
    hostile = "batch\u202enorm"  # a right-to-left override, as a hostile archive could carry

    def change(name: str, data: bytes) -> bytes:
        if name.endswith(".json") and "/models/" in f"/{name}":
            return data.replace(b'"batch_norm"', json.dumps(hostile).encode())
        return data

    path = rewrite(REPO / "sample_models/pt2/training.pt2", tmp_path / "hostile.pt2", change)
    doc = json.loads(cli("inspect", str(path), "--format", "json").stdout)
    messages = [f["message"] for file in doc["files"] for f in file["findings"] if f["code"] == "BN012"]
    assert any(f"node '{hostile}'" in m for m in messages), messages
    # the table groups the three layers' BN012 into one row without node names; -q keeps them
    table = cli("inspect", str(path), "-q", width=200).stdout
    assert "\u202e" not in table and "batch\\u202enorm" in table

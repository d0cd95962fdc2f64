"""torch.distributed.checkpoint folders: read without running code, sharded tensors
assembled exactly, every value equal to what torch's own dcp_to_torch_save writes."""

from __future__ import annotations

import os
import pickle
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import SAMPLES, run_ranks
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

import bnaudit
from bnaudit.errors import BnauditError
from bnaudit.formats.dcp import read_dcp_layout
from bnaudit.formats.read import read_checkpoint
from bnaudit.formats.sniff import sniff_format
from bnaudit.runtime.models import ModelSpec

ARCH = f"{SAMPLES}/digits_net.py:digits_net"
VAL = f"{SAMPLES}/data/digits_val.safetensors"


def trained_with_optimizer(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A conv-BN net after a few real SGD steps with momentum: BN statistics and momentum
    buffers that are not their initial values."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 36, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        x = torch.randn(8, 3, 8, 8) * 2 + 0.5
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def save_dcp(state: dict, folder: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=str(folder))
    return folder


def torch_reference(folder: Path, tmp_path: Path) -> dict:
    """torch's own conversion of the folder to one torch.save file, loaded."""
    out = tmp_path / f"{folder.name}-reference.pt"
    dcp_to_torch_save(str(folder), str(out))
    return torch.load(out, weights_only=True)


def assert_same_values(ckpt, reference: dict) -> None:
    assert set(ckpt.tensors) == set(reference)
    for name, expected in reference.items():
        ref = ckpt.tensors[name]
        assert ref.shape == tuple(expected.shape) and ref.dtype == str(expected.dtype).removeprefix("torch.")
        assert ref.read() == expected.reshape(-1).tolist(), name
        assert torch.equal(ref.to_torch(), expected), name


def test_single_process_folder_reads_as_the_model_with_every_value_torchs(tmp_path: Path) -> None:
    model, opt = trained_with_optimizer()
    folder = save_dcp({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path / "ckpt")
    assert sniff_format(str(folder)) == "dcp"
    ckpt = read_checkpoint(str(folder))
    assert ckpt.format == "dcp" and ckpt.key == "model"
    reference = torch_reference(folder, tmp_path)
    assert_same_values(ckpt, reference["model"])
    # the optimizer's state is a part of the folder, never audited
    assert "optim" in reference and not any("momentum_buffer" in n for n in ckpt.tensors)
    assert torch.equal(ckpt.tensors["1.running_var"].to_torch(), model[1].running_var)


def test_nested_parts_and_key(tmp_path: Path) -> None:
    model, opt = trained_with_optimizer()
    ema, _ = trained_with_optimizer(seed=5)
    folder = save_dcp(
        {"app": {"model": model.state_dict(), "ema": ema.state_dict()}, "optim": opt.state_dict()},
        tmp_path / "nested",
    )
    chosen = read_checkpoint(str(folder))
    assert chosen.key == "app/model" and "app/ema" in chosen.other_keys
    assert chosen.tensors["1.running_mean"].read() == model[1].running_mean.tolist()
    other = read_checkpoint(str(folder), key="app/ema")
    assert other.tensors["1.running_mean"].read() == ema[1].running_mean.tolist()
    with pytest.raises(BnauditError, match="no state dict under key 'optim'"):
        read_checkpoint(str(folder), key="optim")


def test_a_flat_state_dict_is_the_root(tmp_path: Path) -> None:
    model, _ = trained_with_optimizer()
    folder = save_dcp(model.state_dict(), tmp_path / "flat")
    ckpt = read_checkpoint(str(folder))
    assert ckpt.key is None
    assert_same_values(ckpt, torch_reference(folder, tmp_path))


def rewrite_metadata(folder: Path, change) -> None:
    path = folder / ".metadata"
    with open(path, "rb") as f:
        metadata = pickle.load(f)  # the test's own trusted file, as torch reads it
    change(metadata)
    with open(path, "wb") as f:
        pickle.dump(metadata, f)


class Payload:
    """What an attacker pickles in place of a dataclass: unpickling it creates `marker`."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("where", ["root", "tensor entry", "storage record", "planner data"])
def test_hostile_metadata_runs_nothing(tmp_path: Path, where: str) -> None:
    model, opt = trained_with_optimizer()
    folder = save_dcp({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path / "hostile")
    marker = tmp_path / "marker"
    payload = Payload(str(marker))
    if where == "root":
        (folder / ".metadata").write_bytes(pickle.dumps(payload))
    elif where == "tensor entry":
        rewrite_metadata(folder, lambda m: m.state_dict_metadata.__setitem__("model.1.running_var", payload))
    elif where == "storage record":
        rewrite_metadata(folder, lambda m: m.storage_data.__setitem__(next(iter(m.storage_data)), payload))
    else:
        rewrite_metadata(folder, lambda m: setattr(m, "planner_data", {"model.1.weight": payload}))
    # the control: pickle itself would run it
    pickle.loads((folder / ".metadata").read_bytes())
    assert marker.exists()
    marker.unlink()
    with pytest.raises(BnauditError, match="refused to unpickle: it calls a global that could run code"):
        read_checkpoint(str(folder))
    report = bnaudit.inspect(str(folder))
    assert report.files[0].error is not None and "(io.open)" in report.files[0].error
    assert not marker.exists()


def test_chunk_files_outside_the_folder_and_ranges_past_the_end_are_refused(tmp_path: Path) -> None:
    model, _ = trained_with_optimizer()

    def fresh(name: str) -> Path:
        return save_dcp({"model": model.state_dict()}, tmp_path / name)

    def retarget(**fields):
        def change(m):
            for info in m.storage_data.values():
                for k, v in fields.items():
                    setattr(info, k, v(info) if callable(v) else v)

        return change

    outside = tmp_path / "outside.distcp"
    outside.write_bytes((fresh("src") / "__0_0.distcp").read_bytes())
    cases = {
        "dotdot": (retarget(relative_path="../outside.distcp"), "leaves the checkpoint's folder"),
        "absolute": (retarget(relative_path=str(outside)), "is absolute"),
        "past_end": (retarget(length=lambda i: i.length + 10_000_000), "which holds"),
        "missing": (retarget(relative_path="__7_0.distcp"), "missing chunk file"),
    }
    for name, (change, message) in cases.items():
        folder = fresh(name)
        rewrite_metadata(folder, change)
        with pytest.raises(BnauditError, match=message):
            read_checkpoint(str(folder))
    link = fresh("symlink")
    (link / "__0_0.distcp").unlink()
    (link / "__0_0.distcp").symlink_to(outside)
    with pytest.raises(BnauditError, match="symlink out of the checkpoint's folder"):
        read_checkpoint(str(link))


def test_chunks_must_tile_the_tensor(tmp_path: Path) -> None:
    """running_var split into two chunks by hand: [0, 2) and [2, 4) reads back exactly;
    [0, 2) and [1, 3) (an overlap with a gap) are refused when read, the same stored bytes
    named for two chunks when the layout is read (before anything is allocated), and a
    chunk past the shape too."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    model, _ = trained_with_optimizer()
    var = model[1].running_var.clone()

    def split(second_offset: int, second_size: int = 2):
        folder = tmp_path / f"split{second_offset}-{second_size}"
        halves = {"a": var[:2].clone(), "b": var[second_offset : second_offset + second_size].clone()}
        save_dcp(halves, folder)

        def change(m):
            info = {k.fqn: v for k, v in m.storage_data.items()}
            m.state_dict_metadata = {
                "running_var": type(m.state_dict_metadata["a"])(
                    properties=m.state_dict_metadata["a"].properties,
                    size=torch.Size([4]),
                    chunks=[
                        ChunkStorageMetadata(torch.Size([0]), torch.Size([2])),
                        ChunkStorageMetadata(torch.Size([second_offset]), torch.Size([second_size])),
                    ],
                )
            }
            m.storage_data = {
                MetadataIndex("running_var", [0]): info["a"],
                MetadataIndex("running_var", [second_offset]): info["b"],
            }
            m.planner_data = {"running_var": ("running_var",)}

        rewrite_metadata(folder, change)
        return str(folder)

    exact = read_checkpoint(split(2))
    assert exact.tensors["running_var"].read() == var.tolist()
    with pytest.raises(BnauditError, match="two chunks of 'running_var' share bytes"):
        read_checkpoint(split(0))
    overlapping = read_checkpoint(split(1))
    with pytest.raises(BnauditError, match="overlap"):
        overlapping.tensors["running_var"].read()
    with pytest.raises(BnauditError, match="overlap"):
        overlapping.tensors["running_var"].to_torch()
    assert torch.equal(exact.tensors["running_var"].to_torch(), var)
    with pytest.raises(BnauditError, match="runs past its shape"):
        read_checkpoint(split(3))


def test_inspect_scans_a_dcp_folder_as_one_checkpoint(tmp_path: Path) -> None:
    model, opt = trained_with_optimizer()
    run = tmp_path / "run"
    save_dcp({"model": model.state_dict(), "optim": opt.state_dict()}, run / "step-3")
    report = bnaudit.inspect(str(run))
    assert [f.path for f in report.files] == [str(run / "step-3")]
    assert report.files[0].format == "dcp" and report.files[0].error is None
    assert [layer.name for layer in report.files[0].layers] == ["1"]


def test_objects_are_never_unpickled(tmp_path: Path) -> None:
    model, opt = trained_with_optimizer()
    folder = save_dcp({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path / "objects")
    layout = read_dcp_layout(str(folder))
    metadata = pickle.loads((folder / ".metadata").read_bytes())
    objects = [k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)]
    assert sorted(layout.objects) == sorted(objects) and "optim.param_groups.0.lr" in objects


def test_diff_of_a_dcp_folder_against_the_torch_file_it_was_saved_from(tmp_path: Path) -> None:
    state = torch.load(f"{SAMPLES}/healthy.pt", weights_only=True)
    folder = save_dcp({"model": state}, tmp_path / "healthy")
    report = bnaudit.diff(str(folder), f"{SAMPLES}/healthy.pt")
    assert report.a.format == "dcp" and report.a.layers == report.b.layers == 3
    assert len(report.layers) == 3
    assert all(d.weight_identical and d.bias_identical and d.mean_identical and d.var_identical for d in report.layers)


def test_gap_with_arch_reads_the_folder_as_the_torch_file(tmp_path: Path) -> None:
    state = torch.load(f"{SAMPLES}/healthy.pt", weights_only=True)
    folder = save_dcp({"model": state, "step": 3}, tmp_path / "healthy")
    options = bnaudit.DataOptions(path=VAL, num_samples=64, batch_size=32)
    from_folder = bnaudit.measure_gap(ModelSpec(str(folder), arch=ARCH), options)
    from_file = bnaudit.measure_gap(ModelSpec(f"{SAMPLES}/healthy.pt", arch=ARCH), options)
    assert from_folder.layers and from_folder.layers == from_file.layers
    with pytest.raises(BnauditError, match="torch.distributed.checkpoint folder holds tensors, not a model"):
        bnaudit.measure_gap(str(folder), options)


FSDP_SCRIPT = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6), nn.ReLU(), nn.Flatten(), nn.Linear(216, 5))
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(3):
        model(torch.randn(4, 3, 8, 8, generator=g) * 3 + 1).sum().backward()
        opt.step()
        opt.zero_grad()
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=sys.argv[1])
    dist.destroy_process_group()
    # fully_shard on gloo (torch 2.13) leaves a C++ thread joinable at interpreter exit:
    # about one run in six then aborts ("terminate called without an active exception")
    # after the folder is complete. Leave without running those destructors.
    sys.stdout.flush(); sys.stderr.flush()
    import os; os._exit(0)
    """
)


@pytest.mark.slow
def test_fsdp2_sharded_folder_assembles_exactly(tmp_path: Path) -> None:
    (tmp_path / "save.py").write_text(FSDP_SCRIPT)
    folder = tmp_path / "fsdp"
    done = run_ranks(["save.py", str(folder)], cwd=tmp_path, ranks=2)
    assert done.returncode == 0, done.stderr[-3000:]
    layout = read_dcp_layout(str(folder))
    weight = layout.tensors["model.1.weight"]
    # FSDP2 shards the BN weight along dim 0: one half per rank, in two files
    assert [c.offsets for c in weight.chunks] == [(0,), (3,)]
    assert len({c.file for c in weight.chunks}) == 2
    ckpt = read_checkpoint(str(folder))
    assert ckpt.key == "model"
    assert_same_values(ckpt, torch_reference(folder, tmp_path)["model"])
    assert any("2 .distcp files" in note for note in ckpt.notes)
    assert os.path.isfile(folder / ".metadata")


CALIB = f"{SAMPLES}/data/digits_calib.safetensors"


def digits_with_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    """The sample DigitsNet with its trained weights and one real Adam step's state."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("digits_net", f"{SAMPLES}/digits_net.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.digits_net()
    model.load_state_dict(torch.load(f"{SAMPLES}/healthy.pt", weights_only=True))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    torch.manual_seed(0)
    model(torch.rand(4, 1, 8, 8)).sum().backward()
    opt.step()
    return model, opt


def tree_equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(tree_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(tree_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_recalibrate_writes_a_dcp_folder_that_dcp_load_takes(tmp_path: Path) -> None:
    model, opt = digits_with_optimizer()
    source = save_dcp({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path / "in")
    before = {p.name: p.read_bytes() for p in source.iterdir()}
    options = bnaudit.DataOptions(path=CALIB, num_samples=128, batch_size=32)
    out = tmp_path / "out"
    report = bnaudit.recalibrate_checkpoint(ModelSpec(str(source), arch=ARCH), str(out), options)
    assert report is not None and (out / ".metadata").is_file()
    assert {p.name: p.read_bytes() for p in source.iterdir()} == before  # the input is never changed
    # the same calibration of the torch file the folder holds: the independent reference
    plain = tmp_path / "plain.pt"
    torch.save(model.state_dict(), plain)
    bnaudit.recalibrate_checkpoint(ModelSpec(str(plain), arch=ARCH), str(tmp_path / "plain-out.pt"), options)
    expected = torch.load(tmp_path / "plain-out.pt", weights_only=True)
    # dcp.load into the model, as a training job resuming would
    fresh, _ = digits_with_optimizer()
    state = {"model": fresh.state_dict()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        dcp.load(state, checkpoint_id=str(out))
    fresh.load_state_dict(state["model"])
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, expected[name]), name
    assert not torch.equal(expected["features.1.running_var"], model.features[1].running_var)  # it did change
    # everything else is the input's: weights and the optimizer's state and settings
    old, new = torch_reference(source, tmp_path), torch_reference(out, tmp_path)
    assert tree_equal(old["optim"], new["optim"])
    assert all(
        torch.equal(old["model"][k], new["model"][k]) for k in old["model"] if "running" not in k and "num_b" not in k
    )
    assert bnaudit.inspect(str(out)).files[0].provenance  # the record beside the files is read back


def test_recalibrate_refuses_a_file_name_for_a_dcp_folder_and_keeps_an_existing_one(tmp_path: Path) -> None:
    model, _ = digits_with_optimizer()
    source = save_dcp({"model": model.state_dict()}, tmp_path / "in")
    options = bnaudit.DataOptions(path=CALIB, num_samples=64, batch_size=32)
    with pytest.raises(BnauditError, match="written back as a folder"):
        bnaudit.recalibrate_checkpoint(ModelSpec(str(source), arch=ARCH), str(tmp_path / "out.pt"), options)
    existing = save_dcp({"model": model.state_dict()}, tmp_path / "existing")
    with pytest.raises(BnauditError, match="already exists"):
        bnaudit.recalibrate_checkpoint(ModelSpec(str(source), arch=ARCH), str(existing), options)
    bnaudit.recalibrate_checkpoint(ModelSpec(str(source), arch=ARCH), str(existing), options, force=True)
    assert (existing / "bnaudit.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left


DCP_SAMPLE = f"{SAMPLES}/dcp"


def test_cli_inspect_of_the_sample_folder(cli) -> None:
    """The issue's first run: `bnaudit inspect ckpt/` said "directory holds no checkpoint
    files" and exited 2."""
    result = cli("inspect", DCP_SAMPLE, "--format", "json")
    assert result.exit_code == 0, result.output
    import json

    [entry] = json.loads(result.stdout)["files"]
    assert entry["format"] == "dcp" and entry["key"] == "model"
    assert [layer["name"] for layer in entry["layers"]] == ["features.1", "features.4", "head.2"]
    reference = dcp_reference_of_sample()
    assert reference["model"]["features.1.num_batches_tracked"].item() == entry["layers"][0]["num_batches_tracked"]


def dcp_reference_of_sample(tmp: list[dict] = []) -> dict:  # noqa: B006 - a cache of one entry
    if not tmp:
        import tempfile

        with tempfile.TemporaryDirectory() as folder:
            out = os.path.join(folder, "sample.pt")
            dcp_to_torch_save(DCP_SAMPLE, out)
            tmp.append(torch.load(out, weights_only=True))
    return tmp[0]


def test_diff_two_folders_and_a_folder_against_safetensors(tmp_path: Path) -> None:
    """The sample is 3 AdamW steps in training mode from the healthy weights: every layer's
    statistics moved (three EMA updates) against healthy.safetensors; a copy of the folder
    is identical to it."""
    reference = dcp_reference_of_sample()["model"]
    healthy = bnaudit.diff(f"{SAMPLES}/healthy.safetensors", DCP_SAMPLE)
    assert healthy.b.format == "dcp" and len(healthy.layers) == 3
    for d in healthy.layers:
        assert not d.mean_identical and not d.var_identical
        assert d.batches_b - d.batches_a == 3
        assert d.batches_b == reference[f"{d.name}.num_batches_tracked"].item()
    copy = tmp_path / "copy"
    copy.mkdir()
    for p in Path(DCP_SAMPLE).iterdir():
        (copy / p.name).write_bytes(p.read_bytes())
    same = bnaudit.diff(DCP_SAMPLE, str(copy))
    assert all(d.mean_identical and d.var_identical and d.weight_identical for d in same.layers)


def test_invariance_with_arch_reads_the_folder(tmp_path: Path) -> None:
    state = torch.load(f"{SAMPLES}/healthy.pt", weights_only=True)
    folder = save_dcp({"model": state}, tmp_path / "healthy")
    options = bnaudit.DataOptions(path=VAL, num_samples=32, batch_size=16)
    from_folder = bnaudit.measure_invariance(ModelSpec(str(folder), arch=ARCH), options, batch_sizes=[1, 16])
    from_file = bnaudit.measure_invariance(ModelSpec(f"{SAMPLES}/healthy.pt", arch=ARCH), options, batch_sizes=[1, 16])
    assert from_folder.arrangements and from_folder.arrangements == from_file.arrangements
    assert (from_folder.max_deviation, from_folder.flagged) == (from_file.max_deviation, from_file.flagged)


def test_a_hostile_chunk_runs_nothing_and_a_wrong_one_is_refused(tmp_path: Path) -> None:
    """A chunk record pointed at a torch.save blob of a payload (what a forged .distcp holds)
    is refused when read, without running it; a blob of the wrong shape is refused too."""
    import io

    model, _ = trained_with_optimizer()
    marker = tmp_path / "marker"
    for blob_of, message in ((Payload(str(marker)), "unreadable"), (torch.zeros(3), "does not hold a float32")):
        folder = save_dcp({"model": model.state_dict()}, tmp_path / f"chunk-{message.split()[0]}")
        buffer = io.BytesIO()
        torch.save(blob_of, buffer)
        (folder / "__9_0.distcp").write_bytes(buffer.getvalue())
        length = len(buffer.getvalue())

        def point(m, length=length):
            for index, info in m.storage_data.items():
                if index.fqn == "model.1.running_var":
                    info.relative_path, info.offset, info.length = "__9_0.distcp", 0, length

        rewrite_metadata(folder, point)
        ckpt = read_checkpoint(str(folder))  # the metadata is sound: the chunk is read only when asked
        with pytest.raises(BnauditError, match=message):
            ckpt.tensors["1.running_var"].read()
        report = bnaudit.inspect(str(folder))
        assert "model.1.running_var" in report.files[0].error
    assert not marker.exists()


@pytest.mark.slow
def test_inspecting_a_dcp_folder_imports_neither_torch_nor_numpy() -> None:
    import subprocess
    import sys

    code = (
        "import sys; from bnaudit.api import inspect; "
        f"report = inspect({DCP_SAMPLE!r}); assert report.files[0].layers, report.files[0].error; "
        "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))"
    )
    env = {**os.environ, "PYTHONPATH": os.path.dirname(SAMPLES)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "cannot unpickle safely"),
        (b"\x80\x04garbage", "cannot unpickle safely"),
        (pickle.dumps({"model.1.weight": [1.0]}), r"malformed \.metadata \(expected Metadata, found dict\)"),
        (pickle.dumps(Path("x")), "malformed"),  # an allowed global, not a Metadata
    ],
)
def test_a_torn_or_foreign_metadata_is_one_line(tmp_path: Path, content: bytes, message: str) -> None:
    model, _ = trained_with_optimizer()
    folder = save_dcp({"model": model.state_dict()}, tmp_path / "torn")
    (folder / ".metadata").write_bytes(content)
    with pytest.raises(BnauditError, match=message):
        read_checkpoint(str(folder))

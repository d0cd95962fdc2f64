"""Every command reads what inspect reads (issue 21): gap, invariance, recalibrate and diff
take a checkpoint folder (transformers `save_pretrained`, sharded or not; a Trainer
`checkpoint-N/`; an accelerate `save_state` folder; a DeepSpeed folder; Lightning's) and use
the model checkpoint `inspect` finds in it; recalibrate writes a sharded checkpoint back as a
sharded folder.

Folders are written as the libraries write them: safetensors through the `safetensors`
package, shards and index as transformers names and serialises them, training-run files from
the real objects' `state_dict()`; `sample_models/checkpoint-3` is a real Trainer-shaped
folder. Each command's result on a folder is compared with the same command on the file the
folder holds, named explicitly.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random

import numpy as np
import pytest
import torch
from conftest import SAMPLES, save_safetensors
from safetensors import safe_open
from safetensors.torch import load_file
from test_layouts import write_shards

from bnaudit import DataOptions, diff, measure_gap, measure_invariance, recalibrate_checkpoint
from bnaudit.audit.resolve import model_checkpoint
from bnaudit.errors import BnauditError
from bnaudit.runtime.models import ModelSpec

ARCH = os.path.join(SAMPLES, "digits_net.py") + ":digits_net"
VAL = os.path.join(SAMPLES, "data", "digits_val.safetensors")
CALIB = os.path.join(SAMPLES, "data", "digits_calib.safetensors")
# transformers' save_pretrained writes this beside the weights
CONFIG_JSON = {"architectures": ["DigitsNet"], "model_type": "digits", "torch_dtype": "float32"}


def healthy_state() -> dict[str, torch.Tensor]:
    return load_file(os.path.join(SAMPLES, "healthy.safetensors"))


def write_config(folder) -> None:
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(CONFIG_JSON, f, indent=2)


def write_accelerate_folder(folder, state) -> None:
    """What `Accelerator.save_state` leaves: model.safetensors, optimizer.bin, scheduler.bin,
    scaler.pt and random_states_0.pkl, from the real objects' state."""
    from bnaudit.runtime.models import build_arch

    os.makedirs(folder)
    save_safetensors(state, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    model = build_arch(ARCH)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.rand(4, 1, 8, 8)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    torch.save(optimizer.state_dict(), os.path.join(folder, "optimizer.bin"))
    torch.save(scheduler.state_dict(), os.path.join(folder, "scheduler.bin"))
    torch.save(torch.amp.GradScaler("cpu").state_dict(), os.path.join(folder, "scaler.pt"))
    torch.save(
        {
            "random_state": random.getstate(),
            "numpy_random_seed": np.random.get_state(),
            "torch_manual_seed": torch.get_rng_state(),
        },
        os.path.join(folder, "random_states_0.pkl"),
    )


def write_deepspeed_folder(folder, state) -> str:
    """What `engine.save_checkpoint(folder)` leaves: `latest` naming the tag, the tag's
    folder with the model states (state dict under "module") and a ZeRO partition."""
    os.makedirs(os.path.join(folder, "global_step5"))
    with open(os.path.join(folder, "latest"), "w") as f:
        f.write("global_step5")
    with open(os.path.join(folder, "zero_to_fp32.py"), "w") as f:
        f.write("# DeepSpeed's consolidation script\n")
    model_states = os.path.join(folder, "global_step5", "mp_rank_00_model_states.pt")
    torch.save(
        {
            "module": state,
            "buffer_names": [k for k in state if "running" in k or "num_batches" in k],
            "optimizer": None,
            "lr_scheduler": None,
            "global_steps": 5,
            "dp_world_size": 1,
            "mp_world_size": 1,
            "ds_version": "0.16.0",
        },
        model_states,
    )
    torch.save(
        {"optimizer_state_dict": {"base_optimizer_state": {"state": {}, "param_groups": []}}, "ds_version": "0.16.0"},
        os.path.join(folder, "global_step5", "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
    )
    return model_states


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """layout name -> (folder, the model checkpoint inside it, as a user would name it)."""
    root = tmp_path_factory.mktemp("layouts")
    state = healthy_state()
    out = {}
    pretrained = root / "save_pretrained"
    pretrained.mkdir()
    save_safetensors(state, pretrained / "model.safetensors", metadata={"format": "pt"})
    write_config(pretrained)
    out["save_pretrained"] = (str(pretrained), str(pretrained / "model.safetensors"))
    sharded = root / "save_pretrained_sharded"
    index = write_shards(state, sharded, cuts=["features.1.running_var", "head.1.weight"])
    write_config(sharded)
    out["save_pretrained_sharded"] = (str(sharded), index)
    bins = root / "pytorch_model_bin"
    write_shards(state, bins, cuts=["features.4.running_mean"], ext="bin", stem="pytorch_model")
    out["pytorch_model_bin_sharded"] = (str(bins), str(bins / "pytorch_model.bin.index.json"))
    checkpoint3 = os.path.join(SAMPLES, "checkpoint-3")
    out["trainer"] = (checkpoint3, os.path.join(checkpoint3, "model.safetensors"))
    accelerate = root / "accelerate"
    write_accelerate_folder(accelerate, state)
    out["accelerate"] = (str(accelerate), str(accelerate / "model.safetensors"))
    deepspeed = root / "deepspeed"
    out["deepspeed"] = (str(deepspeed), write_deepspeed_folder(str(deepspeed), state))
    lightning = os.path.join(SAMPLES, "lightning")
    out["lightning"] = (lightning, os.path.join(lightning, "last.ckpt"))
    return out


LAYOUTS = [
    "save_pretrained",
    "save_pretrained_sharded",
    "pytorch_model_bin_sharded",
    "trainer",
    "accelerate",
    "deepspeed",
    "lightning",
]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_folder_resolves_to_the_model_checkpoint_inspect_audits_in_it(layouts, layout):
    folder, model = layouts[layout]
    assert model_checkpoint(folder) == model
    assert model_checkpoint(model) == model  # a file names itself


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gap_of_a_folder_is_gap_of_the_model_file_in_it(layouts, layout):
    folder, model = layouts[layout]
    options = DataOptions(path=VAL, batch_size=64, num_samples=128)
    of_folder = measure_gap(ModelSpec(folder, arch=ARCH), options)
    of_file = measure_gap(ModelSpec(model, arch=ARCH), options)
    assert of_folder.checkpoint == of_file.checkpoint == model
    assert of_folder.gap is not None and of_folder.gap == of_file.gap
    assert [dataclasses.astuple(x) for x in of_folder.layers] == [dataclasses.astuple(x) for x in of_file.layers]


@pytest.mark.parametrize("layout", ["save_pretrained_sharded", "trainer", "deepspeed"])
def test_invariance_of_a_folder_is_invariance_of_the_model_file_in_it(layouts, layout):
    folder, model = layouts[layout]
    options = DataOptions(path=VAL, batch_size=16, num_samples=32)
    of_folder = measure_invariance(ModelSpec(folder, arch=ARCH), options, batch_sizes=[1, 16])
    of_file = measure_invariance(ModelSpec(model, arch=ARCH), options, batch_sizes=[1, 16])
    assert of_folder.checkpoint == of_file.checkpoint == model
    assert of_folder.max_deviation == of_file.max_deviation
    assert [dataclasses.astuple(r) for r in of_folder.arrangements] == [
        dataclasses.astuple(r) for r in of_file.arrangements
    ]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_diff_of_folders_is_diff_of_the_model_files_in_them(layouts, layout):
    folder, model = layouts[layout]
    other_folder, other_model = layouts["trainer" if layout != "trainer" else "save_pretrained"]
    of_folders = diff(folder, other_folder)
    of_files = diff(model, other_model)
    assert of_folders.a.path == model and of_folders.b.path == other_model  # the files read, named
    assert of_folders.groups() == of_files.groups()
    assert [(f.code, f.layer, f.message) for f in of_folders.findings] == [
        (f.code, f.layer, f.message) for f in of_files.findings
    ]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fold_of_a_folder_is_fold_of_the_model_file_in_it(layouts, layout):
    from bnaudit import predict_fold
    from bnaudit.config import Config

    folder, model = layouts[layout]
    of_folder, of_file = predict_fold(folder, Config()), predict_fold(model, Config())
    assert of_folder.path == of_file.path == model
    assert of_folder.pairs and of_folder == of_file


def test_measured_fold_of_a_folder_is_that_of_the_model_file_in_it(layouts):
    from bnaudit import measure_fold
    from bnaudit.config import Config

    folder, model = layouts["save_pretrained_sharded"]
    options = DataOptions(path=VAL, batch_size=32, num_samples=64)
    of_folder = measure_fold(ModelSpec(folder, arch=ARCH), options, Config())
    of_file = measure_fold(ModelSpec(model, arch=ARCH), options, Config())
    assert of_folder.path == of_file.path == model
    assert of_folder.measured is not None and of_folder.measured == of_file.measured


@pytest.mark.parametrize("layout", ["save_pretrained", "trainer", "accelerate", "deepspeed", "lightning"])
def test_recalibrate_of_a_folder_writes_what_recalibrate_of_its_model_file_writes(layouts, layout, tmp_path):
    folder, model = layouts[layout]
    options = DataOptions(path=CALIB, batch_size=64)
    suffix = ".safetensors" if model.endswith(".safetensors") else ".pt"
    from_folder, from_file = str(tmp_path / f"a{suffix}"), str(tmp_path / f"b{suffix}")
    if layout == "lightning":  # its hyper_parameters hold a project's classes: refused alike, naming the file
        refusals = []
        for source, output in ((folder, from_folder), (model, from_file)):
            with pytest.raises(BnauditError) as err:
                recalibrate_checkpoint(ModelSpec(source, arch=ARCH), output, options)
            refusals.append(str(err.value))
        assert refusals[0] == refusals[1] and refusals[0].startswith(f"{model}: cannot be written back")
        return
    report = recalibrate_checkpoint(ModelSpec(folder, arch=ARCH), from_folder, options)
    recalibrate_checkpoint(ModelSpec(model, arch=ARCH), from_file, options)
    assert report is not None and report.layers
    if suffix == ".safetensors":
        a, b = load_file(from_folder), load_file(from_file)
    else:
        a, b = torch.load(from_folder, weights_only=True), torch.load(from_file, weights_only=True)
        a, b = a.get("module", a.get("state_dict", a)), b.get("module", b.get("state_dict", b))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_folder_with_several_models_is_refused_naming_them(tmp_path):
    state = healthy_state()
    save_safetensors(state, tmp_path / "model.safetensors")
    torch.save(state, tmp_path / "pytorch_model.bin")
    torch.save({"state": {}, "param_groups": []}, tmp_path / "optimizer.pt")
    with pytest.raises(BnauditError) as err:
        model_checkpoint(str(tmp_path))
    message = str(err.value)
    assert "\n" not in message
    assert "holds 2 model checkpoints (model.safetensors, pytorch_model.bin)" in message
    assert "pass the one to use" in message and "optimizer.pt" not in message
    with pytest.raises(BnauditError, match="holds 2 model checkpoints"):
        measure_gap(ModelSpec(str(tmp_path), arch=ARCH), DataOptions(path=VAL, num_samples=8))


def test_the_configuration_exclude_decides_which_model_a_folder_names(tmp_path):
    """`exclude` removes files from a folder for every command, as from inspect's scan: a
    Hub folder with both weight files and `exclude = ["*.bin"]` names model.safetensors."""
    from bnaudit.config import Config

    state = healthy_state()
    save_safetensors(state, tmp_path / "model.safetensors")
    torch.save(state, tmp_path / "pytorch_model.bin")
    config = Config(exclude=("*.bin",))
    assert model_checkpoint(str(tmp_path), config=config) == str(tmp_path / "model.safetensors")
    with pytest.raises(BnauditError, match="holds 2 model checkpoints"):
        model_checkpoint(str(tmp_path))  # the defaults exclude nothing
    report = diff(str(tmp_path), str(tmp_path / "pytorch_model.bin"), config)
    assert report.a.path == str(tmp_path / "model.safetensors") and report.a.format == "safetensors"
    gap = measure_gap(
        ModelSpec(str(tmp_path), arch=ARCH), DataOptions(path=VAL, num_samples=8, batch_size=4), config=config
    )
    assert gap.checkpoint == str(tmp_path / "model.safetensors")


def test_a_folder_without_model_weights_or_with_an_unreadable_file_is_refused(tmp_path):
    only = tmp_path / "only_optimizer"
    only.mkdir()
    torch.save({"state": {}, "param_groups": []}, only / "optimizer.pt")
    with pytest.raises(BnauditError, match=r"holds no model weights, only optimizer.pt \(optimizer state"):
        model_checkpoint(str(only))
    torn = tmp_path / "torn"
    torn.mkdir()
    save_safetensors(healthy_state(), torn / "model.safetensors")
    (torn / "extra.pt").write_bytes(b"PK\x03\x04" + b"\x00" * 40)
    with pytest.raises(BnauditError, match=r"holds files that cannot be read \(extra.pt: .*beside model.safetensors"):
        model_checkpoint(str(torn))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(BnauditError, match="directory holds no checkpoint files"):
        model_checkpoint(str(empty))


def test_the_cli_commands_take_a_save_pretrained_folder(layouts, cli, tmp_path):
    folder, _ = layouts["save_pretrained_sharded"]
    gap = cli("gap", folder, "--arch", ARCH, "--data", VAL, "--num-samples", "64", "--isolated")
    assert gap.exit_code == 0, gap.output
    inv = cli("invariance", folder, "--arch", ARCH, "--data", VAL, "--num-samples", "32", "--isolated")
    assert inv.exit_code == 0, inv.output
    other, _ = layouts["trainer"]
    assert cli("diff", folder, other, "--isolated").exit_code in (0, 1)
    out = tmp_path / "recalibrated"
    recal = cli("recalibrate", folder, "--arch", ARCH, "--data", CALIB, "--output", str(out))
    assert recal.exit_code == 0, recal.output
    assert sorted(os.listdir(out)) == sorted(os.listdir(folder))


# --- recalibrate of a sharded checkpoint writes a sharded folder ---------------------------------


def _digest(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _content_digest(path) -> str:
    """The file's bytes; for safetensors, its tensors' bytes and its metadata: the package
    writes `__metadata__` from a hash map, so the order of its entries varies between runs."""
    if not str(path).endswith(".safetensors"):
        return _digest(path)
    h = hashlib.sha256()
    with safe_open(path, framework="numpy") as f:
        h.update(json.dumps(f.metadata(), sort_keys=True).encode())
        for name in f.keys():  # noqa: SIM118 (safe_open is no mapping)
            h.update(name.encode() + f.get_tensor(name).tobytes())
    return h.hexdigest()


def _folder_digests(folder) -> dict[str, str]:
    return {name: _content_digest(os.path.join(folder, name)) for name in sorted(os.listdir(folder))}


def _shard_tensors(folder, name) -> dict[str, torch.Tensor]:
    if name.endswith(".safetensors"):
        return load_file(os.path.join(folder, name))
    return torch.load(os.path.join(folder, name), weights_only=True)


@pytest.mark.parametrize("layout", ["save_pretrained_sharded", "pytorch_model_bin_sharded"])
def test_recalibrating_a_sharded_folder_writes_a_sharded_folder_equal_to_a_single_file_recalibration(
    layouts, layout, tmp_path
):
    folder, index_path = layouts[layout]
    before = _folder_digests(folder)
    options = DataOptions(path=CALIB, batch_size=64)
    single = tmp_path / "single.safetensors"
    recalibrate_checkpoint(ModelSpec(os.path.join(SAMPLES, "healthy.safetensors"), arch=ARCH), str(single), options)
    out = tmp_path / "recalibrated"
    report = recalibrate_checkpoint(ModelSpec(folder, arch=ARCH), str(out), options)
    assert report is not None and report.output == str(out)
    assert _folder_digests(folder) == before  # the input is never modified
    assert sorted(os.listdir(out)) == sorted(os.listdir(folder))  # same files: shards, index, config.json
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no temporary folder left
    with open(index_path) as f:
        old_index = json.load(f)
    index_name = os.path.basename(index_path)
    with open(out / index_name) as f:
        new_index = json.load(f)
    assert new_index["weight_map"] == old_index["weight_map"]
    # every tensor the weight map names is in the shard it names, and nothing else is
    expected = single_file = load_file(str(single))
    held: dict[str, str] = {}
    total = 0
    for shard in sorted(set(new_index["weight_map"].values())):
        tensors = _shard_tensors(out, shard)
        held.update(dict.fromkeys(tensors, shard))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        statistics = [k for k in tensors if k.endswith(("running_mean", "running_var", "num_batches_tracked"))]
        if statistics:  # rewritten with the new statistics: equal to the single-file result
            assert all(torch.equal(tensors[k], expected[k]) for k in tensors)
        else:  # no BN buffers: copied byte for byte
            assert _digest(out / shard) == _digest(os.path.join(folder, shard))
    assert held == new_index["weight_map"]
    assert new_index["metadata"]["total_size"] == total
    record = json.loads(new_index["metadata"]["bnaudit"])
    assert record["recalibrated_layers"] == ["features.1", "features.4", "head.2"]
    # the other tensors are bit-identical to the input's
    originals = {}
    for shard in set(old_index["weight_map"].values()):
        originals.update(_shard_tensors(folder, shard))
    for name, shard in new_index["weight_map"].items():
        value = _shard_tensors(out, shard)[name]
        if name.endswith(("running_mean", "running_var", "num_batches_tracked")):
            assert torch.equal(value, single_file[name])
        else:
            assert torch.equal(value, originals[name])
    if layout == "save_pretrained_sharded":  # safetensors shards carry the record in their metadata
        with safe_open(str(out / "model-00001-of-00003.safetensors"), "pt") as f:
            assert json.loads(f.metadata()["bnaudit"])["digests"] == record["digests"]
            assert f.metadata()["format"] == "pt"


def test_inspect_of_a_recalibrated_sharded_folder_trusts_its_record(layouts, tmp_path):
    from bnaudit import inspect

    folder, _ = layouts["pytorch_model_bin_sharded"]
    out = tmp_path / "recalibrated"
    recal = recalibrate_checkpoint(
        ModelSpec(folder, arch=ARCH), str(out), DataOptions(path=CALIB, batch_size=64), eval_data=DataOptions(path=VAL)
    )
    # --eval-data measures the folder written, read back through its index
    assert recal is not None and recal.eval_after is not None
    assert recal.eval_after.checkpoint == str(out / "pytorch_model.bin.index.json")
    report = inspect(str(out))
    assert "statistics of 3 layers re-estimated by bnaudit recalibrate" in report.files[0].provenance


def test_recalibrating_a_sharded_folder_refuses_an_existing_output_without_force(layouts, tmp_path, monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")  # the record's date: equal outputs compare equal
    folder, _ = layouts["save_pretrained_sharded"]
    options = DataOptions(path=CALIB, batch_size=64)
    out = tmp_path / "recalibrated"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(BnauditError, match="already exists"):
        recalibrate_checkpoint(ModelSpec(folder, arch=ARCH), str(out), options)
    # --force replaces a folder only when it holds a checkpoint of this layout
    with pytest.raises(BnauditError, match="not a sharded checkpoint folder"):
        recalibrate_checkpoint(ModelSpec(folder, arch=ARCH), str(out), options, force=True)
    assert (out / "keep.txt").read_text() == "mine"
    done = tmp_path / "done"
    recalibrate_checkpoint(ModelSpec(folder, arch=ARCH), str(done), options)
    first = _folder_digests(done)
    (done / "model-00002-of-00003.safetensors").write_bytes(b"stale")
    recalibrate_checkpoint(ModelSpec(folder, arch=ARCH), str(done), options, force=True)
    assert _folder_digests(done) == first
    with pytest.raises(BnauditError, match="inside the input folder"):
        recalibrate_checkpoint(ModelSpec(folder, arch=ARCH), os.path.join(folder, "out"), options)
    with pytest.raises(BnauditError, match="a sharded checkpoint is written as a folder"):
        recalibrate_checkpoint(ModelSpec(folder, arch=ARCH), str(tmp_path / "one.safetensors"), options)


# --- a real transformers save_pretrained folder, loaded back with from_pretrained ---------------

RESNET = {
    "num_channels": 1,
    "embedding_size": 8,
    "hidden_sizes": [8, 16],
    "depths": [1, 1],
    "layer_type": "basic",
    "num_labels": 10,
}


@pytest.fixture
def resnet_classes(monkeypatch):
    """transformers' ResNetConfig and ResNetForImageClassification (skipped without transformers)."""
    try:
        import torchvision  # noqa: F401
    except Exception:  # a torchvision built for another torch: transformers then must not use it
        import sys

        monkeypatch.setitem(sys.modules, "torchvision", None)
    pytest.importorskip("transformers")
    from transformers import ResNetConfig, ResNetForImageClassification

    return ResNetConfig, ResNetForImageClassification


def test_transformers_save_pretrained_folders_through_gap_and_recalibrate_and_back(resnet_classes, tmp_path):
    """A tiny transformers ResNet saved by `save_pretrained` sharded (max_shard_size 4KB) and
    whole: gap reads both folders alike, recalibrate writes the sharded one back sharded, and
    `from_pretrained` loads the result with every key in place, the statistics those of a
    recalibration of the whole file and every other tensor as saved."""
    config_class, model_class = resnet_classes
    torch.manual_seed(0)
    model = model_class(config_class(**RESNET)).eval()
    sharded, whole = tmp_path / "sharded", tmp_path / "whole"
    model.save_pretrained(sharded, max_shard_size="4KB")
    model.save_pretrained(whole)
    shards = [n for n in os.listdir(sharded) if n.endswith(".safetensors")]
    assert len(shards) > 2 and "model.safetensors.index.json" in os.listdir(sharded)
    assert sorted(os.listdir(whole)) == ["config.json", "model.safetensors"]
    arch = tmp_path / "build_resnet.py"
    arch.write_text(
        "import sys\n"
        "try:\n    import torchvision  # noqa: F401\n"
        "except Exception:\n    sys.modules['torchvision'] = None\n"
        "from transformers import ResNetConfig, ResNetForImageClassification\n\n"
        f"def resnet():\n    return ResNetForImageClassification(ResNetConfig(**{RESNET!r}))\n"
    )
    spec = f"{arch}:resnet"
    options = DataOptions(path=VAL, batch_size=32, num_samples=96)
    of_sharded, of_whole = (
        measure_gap(ModelSpec(str(sharded), arch=spec), options),
        measure_gap(ModelSpec(str(whole), arch=spec), options),
    )
    assert of_sharded.checkpoint == str(sharded / "model.safetensors.index.json")
    assert of_whole.checkpoint == str(whole / "model.safetensors")
    assert of_sharded.gap == of_whole.gap and len(of_sharded.layers) == len(of_whole.layers) > 0

    calib = DataOptions(path=CALIB, batch_size=64)
    out, single = tmp_path / "recalibrated", tmp_path / "single.safetensors"
    recalibrate_checkpoint(ModelSpec(str(sharded), arch=spec), str(out), calib)
    recalibrate_checkpoint(ModelSpec(str(whole), arch=spec), str(single), calib)
    assert sorted(os.listdir(out)) == sorted(os.listdir(sharded))
    with open(sharded / "model.safetensors.index.json") as f:
        theirs = json.load(f)
    with open(out / "model.safetensors.index.json") as f:
        ours = json.load(f)
    assert ours["weight_map"] == theirs["weight_map"]
    assert ours["metadata"]["total_size"] == theirs["metadata"]["total_size"]  # as transformers counts it
    loaded, info = model_class.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    expected = load_file(str(single))
    saved = model.state_dict()
    statistics = ("running_mean", "running_var", "num_batches_tracked")
    for name, value in loaded.state_dict().items():
        if name.endswith(statistics):
            assert torch.equal(value, expected[name]), name
        else:
            assert torch.equal(value, saved[name]), name
    assert not torch.equal(
        loaded.state_dict()["resnet.embedder.embedder.normalization.running_var"],
        saved["resnet.embedder.embedder.normalization.running_var"],
    )  # the statistics did change


def test_diff_against_an_onnx_export_folder_with_arch_reads_the_export_in_it(layouts, cli, tmp_path):
    """`diff checkpoint-folder export-folder --arch`: the export folder (model + its external
    data) names its ONNX model, as inspect finds it, and the report is the files' report."""
    pytest.importorskip("onnx")
    import shutil

    export = tmp_path / "export"
    export.mkdir()
    for name in ("folded.onnx", "folded.onnx.data"):
        shutil.copyfile(os.path.join(SAMPLES, "onnx", name), export / name)
    folder, model = layouts["save_pretrained"]
    of_folders = cli("diff", folder, str(export), "--arch", ARCH, "-f", "json", "--isolated")
    of_files = cli("diff", model, str(export / "folded.onnx"), "--arch", ARCH, "-f", "json", "--isolated")
    assert of_folders.exit_code == of_files.exit_code != 2, of_folders.output
    assert json.loads(of_folders.stdout) == json.loads(of_files.stdout)


def test_a_sharded_write_that_fails_midway_leaves_no_folder_and_keeps_the_old_output(layouts, tmp_path, monkeypatch):
    """A full disk while the second rewritten shard is written: no output folder, no
    temporary folder, and with --force the previous output is kept as it was."""
    import errno

    import bnaudit.formats.write as write

    folder, _ = layouts["save_pretrained_sharded"]
    options = DataOptions(path=CALIB, batch_size=64)
    kept = tmp_path / "kept"
    recalibrate_checkpoint(ModelSpec(folder, arch=ARCH), str(kept), options)
    before = _folder_digests(kept)
    rewrite, calls = write._rewrite_safetensors, []

    def full_disk(source, updates, record, f):
        calls.append(source)
        if len(calls) == 2:
            f.write(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        rewrite(source, updates, record, f)

    monkeypatch.setattr(write, "_rewrite_safetensors", full_disk)
    fresh = tmp_path / "fresh"
    with pytest.raises(BnauditError, match="cannot write .*fresh: No space left on device"):
        recalibrate_checkpoint(ModelSpec(folder, arch=ARCH), str(fresh), options)
    calls.clear()
    with pytest.raises(BnauditError, match="No space left on device"):
        recalibrate_checkpoint(ModelSpec(folder, arch=ARCH), str(kept), options, force=True)
    assert not fresh.exists() and _folder_digests(kept) == before
    assert sorted(os.listdir(tmp_path)) == ["kept"]  # no temporary folder left beside them

"""Real layouts (issue #12 part A): sharded checkpoints and training-run folders.

Shards and their index are written the way transformers / huggingface_hub write them
(`model-0000k-of-0000N.safetensors`, `{"metadata": {"total_size": N}, "weight_map": ...}`,
indent 2, sorted keys); the weights come from a real training run; optimizer, scheduler
and RNG files from the real objects' `state_dict()` / `getstate()`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys
from collections import OrderedDict

import numpy as np
import pytest
import torch
from conftest import REPO, save_safetensors, train_classifier

from bnaudit.api import inspect
from bnaudit.config import Config


def small_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3, padding=1),
        torch.nn.BatchNorm2d(4),
        torch.nn.ReLU(),
        torch.nn.Conv2d(4, 6, 3, padding=1),
        torch.nn.BatchNorm2d(6),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(6, 3),
    )


@pytest.fixture(scope="module")
def trained():
    """(model, optimizer, scheduler) after real AdamW steps on a small 3-class problem."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(96, 1, 6, 6, generator=g)
    y = (x.mean(dim=(1, 2, 3)) > 0).long() + (x[:, 0, 0, 0] > 1).long()
    model = train_classifier(small_net(), x, y, steps=15)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.9**step)
    model.train()
    loss = torch.nn.functional.cross_entropy(model(x[:32]), y[:32])
    loss.backward()
    optimizer.step()
    scheduler.step()
    model.eval()
    return model, optimizer, scheduler


def write_shards(state: dict, folder, cuts: list[str], ext: str = "safetensors", stem: str = "model") -> str:
    """Split `state` (in order) into shards starting at each name of `cuts`, as
    huggingface_hub names them, and write the index as transformers does."""
    os.makedirs(folder, exist_ok=True)
    names = list(state)
    bounds = [0] + [names.index(c) for c in cuts] + [len(names)]
    n = len(bounds) - 1
    weight_map = {}
    for k in range(n):
        shard = f"{stem}-{k + 1:05d}-of-{n:05d}.{ext}"
        part = {name: state[name].contiguous() for name in names[bounds[k] : bounds[k + 1]]}
        if ext == "safetensors":
            save_safetensors(part, os.path.join(folder, shard), metadata={"format": "pt"})
        else:
            torch.save(part, os.path.join(folder, shard))
        weight_map.update(dict.fromkeys(part, shard))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    path = os.path.join(folder, f"{stem}.{ext}.index.json")
    with open(path, "w") as f:
        f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return path


def layer_numbers(report):
    return [dataclasses.replace(s) for f in report.files for s in f.layers]


# ---- sharded checkpoints -------------------------------------------------------------


@pytest.mark.parametrize("ext", ["safetensors", "bin"])
def test_index_and_folder_audit_one_checkpoint_with_a_layer_split_across_shards(tmp_path, trained, ext):
    state = trained[0].state_dict()
    # the cut falls between running_mean and running_var of the first BN layer
    index = write_shards(state, tmp_path / "hf", cuts=["1.running_var", "3.weight"], ext=ext)
    whole = save_safetensors(state, tmp_path / "whole.safetensors")
    reference = inspect(whole, Config())
    for target in (index, str(tmp_path / "hf")):
        report = inspect(target, Config())
        assert [f.path for f in report.files] == [index]
        file = report.files[0]
        assert file.error is None and file.skipped is None
        assert [s.name for s in file.layers] == ["1", "4"]
        assert not [f for f in file.findings if f.code == "BN001"]
        assert file.layers == reference.files[0].layers  # the same numbers as the unsharded file
        assert file.layers[0].var_min == pytest.approx(float(state["1.running_var"].min()), rel=1e-7)
        assert file.notes == ["3 shards read as one checkpoint through the index"]
        assert report.exit_code() == reference.exit_code()


def test_shards_named_next_to_their_index_are_audited_once(tmp_path, trained):
    index = write_shards(trained[0].state_dict(), tmp_path, cuts=["1.running_var"])
    shards = sorted(str(p) for p in tmp_path.glob("model-*.safetensors"))
    report = inspect([*shards, index, str(tmp_path)], Config())
    assert [f.path for f in report.files] == [index, index]  # named index + the folder's: no shard alone


def test_a_shard_alone_says_which_and_downgrades_split_layers_to_info(tmp_path, trained):
    state = trained[0].state_dict()
    write_shards(state, tmp_path, cuts=["1.running_var"])
    first = str(tmp_path / "model-00001-of-00002.safetensors")
    report = inspect(first, Config())
    file = report.files[0]
    assert file.notes == [
        "shard 1 of 2 read alone: missing buffers are info (whole checkpoint: model.safetensors.index.json)"
    ]
    os.remove(tmp_path / "model.safetensors.index.json")
    assert inspect(first, Config()).files[0].notes == [
        "shard 1 of 2 read alone: missing buffers are info (no index beside it)"
    ]
    bn001 = [f for f in file.findings if f.code == "BN001"]
    assert [(f.severity, f.layer) for f in bn001] == [("info", "1")]
    assert (
        "running_var" in bn001[0].message
        and "possibly split across shards: this file is shard 1 of 2" in bn001[0].message
    )
    assert report.exit_code() == 0
    # the same half layer in a file that is not a shard stays an error
    half = save_safetensors(
        {k: v for k, v in state.items() if k.startswith("0.") or k in ("1.weight", "1.bias", "1.running_mean")},
        tmp_path / "half.safetensors",
    )
    assert [f.severity for f in inspect(half, Config()).files[0].findings if f.code == "BN001"] == ["error"]


def _rewrite_index(index: str, edit) -> None:
    with open(index) as f:
        doc = json.load(f)
    text = edit(doc)
    with open(index, "w") as f:
        f.write(text if isinstance(text, str) else json.dumps(doc, indent=2))


def _broken(tmp_path, trained, how: str) -> str:
    state = trained[0].state_dict()
    index = write_shards(state, tmp_path / "hf", cuts=["1.running_var"])
    folder = tmp_path / "hf"
    if how == "missing shard":
        os.remove(folder / "model-00002-of-00002.safetensors")
    elif how == "shard not in the index":
        save_safetensors({"extra": torch.zeros(2)}, folder / "model-00003-of-00003.safetensors")
    elif how == "tensor listed twice":
        _rewrite_index(
            index,
            lambda d: json.dumps(d, indent=2).replace(
                '"weight_map": {', '"weight_map": {\n "1.running_var": "model-00001-of-00002.safetensors",', 1
            ),
        )
    elif how == "tensor stored twice":
        save_safetensors(
            {
                "1.running_var": state["1.running_var"],
                **{k: v for k, v in state.items() if list(state).index(k) >= list(state).index("1.running_var")},
            },
            folder / "model-00002-of-00002.safetensors",
        )
        save_safetensors(
            {k: state[k] for k in list(state)[: list(state).index("1.running_var") + 1]},
            folder / "model-00001-of-00002.safetensors",
        )
    elif how == "dot-dot":
        save_safetensors({"x": torch.zeros(1)}, tmp_path / "outside.safetensors")
        _rewrite_index(index, lambda d: d["weight_map"].update({"0.weight": "../outside.safetensors"}))
    elif how == "absolute":
        _rewrite_index(index, lambda d: d["weight_map"].update({"0.weight": str(tmp_path / "outside.safetensors")}))
    elif how == "symlink out":
        os.replace(folder / "model-00002-of-00002.safetensors", tmp_path / "elsewhere.safetensors")
        os.symlink(tmp_path / "elsewhere.safetensors", folder / "model-00002-of-00002.safetensors")
    return index


BROKEN = {
    "missing shard": "missing shard 'model-00002-of-00002.safetensors'",
    "shard not in the index": "shard 'model-00003-of-00003.safetensors' is not in the index",
    "tensor listed twice": "tensor '1.running_var' listed twice in the index",
    "tensor stored twice": "tensor '1.running_var' is stored twice",
    "dot-dot": "leaves the index's folder ('..')",
    "absolute": "is absolute",
    "symlink out": "is a symlink to",
}


@pytest.mark.parametrize("how", list(BROKEN))
def test_a_broken_sharded_checkpoint_is_one_clear_line_and_exit_2(tmp_path, trained, how, cli):
    index = _broken(tmp_path, trained, how)
    report = inspect(index, Config())
    assert len(report.files) == 1 and BROKEN[how] in report.files[0].error
    assert report.exit_code() == 2
    result = cli("inspect", index, "--isolated")
    assert result.exit_code == 2
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and BROKEN[how] in errors[0] and "Traceback" not in result.output


def test_only_bn_tensors_are_read_from_whichever_shard_holds_them(tmp_path, trained, monkeypatch):
    import bnaudit.formats.model as model

    state = dict(trained[0].state_dict())
    state["big.weight"] = torch.randn(256, 256)  # a non-BN tensor of its own shard
    write_shards(state, tmp_path, cuts=["1.running_var", "big.weight"])
    reads: list[str] = []
    real = model.read_into
    monkeypatch.setattr(
        model,
        "read_into",
        lambda f, offset, target, path: (reads.append(os.path.basename(path)), real(f, offset, target, path))[1],
    )
    report = inspect(str(tmp_path), Config())
    assert report.files[0].error is None and len(report.files[0].layers) == 2
    assert set(reads) == {"model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors"}


# ---- training-run folders -------------------------------------------------------------

TRAINING_ARGS_MODULE = """
import dataclasses

@dataclasses.dataclass
class TrainingArguments:
    output_dir: str = "out"
    learning_rate: float = 5e-5
    per_device_train_batch_size: int = 8
"""


def write_trainer_folder(folder, trained, tmp_path) -> None:
    """A Hugging Face Trainer `checkpoint-N/` as `Trainer._save_checkpoint` leaves it."""
    model, optimizer, scheduler = trained
    os.makedirs(folder, exist_ok=True)
    save_safetensors(model.state_dict(), os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    torch.save(optimizer.state_dict(), os.path.join(folder, "optimizer.pt"))
    torch.save(scheduler.state_dict(), os.path.join(folder, "scheduler.pt"))
    torch.save(
        {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()},
        os.path.join(folder, "rng_state.pth"),
    )
    # training_args.bin pickles a dataclass of a module that no longer exists when bnaudit runs
    moddir = tmp_path / "argsmod"
    moddir.mkdir(exist_ok=True)
    (moddir / "my_trainer_args.py").write_text(TRAINING_ARGS_MODULE)
    sys.path.insert(0, str(moddir))
    try:
        import my_trainer_args

        torch.save(my_trainer_args.TrainingArguments(), os.path.join(folder, "training_args.bin"))
    finally:
        sys.path.remove(str(moddir))
        sys.modules.pop("my_trainer_args", None)
        (moddir / "my_trainer_args.py").unlink()
    with open(os.path.join(folder, "trainer_state.json"), "w") as f:
        json.dump({"global_step": 16, "log_history": []}, f)


def test_a_trainer_checkpoint_folder_audits_the_model_and_skips_the_rest_with_reasons(tmp_path, trained, cli):
    folder = tmp_path / "checkpoint-16"
    write_trainer_folder(folder, trained, tmp_path)
    report = inspect(str(folder), Config())
    by_name = {os.path.basename(f.path): f for f in report.files}
    assert sorted(by_name) == [
        "model.safetensors",
        "optimizer.pt",
        "rng_state.pth",
        "scheduler.pt",
        "training_args.bin",
    ]
    assert len(by_name["model.safetensors"].layers) == 2 and by_name["model.safetensors"].skipped is None
    assert by_name["optimizer.pt"].skipped == "optimizer state (state, param_groups)"
    assert by_name["scheduler.pt"].skipped == "LR scheduler state (last_epoch, base_lrs)"
    assert by_name["rng_state.pth"].skipped == "RNG state (cpu, numpy, python)"
    assert by_name["training_args.bin"].skipped == (
        "training arguments (pickled my_trainer_args.TrainingArguments, not loaded)"
    )
    assert not any(f.error for f in report.files)
    assert report.exit_code() == inspect(str(folder / "model.safetensors"), Config()).exit_code()
    result = cli("inspect", str(folder), "--isolated", "--exit-zero")
    assert result.exit_code == 0 and result.stderr == ""
    assert "4 skipped (not model weights)" in result.stdout


@pytest.mark.parametrize("name", ["optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin"])
def test_a_non_weight_file_named_explicitly_is_one_line_and_exit_0(tmp_path, trained, cli, name):
    folder = tmp_path / "checkpoint-16"
    write_trainer_folder(folder, trained, tmp_path)
    result = cli("inspect", str(folder / name), "--isolated")
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert lines[0].startswith(f"{folder / name}: skipped: ") and lines[0].endswith(": not model weights")
    assert lines[1] == "1 file, 0 BN layers: 0 errors, 0 warnings, 0 infos, 1 skipped (not model weights)"
    assert result.stderr == ""


@pytest.mark.slow
def test_training_args_are_never_unpickled_even_when_the_module_exists(tmp_path, trained):
    """The restricted reader refuses the class: the skip comes from the name and the
    globals torch lists without running the pickle, so an importable module with a side
    effect in its import or __setstate__ runs nothing."""
    folder = tmp_path / "checkpoint-16"
    write_trainer_folder(folder, trained, tmp_path)
    marker = tmp_path / "ran"
    (tmp_path / "argsmod" / "my_trainer_args.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n" + TRAINING_ARGS_MODULE
    )
    code = f"import sys; sys.path.insert(0, {str(tmp_path / 'argsmod')!r}); from bnaudit.cli import main; main()"
    run = subprocess.run(
        [sys.executable, "-c", code, "inspect", str(folder / "training_args.bin"), "--isolated"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert (
        run.returncode == 0 and "skipped: training arguments (pickled my_trainer_args.TrainingArguments" in run.stdout
    )
    assert not marker.exists()


def test_exit_zero_tolerates_an_unreadable_file_in_a_scanned_folder_but_not_a_named_one(tmp_path, trained, cli):
    folder = tmp_path / "run"
    folder.mkdir()
    save_safetensors(trained[0].state_dict(), folder / "model.safetensors")
    (folder / "torn.pt").write_bytes(b"PK\x03\x04" + b"\x00" * 40)
    scanned = cli("inspect", str(folder), "--isolated", "--exit-zero")
    assert scanned.exit_code == 0 and "torn.pt" in scanned.stderr  # reported, not an exit code
    assert cli("inspect", str(folder), "--isolated").exit_code == 2
    named = cli("inspect", str(folder / "torn.pt"), str(folder / "model.safetensors"), "--isolated", "--exit-zero")
    assert named.exit_code == 2
    assert cli("inspect", str(folder / "nope.pt"), "--isolated", "--exit-zero").exit_code == 2


def test_deepspeed_and_accelerate_and_lightning_files(tmp_path, trained):
    model, optimizer, scheduler = trained
    state = model.state_dict()
    folder = tmp_path / "global_step16"
    folder.mkdir()
    # DeepSpeed's engine.save_checkpoint: the state dict under "module", shapes as torch.Size
    torch.save(
        {
            "module": state,
            "buffer_names": [k for k in state if "running" in k or "num_batches" in k],
            "optimizer": None,
            "param_shapes": [OrderedDict((k, v.shape) for k, v in model.named_parameters())],
            "lr_scheduler": None,
            "global_steps": 16,
            "dp_world_size": 1,
            "mp_world_size": 1,
            "ds_version": "0.16.0",
        },
        folder / "mp_rank_00_model_states.pt",
    )
    torch.save(
        {
            "optimizer_state_dict": {
                "base_optimizer_state": optimizer.state_dict(),
                "single_partition_of_fp32_groups": [torch.zeros(8)],
            },
            "ds_config": {},
            "ds_version": "0.16.0",
        },
        folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
    )
    # accelerate's save_state: random_states_0.pkl through torch.save
    torch.save(
        {
            "random_state": random.getstate(),
            "numpy_random_seed": np.random.get_state(),
            "torch_manual_seed": torch.get_rng_state(),
        },
        folder / "random_states_0.pkl",
    )
    torch.save(optimizer.state_dict(), folder / "optimizer.bin")
    # Lightning's last.ckpt
    torch.save(
        {
            "epoch": 3,
            "global_step": 500,
            "pytorch-lightning_version": "2.5.0",
            "state_dict": {f"model.{k}": v for k, v in state.items()},
            "loops": {},
            "callbacks": {},
            "optimizer_states": [optimizer.state_dict()],
            "lr_schedulers": [scheduler.state_dict()],
        },
        folder / "last.ckpt",
    )
    report = inspect(str(folder), Config())
    by_name = {os.path.basename(f.path): f for f in report.files}
    assert by_name["mp_rank_00_model_states.pt"].key == "module"
    assert by_name["last.ckpt"].prefix == "model."
    for name in ("mp_rank_00_model_states.pt", "last.ckpt"):
        assert [s.name for s in by_name[name].layers] == ["1", "4"] and not by_name[name].error
    assert by_name["zero_pp_rank_0_mp_rank_00_optim_states.pt"].skipped.startswith("DeepSpeed ZeRO optimizer partition")
    assert by_name["random_states_0.pkl"].skipped == "RNG state (numpy_random_seed, random_state, torch_manual_seed)"
    assert by_name["optimizer.bin"].skipped == "optimizer state (state, param_groups)"
    assert report.exit_code(exit_zero=True) == 0 and not any(f.error for f in report.files)


def test_an_unknown_refused_pickle_stays_an_error(tmp_path):
    """Classification never excuses a file by name alone unless the name is a training-run one."""
    import datetime

    torch.save({"saved": datetime.datetime(2026, 11, 30)}, tmp_path / "weights.pt")
    report = inspect(str(tmp_path / "weights.pt"), Config())
    assert report.files[0].error and "refused to unpickle" in report.files[0].error
    assert report.exit_code() == 2


# ---- the committed samples and the machine-readable formats ---------------------------


def test_sample_sharded_checkpoint_equals_the_unsharded_healthy_one():
    from conftest import SAMPLES

    sharded = inspect(os.path.join(SAMPLES, "sharded"), Config())
    healthy = inspect(os.path.join(SAMPLES, "healthy.safetensors"), Config())
    assert [os.path.basename(f.path) for f in sharded.files] == ["model.safetensors.index.json"]
    assert sharded.files[0].layers == healthy.files[0].layers and sharded.files[0].findings == []
    with open(os.path.join(SAMPLES, "sharded", "model.safetensors.index.json")) as f:
        index = json.load(f)
    assert set(index) == {"metadata", "weight_map"}
    # features.1 is split: its running_var starts the second shard
    assert index["weight_map"]["features.1.running_mean"] == "model-00001-of-00003.safetensors"
    assert index["weight_map"]["features.1.running_var"] == "model-00002-of-00003.safetensors"


def test_sample_trainer_checkpoint_folder():
    from conftest import SAMPLES

    report = inspect(os.path.join(SAMPLES, "checkpoint-3"), Config())
    audited = [f for f in report.files if not f.skipped]
    assert [os.path.basename(f.path) for f in audited] == ["model.safetensors"]
    assert [s.name for s in audited[0].layers] == ["features.1", "features.4", "head.2"]
    assert sorted(os.path.basename(f.path) for f in report.skipped) == [
        "optimizer.pt",
        "rng_state.pth",
        "scheduler.pt",
        "training_args.bin",
    ]
    assert report.exit_code() == 0


def test_json_and_sarif_carry_skipped_files_and_notes(tmp_path, trained, cli):
    import jsonschema
    from test_sarif import SCHEMA_PATH

    folder = tmp_path / "checkpoint-16"
    write_trainer_folder(folder, trained, tmp_path)
    write_shards(trained[0].state_dict(), folder / "sharded", cuts=["1.running_var"])
    doc = json.loads(cli("inspect", str(folder), "--isolated", "--format", "json").stdout)
    by_name = {os.path.basename(f["path"]): f for f in doc["files"]}
    assert by_name["optimizer.pt"]["skipped"] == "optimizer state (state, param_groups)"
    assert by_name["optimizer.pt"]["error"] is None and by_name["optimizer.pt"]["layers"] == []
    assert by_name["model.safetensors.index.json"]["notes"] == ["2 shards read as one checkpoint through the index"]
    assert by_name["model.safetensors"]["skipped"] is None and by_name["model.safetensors"]["notes"] == []
    result = cli("inspect", str(folder), "--isolated", "--format", "sarif")
    log = json.loads(result.stdout)
    with open(SCHEMA_PATH, encoding="utf-8") as fh:
        jsonschema.Draft4Validator(json.load(fh)).validate(log)
    invocation = log["runs"][0]["invocations"][0]
    assert sorted(n["level"] for n in invocation["toolExecutionNotifications"]) == ["note"] * 4
    assert invocation["executionSuccessful"] is True
    # the skipped files cost nothing: the exit code is the audited files' own
    alone = cli("inspect", str(folder / "model.safetensors"), str(folder / "sharded"), "--isolated")
    assert result.exit_code == alone.exit_code != 2


def test_gap_reads_a_sharded_checkpoint_and_recalibrate_writes_one_as_a_folder(tmp_path, cli):
    from conftest import SAMPLES

    index = os.path.join(SAMPLES, "sharded", "model.safetensors.index.json")
    arch = os.path.join(SAMPLES, "digits_net.py") + ":digits_net"
    val = os.path.join(SAMPLES, "data", "digits_val.safetensors")
    sharded = json.loads(cli("gap", index, "--arch", arch, "--data", val, "--format", "json").stdout)
    healthy = os.path.join(SAMPLES, "healthy.safetensors")
    whole = json.loads(cli("gap", healthy, "--arch", arch, "--data", val, "--format", "json").stdout)
    assert sharded["eval_mode"] == whole["eval_mode"] and sharded["layers"] == whole["layers"]
    no_arch = cli("gap", index, "--data", val)
    assert no_arch.exit_code == 2 and "a sharded checkpoint holds tensors, not a model: pass --arch" in no_arch.stderr
    out = tmp_path / "recal.safetensors"
    recal = cli("recalibrate", index, "--arch", arch, "--data", val, "--output", str(out))
    assert recal.exit_code == 2 and "a sharded checkpoint is written as a folder of shards" in recal.stderr
    assert not out.exists()
    folder = tmp_path / "recal"
    recal = cli("recalibrate", index, "--arch", arch, "--data", val, "--output", str(folder))
    assert recal.exit_code == 0 and sorted(os.listdir(folder)) == sorted(os.listdir(os.path.dirname(index)))


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
@pytest.mark.parametrize("name", ["optimizer.pt", "training_args.bin", "rng_state.pth"])
def test_a_payload_with_a_training_run_name_is_still_refused_not_skipped(tmp_path, name, legacy):
    """The name alone never excuses a pickle that names a global that acts (os.system, exec)."""
    import pickle

    from test_hostile import payload

    for kind in ("os.system", "builtins.exec"):
        marker = tmp_path / f"marker-{kind}"
        evil, global_name = payload(kind, marker)
        path = tmp_path / kind / name
        path.parent.mkdir()
        torch.save({"state": {}, "param_groups": [], "x": evil}, path, _use_new_zipfile_serialization=not legacy)
        report = inspect(str(path), Config())
        assert report.files[0].skipped is None and "refused to unpickle" in report.files[0].error
        assert global_name in report.files[0].error and report.exit_code() == 2
        assert not marker.exists()
        pickle.loads(pickle.dumps(evil))  # the payload is live
        assert marker.exists()


def test_training_args_in_the_legacy_format_are_skipped_by_name(tmp_path):
    """The pre-1.6 stream format is several pickles in a row (magic number, protocol, sys
    info, the object, storage keys) then raw bytes: the class is named in the fourth."""
    legacy = tmp_path / "training_args.bin"
    moddir = tmp_path / "argsmod"
    moddir.mkdir()
    (moddir / "my_trainer_args.py").write_text(TRAINING_ARGS_MODULE)
    sys.path.insert(0, str(moddir))
    try:
        import my_trainer_args

        torch.save(
            {"args": my_trainer_args.TrainingArguments(), "t": torch.zeros(2)},
            legacy,
            _use_new_zipfile_serialization=False,
        )
    finally:
        sys.path.remove(str(moddir))
        sys.modules.pop("my_trainer_args", None)
        (moddir / "my_trainer_args.py").unlink()
    report = inspect(str(legacy), Config())
    assert report.files[0].skipped == "training arguments (pickled my_trainer_args.TrainingArguments, not loaded)"


def test_rng_state_the_restricted_reader_refuses_is_named_from_the_file_name(tmp_path):
    """A pickled numpy Generator needs numpy.random's constructors, which the restricted
    reader refuses: the file name and the refused globals say what it is; nothing is built."""
    path = tmp_path / "rng_state_1.pth"
    torch.save({"python": random.getstate(), "numpy": np.random.default_rng(0)}, path)
    report = inspect(str(path), Config())
    skipped = report.files[0].skipped
    assert skipped.startswith("RNG state (pickled numpy.random.") and skipped.endswith(", not loaded)")
    assert report.exit_code() == 0

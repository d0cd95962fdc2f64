"""Regenerate the sample checkpoints and data in this folder.

    pip install scikit-learn      # only this script needs it: the digits ship inside it
    python sample_models/generate.py

Trains sample_models/digits_net.py:digits_net on scikit-learn's bundled 8x8 digits
(1797 images, nothing downloaded), then writes one healthy checkpoint and one
checkpoint per failure that bnaudit's rules describe, each made the way it happens
in real life. Deterministic: same seeds, same data split, same values.

Data split (fixed permutation, seed 0): 1097 train / 300 calibration / 400 validation.

Real layouts (issue #12): `sharded/` (the healthy weights as Hugging Face writes a sharded
checkpoint: three `model-0000k-of-00003.safetensors` and `model.safetensors.index.json`,
features.1's running_mean and running_var in different shards) and `checkpoint-3/` (a
Hugging Face Trainer folder after 3 AdamW fine-tuning steps on the calibration split:
model.safetensors, optimizer.pt, scheduler.pt, rng_state.pth, training_args.bin,
trainer_state.json), and `lightning/last.ckpt` (a Lightning-style container whose
hyper_parameters and args pickle classes of a project module that does not exist where the file
is audited), and `traced_train.pt` (the healthy model traced with its BatchNorm layers in
training mode: batch-dependent predictions for `bnaudit invariance`), and `swa/` (SWA with
torch.optim.swa_utils.AveragedModel: live.pt, swa.pt its state dict before update_bn, swa_bn.pt
after it), and `dcp/` (a torch.distributed.checkpoint folder: the model and AdamW state after 3
steps on the calibration split, saved by `dcp.save` in one process; `--dcp-only` rewrites it).
`python sample_models/generate.py --layouts-only` rewrites just these,
from the committed healthy.safetensors and calibration data (no scikit-learn needed).

ONNX exports (issue #16): `onnx/digits.onnx` (the healthy model exported in eval mode with
its BatchNormalization nodes kept: the legacy exporter with do_constant_folding=False) and
`onnx/digits_training.onnx` (the same model exported with TrainingMode.TRAINING, as users do
by mistake: BatchNormalization nodes with training_mode=1). Needs the onnx extra at generation
time (`pip install "bnaudit[onnx]"`); `--onnx-only` rewrites just these from healthy.safetensors.

An InceptionV3-like channel: `inception_channel.safetensors` (see `write_inception_channel`;
`--fold-only` rewrites just it from healthy.safetensors).

A federated round (issue #36): `federated/` holds two clients (client1.safetensors trained on
the digits 0-4 of the calibration split, client2.safetensors on 5-9, a few Adam steps each from
the healthy weights; their data as client1_data.safetensors and client2_data.safetensors) and
the server's global.safetensors, every state-dict entry averaged as floats (averaged BN
statistics, float num_batches_tracked), and the clients' statistics files of the global
weights on their data (client1.bnstats, client2.bnstats: `bnaudit recalibrate --stats-out`, so
bnaudit must be importable). `--fed-only` rewrites just these from healthy.safetensors and the
calibration data.

torch.export archives (issue #23): `pt2/eval.pt2` (the healthy model exported with
torch.export.export from model.eval() and saved with torch.export.save: aten.batch_norm nodes
with training=False) and `pt2/training.pt2` (the same model exported in train mode, the
mistake users make: training=True baked into every node). `--pt2-only` rewrites just these
from healthy.safetensors.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile

import numpy as np
import torch
from safetensors.torch import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from digits_net import digits_net  # noqa: E402

BATCH = 64


def load_digits_split():
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)  # (N, 1, 8, 8) in [0, 1]
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    return (x[:1097], y[:1097]), (x[1097:1397], y[1097:1397]), (x[1397:], y[1397:])


def run_epochs(model, opt, x, y, epochs: int, g) -> None:
    """`epochs` shuffled passes in train() mode, batches of BATCH (a lone last sample skipped)."""
    model.train()
    for _ in range(epochs):
        for idx in torch.randperm(len(y), generator=g).split(BATCH):
            if len(idx) < 2:
                continue
            loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()


def train(x, y, epochs: int = 12):
    torch.manual_seed(0)
    model = digits_net()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    run_epochs(model, opt, x, y, epochs, g)
    return model


def accuracy(model, x, y) -> float:
    model.eval()
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def bn_train_only(model):
    model.eval()
    for m in model.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.train()


def state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


def save_pt(sd, name: str) -> None:
    torch.save(sd, os.path.join(HERE, name))


def save_st(sd, name: str, metadata: dict[str, str] | None = None) -> None:
    save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(HERE, name), metadata=metadata)


def write_sharded(healthy: dict[str, torch.Tensor], folder: str, cuts: tuple[str, ...]) -> None:
    """`healthy` as huggingface_hub / transformers shard it: shards named
    `model-0000k-of-0000N.safetensors` with `{"format": "pt"}` metadata, and the index
    `{"metadata": {"total_size": bytes}, "weight_map": {tensor: shard}}` (indent 2, sorted
    keys, trailing newline). Shards start at the names in `cuts`."""
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    names = list(healthy)
    bounds = [0, *(names.index(c) for c in cuts), len(names)]
    n = len(bounds) - 1
    weight_map: dict[str, str] = {}
    for k in range(n):
        shard = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        part = {name: healthy[name].contiguous() for name in names[bounds[k] : bounds[k + 1]]}
        save_file(part, os.path.join(folder, shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    index = {
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in healthy.values())},
        "weight_map": weight_map,
    }
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")


TRAINING_ARGS = """
import dataclasses


@dataclasses.dataclass
class TrainingArguments:
    output_dir: str = "digits-finetune"
    learning_rate: float = 1e-3
    per_device_train_batch_size: int = 64
    max_steps: int = 3
"""


def write_trainer_checkpoint(healthy: dict[str, torch.Tensor], x, y, folder: str, steps: int = 3) -> None:
    """What `transformers.Trainer._save_checkpoint` leaves after `steps` AdamW steps with a
    linear-decay LambdaLR: the model, optimizer and scheduler state dicts, the RNG state
    (python / numpy / cpu) and the pickled training arguments (a dataclass of a module
    that is deleted afterwards, as a user's project is absent where the folder is audited)."""
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    model = digits_net()
    model.load_state_dict(healthy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / steps)
    model.train()
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        idx = torch.randperm(len(y), generator=g)[:BATCH]
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
    save_file(state(model), os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    torch.save(optimizer.state_dict(), os.path.join(folder, "optimizer.pt"))
    torch.save(scheduler.state_dict(), os.path.join(folder, "scheduler.pt"))
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    torch.save(rng, os.path.join(folder, "rng_state.pth"))
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "digits_training_args.py"), "w") as f:
            f.write(TRAINING_ARGS)
        sys.path.insert(0, tmp)
        try:
            import digits_training_args

            torch.save(digits_training_args.TrainingArguments(), os.path.join(folder, "training_args.bin"))
        finally:
            sys.path.remove(tmp)
            sys.modules.pop("digits_training_args", None)
    trainer_state = {"global_step": steps, "epoch": steps * BATCH / len(y), "log_history": [], "max_steps": steps}
    with open(os.path.join(folder, "trainer_state.json"), "w") as f:
        f.write(json.dumps(trainer_state, indent=2, sort_keys=True) + "\n")


def write_dcp_checkpoint(healthy: dict[str, torch.Tensor], x, y, folder: str, steps: int = 3) -> None:
    """What a torch.distributed.checkpoint user writes after `steps` AdamW steps (the issue's
    `dcp.save({"model": ..., "optim": ...}, checkpoint_id="ckpt/")`), in one process: the
    folder `.metadata` + `__0_0.distcp`, the model and the optimizer's state flattened into it."""
    import torch.distributed.checkpoint as dcp

    shutil.rmtree(folder, ignore_errors=True)
    torch.manual_seed(0)
    model = digits_net()
    model.load_state_dict(healthy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        idx = torch.randperm(len(y), generator=g)[:BATCH]
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    # a relative checkpoint_id: the folder's metadata records it, and no absolute path of this machine
    dcp.save(
        {"model": model.state_dict(), "optim": optimizer.state_dict()},
        checkpoint_id=os.path.relpath(folder),
        no_dist=True,
    )


PROJECT_CONFIG = """
import dataclasses


@dataclasses.dataclass
class TrainConfig:
    lr: float = 3e-3
    batch_size: int = 64
    epochs: int = 12


class RunArgs:
    def __init__(self, seed: int = 0, run_name: str = "digits") -> None:
        self.seed, self.run_name = seed, run_name
"""


def write_lightning_checkpoint(healthy: dict[str, torch.Tensor], path: str) -> None:
    """What a LightningModule's `trainer.save_checkpoint` writes: the state dict under
    `state_dict` with the `model.` prefix of the module attribute, and `hyper_parameters`
    / `args` holding classes of the user's project (`myproject.config`, written to a
    temporary folder and gone afterwards, as it is where the checkpoint is audited)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        os.makedirs(os.path.join(tmp, "myproject"))
        open(os.path.join(tmp, "myproject", "__init__.py"), "w").close()
        with open(os.path.join(tmp, "myproject", "config.py"), "w") as f:
            f.write(PROJECT_CONFIG)
        sys.path.insert(0, tmp)
        try:
            from myproject.config import RunArgs, TrainConfig

            checkpoint = {
                "epoch": 11,
                "global_step": 216,
                "pytorch-lightning_version": "2.4.0",
                "state_dict": {f"model.{k}": v for k, v in healthy.items()},
                "loops": {"fit_loop": {"epoch_progress": {"current": {"completed": 11}}}},
                "callbacks": {},
                "optimizer_states": [],
                "lr_schedulers": [],
                "hyper_parameters": {"config": TrainConfig()},
                "args": RunArgs(),
            }
            torch.save(checkpoint, path)
        finally:
            sys.path.remove(tmp)
            for name in ("myproject.config", "myproject"):
                sys.modules.pop(name, None)


def write_traced_in_training_mode(healthy: dict[str, torch.Tensor], x, path: str) -> None:
    """The healthy model exported with torch.jit.trace while its BatchNorm layers were in
    training mode (a trace taken inside the training loop): the graph calls batch_norm
    with training=True as a constant, so `.eval()` after loading changes nothing and every
    prediction depends on its batch (`bnaudit invariance`). Dropout was in eval mode, so
    the archive's outputs are deterministic."""
    import warnings

    model = digits_net()
    model.load_state_dict(healthy)
    bn_train_only(model)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TracerWarning: BN's batch-size check becomes a constant
        traced = torch.jit.trace(model, x[:BATCH], check_trace=False)
    torch.jit.save(traced, path)


def write_layouts(healthy: dict[str, torch.Tensor], xc, yc) -> None:
    write_sharded(healthy, os.path.join(HERE, "sharded"), cuts=("features.1.running_var", "head.2.weight"))
    write_trainer_checkpoint(healthy, xc, yc, os.path.join(HERE, "checkpoint-3"))
    write_lightning_checkpoint(healthy, os.path.join(HERE, "lightning", "last.ckpt"))
    write_traced_in_training_mode(healthy, xc, os.path.join(HERE, "traced_train.pt"))
    write_averaged_model(healthy, xc, yc, os.path.join(HERE, "swa"))
    write_dcp_checkpoint(healthy, xc, yc, os.path.join(HERE, "dcp"))


def write_averaged_model(healthy: dict[str, torch.Tensor], x, y, folder: str, epochs: int = 4) -> None:
    """SWA as torch.optim.swa_utils documents it: from the healthy weights, `epochs` epochs of
    SGD at a constant rate with `AveragedModel.update_parameters` after each. `live.pt` is the
    live model's state dict; `swa.pt` the AveragedModel's (`n_averaged` beside `module.*`,
    use_buffers=False: its buffers copied from the live model) saved without `update_bn`, the
    mistake `bnaudit diff live.pt swa.pt` reports; `swa_bn.pt` the same after `update_bn`."""
    from torch.optim.swa_utils import AveragedModel, update_bn

    os.makedirs(folder, exist_ok=True)
    torch.manual_seed(0)
    model = digits_net()
    model.load_state_dict(healthy)
    swa = AveragedModel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    g = torch.Generator().manual_seed(3)
    for _ in range(epochs):
        run_epochs(model, opt, x, y, 1, g)
        swa.update_parameters(model)
    torch.save(state(model), os.path.join(folder, "live.pt"))
    torch.save(swa.state_dict(), os.path.join(folder, "swa.pt"))
    update_bn(torch.utils.data.DataLoader(x, batch_size=BATCH), swa)
    torch.save(swa.state_dict(), os.path.join(folder, "swa_bn.pt"))


def write_onnx_samples(healthy: dict[str, torch.Tensor], folder: str) -> None:
    """The healthy model exported to ONNX with its BatchNormalization nodes kept, once in eval
    mode and once in training mode (the exporter's TrainingMode.TRAINING). The legacy exporter
    (dynamo=False) with do_constant_folding=False keeps the nodes and names the statistics
    after their modules (`features.1.running_mean`). Tracing in training mode runs one forward
    that updates the running statistics (the exported ones are then 0.9 * trained + 0.1 * those
    of the example batch, as in any such export); it works on a copy."""
    import copy
    import warnings

    os.makedirs(folder, exist_ok=True)
    model = digits_net()
    model.load_state_dict(healthy)
    model.eval()
    from safetensors.torch import load_file

    # two validation images: the training-mode trace needs a batch of more than one
    example = load_file(os.path.join(HERE, "data", "digits_val.safetensors"))["inputs"][:2]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the legacy exporter's deprecation notice
        torch.onnx.export(
            model, (example,), os.path.join(folder, "digits.onnx"), dynamo=False, do_constant_folding=False
        )
        torch.onnx.export(
            copy.deepcopy(model),
            (example,),
            os.path.join(folder, "digits_training.onnx"),
            dynamo=False,
            do_constant_folding=False,
            training=torch.onnx.TrainingMode.TRAINING,
        )


def write_onnx_folded_sample(healthy: dict[str, torch.Tensor], folder: str) -> None:
    """onnx/folded.onnx: the healthy model exported with torch's defaults (dynamo=True, its
    optimiser on), which folds every BatchNorm into the Conv or Linear before it: no
    BatchNormalization node is left, and `bnaudit diff healthy.pt onnx/folded.onnx` verifies
    the folding itself."""
    import contextlib
    import io
    import warnings

    os.makedirs(folder, exist_ok=True)
    model = digits_net()
    model.load_state_dict(healthy)
    model.eval()
    from safetensors.torch import load_file

    example = load_file(os.path.join(HERE, "data", "digits_val.safetensors"))["inputs"][:2]
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (example,), os.path.join(folder, "folded.onnx"), dynamo=True)


def write_pt2_samples(healthy: dict[str, torch.Tensor], folder: str) -> None:
    """pt2/eval.pt2 and pt2/training.pt2: the healthy model through torch.export.export, once
    from model.eval() and once from model.train() (export does not run the model, so both hold
    the healthy statistics), saved with torch.export.save (which also pickles the two example
    images into data/sample_inputs/, which bnaudit lists and never reads)."""
    import warnings

    from safetensors.torch import load_file

    os.makedirs(folder, exist_ok=True)
    # a copy: a slice would pickle the whole validation set's storage into the sample inputs
    example = load_file(os.path.join(HERE, "data", "digits_val.safetensors"))["inputs"][:2].clone()
    for name, mode in (("eval.pt2", False), ("training.pt2", True)):
        model = digits_net()
        model.load_state_dict(healthy)
        model.train(mode)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # pytree deprecation notices of torch.export
            program = torch.export.export(model, (example,))
            torch.export.save(program, os.path.join(folder, name))


def write_inception_channel(healthy: dict[str, torch.Tensor], name: str = "inception_channel.safetensors") -> None:
    """inception_channel.safetensors: the healthy weights with one channel of features.4 given
    the statistics torchvision's InceptionV3 ships (running_var 1.86e-14, gamma 1) and, as
    there, carrying nothing the model uses (head.1's weights that read it are 0), so eval mode
    keeps its accuracy while the folded channel sets the int8 per-tensor range (`bnaudit fold`)."""
    sd = {k: v.clone() for k, v in healthy.items()}
    channel = 5
    sd["features.4.running_var"][channel] = 1.86e-14
    sd["features.4.weight"][channel] = 1.0
    per_channel = sd["head.1.weight"].shape[1] // sd["features.4.running_var"].shape[0]  # flattened 4x4 maps
    sd["head.1.weight"][:, channel * per_channel : (channel + 1) * per_channel] = 0.0
    save_st(sd, name, {"source": "bnaudit sample_models/generate.py: an InceptionV3-like channel"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images-per-class", type=int, default=10)
    parser.add_argument(
        "--layouts-only",
        action="store_true",
        help="rewrite sharded/, checkpoint-3/, lightning/ and traced_train.pt from healthy.safetensors",
    )
    parser.add_argument("--onnx-only", action="store_true", help="rewrite onnx/ from healthy.safetensors")
    parser.add_argument("--pt2-only", action="store_true", help="rewrite pt2/ from healthy.safetensors")
    parser.add_argument("--dcp-only", action="store_true", help="rewrite dcp/ from healthy.safetensors")
    parser.add_argument(
        "--fold-only", action="store_true", help="rewrite inception_channel.safetensors from healthy.safetensors"
    )
    parser.add_argument("--fed-only", action="store_true", help="rewrite federated/ from healthy.safetensors")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.fed_only:
        from safetensors.torch import load_file

        calib = load_file(os.path.join(HERE, "data", "digits_calib.safetensors"))
        healthy = load_file(os.path.join(HERE, "healthy.safetensors"))
        write_federated_samples(healthy, calib["inputs"], calib["labels"], os.path.join(HERE, "federated"))
        return
    if args.fold_only:
        from safetensors.torch import load_file

        write_inception_channel(load_file(os.path.join(HERE, "healthy.safetensors")))
        return
    if args.dcp_only:
        from safetensors.torch import load_file

        calib = load_file(os.path.join(HERE, "data", "digits_calib.safetensors"))
        write_dcp_checkpoint(
            load_file(os.path.join(HERE, "healthy.safetensors")),
            calib["inputs"],
            calib["labels"],
            os.path.join(HERE, "dcp"),
        )
        return
    if args.pt2_only:
        from safetensors.torch import load_file

        write_pt2_samples(load_file(os.path.join(HERE, "healthy.safetensors")), os.path.join(HERE, "pt2"))
        return
    if args.onnx_only:
        from safetensors.torch import load_file

        write_onnx_samples(load_file(os.path.join(HERE, "healthy.safetensors")), os.path.join(HERE, "onnx"))
        write_onnx_folded_sample(load_file(os.path.join(HERE, "healthy.safetensors")), os.path.join(HERE, "onnx"))
        return
    if args.layouts_only:
        from safetensors.torch import load_file

        calib = load_file(os.path.join(HERE, "data", "digits_calib.safetensors"))
        write_layouts(load_file(os.path.join(HERE, "healthy.safetensors")), calib["inputs"], calib["labels"])
        return
    (xt, yt), (xc, yc), (xv, yv) = load_digits_split()
    model = train(xt, yt)
    healthy = state(model)
    print(f"healthy: eval accuracy {accuracy(model, xv, yv):.3f} on {len(yv)} validation images")

    save_pt(healthy, "healthy.pt")
    save_st(healthy, "healthy.safetensors", {"source": "bnaudit sample_models/generate.py"})

    # BN002: statistics reset after training (what `strict=False` loading or a
    # re-created BN layer leaves): weights trained, buffers 0/1, counter 0.
    model.load_state_dict(healthy)
    for m in model.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.reset_running_stats()
    print(f"reset_stats: eval accuracy {accuracy(model, xv, yv):.3f}")
    save_pt(state(model), "reset_stats.pt")

    # BN003: the reset model run through 3 training-mode batches: the initial values
    # still weigh 0.9^3 = 72.9% in every buffer.
    bn_train_only(model)
    with torch.no_grad():
        for idx in torch.arange(3 * BATCH).split(BATCH):
            model(xt[idx])
    print(f"immature: eval accuracy {accuracy(model, xv, yv):.3f}")
    save_pt(state(model), "immature.pt")

    # BN004: a channel that died in training: variance ~0, eval gain |gamma|/sqrt(var+eps).
    dead = dict(healthy)
    dead["features.4.running_var"] = healthy["features.4.running_var"].clone()
    dead["features.4.running_var"][3] = 2e-7
    dead["features.4.weight"] = healthy["features.4.weight"].clone()
    dead["features.4.weight"][3] = 1.0
    save_st(dead, "dead_channel.safetensors")

    # BN005: a diverged fp16 step: Inf and NaN in the running variance.
    broken = dict(healthy)
    broken["head.2.running_var"] = healthy["head.2.running_var"].clone()
    broken["head.2.running_var"][[0, 5]] = torch.tensor([float("nan"), float("inf")])
    save_pt(broken, "nan_stats.pt")

    # BN008: the whole model cast to half precision, buffers included.
    save_st({k: v.half() if v.is_floating_point() else v for k, v in healthy.items()}, "fp16_buffers.safetensors")

    # BN001: a filtered state dict that lost one layer's running_var.
    missing = {k: v for k, v in healthy.items() if k != "features.1.running_var"}
    save_pt(missing, "missing_var.pt")

    # BN009: converted weights (e.g. from Keras): real statistics, counter 0.
    converted = {k: (torch.zeros_like(v) if k.endswith("num_batches_tracked") else v) for k, v in healthy.items()}
    save_st(converted, "converted.safetensors")

    # BN010: backbone frozen (norm_eval) while the head kept training.
    frozen = dict(healthy)
    for k in ("features.1.num_batches_tracked", "features.4.num_batches_tracked"):
        frozen[k] = healthy[k] // 2
    save_pt(frozen, "partially_frozen.pt")

    # `bnaudit diff`: a pretrained/fine-tuned pair. The backbone was "frozen" with
    # requires_grad=False while model.train() left its BatchNorm layers in training mode:
    # its weights are bit-identical, its running statistics moved to the new data
    # (frozen but updating, BN101). The head trained normally.
    save_st(healthy, "pretrained.safetensors", {"source": "bnaudit sample_models/generate.py"})
    save_pt(fine_tune_frozen_backbone(healthy, xc, yc), "finetuned.pt")

    # A torchvision-reference-style container: model, EMA copy, optimizer, args.
    container = {
        "model": healthy,
        "model_ema": {k: v.clone() for k, v in healthy.items()},
        "optimizer": {"state": {}, "param_groups": [{"lr": 0.003}]},
        "epoch": 12,
        "args": argparse.Namespace(lr=0.003, batch_size=BATCH, epochs=12),
    }
    torch.save(container, os.path.join(HERE, "ema_container.pth"))

    data_dir = os.path.join(HERE, "data")
    os.makedirs(data_dir, exist_ok=True)
    save_file({"inputs": xv.contiguous(), "labels": yv.contiguous()}, os.path.join(data_dir, "digits_val.safetensors"))
    save_file(
        {"inputs": xc.contiguous(), "labels": yc.contiguous()}, os.path.join(data_dir, "digits_calib.safetensors")
    )
    write_image_folder(xv, yv, os.path.join(data_dir, "digits_images"), args.images_per_class)
    write_layouts(healthy, xc, yc)
    write_onnx_samples(healthy, os.path.join(HERE, "onnx"))
    write_onnx_folded_sample(healthy, os.path.join(HERE, "onnx"))
    write_pt2_samples(healthy, os.path.join(HERE, "pt2"))
    write_inception_channel(healthy)
    write_federated_samples(healthy, xc, yc, os.path.join(HERE, "federated"))


def fine_tune_frozen_backbone(pretrained, x, y, epochs: int = 2) -> dict[str, torch.Tensor]:
    """The head fine-tuned on (x, y) with the backbone's requires_grad=False, the model in
    train() as a typical loop leaves it (the mistake `bnaudit diff` reports)."""
    torch.manual_seed(3)
    model = digits_net()
    model.load_state_dict(pretrained)
    for p in model.features.parameters():
        p.requires_grad_(False)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    g = torch.Generator().manual_seed(4)
    run_epochs(model, opt, x, y, epochs, g)
    return state(model)


def train_client(global_state: dict[str, torch.Tensor], x, y, steps: int, seed: int) -> dict[str, torch.Tensor]:
    """One federated client's round: the global weights trained `steps` Adam steps on its own
    (class-skewed) data in train() mode, BatchNorm statistics updating as they do."""
    torch.manual_seed(seed)
    model = digits_net()
    model.load_state_dict(global_state)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):
        idx = torch.randperm(len(y), generator=g)[:32]
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return state(model)


def write_federated_samples(healthy: dict[str, torch.Tensor], x, y, folder: str) -> None:
    """A federated round (issue #36): two clients, each with one half of the digits (0-4 and
    5-9 of the calibration split: class-skewed, non-IID), train the healthy weights a few
    steps; the server averages every state-dict entry as floats, as an aggregator that
    treats buffers like weights does: averaged statistics and a float num_batches_tracked."""
    os.makedirs(folder, exist_ok=True)
    clients = []
    for k, (classes, steps) in enumerate((((0, 1, 2, 3, 4), 8), ((5, 6, 7, 8, 9), 5)), start=1):
        mask = torch.isin(y, torch.tensor(classes))
        xk, yk = x[mask].contiguous(), y[mask].contiguous()
        save_file({"inputs": xk, "labels": yk}, os.path.join(folder, f"client{k}_data.safetensors"))
        clients.append(train_client(healthy, xk, yk, steps, seed=10 + k))
        save_file(clients[-1], os.path.join(folder, f"client{k}.safetensors"))
    averaged = {name: sum(c[name].double() for c in clients) / len(clients) for name in clients[0]}
    save_file(
        {name: value.float().contiguous() for name, value in averaged.items()},
        os.path.join(folder, "global.safetensors"),
    )
    write_client_statistics(folder)


def write_client_statistics(folder: str) -> None:
    """The exact fix's first half, as each client runs it: `bnaudit recalibrate --stats-out` of
    the global weights on the client's own data (client1.bnstats, client2.bnstats)."""
    import subprocess

    repo = os.path.dirname(HERE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)}
    here = os.path.relpath(folder, repo)  # the files record the data's path: the same on every machine
    for k in (1, 2):
        subprocess.run(
            [
                sys.executable, "-m", "bnaudit", "recalibrate", os.path.join(here, "global.safetensors"),
                "--arch", os.path.join(os.path.relpath(HERE, repo), "digits_net.py") + ":digits_net",
                "--data", os.path.join(here, f"client{k}_data.safetensors"),
                "--stats-out", os.path.join(here, f"client{k}.bnstats"), "--force", "-q",
            ],
            check=True, env=env, cwd=repo, stdout=subprocess.DEVNULL,
        )  # fmt: skip


def write_image_folder(x, y, root: str, per_class: int) -> None:
    """ImageFolder layout: root/<class>/<index>.png, 8-bit grayscale."""
    from PIL import Image

    counts = dict.fromkeys(range(10), 0)
    for i in range(len(y)):
        c = int(y[i])
        if counts[c] >= per_class:
            continue
        folder = os.path.join(root, str(c))
        os.makedirs(folder, exist_ok=True)
        pixels = (x[i, 0].numpy() * 255).round().astype(np.uint8)
        Image.fromarray(pixels, mode="L").save(os.path.join(folder, f"{i:04d}.png"), optimize=True)
        counts[c] += 1


if __name__ == "__main__":
    main()

"""BN003 graded by damage, on the checkpoint PyTorch Lightning itself writes: one epoch of
18 batches (0.9^18 = 15.0% of initial values, a warning by the counter alone) on inputs of
small variance leaves running_var mostly the initial 1.0, eval mode collapses, and BN003
is an error giving the factor by which the stored variance overstates the data's, checked
against the batch variances the test records itself while Lightning trains."""

from __future__ import annotations

import copy
import re
import statistics
from pathlib import Path

import pytest
import torch
from timm_support import import_lightning
from torch import nn

import bnaudit

BATCHES, BATCH, MOMENTUM, EPS = 18, 64, 0.1, 1e-5
SCALE = 0.03  # the inputs' scale: the first BN's input variance is about 1e-3
BN_LAYERS = ("net.1", "net.4")  # state-dict names in the checkpoint (the module's `net` attribute)

pytestmark = pytest.mark.slow  # importing lightning and a Trainer run take ~15 s here


def _blobs() -> tuple[torch.Tensor, torch.Tensor]:
    """10 overlapping Gaussian classes in 32-D, multiplied by SCALE: BATCHES * BATCH samples."""
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(10, 32, generator=g)
    y = torch.randint(0, 10, (BATCHES * BATCH,), generator=g)
    return (centres[y] + 0.7 * torch.randn(BATCHES * BATCH, 32, generator=g)) * SCALE, y


def _module_class(lightning):
    class Classifier(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(
                nn.Linear(32, 64, bias=False),
                nn.BatchNorm1d(64, momentum=MOMENTUM, eps=EPS),
                nn.ReLU(),
                nn.Linear(64, 64, bias=False),
                nn.BatchNorm1d(64, momentum=MOMENTUM, eps=EPS),
                nn.ReLU(),
                nn.Linear(64, 10),
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self(x), y)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.02)

    return Classifier


@pytest.fixture(scope="module")
def one_epoch(tmp_path_factory):
    """Lightning trains one epoch and writes its own checkpoint (ModelCheckpoint). Returns
    the .ckpt path, the trained module, the unbiased variance of every training batch that
    reached each BN (recorded by forward pre-hooks in training mode only, the values
    PyTorch's running update uses) and the accuracies in train and eval mode."""
    lightning = import_lightning()
    root = tmp_path_factory.mktemp("lightning")
    x, y = _blobs()
    lightning.seed_everything(1, verbose=False)
    model = _module_class(lightning)()
    seen: dict[str, list[torch.Tensor]] = {name: [] for name in BN_LAYERS}

    def record(name: str):
        def hook(module, args):
            if module.training:
                seen[name].append(args[0].detach().double().var(0, unbiased=True))

        return hook

    hooks = [model.get_submodule(name).register_forward_pre_hook(record(name)) for name in BN_LAYERS]
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y),
        batch_size=BATCH,
        shuffle=True,
        generator=torch.Generator().manual_seed(2),
        num_workers=0,
    )
    trainer = lightning.Trainer(
        max_epochs=1,
        accelerator="cpu",
        devices=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=True,
        default_root_dir=root,
        deterministic=True,
    )
    trainer.fit(model, loader)
    for hook in hooks:
        hook.remove()
    (ckpt,) = Path(root, "checkpoints").glob("*.ckpt")  # ModelCheckpoint's own file
    with torch.no_grad():
        train_accuracy = (copy.deepcopy(model.net).train()(x).argmax(1) == y).float().mean().item()
        eval_accuracy = (model.net.eval()(x).argmax(1) == y).float().mean().item()
    return ckpt, model, seen, train_accuracy, eval_accuracy


def _data_variance(batches: list[torch.Tensor]) -> torch.Tensor:
    """Per channel, the momentum-weighted mean of the batch variances: weights
    m(1-m)^(t-1-k) for batch k of t, normalised to sum 1 (the data's variance as the running
    update weighs it, without the initial value)."""
    assert len(batches) == BATCHES
    weights = torch.tensor([MOMENTUM * (1 - MOMENTUM) ** (BATCHES - 1 - k) for k in range(BATCHES)])
    return (weights.double()[:, None] * torch.stack(batches)).sum(0) / weights.double().sum()


def _factor(message: str) -> float:
    found = re.search(r"stored running_var about ([0-9.]+)x the data's", message)
    assert found, message
    return float(found.group(1))


def test_lightning_checkpoint_holds_mostly_initial_statistics(one_epoch):
    """The premises, from the file Lightning wrote: 18 updates, and running_var equal to
    the initial 1 weighted 0.9^18 plus the recorded batches' variances (so the hooks saw
    exactly what the layer averaged); eval mode collapses."""
    ckpt, _, seen, train_accuracy, eval_accuracy = one_epoch
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert "pytorch-lightning_version" in saved and saved["epoch"] == 0
    w = (1 - MOMENTUM) ** BATCHES
    for name in BN_LAYERS:
        assert int(saved["state_dict"][f"{name}.num_batches_tracked"]) == BATCHES
        expected = w * 1.0 + (1 - w) * _data_variance(seen[name])
        stored = saved["state_dict"][f"{name}.running_var"].double()
        torch.testing.assert_close(stored, expected, rtol=1e-4, atol=1e-6)
    # the first BN's data variance is ~1e-3: about 99% of its stored running_var is the initial 1.0
    first = _data_variance(seen["net.1"])
    assert statistics.median((w / (w + (1 - w) * first)).tolist()) > 0.95
    assert train_accuracy > 0.9 and eval_accuracy < train_accuracy - 0.5


def test_bn003_is_an_error_with_the_overstatement_on_a_lightning_checkpoint(one_epoch):
    ckpt, model, seen, _, _ = one_epoch
    report = bnaudit.inspect([str(ckpt)])
    by_layer = {f.layer: f for f in report.files[0].findings if f.code == "BN003"}
    assert set(by_layer) == set(BN_LAYERS)
    # the test's own overstatement: median over channels of (stored + eps) / (data + eps)
    factors = {}
    for name in BN_LAYERS:
        stored = model.get_submodule(name).running_var.double()
        factors[name] = statistics.median(((stored + EPS) / (_data_variance(seen[name]) + EPS)).tolist())
    assert factors["net.1"] > 20 and 0.5 < factors["net.4"] < 2  # only the first BN's data is small
    first = by_layer["net.1"]
    assert first.severity == "error"
    assert f"{(1 - MOMENTUM) ** BATCHES * 100:.1f}% after {BATCHES} updates" in first.message  # 15.0%
    assert _factor(first.message) == pytest.approx(factors["net.1"], rel=0.1)
    # the second BN's data has about unit variance: 15% of initial values do little
    second = by_layer["net.4"]
    assert second.severity == "warning" and "data's" not in second.message

"""One answer to "is this a BatchNorm, and which kind" (audit/normkinds.py): the table pinned
class by class and op by op, and the same answer from every place that asks."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from bnaudit.audit.audit import inspect
from bnaudit.audit.layers import facts_from_module_infos
from bnaudit.cli import app
from bnaudit.formats.read import read_checkpoint
from bnaudit.runtime.norms import batchnorm_modules, classify_layers, norm_modules

# torch.jit.script warns that TorchScript is deprecated; it is still a format users ship
pytestmark = [
    pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning"),
]


class MyBN(nn.BatchNorm2d):
    """A user subclass: TorchScript keeps only the name "MyBN", never the base class."""


class MyIN(nn.InstanceNorm2d):
    pass


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = MyBN(4, track_running_stats=False)
        self.bn2 = nn.BatchNorm2d(4)
        self.inorm = MyIN(4, track_running_stats=False, affine=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inorm(self.bn2(self.bn(self.conv(x))))


def test_scripted_batchnorm_subclass_without_running_stats_gets_bn006_from_the_archive_alone(tmp_path) -> None:
    # issue 20, Q2: before, BN006 needed --arch because "MyBN" does not contain "BatchNorm";
    # the archive's code shows that MyBN normalises by F.batch_norm, the untracked MyIN by
    # F.instance_norm (an InstanceNorm is batch-independent: no BN006 for it)
    path = tmp_path / "model.jit"
    torch.jit.save(torch.jit.script(Net().eval()), str(path))
    result = CliRunner().invoke(app, ["inspect", str(path), "--format", "json"])
    doc = json.loads(result.stdout)
    found = [(f["layer"], f["message"].split(":")[0]) for f in doc["files"][0]["findings"] if f["code"] == "BN006"]
    assert found == [("bn", "MyBN with track_running_stats=False")]


def test_the_archive_reader_and_the_runtime_give_one_answer_for_scripted_and_traced_modules(tmp_path) -> None:
    scripted, traced = tmp_path / "scripted.jit", tmp_path / "traced.jit"
    torch.jit.save(torch.jit.script(Net().eval()), str(scripted))
    eager = nn.Sequential(nn.Conv2d(3, 4, 3), MyBN(4), MyIN(4, track_running_stats=True)).eval()
    torch.jit.save(torch.jit.trace(eager, torch.randn(2, 3, 6, 6)), str(traced))
    for path, batch_norms, norms in ((scripted, ["bn", "bn2"], ["bn", "bn2", "inorm"]), (traced, ["1"], ["1", "2"])):
        loaded = torch.jit.load(str(path))
        assert list(batchnorm_modules(loaded)) == batch_norms, path.name
        assert list(norm_modules(loaded)) == norms, path.name
        facts = facts_from_module_infos(read_checkpoint(str(path)).modules)
        assert sorted(facts.batch_norms) == batch_norms, path.name
    # recalibrate now takes the scripted subclass for what it is
    targets, _ = classify_layers(torch.jit.load(str(traced)))
    assert list(targets) == ["1"]


def test_a_pickled_batchnorm_subclass_without_running_stats_gets_bn006_without_arch(tmp_path) -> None:
    path = tmp_path / "model.pt"
    torch.save(Net().eval(), str(path))
    report = inspect(str(path), trust_pickle=True)
    found = [(f.layer, f.message.split(":")[0]) for f in report.findings if f.code == "BN006"]
    assert found == [("bn", "MyBN with track_running_stats=False")]

"""Issue 21 for `diff`: trust nothing in the file, say what it sees, short output, say what
was measured. Each test builds its files the way users or real libraries do."""

from __future__ import annotations

import json
import os
import sys

import torch
from conftest import SAMPLES, save_safetensors

from bnaudit.audit.diff import diff

sys.path.insert(0, SAMPLES)

ARCH = os.path.join(SAMPLES, "digits_net.py") + ":digits_net"
CALIB = os.path.join(SAMPLES, "data", "digits_calib.safetensors")


def test_forged_recalibration_record_does_not_silence_bn101(tmp_path):
    """A real `recalibrate` record, copied into a fine-tuned checkpoint whose backbone
    updated its statistics while frozen: its digests do not match those statistics, so
    diff audits the layers as usual, exactly as inspect does (BN101 warnings, exit 1)."""
    from bnaudit import DataOptions, inspect, recalibrate_checkpoint

    pretrained = os.path.join(SAMPLES, "pretrained.safetensors")
    recal = str(tmp_path / "recal.safetensors")
    recalibrate_checkpoint(pretrained, recal, DataOptions(path=CALIB, batch_size=50), arch=ARCH)
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

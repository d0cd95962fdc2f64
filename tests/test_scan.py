"""Folder scans (issue #21): every checkpoint suffix `inspect` reads, and what is not a
checkpoint or holds no model listed as skipped, never as unreadable or as an "ok" model.

The foreign files are shaped exactly like the real ones: a Core ML `weight.bin` as
coremltools' MILBlob writer lays it out (StorageFormat.hpp: a 64-byte storage_header,
then per blob a 64-byte blob_metadata with sentinel 0xDEADBEEF and 64-byte aligned data),
a wheel as `bdist_wheel` writes it (deflated members, `*.dist-info/WHEEL`, `METADATA`,
`RECORD` with urlsafe-base64 sha256 digests), and data files as bnaudit's own data
loader reads them (`inputs` / `labels`, sample_models/data).
"""

from __future__ import annotations

import base64
import hashlib
import shutil
import struct
import zipfile
from pathlib import Path

import torch
from conftest import SAMPLES, bn_entries, save_safetensors

from bnaudit.api import inspect
from bnaudit.config import Config


def bn_net() -> torch.nn.Module:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 3, 3), torch.nn.BatchNorm2d(3), torch.nn.ReLU())
    net.train()
    for _ in range(3):
        net(torch.randn(4, 1, 6, 6))
    return net.eval()


def coreml_weight_bin(path: Path, blobs: list[bytes]) -> Path:
    """MILBlob storage (version 2): header {u32 count, u32 version=2, 7 x u64 reserved},
    then per blob {u32 sentinel 0xDEADBEEF, u32 dtype (2 = Float32), u64 size, u64 offset,
    5 x u64 reserved} and the data, every entry 64-byte aligned."""
    out = bytearray(struct.pack("<II7Q", len(blobs), 2, *[0] * 7))
    for data in blobs:
        metadata_at = len(out)
        offset = metadata_at + 64
        out += struct.pack("<IIQQ5Q", 0xDEADBEEF, 2, len(data), offset, *[0] * 5)
        out += data
        out += b"\x00" * (-len(out) % 64)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes(out))
    return path


def wheel(path: Path, files: dict[str, bytes]) -> Path:
    """A wheel as bdist_wheel writes it: deflated members, dist-info last, RECORD listing
    every file with its urlsafe-base64 sha256 digest and size."""
    name, version = "facedet", "1.0"
    info = f"{name}-{version}.dist-info"
    members = dict(files)
    members[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()
    members[f"{info}/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: bdist_wheel (0.43.0)\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    record = []
    for member, data in members.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{member},sha256={digest},{len(data)}")
    record.append(f"{info}/RECORD,,")
    members[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for member, data in members.items():
            archive.writestr(member, data)
    return path


# A module of a real package: far larger than the whole wheel once deflated.
BIG_SOURCE = b"".join(f"TABLE_{i} = {[i * j for j in range(8)]}\n".encode() for i in range(6000))


def by_name(report) -> dict:
    return {Path(f.path).name: f for f in report.files}


def test_scan_takes_jit_and_pt2_files_like_other_checkpoints(tmp_path):
    torch.jit.script(bn_net()).save(str(tmp_path / "model.jit"))
    shutil.copy(Path(SAMPLES) / "healthy.safetensors", tmp_path / "healthy.safetensors")
    shutil.copy(Path(SAMPLES) / "pt2" / "eval.pt2", tmp_path / "model.pt2")  # torch.export.save's archive
    files = by_name(inspect(str(tmp_path), Config()))
    assert set(files) == {"model.jit", "healthy.safetensors", "model.pt2"}
    jit = files["model.jit"]
    assert jit.error is None and jit.format == "torchscript"
    assert [s.name for s in jit.layers] == ["1"] and jit.layers[0].num_features == 3
    pt2 = files["model.pt2"]
    assert pt2.error is None and pt2.format == "pt2" and len(pt2.layers) == 3


def test_foreign_files_in_a_scanned_folder_are_skipped_not_unreadable(tmp_path):
    folder = tmp_path / "release"
    folder.mkdir()
    shutil.copy(Path(SAMPLES) / "healthy.safetensors", folder / "healthy.safetensors")
    weights = [struct.pack("<16f", *[0.25 * i for i in range(16)]), struct.pack("<8f", *range(8))]
    coreml_weight_bin(folder / "Digits.mlpackage/Data/com.apple.CoreML/weights/weight.bin", weights)
    (folder / "vocab.bin").write_text("the\nof\nand\n")
    report = inspect(str(folder), Config())
    files = by_name(report)
    assert set(files) == {"healthy.safetensors", "weight.bin", "vocab.bin"}
    for name in ("weight.bin", "vocab.bin"):
        assert files[name].error is None
        assert files[name].skip_reason == "not a checkpoint"
        assert "neither torch.save" in files[name].skipped
    assert report.summary()["unreadable"] == 0
    assert report.exit_code() == 0  # the healthy model decides
    assert report.summary()["layers"] == 3


def test_foreign_file_named_explicitly_stays_an_error(tmp_path):
    path = coreml_weight_bin(tmp_path / "weight.bin", [b"\x00" * 64])
    report = inspect(str(path), Config())
    (file,) = report.files
    assert file.skipped is None and "not a checkpoint" in file.error
    assert report.exit_code() == 2


def test_a_wheel_is_named_as_a_wheel_not_as_a_zip_bomb(tmp_path):
    path = wheel(
        tmp_path / "facedet-1.0-py3-none-any.whl", {"facedet/__init__.py": b"", "facedet/tables.py": BIG_SOURCE}
    )
    # the premise: a normal deflated member is larger than the whole wheel
    assert len(BIG_SOURCE) > path.stat().st_size
    (file,) = inspect(str(path), Config()).files
    assert file.error is not None
    assert "wheel" in file.error and "not a checkpoint" in file.error
    assert "claims" not in file.error and "refused" not in file.error


def test_a_wheel_says_which_members_look_like_checkpoints(tmp_path):
    onnx_bytes = (Path(SAMPLES) / "onnx" / "digits.onnx").read_bytes()
    path = wheel(tmp_path / "facedet-1.0-py3-none-any.whl", {"facedet/models/det.onnx": onnx_bytes})
    (file,) = inspect(str(path), Config()).files
    assert "wheel" in file.error and "claims" not in file.error
    assert "unzip it to audit the checkpoint files it holds: facedet/models/det.onnx" in file.error


def test_a_zip_that_is_no_torch_archive_in_a_scan_is_skipped(tmp_path):
    with zipfile.ZipFile(tmp_path / "images.pt", "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("images/0.txt", BIG_SOURCE)
    torch.save(bn_entries("bn"), tmp_path / "model.pt")
    report = inspect(str(tmp_path), Config())
    files = by_name(report)
    assert files["images.pt"].error is None
    assert files["images.pt"].skip_reason == "not a checkpoint"
    assert "zip archive" in files["images.pt"].skipped
    assert report.summary()["unreadable"] == 0


def test_a_torch_archive_inflating_past_the_file_is_still_refused(tmp_path):
    # claims the torch.save layout and breaks it: unreadable, in a scan too
    with zipfile.ZipFile(tmp_path / "model.pt", "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("model/data.pkl", BIG_SOURCE)
    report = inspect(str(tmp_path), Config())
    (file,) = report.files
    assert "claims" in file.error and file.skipped is None
    assert report.exit_code() == 2


def test_data_files_in_a_scan_hold_no_model(tmp_path):
    shutil.copy(Path(SAMPLES) / "data" / "digits_calib.safetensors", tmp_path / "digits_calib.safetensors")
    shutil.copy(Path(SAMPLES) / "healthy.safetensors", tmp_path / "healthy.safetensors")
    save_safetensors({"x": torch.randn(5, 3), "y": torch.tensor([0, 1, 0, 1, 1])}, tmp_path / "pairs.safetensors")
    report = inspect(str(tmp_path), Config())
    files = by_name(report)
    for name in ("digits_calib.safetensors", "pairs.safetensors"):
        assert files[name].skip_reason == "data, not a model", name
        assert files[name].layers == [] and files[name].error is None
    assert "inputs (300, 1, 8, 8)" in files["digits_calib.safetensors"].skipped
    assert files["healthy.safetensors"].skipped is None and len(files["healthy.safetensors"].layers) == 3


def test_a_model_without_bn_is_not_taken_for_data(tmp_path):
    save_safetensors({"fc.weight": torch.randn(3, 4), "fc.bias": torch.randn(3)}, tmp_path / "linear.safetensors")
    save_safetensors({"inputs": torch.randn(2, 4), "fc.weight": torch.randn(3, 4)}, tmp_path / "mixed.safetensors")
    shutil.copy(Path(SAMPLES) / "healthy.safetensors", tmp_path / "healthy.safetensors")
    files = by_name(inspect(str(tmp_path), Config()))
    assert files["linear.safetensors"].skipped is None
    assert files["mixed.safetensors"].skipped is None


def test_a_data_file_named_explicitly_says_what_it_holds(tmp_path):
    path = Path(SAMPLES) / "data" / "digits_calib.safetensors"
    (file,) = inspect(str(path), Config()).files
    assert file.skipped is None and file.error is None and file.layers == []
    assert any("data, not a model" in note and "labels (300,)" in note for note in file.notes)

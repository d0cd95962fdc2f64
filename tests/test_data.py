"""Datasets: image folders, tensor files and shards, custom datasets; order, batching,
workers, and every bad-data case as one clear error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid

import numpy as np
import pytest
import torch
from conftest import REPO, count_data_reads
from PIL import Image
from safetensors.torch import save_file
from typer.testing import CliRunner

from bnaudit.cli import app
from bnaudit.errors import BnauditError
from bnaudit.runtime.batching import BatchPlan
from bnaudit.runtime.data import (
    DataOptions,
    make_loader,
    parse_float_list,
)

torch.set_num_threads(1)


def _pixels(seed: int, h: int, w: int, channels: int = 3) -> np.ndarray:
    rng = np.random.default_rng(seed)
    shape = (h, w, channels) if channels > 1 else (h, w)
    return rng.integers(0, 256, size=shape, dtype=np.uint8)


def _image_folder(root, per_class: int = 3, size: tuple[int, int] = (5, 7), suffix: str = ".png"):
    """Classes 'cat' and 'ant' (so sorted order differs from creation order)."""
    arrays = {}
    for c, name in enumerate(["cat", "ant"]):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            pixels = _pixels(10 * c + i, *size)
            Image.fromarray(pixels).save(root / name / f"{i}{suffix}")
            arrays[(name, i)] = pixels
    return arrays


def _all(stream):
    batches = list(stream)
    inputs = torch.cat([b.inputs for b in batches])
    labels = torch.cat([b.labels for b in batches]) if batches[0].labels is not None else None
    origins = [o for b in batches for o in b.origins]
    return batches, inputs, labels, origins


# ----------------------------------------------------------------------------- image folders


def test_image_folder_classes_pixels_and_labels(tmp_path):
    arrays = _image_folder(tmp_path / "imgs")
    stream = make_loader(DataOptions(path=str(tmp_path / "imgs"), batch_size=4, shuffle=False))
    assert stream.has_labels and stream.num_samples == 6
    _, inputs, labels, origins = _all(stream)
    # sorted class order: 'ant' is class 0 although it was created second
    assert labels.tolist() == [0, 0, 0, 1, 1, 1]
    assert origins[0].endswith("ant/0.png")
    expected = torch.from_numpy(arrays[("ant", 0)].astype(np.float32) / 255).permute(2, 0, 1)
    assert inputs.shape == (6, 3, 5, 7) and inputs.dtype == torch.float32
    assert torch.equal(inputs[0], expected)


def test_grayscale_mean_and_std(tmp_path):
    arrays = _image_folder(tmp_path / "imgs")
    stream = make_loader(
        DataOptions(path=str(tmp_path / "imgs"), batch_size=8, shuffle=False, grayscale=True, mean=(0.5,), std=(0.25,))
    )
    _, inputs, _, _ = _all(stream)
    rgb = arrays[("cat", 2)].astype(np.int64)
    # ITU-R 601-2 luma, as Pillow's "L" conversion computes it in fixed point
    luma = (rgb[..., 0] * 19595 + rgb[..., 1] * 38470 + rgb[..., 2] * 7471 + 0x8000) >> 16
    expected = (luma / 255.0 - 0.5) / 0.25
    assert inputs.shape == (6, 1, 5, 7)
    assert np.allclose(inputs[5, 0].numpy(), expected, atol=1e-6)
    rgb_stream = make_loader(
        DataOptions(path=str(tmp_path / "imgs"), batch_size=8, shuffle=False, mean=(0.1, 0.2, 0.3), std=(0.5, 0.5, 2.0))
    )
    _, rgb_inputs, _, _ = _all(rgb_stream)
    raw = arrays[("ant", 1)].astype(np.float64) / 255
    assert np.allclose(rgb_inputs[1].permute(1, 2, 0).numpy(), (raw - [0.1, 0.2, 0.3]) / [0.5, 0.5, 2.0], atol=1e-6)


def test_image_size_resizes_the_shorter_side_and_center_crops(tmp_path):
    arrays = _image_folder(tmp_path / "imgs", size=(6, 10))
    stream = make_loader(DataOptions(path=str(tmp_path / "imgs"), batch_size=8, shuffle=False, image_size=3))
    _, inputs, _, _ = _all(stream)
    assert inputs.shape == (6, 3, 3, 3)
    # 6x10 (h x w) -> shorter side 3: 3x5, then the central 3 columns 1..3
    resized = np.asarray(Image.fromarray(arrays[("ant", 0)]).resize((5, 3), Image.BILINEAR), dtype=np.float32)
    expected = torch.from_numpy(resized[:, 1:4] / 255).permute(2, 0, 1)
    assert torch.allclose(inputs[0], expected)


@pytest.mark.parametrize("suffix", [".jpg", ".bmp", ".webp"])
def test_other_image_formats_are_read(tmp_path, suffix):
    arrays = _image_folder(tmp_path / "imgs", suffix=suffix)
    _, inputs, labels, _ = _all(make_loader(DataOptions(path=str(tmp_path / "imgs"), batch_size=8, shuffle=False)))
    assert inputs.shape == (6, 3, 5, 7) and labels.tolist() == [0, 0, 0, 1, 1, 1]
    if suffix == ".bmp":  # lossless: the pixels come back exactly (JPEG and default WebP are lossy)
        assert torch.equal(inputs[3], torch.from_numpy(arrays[("cat", 0)].astype(np.float32) / 255).permute(2, 0, 1))


def test_unreadable_image_is_named_or_skipped(tmp_path):
    _image_folder(tmp_path / "imgs", per_class=4)
    (tmp_path / "imgs" / "ant" / "broken.png").write_bytes(b"not a png")
    with pytest.raises(BnauditError, match=r"broken\.png: cannot read image .*--skip-bad"):
        list(make_loader(DataOptions(path=str(tmp_path / "imgs"), batch_size=4)))
    stream = make_loader(DataOptions(path=str(tmp_path / "imgs"), batch_size=4, skip_bad=True))
    batches, inputs, _, origins = _all(stream)
    assert stream.skipped == 1 and len(inputs) == 8
    assert not any("broken" in o for o in origins)
    assert all(b.size >= 2 for b in batches)


def test_skipping_never_leaves_a_batch_of_one(tmp_path):
    _image_folder(tmp_path / "imgs", per_class=2)
    for name in ("ant/1.png", "cat/0.png"):
        (tmp_path / "imgs" / name).write_bytes(b"")
    # no shuffle, batches of 2: [ant0, ant1x] [cat0x, cat1] -> one sample each -> joined
    stream = make_loader(DataOptions(path=str(tmp_path / "imgs"), batch_size=2, shuffle=False, skip_bad=True))
    batches = list(stream)
    assert [b.size for b in batches] == [2] and stream.skipped == 2


def test_images_of_different_sizes_need_image_size(tmp_path):
    _image_folder(tmp_path / "imgs", per_class=1)
    Image.fromarray(_pixels(0, 9, 9)).save(tmp_path / "imgs" / "cat" / "big.png")
    with pytest.raises(BnauditError, match=r"samples differ in shape: .* \(pass --image-size"):
        list(make_loader(DataOptions(path=str(tmp_path / "imgs"), batch_size=8, shuffle=False)))


# ----------------------------------------------------------------------------- tensor files


@pytest.mark.parametrize("kind", ["safetensors", "pt", "shards"])
def test_tensor_files_and_shards(tmp_path, kind):
    x = torch.randn(10, 2, 3)
    y = torch.arange(10) % 4
    if kind == "safetensors":
        save_file({"inputs": x, "labels": y}, tmp_path / "d.safetensors")
        path = tmp_path / "d.safetensors"
    elif kind == "pt":
        torch.save({"inputs": x, "labels": y}, tmp_path / "d.pt")
        path = tmp_path / "d.pt"
    else:
        (tmp_path / "shards").mkdir()
        save_file({"inputs": x[:4], "labels": y[:4]}, tmp_path / "shards" / "a.safetensors")
        torch.save({"inputs": x[4:9], "labels": y[4:9]}, tmp_path / "shards" / "b.pt")
        save_file({"inputs": x[9:], "labels": y[9:]}, tmp_path / "shards" / "c.safetensors")  # one sample
        path = tmp_path / "shards"
    stream = make_loader(DataOptions(path=str(path), batch_size=3, seed=4))
    order = torch.randperm(10, generator=torch.Generator().manual_seed(4)).tolist()
    batches, inputs, labels, _ = _all(stream)
    assert [b.size for b in batches] == [3, 3, 4]  # the lone 10th sample joined the last batch
    assert torch.equal(inputs, x[order]) and torch.equal(labels, y[order])
    assert labels.dtype == torch.int64


@pytest.mark.parametrize("fmt", ["safetensors", "torch-zip", "torch-zip-view"])
def test_tensor_file_batches_read_only_their_rows(tmp_path, monkeypatch, fmt):
    """A data file is read batch by batch: each batch's rows and nothing else (a memory
    map would leave every page read resident, so peak RSS would grow with the samples
    streamed), from safetensors and torch.save zip files alike, a view into a larger
    storage too. The values are the file's, in the shuffled order."""

    x = torch.arange(40 * 3 * 4, dtype=torch.float32).reshape(40, 3, 4)
    y = torch.arange(40) % 3
    path = tmp_path / "rows.data"
    if fmt == "safetensors":
        save_file({"inputs": x, "labels": y}, path)
    else:  # the view: rows 5.. of a larger tensor, saved with its whole storage
        padded = torch.cat([torch.full((5, 3, 4), -1.0), x])
        torch.save({"inputs": padded[5:] if fmt == "torch-zip-view" else x, "labels": y}, path)
    read = count_safetensors_reads(monkeypatch) if fmt == "safetensors" else count_data_reads(monkeypatch)
    stream = make_loader(DataOptions(path=str(path), batch_size=8, seed=3))
    batches = list(stream)
    order = torch.cat([b.labels for b in batches])  # labels are row % 3: check rows via inputs
    rows = torch.cat([b.inputs for b in batches])[:, 0, 0].long() // 12
    assert sorted(rows.tolist()) == list(range(40)) and rows.tolist() != list(range(40))  # shuffled, each once
    assert torch.equal(torch.cat([b.inputs for b in batches]), x[rows]) and torch.equal(order, y[rows])
    assert sum(read) == x.numel() * 4  # every input byte read once, in reads of whole rows
    assert all(n % (3 * 4 * 4) == 0 for n in read)


@pytest.mark.slow
def test_streaming_a_safetensors_data_file_keeps_one_batch_in_memory(tmp_path):
    # 32 MiB of inputs read in 1 MiB batches: the peak RSS of the reading process may grow
    # by a few batches, not by the file (as a reader that loads the tensor per slice would)
    path = tmp_path / "big.safetensors"
    save_file({"inputs": torch.zeros(2048, 4096), "labels": torch.zeros(2048, dtype=torch.int64)}, path)
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss across exec, from this (large) process
    script = textwrap.dedent(f"""
        from bnaudit.runtime.safetensors_files import open_safetensors

        def peak_kib():
            with open("/proc/self/status") as f:
                return int(next(line for line in f if line.startswith("VmHWM:")).split()[1])

        inputs = open_safetensors({str(path)!r})["inputs"]
        before = peak_kib()
        for start in range(0, 2048, 64):
            assert inputs.take(list(range(start, start + 64))).shape == (64, 4096)
        print((peak_kib() - before) // 1024)
    """)
    env = {**os.environ, "PYTHONPATH": REPO}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    assert int(done.stdout) < 8, done.stdout  # MiB


def count_safetensors_reads(monkeypatch) -> list[int]:
    """Route `safe_open` in bnaudit.runtime.safetensors_files through a handle that records
    the byte count of every slice read from the package: the list that fills as data is read."""
    import bnaudit.runtime.safetensors_files as module

    read: list[int] = []
    real = module.safe_open

    class Slice:
        def __init__(self, stored):
            self.stored = stored

        def __getitem__(self, key):
            tensor = self.stored[key]
            read.append(tensor.numel() * tensor.element_size())
            return tensor

        def __getattr__(self, name):
            return getattr(self.stored, name)

    class Handle:
        def __init__(self, *args, **kwargs):
            self.handle = real(*args, **kwargs)

        def __enter__(self):
            self.file = self.handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

        def get_slice(self, name):
            return Slice(self.file.get_slice(name))

        def __getattr__(self, name):
            return getattr(self.file, name)

    monkeypatch.setattr(module, "safe_open", Handle)
    return read


def test_torch_file_inputs_not_in_row_order_are_still_read_right(tmp_path):
    x = torch.arange(6 * 2 * 3, dtype=torch.float32).reshape(6, 3, 2).transpose(1, 2)  # not C order
    torch.save({"inputs": x, "labels": torch.arange(6) % 2}, tmp_path / "t.pt")
    batches = list(make_loader(DataOptions(path=str(tmp_path / "t.pt"), batch_size=3, shuffle=False)))
    assert torch.equal(torch.cat([b.inputs for b in batches]), x)


def test_bfloat16_tensor_file_values_and_shape(tmp_path):
    # numpy has no bfloat16: this file's inputs are read through the checkpoint reader
    # (values exact in bfloat16: multiples of 1/8 below 3)
    x = (torch.arange(24, dtype=torch.float32).reshape(6, 2, 2) / 8).to(torch.bfloat16)
    save_file({"inputs": x, "labels": torch.arange(6) % 2}, tmp_path / "bf.safetensors")
    batches = list(make_loader(DataOptions(path=str(tmp_path / "bf.safetensors"), batch_size=3, shuffle=False)))
    assert [tuple(b.inputs.shape) for b in batches] == [(3, 2, 2), (3, 2, 2)]
    assert torch.equal(torch.cat([b.inputs for b in batches]), x)  # the stored dtype, as from a torch file
    assert torch.cat([b.labels for b in batches]).tolist() == [0, 1, 0, 1, 0, 1]


def test_unlabelled_tensor_file(tmp_path):
    x = torch.randn(5, 3)
    save_file({"inputs": x}, tmp_path / "x.safetensors")
    stream = make_loader(DataOptions(path=str(tmp_path / "x.safetensors"), batch_size=5, shuffle=False))
    batches = list(stream)
    assert stream.has_labels is False and batches[0].labels is None and torch.equal(batches[0].inputs, x)


@pytest.mark.parametrize(
    "tensors, fragment",
    [
        (
            {"inputs": torch.zeros(4, 2), "labels": torch.zeros(3, dtype=torch.int64)},
            "'inputs' has 4 samples but 'labels' has 3",
        ),
        ({"x": torch.zeros(4, 2)}, "holds no 'inputs' tensor (found 'x')"),
        ({"inputs": torch.zeros(4, 2), "labels": torch.zeros(4)}, "'labels' must hold integer class indices"),
        ({"inputs": torch.zeros(4, 2), "labels": torch.zeros(4, 2, dtype=torch.int64)}, "one class index per sample"),
        ({"inputs": torch.zeros(0, 2)}, "'inputs' holds no samples"),
    ],
)
def test_bad_tensor_files(tmp_path, tensors, fragment):
    save_file(tensors, tmp_path / "bad.safetensors")
    with pytest.raises(BnauditError) as err:
        make_loader(DataOptions(path=str(tmp_path / "bad.safetensors")))
    assert fragment in str(err.value) and "bad.safetensors" in str(err.value)


def test_shards_must_agree(tmp_path):
    (tmp_path / "s").mkdir()
    save_file({"inputs": torch.zeros(2, 3)}, tmp_path / "s" / "a.safetensors")
    save_file({"inputs": torch.zeros(2, 4)}, tmp_path / "s" / "b.safetensors")
    with pytest.raises(BnauditError, match=r"b\.safetensors: inputs of shape \[4\] per sample"):
        make_loader(DataOptions(path=str(tmp_path / "s")))
    save_file(
        {"inputs": torch.zeros(2, 3), "labels": torch.zeros(2, dtype=torch.int64)}, tmp_path / "s" / "b.safetensors"
    )
    with pytest.raises(BnauditError, match="has no labels"):
        make_loader(DataOptions(path=str(tmp_path / "s")))


def test_nan_in_a_batch_names_the_batch_and_sample(tmp_path):
    x = torch.randn(12, 2)
    x[9, 1] = float("inf")
    save_file({"inputs": x}, tmp_path / "x.safetensors")
    with pytest.raises(BnauditError, match=r"batch 2: NaN or Inf in the inputs \(first in .*x\.safetensors\[9\]\)"):
        list(make_loader(DataOptions(path=str(tmp_path / "x.safetensors"), batch_size=4, shuffle=False)))


def test_nan_in_a_batch_that_spans_shards_names_the_shard_and_row(tmp_path):
    (tmp_path / "s").mkdir()
    a, b = torch.randn(4, 3), torch.randn(4, 3)
    b[2, 0] = float("nan")
    save_file({"inputs": a}, tmp_path / "s" / "a.safetensors")
    save_file({"inputs": b}, tmp_path / "s" / "b.safetensors")
    # one shuffled batch of all 8 samples: rows of both shards, interleaved
    with pytest.raises(BnauditError, match=r"batch 0: NaN or Inf in the inputs \(first in .*b\.safetensors\[2\]\)"):
        list(make_loader(DataOptions(path=str(tmp_path / "s"), batch_size=8, seed=1)))


def test_finite_values_whose_sum_overflows_are_not_called_infinite(tmp_path):
    # float16 holds 60000, but the batch's sum (480000) does not: the inputs are still finite
    x = torch.full((4, 2), 60000.0, dtype=torch.float16)
    save_file({"inputs": x}, tmp_path / "big.safetensors")
    batches = list(make_loader(DataOptions(path=str(tmp_path / "big.safetensors"), batch_size=4)))
    assert torch.equal(batches[0].inputs, x)


# ----------------------------------------------------------------------------- custom datasets


@pytest.fixture
def datasets_module(tmp_path, monkeypatch):
    name = f"userdata_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text("""
import torch

X = torch.arange(24, dtype=torch.float32).reshape(6, 4)


class Items(torch.utils.data.Dataset):
    def __init__(self, make):
        self.make = make

    def __len__(self):
        return 6

    def __getitem__(self, i):
        return self.make(i)


def plain():
    return Items(lambda i: X[i])


def pairs():
    return Items(lambda i: (X[i], i % 2))


def dicts():
    return Items(lambda i: {"a": X[i], "b": -X[i], "label": torch.tensor(i % 3)})


def multi():
    return Items(lambda i: ((X[i], X[i] * 2), i))


def failing():
    return Items(lambda i: 1 / 0 if i == 4 else X[i])


def killed_worker():
    import os, signal  # a worker the OS kills (the out-of-memory killer does this)
    return Items(lambda i: os.kill(os.getpid(), signal.SIGKILL) if i == 4 else X[i])


def not_a_dataset():
    return iter([1, 2])
""")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_custom_dataset_item_kinds(datasets_module):
    x = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    opts = dict(batch_size=6, shuffle=False)
    plain = make_loader(DataOptions(dataset=f"{datasets_module}:plain", **opts))
    (batch,) = list(plain)
    assert plain.has_labels is False and torch.equal(batch.inputs, x)
    (batch,) = list(make_loader(DataOptions(dataset=f"{datasets_module}:pairs", **opts)))
    assert torch.equal(batch.inputs, x) and batch.labels.tolist() == [0, 1, 0, 1, 0, 1]
    (batch,) = list(make_loader(DataOptions(dataset=f"{datasets_module}:dicts", **opts)))
    assert set(batch.inputs) == {"a", "b"} and torch.equal(batch.inputs["b"], -x)
    assert batch.labels.tolist() == [0, 1, 2, 0, 1, 2]
    (batch,) = list(make_loader(DataOptions(dataset=f"{datasets_module}:multi", **opts)))
    assert isinstance(batch.inputs, (tuple, list)) and torch.equal(batch.inputs[1], 2 * x)
    assert batch.labels.tolist() == list(range(6))


def test_custom_dataset_errors(datasets_module):
    with pytest.raises(BnauditError, match=r"batch 1: item 4: reading it failed \(ZeroDivisionError"):
        list(make_loader(DataOptions(dataset=f"{datasets_module}:failing", batch_size=3, shuffle=False)))
    with pytest.raises(BnauditError, match="need a map-style Dataset"):
        make_loader(DataOptions(dataset=f"{datasets_module}:not_a_dataset"))
    with pytest.raises(BnauditError, match="exactly one of --data"):
        make_loader(DataOptions(path="x", dataset=f"{datasets_module}:plain"))


# ----------------------------------------------------------------------------- order and batching


def test_order_is_fixed_by_seed_and_no_shuffle_keeps_file_order():
    a = BatchPlan.draw(50, 8, seed=1).batches
    assert a == BatchPlan.draw(50, 8, seed=1).batches
    assert a != BatchPlan.draw(50, 8, seed=2).batches
    assert sorted(i for b in a for i in b) == list(range(50))
    assert BatchPlan.draw(10, 4, shuffle=False).batches == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    # a cap keeps a random subset when shuffled, the first samples in file order
    capped = [i for b in BatchPlan.draw(100, 10, num_samples=20, seed=0).batches for i in b]
    assert len(capped) == 20 and max(capped) > 19
    assert [i for b in BatchPlan.draw(100, 10, num_samples=20, shuffle=False).batches for i in b] == list(range(20))


@pytest.mark.parametrize("n, size, expected", [(9, 4, [4, 5]), (8, 4, [4, 4]), (1, 4, [1]), (5, 4, [5])])
def test_a_last_batch_of_one_joins_the_previous(n, size, expected):
    assert [len(b) for b in BatchPlan.draw(n, size, shuffle=False).batches] == expected


def test_a_killed_worker_is_one_clear_error(datasets_module):
    stream = make_loader(
        DataOptions(dataset=f"{datasets_module}:killed_worker", batch_size=3, shuffle=False, workers=1)
    )
    with pytest.raises(BnauditError, match=r"a --workers process died .*out of memory.*fewer --workers"):
        list(stream)


def test_workers_give_the_same_batches(tmp_path):
    _image_folder(tmp_path / "imgs", per_class=5)
    one = _all(make_loader(DataOptions(path=str(tmp_path / "imgs"), batch_size=3, seed=7)))
    two = _all(make_loader(DataOptions(path=str(tmp_path / "imgs"), batch_size=3, seed=7, workers=2)))
    assert torch.equal(one[1], two[1]) and torch.equal(one[2], two[2]) and one[3] == two[3]


# ----------------------------------------------------------------------------- bad input as one line


@pytest.mark.parametrize(
    "layout, fragment",
    [
        ("empty", "empty folder"),
        ("flat", "one subfolder per class"),
        ("no-images", "no images"),
        ("missing", "no such file or folder"),
        ("text", "no class subfolders with images and no tensor files"),
    ],
)
def test_bad_folders(tmp_path, layout, fragment):
    root = tmp_path / "data"
    if layout != "missing":
        root.mkdir()
    if layout == "flat":
        Image.fromarray(_pixels(0, 4, 4)).save(root / "a.png")
    elif layout == "no-images":
        (root / "cat").mkdir()
        (root / "cat" / "notes.txt").write_text("hi")
    elif layout == "text":
        (root / "notes.txt").write_text("hi")
    with pytest.raises(BnauditError, match=fragment):
        make_loader(DataOptions(path=str(root)))


def test_option_errors():
    with pytest.raises(BnauditError, match="comma-separated list"):
        parse_float_list("0.5,abc", "--mean")
    assert parse_float_list("0.5, 0.25", "--std") == (0.5, 0.25)
    for options, fragment in [
        (DataOptions(path="x", batch_size=0), "--batch-size"),
        (DataOptions(path="x", std=(0.0,)), "--std"),
        (DataOptions(path="x", workers=-1), "--workers"),
        (DataOptions(), "exactly one of"),
    ]:
        with pytest.raises(BnauditError, match=fragment):
            options.validate()


def test_mean_with_the_wrong_channel_count(tmp_path):
    _image_folder(tmp_path / "imgs")
    with pytest.raises(BnauditError, match="--mean has 2 values, the images have 3"):
        make_loader(DataOptions(path=str(tmp_path / "imgs"), mean=(0.1, 0.2)))


def test_data_errors_through_the_cli_are_one_line_and_json(tmp_path):
    (tmp_path / "net.py").write_text(
        "from torch import nn\n"
        "def net():\n"
        "    return nn.Sequential(nn.BatchNorm2d(3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, 2))\n"
    )
    import importlib.util

    spec = importlib.util.spec_from_file_location("net_for_data_tests", tmp_path / "net.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    save_file(module.net().state_dict(), tmp_path / "net.safetensors")
    _image_folder(tmp_path / "imgs")
    (tmp_path / "imgs" / "cat" / "zz.png").write_bytes(b"garbage")
    (tmp_path / "empty").mkdir()
    base = ["gap", str(tmp_path / "net.safetensors"), "--arch", f"{tmp_path / 'net.py'}:net", "--batch-size", "4"]
    for data, fragment in [("imgs", "zz.png: cannot read image"), ("empty", "empty folder")]:
        result = CliRunner().invoke(app, base + ["--data", str(tmp_path / data), "--format", "json"])
        assert result.exit_code == 2, result.output
        assert fragment in json.loads(result.stdout)["error"]
        assert result.stderr == ""  # said once: in the document
        table = CliRunner().invoke(app, base + ["--data", str(tmp_path / data)])
        lines = table.stderr.strip().splitlines()
        assert table.stdout == "" and len(lines) == 1 and fragment in lines[0]
    ok = CliRunner().invoke(app, base + ["--data", str(tmp_path / "imgs"), "--skip-bad", "--format", "json"])
    assert ok.exit_code == 0, ok.output
    doc = json.loads(ok.stdout)
    assert doc["skipped"] == 1 and doc["samples"] == 6

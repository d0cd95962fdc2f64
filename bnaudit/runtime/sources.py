"""Datasets for gap, invariance and recalibrate: what `--data` / `--dataset` name, read
sample by sample (or a batch at a time from tensor files). Batching is `bnaudit.runtime.data`'s.

`--data PATH` is one of
  an ImageFolder     one subfolder per class (class index = sorted subfolder order), PNG, JPEG,
                     BMP or WebP read with Pillow, values scaled to [0, 1]; `--image-size N`
                     resizes the shorter side to N and center-crops N x N, `--grayscale` gives
                     one channel (default RGB), `--mean`/`--std` normalise (x - mean) / std
  a tensor file      `.safetensors`, or `.pt` (tensors and plain containers only), holding `inputs`
                     (N, ...) and optionally `labels` (N,) integer class indices
  a numpy file      `.npy` (inputs only, no labels), or `.npz` holding `inputs`/`labels`,
                     `x`/`y`, or a single array (inputs, no labels); never unpickled
                     (allow_pickle=False). Uncompressed arrays are read batch by batch
                     from the file like tensor files; compressed `.npz` members (np.savez_compressed)
                     cannot be read in place and are decompressed whole
  a folder of shards such tensor or numpy files, concatenated in sorted name order
or `--dataset MODULE:CALLABLE` returns a map-style torch Dataset.

Items are `input` or `(input, label)` where the label is an int (or 0-d integer tensor);
a dict item's "label" / "labels" entry is the label and the rest is the input. An input is
a tensor, a tuple of tensors (the model's positional arguments) or a dict (keyword
arguments).

Every problem with the data ends in a `BnauditError` naming the file or the item.
"""

from __future__ import annotations

import bisect
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from bnaudit.errors import BnauditError
from bnaudit.formats.allowed import Mode
from bnaudit.formats.model import TensorRef, read_into
from bnaudit.formats.pickled import mapping_items
from bnaudit.formats.sniff import sniff_format
from bnaudit.formats.torchobjects import torch_objects
from bnaudit.formats.torchsave import read_torch_save
from bnaudit.formats.views import contiguous_start
from bnaudit.runtime.models import exit_message, import_callable
from bnaudit.runtime.numpy_files import StoredRows, open_numpy
from bnaudit.runtime.safetensors_files import SafetensorsRows, open_safetensors
from bnaudit.text import plural

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp")


NUMPY_SUFFIXES = (".npy", ".npz")


TENSOR_SUFFIXES = (".safetensors", ".pt", ".pth", *NUMPY_SUFFIXES)


LABEL_KEYS = ("label", "labels")


@dataclass(frozen=True)
class DataOptions:
    """How to read and batch the data (the CLI's data options, with their defaults)."""

    path: str | None = None
    dataset: str | None = None
    batch_size: int = 64
    num_samples: int | None = None
    seed: int = 0
    shuffle: bool = True
    workers: int = 0
    image_size: int | None = None
    grayscale: bool = False
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    skip_bad: bool = False
    pin_memory: bool = False

    def validate(self) -> None:
        if (self.path is None) == (self.dataset is None):
            raise BnauditError("give exactly one of --data PATH and --dataset MODULE:CALLABLE")
        if self.batch_size < 1:
            raise BnauditError(f"--batch-size must be at least 1, got {self.batch_size}")
        if self.num_samples is not None and self.num_samples < 1:
            raise BnauditError(f"--num-samples must be at least 1, got {self.num_samples}")
        if not -(2**63) <= self.seed < 2**64:  # the range torch.Generator.manual_seed accepts
            raise BnauditError(f"--seed must lie in [-2^63, 2^64), got {self.seed}")
        if self.workers < 0:
            raise BnauditError(f"--workers must be 0 or more, got {self.workers}")
        if self.image_size is not None and self.image_size < 1:
            raise BnauditError(f"--image-size must be at least 1, got {self.image_size}")
        if self.std is not None and any(s == 0 or not math.isfinite(s) for s in self.std):
            raise BnauditError("--std values must be finite and non-zero")
        if self.mean is not None and any(not math.isfinite(m) for m in self.mean):
            raise BnauditError("--mean values must be finite")


def parse_float_list(text: str | None, option: str) -> tuple[float, ...] | None:
    """'0.485,0.456,0.406' -> (0.485, 0.456, 0.406)."""
    if text is None:
        return None
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise BnauditError(f"{option} must be a comma-separated list of numbers, got '{text}'") from None
    return values


@dataclass(frozen=True)
class BadItem:
    """An item that could not be read; crosses worker processes as data."""

    message: str
    skippable: bool = False


@dataclass(frozen=True)
class Item:
    input: Any
    label: Any
    origin: str


@dataclass(frozen=True)
class Gathered:
    """A whole batch read at once (tensor files): inputs (N, ...), int64 labels (N,)
    or None, and the origin of each sample."""

    inputs: Any
    labels: Any
    origins: list[str]


def _is_label(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, np.integer)):
        return True
    return (
        isinstance(value, torch.Tensor)
        and value.dim() == 0
        and not value.dtype.is_floating_point
        and not value.dtype.is_complex
        and value.dtype != torch.bool
    )


def _text_label(item: Any) -> str | None:
    """The label of an (input, label) pair or a dict item when it is text, else None."""
    label: Any = None
    if isinstance(item, (tuple, list)) and len(item) == 2:
        label = item[1]
    elif isinstance(item, Mapping):
        label = next((item[k] for k in LABEL_KEYS if k in item), None)
    if isinstance(label, (str, bytes, np.str_)):
        return str(label)
    return None


def split_item(item: Any) -> tuple[Any, Any]:
    """(input, label or None) of one dataset item (see the module docstring)."""
    if isinstance(item, (tuple, list)) and len(item) == 2 and _is_label(item[1]):
        return item[0], item[1]
    if isinstance(item, Mapping):
        keys = [k for k in LABEL_KEYS if k in item]
        if keys:
            return {k: v for k, v in item.items() if k not in LABEL_KEYS}, item[keys[0]]
    return item, None


class Source:
    """A map-style dataset whose `load(i)` returns (input, label or None)."""

    kind = "?"
    description = "?"
    has_labels: bool | None = None
    is_images = False

    def __len__(self) -> int:
        raise NotImplementedError

    def load(self, index: int) -> tuple[Any, Any]:
        raise NotImplementedError

    def origin(self, index: int) -> str:
        return f"item {index}"


class ImageFolderSource(Source):
    kind = "image-folder"
    is_images = True

    def __init__(self, root: str, options: DataOptions) -> None:
        self.root = root
        self.classes = sorted(
            d for d in os.listdir(root) if not d.startswith(".") and os.path.isdir(os.path.join(root, d))
        )
        self.files: list[tuple[str, int]] = []
        for index, name in enumerate(self.classes):
            for folder, dirs, files in os.walk(os.path.join(root, name), followlinks=True):
                dirs.sort()
                self.files += [
                    (os.path.join(folder, f), index) for f in sorted(files) if f.lower().endswith(IMAGE_SUFFIXES)
                ]
        if not self.files:
            raise BnauditError(
                f"{root}: no images ({' '.join(IMAGE_SUFFIXES)}) in its {plural(len(self.classes), 'class folder')}"
            )
        # Pillow comes with the torch extra, not with bnaudit: without it the import fails here,
        # once, and the CLI says what to install, rather than every image failing to decode
        from PIL import Image  # noqa: F401

        channels = 1 if options.grayscale else 3
        for option, values in (("--mean", options.mean), ("--std", options.std)):
            if values is not None and len(values) not in (1, channels):
                raise BnauditError(
                    f"{option} has {plural(len(values), 'value')}, the images have {plural(channels, 'channel')}"
                    + ("" if options.grayscale else " (RGB; --grayscale gives 1)")
                )
        self.image_size = options.image_size
        self.grayscale = options.grayscale
        self.mean = None if options.mean is None else np.asarray(options.mean, dtype=np.float32)
        self.std = None if options.std is None else np.asarray(options.std, dtype=np.float32)
        self.has_labels = True
        self.description = f"{root} (image folder: {len(self.files)} images, {len(self.classes)} classes)"

    def __len__(self) -> int:
        return len(self.files)

    def origin(self, index: int) -> str:
        return self.files[index][0]

    def load(self, index: int) -> tuple[Any, Any]:
        # Pillow only where images are read: tensor-file data never loads it
        from PIL import Image

        path, label = self.files[index]
        with Image.open(path) as opened:
            image = opened.convert("L" if self.grayscale else "RGB")
            if self.image_size is not None:
                image = resize_center_crop(image, self.image_size)
            array = np.asarray(image, dtype=np.float32) / 255.0
        array = array[None] if array.ndim == 2 else array.transpose(2, 0, 1)
        if self.mean is not None:
            array = array - self.mean.reshape(-1, 1, 1)
        if self.std is not None:
            array = array / self.std.reshape(-1, 1, 1)
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)), label


def resize_center_crop(image: Any, size: int) -> Any:
    """Resize so the shorter side is `size` (bilinear), then crop the central size x size."""
    from PIL import Image  # as in ImageFolderSource.load: only image data needs Pillow

    width, height = image.size
    scale = size / min(width, height)
    new_w, new_h = max(size, round(width * scale)), max(size, round(height * scale))
    if (new_w, new_h) != (width, height):
        image = image.resize((new_w, new_h), Image.BILINEAR)  # type: ignore[attr-defined]  # Pillow's annotations omit this constant; Image.Resampling needs Pillow >= 9.1
    left, top = (new_w - size) // 2, (new_h - size) // 2
    return image.crop((left, top, left + size, top + size))


@dataclass
class _Shard:
    path: str
    inputs: Any  # FileRows, SafetensorsRows or torch tensor, indexed by sample
    labels: Any  # torch tensor, or None
    length: int


class TensorSource(Source):
    """One tensor file or a folder of shards, concatenated in sorted order."""

    def __init__(self, paths: list[str], description: str, kind: str) -> None:
        self.kind = kind
        self.shards = [_open_shard(p) for p in paths]
        first = self.shards[0]
        sample_shape = tuple(first.inputs.shape[1:])
        for shard in self.shards[1:]:
            if tuple(shard.inputs.shape[1:]) != sample_shape:
                raise BnauditError(
                    f"{shard.path}: inputs of shape {list(shard.inputs.shape[1:])} per sample, but "
                    f"{first.path} has {list(sample_shape)}"
                )
            if (shard.labels is None) != (first.labels is None):
                with_labels = shard.path if shard.labels is not None else first.path
                without = first.path if shard.labels is not None else shard.path
                raise BnauditError(f"{without}: has no labels, but {with_labels} has: all shards or none")
        self.starts = [0]
        for shard in self.shards:
            self.starts.append(self.starts[-1] + shard.length)
        self.has_labels = first.labels is not None
        self.description = f"{description} ({self.starts[-1]} samples, inputs {list(sample_shape)} per sample" + (
            ", labelled)" if self.has_labels else ", no labels)"
        )

    def __len__(self) -> int:
        return self.starts[-1]

    def _locate(self, index: int) -> tuple[_Shard, int]:
        k = bisect.bisect_right(self.starts, index) - 1
        return self.shards[k], index - self.starts[k]

    def origin(self, index: int) -> str:
        shard, local = self._locate(index)
        return f"{shard.path}[{local}]"

    def load(self, index: int) -> tuple[Any, Any]:
        shard, local = self._locate(index)
        sample = _take(shard.inputs, [local])[0]
        label = None if shard.labels is None else int(shard.labels[local])
        return sample, label

    def load_batch(self, indices: list[int]) -> Gathered | None:
        """The samples `indices` read together, one gather per shard: the batch that
        `load` of each sample and stacking would give (same values and dtypes, labels
        as int64). None where labels would not all fit int64 (uint64): the per-sample
        path then checks them one by one."""
        if self.has_labels and not _fits_int64(self.shards[0].labels.dtype):
            return None
        groups: dict[int, list[tuple[int, int]]] = {}  # shard -> (position in the batch, row)
        origins = []
        for position, index in enumerate(indices):
            k = bisect.bisect_right(self.starts, index) - 1
            local = index - self.starts[k]
            groups.setdefault(k, []).append((position, local))
            origins.append(f"{self.shards[k].path}[{local}]")
        inputs, labels, positions = [], [], []
        for k, members in groups.items():
            shard, rows = self.shards[k], [row for _, row in members]
            inputs.append(_take(shard.inputs, rows))
            if shard.labels is not None:
                labels.append(_take(shard.labels, rows).to(torch.int64))
            positions += [position for position, _ in members]
        if len(groups) == 1:
            return Gathered(inputs[0], labels[0] if labels else None, origins)
        # back into the batch's order
        order = torch.empty(len(positions), dtype=torch.int64)
        order[torch.as_tensor(positions)] = torch.arange(len(positions))
        return Gathered(torch.cat(inputs)[order], torch.cat(labels)[order] if labels else None, origins)


def _fits_int64(dtype: Any) -> bool:
    return str(dtype).removeprefix("torch.") != "uint64"


def _take(values: Any, rows: list[int]) -> Any:
    """values[rows] (FileRows or a tensor) as a new tensor."""
    if isinstance(values, (FileRows, SafetensorsRows)):
        return values.take(rows)
    return values[torch.as_tensor(rows, dtype=torch.int64)]


@dataclass(frozen=True)
class FileRows:
    """A tensor stored in a file (little-endian, C order), read a few rows at a time.

    Each `take` reads just its rows into a buffer of its own, so a batch costs its own
    bytes of memory whatever the file's size. A memory map would keep every page it has
    read resident: peak RSS would grow with the samples streamed (10x the samples of a
    tensor file: 1.65x the RSS of `gap`).
    """

    path: str
    offset: int  # of row 0
    dtype: str  # torch name: float32, bfloat16, ...
    shape: tuple[int, ...]

    @property
    def row_bytes(self) -> int:
        dtype: torch.dtype = getattr(torch, self.dtype)
        return dtype.itemsize * math.prod(self.shape[1:])

    def take(self, rows: list[int]) -> Any:

        size, dtype = self.row_bytes, getattr(torch, self.dtype)
        if size == 0 or not rows:
            return torch.empty((len(rows), *self.shape[1:]), dtype=dtype)
        data = bytearray(len(rows) * size)
        buffer = memoryview(data)
        with open(self.path, "rb", buffering=0) as f:
            start = 0
            while start < len(rows):  # runs of consecutive rows in one read each
                end = start + 1
                while end < len(rows) and rows[end] == rows[end - 1] + 1:
                    end += 1
                read_into(f, self.offset + rows[start] * size, buffer[start * size : end * size], self.path)
                start = end
        return torch.frombuffer(data, dtype=dtype).reshape(len(rows), *self.shape[1:])  # shares `data`


def _open_shard(path: str) -> _Shard:
    fmt = "numpy" if path.lower().endswith(NUMPY_SUFFIXES) else sniff_format(path)
    if fmt == "numpy":
        tensors = {
            k: FileRows(v.path, v.offset, v.dtype, v.shape) if isinstance(v, StoredRows) else v
            for k, v in open_numpy(path).items()
        }
    elif fmt == "safetensors":
        tensors = open_safetensors(path)
    elif fmt in ("torch-zip", "torch-legacy"):
        tensors = _open_torch_tensors(path, fmt)
    else:
        what = {"onnx": "an ONNX model", "pt2": "a torch.export archive"}.get(fmt, "a TorchScript archive")
        raise BnauditError(f"{path}: {what}, not a tensor file with 'inputs'")
    if "inputs" not in tensors:
        found = ", ".join(repr(k) for k in list(tensors)[:8]) or "nothing"
        raise BnauditError(f"{path}: holds no 'inputs' tensor (found {found})")
    inputs, labels = tensors["inputs"], tensors.get("labels")
    if len(inputs.shape) < 1 or inputs.shape[0] == 0:
        raise BnauditError(f"{path}: 'inputs' holds no samples (shape {list(inputs.shape)})")
    if labels is not None:
        if len(labels.shape) != 1:
            raise BnauditError(f"{path}: 'labels' must be one class index per sample, got shape {list(labels.shape)}")
        if not _integer_dtype(labels.dtype):
            raise BnauditError(f"{path}: 'labels' must hold integer class indices, got {labels.dtype}")
        if labels.shape[0] != inputs.shape[0]:
            raise BnauditError(f"{path}: 'inputs' has {inputs.shape[0]} samples but 'labels' has {labels.shape[0]}")
    return _Shard(path, inputs, labels, int(inputs.shape[0]))


def _integer_dtype(dtype: Any) -> bool:
    text = str(dtype).removeprefix("torch.")
    return text.startswith(("int", "uint"))


def _open_torch_tensors(path: str, fmt: str) -> dict[str, Any]:
    try:
        obj = read_torch_save(path, fmt == "torch-legacy", Mode.TENSORS).value
    except BnauditError as exc:
        text = str(exc)
        if "refused to unpickle" not in text:
            raise
        # The reader's advice (--trust-pickle) is about checkpoints: data files are always
        # read without running code, whatever the flags.
        raise BnauditError(
            text.split("; if you trust", 1)[0]
            + "; data files are never unpickled beyond plain tensors (--trust-pickle applies "
            "to the checkpoint only): save the inputs and labels with safetensors, or as a dict of tensors"
        ) from None
    if not isinstance(obj, Mapping):
        raise BnauditError(f"{path}: holds a {type(obj).__name__}, not a dict with 'inputs' (and 'labels')")
    tensors: dict[str, torch.Tensor | FileRows] = {}
    for key, value in mapping_items(obj):
        if not isinstance(value, TensorRef):
            continue
        start = contiguous_start(value) if key == "inputs" else None
        if start is not None:
            # the inputs are read batch by batch where they lie as plain rows: a batch costs
            # its own bytes, whatever the file's size
            tensors["inputs"] = FileRows(path, start, value.dtype, value.shape)
        else:
            tensors[str(key)] = torch_objects(value, path)
    return tensors


class CustomSource(Source):
    kind = "dataset"

    def __init__(self, spec: str) -> None:
        factory = import_callable(spec, "--dataset")
        try:
            dataset = factory()
        except Exception as exc:
            raise BnauditError(f"--dataset {spec}: calling it failed: {type(exc).__name__}: {exc}") from None
        except SystemExit as exc:
            raise BnauditError(f"--dataset {spec}: {exit_message(exc, 'calling it')}") from None
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise BnauditError(
                f"--dataset {spec} returned {type(dataset).__name__}: need a map-style Dataset "
                "(with __len__ and __getitem__)"
            )
        self.dataset = dataset
        self.spec = spec
        try:
            n = len(dataset)
        except Exception as exc:
            raise BnauditError(f"--dataset {spec}: len() failed: {type(exc).__name__}: {exc}") from None
        if n == 0:
            raise BnauditError(f"--dataset {spec}: the dataset is empty")
        self.length = n
        try:
            first = dataset[0]
            _, label = split_item(first)
        except Exception as exc:
            raise BnauditError(f"--dataset {spec}: reading item 0 failed: {type(exc).__name__}: {exc}") from None
        text = _text_label(first)
        if text is not None:
            raise BnauditError(
                f"--dataset {spec}: item 0 has the label {text!r}: labels must be integer class indices "
                "(map the class names to 0..K-1 in the dataset)"
            )
        self.has_labels = label is not None
        self.description = f"--dataset {spec} ({n} samples" + (", labelled)" if self.has_labels else ", no labels)")

    def __len__(self) -> int:
        return self.length

    def load(self, index: int) -> tuple[Any, Any]:
        return split_item(self.dataset[index])


def open_source(options: DataOptions) -> Source:
    """The dataset that `--data` / `--dataset` names (validated, nothing decoded yet)."""
    options.validate()
    if options.dataset is not None:
        source: Source = CustomSource(options.dataset)
    else:
        path = options.path
        assert path is not None
        if not os.path.exists(path):
            raise BnauditError(f"{path}: no such file or folder")
        if os.path.isdir(path):
            source = _open_folder(path, options)
        else:
            source = TensorSource([path], path, "tensor-file")
    if not source.is_images and (
        options.image_size is not None or options.grayscale or options.mean is not None or options.std is not None
    ):
        raise BnauditError("--image-size, --grayscale, --mean and --std apply to image folders only")
    return source


def _open_folder(path: str, options: DataOptions) -> Source:
    try:
        entries = sorted(e for e in os.listdir(path) if not e.startswith("."))
    except PermissionError:
        raise BnauditError(f"{path}: permission denied") from None
    if not entries:
        raise BnauditError(f"{path}: empty folder")
    subfolders = [e for e in entries if os.path.isdir(os.path.join(path, e))]
    shards = [
        os.path.join(path, e)
        for e in entries
        if e.lower().endswith(TENSOR_SUFFIXES) and os.path.isfile(os.path.join(path, e))
    ]
    if subfolders:
        return ImageFolderSource(path, options)
    if shards:
        return TensorSource(shards, f"{path} ({len(shards)} shards)" if len(shards) > 1 else path, "tensor-shards")
    if any(e.lower().endswith(IMAGE_SUFFIXES) for e in entries):
        raise BnauditError(
            f"{path}: images must lie in one subfolder per class (ImageFolder layout: {path}/<class>/*.png)"
        )
    raise BnauditError(f"{path}: no class subfolders with images and no tensor files ({' '.join(TENSOR_SUFFIXES)})")

"""Batches for gap, invariance and recalibrate: the data options' samples
(`bnaudit.runtime.sources`) in the batches of one plan (`bnaudit.runtime.batching`),
decoded in `--workers` DataLoader processes.

Samples are drawn in an order shuffled by `--seed` (or file order with `--no-shuffle`),
capped by `--num-samples` and cut into batches of `--batch-size` (`BatchPlan.draw`: a last
batch of one sample joins the previous batch). `uint8` inputs (images as stored) become
float32 x / 255 in [0, 1], with a note in the report.

Every problem with the data ends in a `BnauditError` naming the file or the batch. Errors
found in worker processes travel back as marker objects, never as exceptions, so the
message stays one line.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, default_collate

from bnaudit.errors import BnauditError
from bnaudit.runtime.batching import BatchPlan, concat_batches
from bnaudit.runtime.sources import (
    IMAGE_SUFFIXES,
    BadItem,
    DataOptions,
    Gathered,
    Item,
    Source,
    open_source,
    parse_float_list,
)
from bnaudit.text import single_line

# the data options and their parser are read where the batches are made
__all__ = ["Batch", "BatchStream", "DataOptions", "make_loader", "parse_float_list"]


@dataclass
class Batch:
    """One batch: `inputs` (tensor, tuple or dict, collated), `labels` (int64 tensor or
    None), `size` samples, `origins` naming each sample (file, shard[index] or item i)."""

    index: int
    inputs: Any
    labels: Any
    size: int
    origins: list[str] = field(default_factory=list)
    skipped: int = 0


@dataclass(frozen=True)
class _BadBatch:
    message: str


class _ItemDataset:
    """Wraps a source so that every failure becomes a BadItem (data, not an exception)."""

    def __init__(self, source: Source) -> None:
        self.source = source

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> Item | BadItem:
        origin = self.source.origin(index)
        try:
            value, label = self.source.load(index)
        except BnauditError as exc:
            return BadItem(str(exc), skippable=self.source.is_images)
        except Exception as exc:  # a decoder or user code failing on this item
            reason = single_line(str(exc)) or type(exc).__name__
            what = "cannot read image" if self.source.is_images else "reading it failed"
            return BadItem(f"{origin}: {what} ({type(exc).__name__}: {reason})", skippable=self.source.is_images)
        return Item(value, label, origin)

    def __getitems__(self, indices: list[int]) -> Gathered | list[Item | BadItem]:
        """A batch (DataLoader calls this instead of one __getitem__ per sample): one
        gather where the source can (tensor files), else item by item. Any failure of
        the gather falls back to the items, whose errors name the sample."""
        gather = getattr(self.source, "load_batch", None)
        if gather is not None:
            batch: Gathered | None
            try:
                batch = gather(list(indices))
            except Exception:
                batch = None
            if batch is not None:
                return batch
        return [self[index] for index in indices]


class _Collate:
    """Items -> one batch (or a _BadBatch saying what is wrong); runs in the workers."""

    def __init__(self, skip_bad: bool) -> None:
        self.skip_bad = skip_bad

    def __call__(self, items: list[Any] | Gathered) -> tuple[Any, ...] | _BadBatch:
        if isinstance(items, Gathered):
            bad = _first_non_finite(items.inputs, items.origins)
            if bad is not None:
                return _BadBatch(f"NaN or Inf in the inputs (first in {bad})")
            return (items.inputs, items.labels, items.origins, 0)
        good: list[Item] = []
        skipped = 0
        for item in items:
            if isinstance(item, BadItem):
                if self.skip_bad and item.skippable:
                    skipped += 1
                    continue
                return _BadBatch(item.message + ("" if not item.skippable else " (--skip-bad skips such files)"))
            good.append(item)
        if not good:
            return (None, None, [], skipped)
        with_labels = [item.label is not None for item in good]
        if any(with_labels) and not all(with_labels):
            i = with_labels.index(not with_labels[0])
            return _BadBatch(f"{good[0].origin} and {good[i].origin} differ: one has a label, the other not")
        shape_error = _shape_clash(good)
        if shape_error:
            return _BadBatch(shape_error)
        try:
            inputs = default_collate([item.input for item in good])
        except Exception as exc:
            return _BadBatch(f"cannot stack the samples into a batch ({single_line(str(exc))})")
        labels = None
        if with_labels[0]:
            text = next((item.label for item in good if isinstance(item.label, (str, bytes, np.str_))), None)
            if text is not None:
                return _BadBatch(f"labels must be integer class indices, got the text {str(text)!r}")
            try:
                labels = torch.as_tensor([int(item.label) for item in good], dtype=torch.int64)
            except (TypeError, ValueError) as exc:
                return _BadBatch(f"labels must be integer class indices ({exc})")
        bad = _first_non_finite(inputs, [item.origin for item in good])
        if bad is not None:
            return _BadBatch(f"NaN or Inf in the inputs (first in {bad})")
        return (inputs, labels, [item.origin for item in good], skipped)


def _shape_clash(items: list[Item]) -> str | None:
    first = items[0]
    if not isinstance(first.input, torch.Tensor):
        return None
    for item in items[1:]:
        if isinstance(item.input, torch.Tensor) and item.input.shape != first.input.shape:
            hint = " (pass --image-size to resize images)" if first.origin.lower().endswith(IMAGE_SUFFIXES) else ""
            return (
                f"samples differ in shape: {first.origin} is {list(first.input.shape)}, "
                f"{item.origin} is {list(item.input.shape)}{hint}"
            )
    return None


def _tensors(value: Any) -> Iterator[Any]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)


def _first_non_finite(inputs: Any, origins: list[str]) -> str | None:
    """The origin of the first sample holding a NaN or an infinity (None: all finite)."""
    for tensor in _tensors(inputs):
        if not (tensor.dtype.is_floating_point or tensor.dtype.is_complex) or tensor.numel() == 0:
            continue
        # A finite sum has no NaN or Inf among its terms (either would make it NaN or
        # infinite): one reduction instead of a mask of the batch. An infinite sum of
        # finite values (overflow) goes on to the elementwise test.
        if bool(torch.isfinite(tensor.sum())):
            continue
        finite = torch.isfinite(tensor)
        if bool(finite.all()):
            continue
        if tensor.dim() >= 1 and tensor.shape[0] == len(origins):
            per_sample = finite.reshape(len(origins), -1).all(dim=1)
            return origins[int((~per_sample).nonzero()[0, 0])]
        return "the batch"
    return None


@dataclass
class BatchStream:
    """The batches of one pass over the data: iterate once, in a fixed order.

    `plan` says which samples form each batch; `skipped` counts the images skipped
    with --skip-bad once the stream has been iterated. `plan.first` numbers the plan's
    first batch (nonzero for a rank's shard of a run under torchrun, so that batch numbers
    in messages are those of the whole run).
    """

    source: Source
    options: DataOptions
    plan: BatchPlan
    skipped: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def description(self) -> str:
        return self.source.description

    @property
    def has_labels(self) -> bool | None:
        return self.source.has_labels

    @property
    def num_samples(self) -> int:
        return self.plan.samples

    @property
    def num_batches(self) -> int:
        return len(self.plan)

    @property
    def batch_size(self) -> int:
        return self.options.batch_size

    def __len__(self) -> int:
        return len(self.plan)

    def shard(self, rank: int, world: int) -> BatchStream:
        """Rank `rank`'s share of the stream (`BatchPlan.shard`: whole batches, numbered as
        the whole run numbers them); the stream itself with one rank."""
        return self if world == 1 else replace(self, plan=self.plan.shard(rank, world))

    def __iter__(self) -> Iterator[Batch]:
        loader: DataLoader[Item | BadItem] = DataLoader(
            _ItemDataset(self.source),  # type: ignore[arg-type]  # torch types it as Dataset; any map-style object with __getitem__/__len__ works
            batch_sampler=self.plan,
            collate_fn=_Collate(self.options.skip_bad),
            num_workers=self.options.workers,
            pin_memory=self.options.pin_memory,
        )
        self.skipped = 0
        held: Batch | None = None
        emitted = 0
        for number, raw in enumerate(_surviving(loader)):
            if isinstance(raw, _BadBatch):
                raise BnauditError(f"batch {self.plan.first + number}: {raw.message}")
            inputs, labels, origins, skipped = raw
            self.skipped += skipped
            if not origins:
                continue
            if isinstance(inputs, torch.Tensor) and inputs.dtype == torch.uint8:
                # images as stored: models take floats in [0, 1] (what ImageFolder gives)
                inputs = inputs.to(torch.float32).div_(255.0)
                if UINT8_NOTE not in self.notes:
                    self.notes.append(UINT8_NOTE)
            batch = Batch(self.plan.first + emitted, inputs, labels, len(origins), origins, skipped)
            # The plan already joined a last batch of one sample (the batching
            # rule); only --skip-bad can shrink another batch to one: the same rule
            # joins it to a neighbour, where the inputs can be joined.
            joined = _join(held, batch) if held is not None and (held.size < 2 or batch.size < 2) else None
            if held is None:
                held = batch
            elif joined is not None:
                held = joined
            else:
                yield held
                emitted += 1
                batch.index = self.plan.first + emitted
                held = batch
        if held is None:
            raise BnauditError(f"{self.description}: every image was unreadable and skipped")
        yield held


UINT8_NOTE = "inputs are uint8: converted to float32 x / 255 in [0, 1]"


def _surviving(loader: Any) -> Iterator[Any]:
    """The loader's batches; a worker process that died (killed by the OS, as the
    out-of-memory killer does) ends in one line instead of torch's RuntimeError."""
    batches = iter(loader)
    while True:
        try:
            raw = next(batches)
        except StopIteration:
            return
        except RuntimeError as exc:
            if not str(exc).startswith("DataLoader worker"):
                raise
            first = str(exc).strip().splitlines()[0].rstrip(". ")
            raise BnauditError(
                f"a --workers process died ({first}); the machine may be out of memory: "
                "try fewer --workers or a smaller --batch-size"
            ) from None
        yield raw


def _join(a: Batch, b: Batch) -> Batch | None:
    """One batch of a's samples followed by b's (None: inputs of a structure that
    `batching.concat_batches` cannot join)."""
    inputs = concat_batches(a.inputs, b.inputs)
    if inputs is None:
        return None
    labels = None if a.labels is None else concat_batches(a.labels, b.labels)
    return Batch(a.index, inputs, labels, a.size + b.size, a.origins + b.origins, a.skipped + b.skipped)


def make_loader(options: DataOptions) -> BatchStream:
    """The batch stream that the data options describe (nothing is decoded until it is
    iterated; iterate it once and reuse each batch for every pass that needs it)."""
    source = open_source(options)
    plan = BatchPlan.draw(len(source), options.batch_size, options.num_samples, options.shuffle, options.seed)
    return BatchStream(source, options, plan)

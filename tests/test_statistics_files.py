"""The statistics file format (bnaudit.formats.bnstats) as another program would write it:
numpy arrays saved by the safetensors package with the documented names, metadata and
checksum are read and merged; every value a merge relies on is checked, with a valid
checksum, so that the check and not the checksum refuses."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

import bnaudit.formats.bnstats as bnstats
from bnaudit.errors import BnauditError
from bnaudit.formats.bnstats import parse_shard, read_statistics, statistics_checksum
from bnaudit.runtime.recalibrate.statsfiles import combine_statistics


def metadata(**changes: str) -> dict[str, str]:
    base = {
        "format": "bnaudit statistics",
        "format_version": "1",
        "checkpoint_digest": "ab" * 32,
        "key": "",
        "prefix": "",
        "layers": json.dumps([{"name": "bn", "channels": 3, "batches": 2, "calls": 2, "calls_per_batch": 1}]),
        "method": "exact",
        "batch_size": "4",
        "seed": "0",
        "shuffle": "true",
        "num_samples": "",
        "data": "site A",
        "samples": "8",
        "batches": "2",
        "world_size": "1",
        "shard": "",
        "batch_range": "0,2",
        "plan_batches": "2",
        "bnaudit_version": "elsewhere",
    }
    base.update(changes)
    return base


def write(path: Path, tensors: dict[str, np.ndarray], meta: dict[str, str]) -> str:
    """A third party's writer: the checksum over the metadata and the tensors' bytes."""
    raw = {name: ("F64" if t.dtype == np.float64 else "F32", t.shape, t.astype(t.dtype.newbyteorder("<")).tobytes())
           for name, t in tensors.items()}  # fmt: skip
    meta = {**meta, "checksum": statistics_checksum(meta, raw)}
    save_file(tensors, str(path), metadata=meta)
    return str(path)


def values(x: np.ndarray) -> dict[str, np.ndarray]:
    """count, mean and M2 per channel of x (rows: values, columns: channels), by numpy."""
    mean = x.mean(axis=0)
    return {
        "bn.count": np.full(x.shape[1], float(len(x))),
        "bn.mean": mean,
        "bn.m2": ((x - mean) ** 2).sum(axis=0),
    }


def test_files_written_by_another_program_merge_to_the_statistics_of_the_union(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    a, b = rng.normal(3.0, 2.0, size=(40, 3)), rng.normal(-1.0, 0.5, size=(24, 3))
    first = read_statistics(write(tmp_path / "a.bnstats", values(a), metadata()))
    second = read_statistics(write(tmp_path / "b.bnstats", values(b), metadata(data="site B")))
    merged = combine_statistics([first, second])["bn"]
    union = np.concatenate([a, b])
    assert merged.stats.count == 64 and merged.batches == 4
    np.testing.assert_allclose(merged.stats.mean.numpy(), union.mean(axis=0), rtol=1e-13)
    np.testing.assert_allclose(merged.stats.var.numpy(), union.var(axis=0, ddof=1), rtol=1e-12)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"bn.count": np.array([5.0, 5.0, 6.0])}, "one whole number"),
        ({"bn.count": np.array([2.5, 2.5, 2.5])}, "one whole number"),
        ({"bn.m2": np.array([1.0, -1.0, 1.0])}, "negative"),
        ({"bn.mean": np.array([0.0, np.nan, 0.0])}, "NaN or Inf"),
        ({"bn.mean": np.zeros(3, dtype=np.float32)}, r"not F64 \[3\]"),
        ({"bn.mean": np.zeros(4)}, r"not F64 \[3\]"),
        ({"other.mean": np.zeros(3)}, "belongs to no listed layer"),
    ],
)
def test_values_a_merge_relies_on_are_checked(tmp_path: Path, change: dict, words: str) -> None:
    tensors = values(np.arange(24.0).reshape(8, 3))
    tensors.update(change)
    with pytest.raises(BnauditError, match=words):
        read_statistics(write(tmp_path / "x.bnstats", tensors, metadata()))


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"method": "sequential"}, "unknown method"),
        ({"format_version": "2"}, "format version"),
        ({"layers": "[]"}, "layer list"),
        ({"layers": json.dumps([{"name": "bn", "channels": 3}])}, "layer entry"),
        ({"samples": "-3"}, "samples"),
        ({"samples": "²"}, "samples"),
        ({"shard": "3/2"}, "shard"),
        ({"batch_range": "0,5"}, "batch_range"),
    ],
)
def test_metadata_a_merge_relies_on_is_checked(tmp_path: Path, change: dict, words: str) -> None:
    with pytest.raises(BnauditError, match=words):
        read_statistics(write(tmp_path / "x.bnstats", values(np.arange(24.0).reshape(8, 3)), metadata(**change)))


def test_a_large_file_is_refused_before_it_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path / "x.bnstats", values(np.arange(24.0).reshape(8, 3)), metadata())
    monkeypatch.setattr(bnstats, "MAX_FILE_BYTES", 100)
    opened = []
    monkeypatch.setattr(bnstats, "read_safetensors_header", lambda p: opened.append(p))
    with pytest.raises(BnauditError, match="too large for a statistics file"):
        read_statistics(path)
    assert opened == []


def test_shard_numbers_are_torchrun_ranks() -> None:
    assert (parse_shard("0/1").index, parse_shard(" 6/7 ").count) == (0, 7)
    for text in ("1/1", "-1/2", "1/0", "1", "a/b", "1/2/3", "٣/4"):
        with pytest.raises(BnauditError, match="--shard"):
            parse_shard(text)


def test_inspect_and_merge_name_a_statistics_file_given_as_a_checkpoint(tmp_path: Path) -> None:
    from bnaudit.api import inspect
    from bnaudit.formats.classify import NotModelWeights
    from bnaudit.formats.read import read_checkpoint

    path = write(tmp_path / "x.bnstats", values(np.arange(24.0).reshape(8, 3)), metadata())
    assert "a bnaudit statistics file" in inspect([path]).files[0].skipped
    with pytest.raises(NotModelWeights, match="a bnaudit statistics file"):
        read_checkpoint(path)

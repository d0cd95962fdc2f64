"""The records a folder scan builds by the thousand, built the cheap way, equal the plain way.

`model.lazy_ref` and `views.storage_record` set a frozen dataclass's fields without its
`__init__`; `views._all_counts` checks a tensor record's sizes and strides by type and
minimum. Each is compared here with what it stands for: the dataclass's own constructor, and
`is_count` of every value, over generated values (bools, negatives, int subclasses, floats,
huge ints, empty tuples).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import random
import zipfile
from pathlib import Path
from typing import Any

import pytest

from bnaudit.errors import BnauditError
from bnaudit.formats import torchsave, views
from bnaudit.formats.model import TensorRef, lazy_ref
from bnaudit.formats.safetensors import is_count
from bnaudit.formats.views import check_tensor_record


def reader() -> list[float]:
    return [1.0]


def to_torch() -> None:
    return None


@pytest.mark.parametrize(
    "args",
    [
        ("a.b", (2, 3), "float32", reader),
        ("", (), "int64", reader, to_torch),
        ("x", (4,), "bfloat16", reader, None, (12, 8)),
    ],
)
def test_lazy_ref_is_the_constructor(args: tuple) -> None:
    cheap, plain = lazy_ref(*args), TensorRef(*args)
    assert type(cheap) is TensorRef
    assert vars(cheap) == vars(plain)
    assert list(vars(cheap)) == [f.name for f in dataclasses.fields(TensorRef)]
    assert cheap == plain and repr(cheap) == repr(plain)
    assert cheap.read() == [1.0] and cheap.renamed("z") == TensorRef("z", *args[1:])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cheap.name = "y"  # type: ignore[misc]
    with pytest.raises(TypeError):
        cheap.__setstate__({"name": "y"})


@pytest.mark.parametrize("args", [("/p", "float32", 10, 64, "r/data/0"), ("/q", "uint8", 0, None, None)])
def test_storage_is_the_constructor(args: tuple) -> None:
    cheap, plain = views.storage_record(*args), views.Storage(*args)
    assert type(cheap) is views.Storage
    assert vars(cheap) == vars(plain)
    assert list(vars(cheap)) == [f.name for f in dataclasses.fields(views.Storage)]
    assert cheap == plain
    with pytest.raises(dataclasses.FrozenInstanceError):
        cheap.numel = 99  # type: ignore[misc]


class Sub(int):
    pass


def values(rng: random.Random) -> tuple:
    pool = [0, 1, 7, 2**40, 2**70, -1, -(2**65), True, False, Sub(3), Sub(-2), 1.0, 0.0, "1", None, (1,)]
    return tuple(rng.choice(pool) if rng.random() < 0.3 else rng.randrange(0, 1000) for _ in range(rng.randrange(9)))


def test_all_counts_is_is_count_of_each() -> None:
    rng = random.Random(11)
    seen = {True: 0, False: 0}
    for _ in range(20000):
        checked = values(rng)
        expected = all(is_count(x) for x in checked)
        assert views._all_counts(checked) is expected, checked
        seen[expected] += 1
    assert min(seen.values()) > 1000  # both outcomes well exercised


@pytest.mark.parametrize(
    "size, stride",
    [((2, True), (1, 1)), ((2,), (-1,)), ((2.0,), (1,)), ((2, 3), (3,)), ([2], [1]), ((Sub(-1),), (1,))],
)
def test_malformed_records_refused(size: object, stride: object) -> None:
    storage = views.storage_record("/p", "float32", 10, 0)
    with pytest.raises(pickle.UnpicklingError, match="malformed tensor record"):
        check_tensor_record(storage, 0, size, stride, views.Storage)
    check_tensor_record(storage, 0, (2, Sub(3)), (3, 1), views.Storage)  # an int subclass is a count


# ----------------------------------------------------------------------------- zip records


def reference_records(path: str, archive: zipfile.ZipFile, root: str, base: int = 0, end: int | None = None) -> Any:
    """`torchsave.zip_records` as it was before its local headers were read a page at a
    time: one 30-byte read per record."""
    records = {}
    prefix = f"{root}/data/"
    with open(path, "rb", buffering=0) as f:
        fd = f.fileno()
        size = os.fstat(fd).st_size if end is None else end
        for info in archive.infolist():
            if not info.filename.startswith(prefix):
                continue
            start = None
            if info.compress_type == zipfile.ZIP_STORED and not info.flag_bits & 0x1:
                head = os.pread(fd, 30, base + info.header_offset)
                if head[:4] == b"PK\x03\x04":
                    names, extra = int.from_bytes(head[26:28], "little"), int.from_bytes(head[28:30], "little")
                    start = base + info.header_offset + 30 + names + extra
                    if start + info.file_size > size:
                        raise BnauditError(f"{path}: zip record '{info.filename}' runs past the end of the file")
            records[info.filename[len(prefix) :]] = (start, info.file_size, info.filename)
    return records


def records_outcome(read: Any, path: str, base: int = 0, end: int | None = None) -> tuple:
    try:
        with zipfile.ZipFile(path) as archive:
            root = archive.namelist()[0].split("/")[0]
            return ("ok", read(path, archive, root, base, end))
    except Exception as exc:
        return ("error", type(exc).__name__, str(exc))


def cd_entries(data: bytes) -> list[int]:
    """Offsets of the central directory's file headers of `data/` records (the others, the
    pickle and byte order, are read through zipfile)."""
    found, at = [], data.find(b"PK\x01\x02")
    while at >= 0:
        name = data[at + 46 : at + 46 + int.from_bytes(data[at + 28 : at + 30], "little")]
        if b"/data/" in name:
            found.append(at)
        at = data.find(b"PK\x01\x02", at + 46)
    return found


def test_zip_records_read_by_pages_equal_one_read_each(tmp_path: Path) -> None:
    import torch

    state = {f"layer{i}.{leaf}": torch.randn(n) for i, n in enumerate((3, 64, 700, 5, 2000)) for leaf in "ab"}
    state["big"] = torch.randn(4000)
    real = tmp_path / "real.pt"
    torch.save(state, real)
    data = real.read_bytes()
    offsets = [int.from_bytes(data[e + 42 : e + 46], "little") for e in cd_entries(data)]
    rng = random.Random(25)
    forged = tmp_path / "forged.pt"
    outcomes = set()

    def compare(path: Path, base: int = 0, end: int | None = None) -> None:
        def ours(*args: Any) -> Any:
            return torchsave.zip_records(*args)[0]

        got = records_outcome(ours, str(path), base, end)
        assert got == records_outcome(reference_records, str(path), base, end)
        outcomes.add(got[0] if got[0] == "error" else str(sum(s is None for s, _, _ in got[1].values())))

    compare(real)
    for o in offsets:  # a stored archive's end inside a record: the record is refused
        compare(real, end=o + 100)
    for _ in range(300):
        out = bytearray(data)
        entries = cd_entries(data)
        for index in rng.sample(range(len(entries)), rng.randrange(1, 4)):
            entry, choice = entries[index], rng.random()
            if choice < 0.2:  # another record's local header (a page already read, or not)
                target = rng.choice(offsets) + rng.choice((0, 0, 1, -1))
            elif choice < 0.4 and index + 1 < len(entries):
                # the page this record's header starts ends inside the next record's header
                target = offsets[index + 1] - torchsave._HEADER_PAGE + rng.randrange(1, 30)
            elif choice < 0.6:  # the last bytes of the file: a header cut short
                target = len(data) - rng.randrange(1, 40)
            else:
                target = rng.randrange(0, len(data) + 64)
            out[entry + 42 : entry + 46] = max(0, target).to_bytes(4, "little")
        forged.write_bytes(bytes(out))
        compare(forged)
    assert "error" in outcomes and len(outcomes) >= 3  # refusals and several readings exercised


def test_read_errors_name_the_tensor() -> None:
    def torn() -> list[float]:
        raise ValueError("short read")

    def refused() -> list[float]:
        raise BnauditError("x.pt: truncated tensor data")

    for make in (TensorRef, lazy_ref):
        with pytest.raises(BnauditError, match=r"^cannot read tensor 'bn.running_var': short read$"):
            make("bn.running_var", (2,), "float32", torn).read()
        with pytest.raises(BnauditError, match=r"^x.pt: truncated tensor data$"):
            make("bn.running_var", (2,), "float32", refused).read()
        with pytest.raises(BnauditError, match=r"^cannot read tensor 'w': short read$"):
            make("w", (2,), "float32", reader, torn).to_torch()

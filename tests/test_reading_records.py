"""The records a folder scan builds by the thousand, built the cheap way, equal the plain way.

`model.lazy_ref` and torchsave's `_storage` set a frozen dataclass's fields without its
`__init__`; `torchscript._all_counts` checks a tensor record's sizes and strides by type and
minimum. Each is compared here with what it stands for: the dataclass's own constructor, and
`is_count` of every value, over generated values (bools, negatives, int subclasses, floats,
huge ints, empty tuples).
"""

from __future__ import annotations

import dataclasses
import pickle
import random

import pytest

from bnaudit.formats import torchsave, torchscript
from bnaudit.formats.model import TensorRef, lazy_ref
from bnaudit.formats.safetensors import is_count
from bnaudit.formats.torchscript import check_tensor_record


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
    cheap, plain = torchsave._storage(*args), torchsave._Storage(*args)
    assert type(cheap) is torchsave._Storage
    assert vars(cheap) == vars(plain)
    assert list(vars(cheap)) == [f.name for f in dataclasses.fields(torchsave._Storage)]
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
        assert torchscript._all_counts(checked) is expected, checked
        seen[expected] += 1
    assert min(seen.values()) > 1000  # both outcomes well exercised


@pytest.mark.parametrize(
    "size, stride",
    [((2, True), (1, 1)), ((2,), (-1,)), ((2.0,), (1,)), ((2, 3), (3,)), ([2], [1]), ((Sub(-1),), (1,))],
)
def test_malformed_records_refused(size: object, stride: object) -> None:
    storage = torchsave._storage("/p", "float32", 10, 0)
    with pytest.raises(pickle.UnpicklingError, match="malformed tensor record"):
        check_tensor_record(storage, 0, size, stride, torchsave._Storage)
    check_tensor_record(storage, 0, (2, Sub(3)), (3, 1), torchsave._Storage)  # an int subclass is a count

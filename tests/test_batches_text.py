"""The batch line of gap and recalibrate says the batches runtime/batching.py forms."""

from __future__ import annotations

import pytest

from bnaudit.output.table.common import batches_text

pytestmark = pytest.mark.torchfree  # runs without torch (conftest.py)


@pytest.mark.parametrize(
    ("samples", "batches", "size", "skipped", "expected"),
    [
        # fewer samples than the batch size: one batch of all of them, not "1 batch of 64"
        (32, 1, 64, 0, "32 samples in 1 batch"),
        # 100 = 64 + 36
        (100, 2, 64, 0, "100 samples in 2 batches of 64, the last of 36"),
        # 41 = 5 * 8 + 1: the lone sample joins the batch before it (8, 8, 8, 8, 9)
        (41, 5, 8, 0, "41 samples in 5 batches of 8, the last of 9"),
        # 400 = 6 * 64 + 16
        (400, 7, 64, 0, "400 samples in 7 batches of 64, the last of 16"),
        # an even cut says nothing more
        (128, 2, 64, 0, "128 samples in 2 batches of 64"),
        (1, 1, 64, 0, "1 sample in 1 batch"),
        # unreadable images skipped, or an unknown number: batches need not cut evenly
        (100, 2, 64, 3, "100 samples in 2 batches of 64"),
        (100, 2, 64, None, "100 samples in 2 batches of 64"),
    ],
)
def test_batches_text(samples: int, batches: int, size: int, skipped: int | None, expected: str) -> None:
    assert batches_text(samples, batches, size, skipped) == expected

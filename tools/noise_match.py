"""Compare a shown output (README example, golden file) with a run, float noise masked.

Float32 kernels sum in an order that depends on the CPU, so a figure computed on one
machine can differ from the same figure on another in its last digits. bnaudit prints
what is pure noise on a healthy model as the floor it lies below ("<1.5e-05", see
`bnaudit.text.above_floor`): those print identically everywhere and compare as text.
What remains noisy are the last digits of real figures (0.164 printed from 0.16449999 on
one CPU and 0.16450001 on another reads 0.164 and 0.165). The rule, applied line by line:

- The lines must be equal once every number is masked; a run of spaces beside a number
  counts as one space (a number one digit shorter moves its padding, not its column).
- Integers on both sides (counts, channels, exit codes) must be equal.
- Other numbers a, b match when |a - b| <= UNITS_IN_LAST_PLACE units in the last printed
  digit of the more precise of the two (0.119 vs 0.12: 0.001) and <= REL_TOL x max(|a|, |b|).
  The first bound is what rounding a value moved by noise can do to it; the second catches
  "%g" numbers with trailing zeros dropped ("2e-07" is 2.00e-07, so 3e-07 is no neighbour).

A different finding, word, count, or a figure moved by more than its last digit still fails.
"""

from __future__ import annotations

import difflib
import re

UNITS_IN_LAST_PLACE = 1
REL_TOL = 0.1  # one unit in the last digit of a two-significant-digit number is at most 10%

# a number not inside a word, a dotted version (2.13.0) or a name (features.1); the sign
# belongs to it only where it cannot be a range's dash (42.9-52.6%)
NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?(?![\w.])")


def _split(line: str) -> tuple[str, list[str]]:
    """The line with each number replaced by NUL and a run of spaces beside one by one
    space, and its numbers."""
    skeleton = re.sub(r"\x00 +", "\x00 ", re.sub(r" +\x00", " \x00", NUMBER.sub("\x00", line)))
    return skeleton, NUMBER.findall(line)


def _last_place(token: str) -> float:
    """The value of one unit in the last printed digit: 0.119 -> 0.001, 5.93e-07 -> 1e-09."""
    mantissa, _, exponent = token.lstrip("+-").partition("e")
    decimals = len(mantissa.partition(".")[2])
    return 10.0 ** (int(exponent or 0) - decimals)


def numbers_match(a: str, b: str) -> bool:
    """Whether printed numbers `a` and `b` differ by no more than float noise can move them."""
    if a == b:
        return True
    integers = not any(c in token for token in (a, b) for c in ".e")
    if integers:
        return False
    x, y = float(a), float(b)
    tolerance = min(UNITS_IN_LAST_PLACE * min(_last_place(a), _last_place(b)), REL_TOL * max(abs(x), abs(y)))
    return abs(x - y) <= tolerance * (1 + 1e-9)  # the decimal units are not exact in binary


def line_difference(shown: str, run: str) -> str | None:
    """Why line `run` is not line `shown` up to noise, or None."""
    (skeleton_a, numbers_a), (skeleton_b, numbers_b) = _split(shown), _split(run)
    if skeleton_a != skeleton_b or len(numbers_a) != len(numbers_b):
        return "the text differs"
    for a, b in zip(numbers_a, numbers_b):
        if not numbers_match(a, b):
            return f"{a} and {b} differ by more than float noise"
    return None


def difference(shown: str, run: str) -> str | None:
    """None when `run` prints what `shown` shows up to float noise; otherwise a unified
    diff of the two, headed by the first line that differs and why."""
    lines_a, lines_b = shown.split("\n"), run.split("\n")  # a missing last newline is a difference too
    reason = None
    if len(lines_a) != len(lines_b):
        reason = f"{len(lines_a)} lines shown, {len(lines_b)} printed"
    else:
        for number, (a, b) in enumerate(zip(lines_a, lines_b), 1):
            why = line_difference(a, b)
            if why is not None:
                reason = f"line {number}: {why}"
                break
    if reason is None:
        return None
    diff = "".join(difflib.unified_diff(shown.splitlines(True), run.splitlines(True), "shown", "printed"))
    return f"{reason}\n{diff}"

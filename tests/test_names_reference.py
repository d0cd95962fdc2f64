"""`bnaudit.output.names.shorten_names` chooses what it chose before it was made faster.

The reference below is the shortening as it was (every other name compared word for word,
every kept shortening's pattern compiled and searched, every candidate scored per name),
kept verbatim; the module now skips patterns whose literal runs appear nowhere, splits the
names into classes of equal differences and ranks the candidates once per shape of name.
Those may only make it cheaper: on many generated name sets (separators, repeated and
numeric segments, names equal word for word, context names, control characters, widths
from 1 to 90) both choose the same shortening for every name.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from functools import lru_cache

import pytest

from bnaudit.output.names import shorten_names

pytestmark = pytest.mark.torchfree  # runs without torch (conftest.py)

# ----------------------------------------------------------------------------- the reference, as it was

ELLIPSIS = "…"
WORDS = {"./": re.compile(r"[^./]+"), "/": re.compile(r"[^/]+")}
SEP = "\x1f"
GAP = "[^\x1f\n]+(?:\x1f[^\x1f\n]+)*"


def segments(name, separators="./"):
    return tuple(m.span() for m in WORDS[separators].finditer(name))


def render(name, spans, runs):
    parts = []
    at = 0
    for start, end in runs:
        if start > at:
            parts.append(ELLIPSIS)
        first = 0 if start == 0 else spans[start][0]
        last = len(name) if end == len(spans) else spans[end - 1][1]
        parts.append(name[first:last])
        at = end
    if at < len(spans):
        parts.append(ELLIPSIS)
    return "".join(parts)


@lru_cache(maxsize=64)
def candidates(n):
    found = []
    for h in range(n):
        for t in range(n - h):
            outer = ((0, h),) if h else ()
            tail = ((n - t, n),) if t else ()
            if h or t:
                found.append((*outer, *tail))
            for a in range(h + 1, n - t):
                for b in range(a + 1, n - t):
                    found.append((*outer, (a, b), *tail))
    return tuple(found)


def regex(words, runs):
    pieces = []
    at = 0
    for start, end in runs:
        if start > at:
            pieces.append(GAP)
        pieces.append(re.escape(SEP.join(words[start:end])))
        at = end
    if at < len(words):
        pieces.append(GAP)
    return re.compile("^" + re.escape(SEP).join(pieces) + "$", re.MULTILINE)


def reference(names: Sequence[str], width: int, separators="./", context: Sequence[str] = ()) -> dict[str, str]:
    unique = list(dict.fromkeys(names))
    every = list(dict.fromkeys([*unique, *context]))
    words = {name: tuple(name[s:e] for s, e in segments(name, separators)) for name in every}
    lines = {name: SEP.join(w) for name, w in words.items()}
    everyone = "\n".join(lines.values())
    shown = {}
    for name in unique:
        if len(name) <= width:
            shown[name] = name
            continue
        others = everyone.replace("\n" + lines[name] + "\n", "\n").removeprefix(lines[name] + "\n")
        others = others.removesuffix("\n" + lines[name]) if others != lines[name] else ""
        own = words[name]
        masks = {
            sum(1 << i for i, (x, y) in enumerate(zip(own, w)) if x != y)
            for other, w in words.items()
            if len(w) == len(own) and other != name
        }
        shown[name] = shorten(name, width, own, others, masks, separators)
    if len(set(shown.values())) < len(shown):
        counts = {}
        for value in shown.values():
            counts[value] = counts.get(value, 0) + 1
        shown = {name: name if counts[value] > 1 else value for name, value in shown.items()}
    return shown


def shorten(name, width, own, others, masks, separators="./"):
    spans = segments(name, separators)
    if len(spans) < 2:
        keep = max(width - 1, 2)
        return name[: keep - keep // 2] + ELLIPSIS + name[len(name) - keep // 2 :]
    n = len(spans)
    starts = [0, *(s for s, _ in spans[1:])]
    ends = [*(e for _, e in spans[:-1]), len(name)]
    scored = []
    for runs in candidates(n):
        gaps = len(runs) - 1 + (runs[0][0] > 0) + (runs[-1][1] < n)
        length = gaps + sum(ends[end - 1] - starts[start] for start, end in runs)
        bare = sum(1 for start, _ in runs if start and own[start].isdigit())
        bare += sum(2 for start, end in runs if start and all(w.isdigit() for w in own[start:end]))
        scored.append((length, -(length - 3 * gaps - 4 * bare), runs[-1][1] < n, runs))
    fitting = sorted((s for s in scored if s[0] <= width), key=lambda s: (s[1], s[2]))
    for *_, runs in [*fitting, *sorted(scored, key=lambda s: (s[0], s[1], s[2]))]:
        kept = sum(((1 << end) - (1 << start)) for start, end in runs)
        if all(kept & mask for mask in masks) and not regex(own, runs).search(others):
            return render(name, spans, runs)
    return name


# ----------------------------------------------------------------------------- generated name sets

WORDS_POOL = [
    "model", "layers", "layer", "0", "1", "2", "12", "bn", "bn1", "norm", "encoder", "blocks", "attn",
    "stages", "normalization", "x" * 30, "日本語", "a b", "ckpt_000.pt", "ckpt_001.pt", "exp-2024_lr0.1",
    "tmp", "bench", "torch_save_folder", "model.safetensors",
]  # fmt: skip
ODD_WORDS = ["line\nbreak", "unit\x1fsep", "\\x1b[31m", "^$", "(a|b)*", ".*"]


def name_set(rng: random.Random) -> tuple[list[str], str, list[str], int]:
    separators = rng.choice(["./", "/"])
    pool = WORDS_POOL + (ODD_WORDS if rng.random() < 0.2 else [])
    depth = rng.choice([1, 2, 3, 4, 6, 8, 14])  # past 12 segments rankings are not cached
    base = [rng.choice(pool) for _ in range(depth)]

    def one() -> str:
        # mostly variations on one stem (a folder, a model's stages): the hard case
        words = [w if rng.random() < 0.7 else rng.choice(pool) for w in base]
        words = words[: rng.randint(1, len(words))] + [rng.choice(pool) for _ in range(rng.randint(0, 2))]
        joiners = "/" if separators == "/" else rng.choice([".", ".", "/", ".."])
        return rng.choice(["", "/", "."]) * (rng.random() < 0.2) + joiners.join(words)

    names = [one() for _ in range(rng.choice([1, 2, 3, 5, 12, 30, 50]))]
    context = [one() for _ in range(rng.choice([0, 0, 3, 10]))]
    return names, separators, context, rng.choice([1, 3, 8, 12, 16, 20, 24, 30, 36, 45, 60, 90])


@pytest.mark.parametrize("seed", range(40))
def test_shortenings_equal_the_reference_on_generated_name_sets(seed):
    rng = random.Random(seed)
    differ = 0
    for _ in range(12):
        names, separators, context, width = name_set(rng)
        expected = reference(names, width, separators, context)
        assert shorten_names(names, width, separators, context) == expected, (names, width, separators, context)
        differ += any(short != name for name, short in expected.items())
    assert differ  # the sets do shorten names, not only leave them whole

"""Long layer names in narrow columns: shortened at segment boundaries so that different
names stay different. Plain strings, no rich, no torch.

A name is read as segments: the words between its separators ("." and "/"):
`resnet.encoder.stages.1.layers.0.shortcut.normalization` has eight. A shortened name
keeps up to three runs of whole segments (one at the start, one inside, one at the end)
and writes "…" for each run of segments it leaves out:

    resnet.encoder.stages.1.layers.0.shortcut.normalization
    …stages.1.layers.0.shortcut…        (30 columns, among ResNet-50's 53 BN layers)

It never cuts inside a segment, so every part shown is a substring of the name (grep
finds it), and it is chosen so that the shortened name could stand for no other name of
the column: read as a pattern ("…" = one or more segments), it matches its own name only.
Among the shortenings that fit and are unique, the one keeping the most characters wins
(each "…" costs three characters of score, a kept run that starts with a bare index
after a "…" four more, one that is only indices eight more; at equal score the one
keeping the leaf).
Where none fits, the shortest unique one is used and is wider than asked: the table then
drops columns (`bnaudit.output.table.common.fitted_table`), it never folds a name. Only a
name of one segment wider than the column is cut inside, in its middle. A path (separators
"/") always keeps its file name: `sample_models/lightning/last.ckpt` may become
`…lightning/last.ckpt` or `…last.ckpt`, never `sample_models/lightning…`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache

ELLIPSIS = "…"
_WORDS = {"./": re.compile(r"[^./]+"), "/": re.compile(r"[^/]+")}

_Runs = tuple[tuple[int, int], ...]  # kept segment runs [start, end), in order


def _segments(name: str, separators: str = "./") -> tuple[tuple[int, int], ...]:
    return tuple(m.span() for m in _WORDS[separators].finditer(name))


def _render(name: str, spans: Sequence[tuple[int, int]], runs: _Runs) -> str:
    """The kept runs of `name` as written (separators inside a run kept), "…" for each gap."""
    parts: list[str] = []
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
def _candidates(n: int) -> tuple[_Runs, ...]:
    """Every way to keep a start run [0, h), an inner run [a, b) and an end run [n-t, n)
    of n segments, any of them empty but not all, with at least one segment left out
    between each two kept runs."""
    found: list[_Runs] = []
    for h in range(n):
        for t in range(n - h):
            outer: _Runs = ((0, h),) if h else ()
            tail: _Runs = ((n - t, n),) if t else ()
            if h or t:
                found.append((*outer, *tail))
            for a in range(h + 1, n - t):
                for b in range(a + 1, n - t):
                    found.append((*outer, (a, b), *tail))
    return tuple(found)


_SEP = "\x1f"  # between the words of a name in the text patterns are matched against
_GAP = "[^\x1f\n]+(?:\x1f[^\x1f\n]+)*"  # one or more words


def _regex(words: tuple[str, ...], runs: _Runs) -> re.Pattern[str]:
    """The shortening `runs` of `words` as a pattern over names written word SEP word,
    one per line: "…" is one or more words."""
    pieces: list[str] = []
    at = 0
    for start, end in runs:
        if start > at:
            pieces.append(_GAP)
        pieces.append(re.escape(_SEP.join(words[start:end])))
        at = end
    if at < len(words):
        pieces.append(_GAP)
    return re.compile("^" + re.escape(_SEP).join(pieces) + "$", re.MULTILINE)


def shorten_names(
    names: Sequence[str], width: int, separators: str = "./", context: Sequence[str] = ()
) -> dict[str, str]:
    """Each name -> itself if it fits `width` characters, else a shortening at segment
    boundaries that no other name of `names` could be read as (see the module docstring);
    wider than `width` where no unique one fits. Different names stay different.
    `separators` "/" for paths: a file name ("model.safetensors") is one segment.
    `context`: more names a shortening must not stand for (the model's other layers
    where a table shows some of them)."""
    unique = list(dict.fromkeys(names))
    every = list(dict.fromkeys([*unique, *context]))
    words = {name: tuple(name[s:e] for s, e in _segments(name, separators)) for name in every}
    lines = {name: _SEP.join(w) for name, w in words.items()}
    everyone = "\n".join(lines.values())
    shown: dict[str, str] = {}
    groups: dict[int, tuple[int, list[dict[str, int]]]] | None = None
    for j, name in enumerate(every[: len(unique)]):  # j: the name's bit in `_masks` (every starts with unique)
        if len(name) <= width:
            shown[name] = name
            continue
        # the others: every line but this name's own (names equal word for word are told apart below)
        others = everyone.replace("\n" + lines[name] + "\n", "\n").removeprefix(lines[name] + "\n")
        others = others.removesuffix("\n" + lines[name]) if others != lines[name] else ""
        # a shortening stands for no other name of as many words only if it keeps a word
        # where that name differs: checked on bit masks first, the regex then decides
        groups = _by_position(list(words.values())) if groups is None else groups
        shown[name] = _shorten(name, width, words[name], others, _masks(words[name], j, groups), separators)
    if len(set(shown.values())) < len(shown):  # names that differ only in separators: kept whole
        counts: dict[str, int] = {}
        for value in shown.values():
            counts[value] = counts.get(value, 0) + 1
        shown = {name: name if counts[value] > 1 else value for name, value in shown.items()}
    return shown


def _by_position(words: list[tuple[str, ...]]) -> dict[int, tuple[int, list[dict[str, int]]]]:
    """For each word count: the names of that many words, and at each position the names
    with each word there, as sets of bits (bit j: the j-th of `words`)."""
    groups: dict[int, tuple[int, list[dict[str, int]]]] = {}
    for j, own in enumerate(words):
        members, at = groups.get(len(own), (0, [{} for _ in own]))
        for i, word in enumerate(own):
            at[i][word] = at[i].get(word, 0) | 1 << j
        groups[len(own)] = (members | 1 << j, at)
    return groups


def _masks(own: tuple[str, ...], j: int, groups: dict[int, tuple[int, list[dict[str, int]]]]) -> set[int]:
    """The positions where each other name of as many words as `own` (the j-th) differs
    from it, one bit mask per distinct set: the names are split position by position into
    classes of equal masks (a few classes, where comparing name with name costs 50 x 50
    tuple walks for a folder of 50 paths)."""
    members, at = groups[len(own)]
    rest = members & ~(1 << j)
    classes = {0: rest} if rest else {}
    for i, word in enumerate(own):
        same = at[i][word]
        refined: dict[int, int] = {}
        for mask, bits in classes.items():
            if bits & same:
                refined[mask] = bits & same
            if bits & ~same:
                refined[mask | 1 << i] = bits & ~same
        classes = refined
    return set(classes)


def _stands_for_another(own: tuple[str, ...], runs: _Runs, others: str) -> bool:
    """Whether the shortening `runs` of `own` matches a line of `others` (`_regex`).

    Each kept run is a literal that a matching line holds where the pattern puts it (the
    first run at the line's start, the last at its end, any between separators); where one
    is nowhere in `others`, no line matches and the pattern is never compiled (one pattern
    per shortened path of a folder scan)."""
    text = "\n" + others + "\n"
    for start, end in runs:
        before = "\n" if start == 0 else _SEP
        after = "\n" if end == len(own) else _SEP
        if before + _SEP.join(own[start:end]) + after not in text:
            return False
    return _regex(own, runs).search(others) is not None


_RANKED_KEPT = 12  # segments; 792 candidates, 32 such rankings hold about 10 MB


@lru_cache(maxsize=32)
def _ranked(
    starts: tuple[int, ...], ends: tuple[int, ...], digits: tuple[bool, ...], width: int
) -> tuple[tuple[_Runs, int], ...]:
    """The shortenings of a name whose segments are written from `starts` to `ends` (bare
    indices where `digits`), in the order they are tried, each with its kept segments as
    bits: the ones that fit `width`, best score first, then all of them, shortest first.
    Cached: the paths of a folder, the layers of a stage, are alike in all of these."""
    n = len(starts)
    scored = []
    for runs in _candidates(n):
        gaps = len(runs) - 1 + (runs[0][0] > 0) + (runs[-1][1] < n)
        length = gaps + sum(ends[end - 1] - starts[start] for start, end in runs)
        # a run that starts with a bare index after "…" ("…0.layers") hides what it indexes;
        # a run that is nothing but one ("…0…") says less still
        bare = sum(1 for start, _ in runs if start and digits[start])
        bare += sum(2 for start, end in runs if start and all(digits[start:end]))
        scored.append((length, -(length - 3 * gaps - 4 * bare), runs[-1][1] < n, runs))
    fitting = sorted((s for s in scored if s[0] <= width), key=lambda s: (s[1], s[2]))
    # then, where none fits and is unique, the shortest unique one
    return tuple(
        (runs, sum(((1 << end) - (1 << start)) for start, end in runs))
        for *_, runs in [*fitting, *sorted(scored, key=lambda s: (s[0], s[1], s[2]))]
    )


def _shorten(name: str, width: int, own: tuple[str, ...], others: str, masks: set[int], separators: str = "./") -> str:
    spans = _segments(name, separators)
    if len(spans) < 2:  # one word wider than the column (a hostile name): cut in its middle
        keep = max(width - 1, 2)
        return name[: keep - keep // 2] + ELLIPSIS + name[len(name) - keep // 2 :]
    starts = (0, *(s for s, _ in spans[1:]))
    ends = (*(e for _, e in spans[:-1]), len(name))
    # a name of many segments has thousands of candidates: ranked afresh, not kept
    rank = _ranked if len(spans) <= _RANKED_KEPT else _ranked.__wrapped__
    leaf = separators == "/"  # a path keeps its file name
    for runs, kept in rank(starts, ends, tuple(w.isdigit() for w in own), width):
        if leaf and runs[-1][1] != len(spans):
            continue
        if all(kept & mask for mask in masks) and not _stands_for_another(own, runs, others):
            return _render(name, spans, runs)
    return name

"""Text that reaches a terminal: safe names, one-line errors, short listings.

One of each, used by every command, so that a message reads the same wherever it is
raised. Strings from files and models are untrusted: `printable` is applied by the
output package, exactly once, where they are written.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

# C0/C1 controls, DEL, the bidi controls that can reorder what a reader sees (marks
# U+200E/F and U+061C, embeddings and overrides U+202A-E, isolates U+2066-9), the line
# and paragraph separators a terminal may break on, and lone surrogates (bytes of a
# non-UTF-8 file name, which a UTF-8 stdout refuses to encode).
_UNPRINTABLE = "[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]"
_ANSI_COLOUR = re.compile(r"\x1b\[[0-9;]*m")


def printable(text: str) -> str:
    """`text` with control characters written as escapes (ESC -> \\x1b).

    Layer names, keys and messages come from the checkpoint: printed raw, an
    escape sequence in a name could recolour, retitle or rewrite the terminal.
    """
    if text.isascii() and text.isprintable():  # nearly every name: the regex is never compiled
        return text
    return re.sub(
        _UNPRINTABLE,
        lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100 else f"\\u{ord(m.group()):04x}",
        text,
    )


def single_line(text: str) -> str:
    """`text` on one line: every run of whitespace (newlines too) one space, none at the ends."""
    return " ".join(text.split())


def shown_value(value: object, limit: int = 80, depth: int = 3) -> str:
    """A short repr of a value read from a file, for a message: at most `limit` characters,
    containers nested deeper than `depth` shown as `...`.

    Built piece by piece and stopped at the limit, never by cutting a whole `str()`: a pickle
    can hold a tuple that contains itself twice, level by level, whose full text doubles per
    level (160 bytes of pickle, 2^40 characters); nothing here costs more than `limit`.
    """
    pieces: list[str] = []
    budget = [limit + 1]
    _render(value, depth, pieces, budget)
    text = "".join(pieces)
    return text if len(text) <= limit else text[: max(limit - 3, 0)] + "..."


def _render(value: object, depth: int, out: list[str], budget: list[int]) -> None:
    if budget[0] <= 0:
        return
    if isinstance(value, (str, bytes, bytearray)):
        piece = repr(value[: budget[0]])  # a slice: the repr of at most what still fits
    elif isinstance(value, bool) or value is None or isinstance(value, float):
        piece = repr(value)
    elif isinstance(value, int):
        # int -> str is quadratic (and refused past 4300 digits): a size, not the digits
        piece = repr(value) if value.bit_length() <= 128 else f"<int of {value.bit_length()} bits>"
    elif isinstance(value, (tuple, list, set, frozenset, dict)):
        opening, closing = {tuple: ("(", ")"), list: ("[", "]")}.get(type(value), ("{", "}"))
        if depth <= 0:
            piece = f"{opening}...{closing}"
        else:
            out.append(opening)
            budget[0] -= 1
            items = dict.items(value) if isinstance(value, dict) else value
            for i, item in enumerate(items):
                if budget[0] <= 0:
                    return
                if i:
                    out.append(", ")
                    budget[0] -= 2
                if isinstance(value, dict):
                    _render(item[0], depth - 1, out, budget)
                    out.append(": ")
                    budget[0] -= 2
                    _render(item[1], depth - 1, out, budget)
                else:
                    _render(item, depth - 1, out, budget)
            piece = closing
    else:  # records of bnaudit's readers, anything else: its type, never its own repr
        name = getattr(value, "name", None)
        kind = type(value).__name__
        piece = f"<{kind} {name[:60]}>" if isinstance(name, str) else f"<{kind}>"
    out.append(piece)
    budget[0] -= len(piece)


def exception_line(exc: BaseException, *, with_type: bool = True) -> str:
    """The one line of an exception worth showing a user.

    The first non-blank line of its message (TorchScript errors carry the scripted code
    first and the message last: the last line there), without colour codes, prefixed by
    the exception's class name when `with_type` (a library's own error, where the class
    says what went wrong) and standing alone otherwise (a reader's parse error). An
    exception that carries a container or a huge number (a KeyError of a key read from a
    file) shows its values through `shown_value`: their own str() can be exponential.
    """
    if any(_unbounded(arg) for arg in exc.args):
        message = ", ".join(shown_value(arg) for arg in exc.args)
    else:
        message = str(exc)
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    text = _ANSI_COLOUR.sub("", lines[-1] if "Traceback of TorchScript" in message else lines[0])
    return f"{type(exc).__name__}: {text}" if with_type else text


def _unbounded(value: object) -> bool:
    """Whether str() of `value` may cost more than its size: a container (it may hold itself
    many times) or an int past what int -> str converts."""
    return isinstance(value, (tuple, list, set, frozenset, dict)) or (
        isinstance(value, int) and value.bit_length() > 4096
    )


def listing(items: Iterable[object], limit: int = 3) -> str:
    """ "a, b, c and 4 more": at most `limit` items, then how many were left out."""
    shown = [str(item) for item in items]
    if len(shown) <= limit:
        return ", ".join(shown)
    return f"{', '.join(shown[:limit])} and {len(shown) - limit} more"


def plural(count: int, noun: str, plural_form: str | None = None) -> str:
    """ "1 layer", "3 layers" (`plural_form` where adding an s is wrong)."""
    return f"{count} {noun if count == 1 else (plural_form or noun + 's')}"


def layer_list(names: list[str], limit: int = 3) -> str:
    """ "layer a" / "layers a, b, c and 2 more"."""
    return f"{'layer' if len(names) == 1 else 'layers'} {listing(names, limit)}"


def above_floor(value: float, floor: float, spec: str = ".2g") -> str:
    """`value` as `spec` formats it, or "<floor" (the floor at 2 significant digits, no
    space, so that wrapped text never splits it) when it lies below `floor`.

    For figures that are float rounding on a healthy model: below its noise floor a value
    carries only the kernels' summation order, which differs between CPUs (3.8e-07 on one,
    4.7e-07 on another), so the text says where it lies ("<1.5e-05"), not the noise. Each floor is
    defined, with its reason, where the measurement is (invariance's screen, export
    parity's floor, invariance's KL_FLOOR). JSON keeps the exact numbers. NaN is printed,
    never hidden: it is not below anything.
    """
    if value < floor:
        return f"<{floor:.2g}"
    return format(value, spec)

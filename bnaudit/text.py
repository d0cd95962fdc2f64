"""TODO docstring. From: checkpoint, report, models, gap"""
from __future__ import annotations

import re


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return re.sub(r"\x1b\[[0-9;]*m", "", text[0]) if text else type(exc).__name__


# C0/C1 controls, DEL, the bidi overrides that can reorder what a reader sees, and lone
# surrogates (bytes of a non-UTF-8 file name, which a UTF-8 stdout refuses to encode).
_UNPRINTABLE = "[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\ud800-\udfff]"


def printable(text: str) -> str:
    """`text` with control characters written as escapes (ESC -> \\x1b).

    Layer names, keys and messages come from the checkpoint: printed raw, an
    escape sequence in a name could recolour, retitle or rewrite the terminal.
    """
    if text.isascii() and text.isprintable():  # nearly every name: no 1 ms regex compile per run
        return text
    return re.sub(_UNPRINTABLE, lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100
                  else f"\\u{ord(m.group()):04x}", text)


def one_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def exception_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    # TorchScript errors carry the scripted code first and the message last.
    text = lines[-1] if lines and "Traceback of TorchScript" in str(exc) else (lines[0] if lines else "")
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def name_list(names: list[str], limit: int = 3) -> str:
    shown = ", ".join(names[:limit])
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return f"{'layer' if len(names) == 1 else 'layers'} {shown}{more}"

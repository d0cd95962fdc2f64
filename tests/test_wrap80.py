"""At 80 columns, tables wrap only at spaces: every token of a table line at 80 columns is
a whole token of the same command's output at a width where nothing wraps (a word folded
inside would leave fragments such as "track_running_stats=Fal" that the wide output lacks).
Note lines under a file title keep their indent when they wrap."""

from __future__ import annotations

import glob
import os
import re

import pytest
from conftest import SAMPLES

BOX = "│┃━─╇┼╋╀╂┿"


def _tokens(text: str) -> set[str]:
    for ch in BOX:
        text = text.replace(ch, " ")
    return set(text.split())


def _table_tokens(text: str) -> set[str]:
    return _tokens("\n".join(line for line in text.splitlines() if "│" in line or "┃" in line))


def _shortened(token: str, whole: set[str]) -> bool:
    """A name shortened on purpose ("…sample_models/immature.pt", "resnet…0.bn1"): each "…"
    stands for one or more characters of a whole token, the rest is as written."""
    parts = token.split("…")
    if len(parts) < 2:
        return False
    pattern = re.compile(".+".join(map(re.escape, parts)))
    return any(pattern.fullmatch(w) for w in whole)


def check_wraps_at_spaces(cli, *args: str) -> None:
    narrow = cli(*args, width=80)
    wide = cli(*args, width=1000)
    assert narrow.exit_code == wide.exit_code, narrow.output
    assert any("│" in line for line in narrow.output.splitlines()), narrow.output
    assert all(len(line) <= 80 for line in narrow.output.splitlines() if "│" in line), narrow.output
    whole = _tokens(wide.output)
    broken = {t for t in _table_tokens(narrow.output) - whole if not _shortened(t, whole)}
    assert not broken, f"tokens split at 80 columns: {sorted(broken)}\n{narrow.output}"


def test_rules_wrap_at_spaces(cli):
    check_wraps_at_spaces(cli, "rules")


SAMPLE_FILES = sorted(p for p in glob.glob(os.path.join(SAMPLES, "*")) if p.endswith((".pt", ".pth", ".safetensors")))


@pytest.mark.parametrize("path", SAMPLE_FILES, ids=os.path.basename)
def test_inspect_wraps_at_spaces(cli, path):
    check_wraps_at_spaces(cli, "inspect", path)


def test_inspect_several_wraps_at_spaces(cli):
    check_wraps_at_spaces(cli, "inspect", *SAMPLE_FILES)


def test_diff_wraps_at_spaces(cli):
    check_wraps_at_spaces(
        cli, "diff", os.path.join(SAMPLES, "pretrained.safetensors"), os.path.join(SAMPLES, "finetuned.pt")
    )


def _note_lines(output: str, first_note: str) -> list[str]:
    """The lines from the one starting with `first_note` (indented) to the next blank or table line."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("  " + first_note))
    block = []
    for line in lines[start:]:
        if not line.strip() or "┃" in line or "│" in line:
            break
        block.append(line)
    return block


@pytest.mark.parametrize("width", [44, 60])
def test_inspect_notes_keep_their_indent_when_wrapped(cli, width):
    result = cli("inspect", os.path.join(SAMPLES, "sharded"), width=width)
    notes = _note_lines(result.output, "eps")
    assert len(notes) > 2, result.output  # the two notes wrap at this width
    assert all(line.startswith("  ") and not line.startswith("   ") for line in notes), result.output
    assert any(line.strip().startswith("3 shards read") for line in notes), result.output


def test_diff_notes_keep_their_indent_when_wrapped(cli):
    pair = (os.path.join(SAMPLES, "pretrained.safetensors"), os.path.join(SAMPLES, "finetuned.pt"))
    result = cli("diff", *pair, width=44)
    notes = _note_lines(result.output, "eps")
    assert len(notes) > 1, result.output
    assert all(line.startswith("  ") for line in notes), result.output


def test_gap_wraps_at_spaces(cli):
    net = os.path.join(SAMPLES, "digits_net.py") + ":digits_net"
    data = os.path.join(SAMPLES, "data", "digits_val.safetensors")
    check_wraps_at_spaces(cli, "gap", os.path.join(SAMPLES, "dead_channel.safetensors"), "--arch", net, "--data", data)

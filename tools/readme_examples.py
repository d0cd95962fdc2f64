"""Rewrite the example outputs of README.md and docs/**/*.md from real runs of the commands they show.

    python tools/readme_examples.py          # run every example, rewrite its block
    python tools/readme_examples.py --check  # exit 1 if a shown output differs from a run

documents() lists the files scanned: README.md first, then every Markdown file under docs/
in name order (a later example may read what an earlier one wrote, across files too).

An example is a block

    <!-- begin example COLUMNS=100 bnaudit inspect sample_models/healthy.pt -->
    ```
    $ bnaudit inspect sample_models/healthy.pt
    ...what the command printed...
    ```
    <!-- end example -->

The command after `begin example` (optional VAR=value settings, then `bnaudit ...`) runs
from the repository root, without colour, at the stated COLUMNS (100 when none is stated);
stdout and stderr are shown as a terminal would show them, with trailing spaces trimmed.
tests/test_readme_examples.py fails when a block differs from a run. Blocks are compared
with float noise masked (tools/noise_match.py: the last printed digit of a figure may
differ between CPUs); a block that matches a run up to noise is kept as it is, so a
rewrite on another machine changes only what really changed.

Examples that write files write them under SCRATCH (created before each run), e.g.
`bnaudit recalibrate ... -o /tmp/bnaudit-readme/reset.recal.pt --force` (or `--stats-out`); a later example may
read what an earlier one wrote (`bnaudit inspect /tmp/bnaudit-readme/reset.recal.pt`), and
`prerequisites()` names the earlier ones to run first when an example is run alone.
"""

from __future__ import annotations

import argparse
import glob
import itertools
import os
import re
import shlex
import subprocess
import sys

from noise_match import difference

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")


def documents() -> list[str]:
    """The files whose example blocks are run: README.md, then docs/**/*.md in name order."""
    return [README, *sorted(glob.glob(os.path.join(REPO, "docs", "**", "*.md"), recursive=True))]


BLOCK = re.compile(r"(<!-- begin example (?P<command>[^\n]*?) -->\n)(?P<body>.*?)(<!-- end example -->)", re.DOTALL)
DEFAULT_COLUMNS = "100"
SCRATCH = "/tmp/bnaudit-readme"


def run_example(command: str) -> str:
    """The block body for `command`: a fenced `$ command` and what it printed."""
    words = shlex.split(command)
    settings = {}
    while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
        name, _, value = words.pop(0).partition("=")
        settings[name] = value
    if not words or words[0] != "bnaudit":
        raise ValueError(f"an example runs bnaudit: {command!r}")
    os.makedirs(SCRATCH, exist_ok=True)
    env = {**os.environ, "COLUMNS": DEFAULT_COLUMNS, "NO_COLOR": "1", **settings}
    env.pop("FORCE_COLOR", None)
    proc = subprocess.run(
        [sys.executable, "-m", "bnaudit", *words[1:]],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # interleaved, as a terminal shows them
        text=True,
        timeout=300,
        check=False,
    )
    lines = [line.rstrip() for line in proc.stdout.rstrip("\n").splitlines()]
    shown = shlex.join(words)
    status = f"  # exit {proc.returncode}" if proc.returncode else ""
    return "```\n" + f"$ {shown}{status}\n" + "\n".join(lines) + "\n```\n"


def examples(text: str) -> list[tuple[str, str]]:
    """(command, current body) of every example block in `text`."""
    return [(m["command"], m["body"]) for m in BLOCK.finditer(text)]


def _written(command: str) -> set[str]:
    """The SCRATCH files `command` writes (its -o/--output, --stats-out)."""
    words = shlex.split(command)
    return {
        after
        for before, after in itertools.pairwise(words)
        if before in ("-o", "--output", "--stats-out") and after.startswith(SCRATCH + "/")
    }


def prerequisites(command: str, commands: list[str]) -> list[str]:
    """The examples before `command` in `commands` that write a SCRATCH file it names."""
    names = set(shlex.split(command))
    earlier = commands[: commands.index(command)]
    return [c for c in earlier if _written(c) & (names - _written(command))]


def update(text: str, report: list[str] | None = None) -> str:
    """`text` with every example block rewritten from a run, except blocks that match
    their run up to float noise (kept as shown); `report` gets, for each rewritten
    block, its command and how it differs."""

    def rewrite(m: re.Match[str]) -> str:
        run = run_example(m["command"])
        why = difference(m["body"], run)
        if why is None:
            return m.group(0)
        if report is not None:
            report.append(f"{m['command']}\n{why}")
        return m.group(1) + run + m.group(4)

    return BLOCK.sub(rewrite, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report whether the shown outputs are current")
    args = parser.parse_args(argv)
    failed = 0
    for path in documents():
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        differences: list[str] = []
        updated = update(text, differences)
        if updated == text:
            print(f"{path}: {len(examples(text))} examples are current")
            continue
        if args.check:
            for entry in differences:
                print(f"example {entry}", file=sys.stderr)
            print(f"{path}: example output differs from a run; run python tools/readme_examples.py", file=sys.stderr)
            failed = 1
            continue
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(updated)
        print(f"{path}: examples rewritten from real runs")
    return failed


if __name__ == "__main__":
    sys.exit(main())

"""Write the JSON report of every documented example, to compare two trees byte for byte.

    python tools/sample_reports.py OUT_DIR              # one JSON file per example command
    python tools/sample_reports.py OUT_DIR --against DIR  # and exit 1 if any differs from DIR's
    python tools/sample_reports.py OUT_DIR --torch-free   # only the commands that need no torch

The commands are the examples of README.md and docs/ (tools/readme_examples.py finds them),
each run with `--format json` (a `-q`, which JSON ignores, is dropped), plus `inspect` of
the whole `sample_models/` folder. A refactoring that must not change behaviour is checked
by running this before and after it on the same machine: every report must be identical.
With --torch-free, the commands that read checkpoints only (inspect, diff, rules, fold without
a model or data): CI compares their reports across Python versions, with and without torch.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shlex
import subprocess
import sys

from readme_examples import BLOCK, REPO, SCRATCH, documents


def commands(torch_free: bool = False) -> list[str]:
    found = ["bnaudit inspect sample_models"]
    for path in documents():
        with open(path, encoding="utf-8") as fh:
            found += [m["command"] for m in BLOCK.finditer(fh.read())]
    found = list(dict.fromkeys(found))
    return [c for c in found if needs_no_torch(c)] if torch_free else found


def needs_no_torch(command: str) -> bool:
    """Whether `command` reads checkpoints only: no model built, no data run, and no input that
    an earlier example made with torch (recalibrate's outputs under SCRATCH)."""
    words = shlex.split(command)
    while "=" in words[0]:  # VAR=value settings before `bnaudit`
        words.pop(0)
    options = {w.partition("=")[0] for w in words}
    runs_a_model = bool(options & {"--arch", "--data", "--dataset"})
    return (
        words[1] in ("inspect", "diff", "rules", "fold") and not runs_a_model and not any(SCRATCH in w for w in words)
    )


def run_json(command: str) -> bytes:
    words = shlex.split(command)
    settings = {}
    while "=" in words[0]:
        name, _, value = words.pop(0).partition("=")
        settings[name] = value
    args = [w for w in words[1:] if w != "-q"]
    if args[0] == "rules":  # plain text only
        pass
    elif args[0] == "recalibrate":  # its exit code is not a verdict
        args += ["--format", "json"]
    else:
        args += ["--format", "json", "--exit-zero"]
    os.makedirs(SCRATCH, exist_ok=True)
    env = {**os.environ, "NO_COLOR": "1", **settings}
    proc = subprocess.run(
        [sys.executable, "-m", "bnaudit", *args], cwd=REPO, env=env, capture_output=True, timeout=600, check=False
    )
    return proc.stdout + f"\n[exit {proc.returncode}]\n".encode() + proc.stderr


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--against", help="a folder this script wrote before")
    parser.add_argument("--torch-free", action="store_true", help="only the commands that need no torch")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    differ = 0
    for n, command in enumerate(commands(args.torch_free)):
        name = f"{n:02d}.json"
        with open(os.path.join(args.out, name), "wb") as fh:
            fh.write(f"$ {command}\n".encode() + run_json(command))
        if args.against:
            same = filecmp.cmp(os.path.join(args.out, name), os.path.join(args.against, name), shallow=False)
            differ += not same
            print(f"{'same' if same else 'DIFFERS'}  {name}  {command}")
        else:
            print(f"{name}  {command}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())

"""Regenerate the golden output of tests/test_golden.py after an intended change:

    python tools/update_golden.py            every case
    python tools/update_golden.py gap rules  only these

Writes tests/golden/NAME.txt from the same `render` the test compares with, and says which
files changed; review them with `git diff tests/golden/`. A file whose new text differs
only by float noise (tools/noise_match.py) is left as it is. The tables are drawn by rich: a
rich release that changes how tables are drawn changes the files too (rich is pinned with
a lower bound in pyproject.toml; regenerate with the version the suite is meant to pass on).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "tools")]

from noise_match import difference
from test_golden import CASES, GOLDEN, render


def main(names: list[str]) -> int:
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        print(f"unknown case(s): {', '.join(unknown)} (cases: {', '.join(CASES)})", file=sys.stderr)
        return 2
    GOLDEN.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        for name in names or list(CASES):
            printed, code = render(name, Path(scratch) / name)
            expected_code = CASES[name][1]
            if code != expected_code:
                print(f"{name}: exit code {code}, the case expects {expected_code}; not written", file=sys.stderr)
                return 1
            path = GOLDEN / f"{name}.txt"
            old = path.read_text(encoding="utf-8") if path.exists() else None
            if old is not None and old != printed and difference(old, printed) is None:
                # another CPU's last digits: the file stays, so a diff shows only real changes
                print(f"unchanged {path.relative_to(REPO)} (differs by float noise only)")
                continue
            with open(path, "w", encoding="utf-8", newline="") as fh:  # newline="": the bytes as printed
                fh.write(printed)
            print(f"{'unchanged' if old == printed else 'written  '} {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

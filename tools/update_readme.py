"""Rewrite README.md's generated blocks (rule table, configuration reference) from the code.

    python tools/update_readme.py          # rewrite the blocks in place
    python tools/update_readme.py --check  # exit 1 if a block is out of date (CI, tests)

A block sits between `<!-- begin NAME ... -->` and `<!-- end NAME -->`; its content comes
from bnaudit.docs (rules.RULES and config.KEYS), the source `bnaudit rules` prints too.
"""

from __future__ import annotations

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bnaudit.audit.ruledocs import GENERATED, generated_blocks, update_generated


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report whether the README is up to date")
    parser.add_argument("--readme", default=os.path.join(REPO, "README.md"))
    args = parser.parse_args(argv)
    with open(args.readme, encoding="utf-8") as fh:
        text = fh.read()
    missing = sorted(set(GENERATED) - set(generated_blocks(text)))
    if missing:
        print(f"{args.readme}: no generated block for {', '.join(missing)}", file=sys.stderr)
        return 1
    updated = update_generated(text)
    if updated == text:
        print(f"{args.readme}: generated blocks are up to date")
        return 0
    if args.check:
        print(f"{args.readme}: generated blocks are out of date; run python tools/update_readme.py", file=sys.stderr)
        return 1
    with open(args.readme, "w", encoding="utf-8") as fh:
        fh.write(updated)
    print(f"{args.readme}: generated blocks rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())

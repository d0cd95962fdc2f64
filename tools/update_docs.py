"""Rewrite the generated documentation from the code: the rule pages and the generated blocks.

    python tools/update_docs.py          # rewrite docs/rules/*.md and every generated block
    python tools/update_docs.py --check  # exit 1 if anything is out of date (CI, tests)

Both also report every relative link of README.md and docs/ whose file or anchor is missing
(exit 1).

Generated from the rule registry and the configuration keys (bnaudit.audit.ruledocs):

- docs/rules/index.md and one page per rule code, docs/rules/<CODE>.md; a page of a code
  that no longer exists is removed (reported by --check);
- every `<!-- begin NAME ... -->` ... `<!-- end NAME -->` block of ruledocs.GENERATED in
  README.md and docs/**/*.md (the configuration table of docs/configuration.md).

A rule page may show a real run on a committed sample (RULE_EXAMPLES): its output is filled in
and checked by tools/readme_examples.py, and kept here when a page is rewritten.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from readme_examples import BLOCK

from bnaudit.audit.ruledocs import GENERATED, generated_blocks, rule_page, rules_index_page, update_generated
from bnaudit.audit.rules import RULES

RULES_DIR = "docs/rules"

# A command whose output shows the rule on a committed sample model (sample_models/generate.py
# builds one broken model per rule). Rules without a sample that shows them have no example.
RULE_EXAMPLES = {
    "BN001": "bnaudit inspect -q sample_models/missing_var.pt",
    "BN002": "bnaudit inspect -q sample_models/reset_stats.pt",
    "BN003": "bnaudit inspect -q sample_models/immature.pt",
    "BN004": "bnaudit inspect -q sample_models/dead_channel.safetensors",
    "BN005": "bnaudit inspect -q sample_models/nan_stats.pt",
    "BN008": "bnaudit inspect -q sample_models/fp16_buffers.safetensors",
    "BN009": "bnaudit inspect -q sample_models/converted.safetensors",
    "BN010": "bnaudit inspect -q sample_models/partially_frozen.pt",
    "BN012": "bnaudit inspect -q sample_models/onnx/digits_training.onnx",
    "BN014": "bnaudit inspect -q sample_models/onnx/folded.onnx",
    "BN101": "bnaudit diff -q sample_models/pretrained.safetensors sample_models/finetuned.pt --expect-frozen 'features.*'",
    "BN105": "bnaudit diff -q sample_models/pretrained.safetensors sample_models/finetuned.pt --expect-frozen 'head.*'",
    "BN108": "bnaudit diff -q sample_models/healthy.pt sample_models/onnx/digits_training.onnx --select BN108",
    "BN302": "bnaudit fed -q sample_models/federated/global.safetensors sample_models/federated/client1.safetensors "
    "sample_models/federated/client2.safetensors --select BN302",
    "BN305": "bnaudit fed -q sample_models/federated/global.safetensors sample_models/federated/client1.safetensors "
    "sample_models/federated/client2.safetensors --select BN305",
    "BN401": "bnaudit parity -q sample_models/healthy.pt --arch sample_models/digits_net.py:digits_net "
    "--data sample_models/data/digits_val.safetensors --against sample_models/onnx/digits_training.onnx",
}


def documents(repo: str = REPO) -> list[str]:
    """README.md and every Markdown file under docs/, as paths relative to `repo`."""
    found = glob.glob("docs/**/*.md", root_dir=repo, recursive=True)
    return ["README.md", *sorted(path.replace(os.sep, "/") for path in found)]


def keep_examples(new: str, old: str) -> str:
    """`new` with each example block's output taken from the same command's block in `old`
    (a regenerated page keeps the real runs tools/readme_examples.py wrote into it)."""
    bodies = {m["command"]: m["body"] for m in BLOCK.finditer(old)}
    return BLOCK.sub(lambda m: m.group(1) + bodies.get(m["command"], m["body"]) + m.group(4), new)


def expected(repo: str = REPO) -> dict[str, str | None]:
    """Every generated document: path relative to `repo` -> its text, None for a rule page to remove."""
    out: dict[str, str | None] = {}
    pages = {f"{RULES_DIR}/index.md": rules_index_page()}
    pages |= {f"{RULES_DIR}/{code}.md": rule_page(rule, RULE_EXAMPLES.get(code)) for code, rule in RULES.items()}
    for path in glob.glob(f"{RULES_DIR}/*.md", root_dir=repo):
        out.setdefault(path.replace(os.sep, "/"), None)
    for path, text in pages.items():
        out[path] = keep_examples(text, read(repo, path) or "")
    for path in documents(repo):
        if path in out:
            continue
        text = read(repo, path)
        if text is not None and generated_blocks(text):
            out[path] = update_generated(text)
    return out


def read(repo: str, path: str) -> str | None:
    try:
        with open(os.path.join(repo, path), encoding="utf-8") as fh:
            return fh.read()
    except FileNotFoundError:
        return None


def stale(repo: str = REPO) -> dict[str, str | None]:
    """The generated documents whose text differs from what the code gives (None: to remove)."""
    return {path: text for path, text in expected(repo).items() if read(repo, path) != text}


def missing_blocks(repo: str = REPO) -> list[str]:
    """Generated block names that no document holds."""
    found: set[str] = set()
    for path in documents(repo):
        found |= set(generated_blocks(read(repo, path) or ""))
    return sorted(set(GENERATED) - found)


LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives the headings of `markdown`: lower case, punctuation but `-`
    and `_` dropped, spaces as `-`, a repeated heading suffixed -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    for line in _outside_code(markdown, spans=False).splitlines():
        if m := re.match(r"#{1,6} +(.*?) *#*$", line):
            slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
            out.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return out


def _outside_code(markdown: str, spans: bool = True) -> str:
    """`markdown` without fenced code blocks and (with `spans`) inline code spans: a link or a
    heading there is text."""
    text = re.sub(r"^```.*?^```[^\n]*$", "", markdown, flags=re.DOTALL | re.MULTILINE)
    return re.sub(r"`[^`\n]*`", "", text) if spans else text


def broken_links(repo: str = REPO) -> list[str]:
    """Relative links of README.md and docs/**/*.md whose file or #anchor does not exist."""
    broken = []
    for path in documents(repo):
        text = read(repo, path) or ""
        for target in LINK.findall(_outside_code(text)):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            resolved = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
            full = os.path.join(repo, resolved)
            if not os.path.exists(full) or os.path.relpath(full, repo).startswith(".."):
                broken.append(f"{path}: {target}: no such file")
            elif anchor and (os.path.isdir(full) or anchor not in anchors(read(repo, resolved) or "")):
                broken.append(f"{path}: {target}: no such anchor")
    return broken


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report whether the generated docs are up to date")
    parser.add_argument("--repo", default=REPO, help="the checkout to update (default: this one)")
    args = parser.parse_args(argv)
    if missing := missing_blocks(args.repo):
        print(f"no document holds the generated block {', '.join(missing)}", file=sys.stderr)
        return 1
    changes = stale(args.repo)
    if args.check:
        for path, text in changes.items():
            print(f"{path}: {'no rule has this code' if text is None else 'out of date'}", file=sys.stderr)
        if changes:
            print("run python tools/update_docs.py", file=sys.stderr)
    else:
        write(args.repo, changes)
    for line in (broken := broken_links(args.repo)):
        print(line, file=sys.stderr)
    if not changes and not broken:
        print("generated docs are up to date; every relative link resolves")
    return 1 if broken or (changes and args.check) else 0


def write(repo: str, changes: dict[str, str | None]) -> None:
    """Write the generated documents (None: remove the page)."""
    for path, text in changes.items():
        full = os.path.join(repo, path)
        if text is None:
            os.remove(full)
            print(f"{path}: removed (no rule has this code)")
            continue
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w", encoding="utf-8") as fh:
            fh.write(text)
        print(f"{path}: rewritten")


if __name__ == "__main__":
    sys.exit(main())

"""A page of `--format html` read back with the standard library's html.parser: elements,
attributes, text, the numbers its tables keep (`data-value`), and every URL it could load."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from html.parser import HTMLParser

# Elements without an end tag in HTML (SVG's self-closing elements come as startendtag).
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


@dataclass
class Node:
    tag: str
    attrs: dict[str, str]
    parent: Node | None = None
    children: list[Node | str] = field(default_factory=list)

    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())

    def iter(self):
        yield self
        for child in self.children:
            if isinstance(child, Node):
                yield from child.iter()

    def find_all(self, tag: str | None = None, cls: str | None = None, **attrs: str) -> list[Node]:
        return [
            n
            for n in self.iter()
            if (tag is None or n.tag == tag)
            and (cls is None or cls in n.classes())
            and all(n.attrs.get(k.replace("_", "-")) == v for k, v in attrs.items())
        ]

    def find(self, tag: str | None = None, cls: str | None = None, **attrs: str) -> Node:
        found = self.find_all(tag, cls, **attrs)
        assert found, (tag, cls, attrs)
        return found[0]

    def text(self) -> str:
        return "".join(c if isinstance(c, str) else c.text() for c in self.children)

    def ancestors(self):
        node = self.parent
        while node is not None:
            yield node
            node = node.parent


class _Builder(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Node("#document", {})
        self.current = self.root
        self.errors: list[str] = []

    def handle_starttag(self, tag, attrs):
        node = Node(tag, {k: v or "" for k, v in attrs}, self.current)
        self.current.children.append(node)
        if tag not in VOID:
            self.current = node

    def handle_startendtag(self, tag, attrs):
        self.current.children.append(Node(tag, {k: v or "" for k, v in attrs}, self.current))

    def handle_endtag(self, tag):
        if tag in VOID:
            return
        node = self.current
        while node is not None and node.tag != tag:
            node = node.parent
        if node is None:
            self.errors.append(f"stray </{tag}>")
            return
        if node is not self.current:
            self.errors.append(f"</{tag}> closes an element left open ({self.current.tag})")
        assert node.parent is not None
        self.current = node.parent

    def handle_data(self, data):
        self.current.children.append(data)


def parse(page: str) -> Node:
    """The page as a tree; every element closed where it should be."""
    builder = _Builder()
    builder.feed(page)
    builder.close()
    assert builder.errors == [], builder.errors[:5]
    assert builder.current is builder.root, f"unclosed <{builder.current.tag}>"
    return builder.root


def value(cell: Node) -> float | None:
    """The exact number a table cell keeps (None where it shows none)."""
    raw = cell.attrs.get("data-value")
    return None if raw is None else float(raw)


def same_number(shown: float | None, json_value: float | int | None) -> bool:
    """A cell's exact value against the JSON report's (which writes NaN and Inf as null)."""
    if json_value is None:
        return shown is None or not math.isfinite(shown)
    return shown is not None and shown == json_value


def table_rows(table: Node) -> tuple[list[str], list[list[Node]]]:
    """(header texts, the cells of each body row)."""
    headers = [th.text() for th in table.find("thead").find_all("th")]
    rows = [tr.find_all("td") for tr in table.find("tbody").find_all("tr")]
    return headers, rows


# Attributes through which a page could make the browser fetch something.
_LOADING = {"src", "href", "xlink:href", "srcset", "poster", "data", "action", "formaction", "background", "ping"}
_URL = re.compile(r"url\(\s*['\"]?([^'\")]*)")


def resource_urls(root: Node, page: str) -> list[str]:
    """Every URL the page could load: attributes of elements that fetch, url() in styles,
    @import. Hyperlinks (<a href>) are not resources: following one is the reader's act."""
    found = []
    for node in root.iter():
        for key, val in node.attrs.items():
            if key in _LOADING and not (node.tag == "a" and key == "href"):
                found.append(val)
            if key == "style":
                found += _URL.findall(val)
    for style in root.find_all("style"):
        found += _URL.findall(style.text())
        if "@import" in style.text():
            found.append("@import")
    return found

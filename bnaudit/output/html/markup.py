"""The page around the charts: escaped text, tables of exact numbers, findings, one stylesheet.

No matplotlib here (the charts are `charts.py`'s); plain strings in, one HTML document out.

Escaping happens in exactly one place, `tag`: a `str` child or attribute value is untrusted
and is made printable (`bnaudit.text.printable`: controls, bidi overrides and lone
surrogates written as escapes) and HTML-escaped there; a child that is already `Html`
(built by `tag`, or a chart's SVG) is inserted as it is. So a layer name passes through the
escape once whichever helper carries it, and nothing a file holds becomes markup.

Every number a table shows keeps its exact value beside the rounded text: `<td
data-value="repr(x)">` (`num`), so the page and the JSON report can be compared number for
number, and a reader can copy the full value.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from bnaudit import __version__
from bnaudit.output.table.common import g3
from bnaudit.text import printable

if TYPE_CHECKING:
    from bnaudit.audit.rules import Finding

# The rule pages of the documentation (docs/rules/CODE.md in the repository SARIF names as
# the tool's home), linked as plain hyperlinks: opening the page never fetches anything.
RULE_PAGES = "https://github.com/bnaudit/bnaudit/blob/main/docs/rules/"

# One colour per severity, shared by the stylesheet and the charts (charts.py).
SEVERITY_COLOURS = {"error": "#c62828", "warning": "#d08700", "info": "#1565c0", "ok": "#2e7d32"}
MUTED = "#8a8f98"


Header = str | tuple[str, str]  # a column header, or (header, tooltip)


class Html(str):
    """Markup: already escaped, inserted as it is."""

    __slots__ = ()


class Cell(Html):
    """A whole table cell (<td>): a row takes it as it is."""

    __slots__ = ()


def text(value: str) -> Html:
    """Untrusted text as HTML: printable, then escaped (quotes too, for attributes)."""
    return Html(html.escape(printable(value), quote=True))


def _flatten(children: Iterable[object], out: list[str]) -> None:
    for child in children:
        if child is None or child is False:
            continue
        if isinstance(child, Html):
            out.append(child)
        elif isinstance(child, str):
            out.append(text(child))
        elif isinstance(child, (int, float)):
            out.append(text(str(child)))
        else:
            _flatten(child, out)  # type: ignore[arg-type]  # an iterable of children


def join(*children: object) -> Html:
    """Children as one piece of markup (str children escaped, Html kept)."""
    out: list[str] = []
    _flatten(children, out)
    return Html("".join(out))


_VOID = frozenset({"br", "hr", "meta", "col", "wbr"})


def tag(name: str, /, *children: object, **attrs: str | int | float | bool | None) -> Html:
    """<name attrs>children</name>. Attribute names: `class_` -> class, `data_value` ->
    data-value; None or False leaves an attribute out, True writes it bare."""
    parts = [name]
    for key, value in attrs.items():
        if value is None or value is False:
            continue
        attr = key.rstrip("_").replace("_", "-")
        parts.append(attr if value is True else f'{attr}="{text(str(value))}"')
    opening = f"<{' '.join(parts)}>"
    if name in _VOID:
        return Html(opening)
    return Html(f"{opening}{join(*children)}</{name}>")


# --- cells --------------------------------------------------------------------------------


def cell(*children: object, **attrs: str | int | float | bool | None) -> Cell:
    """<td> with these children (str escaped, Html kept)."""
    return Cell(tag("td", *children, **attrs))


def exact(x: float | int | None) -> str | None:
    """The value a number cell keeps: repr (round-trips through float()), None for none."""
    return None if x is None else repr(x)


def num(x: float | int | None, shown: str | None = None, **attrs: str | None) -> Cell:
    """A right-aligned cell showing `shown` (default: the integer, or three significant digits
    as the terminal's tables print them) and keeping `x` exactly."""
    if shown is None:
        shown = "-" if x is None else (str(x) if isinstance(x, int) else g3(x))
    return cell(shown, class_="num", data_value=exact(x), **attrs)


# --- building blocks ----------------------------------------------------------------------


def severity_badge(severity: str) -> Html:
    return tag("span", severity, class_=f"badge sev-{severity}")


def rule_link(code: str, name: str) -> Html:
    """The rule's code linked to its page, its name, and its summary as a tooltip."""
    from bnaudit.audit.rules import RULES  # the registry: imported by whoever made findings already

    rule = RULES.get(code)
    summary = rule.summary if rule is not None else None
    return join(tag("a", code, href=f"{RULE_PAGES}{code}.md", title=summary, class_="rule"), " ", name)


def table(
    headers: Sequence[Header],
    rows: Iterable[Html],
    *,
    caption: str | None = None,
    class_: str = "",
    scroll: bool = False,
) -> Html:
    """A table; a header may be (text, tooltip). `rows` are `row()`s. `scroll`: in a box of
    bounded height (a long table beside its chart), unbounded in print."""
    head = tag(
        "tr",
        *(
            tag("th", h[0], title=h[1], scope="col") if isinstance(h, tuple) else tag("th", h, scope="col")
            for h in headers
        ),
    )
    body = join(*rows)
    built = tag(
        "table",
        tag("caption", caption) if caption else None,
        tag("thead", head),
        tag("tbody", body),
        class_=class_ or None,
    )
    return tag("div", built, class_="table scroll" if scroll else "table")


def row(*cells: object, **attrs: str | None) -> Html:
    """A table row; a Cell (num(), cell()) stays as it is, anything else becomes one cell."""
    return tag("tr", *(c if isinstance(c, Cell) else cell(c) for c in cells), **attrs)


def findings_table(findings: Sequence[Finding], caption: str = "findings") -> Html:
    """Every finding, one row each (never collapsed: the page has room), rule pages linked."""
    if not findings:
        return tag("p", "No findings.", class_="quiet")
    rows = [
        row(
            cell(rule_link(f.code, f.name)),
            cell(severity_badge(f.severity)),
            cell(f.layer or "(file)", class_="name"),
            cell(f.message, class_="message"),
            data_layer=f.layer or "",
            data_code=f.code,
            class_=f"finding sev-{f.severity}",
        )
        for f in findings
    ]
    return table(["rule", "severity", "layer", "message"], rows, caption=caption, class_="findings")


def bullets(lines: Sequence[str], class_: str = "diagnosis") -> Html:
    return tag("ul", *(tag("li", line) for line in lines), class_=class_) if lines else Html("")


def figure_with_table(chart: Html, caption: str, numbers: Html, stacked: bool = False) -> Html:
    """A chart, its caption (the text alternative a reader sees), and beside it the table it
    summarises (below it where the page is narrow, or always with `stacked`: a wide table)."""
    return tag(
        "div",
        tag("figure", chart, tag("figcaption", caption)),
        tag("div", numbers, class_="numbers"),
        class_="pair stacked" if stacked else "pair",
    )


def section(title: str, *children: object, anchor: str | None = None, level: int = 2) -> Html:
    return tag("section", tag(f"h{level}", title), *children, id=anchor)


def facts(items: Sequence[tuple[str, object]]) -> Html:
    """A definition list of what a report says about its inputs; empty values left out."""
    return tag(
        "dl",
        *(join(tag("dt", k), tag("dd", v)) for k, v in items if v not in (None, "", [], ())),
        class_="facts",
    )


def counts_line(parts: Sequence[tuple[int, str]]) -> Html:
    """'3 errors · 1 warning' with each count coloured by its severity."""
    shown = []
    for n, word in parts:
        shown.append(tag("span", f"{n} {word if n == 1 else word + 's'}", class_=f"count sev-{word}" if n else "count"))
    return tag("p", *_interleave(shown, Html(" &middot; ")), class_="counts")


def _interleave(items: list[Html], separator: Html) -> list[Html]:
    out: list[Html] = []
    for i, item in enumerate(items):
        if i:
            out.append(separator)
        out.append(item)
    return out


def anchor_for(kind: str, index: int) -> str:
    """An id for the index-th thing of a kind: never derived from a name in the file."""
    return f"{kind}-{index}"


# --- the document -------------------------------------------------------------------------

# the severity colours as CSS variables, then the sheet itself
_CSS = (
    ":root{--fg:#1d2330;--muted:#5b6472;--line:#d9dde3;--bg:#ffffff;--soft:#f5f6f8;"
    + ";".join(f"--{name}:{colour}" for name, colour in SEVERITY_COLOURS.items())
    + "}"
    + """
*{box-sizing:border-box}
html{-webkit-text-size-adjust:100%}
body{margin:0;color:var(--fg);background:var(--bg);
font:15px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,"Noto Sans","DejaVu Sans",sans-serif}
main{max-width:1280px;margin:0 auto;padding:1.25rem 1.5rem 3rem}
header.top{margin-bottom:.5rem}
h1{font-size:1.45rem;margin:.2rem 0 .3rem;overflow-wrap:anywhere}
h2{font-size:1.2rem;margin:2rem 0 .6rem;padding-top:.4rem;border-top:1px solid var(--line);overflow-wrap:anywhere}
h3,h4{font-size:1.02rem;margin:1.4rem 0 .5rem;overflow-wrap:anywhere}
p{margin:.4rem 0}
a{color:#1a56b3}
.quiet{color:var(--muted)}
.counts{font-size:1.05rem;margin:.3rem 0}
.count{white-space:nowrap}
.count.sev-error{color:var(--error);font-weight:600}.count.sev-warning{color:var(--warning);font-weight:600}
.count.sev-info{color:var(--info)}
dl.facts{display:grid;grid-template-columns:max-content 1fr;gap:.1rem 1rem;margin:.5rem 0;font-size:.92rem}
dl.facts dt{color:var(--muted)}dl.facts dd{margin:0;overflow-wrap:anywhere}
.pair{display:flex;flex-wrap:wrap;gap:1rem 1.5rem;align-items:flex-start;margin:.6rem 0 1.2rem}
.pair figure{flex:1 1 560px;min-width:0;margin:0}
.pair .numbers{flex:1 1 400px;min-width:0}
.pair.stacked figure{flex-basis:100%;max-width:60rem}.pair.stacked .numbers{flex-basis:100%}
figure svg{display:block;width:100%;height:auto;max-width:calc(var(--natural) * 1.25)}
figcaption{color:var(--muted);font-size:.86rem;margin-top:.3rem}
.table{overflow-x:auto;max-width:100%}
.table.scroll{max-height:30rem;overflow-y:auto;border:1px solid var(--line);border-radius:4px}
table{border-collapse:collapse;font-size:.86rem;width:100%}
caption{text-align:left;font-weight:600;padding:.2rem 0 .35rem;color:var(--fg)}
th,td{padding:.25rem .55rem;border-bottom:1px solid var(--line);text-align:left;vertical-align:top}
thead th{position:sticky;top:0;background:var(--soft);font-weight:600;white-space:nowrap}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
td.name{font-family:ui-monospace,"SFMono-Regular",Menlo,Consolas,"DejaVu Sans Mono",monospace;font-size:.82rem;
overflow-wrap:anywhere;min-width:8rem}
td.message{min-width:16rem}
tr.flagged td:first-child{box-shadow:inset 3px 0 0 var(--error)}
tr.flagged.sev-warning td:first-child{box-shadow:inset 3px 0 0 var(--warning)}
tr.flagged.sev-info td:first-child{box-shadow:inset 3px 0 0 var(--info)}
tr.origin td{background:#fff4e5}
.badge{display:inline-block;padding:0 .45rem;border-radius:999px;font-size:.78rem;font-weight:600;
color:#fff;white-space:nowrap}
.sev-error.badge{background:var(--error)}.sev-warning.badge{background:var(--warning)}
.sev-info.badge{background:var(--info)}.sev-ok.badge{background:var(--ok)}
.verdict{font-weight:600;white-space:nowrap}
a.rule{font-weight:600;text-decoration:none}a.rule:hover{text-decoration:underline}
ul.diagnosis{padding-left:1.2rem}ul.diagnosis li{margin:.3rem 0}
ul.notes{padding-left:1.2rem;color:var(--muted);font-size:.9rem}
footer{margin-top:3rem;color:var(--muted);font-size:.82rem;border-top:1px solid var(--line);padding-top:.6rem}
@media (max-width:640px){main{padding:.8rem .7rem 2rem}body{font-size:14px}
dl.facts{grid-template-columns:1fr}dl.facts dt{margin-top:.3rem}
.pair figure,.pair .numbers{flex-basis:100%}th,td{padding:.2rem .35rem}
.pair figure{overflow-x:auto}figure svg{width:var(--natural);max-width:none}
table.findings thead{display:none}table.findings tr{display:block;border-bottom:1px solid var(--line);padding:.3rem 0}
table.findings td{display:inline-block;border:0;padding:.1rem .35rem;min-width:0}
table.findings td.message{display:block}}
@media print{body{font-size:10.5pt}main{max-width:none;padding:0}
.table.scroll{max-height:none;overflow:visible;border:0}thead th{position:static}
.pair{display:block}.pair figure{break-inside:avoid;margin-bottom:.6rem}
section{break-before:auto}h2,h3,h4{break-after:avoid}a{color:inherit;text-decoration:none}}
"""
)


def document(title: str, subtitle: Html | str, body: Sequence[Html]) -> str:
    """The whole page: one file, every style inline, no script, nothing fetched. Non-ASCII
    characters are written as character references, so the page is the same bytes whatever
    the encoding of the stream it is written to."""
    page = join(
        Html("<!DOCTYPE html>\n"),
        Html('<html lang="en">'),
        tag(
            "head",
            Html('<meta charset="utf-8">'),
            Html('<meta name="viewport" content="width=device-width, initial-scale=1">'),
            tag("meta", name="generator", content=f"bnaudit {__version__}"),
            tag("title", title),
            tag("style", Html(_CSS)),
        ),
        tag(
            "body",
            tag(
                "main",
                tag("header", tag("h1", title), subtitle, class_="top"),
                *body,
                tag(
                    "footer",
                    f"bnaudit {__version__}. Charts summarise the tables beside them; the tables hold the "
                    "numbers (each cell keeps its exact value in data-value).",
                ),
            ),
        ),
        Html("</html>\n"),
    )
    return page.encode("ascii", "xmlcharrefreplace").decode("ascii")

"""Charts as inline SVG, drawn by matplotlib's SVG backend (the `html` extra).

matplotlib is imported inside the functions that draw, never at module level: the package
`bnaudit.output` must import without numpy (tests/test_architecture.py), and a page is the
only thing that needs it. Figures are `matplotlib.figure.Figure` objects saved with
`format="svg"`: no pyplot, no global figure manager, no GUI backend chosen.

What makes the SVG fit one self-contained, reproducible page (`Charts.draw`):

- rcParams inside `rc_context` only (a program that imports bnaudit keeps its own):
  `svg.fonttype: none` writes text as <text> (selectable, searchable, a fraction of the
  size of glyph outlines), `svg.hashsalt` fixes the ids matplotlib derives from hashes, so
  the same report gives the same bytes, and `text.parse_math: False` draws a `$` in a layer
  name as a dollar sign instead of reading TeX from the file;
- metadata Date, Creator, Format and Type set to None: no timestamp and no RDF block (whose
  namespace URLs would be the page's only http strings besides xmlns);
- the XML declaration and DOCTYPE go (an inline <svg> needs neither); every id nothing refers
  to goes, and the ones referred to (clip paths, markers) get the chart's own prefix, so two
  charts of one page never share an id; the per-element font-family goes too (the page's
  font is set once on the <svg>); a <title> is the chart's text alternative.

Untrusted strings reach a chart as tick labels or annotations: they are made printable
(bnaudit.text.printable) before matplotlib sees them, and matplotlib's own XML writer
escapes them; the page inserts the result as markup (`markup.Html`).
"""

from __future__ import annotations

import importlib.util
import io
import math
import re
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from bnaudit.errors import BnauditError
from bnaudit.output.html.markup import MUTED, SEVERITY_COLOURS, Html
from bnaudit.text import printable

if TYPE_CHECKING:
    from matplotlib.axes import Axes

MISSING = "--format html draws its charts with matplotlib, which is not installed: pip install 'bnaudit[html]'"

_SVG = "http://www.w3.org/2000/svg"
_XLINK = "http://www.w3.org/1999/xlink"

# The page's sans-serif stack; matplotlib lays text out with DejaVu Sans (it ships it), which
# the stack names first so that the labels fit where matplotlib measured them.
FONT = "'DejaVu Sans', 'Noto Sans', Arial, sans-serif"

_RC: dict[str, Any] = {
    "svg.fonttype": "none",
    "text.parse_math": False,
    "font.family": "sans-serif",
    "font.sans-serif": ["DejaVu Sans"],
    "font.size": 9.0,
    "axes.titlesize": 10.0,
    "axes.titleweight": "bold",
    "axes.labelsize": 9.0,
    "axes.edgecolor": "#9aa1ab",
    "axes.linewidth": 0.8,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "axes.axisbelow": True,
    "grid.color": "#e6e8ec",
    "grid.linewidth": 0.7,
    "xtick.color": "#5b6472",
    "ytick.color": "#5b6472",
    "xtick.labelsize": 8.0,
    "ytick.labelsize": 8.0,
    "legend.fontsize": 8.0,
    "legend.frameon": False,
    "path.simplify": True,
}
_NO_METADATA = {"Date": None, "Creator": None, "Format": None, "Type": None}

# Per-channel series longer than this are drawn as the envelope (min and max) of this many
# buckets: a chart's size stays bounded whatever the channel count, and the extremes (a
# near-eps channel is a minimum) stay visible.
MAX_POINTS = 256

# The colours of a chart; severities are markup's (the table badges use the same).
COLOURS = {
    **SEVERITY_COLOURS,
    "line": "#3b6ea8",
    "fill": "#b9cde4",
    "second": "#7a4fa3",
    "muted": MUTED,
    "threshold": "#c62828",
    "eps": "#444b55",
}


def require() -> None:
    """Raise the one-line error naming the extra where matplotlib is not installed (before
    any work: a gap measurement should not run for minutes to fail at its page)."""
    if importlib.util.find_spec("matplotlib") is None:
        raise BnauditError(MISSING)


class Charts:
    """The charts of one page: numbered, so that each gets its own ids."""

    def __init__(self) -> None:
        self.count = 0

    def draw(self, alt: str, width: float, height: float, paint: Callable[..., None], *args: Any) -> Html:
        """An inline <svg> of the figure `paint(figure, *args)` draws on a `width` x `height`
        inch canvas; `alt` is its text alternative (<title>)."""
        try:
            import matplotlib
            from matplotlib.figure import Figure
        except ImportError:
            raise BnauditError(MISSING) from None
        self.count += 1
        prefix = f"c{self.count}"
        settings: Any = {**_RC, "svg.hashsalt": f"bnaudit-{prefix}"}  # rc_context types its keys
        with matplotlib.rc_context(settings):
            figure = Figure(figsize=(width, height), layout="constrained")
            # more room at the edges than matplotlib's default: a browser's DejaVu Sans may set
            # a label a few percent wider than matplotlib measured it
            figure.get_layout_engine().set(w_pad=0.08, h_pad=0.06)  # type: ignore[call-arg, union-attr]
            paint(figure, *args)
            buffer = io.StringIO()
            figure.savefig(buffer, format="svg", metadata=_NO_METADATA)
        return inline_svg(buffer.getvalue(), alt, prefix)


_URL_REF = re.compile(r"url\(#([^)]+)\)")
_FONT_FAMILY = re.compile(r"font-family:[^;\"]*;?\s*")


_COORDINATE = re.compile(r"(-?\d+\.\d)\d+")


def _rounded(path: str) -> str:
    """A path's coordinates to a tenth of a point (matplotlib writes six decimals): a tenth
    of a point is below a screen pixel at any zoom a page is read at, and it halves the
    bytes of a chart of many points. Truncated, not rounded: the error stays under 0.1."""
    return _COORDINATE.sub(r"\1", path)


def inline_svg(document: str, alt: str, prefix: str) -> Html:
    """matplotlib's SVG document as an element of a page (see the module docstring)."""
    ET.register_namespace("", _SVG)
    ET.register_namespace("xlink", _XLINK)
    root = ET.fromstring(document)  # no DTD is fetched: expat resolves no external entity
    href = f"{{{_XLINK}}}href"
    referenced: set[str] = set()
    for element in root.iter():
        for key, value in element.attrib.items():
            referenced.update(_URL_REF.findall(value))
            if key in (href, "href") and value.startswith("#"):
                referenced.add(value[1:])
    for element in root.iter():
        attrib = element.attrib
        if "id" in attrib:
            if attrib["id"] in referenced:
                attrib["id"] = f"{prefix}-{attrib['id']}"
            else:
                del attrib["id"]
        for key, value in list(attrib.items()):
            if "url(#" in value:
                attrib[key] = _URL_REF.sub(lambda m: f"url(#{prefix}-{m.group(1)})", value)
            elif key in (href, "href") and value.startswith("#"):
                attrib[key] = f"#{prefix}-{value[1:]}"
        for key in ("d", "x", "y"):
            if key in attrib:
                attrib[key] = _rounded(attrib[key])
        if element.tag != f"{{{_SVG}}}text" and element.text is not None and not element.text.strip():
            element.text = None  # matplotlib's indentation: a tenth of the bytes
        if element.tail is not None and not element.tail.strip():
            element.tail = None
        style = attrib.get("style")
        if style and "font-family" in style:
            attrib["style"] = _FONT_FAMILY.sub("", style).strip().rstrip(";")
    for size in ("width", "height"):
        root.attrib.pop(size, None)  # the page sizes it (width 100%), the viewBox keeps its shape
    natural = float(root.get("viewBox", "0 0 600 0").split()[2])
    root.set("role", "img")
    root.set("aria-labelledby", f"{prefix}-title")
    # --natural: the width at which its text is as large as drawn; a narrow screen shows the
    # chart at that width and scrolls it sideways rather than shrinking its labels to dust
    root.set("style", f"font-family: {FONT}; --natural: {natural * 1.1:.0f}px")
    title = ET.Element(f"{{{_SVG}}}title", {"id": f"{prefix}-title"})
    title.text = printable(alt)
    root.insert(0, title)
    return Html(ET.tostring(root, encoding="unicode"))


# --- drawing helpers ------------------------------------------------------------------------


# Chart widths in inches: a chart beside its table, and a chart of one column per layer (the
# full width of the page from a dozen layers on; a few layers keep readable columns narrower).
BESIDE = 6.6
WIDE = 8.2


def strip_width(columns: int) -> float:
    return BESIDE if columns <= 12 else WIDE


def label(name: str) -> str:
    """An untrusted name as a chart may show it: printable, one line."""
    return printable(name)


def segments(
    ax: Axes, xs: Sequence[float], lows: Sequence[float], highs: Sequence[float], colours: Sequence[str], width: float
) -> None:
    """A vertical segment from low to high at each x, in its colour: one path per colour
    (segments joined with gaps), where a LineCollection would write one element per segment."""
    by_colour: dict[str, tuple[list[float], list[float]]] = {}
    for x, low, high, colour in zip(xs, lows, highs, colours):
        if low != low or high != high:  # NaN: nothing to draw
            continue
        px, py = by_colour.setdefault(colour, ([], []))
        px += [x, x, math.nan]
        py += [low, high, math.nan]
    for colour, (px, py) in by_colour.items():
        ax.plot(px, py, color=colour, linewidth=width, solid_capstyle="butt")


def marks(ax: Axes, xs: Sequence[float], ys: Sequence[float], colours: Sequence[str], marker: str = "o") -> None:
    """A mark at each (x, y) (a median on its min-max segment, the tip of a lollipop), one
    artist per colour: a marker of a fixed size where the layers are few, and, where they
    are many, a horizontal stroke one layer wide drawn as one path (a marker is one SVG
    element per point)."""
    many = len(xs) > 80
    by_colour: dict[str, tuple[list[float], list[float]]] = {}
    for x, y, colour in zip(xs, ys, colours):
        if y != y:
            continue
        px, py = by_colour.setdefault(colour, ([], []))
        px += [x - 0.5, x + 0.5, math.nan] if many else [x]
        py += [y, y, math.nan] if many else [y]
    for colour, (px, py) in by_colour.items():
        if many:
            ax.plot(px, py, color=colour, linewidth=1.2, solid_capstyle="butt")
        else:
            ax.plot(
                px,
                py,
                color=colour,
                linestyle="none",
                marker=marker,
                markersize=5 if marker == "o" else 8,
                markeredgewidth=1.8,
            )


def buckets(count: int, limit: int = MAX_POINTS) -> int:
    """How many consecutive channels one drawn point stands for (1 up to `limit` channels)."""
    return max(1, math.ceil(count / limit))


def channel_series(ax: Axes, values: Sequence[float], colour: str, floor: float, label_text: str) -> None:
    """Every channel's value on a log axis, as one step line (or, past MAX_POINTS channels,
    the min-max envelope of buckets of channels). Values at or below `floor` (a zero variance,
    which a log axis cannot show) are drawn at `floor`; NaN and Inf are left out."""
    n = len(values)
    per = buckets(n)
    shown = [max(v, floor) if math.isfinite(v) else math.nan for v in values]
    if per == 1:
        ax.plot(range(n), shown, drawstyle="steps-mid", color=colour, linewidth=1.0, label=label_text)
        return
    xs, lows, highs = [], [], []
    for start in range(0, n, per):
        chunk = [v for v in shown[start : start + per] if v == v]
        xs.append(start + (min(per, n - start) - 1) / 2)
        lows.append(min(chunk) if chunk else math.nan)
        highs.append(max(chunk) if chunk else math.nan)
    ax.fill_between(xs, lows, highs, color=colour, alpha=0.35, linewidth=0, step="mid")
    ax.plot(xs, lows, drawstyle="steps-mid", color=colour, linewidth=0.8, label=f"{label_text} (min-max of {per})")


def layer_axis(ax: Axes, names: Sequence[str], limit: int = 24) -> None:
    """The x axis of a per-layer chart: layer positions 1..n, named when there are few."""
    n = len(names)
    ax.set_xlim(-0.6, n - 0.4)
    if n <= limit:
        ax.set_xticks(range(n), [short(name, 22) for name in names], rotation=35, ha="right")
    else:
        ax.set_xlabel("BN layer (#, in file order)")
        ax.xaxis.set_major_formatter(_one_based())
    ax.grid(axis="x", visible=False)


def _one_based() -> Any:
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda x, _pos: f"{int(x) + 1}" if float(x).is_integer() else "")


def short(name: str, width: int) -> str:
    """A printable name cut in its middle to `width` characters (the table has it whole)."""
    shown = label(name)
    if len(shown) <= width:
        return shown
    keep = width - 1
    return shown[: keep // 2] + "…" + shown[len(shown) - (keep - keep // 2) :]


def threshold(ax: Axes, y: float, text: str, colour: str = COLOURS["threshold"], style: Any = "--") -> None:
    """A horizontal reference line with its meaning in the legend."""
    ax.axhline(y, color=colour, linestyle=style, linewidth=1.0, label=text)


def legend(ax: Axes) -> None:
    """The axes' legend to the right of it (never over the data)."""
    handles, _ = ax.get_legend_handles_labels()
    if handles:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def log_axis(ax: Axes, which: str = "y") -> None:
    """A log scale whose labels are plain numbers ("1e-05", "0.01", "100"): matplotlib's
    default log labels are TeX, which `text.parse_math: False` (set for the names a chart
    shows) would print as TeX source. Call it once the data is drawn: an axis spanning less
    than a decade stays linear, one of less than two gets ticks at 1, 2 and 5 of each, a
    wider one a tick per decade and no minor ticks (each is two artists to lay out and draw,
    the bulk of a chart's time)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

    axis = ax.yaxis if which == "y" else ax.xaxis
    (ax.set_yscale if which == "y" else ax.set_xscale)("log")
    ax.autoscale_view()  # the limits of the log scale, not those autoscaled for a linear one
    low, high = ax.get_ylim() if which == "y" else ax.get_xlim()
    if low > 0 and high / low < 10:  # within a decade a log axis has no tick to label: linear reads the same
        (ax.set_yscale if which == "y" else ax.set_xscale)("linear")
        return
    narrow = low > 0 and high / low < 100
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0) if narrow else (1.0,), numticks=8))
    axis.set_minor_locator(NullLocator())
    axis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))


def level(ax: Axes, values: Sequence[float], text: str, colour: str, style: Any) -> None:
    """A per-layer reference level (eps, a limit): one line when every layer has the same,
    else a short dash at each layer."""
    if len(set(values)) <= 1:
        if values:
            ax.axhline(values[0], color=colour, linestyle=style, linewidth=1.0, label=text)
        return
    xs = range(len(values))
    ax.hlines(
        values,
        [x - 0.45 for x in xs],
        [x + 0.45 for x in xs],
        colors=colour,
        linestyles=style,
        linewidth=1.0,
        label=text,
    )

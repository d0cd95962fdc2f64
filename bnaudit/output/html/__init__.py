"""`--format html`: one self-contained page per report, its charts drawn by matplotlib.

    markup.py    escaped text, tables that keep every number exactly, the page and its style
    charts.py    matplotlib figures as inline SVG (the `html` extra; imported when drawing)
    inspect.py   inspect_to_html      diff.py     diff_to_html       fold.py  fold_to_html
    measure.py   gap_to_html, recalibrate_to_html (the measurements on data)

Each renderer takes a report record and returns the page as a string; `bnaudit.output.emit`
writes it like any text format (EMITTERS names one renderer per report kind: a new kind's
page is a module with one such function and one line there). A page fetches nothing:
styles are inline, charts are inline SVG, no script runs, and links to the rule pages are
plain hyperlinks. Importing this package imports neither matplotlib nor numpy.
"""

from bnaudit.output.html.charts import MISSING, require

__all__ = ["MISSING", "require"]

"""--format html: one self-contained page per report, whose tables hold the JSON report's numbers.

Each page is read back with html.parser (tests/html_page.py): the numbers of its tables
(every cell keeps its exact value in data-value) against the JSON report of the same run,
one chart per picture the page promises with its text alternative, every finding and
flagged layer present, nothing the browser would fetch, hostile names escaped exactly once.
Rendering in a real browser is tests/test_html_browser.py (slow tier).
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, SAMPLES
from html_page import Node, parse, resource_urls, same_number, table_rows, value
from typer.testing import CliRunner

from bnaudit.cli import app
from bnaudit.output.html.charts import MISSING
from bnaudit.output.html.inspect import MAX_EXPANDED
from bnaudit.text import printable

pytest.importorskip("matplotlib")

INSPECTED = [
    f"{SAMPLES}/{name}" for name in ("dead_channel.safetensors", "reset_stats.pt", "immature.pt", "healthy.pt")
]
VAL = f"{SAMPLES}/data/digits_val.safetensors"
CALIB = f"{SAMPLES}/data/digits_calib.safetensors"
ARCH = f"{SAMPLES}/digits_net.py:digits_net"


def run(*args: str, code: int | None = None):
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "120", "NO_COLOR": "1"})
    if code is not None:
        assert result.exit_code == code, result.output
    return result


def both(*args: str) -> tuple[Node, str, dict]:
    """The html page (parsed, and its text) and the JSON document of the same command."""
    page = run(*args, "--format", "html").stdout
    document = json.loads(run(*args, "--format", "json").stdout)
    return parse(page), page, document


def rows_by(table: Node, key: str = "data-layer") -> tuple[list[str], dict[str, list[Node]]]:
    headers, _ = table_rows(table)
    rows = {tr.attrs[key]: tr.find_all("td") for tr in table.find("tbody").find_all("tr")}
    return headers, rows


def column(headers: list[str], name: str) -> int:
    return headers.index(name)


@pytest.fixture(scope="module")
def inspect_pages():
    return both("inspect", *INSPECTED, "--exit-zero")


# ----------------------------------------------------------------------------- inspect


def check_inspect_numbers(root: Node, document: dict) -> int:
    """Every layer row of every file against the JSON report; the count of numbers compared."""
    fields = {
        "C": lambda j: j["num_features"],
        "batches": lambda j: j["num_batches_tracked"],
        "eps": lambda j: j["eps"],
        "momentum": lambda j: j["momentum"],
        "mean min": lambda j: j["mean"]["min"],
        "mean max": lambda j: j["mean"]["max"],
        "var min": lambda j: j["var"]["min"],
        "var median": lambda j: j["var"]["median"],
        "var max": lambda j: j["var"]["max"],
        "near-eps": lambda j: j["near_eps_channels"],
        "max gain": lambda j: j["max_eval_gain"],
    }
    compared = 0
    for index, file in enumerate(document["files"], 1):
        section = root.find("section", id=f"file-{index}")
        headers, rows = rows_by(section.find("table", cls="layers"))
        assert list(rows) == [printable(layer["name"]) for layer in file["layers"]]
        for layer in file["layers"]:
            cells = rows[printable(layer["name"])]
            for header, field in fields.items():
                assert same_number(value(cells[column(headers, header)]), field(layer)), (layer["name"], header)
                compared += 1
            assert cells[column(headers, "status")].text() == layer["status"]
    return compared


def test_inspect_layer_tables_hold_the_json_numbers(inspect_pages):
    root, _, document = inspect_pages
    assert check_inspect_numbers(root, document) == 11 * 12  # four files of three layers


def test_inspect_shows_every_finding_with_its_rule_page_and_expands_every_flagged_layer(inspect_pages):
    root, _, document = inspect_pages
    for index, file in enumerate(document["files"], 1):
        section = root.find("section", id=f"file-{index}")
        # the file's findings table: the first of its section (a flagged layer's own come after)
        tables = section.find_all("table", cls="findings")
        shown = [
            (tr.attrs["data-code"], tr.attrs["data-layer"], tr.find_all("td")[3].text())
            for tr in (tables[0].find_all("tr", cls="finding") if file["findings"] else [])
        ]
        expected = [(f["code"], printable(f["layer"] or ""), printable(f["message"])) for f in file["findings"]]
        assert Counter(shown) == Counter(expected)
        for link in section.find_all("a", cls="rule"):
            code = link.text()
            assert link.attrs["href"].endswith(f"/docs/rules/{code}.md")
            assert os.path.exists(os.path.join(REPO, "docs", "rules", f"{code}.md"))
        flagged = {printable(layer["name"]) for layer in file["layers"] if layer["status"] != "ok"}
        flagged |= {printable(layer["name"]) for layer in file["layers"] if layer["near_eps_channels"]}
        expanded = section.find_all("div", cls="expanded")
        assert {div.find("h4").text().split(" ", 1)[1].rsplit(" ", 1)[0] for div in expanded} == flagged
        for div in expanded:  # each drawn channel by channel, with its table of channels
            assert len(div.find_all("svg")) == 1 and div.find("table", cls="channels")


def test_inspect_draws_one_strip_per_file_and_one_chart_per_flagged_layer(inspect_pages):
    root, _, document = inspect_pages
    for index, file in enumerate(document["files"], 1):
        section = root.find("section", id=f"file-{index}")
        flagged = sum(1 for layer in file["layers"] if layer["status"] != "ok" or layer["near_eps_channels"])
        assert len(section.find_all("svg")) == 1 + flagged
    for figure in root.find_all("figure"):
        (svg,) = figure.find_all("svg")
        assert svg.attrs["role"] == "img"
        title = svg.find("title")
        assert svg.attrs["aria-labelledby"] == title.attrs["id"] and title.text().strip()
        assert figure.find("figcaption").text().strip()
        assert figure.parent is not None and figure.parent.find("table")  # the numbers beside it


def test_the_channel_table_holds_each_channels_stored_variance_and_eval_gain(inspect_pages):
    # an independent computation: the file read with safetensors, the gain in numpy float64
    from safetensors.numpy import load_file

    root, _, _ = inspect_pages
    tensors = load_file(f"{SAMPLES}/dead_channel.safetensors")
    var = tensors["features.4.running_var"].astype(np.float64)
    gain = np.abs(tensors["features.4.weight"].astype(np.float64)) / np.sqrt(var + 1e-5)
    (div,) = [d for d in root.find("section", id="file-1").find_all("div", cls="expanded") if "features.4" in d.text()]
    rows = div.find("table", cls="channels").find("tbody").find_all("tr")
    for tr in rows:
        c = int(tr.attrs["data-channel"])
        cells = tr.find_all("td")
        assert value(cells[1]) == pytest.approx(var[c], rel=1e-12)
        assert value(cells[2]) == pytest.approx(gain[c], rel=1e-12)
    near = [tr for tr in rows if tr.find_all("td")[3].text() == "near eps"]
    assert [int(tr.attrs["data-channel"]) for tr in near] == [c for c in range(len(var)) if var[c] < 10 * 1e-5]


def test_keeping_the_channels_changes_no_summary_and_no_json():
    from bnaudit import output
    from bnaudit.api import inspect

    kept, plain = (inspect(INSPECTED, channels=flag) for flag in (True, False))
    assert all(s.channels is not None for f in kept.files for s in f.layers)
    assert all(s.channels is None for f in plain.files for s in f.layers)
    assert [f.layers for f in kept.files] == [f.layers for f in plain.files]
    assert output.emitter(kept, "json")(kept) == output.emitter(plain, "json")(plain)


# ----------------------------------------------------------------------------- diff, fold


def test_diff_layer_table_holds_the_json_numbers_and_verdicts():
    root, _, document = both("diff", f"{SAMPLES}/pretrained.safetensors", f"{SAMPLES}/finetuned.pt", "--exit-zero")
    check_diff(root, document)


def check_diff(root: Node, document: dict) -> None:
    headers, rows = rows_by(root.find("table", cls="layers"))
    fields = {
        "C": lambda j: j["num_features"],
        "Δweight": lambda j: j["weight_change"],
        "Δbias": lambda j: j["bias_change"],
        "max shift": lambda j: j["max_mean_shift"],
        "max var log-ratio": lambda j: j["max_var_log_ratio"],
        "batches A": lambda j: j["num_batches_tracked"]["a"],
        "batches B": lambda j: j["num_batches_tracked"]["b"],
        "Δbatches": lambda j: j["num_batches_tracked"]["change"],
        "eps A": lambda j: j["eps"]["a"],
        "eps B": lambda j: j["eps"]["b"],
        "momentum A": lambda j: j["momentum"]["a"],
        "momentum B": lambda j: j["momentum"]["b"],
    }
    assert list(rows) == [layer["name"] for layer in document["layers"]]
    for layer in document["layers"]:
        cells = rows[layer["name"]]
        for header, field in fields.items():
            assert same_number(value(cells[column(headers, header)]), field(layer)), (layer["name"], header)
        assert cells[column(headers, "verdict")].text() == layer["verdict"]
        ratio = value(cells[column(headers, "var ratio")])
        assert ratio == pytest.approx(math.exp(layer["max_var_log_ratio"]))
    assert len(root.find_all("svg")) == 1
    shown = {(tr.attrs["data-code"], tr.attrs["data-layer"]) for tr in root.find_all("tr", cls="finding")}
    assert shown == {(f["code"], f["layer"] or "") for f in document["findings"]}


def test_fold_pairs_table_holds_the_json_numbers_and_each_hazardous_pair_is_drawn():
    root, _, document = both("fold", f"{SAMPLES}/inception_channel.safetensors", "--exit-zero")
    assert check_fold(root, document) == 1


def check_fold(root: Node, document: dict) -> int:
    """The pairs table against the JSON report, each hazardous pair drawn; how many are."""
    headers, rows = rows_by(root.find("table", cls="layers"))
    assert list(rows) == [p["bn"] for p in document["pairs"]]
    for p in document["pairs"]:
        cells = rows[p["bn"]]
        int8 = p["int8_per_tensor"]
        # none where every folded weight is 0 (timm zero-initialises the last gamma of a block)
        setter = int8["scale_set_by"] or dict.fromkeys(("channel", "running_var", "gamma", "gain"))
        expected = {
            "C": p["channels"],
            "int8 scale": int8["scale"],
            "collapsed": len(int8["collapsed_channels"]),
            "coarse": len(int8["coarse_channels"]),
            "scale set by": setter["channel"],
            "its var": setter["running_var"],
            "its gamma": setter["gamma"],
            "its gain": setter["gain"],
            "int8/C collapsed": len(p["int8_per_channel"]["collapsed_channels"]),
            "fp16 overflow": len(p["fp16"]["overflow_channels"]),
            "fp16 flush": len(p["fp16"]["flush_channels"]),
            "fp16 cancel.": len(p["fp16"]["cancellation_channels"]),
            "bf16 cancel.": len(p["bf16"]["cancellation_channels"]),
            "drop": p["measured_drop"],
        }
        for header, number in expected.items():
            assert same_number(value(cells[column(headers, header)]), number), (p["bn"], header)
    hazardous = [
        p
        for p in document["pairs"]
        if p["int8_per_tensor"]["collapsed_channels"]
        or p["int8_per_tensor"]["coarse_channels"]
        or any(p["fp16"].values())
        or p["bf16"]["cancellation_channels"]
    ]
    expanded = root.find_all("div", cls="expanded")
    assert [d.find("h4").text().split(" ")[1] for d in expanded] == [p["bn"] for p in hazardous]
    assert len(root.find_all("svg")) == 1 + len(hazardous)
    for div, p in zip(expanded, hazardous):
        lists = {tr.find_all("td")[0].text(): tr.find_all("td")[2].text() for tr in div.find_all("tr")[1:]}
        assert lists["int8 coarse"].startswith(", ".join(map(str, p["int8_per_tensor"]["coarse_channels"][:3])))
        assert lists["bf16 cancellation"].startswith(", ".join(map(str, p["bf16"]["cancellation_channels"][:3])))
    return len(hazardous)


# ----------------------------------------------------------------------------- measurements


@pytest.fixture(scope="module")
def gap_pages():
    return both("gap", f"{SAMPLES}/immature.pt", "--arch", ARCH, "--data", VAL, "--num-samples", "200")


def test_gap_drift_table_holds_the_json_numbers_in_forward_order_with_the_origin_marked(gap_pages):
    root, _, document = gap_pages
    check_gap_drift(root, document)
    assert [tr.attrs["data-layer"] for tr in root.find_all("tr", cls="origin")]


def check_gap_drift(root: Node, document: dict) -> None:
    headers, rows = rows_by(root.find("table", cls="layers"))
    ordered = sorted(document["layers"], key=lambda d: d["position"])
    assert list(rows) == [d["name"] for d in ordered]
    for d in ordered:
        cells = rows[d["name"]]
        expected = {
            "#": d["position"],
            "C": d["channels"],
            "values/ch": d["values"],
            "mean shift": d["mean_shift"],
            "max shift": d["max_mean_shift"],
            "var log-ratio": d["var_log_ratio"],
            "drift": d["drift"],
            "worst ch drift": d["peak"],
            "worst ch": d["worst_channels"][0]["index"] if d["worst_channels"] else None,
        }
        for header, number in expected.items():
            assert same_number(value(cells[column(headers, header)]), number), (d["name"], header)
    origins = [tr.attrs["data-layer"] for tr in root.find_all("tr", cls="origin")]
    assert origins == [d["name"] for d in ordered if d["origin"]]


def test_gap_shows_both_modes_with_their_intervals_and_the_gap(gap_pages):
    root, _, document = gap_pages
    modes = {tr.attrs["data-mode"]: tr.find_all("td") for tr in root.find_all("tr") if "data-mode" in tr.attrs}
    for mode, key in (("train", "train_mode"), ("eval", "eval_mode")):
        assert value(modes[mode][2]) == document[key]["accuracy"]
        interval = document[f"{key}_interval"]
        assert [value(modes[mode][3]), value(modes[mode][4])] == interval
    measures = {
        tr.attrs["data-measure"]: tr.find_all("td")[1] for tr in root.find_all("tr") if "data-measure" in tr.attrs
    }
    assert value(measures["gap"]) == document["gap"]
    assert [value(measures["gap 95% CI low"]), value(measures["gap 95% CI high"])] == document["gap_interval"]
    assert value(measures["agreement"]) == document["agreement"]
    assert len(root.find_all("svg")) == 2  # the two modes, the drift per layer
    shown = {(tr.attrs["data-code"], tr.attrs["data-layer"]) for tr in root.find_all("tr", cls="finding")}
    assert shown == {(f["code"], f["layer"] or "") for f in document["findings"]}
    assert [li.text() for li in root.find("ul", cls="diagnosis").find_all("li")] == document["diagnosis"]


def test_recalibrate_page_holds_the_old_and_new_drift_and_the_held_out_accuracies(tmp_path):
    args = ["recalibrate", f"{SAMPLES}/reset_stats.pt", "--arch", ARCH, "--data", CALIB, "--eval-data", VAL]
    args += ["--num-samples", "200", "--force"]
    run(*args, "-o", str(tmp_path / "a.pt"), "--format", "html", "--report", str(tmp_path / "r.html"), code=0)
    document = json.loads(run(*args, "-o", str(tmp_path / "b.pt"), "--format", "json", code=0).stdout)
    root = parse((tmp_path / "r.html").read_text())
    headers, rows = rows_by(root.find("table", cls="layers"))
    for c in document["layers"]:
        cells = rows[c["name"]]
        for header, number in (
            ("mean shift old", c["before"]["mean_shift"]),
            ("mean shift new", c["after"]["mean_shift"]),
            ("var log-ratio old", c["before"]["var_log_ratio"]),
            ("var log-ratio new", c["after"]["var_log_ratio"]),
            ("values/ch", c["values"]),
        ):
            assert same_number(value(cells[column(headers, header)]), number), (c["name"], header)
    sides = {tr.attrs["data-side"]: tr.find_all("td") for tr in root.find_all("tr") if "data-side" in tr.attrs}
    assert value(sides["old"][1]) == document["eval"]["before"]["eval_mode"]["accuracy"]
    assert value(sides["new"][1]) == document["eval"]["after"]["eval_mode"]["accuracy"]
    assert len(root.find_all("svg")) == 2


def test_recalibrate_refuses_a_report_file_that_is_its_checkpoint_output(tmp_path):
    out = str(tmp_path / "new.pt")
    result = run(
        "recalibrate", f"{SAMPLES}/reset_stats.pt", "--arch", ARCH, "--data", CALIB, "-o", out, "--report", out, code=2
    )
    assert "--report names another output of this run" in result.output and not os.path.exists(out)


def test_invariance_page_holds_each_arrangements_numbers():
    root, _, document = both(
        "invariance", f"{SAMPLES}/traced_train.pt", "--data", VAL, "--batch-sizes", "1,8", "--num-samples", "64"
    )
    headers, rows = rows_by(root.find("table", cls="arrangements"), "data-arrangement")
    for a in document["arrangements"]:
        cells = rows[a["name"]]
        for header, number in (
            ("batches", a["batches"]),
            ("max deviation", a["max_deviation"]),
            ("coupled", a["coupled_samples"]),
            ("accuracy", a["accuracy"]),
        ):
            assert same_number(value(cells[column(headers, header)]), number), (a["name"], header)
    assert len(root.find_all("svg")) == 1


# ----------------------------------------------------------------------------- the page itself


@pytest.fixture(scope="module")
def every_page(inspect_pages, gap_pages):
    pages = {"inspect": inspect_pages[1], "gap": gap_pages[1]}
    pages["diff"] = run("diff", f"{SAMPLES}/pretrained.safetensors", f"{SAMPLES}/finetuned.pt", "-f", "html").stdout
    pages["fold"] = run("fold", f"{SAMPLES}/inception_channel.safetensors", "-f", "html").stdout
    return pages


def test_no_page_loads_anything_or_runs_a_script(every_page):
    for kind, page in every_page.items():
        root = parse(page)
        assert resource_urls(root, page) == [u for u in resource_urls(root, page) if u.startswith("#")], kind
        assert not root.find_all("script") and not root.find_all("link") and not root.find_all("img"), kind
        assert not root.find_all("iframe") and not root.find_all("object") and not root.find_all("embed"), kind
        assert not any(k.startswith("on") for n in root.iter() for k in n.attrs), kind  # no event handlers
        # the only http(s) strings: SVG's namespace names and the rule pages' hyperlinks
        links = [a.attrs["href"] for a in root.find_all("a") if a.attrs.get("href", "").startswith("http")]
        namespaces = [v for n in root.iter() for k, v in n.attrs.items() if k.startswith("xmlns")]
        assert page.count("http") == len(links) + len(namespaces), kind
        assert page.isascii(), kind  # written as character references: any stream encoding carries it
        assert root.find("style").text().count("@media print") == 1, kind


def test_a_page_is_the_same_bytes_on_every_run(every_page):
    again = run("diff", f"{SAMPLES}/pretrained.safetensors", f"{SAMPLES}/finetuned.pt", "-f", "html").stdout
    assert again == every_page["diff"]


HOSTILE = [
    "<script>alert(1)</script>",
    "q\"uo'te&amp;",
    "rtl\u202egnp.exe",
    "esc\x1b]0;owned\x07",
    "tex$\\mathdefault{x}$",
    "<!--x-->",
    "lone\udc80",
]


@pytest.fixture(scope="module")
def hostile_page(tmp_path_factory):
    import torch
    from conftest import bn_entries

    state = {}
    for i, name in enumerate(HOSTILE):
        state.update(bn_entries(name, 4, var=torch.tensor([1e-8, 0.5, 0.7, 0.9]) if i % 2 else None))
    path = tmp_path_factory.mktemp("hostile") / "hostile.pt"
    torch.save(state, path)
    return run("inspect", str(path), "--format", "html", code=1).stdout


def test_hostile_names_are_escaped_exactly_once_and_stay_inert(hostile_page):
    page = hostile_page
    root = parse(page)
    assert not root.find_all("script")
    assert "<script>alert" not in page and "<!--x" not in page
    assert "&amp;lt;" not in page and "&amp;amp;lt" not in page  # nothing escaped twice
    for bad in ("\x1b", "\x07", "\u202e", "\udc80"):
        assert bad not in page
    rows = root.find("table", cls="layers").find("tbody").find_all("tr")
    assert [tr.attrs["data-layer"] for tr in rows] == [printable(name) for name in HOSTILE]
    assert [tr.find_all("td")[1].text() for tr in rows] == [printable(name) for name in HOSTILE]
    # chart labels too: names as text of the SVG, once escaped, TeX not read
    labels = {t.text() for svg in root.find_all("svg") for t in svg.find_all("text")}
    assert any(t.startswith("<script>al") for t in labels) and not any("&lt;" in t for t in labels)
    assert any("$\\mathdefault{x}$" in t for t in labels)
    headings = [div.find("h4").text() for div in root.find_all("div", cls="expanded")]
    for name in HOSTILE[1::2]:  # the layers given a dead channel: flagged, expanded under their name
        assert sum(printable(name) in h for h in headings) == 1, name


# ----------------------------------------------------------------------------- the file, the extra


def test_output_writes_the_page_atomically_and_never_over_an_input_or_without_force(tmp_path):
    page = tmp_path / "report.html"
    run("inspect", INSPECTED[0], "-f", "html", "-o", str(page), code=1)
    assert page.read_text() == run("inspect", INSPECTED[0], "-f", "html", code=1).stdout
    again = run("inspect", INSPECTED[0], "-f", "html", "-o", str(page), code=2)
    assert "already exists (pass --force to overwrite)" in again.output
    run("inspect", INSPECTED[1], "-f", "html", "-o", str(page), "--force", code=1)
    assert "reset_stats.pt" in page.read_text()
    copy = tmp_path / "model.safetensors"
    original = Path(INSPECTED[0]).read_bytes()
    copy.write_bytes(original)
    refused = run("inspect", str(copy), "-f", "html", "-o", str(copy), "--force", code=2)
    assert "is the input checkpoint" in refused.output
    assert copy.read_bytes() == original
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors", "report.html"]  # no temporary left


def test_without_matplotlib_html_is_one_line_naming_the_extra_before_any_work(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails, find_spec says absent
    for args in (
        ("inspect", INSPECTED[0]),
        ("diff", f"{SAMPLES}/pretrained.safetensors", f"{SAMPLES}/finetuned.pt"),
        ("fold", f"{SAMPLES}/inception_channel.safetensors"),
        ("gap", f"{SAMPLES}/immature.pt", "--arch", ARCH, "--data", VAL),
    ):
        result = run(*args, "--format", "html", "-o", str(tmp_path / "r.html"), code=2)
        assert result.stderr == f"bnaudit: error: {MISSING}\n" and result.stdout == ""
        assert "bnaudit[html]" in MISSING
    assert os.listdir(tmp_path) == []


def test_every_format_a_command_offers_has_an_emitter_for_its_report():
    # a command's --format choices and bnaudit.output.EMITTERS agree: html is offered exactly
    # where a page exists (merge and fed have none), never as an internal error after the work
    import typing

    from bnaudit import output

    checked = []
    for command in app.registered_commands:
        name = command.name or command.callback.__name__
        hint = typing.get_type_hints(command.callback, include_extras=True).get("output_format")
        if hint is None:
            continue
        offered = {member.value for member in typing.get_args(hint)[0]}
        emitters = set(output.EMITTERS[name]) - {"record"}  # each command's report kind is its name
        assert offered == emitters, (name, offered ^ emitters)
        checked.append(name)
    assert {"inspect", "diff", "fold", "gap", "invariance", "recalibrate"} <= set(checked)


# ----------------------------------------------------------------------------- parity


@pytest.mark.slow  # two real parity runs (eager, a compiled target, the float64 floor)
def test_parity_layer_table_holds_the_json_numbers_and_marks_the_first_divergent_layer():
    backend = f"compile:{SAMPLES}/faulty_backend.py:faulty"  # changes one layer's eps
    arch = f"{SAMPLES}/digits_net.py:digits_net"
    data = f"{SAMPLES}/data/digits_val.safetensors"
    root, page, document = both(
        "parity", f"{SAMPLES}/healthy.pt", "--arch", arch, "--data", data, "--against", backend, "--exit-zero"
    )
    headers, rows = rows_by(root.find("table", cls="layers"))
    assert list(rows) == [layer["name"] for layer in document["layers"]]  # execution order
    for layer in document["layers"]:
        cells = rows[layer["name"]]
        for header in ("floor", "relative", "ratio"):
            assert same_number(value(cells[column(headers, header)]), layer[header]), (layer["name"], header)
        assert same_number(value(cells[column(headers, "max |Δ|")]), layer["max_abs"])
        assert cells[column(headers, "verdict")].text() == ("diverges" if layer["diverges"] else "within")
    first = document["first_divergent"]
    assert first is not None and f"first divergent layer: {first}" in page
    assert len(root.find_all("svg")) == 1 and all(u.startswith("#") for u in resource_urls(root, page))
    shown = {(tr.attrs["data-code"], tr.attrs["data-layer"]) for tr in root.find_all("tr", cls="finding")}
    assert shown == {(f["code"], f["layer"] or "") for f in document["findings"]}


# ----------------------------------------------------------------------------- large models


def many_layers(path, layers: int = 500, channels: int = 2048, every: int = 50) -> str:
    """`layers` BN layers of `channels`, one in `every` with three dead channels (BN004)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    tensors = {}
    for i in range(layers):
        var = rng.lognormal(-1.0, 0.6, channels).astype(np.float32)
        if i % every == 7 % every:
            var[rng.choice(channels, 3, replace=False)] = 1e-7
        tensors[f"blocks.{i}.bn.weight"] = rng.normal(1.0, 0.1, channels).astype(np.float32)
        tensors[f"blocks.{i}.bn.bias"] = rng.normal(0.0, 0.1, channels).astype(np.float32)
        tensors[f"blocks.{i}.bn.running_mean"] = rng.normal(0.0, 0.3, channels).astype(np.float32)
        tensors[f"blocks.{i}.bn.running_var"] = var
        tensors[f"blocks.{i}.bn.num_batches_tracked"] = np.array(20000, np.int64)
    save_file(tensors, str(path))
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("every", [50, 1], ids=["ten flagged", "all flagged"])
def test_a_page_of_500_layers_of_2048_channels_stays_a_few_mib(tmp_path, every):
    path = many_layers(tmp_path / "many.safetensors", every=every)
    page = run("inspect", path, "--format", "html", "--exit-zero", code=0).stdout
    size = len(page.encode())
    assert size < 5 * 2**20, size  # bytes: deterministic (the same page on every run)
    root = parse(page)
    flagged = 500 // every
    assert len(root.find("table", cls="layers").find("tbody").find_all("tr")) == 500
    assert len(root.find_all("div", cls="expanded")) == min(flagged, MAX_EXPANDED)
    assert len(root.find_all("svg")) == 1 + min(flagged, MAX_EXPANDED)
    findings = root.find("section", id="file-1").find("table", cls="findings").find("tbody").find_all("tr")
    assert len(findings) == flagged  # every finding listed, drawn or not


# ----------------------------------------------------------------------------- a real model


@pytest.mark.slow
def test_a_timm_resnet18_with_statistics_from_a_few_forward_passes_gets_every_page(tmp_path):
    # a real architecture (timm's resnet18, random weights, nothing downloaded): three
    # training-mode passes leave young statistics (BN003 everywhere), ten more move them
    import torch
    from conftest import save_safetensors
    from timm_support import import_timm

    timm = import_timm()
    torch.manual_seed(0)
    model = timm.create_model("resnet18", num_classes=10).train()
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(8, 3, 32, 32))
    young = save_safetensors(model.state_dict(), tmp_path / "young.safetensors")
    with torch.no_grad():
        for _ in range(10):
            model(torch.randn(8, 3, 32, 32) * 1.5 + 0.2)
    older = save_safetensors(model.state_dict(), tmp_path / "older.safetensors")

    root, _, document = both("inspect", young, "--exit-zero")
    layers = document["files"][0]["layers"]
    assert len(layers) == 20 and check_inspect_numbers(root, document) == 11 * 20
    flagged = sum(1 for layer in layers if layer["status"] != "ok" or layer["near_eps_channels"])
    assert flagged and len(root.find_all("svg")) == 1 + min(flagged, MAX_EXPANDED)
    assert "initial weight" in root.find("svg").text()  # young: the maturity panel is drawn

    root, _, document = both("diff", young, older, "--exit-zero")
    check_diff(root, document)
    assert {layer["verdict"] for layer in document["layers"]} == {"frozen but updating"}

    root, _, document = both("fold", older, "--exit-zero")
    assert len(document["pairs"]) == 20
    assert len(root.find_all("svg")) == 1 + check_fold(root, document)

    arch = tmp_path / "resnet.py"
    arch.write_text(
        f"import sys\nsys.path.insert(0, {os.path.dirname(__file__)!r})\n"
        "from timm_support import import_timm\n\n\n"
        "def resnet18():\n    return import_timm().create_model('resnet18', num_classes=10)\n"
    )
    from safetensors.torch import save_file

    data = tmp_path / "data.safetensors"
    save_file({"inputs": torch.randn(48, 3, 32, 32), "labels": torch.randint(0, 10, (48,))}, str(data))
    root, _, document = both("gap", older, "--arch", f"{arch}:resnet18", "--data", str(data), "--batch-size", "16")
    check_gap_drift(root, document)
    assert len(root.find_all("svg")) == 2

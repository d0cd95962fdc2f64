"""Result records of an audit and their renderers (rich table, JSON).

The records are plain data a notebook can use; only the `render_*` functions know
about rich or JSON. Per-layer statistics (defined once, here):

  mean range      [min_c running_mean_c, max_c running_mean_c]
  var min/median/max  over channels of running_var
  near-eps        number of channels with 0 <= running_var_c < near_eps_factor * eps
  max eval gain   max_c |gamma_c| / sqrt(running_var_c + eps)   (gamma = 1 without affine)

NaN channels are left out of min/median/max (BN005 reports them); a value that is
still non-finite is written as null in JSON.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from bnaudit import __version__
from bnaudit.config import SEVERITIES, Config, severity_rank
from bnaudit.layers import BNLayer
from bnaudit.rules import Finding, eval_gain, near_eps_channels


@dataclass(frozen=True)
class LayerSummary:
    name: str
    kind: str
    num_features: int
    num_batches_tracked: int | None
    eps: float
    momentum: float | None
    stats_dtype: str
    mean_min: float | None
    mean_max: float | None
    var_min: float | None
    var_median: float | None
    var_max: float | None
    near_eps_channels: int
    max_eval_gain: float | None

    @classmethod
    def of(cls, layer: BNLayer, near_eps_factor: float) -> LayerSummary:
        mean, var, gains = map(_numbers, (layer.running_mean, layer.running_var, eval_gain(layer)))
        ordered = sorted(var)
        return cls(
            name=layer.name,
            kind=layer.kind,
            num_features=layer.num_features,
            num_batches_tracked=layer.num_batches_tracked,
            eps=layer.eps,
            momentum=layer.momentum,
            stats_dtype=layer.stats_dtype,
            mean_min=min(mean, default=None),
            mean_max=max(mean, default=None),
            var_min=ordered[0] if ordered else None,
            var_median=_median(ordered) if ordered else None,
            var_max=ordered[-1] if ordered else None,
            near_eps_channels=len(near_eps_channels(layer, near_eps_factor)),
            max_eval_gain=max(gains, default=None),
        )


def _numbers(values: list[float]) -> list[float]:
    """The values without NaN (one C-speed sum tells whether there is any)."""
    total = sum(values)
    return values if total == total else [v for v in values if v == v]  # v != v: NaN


def _median(ordered: list[float]) -> float:
    """The middle value of sorted values, or the mean of the two middle ones (as numpy.median)."""
    half = len(ordered) // 2
    return ordered[half] if len(ordered) % 2 else (ordered[half - 1] + ordered[half]) / 2


@dataclass
class FileReport:
    path: str
    format: str | None = None
    key: str | None = None
    other_keys: list[str] = field(default_factory=list)
    prefix: str = ""
    is_ema: bool = False
    settings: str = ""
    provenance: str = ""
    layers: list[LayerSummary] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    error: str | None = None

    def layer_status(self, name: str) -> str:
        severities = [f.severity for f in self.findings if f.layer == name]
        return max(severities, key=severity_rank) if severities else "ok"


@dataclass
class InspectReport:
    files: list[FileReport]
    config: Config

    @property
    def findings(self) -> list[Finding]:
        return [f for file in self.files for f in file.findings]

    def summary(self) -> dict[str, int]:
        counts = {s: sum(1 for f in self.findings if f.severity == s) for s in SEVERITIES}
        return {
            "files": len(self.files),
            "layers": sum(len(f.layers) for f in self.files),
            "errors": counts["error"],
            "warnings": counts["warning"],
            "infos": counts["info"],
            "unreadable": sum(1 for f in self.files if f.error),
        }

    def exit_code(self, fail_on: str | None = None) -> int:
        """2 if a file could not be read, 1 if a finding is at or above fail_on, else 0."""
        if any(f.error for f in self.files):
            return 2
        threshold = severity_rank(fail_on or self.config.fail_on)
        return 1 if any(severity_rank(f.severity) >= threshold for f in self.findings) else 0


# ----------------------------------------------------------------------------- JSON


def json_number(x: Any) -> Any:
    """Strict JSON: NaN and +-Inf become null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def finding_to_json(f: Finding) -> dict:
    return {"code": f.code, "name": f.name, "severity": f.severity, "layer": f.layer,
            "message": f.message, "channels": list(f.channels)}


def inspect_to_json(report: InspectReport) -> dict:
    files = []
    for file in report.files:
        files.append({
            "path": file.path,
            "format": file.format,
            "key": file.key,
            "other_keys": file.other_keys,
            "prefix": file.prefix or None,
            "settings": file.settings or None,
            "provenance": file.provenance or None,
            "layers": [{
                "name": s.name,
                "kind": s.kind,
                "num_features": s.num_features,
                "num_batches_tracked": s.num_batches_tracked,
                "eps": json_number(s.eps),
                "momentum": json_number(s.momentum),
                "dtype": s.stats_dtype,
                "mean": {"min": json_number(s.mean_min), "max": json_number(s.mean_max)},
                "var": {"min": json_number(s.var_min), "median": json_number(s.var_median),
                        "max": json_number(s.var_max)},
                "near_eps_channels": s.near_eps_channels,
                "max_eval_gain": json_number(s.max_eval_gain),
                "status": file.layer_status(s.name),
            } for s in file.layers],
            "findings": [finding_to_json(f) for f in file.findings],
            "error": file.error,
        })
    return {"version": __version__, "config": report.config.as_dict(), "files": files,
            "summary": report.summary()}


# ----------------------------------------------------------------------------- rich

SEVERITY_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan", "ok": "green"}

# C0/C1 controls, DEL, the bidi overrides that can reorder what a reader sees, and lone
# surrogates (bytes of a non-UTF-8 file name, which a UTF-8 stdout refuses to encode).
_UNPRINTABLE = "[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\ud800-\udfff]"


def printable(text: str) -> str:
    """`text` with control characters written as escapes (ESC -> \\x1b).

    Layer names, keys and messages come from the checkpoint: printed raw, an
    escape sequence in a name could recolour, retitle or rewrite the terminal.
    """
    if text.isascii() and text.isprintable():  # nearly every name: no 1 ms regex compile per run
        return text
    return re.sub(_UNPRINTABLE, lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100
                  else f"\\u{ord(m.group()):04x}", text)


def _cell(text: str, style: str = "") -> Any:
    """A table cell that shows `text` as is: plain strings would be parsed as rich markup."""
    from rich.text import Text

    return Text(printable(text), style=style)


def _g(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.3g}" if math.isfinite(x) else str(x)


def _layer_table(file: FileReport, console: Any) -> Any:
    """One row per layer, with the most columns that fit the terminal: numbers are
    never folded across lines, the least telling columns go first."""
    c = ("C", lambda s: str(s.num_features))
    batches = ("batches", lambda s: "-" if s.num_batches_tracked is None else str(s.num_batches_tracked))
    mean = ("mean range", lambda s: f"[{_g(s.mean_min)}, {_g(s.mean_max)}]")
    var = ("var min / med / max", lambda s: f"{_g(s.var_min)} / {_g(s.var_median)} / {_g(s.var_max)}")
    var_min = ("var min", lambda s: _g(s.var_min))
    near = ("near-eps", lambda s: str(s.near_eps_channels))
    gain = ("max gain", lambda s: _g(s.max_eval_gain))
    layouts = ([c, batches, mean, var, near, gain], [c, batches, var, near, gain], [c, var_min, near, gain])
    longest = max(len(s.name) for s in file.layers)
    statuses = {s.name: file.layer_status(s.name) for s in file.layers}
    for columns in layouts:
        cells = [[cell(s) for s in file.layers] for _, cell in columns]
        needed = min(longest, 24) + max(6, *map(len, statuses.values())) + 3 * (len(columns) + 1)
        needed += sum(max(len(header), *map(len, col)) for (header, _), col in zip(columns, cells))
        if needed <= console.width:
            break
    headers = ["layer", *(header for header, _ in columns), "status"]
    rows = [[printable(s.name), *(printable(cell(s)) for _, cell in columns), statuses[s.name]] for s in file.layers]
    grid = _grid(headers, rows, console, min(longest, 24))
    if grid is not None:
        return grid
    from rich.table import Table  # here: with its fractions and decimal, 5 ms of start-up
    from rich.text import Text

    table = Table(show_edge=False, pad_edge=False, header_style="bold")
    table.add_column("layer", overflow="fold", min_width=min(longest, 24))
    for header in headers[1:-1]:
        table.add_column(header, justify="right", no_wrap=True)
    table.add_column("status", no_wrap=True)
    for row in rows:
        # Text: "[inf, inf]" or a name from the file would otherwise parse as rich markup
        table.add_row(*map(Text, row[:-1]), Text(row[-1], style=SEVERITY_STYLE[row[-1]]))
    return table


def _grid(headers: list[str], rows: list[list[str]], console: Any, min_first: int) -> Any:
    """The layer table exactly as the rich.Table of `_layer_table` draws it, as one Text.

    rich measures and renders every cell on its own, about 70 us a cell: 38 ms for
    ResNet-50's 53 rows, half of what a pre-commit run may take. The layer table is
    a fixed grid (first column folded, numbers right-justified, status last), so it
    is laid out here; tests/test_report.py compares both, styles included. None where
    rich would have to shrink more than the first column (a very narrow terminal).
    """
    from rich.cells import cell_len
    from rich.text import Text

    widths = [max(cell_len(header), *(cell_len(row[i]) for row in rows)) for i, header in enumerate(headers)]
    rest = sum(widths[1:]) + 3 * (len(headers) - 1)
    first = min(widths[0], console.width - rest)
    if first < max(min_first, cell_len(headers[0])):
        return None
    widths[0] = first
    last = len(widths) - 1
    out = Text()

    # Segment for segment what rich emits: a header cell and the spaces beside its bars
    # carry the header style, a body cell its own (status) style, the bars none.
    def line(cells: list[str], bar: str, pad_style: str, styles: list[str]) -> None:
        if len(out):
            out.append("\n")
        for i, (cell, width, style) in enumerate(zip(cells, widths, styles)):
            if i:
                out.append(" ", pad_style)
                out.append(bar)
                out.append(" ", pad_style)
            pad = " " * (width - cell_len(cell))
            out.append(pad + cell if 0 < i < last else cell + pad, style)

    line(headers, "┃", "bold", ["bold"] * len(headers))
    out.append("\n" + "╇".join("━" * (w + (1 if i in (0, last) else 2)) for i, w in enumerate(widths)))
    plain = [""] * last
    for row in rows:
        name = [row[0]]
        if cell_len(row[0]) > first:
            name = [part.plain for part in Text(row[0]).wrap(console, first, overflow="fold")]
        line([name[0], *row[1:]], "│", "", [*plain, SEVERITY_STYLE[row[-1]]])
        for part in name[1:]:
            line([part, *[""] * last], "│", "", [*plain, ""])
    return out


def render_inspect(report: InspectReport, console: Any, quiet: bool = False) -> None:
    from rich.text import Text

    for file in report.files:
        if file.error:
            console.print(_cell(f"{file.path}: error: {file.error}", style="bold red"), soft_wrap=True)
            continue
        if quiet:
            continue
        title = _cell(file.path, style="bold")
        where = f"{file.format}" + (f", key '{file.key}'" if file.key else "")
        if file.prefix:
            where += f", prefix '{file.prefix}' stripped"
        title.append(printable(f"  ({where})"), style="dim")
        console.print(title)
        if file.other_keys:
            console.print(_cell(f"  other state dicts: {', '.join(file.other_keys)} (choose with --key)", style="dim"))
        if file.settings:
            console.print(_cell(f"  {file.settings}", style="dim"))
        if file.provenance:
            console.print(_cell(f"  {file.provenance}", style="dim"))
        if file.layers:
            console.print(_layer_table(file, console))
        else:
            console.print(Text("  no BatchNorm layers found", style="dim"))
        if file.findings:
            from rich.table import Table

            findings = Table(show_edge=False, pad_edge=False, header_style="bold")
            for col in ("code", "severity", "layer", "message"):
                findings.add_column(col, overflow="fold")
            for f in file.findings:
                findings.add_row(f"{f.code} {f.name}", Text(f.severity, style=SEVERITY_STYLE[f.severity]),
                                 _cell(f.layer or "-"), _cell(f.message))
            console.print(findings)
        console.print()
    s = report.summary()
    line = (f"{s['files']} file(s), {s['layers']} BN layer(s): {s['errors']} error(s), "
            f"{s['warnings']} warning(s), {s['infos']} info(s)")
    if s["unreadable"]:
        line += f", {s['unreadable']} unreadable file(s)"
    worst = "error" if s["errors"] or s["unreadable"] else "warning" if s["warnings"] else "ok"
    console.print(Text(line, style=SEVERITY_STYLE[worst]), soft_wrap=True)


# ----------------------------------------------------------------------------- gap

# The gap report itself (`GapReport`, `LayerDrift`) lives in bnaudit.gap with the
# definitions of every number; these functions only render it.


def gap_to_json(report: Any) -> dict:
    """The `bnaudit gap --format json` document (accuracies as fractions, null without labels)."""
    return {
        "version": __version__,
        "checkpoint": report.checkpoint,
        "model": report.model,
        "data": report.data,
        "samples": report.samples,
        "batch_size": report.batch_size,
        "batches": report.batches,
        "seed": report.seed,
        "shuffle": report.shuffle,
        "device": report.device,
        "skipped": report.skipped,
        "train_mode": {"accuracy": json_number(report.train_accuracy),
                       "non_finite_outputs": report.non_finite.get("train_mode", 0)},
        "eval_mode": {"accuracy": json_number(report.eval_accuracy),
                      "non_finite_outputs": report.non_finite.get("eval_mode", 0)},
        "gap": json_number(report.gap),
        "agreement": json_number(report.agreement),
        "divergence": json_number(report.divergence),
        "divergence_kind": report.divergence_kind,
        "layers": [{
            "name": d.name,
            "position": d.position,
            "kind": d.kind,
            "channels": d.channels,
            "values": d.values,
            "mean_shift": json_number(d.mean_shift),
            "max_mean_shift": json_number(d.max_mean_shift),
            "var_log_ratio": json_number(d.var_log_ratio),
            "drift": json_number(d.drift),
            "note": d.note,
        } for d in report.layers],
        "findings": [finding_to_json(f) for f in report.findings],
        "diagnosis": list(report.diagnosis),
    }


def _percent(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.1f}%"


def _f2(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}" if abs(x) < 10 else f"{x:.1f}"


def render_gap(report: Any, console: Any, quiet: bool = False) -> None:
    """Rich rendering: header, the two modes, per-layer drift (worst first), findings, diagnosis."""
    from rich.table import Table
    from rich.text import Text

    title = Text(report.checkpoint, style="bold")
    title.append(f"  ({report.model})", style="dim")
    console.print(title)
    console.print(Text(f"data: {report.data}", style="dim"))
    order = f"shuffled with seed {report.seed}" if report.shuffle else "file order, --no-shuffle"
    skipped = f", {report.skipped} unreadable image(s) skipped" if report.skipped else ""
    console.print(f"{report.samples} samples in {report.batches} batches of {report.batch_size} "
                  f"({order}), device {report.device}{skipped}")
    console.print()

    modes = Table(show_edge=False, pad_edge=False, header_style="bold")
    modes.add_column("mode")
    modes.add_column("BatchNorm normalises with")
    modes.add_column("accuracy", justify="right")
    modes.add_row("train", "batch statistics", _percent(report.train_accuracy))
    modes.add_row("eval", "running statistics", _percent(report.eval_accuracy))
    console.print(modes)
    parts = []
    if report.gap is not None:
        style = "bold red" if report.gap > 0.01 else "green"
        parts.append(Text(f"gap {report.gap * 100:+.1f} points", style=style))
    if report.agreement is not None:
        parts.append(Text(f"agreement {_percent(report.agreement)}"))
    if report.divergence is not None:
        kind = "KL(eval || train)" if report.divergence_kind == "kl" else "relative L2"
        parts.append(Text(f"divergence {report.divergence:.4g} ({kind})"))
    if parts:
        console.print(Text("  ·  ").join(parts))
    console.print()

    if report.layers and not quiet:
        table = Table(title="per-layer drift: eval-mode inputs against running statistics, worst first",
                      title_justify="left", title_style="bold", show_edge=False, pad_edge=False,
                      header_style="bold")
        for col, justify in (("layer", "left"), ("#", "right"), ("kind", "left"), ("C", "right"),
                             ("mean shift", "right"), ("max shift", "right"), ("var log-ratio", "right"),
                             ("drift", "right")):
            table.add_column(col, justify=justify, overflow="fold")
        worst = report.layers[0] if report.layers and report.layers[0].drift is not None else None
        for d in report.layers:
            if d.drift is None:
                style = "dim"
            elif d is worst and d.large:
                style = "bold red"
            elif d.large:
                style = "yellow"
            else:
                style = ""
            table.add_row(d.name, str(d.position + 1), d.kind, str(d.channels), _f2(d.mean_shift),
                          _f2(d.max_mean_shift), _f2(d.var_log_ratio),
                          _f2(d.drift) if d.drift is not None else (d.note or "-"), style=style)
        console.print(table)
        console.print()

    if report.findings:
        findings = Table(title="inspect findings for this checkpoint", title_justify="left", title_style="bold",
                         show_edge=False, pad_edge=False, header_style="bold")
        for col in ("code", "severity", "layer", "message"):
            findings.add_column(col, overflow="fold")
        for f in report.findings:
            findings.add_row(f"{f.code} {f.name}", Text(f.severity, style=SEVERITY_STYLE[f.severity]),
                             f.layer or "-", f.message)
        console.print(findings)
        console.print()

    console.print(Text("diagnosis", style="bold"))
    # A grid keeps wrapped lines indented under their bullet.
    bullets = Table.grid(padding=(0, 1))
    bullets.add_column(width=3, justify="right")
    bullets.add_column()
    for line in report.diagnosis:
        bullets.add_row("-", Text(line))
    console.print(bullets)


# ----------------------------------------------------------------------------- recalibrate

# The records (`RecalibrationReport`, `LayerChange`) live in bnaudit.recalibrate (`Drift` in
# bnaudit.stats) with the definitions of every number; these functions only render them.


def _drift_to_json(d: Any) -> dict:
    return {"mean_shift": json_number(d.mean_shift), "max_mean_shift": json_number(d.max_mean_shift),
            "var_log_ratio": json_number(d.var_log_ratio)}


def recalibrate_to_json(report: Any) -> dict:
    """The `bnaudit recalibrate --format json` document."""
    evaluation = None
    if report.eval_before is not None and report.eval_after is not None:
        evaluation = {"before": gap_to_json(report.eval_before), "after": gap_to_json(report.eval_after)}
    return {
        "version": __version__,
        "input": report.input,
        "output": report.output,
        "format": report.format,
        "key": report.key,
        "model": report.model,
        "data": report.data,
        "method": report.method,
        "samples": report.samples,
        "batches": report.batches,
        "batch_size": report.batch_size,
        "seed": report.seed,
        "shuffle": report.shuffle,
        "device": report.device,
        "world_size": report.world_size,
        "layers": [{
            "name": c.name,
            "channels": c.channels,
            "values": c.values,
            "batches": c.batches,
            "before": _drift_to_json(c.before),
            "after": _drift_to_json(c.after),
        } for c in report.layers],
        "skipped": [{"name": s.name, "reason": s.reason} for s in report.skipped],
        "warnings": list(report.warnings),
        "provenance": dict(report.provenance),
        "eval": evaluation,
    }


def _arrow(before: float | None, after: float | None) -> Any:
    from rich.text import Text

    text = Text(_f2(before), style="yellow" if before is not None and before >= 0.5 else "")
    text.append(" -> ", style="dim")
    text.append(_f2(after), style="yellow" if after is not None and after >= 0.5 else "green")
    return text


def render_recalibrate(report: Any, console: Any, quiet: bool = False) -> None:
    """Rich rendering: what was written, the per-layer before/after drift, skipped
    layers, and with --eval-data the two gap reports side by side."""
    from rich.table import Table
    from rich.text import Text

    title = Text(report.input, style="bold")
    title.append(" -> ", style="dim")
    title.append(report.output, style="bold green")
    title.append(f"  ({report.format}" + (f", key '{report.key}'" if report.key else "") + ")", style="dim")
    console.print(title)
    console.print(Text(f"model: {report.model}", style="dim"))
    console.print(Text(f"data: {report.data}", style="dim"))
    order = f"shuffled with seed {report.seed}" if report.shuffle else "file order (--no-shuffle)"
    ranks = f" on {report.world_size} ranks" if report.world_size > 1 else ""
    console.print(f"method {report.method}: {report.samples} samples in {report.batches} batches of "
                  f"{report.batch_size} ({order}), device {report.device}{ranks}")
    console.print()

    if not quiet:
        table = Table(title="per-layer drift against the calibration data: old -> new statistics",
                      title_justify="left", title_style="bold", show_edge=False, pad_edge=False,
                      header_style="bold")
        for col, justify in (("layer", "left"), ("C", "right"), ("values/ch", "right"),
                             ("mean shift", "right"), ("max shift", "right"), ("var log-ratio", "right")):
            table.add_column(col, justify=justify, overflow="fold")
        for c in report.layers:
            table.add_row(c.name, str(c.channels), str(c.values),
                          _arrow(c.before.mean_shift, c.after.mean_shift),
                          _arrow(c.before.max_mean_shift, c.after.max_mean_shift),
                          _arrow(c.before.var_log_ratio, c.after.var_log_ratio))
        console.print(table)
        console.print()
    if report.skipped:
        console.print(Text(f"{len(report.skipped)} layer(s) kept their statistics:", style="bold"))
        for s in report.skipped:
            console.print(Text(f"  {s.name}: {s.reason}", style="dim"))
        console.print()

    before, after = report.eval_before, report.eval_after
    if before is not None and after is not None:
        console.print(Text(f"held-out data: {after.data}", style="dim"))
        table = Table(title="gap on the held-out data: old -> new checkpoint",
                      title_justify="left", title_style="bold", show_edge=False, pad_edge=False,
                      header_style="bold")
        for col, justify in (("", "left"), ("old", "right"), ("new", "right")):
            table.add_column(col, justify=justify)
        table.add_row("eval-mode accuracy", _percent(before.eval_accuracy), _percent(after.eval_accuracy))
        table.add_row("train-mode accuracy", _percent(before.train_accuracy), _percent(after.train_accuracy))
        table.add_row("gap (points)", "-" if before.gap is None else f"{before.gap * 100:+.1f}",
                      "-" if after.gap is None else f"{after.gap * 100:+.1f}")
        table.add_row("agreement", _percent(before.agreement), _percent(after.agreement))
        kind = "KL(eval || train)" if after.divergence_kind == "kl" else "relative L2"
        table.add_row(f"divergence ({kind})", "-" if before.divergence is None else f"{before.divergence:.3g}",
                      "-" if after.divergence is None else f"{after.divergence:.3g}")
        console.print(table)
        console.print()
    console.print(Text(f"wrote {report.output}: {len(report.layers)} layer(s) recalibrated", style="green"))

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

import numpy as np

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
        def stat(fn, values: np.ndarray) -> float | None:
            finite = values[~np.isnan(values)]
            return float(fn(finite)) if finite.size else None

        gains = eval_gain(layer)
        return cls(
            name=layer.name,
            kind=layer.kind,
            num_features=layer.num_features,
            num_batches_tracked=layer.num_batches_tracked,
            eps=layer.eps,
            momentum=layer.momentum,
            stats_dtype=layer.stats_dtype,
            mean_min=stat(np.min, layer.running_mean),
            mean_max=stat(np.max, layer.running_mean),
            var_min=stat(np.min, layer.running_var),
            var_median=stat(np.median, layer.running_var),
            var_max=stat(np.max, layer.running_var),
            near_eps_channels=int(near_eps_channels(layer, near_eps_factor).size),
            max_eval_gain=stat(np.max, gains),
        )


@dataclass
class FileReport:
    path: str
    format: str | None = None
    key: str | None = None
    other_keys: list[str] = field(default_factory=list)
    prefix: str = ""
    is_ema: bool = False
    settings: str = ""
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
_UNPRINTABLE_RE = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def printable(text: str) -> str:
    """`text` with control characters written as escapes (ESC -> \\x1b).

    Layer names, keys and messages come from the checkpoint: printed raw, an
    escape sequence in a name could recolour, retitle or rewrite the terminal.
    """
    return _UNPRINTABLE_RE.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100
                               else f"\\u{ord(m.group()):04x}", text)


def _cell(text: str, style: str = "") -> Any:
    """A table cell that shows `text` as is: plain strings would be parsed as rich markup."""
    from rich.text import Text

    return Text(printable(text), style=style)


def _g(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.3g}" if math.isfinite(x) else str(x)


def render_inspect(report: InspectReport, console: Any, quiet: bool = False) -> None:
    from rich.table import Table
    from rich.text import Text

    for file in report.files:
        if file.error:
            console.print(_cell(f"{file.path}: error: {file.error}", style="bold red"))
            continue
        if not quiet:
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
            if file.layers:
                table = Table(show_edge=False, pad_edge=False, header_style="bold")
                for col, justify in (("layer", "left"), ("C", "right"), ("batches", "right"),
                                     ("mean range", "right"), ("var min / median / max", "right"),
                                     ("near-eps", "right"), ("max gain", "right"), ("status", "left")):
                    table.add_column(col, justify=justify, overflow="fold")
                for s in file.layers:
                    status = file.layer_status(s.name)
                    table.add_row(
                        _cell(s.name), str(s.num_features),
                        "-" if s.num_batches_tracked is None else str(s.num_batches_tracked),
                        _cell(f"[{_g(s.mean_min)}, {_g(s.mean_max)}]"),  # "[inf, inf]" would parse as markup
                        f"{_g(s.var_min)} / {_g(s.var_median)} / {_g(s.var_max)}",
                        str(s.near_eps_channels), _g(s.max_eval_gain),
                        Text(status, style=SEVERITY_STYLE[status]),
                    )
                console.print(table)
            else:
                console.print(Text("  no BatchNorm layers found", style="dim"))
        if file.findings:
            findings = Table(show_edge=False, pad_edge=False, header_style="bold")
            for col in ("code", "severity", "layer", "message"):
                findings.add_column(col, overflow="fold")
            for f in file.findings:
                findings.add_row(f"{f.code} {f.name}", Text(f.severity, style=SEVERITY_STYLE[f.severity]),
                                 _cell(f.layer or "-"), _cell(f.message))
            if quiet:
                console.print(_cell(file.path, style="bold"))
            console.print(findings)
        if not quiet:
            console.print()
    s = report.summary()
    line = (f"{s['files']} file(s), {s['layers']} BN layer(s): {s['errors']} error(s), "
            f"{s['warnings']} warning(s), {s['infos']} info(s)")
    if s["unreadable"]:
        line += f", {s['unreadable']} unreadable file(s)"
    worst = "error" if s["errors"] or s["unreadable"] else "warning" if s["warnings"] else "ok"
    console.print(Text(line, style=SEVERITY_STYLE[worst]))

"""Thresholds and switches of an audit: defaults, `[tool.bnaudit]` discovery, CLI overrides.

Precedence, lowest first: the defaults of `Config`, the nearest configuration file, the
command line. The configuration file is found as ruff finds its own, from the current
directory upward; in each folder

  bnaudit.toml     keys at the top level; wins when both files are in the same folder
                   (a dedicated file is the more specific statement, as ruff.toml beats
                   pyproject.toml)
  pyproject.toml   keys under `[tool.bnaudit]`; a pyproject.toml without that table is
                   passed over and the search goes on upward

and the first folder holding either ends the search. `--config PATH` names a file
instead (a file called pyproject.toml is read at `[tool.bnaudit]`, any other at the top
level); `--isolated` reads none. Every key and value is checked: an unknown key or a bad
value is a `BnauditError` that names the key and the file.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path, PurePosixPath
from typing import Any

from bnaudit.errors import BnauditError
from bnaudit.normkinds import DEFAULT_EPS, DEFAULT_MOMENTUM
from bnaudit.severity import Severity

SEVERITIES: tuple[Severity, ...] = tuple(Severity)  # lowest first
_CONFIG_FILE = "bnaudit.toml"
_PYPROJECT = "pyproject.toml"


def severity_rank(severity: str) -> int:
    """Severity.rank of a severity or its name: 0 info, 1 warning, 2 error."""
    return Severity.parse(severity).rank


@dataclass(frozen=True)
class Config:
    """Effective settings of one run.

    near_eps_factor  BN004 fires for channels with running_var < near_eps_factor * eps
    max_gain         BN004 is a warning when some such channel's eval gain >= max_gain
    max_live_gain    BN004 is an error when a live channel's eval gain > max_live_gain
    max_init_weight  BN003 fires when (1 - momentum)^num_batches_tracked > max_init_weight
    max_implied_var_ratio   BN003 is an error when the stored running_var is this many times
                     the data's variance it implies (or 1/this), median over the channels
    max_implied_mean_shift  BN003 is an error when the stored running_mean sits this many of
                     the data's standard deviations from the mean it implies (median)
    eps, momentum    used where the file holds no modules (None: not stated, PyTorch's
                     defaults assumed; see bnaudit.audit.settings.settings_stated_by)
    select, ignore   rule-code prefixes: run only the selected rules, minus the ignored
    per_layer_ignores  layer-name glob -> rule-code prefixes not reported for those layers
    severity         rule code -> the severity every finding of that rule is reported at
    exclude          file globs not audited (see `Config.excludes`)
    expect_frozen    diff: layer-name globs that must not change (BN101 error, BN105)
    expect_trained   diff: layer-name globs whose weights must change (BN105)
    stale_max_change diff: BN102 is an error when the weight/bias change of a layer with
                     stale statistics exceeds this fraction of the layer's scale max|gamma|
    max_cancellation fold: BN206 flags a channel whose half-precision cancellation bound
                     |running_mean| * u / sqrt(var + eps) exceeds this (u: the format's unit roundoff)
    source           the configuration file these settings came from (None: none)
    from_file        the fields whose value the configuration file set (the others are
                     defaults, or given on the command line / by the caller)
    """

    fail_on: Severity = Severity.WARNING
    near_eps_factor: float = 10.0
    max_gain: float = 100.0
    max_init_weight: float = 0.05
    max_implied_var_ratio: float = 4.0
    max_implied_mean_shift: float = 1.0
    max_live_gain: float = 100.0
    eps: float | None = None
    momentum: float | None = None
    select: tuple[str, ...] = ()
    ignore: tuple[str, ...] = ()
    per_layer_ignores: dict[str, tuple[str, ...]] = field(default_factory=dict)
    severity: dict[str, Severity] = field(default_factory=dict)
    exclude: tuple[str, ...] = ()
    expect_frozen: tuple[str, ...] = ()
    expect_trained: tuple[str, ...] = ()
    stale_max_change: float = 0.1
    max_cancellation: float = 0.05
    source: str | None = field(default=None, compare=False)
    from_file: frozenset[str] = field(default=frozenset(), compare=False)

    def as_dict(self) -> dict[str, Any]:
        return {
            "fail-on": str(self.fail_on),
            "near-eps-factor": self.near_eps_factor,
            "max-gain": self.max_gain,
            "max-init-weight": self.max_init_weight,
            "max-implied-var-ratio": self.max_implied_var_ratio,
            "max-implied-mean-shift": self.max_implied_mean_shift,
            "max-live-gain": self.max_live_gain,
            "eps": self.eps,
            "momentum": self.momentum,
            "select": list(self.select),
            "ignore": list(self.ignore),
            "per-layer-ignores": {k: list(v) for k, v in self.per_layer_ignores.items()},
            "severity": {code: str(severity) for code, severity in self.severity.items()},
            "exclude": list(self.exclude),
            "expect-frozen": list(self.expect_frozen),
            "expect-trained": list(self.expect_trained),
            "stale-max-change": self.stale_max_change,
            "max-cancellation": self.max_cancellation,
        }

    @property
    def root(self) -> str:
        """The folder `exclude` globs are relative to: the configuration file's, else the cwd."""
        return os.path.dirname(os.path.abspath(self.source)) if self.source else os.getcwd()

    def excludes(self, path: str) -> bool:
        """Whether `exclude` removes `path` from an audit.

        A glob matches the path relative to `root` (`*` also crosses `/`, as in fnmatch),
        and a glob without `/` also matches any single component of it, so `runs` or
        `*.tmp.pt` exclude those names in every folder. Files named on the command line
        are excluded too, so a pre-commit hook, which names every staged file, honours it.
        """
        return self.exclusion(path) is not None

    def exclusion(self, path: str) -> str | None:
        """The `exclude` glob that removes `path` (see `excludes`), or None."""
        if not self.exclude:
            return None
        absolute = os.path.abspath(path)
        relative = os.path.relpath(absolute, self.root)
        if relative == ".." or relative.startswith(".." + os.sep):
            relative = absolute
        posix = PurePosixPath(*Path(relative).parts).as_posix()
        parts = posix.split("/")
        for pattern in self.exclude:
            if fnmatchcase(posix, pattern):
                return pattern
            if "/" not in pattern and any(fnmatchcase(part, pattern) for part in parts):
                return pattern
        return None


# ----------------------------------------------------------------------------- keys


@dataclass(frozen=True)
class Key:
    """One configuration key: its TOML name, the Config field it sets, its parser.

    `parse(value, rule_codes)` returns the field's value or raises ValueError with the
    problem (`rule_codes`: the registered rule codes, for keys that name rules); `doc`
    is the one line the README's configuration reference shows.
    """

    name: str
    field: str
    parse: Callable[[Any, Collection[str]], Any]
    doc: str


def _ignoring_codes(parse: Callable[[Any], Any]) -> Callable[[Any, Collection[str]], Any]:
    return lambda value, _rule_codes: parse(value)


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"expected a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {value!r}")
    return float(value)


def _positive(value: Any) -> float:
    number = _number(value)
    if number <= 0:
        raise ValueError(f"expected a positive number, got {value!r}")
    return number


def _open_fraction(value: Any) -> float:
    number = _number(value)
    if not 0 < number < 1:
        raise ValueError(f"expected a number between 0 and 1 (exclusive), got {value!r}")
    return number


def _above_one(value: Any) -> float:
    number = _number(value)
    if number <= 1:
        raise ValueError(f"expected a number above 1, got {value!r}")
    return number


def _momentum(value: Any) -> float:
    number = _number(value)
    if not 0 <= number <= 1:
        raise ValueError(f"expected a number in [0, 1], got {value!r}")
    return number


def _severity(value: Any) -> Severity:
    return Severity.parse(value)


def _strings(value: Any, what: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"expected a list of {what}, got {value!r}")
    return tuple(value)


def rule_codes(value: Any, known: Collection[str]) -> tuple[str, ...]:
    """A list of rule codes or code prefixes ("BN004", "BN00", "BN"), upper-cased.

    A prefix must select at least one of the `known` codes, so a typo cannot silently
    select or ignore nothing.
    """
    codes = tuple(code.strip().upper() for code in _strings(value, "rule codes"))
    for code in codes:
        if not code or not any(k.startswith(code) for k in known):
            raise ValueError(f"unknown rule code {code!r} (known: {', '.join(known)})")
    return codes


def _per_layer_ignores(value: Any, known: Collection[str]) -> dict[str, tuple[str, ...]]:
    if not isinstance(value, dict):
        raise ValueError(
            f'expected a table of layer globs to rule codes, e.g. {{"backbone.*" = ["BN003"]}}, got {value!r}'
        )
    parsed: dict[str, tuple[str, ...]] = {}
    for pattern, codes in value.items():
        try:
            parsed[pattern] = rule_codes(codes, known)
        except ValueError as exc:
            raise ValueError(f"{pattern!r}: {exc}") from None
    return parsed


def _severity_overrides(value: Any, known: Collection[str]) -> dict[str, Severity]:
    """`{BN004 = "error"}`: exact rule codes (a prefix would silently re-rate rules added
    later) mapped to a severity."""
    if not isinstance(value, dict):
        raise ValueError(f'expected a table of rule codes to severities, e.g. {{BN004 = "error"}}, got {value!r}')
    parsed: dict[str, Severity] = {}
    for code, severity in value.items():
        upper = code.strip().upper()
        if upper not in known:
            raise ValueError(f"unknown rule code {code!r} (known: {', '.join(known)})")
        try:
            parsed[upper] = _severity(severity)
        except ValueError as exc:
            raise ValueError(f"{code}: {exc}") from None
    return parsed


def _globs(value: Any) -> tuple[str, ...]:
    return _strings(value, "file globs")


def _layer_globs(value: Any) -> tuple[str, ...]:
    globs = _strings(value, "layer-name globs")
    if any(not g for g in globs):
        raise ValueError("an empty layer-name glob matches no layer")
    return globs


KEYS: dict[str, Key] = {
    k.name: k
    for k in (
        Key(
            "fail-on",
            "fail_on",
            _ignoring_codes(_severity),
            'exit 1 when a finding is at or above this severity: "error", "warning" or "info"',
        ),
        Key(
            "near-eps-factor",
            "near_eps_factor",
            _ignoring_codes(_positive),
            "BN004: a channel is near-eps when running_var < near-eps-factor * eps",
        ),
        Key(
            "max-gain",
            "max_gain",
            _ignoring_codes(_positive),
            "BN004: warning (not info) when a near-eps channel's eval gain |gamma|/sqrt(var+eps) reaches this",
        ),
        Key(
            "max-init-weight",
            "max_init_weight",
            _ignoring_codes(_open_fraction),
            "BN003: fires when the initial values still weigh (1-momentum)^t above this fraction",
        ),
        Key(
            "max-implied-var-ratio",
            "max_implied_var_ratio",
            _ignoring_codes(_above_one),
            "BN003: error when the stored running_var is this many times the data's variance it "
            "implies, (stored - w)/(1 - w), or 1/this (median over channels)",
        ),
        Key(
            "max-implied-mean-shift",
            "max_implied_mean_shift",
            _ignoring_codes(_positive),
            "BN003: error when the stored running_mean sits this many of the data's standard "
            "deviations from the mean it implies, stored/(1 - w) (median over channels)",
        ),
        Key(
            "max-live-gain",
            "max_live_gain",
            _ignoring_codes(_positive),
            "BN004: error when a live near-eps channel (|running_mean| >= sqrt(var+eps)) has an eval gain above this",
        ),
        Key(
            "eps",
            "eps",
            _ignoring_codes(_positive),
            f"BN eps where the file holds no modules (a state dict does not store it; default {DEFAULT_EPS:g})",
        ),
        Key(
            "momentum",
            "momentum",
            _ignoring_codes(_momentum),
            f"BN momentum where the file holds no modules (default {DEFAULT_MOMENTUM:g}; a Keras port: 0.01)",
        ),
        Key(
            "select",
            "select",
            rule_codes,
            'run only these rules (codes or prefixes, e.g. ["BN002", "BN005"]); empty: all',
        ),
        Key("ignore", "ignore", rule_codes, "never report these rules"),
        Key(
            "per-layer-ignores",
            "per_layer_ignores",
            _per_layer_ignores,
            'layer-name glob -> rules not reported for matching layers, e.g. {"backbone.*" = ["BN003"]}',
        ),
        Key(
            "severity",
            "severity",
            _severity_overrides,
            'rule code -> the severity its findings are reported at, e.g. {BN004 = "error"}',
        ),
        Key(
            "exclude",
            "exclude",
            _ignoring_codes(_globs),
            'file globs not audited, relative to the configuration file, e.g. ["runs/*", "*.tmp.pt"]',
        ),
        Key(
            "expect-frozen",
            "expect_frozen",
            _ignoring_codes(_layer_globs),
            'diff: layer-name globs that must not change, e.g. ["backbone.*"] (BN101 error, BN105)',
        ),
        Key(
            "expect-trained",
            "expect_trained",
            _ignoring_codes(_layer_globs),
            'diff: layer-name globs whose weight/bias must change, e.g. ["head.*"] (BN105)',
        ),
        Key(
            "stale-max-change",
            "stale_max_change",
            _ignoring_codes(_positive),
            "diff: BN102 is an error when weights with stale statistics moved by more than this "
            "fraction of the layer's scale max|gamma|",
        ),
        Key(
            "max-cancellation",
            "max_cancellation",
            _ignoring_codes(_positive),
            "fold: BN206 flags a channel whose fp16/bf16 cancellation bound |mean| * u / sqrt(var + eps) "
            "exceeds this (in units of the channel's standard deviation)",
        ),
    )
}


# ----------------------------------------------------------------------------- files


def _read_bytes(path: Path) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise BnauditError(f"{path}: cannot read configuration: {exc.strerror or exc}") from None


def _read_toml(path: Path, raw: bytes | None = None) -> dict[str, Any]:
    import tomllib  # here: most runs parse no TOML (docs/performance.md)

    try:
        return tomllib.loads((_read_bytes(path) if raw is None else raw).decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise BnauditError(f"{path}: invalid TOML: {exc}") from None


def _tool_table(path: Path, document: dict[str, Any]) -> dict[str, Any] | None:
    table = document.get("tool", {}).get("bnaudit") if isinstance(document.get("tool"), dict) else None
    if table is not None and not isinstance(table, dict):
        raise BnauditError(f"{path}: [tool.bnaudit] must be a table")
    return table


def _read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The raw key table of one configuration file (see the module docstring)."""
    path = Path(path)
    document = _read_toml(path)
    if path.name == _PYPROJECT:
        table = _tool_table(path, document)
        if table is None:
            raise BnauditError(f"{path}: no [tool.bnaudit] table")
        return table
    return document


def _may_hold_tool_table(raw: bytes) -> bool:
    """False when the TOML text `raw` cannot define the table tool.bnaudit: a pyproject.toml
    naming bnaudit only elsewhere (a dependency, a console script) is then neither parsed nor
    judged, and tomllib not imported. True when the word bnaudit could
    be a key of `tool`: in a dotted key or header after `tool.`, or as a key at the start of
    a line or of an inline table's entry while a `[tool]` header or `tool = {` exists. Keys
    spelled with escapes ("bn\\u0061udit") are not seen."""
    if b"bnaudit" not in raw:
        return False
    quote = rb"[\"']?"
    if re.search(rb"tool" + quote + rb"[ \t]*\.[ \t]*" + quote + rb"bnaudit", raw):
        return True  # [tool.bnaudit], [ "tool" . 'bnaudit' ], tool.bnaudit.key = ...
    tool_table = re.search(rb"^[ \t]*\[[ \t]*" + quote + rb"tool" + quote + rb"[ \t]*\]", raw, re.MULTILINE)
    tool_inline = re.search(rb"tool" + quote + rb"[ \t]*=[ \t]*\{", raw)
    bnaudit_key = re.search(rb"(?:^|[{,])[ \t]*" + quote + rb"bnaudit" + quote + rb"[ \t]*[.=]", raw, re.MULTILINE)
    return bool((tool_table or tool_inline) and bnaudit_key)


def find_config_file(start: str | os.PathLike[str] | None = None) -> tuple[Path, dict[str, Any]] | None:
    """The nearest bnaudit.toml, or pyproject.toml with [tool.bnaudit], from `start` (default:
    the current directory) upward, with its raw key table; None when there is none."""
    folder = Path(start if start is not None else os.getcwd()).resolve()
    for directory in (folder, *folder.parents):
        dedicated = directory / _CONFIG_FILE
        if dedicated.is_file():
            return dedicated, _read_config_file(dedicated)
        pyproject = directory / _PYPROJECT
        if pyproject.is_file():
            raw = _read_bytes(pyproject)
            if not _may_hold_tool_table(raw):  # not ours to parse, or to judge
                continue
            table = _tool_table(pyproject, _read_toml(pyproject, raw))
            if table is not None:
                return pyproject, table
    return None


def _where(path: Path) -> str:
    return f"{path} [tool.bnaudit]" if path.name == _PYPROJECT else str(path)


def _parse_table(table: Mapping[str, Any], where: str, rule_codes: Collection[str]) -> dict[str, Any]:
    """Check every key and value of a configuration table; Config field -> value."""
    values: dict[str, Any] = {}
    for name, value in table.items():
        key = KEYS.get(name)
        if key is None:
            raise BnauditError(f"{where}: unknown key {name!r}{_suggestion(name)} (keys: {', '.join(KEYS)})")
        try:
            values[key.field] = key.parse(value, rule_codes)
        except ValueError as exc:
            raise BnauditError(f"{where}: {name}: {exc}") from None
    return values


def _suggestion(name: str) -> str:
    if name == "tool":
        return " (bnaudit.toml holds the keys at its top level, without [tool.bnaudit])"
    close = difflib.get_close_matches(name.replace("_", "-"), KEYS, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def load_config(
    overrides: Mapping[str, Any] | None = None,
    config_file: str | os.PathLike[str] | None = None,
    start: str | os.PathLike[str] | None = None,
    isolated: bool = False,
    *,
    rule_codes: Collection[str],
) -> Config:
    """The effective Config: defaults < configuration file < `overrides` (the command line).

    `overrides` maps option names ("--fail-on", "--select", ...; the TOML key with two
    dashes) to values, None meaning not given. `select` and `ignore` combine as in ruff:
    a command-line select replaces the file's select and ignore; a command-line ignore
    adds to the file's ignore. `rule_codes` are the registered rule codes that select,
    ignore and per-layer-ignores may name (the caller's registry: configuration does not
    depend on the rules).
    """
    found: tuple[Path, dict[str, Any]] | None = None
    if config_file is not None:
        if not Path(config_file).is_file():
            raise BnauditError(f"{config_file}: configuration file not found")
        found = Path(config_file), _read_config_file(config_file)
    elif not isolated:
        found = find_config_file(start)
    source = found[0] if found else None
    values = _parse_table(found[1], _where(found[0]), rule_codes) if found else {}

    given = {option.removeprefix("--"): value for option, value in (overrides or {}).items() if value is not None}
    cli = {}
    for name, value in given.items():
        if name not in KEYS:
            raise ValueError(f"not a configuration option: --{name}")  # a bug in the caller
        try:
            cli[KEYS[name].field] = KEYS[name].parse(value, rule_codes)
        except ValueError as exc:
            raise BnauditError(f"--{name}: {exc}") from None
    from_file = frozenset(values) - frozenset(cli)
    if "select" in cli:
        values["ignore"] = ()
    if "ignore" in cli:
        cli["ignore"] = values.get("ignore", ()) + cli["ignore"]
    values.update(cli)
    return Config(**values, source=str(source) if source is not None else None, from_file=from_file)


# ----------------------------------------------------------------------------- exit codes


def exit_code_for(
    severities: Iterable[str],
    fail_on: str | None,
    *,
    failed: bool = False,
    error: bool = False,
    found_error: bool = False,
    exit_zero: bool = False,
) -> int:
    """The exit code of every command, from what its report found.

      2  `error`: an input the user named could not be read, or an option cannot be
         applied (gap's --max-gap on unlabelled data); `exit_zero` does not hide it.
         `found_error`: an input a folder scan found could not be read; 2 unless `exit_zero`
      1  a severity at or above `fail_on` (None: findings never fail the run), or `failed`:
         the command's own check failed (a gap above --max-gap, outputs coupled to their batch)
      0  otherwise, and with `exit_zero` instead of 1

    Every report's `exit_code` is this function of its findings and checks (inspect,
    diff, gap, invariance); `rules` and `recalibrate` have nothing that fails a run: 0.
    Usage errors the command line or a core function refuses never reach a report: they
    end as one line and exit 2 at the CLI's boundary. An unknown severity is a ValueError
    (the callers pass `Config.fail_on` and finding severities, both checked).
    """
    if error or (found_error and not exit_zero):
        return 2
    if exit_zero:
        return 0
    if failed:
        return 1
    if fail_on is None:
        return 0
    threshold = severity_rank(fail_on)
    return 1 if any(severity_rank(s) >= threshold for s in severities) else 0


def measurement_fail_on(config: Config | None, fail_on: str | None = None) -> str | None:
    """The severity from which the inspect findings shown with a measurement (gap,
    invariance) fail the run: `fail_on` (the command line's --fail-on), else the
    configuration file's fail-on, else None. A measurement's own check decides its exit
    code; its findings are context, so the default "warning" of an audit (inspect, diff)
    does not apply to them unless the user states it. A `fail_on` that is no severity is
    a BnauditError here, before the measurement, so that the report's exit code cannot fail.
    """
    if fail_on is not None:
        try:
            return _severity(fail_on)
        except ValueError as exc:
            raise BnauditError(f"--fail-on: {exc}") from None
    if config is not None and "fail_on" in config.from_file:
        return config.fail_on
    return None

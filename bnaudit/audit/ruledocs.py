"""Rule and configuration documentation, generated from one source.

`bnaudit rules`, the SARIF rule descriptors, the rule pages of docs/rules/ (one per
code and an index) and the configuration table of docs/configuration.md are all built
here from `rules.RULES` and `config.KEYS`, so none of them can say something the code
does not do. `tools/update_docs.py` rewrites the generated pages and blocks, and
`tests/test_docs.py` fails when they drift.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Mapping
from typing import Any

from bnaudit.audit.rules import ALIASES, RULES, Rule, rule_for
from bnaudit.config import KEYS, Config
from bnaudit.errors import BnauditError
from bnaudit.normkinds import DEFAULT_EPS, DEFAULT_MOMENTUM

_WIDTH = 88


def find_rule(code: str) -> Rule:
    """The rule `code` names, exactly or as an alias (a former code of the same fact)."""
    rule = rule_for(code)
    if rule is None:
        raise BnauditError(f"unknown rule {code!r} (known: {', '.join(RULES)})")
    return rule


def worst_severity(rule: Rule, overrides: Mapping[str, str] | None = None) -> str:
    """The highest severity a rule can report ("error / warning" -> "error"), or the one
    the configuration's `severity` table sets for it."""
    configured = rule.configured_severity(overrides or {})
    return rule.worst_severity if configured is None else configured


def shown_severity(rule: Rule, overrides: Mapping[str, str] | None = None) -> str:
    """The severity column of `bnaudit rules`: the default, or the configured one and the default."""
    configured = rule.configured_severity(overrides or {})
    return rule.severity if configured is None else f"{configured} (configured)"


def rule_rows(overrides: Mapping[str, str] | None = None) -> list[tuple[str, str, str, str]]:
    """The rows of `bnaudit rules` in code order: (code, name, severity, summary) for each
    rule, and a row for each alias naming the rule it stands for."""
    rows = [(r.code, r.name, shown_severity(r, overrides), r.summary) for r in RULES.values()]
    for alias, code in ALIASES.items():
        target = RULES[code]
        rows.append(
            (
                alias,
                f"alias of {code}",
                shown_severity(target, overrides),
                f"Former code of {code} {target.name}, accepted wherever a rule code is.",
            )
        )
    return sorted(rows)


def _default_value(key: str) -> Any:
    """The default of a configuration key; eps and momentum show PyTorch's defaults."""
    if key == "eps":
        return DEFAULT_EPS
    if key == "momentum":
        return DEFAULT_MOMENTUM
    value = getattr(Config(), KEYS[key].field)
    return list(value) if isinstance(value, tuple) else value


def _toml_value(value: Any) -> str:
    """A value written as TOML."""
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, float):
        return f"{value:g}" if "e" in f"{value:g}" else repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f'"{k}" = {_toml_value(v)}' for k, v in value.items()) + "}"
    return str(value)


def _silence_lines(rule: Rule) -> list[str]:
    """Every way to stop a rule from reporting or from failing a run."""
    code = rule.code
    lines = [
        "for one run: " + " or ".join(f"bnaudit {command} --ignore {code} ..." for command in rule.commands),
        f'for the project: ignore = ["{code}"] under [tool.bnaudit] in pyproject.toml (or in bnaudit.toml)',
        f'for some layers: per-layer-ignores = {{"backbone.*" = ["{code}"]}} (globs on layer names; '
        "file-level findings have no layer and are not matched)",
    ]
    if rule.settings:
        tuned = ", ".join(f"{key} = {_toml_value(_default_value(key))}" for key in rule.settings)
        lines.append(f"tune it instead (defaults shown): {tuned}")
    lines.append(
        f'change its severity: severity = {{{code} = "info"}} under [tool.bnaudit] (or [severity] in bnaudit.toml)'
    )
    worst = worst_severity(rule)
    if worst == "info":
        lines.append('info findings fail a run only with fail-on = "info"')
    elif worst == "warning":
        lines.append('report it without failing: fail-on = "error" (or --fail-on error)')
    return lines


def _alias_line(rule: Rule) -> str:
    return (
        f"{'aliases' if len(rule.aliases) > 1 else 'alias'}: {', '.join(rule.aliases)} (former code of the same "
        "fact, accepted in select, ignore, per-layer-ignores and severity)"
    )


def explain_rule(rule: Rule, markdown: bool = False, overrides: Mapping[str, str] | None = None) -> str:
    """What a rule detects, why it matters, how to fix it, how to silence it; with the
    configuration's severity `overrides`, the severity this project reports it at."""
    sections = [
        ("What it detects", [rule.summary]),
        ("Why it matters", [rule.explanation]),
        ("How to fix it", [rule.fix]),
        ("How to silence it", _silence_lines(rule)),
    ]
    if markdown:
        out = [f"**{rule.code} {rule.name}** (default severity: {rule.severity})", ""]
        if rule.aliases:
            out += [_alias_line(rule), ""]
        for title, paragraphs in sections:
            out.append(f"**{title}**")
            out.append("")
            if title == "How to silence it":
                out += [f"- {line}" for line in paragraphs]
            else:
                out += paragraphs
            out.append("")
        return "\n".join(out).rstrip() + "\n"
    out = [f"{rule.code} {rule.name}", f"default severity: {rule.severity}"]
    configured = rule.configured_severity(overrides or {})
    if configured is not None:
        out.append(f"configured severity: {configured} (every finding of the rule)")
    if rule.aliases:
        out.append(_alias_line(rule))
    out.append("")
    for title, paragraphs in sections:
        out.append(title)
        bullet = title == "How to silence it"
        for paragraph in paragraphs:
            out += textwrap.wrap(
                paragraph,
                _WIDTH,
                initial_indent="  - " if bullet else "  ",
                subsequent_indent="    " if bullet else "  ",
                break_on_hyphens=False,
            )
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _markdown_text(text: str) -> str:
    """Registry prose as Markdown: `*` outside code spans escaped (10*eps is not emphasis)."""
    parts = text.split("`")
    return "`".join(part if i % 2 else part.replace("*", "\\*") for i, part in enumerate(parts))


def _rules_table_markdown() -> str:
    rows = ["| code | name | severity | reported by | fires when |", "| --- | --- | --- | --- | --- |"]
    rows += [
        f"| [{r.code}]({r.code}.md) | {r.name} | {r.severity} | `{r.command}` | {_cell(_markdown_text(r.summary))} |"
        for r in RULES.values()
    ]
    return "\n".join(rows) + "\n"


GENERATED_NOTE = "<!-- generated from the rule registry (bnaudit/audit/rules/) by tools/update_docs.py; do not edit -->"


def rules_index_page() -> str:
    """docs/rules/index.md: every rule with its page, name, default severity and summary."""
    return "\n".join(
        [
            GENERATED_NOTE,
            "# Rules",
            "",
            "Every finding bnaudit reports has a stable code. `inspect` runs BN001-BN099 on a",
            "checkpoint alone (some need `--arch`, a TorchScript archive or an ONNX export); `diff`",
            "runs BN101 and up on two checkpoints, or a checkpoint and its ONNX export; `fold` runs",
            "BN201 and up, `parity` BN401 and up (a checkpoint against the artifact that ships). The severity",
            'column is the default; "error / warning" means the case decides (see each page). Any',
            "rule can be re-rated, ignored or tuned in the [configuration](../configuration.md);",
            "`bnaudit rules CODE` prints a rule's page in the terminal.",
            "",
            _rules_table_markdown(),
        ]
    )


def rule_page(rule: Rule, example: str | None = None) -> str:
    """docs/rules/CODE.md: what the rule checks, why, an example, how to fix it, its configuration.

    `example` is a bnaudit command line whose output shows the rule on a committed sample:
    it becomes an empty `<!-- begin example ... -->` block that tools/readme_examples.py
    fills with a real run.
    """
    out = [
        GENERATED_NOTE,
        f"# {rule.code} {rule.name}",
        "",
        f"Default severity: **{rule.severity}**. Reported by `bnaudit {rule.command}`.",
        "",
        "## What it checks",
        "",
        _markdown_text(rule.summary),
        "",
        "## Why it matters",
        "",
        _markdown_text(rule.explanation),
        "",
    ]
    if example is not None:
        out += ["## Example", "", f"<!-- begin example {example} -->", "<!-- end example -->", ""]
    out += ["## How to fix it", "", _markdown_text(rule.fix), "", "## Configuration", ""]
    if rule.settings:
        out += ["The keys that tune it (`[tool.bnaudit]` in pyproject.toml, or bnaudit.toml):", ""]
        out += ["| key | default | meaning |", "| --- | --- | --- |"]
        out += [
            f"| `{key}` | `{_cell(_toml_value(_default_value(key)))}` | {_cell(KEYS[key].doc)} |"
            for key in rule.settings
        ]
        out.append("")
    out += ["How to silence it:", ""]
    out += [f"- {_markdown_text(line)}" for line in _silence_lines(rule)]
    out += ["", "[All rules](index.md) · [Configuration](../configuration.md)", ""]
    return "\n".join(out)


def _config_table_markdown() -> str:
    rows = ["| key | default | meaning |", "| --- | --- | --- |"]
    rows += [f"| `{k.name}` | `{_cell(_toml_value(_default_value(k.name)))}` | {_cell(k.doc)} |" for k in KEYS.values()]
    return "\n".join(rows) + "\n"


# Blocks `<!-- begin NAME -->` ... `<!-- end NAME -->` inside hand-written pages.
GENERATED = {"config-table": _config_table_markdown}


def _block(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- begin {name}\b[^\n]*-->\n)(.*?)(<!-- end {name} -->)", re.DOTALL)


def generated_blocks(text: str) -> dict[str, str]:
    """The current content of each generated block found in `text`."""
    return {name: m.group(2) for name in GENERATED if (m := _block(name).search(text))}


def update_generated(text: str) -> str:
    """`text` with every generated block rewritten from the sources."""
    for name, build in GENERATED.items():
        body = build()

        def replace(m: re.Match[str], body: str = body) -> str:
            return m.group(1) + body + m.group(3)

        text = _block(name).sub(replace, text)
    return text

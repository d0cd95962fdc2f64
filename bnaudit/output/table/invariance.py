"""The invariance table: the verdict, one row per arrangement, the noise floor, where
samples meet, findings, diagnosis."""

from __future__ import annotations

from typing import TYPE_CHECKING

from bnaudit.output.names import shorten_names
from bnaudit.output.table.common import (
    NAME_MIN,
    Justify,
    bordered,
    cell,
    findings_and_diagnosis,
    fit_width,
    measurement_header,
    percent,
)
from bnaudit.text import above_floor, plural, printable

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from bnaudit.reports.invariance import CouplingSite, InvarianceReport


def render_invariance(report: InvarianceReport, console: Console, quiet: bool = False) -> None:
    """Rich rendering: header, verdict, one row per arrangement, the noise floor, the
    coupling sites, findings, diagnosis."""
    measurement_header(console, report.checkpoint, report.model, report.data, report.notes, report.key, report.prefix)
    order = f"shuffled with seed {report.seed}" if report.shuffle else "file order, --no-shuffle"
    skipped = f", {plural(report.skipped, 'unreadable image')} skipped" if report.skipped else ""
    sizes = ", ".join(str(s) for s in report.batch_sizes)
    console.print(
        cell(
            f"{plural(report.samples, 'sample')} ({order}), batch sizes {sizes}, "
            f"{plural(len(report.arrangements), 'arrangement')}, device {report.device}, "
            f"{report.dtype} outputs{skipped}"
        )
    )
    console.print()
    console.print(_verdict(report))
    console.print()
    if not quiet:
        _arrangements(report, console)
    _deviation_and_noise(report, console)
    if report.sites:
        console.print(fit_width(_sites_table(report.sites), console.width))
        console.print()
    findings_and_diagnosis(console, report.findings, report.diagnosis, quiet=quiet)


def _verdict(report: InvarianceReport) -> Text:
    from rich.text import Text

    if report.verdict != "coupled":
        return Text("invariant: no output depends on its batch companions", style="bold green")
    words = f"coupled: {report.coupled} of {plural(report.samples, 'sample')} depend on their batch companions"
    if report.failures:
        words += (
            " (and the model cannot score one sample alone)"
            if report.coupled
            else (": the model cannot score one sample alone")
        )
    return Text(words, style="bold red")


def _arrangements(report: InvarianceReport, console: Console) -> None:
    """One row per arrangement against the reference, the norm, the failed arrangements."""
    from rich.text import Text

    table = bordered(f"outputs against the reference ({report.reference}), per arrangement")
    columns: tuple[tuple[str, Justify], ...] = (
        ("arrangement", "left"),
        ("batches", "right"),
        ("max deviation", "right"),
        ("coupled", "right"),
        ("changed", "right"),
        ("accuracy", "right"),
    )
    for col, justify in columns:
        table.add_column(col, justify=justify)
    for a in report.arrangements:
        reference = a.name == report.reference
        table.add_row(
            a.name + (" *" if reference else ""),
            str(a.batches),
            "-" if reference else above_floor(a.max_deviation, report.screen),
            "-" if reference else str(a.coupled),
            "-" if reference or a.changed is None else str(a.changed),
            percent(a.accuracy),
            style="red" if a.coupled else "",
        )
    console.print(fit_width(table, console.width))
    console.print(Text("* reference; deviation: " + report.norm, style="dim"))
    for name, message in report.failures.items():
        console.print(cell(f"{name}: failed: {message}", style="red"))
    console.print()


def _deviation_and_noise(report: InvarianceReport, console: Console) -> None:
    """The largest deviation, changed predictions and KL on one line; the noise floor."""
    from rich.text import Text

    # below the screen, which sample deviates most is kernel noise too: not named
    below_screen = report.max_deviation < report.screen
    where = f" ({report.max_deviation_sample})" if report.max_deviation_sample and not below_screen else ""
    parts = [Text(f"largest deviation {above_floor(report.max_deviation, report.screen, '.3g')}{where}")]
    if report.changed is not None:
        parts.append(Text(f"predictions changed {report.changed} ({percent(report.changed_share)})"))
    if report.max_kl is not None and report.mean_kl is not None:
        kl_max, kl_mean = (above_floor(kl, report.kl_floor, ".3g") for kl in (report.max_kl, report.mean_kl))
        parts.append(Text(f"KL(reference || arrangement) max {kl_max}, mean {kl_mean}"))
    console.print(Text("  ·  ").join(parts))
    rescored = (
        f"{report.flagged} flagged, {report.cleared} cleared by float64 re-scoring"
        if report.float64
        else f"{report.flagged} flagged" + (", not re-scored in float64" if report.flagged else "")
    )
    noise64 = report.float64_noise
    noise = f", largest float64 noise {above_floor(noise64, report.floor)}" if noise64 is not None else ""
    console.print(
        cell(
            f"noise floor: screen {report.screen:.2g} ({report.dtype}), float64 floor {report.floor:.2g}; "
            f"{rescored}{noise}",
            style="dim",
        )
    )
    console.print()


def _sites_table(sites: list[CouplingSite]) -> Table:
    """Where samples meet: one row per reason (a whole graph traced in training mode is one finding)."""
    table = bordered("where samples meet")
    # module names shortened all together (different modules stay different), wrapped at ", "
    shown = shorten_names([printable(s.module) for s in sites], NAME_MIN)
    table.add_column("module")
    table.add_column("kind")
    table.add_column("why", overflow="fold")
    groups: dict[str, list[CouplingSite]] = {}
    for site in sites:
        groups.setdefault(site.reason.replace(site.kind, "{kind}"), []).append(site)
    for group in groups.values():
        kinds = list(dict.fromkeys(s.kind for s in group))
        reason = group[0].reason if len(group) == 1 else group[0].reason.replace(f"{group[0].kind} ", "")
        modules = ", ".join(shown[printable(s.module)] for s in group)
        table.add_row(cell(modules), cell(", ".join(kinds)), cell(reason))
    return table

"""`bnaudit fed`: how a federated server combined its clients' BatchNorm statistics."""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from bnaudit import output
from bnaudit.cli.boundary import user_errors
from bnaudit.cli.options import (
    ConfigOpt,
    DebugOpt,
    ExitZeroOpt,
    FailOnOpt,
    FoldFormat,
    IgnoreOpt,
    IsolatedOpt,
    KeyOpt,
    TrustPickleOpt,
    code_list,
)


def fed_command(
    global_path: Annotated[
        str,
        typer.Argument(
            metavar="GLOBAL", help="The global checkpoint the server aggregated (any format inspect reads)."
        ),
    ],
    clients: Annotated[
        list[str], typer.Argument(metavar="CLIENT...", help="The clients' checkpoints of the same round.")
    ],
    stats: Annotated[
        Optional[list[str]],
        typer.Option(
            "--stats",
            metavar="FILE",
            help="A client's statistics file (`recalibrate --stats-out`), for its counts: once per client, in the clients' order.",
        ),
    ] = None,
    output_format: Annotated[
        FoldFormat,
        typer.Option(
            "--format",
            "-f",
            help="Report format. sarif: SARIF 2.1.0 for code scanning; github: workflow-command annotations; gitlab: Code Quality JSON; junit: JUnit XML; markdown: a job summary.",
        ),
    ] = FoldFormat.table,
    fail_on: FailOnOpt = None,
    exit_zero: ExitZeroOpt = False,
    select: Annotated[
        Optional[list[str]],
        typer.Option(metavar="CODES", help="Run only these rules (codes or prefixes, e.g. BN301,BN302)."),
    ] = None,
    ignore: IgnoreOpt = None,
    config_file: ConfigOpt = None,
    isolated: IsolatedOpt = False,
    key: KeyOpt = None,
    trust_pickle: TrustPickleOpt = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No per-layer table.")] = False,
    debug: DebugOpt = False,
) -> None:
    """Classify each BN layer of a federated global checkpoint: copied, averaged, pooled or never aggregated."""
    from bnaudit.audit.fed.federation import audit_federation
    from bnaudit.audit.rules import accepted_codes
    from bnaudit.config import load_config

    with user_errors(debug, output_format in (FoldFormat.json, FoldFormat.gitlab)):
        overrides = {
            "--fail-on": fail_on.value if fail_on else None,
            "--select": code_list(select),
            "--ignore": code_list(ignore),
        }
        config = load_config(overrides, config_file=config_file, isolated=isolated, rule_codes=accepted_codes())
        report = audit_federation(
            global_path, clients, config, key=key, statistics=stats or (), trust_pickle=trust_pickle
        )
        output.emit(report, output_format.value, sys.stdout, quiet=quiet)
    raise typer.Exit(report.exit_code(exit_zero=exit_zero))

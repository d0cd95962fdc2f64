"""`bnaudit merge`: statistics files of disjoint data merged exactly into their checkpoint."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from bnaudit import output
from bnaudit.cli.boundary import frozen_imports, user_errors
from bnaudit.cli.options import ConfigOpt, DebugOpt, Format, FormatOpt, IsolatedOpt, KeyOpt, TrustPickleOpt


def merge_command(
    statistics: Annotated[
        list[str],
        typer.Argument(
            metavar="STATS...",
            help="Statistics files written by `bnaudit recalibrate --stats-out` (shards, jobs or clients of one checkpoint).",
        ),
    ],
    checkpoint: Annotated[
        str,
        typer.Option(
            "--checkpoint",
            "-c",
            metavar="CHECKPOINT",
            help="The checkpoint the statistics were computed on (a file, or a folder holding one).",
        ),
    ],
    output_path: Annotated[
        str,
        typer.Option(
            "--output",
            "-o",
            metavar="PATH",
            help="Where to write the checkpoint with the merged statistics (its format as recalibrate's --output).",
        ),
    ],
    key: KeyOpt = None,
    trust_pickle: TrustPickleOpt = False,
    force: Annotated[bool, typer.Option("--force", help="Overwrite --output if it exists.")] = False,
    config_file: ConfigOpt = None,
    isolated: IsolatedOpt = False,
    output_format: FormatOpt = Format.table,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No table of the files and none of the layers.")] = False,
    debug: DebugOpt = False,
) -> None:
    """Merge statistics files exactly (Chan's formulas) and write the checkpoint with the merged statistics."""
    from bnaudit.audit.rules import accepted_codes
    from bnaudit.config import load_config

    with user_errors(debug, output_format is Format.json):
        # the configuration's excludes decide which checkpoint a folder holds, as for inspect
        config = load_config(config_file=config_file, isolated=isolated, rule_codes=accepted_codes())
        with frozen_imports():
            from bnaudit.runtime.recalibrate.merge import merge_statistics

            report = merge_statistics(
                statistics, checkpoint, output_path, key=key, trust_pickle=trust_pickle, force=force, config=config
            )
        for message in report.warnings:
            output.emit_warning(message, sys.stderr)
        output.emit(report, output_format.value, sys.stdout, quiet=quiet)
    raise typer.Exit(0)

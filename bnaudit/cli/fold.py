"""`bnaudit fold`: will each BN survive folding into its producer, int8, fp16 and bf16?"""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from bnaudit import output
from bnaudit.audit.settings import DEFAULT_EPS
from bnaudit.cli.boundary import user_errors
from bnaudit.cli.options import (
    ConfigOpt,
    DebugOpt,
    ExitZeroOpt,
    FailOnOpt,
    Format,
    FormatOpt,
    IsolatedOpt,
    KeyOpt,
    TrustPickleOpt,
)


def fold_command(
    path: Annotated[
        str, typer.Argument(metavar="PATH", help="A checkpoint (.pt, .safetensors) or TorchScript archive.")
    ],
    output_format: FormatOpt = Format.table,
    fail_on: FailOnOpt = None,
    exit_zero: ExitZeroOpt = False,
    config_file: ConfigOpt = None,
    isolated: IsolatedOpt = False,
    key: KeyOpt = None,
    eps: Annotated[
        Optional[float],
        typer.Option(metavar="EPS", help=f"BN eps where the file holds no modules (default {DEFAULT_EPS:g})."),
    ] = None,
    trust_pickle: TrustPickleOpt = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No per-pair table.")] = False,
    debug: DebugOpt = False,
) -> None:
    """Predict what folding BN into its producer, then int8, fp16 and bf16, do to each channel."""
    from bnaudit.audit.foldaudit import predict_fold
    from bnaudit.audit.rules import accepted_codes
    from bnaudit.config import load_config

    with user_errors(debug, output_format is Format.json):
        overrides = {"--fail-on": fail_on.value if fail_on else None, "--eps": eps}
        config = load_config(overrides, config_file=config_file, isolated=isolated, rule_codes=accepted_codes())
        report = predict_fold(path, config, key=key, trust_pickle=trust_pickle)
        output.emit(report, output_format.value, sys.stdout, quiet=quiet)
    raise typer.Exit(report.exit_code(exit_zero=exit_zero))

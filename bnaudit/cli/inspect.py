"""`bnaudit inspect` and `bnaudit rules`: the checkpoint audit without code or data."""

# No `from __future__ import annotations`: typer reads these annotations at every start-up
# (see bnaudit.cli).

import sys
from typing import Annotated, Optional

import typer

from bnaudit import output
from bnaudit.cli.boundary import user_errors
from bnaudit.cli.options import ConfigOpt, DebugOpt, FailOnOpt, InspectFormat, InspectFormatOpt, IsolatedOpt, code_list
from bnaudit.cli.report import Destination, ReportForceOpt, ReportOutputOpt
from bnaudit.normkinds import DEFAULT_EPS, DEFAULT_MOMENTUM


def inspect(
    paths: Annotated[
        list[str],
        typer.Argument(
            metavar="PATHS...",
            help="Checkpoint files, shard indexes (*.safetensors.index.json) or directories (searched for .pt .pth .ckpt .bin .tar .safetensors .onnx .jit .pt2 and shard indexes; a Hugging Face cache by repo and revision).",
        ),
    ],
    output_format: InspectFormatOpt = InspectFormat.table,
    output_path: ReportOutputOpt = None,
    force: ReportForceOpt = False,
    fail_on: FailOnOpt = None,
    exit_zero: Annotated[
        bool,
        typer.Option(
            "--exit-zero",
            help="Exit 0 even when findings are at or above --fail-on, or a file found in a scanned folder cannot be read (2 stays for usage errors and unreadable files you named).",
        ),
    ] = False,
    select: Annotated[
        Optional[list[str]],
        typer.Option(
            metavar="CODES",
            help="Run only these rules: codes or prefixes, comma-separated or repeated. Replaces the configuration's select and ignore.",
        ),
    ] = None,
    ignore: Annotated[
        Optional[list[str]],
        typer.Option(
            metavar="CODES", help="Do not report these rules (codes or prefixes); added to the configuration's ignore."
        ),
    ] = None,
    config_file: ConfigOpt = None,
    isolated: IsolatedOpt = False,
    key: Annotated[
        Optional[str], typer.Option(metavar="KEY", help="Container key of the state dict to audit (e.g. model_ema).")
    ] = None,
    eps: Annotated[
        Optional[float],
        typer.Option(metavar="EPS", help=f"BN eps where the file holds no modules (default {DEFAULT_EPS:g})."),
    ] = None,
    momentum: Annotated[
        Optional[float],
        typer.Option(metavar="M", help=f"BN momentum where the file holds no modules (default {DEFAULT_MOMENTUM:g})."),
    ] = None,
    trust_pickle: Annotated[
        bool,
        typer.Option(
            "--trust-pickle", help="Unpickle arbitrary classes: runs code from the file. Only for files you trust."
        ),
    ] = False,
    quiet: Annotated[
        bool,
        typer.Option(
            "--quiet", "-q", help="One line per finding (path: layer: CODE name: message) and the summary line."
        ),
    ] = False,
    all_layers: Annotated[
        bool,
        typer.Option(
            "--layers", help="With several files: a layer table for every file, not only those with findings."
        ),
    ] = False,
    all_revisions: Annotated[
        bool,
        typer.Option(
            "--all-revisions",
            help="In a Hugging Face cache, audit every downloaded snapshot, not only the one refs/main names (each file read once).",
        ),
    ] = False,
    jobs: Annotated[
        Optional[int],
        typer.Option(
            "--jobs",
            "-j",
            metavar="N",
            help="At most N processes audit the files of a scan (default: one per CPU, from 16 files up; 1: this process alone).",
        ),
    ] = None,
    debug: DebugOpt = False,
    arch: Annotated[
        Optional[str],
        typer.Option(
            metavar="MODULE:CALLABLE",
            help="MODULE:CALLABLE or path/to/file.py:CALLABLE building the model: exact BN001, BN006, BN007, BN011 and the real eps/momentum.",
        ),
    ] = None,
    arch_kwargs: Annotated[
        Optional[str],
        typer.Option(
            "--arch-kwargs",
            metavar="JSON",
            help="JSON object of keyword arguments for --arch, e.g. '{\"num_classes\": 10}'.",
        ),
    ] = None,
    base: Annotated[
        Optional[str],
        typer.Option(
            metavar="PATH",
            help="The base checkpoint (file or save_pretrained folder) a PEFT adapter folder is composed with "
            "(default: its base_model_name_or_path, found locally or in the Hugging Face cache).",
        ),
    ] = None,
) -> None:
    """Audit every BatchNorm layer of checkpoints, without code or data."""
    from bnaudit.api import inspect as run_inspect
    from bnaudit.audit.rules import accepted_codes
    from bnaudit.config import load_config

    with user_errors(debug, output_format is InspectFormat.json):
        overrides = {
            "--fail-on": fail_on.value if fail_on else None,
            "--eps": eps,
            "--momentum": momentum,
            "--select": code_list(select),
            "--ignore": code_list(ignore),
        }
        config = load_config(overrides, config_file=config_file, isolated=isolated, rule_codes=accepted_codes())
        destination = Destination(output_format.value, output_path, force, paths)
        report = run_inspect(
            paths,
            config,
            key=key,
            trust_pickle=trust_pickle,
            arch=arch,
            arch_kwargs=arch_kwargs,
            debug=debug,
            all_revisions=all_revisions,
            jobs=jobs,
            base=base,
            channels=output_format is InspectFormat.html,  # the page draws every channel
        )
        # emitting stays inside the boundary: the values it prints come from the files
        output.emit(report, output_format.value, destination.stream, quiet=quiet, all_layers=all_layers)
        destination.finish()
    output.emit_diagnostics(report, sys.stderr, output_format.value)
    raise typer.Exit(report.exit_code(exit_zero=exit_zero))


def rules_command(
    code: Annotated[
        Optional[str], typer.Argument(metavar="[CODE]", help="A rule code, e.g. BN004: explain that rule.")
    ] = None,
    config_file: ConfigOpt = None,
    isolated: IsolatedOpt = False,
    debug: DebugOpt = False,
) -> None:
    """List the rules, or explain one: what it detects, why it matters, how to fix and silence it."""
    from bnaudit.audit.rules import accepted_codes
    from bnaudit.config import load_config

    with user_errors(debug):
        # severities as this project's configuration sets them
        config = load_config(config_file=config_file, isolated=isolated, rule_codes=accepted_codes())
        output.render_rules(sys.stdout, code, overrides=config.severity)

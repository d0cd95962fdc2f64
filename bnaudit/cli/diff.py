"""`bnaudit diff`: the BatchNorm state of two checkpoints, or of a checkpoint and its ONNX export."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from bnaudit import output
from bnaudit.cli.boundary import user_errors
from bnaudit.cli.options import (
    ArchKwargsOpt,
    BatchSizeOpt,
    ConfigOpt,
    DebugOpt,
    ExitZeroOpt,
    FailOnOpt,
    IgnoreOpt,
    InspectFormat,
    InspectFormatOpt,
    IsolatedOpt,
    NumSamplesOpt,
    code_list,
    data_options,
)
from bnaudit.cli.report import Destination, ReportForceOpt, ReportOutputOpt
from bnaudit.errors import BnauditError
from bnaudit.normkinds import DEFAULT_EPS, DEFAULT_MOMENTUM


def diff_command(
    path_a: Annotated[
        str, typer.Argument(metavar="A", help="The checkpoint before (e.g. pretrained.pt, or a folder holding one).")
    ],
    path_b: Annotated[str, typer.Argument(metavar="B", help="The checkpoint after (e.g. finetuned.ckpt).")],
    key_a: Annotated[
        Optional[str], typer.Option("--key-a", metavar="KEY", help="Container key of A's state dict (e.g. state_dict).")
    ] = None,
    key_b: Annotated[
        Optional[str],
        typer.Option("--key-b", metavar="KEY", help="Container key of B's state dict (e.g. state_dict_ema)."),
    ] = None,
    expect_frozen: Annotated[
        Optional[list[str]],
        typer.Option(
            "--expect-frozen",
            metavar="GLOB",
            help="Layers (name glob, repeatable) that must not change: anything that moved is an error.",
        ),
    ] = None,
    expect_trained: Annotated[
        Optional[list[str]],
        typer.Option(
            "--expect-trained",
            metavar="GLOB",
            help="Layers (name glob, repeatable) whose weights must change: bit-identical weights are an error.",
        ),
    ] = None,
    output_format: InspectFormatOpt = InspectFormat.table,
    output_path: ReportOutputOpt = None,
    force: ReportForceOpt = False,
    fail_on: FailOnOpt = None,
    exit_zero: ExitZeroOpt = False,
    select: Annotated[
        Optional[list[str]],
        typer.Option(metavar="CODES", help="Run only these rules (codes or prefixes, e.g. BN101,BN104)."),
    ] = None,
    ignore: IgnoreOpt = None,
    config_file: ConfigOpt = None,
    isolated: IsolatedOpt = False,
    eps: Annotated[
        Optional[float],
        typer.Option(
            metavar="EPS",
            help=f"BN eps where a file holds no modules (default {DEFAULT_EPS:g}): scales the mean shift.",
        ),
    ] = None,
    momentum: Annotated[
        Optional[float],
        typer.Option(
            metavar="M",
            help=f"BN momentum where a file holds no modules (default {DEFAULT_MOMENTUM:g}): compared with the other side's.",
        ),
    ] = None,
    trust_pickle: Annotated[
        bool,
        typer.Option(
            "--trust-pickle", help="Unpickle arbitrary classes: runs code from the files. Only for files you trust."
        ),
    ] = False,
    quiet: Annotated[
        bool,
        typer.Option(
            "--quiet",
            "-q",
            help="One line per finding (path: layer: CODE name: message), the output comparison when it passed, and the summary line.",
        ),
    ] = False,
    debug: DebugOpt = False,
    arch: Annotated[
        Optional[str],
        typer.Option(
            "--arch",
            metavar="MODULE:CALLABLE",
            help="A checkpoint against its ONNX export: the model (folded layers paired through its graph, its real eps).",
        ),
    ] = None,
    arch_kwargs: ArchKwargsOpt = None,
    data: Annotated[
        Optional[str],
        typer.Option(
            "--data",
            metavar="PATH",
            help="With --arch, a checkpoint against its ONNX export: run both (torch eval, onnxruntime CPU) on this data and compare the outputs.",
        ),
    ] = None,
    batch_size: BatchSizeOpt = 64,
    num_samples: NumSamplesOpt = None,
) -> None:
    """Compare the BatchNorm state of two checkpoints: frozen layers that kept updating,
    averaged weights with stale statistics, double-counted batches; or a checkpoint with its
    ONNX export (nodes, folding, and with --arch and --data the outputs)."""
    from bnaudit.audit.diff.checkpoints import diff as run_diff
    from bnaudit.audit.rules import accepted_codes
    from bnaudit.config import load_config

    with user_errors(debug, output_format is InspectFormat.json):
        overrides = {
            "--fail-on": fail_on.value if fail_on else None,
            "--eps": eps,
            "--momentum": momentum,
            "--select": code_list(select),
            "--ignore": code_list(ignore),
            "--expect-frozen": expect_frozen or None,
            "--expect-trained": expect_trained or None,
        }
        config = load_config(overrides, config_file=config_file, isolated=isolated, rule_codes=accepted_codes())
        destination = Destination(output_format.value, output_path, force, [path_a, path_b, *([data] if data else [])])
        if data is not None and arch is None:
            raise BnauditError("--data needs --arch (the model to run the checkpoint with)")
        if arch is not None or arch_kwargs is not None:
            if arch is None:
                raise BnauditError("--arch-kwargs needs --arch")
            from bnaudit.audit.resolve import model_checkpoint
            from bnaudit.formats.sniff import sniff_format
            from bnaudit.runtime.models import ModelSpec
            from bnaudit.runtime.parity.onnx import diff_export

            if sniff_format(model_checkpoint(path_b, trust_pickle=trust_pickle, config=config)) != "onnx":
                raise BnauditError(f"--arch applies to a checkpoint against its ONNX export: {path_b} is not ONNX")
            options = None
            if data is not None:  # the samples in file order, read in the main process
                options = data_options(data=data, batch_size=batch_size, num_samples=num_samples, no_shuffle=True)
            spec = ModelSpec(path_a, arch=arch, arch_kwargs=arch_kwargs, key=key_a, trust_pickle=trust_pickle)
            report = diff_export(spec, path_b, config, options)
        else:
            report = run_diff(path_a, path_b, config, key_a=key_a, key_b=key_b, trust_pickle=trust_pickle)
        output.emit(report, output_format.value, destination.stream, quiet=quiet)
        destination.finish()
    raise typer.Exit(report.exit_code(exit_zero=exit_zero))

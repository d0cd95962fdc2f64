"""`bnaudit parity`: does the artifact you deploy compute what the checkpoint computes, and which
BN layer is the first to differ?"""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from bnaudit import output
from bnaudit.cli.boundary import frozen_imports, user_errors
from bnaudit.cli.options import (
    ArchKwargsOpt,
    ArchOpt,
    BatchSizeOpt,
    ConfigOpt,
    DataOpt,
    DatasetOpt,
    DebugOpt,
    DeviceOpt,
    ExitZeroOpt,
    FailOnOpt,
    ForwardOpt,
    GrayscaleOpt,
    IgnoreOpt,
    ImageSizeOpt,
    InspectFormat,
    InspectFormatOpt,
    IsolatedOpt,
    KeyOpt,
    MeanOpt,
    NoShuffleOpt,
    SeedOpt,
    SkipBadOpt,
    StdOpt,
    TrustPickleOpt,
    WorkersOpt,
    code_list,
    data_options,
    data_parameters,
)
from bnaudit.cli.report import Destination, ReportForceOpt, ReportOutputOpt
from bnaudit.errors import BnauditError


def parity_command(
    checkpoint: Annotated[
        str,
        typer.Argument(
            metavar="CHECKPOINT",
            help="A state dict (with --arch), a TorchScript archive or a pickled nn.Module; or a folder holding one (as inspect finds it).",
        ),
    ],
    against: Annotated[
        str,
        typer.Option(
            "--against",
            metavar="TARGET",
            help="What ships: compile (torch.compile, inductor), compile:BACKEND (a registered backend name, or FILE.py:fn, a backend fn(gm, example_inputs)), an ONNX model (onnxruntime, CPU), a torch.export .pt2 archive or a TorchScript file. Running it runs code from it.",
        ),
    ],
    data: DataOpt = None,
    dataset: DatasetOpt = None,
    arch: ArchOpt = None,
    arch_kwargs: ArchKwargsOpt = None,
    key: KeyOpt = None,
    trust_pickle: TrustPickleOpt = False,
    forward: ForwardOpt = None,
    batch_size: BatchSizeOpt = 64,
    num_samples: Annotated[
        Optional[int],
        typer.Option("--num-samples", metavar="N", help="Compare at most this many samples (default 512)."),
    ] = 512,
    seed: SeedOpt = 0,
    no_shuffle: NoShuffleOpt = False,
    device: DeviceOpt = "cpu",
    workers: WorkersOpt = 0,
    image_size: ImageSizeOpt = None,
    grayscale: GrayscaleOpt = False,
    mean: MeanOpt = None,
    std: StdOpt = None,
    skip_bad: SkipBadOpt = False,
    output_format: InspectFormatOpt = InspectFormat.table,
    output_path: ReportOutputOpt = None,
    force: ReportForceOpt = False,
    fail_on: FailOnOpt = None,
    exit_zero: ExitZeroOpt = False,
    select: Annotated[
        Optional[list[str]],
        typer.Option(metavar="CODES", help="Run only these rules (codes or prefixes, e.g. BN401)."),
    ] = None,
    ignore: IgnoreOpt = None,
    config_file: ConfigOpt = None,
    isolated: IsolatedOpt = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar and no per-layer table.")] = False,
    debug: DebugOpt = False,
) -> None:
    """Run the checkpoint in eager PyTorch and the artifact that ships (torch.compile, ONNX,
    .pt2, TorchScript) on the same batches, and find the first BN layer where they differ."""
    data_args = data_parameters(locals())  # before any other local: the command's own arguments
    from bnaudit.audit.rules import accepted_codes
    from bnaudit.config import load_config

    json_output = output_format in (InspectFormat.json, InspectFormat.gitlab)
    with user_errors(debug, json_output):
        from bnaudit.runtime.distributed import distributed

        if distributed()[1] > 1:
            raise BnauditError("parity runs in one process: run it without torchrun")
        overrides = {
            "--fail-on": fail_on.value if fail_on else None,
            "--select": code_list(select),
            "--ignore": code_list(ignore),
        }
        config = load_config(overrides, config_file=config_file, isolated=isolated, rule_codes=accepted_codes())
        options = data_options(**data_args)
        inputs = [checkpoint, against, *([data] if data else [])]
        destination = Destination(output_format.value, output_path, force, inputs)
        with frozen_imports():
            from bnaudit.runtime.models import ModelSpec
            from bnaudit.runtime.parity.measure import measure_parity

            spec = ModelSpec(
                checkpoint,
                arch=arch,
                arch_kwargs=arch_kwargs,
                key=key,
                trust_pickle=trust_pickle,
                forward=forward,
                device=device,
            )
            with output.progress("parity", sys.stderr, quiet=quiet or json_output) as update:
                report = measure_parity(spec, against, options, config, progress=update)
        output.emit(report, output_format.value, destination.stream, quiet=quiet)
        destination.finish()
    raise typer.Exit(report.exit_code(exit_zero=exit_zero))

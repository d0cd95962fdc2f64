"""`bnaudit fold`: will each BN survive folding into its producer, int8, fp16 and bf16?"""

from __future__ import annotations

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
    ExitZeroOpt,
    FailOnOpt,
    ForwardOpt,
    GrayscaleOpt,
    IgnoreOpt,
    ImageSizeOpt,
    InspectFormat,
    IsolatedOpt,
    KeyOpt,
    MeanOpt,
    NoShuffleOpt,
    NumSamplesOpt,
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
from bnaudit.normkinds import DEFAULT_EPS


def fold_command(
    path: Annotated[
        str,
        typer.Argument(
            metavar="PATH",
            help="A checkpoint (.pt, .safetensors), TorchScript archive, ONNX model or torch.export .pt2 archive.",
        ),
    ],
    output_format: Annotated[
        InspectFormat,
        typer.Option(
            "--format",
            "-f",
            help="Report format. sarif: SARIF 2.1.0 for code scanning; github: workflow-command annotations; gitlab: Code Quality JSON; junit: JUnit XML; markdown: a job summary; html: one self-contained page with charts (the html extra).",
        ),
    ] = InspectFormat.table,
    output_path: ReportOutputOpt = None,
    force: ReportForceOpt = False,
    fail_on: FailOnOpt = None,
    exit_zero: ExitZeroOpt = False,
    select: Annotated[
        Optional[list[str]],
        typer.Option(metavar="CODES", help="Run only these rules (codes or prefixes, e.g. BN201,BN204)."),
    ] = None,
    ignore: IgnoreOpt = None,
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
    arch: ArchOpt = None,
    arch_kwargs: ArchKwargsOpt = None,
    data: DataOpt = None,
    dataset: DatasetOpt = None,
    forward: ForwardOpt = None,
    batch_size: BatchSizeOpt = 64,
    num_samples: NumSamplesOpt = None,
    seed: SeedOpt = 0,
    no_shuffle: NoShuffleOpt = False,
    workers: WorkersOpt = 0,
    image_size: ImageSizeOpt = None,
    grayscale: GrayscaleOpt = False,
    mean: MeanOpt = None,
    std: StdOpt = None,
    skip_bad: SkipBadOpt = False,
) -> None:
    """Predict what folding BN into its producer, then int8, fp16 and bf16, do to each channel;
    with --data (and --arch), measure it."""
    data_args = data_parameters(locals())  # before any other local: the command's own arguments
    from bnaudit.audit.fold.predict import predict_fold
    from bnaudit.audit.rules import accepted_codes
    from bnaudit.config import load_config

    json_output = output_format in (InspectFormat.json, InspectFormat.gitlab)
    measuring = data is not None or dataset is not None
    printing = True
    if measuring:  # under torchrun rank 0 alone prints (errors too): the runner says which
        # runtime/ needs torch: its absence is said here, by any process (no torchrun without torch)
        with user_errors(debug, json_output):
            from bnaudit.runtime.distributed import prints
        printing = prints()
    with user_errors(debug, json_output and printing):
        overrides = {
            "--fail-on": fail_on.value if fail_on else None,
            "--eps": eps,
            "--select": code_list(select),
            "--ignore": code_list(ignore),
        }
        config = load_config(overrides, config_file=config_file, isolated=isolated, rule_codes=accepted_codes())
        destination = Destination(output_format.value, output_path, force, [path, *([data] if data else [])])
        if not measuring:
            if arch is not None or arch_kwargs is not None or forward is not None:
                raise BnauditError("--arch, --arch-kwargs and --forward measure: give --data or --dataset too")
            report = predict_fold(path, config, key=key, trust_pickle=trust_pickle)
            output.emit(report, output_format.value, destination.stream, quiet=quiet)
            destination.finish()
        else:
            import torch

            from bnaudit.runtime.distributed import torchrun
            from bnaudit.runtime.fold import measure_fold
            from bnaudit.runtime.models import ModelSpec

            options = data_options(**data_args)
            spec = ModelSpec(
                path, arch=arch, arch_kwargs=arch_kwargs, key=key, trust_pickle=trust_pickle, forward=forward
            )
            # printed inside the runner's wait: torchrun stops every rank as soon as one exits
            with frozen_imports(), torchrun(torch.device("cpu"), wait=True):
                report = measure_fold(spec, options, config)
                if printing:
                    output.emit(report, output_format.value, destination.stream, quiet=quiet)
                    destination.finish()
    raise typer.Exit(report.exit_code(exit_zero=exit_zero))

"""`bnaudit recalibrate`: re-estimate the running statistics on data and write a new checkpoint."""

from __future__ import annotations

import os
import sys
from enum import Enum
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
    ForwardOpt,
    GrayscaleOpt,
    ImageSizeOpt,
    IsolatedOpt,
    KeyOpt,
    MeanOpt,
    NoShuffleOpt,
    NumSamplesOpt,
    PageFormat,
    PageFormatOpt,
    QuietOpt,
    SeedOpt,
    SkipBadOpt,
    StdOpt,
    TrustPickleOpt,
    WorkersOpt,
    data_options,
    data_parameters,
)
from bnaudit.cli.report import Destination
from bnaudit.errors import BnauditError


class Method(str, Enum):
    exact = "exact"
    sequential = "sequential"
    cumulative = "cumulative"


def recalibrate(
    checkpoint: Annotated[
        str,
        typer.Argument(
            metavar="CHECKPOINT",
            help="A state dict (with --arch), a TorchScript archive or a pickled nn.Module; or a folder holding one (as inspect finds it).",
        ),
    ],
    output_path: Annotated[
        Optional[str],
        typer.Option(
            "--output",
            "-o",
            metavar="PATH",
            help="Where to write the recalibrated checkpoint: .safetensors writes safetensors, .pt/.pth/.ckpt/.bin a torch file, any other name the input's format; a sharded checkpoint is written as a folder of shards.",
        ),
    ] = None,
    stats_out: Annotated[
        Optional[str],
        typer.Option(
            "--stats-out",
            metavar="PATH",
            help="Also (or, without --output, instead) write the per-layer count, mean and sum of squared deviations (float64) as a statistics file for `bnaudit merge`.",
        ),
    ] = None,
    shard: Annotated[
        Optional[str],
        typer.Option(
            "--shard",
            metavar="I/N",
            help="Run only the whole batches rank I of N would run under torchrun (I from 0); with --stats-out: N such runs merge into the one-process result.",
        ),
    ] = None,
    data: DataOpt = None,
    dataset: DatasetOpt = None,
    arch: ArchOpt = None,
    arch_kwargs: ArchKwargsOpt = None,
    key: KeyOpt = None,
    trust_pickle: TrustPickleOpt = False,
    forward: ForwardOpt = None,
    method: Annotated[
        Method,
        typer.Option(
            "--method",
            help="exact: population statistics in one pass; sequential: layer by layer, eval-mode self-consistent; cumulative: update_bn's average of batch statistics.",
        ),
    ] = Method.exact,
    layers: Annotated[
        Optional[list[str]],
        typer.Option("--layers", metavar="GLOB", help="Recalibrate only BN layers matching this glob (repeatable)."),
    ] = None,
    exclude: Annotated[
        Optional[list[str]],
        typer.Option("--exclude", metavar="GLOB", help="Leave BN layers matching this glob as they are (repeatable)."),
    ] = None,
    eval_data: Annotated[
        Optional[str],
        typer.Option(
            "--eval-data",
            metavar="PATH",
            help="Held-out data (same kinds as --data): the gap report of the old and the new checkpoint side by side.",
        ),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite --output (and --report) if it exists.")] = False,
    allow_input_mismatch: Annotated[
        bool,
        typer.Option(
            "--allow-input-mismatch",
            help="Write even when the data disagrees with mature statistics at the first BN layer (the sign of wrong preprocessing).",
        ),
    ] = False,
    batch_size: BatchSizeOpt = 64,
    num_samples: NumSamplesOpt = None,
    seed: SeedOpt = 0,
    no_shuffle: NoShuffleOpt = False,
    device: DeviceOpt = "cpu",
    amp: Annotated[
        bool,
        typer.Option("--amp", help="Autocast the forward to float16 on CUDA (statistics still accumulate in float64)."),
    ] = False,
    workers: WorkersOpt = 0,
    image_size: ImageSizeOpt = None,
    grayscale: GrayscaleOpt = False,
    mean: MeanOpt = None,
    std: StdOpt = None,
    skip_bad: SkipBadOpt = False,
    config_file: ConfigOpt = None,
    isolated: IsolatedOpt = False,
    output_format: PageFormatOpt = PageFormat.table,
    report_path: Annotated[
        Optional[str],
        typer.Option(
            "--report",
            metavar="FILE",
            help="Write the report to FILE (all at once) instead of stdout, e.g. report.html with --format html.",
        ),
    ] = None,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Re-estimate BatchNorm running statistics on data and write a new checkpoint (or statistics to merge) safely."""
    data_args = data_parameters(locals())  # before any other local: the command's own arguments
    import dataclasses

    from bnaudit.audit.rules import accepted_codes
    from bnaudit.config import load_config

    json_output = output_format is PageFormat.json
    # runtime/ needs torch: its absence is said here, by any process (no torchrun without torch)
    with user_errors(debug, json_output):
        from bnaudit.runtime.distributed import prints
        from bnaudit.runtime.models import ModelSpec
        from bnaudit.runtime.recalibrate.command import recalibrate_checkpoint
    # under torchrun every rank runs this; rank 0 alone reports, errors included in JSON
    printing = prints()

    def warn(message: str) -> None:
        output.emit_warning(message, sys.stderr)

    with user_errors(debug, json_output and printing):
        for written in (output_path, stats_out):  # the run's own outputs: the report must not replace one
            if (
                report_path is not None
                and written is not None
                and os.path.abspath(report_path) == os.path.abspath(written)
            ):
                raise BnauditError(
                    f"{report_path}: --report names another output of this run; write it to another file"
                )
        inputs = [p for p in (checkpoint, data, eval_data) if p]
        destination = Destination(output_format.value, report_path, force, inputs)
        from bnaudit.formats.bnstats import parse_shard

        share = None if shard is None else parse_shard(shard)
        options = data_options(**data_args)
        held_out = None if eval_data is None else dataclasses.replace(options, path=eval_data, dataset=None)
        # The inspect findings of the --eval-data gap reports follow the project's configuration.
        config = load_config(config_file=config_file, isolated=isolated, rule_codes=accepted_codes())
        quiet_bar = quiet or json_output or not printing
        with frozen_imports(), output.progress(f"recalibrate ({method.value})", sys.stderr, quiet=quiet_bar) as update:
            report = recalibrate_checkpoint(
                ModelSpec(
                    checkpoint,
                    arch=arch,
                    arch_kwargs=arch_kwargs,
                    key=key,
                    trust_pickle=trust_pickle,
                    forward=forward,
                    device=device,
                ),
                output_path,
                options,
                stats_out=stats_out,
                shard=share,
                method=method.value,
                amp=amp,
                include=layers or (),
                exclude=exclude or (),
                force=force,
                eval_data=held_out,
                config=config,
                progress=update,
                warn=warn,
                allow_input_mismatch=allow_input_mismatch,
            )
        if report is None:  # another rank than 0 under torchrun: rank 0 reports
            raise typer.Exit(0)
        output.emit_diagnostics(report, sys.stderr)
        output.emit(report, output_format.value, destination.stream, quiet=quiet)
        destination.finish()
    raise typer.Exit(0)

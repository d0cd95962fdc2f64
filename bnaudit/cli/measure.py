"""`bnaudit gap` and `bnaudit invariance`: measurements of a model on data."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Optional

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
    MeasureExitZeroOpt,
    MeasureFailOnOpt,
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
from bnaudit.cli.report import Destination, ReportForceOpt, ReportOutputOpt

if TYPE_CHECKING:
    from bnaudit.runtime.data import DataOptions


def gap(
    checkpoint: Annotated[
        str,
        typer.Argument(
            metavar="CHECKPOINT",
            help="A state dict (with --arch), a TorchScript archive or a pickled nn.Module; or a folder holding one (as inspect finds it).",
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
    num_samples: NumSamplesOpt = None,
    seed: SeedOpt = 0,
    no_shuffle: NoShuffleOpt = False,
    device: DeviceOpt = "cpu",
    workers: WorkersOpt = 0,
    image_size: ImageSizeOpt = None,
    grayscale: GrayscaleOpt = False,
    mean: MeanOpt = None,
    std: StdOpt = None,
    skip_bad: SkipBadOpt = False,
    max_gap: Annotated[
        Optional[float],
        typer.Option(
            "--max-gap",
            metavar="FRACTION",
            help="Exit 1 when the gap (train-mode minus eval-mode accuracy, a fraction) exceeds this and is significant (see --strict).",
        ),
    ] = None,
    strict: Annotated[
        bool,
        typer.Option(
            "--strict",
            help="With --max-gap: exit 1 on a gap above it even when it is not significant (its 95% interval contains 0).",
        ),
    ] = False,
    fail_on: MeasureFailOnOpt = None,
    exit_zero: MeasureExitZeroOpt = False,
    config_file: ConfigOpt = None,
    isolated: IsolatedOpt = False,
    output_format: PageFormatOpt = PageFormat.table,
    output_path: ReportOutputOpt = None,
    force: ReportForceOpt = False,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Measure the train-mode vs eval-mode gap on data and find the BN layer responsible."""
    data_args = data_parameters(locals())  # before any other local: the command's own arguments

    def measure(options: DataOptions, config: Any, progress: Any) -> Any:
        from bnaudit.runtime.gap import measure_gap
        from bnaudit.runtime.models import ModelSpec

        spec = ModelSpec(
            checkpoint,
            arch=arch,
            arch_kwargs=arch_kwargs,
            key=key,
            trust_pickle=trust_pickle,
            forward=forward,
            device=device,
        )
        return measure_gap(
            spec,
            options,
            config=config,
            progress=progress,
            max_gap=max_gap,
            strict=strict,
            fail_on=fail_on.value if fail_on else None,
        )

    settings = ConfigSettings(config_file, isolated, exit_zero, output_path, force, checkpoint)
    raise typer.Exit(_measure_and_emit("gap", measure, data_args, settings, device, output_format, quiet, debug))


@dataclass(frozen=True)
class ConfigSettings:
    """The configuration, exit-code and report-file options gap and invariance share."""

    config_file: str | None
    isolated: bool
    exit_zero: bool
    output_path: str | None = None  # --output: the report's file (None: stdout)
    force: bool = False
    checkpoint: str | None = None  # the input the report file must not replace


def _measure_and_emit(
    what: str,
    measure: Callable[[DataOptions, Any, Any], Any],
    data_args: dict[str, Any],
    settings: ConfigSettings,
    device: str,
    output_format: PageFormat,
    quiet: bool,
    debug: bool,
) -> int:
    """gap and invariance: data options, the project's configuration (the inspect findings shown
    with the measurement follow it too), the measurement, the report; the exit code
    (`bnaudit.config.exit_code_for`, through the report).

    Under torchrun every rank measures its share and holds the same report, so exit codes
    agree; rank 0 alone prints it (the runner says which process prints), errors included in
    JSON. Errors are said inside the runner's block, before the ranks wait for each other:
    torchrun stops the other ranks as soon as one exits. The exit code is asked before the
    report is printed: a report may find its own options wrong (gap's --max-gap without
    labels is an error, exit 2).
    """
    from bnaudit.audit.rules import accepted_codes
    from bnaudit.config import load_config

    json_output = output_format is PageFormat.json
    # runtime/ needs torch: its absence is said here, by any process (no torchrun without torch)
    with user_errors(debug, json_output):
        from bnaudit.runtime.distributed import prints, torchrun
        from bnaudit.runtime.models import resolve_device
    printing = prints()
    with user_errors(debug, json_output and printing):
        inputs = [p for p in (settings.checkpoint, data_args.get("data")) if p]
        destination = Destination(output_format.value, settings.output_path, settings.force, inputs)
        options = data_options(**data_args)  # the data options, built once
        config = load_config(config_file=settings.config_file, isolated=settings.isolated, rule_codes=accepted_codes())
        quiet_bar = quiet or json_output or not printing
        with (
            frozen_imports(),
            torchrun(resolve_device(device), wait=True),
            user_errors(debug, json_output and printing),
        ):
            with output.progress(what, sys.stderr, quiet=quiet_bar) as update:
                report = measure(options, config, update)
            code: int = report.exit_code(exit_zero=settings.exit_zero)
            if printing:
                output.emit(report, output_format.value, destination.stream, quiet=quiet)
                destination.finish()
    return code


def invariance(
    checkpoint: Annotated[
        str,
        typer.Argument(
            metavar="CHECKPOINT",
            help="A state dict (with --arch), a TorchScript archive or a pickled nn.Module; or a folder holding one (as inspect finds it).",
        ),
    ],
    data: DataOpt = None,
    dataset: DatasetOpt = None,
    arch: ArchOpt = None,
    arch_kwargs: ArchKwargsOpt = None,
    key: KeyOpt = None,
    trust_pickle: TrustPickleOpt = False,
    forward: ForwardOpt = None,
    batch_sizes: Annotated[
        Optional[str],
        typer.Option(
            "--batch-sizes",
            metavar="B1,B2,...",
            help="Batch sizes to score each sample in, comma list; 1 scores it alone (default: 1 and --batch-size).",
        ),
    ] = None,
    batch_size: Annotated[
        int, typer.Option("--batch-size", metavar="N", help="Samples per batch when --batch-sizes is not given.")
    ] = 64,
    num_samples: Annotated[
        int, typer.Option("--num-samples", metavar="N", help="Samples to score in every arrangement.")
    ] = 256,
    seed: Annotated[
        int, typer.Option("--seed", metavar="SEED", help="Seed of the sample order and of the other companions.")
    ] = 0,
    no_shuffle: NoShuffleOpt = False,
    device: DeviceOpt = "cpu",
    workers: WorkersOpt = 0,
    image_size: ImageSizeOpt = None,
    grayscale: GrayscaleOpt = False,
    mean: MeanOpt = None,
    std: StdOpt = None,
    skip_bad: SkipBadOpt = False,
    fail_on: MeasureFailOnOpt = None,
    exit_zero: MeasureExitZeroOpt = False,
    config_file: ConfigOpt = None,
    isolated: IsolatedOpt = False,
    output_format: PageFormatOpt = PageFormat.table,
    output_path: ReportOutputOpt = None,
    force: ReportForceOpt = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar and no arrangement table.")] = False,
    debug: DebugOpt = False,
) -> None:
    """Test whether a prediction depends on the other samples in its batch, and find where."""
    data_args = data_parameters(locals())  # before any other local: the command's own arguments

    def measure(options: DataOptions, config: Any, progress: Any) -> Any:
        from bnaudit.runtime.invariance import measure_invariance, parse_batch_sizes
        from bnaudit.runtime.models import ModelSpec

        spec = ModelSpec(
            checkpoint,
            arch=arch,
            arch_kwargs=arch_kwargs,
            key=key,
            trust_pickle=trust_pickle,
            forward=forward,
            device=device,
        )
        return measure_invariance(
            spec,
            options,
            config=config,
            progress=progress,
            batch_sizes=parse_batch_sizes(batch_sizes, batch_size),
            fail_on=fail_on.value if fail_on else None,
        )

    settings = ConfigSettings(config_file, isolated, exit_zero, output_path, force, checkpoint)
    raise typer.Exit(_measure_and_emit("invariance", measure, data_args, settings, device, output_format, quiet, debug))

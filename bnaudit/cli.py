"""The typer app: parse options, call one core function, `bnaudit.output.emit`, exit code.

Report on stdout, diagnostics on stderr. Every `BnauditError` (and any unexpected
exception, unless --debug) ends as one line on stderr and exit code 2. Values are checked
where they are used (`load_config`, `DataOptions.validate`, the core functions), so that
the library and the CLI refuse the same things with the same words.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from enum import Enum
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from bnaudit import __version__, fastcli, output
from bnaudit.audit.settings import DEFAULT_EPS, DEFAULT_MOMENTUM
from bnaudit.errors import BnauditError, OutputClosed

if TYPE_CHECKING:
    from bnaudit.runtime.data import DataOptions

# typer would import pydantic to convert each option; plain ones do not need it. On a
# typer other than the one fastcli was written for this patches nothing (plain typer).
fastcli.install()
fastcli.metavars_as_given()

_APP_SETTINGS: dict[str, Any] = dict(
    name="bnaudit",
    help="Audit the BatchNorm running statistics of PyTorch models before they ship.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    # help uses the terminal's whole width (click's default stops at 80 columns)
    context_settings={"max_content_width": 10_000},
)
app = typer.Typer(**_APP_SETTINGS)


class Format(str, Enum):
    table = "table"
    json = "json"


class InspectFormat(str, Enum):
    table = "table"
    json = "json"
    sarif = "sarif"


class Severity(str, Enum):
    error = "error"
    warning = "warning"
    info = "info"


def _version(value: bool) -> None:
    if value:
        typer.echo(f"bnaudit {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        Optional[bool], typer.Option("--version", callback=_version, is_eager=True, help="Show the version and exit.")
    ] = None,
) -> None:
    """Audit the BatchNorm running statistics of PyTorch models before they ship."""


@contextlib.contextmanager
def user_errors(debug: bool, json_output: bool = False) -> Iterator[None]:
    """The one boundary where errors become a line on stderr and exit code 2 (with
    `json_output`, also an `{"error": ...}` document on stdout)."""
    try:
        yield
    except BnauditError as exc:
        _fail(str(exc), json_output)
    except KeyboardInterrupt:
        output.emit_interrupted(sys.stderr)
        raise typer.Exit(130) from None
    except (typer.Exit, OutputClosed):
        raise  # OutputClosed: the reader left (`| head`); main() ends quietly
    except Exception as exc:  # a bug: one line unless the user asks for the traceback
        if debug:
            raise
        _fail(f"internal error: {type(exc).__name__}: {exc} (run with --debug for the traceback)", json_output)


def _fail(message: str, json_output: bool) -> None:
    output.emit_error(message, sys.stderr, json_stream=sys.stdout if json_output else None)
    raise typer.Exit(2)


DebugOpt = Annotated[bool, typer.Option("--debug", help="Show tracebacks instead of one-line errors.")]


@app.command()
def inspect(
    paths: Annotated[
        list[str],
        typer.Argument(
            metavar="PATHS...",
            help="Checkpoint files, shard indexes (*.safetensors.index.json) or directories (searched for .pt .pth .ckpt .bin .tar .safetensors and shard indexes).",
        ),
    ],
    output_format: Annotated[
        InspectFormat, typer.Option("--format", "-f", help="Report format (sarif: SARIF 2.1.0 for code scanning).")
    ] = InspectFormat.table,
    fail_on: Annotated[
        Optional[Severity],
        typer.Option(
            help="Exit 1 when a finding is at or above this severity (default: warning, or fail-on from the configuration)."
        ),
    ] = None,
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
    config_file: Annotated[
        Optional[str],
        typer.Option(
            "--config",
            metavar="PATH",
            help="Read this configuration file instead of the nearest bnaudit.toml / pyproject.toml [tool.bnaudit].",
        ),
    ] = None,
    isolated: Annotated[bool, typer.Option("--isolated", help="Read no configuration file.")] = False,
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
) -> None:
    """Audit every BatchNorm layer of checkpoints, without code or data."""
    from bnaudit.audit.audit import inspect as run_inspect
    from bnaudit.audit.rules import accepted_codes
    from bnaudit.config import load_config

    with user_errors(debug, output_format is InspectFormat.json):
        overrides = {
            "--fail-on": fail_on.value if fail_on else None,
            "--eps": eps,
            "--momentum": momentum,
            "--select": _code_list(select),
            "--ignore": _code_list(ignore),
        }
        config = load_config(overrides, config_file=config_file, isolated=isolated, rule_codes=accepted_codes())
        report = run_inspect(
            paths, config, key=key, trust_pickle=trust_pickle, arch=arch, arch_kwargs=arch_kwargs, debug=debug
        )
        # emitting stays inside the boundary: the values it prints come from the files
        output.emit(report, output_format.value, sys.stdout, quiet=quiet, all_layers=all_layers)
    output.emit_diagnostics(report, sys.stderr, output_format.value)
    raise typer.Exit(report.exit_code(exit_zero=exit_zero))


def _code_list(values: list[str] | None) -> list[str] | None:
    """`--select BN002,BN005 --select BN008` -> ["BN002", "BN005", "BN008"]."""
    if values is None:
        return None
    return [code for value in values for code in value.split(",") if code.strip()]


@app.command("rules")
def rules_command(
    code: Annotated[
        Optional[str], typer.Argument(metavar="[CODE]", help="A rule code, e.g. BN004: explain that rule.")
    ] = None,
    config_file: Annotated[
        Optional[str],
        typer.Option(
            "--config",
            metavar="PATH",
            help="Read this configuration file instead of the nearest bnaudit.toml / pyproject.toml [tool.bnaudit].",
        ),
    ] = None,
    isolated: Annotated[bool, typer.Option("--isolated", help="Read no configuration file.")] = False,
    debug: DebugOpt = False,
) -> None:
    """List the rules, or explain one: what it detects, why it matters, how to fix and silence it."""
    from bnaudit.audit.rules import accepted_codes
    from bnaudit.config import load_config

    with user_errors(debug):
        # severities as this project's configuration sets them
        config = load_config(config_file=config_file, isolated=isolated, rule_codes=accepted_codes())
        output.render_rules(sys.stdout, code, overrides=config.severity)


# ----------------------------------------------------------------------------- gap
# Options shared by the commands that run a model on data (gap, invariance, recalibrate).

ArchOpt = Annotated[
    Optional[str],
    typer.Option(
        "--arch",
        metavar="MODULE:CALLABLE",
        help="MODULE:CALLABLE or path/to/file.py:CALLABLE that builds the model (imported with the current directory on sys.path).",
    ),
]
ArchKwargsOpt = Annotated[
    Optional[str],
    typer.Option(
        "--arch-kwargs",
        metavar="JSON",
        help="JSON object of keyword arguments for --arch, e.g. '{\"num_classes\": 10}'.",
    ),
]
KeyOpt = Annotated[
    Optional[str],
    typer.Option("--key", metavar="KEY", help="Container key of the state dict to load (e.g. model_ema)."),
]
TrustPickleOpt = Annotated[
    bool,
    typer.Option(
        "--trust-pickle",
        help="Unpickle arbitrary classes (a pickled model of your own): runs code from the file. Only for files you trust.",
    ),
]
ForwardOpt = Annotated[
    Optional[str],
    typer.Option(
        "--forward",
        metavar="MODULE:CALLABLE",
        help="MODULE:CALLABLE fn(model, batch) -> logits, for models that take something else than a tensor, tuple or dict.",
    ),
]
DataOpt = Annotated[
    Optional[str],
    typer.Option(
        "--data",
        metavar="PATH",
        help="An ImageFolder (one subfolder per class), a .safetensors/.pt file with 'inputs' (and 'labels'), or a folder of such shards.",
    ),
]
DatasetOpt = Annotated[
    Optional[str],
    typer.Option(
        "--dataset",
        metavar="MODULE:CALLABLE",
        help="MODULE:CALLABLE returning a map-style torch Dataset (instead of --data).",
    ),
]
BatchSizeOpt = Annotated[
    int, typer.Option("--batch-size", metavar="N", help="Samples per batch (train-mode results depend on it).")
]
NumSamplesOpt = Annotated[
    Optional[int], typer.Option("--num-samples", metavar="N", help="Use at most this many samples (default: all).")
]
SeedOpt = Annotated[int, typer.Option("--seed", metavar="SEED", help="Seed of the shuffled sample order.")]
NoShuffleOpt = Annotated[
    bool, typer.Option("--no-shuffle", help="Keep file order (a class-sorted folder then gives one-class batches).")
]
DeviceOpt = Annotated[str, typer.Option("--device", metavar="DEVICE", help="cpu, cuda, cuda:N or auto.")]
WorkersOpt = Annotated[
    int, typer.Option("--workers", metavar="N", help="DataLoader worker processes for reading and decoding.")
]
ImageSizeOpt = Annotated[
    Optional[int],
    typer.Option("--image-size", metavar="N", help="Images: resize the shorter side to N, then center-crop N x N."),
]
GrayscaleOpt = Annotated[bool, typer.Option("--grayscale", help="Images: one channel (default RGB).")]
MeanOpt = Annotated[
    Optional[str],
    typer.Option(
        "--mean", metavar="M1,M2,...", help="Images: per-channel mean to subtract, comma list (values in [0, 1] scale)."
    ),
]
StdOpt = Annotated[
    Optional[str], typer.Option("--std", metavar="S1,S2,...", help="Images: per-channel std to divide by, comma list.")
]
SkipBadOpt = Annotated[
    bool, typer.Option("--skip-bad", help="Images: count and skip unreadable files instead of stopping.")
]


def data_options(
    data: str | None,
    dataset: str | None,
    batch_size: int,
    num_samples: int | None,
    seed: int,
    no_shuffle: bool,
    workers: int,
    image_size: int | None,
    grayscale: bool,
    mean: str | None,
    std: str | None,
    skip_bad: bool,
) -> DataOptions:
    """The CLI's data options as a `bnaudit.runtime.data.DataOptions` (the core function
    that reads the data validates them)."""
    from bnaudit.runtime.data import DataOptions, parse_float_list

    return DataOptions(
        path=data,
        dataset=dataset,
        batch_size=batch_size,
        num_samples=num_samples,
        seed=seed,
        shuffle=not no_shuffle,
        workers=workers,
        image_size=image_size,
        grayscale=grayscale,
        mean=parse_float_list(mean, "--mean"),
        std=parse_float_list(std, "--std"),
        skip_bad=skip_bad,
    )


@contextlib.contextmanager
def frozen_imports() -> Iterator[None]:
    """Import torch, then, while the block runs, leave every object alive at that point out
    of the cyclic garbage collector's walks.

    gap and recalibrate allocate many short-lived objects per batch, and every so often
    that triggers a full collection, which walks every tracked object: torch's, typer's
    and bnaudit's modules, classes and functions (about 50 ms a walk, several per run),
    none of which can become garbage before the command ends. `gc.freeze` moves them to
    a generation the collector does not walk; reference counting still frees them, and
    objects created in the block are collected as before. Unfrozen on exit (the CLI may
    run inside another process: tests, `CliRunner`).
    """
    import gc

    import torch  # noqa: F401  (the bulk of them; the command needs it next anyway)

    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@app.command()
def gap(
    checkpoint: Annotated[
        str,
        typer.Argument(
            metavar="CHECKPOINT", help="A state dict (with --arch), a TorchScript archive or a pickled nn.Module."
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
    output_format: Annotated[Format, typer.Option("--format", "-f", help="Report format.")] = Format.table,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar and no per-layer table.")] = False,
    debug: DebugOpt = False,
) -> None:
    """Measure the train-mode vs eval-mode gap on data and find the BN layer responsible."""

    def measure(options: DataOptions, config: Any, progress: Any) -> Any:
        from bnaudit.runtime.gap import measure_gap

        return measure_gap(
            checkpoint,
            options,
            arch=arch,
            arch_kwargs=arch_kwargs,
            key=key,
            trust_pickle=trust_pickle,
            forward=forward,
            device=device,
            config=config,
            progress=progress,
            max_gap=max_gap,
            strict=strict,
        )

    data_args = (
        data,
        dataset,
        batch_size,
        num_samples,
        seed,
        no_shuffle,
        workers,
        image_size,
        grayscale,
        mean,
        std,
        skip_bad,
    )
    raise typer.Exit(_measure_and_emit("gap", measure, data_args, device, output_format, quiet, debug))


def _measure_and_emit(
    what: str,
    measure: Callable[[DataOptions, Any, Any], Any],
    data_args: tuple[Any, ...],
    device: str,
    output_format: Format,
    quiet: bool,
    debug: bool,
) -> int:
    """gap and invariance: data options, the project's configuration (the inspect findings shown
    with the measurement follow it too), the measurement, the report; the exit code.

    Under torchrun every rank measures its share and holds the same report, so exit codes
    agree; rank 0 alone prints it, errors included in JSON. Errors are said inside `reporting`,
    before the ranks wait for each other: torchrun stops the other ranks as soon as one exits.
    The exit code is asked before the report is printed: a report may find its own options
    wrong (gap's --max-gap without labels is an error, exit 2).
    """
    from bnaudit.audit.rules import accepted_codes
    from bnaudit.config import load_config
    from bnaudit.runtime.distributed import reporting
    from bnaudit.runtime.models import resolve_device

    json_output = output_format is Format.json
    rank = int(os.environ.get("RANK", "0"))
    with user_errors(debug, json_output and rank == 0):
        options = data_options(*data_args)
        config = load_config(rule_codes=accepted_codes())
        quiet_bar = quiet or json_output or rank != 0
        with frozen_imports(), reporting(resolve_device(device)), user_errors(debug, json_output and rank == 0):
            with output.progress(what, sys.stderr, quiet=quiet_bar) as update:
                report = measure(options, config, update)
            code: int = report.exit_code()
            if rank == 0:
                output.emit(report, output_format.value, sys.stdout, quiet=quiet)
    return code


# ----------------------------------------------------------------------------- invariance


@app.command()
def invariance(
    checkpoint: Annotated[
        str,
        typer.Argument(
            metavar="CHECKPOINT", help="A state dict (with --arch), a TorchScript archive or a pickled nn.Module."
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
    fail_on: Annotated[
        Optional[Severity],
        typer.Option(help="Exit 1 also when an inspect finding of the checkpoint is at or above this severity."),
    ] = None,
    exit_zero: Annotated[
        bool, typer.Option("--exit-zero", help="Exit 0 even when outputs depend on the batch (2 stays for errors).")
    ] = False,
    output_format: Annotated[Format, typer.Option("--format", "-f", help="Report format.")] = Format.table,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar and no arrangement table.")] = False,
    debug: DebugOpt = False,
) -> None:
    """Test whether a prediction depends on the other samples in its batch, and find where."""

    def measure(options: DataOptions, config: Any, progress: Any) -> Any:
        from bnaudit.runtime.invariance import measure_invariance, parse_batch_sizes

        return measure_invariance(
            checkpoint,
            options,
            arch=arch,
            arch_kwargs=arch_kwargs,
            key=key,
            trust_pickle=trust_pickle,
            forward=forward,
            device=device,
            config=config,
            progress=progress,
            batch_sizes=parse_batch_sizes(batch_sizes, batch_size),
            fail_on=fail_on.value if fail_on else None,
            exit_zero=exit_zero,
        )

    data_args = (
        data,
        dataset,
        batch_size,
        num_samples,
        seed,
        no_shuffle,
        workers,
        image_size,
        grayscale,
        mean,
        std,
        skip_bad,
    )
    raise typer.Exit(_measure_and_emit("invariance", measure, data_args, device, output_format, quiet, debug))


# ----------------------------------------------------------------------------- recalibrate


class Method(str, Enum):
    exact = "exact"
    sequential = "sequential"
    cumulative = "cumulative"


@app.command()
def recalibrate(
    checkpoint: Annotated[
        str,
        typer.Argument(
            metavar="CHECKPOINT", help="A state dict (with --arch), a TorchScript archive or a pickled nn.Module."
        ),
    ],
    output_path: Annotated[
        str,
        typer.Option(
            "--output",
            "-o",
            metavar="PATH",
            help="Where to write the recalibrated checkpoint: .safetensors writes safetensors, .pt/.pth/.ckpt/.bin a torch file, any other name the input's format.",
        ),
    ],
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
    force: Annotated[bool, typer.Option("--force", help="Overwrite --output if it exists.")] = False,
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
    output_format: Annotated[Format, typer.Option("--format", "-f", help="Report format.")] = Format.table,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar and no per-layer table.")] = False,
    debug: DebugOpt = False,
) -> None:
    """Re-estimate BatchNorm running statistics on data and write a new checkpoint safely."""
    import dataclasses

    from bnaudit.audit.rules import accepted_codes
    from bnaudit.config import load_config
    from bnaudit.runtime.recalibrate.command import recalibrate_checkpoint

    json_output = output_format is Format.json
    # under torchrun every rank runs this; rank 0 alone reports, errors included in JSON
    rank = int(os.environ.get("RANK", "0"))

    def warn(message: str) -> None:
        output.emit_warning(message, sys.stderr)

    with user_errors(debug, json_output and rank == 0):
        options = data_options(
            data,
            dataset,
            batch_size,
            num_samples,
            seed,
            no_shuffle,
            workers,
            image_size,
            grayscale,
            mean,
            std,
            skip_bad,
        )
        held_out = None if eval_data is None else dataclasses.replace(options, path=eval_data, dataset=None)
        # The inspect findings of the --eval-data gap reports follow the project's configuration.
        config = load_config(rule_codes=accepted_codes())
        quiet_bar = quiet or json_output or rank != 0
        with frozen_imports(), output.progress(f"recalibrate ({method.value})", sys.stderr, quiet=quiet_bar) as update:
            report = recalibrate_checkpoint(
                checkpoint,
                output_path,
                options,
                method=method.value,
                arch=arch,
                arch_kwargs=arch_kwargs,
                key=key,
                trust_pickle=trust_pickle,
                forward=forward,
                device=device,
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
        output.emit(report, output_format.value, sys.stdout, quiet=quiet)
    raise typer.Exit(0)


# ----------------------------------------------------------------------------- diff


@app.command("diff")
def diff_command(
    path_a: Annotated[str, typer.Argument(metavar="A", help="The checkpoint before (e.g. pretrained.pt).")],
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
    output_format: Annotated[
        InspectFormat, typer.Option("--format", "-f", help="Report format (sarif: SARIF 2.1.0 for code scanning).")
    ] = InspectFormat.table,
    fail_on: Annotated[
        Optional[Severity],
        typer.Option(
            help="Exit 1 when a finding is at or above this severity (default: warning, or fail-on from the configuration)."
        ),
    ] = None,
    exit_zero: Annotated[
        bool, typer.Option("--exit-zero", help="Exit 0 even when findings are at or above --fail-on.")
    ] = False,
    select: Annotated[
        Optional[list[str]],
        typer.Option(metavar="CODES", help="Run only these rules (codes or prefixes, e.g. BN101,BN104)."),
    ] = None,
    ignore: Annotated[
        Optional[list[str]], typer.Option(metavar="CODES", help="Do not report these rules (codes or prefixes).")
    ] = None,
    config_file: Annotated[
        Optional[str],
        typer.Option(
            "--config",
            metavar="PATH",
            help="Read this configuration file instead of the nearest bnaudit.toml / pyproject.toml [tool.bnaudit].",
        ),
    ] = None,
    isolated: Annotated[bool, typer.Option("--isolated", help="Read no configuration file.")] = False,
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
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print only the summary line and errors.")] = False,
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
    from bnaudit.audit.diff import diff as run_diff
    from bnaudit.audit.rules import accepted_codes
    from bnaudit.config import load_config

    with user_errors(debug, output_format is InspectFormat.json):
        overrides = {
            "--fail-on": fail_on.value if fail_on else None,
            "--eps": eps,
            "--momentum": momentum,
            "--select": _code_list(select),
            "--ignore": _code_list(ignore),
            "--expect-frozen": expect_frozen or None,
            "--expect-trained": expect_trained or None,
        }
        config = load_config(overrides, config_file=config_file, isolated=isolated, rule_codes=accepted_codes())
        if data is not None and arch is None:
            raise BnauditError("--data needs --arch (the model to run the checkpoint with)")
        if arch is not None or arch_kwargs is not None:
            if arch is None:
                raise BnauditError("--arch-kwargs needs --arch")
            from bnaudit.formats.sniff import sniff_format
            from bnaudit.runtime.exportparity import diff_export

            if sniff_format(path_b) != "onnx":
                raise BnauditError(f"--arch applies to a checkpoint against its ONNX export: {path_b} is not ONNX")
            options = None
            if data is not None:
                options = data_options(data, None, batch_size, num_samples, 0, True, 0, None, False, None, None, False)
            report = diff_export(
                path_a, path_b, config, arch, arch_kwargs, options, key=key_a, trust_pickle=trust_pickle
            )
        else:
            report = run_diff(path_a, path_b, config, key_a=key_a, key_b=key_b, trust_pickle=trust_pickle)
        output.emit(report, output_format.value, sys.stdout, quiet=quiet)
    code = report.exit_code()
    raise typer.Exit(0 if exit_zero and code == 1 else code)


def main() -> None:
    """The `bnaudit` executable: one line for a usage error, quiet when the reader of
    stdout goes away, the command's exit code otherwise."""
    try:
        code = _dispatch()
    except OutputClosed:
        # `bnaudit inspect ... | head -1`: the reader has what it wanted. Point stdout at
        # devnull so that the interpreter's final flush cannot fail a second time.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        code = 0
    sys.exit(code)


def usage_error_line(exc: Exception) -> str:
    """A command-line parsing error as one line: the option and the problem, in our words
    (no validator prefix such as "Value error, "), and where the help is."""
    import re

    message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
    message = message.replace("Value error, ", "")
    for pattern, words in (
        (r"Input should be a valid number, unable to parse string as a number", "expected a number"),
        (r"Input should be a valid integer, unable to parse string as an integer", "expected a whole number"),
        (r"Input should be a valid integer, got a number with a fractional part", "expected a whole number"),
    ):
        message = re.sub(pattern, words, message)
    message = re.sub(r"^Invalid value for '([^']+)': ", r"\1: ", message).rstrip(".")
    ctx = getattr(exc, "ctx", None)
    path = getattr(ctx, "command_path", None) or "bnaudit"
    return f"{message} (see {path} --help)"


def _dispatch() -> int:
    """Run the command line; the exit code."""
    command = _command()
    try:
        result = command.main(prog_name="bnaudit", standalone_mode=False)
    except typer.Exit as exc:
        return int(exc.exit_code)
    except typer.Abort:
        output.emit_interrupted(sys.stderr)
        return 130
    except Exception as exc:
        # typer's parser errors (UsageError, BadParameter, NoSuchOption, ...): their base
        # class is not public, but every one carries an exit code and a message
        if type(exc).__module__.startswith("typer.") and hasattr(exc, "exit_code"):
            if type(exc).__name__ == "NoArgsIsHelpError" and hasattr(exc, "show"):
                exc.show()  # `bnaudit` alone: the help, as typer prints it
            else:
                output.emit_error(usage_error_line(exc), sys.stderr)
            return int(exc.exit_code)
        raise
    return result if isinstance(result, int) else 0


def _command() -> Any:
    # typer builds the options of every command before it runs one (gap and recalibrate
    # have dozens: 6 ms of each pre-commit run of inspect). When the first argument names
    # a command, the group is built with that command alone; anything else (--help, a
    # typo that deserves "did you mean") gets the whole group. The lean group is built
    # from typer internals, so only on the typer they were checked against (fastcli).
    if not fastcli.lean_group_supported(app):
        return typer.main.get_command(app)
    named = [c for c in app.registered_commands if len(sys.argv) > 1 and _command_name(c) == sys.argv[1]]
    if not named:
        return typer.main.get_command(app)
    lean = typer.Typer(**_APP_SETTINGS)
    lean.registered_callback, lean.registered_commands = app.registered_callback, named
    return typer.main.get_group(lean)  # a group even with one command, as the full app


def _command_name(info: typer.models.CommandInfo) -> str:
    if info.name or info.callback is None:  # `app.command()` always records the function
        return info.name or ""
    return typer.main.get_command_name(info.callback.__name__)


if __name__ == "__main__":
    main()

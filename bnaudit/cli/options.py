"""Option declarations shared by several commands, the choice types, and the conversion of
the data options into the `DataOptions` the core functions take."""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from bnaudit.severity import Severity

if TYPE_CHECKING:
    from bnaudit.runtime.data import DataOptions


class Format(str, Enum):
    table = "table"
    json = "json"


class PageFormat(str, Enum):
    """The formats of the measurements that have a page too (gap, invariance, recalibrate):
    the table, JSON and html (bnaudit.output.html)."""

    table = "table"
    json = "json"
    html = "html"


class InspectFormat(str, Enum):
    """The formats of the commands that report findings at locations (inspect, diff, fold):
    the table, JSON, SARIF, what CI systems read (bnaudit.output: github, gitlab, junit,
    markdown), and a page (html)."""

    table = "table"
    json = "json"
    sarif = "sarif"
    github = "github"
    gitlab = "gitlab"
    junit = "junit"
    markdown = "markdown"
    html = "html"


class FoldFormat(str, Enum):
    """fed's formats: those of inspect, diff and fold but the page (its findings are at one
    file)."""

    table = "table"
    json = "json"
    sarif = "sarif"
    github = "github"
    gitlab = "gitlab"
    junit = "junit"
    markdown = "markdown"


DebugOpt = Annotated[bool, typer.Option("--debug", help="Show tracebacks instead of one-line errors.")]
FormatOpt = Annotated[Format, typer.Option("--format", "-f", help="Report format.")]
PageFormatOpt = Annotated[
    PageFormat,
    typer.Option("--format", "-f", help="Report format. html: one self-contained page with charts (the html extra)."),
]
InspectFormatOpt = Annotated[
    InspectFormat,
    typer.Option(
        "--format",
        "-f",
        help="Report format. sarif: SARIF 2.1.0 for code scanning; github: workflow-command annotations; gitlab: Code Quality JSON; junit: JUnit XML; markdown: a job summary ($GITHUB_STEP_SUMMARY); html: one self-contained page with charts (the html extra).",
    ),
]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar and no per-layer table.")]

# The configuration and exit-code options of every command (bnaudit.config: one exit policy).
ConfigOpt = Annotated[
    Optional[str],
    typer.Option(
        "--config",
        metavar="PATH",
        help="Read this configuration file instead of the nearest bnaudit.toml / pyproject.toml [tool.bnaudit].",
    ),
]
IsolatedOpt = Annotated[bool, typer.Option("--isolated", help="Read no configuration file.")]
IgnoreOpt = Annotated[
    Optional[list[str]], typer.Option(metavar="CODES", help="Do not report these rules (codes or prefixes).")
]
FailOnOpt = Annotated[
    Optional[Severity],
    typer.Option(
        "--fail-on",
        help="Exit 1 when a finding is at or above this severity (default: warning, or fail-on from the configuration).",
    ),
]
MeasureFailOnOpt = Annotated[
    Optional[Severity],
    typer.Option(
        "--fail-on",
        help="Exit 1 also when an inspect finding of the checkpoint is at or above this severity (default: none, or fail-on from the configuration).",
    ),
]
ExitZeroOpt = Annotated[
    bool,
    typer.Option(
        "--exit-zero",
        help="Exit 0 even when findings are at or above --fail-on (2 stays for usage errors and unreadable inputs).",
    ),
]
MeasureExitZeroOpt = Annotated[
    bool,
    typer.Option(
        "--exit-zero",
        help="Exit 0 even when the measurement fails its check (gap above --max-gap, outputs that depend on the batch) or a finding is at or above --fail-on (2 stays for errors).",
    ),
]


def code_list(values: list[str] | None) -> list[str] | None:
    """`--select BN002,BN005 --select BN008` -> ["BN002", "BN005", "BN008"]."""
    if values is None:
        return None
    return [code for value in values for code in value.split(",") if code.strip()]


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


# The parameters of the data options, named as every command that reads data names them.
DATA_PARAMETERS = (
    "data",
    "dataset",
    "batch_size",
    "num_samples",
    "seed",
    "no_shuffle",
    "workers",
    "image_size",
    "grayscale",
    "mean",
    "std",
    "skip_bad",
)


def data_parameters(values: Mapping[str, Any]) -> dict[str, Any]:
    """A command's data parameters, picked from its arguments (`locals()` at its start): the
    commands share these options, and build their `DataOptions` from them once."""
    return {name: values[name] for name in DATA_PARAMETERS if name in values}


def data_options(
    *,
    data: str | None,
    dataset: str | None = None,
    batch_size: int = 64,
    num_samples: int | None = None,
    seed: int = 0,
    no_shuffle: bool = False,
    workers: int = 0,
    image_size: int | None = None,
    grayscale: bool = False,
    mean: str | None = None,
    std: str | None = None,
    skip_bad: bool = False,
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

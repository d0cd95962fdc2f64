"""`bnaudit parity`'s numbers and verdicts, torch-free: what a deployed target computes at
each BN layer against eager PyTorch, and what differs at the first layer that diverges.

The measurement (`bnaudit.runtime.parity`) runs eager PyTorch (float32 and a float64
copy) and the target on the same batches and hands over one `LayerParity` per BN layer in
execution order (the order the eager forward first calls them), an `OutputParity` for the
final outputs, and the layers whose output the target did not show (`UnseenLayer`). The
statistics (channel_relative, rounding, noise floor, ratio, PARITY_FACTOR) are defined in
`bnaudit.audit.statistics`.

  first divergent   the first layer in execution order whose channel_relative exceeds
                    PARITY_FACTOR x its noise floor: where the target starts to compute
                    something else. Later layers that exceed it too follow from it, or add
                    their own difference: the measurement cannot tell those apart.
  outputs deviate   the largest relative_deviation of the target's outputs from eager's
                    exceeds PARITY_FACTOR x their noise floor. Top-1 agreement is reported
                    beside it, not judged: a near tie between two classes flips on noise.

What differs at a layer is read where it can be (`Evidence`): from the artifact itself
(`bnaudit diff`'s comparison of an ONNX export, a .pt2 program or a TorchScript file with
the checkpoint: eps, tensors, training mode, a folding that does not match), from the
compiled graph (the eps and training arguments of its batch_norm call as the backend left
them), and from the outputs: the per-channel least-squares line y = a r + b of the
target's values y against eager's r. A scale a != 1 is what another running_var, weight or
eps gives (with one eps for every channel that explains it, the eps is named); a shift b
alone is another running_mean or bias; values no line fits are no fixed change (batch
statistics: training mode); a float16 or bfloat16 output is precision.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from bnaudit.audit.export.folded import float32
from bnaudit.audit.statistics import PARITY_FACTOR, exceeds_floor
from bnaudit.config import Config
from bnaudit.text import listing, plural

if TYPE_CHECKING:  # the comparisons parity reads its evidence from
    from bnaudit.audit.diff.layers import LayerDiff
    from bnaudit.audit.export.diff import ExportCheck

TARGET_KINDS = ("compile", "onnx", "pt2", "torchscript")

# An affine fit leaves this share of the change unexplained, or more: no fixed per-channel change
NOT_AFFINE = 0.1
# a fitted scale or shift within this of the identity counts as none (float32 rounding of the fit)
FIT_TOLERANCE = 1e-4
# implied eps values within this relative spread count as one eps
EPS_SPREAD = 0.05


@dataclass(frozen=True)
class ParityTarget:
    """What the checkpoint is compared with: `kind` one of TARGET_KINDS, `path` the artifact
    (None for compile), `backend` the torch.compile backend (its registered name or the
    FILE.py:fn given; None for the others)."""

    kind: str
    path: str | None = None
    backend: str | None = None

    def describe(self) -> str:
        if self.kind == "compile":
            return f"torch.compile (backend {self.backend})"
        words = {"onnx": "ONNX model (onnxruntime, CPU)", "pt2": "torch.export program", "torchscript": "TorchScript"}
        return f"{words[self.kind]} {self.path}"


@dataclass(frozen=True)
class Fit:
    """The least-squares line y = scale * r + shift of one channel's target values y against
    eager's r, and `unexplained`: the share of the change y - r it leaves,
    sqrt(sum (y - scale r - shift)^2 / sum (y - r)^2) (0: a fixed scale and shift)."""

    channel: int
    scale: float
    shift: float
    unexplained: float


@dataclass(frozen=True)
class Evidence:
    """What is known at one layer about why the target may compute something else.

    static      differences read from the artifact or the compiled graph, in words, each
                naming its source ("epsilon 0.001 in the export, eps 1e-05 in the checkpoint")
    folded      the target's value is its producer's output, BN folded into it (the node named)
    dtype       the dtype of the target's output at the layer ("float32", "float16")
    fits        the fits of the channels above the threshold, worst first (at most a few)
    implied_eps one eps that explains every fitted scale, where there is one
    eps         the checkpoint layer's own eps
    """

    static: tuple[str, ...] = ()
    folded: str | None = None
    dtype: str = "float32"
    fits: tuple[Fit, ...] = ()
    implied_eps: float | None = None
    eps: float | None = None


@dataclass(frozen=True)
class LayerParity:
    """One BN layer: the target's output of it against eager's (statistics module docstring).

    site      where the target's value was read, in words ("BatchNormalization node X",
              "conv node Y (BN folded into it)", "batch_norm call of the compiled graph")
    floor     the noise floor; max_abs max |y - r| over every value; relative channel_relative
    calls     how often one forward calls the layer (every call is compared)
    channels_over  the channels whose channel_deviation exceeds PARITY_FACTOR x floor
    """

    name: str
    channels: int
    site: str
    floor: float
    max_abs: float
    relative: float
    calls: int = 1
    worst_channel: int | None = None
    channels_over: tuple[int, ...] = ()
    evidence: Evidence = field(default_factory=Evidence)

    @property
    def ratio(self) -> float:
        """relative / floor (NaN stays NaN)."""
        return self.relative / self.floor if self.floor > 0 else math.inf

    @property
    def diverges(self) -> bool:
        return exceeds_floor(self.relative, self.floor)


@dataclass(frozen=True)
class UnseenLayer:
    """A BN layer of the checkpoint whose output the target does not show, and why."""

    name: str
    reason: str


@dataclass(frozen=True)
class OutputParity:
    """The final outputs: `relative` the largest relative_deviation of a sample, `max_abs`
    max |y - r| (the largest change of a logit), `floor` their noise floor, `top1_agreement`
    the share of samples with the same argmax."""

    samples: int
    max_abs: float
    relative: float
    floor: float
    top1_agreement: float

    @property
    def deviates(self) -> bool:
        return exceeds_floor(self.relative, self.floor)


def first_divergent(layers: Sequence[LayerParity]) -> LayerParity | None:
    """The first layer (execution order) that diverges, None when none does."""
    return next((layer for layer in layers if layer.diverges), None)


def reading(layer: LayerParity) -> str:
    """What differs at `layer`, in words: the artifact's own differences first, then what the
    outputs show (module docstring)."""
    e = layer.evidence
    parts = list(e.static)
    if e.dtype in ("float16", "bfloat16"):
        parts.append(f"precision: the target computes the layer in {e.dtype}")
    if not parts:
        parts.append(_from_outputs(layer))
    if e.folded:  # where the value was read, not a cause by itself
        parts.append(f"(read at {e.folded}, which BN was folded into)")
    return "; ".join(parts)


def _from_outputs(layer: LayerParity) -> str:
    e = layer.evidence
    if not e.fits:
        return "nothing read from the artifact explains it"
    over = layer.channels_over
    which = (
        f"{plural(len(over), 'channel')} of {layer.channels} ({listing(over, 8)})"
        if len(over) < layer.channels
        else f"every channel of {layer.channels}"
    )
    if any(f.unexplained >= NOT_AFFINE for f in e.fits):
        return (
            f"{which} differ by no fixed scale and shift: the target normalises with other statistics on "
            "each batch (training mode?) or computes something else"
        )
    worst = e.fits[0]
    scaled = any(abs(f.scale - 1) > FIT_TOLERANCE for f in e.fits)
    numbers = f"channel {worst.channel}: y = {worst.scale:.4g} x eager + {worst.shift:.3g}"
    if scaled and e.implied_eps is not None and e.eps is not None:
        return f"{which} scaled as an eps of {e.implied_eps:.3g} instead of {e.eps:.3g} scales them ({numbers})"
    if scaled:
        return f"{which} scaled: their running_var, weight or eps differ ({numbers})"
    return f"{which} shifted: their running_mean or bias differ ({numbers})"


def implied_eps(scales: Sequence[tuple[float, float]], eps: float) -> float | None:
    """One eps e' that explains every (scale a_c, running_var v_c) pair, where there is one:
    a channel normalised with sqrt(v_c + e') instead of sqrt(v_c + eps) is scaled by
    a_c = sqrt((v_c + eps) / (v_c + e')), so e'_c = (v_c + eps) / a_c^2 - v_c; one e' when
    every e'_c is positive and they agree within EPS_SPREAD (relative). None otherwise."""
    values = [(v + eps) / (a * a) - v for a, v in scales if a > 0 and math.isfinite(a) and math.isfinite(v)]
    if not values or len(values) < len(scales) or min(values) <= 0:
        return None
    low, high = min(values), max(values)
    if (high - low) > EPS_SPREAD * high or math.isclose(high, eps, rel_tol=EPS_SPREAD):
        return None
    return sum(values) / len(values)


@dataclass(frozen=True)
class ParityContext:
    """What the parity rules read (BN401-BN403)."""

    layers: tuple[LayerParity, ...]
    unseen: tuple[UnseenLayer, ...]
    outputs: OutputParity
    target: ParityTarget
    config: Config


def threshold_words(floor: float) -> str:
    """The threshold of a noise floor, for messages: "threshold 1e-05 (10x the noise floor 1e-06)"."""
    return f"threshold {PARITY_FACTOR * floor:.0e}, {PARITY_FACTOR}x the noise floor {floor:.0e}"


def export_evidence(check: ExportCheck) -> dict[str, tuple[str, ...]]:
    """Layer -> what `bnaudit diff` found different in an export's node or folding for it
    (bnaudit.audit.export.diff: training mode, eps, tensors, a folding that does not match)."""
    found: dict[str, tuple[str, ...]] = {}
    for node in check.nodes:
        words = []
        if node.training_mode:
            why = f" ({node.training_reason})" if node.training_reason else ""
            words.append(f"the node normalises with the batch's statistics{why}")
        if node.eps_differs and not node.checkpoint.eps.assumed:
            words.append(
                f"epsilon {float32(node.eps_export):.3g} in the export, eps {node.eps_checkpoint:.3g} in the checkpoint"
            )
        for m in node.mismatches:
            words.append(
                f"{m.tensor} differs from the checkpoint's in {plural(m.channels, 'channel')} "
                f"(max |difference| {m.max_abs:.3g})"
            )
        if words:
            found[node.name] = tuple(words)
    for folded in check.folded:
        if not folded.check.matches and folded.fits_eps is None:
            found[folded.name] = (f"folded into {folded.node} with other statistics or eps: {folded.check.cause}",)
    return found


def checkpoint_evidence(layers: Sequence[LayerDiff]) -> dict[str, tuple[str, ...]]:
    """Layer -> what differs between the checkpoint and a file holding the same layers (a
    TorchScript archive), as `bnaudit diff` compares two checkpoints: tensors, eps."""
    found: dict[str, tuple[str, ...]] = {}
    for d in layers:
        words = []
        moved = [
            tensor
            for tensor, same in (
                ("weight", d.weight_identical),
                ("bias", d.bias_identical),
                ("running_mean", d.mean_identical),
                ("running_var", d.var_identical),
            )
            if not same
        ]
        if moved:
            words.append(f"{listing(moved, 4)} differ from the checkpoint's in the file")
        eps_a, eps_b = d.settings_a.eps, d.settings_b.eps
        if eps_a.known and eps_b.known and float32(d.eps_a) != float32(d.eps_b):
            words.append(f"eps {d.eps_b:.3g} in the file, {d.eps_a:.3g} in the checkpoint")
        if words:
            found[d.name] = tuple(words)
    return found

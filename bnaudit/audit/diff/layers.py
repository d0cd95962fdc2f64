"""How one BN layer changed between two checkpoints: the per-layer numbers of `bnaudit diff`.

Torch-free, like the rest of audit/. Separate from `diff.py` (which reads the files and
builds the report) so that the rule registry can judge `LayerDiff` records without
importing the module that imports the registry.

Definitions (side A is "before", side B "after"; every maximum runs over channels c):

  scale s          max(max_c |gamma_a,c|, 1e-3): the layer's output scale on side A
                   (1 when the layer has no affine weight); the floor keeps a layer whose
                   gammas all died from turning any change into infinity
  weight change    max_c |gamma_b,c - gamma_a,c| / s           (dimensionless)
  bias change      max_c |beta_b,c - beta_a,c| / s             (dimensionless: beta moves
                   the output by that many units of the layer's scale)
  max_mean_shift, max_var_log_ratio
                   as `bnaudit.audit.statistics` defines them, B's running statistics
                   compared against A's (the maxima over channels: one channel that
                   moved is what a diff looks for)
  batches change   num_batches_tracked_b - num_batches_tracked_a (None when either side
                   has no counter)

`eps` is side A's (bnaudit.audit.settings: the module's own, else --eps or the configuration,
else PyTorch's default).
"Identical" means bit-identical: every stored value has the same IEEE bit pattern once
widened exactly to float64 (the readers' widening is exact and one-to-one, so -0.0 and
0.0 differ, a NaN equals only the same NaN). A value changed by one ulp has moved.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING

from bnaudit.audit.layers import BNLayer
from bnaudit.audit.settings import Settings
from bnaudit.audit.statistics import channel_log_var_ratio, channel_shift
from bnaudit.config import Config
from bnaudit.text import plural

if TYPE_CHECKING:  # the export check's modules are needed only when one side is an export
    from bnaudit.audit.export.diff import ExportCheck

SCALE_FLOOR = 1e-3

# Verdicts of a matched layer; the rules BN101-BN103 report the first three.
FROZEN_BUT_UPDATING = "frozen but updating"
STALE = "stale statistics"
RE_ESTIMATED = "re-estimated"
TRAINED = "trained"
UNCHANGED = "unchanged"
# A checkpoint against its export (bnaudit.audit.export.diff): a kept BatchNormalization
# node whose tensors differ from the checkpoint's beyond float32 rounding (rule BN108).
EXPORT_DIFFERS = "differs from checkpoint"
VERDICTS = (FROZEN_BUT_UPDATING, STALE, RE_ESTIMATED, TRAINED, EXPORT_DIFFERS, UNCHANGED)


def bit_identical(a: list[float] | None, b: list[float] | None) -> bool:
    """Both absent, or the same length and the same float64 bit pattern in every value."""
    if a is None or b is None:
        return a is None and b is None
    if len(a) != len(b):
        return False
    if a == b and _all_finite_nonzero_safe(a):
        return True  # the common case, compared in C; zeros and NaN need the bytes
    return struct.pack(f"<{len(a)}d", *a) == struct.pack(f"<{len(b)}d", *b)


def _all_finite_nonzero_safe(values: list[float]) -> bool:
    """== agrees with bit identity when no value is NaN (NaN != NaN) and none is a zero
    (-0.0 == 0.0); the sum check is one C-speed pass."""
    return math.isfinite(sum(values)) and 0.0 not in values


def layer_scale(layer: BNLayer) -> float:
    """s = max(max_c |gamma_c|, 1e-3), or 1 without an affine weight."""
    if layer.weight is None or not layer.weight:
        return 1.0
    finite = [abs(w) for w in layer.weight if math.isfinite(w)]
    return max(max(finite, default=0.0), SCALE_FLOOR)


def max_abs_change(a: list[float] | None, b: list[float] | None, scale: float) -> float | None:
    """max_c |b_c - a_c| / scale; None when either side lacks the values or their lengths
    differ; NaN when a value is NaN."""
    if a is None or b is None or len(a) != len(b) or not a:
        return None
    return max(abs(y - x) for x, y in zip(a, b)) / scale


def max_mean_shift(a: BNLayer, b: BNLayer) -> float | None:
    """max_mean_shift (`bnaudit.audit.statistics`) of B's statistics against A's, with A's
    eps; NaN when any channel's shift is (a negative or NaN variance, a NaN mean)."""
    if a.num_features != b.num_features or not a.num_features:
        return None
    shifts = [channel_shift(mb, ma, va, a.eps) for ma, mb, va in zip(a.running_mean, b.running_mean, a.running_var)]
    return math.nan if any(math.isnan(x) for x in shifts) else max(shifts)


def max_var_log_ratio(a: BNLayer, b: BNLayer) -> float | None:
    """max_var_log_ratio (`bnaudit.audit.statistics`) of B's variances against A's, with
    A's eps; NaN when any channel's ratio is."""
    if a.num_features != b.num_features or not a.num_features:
        return None
    ratios = [channel_log_var_ratio(vb, va, a.eps) for va, vb in zip(a.running_var, b.running_var)]
    return math.nan if any(math.isnan(x) for x in ratios) else max(ratios)


@dataclass(frozen=True)
class LayerDiff:
    """One layer present on both sides with the same channel count.

    `*_identical`: that tensor bit-identical on both sides (both absent counts as
    identical). `batches_change` is B's counter minus A's. `verdict` is
    one of VERDICTS (see `classify`). `settings_a` / `settings_b`: each side's eps and
    momentum with their provenance (bnaudit.audit.settings).
    """

    name: str
    kind: str
    num_features: int
    weight_change: float | None
    bias_change: float | None
    max_mean_shift: float | None
    max_var_log_ratio: float | None
    batches_a: int | None
    batches_b: int | None
    weight_identical: bool
    bias_identical: bool
    mean_identical: bool
    var_identical: bool
    verdict: str
    settings_a: Settings
    settings_b: Settings
    recalibrated: bool = False
    # False when a side is an EMA copy: its counter is not a count of its batches (timm's
    # ModelEmaV2 averages and truncates it, 0 early on; ModelEmaV3 copies the live model's;
    # torchvision halves it; AveragedModel copies the live model's counter or averages it)
    counter_meaningful: bool = True

    @property
    def eps_a(self) -> float:
        return self.settings_a.eps_value

    @property
    def eps_b(self) -> float:
        return self.settings_b.eps_value

    @property
    def momentum_a(self) -> float | None:
        return self.settings_a.momentum.value

    @property
    def momentum_b(self) -> float | None:
        return self.settings_b.momentum.value

    @property
    def settings_known(self) -> bool:
        """Both sides' eps and momentum read from their files."""
        return self.settings_a.from_file and self.settings_b.from_file

    @property
    def stats_identical(self) -> bool:
        return self.mean_identical and self.var_identical

    @property
    def batches_change(self) -> int | None:
        if self.batches_a is None or self.batches_b is None:
            return None
        return self.batches_b - self.batches_a

    @property
    def params_identical(self) -> bool:
        return self.weight_identical and self.bias_identical

    @property
    def moved(self) -> list[str]:
        """What changed, in words: "weight", "bias", "running_mean", "running_var", "counter"."""
        flags = (
            ("weight", self.weight_identical),
            ("bias", self.bias_identical),
            ("running_mean", self.mean_identical),
            ("running_var", self.var_identical),
        )
        out = [name for name, identical in flags if not identical]
        if self.batches_change:
            out.append("num_batches_tracked")
        return out


def classify(params_identical: bool, stats_identical: bool, batches_change: int | None, recalibrated: bool) -> str:
    """The verdict of a layer.

    unchanged            parameters and statistics bit-identical (the counter may have
                         grown: momentum 0 counts without updating)
    frozen but updating  parameters identical, statistics moved, counter grew
    re-estimated         statistics moved while the counter was reset, replaced or is
                         unknown (parameters identical or not), or bnaudit's provenance
                         record names the layer
    stale statistics     parameters moved, statistics identical, counter not grown
    trained              everything else that moved (parameters and statistics with the
                         counter grown or unchanged, e.g. an EMA copy's counter)
    """
    grew = batches_change is not None and batches_change > 0
    if params_identical and stats_identical:
        return UNCHANGED
    if stats_identical:
        return TRAINED if grew else STALE
    if recalibrated:
        return RE_ESTIMATED
    if params_identical:
        return FROZEN_BUT_UPDATING if grew else RE_ESTIMATED
    if batches_change is not None and batches_change < 0:
        return RE_ESTIMATED
    return TRAINED


def compare_layers(a: BNLayer, b: BNLayer, recalibrated: bool = False, counter_meaningful: bool = True) -> LayerDiff:
    """The LayerDiff of two layers of the same name and channel count; without a
    meaningful counter (an EMA side) the verdict ignores the counters."""
    scale = layer_scale(a)
    same = {
        "weight": bit_identical(a.weight, b.weight),
        "bias": bit_identical(a.bias, b.bias),
        "mean": bit_identical(a.running_mean, b.running_mean),
        "var": bit_identical(a.running_var, b.running_var),
    }
    ta, tb = a.num_batches_tracked, b.num_batches_tracked
    change = None if ta is None or tb is None else tb - ta
    return LayerDiff(
        name=a.name,
        kind=b.kind,
        num_features=a.num_features,
        weight_change=max_abs_change(a.weight, b.weight, scale),
        bias_change=max_abs_change(a.bias, b.bias, scale),
        max_mean_shift=max_mean_shift(a, b),
        max_var_log_ratio=max_var_log_ratio(a, b),
        batches_a=a.num_batches_tracked,
        batches_b=b.num_batches_tracked,
        weight_identical=same["weight"],
        bias_identical=same["bias"],
        mean_identical=same["mean"],
        var_identical=same["var"],
        verdict=classify(
            same["weight"] and same["bias"],
            same["mean"] and same["var"],
            change if counter_meaningful else None,
            recalibrated,
        ),
        settings_a=a.settings,
        settings_b=b.settings,
        recalibrated=recalibrated,
        counter_meaningful=counter_meaningful,
    )


@dataclass(frozen=True)
class DiffContext:
    """What the diff rules (BN1xx) judge: matched layers, layers on one side only,
    channel-count changes, the settings and bnaudit's provenance record of side B."""

    layers: list[LayerDiff]
    config: Config
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    reshaped: list[tuple[str, int, int]] = field(default_factory=list)  # name, C on A, C on B
    provenance: str = ""  # "bnaudit recalibrate (method ..., N samples, date)" when B has the record
    export: ExportCheck | None = None  # one side is an ONNX export of the other
    # One side an averaged copy (EMA/SWA), the other not: (copy's layer, live layer) of every
    # matched layer, and the copy's kind in words ("EMA copy (timm ModelEmaV3)")
    averaged_pairs: tuple[tuple[BNLayer, BNLayer], ...] = ()
    averaged_kind: str = ""


def unrelated(matched: int, reshaped: list[tuple[str, int, int]], only_a: list[str], only_b: list[str]) -> str | None:
    """Why two checkpoints look like different models, or None.

    Layers pair by name; generic names (`p2o.BatchNormalization.0`, `bn1`) pair between
    models that have nothing in common. With P = matched + reshaped pairs among the
    U = P + |only A| + |only B| layer names of both sides: different models when
    P < U / 2 (fewer than half of the layers pair) or reshaped > P / 2 (most pairs
    disagree in channel count).
    """
    pairs = matched + len(reshaped)
    names = pairs + len(only_a) + len(only_b)
    if pairs and 2 * pairs < names:
        return f"only {pairs} of {names} layers pair by name"
    if reshaped and 2 * len(reshaped) > pairs:
        return f"{len(reshaped)} of the {plural(pairs, 'layer')} that pair by name have other channel counts"
    return None


def matches(name: str, globs: tuple[str, ...]) -> bool:
    """Whether a layer name matches one of the globs (fnmatch, case-sensitive: `*`
    crosses dots, so `backbone.*` is every layer under backbone)."""
    return any(fnmatchcase(name, g) for g in globs)


def describe_group(names: list[str], all_names: list[str], limit: int = 4) -> str:
    """A short name for a group of layers among `all_names`: the shortest dotted prefixes
    that cover the group and no other layer (`backbone.*`), or the names themselves.

    >>> describe_group(["b.0.bn", "b.1.bn"], ["b.0.bn", "b.1.bn", "head.bn"])
    'b.*'
    """
    group = set(names)
    others = [n for n in all_names if n not in group]
    shown: list[str] = []
    for name in names:
        parts = name.split(".")
        label = name
        for i in range(1, len(parts)):
            prefix = ".".join(parts[:i]) + "."
            if not any(o.startswith(prefix) for o in others):
                label = prefix + "*"
                break
        if label not in shown:
            shown.append(label)
    more = f" and {len(shown) - limit} more" if len(shown) > limit else ""
    return ", ".join(shown[:limit]) + more

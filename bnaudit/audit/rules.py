"""The rule registry: stable codes, names, severities, explanations and checks.

Definitions used by every rule (and printed by the report):

  eval gain      g_c = |gamma_c| / sqrt(running_var_c + eps)   (gamma_c = 1 without affine)
                 the factor by which eval mode multiplies a channel's deviation from
                 running_mean; a dead channel (var ~ 0, gamma 1) at eps 1e-5 gets 316x.
  initial weight w = (1 - momentum)^t after t = num_batches_tracked updates: the share
                 the initial values (mean 0, var 1) still hold in the running buffers.
  near-eps       running_var_c < near_eps_factor * eps.
  live channel   |running_mean_c| >= sqrt(running_var_c + eps): the channel's data sits at
                 least one (eval-mode) standard deviation away from zero, so it carries a
                 signal; a dead channel (constant zero input) keeps mean ~0 and var ~0.
"""

from __future__ import annotations

import fnmatch
import itertools
import math
import operator
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

from bnaudit.audit import layerdiff
from bnaudit.audit.layerdiff import DiffContext, LayerDiff, describe_group, matches
from bnaudit.audit.layers import BNLayer, Discovery, ModuleFacts
from bnaudit.config import Config
from bnaudit.text import listing, plural

if TYPE_CHECKING:
    from bnaudit.audit.layers import BNLayer, Discovery, ModuleFacts


@dataclass(frozen=True)
class Finding:
    code: str
    name: str
    severity: str  # "error" | "warning" | "info"
    layer: str | None  # None for file-level findings
    message: str
    channels: tuple[int, ...] = ()


@dataclass(frozen=True)
class RuleContext:
    discovery: Discovery
    config: Config
    is_ema: bool = False
    # Set when a module is available (--arch, TorchScript, pickled module): BN001 is
    # then exact, and BN006 / BN007 / BN011 can speak.
    module: ModuleFacts | None = None
    # Layers whose statistics `bnaudit recalibrate` wrote (population statistics, not
    # an EMA: their counter is the number of calibration batches).
    recalibrated: frozenset[str] = frozenset()
    # Exported graphs (ONNX): BatchNormalization nodes whose statistics are not constants,
    # one note each, and the evidence of BN folded into Conv nodes (Checkpoint.folded).
    unauditable: tuple[str, ...] = ()
    folded: str | None = None


@dataclass(frozen=True)
class Rule:
    code: str
    name: str
    severity: str  # default severity; "error / warning" when it depends on the case
    summary: str
    explanation: str
    fix: str
    # a RuleContext for inspect's rules, a layerdiff.DiffContext for diff's
    check: Callable[[Any], Iterable[Finding]] = field(repr=False)
    settings: tuple[str, ...] = ()  # configuration keys (config.KEYS) that tune the rule
    command: str = "inspect"  # the command whose reports the rule speaks in: "inspect" or "diff"

    def finding(self, severity: str, layer: str | None, message: str, channels: Iterable[int] = ()) -> Finding:
        return Finding(self.code, self.name, severity, layer, message, tuple(int(c) for c in channels))


RULES: dict[str, Rule] = {}

_Check = TypeVar("_Check", bound=Callable[[Any], Iterable[Finding]])


def rule(
    code: str,
    name: str,
    severity: str,
    summary: str,
    explanation: str,
    fix: str,
    settings: tuple[str, ...] = (),
    command: str = "inspect",
) -> Callable[[_Check], _Check]:
    def register(check: _Check) -> _Check:
        RULES[code] = Rule(code, name, severity, summary, explanation, fix, check, settings, command)
        return check

    return register


def _all_finite(values: list[float]) -> bool:
    """No NaN or Inf among the values: one C-speed sum (a sum that overflows only sends
    the caller down its slower per-value path)."""
    return math.isfinite(sum(values))


def eval_gain(layer: BNLayer) -> list[float]:
    """g_c = |gamma_c| / sqrt(running_var_c + eps); NaN where var is non-finite or < 0."""
    var, eps = layer.running_var, layer.eps
    gamma = layer.weight if layer.weight is not None and len(layer.weight) == len(var) else [1.0] * len(var)
    if eps > 0 and _all_finite(var) and min(var, default=0.0) >= 0:  # every denominator > 0
        # map over builtins: the loop runs in C, 3x faster than a comprehension
        return list(
            map(operator.truediv, map(abs, gamma), map(math.sqrt, map(operator.add, var, itertools.repeat(eps))))
        )
    return [_gain(g, v, eps) for g, v in zip(gamma, var)]


def _gain(gamma: float, var: float, eps: float) -> float:
    """|gamma| / sqrt(var + eps) in IEEE float64, as a vectorised library would give it
    (x/0 = inf, 0/0 = NaN, sqrt of a negative = NaN), instead of Python's exceptions."""
    if not math.isfinite(var) or var < 0:
        return math.nan
    denominator = var + eps
    if denominator > 0:
        return abs(gamma) / math.sqrt(denominator)
    if denominator == 0:
        return math.nan if gamma == 0 or math.isnan(gamma) else math.inf
    return math.nan


def _is_live(layer: BNLayer, channel: int) -> bool:
    """|running_mean_c| >= sqrt(running_var_c + eps): see "live channel" above."""
    mean, var = layer.running_mean[channel], layer.running_var[channel]
    return math.isfinite(mean) and abs(mean) >= math.sqrt(max(var, 0.0) + layer.eps)


def near_eps_channels(layer: BNLayer, factor: float) -> list[int]:
    """Indices of channels with 0 <= running_var < factor * eps."""
    limit, var = factor * layer.eps, layer.running_var
    if _all_finite(var) and min(var, default=limit) >= limit:  # the common case: none
        return []
    return [c for c, v in enumerate(var) if 0 <= v < limit]  # NaN compares False


# From here on the initial 0/1 outweigh everything the buffers have seen: an error.
IMMATURE_ERROR_WEIGHT = 0.5


def _initial_weight(momentum: float, updates: int) -> float:
    """w = (1 - momentum)^t: the weight the initial 0/1 values keep after t updates."""
    return float((1.0 - momentum) ** updates)


def _has_identity_stats(layer: BNLayer) -> bool:
    """running_mean == 0 and running_var == 1 in every channel of a layer that has channels.

    A 0-channel layer holds no statistics to lose: "every channel" must not be vacuous.
    """
    return layer.num_features > 0 and _all_equal(layer.running_mean, 0.0) and _all_equal(layer.running_var, 1.0)


def _all_equal(values: list[float], value: float) -> bool:
    return values.count(value) == len(values)  # count: == in C (NaN never equal, -0.0 == 0.0)


def _has_initial_affine(layer: BNLayer) -> bool:
    return (layer.weight is None or _all_equal(layer.weight, 1.0)) and (
        layer.bias is None or _all_equal(layer.bias, 0.0)
    )


def _fmt(x: float) -> str:
    return f"{x:.3g}"


@rule(
    "BN001",
    "missing-buffers",
    "error / warning",
    "A layer lacks running_mean or running_var, or the file holds BN parameters without any buffers.",
    "Eval mode normalises with running_mean and running_var. A checkpoint saved without them "
    "(parameters only, a filtered state dict, `strict=False` on load) gives every BN layer the "
    "initial 0 and 1 when it is loaded, so eval mode computes (x - 0) / sqrt(1 + eps) instead of "
    "(x - mu) / sqrt(var + eps). Error: a layer has some of its buffers but not both statistics. "
    "Warning (suspected): the file has 1-D weight/bias pairs under batch-norm-like names "
    "(bn, batchnorm, downsample.1, ...) and no running statistics at all; LayerNorm or GroupNorm "
    "layers named that way are the innocent explanation. When the model is known (--arch, "
    "TorchScript, a pickled module) the check is exact: every BN module of the model whose "
    "running_mean or running_var is absent from the checkpoint is an error, whatever its name.",
    "Save `model.state_dict()` (it includes buffers), not `named_parameters()`; load with "
    "strict=True; or re-estimate the statistics with `bnaudit recalibrate`.",
)
def _check_missing_buffers(ctx: RuleContext) -> Iterator[Finding]:
    r = RULES["BN001"]
    if ctx.module is not None:
        # Exact: the model names its BN modules, so no name heuristics are needed.
        missing = set(ctx.module.missing)
        for name in ctx.module.norms:
            absent = [s for s in ("running_mean", "running_var") if _join(name, s) in missing]
            if absent:
                yield r.finding(
                    "error",
                    name,
                    f"the model's {ctx.module.norms[name].class_name} has no {' or '.join(absent)} in the "
                    "checkpoint: loading leaves the initial 0/1 and eval mode normalises with them",
                )
        return
    for group in ctx.discovery.incomplete:
        yield r.finding(
            "error",
            group.name,
            f"has {', '.join(group.present)} but no {' or '.join(group.missing)}",
        )
    suspected = ctx.discovery.suspected_without_buffers
    if suspected:
        shown = ", ".join(suspected[:5]) + (f" and {len(suspected) - 5} more" if len(suspected) > 5 else "")
        yield r.finding(
            "warning",
            None,
            f"{plural(len(suspected), 'batch-norm-like parameter group')} ({shown}) and no running "
            "statistics anywhere: parameters saved without buffers? (LayerNorm/GroupNorm named "
            "this way would be innocent)",
        )


@rule(
    "BN002",
    "initial-values",
    "error",
    "running_mean is exactly 0 and running_var exactly 1 in every channel: statistics lost, reset or never loaded.",
    "Training never leaves the statistics at exactly 0 and 1 in every channel, so these values mean the "
    "buffers were reset (`reset_running_stats()`), never loaded, or never updated. Eval mode then "
    "normalises with mean 0 and variance 1, whatever the data's real statistics. If weight and bias "
    "are also at their initial 1 and 0 the whole layer is untrained. Exception: when no layer has a "
    "counter and every layer has identity statistics with trained weights, the statistics were folded "
    "into weight and bias (Caffe2/detectron2 FrozenBatchNorm): reported as info.",
    "Reload the statistics from the original training checkpoint, or re-estimate them with "
    "`bnaudit recalibrate` on representative data.",
)
def _check_initial_values(ctx: RuleContext) -> Iterator[Finding]:
    r = RULES["BN002"]
    layers = ctx.discovery.layers
    identity = [layer for layer in layers if _has_identity_stats(layer)]
    if not identity:
        return
    folded = (
        len(identity) == len(layers)
        and all(layer.num_batches_tracked is None for layer in layers)
        and all(not _has_initial_affine(layer) for layer in layers)
    )
    if folded:
        yield r.finding(
            "info",
            None,
            f"all {len(layers)} layers have identity statistics, trained weights and no counter: "
            "statistics folded into weight/bias (FrozenBatchNorm, Caffe2/detectron2 style)",
        )
        return
    for layer in identity:
        if layer.weight is None and layer.bias is None:
            message = "running_mean is 0 and running_var is 1 in every channel (no affine parameters)"
        elif _has_initial_affine(layer):
            message = "layer looks untrained: statistics 0/1 and weight 1, bias 0 as initialised"
        else:
            message = (
                "running_mean is 0 and running_var is 1 in every channel while weight/bias are "
                "trained: statistics lost, reset or never loaded"
            )
        if layer.num_batches_tracked:
            message += f" (num_batches_tracked = {layer.num_batches_tracked})"
        yield r.finding("error", layer.name, message)


@rule(
    "BN003",
    "immature-stats",
    "error / warning",
    "After t = num_batches_tracked updates the initial values still weigh (1-momentum)^t above the threshold.",
    "The running buffers start at mean 0 and variance 1 and move by new = (1-m)*old + m*batch. After t "
    "updates the initial values keep the weight (1-m)^t: 0.9^3 = 72.9% after 3 updates at momentum "
    "0.1, still 4.2% after 30. A short fine-tune leaves buffers that describe no data. Error when "
    "the initial values weigh 50% or more (the buffers are then more initialisation than data: two "
    "updates at momentum 0.1 leave 81%), warning between the threshold and 50%. Default "
    "threshold 5% (`max-init-weight`). EMA copies are not checked (their counter means nothing), nor "
    "layers that the file's recalibration record says `bnaudit recalibrate` wrote (population "
    "statistics: their counter is the number of calibration batches).",
    "Train longer, or re-estimate the statistics with `bnaudit recalibrate` (a few thousand samples suffice).",
    settings=("max-init-weight", "momentum"),
)
def _check_immature(ctx: RuleContext) -> Iterator[Finding]:
    if ctx.is_ema:
        return
    r = RULES["BN003"]
    for layer in ctx.discovery.layers:
        t, m = layer.num_batches_tracked, layer.momentum
        if layer.name in ctx.recalibrated:
            continue
        if t is None or t <= 0 or m is None or not 0.0 < m < 1.0 or _has_identity_stats(layer):
            continue
        weight = _initial_weight(m, t)
        if weight > ctx.config.max_init_weight:
            assumed = " (assumed)" if layer.settings_assumed else ""
            yield r.finding(
                "error" if weight >= IMMATURE_ERROR_WEIGHT else "warning",
                layer.name,
                f"initial values still weigh {weight * 100:.1f}% after {plural(t, 'update')} at momentum {m:g}{assumed}",
            )


@rule(
    "BN004",
    "near-eps-variance",
    "error / warning / info",
    "Channels with running_var < 10*eps: eval mode multiplies them by |gamma|/sqrt(var+eps).",
    "A channel that died in training keeps a running variance near 0. In eval mode its deviation from "
    "running_mean is multiplied by the eval gain |gamma| / sqrt(var + eps): 1/sqrt(1e-5) = 316x for "
    "gamma 1 at eps 1e-5. Any input that moves that channel slightly is amplified hundreds of times "
    "and the model turns brittle. Warning when some such channel's gain is >= 100 (`max-gain`); info "
    "when a small |gamma| mutes all of them. Error when such a channel is live, its "
    "|running_mean| >= sqrt(running_var + eps), and its gain exceeds `max-live-gain` (100): a dead "
    "channel (its input always 0) has mean ~0 as well as var ~0, so eval mode multiplies ~0 by the "
    "gain and little happens; that is plausible and stays a warning. A channel whose mean sits many "
    "standard deviations away from 0 carries a real signal, and a variance that small for it means "
    "the statistics are broken (a corrupted or mis-converted buffer): every natural fluctuation of "
    "the signal is multiplied hundreds of times. Threshold factor 10 (`near-eps-factor`).",
    "Prune the dead channels, or check the data that reaches the layer; `bnaudit gap` shows whether eval mode suffers.",
    settings=("near-eps-factor", "max-gain", "max-live-gain", "eps"),
)
def _check_near_eps(ctx: RuleContext) -> Iterator[Finding]:
    r = RULES["BN004"]
    cfg = ctx.config
    for layer in ctx.discovery.layers:
        channels = near_eps_channels(layer, cfg.near_eps_factor)
        if not channels:
            continue
        all_gains = eval_gain(layer)
        gains = {c: all_gains[c] for c in channels}
        worst = max(g for g in gains.values() if not math.isnan(g)) if any(map(math.isfinite, gains.values())) else 0.0
        live = [c for c in channels if _is_live(layer, c) and gains[c] > cfg.max_live_gain]
        severity = "error" if live else "warning" if worst >= cfg.max_gain else "info"
        # worst first, NaN last; sorted is stable, so ties keep channel order
        order = sorted(channels, key=lambda c: -(0.0 if math.isnan(gains[c]) else gains[c]))
        details = ", ".join(f"ch {c} (var {_fmt(layer.running_var[c])}, gain {gains[c]:.1f})" for c in order[:5])
        more = f" and {len(channels) - 5} more" if len(channels) > 5 else ""
        if severity == "error":
            tail = (
                f"; ch {listing(live, 5)} {'is' if len(live) == 1 else 'are'} live (|mean| >= sqrt(var+eps)) "
                f"with gain above {cfg.max_live_gain:g}"
            )
        else:
            tail = "" if severity == "warning" else f"; muted by small |gamma| (max gain {worst:.1f})"
        yield r.finding(
            severity,
            layer.name,
            f"{plural(len(channels), 'channel')} with running_var < {cfg.near_eps_factor:g}*eps "
            f"({_fmt(cfg.near_eps_factor * layer.eps)}): {details}{more}{tail}",
            channels,
        )


@rule(
    "BN005",
    "invalid-values",
    "error",
    "NaN or Inf in a buffer or parameter, negative running_var or counter, or shapes that disagree.",
    "A NaN or Inf in running_mean/running_var makes every eval-mode output of the channel NaN; a "
    "negative variance makes sqrt(var + eps) NaN. These come from fp16 overflow, a diverged step or a "
    "broken conversion. A weight or bias whose length differs from the statistics cannot belong to "
    "the same layer: the state dict was assembled wrongly.",
    "Go back to an earlier checkpoint, or re-estimate the statistics with `bnaudit recalibrate`; "
    "for shape mismatches, check how the state dict was converted.",
)
def _check_invalid(ctx: RuleContext) -> Iterator[Finding]:
    r = RULES["BN005"]
    for layer in ctx.discovery.layers:
        problems: list[str] = []
        bad: set[int] = set()
        c = layer.num_features
        for label, values in (
            ("running_mean", layer.running_mean),
            ("running_var", layer.running_var),
            ("weight", layer.weight),
            ("bias", layer.bias),
        ):
            if values is None:
                continue
            if len(values) != c:
                problems.append(f"{label} has {len(values)} values but the statistics have {c}")
                continue
            channels = [] if _all_finite(values) else [i for i, v in enumerate(values) if not math.isfinite(v)]
            if channels:
                nan = sum(1 for i in channels if math.isnan(values[i]))
                inf = len(channels) - nan
                parts = [f"{nan} NaN" if nan else "", f"{inf} Inf" if inf else ""]
                problems.append(f"{label} has {' and '.join(p for p in parts if p)} (channels {listing(channels, 8)})")
                bad.update(channels)
        var = layer.running_var
        negative = [] if _all_finite(var) and min(var, default=0.0) >= 0 else [i for i, v in enumerate(var) if v < 0]
        if negative:
            problems.append(f"running_var is negative in {plural(len(negative), 'channel')} ({listing(negative, 8)})")
            bad.update(negative)
        if layer.num_batches_tracked is not None and layer.num_batches_tracked < 0:
            problems.append(f"num_batches_tracked is negative ({layer.num_batches_tracked})")
        if problems:
            yield r.finding("error", layer.name, "; ".join(problems), sorted(bad))


def _join(prefix: str, leaf: str) -> str:
    return f"{prefix}.{leaf}" if prefix else leaf


@rule(
    "BN006",
    "batch-dependent-eval",
    "warning",
    "A BatchNorm module has track_running_stats=False: eval mode still normalises with batch statistics.",
    "Without running statistics (`track_running_stats=False`) a BatchNorm layer normalises with the "
    "mean and variance of the current batch in eval mode too. A prediction then depends on the other "
    "samples in its batch: a sample scores differently alone, with different companions, or in a "
    "smaller last batch, and a batch of one fails for BatchNorm1d. Needs the module (--arch, "
    "TorchScript or a pickled module): a state dict cannot show it, it simply has no buffers.",
    "Build the layer with track_running_stats=True and estimate its statistics with "
    "`bnaudit recalibrate`, or replace it with GroupNorm/LayerNorm if batch independence is needed "
    "without statistics.",
)
def _check_batch_dependent(ctx: RuleContext) -> Iterator[Finding]:
    if ctx.module is None:
        return
    r = RULES["BN006"]
    for name, info in ctx.module.norms.items():
        if name in ctx.module.batch_norms and info.track_running_stats is False:
            yield r.finding(
                "warning",
                name,
                f"{info.class_name} with track_running_stats=False: eval mode normalises with the "
                "statistics of each batch, so predictions depend on their batch companions",
            )


# Above this, a momentum looks like the retained fraction of Keras/ONNX (0.99, 0.997)
# passed straight through as PyTorch's weight of the new batch.
_RETAINED_FRACTION_MOMENTUM = 0.5


@rule(
    "BN007",
    "stats-update-config",
    "warning / info",
    "momentum 0 (buffers never update), None (cumulative average) or above 0.5 (a Keras/ONNX retained fraction?).",
    "PyTorch updates running statistics by new = (1 - m) * old + m * batch. With m = 0 training never "
    "changes them (the counter still counts), so they stay whatever was loaded; with m = None they "
    "are the plain average of every batch since the last reset (factor 1 / num_batches_tracked), "
    "which weighs early, untrained batches as much as late ones. Keras (0.99) and ONNX (0.9) call "
    "the retained fraction momentum; passed straight to PyTorch (HF MobileNetV2's 0.997) each batch "
    "replaces 99.7% of the statistics, which then describe the last batch only: a warning. Needs the "
    "module; eps and momentum are never saved in a state dict. An ONNX BatchNormalization node's "
    "momentum m (retained fraction) is translated to PyTorch's 1 - m first, and the message says so: "
    "ONNX 0.1 (PyTorch's 0.1 written unconverted) is PyTorch 0.9.",
    "Set the intended momentum on the module (PyTorch's 0.1 = 1 - Keras's 0.9; ONNX's 0.9), or "
    "recalibrate with `bnaudit recalibrate`, which does not depend on momentum.",
)
def _check_update_config(ctx: RuleContext) -> Iterator[Finding]:
    if ctx.module is None:
        return
    r = RULES["BN007"]
    for name, info in ctx.module.norms.items():
        if info.track_running_stats is False or not info.momentum_known:
            continue
        m = info.momentum
        if m is None:
            yield r.finding(
                "info",
                name,
                "momentum None: running statistics are the cumulative average of "
                "every batch since the last reset (factor 1/num_batches_tracked)",
            )
        elif m == 0:
            yield r.finding(
                "info",
                name,
                "momentum 0: training never updates the running statistics "
                "(the counter still counts); they stay as loaded",
            )
        elif m > _RETAINED_FRACTION_MOMENTUM:
            if info.source is not None:  # an exported node (ModuleInfo.source): its momentum was translated
                yield r.finding(
                    "warning",
                    name,
                    f"ONNX momentum {1 - m:.3g} = PyTorch {m:g} (ONNX stores the retained fraction): each "
                    f"batch would replace {m * 100:.1f}% of the statistics; PyTorch's {1 - m:.3g} written "
                    f"unconverted, meant as ONNX {m:g}?",
                )
                continue
            yield r.finding(
                "warning",
                name,
                f"momentum {m:g}: each batch replaces {m * 100:.1f}% of the "
                f"statistics; a retained fraction (Keras/ONNX convention) meant as {1 - m:.3g}?",
            )


@rule(
    "BN008",
    "low-precision-buffers",
    "warning",
    "running statistics stored in float16 or bfloat16.",
    "float16 cannot hold a variance above 65504 (it becomes Inf) and resolves nothing below about "
    "6e-8, so a near-eps variance underflows to 0; bfloat16 keeps only 8 bits of mantissa, so "
    "statistics lose about 3 significant digits. BatchNorm buffers are tiny: keep them in float32 "
    "even in a half-precision model.",
    "Keep BN buffers in float32 when converting (e.g. `model.half()` then `bn.float()` for each BN), "
    "or export with mixed precision that excludes normalisation layers.",
)
def _check_low_precision(ctx: RuleContext) -> Iterator[Finding]:
    r = RULES["BN008"]
    for layer in ctx.discovery.layers:
        if layer.stats_dtype in ("float16", "bfloat16"):
            yield r.finding("warning", layer.name, f"running statistics stored in {layer.stats_dtype}")


@rule(
    "BN009",
    "counter-zero",
    "info",
    "num_batches_tracked is 0 but the statistics are not the initial values.",
    "PyTorch increments num_batches_tracked on every training-mode forward, so 0 with real statistics "
    "means the values were written some other way: converted weights (e.g. from Keras or ONNX) or "
    "momentum 0. Usually legitimate; worth knowing when momentum=None (cumulative averaging divides "
    "by the counter) or when the layer will be fine-tuned.",
    "Nothing to fix if the weights were converted; otherwise check how the statistics were produced.",
)
def _check_counter_zero(ctx: RuleContext) -> Iterator[Finding]:
    r = RULES["BN009"]
    for layer in ctx.discovery.layers:
        if layer.num_batches_tracked == 0 and not _has_identity_stats(layer):
            yield r.finding(
                "info",
                layer.name,
                "num_batches_tracked is 0 but the statistics are not 0/1: converted weights or momentum 0",
            )


@rule(
    "BN010",
    "uneven-counters",
    "info",
    "num_batches_tracked differs between layers: part of the network was frozen or fine-tuned.",
    "Every BN layer of a network trained end to end sees the same number of training-mode forwards. "
    "Different counters mean some layers were frozen (norm_eval, FrozenBatchNorm, requires_grad off "
    "with eval mode) or added and fine-tuned later; their statistics may describe different data. "
    "Layers the file's recalibration record says `bnaudit recalibrate` wrote are not counted.",
    "Nothing to fix if the freezing was intended; otherwise recalibrate the layers that were frozen "
    "on the data the model now sees.",
)
def _check_uneven_counters(ctx: RuleContext) -> Iterator[Finding]:
    if ctx.is_ema:
        return
    groups: dict[int, list[str]] = {}
    for layer in ctx.discovery.layers:
        # a recalibrated layer's counter counts calibration batches, not training steps
        if layer.num_batches_tracked is not None and layer.name not in ctx.recalibrated:
            groups.setdefault(layer.num_batches_tracked, []).append(layer.name)
    if len(groups) < 2:
        return
    ordered = sorted(groups.items(), key=lambda kv: -len(kv[1]))
    parts = [f"{t} in {plural(len(names), 'layer')} ({_describe_names(names)})" for t, names in ordered[:6]]
    more = f"; and {len(ordered) - 6} more values" if len(ordered) > 6 else ""
    yield RULES["BN010"].finding("info", None, f"num_batches_tracked differs between layers: {'; '.join(parts)}{more}")


@rule(
    "BN011",
    "load-mismatch",
    "error / warning / info",
    "The checkpoint does not fit the model: keys missing, unexpected, or of another shape.",
    "With the model known (--arch), its state dict is compared key by key with the checkpoint, as "
    "`load_state_dict(strict=True)` would. A parameter or buffer the checkpoint lacks keeps its "
    "random initial value (error; missing BN statistics are BN001); a shape that differs cannot load "
    "at all (error); a key the model lacks is ignored (warning: a renamed layer or the wrong "
    "architecture); a missing num_batches_tracked is filled by PyTorch on load (info).",
    "Pass the architecture and --arch-kwargs the checkpoint was trained with; choose the right "
    "state dict with --key; rename keys when converting.",
)
def _check_load_mismatch(ctx: RuleContext) -> Iterator[Finding]:
    facts = ctx.module
    if facts is None:
        return
    r = RULES["BN011"]
    stats = {_join(n, s) for n in facts.norms for s in ("running_mean", "running_var")}
    counters = {_join(n, "num_batches_tracked") for n in facts.norms}
    missing = [k for k in facts.missing if k not in stats and k not in counters]
    missing_counters = [k for k in facts.missing if k in counters]
    for key, file_shape, model_shape in facts.mismatched:
        yield r.finding(
            "error",
            key.rpartition(".")[0] or None,
            f"'{key}' has shape {list(file_shape)} in the checkpoint but {list(model_shape)} in the model",
        )
    if missing:
        yield r.finding(
            "error",
            None,
            f"{plural(len(missing), 'key')} of the model absent from the checkpoint "
            f"{'keeps its initial value' if len(missing) == 1 else 'keep their initial values'}: {listing(missing, 5)}",
        )
    if facts.unexpected:
        yield r.finding(
            "warning",
            None,
            f"{plural(len(facts.unexpected), 'checkpoint key')} the model does not have: {listing(facts.unexpected, 5)}",
        )
    if missing_counters:
        yield r.finding(
            "info",
            None,
            f"num_batches_tracked absent for {plural(len(missing_counters), 'layer')} "
            f"({listing((k.rpartition('.')[0] for k in missing_counters), 5)}): PyTorch fills it on load",
        )


@rule(
    "BN012",
    "training-mode-export",
    "error",
    "An exported BatchNormalization node normalises with the batch's statistics (training mode).",
    "An inference graph should normalise with the stored running statistics. A BatchNormalization "
    "node in training mode (BatchNormalization-14/15 `training_mode=1`; -7 and -9 with the "
    "training-mode outputs mean/var/saved_mean/saved_var; -6 and older with `is_test=0` or without "
    "`is_test`, whose default is training) normalises every batch with its own mean and variance: "
    "a prediction depends on its batch companions, a batch of one normalises to beta, and some "
    "execution providers refuse the node outright. Exporters leave it this way when the model was "
    "exported in training mode (`torch.onnx.export(..., training=TrainingMode.TRAINING)`, or "
    "`model.eval()` forgotten with TrainingMode.PRESERVE). The finding names the node, its "
    "version and the opset.",
    "Export again from `model.eval()` (torch.onnx.export's default TrainingMode.EVAL), or set "
    "`training_mode` to 0 and drop the extra outputs with the onnx package.",
)
def _check_training_mode_export(ctx: RuleContext) -> Iterator[Finding]:
    if ctx.module is None:
        return
    r = RULES["BN012"]
    for name, info in ctx.module.norms.items():
        if info.training_mode:
            why = info.training_reason or "training mode"
            where = f" ({info.source})" if info.source else ""
            yield r.finding(
                "error",
                name,
                f"{why}: normalises with each batch's statistics, so predictions depend on their "
                f"batch companions{where}",
            )


@rule(
    "BN013",
    "stats-not-constant",
    "info",
    "An exported BatchNormalization node's scale, B, mean or variance is not a constant: it cannot be audited.",
    "bnaudit reads the statistics a BatchNormalization node uses from initializers and Constant "
    "nodes (through Identity nodes). A node whose inputs are graph inputs (statistics fed at run "
    "time) or computed by other nodes has no stored values to check, so none of the other rules "
    "can speak for it. The finding names the node and which input is not a constant.",
    "Audit the checkpoint the graph was exported from; or export with the statistics as "
    "initializers (`torch.onnx.export(..., export_params=True)`, the default).",
)
def _check_not_constant(ctx: RuleContext) -> Iterator[Finding]:
    r = RULES["BN013"]
    for note in ctx.unauditable:
        yield r.finding("info", None, note)


@rule(
    "BN014",
    "folded-export",
    "info",
    "Exported Conv nodes hold BN folded into their weights: no BatchNormalization node left, or weights made by constant folding.",
    "Both torch exporters fold BatchNorm into the preceding convolution by default (the legacy "
    "exporter with constant folding, the dynamo exporter with its optimiser): the Conv's weights "
    "become W*gamma/sqrt(var+eps) per output channel and its bias beta + (b - mean)*gamma/sqrt(var+eps). "
    "The statistics then no longer exist as such and cannot be audited from the export. What the "
    "test sees: a graph without any BatchNormalization node that has at least one Conv node whose "
    "weight and bias are both constants; or, in any graph, Conv nodes whose weight torch's legacy "
    "exporter computed by constant folding (it names such tensors `onnx::Conv_N` instead of the "
    "module's parameter; BN after a Linear layer stays a node and is audited). A network that had "
    "no BatchNorm and convolutions with their own bias matches the first test as well, so the line "
    "says 'if the model had BatchNorm there'; a graph without BatchNormalization and without such "
    "a Conv gets no finding.",
    "Audit the checkpoint instead (`bnaudit inspect model.pt`), and check the folding against it "
    "with `bnaudit diff model.pt model.onnx`; or export with BN nodes kept "
    "(`do_constant_folding=False`, or `optimize=False` with dynamo=True) to audit the export itself.",
)
def _check_folded_export(ctx: RuleContext) -> Iterator[Finding]:
    if ctx.folded is None:
        return
    yield RULES["BN014"].finding(
        "info",
        None,
        f"{ctx.folded}: if the model had BatchNorm there, the exporter folded its statistics into these "
        "convolutions and they cannot be audited from the export: audit the checkpoint",
    )


def _describe_names(names: list[str]) -> str:
    """A short description of a group of layer names: their top-level modules."""
    tops: list[str] = []
    for name in names:
        top = name.split(".")[0] if "." in name else name
        if top not in tops:
            tops.append(top)
    shown = ", ".join(f"{t}.*" if any(n.startswith(t + ".") for n in names) else t for t in tops[:4])
    return shown + (", ..." if len(tops) > 4 else "")


def _selected(code: str, cfg: Config) -> bool:
    if cfg.select and not any(code.startswith(s) for s in cfg.select):
        return False
    return not any(code.startswith(i) for i in cfg.ignore)


def _ignored_for_layer(finding: Finding, cfg: Config) -> bool:
    if finding.layer is None:
        return False
    return any(
        fnmatch.fnmatchcase(finding.layer, pattern) and any(finding.code.startswith(c) for c in codes)
        for pattern, codes in cfg.per_layer_ignores.items()
    )


def run_rules(ctx: RuleContext) -> list[Finding]:
    """Every selected inspect rule's findings, in rule order, at the configured severity."""
    return _run_command_rules("inspect", ctx, ctx.config)


def _run_command_rules(command: str, ctx: Any, config: Config) -> list[Finding]:
    """The findings of the selected rules of `command` (inspect, diff), in rule order, with
    per-layer ignores applied and `[tool.bnaudit.severity]` overrides in force."""
    findings: list[Finding] = []
    overrides = config.severity
    for code, r in RULES.items():
        if r.command == command and _selected(code, config):
            found = [f for f in r.check(ctx) if not _ignored_for_layer(f, config)]
            if code in overrides:
                found = [replace(f, severity=overrides[code]) for f in found]
            findings.extend(found)
    return findings


# ----------------------------------------------------------------------------- diff
# The rules of `bnaudit diff` (BN1xx): they judge how each layer changed between two
# checkpoints (layerdiff.LayerDiff; definitions of the numbers in bnaudit.audit.layerdiff).


def run_diff_rules(ctx: DiffContext) -> list[Finding]:
    """Every selected diff rule's findings, in rule order, at the configured severity."""
    return _run_command_rules("diff", ctx, ctx.config)


def _numbers_of(d: LayerDiff) -> str:
    parts = []
    if d.mean_shift is not None:
        parts.append(f"mean shift {_fmt(d.mean_shift)}")
    if d.var_log_ratio is not None:
        parts.append(f"var log-ratio {_fmt(d.var_log_ratio)}")
    return ", ".join(parts)


def _counter_words(d: LayerDiff) -> str:
    if d.batches_a is None or d.batches_b is None:
        return "no counter on one side"
    return f"num_batches_tracked {d.batches_a} -> {d.batches_b}"


@rule(
    "BN101",
    "frozen-but-updating",
    "error / warning",
    "weight and bias bit-identical, running statistics moved and the counter grew: trained in train() while frozen.",
    "`requires_grad=False` stops the optimizer, not BatchNorm: a module left in training mode "
    "keeps moving running_mean and running_var towards every batch it sees (and counts the batches), "
    "so the frozen weights are evaluated with statistics of the new data. When the backbone was "
    "meant to stay exactly as pretrained, its eval-mode function has changed anyway. Warning; "
    "error for layers matched by --expect-frozen (`expect-frozen`).",
    "Put the frozen modules in eval mode after every `model.train()` (override `train()` or use "
    "your framework's norm_eval / `freeze(train_bn=False)`), or accept the new statistics on purpose.",
    settings=("expect-frozen",),
    command="diff",
)
def _check_frozen_updating(ctx: DiffContext) -> Iterator[Finding]:
    r = RULES["BN101"]
    for d in ctx.layers:
        if d.verdict == layerdiff.FROZEN_BUT_UPDATING:
            expected = matches(d.name, ctx.config.expect_frozen)
            yield r.finding(
                "error" if expected else "warning",
                d.name,
                f"weight and bias bit-identical but running statistics moved ({_numbers_of(d)}; "
                f"{_counter_words(d)}): the module ran in training mode while its weights were frozen"
                + (" (expected frozen)" if expected else ""),
            )


@rule(
    "BN102",
    "stale-statistics",
    "error / warning",
    "Parameters moved while the running statistics stayed bit-identical and the counter did not grow.",
    "Running statistics describe the activations of the weights they were measured with. Weights "
    "that were averaged (EMA, SWA's AveragedModel) or edited without training-mode forwards keep "
    "the statistics of other weights: eval mode then normalises with the wrong mean and variance "
    "(SWA models near chance accuracy until `update_bn`). Warning; error when the weight or bias "
    "change, relative to the layer's scale max|gamma|, exceeds `stale-max-change` (default 0.1).",
    "Recompute the statistics for the new weights: `torch.optim.swa_utils.update_bn`, or "
    "`bnaudit recalibrate` on representative data.",
    settings=("stale-max-change",),
    command="diff",
)
def _check_stale(ctx: DiffContext) -> Iterator[Finding]:
    r = RULES["BN102"]
    limit = ctx.config.stale_max_change
    for d in ctx.layers:
        if d.verdict != layerdiff.STALE:
            continue
        changes = [c for c in (d.weight_change, d.bias_change) if c is not None]
        worst = max(changes, default=0.0)
        severity = "error" if not worst <= limit else "warning"  # NaN counts as moved too far
        yield r.finding(
            severity,
            d.name,
            f"{' and '.join(d.moved)} moved (weight change {_fmt_opt(d.weight_change)}, bias change "
            f"{_fmt_opt(d.bias_change)} of the layer's scale) while running statistics are bit-identical "
            f"and the counter did not grow: weights trained or averaged (EMA/SWA) without updating the "
            f"statistics; recalibrate" + (f" (change above stale-max-change {limit:g})" if severity == "error" else ""),
        )


def _fmt_opt(x: float | None) -> str:
    return "-" if x is None else _fmt(x)


@rule(
    "BN103",
    "re-estimated",
    "info",
    "Running statistics replaced while the counter was reset or replaced: a recalibration.",
    "Statistics that moved while the counter did not grow (or fell: `update_bn` and "
    "`bnaudit recalibrate` reset it and count their own batches) were re-estimated rather than "
    "trained. That is usually the fix for stale statistics; the finding names bnaudit's "
    "provenance record when side B carries one (`bnaudit recalibrate` writes it into every format).",
    "Nothing to fix; check that the calibration data matched the data the model will see.",
    command="diff",
)
def _check_re_estimated(ctx: DiffContext) -> Iterator[Finding]:
    r = RULES["BN103"]
    for d in ctx.layers:
        if d.verdict != layerdiff.RE_ESTIMATED:
            continue
        if d.recalibrated and ctx.provenance:
            how = f"re-estimated by {ctx.provenance}"
        else:
            how = "statistics re-estimated (a recalibration such as update_bn)"
        weights = "weights identical" if d.params_identical else "weights also moved"
        yield r.finding("info", d.name, f"{how}: {_numbers_of(d)}; {_counter_words(d)}; {weights}")


@rule(
    "BN104",
    "uneven-counting",
    "warning",
    "Among layers whose counter grew, the increments differ (e.g. some at exactly twice the others').",
    "Every BN layer of a network trained end to end runs one training-mode forward per step, so "
    "their counters grow by the same amount. A group that grew by exactly twice as much ran its "
    "forwards twice: activation checkpointing (`torch.utils.checkpoint`, reentrant or not, as of "
    "torch 2.13) re-runs the forward of the checkpointed block in training mode during backward, "
    "updating its statistics a second time with the same batch. Other ratios mean parts of "
    "the network ran on different batches or were trained in separate phases.",
    "Put the checkpointed block's BN layers in eval mode during recomputation, checkpoint blocks "
    "without BatchNorm, or recalibrate the statistics after training.",
    command="diff",
)
def _check_uneven_counting(ctx: DiffContext) -> Iterator[Finding]:
    groups: dict[int, list[str]] = {}
    for d in ctx.layers:
        change = d.batches_change
        if change is not None and change > 0 and d.counter_meaningful:
            groups.setdefault(change, []).append(d.name)
    if len(groups) < 2:
        return
    every = [d.name for d in ctx.layers]
    # the increment most layers share is the baseline; ties go to the smaller increment
    ordered = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    base, base_names = ordered[0]
    parts = [f"+{base} in {plural(len(base_names), 'layer')} ({describe_group(base_names, every)})"]
    for change, names in ordered[1:6]:
        ratio = change / base
        ratio_text = f"exactly {ratio:g}x" if change % base == 0 or base % change == 0 else f"{ratio:.3g}x"
        parts.append(f"+{change} in {plural(len(names), 'layer')} ({describe_group(names, every)}): {ratio_text}")
    more = f"; and {len(ordered) - 6} more increments" if len(ordered) > 6 else ""
    twice = any(change == 2 * base for change in groups)
    hint = ": BN forwards run twice per step there (activation checkpointing?)" if twice else ""
    yield RULES["BN104"].finding("warning", None, f"counter increments differ: {'; '.join(parts)}{more}{hint}")


@rule(
    "BN105",
    "expectation-violated",
    "error",
    "A layer matched by --expect-frozen moved, or one matched by --expect-trained did not train.",
    "`expect-frozen` and `expect-trained` (layer-name globs, also --expect-frozen/--expect-trained) "
    "state what a run was meant to do. An expected-frozen layer whose weight, bias or statistics "
    "moved is an error naming what moved (statistics that moved under identical weights are "
    "reported as BN101 at error severity); an expected-trained layer whose weights stayed "
    "bit-identical did not train. A glob that matches no layer on either side is an error too: "
    "a renamed module would otherwise pass the check silently.",
    "Fix the freezing (requires_grad and eval mode) or the optimizer's parameter groups, or correct the globs.",
    settings=("expect-frozen", "expect-trained"),
    command="diff",
)
def _check_expectations(ctx: DiffContext) -> Iterator[Finding]:
    r = RULES["BN105"]
    cfg = ctx.config
    for d in ctx.layers:
        if matches(d.name, cfg.expect_frozen) and d.verdict != layerdiff.FROZEN_BUT_UPDATING and d.moved:
            if d.moved == ["num_batches_tracked"]:
                continue  # the counter counts in train() even at momentum 0: nothing the layer computes moved
            yield r.finding("error", d.name, f"expected frozen, but {', '.join(d.moved)} moved")
        if matches(d.name, cfg.expect_trained) and d.params_identical:
            what = "weight and bias are" if d.verdict != layerdiff.UNCHANGED else "nothing is"
            yield r.finding("error", d.name, f"expected to train, but {what} bit-identical")
    names = [d.name for d in ctx.layers] + ctx.only_a + ctx.only_b + [n for n, _, _ in ctx.reshaped]
    for option, globs in (("expect-frozen", cfg.expect_frozen), ("expect-trained", cfg.expect_trained)):
        for glob in globs:
            if not any(fnmatch.fnmatchcase(n, glob) for n in names):
                yield r.finding("error", None, f"{option} glob {glob!r} matches no BN layer")


@rule(
    "BN106",
    "settings-changed",
    "error / info",
    "eps (error) or momentum (info) differs between the two sides' modules.",
    "eps and momentum are constructor arguments, never saved in a state dict; only files that hold "
    "modules (TorchScript, pickled torch.nn) carry them. A changed eps changes the function eval "
    "mode computes, (x - mu) / sqrt(var + eps): a model evaluated with another eps than it was "
    "trained with computes another function (error). A changed momentum only changes how future "
    "training updates the statistics (info).",
    "Build the model with the eps it was trained with (a Keras port: 1e-3); set momentum deliberately.",
    command="diff",
)
def _check_settings_changed(ctx: DiffContext) -> Iterator[Finding]:
    r = RULES["BN106"]
    if ctx.export is not None:
        return  # a checkpoint against its export: BN109 and BN110 say it in ONNX's terms
    for d in ctx.layers:
        if not d.settings_known:
            continue
        if d.eps_a != d.eps_b:
            yield r.finding(
                "error", d.name, f"eps changed from {d.eps_a:g} to {d.eps_b:g}: eval mode computes another function"
            )
        if d.momentum_a != d.momentum_b:
            yield r.finding("info", d.name, f"momentum changed from {d.momentum_a} to {d.momentum_b}")


@rule(
    "BN107",
    "layers-changed",
    "warning / info",
    "A layer's channel count changed (warning), or layers exist on one side only (info).",
    "Layers are matched by name after each side's wrapper prefix (module., _orig_mod., model.) is "
    "stripped. A layer whose channel count changed was replaced, not trained: its statistics "
    "cannot be compared. Layers on one side only were added, removed or renamed; a rename "
    "hides what happened to them.",
    "Nothing to fix when the architecture changed on purpose; otherwise check the key names "
    "(--key-a / --key-b choose the state dicts of a container).",
    command="diff",
)
def _check_layers_changed(ctx: DiffContext) -> Iterator[Finding]:
    r = RULES["BN107"]
    for name, ca, cb in ctx.reshaped:
        yield r.finding("warning", name, f"channel count changed from {ca} to {cb}: the layer was replaced")
    for side, names in (("A", ctx.only_a), ("B", ctx.only_b)):
        if names:
            yield r.finding("info", None, f"{plural(len(names), 'layer')} only in {side}: {listing(names, 5)}")


# ----------------------------------------------------------------------------- diff: exports
# A checkpoint against its ONNX export (bnaudit.audit.exportdiff): the side that is not
# ONNX is the reference; definitions of the numbers in exportdiff and bnaudit.audit.fold.


def _eps_words(eps: float, assumed: bool) -> str:
    return f"{eps:g}" + (" (assumed: the checkpoint holds no modules; set --eps)" if assumed else "")


@rule(
    "BN108",
    "export-tensors-differ",
    "error / warning",
    "A BatchNormalization node's scale, B, mean or var differs from the checkpoint layer's beyond float32 rounding.",
    "An export is meant to compute what the checkpoint computes. A node whose tensors are not the checkpoint's "
    "(compared value by value after rounding both to float32, so a float64 checkpoint exported in float32 is "
    "equal) was exported from other weights: statistics reset or never loaded before export, an older or "
    "EMA copy, an edited graph. Error; warning when the only difference is that the export stores the values "
    "in a narrower type (float16, bfloat16: each value is the checkpoint's rounded), which costs precision "
    "(about 1e-3 relative for float16) but not correctness. The diff table shows these layers with the verdict "
    "'differs from checkpoint' and the usual mean shift and var log-ratio (bnaudit.audit.layerdiff); BN101-BN104, "
    "which read training between two checkpoints, stay silent for an export.",
    "Export again from the model with the checkpoint loaded (`model.load_state_dict(...)`, `model.eval()`), "
    "and keep the statistics in float32.",
    command="diff",
)
def _check_export_tensors(ctx: DiffContext) -> Iterator[Finding]:
    if ctx.export is None:
        return
    r = RULES["BN108"]
    for node in ctx.export.nodes:
        for m in node.mismatches:
            if m.rounding:
                yield r.finding(
                    "warning",
                    node.name,
                    f"{m.tensor} stored as {m.export_dtype} in the export: the checkpoint's values rounded "
                    f"(max relative error {_fmt(m.max_rel)} in {plural(m.channels, 'channel')})",
                )
                continue
            what = f"{m.tensor} differs from the checkpoint's in {plural(m.channels, 'channel')} (max |difference| {_fmt(m.max_abs)})"
            if m.initial:
                initial = "1" if m.tensor in ("weight", "running_var") else "0"
                what += f": the export holds {initial} in every channel (reset or never loaded before export)"
            yield r.finding("error", node.name, what)


@rule(
    "BN109",
    "export-eps-differs",
    "error",
    "A BatchNormalization node's epsilon is not the checkpoint module's eps.",
    "eps is a constructor argument: no state dict stores it, and an exporter writes whatever the module "
    "object held at export time. A node with another epsilon normalises with sqrt(var + eps') instead of "
    "sqrt(var + eps): a model trained at 1e-5 and run at 1e-3 (a Keras convention) changes every channel "
    "whose variance is not far above 1e-3. The reference is the checkpoint module's eps when the file holds "
    "modules (TorchScript, a pickled model, --arch), else --eps (default 1e-5, said as assumed). Both are "
    "compared as float32, the type of the ONNX attribute.",
    "Build the model with the eps it was trained with before exporting, or pass --eps when the checkpoint "
    "was trained with another one.",
    settings=("eps",),
    command="diff",
)
def _check_export_eps(ctx: DiffContext) -> Iterator[Finding]:
    if ctx.export is None:
        return
    r = RULES["BN109"]
    from bnaudit.audit.fold import float32

    for node in ctx.export.nodes:
        if float32(node.eps_export) != float32(node.eps_checkpoint):
            yield r.finding(
                "error",
                node.name,
                f"epsilon {float32(node.eps_export):.3g} in the export, eps "
                f"{_eps_words(node.eps_checkpoint, node.settings_assumed)} in the checkpoint",
            )


@rule(
    "BN110",
    "export-momentum-unconverted",
    "warning",
    "A BatchNormalization node's momentum is not 1 - the checkpoint's PyTorch momentum.",
    "ONNX (like Keras) stores the retained fraction: running = momentum * running + (1 - momentum) * batch, "
    "default 0.9. PyTorch stores the update fraction, default 0.1. An export that writes PyTorch's 0.1 "
    "unconverted tells every runtime that trains or fine-tunes the graph to keep only 10% of the running "
    "statistics per batch. Inference is unaffected, hence a warning. Reported when the module is known "
    "and 1 - ONNX momentum differs from its momentum, and, when the checkpoint holds no modules, when the "
    "node's momentum equals the assumed PyTorch value (0.1, unconverted).",
    "Write momentum as 1 - PyTorch momentum (torch.onnx.export does this itself).",
    command="diff",
)
def _check_export_momentum(ctx: DiffContext) -> Iterator[Finding]:
    if ctx.export is None:
        return
    r = RULES["BN110"]
    for node in ctx.export.nodes:
        onnx_m, torch_m = node.momentum_onnx, node.momentum_checkpoint
        if onnx_m is None or torch_m is None:
            continue  # cumulative average (momentum=None) has no ONNX counterpart
        converted = 1.0 - torch_m
        if abs(onnx_m - converted) <= 1e-6:
            continue
        unconverted = abs(onnx_m - torch_m) <= 1e-6
        if node.settings_assumed and not unconverted:
            continue
        words = (
            f"momentum {onnx_m:.3g} in the export (ONNX convention: the retained fraction), expected "
            f"{converted:.3g} = 1 - PyTorch momentum {torch_m:g}"
        )
        if unconverted:
            words += ": PyTorch's value written without conversion"
        yield r.finding("warning", node.name, words)


@rule(
    "BN111",
    "export-training-mode",
    "error",
    "A BatchNormalization node of the export runs in training mode (training_mode=1, or is_test unset before opset 7).",
    "A node in training mode normalises with the statistics of the batch it is given, not the stored ones: "
    "predictions depend on the other samples of the batch, a batch of one is normalised to beta, and some "
    "execution providers refuse the node. torch.onnx.export writes it when the model was exported in "
    "train() mode (or with training=TrainingMode.TRAINING).",
    "Call model.eval() before torch.onnx.export (and leave `training` at its default).",
    command="diff",
)
def _check_export_training(ctx: DiffContext) -> Iterator[Finding]:
    if ctx.export is None:
        return
    r = RULES["BN111"]
    for node in ctx.export.nodes:
        if node.training_mode:
            yield r.finding(
                "error",
                node.name,
                f"{node.source}: training mode ({node.training_reason or 'training_mode=1'}), it normalises with "
                "each batch's statistics, so predictions depend on batch companions",
            )


@rule(
    "BN112",
    "folded-mismatch",
    "error",
    "A Conv the exporter folded BN into does not carry gamma/sqrt(var+eps) and beta + (b - mean)*gamma/sqrt(var+eps) of the checkpoint.",
    "Both torch exporters fold eval-mode BN into the preceding Conv (or Linear) by default, so the export "
    "has no BatchNormalization node to read. The folding can still be checked: the exported weight must be "
    "the checkpoint conv's weight scaled per output channel by s = gamma/sqrt(var + eps), and its bias must "
    "be t = beta + (b - mean) * s (b the conv's own bias, 0 without one). bnaudit recovers s by least "
    "squares over each channel's weights and compares both with the checkpoint's BN (relative tolerance "
    "1e-5, float32 folding stays below 1e-6). It also solves for the eps the export implies, "
    "eps' = (gamma/s)^2 - var, on the channel that determines it best. A mismatch means the model was "
    "exported with other statistics (reset, stale, another checkpoint's) or another eps; the finding says "
    "which the numbers fit. Exported weights that are not a per-channel scaling of the conv's are reported too.",
    "Export again from the model with the checkpoint loaded, in eval mode, with the eps it was trained with.",
    settings=("eps",),
    command="diff",
)
def _check_folded(ctx: DiffContext) -> Iterator[Finding]:
    if ctx.export is None:
        return
    r = RULES["BN112"]
    for f in ctx.export.folded:
        c = f.check
        if c.matches:
            continue
        numbers = []
        if c.scale_error is not None:
            numbers.append(f"scale error {_fmt(c.scale_error)}")
        if c.shift_error is not None:
            numbers.append(f"shift error {_fmt(c.shift_error)}")
        if c.implied_eps is not None:
            numbers.append(f"implied eps {c.implied_eps:.3g}")
        detail = f" ({', '.join(numbers)}; worst channel {c.worst_channel})" if numbers else ""
        yield r.finding("error", f.name, f"folded into {f.node}: {c.cause}{detail}")


@rule(
    "BN113",
    "export-unpaired",
    "warning / info",
    "A checkpoint BN layer has neither a BatchNormalization node nor a conv it was folded into (warning), or an export node cannot be audited (info).",
    "Every checkpoint BN layer should appear in the export either as a BatchNormalization node (matched by "
    "name, the exporter's scope in the node's name, then order and channel count) or folded into the conv "
    "that feeds it (found with --arch from the model graph, else from the checkpoint's key order and channel "
    "counts, then its export node by initializer name, exporter scope, or order among convs of that shape). "
    "A layer paired with neither could not be checked: a changed architecture, or an exporter that renamed "
    "everything and reordered the graph. Export convs whose weights equal no checkpoint weight and feed no "
    "BatchNormalization node are listed too (folded from a BN that could not be paired). Info: nodes whose "
    "statistics are not constants (graph inputs, computed) cannot be compared.",
    "Pass --arch so pairing follows the model graph, or export with do_constant_folding=False / optimize=False "
    "to keep the BatchNormalization nodes.",
    command="diff",
)
def _check_export_unpaired(ctx: DiffContext) -> Iterator[Finding]:
    if ctx.export is None:
        return
    r = RULES["BN113"]
    for u in ctx.export.unpaired:
        layer = None if u.name.startswith("node ") else u.name
        text = u.reason if layer is not None else f"{u.name}: {u.reason}"
        yield r.finding("warning", layer, f"could not be checked: {text}" if layer else text)
    for note in ctx.export.unauditable:
        yield r.finding("info", None, f"cannot be compared: {note}")


@rule(
    "BN114",
    "export-output-deviates",
    "error",
    "With --arch and --data: the export's outputs (onnxruntime, CPU) deviate from the checkpoint's (torch, eval mode) beyond float32 rounding.",
    "Reading the tensors cannot see everything an export changes. With --arch and --data, diff runs the "
    "checkpoint in torch (eval mode) and the export in onnxruntime (CPU execution provider only, no custom "
    "operators) on the same batches, and compares the largest relative output deviation, "
    "max |y_onnx - y_torch| / max |y_torch| per sample, with a floor: 10x what float32 rounding alone gives "
    "(the float32 model against a float64 re-run of itself) rounded up to a power of ten, so that it is the "
    "same on every CPU, at least 1e-6. A correct export stays below the "
    "floor; argmax agreement alone can hide a training-mode export on easy data. The finding says whether "
    "the BatchNormalization nodes (training mode, eps, tensors) or the folding explain the deviation.",
    "Fix what the other export findings name; if none, compare the operators (torch.onnx.verification).",
    command="diff",
)
def _check_export_outputs(ctx: DiffContext) -> Iterator[Finding]:
    if ctx.export is None or ctx.export.parity is None:
        return
    p = ctx.export.parity
    if not p.deviates:
        return
    yield RULES["BN114"].finding(
        "error",
        None,
        f"largest relative output deviation {_fmt(p.max_deviation)} (floor {_fmt(p.floor)}), argmax agreement "
        f"{p.agreement * 100:.1f}% on {plural(p.samples, 'sample')}: {ctx.export.explanation()}",
    )

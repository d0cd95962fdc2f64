"""BN003, immature statistics: judged by the counter where it counts updates, and by the
statistics themselves where it does not (an EMA copy, a file without counters); the
estimates are bnaudit.audit.checkpoint.immaturity's. Also spoken in `diff` of a live model against
its EMA copy (one code per fact)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from bnaudit.audit.formulas import initial_weight
from bnaudit.audit.rules.registry import RULES, Finding, RuleContext, also_in, rule
from bnaudit.severity import Severity
from bnaudit.text import plural

if TYPE_CHECKING:  # `bnaudit rules` imports this module and reads no checkpoint; inspect never diffs
    from bnaudit.audit.diff.layers import DiffContext
    from bnaudit.audit.layers import BNLayer
    from bnaudit.config import Config

# The checks import the estimates (bnaudit.audit.checkpoint.immaturity) and the averaging words
# (bnaudit.formats.ema) where they run: `bnaudit rules` imports every rule module and needs
# none of their records.

# From here on the initial 0/1 outweigh everything the buffers have seen: an error.
IMMATURE_ERROR_WEIGHT = 0.5


@rule(
    "BN003",
    "immature-stats",
    (Severity.ERROR, Severity.WARNING, Severity.INFO),
    "After t = num_batches_tracked updates the initial values still weigh (1-momentum)^t above the threshold.",
    "The running buffers start at mean 0 and variance 1 and move by new = (1-m)*old + m*batch. After t "
    "updates the initial values keep the weight w = (1-m)^t: 0.9^3 = 72.9% after 3 updates at momentum "
    "0.1, still 4.2% after 30. A short fine-tune leaves buffers that describe no data. How much that "
    "hurts depends on the data too: stored = w*init + (1-w)*data, so the data's statistics are "
    "implied per channel, var_data = (var_stored - w)/(1 - w) and mean_data = mean_stored/(1 - w), and "
    "the stored variance overstates the data's by q = (var_stored + eps)/(var_data + eps). Data of "
    "small variance (inputs scaled to 0.1) turns 15% of initial values into a variance several times "
    "too large, and eval mode shrinks every such channel. Error when the median q over the layer's "
    "channels reaches 4 or falls to 1/4 (`max-implied-var-ratio`), or the median distance between "
    "the stored and the implied mean reaches 1 data standard deviation (`max-implied-mean-shift`); "
    "the message then gives the factor. Error also when the initial values weigh 50% or more (the "
    "buffers are then more initialisation than data: two updates at momentum 0.1 leave 81%); warning "
    "between the threshold and 50% when the implied error is small. Default threshold 5% "
    "(`max-init-weight`). An EMA copy's counter means nothing (timm's ModelEmaV2 averages it "
    "toward 0, ModelEmaV3 copies the live model's), so a copy is judged by its statistics: "
    "where the container holds the live model too (timm's CheckpointSaver: state_dict and "
    "state_dict_ema), the copy's statistics sit between the initial 1/0 and the live ones and "
    "the initial values' weight is estimated per channel, w = (var_ema - var_live)/(1 - var_live) "
    "and (mean_live - mean_ema)/mean_live (median; `ModelEmaV3(decay=0.999)` after 100 steps "
    "without warmup leaves 0.999^100 = 90.5%). Reported when that weight exceeds `max-init-weight` "
    "and the copy's variance differs from the live one by a factor 1.5 or its mean by half a live "
    "standard deviation (closer, it is a lagging average, or one begun from a trained model); an "
    "error when the difference passes `max-implied-var-ratio` or `max-implied-mean-shift`, or the "
    "weight is 50% or more. Where the container also records the EMA's schedule (timm's train.py "
    "saves its arguments as `args`: `model_ema_decay`, `model_ema_warmup`, `grad_accum_steps`, "
    "`bn_momentum`) and the copy's kind is known, the weight is computed instead of estimated: the copy "
    "starts as the untrained model and update k lerps it toward the live buffers, whose initial values "
    "weigh (1-m)^(k*a), W_k = d_k W_(k-1) + (1 - d_k)(1-m)^(k*a), with ModelEmaV3's decay d_1 = 0 "
    "then `model_ema_decay` (or its warm-up 1 - (1 + (k-1))^(-2/3), clamped), a constant decay for "
    "ModelEmaV2; the number of updates T is num_batches_tracked / a (ModelEmaV3 copies the live "
    "counter; ModelEmaV2's averaged one is replaced by the live model's), assuming a = "
    "grad_accum_steps BN forwards per EMA update. ModelEmaV3(decay=0.998), BN momentum 0.1, 288 "
    "updates: exactly 51.6% in every layer. A run started from `pretrained` or `initial_checkpoint` "
    "weights is estimated as before. `diff` "
    "of a live model against its EMA copy reports the same. A counter the statistics contradict is no "
    "count of updates: after t updates at momentum m running_var >= (1-m)^t (the data's variance is "
    "never negative), so when the implied variance of the data is negative in most channels "
    "(TF-converted weights whose converter writes num_batches_tracked = 1) the finding is info and "
    "says the counter or the momentum is not real, like converted weights. Without the live copy, and in a file without counters, a layer with trained weights "
    "whose running_var is still 1 within float32 rounding in half its channels or more is a "
    "warning. Layers that the file's recalibration record says `bnaudit recalibrate` wrote are not "
    "checked (population statistics: their counter is the number of calibration batches).",
    "Train longer, or re-estimate the statistics with `bnaudit recalibrate` (a few thousand samples suffice).",
    settings=("max-init-weight", "max-implied-var-ratio", "max-implied-mean-shift", "momentum"),
)
def _check_immature(ctx: RuleContext) -> Iterator[Finding]:
    from bnaudit.audit.checkpoint.immaturity import has_identity_stats, implied_damage

    r = RULES["BN003"]
    cfg = ctx.config
    for layer in ctx.discovery.layers:
        t, m = layer.num_batches_tracked, layer.momentum
        if layer.name in ctx.recalibrated or has_identity_stats(layer):
            continue
        if t is None and not ctx.is_ema and f"{layer.name}.num_batches_tracked" in ctx.tensors:
            continue  # a counter the file holds but not as one integer (a float copy): not "without counters"
        if ctx.is_ema or t is None:
            finding = _immature_without_counter(ctx, layer)
            if finding is not None:
                yield finding
            continue
        if t <= 0 or m is None or not 0.0 < m < 1.0:
            continue
        weight = initial_weight(m, t)
        if weight <= cfg.max_init_weight:
            continue
        assumed = " (assumed)" if layer.settings.momentum.assumed else ""
        impossible = _impossible_channels(layer, weight)
        if impossible * 2 > layer.num_features:
            yield r.finding(
                Severity.INFO,
                layer.name,
                f"{plural(t, 'update')} at momentum {m:g}{assumed} would leave running_var >= {weight:.3g}, yet "
                f"{impossible} of {layer.num_features} channels are below it (a negative variance of the data): "
                "the counter or the momentum is not real (converted weights write a placeholder counter); "
                "not judged by it",
            )
            continue
        message = (
            f"initial values still weigh {weight * 100:.1f}% after {plural(t, 'update')} at momentum {m:g}{assumed}"
        )
        damage = implied_damage(layer, weight)
        harmful = damage is not None and (
            max(damage.var_ratio, 1.0 / damage.var_ratio) >= cfg.max_implied_var_ratio
            or damage.mean_shift >= cfg.max_implied_mean_shift
        )
        if harmful and damage is not None:
            message += f": {damage.describe()}"
        severity = Severity.ERROR if harmful or weight >= IMMATURE_ERROR_WEIGHT else Severity.WARNING
        yield r.finding(severity, layer.name, message)


def _impossible_channels(layer: BNLayer, weight: float) -> int:
    """The channels whose running_var is below `weight`, the least t updates at momentum m
    leave (w = (1-m)^t of the initial 1, plus a non-negative share of the data's variance):
    the implied data variance (var - w) / (1 - w) is negative beyond float32 rounding."""
    floor = weight * (1.0 - 1e-6)
    return sum(1 for v in layer.running_var if v < floor)  # NaN compares False


# Below these an averaged copy's statistics are close enough to the live ones to say nothing
# about its start: var within a factor 1.5, mean within half a live standard deviation.
NOTABLE_VAR_FACTOR = 1.5
NOTABLE_MEAN_SHIFT = 0.5


def _against_live_finding(copy: BNLayer, live: BNLayer, what: str, cfg: Config) -> Finding | None:
    """BN003 for an averaged copy's layer judged against the live model's layer
    (immaturity.against_live): reported when the initial values' estimated weight exceeds
    max-init-weight and the copy's statistics differ notably from the live ones; an error
    when that difference passes max-implied-var-ratio / max-implied-mean-shift, or w >= 50%."""
    from bnaudit.audit.checkpoint.immaturity import against_live

    compared = against_live(copy, live)
    if compared is None or compared.initial_weight is None or compared.initial_weight <= cfg.max_init_weight:
        return None
    w = compared.initial_weight
    factor = max(compared.var_ratio, 1.0 / compared.var_ratio)
    if factor < NOTABLE_VAR_FACTOR and compared.mean_shift < NOTABLE_MEAN_SHIFT:
        return None  # close to the live statistics: a lagging average (or one begun from a trained model)
    harmful = factor >= cfg.max_implied_var_ratio or compared.mean_shift >= cfg.max_implied_mean_shift
    message = (
        f"{what}: the initial values still weigh about {w * 100:.0f}% of its statistics, estimated "
        f"against the live model: {compared.describe()}; recalibrate it, or use the live statistics"
    )
    severity = Severity.ERROR if harmful or w >= IMMATURE_ERROR_WEIGHT else Severity.WARNING
    return RULES["BN003"].finding(severity, copy.name, message)


@also_in("BN003", "diff")
def _check_immature_copy_in_diff(ctx: DiffContext) -> Iterator[Finding]:
    """An averaged copy diffed against its live model: the copy's statistics far from the
    live ones because they still hold the initial values, not because the weights moved."""
    from bnaudit.audit.checkpoint.immaturity import has_identity_stats

    for copy, live in ctx.averaged_pairs:
        if has_identity_stats(copy):
            continue
        finding = _against_live_finding(copy, live, ctx.averaged_kind, ctx.config)
        if finding is not None:
            yield finding


# Half the channels or more still at the initial variance: the layer's statistics never moved.
UNMOVED_SHARE = 0.5


def _immature_without_counter(ctx: RuleContext, layer: BNLayer) -> Finding | None:
    """BN003 for an averaged copy or a layer without a counter: against the live model's
    layer where the container holds it, else by the share of channels still at variance 1."""
    from bnaudit.audit.checkpoint.immaturity import has_initial_affine, unmoved_fraction
    from bnaudit.formats.ema import copy_words

    r, cfg = RULES["BN003"], ctx.config
    what = copy_words(ctx.averaging)
    live = ctx.live_layers.get(layer.name) if ctx.is_ema and ctx.live_layers is not None else None
    if ctx.is_ema:
        applies, scheduled = _scheduled_finding(ctx, layer, live, what)
        if applies:
            return scheduled
    if live is not None:
        return _against_live_finding(layer, live, what, cfg)
    share = unmoved_fraction(layer)
    if share < UNMOVED_SHARE or has_initial_affine(layer):
        return None
    subject = what if ctx.is_ema else "no counter"
    return r.finding(
        Severity.WARNING,
        layer.name,
        f"{subject}: running_var is still the initial 1 (within float32 rounding) in {share * 100:.0f}% of "
        "the channels while the weights are trained: statistics that never moved from their start",
    )


def _scheduled_finding(
    ctx: RuleContext, layer: BNLayer, live: BNLayer | None, what: str
) -> tuple[bool, Finding | None]:
    """(whether the schedule applies, BN003 for the layer) for an EMA copy whose schedule the
    container records (formulas.ema_initial_weight). It does not apply without args, from
    another start, for an unknown kind or without a count of updates; where it applies the
    finding is None when the initial values weigh no more than max-init-weight."""
    from bnaudit.audit.formulas import ema_decays, ema_initial_weight
    from bnaudit.formats.ema import V2, V3

    schedule, averaging, cfg = ctx.ema_schedule, ctx.averaging, ctx.config
    if schedule is None or not schedule.fresh_start or averaging is None or averaging.kind not in (V2, V3):
        return False, None
    # ModelEmaV3 copies the live counter; ModelEmaV2 averages it, so the live model's counts
    counter = layer.num_batches_tracked if averaging.kind == V3 else (live.num_batches_tracked if live else None)
    if not counter or counter < schedule.accumulation:
        return False, None
    updates = counter // schedule.accumulation
    m: float | None
    if schedule.bn_momentum is not None:
        m, said = schedule.bn_momentum, f"BN momentum {schedule.bn_momentum:g} (args.bn_momentum)"
    else:
        m = layer.momentum
        origin = "assumed" if layer.settings.momentum.assumed else f"from {layer.settings.momentum.origin()}"
        said = f"BN momentum {layer.settings.momentum.text()} {origin}"
    if m is not None and not 0.0 < m <= 1.0:
        return False, None
    v3 = averaging.kind == V3
    decays = ema_decays(
        updates, schedule.decay, schedule.warmup and v3, v3, schedule.warmup_gamma, schedule.warmup_power
    )
    weight = ema_initial_weight(decays, m, schedule.accumulation)
    if weight <= cfg.max_init_weight:
        return True, None
    if v3:
        how = f"decay 0 at update 1, then {'warmed up to ' if schedule.warmup else ''}{schedule.decay:g}"
    else:
        how = f"decay {schedule.decay:g} at every update"
    per = "one BN update" if schedule.accumulation == 1 else f"{schedule.accumulation} BN updates"
    message = (
        f"{what}: the initial values weigh {weight * 100:.1f}% of its statistics, computed from the EMA schedule "
        f"its args record ({schedule.recorded}: {how}; {plural(updates, 'update')}, counted by "
        f"num_batches_tracked at {per} per EMA update; {said})"
    )
    harmful = False
    if live is not None:
        from bnaudit.audit.checkpoint.immaturity import against_live

        compared = against_live(layer, live)
        if compared is not None:
            factor = max(compared.var_ratio, 1.0 / compared.var_ratio)
            harmful = factor >= cfg.max_implied_var_ratio or compared.mean_shift >= cfg.max_implied_mean_shift
            if factor >= NOTABLE_VAR_FACTOR or compared.mean_shift >= NOTABLE_MEAN_SHIFT:
                message += f": {compared.describe()}"
    severity = Severity.ERROR if harmful or weight >= IMMATURE_ERROR_WEIGHT else Severity.WARNING
    return True, RULES["BN003"].finding(severity, layer.name, f"{message}; recalibrate it, or use the live statistics")

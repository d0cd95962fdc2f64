"""The inspect rules on a checkpoint's BN layers (BN001-BN011; BN003 in `immature`).

The formulas (eval gain, initial weight, near-eps channels) are defined in
bnaudit.audit.formulas; one definition is the rules' own:

  live channel   |running_mean_c| >= sqrt(running_var_c + eps): the channel's data sits at
                 least one (eval-mode) standard deviation away from zero, so it carries a
                 signal; a dead channel (constant zero input) keeps mean ~0 and var ~0.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

from bnaudit.audit.formulas import all_finite, retained_fraction
from bnaudit.audit.rules.registry import RULES, Finding, RuleContext, rule, three_digits
from bnaudit.severity import Severity
from bnaudit.text import listing, plural

if TYPE_CHECKING:  # `bnaudit rules` imports this module and reads no checkpoint
    from bnaudit.audit.layers import BNLayer

# The checks import the estimates they use (bnaudit.audit.checkpoint.immaturity, .producers) where they
# run: `bnaudit rules` imports every rule module and needs none of their records.


def _constant_channels(ctx: RuleContext, layer: BNLayer, channels: list[int]) -> set[int]:
    """The channels among `channels` whose producing layer (an exported graph's node, the
    model graph's module, else by naming convention: bnaudit.audit.producers) has an
    all-zero filter: a constant input, not a live one."""
    from bnaudit.audit.producers import weight_fits, zero_filter_channels

    if not channels:
        return set()
    exported = ctx.graph_producers.get(layer.name)
    if exported is not None:
        return zero_filter_channels(exported.weight, channels, exported.out_axis)
    producer = ctx.producers.get(layer.name) if ctx.tensors else None
    weight = ctx.tensors.get(f"{producer}.weight") if producer is not None else None
    axis = 1 if producer in ctx.transposed else 0
    return (
        zero_filter_channels(weight, channels, axis)
        if weight is not None and weight_fits(weight, layer.num_features, axis)
        else set()
    )


def _adapter_missing_statistics(ctx: RuleContext) -> Iterator[Finding]:
    """BN001 for a PEFT adapter: a BN layer in its modules_to_save whose running statistics it
    does not hold (bnaudit.formats.peft)."""
    adapter = ctx.adapter
    if adapter is None:
        return
    for layer in ctx.discovery.layers:
        if not adapter.to_save(layer.name):
            continue
        lacking = [leaf for leaf in ("running_mean", "running_var") if f"{layer.name}.{leaf}" not in adapter.saved]
        if lacking:
            yield RULES["BN001"].finding(
                Severity.ERROR,
                layer.name,
                f"in the adapter's modules_to_save, but the adapter holds no {' / '.join(lacking)} for it (converted "
                "by convert_to_lora or save_as_lora?): PEFT cannot load it, or the reloaded model keeps the base's "
                "statistics instead of the trained ones",
            )


def is_untouched(layer: BNLayer) -> bool:
    """Identity statistics (running_mean 0, running_var 1) and beta exactly 0 in every
    channel: a module no training and no fold has touched (a fold writes beta - mean * gamma /
    sqrt(var + eps) into the bias; training moves the statistics)."""
    from bnaudit.audit.checkpoint.immaturity import has_identity_stats

    return has_identity_stats(layer) and layer.bias is not None and layer.bias.count(0.0) == len(layer.bias)


def _is_live(layer: BNLayer, channel: int) -> bool:
    """|running_mean_c| >= sqrt(running_var_c + eps): see "live channel" above."""
    mean, var = layer.running_mean[channel], layer.running_var[channel]
    return math.isfinite(mean) and abs(mean) >= math.sqrt(max(var, 0.0) + layer.eps)


@rule(
    "BN001",
    "missing-buffers",
    (Severity.ERROR, Severity.WARNING),
    "A layer lacks running_mean or running_var, or the file holds BN parameters without any buffers.",
    "Eval mode normalises with running_mean and running_var. A checkpoint saved without them "
    "(parameters only, a filtered state dict, `strict=False` on load) gives every BN layer the "
    "initial 0 and 1 when it is loaded, so eval mode computes (x - 0) / sqrt(1 + eps) instead of "
    "(x - mu) / sqrt(var + eps). Error: a layer has some of its buffers but not both statistics. "
    "Warning (suspected): the file has 1-D weight/bias pairs under batch-norm-like names "
    "(bn, batchnorm, downsample.1, ...) and no running statistics at all; LayerNorm or GroupNorm "
    "layers named that way are the innocent explanation. When the model is known (--arch, "
    "TorchScript, a pickled module) the check is exact: every BN module of the model whose "
    "running_mean or running_var is absent from the checkpoint is an error, whatever its name. A PEFT "
    "adapter folder is audited composed with its base: a BN layer in the adapter's `modules_to_save` whose "
    "running statistics the adapter does not hold is an error (`convert_to_lora` / `save_as_lora` drop them, "
    "peft PR 3481: the adapter then fails to load, or the reloaded model keeps the base's statistics).",
    "Save `model.state_dict()` (it includes buffers), not `named_parameters()`; load with "
    "strict=True; or re-estimate the statistics with `bnaudit recalibrate`.",
)
def _check_missing_buffers(ctx: RuleContext) -> Iterator[Finding]:
    r = RULES["BN001"]
    yield from _adapter_missing_statistics(ctx)
    if ctx.module is not None:
        # Exact: the model names its BN modules, so no name heuristics are needed.
        missing = set(ctx.module.missing)
        for name in ctx.module.norms:
            absent = [s for s in ("running_mean", "running_var") if _join(name, s) in missing]
            if absent:
                yield r.finding(
                    Severity.ERROR,
                    name,
                    f"the model's {ctx.module.norms[name].class_name} has no {' or '.join(absent)} in the "
                    "checkpoint: loading leaves the initial 0/1 and eval mode normalises with them",
                )
        return
    for group in ctx.discovery.incomplete:
        yield r.finding(
            Severity.ERROR,
            group.name,
            f"has {', '.join(group.present)} but no {' or '.join(group.missing)}",
        )
    suspected = ctx.discovery.suspected_without_buffers
    if suspected:
        shown = ", ".join(suspected[:5]) + (f" and {len(suspected) - 5} more" if len(suspected) > 5 else "")
        yield r.finding(
            Severity.WARNING,
            None,
            f"{plural(len(suspected), 'batch-norm-like parameter group')} ({shown}) and no running "
            "statistics anywhere: parameters saved without buffers? (LayerNorm/GroupNorm named "
            "this way would be innocent)",
        )


@rule(
    "BN002",
    "initial-values",
    Severity.ERROR,
    "running_mean is exactly 0 and running_var exactly 1 in every channel: statistics lost, reset or never loaded.",
    "Training never leaves the statistics at exactly 0 and 1 in every channel, so these values mean the "
    "buffers were reset (`reset_running_stats()`), never loaded, or never updated. Eval mode then "
    "normalises with mean 0 and variance 1, whatever the data's real statistics. If weight and bias "
    "are also at their initial 1 and 0 the whole layer is untrained. Exception: when no layer has a "
    "counter and every layer has identity statistics with trained weights, the statistics were folded "
    "into weight and bias (Caffe2/detectron2 FrozenBatchNorm): reported as info. A fold leaves "
    "beta - mean * gamma / sqrt(var + eps) as the bias, so when beta is also exactly 0 in every channel "
    "of every such layer the module was never trained (PyTorch before 0.4 initialised the weight "
    "uniformly at random and the bias to 0: onnx's bundled PyTorch 0.3 test exports): reported as info, "
    "an untrained module, not a fold.",
    "Reload the statistics from the original training checkpoint, or re-estimate them with "
    "`bnaudit recalibrate` on representative data.",
)
def _check_initial_values(ctx: RuleContext) -> Iterator[Finding]:
    from bnaudit.audit.checkpoint.immaturity import has_identity_stats, has_initial_affine

    r = RULES["BN002"]
    layers = ctx.discovery.layers
    identity = [layer for layer in layers if has_identity_stats(layer)]
    if not identity:
        return
    folded = (
        len(identity) == len(layers)
        and all(layer.num_batches_tracked is None for layer in layers)
        and all(not has_initial_affine(layer) for layer in layers)
    )
    if folded and all(is_untouched(layer) for layer in layers):
        yield r.finding(
            Severity.INFO,
            None,
            f"all {len(layers)} layers have identity statistics and beta exactly 0 in every channel, no counter: "
            "an untrained module (its weight as a framework initialised it), nothing folded",
        )
        return
    if folded:
        yield r.finding(
            Severity.INFO,
            None,
            f"all {len(layers)} layers have identity statistics, trained weights and no counter: "
            "statistics folded into weight/bias (FrozenBatchNorm, Caffe2/detectron2 style)",
        )
        return
    for layer in identity:
        if layer.weight is None and layer.bias is None:
            message = "running_mean is 0 and running_var is 1 in every channel (no affine parameters)"
        elif has_initial_affine(layer):
            message = "layer looks untrained: statistics 0/1 and weight 1, bias 0 as initialised"
        else:
            message = (
                "running_mean is 0 and running_var is 1 in every channel while weight/bias are "
                "trained: statistics lost, reset or never loaded"
            )
        if layer.num_batches_tracked:
            message += f" (num_batches_tracked = {layer.num_batches_tracked})"
        yield r.finding(Severity.ERROR, layer.name, message)


@rule(
    "BN004",
    "near-eps-variance",
    (Severity.ERROR, Severity.WARNING, Severity.INFO),
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
    "the signal is multiplied hundreds of times. A channel whose producing layer's filter is all zero "
    "(the node feeding the BN node in an ONNX graph or a `.pt2` program, as `bnaudit fold` pairs them; "
    "the model's graph with --arch; else the state dict's naming conventions: `features.3` feeds "
    "`features.4`, `conv1` feeds `bn1`, `downsample.0` feeds `downsample.1`) receives that layer's bias alone, a constant equal to "
    "its running_mean: whatever its mean and gain it is not live, and the message says so. Threshold "
    "factor 10 (`near-eps-factor`).",
    "Prune the dead channels, or check the data that reaches the layer; `bnaudit gap` shows whether eval mode suffers.",
    settings=("near-eps-factor", "max-gain", "max-live-gain", "eps"),
)
def _check_near_eps(ctx: RuleContext) -> Iterator[Finding]:
    r = RULES["BN004"]
    cfg = ctx.config
    for layer in ctx.discovery.layers:
        channels = layer.near_eps(cfg.near_eps_factor)
        if not channels:
            continue
        all_gains = layer.gains
        gains = {c: all_gains[c] for c in channels}
        worst = max(g for g in gains.values() if not math.isnan(g)) if any(map(math.isfinite, gains.values())) else 0.0
        live = [c for c in channels if _is_live(layer, c) and gains[c] > cfg.max_live_gain]
        constant = _constant_channels(ctx, layer, live)
        live = [c for c in live if c not in constant]
        severity = Severity.ERROR if live else Severity.WARNING if worst >= cfg.max_gain else Severity.INFO
        # worst first, NaN last; sorted is stable, so ties keep channel order
        order = sorted(channels, key=lambda c: -(0.0 if math.isnan(gains[c]) else gains[c]))
        details = ", ".join(
            f"ch {c} (var {three_digits(layer.running_var[c])}, gain {gains[c]:.1f})" for c in order[:5]
        )
        more = f" and {len(channels) - 5} more" if len(channels) > 5 else ""
        if severity == Severity.ERROR:
            tail = (
                f"; ch {listing(live, 5)} {'is' if len(live) == 1 else 'are'} live (|mean| >= sqrt(var+eps)) "
                f"with gain above {cfg.max_live_gain:g}"
            )
        else:
            tail = "" if severity == Severity.WARNING else f"; muted by small |gamma| (max gain {worst:.1f})"
        if constant:
            tail += (
                f"; ch {listing(sorted(constant), 5)}: the producing layer's filter is all zero, so the input is "
                "the constant running_mean and the gain multiplies nothing"
            )
        yield r.finding(
            severity,
            layer.name,
            f"{plural(len(channels), 'channel')} with running_var < {cfg.near_eps_factor:g}*eps "
            f"({three_digits(cfg.near_eps_factor * layer.eps)}): {details}{more}{tail}",
            channels,
        )


@rule(
    "BN005",
    "invalid-values",
    Severity.ERROR,
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
            finite = layer.var_finite if values is layer.running_var else all_finite(values)
            channels = [] if finite else [i for i, v in enumerate(values) if not math.isfinite(v)]
            if channels:
                nan = sum(1 for i in channels if math.isnan(values[i]))
                inf = len(channels) - nan
                parts = [f"{nan} NaN" if nan else "", f"{inf} Inf" if inf else ""]
                problems.append(f"{label} has {' and '.join(p for p in parts if p)} (channels {listing(channels, 8)})")
                bad.update(channels)
        var = layer.running_var
        floor = layer.var_floor
        negative = [] if floor is not None and floor >= 0 else [i for i, v in enumerate(var) if v < 0]
        if negative:
            problems.append(f"running_var is negative in {plural(len(negative), 'channel')} ({listing(negative, 8)})")
            bad.update(negative)
        if layer.num_batches_tracked is not None and layer.num_batches_tracked < 0:
            problems.append(f"num_batches_tracked is negative ({layer.num_batches_tracked})")
        if problems:
            yield r.finding(Severity.ERROR, layer.name, "; ".join(problems), sorted(bad))


def _join(prefix: str, leaf: str) -> str:
    return f"{prefix}.{leaf}" if prefix else leaf


@rule(
    "BN006",
    "batch-dependent-eval",
    Severity.WARNING,
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
                Severity.WARNING,
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
    (Severity.WARNING, Severity.INFO),
    "momentum 0 (buffers never update), None (cumulative average) or above 0.5 (a Keras/ONNX retained fraction?).",
    "PyTorch updates running statistics by new = (1 - m) * old + m * batch. With m = 0 training never "
    "changes them (the counter still counts), so they stay whatever was loaded; with m = None they "
    "are the plain average of every batch since the last reset (factor 1 / num_batches_tracked), "
    "which weighs early, untrained batches as much as late ones. Keras (0.99) and ONNX (0.9) call "
    "the retained fraction momentum; passed straight to PyTorch (HF MobileNetV2's 0.997) each batch "
    "replaces 99.7% of the statistics, which then describe the last batch only: a warning. Needs the "
    "module; eps and momentum are never saved in a state dict. An ONNX BatchNormalization node's "
    "momentum m (retained fraction) is translated to PyTorch's 1 - m first, and the message says so: "
    "ONNX 0.1 (PyTorch's 0.1 written unconverted) is PyTorch 0.9. An exported node of an untrained "
    "module (identity statistics, beta exactly 0) never applied its momentum and its statistics cannot "
    "tell a correct export from an unconverted one: said as info (onnx's bundled `momentum=0.8` test "
    "export is correct).",
    "Set the intended momentum on the module (PyTorch's 0.1 = 1 - Keras's 0.9; ONNX's 0.9), or "
    "recalibrate with `bnaudit recalibrate`, which does not depend on momentum.",
)
def _check_update_config(ctx: RuleContext) -> Iterator[Finding]:
    if ctx.module is None:
        return
    r = RULES["BN007"]
    layers = {layer.name: layer for layer in ctx.discovery.layers}
    for name, info in ctx.module.norms.items():
        if info.track_running_stats is False or not info.momentum_known:
            continue
        m = info.momentum
        layer = layers.get(name)
        exported = info.source is not None  # an exported node (ModuleInfo.source): its momentum was translated
        if exported and m is not None and m > _RETAINED_FRACTION_MOMENTUM and layer is not None and is_untouched(layer):
            # nothing tells a correct export of momentum=0.8 from PyTorch's 0.2 written unconverted
            yield r.finding(
                Severity.INFO,
                name,
                f"ONNX momentum {retained_fraction(m):.3g} = PyTorch {m:g} on an untrained module (identity "
                f"statistics, beta 0): never applied; in training each batch would replace {m * 100:.1f}% of the "
                "statistics",
            )
            continue
        if m is None:
            yield r.finding(
                Severity.INFO,
                name,
                "momentum None: running statistics are the cumulative average of "
                "every batch since the last reset (factor 1/num_batches_tracked)",
            )
        elif m == 0:
            yield r.finding(
                Severity.INFO,
                name,
                "momentum 0: training never updates the running statistics "
                "(the counter still counts); they stay as loaded",
            )
        elif m > _RETAINED_FRACTION_MOMENTUM:
            if info.source is not None:  # an exported node (ModuleInfo.source): its momentum was translated
                yield r.finding(
                    Severity.WARNING,
                    name,
                    f"ONNX momentum {retained_fraction(m):.3g} = PyTorch {m:g} (ONNX stores the retained fraction): each "
                    f"batch would replace {m * 100:.1f}% of the statistics; PyTorch's {retained_fraction(m):.3g} written "
                    f"unconverted, meant as ONNX {m:g}?",
                )
                continue
            yield r.finding(
                Severity.WARNING,
                name,
                f"momentum {m:g}: each batch replaces {m * 100:.1f}% of the "
                f"statistics; a retained fraction (Keras/ONNX convention) meant as {retained_fraction(m):.3g}?",
            )


@rule(
    "BN008",
    "low-precision-buffers",
    Severity.WARNING,
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
            yield r.finding(Severity.WARNING, layer.name, f"running statistics stored in {layer.stats_dtype}")


@rule(
    "BN009",
    "counter-zero",
    Severity.INFO,
    "num_batches_tracked is 0 but the statistics are not the initial values.",
    "PyTorch increments num_batches_tracked on every training-mode forward, so 0 with real statistics "
    "means the values were written some other way: converted weights (e.g. from Keras or ONNX) or "
    "momentum 0. Usually legitimate; worth knowing when momentum=None (cumulative averaging divides "
    "by the counter) or when the layer will be fine-tuned. Not checked in an EMA copy, whose counter "
    "counts nothing (timm's ModelEmaV2 averages it and truncates it to 0 early on).",
    "Nothing to fix if the weights were converted; otherwise check how the statistics were produced.",
)
def _check_counter_zero(ctx: RuleContext) -> Iterator[Finding]:
    from bnaudit.audit.checkpoint.immaturity import has_identity_stats

    if ctx.is_ema:  # an EMA copy's counter counts nothing (timm's ModelEmaV2 leaves it 0)
        return
    r = RULES["BN009"]
    for layer in ctx.discovery.layers:
        if layer.num_batches_tracked == 0 and not has_identity_stats(layer):
            yield r.finding(
                Severity.INFO,
                layer.name,
                "num_batches_tracked is 0 but the statistics are not 0/1: converted weights or momentum 0",
            )


@rule(
    "BN010",
    "uneven-counters",
    Severity.INFO,
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
    yield RULES["BN010"].finding(
        Severity.INFO, None, f"num_batches_tracked differs between layers: {'; '.join(parts)}{more}"
    )


@rule(
    "BN011",
    "load-mismatch",
    (Severity.ERROR, Severity.WARNING, Severity.INFO),
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
            Severity.ERROR,
            key.rpartition(".")[0] or None,
            f"'{key}' has shape {list(file_shape)} in the checkpoint but {list(model_shape)} in the model",
        )
    if missing:
        yield r.finding(
            Severity.ERROR,
            None,
            f"{plural(len(missing), 'key')} of the model absent from the checkpoint "
            f"{'keeps its initial value' if len(missing) == 1 else 'keep their initial values'}: {listing(missing, 5)}",
        )
    if facts.unexpected:
        yield r.finding(
            Severity.WARNING,
            None,
            f"{plural(len(facts.unexpected), 'checkpoint key')} the model does not have: {listing(facts.unexpected, 5)}",
        )
    if missing_counters:
        yield r.finding(
            Severity.INFO,
            None,
            f"num_batches_tracked absent for {plural(len(missing_counters), 'layer')} "
            f"({listing((k.rpartition('.')[0] for k in missing_counters), 5)}): PyTorch fills it on load",
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

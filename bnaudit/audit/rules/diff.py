"""The rules of `bnaudit diff` between two checkpoints (BN101-BN107): they judge how each
layer changed (layerdiff.LayerDiff; definitions of the numbers in bnaudit.audit.diff.layers).

A message says what the layer's row of the table and its JSON record do not: the per-layer
numbers (shift, log-ratio, weight change) are there already, so the same fact on many
layers reads the same and collapses into one row (a freeze bug on 20 layers is one row)."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator
from typing import TYPE_CHECKING

from bnaudit.audit.rules.registry import RULES, Finding, rule
from bnaudit.audit.settings import assumed_note, provenance_words
from bnaudit.severity import Severity
from bnaudit.text import listing, plural

if TYPE_CHECKING:
    from bnaudit.audit.diff.layers import DiffContext, LayerDiff

# The checks import bnaudit.audit.diff.layers where they run: importing the registry (every
# `inspect`, `rules`) then never loads the diff's machinery.


def _counter_words(d: LayerDiff) -> str:
    if d.batches_a is None or d.batches_b is None:
        return "no counter on one side"
    return f"num_batches_tracked {d.batches_a} -> {d.batches_b}"


@rule(
    "BN101",
    "frozen-but-updating",
    (Severity.ERROR, Severity.WARNING),
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
    from bnaudit.audit.diff import layers as layerdiff

    r = RULES["BN101"]
    for d in ctx.layers:
        if d.verdict == layerdiff.FROZEN_BUT_UPDATING:
            expected = layerdiff.matches(d.name, ctx.config.expect_frozen)
            yield r.finding(
                Severity.ERROR if expected else Severity.WARNING,
                d.name,
                f"weight and bias bit-identical but running statistics moved ({_counter_words(d)}): "
                "the module ran in training mode while its weights were frozen"
                + (" (expected frozen)" if expected else ""),
            )


@rule(
    "BN102",
    "stale-statistics",
    (Severity.ERROR, Severity.WARNING),
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
    from bnaudit.audit.diff import layers as layerdiff

    r = RULES["BN102"]
    limit = ctx.config.stale_max_change
    for d in ctx.layers:
        if d.verdict != layerdiff.STALE:
            continue
        changes = [c for c in (d.weight_change, d.bias_change) if c is not None]
        worst = max(changes, default=0.0)
        severity = Severity.ERROR if not worst <= limit else Severity.WARNING  # NaN counts as moved too far
        yield r.finding(
            severity,
            d.name,
            f"{' and '.join(d.moved)} moved while running statistics are bit-identical "
            f"and the counter did not grow: weights trained or averaged (EMA/SWA) without updating the "
            f"statistics; recalibrate"
            + (f" (change above stale-max-change {limit:g})" if severity == Severity.ERROR else ""),
        )


@rule(
    "BN103",
    "re-estimated",
    Severity.INFO,
    "Running statistics replaced while the counter was reset or replaced: a recalibration.",
    "Statistics that moved while the counter did not grow (or fell: `update_bn` and "
    "`bnaudit recalibrate` reset it and count their own batches) were re-estimated rather than "
    "trained. That is usually the fix for stale statistics; the finding names bnaudit's "
    "provenance record when side B carries one (`bnaudit recalibrate` writes it into every format).",
    "Nothing to fix; check that the calibration data matched the data the model will see.",
    command="diff",
)
def _check_re_estimated(ctx: DiffContext) -> Iterator[Finding]:
    from bnaudit.audit.diff import layers as layerdiff

    r = RULES["BN103"]
    for d in ctx.layers:
        if d.verdict != layerdiff.RE_ESTIMATED:
            continue
        if d.recalibrated and ctx.provenance:
            how = f"re-estimated by {ctx.provenance}"
        else:
            how = "statistics re-estimated (a recalibration such as update_bn)"
        weights = "weights identical" if d.params_identical else "weights also moved"
        yield r.finding(Severity.INFO, d.name, f"{how}: {_counter_words(d)}; {weights}")


@rule(
    "BN104",
    "uneven-counting",
    Severity.WARNING,
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
    from bnaudit.audit.diff import layers as layerdiff

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
    parts = [f"+{base} in {plural(len(base_names), 'layer')} ({layerdiff.describe_group(base_names, every)})"]
    for change, names in ordered[1:6]:
        ratio = change / base
        ratio_text = f"exactly {ratio:g}x" if change % base == 0 or base % change == 0 else f"{ratio:.3g}x"
        parts.append(
            f"+{change} in {plural(len(names), 'layer')} ({layerdiff.describe_group(names, every)}): {ratio_text}"
        )
    more = f"; and {len(ordered) - 6} more increments" if len(ordered) > 6 else ""
    twice = any(change == 2 * base for change in groups)
    hint = ": BN forwards run twice per step there (activation checkpointing?)" if twice else ""
    yield RULES["BN104"].finding(Severity.WARNING, None, f"counter increments differ: {'; '.join(parts)}{more}{hint}")


@rule(
    "BN105",
    "expectation-violated",
    Severity.ERROR,
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
    from bnaudit.audit.diff import layers as layerdiff

    r = RULES["BN105"]
    cfg = ctx.config
    for d in ctx.layers:
        if layerdiff.matches(d.name, cfg.expect_frozen) and d.verdict != layerdiff.FROZEN_BUT_UPDATING and d.moved:
            if d.moved == ["num_batches_tracked"]:
                continue  # the counter counts in train() even at momentum 0: nothing the layer computes moved
            yield r.finding(Severity.ERROR, d.name, f"expected frozen, but {', '.join(d.moved)} moved")
        if layerdiff.matches(d.name, cfg.expect_trained) and d.params_identical:
            what = "weight and bias are" if d.verdict != layerdiff.UNCHANGED else "nothing is"
            yield r.finding(Severity.ERROR, d.name, f"expected to train, but {what} bit-identical")
    names = [d.name for d in ctx.layers] + ctx.only_a + ctx.only_b + [n for n, _, _ in ctx.reshaped]
    for option, globs in (("expect-frozen", cfg.expect_frozen), ("expect-trained", cfg.expect_trained)):
        for glob in globs:
            if not any(fnmatch.fnmatchcase(n, glob) for n in names):
                yield r.finding(Severity.ERROR, None, f"{option} glob {glob!r} matches no BN layer")


@rule(
    "BN106",
    "settings-changed",
    (Severity.ERROR, Severity.INFO),
    "eps (error) or momentum (info) differs between the two sides (info when one side's value is only assumed).",
    "eps and momentum are constructor arguments, never saved in a state dict; only files that hold "
    "modules (TorchScript, pickled torch.nn) carry them. A changed eps changes the function eval "
    "mode computes, (x - mu) / sqrt(var + eps): a model evaluated with another eps than it was "
    "trained with computes another function (error). A changed momentum only changes how future "
    "training updates the statistics (info). A side without modules uses the eps and momentum given "
    "by --eps / --momentum or the configuration, which count as known; without them PyTorch's "
    "defaults are only assumed, and a difference from the other side's modules is an info that says "
    "what to pass.",
    "Build the model with the eps it was trained with (a Keras port: 1e-3); set momentum deliberately.",
    command="diff",
)
def _check_settings_changed(ctx: DiffContext) -> Iterator[Finding]:
    r = RULES["BN106"]
    if ctx.export is not None:
        return  # a checkpoint against its export: BN109 and BN110 say it in ONNX's terms
    for d in ctx.layers:
        for name, a, b in (
            ("eps", d.settings_a.eps, d.settings_b.eps),
            ("momentum", d.settings_a.momentum, d.settings_b.momentum),
        ):
            if a.value == b.value:
                continue
            if a.assumed or b.assumed:  # both assumed: the same default, never different
                (side, assumed), other = (("A", a), b) if a.assumed else (("B", b), a)
                yield r.finding(
                    Severity.INFO,
                    d.name,
                    f"{name} {other.text()} on the other side; "
                    + assumed_note(name, assumed, other.text(), holder=f"side {side}"),
                )
            elif name == "eps":
                given = provenance_words(a) or provenance_words(b)
                yield r.finding(
                    Severity.ERROR,
                    d.name,
                    f"eps changed from {a.text()} to {b.text()}{given}: eval mode computes another function",
                )
            else:
                yield r.finding(Severity.INFO, d.name, f"momentum changed from {a.value} to {b.value}")


@rule(
    "BN107",
    "layers-changed",
    (Severity.WARNING, Severity.INFO),
    "A layer's channel count changed or the two files look like different models (warning), or "
    "layers exist on one side only (info).",
    "Layers are matched by name after each side's wrapper prefix (module., _orig_mod., model.) is "
    "stripped. A layer whose channel count changed was replaced, not trained: its statistics "
    "cannot be compared. Layers on one side only were added, removed or renamed; a rename "
    "hides what happened to them. Generic names (`p2o.BatchNormalization.0` in every "
    "paddle2onnx export, `bn1`) pair layers of models that have nothing in common: when fewer "
    "than half of all layer names pair, or most pairs disagree in channel count, the two files "
    "look like different models (warning) and their verdicts compare unrelated layers.",
    "Nothing to fix when the architecture changed on purpose; otherwise check the key names "
    "(--key-a / --key-b choose the state dicts of a container).",
    command="diff",
)
def _check_layers_changed(ctx: DiffContext) -> Iterator[Finding]:
    from bnaudit.audit.diff import layers as layerdiff

    r = RULES["BN107"]
    why = None if ctx.export is not None else layerdiff.unrelated(len(ctx.layers), ctx.reshaped, ctx.only_a, ctx.only_b)
    if why:
        yield r.finding(
            Severity.WARNING,
            None,
            f"the two files look like different models: {why}; the layers that share a name are compared anyway",
        )
    for name, ca, cb in ctx.reshaped:
        yield r.finding(Severity.WARNING, name, f"channel count changed from {ca} to {cb}: the layer was replaced")
    for side, names in (("A", ctx.only_a), ("B", ctx.only_b)):
        if names and ctx.export is None:  # an export's own extra layers are BN113's
            yield r.finding(Severity.INFO, None, f"{plural(len(names), 'layer')} only in {side}: {listing(names, 5)}")

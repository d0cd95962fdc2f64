"""The rules of `bnaudit parity`: BN401-BN403, where a deployed target (torch.compile, an ONNX
model in onnxruntime, a .pt2 program, a TorchScript file) stops computing what the
checkpoint computes in eager PyTorch (definitions in bnaudit.audit.parity and
bnaudit.audit.statistics)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from bnaudit.audit.rules.registry import RULES, Finding, rule, three_digits
from bnaudit.severity import Severity
from bnaudit.text import plural

if TYPE_CHECKING:  # `bnaudit parity` builds it; registering the rules needs none of it
    from bnaudit.audit.parity import ParityContext

# The checks import the parity records where they run: every command imports this module to
# register the rules (inspect of one file among them), and none of them but parity reads them.


@rule(
    "BN401",
    "parity-layer-diverges",
    Severity.ERROR,
    "The deployed target's output of a BN layer deviates from eager PyTorch's beyond 10x float32 noise: the first such layer in execution order.",
    "bnaudit parity runs eager PyTorch and the target (torch.compile with a backend, an ONNX model in "
    "onnxruntime, a torch.export program, a TorchScript file) on the same batches and reads the target's "
    "output of every BN layer (or, where BN was folded into its producer, the producer's output). Per channel, "
    "the largest change against eager's float32 output relative to the channel's largest value is compared "
    "with the noise floor: what float32 rounding alone does at that layer (eager in float32 against a float64 "
    "copy), rounded up to a power of ten. A healthy target stays within a few times the floor; the first layer "
    "beyond 10x it is where the target starts to compute something else (a 1% change of a layer's output is "
    "hundreds of times the floor). The finding names that layer and what differs there where it can be read: "
    "the artifact's eps, statistics, training mode or folding (as `bnaudit diff` compares them), the "
    "compiled graph's eps or training argument, a precision below float32, or the change itself (a "
    "per-channel scale points to running_var, weight or eps; a shift to running_mean or bias; no fixed "
    "change to batch statistics). Later layers that exceed the floor too are counted: they inherit the "
    "difference, or add their own.",
    "Fix what the finding names at that layer (export again from the model with the checkpoint loaded, in "
    "eval mode, with its eps); for a compiler backend, report the layer and the backend upstream, or compile "
    "without the pass that changes it.",
    command="parity",
)
def _check_divergent(ctx: ParityContext) -> Iterator[Finding]:
    from bnaudit.audit.parity import first_divergent, reading
    from bnaudit.audit.statistics import PARITY_FACTOR

    first = first_divergent(ctx.layers)
    if first is None:
        return
    after = [layer for layer in ctx.layers[ctx.layers.index(first) + 1 :] if layer.diverges]
    later = (
        f"; {plural(len(after), 'later layer')} {'exceeds' if len(after) == 1 else 'exceed'} it too" if after else ""
    )
    yield RULES["BN401"].finding(
        Severity.ERROR,
        first.name,
        f"the {ctx.target.kind} target's output ({first.site}) deviates by {three_digits(first.relative)}, "
        f"{three_digits(first.ratio)}x its noise floor {first.floor:.0e}: the first layer in execution order beyond "
        f"{PARITY_FACTOR}x{later}. What differs: {reading(first)}",
        first.channels_over,
    )


@rule(
    "BN402",
    "parity-outputs-deviate",
    Severity.ERROR,
    "The deployed target's final outputs deviate from eager PyTorch's beyond 10x float32 noise.",
    "The final outputs of the target and of eager PyTorch (float32) on the same samples: the largest relative "
    "deviation of a sample, max |y - r| / max |r|, against 10x the outputs' noise floor (float32 against a "
    "float64 copy of the model, rounded up to a power of ten). Top-1 agreement is reported beside it but not "
    "judged alone: where two classes nearly tie, noise flips the argmax. Outputs that deviate while no BN "
    "layer diverges point after the last BN layer, or to a layer whose output the target does not show "
    "(BN403).",
    "Follow BN401's layer if there is one; otherwise compare the layers after the last BN.",
    command="parity",
)
def _check_outputs(ctx: ParityContext) -> Iterator[Finding]:
    from bnaudit.audit.parity import first_divergent, threshold_words

    o = ctx.outputs
    if not o.deviates:
        return
    where = (
        f"; the first divergent layer is {first.name}"
        if (first := first_divergent(ctx.layers)) is not None
        else "; no BN layer diverges: the difference starts after the last BN layer or in a layer the target "
        "does not show"
    )
    yield RULES["BN402"].finding(
        Severity.ERROR,
        None,
        f"largest relative output deviation {three_digits(o.relative)} ({threshold_words(o.floor)}), "
        f"max |change of an output| {three_digits(o.max_abs)}, top-1 agreement {o.top1_agreement:.1%} on "
        f"{plural(o.samples, 'sample')}{where}",
    )


@rule(
    "BN403",
    "parity-layer-unseen",
    Severity.INFO,
    "A BN layer of the checkpoint whose output the deployed target does not show: not compared.",
    "parity reads a layer's output where the target computes it: a BatchNormalization node's output (or the "
    "Conv/Gemm node BN was folded into, paired as `bnaudit diff` pairs them), a batch-norm call of the "
    "compiled graph or of the program's operators, found by the layer's own statistics tensors. A layer the "
    "eager forward never calls, a node inside an ONNX subgraph or function, a fold that could not be paired "
    "with a node, or a target that fused the layer away out of sight leaves nothing to read: the layer is "
    "listed, not judged. The outputs are still compared (BN402).",
    "Pass --arch so folded layers are paired through the model graph, or export with the BN nodes kept.",
    command="parity",
)
def _check_unseen(ctx: ParityContext) -> Iterator[Finding]:
    for layer in ctx.unseen:
        yield RULES["BN403"].finding(Severity.INFO, layer.name, f"not compared: {layer.reason}")

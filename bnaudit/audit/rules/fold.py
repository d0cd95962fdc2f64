"""The rules of `bnaudit fold`: BN201-BN207, what folding BN into its producer and then
int8 or half precision do to each channel (definitions in bnaudit.audit.fold.check)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from bnaudit.audit.formulas import COARSE_LEVELS
from bnaudit.audit.rules.registry import RULES, Finding, rule, three_digits
from bnaudit.severity import Severity
from bnaudit.text import listing, plural

if TYPE_CHECKING:  # `bnaudit fold` builds them; registering the rules needs none of it
    from bnaudit.audit.fold.check import FoldContext, PairPrediction


def _channels(channels: tuple[int, ...]) -> str:
    return f"{'channel' if len(channels) == 1 else 'channels'} {listing(channels, 8)}"


def _left_out(silent: tuple[int, ...]) -> str:
    """BN201's and BN205's count of the near-silent channels they leave out (fold.check: SILENT_FLOOR)."""
    if not silent:
        return ""
    return (
        f"; {plural(len(silent), 'near-silent channel')} left out ({_channels(silent)}: output variation or "
        "folded weights <= 1e-6 of the layer's largest, nothing to lose in float already)"
    )


def _setter(p: PairPrediction) -> str:
    s = p.scale_set_by
    if s is None:
        return ""
    if s.running_var is None or s.gamma is None or s.gain is None:
        return f"the scale {three_digits(p.int8_scale or 0.0)} is set by channel {s.channel} (BN already folded)"
    return (
        f"the scale {three_digits(p.int8_scale or 0.0)} is set by channel {s.channel} "
        f"(running_var {three_digits(s.running_var)}, gamma {three_digits(s.gamma)}, gain {three_digits(s.gain)})"
    )


@rule(
    "BN201",
    "int8-per-tensor-collapse",
    (Severity.ERROR, Severity.INFO),
    "After folding, whole output channels round to zero in int8 per-tensor quantization.",
    "Folding multiplies channel c of the producer's weights by gamma_c / sqrt(var_c + eps). A channel "
    "with a tiny running_var (torchvision's InceptionV3 ships 1.86e-14, a gain near 1000) then holds "
    "weights far larger than every other channel's, and symmetric per-tensor int8 (scale "
    "S = max|W'| / 127, round half to even) spends its range on that one channel: a channel c with "
    "max|W'_c| <= S/2 rounds to all zeros and outputs its bias alone. An error when such a channel's "
    "folded weights were not zero (it carried signal); info when they were zero already. The finding "
    "names the channels and the channel that sets the scale, with its running_var, gamma and gain. "
    "A channel that carried nothing in float already is not counted as live: its output varies by "
    "|gamma_c| sqrt(var_c / (var_c + eps)) <= 1e-6 of the layer's loudest channel's, or its folded weights "
    "are <= 1e-6 of the largest (a slimmed network's gamma ~1e-9, a channel whose input never varies); the "
    "finding says how many such near-silent channels it left out.",
    "Quantize per channel (one scale per output channel), or repair the statistic behind the scale: "
    "re-estimate it (`bnaudit recalibrate`) or clamp the running_var of dead channels before export.",
    command="fold",
)
def _check_collapse(ctx: FoldContext) -> Iterator[Finding]:
    r = RULES["BN201"]
    for p in ctx.pairs:
        if not p.collapsed:
            continue
        live, silent = p.live_collapsed, p.silent_collapsed
        severity = Severity.ERROR if live else Severity.INFO
        if live:
            what = f"{plural(len(live), 'live channel')} of {p.channels} ({_channels(live)}) round to all zeros in int8 per-tensor"
        elif silent:
            what = f"{_channels(p.collapsed)} of {p.channels} round to all zeros in int8 per-tensor"
        else:
            what = f"{_channels(p.collapsed)} of {p.channels} hold zero folded weights already"
        yield r.finding(
            severity, p.bn, f"{what} after folding into {p.producer}: {_setter(p)}{_left_out(silent)}", p.collapsed
        )


@rule(
    "BN202",
    "int8-per-tensor-coarse",
    Severity.WARNING,
    "After folding, output channels keep fewer than 4 bits in int8 per-tensor quantization.",
    f"A channel c whose largest folded weight is below {COARSE_LEVELS:g} int8 steps (max|W'_c| < "
    f"{COARSE_LEVELS:g} S, S = max|W'| / 127) keeps fewer than 8 levels: its weights round to a handful "
    "of values. Caused by a spread of folded gains gamma_c / sqrt(var_c + eps) across the channels of "
    "one layer; the finding names the channels and the channel that sets the scale.",
    "Quantize per channel, or re-estimate the statistics of the channel that sets the scale.",
    command="fold",
)
def _check_coarse(ctx: FoldContext) -> Iterator[Finding]:
    r = RULES["BN202"]
    for p in ctx.pairs:
        if p.coarse:
            yield r.finding(
                Severity.WARNING,
                p.bn,
                f"{plural(len(p.coarse), 'channel')} of {p.channels} ({_channels(p.coarse)}) keep fewer than "
                f"{COARSE_LEVELS:g} int8 levels after folding into {p.producer}: {_setter(p)}",
                p.coarse,
            )


@rule(
    "BN203",
    "int8-per-channel-collapse",
    Severity.INFO,
    "After folding, output channels whose weights are all zero: nothing is left to quantize.",
    "With one scale per output channel, int8 keeps every channel that has a non-zero weight; only a "
    "channel whose folded weights W'_c = W_c gamma_c / sqrt(var_c + eps) are all zero already (gamma 0, "
    "or zero weights) outputs its bias alone, in float as in int8.",
    "Nothing to fix for quantization; a pruned or dead channel can be removed.",
    command="fold",
)
def _check_per_channel(ctx: FoldContext) -> Iterator[Finding]:
    r = RULES["BN203"]
    for p in ctx.pairs:
        if p.per_channel_collapsed:
            c = p.per_channel_collapsed
            yield r.finding(
                Severity.INFO,
                p.bn,
                f"{_channels(c)} of {p.channels} {'has' if len(c) == 1 else 'have'} zero folded weights in {p.producer}",
                c,
            )


@rule(
    "BN204",
    "fp16-overflow",
    Severity.ERROR,
    "A running_var, folded weight, folded bias or gain becomes inf in fp16.",
    "float16's largest finite value is 65504 and round-to-nearest sends every magnitude of 65520 or "
    "more to inf. A running_var that large is inf in an fp16 model (the BN then outputs beta); a "
    "folded weight, folded bias beta + (b - mean) gamma / sqrt(var + eps) or gain gamma / sqrt(var + eps) "
    "that large makes the folded layer output inf or NaN. The finding names the channels and which "
    "quantity overflows.",
    "Keep this layer in float32, or repair the statistic (a running_var that large usually means "
    "diverged training or unnormalised inputs).",
    command="fold",
)
def _check_overflow(ctx: FoldContext) -> Iterator[Finding]:
    r = RULES["BN204"]
    for p in ctx.pairs:
        if p.fp16_overflow:
            detail = listing((f"{c} ({w})" for c, w in zip(p.fp16_overflow, p.fp16_overflow_what)), 8)
            yield r.finding(
                Severity.ERROR, p.bn, f"fp16 overflow (>= 65520 rounds to inf) in channels {detail}", p.fp16_overflow
            )


@rule(
    "BN205",
    "fp16-flush",
    (Severity.WARNING, Severity.INFO),
    "After folding, every weight of an output channel rounds to zero in fp16.",
    "float16's smallest subnormal is 2^-24 and every magnitude up to 2^-25 rounds to 0: a channel whose "
    "folded weights are all that small (a near-zero gamma over a large running_var) outputs its bias "
    "alone in fp16. A warning when such a channel carried signal in float; info when every flushed channel "
    "was near-silent already (as for BN201: output variation or folded weights <= 1e-6 of the layer's "
    "largest, a slimmed network's gamma ~1e-9), which the finding counts apart.",
    "Keep the layer in float32 or bf16, or remove the channel if it is dead.",
    command="fold",
)
def _check_flush(ctx: FoldContext) -> Iterator[Finding]:
    r = RULES["BN205"]
    for p in ctx.pairs:
        if not p.fp16_flush:
            continue
        live = p.live_flush
        if live:
            severity, what = Severity.WARNING, f"{plural(len(live), 'live channel')} ({_channels(live)})"
            tail = _left_out(p.silent_flush)
        else:
            severity, what, tail = (
                Severity.INFO,
                _channels(p.fp16_flush),
                ", all near-silent: nothing to lose in float already",
            )
        message = f"{what} of {p.channels}: every folded weight rounds to 0 in fp16{tail}"
        yield r.finding(severity, p.bn, message, p.fp16_flush)


@rule(
    "BN206",
    "half-cancellation",
    Severity.WARNING,
    "A channel's mean dwarfs its standard deviation: x - mean cancels in bf16 or fp16.",
    "In half precision the input x ~ N(mean, var) and the mean (or the folded bias that subtracts it) "
    "are rounded to the format before x - mean is formed, an absolute error up to |mean| u, u the unit "
    "roundoff (fp16 2^-11, bf16 2^-8). In the channel's standard deviations that is "
    "e_c = |mean_c| u / sqrt(var_c + eps); the finding lists the channels above max-cancellation "
    "(0.05 by default) per format.",
    "Keep the layer in float32, or centre its input (a bias before the BN absorbs the mean).",
    settings=("max-cancellation",),
    command="fold",
)
def _check_cancellation(ctx: FoldContext) -> Iterator[Finding]:
    r = RULES["BN206"]
    for p in ctx.pairs:
        for fmt, channels in (("bf16", p.bf16_cancellation), ("fp16", p.fp16_cancellation)):
            if channels and p.worst_cancellation is not None:
                e, c = p.worst_cancellation
                scale = 1.0 if fmt == "bf16" else 2.0**-3  # fp16's unit roundoff is bf16's / 8
                yield r.finding(
                    Severity.WARNING,
                    p.bn,
                    f"{fmt}: {plural(len(channels), 'channel')} ({_channels(channels)}) "
                    f"{'loses' if len(channels) == 1 else 'lose'} more than "
                    f"{three_digits(ctx.config.max_cancellation)} std to cancellation (worst channel {c}: "
                    f"{three_digits(e * scale)})",
                    channels,
                )


@rule(
    "BN207",
    "bn-not-paired",
    Severity.INFO,
    "A BN layer without a producer to fold into (by the state dict's names or the graph).",
    "bnaudit pairs each BN with the Conv or Linear before it by the naming conventions of real "
    "libraries (Sequential index i-1, convK/bnK, conv_stem/bn1, downsample.0/.1, .conv/.bn siblings, "
    "transformers convolution/normalization) where the producer's output channels equal the BN's; in an "
    "exported graph (ONNX, .pt2), a BN node whose input is the output of one Conv, Gemm or linear that "
    "nothing else reads. A "
    "BN that follows an Add, a concat or a pooling cannot be folded and stays a standalone op, which "
    "some backends (ExecuTorch/XNNPACK, Arm) refuse or decompose; a BN whose producer is named "
    "otherwise is simply not audited by `fold`.",
    "Audit the export instead (ONNX, TorchScript: pairs from the graph), or ignore BN207 for layers "
    "known to stand alone.",
    command="fold",
)
def _check_unpaired(ctx: FoldContext) -> Iterator[Finding]:
    r = RULES["BN207"]
    for name, why in ctx.unpaired:
        yield r.finding(Severity.INFO, name, why)

"""Will a BatchNorm survive being folded into the layer before it, then int8, fp16, bf16?

Torch- and numpy-free (plain Python floats, float64), like the rest of audit/. Deployment
folds every eval-mode BN into its producer (a Conv or Linear whose output it normalises);
with the folded scale and bias of `bnaudit.audit.formulas` (`folded_conv`), per output
channel c:

    W'_c = s_c * W_c,   s_c = gamma_c / sqrt(var_c + eps)
    b'_c = t_c = beta_c + (b_c - mu_c) * s_c          (b_c the producer's bias, 0 without)

Every prediction below depends on a channel's weights only through M'_c = max_k |W'_c,k|
= |s_c| * max_k |W_c,k| (rounding is monotone, so the maximum of the rounded products is
the rounded product of the maximum): the producer's weights are reduced to one number per
channel as they are read (`channel_maxima`: from a safetensors file, streamed whole channels
at a time).

int8, per tensor  symmetric, scale S = max_c M'_c / 127, q = round_half_even(W'/S) clamped
                  to [-127, 127]. Channel c *collapses* when every weight rounds to 0:
                  M'_c / S <= 1/2 (half-to-even sends exactly 1/2 to 0); the channel then
                  outputs its bias alone. It is *coarse* when it does not collapse but
                  M'_c < 8 S: its largest weight gets fewer than 8 levels (under 4 bits).
                  The channel c* with M'_c* = 127 S *sets the scale*; its BN channel's
                  var, gamma and gain |s_c*| say why.
                  range ratio  r_c = M'_c / max_c M'_c; collapse is r_c <= 1/254.
                  A collapsed channel is *live* unless it carried nothing in float
                  already (*silent*): its output's variation sigma_c = |gamma_c|
                  sqrt(var_c / (var_c + eps)) (formulas.channel_signal) is at most
                  SILENT_FLOOR (1e-6) of the layer's largest, or its folded weights
                  M'_c are at most SILENT_FLOOR of the largest M' (a pruned gamma ~1e-9, a
                  channel whose input never varies); those are counted apart.
int8, per channel one scale per channel, S_c = M'_c / 127: only a channel whose W'_c is
                  all zero already (gamma 0, or zero weights) rounds to nothing.
fp16              largest finite value 65504; round-to-nearest sends |x| >= 65520 to inf.
                  *overflow*: var_c, M'_c, |b'_c| or the gain |s_c| is >= 65520.
                  *flush*: 0 < M'_c <= 2^-25: every weight of the channel rounds to 0
                  (the smallest subnormal is 2^-24; half of it rounds to even, 0).
                  A flushed channel that was *silent* in float (above) loses nothing:
                  counted apart, as for int8.
cancellation      a half-precision BN forward (or the folded bias b' = beta - mu s added to
                  W'x) computes x - mu with x ~ N(mu_c, var_c) and mu_c rounded to the
                  format: an absolute error up to |mu_c| u, i.e. in the channel's standard
                  deviations  e_c = |mu_c| u / sqrt(var_c + eps), u the unit roundoff
                  (fp16 2^-11, bf16 2^-8). Flagged where e_c > max-cancellation (0.05).

Pairing (`paired_producers`): the producer finder (bnaudit.audit.producers) names each BN's
producer, from a traced forward with --arch, else from the state dict's names (the naming
conventions, then the module stored right before the BN): a weight of two or more
dimensions whose output-channel dimension equals the BN's channel count, not itself a BN.
A BN without one is listed as unpaired with the reason: folding needs the layer before it,
and a BN after an Add, a concat or a pooling stays a standalone op (which some backends
refuse). A ConvTranspose (weight (C_in, C_out, k...), groups 1) holds its output channels on
axis 1: W'_c scales weight[:, c] and M'_c is its maximum (a graph tells the type: --arch,
ONNX, .pt2; names cannot, see bnaudit.audit.producers).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from bnaudit.audit.formulas import (
    COARSE_LEVELS,
    COLLAPSE_LEVELS,
    FP16_FLUSH,
    FP16_OVERFLOW,
    INT8_LEVELS,
    SILENT_FLOOR,
    UNIT_ROUNDOFF,
    channel_signal,
    folded_conv,
)
from bnaudit.audit.layers import BNLayer
from bnaudit.audit.producers import Producers, producers_from_names, weight_fits
from bnaudit.config import Config
from bnaudit.errors import BnauditError
from bnaudit.formats.model import STORAGE_ITEMSIZE, TensorRef, decode_values


@dataclass(frozen=True)
class Producer:
    """The layer a BN folds into, as a state dict names it (`out_axis`: the weight's axis of
    output channels, 1 for a ConvTranspose)."""

    name: str
    weight: TensorRef
    bias: TensorRef | None
    out_axis: int = 0


@dataclass(frozen=True)
class ScaleSetter:
    """The channel whose folded weights set the per-tensor int8 scale, and its BN numbers."""

    channel: int
    # its BN channel's numbers; None for a conv an exporter already folded (no BN left)
    running_var: float | None
    gamma: float | None
    gain: float | None  # |gamma| / sqrt(var + eps)


@dataclass(frozen=True)
class PairPrediction:
    """What folding, int8 and half precision do to one BN and its producer (definitions in
    the module docstring). Channel lists are indices of output channels."""

    bn: str
    producer: str
    paired_by: str  # "name": naming conventions; "graph": the BN node's input; "folded": no BN left
    channels: int
    eps: float | None  # None for a conv already folded
    int8_scale: float | None  # S; None when a folded weight is not finite (BN005's case) or all are 0
    collapsed: tuple[int, ...]
    live_collapsed: tuple[int, ...]  # collapsed channels that carried a signal in float (not silent)
    silent_collapsed: tuple[int, ...]  # collapsed channels with non-zero W'_c that carried nothing in float
    coarse: tuple[int, ...]
    scale_set_by: ScaleSetter | None
    worst_range_ratio: float | None  # min_c r_c
    per_channel_collapsed: tuple[int, ...]
    fp16_overflow: tuple[int, ...]
    fp16_overflow_what: tuple[str, ...]  # which quantity overflows, one per overflow channel
    fp16_flush: tuple[int, ...]
    silent_flush: tuple[int, ...]  # the flushed channels that carried nothing in float already
    fp16_cancellation: tuple[int, ...]
    bf16_cancellation: tuple[int, ...]
    worst_cancellation: tuple[float, int] | None  # (e_c at bf16, c) of the worst channel

    @property
    def live_flush(self) -> tuple[int, ...]:
        """The flushed channels that carried a signal in float."""
        return tuple(c for c in self.fp16_flush if c not in self.silent_flush)


@dataclass(frozen=True)
class FoldContext:
    """What the fold rules (BN2xx) read."""

    pairs: tuple[PairPrediction, ...]
    unpaired: tuple[tuple[str, str], ...]  # (BN layer, why it has no producer)
    config: Config


def _producer(
    tensors: Mapping[str, TensorRef], name: str, layer: BNLayer, bn_names: set[str], out_axis: int = 0
) -> Producer | None:
    """`name`'s weight and bias when it can be `layer`'s producer: a floating weight of two or
    more dimensions with the BN's channel count on its output axis, and not itself a BN."""
    weight = tensors.get(f"{name}.weight")
    if name in bn_names or not weight_fits(weight, layer.num_features, out_axis) or weight is None:
        return None
    bias = tensors.get(f"{name}.bias")
    ok_bias = bias is not None and bias.is_floating and bias.shape == (layer.num_features,)
    return Producer(name, weight, bias if ok_bias else None, out_axis)


def paired_producers(
    tensors: Mapping[str, TensorRef], layers: Sequence[BNLayer], producers: Producers
) -> tuple[list[tuple[BNLayer, Producer]], list[tuple[str, str]]]:
    """(BN layer, producer) for every BN the producer finder can fold (its `foldable`), and
    (BN name, why) for the others: the finder's reason, or, for a BN a traced forward never
    called, that it was not reached."""
    bn_names = {layer.name for layer in layers}
    foldable = producers.foldable
    pairs: list[tuple[BNLayer, Producer]] = []
    unpaired: list[tuple[str, str]] = []
    for layer in layers:
        name = foldable.get(layer.name)
        producer = _producer(tensors, name, layer, bn_names, producers.out_axis(name)) if name is not None else None
        if producer is not None:
            pairs.append((layer, producer))
        elif name is not None:
            unpaired.append((layer.name, f"its producer {name} has no weight of {layer.num_features} outputs"))
        else:
            unpaired.append((layer.name, producers.unpaired.get(layer.name, "not reached by the traced forward")))
    return pairs, unpaired


# Values decoded at a time when a weight is streamed from its file (about 32 MB of floats).
STREAM_VALUES = 1 << 20


def channel_maxima(weight: TensorRef, path: str | None = None, out_axis: int = 0) -> list[float]:
    """max_k |W_c,k| for every output channel c of a stored weight: its first dimension, or
    with `out_axis` 1 its second (a ConvTranspose's (C_in, C_out, k...), read at once).

    With `path`, the file the weight's `location` refers to (a single safetensors file),
    whole channels are decoded STREAM_VALUES at a time, so the memory stays bounded whatever
    the layer's size; otherwise the values are read at once (about 32 bytes a weight)."""
    if out_axis == 1:
        k, n = weight.shape[0], weight.shape[1]
        taps = math.prod(weight.shape[2:])
        values = weight.read()
        return [
            max((abs(v) for i in range(k) for v in values[(i * n + c) * taps : (i * n + c + 1) * taps]), default=0.0)
            for c in range(n)
        ]
    n = weight.shape[0] if weight.shape else 0
    per = math.prod(weight.shape[1:]) if n else 0
    size = STORAGE_ITEMSIZE.get(weight.dtype, 0)
    if path is None or weight.location is None or not weight.is_floating or weight.location[1] != n * per * size:
        values = weight.read()
        return [max(map(abs, values[c * per : (c + 1) * per]), default=0.0) for c in range(n)]
    offset = weight.location[0]
    rows = max(1, STREAM_VALUES // max(per, 1))
    maxima: list[float] = []
    with open(path, "rb") as f:
        for first in range(0, n, rows):
            count = min(rows, n - first)
            f.seek(offset + first * per * size)
            raw = f.read(count * per * size)
            if len(raw) != count * per * size:
                raise BnauditError(f"{path}: truncated tensor data in '{weight.name}'")
            values = decode_values(raw, weight.dtype)
            maxima += [max(map(abs, values[c * per : (c + 1) * per]), default=0.0) for c in range(count)]
    return maxima


def cancellation_bound(mean: float, var: float, eps: float, unit_roundoff: float) -> float:
    """e = |mean| u / sqrt(var + eps): the error of x - mean in a format of unit roundoff u,
    in the channel's standard deviations (inf where var + eps <= 0 and mean != 0)."""
    denominator = var + eps
    if math.isnan(denominator) or math.isnan(mean):
        return math.nan  # invalid statistics (inspect's BN005): no bound, never flagged
    if not denominator > 0:
        return math.inf if mean != 0 else 0.0
    return abs(mean) * unit_roundoff / math.sqrt(denominator)


@dataclass(frozen=True)
class BNNumbers:
    """A BN's numbers per channel as folding uses them (absent for a conv already folded)."""

    gamma: list[float]
    scales: list[float]  # s_c = gamma_c / sqrt(var_c + eps), signed
    running_mean: list[float]
    running_var: list[float]
    eps: float


def predict_pair(
    layer: BNLayer,
    producer: str,
    maxima: Sequence[float],
    conv_bias: Sequence[float] | None,
    config: Config,
    paired_by: str = "name",
) -> PairPrediction:
    """The prediction for one pair from its BN's statistics and the producer's per-channel
    weight maxima `maxima` (`channel_maxima`), in float64 (module docstring)."""
    n = layer.num_features
    # affine parameters of another length (BN005 reports them) count as absent
    g = layer.weight if layer.weight is not None and len(layer.weight) == n else None
    beta = layer.bias if layer.bias is not None and len(layer.bias) == n else None
    scales, biases = folded_conv(g, beta, layer.running_mean, layer.running_var, layer.eps, conv_bias)
    folded_max = [abs(s) * m if m != 0 else 0.0 for s, m in zip(scales, maxima)]
    stats = BNNumbers(g if g is not None else [1.0] * n, scales, layer.running_mean, layer.running_var, layer.eps)
    return predict_folded(layer.name, producer, paired_by, folded_max, biases, stats, config)


def predict_folded(
    bn: str,
    producer: str,
    paired_by: str,
    folded_max: Sequence[float],
    folded_bias: Sequence[float],
    stats: BNNumbers | None,
    config: Config,
) -> PairPrediction:
    """The prediction from the folded weights' per-channel maxima M'_c and folded biases b'_c,
    with the BN's numbers where they are known (`stats` None: a conv an exporter already
    folded; its scale setter then has no BN numbers and cancellation cannot be told)."""
    n = len(folded_max)
    top = max(folded_max, default=0.0)
    int8_scale: float | None = None
    collapsed: list[int] = []
    coarse: list[int] = []
    setter = None
    ratio = None
    if all(math.isfinite(m) for m in folded_max) and top > 0:
        int8_scale = top / INT8_LEVELS
        collapsed = [c for c, m in enumerate(folded_max) if m / int8_scale <= COLLAPSE_LEVELS]
        coarse = [c for c, m in enumerate(folded_max) if COLLAPSE_LEVELS < m / int8_scale < COARSE_LEVELS]
        c_top = list(folded_max).index(top)
        setter = (
            ScaleSetter(c_top, None, None, None)
            if stats is None
            else ScaleSetter(c_top, stats.running_var[c_top], stats.gamma[c_top], abs(stats.scales[c_top]))
        )
        ratio = min(folded_max) / top
    overflow: list[int] = []
    what: list[str] = []
    for c in range(n):
        candidates = [("weight", folded_max[c]), ("bias", folded_bias[c])]
        if stats is not None:
            candidates = [("running_var", stats.running_var[c]), *candidates, ("gain", stats.scales[c])]
        causes = [label for label, x in candidates if abs(x) >= FP16_OVERFLOW]
        if causes:
            overflow.append(c)
            what.append("/".join(causes))
    bounds: dict[str, list[float]] = {fmt: [] for fmt in UNIT_ROUNDOFF}
    if stats is not None:
        bounds = {
            fmt: [cancellation_bound(mu, v, stats.eps, u) for mu, v in zip(stats.running_mean, stats.running_var)]
            for fmt, u in UNIT_ROUNDOFF.items()
        }
    limit = config.max_cancellation
    silent = _silent_channels(folded_max, stats)
    nonzero = [c for c in collapsed if folded_max[c] > 0]
    flush = [c for c, m in enumerate(folded_max) if 0 < m <= FP16_FLUSH]
    return PairPrediction(
        bn=bn,
        producer=producer,
        paired_by=paired_by,
        channels=n,
        eps=None if stats is None else stats.eps,
        int8_scale=int8_scale,
        collapsed=tuple(collapsed),
        live_collapsed=tuple(c for c in nonzero if c not in silent),
        silent_collapsed=tuple(c for c in nonzero if c in silent),
        coarse=tuple(coarse),
        scale_set_by=setter,
        worst_range_ratio=ratio,
        per_channel_collapsed=tuple(c for c, m in enumerate(folded_max) if m == 0),
        fp16_overflow=tuple(overflow),
        fp16_overflow_what=tuple(what),
        fp16_flush=tuple(flush),
        silent_flush=tuple(c for c in flush if c in silent),
        fp16_cancellation=tuple(c for c, e in enumerate(bounds["fp16"]) if e > limit),
        bf16_cancellation=tuple(c for c, e in enumerate(bounds["bf16"]) if e > limit),
        worst_cancellation=max(((e, c) for c, e in enumerate(bounds["bf16"]) if not math.isnan(e)), default=None),
    )


def _silent_channels(folded_max: Sequence[float], stats: BNNumbers | None) -> set[int]:
    """The channels that carry nothing in float (module docstring: SILENT_FLOOR of the
    layer's largest folded weight, or of its largest output variation where the BN's numbers
    are known)."""
    top = max((m for m in folded_max if math.isfinite(m)), default=0.0)
    silent = {c for c, m in enumerate(folded_max) if math.isfinite(m) and m <= SILENT_FLOOR * top}
    if stats is not None:
        signal = [channel_signal(g, v, stats.eps) for g, v in zip(stats.gamma, stats.running_var)]
        loudest = max((x for x in signal if math.isfinite(x)), default=0.0)
        silent |= {c for c, x in enumerate(signal) if math.isfinite(x) and x <= SILENT_FLOOR * loudest}
    return silent


def predict_pairs(
    tensors: Mapping[str, TensorRef],
    layers: Sequence[BNLayer],
    config: Config,
    producers: Producers | None = None,
    stream_from: str | None = None,
) -> tuple[list[PairPrediction], list[tuple[str, str]]]:
    """Pair every BN layer with its producer (`producers`, from a traced forward; by default
    the names: bnaudit.audit.producers) and predict each pair; (BN name, why) of the
    unpaired. `stream_from`: the single safetensors file the tensors' locations refer to
    (`channel_maxima` streams the weights from it)."""
    producers = (
        producers
        if producers is not None
        else producers_from_names(tensors, {layer.name: layer.num_features for layer in layers})
    )
    pairs, unpaired = paired_producers(tensors, layers, producers)
    predictions = []
    for layer, producer in pairs:
        maxima = channel_maxima(producer.weight, stream_from, producer.out_axis)
        conv_bias = producer.bias.read() if producer.bias is not None else None
        predictions.append(predict_pair(layer, producer.name, maxima, conv_bias, config, producers.by))
    return predictions, unpaired

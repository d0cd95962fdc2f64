"""How a federated server combined its clients' BatchNorm statistics, read from checkpoints
alone: each BN layer of the global checkpoint against the same layer of K client checkpoints
(torch-free; layers found by what they hold, `bnaudit.audit.layers`, not by "bn" in a name).

For a layer with client statistics (m_k, v_k) per channel (running_mean, and running_var,
which holds the unbiased variance) and weights w_k (sum 1) from one of the weightings
(plain: 1/K; the clients' `num_batches_tracked` for that layer, a proxy for their counts;
the clients' statistics files, n_k samples seen), with mu = sum_k w_k m_k:

  initial       running_mean 0 and running_var 1 in every channel: never aggregated
                (FedBN-style local statistics, or buffers left out of the aggregation)
  copied        bit-identical to client k's (the first such client is named): the global
                kept one client's buffers
  pooled        mean mu, variance sum_k w_k (v_k + (m_k - mu)^2): the statistics of the
                union of the clients' data (to O(1/n), the n - 1 of each client's unbiased
                variance aside)
  averaged      mean mu, variance sum_k w_k v_k: the mean of the clients' variances, which
                leaves out the between-client term  B = sum_k w_k (m_k - mu)^2  (with
                w_k = n_k / N: sum_k n_k (m_k - mu)^2 / N), the variance it understates
  recalibrated  the global's own bnaudit recalibration record matches the layer (a merge of
                the clients' statistics files writes one)
  other         none of these (another layer shape or missing in a client included)

Agreement is judged per channel within what rounding a framework's float32 arithmetic may
leave: |global - expected| <= r * s, with r = 8 (K + 2) u, u the unit roundoff of the
global's statistics dtype but at least float32's (2^-24), and s the sum of the magnitudes
the expected value is made of (for the mean sum_k w_k |m_k| + |global|; for the variance
sum_k w_k v_k + B + |global| + 2 max_k |m_k - mu| sum_k w_k |m_k|, the last term for the
error of a rounded mu inside (m_k - mu)^2). When the variance agrees with both pooled and
averaged (B within rounding: the clients' means agree), the layer is pooled.

A counter `num_batches_tracked` stored as a floating tensor is named separately: an integer
counter averaged into a float (loading it into PyTorch's int64 buffer truncates it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from bnaudit.audit.layers import BNLayer
from bnaudit.config import Config
from bnaudit.formats.model import Checkpoint

KINDS = ("pooled", "recalibrated", "averaged", "copied", "initial", "other")

_UNIT_ROUNDOFF = {"float64": 2.0**-53, "float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}
_FLOAT32 = 2.0**-24


@dataclass(frozen=True)
class Weighting:
    """Client weights w_k (normalised to sum 1) and where they come from."""

    source: str  # "plain mean", "num_batches_tracked", "statistics files"
    weights: tuple[float, ...]


@dataclass(frozen=True)
class CounterNote:
    """A layer's num_batches_tracked stored as a float: its dtype and value, and the clients'."""

    dtype: str
    value: float
    clients: tuple[int | None, ...]


@dataclass(frozen=True)
class FedLayer:
    """One BN layer of the global checkpoint, classified (module docstring).

    `client`: copied: the index of the client whose statistics it holds. `weighting`:
    averaged and pooled: the weights that reproduce it. `understated`: averaged: the
    between-client term B per channel; `understated_fraction`: the largest B / (v + B) over
    the channels, v the stored variance (the share of the pooled variance left out).
    `reason`: other: why no aggregation matched."""

    name: str
    channels: int
    kind: str
    client: int | None = None
    weighting: Weighting | None = None
    understated: tuple[float, ...] = ()
    understated_fraction: float | None = None
    reason: str = ""
    counter: CounterNote | None = None

    @property
    def understated_mean(self) -> float | None:
        """The mean of B over the channels (averaged layers), else None."""
        return sum(self.understated) / len(self.understated) if self.understated else None


@dataclass(frozen=True)
class FedContext:
    """What the fed rules read: the classified layers, the clients' files, the configuration."""

    layers: tuple[FedLayer, ...]
    clients: tuple[str, ...]
    config: Config
    global_path: str = ""
    weighting_sources: tuple[str, ...] = field(default=())


def unit_roundoff(dtype: str) -> float:
    """u of the statistics' dtype, at least float32's (module docstring)."""
    return max(_UNIT_ROUNDOFF.get(dtype, _FLOAT32), _FLOAT32)


def classify_layer(
    layer: BNLayer,
    clients: Sequence[BNLayer | None],
    weightings: Sequence[Weighting],
    recalibrated: bool = False,
    counter: CounterNote | None = None,
) -> FedLayer:
    """The class of one global layer against the clients' same-named layers (None: the
    client lacks it); `weightings` to try, in order; `recalibrated`: the global's own
    recalibration record matches the layer."""
    base = FedLayer(layer.name, layer.num_features, "other", counter=counter)
    missing = [i for i, c in enumerate(clients) if c is None]
    if missing:
        return _other(base, f"not in client {missing[0] + 1}'s checkpoint")
    present = [c for c in clients if c is not None]
    shaped = [i for i, c in enumerate(present) if c.num_features != layer.num_features]
    if shaped:
        return _other(base, f"{present[shaped[0]].num_features} channels in client {shaped[0] + 1}")
    if recalibrated:  # its counter then holds bnaudit's calibration batches, whatever its dtype
        return FedLayer(layer.name, layer.num_features, "recalibrated")
    if all(m == 0.0 for m in layer.running_mean) and all(v == 1.0 for v in layer.running_var):
        return FedLayer(layer.name, layer.num_features, "initial", counter=counter)
    for i, c in enumerate(present):
        if _same(c.running_mean, layer.running_mean) and _same(c.running_var, layer.running_var):
            return FedLayer(layer.name, layer.num_features, "copied", client=i, counter=counter)
    rtol = 8 * (len(present) + 2) * unit_roundoff(layer.stats_dtype)
    averaged: tuple[Weighting, list[float]] | None = None
    for weighting in weightings:
        fit = _fit(layer, present, weighting.weights, rtol)
        if fit is None:
            continue
        pooled_fits, averaged_fits, between = fit
        if pooled_fits:
            return FedLayer(layer.name, layer.num_features, "pooled", weighting=weighting, counter=counter)
        if averaged_fits and averaged is None:
            averaged = (weighting, between)
    if averaged is not None:
        weighting, between = averaged
        fractions = [b / (v + b) if v + b > 0 else 0.0 for b, v in zip(between, layer.running_var, strict=True)]
        return FedLayer(
            layer.name,
            layer.num_features,
            "averaged",
            weighting=weighting,
            understated=tuple(between),
            understated_fraction=max(fractions, default=0.0),
            counter=counter,
        )
    return _other(base, "matches no copy, mean or pooled statistics of the clients'")


def _other(base: FedLayer, reason: str) -> FedLayer:
    return FedLayer(base.name, base.channels, "other", reason=reason, counter=base.counter)


def _same(a: Sequence[float], b: Sequence[float]) -> bool:
    """Bit-identical as read (NaN equal to NaN: a copied NaN is still a copy)."""
    return len(a) == len(b) and all(x == y or (x != x and y != y) for x, y in zip(a, b, strict=True))


def _fit(
    layer: BNLayer, clients: Sequence[BNLayer], weights: Sequence[float], rtol: float
) -> tuple[bool, bool, list[float]] | None:
    """None when the mean is not the weighted mean of the clients'; else whether the variance
    is the pooled one, whether it is the averaged one, and the between-client term B."""
    between: list[float] = []
    pooled_fits = averaged_fits = True
    for c in range(layer.num_features):
        means = [client.running_mean[c] for client in clients]
        variances = [client.running_var[c] for client in clients]
        mu = sum(w * m for w, m in zip(weights, means, strict=True))
        scale = sum(w * abs(m) for w, m in zip(weights, means, strict=True))
        g_mean, g_var = layer.running_mean[c], layer.running_var[c]
        if not (math.isfinite(g_mean) and math.isfinite(g_var) and math.isfinite(mu)):
            return None
        if abs(g_mean - mu) > rtol * (scale + abs(g_mean)) + 1e-300:
            return None
        within = sum(w * v for w, v in zip(weights, variances, strict=True))
        b = sum(w * (m - mu) ** 2 for w, m in zip(weights, means, strict=True))
        spread = max(abs(m - mu) for m in means)
        tolerance = rtol * (abs(within) + b + abs(g_var) + 2 * spread * scale) + 1e-300
        pooled_fits = pooled_fits and abs(g_var - (within + b)) <= tolerance
        averaged_fits = averaged_fits and abs(g_var - within) <= tolerance
        between.append(b)
        if not (pooled_fits or averaged_fits):
            return None
    return pooled_fits, averaged_fits, between


def counter_note(ckpt: Checkpoint, layer: str, clients: Sequence[Checkpoint]) -> CounterNote | None:
    """A floating num_batches_tracked of `layer` in the global `ckpt` (None when it is an
    integer or absent), with the clients' counters (None where not an integer)."""
    ref = ckpt.tensors.get(f"{layer}.num_batches_tracked")
    if ref is None or not ref.is_floating or len(ref.shape) > 1 or (ref.shape and ref.shape[0] != 1):
        return None
    values = ref.read()
    theirs = []
    for client in clients:
        other = client.tensors.get(f"{layer}.num_batches_tracked")
        value = other.read() if other is not None and other.is_integer and len(other.shape) <= 1 else None
        theirs.append(int(value[0]) if value and len(value) == 1 else None)
    return CounterNote(ref.dtype, float(values[0]) if values else math.nan, tuple(theirs))


def weightings(
    layer: str, clients: Sequence[Mapping[str, BNLayer]], counts: Sequence[Mapping[str, int]] | None
) -> list[Weighting]:
    """The weightings to try for `layer`: plain, the clients' num_batches_tracked when all are
    positive and not all equal, the statistics files' counts when given."""
    k = len(clients)
    out = [Weighting("plain mean", tuple(1.0 / k for _ in range(k)))]
    counters = [c[layer].num_batches_tracked if layer in c else None for c in clients]
    known = [n for n in counters if n is not None and n > 0]
    if len(known) == k and len(set(known)) > 1:
        total = sum(known)
        out.append(Weighting("num_batches_tracked", tuple(n / total for n in known)))
    if counts is not None:
        ns = [c.get(layer, c.get("", 0)) for c in counts]
        if all(n > 0 for n in ns):
            total = sum(ns)
            out.append(Weighting("statistics files", tuple(n / total for n in ns)))
    return out

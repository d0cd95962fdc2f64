"""The rules of `bnaudit fed`: BN301-BN305, how a federated server combined its clients'
BatchNorm statistics (the classes and their tolerances in bnaudit.audit.fed.classify)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

from bnaudit.audit.rules.registry import RULES, Finding, rule
from bnaudit.severity import Severity

if TYPE_CHECKING:  # `bnaudit fed` builds them; registering the rules needs none of it
    from bnaudit.audit.fed.classify import FedContext, Weighting

_FIX = (
    "Give the global model the statistics of the union of the clients' data, computed under the global "
    "weights and merged exactly: at each client `bnaudit recalibrate GLOBAL --arch ... --data LOCAL --stats-out "
    "client-k.bnstats`, at the server `bnaudit merge client-*.bnstats --checkpoint GLOBAL -o fixed.pt` "
    "(no data leaves a client: a statistics file holds per-channel counts, means and sums of squares)."
)


def _weights(weighting: Weighting | None) -> str:
    if weighting is None:
        return ""
    if weighting.source == "plain mean":
        return "the plain mean"
    shown = ", ".join(f"{w:.3g}" for w in weighting.weights)
    return f"the mean weighted by the clients' {weighting.source} ({shown})"


def _client(ctx: FedContext, index: int | None) -> str:
    if index is None or not 0 <= index < len(ctx.clients):
        return "a client"
    return f"client {index + 1} ({os.path.basename(ctx.clients[index])})"


@rule(
    "BN301",
    "fed-copied-statistics",
    Severity.WARNING,
    "The global model's BN statistics are one client's, bit for bit.",
    "Aggregators average `model.parameters()`; running_mean and running_var are buffers, so a server that "
    "starts the global model from the first upload, or loads one client's state dict and overwrites the "
    "parameters, keeps that client's statistics (TsingZ0/PFLlib#260). The global model then normalises every "
    "client's data with one client's means and variances: with class-skewed clients, the others' "
    "activations are shifted and scaled wrongly in eval mode. The finding names the client file.",
    _FIX,
    command="fed",
)
def _check_copied(ctx: FedContext) -> Iterator[Finding]:
    r = RULES["BN301"]
    for layer in ctx.layers:
        if layer.kind == "copied":
            yield r.finding(
                Severity.WARNING,
                layer.name,
                f"running_mean and running_var are bit-identical to {_client(ctx, layer.client)}'s: the global "
                "model normalises every client's data with one client's statistics",
            )


@rule(
    "BN302",
    "fed-averaged-variance",
    Severity.WARNING,
    "The global running_var is the mean of the clients' variances: the spread of the client means is lost.",
    "The variance of the union of the clients' data is the mean of their variances plus the between-client "
    "term B = sum_k n_k (mu_k - mu)^2 / N (mu the pooled mean). Averaging running_var as if it were a weight "
    "leaves B out, so the global variance is too small by exactly B, and the global model scales up "
    "activations in eval mode; with non-IID clients B is large. The finding gives B's share of the pooled "
    "variance (largest over the channels) and its mean; the weights that reproduce the average are named.",
    _FIX,
    command="fed",
)
def _check_averaged(ctx: FedContext) -> Iterator[Finding]:
    r = RULES["BN302"]
    for layer in ctx.layers:
        if layer.kind == "averaged":
            fraction = (layer.understated_fraction or 0.0) * 100
            yield r.finding(
                Severity.WARNING,
                layer.name,
                f"running_var is {_weights(layer.weighting)} of the clients' variances: it lacks the "
                f"between-client term, up to {fraction:.2g}% of the pooled variance",
            )


@rule(
    "BN303",
    "fed-initial-statistics",
    Severity.WARNING,
    "The global model's BN statistics are the initial 0 and 1: they were never aggregated.",
    "running_mean 0 and running_var 1 in every channel are what a BatchNorm layer starts with. A server that "
    "aggregates parameters only and builds the global model fresh each round never fills them; FedBN keeps BN "
    "statistics local on purpose, and then the global checkpoint cannot be evaluated as it is. Either way "
    "eval mode normalises with statistics of no data.",
    "Evaluate with each client's own statistics (FedBN), or give the global model statistics of the union: "
    + _FIX[0].lower()
    + _FIX[1:],
    command="fed",
)
def _check_initial(ctx: FedContext) -> Iterator[Finding]:
    r = RULES["BN303"]
    for layer in ctx.layers:
        if layer.kind == "initial":
            yield r.finding(
                Severity.WARNING,
                layer.name,
                "running_mean is 0 and running_var 1 in every channel: the statistics were never aggregated "
                "(buffers left out, or FedBN-style local statistics)",
            )


@rule(
    "BN304",
    "fed-unmatched-statistics",
    Severity.INFO,
    "The global model's BN statistics match no aggregation of the clients' statistics.",
    "Neither a copy of one client's statistics, nor their plain or count-weighted mean, nor their pooled "
    "statistics, within float32 rounding: statistics recomputed on server-side data, a client missing from the "
    "list given, clients saved at another round than the global, or a layer of another shape.",
    "Check that the clients given are the ones of the round that made the global checkpoint; to make the "
    "statistics exact, merge the clients' statistics files (`bnaudit merge`).",
    command="fed",
)
def _check_other(ctx: FedContext) -> Iterator[Finding]:
    r = RULES["BN304"]
    for layer in ctx.layers:
        if layer.kind == "other":
            yield r.finding(Severity.INFO, layer.name, f"the statistics {layer.reason}")


@rule(
    "BN305",
    "fed-averaged-counter",
    Severity.WARNING,
    "num_batches_tracked is stored as a float: an integer counter averaged into a float.",
    "num_batches_tracked is an int64 buffer. An aggregator that averages every state-dict entry turns it into "
    "a float (or crashes on it: alibaba/FederatedScope#198, LuminLiu/HierFL#1); loaded back, PyTorch casts "
    "it to int64 and truncates it, and with momentum=None (a cumulative average) the next update weighs the "
    "statistics by the wrong count.",
    "Aggregate buffers by kind: sum or keep the clients' counters as integers (or leave them out), and merge "
    "the statistics exactly (`bnaudit merge`).",
    command="fed",
)
def _check_counter(ctx: FedContext) -> Iterator[Finding]:
    r = RULES["BN305"]
    for layer in ctx.layers:
        note = layer.counter
        if note is None:
            continue
        theirs = [n for n in note.clients if n is not None]
        clients = f" (clients: {', '.join(str(n) for n in theirs)})" if theirs else ""
        yield r.finding(
            Severity.WARNING,
            layer.name,
            f"num_batches_tracked is {note.dtype} holding {note.value:g}{clients}: an integer counter averaged "
            "into a float",
        )

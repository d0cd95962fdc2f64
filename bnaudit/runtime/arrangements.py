"""The samples invariance scores and the ways to batch them (`bnaudit.runtime.invariance`).

Arrangements (`plan_arrangements`). The N samples are read once, in the loader's order
(seeded shuffle, as `gap` draws them); position i is the i-th sample. For each batch size
B of --batch-sizes:

  alone               B = 1: each sample in a batch of its own (the reference)
  in batch (B)        positions 0..N-1 cut into batches of B: the batches gap forms
  other companions    a permutation of the positions fixed by --seed, cut into batches
  (B)                 of B: other companions, in another order

(for B >= 2 a last batch of one sample joins the one before it: the one batch plan,
`bnaudit.runtime.batching.BatchPlan.cut`). Each arrangement fills one output tensor (N, ...) indexed by sample
position, batch by batch (`bnaudit.runtime.invariance.score_arrangement`); every
statistic is computed from these tensors afterwards.

Also here: the comparison of every arrangement's outputs with the reference outputs
(`compare_outputs`: relative_deviation, KL, changed predictions, as the invariance
docstring defines them) and the noise screen.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from bnaudit.errors import BnauditError
from bnaudit.runtime.batching import BatchPlan, concat_batches, sample_order
from bnaudit.runtime.deviation import relative_deviations
from bnaudit.runtime.models import forward, output_tensor, to_device
from bnaudit.text import plural

SCREEN_EPS = 128  # screen = SCREEN_EPS * eps(dtype), capped at SCREEN_MAX
SCREEN_MAX = 1e-2


@dataclass(frozen=True)
class Arrangement:
    """One way to batch the N samples: `plan` holds sample positions, whole batches."""

    name: str
    batch_size: int
    order: str  # "alone", "natural" or "shuffled"
    plan: BatchPlan

    @property
    def batches(self) -> list[list[int]]:
        return self.plan.batches


def plan_arrangements(num_samples: int, batch_sizes: list[int], seed: int) -> list[Arrangement]:
    """The arrangements of the module docstring, batch sizes ascending; batch size 1
    gives "alone" only (there are no companions to vary)."""
    arrangements: list[Arrangement] = []
    n = num_samples
    for size in sorted(set(batch_sizes)):
        if size == 1:
            arrangements.append(Arrangement("alone", 1, "alone", BatchPlan.singles(n)))
            continue
        natural = BatchPlan.cut(range(n), size)
        shuffled = BatchPlan.cut(sample_order(n, shuffle=True, seed=seed), size)
        arrangements.append(Arrangement(f"in batch ({size})", size, "natural", natural))
        arrangements.append(Arrangement(f"other companions ({size})", size, "shuffled", shuffled))
    return arrangements


@dataclass
class Samples:
    """The N samples, read once: `inputs` with N rows (tensor, tuple or dict), `labels`
    (N,) or None, `origins` naming each sample."""

    inputs: Any
    labels: Any
    origins: list[str]

    def __len__(self) -> int:
        return len(self.origins)


def read_samples(stream: Any) -> Samples:
    """Every sample of the stream, in its order, as one `Samples` (joined as
    `batching.concat_batches` joins batches)."""
    inputs: list[Any] = []
    labels: list[Any] = []
    origins: list[str] = []
    for batch in stream:
        inputs.append(batch.inputs)
        labels.append(batch.labels)
        origins.extend(batch.origins)
    labelled = all(label is not None for label in labels)
    joined = functools.reduce(concat_batches, inputs)
    if joined is None:
        kind = type(inputs[0]).__name__
        raise BnauditError(
            f"the inputs are {kind} batches, which invariance cannot re-batch sample by sample: give tensors, "
            "or tuples or dicts of tensors"
        )
    return Samples(joined, torch.cat(labels) if labelled and labels else None, origins)


def take(inputs: Any, rows: list[int]) -> Any:
    """The rows `rows` of a batch structure (tensor, tuple, list, dict), in that order."""
    if isinstance(inputs, torch.Tensor):
        return inputs[torch.as_tensor(rows, dtype=torch.long)]
    if isinstance(inputs, Mapping):
        return {k: take(v, rows) for k, v in inputs.items()}
    if isinstance(inputs, tuple):
        parts = [take(v, rows) for v in inputs]
        return type(inputs)(*parts) if hasattr(inputs, "_fields") else tuple(parts)
    if isinstance(inputs, list):
        if all(isinstance(x, torch.Tensor) for x in inputs):
            return [take(v, rows) for v in inputs]
        return [inputs[r] for r in rows]
    return inputs


def _as_float64(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(torch.float64) if value.dtype.is_floating_point else value
    if isinstance(value, Mapping):
        return {k: _as_float64(v) for k, v in value.items()}
    if isinstance(value, tuple):
        parts = [_as_float64(v) for v in value]
        return type(value)(*parts) if hasattr(value, "_fields") else tuple(parts)
    if isinstance(value, list):
        return [_as_float64(v) for v in value]
    return value


def score_batch(
    model: Any, samples: Samples, rows: list[int], device: Any, forward_fn: Any, float64: bool = False
) -> Any:
    """The model's output tensor for the samples at `rows`, as one batch."""
    inputs = to_device(take(samples.inputs, rows), device)
    if float64:
        inputs = _as_float64(inputs)
    out = output_tensor(forward(model, inputs, forward_fn)).detach()
    if out.dim() == 0 or out.shape[0] != len(rows):
        raise BnauditError(
            f"the model's output has shape {list(out.shape)} for {plural(len(rows), 'sample')}; "
            "pass --forward MODULE:CALLABLE returning one row of outputs per sample"
        )
    return out


@dataclass
class Comparison:
    """Per-sample statistics of `compare_outputs` (module docstring): `deviations` (A, N)
    per arrangement, `kl` (A, N) or None, `changed` (A, N) bool or None."""

    deviations: Any
    kl: Any
    changed: Any
    classifier: bool

    @property
    def deviation(self) -> Any:
        """d_i: the largest deviation of each sample over the arrangements, (N,)."""
        return self.deviations.amax(dim=0)


def compare_outputs(outputs: list[Any], reference: Any) -> Comparison:
    """Compare each arrangement's outputs (N, ...) with the reference outputs (N, ...)."""
    ref = reference.to(torch.float64)
    deviations = [relative_deviations(out, ref) for out in outputs]
    classifier = ref.dim() == 2 and ref.shape[1] >= 2
    kl = changed = None
    if classifier:
        logp_r = torch.log_softmax(ref, dim=1)
        kls, changes = [], []
        for out in outputs:
            logp_a = torch.log_softmax(out.to(torch.float64), dim=1)
            kls.append((logp_r.exp() * (logp_r - logp_a)).sum(dim=1).clamp_min(0.0))
            changes.append(out.argmax(dim=1) != ref.argmax(dim=1))
        kl, changed = torch.stack(kls), torch.stack(changes)
    return Comparison(torch.stack(deviations), kl, changed, classifier)


def screen_for(dtype: Any) -> float:
    """The flagging threshold for outputs of `dtype` (module docstring)."""
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else torch.finfo(torch.float32).eps
    return min(SCREEN_EPS * eps, SCREEN_MAX)

"""`invariance`: does a prediction depend on the other samples in its batch?

In deployment a model scores one input at a time, or whatever batch arrives; its output
for a sample must not change with the sample's companions. The model runs as deployed:
every module in eval mode, no buffer changed (the buffers are snapshot and restored, so
even a graph traced in training mode, which updates its running statistics on every
call, leaves the model as it found it).

Arrangements (`plan_arrangements`). The N samples are read once, in the loader's order
(seeded shuffle, as `gap` draws them); position i is the i-th sample. For each batch size
B of --batch-sizes:

  alone               B = 1: each sample in a batch of its own (the reference)
  in batch (B)        positions 0..N-1 cut into batches of B: the batches gap forms
  other companions    a permutation of the positions fixed by --seed, cut into batches
  (B)                 of B: other companions, in another order

(for B >= 2 a last batch of one sample joins the one before it, `norms.merge_trailing_
singleton`). Each arrangement fills one output tensor (N, ...) indexed by sample
position, batch by batch (`score_arrangement`); every statistic is computed from these
tensors afterwards.

Under torchrun (`score_arrangement`, `bnaudit.runtime.distributed`) every rank reads the N
samples (they are few, and any batch of the "other companions" arrangements may hold any
of them), plans the same arrangements from the seed, and scores a contiguous block of
each arrangement's WHOLE batches: a coupled model's output depends on its companions, so
the batches must be the single process's. The other rows stay zero and the tensors are
summed across ranks, which adds zeros to each value: the combined tensors equal a single
process's to the last bit wherever the forward of one batch is deterministic, so every
statistic, the verdict and the located coupling are the single process's, on every rank
(the flagged samples' float64 re-scoring is split the same way; the few traced forwards of
`locate_coupling` run on every rank).

Statistics, per sample i with reference output r_i (alone; the first other arrangement
when --batch-sizes lacks 1 or the model cannot score one sample alone) and output y_a,i in
arrangement a:

  deviation     d_i = max_a ||y_a,i - r_i||_inf / max(||r_i||_inf, tiny)
                the infinity norm (largest absolute change of any output value, relative
                to the largest absolute output value): one logit that moves counts in
                full whatever the number of classes, and the measure is independent of
                the output's scale. Equal non-finite values count as equal.
  changed       argmax_k y_a,i != argmax_k r_i for some a (class scores only)
  KL            max_a KL(p_r || p_a) = sum_k p_r,k (log p_r,k - log p_a,k), p = softmax;
                class scores only: outputs (N, K) with K >= 2. Other outputs
                (a regression head) get the deviation alone.
  accuracy      per arrangement, top-1 against the labels, where the data has labels

Noise floor. Matrix kernels sum in another order for another batch size, so a
batch-independent float32 model differs by ~1e-7 between arrangements. Two thresholds:

  screen        128 * eps(dtype) of the outputs (1.5e-5 for float32; at most 1e-2): a
                sample with d_i above it is FLAGGED
  floor         sqrt(eps(float64)) = 1.49e-8: every flagged sample is re-scored in a
                float64 copy of the model, in every arrangement (the whole batches that
                hold it); kernel-order noise falls to ~1e-15 there while a real
                coupling keeps its size (~d_i). A flagged sample whose float64
                deviation exceeds the floor is COUPLED; the others are cleared.

Printed figures (`bnaudit.text.above_floor`; JSON keeps the exact numbers). A float32
deviation below the screen is kernel-order noise whose digits differ between CPUs (3.8e-07
on one, 4.7e-07 on another): tables and diagnoses print it as "<1.5e-05", and a float64
deviation below the floor as "<1.5e-08". The largest deviation's sample is named only
above the screen (below it, which sample is largest is noise too). KL below

  KL_FLOOR      1e-6 nats: telling two output distributions that close apart takes about
                1/KL = 10^6 samples; float32 kernel noise gives ~1e-13 on the sample model

prints as "<1e-06".

The verdict rests on the float64 deviation, which lies about seven orders of magnitude
from either side of the floor, so no hand-tuned tolerance decides it. Where no float64
copy runs (a --forward or graph that insists on float32) the screen decides, and the
report says so.

Locating the coupling (`locate_coupling`). For up to three coupled samples, the
reference batch and the arrangement's batch run again (float64) with forward hooks on
every module; in the order the modules finish (inner modules before the ones that contain
them), the first module whose output row for the sample differs beyond the floor while
its input row does not is where the coupling happens. `bnaudit.runtime.norms` says why
when it is BatchNorm (no running statistics, or training mode); any other module "mixes
samples". TorchScript modules run no hooks: their graphs are searched for batch
normalisation called with training=True as a constant (a model traced in training mode).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch

from bnaudit.audit.audit import audit_checkpoint
from bnaudit.audit.report import FileReport
from bnaudit.audit.rules import Finding
from bnaudit.config import Config, severity_rank
from bnaudit.errors import BnauditError
from bnaudit.runtime.data import make_loader
from bnaudit.runtime.distributed import (
    combine_rows,
    device_for_rank,
    distributed,
    first_error,
    process_group,
    shard_batches,
)
from bnaudit.runtime.inputs import input_problem
from bnaudit.runtime.models import forward, load_forward, load_runnable, output_tensor, resolve_device, to_device
from bnaudit.runtime.norms import (
    batch_statistics_reason,
    concat_batches,
    eval_mode,
    is_script,
    merge_trailing_singleton_plan,
    scripted_batch_stat_calls,
)
from bnaudit.text import above_floor, exception_line, listing, plural

SCREEN_EPS = 128  # screen = SCREEN_EPS * eps(dtype), capped at SCREEN_MAX
SCREEN_MAX = 1e-2
FLOOR = math.sqrt(torch.finfo(torch.float64).eps)
KL_FLOOR = 1e-6
LOCATE_SAMPLES = 3
DEFAULT_NUM_SAMPLES = 256
TINY = torch.finfo(torch.float64).tiny


@dataclass(frozen=True)
class Arrangement:
    """One way to batch the N samples: `batches` holds sample positions, whole batches."""

    name: str
    batch_size: int
    order: str  # "alone", "natural" or "shuffled"
    batches: list[list[int]]


def plan_arrangements(num_samples: int, batch_sizes: list[int], seed: int) -> list[Arrangement]:
    """The arrangements of the module docstring, batch sizes ascending; batch size 1
    gives "alone" only (there are no companions to vary)."""
    arrangements: list[Arrangement] = []
    n = num_samples
    for size in sorted(set(batch_sizes)):
        if size == 1:
            arrangements.append(Arrangement("alone", 1, "alone", [[i] for i in range(n)]))
            continue
        natural = merge_trailing_singleton_plan([list(range(i, min(i + size, n))) for i in range(0, n, size)])
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
        shuffled = merge_trailing_singleton_plan([order[i : i + size] for i in range(0, n, size)])
        arrangements.append(Arrangement(f"in batch ({size})", size, "natural", natural))
        arrangements.append(Arrangement(f"other companions ({size})", size, "shuffled", shuffled))
    return arrangements


def parse_batch_sizes(text: str | None, default: int) -> list[int]:
    """--batch-sizes '1,8,64' -> [1, 8, 64]; None -> [1, default]."""
    if text is None:
        return sorted({1, default})
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise BnauditError(f"--batch-sizes must be a comma-separated list of whole numbers, got '{text}'") from None
    return check_batch_sizes(sizes)


def check_batch_sizes(sizes: list[int]) -> list[int]:
    """Sorted distinct batch sizes, at least one of them 2 or more (companions to vary)."""
    if not sizes or any(s < 1 for s in sizes):
        raise BnauditError(f"--batch-sizes must list batch sizes of at least 1, got {','.join(map(str, sizes))}")
    if max(sizes) < 2:
        raise BnauditError("--batch-sizes needs a batch size of at least 2: alone, a sample has no companions")
    return sorted(set(sizes))


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
    `norms.concat_batches` joins batches)."""
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


@contextlib.contextmanager
def preserved_buffers(model: Any) -> Iterator[None]:
    """Every buffer (running statistics, counters) copied back on exit: a graph traced in
    training mode updates them on every call, and the audit must change nothing."""
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, copy_ in saved:
                buffer.copy_(copy_)


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


def score_arrangement(
    model: Any,
    samples: Samples,
    arrangement: Arrangement,
    *,
    device: Any = "cpu",
    forward_fn: Any = None,
    float64: bool = False,
    positions: set[int] | None = None,
    progress: Callable[[], None] | None = None,
    grayscale: bool | None = None,
) -> tuple[Any, Any]:
    """Outputs (N, ...) on the CPU indexed by sample position, filled batch by batch, and
    the boolean mask (N,) of the rows filled (zeros elsewhere). `positions` keeps only the batches that
    hold one of them; outputs are None when no batch ran (the shape is known only from a
    run). Errors name the arrangement and the batch; `grayscale` (--grayscale
    for image folders, None for other data) shapes the advice for a channel mismatch.

    Under torch.distributed, with `batches` None, it is collective: each rank runs its
    share of the arrangement's whole batches (`rank_share`) and the zero-filled rows are
    summed across ranks (`bnaudit.runtime.distributed.combine_rows`: each row comes from
    one rank, so the sums are exact); every rank returns the same outputs, or raises the
    same error (the first failing rank's)."""
    options: dict[str, Any] = {
        "device": device,
        "forward_fn": forward_fn,
        "float64": float64,
        "positions": positions,
        "progress": progress,
        "grayscale": grayscale,
    }
    rank, world = distributed()
    if world == 1:
        return _score_locally(model, samples, arrangement, **options)
    first, mine = shard_batches(arrangement.batches, rank, world)
    outputs = filled = None
    try:
        outputs, filled = _score_locally(model, samples, arrangement, batches=mine, first_batch=first, **options)
        error = None
    except BnauditError as exc:
        error = str(exc)
    error = first_error(error)
    if error is not None:
        raise BnauditError(error)
    return combine_rows(outputs, filled)


def rank_share(arrangement: Arrangement) -> list[list[int]]:
    """The arrangement's batches this process runs: all of them, or under torch.distributed
    this rank's contiguous block of whole batches (`bnaudit.runtime.distributed.shard_batches`)."""
    rank, world = distributed()
    return shard_batches(arrangement.batches, rank, world)[1]


def _score_locally(
    model: Any,
    samples: Samples,
    arrangement: Arrangement,
    *,
    device: Any = "cpu",
    forward_fn: Any = None,
    float64: bool = False,
    positions: set[int] | None = None,
    batches: list[list[int]] | None = None,
    progress: Callable[[], None] | None = None,
    grayscale: bool | None = None,
    first_batch: int = 0,
) -> tuple[Any, Any]:
    """`score_arrangement` in this process alone; `first_batch` numbers the first of
    `batches` in messages (the arrangement's own number for a rank's share)."""
    n = len(samples)
    outputs: Any = None
    filled = torch.zeros(n, dtype=torch.bool)
    for number, rows in enumerate(arrangement.batches if batches is None else batches, start=first_batch):
        if positions is not None and not positions.intersection(rows):
            continue
        try:
            out = score_batch(model, samples, rows, device, forward_fn, float64)
        except BnauditError as exc:
            raise BnauditError(f"{arrangement.name}, batch {number}: {exc}") from None
        except Exception as exc:
            # the words gap uses for inputs a model cannot take (dtype, channels)
            problem = input_problem(model, take(samples.inputs, rows), grayscale) if forward_fn is None else None
            raise BnauditError(
                f"{arrangement.name}, batch {number}: the model rejects the batch "
                f"({plural(len(rows), 'sample')}): {problem or exception_line(exc)}"
            ) from None
        if outputs is None:
            outputs = torch.zeros((n, *out.shape[1:]), dtype=out.dtype)
        elif out.shape[1:] != outputs.shape[1:]:
            raise BnauditError(
                f"{arrangement.name}, batch {number}: the output shape changed to {list(out.shape)} "
                f"from {[len(rows), *outputs.shape[1:]]}"
            )
        index = torch.as_tensor(rows, dtype=torch.long)
        outputs[index] = out.to("cpu", outputs.dtype)
        filled[index] = True
        if progress is not None:
            progress()
    return outputs, filled


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


def _abs_diff(a: Any, b: Any) -> Any:
    """|a - b| with equal values (infinities and NaN in the same place too) as 0."""
    diff = (a - b).abs()
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    return torch.where(same, torch.zeros_like(diff), diff.nan_to_num(nan=math.inf))


def compare_outputs(outputs: list[Any], reference: Any) -> Comparison:
    """Compare each arrangement's outputs (N, ...) with the reference outputs (N, ...)."""
    ref = reference.to(torch.float64)
    n = ref.shape[0]
    flat_ref = ref.reshape(n, -1)
    scale = flat_ref.abs().nan_to_num(nan=0.0, posinf=0.0).amax(dim=1).clamp_min(TINY) if n else flat_ref
    deviations = []
    for out in outputs:
        flat = out.to(torch.float64).reshape(n, -1)
        deviations.append(_abs_diff(flat, flat_ref).amax(dim=1) / scale)
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


# ----------------------------------------------------------------------------- report


@dataclass(frozen=True)
class ArrangementResult:
    """One arrangement: its batches, the largest deviation from the reference (over all
    samples, working precision), the coupled samples whose deviation in it exceeds the
    floor, the predictions that change (coupled samples only) and its accuracy."""

    name: str
    batch_size: int
    order: str
    batches: int
    max_deviation: float
    coupled: int
    changed: int | None
    accuracy: float | None


@dataclass(frozen=True)
class CouplingSite:
    """Where samples meet: a module (or a TorchScript graph call) and why."""

    module: str
    kind: str
    reason: str
    cause: str  # "batchnorm", "traced_training", "mixes_samples", "model_code"
    sample: str | None = None
    arrangement: str | None = None


@dataclass
class InvarianceReport:
    """The result of `measure_invariance` (module docstring for every statistic)."""

    kind: ClassVar[str] = "invariance"  # which emitter of bnaudit.output renders it
    checkpoint: str
    model: str
    data: str
    samples: int
    batch_sizes: list[int]
    seed: int
    shuffle: bool
    device: str
    dtype: str
    reference: str
    arrangements: list[ArrangementResult]
    screen: float
    floor: float
    flagged: int
    cleared: int
    coupled: int
    float64: bool
    max_deviation: float
    max_deviation_sample: str | None
    classifier: bool
    changed: int | None
    max_kl: float | None
    mean_kl: float | None
    inspection: FileReport
    norm: str = "relative max-abs: ||y_a - y_ref||_inf / ||y_ref||_inf"
    float64_noise: float | None = None
    kl_floor: float = KL_FLOOR
    float64_note: str | None = None
    sites: list[CouplingSite] = field(default_factory=list)
    failures: dict[str, str] = field(default_factory=dict)
    labelled: int = 0
    diagnosis: list[str] = field(default_factory=list)
    skipped: int = 0
    notes: list[str] = field(default_factory=list)
    fail_on: str | None = None
    exit_zero: bool = False

    @property
    def findings(self) -> list[Finding]:
        return self.inspection.findings

    @property
    def verdict(self) -> str:
        """ "coupled" when some sample's output depends on its companions (or the model
        cannot score one sample alone), else "invariant"."""
        return "coupled" if self.coupled or self.failures else "invariant"

    @property
    def changed_share(self) -> float | None:
        """Share of samples whose prediction changes with the arrangement."""
        if self.changed is None or not self.samples:
            return None
        return self.changed / self.samples

    def accuracy(self, order: str, batch_size: int | None = None) -> float | None:
        """The accuracy of the first arrangement of that order (and batch size)."""
        for a in self.arrangements:
            if a.order == order and (batch_size is None or a.batch_size == batch_size):
                return a.accuracy
        return None

    def exit_code(self) -> int:
        """1 when coupled, or when an inspect finding is at or above `fail_on`; 0 with
        `exit_zero` or otherwise."""
        if self.exit_zero:
            return 0
        if self.verdict == "coupled":
            return 1
        if self.fail_on is not None and any(
            severity_rank(f.severity) >= severity_rank(self.fail_on) for f in self.findings
        ):
            return 1
        return 0


# ----------------------------------------------------------------------------- measuring


def _float64_copy(model: Any) -> tuple[Any, str | None]:
    """A float64 copy of the model (floating parameters and buffers), or None and why."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # .to() of a ScriptModule warns about .grad
            return copy.deepcopy(model).to(torch.float64), None
    except Exception as exc:
        return None, f"no float64 copy of the model ({exception_line(exc)})"


def score_arrangements(
    model: Any,
    samples: Samples,
    arrangements: list[Arrangement],
    *,
    device: Any = "cpu",
    forward_fn: Any = None,
    progress: Callable[[int, int], None] | None = None,
    grayscale: bool | None = None,
) -> tuple[list[tuple[Arrangement, Any]], dict[str, str]]:
    """Every arrangement's outputs (N, ...) by sample position, and the arrangements that
    failed: a model that cannot score one sample alone is batch-dependent itself, so a
    failure of "alone" is recorded (name -> message), any other failure is an error.
    Under torch.distributed each rank runs its share of every arrangement's batches
    (`rank_share`), combined across ranks by `score_arrangement`."""
    total = sum(len(rank_share(a)) for a in arrangements)
    done = 0

    def step() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total)

    scored: list[tuple[Arrangement, Any]] = []
    failures: dict[str, str] = {}
    for arrangement in arrangements:
        before = done
        try:
            out, _ = score_arrangement(
                model,
                samples,
                arrangement,
                device=device,
                forward_fn=forward_fn,
                progress=step,
                grayscale=grayscale,
            )
        except BnauditError as exc:
            if arrangement.order != "alone":
                raise
            failures[arrangement.name] = str(exc)
            done = before + len(rank_share(arrangement))
            continue
        scored.append((arrangement, out))
    return scored, failures


@dataclass
class Float64Check:
    """The flagged samples re-scored in float64 (module docstring): `coupled` (N,) bool;
    `deviations` (A, N) float64 deviations (zero for samples not flagged) or None where no
    float64 run was possible (`note` says why; the screen then decides); `noise` the
    largest float64 deviation of the samples it cleared; `model` the float64 copy."""

    coupled: Any
    deviations: Any = None
    noise: float | None = None
    note: str | None = None
    model: Any = None


def check_in_float64(
    model: Any,
    samples: Samples,
    reference: Arrangement,
    others: list[Arrangement],
    flagged: list[int],
    *,
    device: Any = "cpu",
    forward_fn: Any = None,
) -> Float64Check:
    """Re-score the batches holding a flagged sample, in every arrangement, with a float64
    copy of the model; coupled: float64 deviation > FLOOR."""
    n = len(samples)
    coupled = torch.zeros(n, dtype=torch.bool)
    if not flagged:
        return Float64Check(coupled)
    index = torch.as_tensor(flagged, dtype=torch.long)
    model64, note = _float64_copy(model)
    if model64 is not None:
        positions = set(flagged)
        try:
            with preserved_buffers(model64), eval_mode(model64):
                rescored = [
                    score_arrangement(
                        model64, samples, a, device=device, forward_fn=forward_fn, float64=True, positions=positions
                    )[0]
                    for a in (reference, *others)
                ]
        except BnauditError as exc:
            model64, note = None, f"the model does not run in float64 ({exc})"
    if model64 is None:
        coupled[index] = True
        return Float64Check(coupled, note=note)
    flagged_cmp = compare_outputs([o[index] for o in rescored[1:]], rescored[0][index])
    deviations = torch.zeros((len(others), n), dtype=torch.float64)
    deviations[:, index] = flagged_cmp.deviations
    coupled[index] = flagged_cmp.deviation > FLOOR
    cleared = ~(flagged_cmp.deviation > FLOOR)
    noise = float(flagged_cmp.deviation[cleared].max()) if bool(cleared.any()) else None
    return Float64Check(coupled, deviations, noise, None, model64)


def measure_model_invariance(
    runnable: Any,
    stream: Any,
    device: Any = "cpu",
    forward_fn: Callable[[Any, Any], Any] | None = None,
    config: Config | None = None,
    progress: Callable[[int, int], None] | None = None,
    batch_sizes: list[int] | None = None,
) -> InvarianceReport:
    """Read the samples of `stream` once and score them in every arrangement (module
    docstring). `runnable` is a `bnaudit.runtime.models.RunnableModel`, `stream` a
    `bnaudit.runtime.data.BatchStream`.

    Steps: `read_samples`, `plan_arrangements`, `score_arrangements` (the bulk of the
    work), `compare_outputs`, `check_in_float64` and `locate_coupling` on the flagged few,
    `diagnose`. Under torch.distributed the scoring of both `score_arrangements` and
    `check_in_float64` is split across ranks (`score_arrangement`); collective, so every
    rank must call it, and every rank returns the same report."""
    device = resolve_device(device) if isinstance(device, str) else device
    config = config or Config()
    sizes = check_batch_sizes(batch_sizes or [1, stream.batch_size])
    inspection = audit_checkpoint(runnable.checkpoint, config, runnable.facts)
    model = runnable.module
    model.to(device)
    samples = read_samples(stream)
    # --grayscale applies to image folders only: elsewhere it is no fix to suggest
    grayscale = stream.options.grayscale if getattr(stream.source, "is_images", False) else None
    n = len(samples)
    if n < 2:
        raise BnauditError("invariance needs at least 2 samples")
    arrangements = plan_arrangements(n, sizes, stream.options.seed)
    with eval_mode(model), torch.no_grad(), preserved_buffers(model):
        scored, failures = score_arrangements(
            model, samples, arrangements, device=device, forward_fn=forward_fn, progress=progress, grayscale=grayscale
        )
        # batch sizes include one of 2 or more: two arrangements besides "alone"
        reference_arrangement, reference = scored[0]
        others = scored[1:]
        comparison = compare_outputs([out for _, out in others], reference)
        screen = screen_for(reference.dtype)
        flagged = [int(i) for i in torch.nonzero(comparison.deviation > screen).flatten()]
        check = check_in_float64(
            model,
            samples,
            reference_arrangement,
            [a for a, _ in others],
            flagged,
            device=device,
            forward_fn=forward_fn,
        )
        sites: list[CouplingSite] = []
        if bool(check.coupled.any()) or failures:
            precise = check.model is not None
            sites = locate_coupling(
                check.model if precise else model,
                samples,
                reference_arrangement,
                others,
                check.deviations if precise else comparison.deviations,
                check.coupled,
                FLOOR if precise else screen,
                device=device,
                forward_fn=forward_fn,
                float64=precise,
            )
    report = _build_report(
        runnable,
        stream,
        samples,
        sizes,
        str(device),
        reference_arrangement,
        others,
        reference,
        comparison,
        check.coupled,
        flagged,
        check.deviations,
        screen,
        inspection,
    )
    report.float64 = check.model is not None
    report.float64_noise = check.noise
    report.float64_note = check.note
    report.sites = sites
    report.failures = failures
    report.diagnosis = diagnose(report)
    return report


def _build_report(
    runnable: Any,
    stream: Any,
    samples: Samples,
    sizes: list[int],
    device: str,
    reference_arrangement: Arrangement,
    others: list[tuple[Arrangement, Any]],
    reference: Any,
    comparison: Comparison,
    coupled_mask: Any,
    flagged: list[int],
    deviations64: Any,
    screen: float,
    inspection: FileReport,
) -> InvarianceReport:
    n = len(samples)
    labels = samples.labels
    classifier = comparison.classifier
    if labels is not None and classifier:
        k = reference.shape[1]
        if int(labels.min()) < 0 or int(labels.max()) >= k:
            raise BnauditError(
                f"labels range over {int(labels.min())}..{int(labels.max())} but the model has {k} outputs"
            )

    def accuracy(out: Any) -> float | None:
        if labels is None or not classifier:
            return None
        return float((out.argmax(dim=1) == labels).double().mean())

    per_arrangement = deviations64 if deviations64 is not None else comparison.deviations
    results = [
        ArrangementResult(
            reference_arrangement.name,
            reference_arrangement.batch_size,
            reference_arrangement.order,
            len(reference_arrangement.batches),
            0.0,
            0,
            0 if classifier else None,
            accuracy(reference),
        )
    ]
    changed_any = torch.zeros(n, dtype=torch.bool)
    for row, (a, out) in enumerate(others):
        coupled_here = coupled_mask & (per_arrangement[row] > (FLOOR if deviations64 is not None else screen))
        changed = None
        if comparison.changed is not None:
            changes = comparison.changed[row] & coupled_here
            changed_any |= changes
            changed = int(changes.sum())
        results.append(
            ArrangementResult(
                a.name,
                a.batch_size,
                a.order,
                len(a.batches),
                float(comparison.deviations[row].max()),
                int(coupled_here.sum()),
                changed,
                accuracy(out),
            )
        )
    deviation = comparison.deviation
    worst = int(deviation.argmax())
    kl = comparison.kl.amax(dim=0) if comparison.kl is not None else None
    return InvarianceReport(
        checkpoint=runnable.checkpoint.path,
        model=runnable.describe(),
        data=stream.description,
        samples=n,
        batch_sizes=sizes,
        seed=stream.options.seed,
        shuffle=stream.options.shuffle,
        device=device,
        dtype=str(reference.dtype).replace("torch.", ""),
        reference=reference_arrangement.name,
        arrangements=results,
        screen=screen,
        floor=FLOOR,
        flagged=len(flagged),
        cleared=len(flagged) - int(coupled_mask.sum()) if deviations64 is not None else 0,
        coupled=int(coupled_mask.sum()),
        float64=False,
        max_deviation=float(deviation[worst]),
        max_deviation_sample=samples.origins[worst] if float(deviation[worst]) > 0 else None,
        classifier=classifier,
        changed=int(changed_any.sum()) if classifier else None,
        max_kl=float(kl.max()) if kl is not None else None,
        mean_kl=float(kl.mean()) if kl is not None else None,
        inspection=inspection,
        labelled=len(labels) if labels is not None and classifier else 0,
        skipped=stream.skipped,
        notes=list(getattr(stream, "notes", [])),
    )


# ----------------------------------------------------------------------------- locating


def _rows(value: Any, position: int, size: int) -> list[Any]:
    """The row `position` of every tensor in `value` whose first dimension is the batch."""
    if isinstance(value, torch.Tensor):
        if value.dim() >= 1 and value.shape[0] == size and value.dtype.is_floating_point:
            return [value[position].detach().to(torch.float64).clone()]
        return []
    if isinstance(value, Mapping):
        return [r for v in value.values() for r in _rows(v, position, size)]
    if isinstance(value, (tuple, list)):
        return [r for v in value for r in _rows(v, position, size)]
    return []


def _relative(a: list[Any], b: list[Any]) -> float | None:
    """max ||a_j - b_j||_inf / ||b_j||_inf over the tensors; None when not comparable."""
    if not a or len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b, strict=True)):
        return None
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        if x.numel() == 0:
            continue
        scale = float(y.abs().nan_to_num(nan=0.0, posinf=0.0).max().clamp_min(TINY))
        worst = max(worst, float(_abs_diff(x, y).max()) / scale)
    return worst


def _trace(
    model: Any, samples: Samples, rows: list[int], position: int, device: Any, forward_fn: Any, float64: bool
) -> list[tuple[str, Any, Any, Any]]:
    """(name, module, input rows, output rows) of every module call, in finishing order,
    for the sample at `position` within `rows`."""
    size = len(rows)
    seen: list[tuple[str, Any, Any, Any]] = []
    handles = []
    for name, module in model.named_modules():
        if is_script(module):
            continue

        def hook(mod: Any, args: Any, kwargs: Any, out: Any, _name: str = name) -> None:
            seen.append((_name, mod, _rows((args, kwargs), position, size), _rows(out, position, size)))

        handles.append(module.register_forward_hook(hook, with_kwargs=True))
    try:
        score_batch(model, samples, rows, device, forward_fn, float64)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def locate_coupling(
    model: Any,
    samples: Samples,
    reference_arrangement: Arrangement,
    others: list[tuple[Arrangement, Any]],
    deviations: Any,
    coupled_mask: Any,
    threshold: float,
    *,
    device: Any = "cpu",
    forward_fn: Any = None,
    float64: bool = False,
) -> list[CouplingSite]:
    """Where the coupling happens (module docstring), distinct modules in the order found."""
    sites: list[CouplingSite] = []
    if is_script(model):
        return _scripted_sites(model)
    coupled = torch.nonzero(coupled_mask).flatten()
    if len(coupled):
        worst_first = coupled[torch.argsort(deviations.amax(dim=0)[coupled], descending=True)]
        for position in worst_first[:LOCATE_SAMPLES].tolist():
            row = int(deviations[:, position].argmax())
            arrangement = others[row][0]
            batch = next(b for b in arrangement.batches if position in b)
            ref_batch = next(b for b in reference_arrangement.batches if position in b)
            try:
                a = _trace(model, samples, batch, batch.index(position), device, forward_fn, float64)
                r = _trace(model, samples, ref_batch, ref_batch.index(position), device, forward_fn, float64)
            except Exception:  # the batches ran before; a hook-incompatible model stays unlocated
                continue
            site = _first_coupling(a, r, threshold)
            if site is None:
                continue
            name, module = site
            found = _site(name, module, model)
            found = replace(found, sample=samples.origins[position], arrangement=arrangement.name)
            if all(s.module != found.module for s in sites):
                sites.append(found)
    if not sites:
        for name, module in model.named_modules():
            if is_script(module):
                sites.extend(
                    replace(s, module=f"{name}.{s.module}" if s.module != "(model)" else name)
                    for s in _scripted_sites(module)
                )
    return sites


def _first_coupling(a: list[Any], r: list[Any], threshold: float) -> tuple[str, Any] | None:
    calls: dict[tuple[str, int], Any] = {}
    counts: dict[str, int] = {}
    for name, _module, inputs, outputs in r:
        k = counts.get(name, 0)
        counts[name] = k + 1
        calls[(name, k)] = (inputs, outputs)
    counts = {}
    for name, module, inputs, outputs in a:
        k = counts.get(name, 0)
        counts[name] = k + 1
        other = calls.get((name, k))
        if other is None:
            continue
        d_out = _relative(outputs, other[1])
        if d_out is None or d_out <= threshold:
            continue
        d_in = _relative(inputs, other[0])
        if not inputs and not other[0]:
            d_in = 0.0  # a module without batch inputs (a parameter source): its output is its own
        if d_in is not None and d_in <= threshold:
            return name, module
    return None


def _site(name: str, module: Any, model: Any) -> CouplingSite:
    cls = type(module).__name__
    reason = batch_statistics_reason(module)
    if reason is not None:
        return CouplingSite(name or "(model)", cls, reason, "batchnorm")
    if module is model:
        return CouplingSite(
            "(model)",
            cls,
            "the model's own forward code mixes samples between its submodules (a reshape, view or "
            "reduction across the batch dimension)",
            "model_code",
        )
    return CouplingSite(
        name,
        cls,
        "mixes samples: its output for a sample changes with the other samples while its input does not "
        "(a reshape, view or reduction across the batch dimension)",
        "mixes_samples",
    )


def _scripted_sites(model: Any) -> list[CouplingSite]:
    sites = [
        CouplingSite(
            call.module,
            call.kind,
            f"the TorchScript graph calls {call.op} with training=True as a constant (traced or exported in "
            "training mode): .eval() cannot switch it to the running statistics",
            "traced_training",
        )
        for call in scripted_batch_stat_calls(model)
    ]
    for name, module in model.named_modules():
        reason = batch_statistics_reason(module)
        if reason is not None and all(s.module != (name or "(model)") for s in sites):
            sites.append(CouplingSite(name or "(model)", getattr(module, "original_name", ""), reason, "batchnorm"))
    return sites


# ----------------------------------------------------------------------------- diagnosis


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 100:.1f}%"


def diagnose(report: InvarianceReport) -> list[str]:
    """Plain-word conclusions: the verdict, where the coupling is and what to fix."""
    lines: list[str] = []
    sizes = ", ".join(str(s) for s in report.batch_sizes)
    for name, message in report.failures.items():
        lines.append(
            f"The model cannot score one sample alone ({name}: {message}): a deployment that sends one input at a "
            "time fails. The usual cause is BatchNorm normalising by batch statistics (no running statistics, "
            "or a graph traced in training mode), which needs more than one value per channel."
        )
    if report.verdict == "invariant":
        lines.append(
            f"Every output is the same alone and among other samples ({plural(report.samples, 'sample')}, batch "
            f"sizes {sizes}; largest deviation {above_floor(report.max_deviation, report.screen)}): predictions do "
            "not depend on their batch companions. Nothing to fix."
        )
        if report.cleared:
            lines.append(
                f"{plural(report.cleared, 'sample')} differed by more than the screen ({report.screen:.2g}) in "
                f"{report.dtype} but agreed in float64 (largest float64 deviation {above_floor(report.float64_noise or 0.0, report.floor)}, "
                f"floor {report.floor:.2g}): the summation order of the kernels, not the companions."
            )
        return lines
    if report.coupled:
        changed = ""
        if report.changed is not None:
            changed = f"; {plural(report.changed, 'prediction')} ({_pct(report.changed_share)}) change"
        lines.append(
            f"{report.coupled} of {plural(report.samples, 'sample')} get other outputs among other companions "
            f"(largest deviation {report.max_deviation:.3g} of the output's largest value{changed}): predictions "
            "depend on the batch they arrive in."
        )
        alone = report.accuracy("alone")
        batched = [a for a in report.arrangements if a.order == "natural" and a.accuracy is not None]
        if alone is not None and batched:
            best = batched[-1]
            lines.append(
                f"Accuracy alone {_pct(alone)} against {_pct(best.accuracy)} in batches of {best.batch_size}: a "
                "score measured in batches is not what single requests get."
            )
    fixes = {
        "batchnorm": "Fix: build it with track_running_stats=True and estimate its statistics (`bnaudit recalibrate`), "
        "or use a per-sample norm (GroupNorm, LayerNorm).",
        "traced_training": "Fix: call model.eval() before torch.jit.trace (or the export) and save it again.",
        "model_code": "Fix: keep the batch dimension apart (permute/transpose instead of reshape/view across it; no "
        "mean, sum or softmax over dim 0).",
        "mixes_samples": "Fix its forward: keep the batch dimension apart (permute/transpose instead of reshape/view "
        "across it; no mean, sum or softmax over dim 0).",
    }
    groups: dict[tuple[str, str], list[CouplingSite]] = {}
    for site in report.sites:
        # the same reason in several modules (a whole graph traced in training mode) said once
        groups.setdefault((site.cause, site.reason.replace(site.kind, "{kind}")), []).append(site)
    for (cause, _), group in groups.items():
        first = group[0]
        if cause == "model_code":
            where = f"{first.kind}.forward"
        else:
            where = listing([f"{s.module} ({s.kind})" for s in group], 4)
        reason = first.reason if len(group) == 1 else first.reason.replace(f"{first.kind} ", "")
        lines.append(f"{where}: {reason}. {fixes[cause]}")
    if report.verdict == "coupled" and not report.sites:
        lines.append(
            "The coupling could not be traced to one module"
            + (
                " (TorchScript runs no hooks and its graph calls no batch normalisation in training mode): pass the "
                "state dict with --arch MODULE:CALLABLE to locate it."
                if "TorchScript" in report.model
                else ": look for code that combines samples (statistics over the batch, reshapes across it)."
            )
        )
    if report.float64_note:
        lines.append(f"Float64 re-scoring was not possible ({report.float64_note}): the screen decided alone.")
    bn006 = [f.layer for f in report.findings if f.code == "BN006" and f.layer]
    if bn006 and not any(s.cause == "batchnorm" for s in report.sites):
        lines.append(f"inspect (BN006) finds no running statistics in {listing(bn006)}: they use batch statistics.")
    return lines


# ----------------------------------------------------------------------------- entry point


def measure_invariance(
    checkpoint: str,
    options: Any,
    *,
    arch: str | None = None,
    arch_kwargs: Any = None,
    key: str | None = None,
    trust_pickle: bool = False,
    forward: str | None = None,
    device: str = "cpu",
    config: Config | None = None,
    progress: Callable[[int, int], None] | None = None,
    batch_sizes: list[int] | None = None,
    fail_on: str | None = None,
    exit_zero: bool = False,
) -> InvarianceReport:
    """Load the model and the data (`options`: a `bnaudit.DataOptions`; `num_samples`
    None reads 256) and measure whether outputs depend on their batch companions (module
    docstring). `batch_sizes` default to [1, options.batch_size]; `fail_on` and
    `exit_zero` are stored for `InvarianceReport.exit_code`. Under torchrun (WORLD_SIZE >
    1) it joins the process group and every rank returns the same report (module
    docstring).

    >>> import bnaudit                                                      # doctest: +SKIP
    >>> bnaudit.measure_invariance("model.pt", bnaudit.DataOptions(path="val.safetensors"),
    ...                            arch="mypkg.models:net").verdict         # doctest: +SKIP
    """
    target = resolve_device(device)
    if options.num_samples is None:
        options = replace(options, num_samples=DEFAULT_NUM_SAMPLES)
    options.validate()
    sizes = check_batch_sizes(batch_sizes or [1, options.batch_size])
    forward_fn = load_forward(forward)
    runnable = load_runnable(checkpoint, arch=arch, arch_kwargs=arch_kwargs, key=key, trust_pickle=trust_pickle)
    stream = make_loader(replace(options, pin_memory=target.type == "cuda"))
    with process_group(target):
        report = measure_model_invariance(
            runnable, stream, device_for_rank(target), forward_fn, config, progress, sizes
        )
    report.fail_on = fail_on
    report.exit_zero = exit_zero
    return report

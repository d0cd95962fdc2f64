"""`invariance`: does a prediction depend on the other samples in its batch?

In deployment a model scores one input at a time, or whatever batch arrives; its output
for a sample must not change with the sample's companions. The model runs as deployed:
every module in eval mode, no buffer changed (the buffers are snapshot and restored, so
even a graph traced in training mode, which updates its running statistics on every
call, leaves the model as it found it).

Arrangements (`bnaudit.runtime.arrangements.plan_arrangements`): "alone", "in batch (B)"
and "other companions (B)" for each batch size B of --batch-sizes. Each arrangement fills one
output tensor (N, ...) indexed by sample position, batch by batch (`score_arrangement`);
every statistic is computed from these tensors afterwards.

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

  deviation     d_i = max_a relative_deviation(y_a,i, r_i)
                        = max_a ||y_a,i - r_i||_inf / max(||r_i||_inf, tiny)
                (`bnaudit.audit.statistics` defines it, non-finite values included: the
                largest absolute change of any output value relative to the largest
                absolute output value)
  changed       argmax_k y_a,i != argmax_k r_i for some a (class scores only)
  KL            max_a KL(p_r || p_a) = sum_k p_r,k (log p_r,k - log p_a,k), p = softmax;
                class scores only: outputs (N, K) with K >= 2. Other outputs
                (a regression head) get the deviation alone.
  accuracy      per arrangement, top-1 against the labels, where the data has labels

Noise floor. Matrix kernels sum in another order for another batch size, so a
batch-independent float32 model differs by ~1e-7 between arrangements. Two thresholds:

  screen        128 * eps(dtype) of the outputs (1.5e-5 for float32; at most 1e-2): a
                sample with d_i above it is FLAGGED (`bnaudit.runtime.arrangements.screen_for`)
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
`bnaudit.reports.invariance.KL_FLOOR` (1e-6 nats: telling two output distributions that
close apart takes about 1/KL = 10^6 samples; float32 kernel noise gives ~1e-13 on the
sample model) prints as "<1e-06".

The verdict rests on the float64 deviation, which lies about seven orders of magnitude
from either side of the floor, so no hand-tuned tolerance decides it. Where no float64
copy runs (a --forward or graph that insists on float32) the screen decides, and the
report says so.

Locating the coupling: `bnaudit.runtime.coupling.locate_coupling`.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from bnaudit.audit.checkpoint.inspect import audit_checkpoint
from bnaudit.audit.checkpoint.report import FileReport
from bnaudit.config import Config, measurement_fail_on
from bnaudit.errors import BnauditError
from bnaudit.reports.invariance import ArrangementResult, CouplingSite, InvarianceReport, diagnose
from bnaudit.runtime.arrangements import (
    Arrangement,
    Comparison,
    Samples,
    compare_outputs,
    plan_arrangements,
    read_samples,
    score_batch,
    screen_for,
    take,
)
from bnaudit.runtime.batching import BatchPlan
from bnaudit.runtime.coupling import locate_coupling
from bnaudit.runtime.data import make_loader
from bnaudit.runtime.distributed import combine_rows, distributed, failure_message, together, torchrun
from bnaudit.runtime.inputs import input_problem
from bnaudit.runtime.models import ModelSpec, as_model_spec, load_forward, load_runnable, resolve_device, resolve_model
from bnaudit.runtime.norms import batch_statistics
from bnaudit.text import exception_line, plural

FLOOR = math.sqrt(torch.finfo(torch.float64).eps)
DEFAULT_NUM_SAMPLES = 256


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

    Under torch.distributed it is collective: each rank runs its share of the
    arrangement's whole batches (`BatchPlan.shard`) and the zero-filled rows are summed
    across ranks (`bnaudit.runtime.distributed.combine_rows`: each row comes from one
    rank, so the sums are exact); every rank returns the same outputs, or raises the
    first failing rank's error (`distributed.together`)."""
    options: dict[str, Any] = {
        "device": device,
        "forward_fn": forward_fn,
        "float64": float64,
        "positions": positions,
        "progress": progress,
        "grayscale": grayscale,
    }
    mine = _share(arrangement)
    with together():
        outputs, filled = _score_locally(model, samples, arrangement.name, mine, **options)
    return combine_rows(outputs, filled)


def _share(arrangement: Arrangement) -> BatchPlan:
    """The arrangement's batches this process runs: all of them, or under torch.distributed
    this rank's contiguous block of whole batches."""
    return arrangement.plan.shard(*distributed())


def _score_locally(
    model: Any,
    samples: Samples,
    name: str,
    plan: BatchPlan,
    *,
    device: Any = "cpu",
    forward_fn: Any = None,
    float64: bool = False,
    positions: set[int] | None = None,
    progress: Callable[[], None] | None = None,
    grayscale: bool | None = None,
) -> tuple[Any, Any]:
    """`score_arrangement` of the batches of `plan` (arrangement `name`) in this process
    alone; messages number them as the whole arrangement does."""
    n = len(samples)
    outputs: Any = None
    filled = torch.zeros(n, dtype=torch.bool)
    for number, rows in plan.numbered():
        if positions is not None and not positions.intersection(rows):
            continue
        try:
            out = score_batch(model, samples, rows, device, forward_fn, float64)
        except BnauditError as exc:
            raise BnauditError(f"{name}, batch {number}: {exc}") from None
        except Exception as exc:
            # the words gap uses for inputs a model cannot take (dtype, channels)
            problem = input_problem(model, take(samples.inputs, rows), grayscale) if forward_fn is None else None
            raise BnauditError(
                f"{name}, batch {number}: the model rejects the batch "
                f"({plural(len(rows), 'sample')}): {problem or exception_line(exc)}"
            ) from None
        if outputs is None:
            outputs = torch.zeros((n, *out.shape[1:]), dtype=out.dtype)
        elif out.shape[1:] != outputs.shape[1:]:
            raise BnauditError(
                f"{name}, batch {number}: the output shape changed to {list(out.shape)} "
                f"from {[len(rows), *outputs.shape[1:]]}"
            )
        index = torch.as_tensor(rows, dtype=torch.long)
        outputs[index] = out.to("cpu", outputs.dtype)
        filled[index] = True
        if progress is not None:
            progress()
    return outputs, filled


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
    (`BatchPlan.shard`), combined across ranks by `score_arrangement`."""
    total = sum(len(_share(a)) for a in arrangements)
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
            failures[arrangement.name] = failure_message(exc)  # the same line on every rank
            done = before + len(_share(arrangement))
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
            with batch_statistics(model64, {}):
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
    # deployed: everything in eval mode, every buffer as it was afterwards
    with batch_statistics(model, {}), torch.no_grad():
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
        sites = _coupling_sites(
            model, samples, reference_arrangement, others, comparison, check, failures, screen, device, forward_fn
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


def _coupling_sites(
    model: Any,
    samples: Samples,
    reference_arrangement: Arrangement,
    others: list[tuple[Arrangement, Any]],
    comparison: Comparison,
    check: Float64Check,
    failures: Any,
    screen: float,
    device: Any,
    forward_fn: Any,
) -> list[CouplingSite]:
    """Where the coupling enters (`locate_coupling`), looked for only when a sample is
    coupled or an arrangement failed: in the float64 copy against FLOOR where one ran,
    else in the model itself against the screen."""
    if not (bool(check.coupled.any()) or failures):
        return []
    precise = check.model is not None
    return locate_coupling(
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
    """The report of the scored arrangements (module docstring); the float64 outcome, the
    coupling sites, the failures and the diagnosis are the caller's to fill in."""
    n = len(samples)
    labels = samples.labels
    classifier = comparison.classifier
    if labels is not None and classifier:
        k = reference.shape[1]
        if int(labels.min()) < 0 or int(labels.max()) >= k:
            raise BnauditError(
                f"labels range over {int(labels.min())}..{int(labels.max())} but the model has {k} outputs"
            )
    results, changed_any = _arrangement_results(
        reference_arrangement, others, reference, comparison, coupled_mask, deviations64, screen, labels, n
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


def _arrangement_results(
    reference_arrangement: Arrangement,
    others: list[tuple[Arrangement, Any]],
    reference: Any,
    comparison: Comparison,
    coupled_mask: Any,
    deviations64: Any,
    screen: float,
    labels: Any,
    n: int,
) -> tuple[list[ArrangementResult], Any]:
    """One result per arrangement, the reference first, and the mask of samples whose top-1
    class changed in some arrangement. A sample counts in an arrangement when it is coupled
    and its deviation there exceeds the threshold that decided: FLOOR on the float64
    deviations where they exist, else the screen."""
    classifier = comparison.classifier
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
            _accuracy(reference, labels, classifier),
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
                _accuracy(out, labels, classifier),
            )
        )
    return results, changed_any


def _accuracy(out: Any, labels: Any, classifier: bool | None) -> float | None:
    """Top-1 accuracy of `out` against the labels; None without labels or class scores."""
    if labels is None or not classifier:
        return None
    return float((out.argmax(dim=1) == labels).double().mean())


# ----------------------------------------------------------------------------- entry point


def measure_invariance(
    spec: ModelSpec | str,
    options: Any,
    *,
    config: Config | None = None,
    progress: Callable[[int, int], None] | None = None,
    batch_sizes: list[int] | None = None,
    fail_on: str | None = None,
    exit_zero: bool = False,
) -> InvarianceReport:
    """Load the model (`spec`: a `bnaudit.ModelSpec`, or a checkpoint path) and the data
    (`options`: a `bnaudit.DataOptions`; `num_samples` None reads 256) and measure whether outputs depend on their batch companions (module
    docstring). `batch_sizes` default to [1, options.batch_size]; `fail_on` (None: the
    configuration file's fail-on, if it states one; `bnaudit.config.measurement_fail_on`)
    and `exit_zero` are stored for `InvarianceReport.exit_code`. Under torchrun (WORLD_SIZE >
    1) it joins the process group and every rank returns the same report (module
    docstring).

    >>> import bnaudit                                                      # doctest: +SKIP
    >>> bnaudit.measure_invariance(bnaudit.ModelSpec("model.pt", arch="mypkg.models:net"),
    ...                            bnaudit.DataOptions(path="val.safetensors")).verdict  # doctest: +SKIP
    """
    threshold = measurement_fail_on(config, fail_on)
    spec = as_model_spec(spec)
    target = resolve_device(spec.device)
    if options.num_samples is None:
        options = replace(options, num_samples=DEFAULT_NUM_SAMPLES)
    options.validate()
    sizes = check_batch_sizes(batch_sizes or [1, options.batch_size])
    forward_fn = load_forward(spec.forward)
    runnable = load_runnable(resolve_model(spec, config))
    stream = make_loader(replace(options, pin_memory=target.type == "cuda"))
    with torchrun(target) as ranks:
        report = measure_model_invariance(runnable, stream, ranks.device, forward_fn, config, progress, sizes)
    report.fail_on = threshold
    report.exit_zero = exit_zero
    return report

"""Where samples meet: the module that couples a sample's output to its batch companions.

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

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch

from bnaudit.reports.invariance import CouplingSite
from bnaudit.runtime.arrangements import Arrangement, Samples, score_batch
from bnaudit.runtime.deviation import relative_deviation
from bnaudit.runtime.norms import batch_statistics_reason, is_script, scripted_batch_stat_calls

LOCATE_SAMPLES = 3


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
    """The largest relative_deviation of a_j against b_j over the tensors; None when not
    comparable."""
    if not a or len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b, strict=True)):
        return None
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        if x.numel() == 0:
            continue
        worst = max(worst, relative_deviation(x, y))
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

"""Which EMA wrote an averaged copy, read from its counters: timm's ModelEmaV2 or ModelEmaV3.

Torch-free. timm (timm/utils/model_ema.py, 1.0) updates every entry of the copy's state
dict in place on each step:

  ModelEma / ModelEmaV2  ema.copy_(decay * ema + (1 - decay) * live) for every entry, the
                         integer num_batches_tracked included: the float result is truncated
                         on the copy, so the counter stays 0 until (1 - decay) * t >= 1 and
                         lags far behind the live counter afterwards
  ModelEmaV3             floating entries lerp toward the live ones (weight 1 - decay);
                         integer entries are copied: num_batches_tracked is the live
                         model's at the last update (exclude_buffers=True copies every buffer)

So beside its live model, a copy whose counters equal the live ones while its statistics
differ is V3-like (equal statistics too: buffers copied, kind unknown), and one whose
counters are all below them (0 early on) V2-like; alone, counters of 0 with
statistics that are not the initial 0/1 point to V2.

The schedule (`EmaSchedule`): timm's train.py saves its argparse namespace as the
container's `args`, whose `model_ema_decay` and `model_ema_warmup` are the arguments it
built the EMA with (`ModelEmaV3(model, decay=..., use_warmup=...)`, warm-up gamma 1 and
power 2/3 by default) and which it updates once per optimizer step with `step=num_updates`
(1, 2, ...); `grad_accum_steps` micro-batches (BN forwards) make one optimizer step;
`bn_momentum` overrides the model's BN momentum; `pretrained` and `initial_checkpoint`
start from weights whose statistics are not the initial 0/1. A checkpoint whose args
lack the decay records no schedule.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from bnaudit.formats.model import Averaging, TensorRef

V2 = "timm ModelEmaV2"
V3 = "timm ModelEmaV3"
UNKNOWN = "EMA (unknown kind)"
COPIED = "copied buffers"
RECALIBRATED = "EMA copy recalibrated by bnaudit"
EMA_PYTORCH = "ema-pytorch EMA"

COUNTER_MEANINGS = {
    V2: "num_batches_tracked averaged like the weights and truncated to an integer on every update "
    "(timm ModelEma/ModelEmaV2): 0 until (1 - decay) * steps reaches 1, then far behind the live counter; "
    "it counts no batches",
    V3: "num_batches_tracked copied from the live model on every update (timm ModelEmaV3 copies integer "
    "buffers): the live model's training counter, not the age of the average",
    COPIED: "num_batches_tracked copied from the live model with its statistics (timm "
    "ModelEmaV3(exclude_buffers=True), or an EMA of the weights only): the live model's training counter",
    UNKNOWN: "num_batches_tracked of an EMA copy: copied or averaged from the live model's, not a count "
    "of the batches its statistics average",
}


def _counters(tensors: Mapping[str, TensorRef]) -> dict[str, int]:
    found = {}
    for name, ref in tensors.items():
        if name.endswith("num_batches_tracked") and ref.is_integer and math.prod(ref.shape) == 1:
            found[name] = int(ref.read()[0])
    return found


def _same_statistics(ema: Mapping[str, TensorRef], live: Mapping[str, TensorRef], counters: list[str]) -> bool:
    """Every running_mean / running_var beside the shared counters equal on both sides."""
    for counter in counters:
        prefix = counter[: -len("num_batches_tracked")]
        for leaf in ("running_mean", "running_var"):
            a, b = ema.get(prefix + leaf), live.get(prefix + leaf)
            if a is None or b is None or a.read() != b.read():
                return False
    return True


def ema_averaging(ema: Mapping[str, TensorRef], live: Mapping[str, TensorRef] | None) -> Averaging:
    """The `Averaging` record of an EMA copy (`ema`), judged by its counters against the
    live model's (`live`, None when the container holds none); see the module docstring."""
    mine = _counters(ema)
    if live is not None:
        theirs = _counters(live)
        shared = [n for n in mine if n in theirs]
        if shared and any(theirs[n] > 0 for n in shared):
            if all(mine[n] == theirs[n] for n in shared):
                if _same_statistics(ema, live, shared):
                    # every buffer copied (ModelEmaV3(exclude_buffers=True), or a copy of the
                    # weights only): the counters say nothing of the kind
                    return Averaging(UNKNOWN, None, "copied", COUNTER_MEANINGS[COPIED])
                return Averaging(V3, None, "averaged", COUNTER_MEANINGS[V3])
            if all(mine[n] < theirs[n] for n in shared):
                return Averaging(V2, None, "averaged", COUNTER_MEANINGS[V2])
    elif mine and all(v == 0 for v in mine.values()):
        return Averaging(V2, None, "averaged", COUNTER_MEANINGS[V2])
    return Averaging(UNKNOWN, None, "unknown", COUNTER_MEANINGS[UNKNOWN])


def ema_pytorch_averaging(step: int | None) -> Averaging:
    """The `Averaging` of an ema-pytorch `ema_model`: floating buffers (running_mean,
    running_var) are averaged like the weights; integer ones are never touched, so its
    num_batches_tracked is the online model's at the EMA's creation (usually 0). `step`
    counts the EMA's `update()` calls; its decay (beta, warm-up, update_after_step,
    update_every) is not saved."""
    steps = f"; its step buffer counts {step} update() calls" if step is not None else ""
    return Averaging(
        EMA_PYTORCH,
        None,
        "averaged",
        "num_batches_tracked is left as it was when the EMA was created (ema-pytorch averages floating buffers "
        f"only): it counts no batches{steps}",
    )


def recalibrated_averaging(before: Averaging | None, source: str) -> Averaging:
    """The `Averaging` of a copy whose statistics `bnaudit recalibrate` re-estimated (`source`
    says which run): its counters count calibration batches, so they tell no EMA kind."""
    n_averaged = before.n_averaged if before is not None else None
    return Averaging(
        RECALIBRATED,
        n_averaged,
        "recalibrated",
        f"num_batches_tracked counts the calibration batches of {source or 'bnaudit recalibrate'}, not "
        "training steps: the statistics are population statistics of the calibration data",
    )


def copy_words(averaging: Averaging | None) -> str:
    """An averaged copy in words: "EMA copy (timm ModelEmaV3)", "averaged copy
    (AveragedModel)", or "EMA copy" where the kind is unknown."""
    if averaging is None or averaging.kind == UNKNOWN:
        return "EMA copy"
    if averaging.kind == "AveragedModel":
        return "averaged copy (AveragedModel)"
    if averaging.kind == RECALIBRATED:
        return "EMA copy (recalibrated by bnaudit)"
    return f"EMA copy ({averaging.kind})"


@dataclass(frozen=True)
class EmaSchedule:
    """How the EMA copy of a timm training run was updated, as its `args` record it (module
    docstring).

    decay          the EMA decay (`model_ema_decay`)
    warmup         `model_ema_warmup`: ModelEmaV3's decay warm-up, 1 - (1 + k / gamma)^-power
                   at update k + 1, clamped to [0, decay] (gamma 1, power 2/3: timm's defaults)
    accumulation   BN forwards per EMA update (`grad_accum_steps`, 1 when absent)
    bn_momentum    the BN momentum the run set (`bn_momentum`), None when the model's own
    fresh_start    the model started from its initial statistics (no `pretrained`, no
                   `initial_checkpoint`)
    recorded       which args said so, for messages
    """

    decay: float
    warmup: bool
    accumulation: int
    bn_momentum: float | None
    fresh_start: bool
    recorded: str
    warmup_gamma: float = 1.0
    warmup_power: float = 2.0 / 3.0


def _arg(args: Any, name: str) -> Any:
    if isinstance(args, Mapping):
        return args.get(name)
    return vars(args).get(name) if hasattr(args, "__dict__") and isinstance(vars(args), dict) else None


def _real(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def ema_schedule(container: Any) -> EmaSchedule | None:
    """The EMA schedule the container's training arguments (`args`: an argparse namespace or
    a mapping, as timm's CheckpointSaver saves them) record, or None where they record no
    decay in [0, 1)."""
    args = container.get("args") if isinstance(container, Mapping) else None
    if args is None:
        return None
    decay = _real(_arg(args, "model_ema_decay"))
    if decay is None or not 0.0 <= decay < 1.0:
        return None
    warmup = _arg(args, "model_ema_warmup") is True
    accumulation = _arg(args, "grad_accum_steps")
    steps = accumulation if isinstance(accumulation, int) and not isinstance(accumulation, bool) else 1
    momentum = _real(_arg(args, "bn_momentum"))
    fresh = not _arg(args, "pretrained") and not _arg(args, "initial_checkpoint")
    recorded = [f"model_ema_decay={decay:g}", f"model_ema_warmup={warmup}"]
    if steps != 1:
        recorded.append(f"grad_accum_steps={steps}")
    if momentum is not None:
        recorded.append(f"bn_momentum={momentum:g}")
    return EmaSchedule(
        decay=decay,
        warmup=warmup,
        accumulation=max(steps, 1),
        bn_momentum=momentum if momentum is not None and 0.0 < momentum <= 1.0 else None,
        fresh_start=fresh,
        recorded=", ".join(recorded),
    )

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
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from bnaudit.formats.model import Averaging, TensorRef

V2 = "timm ModelEmaV2"
V3 = "timm ModelEmaV3"
UNKNOWN = "EMA (unknown kind)"
COPIED = "copied buffers"

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


def copy_words(averaging: Averaging | None) -> str:
    """An averaged copy in words: "EMA copy (timm ModelEmaV3)", "averaged copy
    (AveragedModel)", or "EMA copy" where the kind is unknown."""
    if averaging is None or averaging.kind == UNKNOWN:
        return "EMA copy"
    if averaging.kind == "AveragedModel":
        return "averaged copy (AveragedModel)"
    return f"EMA copy ({averaging.kind})"

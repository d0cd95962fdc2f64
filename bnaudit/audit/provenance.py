"""Which layers a checkpoint's recalibration record may speak for.

`bnaudit recalibrate` leaves a record in the file it writes (safetensors metadata, a
torch state dict's `_metadata`, a TorchScript extra file): the layers it re-estimated
hold population statistics, and their `num_batches_tracked` counts calibration batches,
not training steps, so BN003 and BN010 do not apply to them. The record is untrusted
text: it is honoured for a layer only when its `digests` entry equals the
`statistics_digest` of that layer's statistics as stored now, so a record copied onto
other statistics, or statistics trained further after recalibration, are audited as
usual and the record changes nothing but the note.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from bnaudit.formats.ema import RECALIBRATED, recalibrated_averaging
from bnaudit.formats.model import Averaging, Checkpoint
from bnaudit.formats.provenance import RecalibrationRecord, statistics_digest
from bnaudit.text import plural


@dataclass(frozen=True)
class Provenance:
    """`layers`: the recalibrated layers whose stored statistics match the record;
    `note`: the line the report prints ("" when the file has no usable record);
    `source`: who re-estimated the verified layers, "bnaudit recalibrate (method ...,
    N samples, date)" ("" when no layer is verified), for messages about those layers;
    `mismatch`: the part of the note about claimed layers whose statistics the record does
    not match ("" when there are none)."""

    layers: frozenset[str]
    note: str
    source: str = ""
    mismatch: str = ""


def recalibration_provenance(ckpt: Checkpoint) -> Provenance:
    """The layers `ckpt`'s recalibration record may speak for, and the report's note.

    The one place a record is judged: every command (inspect, diff) asks it, so a record
    that inspect refuses cannot change another command's verdicts."""
    record = RecalibrationRecord.from_metadata(ckpt.metadata)
    if record is None:
        return Provenance(frozenset(), "")
    claimed = record.recalibrated_layers
    verified = frozenset(n for n in claimed if _matches(ckpt, n, record.digests))
    if not claimed:
        return Provenance(frozenset(), "")
    note = source = ""
    if verified:
        source = f"bnaudit recalibrate (method {record.method}, {record.samples} samples, {record.date})"
        note = f"statistics of {plural(len(verified), 'layer')} re-estimated by {source}"
    stale = len(claimed) - len(verified)
    mismatch = ""
    if stale:
        mismatch = (
            f"a bnaudit recalibrate record names {plural(stale, 'layer')} whose statistics it does not match "
            "(changed since, or a record from another file): audited as usual"
        )
        note += ("; " if note else "") + mismatch
    return Provenance(verified, note, source, mismatch)


def _matches(ckpt: Checkpoint, layer: str, digests: Mapping[str, str]) -> bool:
    if layer not in digests:
        return False
    mean, var = ckpt.tensors.get(f"{layer}.running_mean"), ckpt.tensors.get(f"{layer}.running_var")
    if mean is None or var is None:
        return False
    return bool(digests[layer] == statistics_digest(mean.read(), var.read()))


def believed_averaging(ckpt: Checkpoint, provenance: Provenance) -> Averaging | None:
    """An averaged copy's `Averaging`, the recalibration record believed over the counters:
    a copy `bnaudit recalibrate` re-estimated holds population statistics and counters of
    calibration batches, which the counter heuristics (formats/ema.py) would take for a
    ModelEmaV2's truncated average. A record whose digests match none of the layers
    changes nothing."""
    averaging = ckpt.averaging
    if not ckpt.is_ema or not provenance.layers or (averaging is not None and averaging.kind == RECALIBRATED):
        return averaging
    return recalibrated_averaging(averaging, provenance.source)

"""The `--format json` documents: plain dicts, strict JSON (no NaN or Infinity).

Strings from files and models are kept exact (a consumer matches layer names against the
state dict); the encoder escapes their control characters.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from bnaudit import __version__
from bnaudit.audit.checkpoint.report import InspectReport
from bnaudit.audit.rules import Finding
from bnaudit.audit.statistics import (
    MAX_MEAN_SHIFT,
    MAX_VAR_LOG_RATIO,
)

if TYPE_CHECKING:
    from bnaudit.audit.diff.checkpoints import DiffReport, Side
    from bnaudit.audit.export.diff import ExportCheck, FoldedLayer, KeptNode
    from bnaudit.audit.fed.report import FedReport
    from bnaudit.audit.fold.report import FoldReport
    from bnaudit.formats.hfcache import HubSource
    from bnaudit.formats.model import Averaging


def json_number(x: Any) -> Any:
    """Strict JSON: NaN and +-Inf become null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def finding_to_json(f: Finding) -> dict[str, Any]:
    return {
        "code": f.code,
        "name": f.name,
        "severity": f.severity,
        "layer": f.layer,
        "message": f.message,
        "channels": list(f.channels),
    }


def inspect_to_json(report: InspectReport) -> dict[str, Any]:
    files = []
    for file in report.files:
        files.append(
            {
                "path": file.path,
                "format": file.format,
                "key": file.key,
                "other_keys": file.other_keys,
                "prefix": file.prefix or None,
                "averaging": averaging_to_json(file.averaging),
                "settings": file.settings or None,
                "provenance": file.provenance or None,
                "not_loaded": file.not_loaded,
                "layers": [
                    {
                        "name": s.name,
                        "kind": s.kind,
                        "num_features": s.num_features,
                        "num_batches_tracked": s.num_batches_tracked,
                        "eps": json_number(s.eps),
                        "momentum": json_number(s.momentum),
                        "dtype": s.stats_dtype,
                        "mean": {"min": json_number(s.mean_min), "max": json_number(s.mean_max)},
                        "var": {
                            "min": json_number(s.var_min),
                            "median": json_number(s.var_median),
                            "max": json_number(s.var_max),
                        },
                        "near_eps_channels": s.near_eps_channels,
                        "max_eval_gain": json_number(s.max_eval_gain),
                        "status": file.layer_status(s.name),
                    }
                    for s in file.layers
                ],
                "findings": [finding_to_json(f) for f in file.findings],
                "error": file.error,
                "excluded": file.excluded,
                "skipped": file.skipped,
                "skip_reason": file.skip_reason if file.skipped else None,
                "notes": file.notes,
                "hub": hub_to_json(file.hub),
            }
        )
    return {"version": __version__, "config": report.config.as_dict(), "files": files, "summary": report.summary()}


def fed_to_json(report: FedReport) -> dict[str, Any]:
    """The `bnaudit fed --format json` document (classes and tolerances in
    bnaudit.audit.fed.classify); `client` indexes `clients` from 0."""
    return {
        "version": __version__,
        "global": report.path,
        "format": report.format,
        "clients": list(report.clients),
        "statistics": list(report.statistics),
        "layers": [
            {
                "name": layer.name,
                "channels": layer.channels,
                "kind": layer.kind,
                "client": layer.client,
                "weighting": None
                if layer.weighting is None
                else {"source": layer.weighting.source, "weights": list(layer.weighting.weights)},
                "understated_variance": [json_number(b) for b in layer.understated]
                if layer.kind == "averaged"
                else None,
                "understated_fraction": json_number(layer.understated_fraction),
                "reason": layer.reason or None,
                "counter": None
                if layer.counter is None
                else {
                    "dtype": layer.counter.dtype,
                    "value": json_number(layer.counter.value),
                    "clients": list(layer.counter.clients),
                },
            }
            for layer in report.layers
        ],
        "findings": [finding_to_json(f) for f in report.findings],
        "fix": list(report.fix),
        "summary": report.summary(),
    }


def averaging_to_json(averaging: Averaging | None) -> dict[str, Any] | None:
    """An averaged copy's record (bnaudit.formats.model.Averaging), or null for a live model."""
    if averaging is None:
        return None
    return {
        "kind": averaging.kind,
        "n_averaged": averaging.n_averaged,
        "buffers": averaging.buffers,
        "counter_meaning": averaging.counter_meaning,
    }


def hub_to_json(hub: HubSource | None) -> dict[str, Any] | None:
    """Where a file of a Hugging Face cache comes from (bnaudit.formats.hfcache.HubSource)."""
    if hub is None:
        return None
    return {
        "repo_type": hub.repo_type,
        "repo_id": hub.repo_id,
        "revision": hub.revision,
        "file": hub.file,
        "refs": list(hub.refs),
        "also_in": list(hub.also_in),
    }


def diff_to_json(report: DiffReport) -> dict[str, Any]:
    """The `bnaudit diff --format json` document.

    Per layer: the changes defined in bnaudit.audit.diff.layers (null where a side lacks the
    values or a value is not finite), which tensors are bit-identical, the counters of both
    sides and the verdict.
    """

    def side(s: Side) -> dict[str, Any]:
        return {
            "path": s.path,
            "format": s.format,
            "key": s.key,
            "prefix": s.prefix or None,
            "averaging": averaging_to_json(s.averaging),
            "layers": s.layers,
        }

    return {
        "version": __version__,
        "config": report.config.as_dict(),
        "a": side(report.a),
        "b": side(report.b),
        "settings": report.settings or None,
        "provenance": report.provenance or None,
        "layers": [
            {
                "name": d.name,
                "kind": d.kind,
                "num_features": d.num_features,
                "weight_change": json_number(d.weight_change),
                "bias_change": json_number(d.bias_change),
                MAX_MEAN_SHIFT.name: json_number(d.max_mean_shift),
                MAX_VAR_LOG_RATIO.name: json_number(d.max_var_log_ratio),
                "num_batches_tracked": {"a": d.batches_a, "b": d.batches_b, "change": d.batches_change},
                "identical": {
                    "weight": d.weight_identical,
                    "bias": d.bias_identical,
                    "running_mean": d.mean_identical,
                    "running_var": d.var_identical,
                },
                "eps": {
                    "a": json_number(d.eps_a),
                    "b": json_number(d.eps_b),
                    "known": d.settings_known,
                    "source": {"a": d.settings_a.eps.source.value, "b": d.settings_b.eps.source.value},
                },
                "momentum": {
                    "a": json_number(d.momentum_a),
                    "b": json_number(d.momentum_b),
                    "source": {"a": d.settings_a.momentum.source.value, "b": d.settings_b.momentum.source.value},
                },
                "verdict": d.verdict,
            }
            for d in report.layers
        ],
        "only_a": list(report.only_a),
        "only_b": list(report.only_b),
        "reshaped": [{"name": n, "a": ca, "b": cb} for n, ca, cb in report.reshaped],
        "export": _export_to_json(report.export),
        "groups": report.groups(),
        "findings": [finding_to_json(f) for f in report.findings],
        "diagnosis": report.diagnosis(),
        "summary": report.summary(),
    }


def _export_to_json(check: ExportCheck | None) -> dict[str, Any] | None:
    """A checkpoint against its export (bnaudit.audit.export.diff, numbers: bnaudit.audit.export.folded)."""
    if check is None:
        return None
    p = check.parity
    return {
        "export_side": check.export_side,
        "kind": "pt2" if check.kind == "a torch.export program" else "onnx",
        "producer": check.producer or None,
        "opset": check.opset,
        "matching": check.matching or None,
        "pairing": check.pairing or None,
        "nodes": [_export_node_to_json(n) for n in check.nodes],
        "folded": [_folded_to_json(f) for f in check.folded],
        "unpaired": [{"name": u.name, "reason": u.reason} for u in check.unpaired],
        "unauditable": list(check.unauditable),
        "parity": None
        if p is None
        else {
            "samples": p.samples,
            "batches": p.batches,
            "agreement": json_number(p.agreement),
            "max_deviation": json_number(p.max_deviation),
            "floor": json_number(p.floor),
            "deviates": p.deviates,
            "batch_size": p.batch_size,
            "padded": p.padded,
            "explanation": check.explanation() if p.deviates else None,
        },
    }


def fold_to_json(report: FoldReport) -> dict[str, Any]:
    """The `bnaudit fold --format json` document: channel lists as integer indices, null
    where not measured (definitions in bnaudit.audit.fold.check and bnaudit.audit.fold.report)."""
    measured = report.measured
    pairs = []
    for p in report.pairs:
        setter = p.scale_set_by
        pairs.append(
            {
                "bn": p.bn,
                "producer": p.producer,
                "paired_by": p.paired_by,
                "channels": p.channels,
                "int8_per_tensor": {
                    "scale": json_number(p.int8_scale),
                    "collapsed_channels": list(p.collapsed),
                    "coarse_channels": list(p.coarse),
                    "scale_set_by": None
                    if setter is None
                    else {
                        "channel": setter.channel,
                        "running_var": json_number(setter.running_var),
                        "gamma": json_number(setter.gamma),
                        "gain": json_number(setter.gain),
                    },
                },
                "int8_per_channel": {"collapsed_channels": list(p.per_channel_collapsed)},
                "fp16": {
                    "overflow_channels": list(p.fp16_overflow),
                    "flush_channels": list(p.fp16_flush),
                    "silent_flush_channels": list(p.silent_flush),
                    "cancellation_channels": list(p.fp16_cancellation),
                },
                "bf16": {"cancellation_channels": list(p.bf16_cancellation)},
                "measured_drop": None if measured is None else json_number(measured.pair_drop.get(p.bn)),
            }
        )
    return {
        "pairs": pairs,
        "unpaired": [name for name, _ in report.unpaired],
        "measured": None if measured is None else {k: json_number(v) for k, v in measured.results.items()},
        "findings": [finding_to_json(f) for f in report.findings],
        "notes": [*report.notes, *(measured.notes if measured is not None else ())],
        # BN layers left out of the prediction, how many and why ("" when every layer was audited)
        "not_audited": report.not_audited() or None,
        "summary": report.summary(),
    }


def _export_node_to_json(n: KeptNode) -> dict[str, Any]:
    """One BN layer against its export node: settings with their provenance, tensor mismatches."""
    return {
        "name": n.name,
        "node": n.node,
        "source": n.source,
        "matched_by": n.matched_by,
        "eps": {
            "export": json_number(n.eps_export),
            "checkpoint": json_number(n.eps_checkpoint),
            "checkpoint_source": n.checkpoint.eps.source.value,
        },
        "momentum": {
            "onnx": json_number(n.momentum_onnx),
            "checkpoint": json_number(n.momentum_checkpoint),
            "checkpoint_source": n.checkpoint.momentum.source.value,
        },
        "settings_assumed": n.settings_assumed,
        "training_mode": n.training_mode,
        "mismatches": [
            {
                "tensor": m.tensor,
                "export_dtype": m.export_dtype,
                "channels": m.channels,
                "max_abs": json_number(m.max_abs),
                "max_rel": json_number(m.max_rel),
                "rounding": m.rounding,
                "initial": m.initial,
            }
            for m in n.mismatches
        ],
    }


def _folded_to_json(f: FoldedLayer) -> dict[str, Any]:
    """One BN layer folded into its export's convolution: the fit of the folded scale and shift."""
    return {
        "name": f.name,
        "conv": f.conv,
        "node": f.node,
        "pairing": f.pairing,
        "channels": f.check.channels,
        "eps": json_number(f.eps),
        "eps_source": f.eps_setting.source.value,
        "fits_eps": json_number(f.fits_eps),
        "scaled_copy": f.check.scaled_copy,
        "residual": json_number(f.check.residual),
        "scale_error": json_number(f.check.scale_error),
        "shift_error": json_number(f.check.shift_error),
        "implied_eps": json_number(f.check.implied_eps),
        "implied_eps_note": f.check.eps_note,
        "zero_gamma": f.check.zero_gamma,
        "matches": f.check.matches,
        "cause": f.check.cause or None,
    }

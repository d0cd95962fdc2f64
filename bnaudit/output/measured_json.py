"""The `--format json` documents of the measuring commands (gap, invariance, recalibrate,
merge, parity): plain dicts, strict JSON, built as `bnaudit.output.json` builds those of the
commands that read checkpoints (its `json_number` and `finding_to_json`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bnaudit import __version__
from bnaudit.audit.statistics import MAX_MEAN_SHIFT, MEAN_SHIFT, PARITY_FACTOR, VAR_LOG_RATIO, Drift
from bnaudit.output.json import finding_to_json, json_number

if TYPE_CHECKING:
    from bnaudit.reports.gap import GapReport, LayerDrift
    from bnaudit.reports.invariance import InvarianceReport
    from bnaudit.reports.merge import MergeReport
    from bnaudit.reports.parity import ParityReport
    from bnaudit.reports.recalibrate import LayerChange, RecalibrationReport


def gap_to_json(report: GapReport) -> dict[str, Any]:
    """The `bnaudit gap --format json` document (accuracies as fractions, null without labels)."""
    return {
        "version": __version__,
        "checkpoint": report.checkpoint,
        "key": report.key,
        "prefix": report.prefix or None,
        "model": report.model,
        "data": report.data,
        "samples": report.samples,
        "batch_size": report.batch_size,
        "batches": report.batches,
        "seed": report.seed,
        "shuffle": report.shuffle,
        "device": report.device,
        "skipped": report.skipped,
        "train_mode": {
            "accuracy": json_number(report.train_accuracy),
            "non_finite_outputs": report.non_finite.get("train_mode", 0),
        },
        "eval_mode": {
            "accuracy": json_number(report.eval_accuracy),
            "non_finite_outputs": report.non_finite.get("eval_mode", 0),
        },
        "gap": json_number(report.gap),
        "agreement": json_number(report.agreement),
        "divergence": json_number(report.divergence),
        "divergence_kind": report.divergence_kind,
        "layers": [
            {
                "name": d.name,
                "position": d.position + 1,  # 1-based, as the table's # and the diagnosis count
                "kind": d.kind,
                "channels": d.channels,
                "values": d.values,
                **_drift_to_json(d),
                "drift": json_number(d.drift),
                "note": d.note,
                **_attribution_to_json(d),
            }
            for d in report.layers
        ],
        **_confidence_to_json(report),
        "findings": [finding_to_json(f) for f in report.findings],
        "diagnosis": list(report.diagnosis),
    }


def invariance_to_json(report: InvarianceReport) -> dict[str, Any]:
    """The `bnaudit invariance --format json` document (bnaudit.runtime.invariance defines
    every figure; accuracies and shares as fractions, null where they do not apply)."""
    return {
        "version": __version__,
        "checkpoint": report.checkpoint,
        "key": report.key,
        "prefix": report.prefix or None,
        "model": report.model,
        "data": report.data,
        "samples": report.samples,
        "batch_sizes": list(report.batch_sizes),
        "seed": report.seed,
        "shuffle": report.shuffle,
        "device": report.device,
        "dtype": report.dtype,
        "skipped": report.skipped,
        "verdict": report.verdict,
        "reference": report.reference,
        "norm": report.norm,
        "arrangements": [
            {
                "name": a.name,
                "batch_size": a.batch_size,
                "order": a.order,
                "batches": a.batches,
                "max_deviation": json_number(a.max_deviation),
                "coupled_samples": a.coupled,
                "changed_predictions": a.changed,
                "accuracy": json_number(a.accuracy),
            }
            for a in report.arrangements
        ],
        "noise": {
            "screen": report.screen,
            "floor": report.floor,
            "flagged": report.flagged,
            "cleared_by_float64": report.cleared,
            "float64_rescored": report.float64,
            "float64_noise": json_number(report.float64_noise),
            "float64_note": report.float64_note,
        },
        "coupled_samples": report.coupled,
        "max_deviation": json_number(report.max_deviation),
        "max_deviation_sample": report.max_deviation_sample,
        "classifier": report.classifier,
        "changed_predictions": report.changed,
        "changed_share": json_number(report.changed_share),
        "kl": None
        if report.max_kl is None
        else {"max": json_number(report.max_kl), "mean": json_number(report.mean_kl)},
        "labelled": report.labelled,
        "accuracy_alone": json_number(report.accuracy("alone")),
        "accuracy_in_batch": json_number(_largest_batch_accuracy(report)),
        "failures": dict(report.failures),
        "coupling": [
            {
                "module": s.module,
                "kind": s.kind,
                "cause": s.cause,
                "reason": s.reason,
                "sample": s.sample,
                "arrangement": s.arrangement,
            }
            for s in report.sites
        ],
        "notes": list(report.notes),
        "findings": [finding_to_json(f) for f in report.findings],
        "diagnosis": list(report.diagnosis),
    }


def _largest_batch_accuracy(report: InvarianceReport) -> float | None:
    """Accuracy in the natural batches of the largest batch size (None without labels)."""
    natural = [a for a in report.arrangements if a.order == "natural"]
    return natural[-1].accuracy if natural else None


def _attribution_to_json(d: LayerDrift) -> dict[str, Any]:
    """A layer's origin flag, worst-channel drift and top channels (bnaudit.runtime.attribution)."""
    return {
        "origin": d.origin,
        "peak": json_number(d.peak),
        "worst_channels": [
            {
                "index": c.index,
                "data_mean": json_number(c.data_mean),
                "data_var": json_number(c.data_var),
                "running_mean": json_number(c.running_mean),
                "running_var": json_number(c.running_var),
                "shift": json_number(c.shift),
                "log_var_ratio": json_number(c.log_var_ratio),
                "drift": json_number(c.score),
            }
            for c in d.worst
        ],
    }


def _interval(pair: tuple[float, float] | None) -> list[float | None] | None:
    return None if pair is None else [json_number(pair[0]), json_number(pair[1])]


def _confidence_to_json(report: GapReport) -> dict[str, Any]:
    """Sample counts and 95% intervals (bnaudit.runtime.confidence), and the input diagnosis."""
    return {
        "labelled": report.labelled,
        "train_mode_interval": _interval(report.train_interval),
        "eval_mode_interval": _interval(report.eval_interval),
        "gap_interval": _interval(report.gap_interval),
        "gap_significant": report.gap_significant,
        "preprocessing_mismatch": report.preprocessing_mismatch,
        "notes": list(report.notes),
        "input": {
            "mean": None if report.input_mean is None else [json_number(v) for v in report.input_mean],
            "std": None if report.input_std is None else [json_number(v) for v in report.input_std],
            "implied_mean": None if report.implied_mean is None else [json_number(v) for v in report.implied_mean],
            "implied_std": None if report.implied_std is None else [json_number(v) for v in report.implied_std],
        },
    }


def _drift_to_json(d: Drift | LayerDrift) -> dict[str, Any]:
    """A layer's drift statistics under their names (`bnaudit.audit.statistics`)."""
    return {
        MEAN_SHIFT.name: json_number(d.mean_shift),
        MAX_MEAN_SHIFT.name: json_number(d.max_mean_shift),
        VAR_LOG_RATIO.name: json_number(d.var_log_ratio),
    }


def recalibrate_to_json(report: RecalibrationReport) -> dict[str, Any]:
    """The `bnaudit recalibrate --format json` document."""
    evaluation = None
    if report.eval_before is not None and report.eval_after is not None:
        evaluation = {"before": gap_to_json(report.eval_before), "after": gap_to_json(report.eval_after)}
    return {
        "version": __version__,
        "input": report.input,
        "output": report.output,
        "format": report.format,
        "key": report.key,
        "prefix": report.prefix or None,
        "model": report.model,
        "data": report.data,
        "method": report.method,
        "samples": report.samples,
        "batches": report.batches,
        "batch_size": report.batch_size,
        "seed": report.seed,
        "shuffle": report.shuffle,
        "device": report.device,
        "world_size": report.world_size,
        "layers": _changes_to_json(report.layers),
        "skipped": [{"name": s.name, "reason": s.reason} for s in report.skipped],
        "warnings": list(report.warnings),
        "provenance": None if report.provenance is None else report.provenance.as_dict(),
        "eval": evaluation,
        "stats_out": report.stats_out,
        "shard": report.shard,
    }


def _changes_to_json(layers: list[LayerChange]) -> list[dict[str, Any]]:
    """The re-estimated layers of recalibrate's and merge's reports, with their drift before and after."""
    return [
        {
            "name": c.name,
            "channels": c.channels,
            "values": c.values,
            "batches": c.batches,
            "before": _drift_to_json(c.before),
            "after": _drift_to_json(c.after),
        }
        for c in layers
    ]


def merge_to_json(report: MergeReport) -> dict[str, Any]:
    """The `bnaudit merge --format json` document."""
    return {
        "version": __version__,
        "checkpoint": report.checkpoint,
        "output": report.output,
        "format": report.format,
        "key": report.key,
        "prefix": report.prefix or None,
        "method": report.method,
        "samples": report.samples,
        "batches": report.batches,
        "files": [
            {
                "path": f.path,
                "shard": f.shard,
                "samples": f.samples,
                "batches": f.batches,
                "data": f.data,
                "world_size": f.world_size,
            }
            for f in report.files
        ],
        "layers": _changes_to_json(report.layers),
        "warnings": list(report.warnings),
        "provenance": report.provenance.as_dict(),
    }


def parity_to_json(report: ParityReport) -> dict[str, Any]:
    """The `bnaudit parity --format json` document: per layer in execution order its noise
    floor, max |target - eager| (`max_abs`), channel_relative (`relative`) and verdict
    (definitions in bnaudit.audit.statistics and bnaudit.audit.parity); null where a value is
    not finite."""
    first = report.first_divergent
    o = report.outputs
    return {
        "version": __version__,
        "config": report.config.as_dict(),
        "checkpoint": report.checkpoint,
        "model": report.model,
        "target": {"kind": report.target.kind, "path": report.target.path, "backend": report.target.backend},
        "samples": report.samples,
        "batches": report.batches,
        "device": report.device,
        "factor": PARITY_FACTOR,
        "layers": [
            {
                "name": layer.name,
                "site": layer.site,
                "calls": layer.calls,
                "channels": layer.channels,
                "floor": json_number(layer.floor),
                "max_abs": json_number(layer.max_abs),
                "relative": json_number(layer.relative),
                "ratio": json_number(layer.ratio),
                "diverges": layer.diverges,
                "worst_channel": layer.worst_channel,
                "channels_over": list(layer.channels_over),
                "dtype": layer.evidence.dtype,
                "differs": list(layer.evidence.static),
            }
            for layer in report.layers
        ],
        "first_divergent": first.name if first is not None else None,
        "outputs": {
            "max_abs": json_number(o.max_abs),
            "relative": json_number(o.relative),
            "floor": json_number(o.floor),
            "deviates": o.deviates,
            "top1_agreement": json_number(o.top1_agreement),
        },
        "unseen": [{"name": u.name, "reason": u.reason} for u in report.unseen],
        "notes": list(report.notes),
        "findings": [finding_to_json(f) for f in report.findings],
        "diagnosis": report.diagnosis(),
        "summary": report.summary(),
    }

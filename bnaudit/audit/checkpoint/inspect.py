"""`inspect`: paths -> checkpoint -> layers -> rules -> InspectReport.

Directories (and Hugging Face caches) expand as audit/checkpoint/scan.py says; a file named
explicitly is read whatever its name. One unreadable file becomes a FileReport with
`error` set; the others are still audited. Optimizer, scheduler and RNG state and
pickled training arguments become a FileReport with `skipped` set (formats/classify.py);
so do, in a scanned folder only, files of no checkpoint format (formats/sniff.py) and
data sets (tensors `inputs` / `labels`: formats/classify.data_tensors).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping, Sequence

from bnaudit.audit.checkpoint.forked import forked_map, worker_count
from bnaudit.audit.checkpoint.report import FileReport, InspectReport, LayerSummary
from bnaudit.audit.checkpoint.scan import Target, targets, without_external_data, without_indexed_shards
from bnaudit.audit.layers import (
    BNLayer,
    ModelReference,
    ModuleFacts,
    discover_layers,
    facts_from_module_infos,
    not_from_file,
)
from bnaudit.audit.producers import LazyProducers, ProducerFilter, producers_from_names
from bnaudit.audit.provenance import recalibration_provenance
from bnaudit.audit.rules import Finding, RuleContext, run_rules
from bnaudit.audit.settings import settings_stated_by, statement
from bnaudit.config import Config
from bnaudit.errors import BnauditError
from bnaudit.formats.classify import NotModelWeights, data_tensors
from bnaudit.formats.hfcache import HubSource
from bnaudit.formats.model import Checkpoint
from bnaudit.formats.read import read_checkpoint
from bnaudit.formats.shards import index_beside
from bnaudit.formats.sniff import NotACheckpoint
from bnaudit.severity import Severity


def audit_checkpoint(
    ckpt: Checkpoint,
    config: Config,
    module: ModuleFacts | None = None,
    producers: Mapping[str, str] | None = None,
    channels: bool = False,
) -> FileReport:
    """Audit an opened checkpoint; `module` (when the model is known) makes BN001 exact and
    enables the module-only rules; `producers` (BN layer -> the module feeding it, from the
    model's graph) tells BN004 which filters feed which channel; `channels`: the layer
    summaries keep every channel's values (LayerSummary.channels). Raises BnauditError for
    unreadable tensors."""
    discovery = discover_layers(ckpt, settings_stated_by(config))
    live_layers = None
    if ckpt.live_tensors is not None:
        live = Checkpoint(ckpt.path, ckpt.format, ckpt.live_tensors, modules=ckpt.modules)
        live_layers = {layer.name: layer for layer in discover_layers(live, settings_stated_by(config)).layers}
    provenance = recalibration_provenance(ckpt)
    findings = run_rules(
        RuleContext(
            discovery,
            config,
            is_ema=ckpt.is_ema,
            module=module,
            recalibrated=provenance.layers,
            unauditable=tuple(ckpt.unauditable),
            unauditable_layers=dict(ckpt.unauditable_layers),
            folded=ckpt.folded,
            folded_ambiguous=ckpt.folded_ambiguous,
            decomposed=ckpt.decomposed,
            averaging=ckpt.averaging,
            live_layers=live_layers,
            tensors=ckpt.tensors,
            producers=producers if producers is not None else _named_producers(ckpt, discovery.layers),
            graph_producers=_graph_producers(ckpt, discovery.layers),
        )
    )
    report = FileReport(ckpt.path)
    if ckpt.format == "onnx":
        producer = ckpt.metadata.get("onnx.producer") or "an unnamed producer"
        opset = ckpt.metadata.get("onnx.opset") or "?"
        report.notes.append(f"ONNX model from {producer}, opset {opset}: eps and momentum from its nodes")
    if ckpt.format == "pt2":
        producer = ckpt.metadata.get("pt2.producer") or "an unknown torch"
        programs = ckpt.metadata.get("pt2.programs") or "none"
        report.notes.append(
            f"torch.export archive from {producer}, program(s) {programs}: eps and momentum from its nodes"
        )
    report.notes.extend(ckpt.notes)
    if ckpt.shards:
        report.notes.append(f"{ckpt.shards} shards read as one checkpoint through the index")
    if ckpt.shard_of is not None:
        k, n = ckpt.shard_of
        index = index_beside(ckpt.path)
        report.notes.append(
            f"shard {k} of {n} read alone: missing buffers are info "
            + (f"(whole checkpoint: {os.path.basename(index)})" if index else "(no index beside it)")
        )
        findings = [_possibly_split(f, k, n) if f.code == "BN001" else f for f in findings]
    report.provenance = provenance.note
    report.format, report.key, report.other_keys = ckpt.format, ckpt.key, ckpt.other_keys
    report.prefix, report.is_ema, report.averaging = ckpt.prefix, ckpt.is_ema, ckpt.averaging
    report.not_loaded = list(ckpt.not_loaded)
    report.layers = [LayerSummary.of(layer, config.near_eps_factor, channels) for layer in discovery.layers]
    report.findings = findings
    missing_from = "not shown by the program" if ckpt.format == "pt2" else "not in a state dict"
    report.settings = statement(not_from_file(discovery.layers), missing_from)
    return report


def _named_producers(ckpt: Checkpoint, layers: Sequence[BNLayer]) -> Mapping[str, str]:
    """A state dict's producers by name, found only when BN004 asks (bnaudit.audit.producers)."""
    return LazyProducers(
        lambda: producers_from_names(ckpt.tensors, {layer.name: layer.num_features for layer in layers}).feeds
    )


def _graph_producers(ckpt: Checkpoint, layers: Sequence[BNLayer]) -> Mapping[str, ProducerFilter]:
    """An exported graph's BN producers, paired only when BN004 asks (bnaudit.audit.fold.graph)."""
    if ckpt.format not in ("onnx", "pt2"):
        return {}

    def pair() -> Mapping[str, ProducerFilter]:
        from bnaudit.audit.fold.graph import exported_producers

        return exported_producers(ckpt, layers)

    return LazyProducers(pair)


def _possibly_split(finding: Finding, k: int, n: int) -> Finding:
    """BN001 on a shard read without its index: the missing buffers may sit in another shard."""
    return dataclasses.replace(
        finding,
        severity=Severity.INFO,
        message=f"{finding.message} (possibly split across shards: this file is shard {k} of {n})",
    )


def audit_file(
    path: str,
    config: Config,
    key: str | None = None,
    trust_pickle: bool = False,
    reference: ModelReference | None = None,
    debug: bool = False,
    named: bool = True,
    channels: bool = False,
) -> FileReport:
    """Audit one checkpoint; a user-caused problem becomes `FileReport.error`, a file that
    is not model weights `FileReport.skipped`. `named`: the user named it (not a scan);
    `channels`: keep every channel's values (audit_checkpoint).

    `reference` (the model --arch builds) is compared with the checkpoint key by key; a
    file that holds its own modules (TorchScript, a pickled nn.Module) speaks for itself. An unexpected exception (a bug met on this
    file) is recorded the same way so the other files are still audited; `debug=True`
    lets it propagate instead.
    """
    try:
        ckpt = read_checkpoint(path, key=key, trust_pickle=trust_pickle)
        data = data_tensors({name: ref.shape for name, ref in ckpt.tensors.items()})
        if data is not None and not named:
            return FileReport(path, skipped=f"tensors {data}", skip_reason="data, not a model", named=named)
        module = None
        # an exported graph (ONNX, .pt2) holds only its BN tensors (no conv weights to match
        # against --arch) and names its own nodes' settings: --arch would only add noise there
        arch_used = reference is not None and ckpt.format not in ("onnx", "pt2")
        if reference is not None and arch_used:
            ckpt, module = reference.match(ckpt)
        elif ckpt.holds_module and ckpt.modules:
            module = facts_from_module_infos(ckpt.modules)
        producers = reference.producers if reference and arch_used else None
        report = audit_checkpoint(ckpt, config, module, producers, channels)
        if reference is not None and not arch_used:
            report.notes.append("--arch not used for an exported graph: its nodes carry their own settings")
        if data is not None:
            report.notes.append(f"tensors {data}: data, not a model")
    except NotModelWeights as exc:
        return FileReport(path, skipped=exc.what, named=named)
    except NotACheckpoint as exc:
        if named or exc.path != path:  # named, or a shard of this index: the file is broken
            return FileReport(path, error=str(exc).removeprefix(f"{path}: "), named=named)
        return FileReport(path, skipped=exc.what, skip_reason="not a checkpoint", named=named)
    except BnauditError as exc:
        return FileReport(path, error=str(exc).removeprefix(f"{path}: "), named=named)
    except Exception as exc:
        if debug:
            raise
        return FileReport(
            path,
            error=f"internal error: {type(exc).__name__}: {exc} (run with --debug for the traceback)",
            named=named,
        )
    report.named = named
    return report


def inspect_paths(
    paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
    config: Config | None = None,
    key: str | None = None,
    trust_pickle: bool = False,
    reference: ModelReference | None = None,
    debug: bool = False,
    all_revisions: bool = False,
    jobs: int | None = None,
    channels: bool = False,
) -> InspectReport:
    """Audit checkpoints (files or directories) and return the report: `bnaudit.inspect`
    (bnaudit.api) without building a model. `reference`, the model `--arch` names, makes
    BN001 exact and BN006 / BN007 / BN011 apply; the other arguments are `bnaudit.inspect`'s."""
    if jobs is not None and jobs < 1:
        raise BnauditError(f"--jobs must be at least 1, got {jobs}")
    config = config or Config()
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    found = targets([os.fspath(p) for p in paths], all_revisions=all_revisions)
    kept = set(without_external_data(without_indexed_shards([t.path for t in found if t.error is None])))
    plan: list[tuple[Target, FileReport | None]] = []  # None: to be audited
    for target in found:
        path, named = target.path, target.named
        if target.error is not None:
            plan.append((target, FileReport(path, error=target.error, named=named)))
        elif named and (pattern := config.exclusion(path)) is not None:
            # named explicitly: say so instead of auditing nothing in silence
            where = f" in {config.source}" if config.source else ""
            excluded = f'excluded by the configuration (exclude "{pattern}"{where})'
            plan.append((target, FileReport(path, excluded=excluded)))
        elif path in kept and not config.excludes(path):
            plan.append((target, None))

    def audit_target(target: Target) -> FileReport:
        return audit_file(
            target.path,
            config,
            key=key,
            trust_pickle=trust_pickle,
            reference=reference,
            debug=debug,
            named=target.named,
            channels=channels,
        )

    to_audit = [target for target, report in plan if report is None]
    audited = iter(forked_map(audit_target, to_audit, worker_count(len(to_audit), jobs)))
    files: list[FileReport] = []
    for target, ready in plan:
        report = ready if ready is not None else next(audited)
        if target.hub is not None:
            _from_the_hub(report, target.hub)
        files.append(report)
    return InspectReport(files, config)


def _from_the_hub(report: FileReport, hub: HubSource) -> None:
    """Name a file of a Hugging Face cache by repo and revision (the full commit, its refs,
    the other revisions holding the same blobs) instead of its snapshot path."""
    report.hub = hub
    refs = f" ({', '.join(hub.refs)})" if hub.refs else ""
    report.notes.insert(0, f"Hugging Face cache: {hub.repo_id} at revision {hub.revision}{refs}")
    if hub.also_in:
        others = ", ".join(r[:12] for r in hub.also_in)
        report.notes.insert(1, f"the same file in revision{'s' if len(hub.also_in) > 1 else ''} {others}: read once")

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
from bnaudit.audit.provenance import believed_averaging, recalibration_provenance
from bnaudit.audit.rules import Finding, RuleContext, run_rules
from bnaudit.audit.settings import settings_stated_by, statement
from bnaudit.config import Config
from bnaudit.errors import BnauditError
from bnaudit.formats.classify import NotModelWeights, data_tensors
from bnaudit.formats.hfcache import HubSource
from bnaudit.formats.model import Checkpoint
from bnaudit.formats.read import read_checkpoint, read_checkpoints
from bnaudit.formats.shards import index_beside
from bnaudit.formats.sniff import NotACheckpoint, is_adapter_folder
from bnaudit.severity import Severity
from bnaudit.text import plural


def audit_checkpoint(
    ckpt: Checkpoint,
    config: Config,
    module: ModuleFacts | None = None,
    producers: Mapping[str, str] | None = None,
    transposed: frozenset[str] = frozenset(),
    channels: bool = False,
) -> FileReport:
    """Audit an opened checkpoint; `module` (when the model is known) makes BN001 exact and
    enables the module-only rules; `producers` (BN layer -> the module feeding it, from the
    model's graph; `transposed` those that are ConvTranspose) tells BN004 which filters feed
    which channel; `channels`: the layer summaries keep every channel's values
    (LayerSummary.channels). Raises BnauditError for unreadable tensors."""
    discovery = discover_layers(ckpt, settings_stated_by(config))
    live_layers = None
    if ckpt.live_tensors is not None:
        live = Checkpoint(ckpt.path, ckpt.format, ckpt.live_tensors, modules=ckpt.modules)
        live_layers = {layer.name: layer for layer in discover_layers(live, settings_stated_by(config)).layers}
    provenance = recalibration_provenance(ckpt)
    averaging = believed_averaging(ckpt, provenance)
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
            quantized=ckpt.quantized,
            adapter=ckpt.adapter,
            decomposed=ckpt.decomposed,
            averaging=averaging,
            live_layers=live_layers,
            ema_schedule=ckpt.ema_schedule,
            tensors=ckpt.tensors,
            producers=producers if producers is not None else _named_producers(ckpt, discovery.layers),
            transposed=transposed,
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
    if ckpt.adapter is not None:
        outside = [layer.name for layer in discovery.layers if not ckpt.adapter.to_save(layer.name)]
        if outside and ckpt.adapter.base:
            report.notes.append(
                f"{plural(len(outside), 'BN layer')} outside the adapter's modules_to_save: statistics that training "
                "under the adapter updated are not saved in it (peft#1732); audited as the base holds them"
            )
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
    report.prefix, report.is_ema, report.averaging = ckpt.prefix, ckpt.is_ema, averaging
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
    return audit_entries(path, config, key, trust_pickle, reference, debug, named, every=False, channels=channels)[0]


def audit_entries(
    path: str,
    config: Config,
    key: str | None = None,
    trust_pickle: bool = False,
    reference: ModelReference | None = None,
    debug: bool = False,
    named: bool = True,
    every: bool = True,
    base: str | None = None,
    channels: bool = False,
) -> list[FileReport]:
    """`audit_file` of every model state dict the file holds (`every`, without `key`): a
    container of several (timm's CheckpointSaver writes `state_dict` and `state_dict_ema`)
    gives one FileReport each, shown as `path:key`; any other file gives one. A PEFT adapter
    folder is audited composed with its base (`base`, else the one its config names:
    bnaudit.formats.peft)."""
    try:
        if is_adapter_folder(path):
            if key is not None:
                raise BnauditError(f"{path}: --key does not apply to a PEFT adapter folder")
            from bnaudit.formats.peft import adapter_base, read_adapter

            ckpts = [read_adapter(path, adapter_base(path, base), trust_pickle=trust_pickle)]
        elif every and key is None:
            ckpts = read_checkpoints(path, trust_pickle=trust_pickle)
        else:
            ckpts = [read_checkpoint(path, key=key, trust_pickle=trust_pickle)]
    except NotModelWeights as exc:
        return [FileReport(path, skipped=exc.what, named=named)]
    except NotACheckpoint as exc:
        if named or exc.path != path:  # named, or a shard of this index: the file is broken
            return [FileReport(path, error=str(exc).removeprefix(f"{path}: "), named=named)]
        return [FileReport(path, skipped=exc.what, skip_reason="not a checkpoint", named=named)]
    except BnauditError as exc:
        return [FileReport(path, error=str(exc).removeprefix(f"{path}: "), named=named)]
    except Exception as exc:
        if debug:
            raise
        return [_internal_error(path, exc, named)]
    several = len(ckpts) > 1
    reports = []
    for ckpt in ckpts:
        try:
            report = _audit_read(ckpt, config, reference, named, channels)
        except BnauditError as exc:
            report = FileReport(path, error=str(exc).removeprefix(f"{path}: "), named=named, key=ckpt.key)
        except Exception as exc:
            if debug:
                raise
            report = _internal_error(path, exc, named)
            report.key = ckpt.key
        if several:
            report.entry, report.other_keys = True, []
        reports.append(report)
    return reports


def _internal_error(path: str, exc: Exception, named: bool) -> FileReport:
    return FileReport(
        path,
        error=f"internal error: {type(exc).__name__}: {exc} (run with --debug for the traceback)",
        named=named,
    )


def _audit_read(
    ckpt: Checkpoint, config: Config, reference: ModelReference | None, named: bool, channels: bool = False
) -> FileReport:
    """The audit of one state dict as read (module docstring of `audit_file`)."""
    path = ckpt.path
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
    graph = reference if reference is not None and arch_used else None
    report = audit_checkpoint(
        ckpt,
        config,
        module,
        graph.producers if graph is not None else None,
        graph.transposed if graph is not None else frozenset(),
        channels,
    )
    if reference is not None and not arch_used:
        report.notes.append("--arch not used for an exported graph: its nodes carry their own settings")
    if data is not None:
        report.notes.append(f"tensors {data}: data, not a model")
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
    base: str | None = None,
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

    def audit_target(target: Target) -> list[FileReport]:
        return audit_entries(
            target.path,
            config,
            key=key,
            trust_pickle=trust_pickle,
            reference=reference,
            debug=debug,
            named=target.named,
            base=base,
            channels=channels,
        )

    to_audit = [target for target, report in plan if report is None]
    audited = iter(forked_map(audit_target, to_audit, worker_count(len(to_audit), jobs)))
    files: list[FileReport] = []
    for target, ready in plan:
        for report in [ready] if ready is not None else next(audited):
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

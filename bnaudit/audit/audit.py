"""`inspect`: paths -> checkpoint -> layers -> rules -> InspectReport.

A directory expands to every file under it whose name ends in a checkpoint suffix
(`.onnx` included, without the external-data files its models refer to), plus shard
indexes (a sharded checkpoint is audited once, through its index, also when its shards
are named next to it) and accelerate's `random_states_N.pkl`; a file named
explicitly is read whatever its name. One unreadable file becomes a FileReport with
`error` set; the others are still audited. Optimizer, scheduler and RNG state and
pickled training arguments become a FileReport with `skipped` set (formats/classify.py).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from typing import Any

from bnaudit.audit.layers import ModuleFacts, discover_layers, facts_from_module_infos, not_from_file
from bnaudit.audit.provenance import recalibration_provenance
from bnaudit.audit.report import FileReport, InspectReport, LayerSummary
from bnaudit.audit.rules import Finding, RuleContext, run_rules
from bnaudit.audit.settings import statement
from bnaudit.config import Config
from bnaudit.errors import BnauditError
from bnaudit.formats.classify import SCANNED_NAMES, NotModelWeights
from bnaudit.formats.model import Checkpoint
from bnaudit.formats.read import read_checkpoint
from bnaudit.formats.shards import index_beside, is_index, series_members
from bnaudit.formats.sniff import CHECKPOINT_SUFFIXES
from bnaudit.severity import Severity


def _scan_directory(path: str) -> list[str]:
    """Files under `path` to audit, walked in sorted order: names with a checkpoint suffix,
    shard indexes and the training-run files `formats.classify.SCANNED_NAMES` recognises.
    `inspect` then drops, once for every target, the shards an index stands for and the
    external-data files of ONNX models."""
    found: list[str] = []

    # A folder that cannot be listed is kept as an entry of its own, so it is
    # reported (as unreadable) instead of silently contributing nothing.
    def unlistable(err: OSError, into: list[str] = found) -> None:
        into.append(err.filename)

    for root, dirs, files in os.walk(path, onerror=unlistable):
        dirs.sort()
        found += [
            os.path.join(root, f)
            for f in sorted(files)
            if f.lower().endswith(CHECKPOINT_SUFFIXES) or is_index(f) or SCANNED_NAMES.match(f)
        ]
    if not found:
        raise BnauditError(f"{path}: directory holds no checkpoint files ({' '.join(CHECKPOINT_SUFFIXES)})")
    return found


def _without_external_data(paths: list[str]) -> list[str]:
    """`paths` minus the external-data files (`weights.bin`, ...) of the ONNX models among
    them: those bytes belong to their model, not to a checkpoint of their own."""
    models = [p for p in paths if p.lower().endswith(".onnx")]
    if not models:
        return paths
    from bnaudit.formats.onnx import external_data_files

    data: set[str] = set()
    for model in models:
        data |= external_data_files(model)
    return [p for p in paths if os.path.realpath(p) not in data]


def _without_indexed_shards(paths: list[str]) -> list[str]:
    """`paths` minus the shards of an index that is also in `paths`: a sharded checkpoint
    is audited once, through its index."""
    members: set[str] = set()
    for p in paths:
        if is_index(p):
            members |= series_members(p)
    return [p for p in paths if is_index(p) or os.path.realpath(p) not in members]


def audit_checkpoint(ckpt: Checkpoint, config: Config, module: ModuleFacts | None = None) -> FileReport:
    """Audit an opened checkpoint; `module` (when the model is known) makes BN001 exact and
    enables the module-only rules. Raises BnauditError for unreadable tensors."""
    discovery = discover_layers(ckpt, config.stated_settings())
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
    report.layers = [LayerSummary.of(layer, config.near_eps_factor) for layer in discovery.layers]
    report.findings = findings
    missing_from = "not shown by the program" if ckpt.format == "pt2" else "not in a state dict"
    report.settings = statement(not_from_file(discovery.layers), missing_from)
    return report


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
    model: Any = None,
    debug: bool = False,
    named: bool = True,
) -> FileReport:
    """Audit one checkpoint; a user-caused problem becomes `FileReport.error`, a file that
    is not model weights `FileReport.skipped`. `named`: the user named it (not a scan).

    `model` (an nn.Module built from --arch, possibly on the meta device) is compared
    with the checkpoint key by key; a file that holds its own modules (TorchScript, a
    pickled nn.Module) speaks for itself. An unexpected exception (a bug met on this
    file) is recorded the same way so the other files are still audited; `debug=True`
    lets it propagate instead.
    """
    try:
        ckpt = read_checkpoint(path, key=key, trust_pickle=trust_pickle)
        module = None
        # an exported graph (ONNX, .pt2) holds only its BN tensors (no conv weights to match
        # against --arch) and names its own nodes' settings: --arch would only add noise there
        arch_used = model is not None and ckpt.format not in ("onnx", "pt2")
        if arch_used:
            from bnaudit.runtime.models import match_checkpoint

            ckpt, module = match_checkpoint(ckpt, model)
        elif ckpt.holds_module and ckpt.modules:
            module = facts_from_module_infos(ckpt.modules)
        report = audit_checkpoint(ckpt, config, module)
        if model is not None and not arch_used:
            report.notes.append("--arch not used for an exported graph: its nodes carry their own settings")
    except NotModelWeights as exc:
        return FileReport(path, skipped=exc.what, named=named)
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


def inspect(
    paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
    config: Config | None = None,
    key: str | None = None,
    trust_pickle: bool = False,
    arch: str | None = None,
    arch_kwargs: str | dict[str, Any] | None = None,
    debug: bool = False,
) -> InspectReport:
    """Audit checkpoints (files or directories) and return the report.

    `arch` (MODULE:CALLABLE, with `arch_kwargs` JSON) names the model: BN001 becomes
    exact and BN006 / BN007 / BN011 apply; its real eps and momentum replace the defaults.

    >>> report = inspect("sample_models/")      # doctest: +SKIP
    >>> report.exit_code(), report.summary()    # doctest: +SKIP
    """
    config = config or Config()
    model = None
    if arch is not None:
        from bnaudit.runtime.models import build_arch

        model = build_arch(arch, arch_kwargs, meta=True)  # names, shapes, settings: no weights needed
    elif arch_kwargs is not None:
        raise BnauditError("--arch-kwargs needs --arch")
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    # (path, named by the user, error of an unusable directory)
    targets: list[tuple[str, bool, str | None]] = []
    for path in [os.fspath(p) for p in paths]:
        if not os.path.isdir(path):
            targets.append((path, True, None))
            continue
        try:
            targets += [(p, False, None) for p in _scan_directory(path)]
        except BnauditError as exc:
            targets.append((path, True, str(exc).removeprefix(f"{path}: ")))
    kept = set(_without_external_data(_without_indexed_shards([p for p, _, error in targets if error is None])))
    files: list[FileReport] = []
    for path, named, error in targets:
        if error is not None:
            files.append(FileReport(path, error=error))
        elif named and (pattern := config.exclusion(path)) is not None:
            # named explicitly: say so instead of auditing nothing in silence
            where = f" in {config.source}" if config.source else ""
            files.append(FileReport(path, excluded=f'excluded by the configuration (exclude "{pattern}"{where})'))
        elif path in kept and not config.excludes(path):
            report = audit_file(path, config, key=key, trust_pickle=trust_pickle, model=model, debug=debug, named=named)
            files.append(report)
    return InspectReport(files, config)

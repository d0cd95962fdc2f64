"""`diff`: two checkpoints -> BN layers of each -> per-layer changes -> verdicts -> DiffReport.

Both sides are read exactly as `inspect` reads them (every format and container, wrapper
prefixes stripped, only the BN tensors read), so the cost does not grow with the rest of
the checkpoint. Layers are matched by name. The numbers and verdicts are defined in
`bnaudit.audit.diff.layers`; the findings come from the diff rules (BN1xx) of the registry.

When exactly one side is an ONNX export, the other is its reference checkpoint:
BatchNormalization nodes are matched by name, exporter scope, then order and channel
count, and folded layers are verified (`bnaudit.audit.export.diff`, `bnaudit.audit.export.folded`;
rules BN108-BN114). BN101-BN104 and BN106, which read training between two checkpoints,
stay silent there.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from bnaudit.audit.diff.layers import (
    EXPORT_DIFFERS,
    FROZEN_BUT_UPDATING,
    RE_ESTIMATED,
    STALE,
    TRAINED,
    UNCHANGED,
    VERDICTS,
    DiffContext,
    LayerDiff,
    compare_layers,
    describe_group,
    unrelated,
)
from bnaudit.audit.export.diff import (
    ExportCheck,
    FoldedLayer,
    ParityResult,
    Unpaired,
    fold_checks,
    kept_node,
)
from bnaudit.audit.export.pairing import match_by_order, match_layers, program_conv_nodes
from bnaudit.audit.layers import BNLayer, discover_layers, not_from_file
from bnaudit.audit.provenance import believed_averaging, recalibration_provenance
from bnaudit.audit.resolve import read_model_checkpoint
from bnaudit.audit.rules import Finding, run_diff_rules
from bnaudit.audit.settings import OPTIONS, Setting, Source, settings_stated_by, statement
from bnaudit.config import SEVERITIES, Config, exit_code_for
from bnaudit.errors import BnauditError
from bnaudit.formats.containers import averaged_model_record
from bnaudit.formats.ema import copy_words
from bnaudit.formats.model import Averaging, Checkpoint
from bnaudit.severity import Severity
from bnaudit.text import plural


@dataclass(frozen=True)
class Side:
    """Where one side's layers came from."""

    path: str
    format: str
    key: str | None
    prefix: str
    is_ema: bool
    layers: int
    averaging: Averaging | None = None  # an averaged copy (SWA / EMA): how it was averaged


@dataclass
class DiffReport:
    kind: ClassVar[Literal["diff"]] = "diff"  # bnaudit.output.EMITTERS
    a: Side
    b: Side
    config: Config
    layers: list[LayerDiff] = field(default_factory=list)  # matched layers, in A's file order
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    reshaped: list[tuple[str, int, int]] = field(default_factory=list)  # name, C on A, C on B
    findings: list[Finding] = field(default_factory=list)
    settings: str = ""  # the eps / momentum not read from a file: given or assumed (audit.settings.statement)
    provenance: str = ""  # who re-estimated side B's verified layers (audit.provenance), in words
    # side B's record names layers whose statistics it does not match (audit.provenance)
    record_mismatch: str = ""
    # set when one side is an ONNX export of the other (bnaudit.audit.export.diff)
    export: ExportCheck | None = None

    def layers_by_verdict(self) -> dict[str, list[str]]:
        """Verdict -> layer names, for every verdict (empty lists included), in VERDICTS order."""
        out: dict[str, list[str]] = {v: [] for v in VERDICTS}
        for d in self.layers:
            out[d.verdict].append(d.name)
        return out

    def groups(self) -> dict[str, str]:
        """Verdict -> a short description of its layers (`backbone.*`), non-empty verdicts only."""
        every = [d.name for d in self.layers]
        return {v: describe_group(names, every) for v, names in self.layers_by_verdict().items() if names}

    def summary(self) -> dict[str, int]:
        counts = {s: sum(1 for f in self.findings if f.severity == s) for s in SEVERITIES}
        by_verdict = {v: len(names) for v, names in self.layers_by_verdict().items()}
        return {
            "matched": len(self.layers),
            **{v.replace(" ", "_").replace("-", "_"): n for v, n in by_verdict.items()},
            "only_a": len(self.only_a),
            "only_b": len(self.only_b),
            "reshaped": len(self.reshaped),
            **({"folded": len(self.export.folded), "unpaired": len(self.export.unpaired)} if self.export else {}),
            "errors": counts[Severity.ERROR],
            "warnings": counts[Severity.WARNING],
            "infos": counts[Severity.INFO],
        }

    def diagnosis(self) -> list[str]:
        """What happened, in plain words, one line per verdict that needs one."""
        by = self.layers_by_verdict()
        every = [d.name for d in self.layers]
        lines = []
        if by[FROZEN_BUT_UPDATING]:
            lines.append(
                f"{plural(len(by[FROZEN_BUT_UPDATING]), 'layer')} ({describe_group(by[FROZEN_BUT_UPDATING], every)}) "
                "kept their weights but updated their running statistics: they ran in training mode while "
                "frozen. Put frozen modules in eval() after every model.train(), or accept the new statistics."
            )
        if by[STALE]:
            lines.append(
                f"{plural(len(by[STALE]), 'layer')} ({describe_group(by[STALE], every)}) "
                f"{'has' if len(by[STALE]) == 1 else 'have'} new weights but the "
                "old statistics: averaged (EMA/SWA) or edited weights; run update_bn or bnaudit recalibrate."
            )
        if by[RE_ESTIMATED]:
            how = f" by {self.provenance}" if self.provenance else ""
            lines.append(
                f"{plural(len(by[RE_ESTIMATED]), 'layer')} ({describe_group(by[RE_ESTIMATED], every)}) had their "
                f"statistics re-estimated{how}."
            )
        why = None if self.export is not None else unrelated(len(self.layers), self.reshaped, self.only_a, self.only_b)
        if why:
            lines.append(
                f"The two files look like different models ({why}): layers that share a generic name "
                "are not the same layer, so their verdicts say nothing about training."
            )
        if self.record_mismatch:
            lines.append(f"Side B: {self.record_mismatch}.")
        if any(f.code == "BN104" for f in self.findings):
            lines.append(
                "Some layers counted more batches than others during the same run: see BN104 "
                "(a ratio of exactly 2 is activation checkpointing re-running BN forwards)."
            )
        if any(f.code == "BN106" and f.severity == "error" for f in self.findings):
            lines.append("eps changed: side B evaluates another function than side A was trained as.")
        if self.export is not None:
            lines.extend(_export_diagnosis(self.export, self.findings))
        for label, side in (("A", self.a), ("B", self.b)):
            if side.is_ema and side.averaging is not None and side.averaging.kind != "AveragedModel":
                lines.append(f"Side {label} is an {copy_words(side.averaging)}: {side.averaging.counter_meaning}.")
        averaged = next((s.averaging for s in (self.b, self.a) if s.averaging is not None), None)
        if by[TRAINED] and averaged is not None:
            lines.append(
                f"{plural(len(by[TRAINED]), 'layer')} ({describe_group(by[TRAINED], every)}) moved in weights and "
                f"statistics against an averaged copy ({averaged.describe()}): averaged statistics "
                "(use_buffers=True, EMA) only approximate those of the averaged weights; update_bn or "
                "bnaudit recalibrate measures them."
            )
        elif by[TRAINED] and not lines:
            lines.append(
                f"{plural(len(by[TRAINED]), 'layer')} trained normally (weights, statistics and counter moved)."
            )
        if self.reshaped and not self.layers:
            changes = ", ".join(f"{name}: {ca} -> {cb}" for name, ca, cb in self.reshaped[:5])
            more = f" and {len(self.reshaped) - 5} more" if len(self.reshaped) > 5 else ""
            lines.append(
                f"{plural(len(self.reshaped), 'layer')} {'has' if len(self.reshaped) == 1 else 'have'} the same "
                f"{'name' if len(self.reshaped) == 1 else 'names'} on both sides but other channel counts "
                f"({changes}{more}): replaced, not trained; nothing else is present on both sides."
            )
        elif not self.layers and (self.export is None or not self.export.folded):
            lines.append("No BN layer is present on both sides.")
        elif len(by[UNCHANGED]) == len(self.layers) and self.export is None:
            lines.append("Every matched layer is bit-identical on both sides.")
        return lines

    def exit_code(self, fail_on: str | None = None, exit_zero: bool = False) -> int:
        """1 if a finding is at or above fail_on (default: the configuration's), else 0;
        0 with `exit_zero` (`bnaudit.config.exit_code_for`).

        An unreadable side is a BnauditError (exit 2 at the CLI), never a report."""
        return exit_code_for((f.severity for f in self.findings), fail_on or self.config.fail_on, exit_zero=exit_zero)


# formats that are an exported graph (a checkpoint's export, compared in audit/export/diff.py)
EXPORT_FORMATS = ("onnx", "pt2")


def _side(ckpt: Checkpoint, layers: list[BNLayer]) -> Side:
    averaging = believed_averaging(ckpt, recalibration_provenance(ckpt))  # a recalibration record over the counters
    return Side(ckpt.path, ckpt.format, ckpt.key, ckpt.prefix, ckpt.is_ema, len(layers), averaging)


def _buffers_decided(report: DiffReport) -> DiffReport:
    """An AveragedModel side whose buffers the file leaves unknown, against a live model:
    statistics bit-identical to the live side's in every matched layer can only have been
    copied (use_buffers=False); an average of several models' statistics is not."""
    for name, this, other in (("a", report.a, report.b), ("b", report.b, report.a)):
        averaging = this.averaging
        if averaging is None or averaging.kind != "AveragedModel" or averaging.buffers != "unknown":
            continue
        if other.averaging is None and report.layers and all(d.stats_identical for d in report.layers):
            decided = averaged_model_record(averaging.n_averaged, "copied")
            setattr(report, name, dataclasses.replace(this, averaging=decided))
    return report


def diff_checkpoints(
    a: Checkpoint,
    b: Checkpoint,
    config: Config,
    producers: Mapping[str, str] | None = None,
    parity: ParityResult | None = None,
) -> DiffReport:
    """Compare two opened checkpoints layer by layer (see bnaudit.audit.diff.layers).

    When exactly one side is an export (ONNX model or .pt2 program), the other is its
    reference checkpoint and the comparison is `bnaudit.audit.export.diff`'s: `producers` (BN layer -> conv, from the
    model graph with --arch) pairs folded layers, `parity` is the outputs' comparison."""
    if (a.format in EXPORT_FORMATS) != (b.format in EXPORT_FORMATS):
        return _diff_export(a, b, config, producers, parity)
    layers_a = discover_layers(a, settings_stated_by(config)).layers
    layers_b = discover_layers(b, settings_stated_by(config)).layers
    by_name_b = {layer.name: layer for layer in layers_b}
    names_a = {layer.name for layer in layers_a}
    record = recalibration_provenance(b)  # verified against B's statistics, as inspect does
    recalibrated = record.layers
    report = DiffReport(_side(a, layers_a), _side(b, layers_b), config, provenance=record.source)
    report.record_mismatch = record.mismatch
    counters_meaningful = not (a.is_ema or b.is_ema)  # an EMA copy's counter counts nothing
    for la in layers_a:
        lb = by_name_b.get(la.name)
        if lb is None:
            report.only_a.append(la.name)
        elif la.num_features != lb.num_features:
            report.reshaped.append((la.name, la.num_features, lb.num_features))
        else:
            report.layers.append(
                compare_layers(la, lb, recalibrated=la.name in recalibrated, counter_meaningful=counters_meaningful)
            )
    report.only_b = [layer.name for layer in layers_b if layer.name not in names_a]
    copy_side, live_side = (a, layers_a, b), (b, layers_b, a)
    averaged_pairs: tuple[tuple[BNLayer, BNLayer], ...] = ()
    averaged_kind = ""
    if a.is_ema != b.is_ema:
        (copy, copy_layers, _), (_, live_layers, _) = (copy_side, live_side) if a.is_ema else (live_side, copy_side)
        live_by_name = {layer.name: layer for layer in live_layers}
        averaged_pairs = tuple(
            (layer, live_by_name[layer.name])
            for layer in copy_layers
            if layer.name in live_by_name and layer.num_features == live_by_name[layer.name].num_features
        )
        averaged_kind = f"side {'A' if a.is_ema else 'B'}, an {copy_words(copy.averaging)}"
    context = DiffContext(
        report.layers,
        config,
        report.only_a,
        report.only_b,
        report.reshaped,
        provenance=record.source,
        averaged_pairs=averaged_pairs,
        averaged_kind=averaged_kind,
    )
    report.findings = run_diff_rules(context)
    report.settings = statement(not_from_file(layers_a + layers_b), "a side holds no modules")
    return _buffers_decided(report)


def _diff_export(
    a: Checkpoint,
    b: Checkpoint,
    config: Config,
    producers: Mapping[str, str] | None,
    parity: ParityResult | None,
) -> DiffReport:
    """A checkpoint against its export (either side): kept BatchNorm nodes matched and
    compared, folded layers verified (ONNX), the rest listed as unpaired."""
    export_side = "a" if a.format in EXPORT_FORMATS else "b"
    ref, exp = (b, a) if export_side == "a" else (a, b)
    layers_ref = discover_layers(ref, settings_stated_by(config)).layers
    layers_exp = discover_layers(exp).layers  # every node carries its own attributes
    pairs, left_ref, left_exp = match_layers(layers_ref, layers_exp)
    if exp.format == "pt2":
        # a program keeps BN as a node or as arithmetic on the module's own buffers; one folded
        # before export holds convs with the folded weights under the modules' names
        folded: list[FoldedLayer] = []
        kept_elsewhere: list[BNLayer] = []
        how = ""
        unpaired = [
            Unpaired(layer.name, "no batch-norm node or buffers of that name in the program") for layer in left_ref
        ]
        if exp.folded is not None and left_ref:
            nodes = program_conv_nodes(exp.path)
            folded, unpaired, kept_elsewhere, how = fold_checks(ref, left_ref, None, producers, layers_ref, nodes)
        layers_ref = _with_program_eps(layers_ref, pairs)
        pairs = [(next(r for r in layers_ref if r.name == ref_layer.name), e, m) for ref_layer, e, m in pairs]
    else:
        from bnaudit.formats.onnx import load_onnx

        model = exp.graph if exp.graph is not None else load_onnx(exp.path)
        folded, unpaired, kept_elsewhere, how = fold_checks(ref, left_ref, model, producers, layers_ref)
    unpaired_names = {u.name for u in unpaired}
    candidates = [layer for layer in left_ref if layer in kept_elsewhere or layer.name in unpaired_names]
    by_order, _, left_exp = match_by_order(candidates, left_exp)
    ordered = {r.name for r, _, _ in by_order}
    unpaired = [u for u in unpaired if u.name not in ordered]
    unpaired += [
        Unpaired(layer.name, "its conv feeds a BatchNormalization node that could not be matched")
        for layer in kept_elsewhere
        if layer.name not in ordered
    ]
    pairs += by_order
    kinds = [m for _, _, m in pairs]
    check = ExportCheck(
        export_side=export_side,
        producer=exp.metadata.get("onnx.producer", "") or exp.metadata.get("pt2.producer", ""),
        opset=_int(exp.metadata.get("onnx.opset")),
        kind="a torch.export program" if exp.format == "pt2" else "an ONNX export",
        matching=", then ".join(dict.fromkeys(kinds)),
        pairing=how if folded or unpaired else "",
        folded=folded,
        unpaired=unpaired,
        unauditable=list(getattr(exp, "unauditable", [])),
        unauditable_layers=dict(exp.unauditable_layers),
        parity=parity,
    )
    diffs = []
    for r, e, matched_by in pairs:
        node = kept_node(r, e, exp.modules.get(e.name), matched_by)
        if exp.format == "pt2":
            # PyTorch's momentum, no convention to check; an eps the program does not show is not compared
            node = dataclasses.replace(node, momentum_onnx=None, eps_known=e.settings.eps.known)
        check.nodes.append(node)
        first, second = (e, r) if export_side == "a" else (r, e)
        d = compare_layers(first, second, counter_meaningful=False)
        diffs.append(dataclasses.replace(d, name=r.name, verdict=EXPORT_DIFFERS if node.mismatches else UNCHANGED))
    side_ref, side_exp = _side(ref, layers_ref), _side(exp, layers_exp)
    report = DiffReport(
        side_exp if export_side == "a" else side_ref, side_ref if export_side == "a" else side_exp, config
    )
    report.layers = diffs
    report.export = check
    only_exp = [layer.name for layer in left_exp]
    report.only_a, report.only_b = (only_exp, []) if export_side == "a" else ([], only_exp)
    context = DiffContext(report.layers, config, report.only_a, report.only_b, [], export=check)
    report.findings = run_diff_rules(context)
    unread = not_from_file(layers_ref)
    if exp.format == "pt2" or not check.nodes:
        # momentum is compared with ONNX nodes only (a program's is PyTorch's own; a fold holds none)
        unread = [(name, setting) for name, setting in unread if name == "eps"]
    report.settings = statement(unread, "the checkpoint holds no modules", also="--arch")
    return report


def _with_program_eps(layers: list[BNLayer], pairs: list[tuple[BNLayer, BNLayer, str]]) -> list[BNLayer]:
    """The checkpoint's layers, each whose eps is only assumed taking the eps its
    matched batch-norm node of a .pt2 program shows: torch.export traces the model's own
    modules, so the node's eps is the module's (a setting known from the program)."""
    shown = {r.name: e.settings.eps for r, e, _ in pairs if e.settings.eps.known}
    out = []
    for layer in layers:
        eps = shown.get(layer.name)
        if eps is None or not layer.settings.eps.assumed:
            out.append(layer)  # a given eps is the user's claim: the node's is compared with it
            continue
        where = f"the program's {eps.where or 'node'}"
        settings = dataclasses.replace(layer.settings, eps=Setting(eps.value, Source.NODE, where))
        out.append(dataclasses.replace(layer, settings=settings))
    return out


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _export_diagnosis(check: ExportCheck, findings: list[Finding]) -> list[str]:
    """The export's state in plain words."""
    lines = []
    bad = {f.code for f in findings if f.severity in ("error", "warning")}
    kept = len(check.nodes)
    good_folds = [f for f in check.folded if f.check.matches]
    matches = not bad & {"BN108", "BN109", "BN110", "BN111", "BN112", "BN113", "BN114"}
    if matches:
        parts = []
        if kept:
            parts.append(f"{plural(kept, check.node_word)} equal to the checkpoint's layers")
        if good_folds:
            eps = [f.check.implied_eps for f in good_folds if f.check.implied_eps is not None]
            low, high = f"{min(eps, default=0):.2g}", f"{max(eps, default=0):.2g}"
            implied = "" if not eps else f" (implied eps {low})" if low == high else f" (implied eps {low} to {high})"
            parts.append(f"{plural(len(good_folds), 'layer')} folded exactly as the checkpoint's BN{implied}")
            zero = [f for f in good_folds if f.check.zero_gamma]
            if zero:
                parts.append(
                    f"{plural(len(zero), 'of them', 'of them')} with gamma 0 in every channel (a zero-initialised "
                    "last BN of a residual block, timm's zero_init_last): folded to zero weights, carrying no "
                    "statistics"
                )
        at_own_eps = [f for f in check.folded if f.fits_eps is not None]
        if at_own_eps:
            parts.append(
                f"{plural(len(at_own_eps), 'layer')} folded exactly as the checkpoint's BN at the export's eps"
            )
        if parts:
            lines.append("The export matches the checkpoint: " + "; ".join(parts) + ".")
    # the notes of comparisons against an assumed value (bnaudit.audit.settings): say once what would decide them
    unsure = [
        name
        for name, codes in (("eps", ("BN109", "BN112")), ("momentum", ("BN110",)))
        if any(f.code in codes and f.severity == Severity.INFO for f in findings)
    ]
    if unsure:
        words = " and ".join(unsure)
        lines.append(
            f"The export's {words} could not be checked: the checkpoint holds no modules and no {words} was given "
            f"(pass {'/'.join(OPTIONS[n] for n in unsure)}, or --arch)."
        )
    if not matches and (check.parity is None or not check.parity.deviates):
        named = {"BN110": "the momentum convention", "BN113": "layers that could not be checked"}
        seen = [words for code, words in named.items() if code in bad]
        causes = check.causes() or [f"see the findings above ({', '.join(seen) or 'the export findings'})"]
        lines.append("The export differs from the checkpoint: " + "; ".join(causes) + ".")
    if check.parity is not None and check.parity.deviates:
        lines.append(f"The outputs deviate beyond float32 rounding; {check.explanation()}.")
    return lines


def diff(
    path_a: str | os.PathLike[str],
    path_b: str | os.PathLike[str],
    config: Config | None = None,
    key_a: str | None = None,
    key_b: str | None = None,
    trust_pickle: bool = False,
    producers: Mapping[str, str] | None = None,
    parity: ParityResult | None = None,
    checkpoint_a: Checkpoint | None = None,
) -> DiffReport:
    """What happened to the BatchNorm state between two checkpoints.

    A side given as a folder is the model checkpoint inspect audits in it
    (`bnaudit.audit.resolve`). Raises BnauditError when a side cannot be read or holds no
    BN layer.

    >>> report = diff("pretrained.pt", "finetuned.pt")   # doctest: +SKIP
    >>> report.groups()                                  # doctest: +SKIP
    {'frozen but updating': 'features.*', 'trained': 'head.*'}
    """
    config = config or Config()
    sides: list[Checkpoint] = []
    for path, key in ((os.fspath(path_a), key_a), (os.fspath(path_b), key_b)):
        if checkpoint_a is not None and not sides:
            sides.append(checkpoint_a)  # loaded with --arch: its modules carry the real eps and momentum
            continue
        sides.append(read_model_checkpoint(path, key=key, trust_pickle=trust_pickle, config=config))
    report = diff_checkpoints(sides[0], sides[1], config, producers, parity)
    for side in (report.a, report.b):
        if side.layers == 0 and not (report.export is not None and side.format in EXPORT_FORMATS):
            raise BnauditError(
                f"{side.path}: no BatchNorm layers found" + (f" under key '{side.key}'" if side.key else "")
            )
    return report

"""The rules of `bnaudit diff` between a checkpoint and its export, ONNX or .pt2 (BN108-BN114).

A training-mode node and statistics that are not constants are facts of the export
itself, reported under inspect's codes (BN012, BN013) by bnaudit.audit.rules.graph.

The side that is not the export is the reference; definitions of the numbers in
bnaudit.audit.export.diff and bnaudit.audit.export.folded.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from bnaudit.audit.formulas import pytorch_momentum, retained_fraction
from bnaudit.audit.rules.registry import RULES, Finding, rule, three_digits
from bnaudit.audit.settings import assumed_note, provenance_words
from bnaudit.severity import Severity
from bnaudit.text import plural

if TYPE_CHECKING:  # only the diff's checks take one: inspect never imports the diff
    from bnaudit.audit.diff.layers import DiffContext


@rule(
    "BN108",
    "export-tensors-differ",
    (Severity.ERROR, Severity.WARNING),
    "A BatchNormalization node's scale, B, mean or var differs from the checkpoint layer's beyond float32 rounding.",
    "An export is meant to compute what the checkpoint computes. A node whose tensors are not the checkpoint's "
    "(compared value by value after rounding both to float32, so a float64 checkpoint exported in float32 is "
    "equal) was exported from other weights: statistics reset or never loaded before export, an older or "
    "EMA copy, an edited graph. Error; warning when the only difference is that the export stores the values "
    "in a narrower type (float16, bfloat16: each value is the checkpoint's rounded), which costs precision "
    "(about 1e-3 relative for float16) but not correctness. The diff table shows these layers with the verdict "
    "'differs from checkpoint' and the usual max shift and max var log-ratio (bnaudit.audit.statistics); BN101-BN104, "
    "which read training between two checkpoints, stay silent for an export.",
    "Export again from the model with the checkpoint loaded (`model.load_state_dict(...)`, `model.eval()`), "
    "and keep the statistics in float32.",
    command="diff",
)
def _check_export_tensors(ctx: DiffContext) -> Iterator[Finding]:
    if ctx.export is None:
        return
    r = RULES["BN108"]
    for node in ctx.export.nodes:
        for m in node.mismatches:
            if m.rounding:
                yield r.finding(
                    Severity.WARNING,
                    node.name,
                    f"{m.tensor} stored as {m.export_dtype} in the export: the checkpoint's values rounded "
                    f"(max relative error {three_digits(m.max_rel)} in {plural(m.channels, 'channel')})",
                )
                continue
            what = f"{m.tensor} differs from the checkpoint's in {plural(m.channels, 'channel')} (max |difference| {three_digits(m.max_abs)})"
            if m.initial:
                initial = "1" if m.tensor in ("weight", "running_var") else "0"
                what += f": the export holds {initial} in every channel (reset or never loaded before export)"
            yield r.finding(Severity.ERROR, node.name, what)


@rule(
    "BN109",
    "export-eps-differs",
    (Severity.ERROR, Severity.INFO),
    "A BatchNormalization node's epsilon is not the checkpoint's eps (info when the checkpoint's eps is only assumed).",
    "eps is a constructor argument: no state dict stores it, and an exporter writes whatever the module "
    "object held at export time. A node with another epsilon normalises with sqrt(var + eps') instead of "
    "sqrt(var + eps): a model trained at 1e-5 and run at 1e-3 (a Keras convention) changes every channel "
    "whose variance is not far above 1e-3. The reference is the checkpoint module's eps when the file holds "
    "modules (TorchScript, a pickled model, --arch), else the eps given by --eps or the configuration: an "
    "error. A checkpoint without modules and without a given eps has no known eps (PyTorch's 1e-5 is only "
    "assumed): then the difference is an info that says what to pass, since a correct export of a model "
    "built with another eps looks exactly like this. Both are compared as float32, the type of the ONNX "
    "attribute.",
    "Build the model with the eps it was trained with before exporting, or pass --eps when the checkpoint "
    "was trained with another one.",
    settings=("eps",),
    command="diff",
)
def _check_export_eps(ctx: DiffContext) -> Iterator[Finding]:
    if ctx.export is None:
        return
    r = RULES["BN109"]
    from bnaudit.audit.export.folded import float32

    for node in ctx.export.nodes:
        if not node.eps_differs:
            continue
        seen, reference = f"{float32(node.eps_export):.3g}", node.checkpoint.eps
        if reference.assumed:
            note = assumed_note("eps", reference, seen, also="--arch")
            yield r.finding(Severity.INFO, node.name, f"epsilon {seen} in the export; {note}")
            continue
        yield r.finding(
            Severity.ERROR,
            node.name,
            f"epsilon {seen} in the export, eps {reference.text()}{provenance_words(reference)} in the checkpoint",
        )


@rule(
    "BN110",
    "export-momentum-unconverted",
    (Severity.WARNING, Severity.INFO),
    "A BatchNormalization node's momentum is not 1 - the checkpoint's PyTorch momentum (info when that is only assumed).",
    "ONNX (like Keras) stores the retained fraction: running = momentum * running + (1 - momentum) * batch, "
    "default 0.9. PyTorch stores the update fraction, default 0.1. An export that writes PyTorch's 0.1 "
    "unconverted tells every runtime that trains or fine-tunes the graph to keep only 10% of the running "
    "statistics per batch. Inference is unaffected, hence a warning. The reference is the checkpoint "
    "module's momentum, else the one given by --momentum or the configuration. A checkpoint without "
    "modules and without a given momentum has no known momentum (PyTorch's 0.1 is only assumed): then a "
    "difference is an info that says what to pass. Not BN007, which `inspect` reports from a node's value "
    "alone (PyTorch momentum above 0.5): BN110 is the comparison with the checkpoint, and each fires where "
    "the other cannot (ONNX 0.9 against a model built with 0.01; ONNX 0.1 from a model built with 0.9).",
    "Write momentum as 1 - PyTorch momentum (torch.onnx.export does this itself).",
    command="diff",
)
def _check_export_momentum(ctx: DiffContext) -> Iterator[Finding]:
    if ctx.export is None:
        return
    r = RULES["BN110"]
    for node in ctx.export.nodes:
        onnx_m, torch_m = node.momentum_onnx, node.momentum_checkpoint
        if onnx_m is None or torch_m is None:
            continue  # cumulative average (momentum=None) has no ONNX counterpart
        converted = retained_fraction(torch_m)
        if abs(onnx_m - converted) <= 1e-6:
            continue
        unconverted = abs(onnx_m - torch_m) <= 1e-6
        reference = node.checkpoint.momentum
        if reference.assumed:
            seen = f"{pytorch_momentum(onnx_m):.4g}"
            note = assumed_note("momentum", reference, seen, also="--arch")
            if unconverted:
                note += f" (if it was built with {torch_m:g}, the export wrote PyTorch's value without conversion)"
            yield r.finding(
                Severity.INFO,
                node.name,
                f"momentum {onnx_m:.3g} in the export (ONNX convention) = PyTorch {seen}; {note}",
            )
            continue
        words = (
            f"momentum {onnx_m:.3g} in the export (ONNX convention: the retained fraction), expected "
            f"{converted:.3g} = 1 - PyTorch momentum {torch_m:g}{provenance_words(reference)}"
        )
        if unconverted:
            words += ": PyTorch's value written without conversion"
        yield r.finding(Severity.WARNING, node.name, words)


@rule(
    "BN112",
    "folded-mismatch",
    (Severity.ERROR, Severity.INFO),
    "A Conv the exporter folded BN into does not carry gamma/sqrt(var+eps) and beta + (b - mean)*gamma/sqrt(var+eps) of the checkpoint.",
    "Both torch exporters fold eval-mode BN into the preceding Conv (or Linear) by default, so the export "
    "has no BatchNormalization node to read. The folding can still be checked: the exported weight must be "
    "the checkpoint conv's weight scaled per output channel by s = gamma/sqrt(var + eps), and its bias must "
    "be t = beta + (b - mean) * s (b the conv's own bias, 0 without one). bnaudit recovers s by least "
    "squares over each channel's weights and compares both with the checkpoint's BN (relative tolerance "
    "1e-5, float32 folding stays below 1e-6). It also solves for the eps the export implies, "
    "eps' = (gamma/s)^2 - var, on the channel that determines it best. A mismatch means the model was "
    "exported with other statistics (reset, stale, another checkpoint's) or another eps; the finding says "
    "which the numbers fit. Exported weights that are not a per-channel scaling of the conv's are reported too. "
    "When the checkpoint's eps is only assumed (no modules, no --eps) and folding at the implied eps matches "
    "exactly, the export is consistent with a model built with that eps: an info that says what to pass.",
    "Export again from the model with the checkpoint loaded, in eval mode, with the eps it was trained with.",
    settings=("eps",),
    command="diff",
)
def _check_folded(ctx: DiffContext) -> Iterator[Finding]:
    if ctx.export is None:
        return
    r = RULES["BN112"]
    for f in ctx.export.folded:
        c = f.check
        if c.matches:
            continue
        if f.fits_eps is not None:
            seen = f"{f.fits_eps:.3g}"
            note = assumed_note("eps", f.eps_setting, seen, also="--arch")
            yield r.finding(Severity.INFO, f.name, f"folded exactly at eps {seen}; {note}")
            continue
        numbers = []
        if c.scale_error is not None:
            numbers.append(f"scale error {three_digits(c.scale_error)}")
        if c.shift_error is not None:
            numbers.append(f"shift error {three_digits(c.shift_error)}")
        if c.implied_eps is not None:
            numbers.append(f"implied eps {c.implied_eps:.3g}")
        detail = f" ({', '.join(numbers)}; worst channel {c.worst_channel})" if numbers else ""
        yield r.finding(Severity.ERROR, f.name, f"folded into {f.node}: {c.cause}{detail}")


@rule(
    "BN113",
    "export-unpaired",
    Severity.WARNING,
    "A checkpoint BN layer has neither a BatchNormalization node nor a conv it was folded into.",
    "Every checkpoint BN layer should appear in the export either as a BatchNormalization node (matched by "
    "name, the exporter's scope in the node's name, then order and channel count) or folded into the conv "
    "that feeds it (found with --arch from the model graph, else from the checkpoint's key order and channel "
    "counts, then its export node by initializer name, exporter scope, or order among convs of that shape). "
    "A layer paired with neither could not be checked: a changed architecture, or an exporter that renamed "
    "everything and reordered the graph. Export convs whose weights equal no checkpoint weight and feed no "
    "BatchNormalization node are listed too: folded from a BN that could not be paired where a checkpoint "
    "weight of that shape feeds a BN, else (a classifier after the last BN) weights other than the "
    "checkpoint's, never a fold; and so are the "
    "export's BN layers that match no checkpoint layer (statistics the checkpoint does not hold). Nodes whose "
    "statistics are not constants (graph inputs, computed, pickled) cannot be compared either: BN013 says so. A torch.export program (.pt2) "
    "folds nothing into convs: a checkpoint layer with neither a batch-norm node nor buffers of its name in "
    "the program is unpaired.",
    "Pass --arch so pairing follows the model graph, or export with do_constant_folding=False / optimize=False "
    "to keep the BatchNormalization nodes.",
    command="diff",
)
def _check_export_unpaired(ctx: DiffContext) -> Iterator[Finding]:
    if ctx.export is None:
        return
    r = RULES["BN113"]
    for u in ctx.export.unpaired:
        layer = None if u.name.startswith("node ") else u.name
        text = u.reason if layer is not None else f"{u.name}: {u.reason}"
        yield r.finding(Severity.WARNING, layer, f"could not be checked: {text}" if layer else text)
    for name in ctx.only_a + ctx.only_b:  # one side is the export: its layers no checkpoint layer matched
        yield r.finding(Severity.WARNING, name, "only in the export: no checkpoint layer of that name or channel count")


@rule(
    "BN114",
    "export-output-deviates",
    Severity.ERROR,
    "With --arch and --data: the export's outputs (onnxruntime, CPU) deviate from the checkpoint's (torch, eval mode) beyond float32 rounding.",
    "Reading the tensors cannot see everything an export changes. With --arch and --data, diff runs the "
    "checkpoint in torch (eval mode) and the export in onnxruntime (CPU execution provider only, no custom "
    "operators) on the same batches, and compares the largest relative output deviation, "
    "max |y_onnx - y_torch| / max |y_torch| per sample, with a floor: 10x what float32 rounding alone gives "
    "(the float32 model against a float64 re-run of itself) rounded up to a power of ten, so that it is the "
    "same on every CPU, at least 1e-6. A correct export stays below the "
    "floor; argmax agreement alone can hide a training-mode export on easy data. The finding says whether "
    "the BatchNormalization nodes (training mode, eps, tensors) or the folding explain the deviation.",
    "Fix what the other export findings name; if none, compare the operators (torch.onnx.verification).",
    command="diff",
)
def _check_export_outputs(ctx: DiffContext) -> Iterator[Finding]:
    if ctx.export is None or ctx.export.parity is None:
        return
    p = ctx.export.parity
    if not p.deviates:
        return
    yield RULES["BN114"].finding(
        Severity.ERROR,
        None,
        f"largest relative output deviation {three_digits(p.max_deviation)} (floor {three_digits(p.floor)}), argmax agreement "
        f"{p.agreement * 100:.1f}% on {plural(p.samples, 'sample')}: {ctx.export.explanation()}",
    )

"""The rules of exported graphs and programs (ONNX models, torch.export archives, TorchScript): BN012-BN014.

A fact about an exported graph has one code whichever command sees it: `inspect` of the
export and `diff` of a checkpoint against it both report a training-mode node as BN012
and statistics that are not constants as BN013. A TorchScript archive is a program of
the same kind: a BatchNorm call whose training argument its code fixes to True is BN012.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from bnaudit.audit.rules.registry import RULES, Finding, RuleContext, also_in, rule
from bnaudit.severity import Severity

if TYPE_CHECKING:  # only the diff's checks take one: inspect never imports the diff
    from bnaudit.audit.diff.layers import DiffContext


@rule(
    "BN012",
    "training-mode-export",
    (Severity.ERROR, Severity.WARNING),
    "A BatchNorm node of an exported graph or program normalises with the batch's statistics (training mode).",
    "An inference graph should normalise with the stored running statistics. A BatchNorm node in "
    "training mode normalises every batch with its own mean and variance: a prediction depends on "
    "its batch companions, a batch of one normalises to beta, and some runtimes refuse the node "
    "outright. The mode is baked in when the model is exported. ONNX: BatchNormalization-14/15 "
    "`training_mode=1`; -7 and -9 with the training-mode outputs mean/var/saved_mean/saved_var; -6 "
    "and older with `is_test=0` or without `is_test`, whose default is training; exporters write it "
    "when the model was exported in training mode (`torch.onnx.export(..., "
    "training=TrainingMode.TRAINING)`, or `model.eval()` forgotten with TrainingMode.PRESERVE). "
    "torch.export (.pt2): `aten.batch_norm` or `_native_batch_norm_legit` with `training=True`, "
    "`_native_batch_norm_legit_functional` (ExecuTorch refuses it as not core ATen), "
    "`_batch_norm_with_update`, and, for a program decomposed into elementwise arithmetic, one that "
    "writes running_mean back (a buffer mutation in its signature); `torch.export.export` records "
    "the mode the module was in. TorchScript: a program traced in training mode calls "
    "`torch.batch_norm(..., True, ...)` with training=True as a constant (so does a scripted call of "
    "`F.batch_norm(..., training=True)`), which `.eval()` cannot switch: an error for each such "
    "layer; a module saved in training mode whose training argument is computed (`torch.jit.script` "
    "of a model without `.eval()`) is loaded in training mode by `torch.jit.load` and normalises with "
    "batch statistics, updating its running ones, until the caller calls `.eval()`: a warning. The "
    "finding names the node and what in it says training. Reported by `inspect` of the export and by "
    "`diff` of a checkpoint against it (BN111, diff's code for it before, is an alias).",
    "Call `model.eval()` before exporting: torch.export.export(model.eval(), ...) (export an eval "
    "program beside the training one if both are needed); torch.jit.trace(model.eval(), example) or "
    "torch.jit.script(model.eval()); for ONNX, export with torch.onnx.export's default "
    "TrainingMode.EVAL, or set `training_mode` to 0 and drop the extra outputs with the onnx package.",
    aliases=("BN111",),
)
def _check_training_mode_export(ctx: RuleContext) -> Iterator[Finding]:
    if ctx.module is None:
        return
    r = RULES["BN012"]
    for name, info in ctx.module.norms.items():
        if info.training_mode:
            words = _training_mode_words(info.training_reason)
            yield r.finding(Severity.ERROR, name, _with_source(words, info.source), group_as=words)
        elif info.saved_training and info.calls:  # a normalisation module, flag computed at run time
            yield r.finding(
                Severity.WARNING,
                name,
                "saved in training mode (its training flag is True): torch.jit.load returns it in training "
                "mode, where it normalises with each batch's statistics and overwrites its running ones "
                "until .eval() is called",
            )


@also_in("BN012", "diff")
def _check_training_mode_export_in_diff(ctx: DiffContext) -> Iterator[Finding]:
    if ctx.export is None:
        return
    r = RULES["BN012"]
    for node in ctx.export.nodes:
        if node.training_mode:
            words = _training_mode_words(node.training_reason)
            yield r.finding(Severity.ERROR, node.name, _with_source(words, node.source), group_as=words)


def _training_mode_words(reason: str | None) -> str:
    """What every node of an export in training mode shares: the table groups its layers into
    one row with these words (as TorchScript's), each finding adds its node (`_with_source`)."""
    return (
        f"{reason or 'training mode'}: normalises with each batch's statistics, so predictions depend on their "
        "batch companions"
    )


def _with_source(words: str, source: str | None) -> str:
    return f"{words} ({source})" if source else words


@rule(
    "BN013",
    "stats-not-constant",
    Severity.INFO,
    "An exported BatchNorm node's scale, B, mean or variance is not a constant (or not read): it cannot be audited.",
    "bnaudit reads the statistics a BatchNormalization node uses from initializers and Constant "
    "nodes (through Identity nodes), those of a torch.export node from the program's parameters "
    "and buffers (through its graph signature). A node whose inputs are graph inputs (statistics "
    "fed at run time) or computed by other nodes has no stored values to check, so none of the "
    "other rules can speak for it and `diff` cannot compare it with the checkpoint; nor has a .pt2 node whose tensor is stored as a pickle "
    "(`use_pickle`, legacy weights), which bnaudit never unpickles. The finding names the node "
    "and which input is not a constant.",
    "Audit the checkpoint the graph was exported from; or export with the statistics as "
    "initializers (`torch.onnx.export(..., export_params=True)`, the default).",
)
def _check_not_constant(ctx: RuleContext) -> Iterator[Finding]:
    r = RULES["BN013"]
    for note in ctx.unauditable:
        yield r.finding(Severity.INFO, ctx.unauditable_layers.get(note), note)


@also_in("BN013", "diff")
def _check_not_constant_in_diff(ctx: DiffContext) -> Iterator[Finding]:
    if ctx.export is None:
        return
    r = RULES["BN013"]
    for note in ctx.export.unauditable:
        yield r.finding(Severity.INFO, ctx.export.unauditable_layers.get(note), note)


@rule(
    "BN014",
    "folded-export",
    Severity.INFO,
    "No BatchNorm node left in an exported graph: BN folded into Conv weights (ONNX, .pt2), or decomposed into arithmetic (.pt2).",
    "Both torch exporters fold BatchNorm into the preceding convolution by default (the legacy "
    "exporter with constant folding, the dynamo exporter with its optimiser): the Conv's weights "
    "become W*gamma/sqrt(var+eps) per output channel and its bias beta + (b - mean)*gamma/sqrt(var+eps). "
    "The statistics then no longer exist as such and cannot be audited from the export. What the "
    "test sees: a graph without any BatchNormalization node that has at least one Conv node whose "
    "weight and bias are both constants; or, in any graph, Conv nodes whose weight torch's legacy "
    "exporter computed by constant folding (it names such tensors `onnx::Conv_N` instead of the "
    "module's parameter; BN after a Linear layer stays a node and is audited). A network that never "
    "had BatchNorm and convolutions with their own bias (facenet's PNet) matches the first test as "
    "well: without weights the exporter computed, the line says that folding and the absence of "
    "BN cannot be told apart from the export alone, and that `bnaudit diff` with the checkpoint "
    "tells them apart; a graph without BatchNormalization and without such a Conv gets no finding. A torch.export "
    "A quantized ONNX graph (ConvInteger or MatMulInteger after DynamicQuantizeLinear, QLinearConv) gets a "
    "line saying its integer convolutions were not examined. A torch.export "
    "program (.pt2) folded before export (`torch.fx.experimental.optimization.fuse`) is read alike: no batch-norm "
    "node and no BN buffers, convolutions with a stored weight and bias; `bnaudit diff model.pt model.pt2` "
    "verifies the fold and `bnaudit fold model.pt2` audits the folded weights. A torch.export program (.pt2) decomposed with a batch-norm table "
    "(`run_decompositions`) has no batch-norm node either: BN became sub/mul/rsqrt/add on the "
    "module's buffers. The statistics are still stored as those buffers, so they are audited "
    "under the module's names; eps is read from the arithmetic (`add(running_var, eps)` in eval "
    "mode, `add(var, eps)` on the batch variance in training mode), training mode from the "
    "buffer mutations the signature writes back. "
    "The finding says which layers were read this way.",
    "Audit the checkpoint instead (`bnaudit inspect model.pt`), and check the folding against it "
    "with `bnaudit diff model.pt model.onnx`; or export with BN nodes kept "
    "(`do_constant_folding=False`, or `optimize=False` with dynamo=True) to audit the export itself.",
)
def _check_folded_export(ctx: RuleContext) -> Iterator[Finding]:
    if ctx.quantized is not None:
        yield RULES["BN014"].finding(
            Severity.INFO,
            None,
            f"{ctx.quantized}: a quantized graph; its convolutions were not examined (a BatchNorm folded into "
            "them is in their integer weights and scales): audit the float checkpoint or its float export",
        )
    if ctx.decomposed is not None:
        yield RULES["BN014"].finding(
            Severity.INFO,
            None,
            f"{ctx.decomposed}: their statistics are read from the buffers, eps from the arithmetic where "
            "it shows it; check the program against its checkpoint with `bnaudit diff model.pt model.pt2`",
        )
    if ctx.folded is None:
        return
    if ctx.folded_ambiguous:
        export = "model.pt2" if ctx.folded.startswith("no batch-norm node") else "model.onnx"
        yield RULES["BN014"].finding(
            Severity.INFO,
            None,
            f"{ctx.folded}: BatchNorm folded into these convolutions and a network that never had BatchNorm "
            "cannot be told apart from the export alone; if it had BatchNorm, audit the checkpoint and check "
            f"the folding with `bnaudit diff model.pt {export}`",
        )
        return
    yield RULES["BN014"].finding(
        Severity.INFO,
        None,
        f"{ctx.folded}: the exporter folded BatchNorm statistics into these convolutions and they cannot be "
        "audited from the export: audit the checkpoint",
    )

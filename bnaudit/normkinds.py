"""Is this module, graph node or key group a BatchNorm, and which kind: the one table.

In the spirit of timm's `layers/create_norm.py`: one place names the normalisation
classes and operators bnaudit knows, and every reader and command asks it. Torch-free,
so the readers (TorchScript archives, ONNX graphs, pickled modules), the audit and the
runtime (`runtime/norms.py`, which adds torch's own base classes for eager modules) all
give the same answer.

Kinds (`NormKind`):

  batch norm      normalises channel c by the batch's mean mu_c and biased variance
                  var_c in training mode and by running_mean_c / running_var_c in eval
                  mode, y = (x - mu_c) / sqrt(var_c + eps) * weight_c + bias_c; without
                  running statistics (track_running_stats=False) by the batch's in eval
                  mode too. BatchNorm1d/2d/3d, Lazy*, SyncBatchNorm, timm's BatchNormAct2d,
                  quantized BatchNorm, and every subclass.
  frozen          applies statistics it holds as buffers and never updates, whatever the
                  mode (torchvision / detectron2 / timm FrozenBatchNorm2d).
  instance norm   normalises each sample by its own statistics over the spatial
                  dimensions; tracked or not, it never mixes samples (InstanceNorm*d).
  not a norm      anything else, including look-alikes: BatchRenorm (running_std), a
                  LayerNorm or GroupNorm however it is named.

A module is classified by the first name of `[class, *bases]` (nearest first: the most
specific known class wins, so a look-alike that subclasses BatchNorm2d stays a
look-alike) found in `CLASSES`; a module whose classes are all unknown, by the
normalisation operators its own code calls (`OPS`: a TorchScript class keeps only its
name, `class MyBN(nn.BatchNorm2d)` becomes `MyBN`, but its code still calls
`torch.nn.functional.batch_norm`).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol


class NormKind(enum.Enum):
    BATCH_NORM = "batch norm"
    FROZEN = "frozen"
    INSTANCE_NORM = "instance norm"
    NOT_NORM = "not a norm"

    @property
    def switches_with_mode(self) -> bool:
        """Its output depends on the module's training flag (BatchNorm, InstanceNorm)."""
        return self in (NormKind.BATCH_NORM, NormKind.INSTANCE_NORM)


BN, FROZEN, IN, NOT = NormKind.BATCH_NORM, NormKind.FROZEN, NormKind.INSTANCE_NORM, NormKind.NOT_NORM

# Class name -> kind. Names, not classes: TorchScript keeps only the name, and the same
# name means the same kind in every library that uses it (FrozenBatchNorm2d of
# torchvision, detectron2 and timm; BatchNorm2d of torch.nn and torch.ao.nn.quantized).
CLASSES: Mapping[str, NormKind] = {
    # torch.nn (and torch.ao.nn.quantized, whose BatchNorm2d/3d derive from torch.nn's)
    **{f"BatchNorm{d}d": BN for d in (1, 2, 3)},
    **{f"LazyBatchNorm{d}d": BN for d in (1, 2, 3)},
    "SyncBatchNorm": BN,
    "_BatchNorm": BN,
    **{f"InstanceNorm{d}d": IN for d in (1, 2, 3)},
    **{f"LazyInstanceNorm{d}d": IN for d in (1, 2, 3)},
    "_InstanceNorm": IN,
    # Not listed: BNReLU2d/3d, a quantized BatchNorm2d subclass in
    # torch.ao.nn.intrinsic.quantized (known by its bases, or by the quantized::batch_norm
    # it calls) but a Sequential of BatchNorm2d and ReLU in torch.ao.nn.intrinsic (its
    # child "0" is the BatchNorm).
    # timm layers/norm_act.py
    "BatchNormAct2d": BN,
    "SyncBatchNormAct": BN,
    "FrozenBatchNormAct2d": FROZEN,
    # torchvision.ops.misc, detectron2.layers, timm.layers: statistics as buffers only
    "FrozenBatchNorm2d": FROZEN,
    "FrozenBatchNorm": FROZEN,
    # look-alikes: named like BN, or holding BN-like buffers, but not BatchNorm
    **{f"BatchRenorm{d}": NOT for d in ("", "1d", "2d", "3d")},
    "LayerNorm": NOT,
    "LayerNorm2d": NOT,
    "GroupNorm": NOT,
    "GroupNorm1": NOT,
    "RMSNorm": NOT,
    "RmsNorm": NOT,
    "RmsNorm2d": NOT,
    "LocalResponseNorm": NOT,
    "CrossMapLRN2d": NOT,
    "LayerNormAct": NOT,
    "LayerNormAct2d": NOT,
    "GroupNormAct": NOT,
    "GroupNorm1Act": NOT,
    # torch.ao.nn.intrinsic(.qat): Conv (+ReLU) fused with a BatchNorm held at `.bn`
    # (QAT) or as child "1": the fused module is a convolution; its child is the BN
    **{f"ConvBn{d}d": NOT for d in (1, 2, 3)},
    **{f"ConvBnReLU{d}d": NOT for d in (1, 2, 3)},
}


class Statistics(enum.Enum):
    """Which statistics an operator normalises by."""

    BATCH = "its input's own statistics"
    RUNNING = "the running statistics"
    ARGUMENT = "its input's own statistics when its training argument (or attribute) is true, else the running ones"


@dataclass(frozen=True)
class NormOp:
    """A normalisation operator or function: `name` as `namespace::op[.overload]`
    (`torch.nn.functional` for the Python functions), `training_arg` the index of its
    bool training / use_input_stats argument when `statistics` is ARGUMENT."""

    name: str
    kind: NormKind
    statistics: Statistics
    training_arg: int | None = None
    note: str = ""


_ARG = Statistics.ARGUMENT
OPS: tuple[NormOp, ...] = (
    # aten (TorchScript graphs, torch.export graphs, the dispatcher): schemas of torch 2.x
    NormOp("aten::batch_norm", BN, _ARG, 5),
    NormOp("aten::native_batch_norm", BN, _ARG, 5),
    NormOp("aten::_batch_norm_impl_index", BN, _ARG, 5),
    NormOp("aten::_native_batch_norm_legit", BN, _ARG, 5, "torch.export, training"),
    NormOp("aten::_native_batch_norm_legit.no_stats", BN, Statistics.BATCH, None, "torch.export, no running stats"),
    NormOp("aten::_native_batch_norm_legit_functional", BN, _ARG, 5, "torch.export, training (functional)"),
    NormOp("aten::_native_batch_norm_legit_no_training", BN, Statistics.RUNNING, None, "torch.export, eval"),
    NormOp("aten::_batch_norm_with_update", BN, Statistics.BATCH, None, "torch.export, training"),
    NormOp("aten::_batch_norm_with_update_functional", BN, Statistics.BATCH, None, "torch.export, training"),
    NormOp("aten::_batch_norm_no_update", BN, Statistics.RUNNING, None, "torch.export, eval"),
    NormOp("aten::cudnn_batch_norm", BN, _ARG, 5, "GPU (cuDNN)"),
    NormOp("aten::miopen_batch_norm", BN, _ARG, 5, "GPU (MIOpen)"),
    NormOp("aten::instance_norm", IN, _ARG, 5, "use_input_stats"),
    # quantized BatchNorm (eval only)
    *(
        NormOp(f"quantized::batch_norm{d}{relu}", BN, Statistics.RUNNING)
        for d in ("", "1d", "2d", "3d")
        for relu in ("", "_relu")
    ),
    # the Python functions, which a scripted module's code calls by name
    NormOp("torch.nn.functional.batch_norm", BN, _ARG, 5),
    NormOp("torch.nn.functional.instance_norm", IN, _ARG, 5, "use_input_stats"),
    # ONNX (domain "" / ai.onnx): training_mode (-14, -15) or is_test (-6) decide
    NormOp("onnx::BatchNormalization", BN, _ARG, None, "attribute training_mode (-14, -15), is_test (-6)"),
    NormOp("onnx::InstanceNormalization", IN, Statistics.BATCH),
)

_OPS_BY_NAME = {op.name: op for op in OPS}

# How the same operator is spelled where it is met, to its `namespace::` form
_SPELLINGS = (
    ("torch.ops.aten.", "aten::"),
    ("ops.aten.", "aten::"),
    ("aten.", "aten::"),
    ("torch.ops.quantized.", "quantized::"),
    ("ops.quantized.", "quantized::"),
    ("__torch__.torch.nn.functional.", "torch.nn.functional."),
)


@lru_cache(maxsize=1024)
def norm_op(name: str) -> NormOp | None:
    """The normalisation operator `name` names, None if it is none.

    Accepts the spellings it is met in: `aten::batch_norm` (TorchScript graph node),
    `aten._native_batch_norm_legit_no_training.default` (torch.export node target),
    `torch.ops.aten.batch_norm`, `torch.batch_norm` and `ops.quantized.batch_norm2d`
    (TorchScript code), `torch.nn.functional.batch_norm`, `onnx::BatchNormalization` or
    a bare ONNX op type `BatchNormalization`. An overload (`.no_stats`) is looked up
    before its packet; `.default` and `.out` are the packet.
    """
    canonical = name
    for spelling, namespace in _SPELLINGS:
        if name.startswith(spelling):
            canonical = namespace + name[len(spelling) :]
            break
    else:
        if name.startswith("torch.") and not name.startswith("torch.nn."):
            canonical = "aten::" + name[len("torch.") :]  # torch.batch_norm in TorchScript code is the aten op
        elif "::" not in name and "." not in name:
            canonical = "onnx::" + name
    op = _OPS_BY_NAME.get(canonical)
    if op is None and "::" in canonical and "." in canonical.partition("::")[2]:
        op = _OPS_BY_NAME.get(canonical.rsplit(".", 1)[0])
    return op


def op_kind(name: str) -> NormKind:
    """The kind of a graph node or call by its operator name (see `norm_op`)."""
    op = norm_op(name)
    return NOT if op is None else op.kind


def onnx_op(op_type: str) -> NormOp | None:
    """The normalisation operator an ONNX node of the default domain is, by its op type
    (`BatchNormalization`); None if it is none. The op type comes from the file: it is
    looked up in the ONNX namespace only, so an op type spelled `aten::batch_norm` is none."""
    return norm_op(f"onnx::{op_type}")


def onnx_op_kind(op_type: str) -> NormKind:
    """The kind of an ONNX node of the default domain (see `onnx_op`)."""
    op = onnx_op(op_type)
    return NOT if op is None else op.kind


def batch_norm_ops_with_training_argument() -> tuple[NormOp, ...]:
    """The `aten::` BatchNorm operators whose training argument decides the statistics."""
    return tuple(op for op in OPS if op.kind is BN and op.training_arg is not None and op.name.startswith("aten::"))


# Names in TorchScript code that can name an operator: torch.x, ops.ns.x, and the
# functional module's functions. [\w.]+ is linear: no nested quantifier to backtrack.
# The patterns of TorchScript code are strings, compiled (and cached) by `re` on first
# use: most runs read no TorchScript, and compiling them costs every start-up.
_CODE_NAME = r"(?<![\w.])(?:__torch__\.)?(?:torch|ops)\.[\w.]+"


def norm_calls(code: str) -> tuple[str, ...]:
    """The normalisation operators a piece of TorchScript code names, canonical names in
    order of first appearance (`torch.batch_norm(...)` -> `aten::batch_norm`)."""
    found: dict[str, None] = {}
    for match in re.finditer(_CODE_NAME, code):
        op = norm_op(match.group(0))
        if op is not None:
            found[op.name] = None
    return tuple(found)


# `_0 = __torch__.torch.nn.functional.batch_norm`: scripted code calls functions through a local name
_ALIAS = r"(?m)^[ \t]*(\w+) = ((?:__torch__\.)?(?:torch|ops)\.[\w.]+)[ \t]*$"
_CALLEE = r"(?<![\w.])((?:__torch__\.)?(?:torch|ops)\.[\w.]+|\w+)\("


def constant_training_calls(code: str) -> tuple[str, ...]:
    """The BatchNorm operators a piece of TorchScript code calls with the literal `True` as
    its training argument (`NormOp.training_arg`), canonical names in order of first
    appearance: `torch.batch_norm(x, w, b, mean, var, True, 0.1, 1e-05, True)`, which
    tracing in training mode writes, or a scripted `F.batch_norm(..., True, ...)` called
    through a local alias (`_0 = __torch__.torch.nn.functional.batch_norm`). Such a call
    normalises with the batch's statistics whatever the module's training flag: `.eval()`
    cannot switch it. A training argument computed at run time (`bn_training`) is not one."""
    aliases: dict[str, str] = dict(re.findall(_ALIAS, code))
    found: dict[str, None] = {}
    for match in re.finditer(_CALLEE, code):
        op = norm_op(aliases.get(match.group(1), match.group(1)))
        if op is None or op.kind is not BN or op.training_arg is None:
            continue
        arguments = _call_arguments(code, match.end())
        if len(arguments) > op.training_arg and arguments[op.training_arg] == "True":
            found[op.name] = None
    return tuple(found)


_MAX_CALL_CHARS = 10_000


def _call_arguments(code: str, start: int) -> list[str]:
    """The top-level, comma-separated arguments of the call whose "(" ends just before
    `start`, stripped (a trailing comma leaves no empty argument)."""
    arguments: list[str] = []
    depth, begin = 0, start
    # bounded: the code comes from the archive, and an unclosed call must not make every
    # call site rescan the rest of the file
    for i in range(start, min(len(code), start + _MAX_CALL_CHARS)):
        ch = code[i]
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                arguments.append(code[begin:i].strip())
                break
            depth -= 1
        elif ch == "," and depth == 0:
            arguments.append(code[begin:i].strip())
            begin = i + 1
    return [a for a in arguments if a]


# `(self).name(` in TorchScript code: a call of one of the module's own methods
_SELF_METHOD = r"\(self\)\.(\w+)\("


def own_method_calls(code: str) -> tuple[str, ...]:
    """The module's own methods a piece of TorchScript code calls (`(self)._apply_instance_norm(x)`),
    in order of first appearance; its submodules' forwards are `(self.child).forward` and
    not among them."""
    return tuple(dict.fromkeys(re.findall(_SELF_METHOD, code)))


def _bare(name: str) -> str:
    # a qualified name (torch.nn.modules.batchnorm._BatchNorm) or a TorchScript one
    # (__torch__.torch.nn.modules.batchnorm.___torch_mangle_3.BatchNorm2d): the class itself
    return name.rsplit(".", 1)[-1]


def class_kind(names: Iterable[str]) -> NormKind | None:
    """The kind of the first of `names` (a class, then its bases) in `CLASSES`; None
    when none is known."""
    for name in names:
        kind = CLASSES.get(_bare(name))
        if kind is not None:
            return kind
    return None


def classify(class_name: str, bases: Sequence[str] = (), calls: Iterable[str] = ()) -> NormKind:
    """The kind of a module from what is known of it: its class name, its base classes
    nearest first (eager modules), and the operators its own code calls (TorchScript).

    The first known class decides; a module of unknown classes is of the kind of the
    normalisation it calls (BatchNorm before InstanceNorm), else not a norm. Callers
    pass `calls` only for a module that holds (or could hold) running statistics, so a
    container calling `F.batch_norm` on another module's buffers is not taken for one.
    """
    known = class_kind([class_name, *bases])
    if known is not None:
        return known
    kinds = {op_kind(c) for c in calls}
    for kind in (BN, IN):
        if kind in kinds:
            return kind
    return NOT


class _ModuleFacts(Protocol):
    @property
    def class_name(self) -> str: ...
    @property
    def bases(self) -> tuple[str, ...]: ...
    @property
    def calls(self) -> tuple[str, ...]: ...


def module_kind(info: _ModuleFacts) -> NormKind:
    """`classify` of a `formats.model.ModuleInfo`."""
    return classify(info.class_name, info.bases, info.calls)


# --------------------------------------------------------------------------- key groups


class _TensorFacts(Protocol):
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def dtype(self) -> str: ...


@dataclass(frozen=True)
class GroupKind:
    """What a state dict's key group (the leaves under one prefix) is: `kind`, and
    `label`, the kind in words (`BatchNorm`, `QuantizedBatchNorm`, `BatchRenorm`, ...)."""

    kind: NormKind
    label: str


def _is_stat_vector(ref: _TensorFacts | None) -> bool:
    return ref is not None and ref.dtype.startswith(("float", "bfloat")) and len(ref.shape) == 1


def group_kind(group: Mapping[str, _TensorFacts]) -> GroupKind | None:
    """The kind of the key group `P.*` from its leaves; None: it holds no running_mean
    and no running_var.

    A BatchNorm group holds running_mean and running_var, 1-D floating tensors of one
    length C, with optional weight / bias and an integer num_batches_tracked (absent:
    a FrozenBatchNorm or a pre-0.4.1 BatchNorm, `BatchNorm (no counter)`); quantized BN
    adds `scale` and `zero_point`. A tracked InstanceNorm holds the same leaves: only
    the module tells them apart. Not BatchNorm: BatchRenorm (`running_std`), RL
    observation normalisers (a `count` sibling; float64 statistics when both are
    present), statistics that are not 1-D floats or differ in length (e3nn). A group
    with only one of the two statistics is a BatchNorm that lost the other (the
    look-alikes' `running_std` and `count` excepted).
    """
    mean, var = group.get("running_mean"), group.get("running_var")
    if mean is None and var is None:
        return None
    if "running_std" in group:
        return GroupKind(NOT, "BatchRenorm")
    if mean is None or var is None:
        if "count" in group:
            return GroupKind(NOT, "observation normaliser")
        return GroupKind(BN, "BatchNorm (incomplete)")
    if not (_is_stat_vector(mean) and _is_stat_vector(var)):
        return GroupKind(NOT, "statistics that are not 1-D floats")
    if mean.shape != var.shape:
        return GroupKind(NOT, "statistics of different lengths")
    if "count" in group and mean.dtype == "float64":
        return GroupKind(NOT, "observation normaliser")
    if "scale" in group and "zero_point" in group:
        return GroupKind(BN, "QuantizedBatchNorm")
    if "num_batches_tracked" not in group:
        return GroupKind(BN, "BatchNorm (no counter)")
    return GroupKind(BN, "BatchNorm")


# Parameters saved without their buffers: the weight/bias pair's prefix is all that is
# left. FrozenBatchNorm-style `downsample.1` of torchvision's ResNets included.
_BN_LIKE_NAMES = (
    r"(^|[._])(bn|bn\d+|bn_\d+|batchnorm\w*|batch_norm\w*|norm_bn\w*)$",
    r"(^|\.)downsample\.1$",
    r"_bn\d*$",
)


def looks_like_batchnorm_name(prefix: str) -> bool:
    """A key prefix named like a BatchNorm layer (bn, bn1, batch_norm, downsample.1, ...).

    Only a suspicion: a LayerNorm called `bn` matches too, so this is used only where a
    file holds no running statistics at all."""
    low = prefix.lower()
    return any(re.search(p, low) for p in _BN_LIKE_NAMES)


# PyTorch's BatchNorm constructor defaults (torch.nn.BatchNorm2d(eps=1e-5, momentum=0.1)):
# what a layer uses when nobody says otherwise (bnaudit.audit.settings: "assumed").
DEFAULT_EPS = 1e-5
DEFAULT_MOMENTUM = 0.1


# The momentum conventions live here rather than in bnaudit.audit.formulas (which re-exports
# them) because the readers in formats/ translate an exported node's momentum and formats/
# must not import audit/; this module is the torch-free table both already import.


def pytorch_momentum(retained: float) -> float:
    """PyTorch's momentum m from the retained fraction r that ONNX BatchNormalization and
    Keras BatchNormalization call momentum: m = 1 - r (dimensionless).

    PyTorch: running = (1 - m) * running + m * batch (m = weight of the new batch, default 0.1).
    ONNX / Keras: running = r * running + (1 - r) * batch (r = weight kept, default 0.9 / 0.99).
    So ONNX 0.9 = PyTorch 0.1. No rounding: a reader that stores float32 attributes rounds
    the result itself. Inverse of `retained_fraction`."""
    return 1.0 - retained


def retained_fraction(momentum: float) -> float:
    """The retained fraction r = 1 - m that ONNX/Keras store as momentum, from PyTorch's
    momentum m (conventions in `pytorch_momentum`, its inverse): PyTorch 0.1 = ONNX 0.9.
    PyTorch's momentum None (cumulative average) has no ONNX counterpart; callers keep None."""
    return 1.0 - momentum

"""Find BatchNorm layers in a state dict by what they hold, not by what they are called.

A BN layer is a key prefix P whose `P.running_mean` and `P.running_var` are 1-D
floating tensors of the same length C, with optional `P.weight` / `P.bias` (the
affine gamma and beta, normally length C) and an optional integer
`P.num_batches_tracked`. This finds nn.BatchNorm*d, SyncBatchNorm, FrozenBatchNorm
(no counter), fused QAT `*.bn.*` sub-modules, quantized BN (`scale`, `zero_point`)
and tracked InstanceNorm alike. Groups that only look similar are skipped:
statistics of different lengths (e3nn), float64 normalisers with a `count`
sibling (RL observation normalisers), and BatchRenorm's `running_std`. Which key
group is which, and which module is a BatchNorm, is `bnaudit.normkinds`'s answer.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

from bnaudit.audit.formulas import all_finite, eval_gains, near_eps_channels, valid_eval_gains
from bnaudit.audit.settings import Setting, Settings, resolve, stated_settings
from bnaudit.formats.model import Checkpoint, ModuleInfo, TensorRef
from bnaudit.normkinds import GroupKind, NormKind, group_kind, looks_like_batchnorm_name, module_kind

_STAT_NAMES = ("running_mean", "running_var", "num_batches_tracked")


@dataclass(frozen=True)
class BNLayer:
    """One BN layer's buffers and parameters as lists of Python floats (float64), one per channel.

    `settings`: its eps and momentum with their provenance (bnaudit.audit.settings: the
    module's or graph node's own, given by --eps/--momentum or the configuration, or
    PyTorch's defaults assumed). `momentum` None means a cumulative average (PyTorch
    `momentum=None`).
    """

    name: str
    kind: str
    running_mean: list[float]
    running_var: list[float]
    weight: list[float] | None
    bias: list[float] | None
    num_batches_tracked: int | None
    stats_dtype: str
    settings: Settings

    @property
    def num_features(self) -> int:
        return len(self.running_mean)

    @property
    def eps(self) -> float:
        return self.settings.eps_value

    @property
    def momentum(self) -> float | None:
        return self.settings.momentum.value

    @property
    def settings_assumed(self) -> bool:
        """Not both read from the file: given or assumed (see `settings` for which)."""
        return not self.settings.from_file

    # Figures of the statistics that the layer summary and several rules need, computed once
    # per layer (the statistics never change after reading; the lists are not to be modified).

    @cached_property
    def var_finite(self) -> bool:
        """No NaN or Inf in running_var (bnaudit.audit.formulas.all_finite)."""
        return all_finite(self.running_var)

    @cached_property
    def var_floor(self) -> float | None:
        """The smallest running_var when none is NaN or Inf (+inf for no channel), else None."""
        return min(self.running_var, default=math.inf) if self.var_finite else None

    @cached_property
    def gains(self) -> list[float]:
        """Each channel's eval gain, bnaudit.audit.formulas.eval_gains."""
        floor = self.var_floor
        if self.eps > 0 and floor is not None and floor >= 0:  # eval_gains's own test, on a figure at hand
            return valid_eval_gains(self.weight, self.running_var, self.eps)
        return eval_gains(self.weight, self.running_var, self.eps)

    def near_eps(self, factor: float) -> list[int]:
        """The near-eps channels at this threshold factor, bnaudit.audit.formulas.near_eps_channels
        (once per factor: a layer may be audited under several configurations)."""
        found: dict[float, list[int]] = self.__dict__.setdefault("_near_eps", {})
        if factor not in found:
            floor = self.var_floor  # the formula's own shortcut (none near eps), on a figure at hand
            none = floor is not None and floor >= factor * self.eps
            found[factor] = [] if none else near_eps_channels(self.running_var, self.eps, factor)
        return found[factor]


def not_from_file(layers: Iterable[BNLayer]) -> list[tuple[str, Setting]]:
    """("eps" / "momentum", Setting) for each setting some of `layers` did not read from
    their file (given or assumed), first occurrence of each name: what a report says it used."""
    found: dict[str, Setting] = {}
    for layer in layers:
        for name, setting in (("eps", layer.settings.eps), ("momentum", layer.settings.momentum)):
            if not setting.known:
                found.setdefault(name, setting)
    return list(found.items())


@dataclass(frozen=True)
class IncompleteGroup:
    """A prefix with some BN buffers but without running_mean or running_var."""

    name: str
    present: tuple[str, ...]
    missing: tuple[str, ...]


@dataclass(frozen=True)
class ModuleFacts:
    """What the model's modules say that a state dict cannot.

    Available when a module is: `--arch`, a TorchScript archive, a pickled nn.Module.

    norms        every normalisation module that holds or could hold running statistics
                 (its class, eps, momentum, track_running_stats), by state-dict prefix
    batch_norms  the names among `norms` that normalise over the batch (BatchNorm*d,
                 SyncBatchNorm, ...: `bnaudit.normkinds`), as opposed to InstanceNorm and
                 frozen BatchNorm
    missing      state keys of the model absent from the checkpoint
    unexpected   checkpoint keys the model does not have
    mismatched   (key, checkpoint shape, model shape) where both hold a key with different shapes
    """

    norms: dict[str, ModuleInfo]
    batch_norms: frozenset[str] = frozenset()
    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    mismatched: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...] = ()


class ModelReference(Protocol):
    """The model `--arch` names, as `inspect` compares each file with it (built on the torch
    side: `bnaudit.runtime.models.arch_reference`).

    producers   BN module name -> the module whose output it normalises, from the model's graph
    transposed  the producers that are ConvTranspose (output channels on the weight's axis 1)
    match       the checkpoint renamed to the model's names, with the model's real module
                settings, and the ModuleFacts of the comparison
    """

    @property
    def producers(self) -> Mapping[str, str]: ...

    @property
    def transposed(self) -> frozenset[str]: ...

    def match(self, ckpt: Checkpoint) -> tuple[Checkpoint, ModuleFacts]: ...


def facts_from_module_infos(modules: dict[str, ModuleInfo]) -> ModuleFacts:
    """ModuleFacts of a file that holds its own modules (nothing can be missing)."""
    return ModuleFacts(
        norms=dict(modules),
        batch_norms=frozenset(n for n, info in modules.items() if module_kind(info) is NormKind.BATCH_NORM),
    )


def _kind(found: GroupKind | None, module: ModuleInfo | None) -> str:
    """The layer's kind in words: its module's class when known, else its key group's (`found`)."""
    if module is not None:
        return module.class_name
    return found.label if found is not None else "BatchNorm"


@dataclass(frozen=True)
class Discovery:
    """The BN layers found in a checkpoint, and the key groups that look like BN but are not whole."""

    layers: list[BNLayer]
    incomplete: list[IncompleteGroup]
    # 1-D weight/bias pairs under BN-like names, listed only when the file holds
    # no running statistics at all (parameters saved without buffers).
    suspected_without_buffers: list[str]


def _group(tensors: dict[str, TensorRef]) -> dict[str, dict[str, TensorRef]]:
    groups: dict[str, dict[str, TensorRef]] = {}
    for name, ref in tensors.items():
        prefix, _, leaf = name.rpartition(".")
        groups.setdefault(prefix, {})[leaf] = ref
    return groups


def _counter(ref: TensorRef | None) -> int | None:
    if ref is None or not ref.is_integer or math.prod(ref.shape) != 1:  # math.prod: no int64 wrap-around
        return None
    return int(ref.read()[0])


def _floats(ref: TensorRef) -> list[float]:
    values = ref.read()
    return values if ref.is_floating else [float(v) for v in values]


def _vector(ref: TensorRef | None) -> list[float] | None:
    if ref is None or len(ref.shape) != 1 or not (ref.is_floating or ref.is_integer):
        return None
    return _floats(ref)


def discover_layers(ckpt: Checkpoint, stated: Settings | None = None) -> Discovery:
    """BN layers of a checkpoint in file order, reading only their tensors.

    `stated`: eps and momentum for layers whose file does not hold them (`Config.stated_settings()`;
    None: PyTorch's defaults, assumed). A file's own modules or nodes win, setting by
    setting (bnaudit.audit.settings.resolve).
    """
    stated = stated or stated_settings(None, None)
    layers: list[BNLayer] = []
    incomplete: list[IncompleteGroup] = []
    groups = _group(ckpt.tensors)
    any_stats = False
    for prefix, group in groups.items():
        found = group_kind(group)
        if found is not None:
            any_stats = True
            if found.kind is NormKind.NOT_NORM:
                continue  # a look-alike (BatchRenorm, e3nn, RL observation normaliser)
            if "running_mean" in group and "running_var" in group:
                module = ckpt.modules.get(prefix)
                layers.append(_make_layer(prefix, group, resolve(module, stated), _kind(found, module)))
            else:
                present = tuple(k for k in _STAT_NAMES if k in group)
                missing = tuple(k for k in ("running_mean", "running_var") if k not in group)
                incomplete.append(IncompleteGroup(prefix, present, missing))
        elif "num_batches_tracked" in group and _counter(group["num_batches_tracked"]) is not None:
            incomplete.append(IncompleteGroup(prefix, ("num_batches_tracked",), ("running_mean", "running_var")))
    suspected: list[str] = []
    if not any_stats:
        for prefix, group in groups.items():
            w, b = group.get("weight"), group.get("bias")
            if (
                w is not None
                and b is not None
                and len(w.shape) == 1
                and w.shape == b.shape
                and looks_like_batchnorm_name(prefix)
            ):
                suspected.append(prefix)
    return Discovery(layers, incomplete, suspected)


def _make_layer(prefix: str, group: dict[str, TensorRef], settings: Settings, kind: str) -> BNLayer:
    return BNLayer(
        name=prefix,
        kind=kind,
        running_mean=_floats(group["running_mean"]),
        running_var=_floats(group["running_var"]),
        weight=_vector(group.get("weight")),
        bias=_vector(group.get("bias")),
        num_batches_tracked=_counter(group.get("num_batches_tracked")),
        stats_dtype=group["running_var"].dtype,
        settings=settings,
    )

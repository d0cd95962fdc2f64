"""What `bnaudit parity --against TARGET` runs, and where each target shows a BN layer's output.

  compile[:BACKEND]  `bnaudit.runtime.parity.compiled`: a copy of the eager model under
                     torch.compile, its graphs' batch-norm calls made graph outputs
  model.onnx         `bnaudit.runtime.parity.onnx`: onnxruntime (CPU provider, no custom
                     operator library); the values `bnaudit.audit.export.pairing` pairs with
                     the checkpoint's layers added to the graph's outputs
  program.pt2        `torch.export.load(path).module()`, run as it is
  model.ts / .pt     a TorchScript archive, `torch.jit.load`, run as it is

A .pt2 program and a TorchScript module run aten operators through the dispatcher: their
layers' outputs are read there, at each batch-norm operator, named by the buffer it reads
(`bnaudit.runtime.sites.batchnorm_calls`). Both keep the module names of the model they were
made from, which pair them with the checkpoint's layers (a .pt2 program as `bnaudit diff`
pairs it). Loading either runs code from the file: the user named it to run it.

Before any target runs, the artifact is compared with the checkpoint as `bnaudit diff`
compares them (ONNX and .pt2: nodes, eps, tensors, training mode, folding; TorchScript: each
layer's tensors and eps): what differs becomes the evidence of the diagnosis.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from bnaudit.audit.diff.checkpoints import diff
from bnaudit.audit.export.pairing import export_sites, named_layers
from bnaudit.audit.parity import ParityTarget, checkpoint_evidence, export_evidence
from bnaudit.config import Config
from bnaudit.errors import BnauditError
from bnaudit.formats.sniff import sniff_format
from bnaudit.runtime.models import RunnableModel, graph_producers, output_tensor
from bnaudit.runtime.norms import scripted_batch_stat_calls
from bnaudit.runtime.parity.compiled import DEFAULT_BACKEND, CompiledTarget
from bnaudit.runtime.parity.onnx import OnnxTarget
from bnaudit.runtime.sites import batchnorm_outputs
from bnaudit.text import exception_line

# sniffed format -> target kind
_FILE_KINDS = {"onnx": "onnx", "pt2": "pt2", "torchscript": "torchscript"}


def parse_against(against: str) -> ParityTarget:
    """--against: `compile`, `compile:BACKEND` or the path of an ONNX model, a .pt2 archive or
    a TorchScript file (recognised by its bytes); one line for anything else."""
    if against == "compile" or against.startswith("compile:"):
        backend = against.partition(":")[2] or DEFAULT_BACKEND
        return ParityTarget("compile", backend=backend)
    try:
        fmt = sniff_format(against)
    except BnauditError as exc:
        raise BnauditError(f"--against {exc}") from None
    kind = _FILE_KINDS.get(fmt)
    if kind is None:
        raise BnauditError(
            f"--against {against}: a {fmt} file is no deployed target: give compile, compile:BACKEND, an ONNX "
            "model, a torch.export .pt2 archive or a TorchScript file"
        )
    return ParityTarget(kind, path=against)


@dataclass
class OpenTarget:
    """A target ready to run on batches: `run(inputs, forward) -> (output, layer -> values)`
    (values: the layer's output at each call, in call order), with where each layer is read
    (`site`), the layers it cannot show and why (`unseen`), what differs statically at each
    layer (`static`), the layers whose value is a folded producer's output (`folded`), and
    what the runner notes."""

    target: ParityTarget
    run: Callable[[Any, Callable[[Any, Any], Any]], tuple[Any, dict[str, list[Any]]]]
    site: Callable[[str], str]
    unseen: dict[str, str] = field(default_factory=dict)
    static: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    folded: dict[str, str] = field(default_factory=dict)
    notes: Callable[[], list[str]] = list


class ProgramTarget:
    """A .pt2 program or a TorchScript module, each layer read at the batch-norm operators it
    runs (module docstring); `names` maps the program's layer names to the checkpoint's."""

    def __init__(self, target: ParityTarget, device: Any, names: Mapping[str, str]) -> None:
        path = str(target.path)
        try:
            if target.kind == "pt2":
                module = torch.export.load(path).module()
                module.to(device)
            else:
                module = torch.jit.load(path, map_location=device)  # type: ignore[no-untyped-call]  # torch: torch.jit.load is unannotated
                module.eval()
        except Exception as exc:  # whatever the file holds that torch refuses: one line naming it
            loader = "torch.export.load" if target.kind == "pt2" else "torch.jit.load"
            raise BnauditError(f"--against {path}: {loader} cannot load it: {exception_line(exc)}") from None
        self.module = module
        self.names = dict(names)
        self.path = path
        self.fixed = _fixed_batch(module) if target.kind == "pt2" else None
        self.padded = 0

    def run(self, inputs: Any, forward: Callable[[Any, Any], Any]) -> tuple[Any, dict[str, list[Any]]]:
        """The output on one batch and each layer's values; a program exported with a fixed
        batch size takes the batch in sub-batches of that size, the last padded with copies
        of its last sample, whose outputs are dropped (as an ONNX export's)."""
        if self.fixed is None or not isinstance(inputs, torch.Tensor) or len(inputs) == self.fixed:
            return self._run(inputs, forward)
        n = len(inputs)
        pad = -n % self.fixed
        self.padded += pad
        x = torch.cat([inputs, inputs[-1:].expand(pad, *inputs.shape[1:])]) if pad else inputs
        outputs: list[Any] = []
        values: dict[str, list[Any]] = {}
        for start in range(0, n + pad, self.fixed):
            out, part = self._run(x[start : start + self.fixed], forward)
            outputs.append(output_tensor(out))
            for name, calls in part.items():
                values.setdefault(name, [[] for _ in calls])
                for i, value in enumerate(calls):
                    values[name][i].append(value)
        joined = {name: [torch.cat(parts)[:n] for parts in calls] for name, calls in values.items()}
        return torch.cat(outputs)[:n], joined

    def _run(self, inputs: Any, forward: Callable[[Any, Any], Any]) -> tuple[Any, dict[str, list[Any]]]:
        values: dict[str, list[Any]] = {}

        def record(name: str, value: Any) -> None:
            values.setdefault(self.names.get(name, name), []).append(value)

        try:
            with batchnorm_outputs(self.module, None, record):
                out = forward(self.module, inputs)
        except BnauditError:
            raise
        except Exception as exc:
            raise BnauditError(f"--against {self.path}: running it failed: {exception_line(exc)}") from None
        return out, values


def _fixed_batch(module: Any) -> int | None:
    """The batch size a program was exported with when it is fixed (its first input's first
    dimension a number, not a symbol), else None."""
    first = next((n for n in module.graph.nodes if n.op == "placeholder"), None)
    value = first.meta.get("val") if first is not None else None
    shape = getattr(value, "shape", None)
    if not shape:
        return None
    size = shape[0]
    return size if isinstance(size, int) and size > 0 else None


def open_target(
    target: ParityTarget, runnable: RunnableModel, checkpoint: str, config: Config, device: Any
) -> OpenTarget:
    """`target` loaded for `runnable` (the eager model of `checkpoint`), with its static
    comparison done (module docstring)."""
    if target.kind == "compile":
        compiled = CompiledTarget(runnable.module, str(target.backend), device)

        def compiled_notes() -> list[str]:
            if compiled.graphs:
                return []
            return ["the backend compiled no graph: every layer ran eagerly (Dynamo could not capture the model)"]

        return OpenTarget(
            target,
            compiled.run,
            lambda _layer: "batch_norm call of the compiled graph",
            static=compiled.static,
            notes=compiled_notes,
        )
    path = str(target.path)
    if os.path.isdir(path):
        raise BnauditError(f"--against {path}: is a directory: name the artifact file")
    if target.kind == "torchscript":
        report = diff(checkpoint, path, config, checkpoint_a=runnable.checkpoint)
        program = ProgramTarget(target, device, {})
        static = dict(checkpoint_evidence(report.layers))
        for call in scripted_batch_stat_calls(program.module):
            static[call.module] = (
                *static.get(call.module, ()),
                "traced in training mode: it normalises with the batch's statistics",
            )
        return OpenTarget(
            target, program.run, lambda _layer: "batch-norm operator of the TorchScript module", static=static
        )
    producers = graph_producers(runnable.module).feeds
    report = diff(checkpoint, path, config, producers=producers, checkpoint_a=runnable.checkpoint)
    check = report.export
    if check is None:  # diff always compares a checkpoint with its export here
        raise BnauditError(f"--against {path}: not compared as an export")
    static = export_evidence(check)
    if target.kind == "pt2":
        program = ProgramTarget(target, device, named_layers(check))
        return OpenTarget(
            target,
            program.run,
            lambda _layer: "batch-norm operator of the program",
            static=static,
            notes=lambda: _padding_note(program.fixed, program.padded),
        )
    sites, unseen = export_sites(check)
    onnx_target = OnnxTarget(path, sites)
    words = {site.layer: site.words for site in sites}

    def onnx_run(inputs: Any, _forward: Callable[[Any, Any], Any]) -> tuple[Any, dict[str, list[Any]]]:
        return onnx_target.run(inputs)

    return OpenTarget(
        target,
        onnx_run,
        lambda layer: words.get(layer, "ONNX value"),
        unseen=unseen,
        static=static,
        folded={site.layer: site.node for site in sites if site.folded},
        notes=lambda: _padding_note(onnx_target.fixed, onnx_target.padded),
    )


def _padding_note(fixed: int | None, padded: int) -> list[str]:
    if not padded:
        return []
    return [
        f"the target takes batches of exactly {fixed}: {padded} padding sample(s) (copies of a batch's last) "
        "were run and their outputs dropped"
    ]

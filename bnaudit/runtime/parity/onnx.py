"""ONNX models run in onnxruntime: the output comparison of `diff model.pt model.onnx --arch
--data` (rule BN114) and the ONNX target of `bnaudit parity`.

The export runs in onnxruntime (an optional extra) with only the CPU execution provider and
no custom operator library, on the same batches as the checkpoint in torch (eval mode, the
model --arch builds). An export with a fixed batch dimension gets batches of exactly that
size: a short batch is filled with copies of its last sample, whose outputs are dropped
(said in the report).

diff's numbers (`bnaudit.audit.export.diff.ParityResult`, statistics in
`bnaudit.audit.statistics`):

  relative deviation of a sample  relative_deviation of y_onnx against y_torch
  floor                           parity_floor: PARITY_FACTOR x the noise floor of the float32
                                  torch outputs against a float64 copy of the model on the
                                  same batch (float32 rounding alone)
  agreement                       share of samples with the same argmax

The rounding measured is kernel noise: before rounding up, the same model and data give a
floor of 4.97e-06 on one CPU and 5.26e-06 on another. Rounded up, the floor (1e-05 for both)
and every decision against it are the same on every machine; a deviation below it prints
as "<1e-05" (`bnaudit.text.above_floor`; JSON keeps the exact number).

parity reads every paired layer's output too: the values `bnaudit.audit.export.pairing`
names (a BatchNormalization node's output, or the conv BN was folded into) are added to the
graph's outputs of an in-memory copy of the model, which onnxruntime runs (`open_session`).
Marking a value as an output keeps onnxruntime from fusing its writer with the node after
it (a Conv with a following Relu); the BN arithmetic, and a Conv that BN was folded into,
stay what the file says.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from typing import Any

import torch

from bnaudit.audit.diff.checkpoints import DiffReport, diff
from bnaudit.audit.export.diff import ParityResult
from bnaudit.audit.export.pairing import Site
from bnaudit.audit.resolve import model_checkpoint
from bnaudit.audit.statistics import parity_floor
from bnaudit.config import Config
from bnaudit.errors import BnauditError
from bnaudit.formats.onnx import PROTOBUF_LIMIT, load_onnx
from bnaudit.runtime.data import make_loader
from bnaudit.runtime.models import ModelSpec, graph_producers, load_runnable, output_tensor, resolve_model
from bnaudit.runtime.parity.accumulate import OutputDeviation
from bnaudit.runtime.sources import DataOptions
from bnaudit.text import exception_line

ONNXRUNTIME_EXTRA = 'pip install "bnaudit[onnx]"'


def _onnxruntime() -> Any:
    try:
        import onnxruntime  # type: ignore[import-untyped]  # onnxruntime ships no type information
    except ImportError:
        raise BnauditError(f"running an ONNX export needs onnxruntime: {ONNXRUNTIME_EXTRA}") from None
    return onnxruntime


def open_session(path: str, outputs: Sequence[str] = ()) -> Any:
    """An onnxruntime session on the CPU execution provider for `path` (its external data
    checked first), with the values `outputs` added to the graph's outputs (after its own,
    in order); one line naming the file when onnxruntime cannot run it."""
    onnxruntime = _onnxruntime()
    model = load_onnx(path)  # external-data locations validated before onnxruntime opens any file
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    source: str | bytes = path
    if outputs:
        from onnx.helper import make_empty_tensor_value_info

        proto = model.proto  # parsed for this session alone
        present = {o.name for o in proto.graph.output}
        for value in dict.fromkeys(outputs):
            if value not in present:
                proto.graph.output.append(make_empty_tensor_value_info(value))
        if proto.ByteSize() > PROTOBUF_LIMIT:
            raise BnauditError(
                f"{path}: the graph is larger than protobuf's 2 GiB limit once its layer outputs are added: "
                "keep its weights as external data"
            )
        source = proto.SerializeToString()
        # the in-memory copy finds its external data (validated above) beside the model
        folder = os.path.dirname(os.path.abspath(path))
        options.add_session_config_entry("session.model_external_initializers_file_folder_path", folder)
    try:
        return onnxruntime.InferenceSession(source, sess_options=options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime's own errors: one line naming the file
        raise BnauditError(f"{path}: onnxruntime cannot run it: {str(exc).splitlines()[0][:300]}") from None


def session_input(session: Any) -> tuple[str, int | None]:
    """The name of the session's one input and its fixed batch size (None when dynamic)."""
    inputs = session.get_inputs()
    if len(inputs) != 1:
        raise BnauditError(f"the export takes {len(inputs)} inputs; output comparison needs a model with one")
    first_dim = inputs[0].shape[0] if inputs[0].shape else None
    fixed = first_dim if isinstance(first_dim, int) and first_dim > 0 else None
    return inputs[0].name, fixed


def run_outputs(session: Any, name: str, x: Any, fixed: int | None) -> tuple[list[Any], int]:
    """Every output of the session for the samples of `x` (a float32 numpy array), and how
    many padding samples that took.

    Dynamic batch dimension: one call for the whole batch. Fixed batch size b: the
    batch cut into sub-batches of b in order (the same sub-batches a per-sample loop
    feeds, so a training-mode export sees the same companions), the last filled with
    copies of its last sample, whose outputs are dropped; one session, each output's
    buffers written into one preallocated array.
    """
    import numpy as np

    n = len(x)
    if fixed is None:
        return list(session.run(None, {name: x})), 0
    pad = -n % fixed
    if pad:
        x = np.concatenate([x, np.repeat(x[-1:], pad, axis=0)])
    outs: list[Any] = []
    for start in range(0, n + pad, fixed):
        ys = session.run(None, {name: x[start : start + fixed]})
        if not outs:
            outs = [np.empty((n + pad, *y.shape[1:]), dtype=y.dtype) for y in ys]
        for out, y in zip(outs, ys):
            out[start : start + fixed] = y
    return [out[:n] for out in outs], pad


def run_export(session: Any, name: str, x: Any, fixed: int | None) -> tuple[Any, int]:
    """The export's first output for the samples of `x` (`run_outputs`), and the padding."""
    outs, pad = run_outputs(session, name, x, fixed)
    return outs[0], pad


def measure_output_parity(session: Any, model: Any, options: DataOptions) -> ParityResult:
    """Run the torch model (eval) and the onnxruntime session on the same batches.

    Each batch of the data runs once through the torch model and its float64 copy as a
    whole, and through the export at the export's own batch size (`run_outputs`): an
    export with a fixed batch of 2 costs one onnxruntime call per 2 samples, not one
    torch pass per 2 samples besides.
    """
    name, fixed = session_input(session)
    wide = copy.deepcopy(model).double().eval()
    model.eval()
    batches = padded = 0
    outputs = OutputDeviation()
    options.validate()
    with torch.no_grad():
        for batch in make_loader(options):
            x = batch.inputs
            if not isinstance(x, torch.Tensor):
                raise BnauditError("output comparison needs batches of one tensor")
            x = x.float().contiguous()
            y_onnx_np, pad = run_export(session, name, x.numpy(), fixed)
            padded += pad
            y_torch = output_tensor(model(x)).float()
            outputs.update(torch.from_numpy(y_onnx_np).float(), y_torch, output_tensor(wide(x.double())))
            batches += 1
    numbers = outputs.numbers()
    if numbers.samples == 0:
        raise BnauditError("the data holds no samples")
    return ParityResult(
        samples=numbers.samples,
        batches=batches,
        agreement=numbers.agree / numbers.samples,
        max_deviation=numbers.relative,
        floor=parity_floor(numbers.rounding),
        batch_size=fixed,
        padded=padded,
    )


def diff_export(spec: ModelSpec, export: str, config: Config, data: DataOptions | None = None) -> DiffReport:
    """`diff checkpoint export --arch ...`: folded layers paired through the model graph,
    the checkpoint's real eps/momentum from the model's modules, and with `data` the
    outputs of both compared."""
    # a folder: the checkpoint (the export) inspect finds in it
    spec = resolve_model(spec, config)
    export = model_checkpoint(export, trust_pickle=spec.trust_pickle, config=config)
    runnable = load_runnable(spec)
    producers = graph_producers(runnable.module).feeds
    parity = None
    if data is not None:
        parity = measure_output_parity(open_session(export), runnable.module, data)
    return diff(spec.checkpoint, export, config, producers=producers, parity=parity, checkpoint_a=runnable.checkpoint)


class OnnxTarget:
    """`bnaudit parity --against model.onnx`: the export in onnxruntime, every paired layer's
    output added to the graph's outputs (`bnaudit.audit.export.pairing.export_sites`)."""

    def __init__(self, path: str, sites: Sequence[Site]) -> None:
        self.path = path
        self.sites = list(sites)
        self.session = open_session(path, [site.value for site in self.sites])
        self.input, self.fixed = session_input(self.session)
        names = [o.name for o in self.session.get_outputs()]
        self.where = {site.layer: names.index(site.value) for site in self.sites}
        self.padded = 0

    def run(self, inputs: Any) -> tuple[Any, dict[str, list[Any]]]:
        """The export's first output and each site's value, as torch tensors on `inputs`' device."""
        if not isinstance(inputs, torch.Tensor):
            raise BnauditError("an ONNX target needs batches of one tensor")
        x = inputs.detach().float().cpu().contiguous().numpy()
        try:
            outs, pad = run_outputs(self.session, self.input, x, self.fixed)
        except Exception as exc:  # onnxruntime's own errors: one line naming the file
            raise BnauditError(f"{self.path}: onnxruntime cannot run it: {exception_line(exc)[:300]}") from None
        self.padded += pad
        device = inputs.device
        values = {layer: [torch.from_numpy(outs[i]).to(device)] for layer, i in self.where.items()}
        return torch.from_numpy(outs[0]).to(device), values

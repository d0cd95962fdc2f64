"""`diff model.pt model.onnx --arch ... --data ...`: run both and compare their outputs.

The checkpoint runs in torch (eval mode, the model --arch builds), the export in
onnxruntime (an optional extra) with only the CPU execution provider and no custom
operator library, on the same batches (`bnaudit.runtime.data.make_loader`). Numbers
(`bnaudit.audit.export.diff.ParityResult`):

  relative deviation of a sample  relative_deviation (`bnaudit.audit.statistics`) of
                                  y_onnx against y_torch
  floor                           FLOOR_FACTOR x the largest relative deviation of the float32
                                  torch outputs from a float64 copy of the model on the same
                                  batch (float32 rounding alone), rounded up to a power of ten,
                                  at least FLOOR_MIN (`parity_floor`)
  agreement                       share of samples with the same argmax

The rounding measured is kernel noise: before rounding up, the same model and data give a
floor of 4.97e-06 on one CPU and 5.26e-06 on another. Rounded up, the floor (1e-05 for both)
and every decision against it are the same on every machine; a deviation below it prints
as "<1e-05" (`bnaudit.text.above_floor`; JSON keeps the exact number).

An export with a fixed batch dimension gets batches of exactly that size: a short batch is
filled with copies of its last sample, whose outputs are dropped (said in the report).

Also used here, from runtime.models: `graph_producers`, the conv that feeds each BN module
in the model graph (torch.fx), used to pair folded layers with --arch.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch

from bnaudit.audit.diff.checkpoints import DiffReport, diff
from bnaudit.audit.export.diff import ParityResult
from bnaudit.audit.resolve import model_checkpoint
from bnaudit.config import Config
from bnaudit.errors import BnauditError
from bnaudit.formats.onnx import load_onnx
from bnaudit.runtime.data import make_loader
from bnaudit.runtime.deviation import relative_deviations
from bnaudit.runtime.models import ModelSpec, graph_producers, load_runnable, output_tensor, resolve_model
from bnaudit.runtime.sources import DataOptions

FLOOR_FACTOR = 10.0
FLOOR_MIN = 1e-6
ONNXRUNTIME_EXTRA = 'pip install "bnaudit[onnx]"'


def parity_floor(rounding: float) -> float:
    """FLOOR_FACTOR x `rounding` (the largest relative deviation float32 rounding gives)
    rounded up to a power of ten, at least FLOOR_MIN: between 10x and 100x the rounding."""
    scaled = FLOOR_FACTOR * rounding
    if not (math.isfinite(scaled) and scaled > FLOOR_MIN):
        return max(scaled, FLOOR_MIN)  # NaN stays NaN: every deviation then deviates
    return float(f"1e{math.ceil(math.log10(scaled))}")  # the double nearest 10^k, as a user types it


def open_session(path: str) -> Any:
    """An onnxruntime session on the CPU execution provider for `path` (its external data
    checked first); one line naming the file when onnxruntime cannot run it."""
    try:
        import onnxruntime  # type: ignore[import-untyped]  # onnxruntime ships no type information
    except ImportError:
        raise BnauditError(f"running an ONNX export needs onnxruntime: {ONNXRUNTIME_EXTRA}") from None
    load_onnx(path)  # external-data locations validated before onnxruntime opens any file
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    try:
        return onnxruntime.InferenceSession(path, sess_options=options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime's own errors: one line naming the file
        raise BnauditError(f"{path}: onnxruntime cannot run it: {str(exc).splitlines()[0][:300]}") from None


def run_export(session: Any, name: str, x: Any, fixed: int | None) -> tuple[Any, int]:
    """The export's first output for the samples of `x` (a float32 numpy array), and how
    many padding samples that took.

    Dynamic batch dimension: one call for the whole batch. Fixed batch size b: the
    batch cut into sub-batches of b in order (the same sub-batches a per-sample loop
    feeds, so a training-mode export sees the same companions), the last filled with
    copies of its last sample, whose outputs are dropped; one session, its output
    buffers written into one preallocated array.
    """
    import numpy as np

    n = len(x)
    if fixed is None:
        return session.run(None, {name: x})[0], 0
    pad = -n % fixed
    if pad:
        x = np.concatenate([x, np.repeat(x[-1:], pad, axis=0)])
    out: Any = None
    for start in range(0, n + pad, fixed):
        y = session.run(None, {name: x[start : start + fixed]})[0]
        if out is None:
            out = np.empty((n + pad, *y.shape[1:]), dtype=y.dtype)
        out[start : start + fixed] = y
    return out[:n], pad


def measure_parity(session: Any, model: Any, options: DataOptions) -> ParityResult:
    """Run the torch model (eval) and the onnxruntime session on the same batches.

    Each batch of the data runs once through the torch model and its float64 copy as a
    whole, and through the export at the export's own batch size (`run_export`): an
    export with a fixed batch of 2 costs one onnxruntime call per 2 samples, not one
    torch pass per 2 samples besides.
    """
    inputs = session.get_inputs()
    if len(inputs) != 1:
        raise BnauditError(f"the export takes {len(inputs)} inputs; output comparison needs a model with one")
    name = inputs[0].name
    first_dim = inputs[0].shape[0] if inputs[0].shape else None
    fixed = first_dim if isinstance(first_dim, int) and first_dim > 0 else None
    wide = copy.deepcopy(model).double().eval()
    model.eval()
    samples = batches = padded = agree = 0
    worst = 0.0
    rounding = 0.0
    options.validate()
    with torch.no_grad():
        for batch in make_loader(options):
            x = batch.inputs
            if not isinstance(x, torch.Tensor):
                raise BnauditError("output comparison needs batches of one tensor")
            x = x.float().contiguous()
            n = len(x)
            y_onnx_np, pad = run_export(session, name, x.numpy(), fixed)
            padded += pad
            y_onnx = torch.from_numpy(y_onnx_np).float()
            y_torch = output_tensor(model(x)).float()
            y_wide = output_tensor(wide(x.double()))
            if y_onnx.shape != y_torch.shape:
                raise BnauditError(
                    f"the export's output has shape {list(y_onnx.shape)}, the model's {list(y_torch.shape)}"
                )
            worst = max(worst, float(relative_deviations(y_onnx, y_torch).max()))
            rounding = max(rounding, float(relative_deviations(y_torch, y_wide).max()))
            agree += int((y_onnx.flatten(1).argmax(1) == y_torch.flatten(1).argmax(1)).sum())
            samples += n
            batches += 1
    if samples == 0:
        raise BnauditError("the data holds no samples")
    return ParityResult(
        samples=samples,
        batches=batches,
        agreement=agree / samples,
        max_deviation=worst,
        floor=parity_floor(rounding),
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
        parity = measure_parity(open_session(export), runnable.module, data)
    return diff(spec.checkpoint, export, config, producers=producers, parity=parity, checkpoint_a=runnable.checkpoint)

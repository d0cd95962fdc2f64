"""`bnaudit parity`: eager PyTorch and a deployed target on the same batches, layer by layer.

Per batch, one process, no_grad:

  eager float32   the model as loaded (--arch, TorchScript, pickled module), eval mode; each
                  BN layer's output read at its batch-norm operator (`runtime.sites`)
  target          `runtime.parity.targets`: its output of each layer, where it shows one
  eager float64   a float64 copy on the same batch, read the same way: what float32
                  rounding alone does at each layer (the noise floor); on the first batches
                  until FLOOR_SAMPLES samples

The float64 forward runs last: each layer's float64 output is compared with the float32 and
the target's values of that call as it is made (`runtime.parity.accumulate`), and all three
are dropped (in later batches the target's values are compared with the float32 ones after
both ran). Memory holds one batch's BN outputs of eager and of the target, whatever the
number of batches; everything of a batch is gone before the next batch runs.
Layers are reported in execution order: the order one eval-mode forward of the first batch
first calls them (`runtime.sites.forward_order`, the order recalibrate calibrates in);
layers it does not reach follow in registration order. Definitions of the numbers:
`bnaudit.audit.statistics`; of the verdicts: `bnaudit.audit.parity`.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from bnaudit.audit.parity import (
    Evidence,
    LayerParity,
    OutputParity,
    ParityContext,
    ParityTarget,
    UnseenLayer,
    implied_eps,
)
from bnaudit.audit.rules import run_parity_rules
from bnaudit.audit.statistics import PARITY_FACTOR, noise_floor
from bnaudit.config import Config
from bnaudit.errors import BnauditError
from bnaudit.reports.parity import ParityReport
from bnaudit.runtime.data import make_loader
from bnaudit.runtime.models import (
    ModelSpec,
    forward,
    load_forward,
    load_runnable,
    output_tensor,
    resolve_device,
    resolve_model,
    to_device,
)
from bnaudit.runtime.norms import batchnorm_modules
from bnaudit.runtime.parity.accumulate import LayerDeviation, LayerNumbers, OutputDeviation
from bnaudit.runtime.parity.targets import OpenTarget, open_target, parse_against
from bnaudit.runtime.sites import batchnorm_outputs, forward_order, rejected
from bnaudit.runtime.sources import DataOptions

# The float64 copy runs on the first batches until this many samples: float64 convolutions run
# several times slower than float32 ones on a CPU, and the floor, a power of ten, is the same
# from them as from every batch (docs/commands/parity.md: The numbers).
FLOOR_SAMPLES = 64


def _wide(x: Any) -> Any:
    """`x` with every floating tensor in float64 (the float64 copy's inputs)."""
    if isinstance(x, torch.Tensor):
        return x.double() if x.is_floating_point() else x
    if isinstance(x, dict):
        return {k: _wide(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_wide(v) for v in x)
    return x


def _recorded(
    model: Any, layers: Mapping[str, Any] | None, inputs: Any, run: Callable[[Any, Any], Any]
) -> tuple[Any, dict[str, list[Any]]]:
    """The model's output and each BN layer's output at every call (`batchnorm_outputs`)."""
    values: dict[str, list[Any]] = {}
    with batchnorm_outputs(model, layers, lambda name, value: values.setdefault(name, []).append(value)):
        out = run(model, inputs)
    return out, values


def _compared(
    model: Any,
    layers: Mapping[str, Any],
    inputs: Any,
    run: Callable[[Any, Any], Any],
    compare: Callable[[str, Any], None],
) -> Any:
    """The model's output, `compare(name, value)` called with each BN layer's output at each
    call as the forward makes it."""
    with batchnorm_outputs(model, layers, compare):
        return run(model, inputs)


class _Comparer:
    """compare(name, w) for `_compared`: a layer's next call, its float64 value w against the
    float32 and the target's values of that call, which are dropped once compared; `rest()`
    compares the calls no float64 value reached (every call, in a batch without a float64
    pass) against the float32 values alone."""

    def __init__(
        self, eager: dict[str, list[Any]], shown: dict[str, list[Any]], accumulators: dict[str, LayerDeviation]
    ) -> None:
        self.eager, self.shown, self.accumulators = eager, shown, accumulators
        self.seen: dict[str, int] = {}

    def _update(self, name: str, i: int, w: Any) -> None:
        values, targets = self.eager.get(name, []), self.shown.get(name, [])
        if i < len(values) and i < len(targets) and values[i] is not None and targets[i] is not None:
            r = values[i]
            self.accumulators.setdefault(name, LayerDeviation()).update(_paired(name, targets[i], r), r, w)
            values[i] = targets[i] = None

    def __call__(self, name: str, w: Any) -> None:
        i = self.seen[name] = self.seen.get(name, -1) + 1
        self._update(name, i, w)

    def rest(self) -> None:
        for name, values in self.eager.items():
            for i in range(len(values)):
                self._update(name, i, None)


def _paired(name: str, y: Any, r: Any) -> Any:
    """The target's value `y` in eager's shape and device (a flattened value of as many
    elements is reshaped; another size is not the same layer)."""
    if y.shape != r.shape:
        if y.numel() != r.numel():
            raise BnauditError(
                f"layer {name}: the target's output has shape {list(y.shape)}, eager's {list(r.shape)}: not the same layer"
            )
        y = y.reshape(r.shape)
    return y.to(r.device)


def measure_parity(
    spec: ModelSpec,
    against: str,
    options: DataOptions,
    config: Config | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ParityReport:
    """Compare the checkpoint `spec` names, run eagerly, with the target `against` (module
    docstring) on the data `options` describes."""
    config = config or Config()
    options.validate()
    target = parse_against(against)
    spec = resolve_model(spec, config)
    device = resolve_device(spec.device)
    forward_fn = load_forward(spec.forward)
    if forward_fn is not None and target.kind == "onnx":
        raise BnauditError("--forward does not apply to an ONNX target: onnxruntime takes the batch's one tensor")
    runnable = load_runnable(spec)
    model = runnable.module.to(device).eval()
    layers = batchnorm_modules(model)
    if not layers:
        raise BnauditError(f"{spec.checkpoint}: the model has no BatchNorm layer to compare")
    with warnings.catch_warnings():  # a TorchScript module's .double() reads each parameter's .grad, and warns
        warnings.simplefilter("ignore", UserWarning)
        wide = copy.deepcopy(model).double().eval()
    wide_modules = dict(wide.named_modules())  # a TorchScript module has no get_submodule
    wide_layers = {name: wide_modules[name] for name in layers}
    opened = open_target(target, runnable, spec.checkpoint, config, device)
    stream = make_loader(options)

    def run(m: Any, x: Any) -> Any:
        return forward(m, x, forward_fn)

    accumulators: dict[str, LayerDeviation] = {}
    outputs = OutputDeviation()
    calls: dict[str, int] = {}
    order: list[str] = []
    batches = floor_samples = 0
    with torch.no_grad():
        for batch in stream:
            x = to_device(batch.inputs, device)
            if not order:
                order, calls = forward_order(model, [x], run, layers, None)
            yt, shown = opened.run(x, run)
            try:
                y32, eager = _recorded(model, layers, x, run)
                compare = _Comparer(eager, shown, accumulators)
                y64 = None
                if floor_samples < FLOOR_SAMPLES:
                    y64 = _compared(wide, wide_layers, _wide(x), run, compare)
                    floor_samples += batch.size
            except BnauditError:
                raise
            except Exception as exc:
                raise rejected(batch.index, exc) from exc
            compare.rest()  # without a float64 pass: every call compared here
            outputs.update(
                output_tensor(yt).to(device), output_tensor(y32), None if y64 is None else output_tensor(y64)
            )
            del x, y32, y64, yt, eager, shown, compare  # gone before the next batch's forward passes
            batches += 1
            if progress is not None:
                progress(batches, len(stream))
    numbers = outputs.numbers()
    if numbers.samples == 0:
        raise BnauditError("the data holds no samples")
    return _report(
        spec, runnable.describe(), opened, order, calls, layers, accumulators, numbers, config, batches, stream.notes
    )


def _layer(name: str, numbers: LayerNumbers, calls: int, opened: OpenTarget, module: Any) -> LayerParity:
    floor = noise_floor(numbers.rounding_relative)
    relative = numbers.relative
    deviation = numbers.channel_deviation
    over = tuple(int(c) for c in range(numbers.channels) if not float(deviation[c]) <= PARITY_FACTOR * floor)
    worst = int(torch.argmax(deviation.nan_to_num(nan=float("inf")))) if numbers.channels else None
    eps = float(module.eps) if isinstance(getattr(module, "eps", None), (int, float)) else None
    implied = None
    running_var = getattr(module, "running_var", None)
    if numbers.fits and eps is not None and isinstance(running_var, torch.Tensor):
        variances = running_var.detach().double().cpu()
        implied = implied_eps([(f.scale, float(variances[f.channel])) for f in numbers.fits], eps)
    evidence = Evidence(
        static=tuple(opened.static.get(name, ())),
        folded=opened.folded.get(name),
        dtype=numbers.dtype,
        fits=numbers.fits,
        implied_eps=implied,
        eps=eps,
    )
    return LayerParity(
        name,
        numbers.channels,
        opened.site(name),
        floor,
        numbers.max_abs,
        relative,
        max(calls, 1),
        worst,
        over,
        evidence,
    )


def _report(
    spec: ModelSpec,
    model_words: str,
    opened: OpenTarget,
    order: list[str],
    calls: dict[str, int],
    modules: dict[str, Any],
    accumulators: dict[str, LayerDeviation],
    numbers: Any,
    config: Config,
    batches: int,
    notes: list[str],
) -> ParityReport:
    compared = []
    unseen = []
    for name in order:
        accumulator = accumulators.get(name)
        if accumulator is not None:
            compared.append(_layer(name, accumulator.numbers(), calls.get(name, 1), opened, modules[name]))
            continue
        if name not in calls:
            reason = "the eager forward never calls it"
        else:
            reason = opened.unseen.get(name) or (
                "the target ran no batch-norm operation of this layer that bnaudit could read (fused or folded out of sight)"
            )
        unseen.append(UnseenLayer(name, reason))
    outputs = OutputParity(
        numbers.samples,
        numbers.max_abs,
        numbers.relative,
        noise_floor(numbers.rounding),
        numbers.agree / numbers.samples,
    )
    target: ParityTarget = opened.target
    context = ParityContext(tuple(compared), tuple(unseen), outputs, target, config)
    return ParityReport(
        checkpoint=spec.checkpoint,
        model=model_words,
        target=target,
        layers=tuple(compared),
        outputs=outputs,
        unseen=tuple(unseen),
        findings=tuple(run_parity_rules(context)),
        config=config,
        samples=numbers.samples,
        batches=batches,
        device=str(resolve_device(spec.device)),
        notes=tuple(notes) + tuple(opened.notes()),
    )

"""Inputs a model cannot take, said in one line that names the fix, and where in the
model a failed forward failed (`locate_failure`).

Checked only after a forward has failed, so a model that accepts what it is given (its
own casting, a first layer of another kind) is never second-guessed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from bnaudit.text import plural


def input_problem(model: Any, inputs: Any, grayscale: bool | None) -> str | None:
    """Why `model` rejects the tensor `inputs`, or None when neither check explains it.

    dtype: integer or bool inputs against floating-point parameters. Channels: the first
    module with `in_channels` (a convolution) against inputs.shape[1]; `grayscale` is
    whether --grayscale was given (None: not image data, where the option does not apply).
    """
    if not isinstance(inputs, torch.Tensor) or isinstance(model, torch.jit.ScriptModule):
        return None
    expected = next((p.dtype for p in model.parameters() if p.dtype.is_floating_point), None)
    if expected is not None and not inputs.dtype.is_floating_point:
        name = str(expected).removeprefix("torch.")
        return (
            f"the inputs are {str(inputs.dtype).removeprefix('torch.')} but the model expects {name} (the dtype of "
            f"its parameters): store the inputs as {name} (uint8 images are converted to [0, 1] by themselves)"
        )
    first = next(((n, m) for n, m in model.named_modules() if isinstance(getattr(m, "in_channels", None), int)), None)
    if first is None or inputs.dim() < 3:
        return None
    name, module = first
    have, want = int(inputs.shape[1]), int(module.in_channels)
    if have == want:
        return None
    if grayscale is None:
        fix = f"store the inputs with {plural(want, 'channel')}"
    elif want == 1:
        fix = "pass --grayscale for one channel"
    elif grayscale and want == 3:
        fix = "drop --grayscale for RGB images"
    else:
        fix = f"convert the images to {plural(want, 'channel')}"
    return f"the inputs have {plural(have, 'channel')} but the model's first layer {name} expects {want}: {fix}"


def _shapes(args: tuple[Any, ...]) -> str:
    shapes = [list(a.shape) for a in args if isinstance(a, torch.Tensor)]
    if not shapes:
        return "no tensor"
    return "shape " + ", ".join(str(s) for s in shapes)


def locate_failure(model: Any, call: Callable[[], Any]) -> str:
    """Re-run a failed forward with hooks on every module; the innermost module entered
    and not left is the one that failed. Empty for TorchScript (no hooks)."""
    if isinstance(model, torch.jit.ScriptModule):
        return ""
    stack: list[tuple[str, str, str]] = []
    failed: list[tuple[str, str, str]] = []
    handles = []
    for name, module in model.named_modules():

        def pre(mod: Any, args: tuple[Any, ...], _name: str = name) -> None:
            stack.append((_name, type(mod).__name__, _shapes(args)))

        def post(mod: Any, args: tuple[Any, ...], out: Any) -> None:
            if stack:
                stack.pop()

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))
    try:
        call()
    except Exception:
        failed = list(stack)
    finally:
        for handle in handles:
            handle.remove()
    if not failed:
        return ""
    name, kind, shape = failed[-1]
    return f"layer '{name or '(model)'}' ({kind}) got input {shape}: "

"""timm in tests: its PyPI wheel imports torchvision, whose PyPI build (for CUDA torch)
cannot load its operators under CPU torch; declaring the two operator schemas
torchvision's import registers fake kernels for lets the pure-Python part import. Only
the tests do this: bnaudit itself never imports timm or torchvision."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

_LIBRARY: list[Any] = []  # kept alive: the schemas live as long as the Library object


def _declare_torchvision_ops() -> None:
    if _LIBRARY:
        return
    try:
        getattr(torch.ops.torchvision, "nms")  # noqa: B009 (a torchvision whose extension loads defines them)
        return
    except (AttributeError, RuntimeError):
        pass
    library = torch.library.Library("torchvision", "DEF")
    library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    library.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _LIBRARY.append(library)


def import_timm() -> Any:
    """The timm package (skips the test where it is not installed)."""
    if importlib.util.find_spec("timm") is None:  # found without importing torchvision yet
        pytest.skip("timm is not installed")
    _declare_torchvision_ops()
    import timm
    import timm.utils

    return timm


def import_lightning() -> Any:
    """The lightning package (skips the test where it is not installed). torchmetrics,
    which lightning imports, imports torchvision where it is installed: the same operator
    schemas first."""
    if importlib.util.find_spec("lightning") is None:
        pytest.skip("lightning is not installed")
    _declare_torchvision_ops()
    import lightning

    return lightning


def import_peft() -> Any:
    """The peft package (skips the test where it, or accelerate, which it imports, is not
    installed). peft imports transformers, which imports torchvision: the same schemas first."""
    if importlib.util.find_spec("peft") is None or importlib.util.find_spec("accelerate") is None:
        pytest.skip("peft is not installed")
    _declare_torchvision_ops()
    import peft

    return peft


def import_ema_pytorch() -> Any:
    """The ema_pytorch package (skips the test where it is not installed)."""
    if importlib.util.find_spec("ema_pytorch") is None:
        pytest.skip("ema-pytorch is not installed")
    import ema_pytorch

    return ema_pytorch

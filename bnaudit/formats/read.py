"""`read_checkpoint`: a path in, a `Checkpoint` of lazy tensors out, whatever the format.

The one entry point for readers: sniff, dispatch to the format's reader, pick the
state dict inside a container and strip wrapper prefixes. Only torch.save files import
torch (through `torch.load`); safetensors and TorchScript are read without it.
"""

from __future__ import annotations

from bnaudit.errors import BnauditError
from bnaudit.formats.allowlist import load_torch_object
from bnaudit.formats.containers import checkpoint_from_object, strip_wrapper_prefix
from bnaudit.formats.model import Checkpoint
from bnaudit.formats.safetensors import read_safetensors
from bnaudit.formats.sniff import sniff_format
from bnaudit.formats.standins import with_stand_ins_checked


def read_checkpoint(path: str, key: str | None = None, trust_pickle: bool = False) -> Checkpoint:
    """Open `path` read-only and return its (chosen) state dict as lazy tensors."""
    fmt = sniff_format(path)
    if fmt == "safetensors":
        tensors, metadata = read_safetensors(path)
        if key is not None:
            raise BnauditError(f"{path}: --key does not apply to safetensors files")
        ckpt = Checkpoint(path, fmt, tensors, metadata=metadata)
        return strip_wrapper_prefix(ckpt)
    if fmt == "torchscript":
        from bnaudit.formats.torchscript import read_torchscript, script_metadata

        tensors, modules = read_torchscript(path)
        if key is not None:
            raise BnauditError(f"{path}: --key does not apply to TorchScript archives")
        return Checkpoint(path, fmt, tensors, modules=modules, holds_module=True, metadata=script_metadata(path))
    obj = load_torch_object(path, trust_pickle=trust_pickle, mmap=fmt == "torch-zip", stand_ins=True)
    return with_stand_ins_checked(path, obj, lambda: checkpoint_from_object(path, fmt, obj, key))

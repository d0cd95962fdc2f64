"""`save_like`: write a checkpoint again in its own format with new BN statistics.

Only `running_mean`, `running_var` and `num_batches_tracked` are ever replaced; every
other byte, key and piece of metadata stays as it was, so a recalibrated file drops in
where the original was. Separate from the readers: writing needs torch for torch.save
and TorchScript files, reading safetensors does not.
"""

from __future__ import annotations

import json
import math
import os
import sys
import zipfile
from collections.abc import Mapping
from typing import Any

from bnaudit.errors import BnauditError
from bnaudit.formats.allowlist import load_torch_object
from bnaudit.formats.atomic import atomic_write, check_output
from bnaudit.formats.model import Checkpoint
from bnaudit.formats.safetensors import read_safetensors_header
from bnaudit.text import exception_line

# The only tensors bnaudit ever writes: the running statistics of a BN layer.
_WRITABLE_LEAVES = ("running_mean", "running_var", "num_batches_tracked")


def save_like(
    ckpt: Checkpoint,
    updates: Mapping[str, Any],
    output: str,
    force: bool = False,
    provenance: Mapping[str, Any] | None = None,
    trust_pickle: bool = False,
) -> None:
    """Write `ckpt`'s file again, in its own format, to `output`, with `updates` applied.

    `updates` maps names of the chosen state dict (as `ckpt.tensors` names them, the
    wrapper prefix stripped) to new values for `running_mean`, `running_var` and
    `num_batches_tracked` buffers; each is cast to the stored dtype and must keep the
    stored shape. Everything else stays as it is:

      safetensors   the header with `__metadata__` kept plus a `bnaudit` entry (the
                    provenance as JSON); the data section copied byte for byte, then
                    only the updated tensors' bytes overwritten in place
      torch-zip/legacy  the whole container reloaded (same allow-list as reading) and
                    saved in the same serialization; only the selected state dict's
                    entries replaced; no new keys
      torchscript   the archive loaded, buffers set, saved with its extra files

    Written atomically (see `atomic_write`); the input is never opened for writing.
    Non-finite statistics are refused, naming the layer.
    """
    if ckpt.shards:  # one file per shard would have to be rewritten and re-indexed
        raise BnauditError(
            f"{ckpt.path}: writing a sharded checkpoint is not supported; recalibrate a single-file copy"
        )
    check_output(output, ckpt.path, force)
    prepared = _prepare_updates(ckpt, updates)
    if ckpt.format == "safetensors":

        def write(f: Any) -> None:
            _write_safetensors_like(ckpt, prepared, provenance, f)
    elif ckpt.format in ("torch-zip", "torch-legacy"):
        obj = load_torch_object(ckpt.path, trust_pickle=trust_pickle, mmap=ckpt.format == "torch-zip")
        _apply_to_container(ckpt, obj, prepared)

        def write(f: Any) -> None:
            import torch

            torch.save(obj, f, _use_new_zipfile_serialization=ckpt.format == "torch-zip")
    elif ckpt.format == "torchscript":
        module, extra = _load_script_for_rewrite(ckpt.path)
        buffers = dict(module.named_buffers())
        for name, value in prepared.items():
            buffers[name].copy_(value)

        def write(f: Any) -> None:
            import torch

            torch.jit.save(module, f, _extra_files=extra)
    else:  # pragma: no cover - read_checkpoint knows no other format
        raise BnauditError(f"{ckpt.path}: cannot write format {ckpt.format}")
    atomic_write(output, write, force=force)


def _prepare_updates(ckpt: Checkpoint, updates: Mapping[str, Any]) -> dict[str, Any]:
    """Validate `updates` against the checkpoint and cast them to the stored dtypes."""
    import torch

    prepared: dict[str, Any] = {}
    for name, value in updates.items():
        layer, _, leaf = name.rpartition(".")
        if leaf not in _WRITABLE_LEAVES:
            raise ValueError(f"save_like only writes {', '.join(_WRITABLE_LEAVES)}, not {name!r}")
        ref = ckpt.tensors.get(name)
        if ref is None:
            raise ValueError(f"{name!r} is not a tensor of {ckpt.path}")
        dtype = getattr(torch, ref.dtype)
        tensor = torch.as_tensor(value).detach().to("cpu")
        if tuple(tensor.shape) != ref.shape:
            if leaf == "num_batches_tracked" and tensor.numel() == 1 == math.prod(ref.shape):
                tensor = tensor.reshape(ref.shape)
            else:
                raise ValueError(f"{name!r}: new shape {tuple(tensor.shape)} differs from stored {ref.shape}")
        cast = tensor.to(dtype)
        if cast.is_floating_point() and not bool(torch.isfinite(cast).all()):
            bad = int((~torch.isfinite(cast)).sum())
            raise BnauditError(
                f"layer {layer}: refusing to write a non-finite {leaf} ({bad} of {cast.numel()} channel(s) "
                f"NaN or Inf in {ref.dtype})"
            )
        prepared[name] = cast.contiguous()
    return prepared


def _tensor_bytes(tensor: Any) -> bytes:
    """A tensor's bytes in memory order (little-endian here), without the numpy bridge
    (which would import numpy: start-up time)."""
    import ctypes

    t = tensor.detach().cpu().contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()) if t.numel() else b""


def _write_safetensors_like(
    ckpt: Checkpoint, prepared: dict[str, Any], provenance: Mapping[str, Any] | None, f: Any
) -> None:
    if sys.byteorder != "little":  # pragma: no cover - safetensors is little-endian
        raise BnauditError("writing safetensors needs a little-endian machine")
    stored = read_safetensors_header(ckpt.path)
    header = stored.entries
    with open(ckpt.path, "rb") as src:
        src.seek(stored.data_start)
        metadata = dict(stored.metadata)
        if provenance is not None:
            metadata["bnaudit"] = json.dumps(dict(provenance), sort_keys=True)
        new_header = {"__metadata__": metadata, **header} if metadata else header
        raw = json.dumps(new_header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)  # keep the data section 8-byte aligned, as safetensors does
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        data_start = f.tell()
        while chunk := src.read(16 * 1024 * 1024):
            f.write(chunk)
    for name, tensor in prepared.items():
        begin, end = header[ckpt.prefix + name]["data_offsets"]
        data = _tensor_bytes(tensor)
        if len(data) != end - begin:  # pragma: no cover - _prepare_updates checked shape and dtype
            raise ValueError(f"{name}: {len(data)} bytes for a slot of {end - begin}")
        f.seek(data_start + begin)
        f.write(data)
    f.seek(0, os.SEEK_END)


def _apply_to_container(ckpt: Checkpoint, obj: Any, prepared: dict[str, Any]) -> None:
    """Replace the updated entries of the state dict at `ckpt.key` inside `obj`."""
    import torch

    target = obj
    for part in ckpt.key.split("/") if ckpt.key else []:
        target = target[part]
    if isinstance(target, torch.nn.Module):
        with torch.no_grad():
            for name, value in prepared.items():
                target.get_buffer(ckpt.prefix + name).copy_(value)
        return
    for name, value in prepared.items():
        full = ckpt.prefix + name
        old = target[full]
        # a new tensor rather than an in-place copy: storage shared with other
        # entries (an EMA copy, a tied buffer) must not change with it
        target[full] = value.to(old.device)


def _load_script_for_rewrite(path: str) -> tuple[Any, dict[str, bytes]]:
    """A TorchScript archive as a module, with its extra files (kept on save)."""
    import torch

    with zipfile.ZipFile(path) as archive:
        names = [
            n.split("/extra/", 1)[1]
            for n in archive.namelist()
            if "/extra/" in n and n.count("/") >= 2 and not n.endswith("/")
        ]
    extra = dict.fromkeys(names, b"")
    try:
        module = torch.jit.load(path, map_location="cpu", _extra_files=extra)  # type: ignore[no-untyped-call]  # torch: torch.jit.load is unannotated
    except Exception as exc:
        raise BnauditError(
            f"{path}: cannot load TorchScript archive ({exception_line(exc, with_type=False)})"
        ) from None
    return module, extra

"""`read_checkpoint`: a path in, a `Checkpoint` of lazy tensors out, whatever the format.

The one entry point for readers: sniff, dispatch to the format's reader, pick the
state dict inside a container and strip wrapper prefixes. safetensors, TorchScript, torch.save
files, torch.export (.pt2) archives and torch.distributed.checkpoint folders (formats/dcp.py)
are read without torch (every pickle through the one restricted unpickler,
formats/unpickle.py; torch.load only with --trust-pickle), ONNX models with the `onnx`
package (an optional extra).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from bnaudit.errors import BnauditError
from bnaudit.formats.classify import NotModelWeights, kind_from_object, kind_from_refusal
from bnaudit.formats.containers import checkpoint_from_object, find_state_dicts, strip_wrapper_prefix
from bnaudit.formats.model import Checkpoint
from bnaudit.formats.safetensors import read_safetensors
from bnaudit.formats.shards import is_index, read_sharded, shard_position
from bnaudit.formats.sniff import STATISTICS_FORMAT, sniff_opening

if TYPE_CHECKING:
    import zipfile


def read_checkpoints(path: str, trust_pickle: bool = False) -> list[Checkpoint]:
    """Every model state dict of the file at `path`, each as the `Checkpoint` `--key` would
    give: the one `read_checkpoint` picks first, then the other state dicts of its container
    (an EMA copy beside the live model: timm's `state_dict` and `state_dict_ema`) in the
    container's order. The file is read once. Files of one state dict (every format but a
    torch.save container) give one."""
    return _read(path, None, trust_pickle, every=True)


def read_checkpoint(path: str, key: str | None = None, trust_pickle: bool = False) -> Checkpoint:
    """Open `path` read-only and return its (chosen) state dict as lazy tensors.

    A shard index (`*.safetensors.index.json`, `*.bin.index.json`) is read as the one
    checkpoint its shards make; a file that is recognisably not model weights (optimizer,
    scheduler, RNG state, training arguments) raises `NotModelWeights`.
    """
    return _read(path, key, trust_pickle, every=False)[0]


def _read(path: str, key: str | None, trust_pickle: bool, every: bool) -> list[Checkpoint]:
    """`read_checkpoint` (`every` False: the one state dict), or `read_checkpoints`."""
    if is_index(path):
        if key is not None:
            raise BnauditError(f"{path}: --key does not apply to sharded checkpoints")
        return [read_sharded(path, trust_pickle=trust_pickle)]
    fmt, archive = sniff_opening(path)
    if archive is not None:  # a torch.save zip archive, its directory parsed once
        with archive:
            return _read_torch_save_all(path, fmt, trust_pickle, archive, key, every)
    if fmt in _SINGLE_FORMATS:
        return [_read_single(path, fmt, key)]
    return _read_torch_save_all(path, fmt, trust_pickle, None, key, every)


# formats that hold one state dict (a torch.save file is a container of any number)
_SINGLE_FORMATS = ("safetensors", "onnx", "pt2", "dcp", "torchscript")


def _read_single(path: str, fmt: str, key: str | None) -> Checkpoint:
    """A file of one state dict: safetensors, ONNX, .pt2, DCP, TorchScript."""
    if fmt == "safetensors":
        tensors, metadata = read_safetensors(path)
        if metadata.get("format") == STATISTICS_FORMAT:  # recalibrate --stats-out's: statistics, no weights
            raise NotModelWeights(path, "a bnaudit statistics file (for `bnaudit merge`)")
        if key is not None:
            raise BnauditError(f"{path}: --key does not apply to safetensors files")
        ckpt = Checkpoint(path, fmt, tensors, metadata=metadata, shard_of=shard_position(path))
        return strip_wrapper_prefix(ckpt)
    if fmt == "onnx":
        from bnaudit.formats.onnx import read_onnx

        if key is not None:
            raise BnauditError(f"{path}: --key does not apply to ONNX models")
        return read_onnx(path)
    if fmt == "pt2":
        from bnaudit.formats.pt2 import read_pt2

        if key is not None:
            raise BnauditError(f"{path}: --key does not apply to .pt2 archives")
        return read_pt2(path)
    if fmt == "dcp":
        from bnaudit.formats.dcp import read_dcp

        return read_dcp(path, key)
    from bnaudit.formats.torchscript import read_torchscript, script_metadata

    tensors, modules = read_torchscript(path)
    if key is not None:
        raise BnauditError(f"{path}: --key does not apply to TorchScript archives")
    return Checkpoint(path, fmt, tensors, modules=modules, holds_module=True, metadata=script_metadata(path))


def _read_torch_save_all(
    path: str,
    fmt: str,
    trust_pickle: bool,
    opened: zipfile.ZipFile | None = None,
    key: str | None = None,
    every: bool = True,
) -> list[Checkpoint]:
    """A torch.save file (zip or legacy), read once by the restricted unpickler (torch.load
    with --trust-pickle only): the checkpoint `key` chooses (the one `choose_state_dict`
    picks without it), and with `every` the container's other state dicts after it, each
    under its own key."""
    # here: the unpickler (and zipfile's machinery) cost start-up that inspect of a
    # safetensors file never needs
    from bnaudit.formats.standins import stand_ins_in, with_stand_ins_checked

    if trust_pickle:
        from bnaudit.formats.torchobjects import load_torch_save

        obj = load_torch_save(path, fmt, trust_pickle=True)
    else:
        from bnaudit.formats.torchsave import read_torch_save

        try:
            obj = read_torch_save(path, fmt == "torch-legacy", opened=opened).value
        except BnauditError:
            what = kind_from_refusal(path)
            if what is None:
                raise
            raise NotModelWeights(path, what) from None

    # Pickled training arguments are known by their name and the classes the pickle names
    # (left as stand-ins): asked only where the file is not plainly a model.
    def by_name() -> str | None:
        return kind_from_refusal(path) if not trust_pickle and stand_ins_in(obj) else None

    candidates = find_state_dicts(obj)
    if not candidates:  # with or without --key: nothing here is a model
        what = by_name() or kind_from_object(path, obj)
        if what is not None:
            raise NotModelWeights(path, what)
    try:
        ckpt = with_stand_ins_checked(path, obj, lambda: checkpoint_from_object(path, fmt, obj, key, candidates))
    except NotModelWeights:
        raise
    except BnauditError:
        what = by_name()
        if what is None:
            raise
        raise NotModelWeights(path, what) from None
    ckpt.shard_of = shard_position(path)
    found = [ckpt]
    if every and len(candidates) > 1:
        for other in [k for k in candidates if k != (ckpt.key or "")]:

            def build(chosen: str = other) -> Checkpoint:
                return checkpoint_from_object(path, fmt, obj, chosen, candidates)

            entry = with_stand_ins_checked(path, obj, build)
            entry.shard_of = ckpt.shard_of
            found.append(entry)
    return found

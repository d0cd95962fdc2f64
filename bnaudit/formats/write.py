"""`save_like`: write a checkpoint again in its own format with new BN statistics.

Only `running_mean`, `running_var` and `num_batches_tracked` are ever replaced; every
other tensor, key and piece of metadata stays as it was, so a recalibrated file drops in
where the original was. Separate from the readers: writing needs torch, reading does not.
Safetensors files are written by the `safetensors` package (`safetensors.torch.save`), so
each is a file the reference wrote; only the atomic naming (`atomic_write`) is bnaudit's.
"""

from __future__ import annotations

import json
import math
import os
import zipfile
from collections.abc import Mapping
from typing import Any

from bnaudit.errors import BnauditError
from bnaudit.formats.atomic import atomic_folder, atomic_write, check_folder_output, check_output, write_file
from bnaudit.formats.classify import SCANNED_NAMES
from bnaudit.formats.model import Checkpoint, stored_key
from bnaudit.formats.provenance import MODULE_RECORD_ATTRIBUTE, RECORD_KEY, RecalibrationRecord, statistics_digest
from bnaudit.formats.safetensors import SAFETENSORS_DTYPE_CODES
from bnaudit.formats.shards import ShardIndex, is_index, read_index
from bnaudit.formats.sniff import CHECKPOINT_SUFFIXES, sniff_format
from bnaudit.formats.torchobjects import load_torch_save, torch_objects
from bnaudit.formats.torchscript import RECORD_EXTRA_FILE
from bnaudit.text import exception_line, plural

# The only tensors bnaudit ever writes: the running statistics of a BN layer.
_WRITABLE_LEAVES = ("running_mean", "running_var", "num_batches_tracked")


def save_like(
    ckpt: Checkpoint,
    updates: Mapping[str, Any],
    output: str,
    force: bool = False,
    provenance: RecalibrationRecord | None = None,
    trust_pickle: bool = False,
) -> None:
    """Write `ckpt`'s file again to `output`, with `updates` applied, in the format
    `output_format` gives (its own, unless the output's name says safetensors or torch).

    `updates` maps names of the chosen state dict (as `ckpt.tensors` names them, the
    wrapper prefix stripped) to new values for `running_mean`, `running_var` and
    `num_batches_tracked` buffers; each is cast to the stored dtype and must keep the
    stored shape. Everything else stays as it is:

      safetensors   every tensor read with `safetensors.safe_open` and written again by
                    the package, the updated ones replaced, with `__metadata__` kept plus
                    a `bnaudit` entry (the provenance as JSON): for a file the package
                    wrote, only the updated tensors' bytes and the header change
      torch-zip/legacy  the whole container reloaded (same allow-list as reading) and
                    saved in the same serialization; only the selected state dict's
                    entries replaced; no new keys: the provenance goes into the state
                    dict's own `_metadata` (root entry, key "bnaudit"), which torch.save
                    and torch.load(weights_only=True) keep and load_state_dict ignores
      torchscript   the archive loaded, buffers set, saved with its extra files and the
                    provenance as the extra file `bnaudit.json`
      dcp           a torch.distributed.checkpoint folder: every tensor and object saved
                    again by `dcp.save` in one process, the provenance in `bnaudit.json`
                    beside its files (`_write_dcp_like`)

    Across formats: to `.safetensors` from a torch file, the chosen state dict's tensors
    (names as stored, contiguous) with `{"format": "pt", "bnaudit": provenance}` as
    metadata, refused before any work by `check_writable` when the container holds
    anything else; to a torch name from safetensors, a torch zip of all its tensors with
    the provenance in `_metadata`.

    `recalibrate` puts `statistics_digests` into the provenance: inspect trusts the
    record for a layer only while its stored statistics match.

    A sharded checkpoint (`ckpt.path` its index) is written as a folder `output` laid out
    like its own (`_save_sharded_like`): the shards holding updated statistics rewritten
    in their format, the others and the folder's non-checkpoint files (config.json, ...)
    copied byte for byte, the index with the same weight map, `total_size` recomputed and
    the provenance in its metadata.

    Written atomically (see `atomic_write`, `atomic_folder`); the input is never opened
    for writing. Non-finite statistics are refused, naming the layer.
    """
    if ckpt.shards:
        check_destination(output, ckpt.path, force)
        check_writable(ckpt, output, trust_pickle)
        record = provenance.to_json() if provenance is not None else None
        _save_sharded_like(ckpt, _prepare_updates(ckpt, updates), output, force, record, trust_pickle)
        return
    check_output(output, ckpt.path, force)
    target = output_format(ckpt.format, output)
    check_writable(ckpt, output, trust_pickle)
    prepared = _prepare_updates(ckpt, updates)
    record = provenance.to_json() if provenance is not None else None
    if ckpt.format == "safetensors" and target == "safetensors":

        def write(f: Any) -> None:
            _rewrite_safetensors(ckpt.path, {ckpt.prefix + n: v for n, v in prepared.items()}, record, f)
    elif ckpt.format == "safetensors":  # a torch zip of the same tensors
        obj = _safetensors_as_state_dict(ckpt)
        _apply_to_container(ckpt, obj, prepared)
        if record is not None:
            obj = _attach_record(ckpt, obj, record)

        def write(f: Any) -> None:
            import torch

            torch.save(obj, f)
    elif ckpt.format in ("torch-zip", "torch-legacy"):
        obj = load_torch_save(ckpt.path, ckpt.format, trust_pickle=trust_pickle)
        _apply_to_container(ckpt, obj, prepared)
        if target == "safetensors":
            tensors = _state_dict_at(obj, stored_key(ckpt))

            def write(f: Any) -> None:
                write_safetensors(tensors, {"format": "pt", **({RECORD_KEY: record} if record else {})}, f)
        else:
            if record is not None:
                obj = _attach_record(ckpt, obj, record)

            def write(f: Any) -> None:
                import torch

                torch.save(obj, f, _use_new_zipfile_serialization=ckpt.format == "torch-zip")
    elif ckpt.format == "torchscript":
        module, extra = _load_script_for_rewrite(ckpt.path)
        buffers = dict(module.named_buffers())
        for name, value in prepared.items():
            buffers[name].copy_(value)
        if target == "safetensors":
            tensors = dict(module.state_dict())

            def write(f: Any) -> None:
                write_safetensors(tensors, {"format": "pt", **({RECORD_KEY: record} if record else {})}, f)
        else:
            if record is not None:
                extra[RECORD_EXTRA_FILE] = record.encode("utf-8")

            def write(f: Any) -> None:
                import torch

                torch.jit.save(module, f, _extra_files=extra)
    elif ckpt.format == "dcp":
        _write_dcp_like(ckpt, prepared, record, output, force)
        return
    else:  # pragma: no cover - read_checkpoint knows no other format
        raise BnauditError(f"{ckpt.path}: cannot write format {ckpt.format}")
    atomic_write(output, write, force=force)


def _write_dcp_like(ckpt: Checkpoint, prepared: dict[str, Any], record: str | None, output: str, force: bool) -> None:
    """A torch.distributed.checkpoint folder written again by `dcp.save` in this one process
    (no process group: `no_dist`), every tensor and object of the input (optimizer state
    included) under its own key path, the updated buffers replaced; DCP reshards it on
    load, so FSDP or DDP models of any world size `dcp.load` it. Pickled objects are read
    back by the restricted unpickler (tensors and plain data) or the write is refused. The
    provenance goes into `bnaudit.json` beside DCP's files (DCP reads only what its
    metadata names). Built in a temporary folder and renamed (`atomic_folder`)."""
    import warnings

    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    from bnaudit.formats.dcp import RECORD_FILE, nested_state_dict, read_dcp_layout, stored_object, tensor_ref

    layout = read_dcp_layout(ckpt.path)
    values: dict[str, Any] = {fqn: tensor_ref(layout.folder, t).to_torch() for fqn, t in layout.tensors.items()}
    for fqn, chunk in layout.objects.items():
        try:
            values[fqn] = torch_objects(stored_object(layout.folder, chunk, fqn), ckpt.path)
        except BnauditError as exc:
            raise BnauditError(
                f"{ckpt.path}: cannot be written back: the object '{fqn}' is not plain data "
                f"({str(exc).split(': ', 1)[-1]})"
            ) from None
    state = nested_state_dict(layout, values)
    target = state
    for part in _key_parts(ckpt):
        target = target[part]
    for name, value in prepared.items():
        target[ckpt.prefix + name] = value

    def build(folder: str) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP's notes on saving without a process group
            dcp_save(state, checkpoint_id=folder, no_dist=True)
        if record is not None:
            with open(os.path.join(folder, RECORD_FILE), "w", encoding="utf-8") as f:
                f.write(record)

    atomic_folder(output, build, force=force)


# Output names whose format bnaudit knows; any other name keeps the input's format.
_TORCH_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin", ".tar")


def output_format(input_format: str, output: str) -> str:
    """The format `save_like` writes to `output`: `.safetensors` -> safetensors; a torch
    suffix (.pt .pth .ckpt .bin .tar) -> a torch zip for a safetensors input, else the
    input's own torch format (zip, legacy or TorchScript); any other name -> the input's."""
    suffix = os.path.splitext(output)[1].lower()
    if suffix == ".safetensors":
        return "safetensors"
    if suffix in _TORCH_SUFFIXES and input_format == "safetensors":
        return "torch-zip"
    return input_format


def check_destination(output: str, source: str, force: bool = False) -> None:
    """Refuse, before any work, an output `save_like` could not write for the checkpoint
    at `source`: a folder for a shard index (`check_folder_output`), a file otherwise
    (`check_output`)."""
    if is_index(source):
        check_folder_output(output, os.path.dirname(source) or ".", os.path.basename(source), force)
    else:
        check_output(output, source, force)


def check_writable(ckpt: Checkpoint, output: str, trust_pickle: bool = False) -> None:
    """Refuse, before any work, a checkpoint `save_like` could not write to `output`: a
    torch container that `output`'s format (safetensors: named tensors and string metadata
    only) cannot hold, naming what does not fit, and a container read with stand-ins
    (their objects were never loaded, so they cannot be saved again)."""
    suffix = os.path.splitext(output)[1].lower()
    if ckpt.format == "dcp" and suffix in (".safetensors", *_TORCH_SUFFIXES):
        raise BnauditError(
            f"{output}: a torch.distributed.checkpoint folder is written back as a folder: name the output "
            "without a file suffix (torch's dcp_to_torch_save converts the result to one file)"
        )
    if ckpt.not_loaded and not trust_pickle:
        raise BnauditError(
            f"{ckpt.path}: cannot be written back: it holds objects of classes that were not loaded "
            f"({ckpt.not_loaded[0]}); pass --trust-pickle if you trust the file, or save the state dict alone"
        )
    if (
        ckpt.shards
        or output_format(ckpt.format, output) != "safetensors"
        or ckpt.format in ("safetensors", "torchscript")
    ):
        return  # shards are written back each in its own format
    if ckpt.holds_module:
        raise BnauditError(
            f"{output}: a safetensors file cannot hold the pickled nn.Module of {ckpt.path} (only its "
            "tensors); write a torch file (.pt), or save model.state_dict() first"
        )
    obj = load_torch_save(ckpt.path, ckpt.format, trust_pickle=trust_pickle)
    misfits = []
    parts = _key_parts(ckpt)
    node = obj
    for depth, part in enumerate(parts):  # the container's entries beside the path to the state dict
        if isinstance(node, Mapping):
            misfits += ["/".join([*parts[:depth], str(k)]) for k in node if k != part]
        node = node[part]
    if isinstance(node, Mapping):
        misfits += [
            "/".join([*parts, str(k)]) for k, v in node.items() if not (isinstance(k, str) and _is_torch_tensor(v))
        ]
    if misfits:
        shown = ", ".join(repr(m) for m in misfits[:8]) + (f" and {len(misfits) - 8} more" if len(misfits) > 8 else "")
        raise BnauditError(
            f"{output}: a safetensors file holds named tensors only; {ckpt.path} also holds {shown}: "
            "write a torch file (.pt) instead, or save the state dict alone first"
        )


def _is_torch_tensor(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def _key_parts(ckpt: Checkpoint) -> list[str]:
    """The key path of the mapping storing `ckpt`'s tensors (formats.model.stored_key)."""
    key = stored_key(ckpt)
    return key.split("/") if key else []


def _state_dict_at(obj: Any, key: str | None) -> dict[str, Any]:
    for part in key.split("/") if key else []:
        obj = obj[part]
    return dict(obj)


def _safetensors_as_state_dict(ckpt: Checkpoint) -> Any:
    """The tensors of a safetensors checkpoint, all of them, as a torch state dict (names
    as stored: the wrapper prefix kept; in the order of their bytes in the file)."""
    from collections import OrderedDict

    return OrderedDict(_read_all_safetensors(ckpt.path)[0])


def _read_all_safetensors(path: str) -> tuple[dict[str, Any], dict[str, str]]:
    """Every tensor of a safetensors file (torch, in file order) and its metadata, read by
    the `safetensors` package."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt") as f:
            return {name: f.get_tensor(name) for name in f.offset_keys()}, dict(f.metadata() or {})
    except (SafetensorError, OSError) as exc:  # changed since it was read
        raise BnauditError(f"{path}: cannot read safetensors file ({exception_line(exc, with_type=False)})") from None


def write_safetensors(tensors: Mapping[str, Any], metadata: Mapping[str, str], f: Any) -> None:
    """Write `tensors` (torch, any device and layout) with `metadata` as `__metadata__` (none
    when empty) into the new, empty file `f`: the bytes of `safetensors.torch.save`. Tensors
    sharing storage (tied weights, an EMA copy) are written once per name, as copies,
    where the package would refuse them.

    `save`, not `save_file`: the package's `save_file` writes a temporary file of its own
    and renames it over the name given, which would bypass `atomic_write` (an unnamed
    file, never left behind). The cost is one copy of the file's bytes in memory.
    """
    from safetensors.torch import save

    f.write(save(_standalone(tensors), metadata=dict(metadata) or None))


def _standalone(tensors: Mapping[str, Any]) -> dict[str, Any]:
    """`tensors` on the CPU, contiguous, each name with storage of its own (a copy for the
    second and later names of a shared storage), dtypes checked against safetensors'."""
    import torch

    out: dict[str, Any] = {}
    seen: set[int] = set()
    for name, tensor in tensors.items():
        t = tensor.detach().to("cpu")
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in SAFETENSORS_DTYPE_CODES:
            raise BnauditError(f"tensor '{name}': dtype {dtype} has no safetensors equivalent")
        storage = t.untyped_storage().data_ptr()
        if not t.is_contiguous() or (storage and storage in seen):
            t = t.clone(memory_format=torch.contiguous_format)
        seen.add(storage)
        out[name] = t
    return out


def statistics_digests(ckpt: Checkpoint, updates: Mapping[str, Any], layers: list[str]) -> dict[str, str]:
    """Layer -> `statistics_digest` of the statistics `save_like(ckpt, updates, ...)` will
    store for it (cast to the stored dtype, as written), for each of `layers` it updates."""
    prepared = _prepare_updates(ckpt, updates)
    digests = {}
    for layer in layers:
        mean, var = prepared.get(f"{layer}.running_mean"), prepared.get(f"{layer}.running_var")
        if mean is not None and var is not None:
            digests[layer] = statistics_digest(mean.double().reshape(-1).tolist(), var.double().reshape(-1).tolist())
    return digests


def _attach_record(ckpt: Checkpoint, obj: Any, record: str) -> Any:
    """`obj` with `record` in the `_metadata` of the state dict at `ckpt.key` (root entry
    "", key "bnaudit"); a plain dict becomes an OrderedDict to carry it (same keys, and
    `load_state_dict` takes either). A pickled nn.Module keeps it as the string attribute
    `MODULE_RECORD_ATTRIBUTE`. Returns the
    (possibly new) root object."""
    from collections import OrderedDict

    import torch

    parts = _key_parts(ckpt)
    parent, target = None, obj
    for part in parts:
        parent, target = target, target[part]
    if isinstance(target, torch.nn.Module):  # a plain string attribute: pickled with the module
        setattr(target, MODULE_RECORD_ATTRIBUTE, record)
        return obj
    if not isinstance(target, dict):
        return obj
    if not hasattr(target, "__dict__"):  # a plain dict takes no attribute
        target = OrderedDict(target)
        if parent is None:
            obj = target
        else:
            parent[parts[-1]] = target
    metadata = getattr(target, "_metadata", None)
    if not isinstance(metadata, dict):
        metadata = OrderedDict()
    root = dict(metadata.get("", {})) if isinstance(metadata.get(""), dict) else {}
    root[RECORD_KEY] = record
    metadata[""] = root
    target._metadata = metadata
    return obj


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
                f"layer {layer}: refusing to write a non-finite {leaf} ({bad} of {plural(cast.numel(), 'channel')} "
                f"NaN or Inf in {ref.dtype})"
            )
        prepared[name] = cast.contiguous()
    return prepared


def _rewrite_safetensors(source: str, updates: Mapping[str, Any], record: str | None, f: Any) -> None:
    """The safetensors file `source` again, written by the package: `updates` (stored name ->
    tensor of the stored dtype and shape) in place of their tensors and `record` as the
    `bnaudit` metadata (the file's other metadata kept)."""
    tensors, metadata = _read_all_safetensors(source)
    tensors.update(updates)
    if record is not None:
        metadata[RECORD_KEY] = record
    write_safetensors(tensors, metadata, f)


def _save_sharded_like(
    ckpt: Checkpoint,
    prepared: Mapping[str, Any],
    output: str,
    force: bool,
    record: str | None,
    trust_pickle: bool,
) -> None:
    """A sharded checkpoint written again as the folder `output`, laid out like the input's
    (what transformers' `save_pretrained` writes and `from_pretrained` reads):

      shards        the same file names; a shard holding updated statistics rewritten in its
                    own format (safetensors: `_rewrite_safetensors`, the record in its
                    metadata; torch: reloaded, entries replaced, saved again), every other
                    shard copied byte for byte
      index         the input's JSON with the same `weight_map`, `metadata.total_size` the
                    bytes of every tensor stored (sum of numel x element size), and
                    `metadata.bnaudit` the provenance record; written as transformers writes
                    it (indent 2, sorted keys, final newline)
      other files   the regular files beside the index that are no checkpoint (config.json,
                    tokenizer and generation configs, README.md) copied, so the folder loads
                    as the input did; checkpoints of other series and subfolders are not
    """
    import shutil

    import torch

    index = read_index(ckpt.path)
    folder = os.path.dirname(ckpt.path) or "."
    by_shard: dict[str, dict[str, Any]] = {}
    for name, value in prepared.items():
        stored = ckpt.prefix + name
        by_shard.setdefault(index.weight_map[stored], {})[stored] = value
    with open(ckpt.path, encoding="utf-8") as f:
        document = json.load(f)  # read_index validated it
    sizes = {
        dtype: torch.empty((), dtype=getattr(torch, dtype)).element_size()
        for dtype in {r.dtype for r in ckpt.tensors.values()}
    }
    document["metadata"] = {
        **(document.get("metadata") or {}),
        "total_size": sum(math.prod(r.shape) * sizes[r.dtype] for r in ckpt.tensors.values()),
        **({RECORD_KEY: record} if record is not None else {}),
    }

    def fill(temp: str) -> None:
        for shard in index.shards:
            target = os.path.join(temp, os.path.relpath(shard, folder))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            updates = by_shard.get(shard)
            if not updates:
                shutil.copyfile(shard, target)
            elif sniff_format(shard) == "safetensors":
                with open(target, "wb") as out:
                    _rewrite_safetensors(shard, updates, record, out)
            else:
                _rewrite_torch_shard(shard, updates, target, trust_pickle)
        for name in _companions(folder, index):
            shutil.copyfile(os.path.join(folder, name), os.path.join(temp, name))
        with open(os.path.join(temp, os.path.basename(ckpt.path)), "w", encoding="utf-8") as out:
            out.write(json.dumps(document, indent=2, sort_keys=True) + "\n")

    atomic_folder(output, fill, force=force)


def _rewrite_torch_shard(shard: str, updates: Mapping[str, Any], target: str, trust_pickle: bool) -> None:
    """A torch.save shard (a plain state dict) saved again with `updates` replacing its entries."""
    import torch

    fmt = sniff_format(shard)
    state = load_torch_save(shard, fmt, trust_pickle=trust_pickle)
    for name, value in updates.items():
        state[name] = value.to(state[name].device)  # a new tensor: the loaded one maps the input
    # through a Python file: an OS error (no space, quota) is then named, not torch's own
    write_file(target, lambda f: torch.save(state, f, _use_new_zipfile_serialization=fmt == "torch-zip"))


def _companions(folder: str, index: ShardIndex) -> list[str]:
    """Names of the regular files beside a shard index that belong to no checkpoint."""
    shards = {os.path.realpath(s) for s in index.shards}
    return [
        name
        for name in sorted(os.listdir(folder))
        if os.path.isfile(os.path.join(folder, name))
        and not name.lower().endswith(CHECKPOINT_SUFFIXES)
        and not is_index(name)
        and not SCANNED_NAMES.match(name)
        and os.path.realpath(os.path.join(folder, name)) not in shards
    ]


def _apply_to_container(ckpt: Checkpoint, obj: Any, prepared: dict[str, Any]) -> None:
    """Replace the updated entries of the state dict at `ckpt.key` inside `obj`."""
    import torch

    target = obj
    for part in _key_parts(ckpt):
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

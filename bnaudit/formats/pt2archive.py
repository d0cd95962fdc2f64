"""torch.export archives (`.pt2`): the zip, its JSON records and raw tensor bytes, torch-free.

Layout written by `torch.export.save` (torch 2.13; constants in torch/csrc/export/
pt2_archive_constants.h, records in torch/_export/serde/schema.py), every entry under one
root folder:

  archive_format                      "pt2": what makes a zip a PT2 archive
  byteorder                           "little" (raw tensor bytes are native-endian)
  models/<name>.json                  the ExportedProgram: graph nodes and graph signature
  data/weights/<name>_weights_config.json    parameter/buffer FQN -> PayloadMeta
  data/constants/<name>_constants_config.json  lifted constants, custom objects
  data/weights/weight_N, data/constants/tensor_N   raw storage bytes
  data/weights/<name>.pt, data/constants/<name>.pt  legacy weights: a pickle
  data/sample_inputs/<name>.pt        the example inputs: a pickle
  data/aotinductor/...                AOTInductor's compiled code and its weights

A PayloadMeta names a storage file (`path_name`) and how the tensor lies in it: dtype
(schema.ScalarType), sizes, strides and storage_offset in elements. Element i of a tensor
of sizes (s_0..s_k) and strides (t_0..t_k) lies at item offset + sum_j i_j * t_j of the
storage, so the tensor fits when offset + sum_j (s_j - 1) * t_j < items in the file.
`use_pickle: true` (tensor subclasses), `custom_obj_*` / `opaque_obj_*` and every `.pt`
entry are pickles: named here, never read.
"""

from __future__ import annotations

import json
import math
import zipfile
from dataclasses import dataclass, field
from typing import Any

from bnaudit.errors import BnauditError
from bnaudit.formats.model import EXPANDED_LIMIT, STORAGE_ITEMSIZE, TensorRef, claim_too_large, decode_values
from bnaudit.formats.sniff import check_zip_sizes
from bnaudit.text import exception_line, shown_value

ARCHIVE_FORMAT = "archive_format"
MODELS_DIR = "models/"
WEIGHTS_DIR = "data/weights/"
CONSTANTS_DIR = "data/constants/"
AOTINDUCTOR_DIR = "data/aotinductor/"
SAMPLE_INPUTS_DIR = "data/sample_inputs/"

# schema.ScalarType -> torch dtype name (the numeric types a weight can have)
SCALAR_TYPES = {
    1: "uint8",
    2: "int8",
    3: "int16",
    4: "int32",
    5: "int64",
    6: "float16",
    7: "float32",
    8: "float64",
    12: "bool",
    13: "bfloat16",
}
_STRIDED = 7  # schema.Layout.Strided
# JSON records larger than this are refused: a graph of 10^5 nodes is ~100 MB
_JSON_LIMIT = 512 * 1024 * 1024
# storage files up to this size are read whole (their CRC-32 checked); larger ones in the range a tensor spans
_WHOLE_READ = 64 * 1024 * 1024


@dataclass(frozen=True)
class Payload:
    """One entry of a weights or constants config: `fqn` stored in `entry` (the archive
    member), or a pickle (`pickled`), never read."""

    fqn: str
    entry: str
    pickled: bool
    ref: TensorRef | None  # None for a pickle, or a layout bnaudit does not read
    why_not: str = ""  # why `ref` is None


@dataclass
class Pt2Archive:
    """A validated PT2 archive: its root folder, its programs' JSON and their payloads.

    `payloads[model]` maps each parameter / buffer / constant FQN to its Payload;
    `not_read` names every pickle and compiled artefact left alone, one note each."""

    path: str
    root: str
    programs: dict[str, dict[str, Any]] = field(default_factory=dict)
    payloads: dict[str, dict[str, Payload]] = field(default_factory=dict)
    not_read: list[str] = field(default_factory=list)
    aotinductor: bool = False


def _fail(path: str, what: str) -> BnauditError:
    return BnauditError(f"{path}: torn or inconsistent .pt2 archive: {what}")


def _plain_name(path: str, name: Any, where: str) -> str:
    """A storage file name from a config: one path component, nothing that leaves its folder."""
    if not isinstance(name, str) or not name or name in (".", "..") or any(c in name for c in "/\\\x00:"):
        raise _fail(path, f"{where} names the storage file {str(name)[:100]!r}, not a file in its folder")
    return name


def open_pt2(path: str) -> Pt2Archive:
    """Open and validate `path`; a torn, truncated or inconsistent archive is one line."""
    try:
        with zipfile.ZipFile(path) as zf:
            check_zip_sizes(path, zf)
            return _read(path, zf)
    except BnauditError:
        raise
    except Exception as exc:  # zipfile on forged bytes: BadZipFile, EOFError, zlib.error, ...
        raise BnauditError(f"{path}: damaged .pt2 archive ({exception_line(exc, with_type=False)})") from None


def _read(path: str, zf: zipfile.ZipFile) -> Pt2Archive:
    names = zf.namelist()
    if not names:
        raise _fail(path, "empty zip")
    root = names[0].split("/", 1)[0]
    for name in names:
        parts = name.split("/")
        if parts[0] != root or len(parts) < 2 or ".." in parts or name.startswith("/") or "\\" in name:
            raise _fail(path, f"entry {name[:120]!r} lies outside the root folder {root!r}")
    members = {n[len(root) + 1 :]: n for n in names}
    archive = Pt2Archive(path, root)

    def raw(member: str) -> bytes:
        return zf.read(members[member])

    def record(member: str) -> Any:
        info = zf.getinfo(members[member])
        if info.file_size > _JSON_LIMIT:
            raise _fail(path, f"{member} claims {info.file_size} bytes")
        try:
            return json.loads(raw(member))
        except (ValueError, RecursionError) as exc:
            raise _fail(path, f"{member} is not JSON ({exception_line(exc, with_type=False)})") from None

    if raw(ARCHIVE_FORMAT).strip() != b"pt2":
        raise _fail(path, "archive_format is not 'pt2'")
    if "byteorder" in members and raw("byteorder").strip() not in (b"little", b""):
        raise BnauditError(f"{path}: .pt2 archive written on a big-endian machine: not read")
    archive.aotinductor = any(m.startswith(AOTINDUCTOR_DIR) for m in members)
    if archive.aotinductor:
        archive.not_read.append(f"{AOTINDUCTOR_DIR} holds AOTInductor-compiled code and weights: not audited")
    for member in sorted(members):
        if member.startswith(SAMPLE_INPUTS_DIR) and not member.endswith("/"):
            archive.not_read.append(f"{member}: sample inputs (a pickle): not read")
    for member in sorted(members):
        if not (member.startswith(MODELS_DIR) and member.endswith(".json")):
            continue
        model = member[len(MODELS_DIR) : -len(".json")]
        if "/" in model:
            continue
        program = record(member)
        if not isinstance(program, dict) or not isinstance(program.get("graph_module"), dict):
            raise _fail(path, f"{member} holds no graph_module")
        archive.programs[model] = program
        payloads: dict[str, Payload] = {}
        for folder, config_name in ((WEIGHTS_DIR, "weights"), (CONSTANTS_DIR, "constants")):
            legacy = f"{folder}{model}.pt"
            config = f"{folder}{model}_{config_name}_config.json"
            if legacy in members:
                archive.not_read.append(f"{legacy}: legacy {config_name} (a pickle): not read")
            elif config in members:
                _payloads(path, archive, members, zf, record(config), config, folder, payloads)
            elif config_name == "weights":
                raise _fail(path, f"model {model!r} has neither {config} nor {legacy}")
        archive.payloads[model] = payloads
    if not archive.programs and not archive.aotinductor:
        raise _fail(path, "no models/<name>.json")
    return archive


def _payloads(
    path: str,
    archive: Pt2Archive,
    members: dict[str, str],
    zf: zipfile.ZipFile,
    config: Any,
    config_member: str,
    folder: str,
    out: dict[str, Payload],
) -> None:
    entries = config.get("config") if isinstance(config, dict) else None
    if not isinstance(entries, dict):
        raise _fail(path, f"{config_member} has no 'config' mapping")
    for fqn, meta in entries.items():
        where = f"{config_member} entry {str(fqn)[:100]!r}"
        if not isinstance(meta, dict):
            raise _fail(path, f"{where} is not an object")
        member = folder + _plain_name(path, meta.get("path_name"), where)
        if member not in members:
            raise _fail(path, f"{where} names {member}, which the archive does not hold")
        kind = meta["path_name"].split("_", 1)[0]
        if meta.get("use_pickle") or meta["path_name"].startswith(("custom_obj_", "opaque_obj_")):
            what = "a custom object" if kind in ("custom", "opaque") else "a pickled tensor"
            archive.not_read.append(f"{member} ({fqn}): {what}, not read")
            out.setdefault(fqn, Payload(fqn, member, True, None, f"{member} is {what} (not read)"))
            continue
        info = zf.getinfo(members[member])
        ref, why = _strided_ref(path, zf, members[member], info.file_size, fqn, meta.get("tensor_meta"), where)
        out.setdefault(fqn, Payload(fqn, member, False, ref, why))


def _ints(value: Any, what: str, path: str, where: str) -> list[int]:
    """`[{"as_int": n}, ...]` -> [n, ...]; a symbolic size is not a stored tensor's."""
    if not isinstance(value, list):
        raise _fail(path, f"{where} has no {what} list")
    out = []
    for item in value:
        n = item.get("as_int") if isinstance(item, dict) else None
        if not isinstance(n, int) or isinstance(n, bool):
            raise _fail(path, f"{where}: {what} {json.dumps(item)[:80]} is not an integer")
        out.append(n)
    return out


def _strided_ref(
    path: str, zf: zipfile.ZipFile, member: str, nbytes: int, fqn: str, meta: Any, where: str
) -> tuple[TensorRef | None, str]:
    """The TensorRef of one raw payload, checked to fit in its storage file."""
    if not isinstance(meta, dict):
        raise _fail(path, f"{where} has no tensor_meta")
    dtype = SCALAR_TYPES.get(meta.get("dtype"))  # type: ignore[arg-type]
    if dtype is None:
        return None, f"dtype code {meta.get('dtype')!s} is not a type bnaudit reads"
    if meta.get("layout", _STRIDED) != _STRIDED:
        return None, f"layout {meta.get('layout')!s} is not a strided tensor"
    sizes = _ints(meta.get("sizes"), "sizes", path, where)
    strides = _ints(meta.get("strides"), "strides", path, where)
    offset_list = _ints([meta.get("storage_offset", {"as_int": 0})], "storage_offset", path, where)
    offset = offset_list[0]
    if len(sizes) != len(strides) or any(s < 0 for s in sizes) or any(t < 0 for t in strides) or offset < 0:
        raise _fail(
            path,
            f"{where}: sizes {shown_value(sizes)}, strides {shown_value(strides)}, offset {offset} "
            "do not describe a tensor",
        )
    itemsize = STORAGE_ITEMSIZE[dtype]
    count = math.prod(sizes)
    if nbytes % itemsize:
        raise _fail(path, f"{where}: storage of {nbytes} bytes is not a whole number of {dtype} items")
    items = nbytes // itemsize
    if claim_too_large(count, items):
        # zero strides or an empty storage: decoding allocates the claim, bounded as torch.save's
        raise _fail(
            path,
            f"{where}: sizes {shown_value(sizes)} claim {count} elements, but "
            f"{member.split('/', 1)[-1]} holds {items} {dtype} items (at most {EXPANDED_LIMIT} may be expanded)",
        )
    last = offset + sum((s - 1) * t for s, t in zip(sizes, strides)) if count else -1
    if nbytes == 0 and count:
        # torch.export.load makes zeros of an empty record (a fake tensor saved without data)
        return TensorRef(fqn, tuple(sizes), dtype, lambda: [0.0 if dtype != "bool" else False] * count), ""
    if last >= items:
        raise _fail(
            path,
            f"{where}: sizes {shown_value(sizes)} x strides {shown_value(strides)} from offset {offset} reach item {last}, "
            f"but {member.split('/', 1)[-1]} holds {items} {dtype} items",
        )
    shape = tuple(sizes)
    archive_path = path

    # a storage shared by many tensors (a flat parameter buffer) is read in the range this one spans
    first = offset if nbytes > _WHOLE_READ else 0
    span = (last + 1 - first) * itemsize

    def read() -> list[float]:
        with zipfile.ZipFile(archive_path) as again:
            info = again.getinfo(member)
            if info.file_size != nbytes:
                raise BnauditError(f"{archive_path}: {member} changed while being read")
            with again.open(info) as f:
                if first:
                    f.seek(first * itemsize)
                    data = f.read(span)
                else:
                    data = f.read()[:span]  # read to its end: zipfile checks the entry's CRC-32
        if len(data) != span:
            raise BnauditError(f"{archive_path}: {member} ends before the tensor '{fqn}' does")
        values = decode_values(data, dtype)
        return [values[i - first] for i in _indices(shape, strides, offset)]

    return TensorRef(fqn, shape, dtype, read), ""


def _indices(shape: tuple[int, ...], strides: list[int], offset: int) -> list[int]:
    """Storage item of every element, row-major: offset + sum_j i_j * t_j."""
    positions = [offset]
    for size, stride in zip(shape, strides):
        positions = [p + i * stride for p in positions for i in range(size)]
    return positions if math.prod(shape) else []

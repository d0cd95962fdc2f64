"""Which format a checkpoint file is, from its first bytes, never from its name.

  zip (PK)          a torch.export archive (`pt2`) if its root folder's `archive_format`
                    says "pt2"; TorchScript if it has `*/constants.pkl` or `*/code/`,
                    torch.save if it has `data.pkl`; entries of those claiming more bytes
                    than the file are refused. A zip of none of these layouts (a wheel, a
                    zip of images) is `NotACheckpoint`, named for what it is from its
                    member names: its members are never read.
  byte 8 is `{`     safetensors (8-byte header length, then the JSON header; JSON
                    whitespace before the `{` allowed, as the safetensors package does)
  byte 0 is 0x80    a pickle (PROTO opcode, protocol 2 to 5): legacy (pre-1.6) torch.save
  protobuf fields   ONNX: a ModelProto starts with field 1 (ir_version, a varint: byte 0x08)
                    followed by further ModelProto fields of the right wire types
  a folder holding  a torch.distributed.checkpoint (DCP) folder (`dcp`): what dcp.save writes
  `.metadata`       (formats/dcp.py)
Bytes of none of these (a Core ML `weight.bin`, a text file named `.bin`) raise
`NotACheckpoint`: a folder scan lists such a file as skipped, while a file that claims a
format and breaks it (a damaged zip, an empty file: a save that never finished) stays an
error. Another folder, a pipe or a device is refused with one line. Only the first 64 bytes
(and a zip's directory) are read here, so a wrong file costs next to nothing.
"""

from __future__ import annotations

import os
import stat
from typing import TYPE_CHECKING

from bnaudit.errors import BnauditError
from bnaudit.text import exception_line

if TYPE_CHECKING:
    import zipfile

# torch.distributed.checkpoint's metadata file: the folder holding it is one checkpoint.
DCP_METADATA = ".metadata"

# The `format` metadata entry of a statistics file (`recalibrate --stats-out`, formats/bnstats.py):
# a safetensors file of statistics, no weights. Here, so that reading a safetensors file can
# tell one without loading the statistics files' own module.
STATISTICS_FORMAT = "bnaudit statistics"


def is_dcp_folder(path: str) -> bool:
    """A folder that torch.distributed.checkpoint wrote (it holds `.metadata`)."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, DCP_METADATA))


# A PEFT adapter folder (formats/peft.py), one checkpoint composed with its base: told here,
# by its files, so that a scan knows it without loading the adapters' own module.
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


def is_adapter_folder(path: str) -> bool:
    """A folder PEFT's save_pretrained wrote: adapter_config.json beside adapter_model.*."""
    return (
        os.path.isdir(path)
        and os.path.isfile(os.path.join(path, ADAPTER_CONFIG))
        and any(os.path.isfile(os.path.join(path, w)) for w in ADAPTER_WEIGHTS)
    )


CHECKPOINT_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin", ".tar", ".safetensors", ".onnx", ".jit", ".pt2")

NEITHER = "neither torch.save, TorchScript, safetensors nor ONNX"


class NotACheckpoint(BnauditError):
    """`path` is no checkpoint format at all: `what` says what it is instead."""

    def __init__(self, path: str, what: str) -> None:
        super().__init__(f"{path}: not a checkpoint ({what})")
        self.path = path
        self.what = what


def sniff_format(path: str) -> str:
    """Return the format of `path` from its first bytes (see module docstring)."""
    fmt, archive = sniff_opening(path)
    if archive is not None:
        archive.close()
    return fmt


def sniff_opening(path: str) -> tuple[str, zipfile.ZipFile | None]:
    """`sniff_format(path)`, and for a torch.save zip archive the archive it parsed, still
    open (the caller closes it): its reader takes it instead of parsing the directory again."""
    try:
        # stat first: open() on a FIFO blocks until a writer appears, and a device
        # (/dev/zero, /dev/urandom) never ends; neither is a checkpoint.
        mode = os.stat(path).st_mode
        if stat.S_ISDIR(mode):
            if is_dcp_folder(path):
                return "dcp", None
            raise IsADirectoryError(path)
        if not stat.S_ISREG(mode):
            raise BnauditError(f"{path}: not a regular file (a pipe, socket or device)")
        with open(path, "rb") as f:
            head = f.read(64)
    except IsADirectoryError:
        if not os.access(path, os.R_OK | os.X_OK):
            raise BnauditError(f"{path}: directory cannot be listed (permission denied)") from None
        raise BnauditError(f"{path}: is a directory") from None
    except FileNotFoundError:
        raise BnauditError(f"{path}: no such file") from None
    except PermissionError:
        raise BnauditError(f"{path}: permission denied") from None
    except OSError as exc:
        raise BnauditError(f"{path}: cannot open ({exc.strerror or exc})") from None
    if not head:
        raise BnauditError(f"{path}: empty file, not a checkpoint")
    if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
        return _sniff_zip(path)
    if head[8:].lstrip(b" \t\n\r")[:1] == b"{":  # JSON whitespace may precede the header's object
        return "safetensors", None
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return "torch-legacy", None
    if looks_like_onnx(head):
        return "onnx", None
    raise NotACheckpoint(path, NEITHER)


# ModelProto's fields and their wire types (0 varint, 2 length-delimited): ir_version 1,
# producer_name 2, producer_version 3, domain 4, model_version 5, doc_string 6, graph 7,
# opset_import 8, metadata_props 14, training_info 20, functions 25, configuration 26
_MODEL_FIELDS = {1: 0, 2: 2, 3: 2, 4: 2, 5: 0, 6: 2, 7: 2, 8: 2, 14: 2, 20: 2, 25: 2, 26: 2}


def _varint(data: bytes, pos: int) -> tuple[int, int] | None:
    value, shift = 0, 0
    while pos < len(data) and shift < 64:
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            return value, pos
        shift += 7
    return None


def looks_like_onnx(head: bytes) -> bool:
    """An ONNX ModelProto from its first bytes: ir_version (field 1, varint, 1..100) first, as
    every exporter writes it, then only ModelProto fields with their wire types, at least one
    of them, as far as `head` reaches. Cheap and strict enough that a pickle, zip or
    safetensors header never passes (they are recognised before this check anyway)."""
    if head[:1] != b"\x08":
        return False
    parsed = _varint(head, 1)
    if parsed is None or not 1 <= parsed[0] <= 100:
        return False
    pos, fields = parsed[1], 0
    while pos < len(head):
        tag = _varint(head, pos)
        if tag is None:
            break  # cut off by the end of head
        number, wire = tag[0] >> 3, tag[0] & 7
        if _MODEL_FIELDS.get(number) != wire:
            return False
        fields += 1
        value = _varint(head, tag[1])
        if value is None:
            break
        pos = value[1] + (value[0] if wire == 2 else 0)
    return fields >= 1


def _sniff_zip(path: str) -> tuple[str, zipfile.ZipFile | None]:
    import zipfile  # here: a safetensors or ONNX file is told apart without it

    archive = None
    try:
        archive = zipfile.ZipFile(path)
        names = archive.namelist()
        # before TorchScript's test: a .pt2 holds `data/constants/` and pickled sample inputs
        fmt = "pt2" if _is_pt2(names, archive) else _torch_layout(names)
        if fmt is not None:  # only a torch layout's records are ever read: size them
            check_zip_sizes(path, archive)
    except Exception as exc:  # zipfile parsing forged bytes: BadZipFile, NotImplementedError, struct.error, ...
        if archive is not None:
            archive.close()
        if isinstance(exc, BnauditError):
            raise
        raise BnauditError(f"{path}: damaged zip archive ({exception_line(exc, with_type=False)})") from None
    if fmt == "torch-zip":
        return fmt, archive
    archive.close()
    if fmt is None:
        raise NotACheckpoint(path, zip_kind(names))
    return fmt, None


def _torch_layout(names: list[str]) -> str | None:
    if any(n.endswith("/constants.pkl") or "/code/" in n for n in names):
        return "torchscript"
    if any(n.endswith("data.pkl") for n in names):
        return "torch-zip"
    return None


def zip_kind(names: list[str]) -> str:
    """What a zip archive without a torch layout is, from its member names: a wheel
    (`*.dist-info/WHEEL`) or a zip; naming the members that look like checkpoints (a
    wheel shipping its models)."""
    inside = [n for n in names if n.lower().endswith(CHECKPOINT_SUFFIXES)]
    shown = ", ".join(inside[:3]) + (f" and {len(inside) - 3} more" if len(inside) > 3 else "")
    holds = f"; unzip it to audit the checkpoint files it holds: {shown}" if inside else ""
    if any(n.count("/") == 1 and n.endswith(".dist-info/WHEEL") for n in names):
        return f"a Python wheel (a zip archive of a package){holds}"
    return f"a zip archive without data.pkl, not a torch.save file{holds}"


def _is_pt2(names: list[str], archive: zipfile.ZipFile) -> bool:
    """torch.export's archive: `<root>/archive_format` holding "pt2" (torch's own test,
    torch.export.pt2_archive.is_pt2_package)."""
    if not names:
        return False
    member = names[0].split("/", 1)[0] + "/archive_format"
    if member not in names or archive.getinfo(member).file_size > 64:
        return False
    return archive.read(member).strip() == b"pt2"


def check_zip_sizes(path: str, archive: zipfile.ZipFile) -> None:
    """Refuse an archive whose entries claim more bytes than the whole file holds.

    torch.save and torch.jit.save store their records uncompressed, so a real
    entry is never larger than the archive; a compressed entry that inflates past
    it is a zip bomb, and reading it would allocate what it claims.
    """
    size = os.path.getsize(path)
    for info in archive.infolist():
        if info.file_size > size:
            raise BnauditError(
                f"{path}: zip entry '{info.filename}' claims {info.file_size} bytes, "
                f"more than the whole file ({size}): refused"
            )

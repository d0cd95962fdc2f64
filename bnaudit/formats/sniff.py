"""Which format a checkpoint file is, from its first bytes, never from its name.

  zip (PK)          TorchScript if it has `*/constants.pkl` or `*/code/`, torch.save if
                    it has `data.pkl`; entries claiming more bytes than the file are refused
  byte 8 is `{`     safetensors (8-byte header length, then the JSON header)
  byte 0 is 0x80    a pickle: legacy (pre-1.6) torch.save
Anything else, a folder, a pipe or a device is refused with one line. Only the first
16 bytes (and a zip's directory) are read here, so a wrong file costs next to nothing.
"""

from __future__ import annotations

import os
import stat
import zipfile

from bnaudit.errors import BnauditError
from bnaudit.text import exception_line

CHECKPOINT_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin", ".tar", ".safetensors")


def sniff_format(path: str) -> str:
    """Return the format of `path` from its first bytes (see module docstring)."""
    try:
        # stat first: open() on a FIFO blocks until a writer appears, and a device
        # (/dev/zero, /dev/urandom) never ends; neither is a checkpoint.
        mode = os.stat(path).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(path)
        if not stat.S_ISREG(mode):
            raise BnauditError(f"{path}: not a regular file (a pipe, socket or device)")
        with open(path, "rb") as f:
            head = f.read(16)
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
    if len(head) >= 9 and head[8:9] == b"{":
        return "safetensors"
    if head[:1] == b"\x80":
        return "torch-legacy"
    raise BnauditError(f"{path}: not a checkpoint (neither torch.save, TorchScript nor safetensors)")


def _sniff_zip(path: str) -> str:
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
            check_zip_sizes(path, archive)
    except BnauditError:
        raise
    except Exception as exc:  # zipfile parsing forged bytes: BadZipFile, NotImplementedError, struct.error, ...
        raise BnauditError(f"{path}: damaged zip archive ({exception_line(exc, with_type=False)})") from None
    if any(n.endswith("/constants.pkl") or "/code/" in n for n in names):
        return "torchscript"
    if any(n.endswith("data.pkl") for n in names):
        return "torch-zip"
    raise BnauditError(f"{path}: zip archive without data.pkl, not a torch.save file")


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

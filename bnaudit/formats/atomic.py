"""Writing an output file all at once or not at all, and refusing a bad output early.

`check_output` runs before any work (an output that is the input, a folder, in a
missing or read-only folder, or that exists without `force`); `atomic_write` builds the
file unnamed (O_TMPFILE, or a hidden temporary where that is missing) and names it only
when complete and fsynced, so a crash or kill never leaves half a checkpoint.
`check_folder_output` and `atomic_folder` do the same for a checkpoint that is a folder
(shards and their index, a distributed checkpoint): built in a hidden temporary folder beside the target, renamed
into place when complete. What a killed write leaves (SIGKILL runs no cleanup) is removed
by the next write of the same output (`remove_stale_temporaries`).
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from typing import Any

from bnaudit.errors import BnauditError
from bnaudit.formats.sniff import is_dcp_folder

_AT_FDCWD, _AT_EMPTY_PATH = -100, 0x1000


def check_output(output: str, source: str | None = None, force: bool = False) -> None:
    """Refuse, before any work, an output that is the input, a folder, in a missing
    or read-only folder, or that exists (without `force`)."""
    if not output:
        raise BnauditError("the output path is empty")
    directory = os.path.dirname(os.path.abspath(output))
    if source is not None and os.path.exists(output) and os.path.exists(source) and os.path.samefile(output, source):
        raise BnauditError(f"{output}: is the input checkpoint; write the new one to another file")
    # a folder checkpoint (torch.distributed.checkpoint) is rewritten as a folder: --force replaces it
    folders = source is not None and is_dcp_folder(source) and is_dcp_folder(output)
    if os.path.isdir(output) and not folders:
        raise BnauditError(f"{output}: is a directory")
    if not os.path.isdir(directory):
        raise BnauditError(f"{output}: folder {directory} does not exist")
    # access() also answers EROFS for root on a read-only mount: fail before the work,
    # not after it (atomic_write still reports a refusal that comes later).
    if not os.access(directory, os.W_OK | os.X_OK):
        raise BnauditError(f"{output}: folder {directory} is not writable")
    if os.path.lexists(output) and not force:
        raise BnauditError(f"{output}: already exists (pass --force to overwrite)")


class RecordingFile:
    """A file whose OS errors are remembered: a writer that catches one and raises its own
    (torch's zip writer: "unexpected pos") still has its cause told (`raise_cause`)."""

    def __init__(self, file: Any) -> None:
        self.file = file
        self.error: OSError | None = None

    def write(self, data: Any) -> Any:
        try:
            return self.file.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise

    def flush(self) -> None:
        try:
            self.file.flush()
        except OSError as exc:
            self.error = self.error or exc
            raise

    def fileno(self) -> int:
        # no descriptor: a writer that would write to it itself (torch's legacy format does)
        # writes through `write` instead, where an OS error is seen
        raise io.UnsupportedOperation("fileno")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.file, name)

    def raise_cause(self, exc: BaseException) -> None:
        """Raise the OS error behind `exc` (a writer's failure), if one was seen."""
        cause = self.error or _os_error_in(exc)
        if cause is not None and cause is not exc:
            raise cause from None


def _os_error_in(exc: BaseException) -> OSError | None:
    """The first OSError among `exc`'s causes and contexts."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def write_file(path: str, write: Callable[[Any], None]) -> None:
    """Create `path` (inside a temporary folder `atomic_folder` fills) from `write(fileobj)`,
    an OS error behind a writer's own failure raised as that OS error."""
    with open(path, "wb") as f:
        _write_recorded(f, write)


def _cannot_write(output: str, exc: OSError) -> BnauditError:
    """One line naming the output and the cause: no space, read-only, quota, too large."""
    return BnauditError(f"cannot write {output}: {exc.strerror or exc}")


def atomic_write(output: str, write: Callable[[Any], None], force: bool = False) -> None:
    """Create `output` from `write(fileobj)` all at once, or not at all.

    The bytes go to an unnamed file (O_TMPFILE) in the target folder, are flushed and
    fsynced, and only then get a name: linked to `output` directly (which fails if
    it exists: no race with another writer), or, with `force`, linked to a
    temporary name and renamed over `output`. A crash, Ctrl-C or kill at any point
    before leaves no file behind. Where O_TMPFILE is unavailable a hidden temporary
    file `.NAME.bnaudit-PID-*.tmp` is used and removed on any error or Ctrl-C.
    """
    output = os.fspath(output)
    check_output(output, force=force)
    directory = os.path.dirname(os.path.abspath(output))
    base = os.path.basename(output)
    remove_stale_temporaries(directory, base)
    try:
        fd = _open_unnamed(directory)
        if fd is not None:
            with os.fdopen(fd, "w+b") as f:
                _write_recorded(f, write)
                f.flush()
                os.fsync(f.fileno())
                if not _name_unnamed(f.fileno(), output, directory, base, force):
                    # no way to give the unnamed file a name here: copy it into a named one
                    f.seek(0)
                    _write_named(output, directory, base, force, lambda g: _copy_file(f, g))
        else:
            _write_named(output, directory, base, force, write)
        _fsync_dir(directory)
    except FileExistsError:
        raise BnauditError(f"{output}: already exists (pass --force to overwrite)") from None
    except OSError as exc:
        raise _cannot_write(output, exc) from None


def _write_recorded(f: Any, write: Callable[[Any], None]) -> None:
    """`write(f)` through a RecordingFile: a writer's own failure whose cause was an OS error
    (a library that wraps it, torch's "unexpected pos") is raised as that OS error."""
    recorder = RecordingFile(f)
    try:
        write(recorder)
    except OSError:
        raise
    except Exception as exc:
        recorder.raise_cause(exc)
        raise


def _copy_file(src: Any, dst: Any) -> None:
    import shutil

    shutil.copyfileobj(src, dst, 16 * 1024 * 1024)


def _open_unnamed(directory: str) -> int | None:
    flag = getattr(os, "O_TMPFILE", None)
    if flag is None:
        return None
    umask = os.umask(0)
    os.umask(umask)
    try:
        return os.open(directory, flag | os.O_RDWR, 0o666 & ~umask)
    except OSError as exc:
        import errno

        if exc.errno in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT):
            return None  # the filesystem does not support it
        raise


def _link_fd(fd: int, target: str) -> bool:
    """Give the unnamed file `fd` the name `target`; FileExistsError if it exists,
    False if this system offers no way to do it."""
    import ctypes
    import errno

    try:
        os.link(f"/proc/self/fd/{fd}", target, follow_symlinks=True)
        return True
    except FileExistsError:
        raise
    except OSError:
        pass  # e.g. EXDEV where /proc is not the host's: try linkat(AT_EMPTY_PATH)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        result = libc.linkat(fd, b"", _AT_FDCWD, os.fsencode(target), _AT_EMPTY_PATH)
    except (OSError, AttributeError):
        return False
    if result == 0:
        return True
    if ctypes.get_errno() == errno.EEXIST:
        raise FileExistsError(errno.EEXIST, "File exists", target)
    return False


def _name_unnamed(fd: int, output: str, directory: str, base: str, force: bool) -> bool:
    if not force:
        return _link_fd(fd, output)
    temp = os.path.join(directory, f"{_temporary_prefix(base)}{os.getpid()}-{os.urandom(4).hex()}.tmp")
    if not _link_fd(fd, temp):
        return False
    try:
        os.replace(temp, output)
    except BaseException:
        _unlink_quietly(temp)
        raise
    return True


def _write_named(output: str, directory: str, base: str, force: bool, write: Callable[[Any], None]) -> None:
    import tempfile

    fd, temp = tempfile.mkstemp(dir=directory, prefix=f"{_temporary_prefix(base)}{os.getpid()}-", suffix=".tmp")
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temp, 0o666 & ~umask)
        with os.fdopen(fd, "w+b") as f:
            _write_recorded(f, write)
            f.flush()
            os.fsync(f.fileno())
        if force:
            os.replace(temp, output)
        else:
            os.link(temp, output)  # fails if output appeared meanwhile
            os.unlink(temp)
    except BaseException:
        _unlink_quietly(temp)
        raise


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _fsync_dir(directory: str) -> None:
    """Make the new name itself durable (POSIX: fsync the folder)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def check_folder_output(output: str, source_folder: str, marker: str, force: bool = False) -> None:
    """Refuse, before any work, an output folder for a checkpoint that is a folder (shards
    and their index): one with a checkpoint file's name, the input's folder, inside it or
    holding it, in a missing or read-only folder, or existing without `force`. With
    `force` an existing folder is replaced only when it holds `marker` (the index file:
    a previous output) and files only, so a mistyped --output never deletes a tree."""
    from bnaudit.formats.sniff import CHECKPOINT_SUFFIXES

    if not output:
        raise BnauditError("the output path is empty")
    if output.lower().endswith(CHECKPOINT_SUFFIXES) and not os.path.isdir(output):
        raise BnauditError(
            f"{output}: a sharded checkpoint is written as a folder of shards like its input; give --output a "
            f"folder name (it will hold the shards and {marker})"
        )
    real_out, real_source = os.path.realpath(output), os.path.realpath(source_folder)
    if real_out == real_source:
        raise BnauditError(f"{output}: is the input checkpoint's folder; write the new one to another folder")
    if os.path.commonpath([real_out, real_source]) == real_source:
        raise BnauditError(f"{output}: lies inside the input folder {source_folder}; write it elsewhere")
    if os.path.commonpath([real_out, real_source]) == real_out:
        raise BnauditError(f"{output}: holds the input checkpoint ({source_folder}); write it elsewhere")
    directory = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(directory):
        raise BnauditError(f"{output}: folder {directory} does not exist")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise BnauditError(f"{output}: folder {directory} is not writable")
    if not os.path.lexists(output):
        return
    if not force:
        raise BnauditError(f"{output}: already exists (pass --force to overwrite)")
    if os.path.islink(output) or not os.path.isdir(output):
        raise BnauditError(f"{output}: exists and is not a folder; a sharded checkpoint is written as a folder")
    entries = os.listdir(output)
    if marker not in entries or any(os.path.isdir(os.path.join(output, e)) for e in entries):
        raise BnauditError(
            f"{output}: exists and is not a sharded checkpoint folder (no {marker}, or subfolders): "
            "refusing to replace it; choose another --output"
        )


def _temporary_prefix(base: str) -> str:
    """`.BASE.bnaudit-`: every temporary of an output named BASE, then the writer's PID, a
    random part and `.tmp` (what `remove_stale_temporaries` parses)."""
    return f".{base}.bnaudit-"


def remove_stale_temporaries(directory: str, base: str) -> list[str]:
    """Remove what a killed write of `base` left in `directory`: the hidden
    `.BASE.bnaudit-PID-*.tmp` files and folders of a process that no longer runs (SIGKILL, the
    out-of-memory killer, a power cut: nothing ran to remove them). Only `.tmp` entries, the
    incomplete new output: a `.old` folder holds a previous output renamed aside and is the
    user's data. A live PID (this one, or another user's) keeps its temporary. Returns the
    names removed."""
    import shutil

    prefix = _temporary_prefix(base)
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        pid = name[len(prefix) :].split("-", 1)[0]
        if not (name.startswith(prefix) and name.endswith(".tmp") and pid.isdigit()) or _running(int(pid)):
            continue
        path = os.path.join(directory, name)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        except OSError:
            continue  # not ours to remove after all (permissions): leave it
        removed.append(name)
    return removed


def _running(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: a process of another user has that PID
        return True
    return True


def atomic_folder(output: str, fill: Callable[[str], None], force: bool = False) -> None:
    """Create the folder `output` from `fill(folder)` all at once, or not at all.

    `fill` writes into a hidden temporary folder beside `output` (same filesystem); its
    files and the folder are fsynced, then it is renamed to `output`. With `force` an
    existing `output` is first renamed aside, and removed only once the new folder has its
    name (put back if the rename fails). A crash, Ctrl-C or error in `fill` removes the
    temporary folder and leaves `output` as it was.
    """
    import shutil
    import tempfile

    output = os.fspath(output)
    directory = os.path.dirname(os.path.abspath(output))
    base = os.path.basename(os.path.normpath(output))
    remove_stale_temporaries(directory, base)
    try:
        temp = tempfile.mkdtemp(dir=directory, prefix=f"{_temporary_prefix(base)}{os.getpid()}-", suffix=".tmp")
    except OSError as exc:
        raise _cannot_write(output, exc) from None
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temp, 0o777 & ~umask)  # mkdtemp's 0700 is for the temporary name only
        try:
            fill(temp)
        except OSError:
            raise
        except Exception as exc:  # a writer's own error over an OS one (torch's, DCP's)
            cause = _os_error_in(exc)
            if cause is None:
                raise
            raise cause from None
        for name in os.listdir(temp):
            fd = os.open(os.path.join(temp, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(temp)
        if os.path.lexists(output):
            if not force:
                raise FileExistsError(output)
            old = f"{temp[: -len('.tmp')]}.old"
            os.rename(output, old)
            try:
                os.rename(temp, output)
            except BaseException:
                os.rename(old, output)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(temp, output)
        _fsync_dir(directory)
    except FileExistsError:
        shutil.rmtree(temp, ignore_errors=True)
        raise BnauditError(f"{output}: already exists (pass --force to overwrite)") from None
    except OSError as exc:
        shutil.rmtree(temp, ignore_errors=True)
        raise _cannot_write(output, exc) from None
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise

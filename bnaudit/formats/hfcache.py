"""The Hugging Face hub cache: huggingface_hub's download layout read as a folder of checkpoints.

What `hf_hub_download` writes (huggingface_hub/file_download.py), under
`~/.cache/huggingface/hub/` (`HF_HUB_CACHE`):

    models--ORG--NAME/                repo type + id joined by "--" (datasets--, spaces-- alike)
      blobs/<etag>                    the bytes, named by sha256 (LFS files) or git sha1
      snapshots/<commit>/<file>       relative symlinks ../../blobs/<etag> (one ../ more per
                                      subfolder); plain copies where symlinks are unsupported
      refs/main                       the commit hash main resolved to (no newline)
      .no_exist/<commit>/<file>       empty markers of files the repo does not have
    .locks/, CACHEDIR.TAG             never read

A repo is audited at the commit `refs/main` names (every snapshot with `--all-revisions`).
A snapshot's symlinks are followed into the same repo's `blobs/` and no further: a link
that resolves anywhere else is refused, as shard indexes and ONNX external data refuse
links that leave their folder. `blobs/`, `snapshots/` and each `snapshots/<commit>` must be
real folders of the repo: a snapshot that is itself a link (to any folder) is refused.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from bnaudit.errors import BnauditError

REPO_FOLDER = re.compile(r"^(?P<type>models|datasets|spaces)--(?P<id>.+)$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")
_MAX_REF_BYTES = 256


@dataclass(frozen=True)
class HubSource:
    """Where a file of the cache comes from: repo, commit, its path in the snapshot, the refs
    naming that commit, and (with --all-revisions) the other commits holding the same blobs."""

    repo_type: str  # "model", "dataset" or "space"
    repo_id: str  # "ORG/NAME" (or "NAME")
    revision: str  # the commit hash: the snapshot folder's name
    file: str  # "/"-separated path inside the snapshot
    refs: tuple[str, ...] = ()
    also_in: tuple[str, ...] = ()

    def shown(self) -> str:
        """ "acme/tiny@0123456789ab/model.safetensors" (hf.co's "datasets/" prefix for datasets)."""
        kind = "" if self.repo_type == "model" else f"{self.repo_type}s/"
        return f"{kind}{self.repo_id}@{self.revision[:12]}/{self.file}"


@dataclass(frozen=True)
class Snapshot:
    """One `snapshots/<commit>` folder of a repo in the cache, and the refs naming its commit."""

    repo_folder: str
    repo_type: str
    repo_id: str
    revision: str
    refs: tuple[str, ...]

    @property
    def folder(self) -> str:
        return os.path.join(self.repo_folder, "snapshots", self.revision)

    def source(self, path: str) -> HubSource:
        file = os.path.relpath(path, self.folder).replace(os.sep, "/")
        return HubSource(self.repo_type, self.repo_id, self.revision, file, self.refs)


def cache_root() -> str:
    """The hub cache folder huggingface_hub uses: `HF_HUB_CACHE`, else `HF_HOME`/hub, else
    ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.path.join(home, "hub")


def is_repo_folder(path: str) -> bool:
    """`models--ORG--NAME` (or datasets--, spaces--) holding a `snapshots/` folder."""
    return REPO_FOLDER.match(os.path.basename(os.path.normpath(path))) is not None and os.path.isdir(
        os.path.join(path, "snapshots")
    )


def _repo(repo_folder: str) -> tuple[str, str]:
    match = REPO_FOLDER.match(os.path.basename(os.path.normpath(repo_folder)))
    assert match is not None
    return match["type"][:-1], match["id"].replace("--", "/")


def refs_of(repo_folder: str) -> dict[str, tuple[str, ...]]:
    """commit -> the refs naming it (`main`, `v1.0`, `refs/pr/1`), from `refs/`; files that
    are not a 40-hex commit are ignored."""
    found: dict[str, list[str]] = {}
    root = os.path.join(repo_folder, "refs")
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(folder, name)
            try:
                with open(path, "rb") as f:
                    text = f.read(_MAX_REF_BYTES).decode("ascii", "replace").strip()
            except OSError:
                continue
            if COMMIT.match(text):
                found.setdefault(text, []).append(os.path.relpath(path, root).replace(os.sep, "/"))
    return {commit: tuple(sorted(names, key=lambda n: (n != "main", n))) for commit, names in found.items()}


def snapshots(repo_folder: str, all_revisions: bool = False) -> list[Snapshot]:
    """The snapshot `refs/main` names (every snapshot, main's first, with `all_revisions`).
    Without refs/main, a repo holding one snapshot is read at that one; several are an error
    saying what to do. A `snapshots/` or chosen `snapshots/<commit>` that is a symlink is
    refused (`check_snapshot`)."""
    repo_type, repo_id = _repo(repo_folder)
    refs = refs_of(repo_folder)
    _check_real_folder(repo_folder, os.path.join(repo_folder, "snapshots"))
    try:
        present = sorted(d for d in os.listdir(os.path.join(repo_folder, "snapshots")) if not d.startswith("."))
    except OSError as exc:
        raise BnauditError(f"{repo_folder}: snapshots/ cannot be listed ({exc.strerror or exc})") from None
    main = next((commit for commit, names in refs.items() if "main" in names), None)
    if main is not None and main not in present and not all_revisions:
        raise BnauditError(f"{repo_folder}: refs/main names commit {main}, which has no snapshot folder")
    if all_revisions:
        chosen = sorted(present, key=lambda c: (c != main, c))
    elif main is not None:
        chosen = [main]
    elif len(present) <= 1:
        chosen = present
    else:
        raise BnauditError(
            f"{repo_folder}: no refs/main and {len(present)} snapshots: name one (snapshots/<commit>) "
            "or pass --all-revisions"
        )
    found = [Snapshot(repo_folder, repo_type, repo_id, c, refs.get(c, ())) for c in chosen]
    for snapshot in found:
        check_snapshot(snapshot)
    return found


def _check_real_folder(repo_folder: str, folder: str) -> None:
    if os.path.islink(folder):
        relative = os.path.relpath(folder, repo_folder)
        raise BnauditError(
            f"{repo_folder}: {relative} is a symlink to {os.path.realpath(folder)}: refused "
            "(a cache's links lead into its blobs/ only)"
        )


def check_snapshot(snapshot: Snapshot) -> None:
    """Refuse a snapshot whose folder, or the repo's `snapshots/`, is a symlink: its files
    would be reported as the hub's while they lie anywhere."""
    _check_real_folder(snapshot.repo_folder, os.path.join(snapshot.repo_folder, "snapshots"))
    _check_real_folder(snapshot.repo_folder, snapshot.folder)


def snapshot_of(path: str) -> Snapshot | None:
    """The snapshot a path lies in (the snapshot folder itself or anything below it)."""
    here = os.path.abspath(path)
    while True:
        parent = os.path.dirname(here)
        if parent == here:
            return None
        if os.path.basename(parent) == "snapshots" and is_repo_folder(os.path.dirname(parent)):
            repo_folder = os.path.dirname(parent)
            repo_type, repo_id = _repo(repo_folder)
            revision = os.path.basename(here)
            return Snapshot(repo_folder, repo_type, repo_id, revision, refs_of(repo_folder).get(revision, ()))
        here = parent


def _blobs(snapshot: Snapshot) -> str | None:
    """The real path of the repo's `blobs/`, if it is a real folder inside the repo."""
    blobs = os.path.join(snapshot.repo_folder, "blobs")
    if os.path.islink(blobs) or not os.path.isdir(blobs):
        return None
    return os.path.realpath(blobs)


def in_blobs(folder: str, real_target: str) -> bool:
    """True when `folder` lies in a snapshot and `real_target` (a realpath) is in that
    repo's `blobs/`: where a cache's links are allowed to lead."""
    snapshot = snapshot_of(folder)
    blobs = _blobs(snapshot) if snapshot else None
    return blobs is not None and os.path.commonpath([blobs, real_target]) == blobs


def check_link(path: str, snapshot: Snapshot) -> None:
    """Refuse a file of a snapshot that resolves outside its snapshot and its repo's blobs/,
    or that lies in a snapshot that is a symlink itself."""
    try:
        check_snapshot(snapshot)
    except BnauditError as exc:
        raise BnauditError(f"{path}: {str(exc).removeprefix(f'{snapshot.repo_folder}: ')}") from None
    real = os.path.realpath(path)
    folder = os.path.realpath(snapshot.folder)
    if os.path.commonpath([folder, real]) == folder or in_blobs(snapshot.folder, real):
        return
    raise BnauditError(
        f"{path}: symlink to {real}, outside the cache's blobs/ ({os.path.join(snapshot.repo_folder, 'blobs')}): refused"
    )

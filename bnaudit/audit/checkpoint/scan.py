"""What `inspect` audits when given paths: files as named, folders expanded.

A folder expands to every file under it whose name ends in a checkpoint suffix (`.onnx`
included, without the external-data files its models refer to), plus shard indexes (a
sharded checkpoint is audited once, through its index, also when its shards are named next
to it), accelerate's `random_states_N.pkl` and torch.distributed.checkpoint folders (one
holding `.metadata` is one checkpoint; its files are not listed), and PEFT adapter folders
(`adapter_config.json` beside `adapter_model.*`: one checkpoint, composed with its base;
formats/peft.py). A Hugging Face cache (the hub folder, one
`models--ORG--NAME` folder, or a `snapshots/<commit>` folder; formats/hfcache.py) expands
to the files of each repo's current snapshot (every snapshot with `all_revisions` or when
the `snapshots/` folder itself is named, each set of blobs once), each tagged with its repo
id and revision.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from bnaudit.errors import BnauditError
from bnaudit.formats.classify import SCANNED_NAMES
from bnaudit.formats.hfcache import (
    HubSource,
    Snapshot,
    check_link,
    check_snapshot,
    is_repo_folder,
    snapshot_of,
    snapshots,
)
from bnaudit.formats.shards import is_index, series_members
from bnaudit.formats.sniff import ADAPTER_WEIGHTS, CHECKPOINT_SUFFIXES, is_adapter_folder, is_dcp_folder


@dataclass(frozen=True)
class Target:
    """One thing to audit: a path, whether the user named it, the error of a path that
    cannot be expanded, and where in a Hugging Face cache it lies."""

    path: str
    named: bool
    error: str | None = None
    hub: HubSource | None = None


def targets(paths: list[str], all_revisions: bool = False) -> list[Target]:
    """Every path as a Target, folders expanded (see module docstring)."""
    found: list[Target] = []
    for path in paths:
        if not os.path.isdir(path):
            found.append(_named_file(path))
            continue
        if is_dcp_folder(path) or is_adapter_folder(path):  # a folder that is one checkpoint
            found.append(Target(path, True))
            continue
        try:
            found += _folder(path, all_revisions)
        except BnauditError as exc:
            found.append(Target(path, True, str(exc).removeprefix(f"{path}: ")))
    return found


def _named_file(path: str) -> Target:
    snapshot = snapshot_of(path) if os.path.lexists(path) else None
    if snapshot is None:
        return Target(path, True)
    try:
        check_link(path, snapshot)
    except BnauditError as exc:
        return Target(path, True, str(exc).removeprefix(f"{path}: "), snapshot.source(path))
    return Target(path, True, hub=snapshot.source(path))


def _wanted(name: str) -> bool:
    return name.lower().endswith(CHECKPOINT_SUFFIXES) or is_index(name) or SCANNED_NAMES.match(name) is not None


def _folder(path: str, all_revisions: bool) -> list[Target]:
    snapshot = snapshot_of(path)
    if snapshot is not None and os.path.samefile(snapshot.folder, path):
        found = _snapshot_files([snapshot], named=False)
    elif is_repo_folder(path):
        found = _snapshot_files(snapshots(path, all_revisions), named=False)
    elif os.path.basename(os.path.normpath(path)) == "snapshots" and is_repo_folder(
        os.path.dirname(os.path.abspath(path))
    ):
        found = _snapshot_files(snapshots(os.path.dirname(os.path.abspath(path)), all_revisions=True), named=False)
    else:
        found = _walk(path, all_revisions)
    if not found:
        raise BnauditError(f"{path}: directory holds no checkpoint files ({' '.join(CHECKPOINT_SUFFIXES)})")
    return found


def _walk(path: str, all_revisions: bool) -> list[Target]:
    """Files under `path` in sorted order; a Hugging Face repo folder met on the way is
    expanded as one (its blobs and markers are never listed)."""
    found: list[Target] = []

    # A folder that cannot be listed is kept as an entry of its own, so it is
    # reported (as unreadable) instead of silently contributing nothing.
    def unlistable(err: OSError) -> None:
        found.append(Target(err.filename, False))

    for root, dirs, files in os.walk(path, onerror=unlistable):
        dirs.sort()
        if is_dcp_folder(root):  # one checkpoint, whatever its chunk files are named
            found.append(Target(root, False))
            dirs.clear()
            continue
        adapter = is_adapter_folder(root)
        if adapter:  # audited as one, composed with its base; its subfolders still scanned
            found.append(Target(root, False))
        for name in [d for d in dirs if is_repo_folder(os.path.join(root, d))]:
            dirs.remove(name)
            repo = os.path.join(root, name)
            try:
                found += _snapshot_files(snapshots(repo, all_revisions), named=False)
            except BnauditError as exc:
                found.append(Target(repo, False, str(exc).removeprefix(f"{repo}: ")))
        found += [
            Target(os.path.join(root, f), False)
            for f in sorted(files)
            if _wanted(f) and not (adapter and f in ADAPTER_WEIGHTS)
        ]
    return found


def _snapshot_files(chosen: list[Snapshot], named: bool) -> list[Target]:
    """The checkpoint files of these snapshots (of one repo), links checked; with several
    snapshots, a file whose blobs an earlier snapshot already has is not read again: that
    snapshot's Target lists this revision in `also_in`."""
    found: list[Target] = []
    seen: dict[frozenset[str], int] = {}
    for snapshot in chosen:
        try:
            check_snapshot(snapshot)  # a snapshot folder that is a link: one line, none of its files
        except BnauditError as exc:
            found.append(Target(snapshot.folder, named, str(exc).removeprefix(f"{snapshot.repo_folder}: ")))
            continue
        paths: list[str] = []
        for root, dirs, files in os.walk(snapshot.folder):
            dirs.sort()
            paths += [os.path.join(root, f) for f in sorted(files) if _wanted(f)]
        for path in without_external_data(without_indexed_shards(paths)):
            source = snapshot.source(path)
            try:
                check_link(path, snapshot)
            except BnauditError as exc:
                found.append(Target(path, named, str(exc).removeprefix(f"{path}: "), source))
                continue
            blobs = _blobs_of(path)
            if blobs in seen:
                first = found[seen[blobs]]
                assert first.hub is not None
                hub = dataclasses.replace(first.hub, also_in=(*first.hub.also_in, snapshot.revision))
                found[seen[blobs]] = dataclasses.replace(first, hub=hub)
                continue
            seen[blobs] = len(found)
            found.append(Target(path, named, hub=source))
    return found


def _blobs_of(path: str) -> frozenset[str]:
    """The real files a checkpoint is read from: the file, and an index's shards."""
    real = {os.path.realpath(path)}
    if is_index(path):
        real |= series_members(path)
    return frozenset(real)


def without_external_data(paths: list[str]) -> list[str]:
    """`paths` minus the external-data files (`weights.bin`, ...) of the ONNX models among
    them: those bytes belong to their model, not to a checkpoint of their own."""
    models = [p for p in paths if p.lower().endswith(".onnx")]
    if not models:
        return paths
    from bnaudit.formats.onnx import external_data_files

    data: set[str] = set()
    for model in models:
        data |= external_data_files(model)
    return [p for p in paths if os.path.realpath(p) not in data]


def without_indexed_shards(paths: list[str]) -> list[str]:
    """`paths` minus the shards of an index that is also in `paths`: a sharded checkpoint
    is audited once, through its index."""
    members: set[str] = set()
    for p in paths:
        if is_index(p):
            members |= series_members(p)
    return [p for p in paths if is_index(p) or os.path.realpath(p) not in members]

"""The Hugging Face cache as a folder of checkpoints (issue #25).

The cache is built exactly as huggingface_hub's `hf_hub_download` writes it
(src/huggingface_hub/file_download.py, constants.py), without the package and without
network: `<cache>/models--ORG--NAME/` (`repo_folder_name`: type + id joined by
`REPO_ID_SEPARATOR` "--"), the file's bytes in `blobs/<etag>` (the sha256 of an LFS file,
the git blob sha1 of a small one), `snapshots/<commit>/<filename>` a RELATIVE symlink to
the blob (`_create_symlink`: `os.path.relpath(blob, dirname(pointer))`, so
`../../blobs/<etag>`, one `../` more per subfolder), `refs/<revision>` holding the commit
hash with no newline (`_cache_commit_hash_for_specific_revision`), `.no_exist/<commit>/<filename>`
empty files for files the repo does not have (what transformers' probes leave, e.g.
`model.safetensors.index.json` next to an unsharded model), `<cache>/.locks/<repo folder>/<etag>.lock`
and `<cache>/CACHEDIR.TAG`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import bn_entries

from bnaudit.api import inspect
from bnaudit.config import Config

LFS_SUFFIXES = (".safetensors", ".bin", ".onnx", ".pt", ".pth")
CACHEDIR_TAG = (
    "Signature: 8a477f597d28d172789f06886806bc55\n"
    "# This file is a cache directory tag created by huggingface_hub.\n"
    "# For information about cache directory tags, see:\n"
    "#\thttp://www.brynosaurus.com/cachedir/\n"
)


def etag(name: str, data: bytes) -> str:
    """The Hub's ETag: sha256 for an LFS file, git's blob sha1 for a small one."""
    if name.endswith(LFS_SUFFIXES):
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def hub_download(cache: Path, repo_id: str, commit: str, files: dict[str, bytes], revision: str = "main") -> Path:
    """What `hf_hub_download(repo_id, filename, revision=revision)` leaves for each file."""
    storage = cache / ("models--" + repo_id.replace("/", "--"))
    (cache / "CACHEDIR.TAG").write_text(CACHEDIR_TAG) if not (cache / "CACHEDIR.TAG").exists() else None
    for name, data in files.items():
        tag = etag(name, data)
        blob = storage / "blobs" / tag
        pointer = storage / "snapshots" / commit / name
        blob.parent.mkdir(parents=True, exist_ok=True)
        pointer.parent.mkdir(parents=True, exist_ok=True)
        lock = cache / ".locks" / storage.name / f"{tag}.lock"
        lock.parent.mkdir(parents=True, exist_ok=True)
        lock.touch()
        if not blob.exists():
            blob.write_bytes(data)
        os.symlink(os.path.relpath(os.path.abspath(blob), os.path.abspath(pointer.parent)), pointer)
    if revision != commit:
        (storage / "refs").mkdir(parents=True, exist_ok=True)
        (storage / "refs" / revision).write_text(commit)
    return storage


def no_exist(storage: Path, commit: str, name: str) -> None:
    path = storage / ".no_exist" / commit / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()


def safetensors_bytes(state: dict[str, torch.Tensor], metadata=None) -> bytes:
    from safetensors.torch import save

    return save({k: v.contiguous() for k, v in state.items()}, metadata=metadata)


def model_state(var=None) -> dict[str, torch.Tensor]:
    state = {"conv.weight": torch.randn(4, 1, 3, 3), **bn_entries("bn", 4, var=var)}
    state.update(bn_entries("head.bn", 6))
    return state


HEALTHY = safetensors_bytes(model_state(), {"format": "pt"})
# running_var 1e-7 in channel 2: BN004 (near-eps variance)
BROKEN = safetensors_bytes(model_state(var=torch.tensor([1.0, 0.5, 1e-7, 2.0])), {"format": "pt"})
CONFIG = json.dumps({"architectures": ["TinyNet"], "model_type": "tiny"}, indent=2).encode()
OLD, NEW, DOCS = "a" * 40, "b" * 40, "c" * 40
SHARDED = "d" * 40


def sharded_files() -> dict[str, bytes]:
    """transformers' save_pretrained split: bn's buffers across two shards, an index."""
    state = model_state()
    names = sorted(state)
    first = {k: state[k] for k in names[: len(names) // 2]}
    second = {k: state[k] for k in names[len(names) // 2 :]}
    shards = {
        "model-00001-of-00002.safetensors": safetensors_bytes(first, {"format": "pt"}),
        "model-00002-of-00002.safetensors": safetensors_bytes(second, {"format": "pt"}),
    }
    weight_map = dict.fromkeys(first, "model-00001-of-00002.safetensors") | dict.fromkeys(
        second, "model-00002-of-00002.safetensors"
    )
    index = {"metadata": {"total_size": sum(t.numel() * 4 for t in state.values())}, "weight_map": weight_map}
    return {**shards, "model.safetensors.index.json": json.dumps(index, indent=2, sort_keys=True).encode()}


@pytest.fixture
def cache(tmp_path) -> Path:
    """Two repos: acme/tiny downloaded at three commits (OLD: broken statistics, NEW: healthy,
    DOCS: the same weights, only the README changed), main at DOCS; acme/sharded at one."""
    hub = tmp_path / "huggingface" / "hub"
    hub.mkdir(parents=True)
    tiny = hub_download(hub, "acme/tiny", OLD, {"config.json": CONFIG, "model.safetensors": BROKEN})
    hub_download(hub, "acme/tiny", NEW, {"config.json": CONFIG, "model.safetensors": HEALTHY})
    hub_download(hub, "acme/tiny", DOCS, {"README.md": b"# tiny\n", "model.safetensors": HEALTHY})
    for commit in (OLD, NEW, DOCS):
        no_exist(tiny, commit, "model.safetensors.index.json")  # transformers' probe
    sharded = hub_download(hub, "acme/sharded", SHARDED, {"config.json": CONFIG, **sharded_files()})
    no_exist(sharded, SHARDED, "model.safetensors")
    return hub


def shown(report) -> list[str]:
    return [f.shown for f in report.files]


def test_the_cache_audits_each_models_current_snapshot_by_repo_id(cache):
    report = inspect(str(cache), Config())
    assert shown(report) == [
        f"acme/sharded@{SHARDED[:12]}/model.safetensors.index.json",
        f"acme/tiny@{DOCS[:12]}/model.safetensors",
    ]
    sharded, tiny = report.files
    assert sharded.error is None and len(sharded.layers) == 2
    assert "2 shards read as one checkpoint through the index" in sharded.notes
    assert tiny.error is None and len(tiny.layers) == 2 and tiny.findings == []  # OLD's BN004 not audited
    assert (tiny.hub.repo_id, tiny.hub.revision, tiny.hub.file, tiny.hub.refs) == (
        "acme/tiny",
        DOCS,
        "model.safetensors",
        ("main",),
    )
    assert report.exit_code() == 0


def test_all_revisions_reads_each_blob_once(cache):
    report = inspect(str(cache), Config(), all_revisions=True)
    tiny = [f for f in report.files if f.hub.repo_id == "acme/tiny"]
    # DOCS and NEW share one blob: one report, saying where else it is
    assert [f.hub.revision for f in tiny] == [DOCS, OLD]
    assert tiny[0].hub.also_in == (NEW,)
    assert any(NEW[:12] in note for note in tiny[0].notes)
    assert [f.code for f in tiny[1].findings] == ["BN004"] and tiny[1].findings[0].channels == (2,)
    assert report.exit_code() == 1


@pytest.mark.parametrize("where", ["repo", "snapshot", "snapshots"])
def test_one_repo_folder_or_one_snapshot(cache, where):
    repo = cache / "models--acme--tiny"
    path = {"repo": repo, "snapshot": repo / "snapshots" / OLD, "snapshots": repo / "snapshots"}[where]
    report = inspect(str(path), Config())
    expected = {"repo": [DOCS], "snapshot": [OLD], "snapshots": [DOCS, OLD]}[where]
    assert shown(report) == [f"acme/tiny@{commit[:12]}/model.safetensors" for commit in expected]


def test_a_snapshot_link_leaving_the_cache_is_refused(cache, tmp_path):
    outside = tmp_path / "elsewhere.safetensors"
    outside.write_bytes(HEALTHY)
    link = cache / "models--acme--tiny" / "snapshots" / DOCS / "extra.safetensors"
    os.symlink(outside, link)
    report = inspect(str(cache), Config())
    (bad,) = [f for f in report.files if f.hub.file == "extra.safetensors"]
    assert bad.error is not None and "outside" in bad.error and "blobs" in bad.error
    assert bad.layers == []
    assert report.exit_code(exit_zero=False) == 2


def test_a_shard_link_leaving_the_cache_is_refused(cache, tmp_path):
    snapshot = cache / "models--acme--sharded" / "snapshots" / SHARDED
    shard = snapshot / "model-00002-of-00002.safetensors"
    outside = tmp_path / "elsewhere.safetensors"
    outside.write_bytes(shard.read_bytes())
    shard.unlink()
    os.symlink(outside, shard)
    (file,) = inspect(str(snapshot / "model.safetensors.index.json"), Config()).files
    assert file.error is not None and "is a symlink to" in file.error


def test_no_refs_main_and_several_snapshots_says_what_to_do(cache):
    repo = cache / "models--acme--tiny"
    (repo / "refs" / "main").unlink()
    report = inspect(str(repo), Config())
    (file,) = report.files
    assert "refs/main" in file.error and "--all-revisions" in file.error


def test_cli_table_and_json_name_the_repo_and_revision(cache, cli):
    result = cli("inspect", str(cache), "--all-revisions", width=200)
    assert result.exit_code == 1, result.output
    assert f"acme/tiny@{OLD[:12]}/model.safetensors" in result.stdout
    assert "blobs" not in result.stdout
    doc = json.loads(cli("inspect", str(cache), "--format", "json").stdout)
    hub = [f["hub"] for f in doc["files"]]
    assert hub[1] == {
        "repo_type": "model",
        "repo_id": "acme/tiny",
        "revision": DOCS,
        "file": "model.safetensors",
        "refs": ["main"],
        "also_in": [],
    }


def test_an_onnx_export_with_external_data_in_a_snapshot(tmp_path):
    """`onnx/model.onnx` + `onnx/model.onnx_data` (how repos ship large exports): both links
    into blobs/, one `../` deeper; the external data is read through its link."""
    import onnx
    from conftest import SAMPLES

    model = onnx.load(os.path.join(SAMPLES, "onnx", "digits.onnx"))
    work = tmp_path / "export"
    work.mkdir()
    onnx.save_model(
        model, str(work / "model.onnx"), save_as_external_data=True, location="model.onnx_data", size_threshold=0
    )
    files = {
        "onnx/model.onnx": (work / "model.onnx").read_bytes(),
        "onnx/model.onnx_data": (work / "model.onnx_data").read_bytes(),
    }
    hub = tmp_path / "hub"
    hub.mkdir()
    storage = hub_download(hub, "acme/digits-onnx", SHARDED, files)
    pointer = storage / "snapshots" / SHARDED / "onnx" / "model.onnx_data"
    assert os.readlink(pointer).startswith("../../../blobs/")
    report = inspect(str(hub), Config())
    (file,) = report.files
    assert file.shown == f"acme/digits-onnx@{SHARDED[:12]}/onnx/model.onnx"
    assert file.error is None and len(file.layers) == 3 and file.findings == []


def test_ci_formats_name_a_cached_file_by_repo_and_revision(cache):
    """GitHub, GitLab, JUnit and Markdown locate a cached file as `repo@revision/file`: the
    snapshot path under the cache holds the machine's cache folder and the commit hash, so
    it would differ between runners (GitLab's fingerprints would change every run)."""
    from bnaudit.output.github import to_github
    from bnaudit.output.gitlab import to_gitlab
    from bnaudit.output.junit import to_junit
    from bnaudit.output.markdown import to_markdown

    report = inspect(str(cache), Config(), all_revisions=True)
    old = f"acme/tiny@{OLD[:12]}/model.safetensors"
    assert old in shown(report) and any(f.findings for f in report.files if f.shown == old)
    github, junit, markdown = to_github(report), to_junit(report), to_markdown(report)
    gitlab = to_gitlab(report)
    assert f"file={old}," in github
    assert f'name="{old}"' in junit
    assert f"### {old}" in markdown.replace("\\", "")
    assert old in {issue["location"]["path"] for issue in gitlab}
    for text in (github, junit, markdown, json.dumps(gitlab)):
        assert "snapshots" not in text and str(cache) not in text


@pytest.mark.parametrize("linked", ["snapshot", "snapshots"])
def test_a_snapshot_folder_that_is_a_symlink_out_of_the_cache_is_refused(cache, tmp_path, linked):
    # links are followed into blobs/ only: a snapshots/<commit> (or snapshots/) that is itself
    # a link to any folder made its files pass for the hub's (was: audited as acme/tiny@...)
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / DOCS).mkdir(parents=True)
    (elsewhere / DOCS / "model.safetensors").write_bytes(BROKEN)
    repo = cache / "models--acme--tiny"
    if linked == "snapshot":
        shutil.rmtree(repo / "snapshots" / DOCS)
        os.symlink(elsewhere / DOCS, repo / "snapshots" / DOCS)
    else:
        shutil.rmtree(repo / "snapshots")
        os.symlink(elsewhere, repo / "snapshots")
    for where in (cache, repo, repo / "snapshots" / DOCS):
        report = inspect(str(where), Config())
        tiny = [f for f in report.files if "tiny" in f.path]
        assert len(tiny) == 1, [f.path for f in report.files]
        (file,) = tiny
        assert file.error is not None and "is a symlink to" in file.error and "refused" in file.error, file.error
        assert file.layers == [] and file.findings == []
        assert report.exit_code(exit_zero=False) == 2
    # a file named inside it is refused too
    (file,) = inspect(str(repo / "snapshots" / DOCS / "model.safetensors"), Config()).files
    assert file.error is not None and "symlink" in file.error

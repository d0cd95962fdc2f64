"""Without torch, what needs it says so in one line: every command and option that builds a
model, at the CLI's one error boundary (exit 2, the install for CPU and GPU machines named; in
JSON the error document), and the Python API's names that need it.

Where torch is installed its absence is simulated the way Python reports it: `sys.modules`
maps torch to None (an `import torch` then raises ModuleNotFoundError for `torch`), and
bnaudit.runtime's modules, which imported it already, are forgotten for the test. Where torch is
not installed (CI's torch-free tier) the same tests run against the real absence.
"""

from __future__ import annotations

import json
import sys

import pytest
from conftest import REPO

from bnaudit.errors import missing_dependency

pytestmark = pytest.mark.torchfree

ARCH = ["--arch", "sample_models/digits_net.py:digits_net"]
DATA = ["--data", "sample_models/data/digits_val.safetensors"]
NEEDS_TORCH = {
    "gap": ["gap", "sample_models/immature.pt", *ARCH, *DATA],
    "gap-no-arch": ["gap", "sample_models/traced_train.pt", *DATA],
    "invariance": ["invariance", "sample_models/traced_train.pt", *DATA],
    "recalibrate": ["recalibrate", "sample_models/immature.pt", *ARCH, *DATA, "-o", "never-written.pt"],
    "fold-data": ["fold", "sample_models/immature.pt", *ARCH, *DATA],
    "inspect-arch": ["inspect", "sample_models/immature.pt", *ARCH],
    "diff-arch": ["diff", "sample_models/healthy.pt", "sample_models/onnx/digits.onnx", *ARCH],
}
JSON_FORMAT = {"gap", "invariance", "recalibrate", "fold-data", "inspect-arch", "diff-arch"}


def hide(monkeypatch, *packages: str) -> None:
    """`import PACKAGE` (and of its modules) raises ModuleNotFoundError(name=PACKAGE) until
    the test ends. Its modules stay where they are in sys.modules: their order decides the
    order of the interpreter's clean-up at exit."""
    loaded = dict(sys.modules)
    for name in loaded:
        if name.startswith("bnaudit.runtime"):
            parent, _, child = name.rpartition(".")
            if hasattr(loaded[parent], child):
                # an import while hidden binds a new module to its parent: the old one comes back
                monkeypatch.setattr(loaded[parent], child, getattr(loaded[parent], child))
            monkeypatch.delitem(sys.modules, name)
    for package in packages:
        monkeypatch.setitem(sys.modules, package, None)


@pytest.fixture
def no_torch(monkeypatch):
    monkeypatch.chdir(REPO)
    hide(monkeypatch, "torch")


def assert_names_the_install(message: str) -> None:
    assert message.startswith("torch is not installed, and this builds a model with it")
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in message
    assert "https://pytorch.org/get-started/locally/" in message
    assert message.endswith('then pip install "bnaudit[torch]"')


def test_the_message_is_for_the_packages_the_base_install_leaves_out():
    assert_names_the_install(missing_dependency(ModuleNotFoundError("No module named 'torch'", name="torch")))
    pillow = missing_dependency(ModuleNotFoundError("No module named 'PIL'", name="PIL"))
    assert pillow is not None and 'pip install "bnaudit[torch]"' in pillow and "image folder" in pillow
    # a module missing inside an installed torch, another package, another error: bugs, not installs
    assert missing_dependency(ModuleNotFoundError("no torch.distributed", name="torch.distributed")) is None
    assert missing_dependency(ModuleNotFoundError("No module named 'scipy'", name="scipy")) is None
    assert missing_dependency(ImportError("cannot import name 'x' from 'torch'", name="torch")) is None
    assert missing_dependency(ValueError("torch")) is None


def test_hiding_torch_makes_its_import_fail_as_absence_does(no_torch):
    with pytest.raises(ModuleNotFoundError) as raised:
        import bnaudit.runtime.distributed  # noqa: F401
    assert raised.value.name == "torch"


@pytest.mark.parametrize("case", list(NEEDS_TORCH))
@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug"])
def test_a_command_that_builds_a_model_says_torch_is_missing_in_one_line(cli, no_torch, case, debug):
    result = cli(*NEEDS_TORCH[case], *(["--debug"] if debug else []), width=80)
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    (line,) = result.stderr.splitlines()  # the whole message on one line, whatever the width
    assert line.startswith("bnaudit: error: ")
    assert_names_the_install(line.removeprefix("bnaudit: error: "))


@pytest.mark.parametrize("case", sorted(JSON_FORMAT))
def test_with_json_the_error_is_the_document(cli, no_torch, case):
    result = cli(*NEEDS_TORCH[case], "--format", "json")
    assert result.exit_code == 2, result.output
    assert result.stderr == ""
    assert_names_the_install(json.loads(result.stdout)["error"])


def test_the_commands_that_read_checkpoints_only_still_run(cli, no_torch):
    assert cli("inspect", "sample_models/immature.pt", "-q").exit_code == 1  # BN003
    assert cli("diff", "sample_models/pretrained.safetensors", "sample_models/finetuned.pt", "-q").exit_code == 1
    assert cli("fold", "sample_models/healthy.pt", "-q").exit_code == 0
    assert cli("rules", "BN003").exit_code == 0
    # a usage error is still the usage error, not a missing torch
    bad = cli("fold", "sample_models/healthy.pt", *ARCH)
    assert bad.exit_code == 2 and "give --data or --dataset too" in bad.stderr


def test_the_python_api_names_the_install_for_what_needs_torch(no_torch):
    import bnaudit

    assert bnaudit.inspect("sample_models/immature.pt").exit_code() == 1
    assert bnaudit.diff("sample_models/pretrained.safetensors", "sample_models/finetuned.pt").exit_code() == 1
    assert bnaudit.predict_fold("sample_models/healthy.pt", bnaudit.Config()).exit_code() == 0
    for name in ("measure_gap", "measure_invariance", "recalibrate_checkpoint", "measure_fold", "DataOptions"):
        with pytest.raises(ModuleNotFoundError) as raised:
            getattr(bnaudit, name)
        assert raised.value.name == "torch"
        assert str(raised.value).startswith(f"bnaudit.{name}: ")
        assert_names_the_install(str(raised.value).removeprefix(f"bnaudit.{name}: "))


def test_an_image_folder_without_pillow_names_its_install(cli, monkeypatch):
    pytest.importorskip("torch")  # the model runs: only Pillow is missing
    monkeypatch.chdir(REPO)
    hide(monkeypatch, "PIL")
    result = cli(
        "gap", "sample_models/healthy.pt", *ARCH, "--data", "sample_models/data/digits_images", "--grayscale", "-q"
    )
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.splitlines()
    assert line.startswith("bnaudit: error: Pillow is not installed, and reading an image folder needs it")
    assert 'pip install "bnaudit[torch]"' in line

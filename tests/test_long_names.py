"""Long names, narrow terminals: every table of every command at 80, 100 and 120 columns
with the layer names real libraries write (transformers' ResNet, timm's EfficientNet).

The rule (`bnaudit.output.names`, `output.table.common.fitted_table`): no name or word
is broken across lines; a shortened name keeps whole segments, "…" standing for one or
more of them, and stands for one layer only, so different layers stay different; columns
that had to go are named under the table.
"""

from __future__ import annotations

import itertools
import re
import textwrap

import pytest
import torch
from conftest import save_safetensors

from bnaudit.output.names import shorten_names

BOX = "│┃━─╇┼╋╀╂┿"
WIDTHS = (80, 100, 120)


def transformers_resnet50_names() -> list[str]:
    """The BN module names of transformers' ResNetForImageClassification (resnet-50)."""
    names = ["resnet.embedder.embedder.normalization"]
    for stage, depth in enumerate((3, 4, 6, 3)):
        for layer in range(depth):
            if layer == 0:
                names.append(f"resnet.encoder.stages.{stage}.layers.{layer}.shortcut.normalization")
            names += [f"resnet.encoder.stages.{stage}.layers.{layer}.layer.{k}.normalization" for k in range(3)]
    return names


def timm_efficientnet_names() -> list[str]:
    """BN names of timm's efficientnet_b0 (bn1, blocks.S.B.bnN, bn2)."""
    names = ["bn1"]
    for stage, depth in enumerate((1, 2, 2, 3, 3, 4, 1)):
        for block in range(depth):
            names += [f"blocks.{stage}.{block}.bn{k}" for k in ((1, 2) if stage == 0 else (1, 2, 3))]
    return [*names, "bn2"]


HF = transformers_resnet50_names()
TIMM = timm_efficientnet_names()
MODEL = """
import torch
from torch import nn

NAMES = {names!r}


class Long(nn.Module):
    # one conv + BN per name, each BN registered under its dotted name; run in name order
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(1, 4, 3, padding=1)
        for name in NAMES:
            parent = self
            *path, leaf = name.split(".")
            for part in path:
                if not hasattr(parent, part):
                    parent.add_module(part, nn.Module())
                parent = getattr(parent, part)
            parent.add_module(leaf, nn.BatchNorm2d(4))
        self.head = nn.Linear(4, 10)

    def forward(self, x):
        x = self.stem(x)
        modules = dict(self.named_modules())
        for name in NAMES:
            x = torch.relu(modules[name](x))
        return self.head(x.mean((2, 3)))


def build():
    return Long()
"""


@pytest.fixture(scope="module", params=["transformers", "timm"])
def named(request, tmp_path_factory):
    """(names, model file, checkpoint, a copy with other statistics, data) for one library's names."""
    names = HF if request.param == "transformers" else TIMM
    folder = tmp_path_factory.mktemp(request.param)
    (folder / "long_model.py").write_text(textwrap.dedent(MODEL.format(names=names)))
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"long_model_{request.param}", folder / "long_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    model = module.build()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 1, 8, 8, generator=g)
    model.train()
    with torch.no_grad():
        for _ in range(3):
            model(x)
    state = model.state_dict()
    # half the layers with statistics of other data: drift in gap, a change in diff
    shifted = {k: (v + 0.5 if k.endswith("running_mean") and i % 2 else v) for i, (k, v) in enumerate(state.items())}
    ckpt = save_safetensors(shifted, folder / "model.safetensors")
    other = save_safetensors(state, folder / "other.safetensors")
    data = save_safetensors(
        {"inputs": x, "labels": torch.randint(0, 10, (64,), generator=g)}, folder / "data.safetensors"
    )
    return names, f"{folder / 'long_model.py'}:build", ckpt, other, data, folder


def _tokens(text: str) -> list[str]:
    for ch in BOX:
        text = text.replace(ch, " ")
    return [t.strip("(),:;'") for t in text.split()]


def segments_pattern(shown: str) -> re.Pattern[str]:
    """A shortened name as a pattern: each "…" one or more whole segments (with the
    separators around them), the rest as written."""
    parts = shown.split("…")
    # a name written from its root ("/resnet/...", an exporter's scope) starts with a separator
    regex = "[./]?" if not parts[0] else re.escape(parts[0])
    for before, part in itertools.pairwise(parts):
        regex += ("[./]" if before else "") + r"[^./]+(?:[./][^./]+)*" + ("[./]" if part else "") + re.escape(part)
    return re.compile(regex)


def check_table_lines(narrow: str, wide: str, names: list[str], width: int) -> set[str]:
    """Every line of `narrow` fits `width`; every token of a table line is a whole token of
    the wide output or a shortened name standing for exactly one of `names`. The shortened
    names seen."""
    whole = set(_tokens(wide))
    shortened = set()
    for line in narrow.splitlines():
        assert len(line) <= width, f"{len(line)} > {width}: {line!r}\n{narrow}"
        if "│" not in line and "┃" not in line:
            continue
        for token in _tokens(line):
            if not token or token in whole:
                continue
            assert "…" in token, f"{token!r} is no whole word or name (split across lines?)\n{narrow}"
            if token.endswith((".safetensors", ".pt")):
                continue  # a path in a files table
            matches = [n for n in names if segments_pattern(token).fullmatch(n)]
            assert len(matches) == 1, f"{token!r} stands for {matches}\n{narrow}"
            shortened.add(token)
    return shortened


def run_both(cli, *args: str, width: int):
    narrow = cli(*args, width=width)
    wide = cli(*args, width=1000)
    assert narrow.exit_code == wide.exit_code, narrow.output
    assert narrow.exit_code in (0, 1), narrow.output
    return narrow.stdout, wide.stdout


@pytest.mark.slow
@pytest.mark.parametrize("width", WIDTHS)
def test_gap_layer_table(cli, named, width):
    names, arch, ckpt, _, data, _ = named
    narrow, wide = run_both(cli, "gap", ckpt, "--arch", arch, "--data", data, "--isolated", width=width)
    assert "per-layer drift" in narrow
    check_table_lines(narrow, wide, names, width)
    if width == 80 and names is HF:
        assert "dropped to fit 80 columns: kind" in narrow, narrow


@pytest.mark.slow
@pytest.mark.parametrize("width", WIDTHS)
def test_recalibrate_layer_table(cli, named, width, tmp_path):
    names, arch, ckpt, _, data, _ = named
    args = ("recalibrate", ckpt, "--arch", arch, "--data", data, "--isolated", "--allow-input-mismatch", "--force")
    narrow = cli(*args, "-o", str(tmp_path / "a.safetensors"), width=width)
    wide = cli(*args, "-o", str(tmp_path / "b.safetensors"), width=1000)
    assert narrow.exit_code == 0, narrow.output
    # the output path differs between the two runs: only the table lines are compared
    check_table_lines(narrow.stdout.replace("a.safetensors", "b.safetensors"), wide.stdout, names, width)
    if width == 80 and names is HF:
        assert "dropped to fit 80 columns:" in narrow.stdout, narrow.stdout


@pytest.mark.slow
@pytest.mark.parametrize("width", WIDTHS)
def test_diff_layer_table(cli, named, width):
    names, _, ckpt, other, _, _ = named
    narrow, wide = run_both(cli, "diff", other, ckpt, "--isolated", width=width)
    check_table_lines(narrow, wide, names, width)
    if width == 80 and names is HF:
        note = next(line for line in narrow.splitlines() if line.startswith("dropped to fit 80 columns: "))
        assert "Δbatches" in note, narrow


@pytest.mark.slow
@pytest.mark.parametrize("width", WIDTHS)
def test_inspect_layer_and_findings_tables(cli, named, width):
    names, _, ckpt, _, _, folder = named
    state = dict(__import__("safetensors.torch", fromlist=["load_file"]).load_file(ckpt))
    for name in names[::3]:  # reset statistics on a third of the layers: one finding naming many
        state[f"{name}.running_mean"] = torch.zeros_like(state[f"{name}.running_mean"])
        state[f"{name}.running_var"] = torch.ones_like(state[f"{name}.running_var"])
    path = save_safetensors(state, folder / f"reset_{width}.safetensors")
    narrow, wide = run_both(cli, "inspect", path, "--isolated", width=width)
    shortened = check_table_lines(narrow, wide, names, width)
    if names is HF:
        assert shortened, narrow  # at 120 columns too, these names do not fit whole


@pytest.mark.slow
@pytest.mark.parametrize("width", WIDTHS)
def test_invariance_tables(cli, named, width):
    names, arch, ckpt, _, data, _ = named
    args = ("invariance", ckpt, "--arch", arch, "--data", data, "--isolated", "--num-samples", "16")
    narrow, wide = run_both(cli, *args, "--batch-sizes", "1,8", width=width)
    check_table_lines(narrow, wide, names, width)


@pytest.mark.parametrize("width", WIDTHS)
def test_rules_table(cli, width):
    narrow, wide = run_both(cli, "rules", width=width)
    check_table_lines(narrow, wide, [], width)


# ----------------------------------------------------------------------------- the rule itself


@pytest.mark.parametrize("width", [16, 24, 32, 40, 60])
def test_shortened_names_are_whole_segments_and_each_stands_for_one_layer(width):
    for names in (HF, TIMM):
        shown = shorten_names(names, width)
        assert len(set(shown.values())) == len(names)
        for name, short in shown.items():
            if short == name:
                assert len(name) <= width or "…" not in name
                continue
            assert [n for n in names if segments_pattern(short).fullmatch(n)] == [name], (name, short)


def test_three_stage_layers_no_longer_read_the_same():
    # inspect 0.x shortened these three to "resnet.encoder.s…0.normalization" each
    three = [
        "resnet.encoder.stages.1.layers.0.shortcut.normalization",
        "resnet.encoder.stages.2.layers.0.shortcut.normalization",
        "resnet.encoder.stages.3.layers.0.shortcut.normalization",
    ]
    shown = shorten_names(HF, 32)
    assert len({shown[n] for n in three}) == 3
    assert all(len(shown[n]) <= 32 for n in three)
    assert all(f"stages.{i}" in shown[n] for i, n in zip((1, 2, 3), three)), [shown[n] for n in three]


def test_names_that_fit_are_left_alone():
    assert shorten_names(TIMM, 40) == {n: n for n in TIMM}


def test_prefix_note_says_where_bare_names_came_from(cli, tmp_path):
    seq = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(), torch.nn.BatchNorm2d(4)
    )
    path = save_safetensors({f"model.{k}": v for k, v in seq.state_dict().items()}, tmp_path / "bare.safetensors")
    out = cli("inspect", path, "--isolated", width=80).stdout
    assert "layer names without the prefix 'model.': layer 1 is 'model.1' in the file" in out, out
    assert out.count("layer 1 is 'model.1'") == 1


def test_no_prefix_note_for_named_layers(cli, tmp_path):
    state = {f"model.backbone.bn{i}.{k}": v for i in range(2) for k, v in torch.nn.BatchNorm2d(4).state_dict().items()}
    out = cli("inspect", save_safetensors(state, tmp_path / "named.safetensors"), "--isolated", width=80).stdout
    assert "without the prefix" not in out, out


def test_onnx_finding_names_are_not_split(cli, tmp_path):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    # a BN node whose variance is computed in the graph: a finding that quotes the node's
    # name, written as the torch exporter writes names
    name = "/resnet/encoder/stages.1/layers.0/shortcut/normalization/BatchNormalization"
    inits = [helper.make_tensor(n, TensorProto.FLOAT, [4], [1.0] * 4) for n in ("w", "b", "m")]
    nodes = [
        helper.make_node("Relu", ["s"], ["v"], name="/resnet/encoder/stages.1/layers.0/shortcut/Relu"),
        helper.make_node("BatchNormalization", ["x", "w", "b", "m", "v"], ["y"], name=name),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 2, 2]),
            helper.make_tensor_value_info("s", TensorProto.FLOAT, [4]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    for width in WIDTHS:
        narrow, wide = run_both(cli, "inspect", str(path), "--isolated", width=width)
        assert "BN013" in narrow, narrow
        check_table_lines(narrow, wide, [name], width)

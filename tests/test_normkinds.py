"""One answer to "is this a BatchNorm, and which kind" (bnaudit/normkinds.py): the table pinned
class by class and op by op, and the same answer from every place that asks."""

from __future__ import annotations

import json

import pytest
import torch
import torch.ao.nn.intrinsic as nni
import torch.ao.nn.intrinsic.qat as nniqat
import torch.ao.nn.intrinsic.quantized as nniq
import torch.ao.nn.quantized as nnq
from torch import nn
from typer.testing import CliRunner

from bnaudit.api import inspect
from bnaudit.audit.layers import facts_from_module_infos
from bnaudit.cli import app
from bnaudit.formats.containers import module_infos
from bnaudit.formats.read import read_checkpoint
from bnaudit.normkinds import (
    CLASSES,
    OPS,
    GroupKind,
    NormKind,
    NormOp,
    Statistics,
    classify,
    group_kind,
    looks_like_batchnorm_name,
    norm_calls,
    norm_op,
    onnx_op_kind,
    op_kind,
    own_method_calls,
)
from bnaudit.runtime.norms import batchnorm_modules, classify_layers, norm_modules

# torch.jit.script warns that TorchScript is deprecated; it is still a format users ship
pytestmark = [
    pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning"),
]


class MyBN(nn.BatchNorm2d):
    """A user subclass: TorchScript keeps only the name "MyBN", never the base class."""


class MyIN(nn.InstanceNorm2d):
    pass


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = MyBN(4, track_running_stats=False)
        self.bn2 = nn.BatchNorm2d(4)
        self.inorm = MyIN(4, track_running_stats=False, affine=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inorm(self.bn2(self.bn(self.conv(x))))


def test_scripted_batchnorm_subclass_without_running_stats_gets_bn006_from_the_archive_alone(tmp_path) -> None:
    # issue 20, Q2: before, BN006 needed --arch because "MyBN" does not contain "BatchNorm";
    # the archive's code shows that MyBN normalises by F.batch_norm, the untracked MyIN by
    # F.instance_norm (an InstanceNorm is batch-independent: no BN006 for it)
    path = tmp_path / "model.jit"
    torch.jit.save(torch.jit.script(Net().eval()), str(path))
    result = CliRunner().invoke(app, ["inspect", str(path), "--format", "json"])
    doc = json.loads(result.stdout)
    found = [(f["layer"], f["message"].split(":")[0]) for f in doc["files"][0]["findings"] if f["code"] == "BN006"]
    assert found == [("bn", "MyBN with track_running_stats=False")]


def test_the_archive_reader_and_the_runtime_give_one_answer_for_scripted_and_traced_modules(tmp_path) -> None:
    scripted, traced = tmp_path / "scripted.jit", tmp_path / "traced.jit"
    torch.jit.save(torch.jit.script(Net().eval()), str(scripted))
    eager = nn.Sequential(nn.Conv2d(3, 4, 3), MyBN(4), MyIN(4, track_running_stats=True)).eval()
    torch.jit.save(torch.jit.trace(eager, torch.randn(2, 3, 6, 6)), str(traced))
    for path, batch_norms, norms in ((scripted, ["bn", "bn2"], ["bn", "bn2", "inorm"]), (traced, ["1"], ["1", "2"])):
        loaded = torch.jit.load(str(path))
        assert list(batchnorm_modules(loaded)) == batch_norms, path.name
        assert list(norm_modules(loaded)) == norms, path.name
        facts = facts_from_module_infos(read_checkpoint(str(path)).modules)
        assert sorted(facts.batch_norms) == batch_norms, path.name
    # recalibrate now takes the scripted subclass for what it is
    targets, _ = classify_layers(torch.jit.load(str(traced)))
    assert list(targets) == ["1"]


def test_a_pickled_batchnorm_subclass_without_running_stats_gets_bn006_without_arch(tmp_path) -> None:
    path = tmp_path / "model.pt"
    torch.save(Net().eval(), str(path))
    report = inspect(str(path), trust_pickle=True)
    found = [(f.layer, f.message.split(":")[0]) for f in report.findings if f.code == "BN006"]
    assert found == [("bn", "MyBN with track_running_stats=False")]


# ----------------------------------------------------------------------------- the table


def _bases(cls: type) -> tuple[str, ...]:
    return tuple(f"{c.__module__}.{c.__qualname__}" for c in cls.__mro__[1:] if c is not object)


def _torch_says(cls: type) -> NormKind:
    """The kind by torch's own class hierarchy, independent of the table."""
    if issubclass(cls, nn.modules.batchnorm._BatchNorm):
        return NormKind.BATCH_NORM
    if issubclass(cls, nn.modules.instancenorm._InstanceNorm):
        return NormKind.INSTANCE_NORM
    return NormKind.NOT_NORM


TORCH_CLASSES = [
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.LazyBatchNorm1d,
    nn.LazyBatchNorm2d,
    nn.LazyBatchNorm3d,
    nn.SyncBatchNorm,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
    nn.LazyInstanceNorm1d,
    nn.LazyInstanceNorm2d,
    nn.LazyInstanceNorm3d,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.RMSNorm,
    nn.LocalResponseNorm,
    nn.CrossMapLRN2d,
    nnq.BatchNorm2d,
    nnq.BatchNorm3d,
    nnq.InstanceNorm2d,
    nnq.LayerNorm,
    nnq.GroupNorm,
    nniq.BNReLU2d,  # a quantized BatchNorm2d
    nniq.BNReLU3d,
    nni.BNReLU2d,  # a Sequential(BatchNorm2d, ReLU): its child "0" is the BatchNorm
    nni.ConvBn2d,
    nniqat.ConvBn1d,
    nniqat.ConvBn2d,
    nniqat.ConvBnReLU2d,
    nniqat.ConvBn3d,
]


@pytest.mark.parametrize("cls", TORCH_CLASSES, ids=lambda c: f"{c.__module__}.{c.__name__}")
def test_every_torch_normalisation_class_is_of_the_kind_its_torch_base_class_says(cls: type) -> None:
    assert classify(cls.__name__, _bases(cls)) is _torch_says(cls)


def test_torch_classes_known_by_name_alone_as_torchscript_keeps_them() -> None:
    # TorchScript keeps only the class name: every torch class the table names gets the
    # same answer from the name alone
    for cls in TORCH_CLASSES:
        if cls.__name__ in CLASSES:
            assert classify(cls.__name__) is _torch_says(cls), cls
    # the two BNReLU2d are told apart by what they call: the quantized one calls
    # quantized::batch_norm2d_relu, the Sequential one nothing (its child does)
    assert classify("BNReLU2d") is NormKind.NOT_NORM
    assert classify("BNReLU2d", calls=["ops.quantized.batch_norm2d_relu"]) is NormKind.BATCH_NORM


def test_fused_qat_convbn_holds_its_batchnorm_at_bn() -> None:
    fused = nniqat.ConvBnReLU2d(3, 4, 3, qconfig=torch.ao.quantization.get_default_qat_qconfig())
    kinds = {name: classify(type(m).__name__, _bases(type(m))) for name, m in fused.named_modules()}
    assert kinds[""] is NormKind.NOT_NORM and kinds["bn"] is NormKind.BATCH_NORM


@pytest.mark.parametrize(
    ("class_name", "bases", "kind"),
    [
        # torchvision.ops.misc / detectron2.layers / timm.layers: buffers, no training mode
        ("FrozenBatchNorm2d", ("torch.nn.modules.module.Module",), NormKind.FROZEN),
        ("FrozenBatchNormAct2d", ("torch.nn.modules.module.Module",), NormKind.FROZEN),
        # timm layers/norm_act.py: BatchNorm2d / SyncBatchNorm with an activation
        ("BatchNormAct2d", ("torch.nn.modules.batchnorm.BatchNorm2d",), NormKind.BATCH_NORM),
        ("SyncBatchNormAct", ("torch.nn.modules.batchnorm.SyncBatchNorm",), NormKind.BATCH_NORM),
        ("BatchNormAct2d", (), NormKind.BATCH_NORM),
        # a user subclass: its nearest known base decides
        ("MyBN", ("tests.MyBase", "torch.nn.modules.batchnorm.BatchNorm2d"), NormKind.BATCH_NORM),
        # look-alikes: the most specific known class wins over a BatchNorm base
        ("BatchRenorm2d", ("torch.nn.modules.batchnorm.BatchNorm2d",), NormKind.NOT_NORM),
        ("BatchRenorm", (), NormKind.NOT_NORM),
        ("LayerNorm2d", ("torch.nn.modules.normalization.LayerNorm",), NormKind.NOT_NORM),
        ("GroupNormAct", ("torch.nn.modules.normalization.GroupNorm",), NormKind.NOT_NORM),
        ("Frozen", ("torch.nn.modules.module.Module",), NormKind.NOT_NORM),
        # the names TorchScript gives: mangled, qualified
        ("__torch__.torch.nn.modules.batchnorm.___torch_mangle_3.BatchNorm2d", (), NormKind.BATCH_NORM),
    ],
)
def test_classes_of_other_libraries_and_look_alikes(class_name: str, bases: tuple[str, ...], kind: NormKind) -> None:
    assert classify(class_name, bases) is kind


def test_a_class_the_table_does_not_know_is_of_the_kind_of_the_norm_it_calls() -> None:
    assert classify("MyBN", calls=["__torch__.torch.nn.functional.batch_norm"]) is NormKind.BATCH_NORM
    assert classify("MyIN", calls=["torch.nn.functional.instance_norm"]) is NormKind.INSTANCE_NORM
    assert classify("Traced", calls=["torch.batch_norm"]) is NormKind.BATCH_NORM
    assert classify("Mine", calls=["torch.layer_norm", "torch.relu"]) is NormKind.NOT_NORM
    # a known name decides over its calls (detectron2's FrozenBatchNorm2d calls F.batch_norm)
    assert classify("FrozenBatchNorm2d", calls=["torch.nn.functional.batch_norm"]) is NormKind.FROZEN


def test_norm_calls_reads_torchscript_code_without_running_it() -> None:
    code = (
        "  _2 = __torch__.torch.nn.functional.batch_norm\n"
        "  bn : __torch__.torch.nn.modules.batchnorm.BatchNorm2d\n"  # an annotation, not a call
        "  _5 = torch.batch_norm(input, w, b, m, v, False, 0.1, 1e-05, True)\n"
        "  _6 = ops.quantized.batch_norm2d(x, w, b, m, v, 1e-05, 0.1, 0)\n"
        "  _7 = torch.layer_norm(x, [4], None, None, 1e-05)\n"
        "  y = my_torch.batch_norm(x)\n"  # not torch's
    )
    assert norm_calls(code) == ("torch.nn.functional.batch_norm", "aten::batch_norm", "quantized::batch_norm2d")
    assert own_method_calls("x = (self)._apply_instance_norm(input, )\n(self.child).forward(x)") == (
        "_apply_instance_norm",
    )


# ----------------------------------------------------------------------------- operators


ATEN_OPS = [op for op in OPS if op.name.startswith(("aten::", "quantized::"))]


@pytest.mark.parametrize("op", ATEN_OPS, ids=lambda op: op.name)
def test_every_operator_of_the_table_exists_in_torch_with_its_training_argument_where_it_says(op: NormOp) -> None:
    namespace, _, name = op.name.partition("::")
    packet, _, overload = name.partition(".")
    schema = getattr(getattr(getattr(torch.ops, namespace), packet), overload or "default")._schema
    bools = [i for i, a in enumerate(schema.arguments) if str(a.type) == "bool" and not a.kwarg_only]
    flags = [schema.arguments[i].name for i in bools if schema.arguments[i].name in ("training", "use_input_stats")]
    if op.statistics is Statistics.ARGUMENT:
        assert schema.arguments[op.training_arg].name in ("training", "use_input_stats")
    elif op.name != "aten::_native_batch_norm_legit.no_stats":  # no stats: batch statistics whatever it says
        assert flags == [], f"{op.name} has a {flags} argument: its statistics are not fixed"


def test_torch_export_graph_nodes_are_classified_with_their_statistics() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.InstanceNorm2d(4)).eval()
    program = torch.export.export(model, (torch.randn(2, 3, 6, 6),)).run_decompositions()
    ops = [norm_op(str(n.target)) for n in program.graph.nodes if n.op == "call_function"]
    assert [(op.name, op.kind, op.statistics) for op in ops if op is not None] == [
        ("aten::_native_batch_norm_legit_no_training", NormKind.BATCH_NORM, Statistics.RUNNING),
        # InstanceNorm decomposes into a batch norm over the reshaped (1, N*C, ...) input
        ("aten::_native_batch_norm_legit.no_stats", NormKind.BATCH_NORM, Statistics.BATCH),
    ]
    # a program exported in training mode (its decomposition's spelling)
    training = norm_op("aten._native_batch_norm_legit_functional.default")
    assert training is not None and training.statistics is Statistics.ARGUMENT and training.training_arg == 5
    assert op_kind("aten.batch_norm.default") is NormKind.BATCH_NORM
    assert op_kind("aten::instance_norm") is NormKind.INSTANCE_NORM
    assert op_kind("aten.layer_norm.default") is NormKind.NOT_NORM


def test_onnx_op_types() -> None:
    assert onnx_op_kind("BatchNormalization") is NormKind.BATCH_NORM
    assert onnx_op_kind("InstanceNormalization") is NormKind.INSTANCE_NORM
    assert onnx_op_kind("LayerNormalization") is NormKind.NOT_NORM
    assert onnx_op_kind("aten::batch_norm") is NormKind.NOT_NORM  # an op type from the file: ONNX names only


# ----------------------------------------------------------------------------- key groups


def _groups(tmp_path, state: dict[str, torch.Tensor]) -> dict[str, GroupKind | None]:
    torch.save(state, tmp_path / "state.pt")
    tensors = read_checkpoint(str(tmp_path / "state.pt")).tensors
    groups: dict[str, dict] = {}
    for name, ref in tensors.items():
        prefix, _, leaf = name.rpartition(".")
        groups.setdefault(prefix, {})[leaf] = ref
    return {prefix: group_kind(group) for prefix, group in groups.items()}


def test_key_groups_of_real_state_dicts(tmp_path) -> None:
    quantized = nnq.BatchNorm2d(4)
    state = {
        **{f"bn.{k}": v for k, v in nn.BatchNorm2d(4).state_dict().items()},
        **{f"inorm.{k}": v for k, v in nn.InstanceNorm2d(4, track_running_stats=True).state_dict().items()},
        **{f"q.{k}": v for k, v in quantized.state_dict().items() if isinstance(v, torch.Tensor)},
        "frozen.weight": torch.ones(4),
        "frozen.bias": torch.zeros(4),
        "frozen.running_mean": torch.zeros(4),
        "frozen.running_var": torch.ones(4),
        "renorm.running_mean": torch.zeros(4),
        "renorm.running_std": torch.ones(4),
        "obs.running_mean": torch.zeros(4, dtype=torch.float64),
        "obs.running_var": torch.ones(4, dtype=torch.float64),
        "obs.count": torch.tensor(10.0, dtype=torch.float64),
        "e3nn.running_mean": torch.zeros(3),
        "e3nn.running_var": torch.ones(5),
        "half.running_mean": torch.zeros(4),
        "ln.weight": torch.ones(4),
        "ln.bias": torch.zeros(4),
    }
    kinds = {p: (k.kind, k.label) if k is not None else None for p, k in _groups(tmp_path, state).items()}
    assert kinds == {
        "bn": (NormKind.BATCH_NORM, "BatchNorm"),
        "inorm": (NormKind.BATCH_NORM, "BatchNorm"),  # the same leaves: only the module tells them apart
        "q": (NormKind.BATCH_NORM, "QuantizedBatchNorm"),
        "frozen": (NormKind.BATCH_NORM, "BatchNorm (no counter)"),
        "renorm": (NormKind.NOT_NORM, "BatchRenorm"),
        "obs": (NormKind.NOT_NORM, "observation normaliser"),
        "e3nn": (NormKind.NOT_NORM, "statistics of different lengths"),
        "half": (NormKind.BATCH_NORM, "BatchNorm (incomplete)"),
        "ln": None,
    }
    assert looks_like_batchnorm_name("layer1.0.bn1") and looks_like_batchnorm_name("layer1.0.downsample.1")
    assert not looks_like_batchnorm_name("encoder.norm1") and not looks_like_batchnorm_name("abnormal")


class BatchRenorm2d(nn.BatchNorm2d):
    """A BatchRenorm built on BatchNorm2d: the table's look-alike, whatever its base."""


class BatchNormAct2d(nn.BatchNorm2d):
    """timm's: a BatchNorm2d with an activation child."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.act = nn.ReLU()


def test_eager_modules_get_the_tables_answer_by_their_class_and_bases() -> None:
    model = nn.Sequential(MyBN(4), BatchRenorm2d(4), BatchNormAct2d(4), MyIN(4), nn.LayerNorm(4))
    assert list(batchnorm_modules(model)) == ["0", "2"]
    assert list(norm_modules(model)) == ["0", "2", "3"]
    # and the pickled-module reader records the same bases for the audit
    infos = module_infos(model)
    assert sorted(facts_from_module_infos(infos).batch_norms) == ["0", "2"]

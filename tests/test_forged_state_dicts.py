"""bnaudit never reports fewer BN layers than torch would load (issue #32).

A forged state dict passed the audit: one BUILD after a normal state dict (`OrderedDict` +
SETITEMS, then `}X'items' c collections\\nOrderedDict\\n s b`) put an instance attribute
`items` on the dict, so bnaudit's `sd.items()` returned nothing ("0 BN layers", exit 0)
while `torch.load(weights_only=True)` accepts the file and `load_state_dict` loads every
tensor (it reads through `keys()` and `[]`). The reference here is torch itself: load the
file with `torch.load(weights_only=True)` and count the BN layers whose running statistics
`load_state_dict` copies into the model. Property: a file is refused (exit 2) or bnaudit
audits at least that many BN layers, for generated state dicts with a random opcode snippet
inserted (BUILD shadowing every dict method, SETITEM, single opcodes).
"""

from __future__ import annotations

import io
import pickle
import pickletools
import struct
import zipfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bnaudit.api import inspect


def model_of(channels: list[int]) -> torch.nn.Sequential:
    layers: list[torch.nn.Module] = []
    previous = 3
    for width in channels:
        layers += [torch.nn.Conv2d(previous, width, 1), torch.nn.BatchNorm2d(width)]
        previous = width
    model = torch.nn.Sequential(*layers)
    model.train()
    model(torch.randn(4, 3, 2, 2))  # statistics away from their initial values
    return model.eval()


def text(s: str) -> bytes:
    b = s.encode()
    return pickle.BINUNICODE + struct.pack("<I", len(b)) + b


def data_pkl(model: torch.nn.Module) -> tuple[bytes, bytes]:
    """(the bytes of a torch.save zip of the model's state dict, its data.pkl)."""
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as z:
        return buffer.getvalue(), z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))


def with_data_pkl(archive: bytes, data: bytes, path: Path) -> Path:
    with zipfile.ZipFile(io.BytesIO(archive)) as zin, zipfile.ZipFile(path, "w") as zout:
        for entry in zin.namelist():
            zout.writestr(entry, data if entry.endswith("/data.pkl") else zin.read(entry))
    return path


def shadow(attribute: str, value: bytes = pickle.GLOBAL + b"collections\nOrderedDict\n") -> bytes:
    """BUILD on the object on top of the stack: an instance attribute `attribute` = `value`."""
    return pickle.EMPTY_DICT + text(attribute) + value + pickle.SETITEM + pickle.BUILD


def torch_loaded_bn_layers(path: Path, channels: list[int]) -> int:
    """BN layers whose running_mean and running_var torch.load(weights_only=True) followed by
    load_state_dict copies into the model: the independent count."""
    try:
        state = torch.load(path, weights_only=True)
    except Exception:
        return 0
    model = model_of(channels)
    for module in model:
        if isinstance(module, torch.nn.BatchNorm2d):
            module.reset_running_stats()
            module.running_mean.fill_(float("nan"))
    try:
        result = model.load_state_dict(state, strict=False)
    except Exception:
        return 0  # torch refuses the file's state dict: nothing is loaded
    missing = set(result.missing_keys)
    return sum(
        1
        for i, module in enumerate(model)
        if isinstance(module, torch.nn.BatchNorm2d)
        and f"{i}.running_mean" not in missing
        and f"{i}.running_var" not in missing
        and not torch.isnan(module.running_mean).any()
    )


def audited_bn_layers(path: Path) -> int | None:
    """BN layers bnaudit audits in the file; None when it refuses the file."""
    (file,) = inspect(str(path)).files
    return None if file.error else len(file.layers)


# ----------------------------------------------------------------------------- the attack


@pytest.mark.parametrize("attribute", ["items", "keys", "values", "get", "__iter__", "__len__", "_metadata"])
def test_a_dict_method_shadowed_by_build_never_hides_a_layer(tmp_path, attribute, cli):
    channels = [4, 6]
    archive, data = data_pkl(model_of(channels))
    forged = data[:-1] + shadow(attribute) + pickle.STOP  # after the state dict's own BUILD
    path = with_data_pkl(archive, forged, tmp_path / "forged.pt")
    loaded = torch_loaded_bn_layers(path, channels)
    if attribute == "items":  # the reported case: torch accepts it and loads every layer
        assert loaded == 2
    audited = audited_bn_layers(path)
    assert audited is None or audited >= loaded, (attribute, audited, loaded)
    if attribute != "_metadata":
        result = cli("inspect", str(path))
        assert result.exit_code == 2, result.stdout  # was exit 0, "0 BN layers"
        (line,) = [x for x in result.stderr.splitlines() if x.strip()]
        assert f"sets attributes ('{attribute}')" in line and "only a state dict's _metadata is read" in line


def test_a_plain_state_dict_still_reads_every_layer(tmp_path):
    channels = [4, 6, 2]
    archive, data = data_pkl(model_of(channels))
    path = with_data_pkl(archive, data, tmp_path / "plain.pt")
    assert audited_bn_layers(path) == torch_loaded_bn_layers(path, channels) == 3


# ----------------------------------------------------------------------------- the property


DICT_METHODS = sorted(
    {name for name in dir(dict) if not name.startswith("__")}
    | {"__iter__", "__len__", "__contains__", "__getitem__", "__class__", "__dict__", "_metadata"}
)
VALUES = [
    pickle.GLOBAL + b"collections\nOrderedDict\n",
    pickle.EMPTY_TUPLE,
    pickle.EMPTY_DICT,
    pickle.NONE,
    pickle.EMPTY_LIST,
    pickle.BININT1 + b"\x00",
]


def test_every_dict_method_shadowed_with_every_value_never_hides_a_layer(tmp_path):
    channels = [3, 2]
    archive, pkl = data_pkl(model_of(channels))
    hidden = []
    for attribute in DICT_METHODS:
        for value in VALUES:
            path = with_data_pkl(archive, pkl[:-1] + shadow(attribute, value) + pickle.STOP, tmp_path / "f.pt")
            loaded, audited = torch_loaded_bn_layers(path, channels), audited_bn_layers(path)
            if audited is not None and audited < loaded:
                hidden.append((attribute, value, audited, loaded))
    assert hidden == []


# what readers of a mapping call: shadowed most often
READ_THROUGH = ["items", "keys", "values", "get", "__iter__", "__len__", "__contains__", "__getitem__"]


@st.composite
def snippets(draw: st.DrawFn, channels: list[int]) -> bytes:
    kind = draw(st.integers(0, 9))  # weights by hand: a BUILD shadowing a method is the attack
    value = VALUES[0] if draw(st.booleans()) else draw(st.sampled_from(VALUES))  # the class: callable
    if kind < 6:
        names = READ_THROUGH if draw(st.integers(0, 9)) < 7 else DICT_METHODS
        return shadow(draw(st.sampled_from(names)), value)
    if kind < 8:
        keys = [f"{2 * i + 1}.{leaf}" for i in range(len(channels)) for leaf in ("running_mean", "running_var")]
        return text(draw(st.sampled_from([*keys, "x", "0.weight", "bn.running_var"]))) + value + pickle.SETITEM
    return bytes([draw(st.sampled_from(list(b"bsu012(tR.0ea)N]}\x85\x86\x87\x88\x89")))])


def opcode_boundaries(data: bytes) -> list[int]:
    return [position for _, _, position in pickletools.genops(data)]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_never_fewer_bn_layers_than_torch_loads(tmp_path_factory, data):
    channels = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=3), label="channels")
    archive, pkl = data_pkl(model_of(channels))
    snippet = data.draw(snippets(channels), label="snippet")
    boundaries = opcode_boundaries(pkl)
    # mostly at the end (on the root state dict), else anywhere
    at = len(pkl) - 1 if data.draw(st.integers(0, 9)) < 6 else data.draw(st.sampled_from(boundaries), label="at")
    forged = pkl[:at] + snippet + pkl[at:]
    path = with_data_pkl(archive, forged, tmp_path_factory.mktemp("forged") / "forged.pt")
    loaded = torch_loaded_bn_layers(path, channels)
    audited = audited_bn_layers(path)
    assert audited is None or audited >= loaded, (audited, loaded, snippet, at)

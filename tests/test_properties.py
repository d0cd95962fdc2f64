"""Property-based tests: random state dicts and random bytes never crash inspect.

The state dicts are written both as safetensors and with torch.save; the findings
are compared with a direct computation in this file, on the values as stored
(read back by torch, after the dtype conversion). Audits run with debug=True so
that an unexpected exception fails the test instead of becoming a file error.
"""

from __future__ import annotations

import functools
import io
import math
import os
import struct
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from bnaudit.audit.checkpoint.inspect import audit_file
from bnaudit.config import Config

torch.set_num_threads(1)

EPS = 1e-5  # what bnaudit assumes for a state dict (no modules saved)
MOMENTUM = 0.1
SETTINGS = settings(
    max_examples=int(os.environ.get("BNAUDIT_EXAMPLES", 40)),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

FLOAT_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
SPECIAL = [
    0.0,
    -0.0,
    1.0,
    -1.0,
    math.nan,
    math.inf,
    -math.inf,
    1e-40,
    5e-324,
    1e-8,
    5e-5,
    9.9e-5,
    1e-4,
    2.5,
    65504.0,
    1e5,
    1e300,
    -1e-30,
]
values = st.one_of(st.sampled_from(SPECIAL), st.floats(allow_nan=True, allow_infinity=True))


@dataclass
class Group:
    prefix: str
    kind: str  # "bn" | "mean_only" | "two_d" | "int_stats"
    tensors: dict[str, torch.Tensor]


@st.composite
def groups(draw, prefix: str) -> Group:
    kind = draw(st.sampled_from(["bn", "bn", "bn", "mean_only", "two_d", "int_stats"]))
    c = draw(st.integers(0, 5))
    dtype = draw(st.sampled_from(FLOAT_DTYPES))

    def vector(n: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.tensor(draw(st.lists(values, min_size=n, max_size=n)), dtype=torch.float64).to(dt)

    mean, var = vector(c), vector(c)
    if draw(st.booleans()):  # often exactly the initial values, so BN002 gets exercised
        mean, var = torch.zeros(c, dtype=dtype), torch.ones(c, dtype=dtype)
    tensors: dict[str, torch.Tensor] = {}
    if kind == "two_d":
        mean, var = mean.reshape(c, 1), var.reshape(c, 1)
    if kind == "int_stats":
        mean, var = torch.zeros(c, dtype=torch.int64), torch.ones(c, dtype=torch.int64)
    tensors["running_mean"] = mean
    if kind != "mean_only":
        tensors["running_var"] = var
    for name in ("weight", "bias"):
        choice = draw(st.sampled_from(["none", "same", "same", "other", "initial"]))
        if choice == "same":
            tensors[name] = vector(c, draw(st.sampled_from(FLOAT_DTYPES)))
        elif choice == "other":
            tensors[name] = vector(draw(st.integers(0, 6).filter(lambda n: n != c)))
        elif choice == "initial":
            tensors[name] = torch.ones(c) if name == "weight" else torch.zeros(c)
    counter = draw(st.sampled_from(["none", "int", "int", "float", "pair"]))
    if counter == "int":
        tensors["num_batches_tracked"] = torch.tensor(draw(st.integers(-3, 10**7)), dtype=torch.int64)
    elif counter == "float":
        tensors["num_batches_tracked"] = torch.tensor(3.0)
    elif counter == "pair":
        tensors["num_batches_tracked"] = torch.tensor([3, 4])
    return Group(prefix, kind, tensors)


prefixes = st.from_regex(r"[a-z][a-z0-9_]{0,6}(\.[a-z0-9_]{1,4}){0,2}", fullmatch=True).filter(
    lambda p: not p.startswith("mod")  # keep clear of the module./model. wrapper prefixes
)


@st.composite
def state_dicts(draw) -> tuple[list[Group], dict[str, torch.Tensor], bool]:
    names = draw(st.lists(prefixes, min_size=1, max_size=4, unique=True))
    gs = [draw(groups(name)) for name in names]
    wrapped = draw(st.booleans())  # DDP-style "module." on every key: stripped by bnaudit
    state: dict[str, torch.Tensor] = {}
    for g in gs:
        for leaf, tensor in g.tensors.items():
            state[f"{g.prefix}.{leaf}"] = tensor
    state["zz_extra_conv.weight"] = torch.randn(2, 1, 3, 3)
    if wrapped:
        state = {f"module.{k}": v for k, v in state.items()}
    return gs, state, wrapped


# ----------------------------------------------------------------------------- the direct computation


def f64(t: torch.Tensor | None) -> np.ndarray | None:
    return None if t is None else t.to(torch.float64).numpy()


def expected_findings(gs: list[Group]) -> dict:
    layers = [g for g in gs if g.kind == "bn"]
    out: dict = {
        "layers": sorted(g.prefix for g in layers),
        "BN001": sorted(g.prefix for g in gs if g.kind == "mean_only"),
        "BN004": {},
        "BN005": {},
        "BN003": set(),
    }
    identity, counters_none, trained_affine = [], [], []
    for g in layers:
        t = g.tensors
        mean, var = f64(t["running_mean"]), f64(t["running_var"])
        c = mean.shape[0]
        counter_ref = t.get("num_batches_tracked")
        counter = (
            int(counter_ref.item())
            if counter_ref is not None and not counter_ref.is_floating_point() and counter_ref.numel() == 1
            else None
        )
        bad: set[int] = set()
        invalid = False
        for name in ("running_mean", "running_var", "weight", "bias"):
            v = f64(t.get(name))
            if v is None:
                continue
            if v.shape != (c,):
                invalid = True
                continue
            nonfinite = set(np.flatnonzero(~np.isfinite(v)).tolist())
            invalid |= bool(nonfinite)
            bad |= nonfinite
        negative = set(np.flatnonzero(var < 0).tolist())  # NaN compares False
        invalid |= bool(negative) or (counter is not None and counter < 0)
        bad |= negative
        if invalid:
            out["BN005"][g.prefix] = tuple(sorted(bad))
        near = tuple(i for i in range(c) if np.isfinite(var[i]) and 0 <= var[i] < 10 * EPS)
        if near:
            out["BN004"][g.prefix] = near
        is_identity = c > 0 and bool(np.all(mean == 0) and np.all(var == 1))
        identity.append(is_identity)
        counters_none.append(counter is None)
        w, b = f64(t.get("weight")), f64(t.get("bias"))
        initial = (w is None or bool(np.all(w == 1))) and (b is None or bool(np.all(b == 0)))
        trained_affine.append(not initial)
        if counter is not None and counter > 0 and not is_identity and (1 - MOMENTUM) ** counter > 0.05:
            out["BN003"].add(g.prefix)
        # no counter: trained weights over a running_var still at the initial 1 (within float32
        # rounding, 8 * 2^-23) in half the channels or more
        unmoved = c > 0 and np.mean(np.abs(var - 1.0) <= 8 * 2.0**-23) >= 0.5
        if counter_ref is None and not is_identity and not initial and unmoved:
            out["BN003"].add(g.prefix)
    folded = bool(layers) and all(identity) and all(counters_none) and all(trained_affine)
    out["BN002"] = [None] if folded else sorted(g.prefix for g, i in zip(layers, identity) if i)
    return out


def observed_findings(report) -> dict:
    by_code: dict[str, list] = {}
    for f in report.findings:
        by_code.setdefault(f.code, []).append(f)
    return {
        "layers": sorted(s.name for s in report.layers),
        "BN001": sorted(f.layer for f in by_code.get("BN001", [])),
        "BN002": sorted((f.layer for f in by_code.get("BN002", [])), key=lambda name: name or ""),
        "BN003": {f.layer for f in by_code.get("BN003", [])},
        "BN004": {f.layer: f.channels for f in by_code.get("BN004", [])},
        "BN005": {f.layer: f.channels for f in by_code.get("BN005", [])},
    }


@SETTINGS
@given(state_dicts())
def test_random_state_dicts_never_crash_and_findings_agree(case):
    gs, state, wrapped = case
    expected = expected_findings(gs)
    for code in ("BN001", "BN002", "BN003", "BN004", "BN005"):
        event(f"{code} expected: {bool(expected[code])}")
    with tempfile.TemporaryDirectory() as tmp:
        paths = {
            "safetensors": os.path.join(tmp, "sd.safetensors"),
            "torch-zip": os.path.join(tmp, "sd.pt"),
            "torch-legacy": os.path.join(tmp, "legacy.pt"),
        }
        save_file(state, paths["safetensors"])
        torch.save(state, paths["torch-zip"])
        torch.save(state, paths["torch-legacy"], _use_new_zipfile_serialization=False)
        for fmt, path in paths.items():
            report = audit_file(path, Config(), debug=True)
            assert report.error is None, (fmt, report.error)
            assert report.format == fmt
            assert report.prefix == ("module." if wrapped else "")
            assert observed_findings(report) == expected, fmt


# ----------------------------------------------------------------------------- random bytes


def _valid_files() -> dict[str, bytes]:
    """One small valid file per format, for mutation."""
    state = {
        "bn.running_mean": torch.tensor([0.5, -1.0]),
        "bn.running_var": torch.tensor([2.0, 1e-7]),
        "bn.weight": torch.ones(2),
        "bn.bias": torch.zeros(2),
        "bn.num_batches_tracked": torch.tensor(7),
    }
    files = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "f")
        save_file(state, path)
        files["safetensors"] = Path(path).read_bytes()
        buffer = io.BytesIO()
        torch.save(state, buffer)
        files["torch-zip"] = buffer.getvalue()
        buffer = io.BytesIO()
        torch.save(state, buffer, _use_new_zipfile_serialization=False)
        files["torch-legacy"] = buffer.getvalue()
        model = torch.nn.Sequential(torch.nn.BatchNorm1d(2))
        torch.jit.save(torch.jit.script(model), path)
        files["torchscript"] = Path(path).read_bytes()
    return files


valid_files = functools.lru_cache(maxsize=None)(_valid_files)

MAGIC_PREFIXES = [
    b"",
    b"PK\x03\x04",
    b"PK\x05\x06",
    b"\x80\x02",
    b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19.",
    struct.pack("<Q", 2) + b"{}",
    struct.pack("<Q", 40) + b"{",
    b"\x00" * 8 + b"{",
]


def audit_bytes(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "blob.pt")
        with open(path, "wb") as f:
            f.write(data)
        report = audit_file(path, Config(), debug=True)  # BnauditError -> report.error; anything else raises
        assert report.error is None or report.error.strip()
        with open(path, "rb") as f:
            assert f.read() == data  # never modified


@SETTINGS
@given(st.sampled_from(MAGIC_PREFIXES), st.binary(max_size=600))
def test_random_bytes_never_crash_the_readers(prefix, tail):
    audit_bytes(prefix + tail)


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(["safetensors", "torch-zip", "torch-legacy", "torchscript"]),
    st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)), max_size=12),
    st.one_of(st.none(), st.floats(0, 1)),
)
def test_mutated_valid_files_never_crash_the_readers(fmt, edits, cut):
    data = bytearray(valid_files()[fmt])
    for where, byte in edits:
        data[int(where * len(data))] = byte
    if cut is not None:
        data = data[: int(cut * len(data))]
    audit_bytes(bytes(data))


def test_mutation_base_files_are_valid():
    """The files mutated above are valid to begin with (else the test only mutates garbage)."""
    for fmt, data in valid_files().items():
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "f.pt")
            with open(path, "wb") as f:
                f.write(data)
            report = audit_file(path, Config(), debug=True)
            assert report.error is None and report.format == fmt
            assert [s.name for s in report.layers] == (["0"] if fmt == "torchscript" else ["bn"])
    with zipfile.ZipFile(io.BytesIO(valid_files()["torch-zip"])) as archive:
        assert any(n.endswith("data.pkl") for n in archive.namelist())

"""What a file of a training-run folder is when it holds no model weights.

A Hugging Face Trainer `checkpoint-500/`, an accelerate or DeepSpeed folder, sits the
model next to optimizer and scheduler state, RNG state and pickled training arguments.
Those are recognised, never audited and never an error:

  by content   the object the restricted reader (formats/unpickle.py) rebuilt holds no
               state dict and looks like `optimizer.state_dict()` (`state` +
               `param_groups`), an LR scheduler's (`last_epoch` + `base_lrs`), a GradScaler's,
               a DeepSpeed ZeRO partition (`optimizer_state_dict`), or RNG state (only
               keys such as `python` / `numpy` / `cpu` / `cuda`, accelerate's
               `random_state` / `torch_manual_seed`...)
  by name      when the restricted reader refused the file (it needs classes of the user's
               project, e.g. a pickled `TrainingArguments`), the file name says what it is
               (`training_args.bin`, `rng_state_3.pth`, `zero_pp_rank_0_mp_rank_00_optim_states.pt`,
               ...) and the globals it would need are listed without running anything
               (the restricted unpickler's inert scan of the zip's data.pkl or of the
               file's pickles, `Mode.SCAN`).

A file that is neither stays an error: nothing here ever unpickles beyond the
restricted reader.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from bnaudit.errors import BnauditError


class NotModelWeights(BnauditError):
    """`path` is recognisably not model weights: `what` says what it is."""

    def __init__(self, path: str, what: str) -> None:
        super().__init__(f"{path}: {what}: not model weights, nothing to audit")
        self.path = path
        self.what = what


# Names the Trainer, accelerate and DeepSpeed give their non-weight files. Patterns, not
# compiled ones: only torch.save files are asked about, `re` compiles them then.
_NAMES: tuple[tuple[str, str], ...] = (
    (r"^(bf16_)?zero_pp_rank_\d+_mp_rank_\d+_optim_states\.pt$", "DeepSpeed ZeRO optimizer partition"),
    (r"^optimizer(_\d+)?\.(pt|pth|bin)$", "optimizer state"),
    (r"^(lr_)?scheduler(_\d+)?\.(pt|pth|bin)$", "LR scheduler state"),
    (r"^(rng_state(_\d+)?\.pth|random_states_\d+\.pkl)$", "RNG state"),
    (r"^(scaler|grad_scaler)(_\d+)?\.(pt|pth|bin)$", "AMP grad scaler state"),
    (r"^training_args\.bin$", "training arguments"),
)

# A directory scan picks these up although their suffix is not a checkpoint's.
SCANNED_NAMES = re.compile(r"^random_states_\d+\.pkl$")

# Keys of the Trainer's rng_state.pth and accelerate's random_states_N.pkl.
_RNG_KEYS = {
    "python",
    "numpy",
    "cpu",
    "cuda",
    "mps",
    "xpu",
    "npu",
    "hpu",
    "mlu",
    "musa",
    "random_state",
    "numpy_random_seed",
    "torch_manual_seed",
    "torch_cuda_manual_seed",
    "torch_xpu_manual_seed",
    "torch_npu_manual_seed",
    "torch_mlu_manual_seed",
    "torch_musa_manual_seed",
    "xm_seed",
}


# What bnaudit's own data files hold (runtime/sources.py: `inputs` and `labels`; numpy
# files' `x` and `y`) and the usual name for labels elsewhere.
_DATA_INPUTS = {"inputs", "x"}
_DATA_NAMES = _DATA_INPUTS | {"labels", "targets", "y"}


def data_tensors(shapes: Mapping[str, tuple[int, ...]]) -> str | None:
    """ "inputs (300, 1, 8, 8), labels (300,)" when the tensors (name -> shape) are a data
    set rather than a model: every name is one of inputs / labels / targets / x / y and
    one of them is inputs or x. A model's names are module paths (`fc.weight`), so one
    parameter among them makes it a model. None otherwise."""
    names = set(shapes)
    if not names or not names <= _DATA_NAMES or not names & _DATA_INPUTS:
        return None
    return ", ".join(f"{name} {tuple(shapes[name])}" for name in sorted(names, key=lambda n: n not in _DATA_INPUTS))


def kind_from_name(path: str) -> str | None:
    name = os.path.basename(path)
    return next((what for pattern, what in _NAMES if re.match(pattern, name)), None)


def kind_from_object(path: str, obj: Any) -> str | None:
    """What a restricted-loaded object without a state dict is, or None."""
    if isinstance(obj, Mapping):
        keys = {k for k in obj if isinstance(k, str)}
        if {"state", "param_groups"} <= keys:
            return "optimizer state (state, param_groups)"
        if "optimizer_state_dict" in keys or "base_optimizer_state" in keys:
            return "DeepSpeed ZeRO optimizer partition (optimizer_state_dict)"
        if {"last_epoch", "base_lrs"} <= keys:
            return "LR scheduler state (last_epoch, base_lrs)"
        if {"scale", "growth_factor"} <= keys:
            return "AMP grad scaler state (scale, growth_factor)"
        if keys and keys == set(obj) and keys <= _RNG_KEYS:
            return f"RNG state ({', '.join(sorted(keys))})"
    return kind_from_name(path)


def kind_from_refusal(path: str) -> str | None:
    """What a file the restricted reader refused is, from its name, naming the globals it
    would need (listed without running anything); None if the name says nothing or the
    file cannot even be scanned (a damaged file stays an error)."""
    what = kind_from_name(path)
    if what is None:
        return None
    try:
        needed = _needed_globals(path)
    except Exception:  # damaged or not a pickle: not ours to excuse
        return None
    if any(_could_run_code(g) for g in needed):
        return None  # a payload named optimizer.pt is refused as today, not excused by its name
    foreign = [g for g in needed if not g.startswith(_PLAIN_MODULES)]
    if not foreign:
        return None
    shown = ", ".join(foreign[:4]) + (f" and {len(foreign) - 4} more" if len(foreign) > 4 else "")
    return f"{what} (pickled {shown}, not loaded)"


# Globals every torch.save file names; what is left is the file's own classes.
_PLAIN_MODULES = (
    "torch.",
    "collections.",
    "builtins.",
    "_codecs.",
    "copyreg.",
    "numpy.core.",
    "numpy._core.",
    "numpy.dtype",
    "numpy.ndarray",
)

# Modules whose globals act (run commands, import, evaluate, open files) rather than
# rebuild data: a pickle that names one is never a training-run file, whatever its name.
_ACTING_MODULES = {
    "os",
    "posix",
    "nt",
    "subprocess",
    "sys",
    "importlib",
    "runpy",
    "pickle",
    "_pickle",
    "marshal",
    "shutil",
    "socket",
    "ctypes",
    "pty",
    "code",
    "codeop",
    "types",
    "functools",
    "operator",
    "io",
    "_io",
    "pathlib",
    "tempfile",
    "webbrowser",
    "multiprocessing",
    "threading",
    "signal",
    "asyncio",
    "urllib",
    "http",
    "platform",
    "glob",
    "pdb",
    "bdb",
    "timeit",
    "trace",
    "profile",
    "cProfile",
    "site",
    "sysconfig",
    "setuptools",
    "pip",
    "commands",
    "popen2",
    "__builtin__",
    "_operator",
    "_thread",
    "_posixsubprocess",
    "zipimport",
    "pkgutil",
    "inspect",
    "dill",
    "cloudpickle",
}

# builtins a plain-data pickle may name (the containers and scalars it rebuilds)
_DATA_BUILTINS = {
    "set",
    "frozenset",
    "slice",
    "complex",
    "bytearray",
    "bytes",
    "range",
    "object",
    "int",
    "float",
    "str",
    "dict",
    "list",
    "tuple",
    "bool",
    "NoneType",
    "Ellipsis",
}


def _could_run_code(name: str) -> bool:
    module, _, attr = name.rpartition(".")
    if module.split(".")[0] in _ACTING_MODULES:
        return True
    if module == "builtins":
        return attr not in _DATA_BUILTINS
    return module.startswith(("torch.hub", "torch.ops", "torch.jit", "torch.serialization", "torch.package")) or (
        module == "torch" and attr in {"load", "save"}
    )


def _needed_globals(path: str) -> list[str]:
    import zipfile  # here: only pickled files get this far, and most inspected files are not

    if zipfile.is_zipfile(path):
        # every global of data.pkl (torch's own scan lists only those outside its allow-list:
        # the rest are torch., collections., builtins. names, dropped below either way)
        with zipfile.ZipFile(path) as archive:
            entry = next(n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1)
            if archive.getinfo(entry).file_size > 16 * 1024 * 1024:
                raise ValueError("data.pkl too large to scan")
            return _pickle_globals(archive.read(entry))
    with open(path, "rb") as f:
        return _pickle_globals(f.read(16 * 1024 * 1024))


def _pickle_globals(data: bytes) -> list[str]:
    """`module.name` of every global the pickles at the start of `data` name (a legacy
    torch.save file is several pickles in a row, then raw storage bytes), read by the
    restricted unpickler's inert scan: nothing named is imported or called."""
    from bnaudit.formats.allowed import Mode, Refused
    from bnaudit.formats.unpickle import unpickle

    found: list[str] = []
    start = 0
    for i in range(5):
        try:
            scanned = unpickle(data, Mode.SCAN, start=start)
        except Refused:
            if i == 0:
                raise
            break  # the raw storage bytes after a legacy file's pickles
        found += scanned.stand_ins
        start = scanned.end
    return list(dict.fromkeys(found))

"""Runnable models: a checkpoint plus the code that runs it.

Three sources, tried in this order by `load_runnable`:

  --arch MODULE:CALLABLE      (or path/to/file.py:CALLABLE) builds the module, called with no
                              arguments or with --arch-kwargs (a JSON object); the checkpoint's
                              state dict (any format and container `inspect` reads, wrapper
                              prefixes stripped as inspect does) is compared key by key with the
                              model's, as `load_state_dict(strict=True)` would, and loaded.
  TorchScript archive         `torch.jit.load`: runs as it is, no --arch needed.
  pickled nn.Module           a `torch.save(model)` file: loaded through the allow-list when it
                              is built only from torch.nn classes; any other class is refused
                              unless --trust-pickle (unpickling a class runs its code).

Missing, unexpected and mismatched keys become findings (BN001 exact for BN statistics,
BN011 for the rest); a shape mismatch makes the model unrunnable and is an error.

The helpers used to run a model on data live here too: `forward` (tensors, tuples, dicts,
or a --forward function), `output_tensor`, `to_device` and `resolve_device`. Which modules
are BatchNorm is `bnaudit.runtime.norms`'s answer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import importlib.util
import io
import json
import os
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from bnaudit.audit.layers import ModuleFacts, facts_from_module_infos
from bnaudit.audit.producers import BNCall, Producers, producers_from_calls, producers_from_names
from bnaudit.audit.resolve import model_checkpoint
from bnaudit.errors import BnauditError
from bnaudit.formats.containers import (
    choose_state_dict,
    find_state_dicts,
    module_infos,
    wrap_candidate,
)
from bnaudit.formats.model import Checkpoint, torch_ref
from bnaudit.formats.read import read_checkpoint
from bnaudit.formats.shards import is_index
from bnaudit.formats.sniff import sniff_format
from bnaudit.formats.torchobjects import load_torch_save
from bnaudit.runtime.norms import batchnorm_modules, is_batchnorm
from bnaudit.runtime.safetensors_files import read_checkpoint_tensors
from bnaudit.text import exception_line, plural


@dataclass
class RunnableModel:
    """A module ready to run, and what loading it revealed.

    module       the torch.nn.Module (or TorchScript ScriptModule), in eval mode, on the CPU
    checkpoint   the checkpoint it was loaded from; `modules` holds the model's real eps and
                 momentum, so layer discovery uses them instead of assumed defaults
    facts        ModuleFacts for the rules (BN001 exact, BN006, BN007, BN011)
    source       "arch", "torchscript" or "pickle"
    arch         the --arch spec when source is "arch"
    """

    module: Any
    checkpoint: Checkpoint
    facts: ModuleFacts
    source: str
    arch: str | None = None

    @property
    def scripted(self) -> bool:
        return self.source == "torchscript"

    def describe(self) -> str:
        if self.source == "arch":
            return f"--arch {self.arch}"
        return "TorchScript archive" if self.scripted else "pickled nn.Module"


_FILE_MODULES: dict[str, Any] = {}


def import_callable(spec: str, option: str = "--arch", shown: str | None = None) -> Callable[..., Any]:
    """`MODULE:CALLABLE` or `path/to/file.py:CALLABLE` -> the callable.

    The current directory is put on sys.path first (as uvicorn and gunicorn do), so a
    package in the working tree imports without installing it. CALLABLE may be dotted
    (`pkg.mod:Class.factory`). `shown`: how the option and its value read in an error
    (default `OPTION SPEC`).
    """
    given = shown or f"{option} {spec}"
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise BnauditError(f"{option} must be MODULE:CALLABLE or path/to/file.py:CALLABLE, got {spec!r}")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    importlib.invalidate_caches()  # files written since the last import must be found
    if where.endswith(".py") or "/" in where or os.sep in where:
        module = _import_file(where, option)
    else:
        held = None
        try:
            with _held_stderr() as held:
                module = importlib.import_module(where)
        except ModuleNotFoundError as exc:
            if exc.name and where.split(".")[0] == exc.name.split(".")[0]:
                raise BnauditError(
                    f"{given}: no module named '{exc.name}' (run from the folder that holds it, "
                    "or give path/to/file.py:CALLABLE)"
                ) from None
            raise BnauditError(f"{given}: importing '{where}' failed: {exception_line(exc)}") from None
        except Exception as exc:  # user code: any error while importing it is the user's
            raise BnauditError(f"{given}: importing '{where}' failed: {exception_line(exc)}") from None
        except SystemExit as exc:
            printed = held.getvalue() if held is not None else ""
            raise BnauditError(f"{given}: {exit_message(exc, f'importing {where!r}', printed)}") from None
    target: object = module
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise BnauditError(f"{given}: '{where}' has no attribute '{attr}'") from None
    if not callable(target):
        raise BnauditError(f"{given}: '{attr}' is not callable")
    return target


def _import_file(path: str, option: str) -> Any:
    full = os.path.abspath(path)
    if full in _FILE_MODULES:
        return _FILE_MODULES[full]
    if not os.path.isfile(full):
        raise BnauditError(f"{option}: no such file: {path}")
    # A name of our own (not the file's stem) so that the file cannot shadow a real module.
    stem = re.sub(r"\W", "_", os.path.splitext(os.path.basename(full))[0])
    name = f"bnaudit_user_{stem}_{hashlib.sha1(full.encode()).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(name, full)
    if spec is None or spec.loader is None:
        raise BnauditError(f"{option}: cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    folder = os.path.dirname(full)
    if folder not in sys.path:
        sys.path.append(folder)  # sibling imports of the file; appended so it shadows nothing
    sys.modules[name] = module
    held = None
    try:
        with _held_stderr() as held:
            spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise BnauditError(f"{option}: importing {path} failed: {exception_line(exc)}") from None
    except SystemExit as exc:
        del sys.modules[name]
        printed = held.getvalue() if held is not None else ""
        raise BnauditError(f"{option}: {exit_message(exc, f'importing {path}', printed)}") from None
    _FILE_MODULES[full] = module
    return module


def exit_message(exc: SystemExit, doing: str, printed: str = "") -> str:
    """User code that calls sys.exit() (argparse at import time does) must not end
    bnaudit with its own exit code: 1 would read as "findings", 0 as success."""
    code = exc.code
    shown = f": {code}" if isinstance(code, str) else f" with code {code}" if code not in (None, 0) else ""
    last = [line.strip() for line in printed.splitlines() if line.strip()]
    said = f" (it printed: {last[-1]})" if last else ""
    hint = (
        ('code that runs at import must not parse the command line or exit; guard it with `if __name__ == "__main__":`')
        if doing.startswith("importing")
        else "it must return, not exit"
    )
    return f"{doing} ended in sys.exit(){shown}{said}: {hint}"


@contextlib.contextmanager
def _held_stderr() -> Iterator[Any]:
    """Hold what user code prints to sys.stderr while it is imported: shown as it is when
    the import returns or raises, folded into the one-line error when it exits."""
    held = io.StringIO()
    try:
        with contextlib.redirect_stderr(held):
            yield held
    except SystemExit:
        raise
    except BaseException:
        sys.stderr.write(held.getvalue())
        raise
    sys.stderr.write(held.getvalue())


def parse_arch_kwargs(text: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """--arch-kwargs: a JSON object (or an already parsed mapping)."""
    if text is None:
        return {}
    if isinstance(text, Mapping):
        return dict(text)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BnauditError(f"--arch-kwargs is not valid JSON ({exc.msg} at column {exc.colno}): {text}") from None
    if not isinstance(value, dict):
        raise BnauditError(f"--arch-kwargs must be a JSON object like '{{\"num_classes\": 10}}', got {text}")
    return value


def build_arch(arch: str, arch_kwargs: str | Mapping[str, Any] | None = None, meta: bool = False) -> Any:
    """Call the --arch callable and check that it returns an nn.Module.

    `meta=True` builds on the meta device (no memory for weights): enough for the names,
    shapes and settings `inspect` needs. A constructor that cannot run on meta is built
    on the CPU instead.
    """
    factory = import_callable(arch)
    kwargs = parse_arch_kwargs(arch_kwargs)
    model = None
    if meta:
        try:
            with torch.device("meta"):
                model = factory(**kwargs)
        except Exception:
            model = None  # e.g. an init that reads values; fall back to a real build
    if model is None:
        try:
            model = factory(**kwargs)
        except Exception as exc:
            shown = f" with {json.dumps(kwargs)}" if kwargs else ""
            raise BnauditError(f"--arch {arch}: calling it{shown} failed: {exception_line(exc)}") from None
        except SystemExit as exc:
            raise BnauditError(f"--arch {arch}: {exit_message(exc, 'calling it')}") from None
    if not isinstance(model, torch.nn.Module):
        raise BnauditError(f"--arch {arch} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def _shape(value: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in value.shape)


def match_checkpoint(ckpt: Checkpoint, model: Any) -> tuple[Checkpoint, ModuleFacts]:
    """Line up a checkpoint with a model's state dict and describe the differences.

    inspect strips DDP / torch.compile / Lightning prefixes when every key has one; a
    model whose own keys start with such a word (a wrapper with `self.model`) needs
    part of it back, so the tail of the stripped prefix that matches the most model
    keys is restored. Returns the checkpoint renamed to the model's names, with the
    model's real module settings, and the ModuleFacts of the comparison.
    """
    model_state = dict(model.state_dict(keep_vars=True))
    stripped = ckpt.prefix
    tails = [stripped[i:] for i in range(len(stripped) + 1) if i == 0 or stripped[i - 1] == "."]
    best = max(
        reversed(tails),  # ties go to the shortest tail (inspect's choice)
        key=lambda tail: sum(1 for name in ckpt.tensors if tail + name in model_state),
    )
    tensors = {best + n: ref.renamed(best + n) for n, ref in ckpt.tensors.items()}
    infos = module_infos(model)
    batch_norms = frozenset(n for n in batchnorm_modules(model) if n in infos)
    missing = tuple(k for k in model_state if k not in tensors)
    unexpected = tuple(k for k in tensors if k not in model_state)
    mismatched = tuple(
        (k, tensors[k].shape, _shape(v))
        for k, v in model_state.items()
        if k in tensors and tensors[k].shape != _shape(v)
    )
    matched = dataclasses.replace(ckpt, tensors=tensors, prefix=stripped[: len(stripped) - len(best)], modules=infos)
    facts = ModuleFacts(infos, batch_norms, missing, unexpected, mismatched)
    return matched, facts


@dataclass(frozen=True)
class ArchReference:
    """The model --arch builds, as `inspect` compares files with it (the torch side of
    `bnaudit.audit.layers.ModelReference`)."""

    model: Any
    producers: Mapping[str, str]
    transposed: frozenset[str] = frozenset()

    def match(self, ckpt: Checkpoint) -> tuple[Checkpoint, ModuleFacts]:
        return match_checkpoint(ckpt, self.model)


def arch_reference(arch: str, arch_kwargs: str | Mapping[str, Any] | None = None) -> ArchReference:
    """Build the --arch model on the meta device (names, shapes and settings: no weights
    needed) and find its BN producers once, for every file it is compared with."""
    model = build_arch(arch, arch_kwargs, meta=True)
    producers = graph_producers(model)
    return ArchReference(model, producers.feeds, producers.transposed)


def check_fits(ckpt: Checkpoint, facts: ModuleFacts, arch: str) -> None:
    """Refuse a checkpoint the model cannot run with (nothing in common, or a shape clash)."""
    if facts.mismatched:
        key, file_shape, model_shape = facts.mismatched[0]
        more = f" (and {len(facts.mismatched) - 1} more)" if len(facts.mismatched) > 1 else ""
        raise BnauditError(
            f"{ckpt.path}: does not fit --arch {arch}: '{key}' has shape {list(file_shape)} in the checkpoint "
            f"but {list(model_shape)} in the model{more}; check --arch and --arch-kwargs"
        )
    matched = len(ckpt.tensors) - len(facts.unexpected)
    if ckpt.tensors and matched == 0 and facts.missing:
        example = next(iter(ckpt.tensors))
        raise BnauditError(
            f"{ckpt.path}: does not fit --arch {arch}: none of its {len(ckpt.tensors)} keys (e.g. '{example}') "
            f"is a key of the model (e.g. '{facts.missing[0]}')"
        )


def load_state(model: Any, ckpt: Checkpoint) -> None:
    """Copy every checkpoint tensor the model has into it (dtype converted by copy_)."""
    model_keys = set(model.state_dict().keys())
    refs = {name: ref for name, ref in ckpt.tensors.items() if name in model_keys}
    if ckpt.format == "safetensors" and not ckpt.shards:  # torch is loaded: the package reads it
        state = read_checkpoint_tensors(ckpt.path, refs)
    else:
        state = {name: ref.to_torch() for name, ref in refs.items()}
    model.load_state_dict(state, strict=False)


# read_checkpoint gives only an ONNX graph's BatchNormalization tensors: loaded into --arch
# they would leave every other weight at its random initial value, and the measurement would
# be of a model nobody trained.
_ONNX_NOT_RUNNABLE = (
    "{path}: an ONNX model cannot be run here (only its BatchNormalization statistics are read): "
    "give the PyTorch checkpoint it was exported from; audit the export with `bnaudit inspect`"
)

_PT2_NOT_RUNNABLE = (
    "{path}: a torch.export program is not run here (running it would unpickle parts of the archive; "
    "only its batch-norm statistics are read): give the PyTorch checkpoint it was exported from; "
    "audit the program with `bnaudit inspect` and check it with `bnaudit diff checkpoint.pt program.pt2`"
)


@dataclass(frozen=True)
class ModelSpec:
    """Which model a measuring command runs, and how it is built and called: what gap,
    invariance, recalibrate, fold --data and diff --arch share (the CLI builds one; the
    Python API takes one, or a path).

    checkpoint    a state dict (with `arch`), a TorchScript archive or a pickled nn.Module;
                  or a folder holding one, as inspect finds it (`resolve_model`)
    arch          MODULE:CALLABLE (or FILE.py:CALLABLE) that builds the model
    arch_kwargs   its keyword arguments: a JSON object or a mapping
    key           the state dict inside a container (`--key`)
    trust_pickle  let a whole-model pickle run its own code (`--trust-pickle`)
    forward       MODULE:CALLABLE that calls the model on a batch (`--forward`)
    device        where the model runs: "cpu", "cuda", "cuda:1"
    """

    checkpoint: str
    arch: str | None = None
    arch_kwargs: str | Mapping[str, Any] | None = None
    key: str | None = None
    trust_pickle: bool = False
    forward: str | None = None
    device: str = "cpu"


def as_model_spec(model: ModelSpec | str | os.PathLike[str]) -> ModelSpec:
    """`model` itself, or the spec of a checkpoint path that needs no other option."""
    return model if isinstance(model, ModelSpec) else ModelSpec(os.fspath(model))


def resolve_model(model: ModelSpec, config: Any = None) -> ModelSpec:
    """`model` with a folder replaced by the model checkpoint inspect finds in it (under
    `config`'s excludes: `bnaudit.audit.resolve.model_checkpoint`)."""
    checkpoint = model_checkpoint(model.checkpoint, trust_pickle=model.trust_pickle, config=config)
    return dataclasses.replace(model, checkpoint=checkpoint)


def load_runnable(spec: ModelSpec | str) -> RunnableModel:
    """A runnable model (in eval mode, on the CPU) from a checkpoint file and optional --arch.
    The commands turn a folder into the checkpoint file it holds first (`resolve_model`)."""
    spec = as_model_spec(spec)
    checkpoint_path, arch, arch_kwargs, key = spec.checkpoint, spec.arch, spec.arch_kwargs, spec.key
    trust_pickle = spec.trust_pickle
    if arch is None and arch_kwargs is not None:
        raise BnauditError("--arch-kwargs needs --arch")
    # from the bytes, before any reader: refused with or without --arch and without the onnx extra
    fmt = None if is_index(checkpoint_path) else sniff_format(checkpoint_path)
    if fmt == "onnx":
        raise BnauditError(_ONNX_NOT_RUNNABLE.format(path=checkpoint_path))
    if fmt == "pt2":
        raise BnauditError(_PT2_NOT_RUNNABLE.format(path=checkpoint_path))
    if arch is not None:
        ckpt = read_checkpoint(checkpoint_path, key=key, trust_pickle=trust_pickle)
        model = build_arch(arch, arch_kwargs)
        ckpt, facts = match_checkpoint(ckpt, model)
        check_fits(ckpt, facts, arch)
        load_state(model, ckpt)
        model.eval()
        return RunnableModel(model, ckpt, facts, "arch", arch)
    if fmt is None:
        raise BnauditError(
            f"{checkpoint_path}: a sharded checkpoint holds tensors, not a model: pass --arch MODULE:CALLABLE "
            "(the function that builds the model)"
        )
    if fmt == "torchscript":
        return _load_torchscript(checkpoint_path, key)
    if fmt in ("safetensors", "dcp"):
        what = "a safetensors file" if fmt == "safetensors" else "a torch.distributed.checkpoint folder"
        raise BnauditError(
            f"{checkpoint_path}: {what} holds tensors, not a model: pass --arch MODULE:CALLABLE "
            "(the function that builds the model)"
        )
    return _load_pickled_module(checkpoint_path, fmt, key, trust_pickle)


def _load_torchscript(path: str, key: str | None) -> RunnableModel:
    ckpt = read_checkpoint(path, key=key)
    try:
        module = torch.jit.load(path, map_location="cpu")  # type: ignore[no-untyped-call]  # torch: torch.jit.load is unannotated
    except Exception as exc:
        raise BnauditError(f"{path}: cannot load TorchScript archive: {exception_line(exc)}") from None
    module.eval()
    return RunnableModel(module, ckpt, facts_from_module_infos(ckpt.modules), "torchscript")


def _load_pickled_module(path: str, fmt: str, key: str | None, trust_pickle: bool) -> RunnableModel:
    if trust_pickle:
        cwd = os.getcwd()
        if cwd not in sys.path and "" not in sys.path:
            sys.path.insert(0, cwd)  # the pickled classes are imported by module name
    obj = load_torch_save(
        path,
        fmt,
        trust_pickle=trust_pickle,
        hint=(
            "unpickling a class runs code from the file: save model.state_dict() (as .safetensors, the format "
            "that holds no code) and pass --arch MODULE:CALLABLE to build the model"
        ),
    )
    candidates = find_state_dicts(obj)
    modules = {k: v for k, v in candidates.items() if isinstance(v, torch.nn.Module)}
    if not modules:
        raise BnauditError(
            f"{path}: holds a state dict, not a model: pass --arch MODULE:CALLABLE (the function that "
            "builds the model) to run it"
        )
    chosen = choose_state_dict(path, modules, key)
    module = modules[chosen]
    # No prefix stripping: the module's own names and settings are the truth downstream.
    ckpt = wrap_candidate(path, fmt, candidates, chosen)
    infos = ckpt.modules
    facts = dataclasses.replace(
        facts_from_module_infos(infos),
        batch_norms=frozenset(n for n in batchnorm_modules(module) if n in infos),
    )
    module.eval()
    return RunnableModel(module, ckpt, facts, "pickle")


def resolve_device(name: str | None) -> Any:
    """`cpu`, `cuda`, `cuda:N` or `auto` (cuda when available) -> torch.device."""
    name = (name or "cpu").strip().lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise BnauditError(f"--device must be cpu, cuda, cuda:N or auto, got '{name}'") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise BnauditError(f"--device {name}: no CUDA device is available here (use --device cpu or auto)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise BnauditError(f"--device {name}: only {plural(torch.cuda.device_count(), 'CUDA device')} present")
    elif device.type != "cpu":
        raise BnauditError(f"--device must be cpu, cuda, cuda:N or auto, got '{name}'")
    return device


def to_device(value: Any, device: Any) -> Any:
    """Move tensors inside tensors / tuples / lists / dicts to `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, Mapping):
        return {k: to_device(v, device) for k, v in value.items()}
    if isinstance(value, list):
        return [to_device(v, device) for v in value]
    if isinstance(value, tuple):
        return tuple(to_device(v, device) for v in value)
    return value


def load_forward(spec: str | None) -> Callable[[Any, Any], Any] | None:
    """--forward MODULE:CALLABLE: a function fn(model, batch) -> logits."""
    return None if spec is None else import_callable(spec, "--forward")


def forward(model: Any, inputs: Any, forward_fn: Callable[[Any, Any], Any] | None = None) -> Any:
    """Run the model on one batch of inputs.

    A tensor is passed as `model(x)`, a tuple or list as `model(*xs)`, a dict as
    `model(**d)`; with --forward, `forward_fn(model, inputs)` decides.
    """
    if forward_fn is not None:
        return forward_fn(model, inputs)
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def output_tensor(output: Any) -> Any:
    """The tensor of a model output: the tensor itself, `.logits` / `["logits"]` of a
    model-output object or dict, else the first tensor of a tuple, list or dict."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, Mapping):
        if isinstance(output.get("logits"), torch.Tensor):
            return output["logits"]
        values = list(output.values())
    elif isinstance(output, (tuple, list)):
        values = list(output)
    else:
        values = []
    for value in values:
        if isinstance(value, torch.Tensor):
            return value
    raise BnauditError(
        f"the model returned {type(output).__name__}, which holds no tensor; pass --forward MODULE:CALLABLE "
        "returning the logits"
    )


# The layers a BN module can be folded into (bnaudit.audit.producers: the policy); a
# ConvTranspose holds its output channels on its weight's axis 1 (groups 1 only).
TRANSPOSED_TYPES = (torch.nn.ConvTranspose1d, torch.nn.ConvTranspose2d, torch.nn.ConvTranspose3d)
PRODUCER_TYPES = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.Linear, *TRANSPOSED_TYPES)


def producer_out_axis(module: Any) -> int | None:
    """The axis of a producer module's weight that holds its output channels: 0 for a Conv
    or Linear, 1 for a ConvTranspose of one group; None for a grouped ConvTranspose (its
    axis 1 holds C_out / groups) or a module that is no producer."""
    if isinstance(module, TRANSPOSED_TYPES):
        return 1 if module.groups == 1 else None
    return 0 if isinstance(module, PRODUCER_TYPES) else None


def graph_producers(model: Any) -> Producers:
    """Which module feeds each BN module, from a torch.fx trace of the model's forward,
    judged by the one policy (`bnaudit.audit.producers.producers_from_calls`). BN modules are
    leaves of the trace whatever library defines them (timm's BatchNormAct2d subclasses
    BatchNorm2d outside torch.nn and would otherwise be traced into). Where the forward
    cannot be traced symbolically (data-dependent control flow), the model's state dict's
    names decide (`producers_from_names`)."""
    import torch.fx

    norms = batchnorm_modules(model)
    modules = dict(model.named_modules())

    class _Tracer(torch.fx.Tracer):
        def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
            return is_batchnorm(m) or super().is_leaf_module(m, module_qualified_name)

    try:
        graph = _Tracer().trace(model)
    except Exception:  # any failure of tracing user code means: no graph
        channels = {
            name: m.num_features for name, m in norms.items() if isinstance(getattr(m, "num_features", None), int)
        }
        tensors = {name: torch_ref(name, t) for name, t in model.state_dict(keep_vars=True).items()}
        return producers_from_names(tensors, channels)
    calls = []
    for node in graph.nodes:
        if node.op != "call_module" or str(node.target) not in norms:
            continue
        source = node.args[0] if node.args else None
        producer = modules.get(str(source.target)) if isinstance(source, torch.fx.Node) else None
        axis = producer_out_axis(producer)
        if isinstance(source, torch.fx.Node) and source.op == "call_module" and axis is not None:
            shared = len(source.users) != 1
            calls.append(BNCall(str(node.target), str(source.target), shared=shared, transposed=axis == 1))
        elif isinstance(producer, TRANSPOSED_TYPES):
            calls.append(BNCall(str(node.target), None, follows="a grouped ConvTranspose"))
        else:
            what = getattr(source, "target", "an input")
            calls.append(BNCall(str(node.target), None, follows=str(getattr(what, "__name__", what))))
    return producers_from_calls(calls)

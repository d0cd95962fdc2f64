"""TorchScript archives and torch.save zip records, read without torch and without pickle's code.

`read_torchscript` reads an archive's `data.pkl` with the restricted unpickler
(formats/unpickle.py, `Mode.TORCHSCRIPT`: its `__torch__` classes become inert
`ScriptObject`s) and resolves tensors to the zip records that hold their bytes; eps
and momentum come from the archive's code files (`Final` constants), since a scripted
BN module stores them there, and so do the normalisation operators each class calls
(a scripted module keeps only its class name: `class MyBN(nn.BatchNorm2d)` is `MyBN`,
whose code calls `torch.nn.functional.batch_norm`), which `bnaudit.normkinds` classifies by.
A global that could run code is refused: bnaudit never runs TorchScript to inspect it.
"""

from __future__ import annotations

import re
import zipfile
from dataclasses import dataclass
from typing import Any

from bnaudit.errors import BnauditError
from bnaudit.formats.allowed import Mode, Refused, RefusedGlobal
from bnaudit.formats.containers import real_or_none
from bnaudit.formats.model import ModuleInfo, TensorRef
from bnaudit.formats.pickled import ScriptObject
from bnaudit.formats.provenance import RECORD_KEY
from bnaudit.formats.sniff import check_zip_sizes
from bnaudit.formats.torchsave import ZipStorages, open_archive_pickle, zip_records
from bnaudit.formats.unpickle import unpickle
from bnaudit.normkinds import constant_training_calls, norm_calls
from bnaudit.text import exception_line

# The extra file of a TorchScript archive in which `recalibrate` keeps its record
# (`torch.jit.save(..., _extra_files=...)`; loading the archive ignores it).
RECORD_EXTRA_FILE = "bnaudit.json"
_MAX_RECORD_BYTES = 10_000_000


def script_metadata(path: str) -> dict[str, str]:
    """`{"bnaudit": record}` from the archive's `extra/bnaudit.json`, {} without one (or
    one too large or not UTF-8: the record is untrusted and only ever a note)."""
    try:
        with zipfile.ZipFile(path) as archive:
            entry = next(
                (n for n in archive.namelist() if n.count("/") == 2 and n.endswith(f"/extra/{RECORD_EXTRA_FILE}")), None
            )
            if entry is None or archive.getinfo(entry).file_size > _MAX_RECORD_BYTES:
                return {}
            return {RECORD_KEY: archive.read(entry).decode("utf-8")}
    except (OSError, ValueError, zipfile.BadZipFile):
        return {}


_MAX_SCRIPT_VISITS = 100_000


def read_torchscript(path: str) -> tuple[dict[str, TensorRef], dict[str, ModuleInfo]]:
    """Tensors and BN module settings of a TorchScript archive, without loading it."""
    try:
        archive = zipfile.ZipFile(path)
        check_zip_sizes(path, archive)
        archive, root, data = open_archive_pickle(path, archive)
        records, big = zip_records(path, archive, root)
        obj = unpickle(data, Mode.TORCHSCRIPT, ZipStorages(path, records, big)).value
    except BnauditError:
        raise
    except RefusedGlobal as exc:
        raise BnauditError(
            f"{path}: refused to unpickle the TorchScript archive: it needs a global that could run "
            f"code ({exc.name}); bnaudit never runs TorchScript to inspect it; a state dict or a "
            ".safetensors file is the safe format"
        ) from None
    except Refused as exc:
        raise BnauditError(f"{path}: unreadable TorchScript archive ({exc})") from None
    except Exception as exc:  # zipfile on forged bytes
        raise BnauditError(f"{path}: unreadable TorchScript archive ({exception_line(exc, with_type=False)})") from None
    tensors: dict[str, TensorRef] = {}
    modules: dict[str, ModuleInfo] = {}
    classes = _ScriptClasses(archive, root)
    # A module may be shared (visited under each of its names, as state_dict does),
    # but a forged archive can nest shared nodes so that the paths double per level.
    budget = [_MAX_SCRIPT_VISITS]

    def walk(node: Any, prefix: str, depth: int) -> None:
        if depth > 200 or not isinstance(node, ScriptObject):
            return
        budget[0] -= 1
        if budget[0] < 0:
            raise BnauditError(
                f"{path}: TorchScript archive names more than {_MAX_SCRIPT_VISITS} modules (forged nesting?)"
            )
        code = classes.of(node.qualname)
        attrs = {**code.constants, **node.attrs}
        cls = node.qualname.rsplit(".", 1)[-1]
        if "running_mean" in attrs or "track_running_stats" in attrs:
            eps, momentum = attrs.get("eps"), attrs.get("momentum")
            tracking = attrs.get("track_running_stats")
            training = attrs.get("training")
            constant = code.training_calls
            modules[prefix.rstrip(".")] = ModuleInfo(
                cls,
                real_or_none(eps),
                real_or_none(momentum),
                tracking if isinstance(tracking, bool) else None,
                momentum_known="momentum" in attrs and (momentum is None or real_or_none(momentum) is not None),
                calls=code.calls,
                training_mode=True if constant else None,
                training_reason=(
                    f"its TorchScript code calls {', '.join(constant)} with training=True as a constant "
                    "(traced in training mode? .eval() cannot switch it)"
                    if constant
                    else None
                ),
                saved_training=training if isinstance(training, bool) else None,
            )
        for name, value in attrs.items():
            if not isinstance(name, str):
                continue
            if isinstance(value, TensorRef):
                full = prefix + name
                tensors[full] = value.renamed(full)
            elif isinstance(value, ScriptObject):
                walk(value, f"{prefix}{name}.", depth + 1)

    try:
        walk(obj, "", 0)
    except BnauditError:
        raise
    except Exception as exc:  # a damaged code file (bad CRC) or a forged attribute
        raise BnauditError(f"{path}: unreadable TorchScript archive ({exception_line(exc, with_type=False)})") from None
    return tensors, modules


@dataclass(frozen=True)
class _ScriptClass:
    constants: dict[str, Any]
    calls: tuple[str, ...]
    # BatchNorm operators its code calls with a literal training=True (normkinds.constant_training_calls)
    training_calls: tuple[str, ...] = ()


_NO_CLASS = _ScriptClass({}, ())


class _ScriptClasses:
    """What an archive's code files say of each class: its `Final` constants (eps,
    momentum, ...) and the normalisation operators its methods call.

    TorchScript compiles BatchNorm's eps and momentum into its code as
    `eps : Final[float] = 0.001`, and a BatchNorm's forward as a call of
    `__torch__.torch.nn.functional.batch_norm` (scripted) or `torch.batch_norm` (traced);
    the file is read as text, never executed.
    """

    _CLASS_RE = re.compile(r"^class (\w+)\(", re.MULTILINE)
    # [ \t] rather than \s, greedy rather than lazy: the code files come from the
    # archive, and \s+ spanning newlines backtracks quadratically on blank runs.
    _FINAL_RE = re.compile(r"^[ \t]+(\w+) : Final\[\w+\] = (.+)$", re.MULTILINE)

    def __init__(self, archive: zipfile.ZipFile, root: str) -> None:
        self.archive, self.root = archive, root
        self.cache: dict[str, dict[str, _ScriptClass]] = {}

    def of(self, qualname: str) -> _ScriptClass:
        module, _, cls = qualname.rpartition(".")
        if module not in self.cache:
            entry = f"{self.root}/code/{module.replace('.', '/')}.py"
            try:
                source = self.archive.read(entry).decode("utf-8", "replace")
            except KeyError:
                source = ""
            self.cache[module] = self._parse(source)
        return self.cache[module].get(cls, _NO_CLASS)

    def _parse(self, source: str) -> dict[str, _ScriptClass]:
        classes: dict[str, _ScriptClass] = {}
        starts = [(m.start(), m.group(1)) for m in self._CLASS_RE.finditer(source)]
        for i, (start, name) in enumerate(starts):
            end = starts[i + 1][0] if i + 1 < len(starts) else len(source)
            body = source[start:end]
            values: dict[str, Any] = {}
            for key, literal in self._FINAL_RE.findall(body):
                values[key] = _literal(literal.strip())
            classes[name] = _ScriptClass(values, norm_calls(body), constant_training_calls(body))
        return classes


def _literal(text: str) -> Any:
    if text == "None":
        return None
    if text in ("True", "False"):
        return text == "True"
    try:
        return float(text) if any(c in text for c in ".eE") or text in ("inf", "nan") else int(text)
    except ValueError:
        return text

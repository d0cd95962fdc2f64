"""PEFT adapter folders: `save_pretrained` of a `PeftModel` (huggingface/peft), read without
torch and composed with the base checkpoint they adapt.

What PEFT writes (peft/utils/save_and_load.py, `get_peft_model_state_dict`):

    adapter_config.json          `peft_type` (LORA, ...), `base_model_name_or_path`,
                                 `target_modules`, `modules_to_save`, ...
    adapter_model.safetensors    (or adapter_model.bin with safe_serialization=False) the
                                 adapter's tensors under the PeftModel's names,
                                 `base_model.model.<module>.<leaf>`: the LoRA factors
                                 (`lora_A`, `lora_B`, `lora_embedding_*`, `lora_magnitude_*`),
                                 and every parameter and buffer of each module in
                                 `modules_to_save`, a BatchNorm's running statistics included

A BN layer outside `modules_to_save` is not in the adapter: statistics its training updated
under the adapter are not saved (huggingface/peft#1732), the reloaded model keeps the base's.
A BN layer in `modules_to_save` whose statistics the adapter lacks cannot be what training
left: PEFT's `convert_to_lora` / `save_as_lora` drop them (peft PR 3481), and the adapter then
fails to load, or the reloaded model keeps the base's statistics.

`read_adapter` returns the composed checkpoint: the base's tensors (any format bnaudit reads),
the adapter's whole modules in their place; LoRA factors are not merged into the weights
(they change no BN statistic), and `Checkpoint.adapter` says what the adapter held.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from bnaudit.errors import BnauditError
from bnaudit.formats.model import Checkpoint, TensorRef
from bnaudit.formats.sniff import ADAPTER_CONFIG, ADAPTER_WEIGHTS

_PEFT_PREFIX = "base_model.model."
_LORA_PARTS = (".lora_A.", ".lora_B.", ".lora_embedding_A", ".lora_embedding_B", ".lora_magnitude_vector")
_MAX_CONFIG_BYTES = 1 << 20  # a config names modules: far below this


@dataclass(frozen=True)
class AdapterInfo:
    """What an adapter folder holds, for the report and BN001.

    peft_type         the config's `peft_type` ("LORA", ...)
    base              the base checkpoint composed with it ("" when none was found)
    base_named        the config's `base_model_name_or_path` ("" when it names none)
    modules_to_save   the config's `modules_to_save`, as written (module names or suffixes)
    saved             the names (without PEFT's prefix) of every tensor the adapter holds
                      whole: the `modules_to_save` modules' parameters and buffers
    lora_modules      the modules the adapter holds LoRA factors for
    """

    peft_type: str
    base: str
    base_named: str
    modules_to_save: tuple[str, ...]
    saved: frozenset[str]
    lora_modules: tuple[str, ...]

    def to_save(self, module: str) -> bool:
        """`module` is in `modules_to_save` (PEFT matches a module whose name is an entry, or
        ends with "." and an entry)."""
        return any(module == m or module.endswith("." + m) for m in self.modules_to_save)


def _strings(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, str))
    return ()


def read_adapter_config(folder: str) -> dict[str, Any]:
    """adapter_config.json as a JSON object (BnauditError for anything else)."""
    path = os.path.join(folder, ADAPTER_CONFIG)
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise BnauditError(f"{folder}: {ADAPTER_CONFIG} cannot be read ({exc.strerror or exc})") from None
    if len(raw) > _MAX_CONFIG_BYTES:
        raise BnauditError(f"{folder}: {ADAPTER_CONFIG} is larger than {_MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise BnauditError(f"{folder}: {ADAPTER_CONFIG} is not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise BnauditError(f"{folder}: {ADAPTER_CONFIG} holds no JSON object")
    return config


def base_named(folder: str) -> str:
    """The config's `base_model_name_or_path` ("" when it names none)."""
    value = read_adapter_config(folder).get("base_model_name_or_path")
    return value if isinstance(value, str) else ""


# What `save_pretrained` names the base model's weights, preferred first (transformers'
# modeling_utils: SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME).
_BASE_WEIGHTS = (
    "model.safetensors.index.json",
    "model.safetensors",
    "pytorch_model.bin.index.json",
    "pytorch_model.bin",
)


def base_file(path: str) -> str:
    """The base checkpoint `path` names: a file itself; in a folder (a `save_pretrained`
    folder, a snapshot of the Hugging Face cache) the weights file `save_pretrained` writes."""
    if not os.path.isdir(path):
        return path
    found = next((os.path.join(path, n) for n in _BASE_WEIGHTS if os.path.isfile(os.path.join(path, n))), None)
    if found is None:
        raise BnauditError(
            f"{path}: no {' / '.join(_BASE_WEIGHTS[1::2])} in this folder: pass the base checkpoint file with --base"
        )
    return found


def base_in_cache(repo_id: str) -> str | None:
    """The base weights of `repo_id` ("ORG/NAME") at refs/main in the Hugging Face cache
    (`HF_HUB_CACHE`, else `HF_HOME`/hub, else ~/.cache/huggingface/hub), or None."""
    from bnaudit.formats.hfcache import cache_root, is_repo_folder, snapshots

    folder = os.path.join(cache_root(), "models--" + repo_id.replace("/", "--"))
    if not is_repo_folder(folder):
        return None
    found = snapshots(folder)
    return base_file(found[0].folder) if found else None


def adapter_base(folder: str, given: str | None) -> str | None:
    """The base checkpoint file of the adapter at `folder`: `given` (--base: a file or a
    folder), else the config's `base_model_name_or_path` as a local path or a repo of the
    Hugging Face cache; None when it names none that is here."""
    if given is not None:
        return base_file(given)
    named = base_named(folder)
    if not named:
        return None
    if os.path.exists(named):
        return base_file(named)
    return base_in_cache(named)


def _adapter_tensors(folder: str, trust_pickle: bool) -> dict[str, TensorRef]:
    from bnaudit.formats.read import read_checkpoint

    weights = next(os.path.join(folder, w) for w in ADAPTER_WEIGHTS if os.path.isfile(os.path.join(folder, w)))
    ckpt = read_checkpoint(weights, trust_pickle=trust_pickle)
    return {ckpt.prefix + name: ref for name, ref in ckpt.tensors.items()}


def read_adapter(folder: str, base: str | None, trust_pickle: bool = False) -> Checkpoint:
    """The adapter at `folder` composed with the base checkpoint file `base` (None: the
    adapter's own modules alone, said in a note); see the module docstring."""
    from bnaudit.formats.read import read_checkpoint

    config = read_adapter_config(folder)
    stored = _adapter_tensors(folder, trust_pickle)
    whole: dict[str, TensorRef] = {}
    lora: list[str] = []
    for name, ref in stored.items():
        bare = name.removeprefix(_PEFT_PREFIX)
        if any(part in bare for part in _LORA_PARTS):
            module = bare.split(".lora_", 1)[0]
            if module not in lora:
                lora.append(module)
        else:
            whole[bare] = ref.renamed(bare)
    peft_type = config.get("peft_type")
    named = config.get("base_model_name_or_path")
    info = AdapterInfo(
        peft_type=peft_type if isinstance(peft_type, str) else "?",
        base=base or "",
        base_named=named if isinstance(named, str) else "",
        modules_to_save=_strings(config.get("modules_to_save")),
        saved=frozenset(whole),
        lora_modules=tuple(lora),
    )
    notes = []
    if base is not None:
        base_ckpt = read_checkpoint(base, trust_pickle=trust_pickle)
        tensors = dict(base_ckpt.tensors)
        tensors.update(whole)
        ckpt = Checkpoint(folder, "peft", tensors, modules=base_ckpt.modules, metadata=dict(base_ckpt.metadata))
        notes.append(f"PEFT {info.peft_type} adapter composed with its base {base}")
    else:
        ckpt = Checkpoint(folder, "peft", whole)
        wanted = f" ({info.base_named})" if info.base_named else ""
        notes.append(
            f"PEFT {info.peft_type} adapter read alone: its base{wanted} was not found (pass --base): only the "
            "modules the adapter holds whole are audited"
        )
    if lora:
        notes.append(f"LoRA factors of {len(lora)} modules not merged into their weights (no BN statistic changes)")
    ckpt.adapter = info
    ckpt.notes = notes
    return ckpt

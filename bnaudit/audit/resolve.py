"""Which checkpoint a path names, for the commands that take one model (gap, invariance,
recalibrate, diff, ...).

A file names itself. A folder names the one model checkpoint `inspect` would audit in it:
the folder is scanned and every file classified by `inspect` itself, so a Hugging Face
`save_pretrained` folder (`model.safetensors`, or the shard index standing for its
shards), a Trainer `checkpoint-N/` or an accelerate `save_state` folder (optimizer,
scheduler, RNG and scaler state, training arguments skipped as not model weights), and a
DeepSpeed folder (`global_stepN/mp_rank_00_model_states.pt` beside its ZeRO optimizer
partitions) each resolve to their model weights. A folder holding several model
checkpoints (a Hub folder with both `model.safetensors` and `pytorch_model.bin`, several
accelerate models) or a file that cannot be read is refused with one line naming them:
the user passes the file meant.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from bnaudit.audit.checkpoint.inspect import inspect_paths
from bnaudit.config import Config
from bnaudit.errors import BnauditError
from bnaudit.formats.model import Checkpoint
from bnaudit.formats.read import read_checkpoint

# how many candidates a refusal names before "and N more"
_SHOWN = 4


def model_checkpoint(path: str | os.PathLike[str], trust_pickle: bool = False, config: Config | None = None) -> str:
    """`path` itself when it is not a folder; for a folder, the one model checkpoint in it
    (a file, or a shard index standing for its shards), decided as `inspect` decides with
    `config` (its `exclude` globs remove files from the choice, as from a scan).
    BnauditError (one line) when the folder holds none, several, or an unreadable file."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        return path
    report = inspect_paths([path], config or Config(), trust_pickle=trust_pickle)
    # one path per file: a container's state dicts are entries of the same file
    models = list(
        dict.fromkeys(f.path for f in report.files if f.error is None and f.skipped is None and f.excluded is None)
    )
    broken = [f for f in report.files if f.error is not None]
    if len(broken) == 1 and broken[0].path == path:  # the folder itself: nothing to scan
        raise BnauditError(f"{path}: {broken[0].error}")
    if len(models) == 1 and not broken:
        return models[0]

    def named(p: str) -> str:
        return os.path.relpath(p, path)

    if broken:
        shown = "; ".join(f"{named(f.path)}: {f.error}" for f in broken[:_SHOWN])
        more = f" and {len(broken) - _SHOWN} more" if len(broken) > _SHOWN else ""
        found = f" beside {_listing(models, named)}" if models else ""
        raise BnauditError(
            f"{path}: holds files that cannot be read ({shown}{more}){found}: pass the checkpoint file itself"
        )
    if not models:
        skipped = ", ".join(f"{named(f.path)} ({f.skipped})" for f in report.files[:_SHOWN])
        more = f" and {len(report.files) - _SHOWN} more" if len(report.files) > _SHOWN else ""
        raise BnauditError(f"{path}: holds no model weights, only {skipped}{more}")
    example = os.path.join(path, named(models[0]))
    raise BnauditError(
        f"{path}: holds {len(models)} model checkpoints ({_listing(models, named)}): pass the one to use, "
        f"e.g. {example}"
    )


def _listing(paths: list[str], named: Callable[[str], str]) -> str:
    shown = ", ".join(named(p) for p in paths[:_SHOWN])
    return shown + (f" and {len(paths) - _SHOWN} more" if len(paths) > _SHOWN else "")


def read_model_checkpoint(
    path: str | os.PathLike[str], key: str | None = None, trust_pickle: bool = False, config: Config | None = None
) -> Checkpoint:
    """`read_checkpoint` of the checkpoint `path` names (`model_checkpoint`)."""
    chosen = model_checkpoint(path, trust_pickle=trust_pickle, config=config)
    return read_checkpoint(chosen, key=key, trust_pickle=trust_pickle)

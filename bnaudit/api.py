"""The public entry points that need both floors: torch-free auditing, and a model built with torch.

`inspect` audits files without torch (`bnaudit.audit.checkpoint.inspect`); only `--arch`
needs the model built, which is runtime/'s work. Composing the two here keeps audit/ from
importing runtime/, and keeps one entry point for the CLI and the Python API alike.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from bnaudit.audit.checkpoint.inspect import inspect_paths
from bnaudit.audit.checkpoint.report import InspectReport
from bnaudit.audit.layers import ModelReference
from bnaudit.config import Config
from bnaudit.errors import BnauditError


def inspect(
    paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
    config: Config | None = None,
    key: str | None = None,
    trust_pickle: bool = False,
    arch: str | None = None,
    arch_kwargs: str | dict[str, Any] | None = None,
    debug: bool = False,
    all_revisions: bool = False,
    jobs: int | None = None,
    base: str | None = None,
    channels: bool = False,
) -> InspectReport:
    """Audit checkpoints (files or directories) and return the report.

    `arch` (MODULE:CALLABLE, with `arch_kwargs` JSON) names the model: BN001 becomes
    exact and BN006 / BN007 / BN011 apply; its real eps and momentum replace the defaults.
    `all_revisions`: every snapshot of a Hugging Face cache repo, not only refs/main's.
    `jobs`: at most this many processes audit the files (None: one per usable CPU). Fewer
    than 16 files, or a process that already runs threads (torch imported), are audited in
    this process alone (bnaudit.audit.checkpoint.forked says why). `base`: the base
    checkpoint a PEFT adapter folder is composed with (default: its config's
    base_model_name_or_path, locally or in the Hugging Face cache). `channels`: each layer
    summary keeps every channel's running_var, eval gain and near-eps indices
    (`LayerSummary.channels`, which `--format html` draws); off, only the summaries are kept.

    >>> report = inspect("sample_models/")      # doctest: +SKIP
    >>> report.exit_code(), report.summary()    # doctest: +SKIP
    """
    reference: ModelReference | None = None
    if arch is not None:
        from bnaudit.runtime.models import arch_reference

        reference = arch_reference(arch, arch_kwargs)
    elif arch_kwargs is not None:
        raise BnauditError("--arch-kwargs needs --arch")
    return inspect_paths(
        paths,
        config,
        key=key,
        trust_pickle=trust_pickle,
        reference=reference,
        debug=debug,
        all_revisions=all_revisions,
        jobs=jobs,
        base=base,
        channels=channels,
    )

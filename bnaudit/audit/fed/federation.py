"""A global checkpoint and its clients' checkpoints -> `FedReport` (torch-free).

Each file is read as `inspect` reads it (`formats.read.read_checkpoint`: any format, wrapper
prefixes stripped, so a DDP client and a plain global line up), the BN layers of each found
by what they hold (`audit.layers.discover_layers`), and every layer of the global classified
against the clients' same-named layers (`classify.classify_layer`). The clients' counts come
from their statistics files when given (`--stats`, one per client in the clients' order:
each layer's count, else the file's samples), else from their num_batches_tracked.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from bnaudit.audit.fed.classify import FedContext, classify_layer, counter_note, weightings
from bnaudit.audit.fed.report import FedReport
from bnaudit.audit.layers import discover_layers
from bnaudit.audit.provenance import recalibration_provenance
from bnaudit.audit.rules import run_fed_rules
from bnaudit.config import Config
from bnaudit.errors import BnauditError
from bnaudit.formats.bnstats import read_statistics
from bnaudit.formats.read import read_checkpoint


def audit_federation(
    global_path: str,
    client_paths: Sequence[str],
    config: Config | None = None,
    *,
    key: str | None = None,
    statistics: Sequence[str] = (),
    trust_pickle: bool = False,
) -> FedReport:
    """Classify every BN layer of `global_path` against `client_paths` (module docstring).

    >>> import bnaudit                                                        # doctest: +SKIP
    >>> bnaudit.audit_federation("global.pt", ["client0.pt", "client1.pt"]).layers[0].kind  # doctest: +SKIP
    'averaged'
    """
    config = config or Config()
    if not client_paths:
        raise BnauditError("give the clients' checkpoints after the global one")
    if statistics and len(statistics) != len(client_paths):
        raise BnauditError(
            f"--stats given {len(statistics)} times for {len(client_paths)} clients: one statistics file per client, "
            "in the clients' order"
        )
    named = [global_path, *client_paths]
    for i, path in enumerate(named):
        if any(os.path.exists(path) and os.path.exists(o) and os.path.samefile(path, o) for o in named[:i]):
            raise BnauditError(f"{path}: given twice: the global and every client are separate checkpoints")
    ckpt = read_checkpoint(global_path, key=key, trust_pickle=trust_pickle)
    clients = [read_checkpoint(path, key=key, trust_pickle=trust_pickle) for path in client_paths]
    layers = discover_layers(ckpt).layers
    if not layers:
        raise BnauditError(f"{global_path}: holds no BatchNorm running statistics: nothing to audit")
    client_layers = [{layer.name: layer for layer in discover_layers(c).layers} for c in clients]
    counts = None
    if statistics:
        files = [read_statistics(path) for path in statistics]
        counts = [{"": f.samples, **{layer.name: layer.count for layer in f.layers}} for f in files]
    recalibrated = recalibration_provenance(ckpt).layers
    classified = tuple(
        classify_layer(
            layer,
            [c.get(layer.name) for c in client_layers],
            weightings(layer.name, client_layers, counts),
            layer.name in recalibrated,
            counter_note(ckpt, layer.name, clients),
        )
        for layer in layers
    )
    context = FedContext(classified, tuple(client_paths), config, global_path)
    findings = tuple(run_fed_rules(context))
    return FedReport(
        path=global_path,
        format=ckpt.format,
        clients=tuple(client_paths),
        layers=classified,
        findings=findings,
        fail_on=config.fail_on,
        fix=fix_commands(global_path)
        if any(layer.kind not in ("pooled", "recalibrated") for layer in classified)
        else (),
        statistics=tuple(statistics),
        config=config,
    )


def fix_commands(global_path: str) -> tuple[str, ...]:
    """The exact fix: every client's statistics under the global weights, merged."""
    stem, suffix = os.path.splitext(os.path.basename(global_path))
    return (
        f"each client k: bnaudit recalibrate {global_path} --arch MODULE:CALLABLE --data LOCAL_DATA "
        "--stats-out client-k.bnstats",
        f"the server: bnaudit merge client-*.bnstats --checkpoint {global_path} -o {stem}.merged{suffix or '.pt'}",
    )

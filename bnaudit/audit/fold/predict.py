"""`predict_fold`: a checkpoint in, a `FoldReport` of predictions out (torch-free).

Reads the file (or a folder's model checkpoint) through `bnaudit.audit.resolve`, finds its BN layers
(`bnaudit.audit.layers`, eps from `bnaudit.audit.settings`), pairs and predicts
(`bnaudit.audit.fold.check`) and runs the fold rules (BN201-BN207).
"""

from __future__ import annotations

from bnaudit.audit.fold.check import FoldContext, predict_pairs
from bnaudit.audit.fold.report import FoldReport
from bnaudit.audit.layers import discover_layers, not_from_file
from bnaudit.audit.producers import Producers
from bnaudit.audit.resolve import read_model_checkpoint
from bnaudit.audit.rules import run_fold_rules
from bnaudit.audit.settings import settings_stated_by, statement
from bnaudit.config import Config
from bnaudit.errors import BnauditError
from bnaudit.formats.model import Checkpoint


def predict_fold(path: str, config: Config, key: str | None = None, trust_pickle: bool = False) -> FoldReport:
    """The prediction for every BN of the file at `path`: a state dict, safetensors file or
    TorchScript archive (pairs by name), an ONNX model (pairs from the graph, and convs the
    exporter already folded audited directly) or a torch.export archive (pairs from its program);
    a folder: the model checkpoint `inspect` finds in it. Nothing to audit is a BnauditError."""
    return predict_checkpoint(read_model_checkpoint(path, key=key, trust_pickle=trust_pickle, config=config), config)


def predict_checkpoint(
    ckpt: Checkpoint,
    config: Config,
    producers: Producers | None = None,
) -> FoldReport:
    """`predict_fold` of an opened checkpoint (a model's, with its real eps, under --arch);
    `producers` (from a traced forward of the model: paired_by "graph") replace the names."""
    path = ckpt.path
    discovery = discover_layers(ckpt, settings_stated_by(config))
    notes: tuple[str, ...] = ()
    if ckpt.folded is not None and not discovery.layers:
        # nothing left to fold: the folded weights themselves are what int8 and fp16 meet
        notes = (f"already folded ({ckpt.folded}): the folded weights are audited as they are",)
    if ckpt.format == "onnx" and ckpt.graph is not None:
        from bnaudit.audit.fold.graph import graph_pairs

        pairs, unpaired = graph_pairs(ckpt.graph, discovery.layers, config)
    elif ckpt.format == "pt2" and ckpt.folded is not None and not discovery.layers:
        from bnaudit.audit.fold.graph import program_folded_pairs

        pairs, unpaired = program_folded_pairs(path, config), []
    elif not discovery.layers:
        raise BnauditError(f"{path}: no BatchNorm layers with running statistics to fold")
    elif ckpt.format == "pt2":
        from bnaudit.audit.fold.graph import program_pairs

        pairs, unpaired = program_pairs(path, discovery.layers, config)
    else:
        # a single safetensors file: the locations of its tensors are offsets in it
        single = ckpt.format == "safetensors" and not ckpt.shards
        stream_from = ckpt.path if single else None
        pairs, unpaired = predict_pairs(ckpt.tensors, discovery.layers, config, producers, stream_from)
    if not pairs and not unpaired:
        quantized = (
            f" ({ckpt.quantized}: a quantized graph, its convolutions are not examined)" if ckpt.quantized else ""
        )
        raise BnauditError(f"{path}: no BatchNorm layer and no folded convolution to audit{quantized}")
    findings = run_fold_rules(FoldContext(tuple(pairs), tuple(unpaired), config))
    return FoldReport(
        path=path,
        format=ckpt.format,
        pairs=tuple(pairs),
        unpaired=tuple(unpaired),
        findings=tuple(findings),
        fail_on=config.fail_on,
        config=config,
        # momentum plays no part in folding: only eps is said
        settings=statement([(n, s) for n, s in not_from_file(discovery.layers) if n == "eps"], "not in a state dict"),
        notes=notes,
    )

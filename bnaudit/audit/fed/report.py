"""The `fed` report: per BN layer of the global checkpoint, how its statistics came from the
clients' (`bnaudit.audit.fed.classify`), the findings of the fed rules (BN301-BN305) and the
fix. Torch-free: `bnaudit.output` renders it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from bnaudit.audit.fed.classify import KINDS, FedLayer
from bnaudit.audit.rules import Finding
from bnaudit.config import SEVERITIES, Config, exit_code_for
from bnaudit.severity import Severity


@dataclass(frozen=True)
class FedReport:
    """`path`: the global checkpoint; `clients`: the clients' checkpoints, in the order given
    (a layer's `client` indexes them); `statistics`: the statistics files that gave the
    clients' counts (empty when none); `fix`: the commands that write exact statistics."""

    kind: ClassVar[Literal["fed"]] = "fed"  # bnaudit.output.EMITTERS
    path: str
    format: str
    clients: tuple[str, ...]
    layers: tuple[FedLayer, ...]
    findings: tuple[Finding, ...]
    fail_on: Severity  # findings at or above it fail the run (the configuration's fail-on)
    fix: tuple[str, ...] = ()
    statistics: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=())
    config: Config | None = None

    def summary(self) -> dict[str, int]:
        """Layers per class, and findings per severity."""
        counts = {s: sum(1 for f in self.findings if f.severity == s) for s in SEVERITIES}
        return {
            **{kind: sum(1 for layer in self.layers if layer.kind == kind) for kind in KINDS},
            "errors": counts[Severity.ERROR],
            "warnings": counts[Severity.WARNING],
            "infos": counts[Severity.INFO],
        }

    def exit_code(self, exit_zero: bool = False) -> int:
        """`bnaudit.config.exit_code_for`: 1 when a finding is at or above `fail_on`."""
        return exit_code_for((f.severity for f in self.findings), self.fail_on, exit_zero=exit_zero)

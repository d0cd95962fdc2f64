"""The `parity` report: a checkpoint in eager PyTorch against the artifact that ships, per BN
layer in execution order, and the diagnosis in plain words.

Torch-free: `bnaudit.output` renders it; the measurement that fills it is
`bnaudit.runtime.parity`, the per-layer records and verdicts are `bnaudit.audit.parity`'s,
the statistics `bnaudit.audit.statistics`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from bnaudit.audit.parity import (
    LayerParity,
    OutputParity,
    ParityTarget,
    UnseenLayer,
    first_divergent,
    reading,
)
from bnaudit.audit.rules import Finding
from bnaudit.audit.statistics import PARITY_FACTOR
from bnaudit.config import Config, exit_code_for
from bnaudit.text import layer_list, plural


@dataclass(frozen=True)
class ParityReport:
    """`bnaudit parity`: `layers` in execution order, `outputs` the final outputs, `unseen`
    the layers the target does not show; `samples` and `batches` compared; `model` how the
    eager model was built ("--arch FILE.py:fn"); `notes` what the data reader and the
    target runner had to say."""

    kind: ClassVar[Literal["parity"]] = "parity"  # bnaudit.output.EMITTERS
    checkpoint: str
    model: str
    target: ParityTarget
    layers: tuple[LayerParity, ...]
    outputs: OutputParity
    unseen: tuple[UnseenLayer, ...]
    findings: tuple[Finding, ...]
    config: Config
    samples: int
    batches: int
    device: str = "cpu"
    notes: tuple[str, ...] = field(default=())

    @property
    def first_divergent(self) -> LayerParity | None:
        return first_divergent(self.layers)

    @property
    def diverges(self) -> bool:
        """A layer diverges or the outputs deviate: the check fails."""
        return self.first_divergent is not None or self.outputs.deviates

    @property
    def path(self) -> str:
        """The file under review: the artifact, or the checkpoint for a compiled target."""
        return self.target.path or self.checkpoint

    def summary(self) -> dict[str, int]:
        return {
            "layers": len(self.layers),
            "diverging": sum(1 for layer in self.layers if layer.diverges),
            "unseen": len(self.unseen),
            "errors": sum(1 for f in self.findings if f.severity == "error"),
            "warnings": sum(1 for f in self.findings if f.severity == "warning"),
            "infos": sum(1 for f in self.findings if f.severity == "info"),
        }

    def exit_code(self, exit_zero: bool = False) -> int:
        """`bnaudit.config.exit_code_for`: 1 when a layer diverges or the outputs deviate (the
        check fails), or a finding is at or above the configuration's fail-on; 0 otherwise
        or with `exit_zero`."""
        return exit_code_for(
            (f.severity for f in self.findings), self.config.fail_on, failed=self.diverges, exit_zero=exit_zero
        )

    def diagnosis(self) -> list[str]:
        """What the comparison says, one line per point."""
        first = self.first_divergent
        o = self.outputs
        lines = []
        if first is None:
            compared = plural(len(self.layers), "BN layer")
            lines.append(
                f"The target computes what the checkpoint computes: {compared} within {PARITY_FACTOR}x their "
                "float32 noise floors"
                + (", and the outputs too." if not o.deviates else ", but the outputs deviate (see below).")
            )
        else:
            after = [layer.name for layer in self.layers[self.layers.index(first) + 1 :] if layer.diverges]
            lines.append(
                f"First divergent layer: {first.name} ({first.site}), {first.ratio:.3g}x its noise floor; every "
                "earlier layer is within its floor."
            )
            lines.append(f"What differs there: {reading(first)}.")
            if after:
                verb, own = ("exceeds its floor", "its") if len(after) == 1 else ("exceed their floors", "their")
                lines.append(f"Later, {layer_list(after)} {verb} too: inherited, or a difference of {own} own.")
        if o.deviates and first is None:
            lines.append(
                f"The outputs deviate (largest relative deviation {o.relative:.3g}, threshold "
                f"{PARITY_FACTOR * o.floor:.0e}) while no BN layer diverges: look after the last BN layer."
            )
        if self.unseen:
            lines.append(
                f"{plural(len(self.unseen), 'BN layer')} not shown by the target, not compared "
                f"({layer_list([u.name for u in self.unseen])})."
            )
        return lines

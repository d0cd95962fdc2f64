"""Which eps and momentum a BN layer uses, and how bnaudit knows: value plus provenance.

eps and momentum are constructor arguments: a state dict never holds them. Every value
bnaudit uses comes from exactly one of these sources, decided here and nowhere else:

  source    where the value comes from                                   kind
  module    the file's own module (TorchScript, a pickled nn.Module,     known
            or the model --arch builds)
  node      the file's exported graph node (ONNX BatchNormalization,     known
            later a .pt2 graph)
  option    --eps / --momentum, or a Config built by a caller of the     given
            Python API
  config    the configuration file (`eps`, `momentum` in bnaudit.toml    given
            or pyproject.toml [tool.bnaudit])
  default   PyTorch's defaults, eps 1e-5 and momentum 0.1                assumed

precedence, highest first: module or node (the file's own truth) > option > config >
default. Each setting is resolved on its own: a module whose momentum the format cannot
read still gives its eps.

What a comparison may conclude from each kind:

  known     read from the file: a difference from another known or given value is a
            real difference (an error where the rule says so).
  given     the user's statement of what the model uses: not read from the file, but a
            difference from a known value is the user's claim contradicted, so it is
            reported like a known one (an error stays an error). This is why the
            "set --eps" hint disappears once --eps is given.
  assumed   nobody said: the value is PyTorch's default only because something had to
            be used. A comparison against an assumed value is never an error or a
            warning; it becomes a note that says which side is assumed and what to pass
            (`--eps`, `--momentum`, `--arch`).

momentum None is PyTorch's `momentum=None` (a cumulative average, weight 1/t for the
t-th batch): a `Setting(None, Source.MODULE)` is that known value, distinct from an
unknown momentum, which is always the assumed default 0.1 (`Source.DEFAULT`).
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bnaudit.normkinds import DEFAULT_EPS, DEFAULT_MOMENTUM

if TYPE_CHECKING:
    from bnaudit.config import Config
    from bnaudit.formats.model import ModuleInfo


# The command-line options that state each setting, for hints ("set --eps").
OPTIONS = {"eps": "--eps", "momentum": "--momentum"}


class Source(enum.Enum):
    """Where a setting's value comes from (see the module docstring's table)."""

    MODULE = "module"
    NODE = "node"
    OPTION = "option"
    CONFIG = "config"
    DEFAULT = "default"


@dataclass(frozen=True)
class Setting:
    """One setting's value and provenance.

    value  eps (> 0), or PyTorch momentum (the new batch's weight; None: cumulative average)
    where  for CONFIG the configuration file, for OPTION the option ("--eps"), for NODE the
           node's description; empty otherwise
    """

    value: float | None
    source: Source
    where: str = ""

    @property
    def known(self) -> bool:
        """Read from the file (its module or graph node)."""
        return self.source in (Source.MODULE, Source.NODE)

    @property
    def given(self) -> bool:
        """Stated by the user (an option, the API or the configuration file)."""
        return self.source in (Source.OPTION, Source.CONFIG)

    @property
    def assumed(self) -> bool:
        """PyTorch's default, used because nothing else said: never the basis of an error."""
        return self.source is Source.DEFAULT

    def text(self) -> str:
        """The value as printed: eps and momentum with %g, None as "None" (cumulative)."""
        return "None" if self.value is None else f"{self.value:g}"

    def origin(self) -> str:
        """Where the value comes from, in words ("--eps", "bnaudit.toml", "PyTorch's default")."""
        if self.source is Source.DEFAULT:
            return "PyTorch's default"
        if self.source is Source.MODULE:
            return "the module's own"
        return self.where or self.source.value


@dataclass(frozen=True)
class Settings:
    """A BN layer's eps and momentum, each with its provenance."""

    eps: Setting
    momentum: Setting

    @property
    def eps_value(self) -> float:
        """eps as a number: every source gives one (only momentum may be None)."""
        if self.eps.value is None:
            raise ValueError("eps has no value")  # stated_settings and resolve never build one
        return float(self.eps.value)

    @property
    def from_file(self) -> bool:
        """Both read from the file's own module or node."""
        return self.eps.known and self.momentum.known


def stated_settings(
    eps: float | None,
    momentum: float | None,
    from_file: Collection[str] = (),
    config_file: str | None = None,
) -> Settings:
    """What the user stated, for layers whose file says nothing: `eps` / `momentum` (None:
    not stated, PyTorch's default assumed). `from_file` names those that came from the
    configuration file `config_file`; the others were given as options (or by the API)."""

    def one(name: str, value: float | None, default: float) -> Setting:
        if value is None:
            return Setting(default, Source.DEFAULT)
        if name in from_file:
            return Setting(value, Source.CONFIG, config_file or "the configuration file")
        return Setting(value, Source.OPTION, OPTIONS[name])

    return Settings(one("eps", eps, DEFAULT_EPS), one("momentum", momentum, DEFAULT_MOMENTUM))


def settings_stated_by(config: Config) -> Settings:
    """`stated_settings` of a configuration: its eps and momentum, each from an option (or
    the API) or from its configuration file, else PyTorch's defaults as assumed."""
    return stated_settings(config.eps, config.momentum, config.from_file, config.source)


def resolve(module: ModuleInfo | None, stated: Settings) -> Settings:
    """A layer's settings: its module's or graph node's own where the file holds them, else
    what the user `stated` (see `stated_settings`), setting by setting.

    A module whose momentum the format cannot read (`momentum_known` False) still gives its
    eps; its momentum is the stated one."""
    if module is None:
        return stated
    source = Source.NODE if module.source is not None else Source.MODULE
    where = module.source or ""
    eps = Setting(float(module.eps), source, where) if module.eps is not None else stated.eps
    momentum = Setting(module.momentum, source, where) if module.momentum_known else stated.momentum
    return Settings(eps, momentum)


def statement(settings: Iterable[tuple[str, Setting]], missing_from: str, also: str = "") -> str:
    """One line saying which settings were not read from a file, e.g.

      eps 1e-05 and momentum 0.1 assumed (not in a state dict; set --eps/--momentum)
      eps 0.001 given by --eps (not in a state dict)

    `settings`: (name, Setting) pairs not read from the file, each name once; known ones are
    left out. `missing_from` says why the file cannot tell; `also` adds to the options
    a user can pass ("--arch"). Empty when every setting was read from the file."""
    given: list[str] = []
    sources: list[str] = []
    assumed: list[str] = []
    options: list[str] = []
    for name, setting in settings:
        if setting.assumed:
            assumed.append(f"{name} {setting.text()}")
            options.append(OPTIONS[name])
        elif setting.given:
            given.append(f"{name} {setting.text()}")
            sources.append(setting.origin())
    parts = []
    if given:
        by = ", ".join(dict.fromkeys(sources))
        parts.append(f"{' and '.join(given)} given by {by} ({missing_from})")
    if assumed:
        hint = "/".join(options) + (f" or {also}" if also else "")
        parts.append(f"{' and '.join(assumed)} assumed ({missing_from}; set {hint})")
    return "; ".join(parts)


def assumed_note(name: str, setting: Setting, suggested: str, holder: str = "the checkpoint", also: str = "") -> str:
    """The words of a comparison that met an assumed value (a note, never an error), e.g.

      the checkpoint holds no modules, so its eps is not known (1e-05 assumed): pass --eps
      0.001 if its model was built with it, or --arch to read the model's

    `suggested`: the value the other side shows; `also`: another option that would tell."""
    words = (
        f"{holder} holds no modules, so its {name} is not known ({setting.text()} assumed): "
        f"pass {OPTIONS[name]} {suggested} if its model was built with it"
    )
    return words + (f", or {also} to read the model's" if also else "")


def provenance_words(setting: Setting) -> str:
    """What a finding adds after a value the user stated, e.g. ' (given by --eps)', so that a
    contradicted statement is recognisable as the user's; empty for a value read from the file."""
    return f" (given by {setting.origin()})" if setting.given else ""

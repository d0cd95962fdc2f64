"""How bad a finding is: info < warning < error.

A `StrEnum`, so a severity is its own name wherever text is needed (JSON, SARIF levels,
the configuration's "error") and compares equal to it, while `<`, `max` and `sorted`
follow the rank, not the alphabet ("error" < "info" as strings).
"""

from __future__ import annotations

from enum import StrEnum


class Severity(StrEnum):
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"

    @property
    def rank(self) -> int:
        """0 for info, 1 for warning, 2 for error: the order `--fail-on` thresholds use."""
        return _ORDER.index(self)

    @classmethod
    def parse(cls, value: object) -> Severity:
        """The severity named `value` ("error", "warning", "info"); ValueError otherwise."""
        if isinstance(value, str):
            try:
                return cls(value)
            except ValueError:
                pass
        raise ValueError(f"expected one of {', '.join(reversed(_ORDER))}, got {value!r}")

    def _other_rank(self, other: object) -> int | None:
        if isinstance(other, Severity):
            return other.rank
        if isinstance(other, str) and other in _ORDER:
            return Severity(other).rank
        return None

    def __lt__(self, other: str) -> bool:
        rank = self._other_rank(other)
        return NotImplemented if rank is None else self.rank < rank

    def __le__(self, other: str) -> bool:
        rank = self._other_rank(other)
        return NotImplemented if rank is None else self.rank <= rank

    def __gt__(self, other: str) -> bool:
        rank = self._other_rank(other)
        return NotImplemented if rank is None else self.rank > rank

    def __ge__(self, other: str) -> bool:
        rank = self._other_rank(other)
        return NotImplemented if rank is None else self.rank >= rank


_ORDER: tuple[str, ...] = ("info", "warning", "error")

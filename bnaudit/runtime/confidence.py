"""How sure a measured accuracy, and a gap between two of them, is (95% intervals).

Wilson score interval of k successes in n trials, p = k/n, z = 1.96:

  centre     (p + z^2/(2n)) / (1 + z^2/n)
  half       z / (1 + z^2/n) * sqrt(p(1 - p)/n + z^2/(4n^2))
  interval   [centre - half, centre + half]      (always inside [0, 1], sound at p = 0 or 1)

Interval of a difference d = p1 - p2 (Newcombe 1998, method 10, from the two Wilson
intervals [l1, u1], [l2, u2]):

  [d - sqrt((p1 - l1)^2 + (u2 - p2)^2),  d + sqrt((u1 - p1)^2 + (p2 - l2)^2)]

It treats the two accuracies as independent; the train- and eval-mode predictions of the
same samples are positively correlated, so this interval is, if anything, too wide: a gap
called significant by it is significant.
"""

from __future__ import annotations

import math

Z95 = 1.96


def wilson(successes: int, trials: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval (module docstring) of `successes` out of `trials` > 0."""
    if trials <= 0:
        raise ValueError("wilson needs at least one trial")
    p = successes / trials
    z2 = z * z
    centre = (p + z2 / (2 * trials)) / (1 + z2 / trials)
    half = z / (1 + z2 / trials) * math.sqrt(p * (1 - p) / trials + z2 / (4 * trials * trials))
    return max(0.0, centre - half), min(1.0, centre + half)


def difference_interval(k1: int, k2: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Newcombe's interval (module docstring) of k1/n - k2/n."""
    p1, p2 = k1 / n, k2 / n
    l1, u1 = wilson(k1, n, z)
    l2, u2 = wilson(k2, n, z)
    d = p1 - p2
    return d - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2), d + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2)

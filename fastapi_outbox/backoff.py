"""Backoff: the one formula every wait after a failure uses.

A relay's retry of a refused message, a relay or subscriber pausing while its broker or
database is down, a subscriber's retry of a failing handler and the LISTEN connection's
reconnect all wait ``base * multiplier ** (n - 1)`` seconds after the ``n``-th failure in a
row, capped at ``maximum``, then spread by ``jitter`` (a fraction: ``0.25`` multiplies the
delay by a random factor in ``[0.75, 1.25]``; ``(0.0, 0.25)`` in ``[1.0, 1.25]``), never
above ``maximum`` or below zero. Pure: no clock, no I/O, so it is unit-tested on its own.
"""

from __future__ import annotations

import random

__all__ = ["exponential_delay"]

#: Exponents above this change nothing (every real cap is reached long before) and would
#: overflow a float for huge attempt counts.
_MAX_EXPONENT = 64


def exponential_delay(
    failures: int,
    *,
    base: float,
    maximum: float,
    multiplier: float = 2.0,
    jitter: float | tuple[float, float] = 0.0,
    rng: random.Random | None = None,
) -> float:
    """Seconds to wait after the ``failures``-th failure in a row (``failures >= 1``;
    smaller counts wait ``base``)."""
    exponent = min(max(0, failures - 1), _MAX_EXPONENT)
    delay = min(maximum, base * multiplier**exponent)
    low, high = (-jitter, jitter) if isinstance(jitter, float | int) else jitter
    if low or high:
        delay *= 1 + (rng or random).uniform(low, high)
    return max(0.0, min(delay, maximum))

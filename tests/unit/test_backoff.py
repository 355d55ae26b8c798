"""The one backoff formula: growth, cap, jitter bounds, huge counts."""

from __future__ import annotations

import random

import pytest

from fastapi_outbox.backoff import exponential_delay


def test_grows_by_the_multiplier_from_the_first_failure() -> None:
    delays = [exponential_delay(n, base=0.5, maximum=100.0) for n in range(1, 6)]
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0]
    assert exponential_delay(3, base=1.0, maximum=100.0, multiplier=3.0) == 9.0
    assert exponential_delay(0, base=0.5, maximum=100.0) == 0.5


def test_capped_and_never_overflows() -> None:
    assert exponential_delay(10, base=1.0, maximum=30.0) == 30.0
    assert exponential_delay(10**9, base=1.0, maximum=30.0, jitter=0.25) <= 30.0


@pytest.mark.parametrize(("jitter", "low", "high"), [(0.25, 0.75, 1.25), ((0.0, 0.25), 1.0, 1.25)])
def test_jitter_stays_in_its_band(
    jitter: float | tuple[float, float], low: float, high: float
) -> None:
    rng = random.Random(7)
    seen = [
        exponential_delay(3, base=1.0, maximum=1000.0, jitter=jitter, rng=rng) for _ in range(500)
    ]
    assert all(4.0 * low <= d <= 4.0 * high for d in seen)
    assert max(seen) - min(seen) > 4.0 * (high - low) * 0.8  # it does spread

"""The claim size adapts to the backlog: small while idle, growing to ``batch_size`` while
claims come back full, shrinking again when the backlog is gone."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from pydantic import ValidationError

from fastapi_outbox import Message, Outbox, OutboxSettings
from fastapi_outbox.brokers import MemoryBroker
from tests.conftest import unique, wait_until

BACKLOG = 3000


async def test_claims_grow_with_a_backlog_and_shrink_when_it_is_gone(db_url: str) -> None:
    broker = MemoryBroker()
    # One worker: the claims of two workers interleave, which blurs the sequence of sizes.
    settings = OutboxSettings(workers=1, poll_interval_seconds=0.05, max_poll_interval_seconds=0.05)
    assert (settings.min_batch_size, settings.batch_size) == (25, 500)
    outbox = Outbox(db_url, brokers={"default": broker}, settings=settings)
    await outbox.create_tables()
    stream = unique("orders")
    asked: list[tuple[int, int]] = []  # (rows asked for, rows returned)
    claim = outbox.store.claims.claim

    async def recording(broker_name: str, size: int, *args: Any, **kw: Any) -> Any:
        rows = await claim(broker_name, size, *args, **kw)
        asked.append((size, len(rows)))
        return rows

    outbox.store.claims.claim = recording  # type: ignore[method-assign]
    try:
        # A backlog committed before any relay runs.
        async with outbox.unit_of_work() as uow:
            for n in range(BACKLOG):
                uow.publish(Message(stream, "Numbered", {"n": n}))
        async with outbox.relaying():
            await broker.wait_for(BACKLOG, timeout=30)
            table_relay = outbox.relays.tables["default"]
            # Idle again: claims that come back empty halve the size down to the floor.
            await wait_until(lambda: table_relay.claim_size == 25, timeout=10)
            idle_from = len(asked)

            # A trickle: single commits are claimed by small claims.
            for n in range(3):
                async with outbox.unit_of_work() as uow:
                    uow.publish(Message(stream, "Numbered", {"n": BACKLOG + n}))
                await broker.wait_for(BACKLOG + n + 1, timeout=10)
    finally:
        await outbox.aclose()

    sizes = [size for size, _ in asked]
    assert sizes[0] == 25
    assert max(sizes) == 500, sizes
    # It grew by doubling while claims came back full, never past batch_size.
    growth = sizes[: sizes.index(500) + 1]
    assert all(b in (a, a * 2, 500) for a, b in itertools.pairwise(growth)), growth
    full_at_cap = [got for size, got in asked if size == 500]
    assert full_at_cap.count(500) >= 2, "the backlog was drained in claims of batch_size"
    assert all(size == 25 for size, _ in asked[idle_from:]), asked[idle_from:]
    assert sorted(json.loads(m.payload)["n"] for m in broker.messages) == list(range(BACKLOG + 3))


async def test_fixed_claims_when_min_batch_size_equals_batch_size(sqlite_url: str) -> None:
    broker = MemoryBroker()
    settings = OutboxSettings(batch_size=40, min_batch_size=40)
    outbox = Outbox(sqlite_url, brokers={"default": broker}, settings=settings)
    await outbox.create_tables()
    asked: list[int] = []
    claim = outbox.store.claims.claim

    async def recording(broker_name: str, size: int, *args: Any, **kw: Any) -> Any:
        asked.append(size)
        return await claim(broker_name, size, *args, **kw)

    outbox.store.claims.claim = recording  # type: ignore[method-assign]
    try:
        async with outbox.unit_of_work() as uow:
            for n in range(100):
                uow.publish(Message(unique("s"), "Numbered", {"n": n}))
        async with outbox.relaying():
            await broker.wait_for(100, timeout=10)
    finally:
        await outbox.aclose()
    assert set(asked) == {40}


def test_a_batch_size_below_the_default_floor_caps_it() -> None:
    settings = OutboxSettings(batch_size=10)
    assert settings.smallest_claim == 10


def test_min_batch_size_above_batch_size_is_refused_naming_both() -> None:
    with pytest.raises(ValidationError, match=r"min_batch_size.*batch_size"):
        OutboxSettings(batch_size=50, min_batch_size=100)

"""The dispatch cycle: claim a batch, publish it in one broker call, mark it.

Batches go to the broker whole; concurrent relays on one table (two processes) take
disjoint batches, so every message is published once; ``delete_on_publish`` removes rows;
a broker that raises or hangs does not stop the table_relay.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import anyio
import pytest

from fastapi_outbox import Outbox, OutboxSettings
from fastapi_outbox.brokers import MemoryBroker, PublishResults
from fastapi_outbox.events import Envelope, Message
from tests.conftest import unique, wait_until

pytestmark = pytest.mark.mariadb


async def publish(outbox: Outbox, n: int, *, per_transaction: int = 100) -> list[uuid.UUID]:
    stream = unique("orders")
    ids: list[uuid.UUID] = []
    for start in range(0, n, per_transaction):
        async with outbox.unit_of_work() as uow:
            for i in range(start, min(n, start + per_transaction)):
                ids.append(uow.publish(Message(stream, "OrderPlaced", {"n": i})))
    return ids


async def test_each_batch_is_one_broker_call_and_one_mark(db_url: str) -> None:
    broker = MemoryBroker()
    outbox = Outbox(
        db_url,
        brokers={"default": broker},
        settings=OutboxSettings(batch_size=100, min_batch_size=100, workers=1, run_relays=False),
    )
    await outbox.create_tables()
    marks = 0
    mark_published = outbox.store.claims.mark_published

    async def counting(*args: Any, **kw: Any) -> int:
        nonlocal marks
        marks += 1
        return await mark_published(*args, **kw)

    outbox.store.claims.mark_published = counting  # type: ignore[method-assign]
    try:
        ids = await publish(outbox, 250, per_transaction=250)
        async with outbox.relaying():
            await broker.wait_for(250)
            await wait_until(lambda: count_is(outbox, "published", 250), timeout=5)
        assert broker.publish_calls == 3  # 100 + 100 + 50
        assert marks == 3
        assert [m.id for m in broker.messages] == [str(i) for i in ids]  # oldest first
        assert broker.duplicates == 0
        for row in await outbox.store.messages.list_messages(limit=300):
            assert (row["status"], row["attempts"], row["locked_by"]) == ("published", 1, None)
            assert row["published_at"] is not None and row["locked_until"] is None
    finally:
        await outbox.aclose()


async def count_is(outbox: Outbox, status: str, n: int) -> bool:
    return await outbox.store.messages.count(status) == n


async def test_two_relays_on_one_table_publish_every_message_once(pg_url: str) -> None:
    settings = OutboxSettings(batch_size=20, workers=3, poll_interval_seconds=0.05)
    first, second = MemoryBroker(), MemoryBroker()
    a = Outbox(pg_url, brokers={"default": first}, settings=settings)
    b = Outbox(pg_url, brokers={"default": second}, settings=settings)
    await a.create_tables()
    try:
        async with a.relaying(), b.relaying():
            # Written from both "processes" while both relay.
            ids = await publish(a, 300, per_transaction=30) + await publish(
                b, 300, per_transaction=30
            )
            await wait_until(lambda: len(first.messages) + len(second.messages) >= 600, timeout=20)
            await wait_until(lambda: count_is(a, "published", 600), timeout=5)
        got_a = {m.id for m in first.messages}
        got_b = {m.id for m in second.messages}
        assert not got_a & got_b  # SKIP LOCKED: disjoint claims
        assert got_a | got_b == {str(i) for i in ids}
        assert got_a and got_b  # both took part
        assert first.duplicates == second.duplicates == 0
        assert {r["attempts"] for r in await a.store.messages.list_messages(limit=1000)} == {1}
    finally:
        await a.aclose()
        await b.aclose()


async def test_delete_on_publish_removes_the_rows(db_url: str) -> None:
    broker = MemoryBroker()
    outbox = Outbox(
        db_url,
        brokers={"default": broker},
        settings=OutboxSettings(delete_on_publish=True, poll_interval_seconds=0.05),
    )
    await outbox.create_tables()
    try:
        await publish(outbox, 5)
        async with outbox.relaying():
            await broker.wait_for(5)
            await wait_until(lambda: count_is(outbox, "pending", 0), timeout=5)
            await wait_until(lambda: total_is(outbox, 0), timeout=5)
    finally:
        await outbox.aclose()


async def total_is(outbox: Outbox, n: int) -> bool:
    return await outbox.store.messages.count() == n


class FlakyBroker(MemoryBroker):
    """Raises a plain exception (a bug, not a BrokerError) on its first call."""

    def __init__(self) -> None:
        super().__init__()
        self.raised = 0

    async def publish(self, batch: Sequence[Envelope]) -> PublishResults:
        if not self.raised:
            self.raised += 1
            raise KeyError("bug in a broker")
        return await super().publish(batch)


async def test_a_broker_that_raises_does_not_stop_the_relay(sqlite_url: str) -> None:
    broker = FlakyBroker()
    outbox = Outbox(
        sqlite_url,
        brokers={"default": broker},
        settings=OutboxSettings(
            poll_interval_seconds=0.05, retry_base_delay_seconds=0.05, retry_max_delay_seconds=1
        ),
    )
    await outbox.create_tables()
    try:
        ids = await publish(outbox, 3)
        async with outbox.relaying():
            await broker.wait_for(3, timeout=5)
            table_relay = outbox.relays.tables["default"]
            assert table_relay.running and table_relay.failed_total == 3
        for i in ids:
            row = await outbox.store.messages.get(i)
            assert row is not None
            # Counted as a failed attempt (the broker said nothing usable), then published.
            assert (row["status"], row["attempts"]) == ("published", 2)
    finally:
        await outbox.aclose()


class SlowOnceBroker(MemoryBroker):
    """Its first publish hangs past any timeout; later ones answer at once."""

    def __init__(self) -> None:
        super().__init__()
        self.hung = anyio.Event()

    async def publish(self, batch: Sequence[Envelope]) -> PublishResults:
        if not self.hung.is_set():
            self.hung.set()
            await anyio.sleep_forever()
        return await super().publish(batch)


async def test_a_publish_timeout_gives_the_batch_back_without_charge(sqlite_url: str) -> None:
    broker = SlowOnceBroker()
    outbox = Outbox(
        sqlite_url,
        brokers={"default": broker},
        settings=OutboxSettings(
            publish_timeout_seconds=0.3,
            poll_interval_seconds=0.05,
            broker_backoff_max_seconds=0.2,
        ),
    )
    await outbox.create_tables()
    try:
        ids = await publish(outbox, 2)
        async with outbox.relaying():
            await broker.wait_for(2, timeout=5)
            assert broker.hung.is_set()
            await wait_until(lambda: count_is(outbox, "published", 2), timeout=5)
        for i in ids:
            row = await outbox.store.messages.get(i)
            assert row is not None
            assert (row["status"], row["attempts"]) == ("published", 1)  # the timeout was free
    finally:
        await outbox.aclose()

"""capture="wal" under failure: a broker outage pauses the reader without moving the slot;
a message the broker refuses for itself goes to the outbox table as a ``failed`` row."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from fastapi_outbox import Message, Outbox, OutboxSettings, exceptions
from fastapi_outbox.brokers import MemoryBroker, RedisStreamsBroker
from fastapi_outbox.events import Envelope
from tests.conftest import slot_empty, unique, wait_until
from tests.servers import PrivateServer, free_port, redis_argv

PRIVATE_REDIS_PORTS = range(6470, 6480)
FAST = {
    "capture": "wal",
    "poll_interval_seconds": 0.05,
    "max_poll_interval_seconds": 0.2,
    "broker_backoff_max_seconds": 0.3,
    "retry_base_delay_seconds": 0.2,
    "retry_max_delay_seconds": 0.5,
    "publish_timeout_seconds": 1,
}


@pytest.fixture
async def private_redis(tmp_path: Path) -> AsyncIterator[PrivateServer]:
    """A Redis of this test, with AOF fsync always: a restart keeps what it acknowledged."""
    port = free_port(PRIVATE_REDIS_PORTS)
    server = PrivateServer(
        redis_argv(port, tmp_path, persistent=True), port, f"redis://127.0.0.1:{port}/0"
    )
    await server.start()
    try:
        yield server
    finally:
        await server.kill()


async def stream_ids(url: str, stream: str) -> list[str]:
    client = aioredis.Redis.from_url(url, socket_connect_timeout=0.5)
    try:
        return [f[b"id"].decode() for _, f in await client.xrange(stream)]
    finally:
        await client.aclose()


async def produce(outbox: Outbox, stream: str, n: int, start: int = 0) -> list[str]:
    ids = []
    for i in range(start, start + n):
        async with outbox.unit_of_work() as uow:
            ids.append(str(uow.publish(Message(stream, "Numbered", {"n": i}))))
    return ids


async def test_broker_outage_pauses_the_reader_without_moving_the_slot(
    wal_pg_url: str, private_redis: PrivateServer
) -> None:
    stream = unique("walout")
    broker = RedisStreamsBroker(private_redis.url, socket_timeout=1)
    outbox = Outbox(wal_pg_url, brokers={"default": broker}, settings=OutboxSettings(**FAST))
    slot = outbox.wal_slot
    assert slot is not None
    await outbox.create_tables()
    try:
        async with outbox.relaying():
            relay = outbox.relays.wal
            assert relay is not None
            first = await produce(outbox, stream, 20)
            await wait_until(lambda: _has(private_redis.url, stream, first))
            await private_redis.kill()
            during = await produce(outbox, stream, 30, start=20)
            await wait_until(lambda: not relay.broker_ok, timeout=10)
            # Paused: the messages committed during the outage are still in the slot, and
            # nothing was handed to the table (an outage is not a refusal).
            assert relay.lag_seconds > 0
            stats = await slot.stats()
            assert stats is not None and stats.lag_bytes is not None and stats.lag_bytes > 0
            assert await outbox.store.messages.count() == 0
            await private_redis.start()
            await wait_until(lambda: _has(private_redis.url, stream, first + during), timeout=15)
            await wait_until(lambda: relay.broker_ok and relay.oldest_unrelayed is None)
        ids = await stream_ids(private_redis.url, stream)
        assert sorted(ids) == sorted(first + during) and len(ids) == 50
        # In commit order.
        assert ids == first + during
        assert await slot.pending_messages() == 0
        assert await outbox.store.messages.count() == 0
    finally:
        await outbox.aclose()


async def _has(url: str, stream: str, ids: list[str]) -> bool:
    try:
        return set(ids) <= set(await stream_ids(url, stream))
    except Exception:
        return False


async def test_a_refused_message_becomes_a_failed_row_and_the_table_retries_it(
    wal_pg_url: str,
) -> None:
    refusing = {"on": True}

    def reject(envelope: Envelope) -> BaseException | None:
        if refusing["on"] and json.loads(envelope.payload).get("n") == 2:
            return exceptions.MessageRejected("message too large for the stream")
        return None

    broker = MemoryBroker(reject=reject)
    outbox = Outbox(wal_pg_url, brokers={"default": broker}, settings=OutboxSettings(**FAST))
    slot = outbox.wal_slot
    assert slot is not None
    await outbox.create_tables()
    try:
        async with outbox.relaying():
            ids = await produce(outbox, "walrefuse", 5)
            # The others are published; the refused one is in the table, failed.
            await broker.wait_for(4)

            async def failed_row() -> dict[str, Any] | None:
                rows = await outbox.store.messages.list_messages(limit=10)
                return rows[0] if rows else None

            await wait_until(lambda: _row_status(outbox, ids[2], "failed", "published"))
            row = await failed_row()
            assert row is not None and str(row["id"]) == ids[2]
            assert "too large" in (row["last_error"] or "")
            # The slot moved past it: the relay does not publish it again.
            await wait_until(lambda: slot_empty(slot))
            refusing["on"] = False
            # The table's table_relay retries it after its backoff.
            await broker.wait_for(5)
            await wait_until(lambda: _row_status(outbox, ids[2], "published"))
        assert sorted(m.id for m in broker.messages) == sorted(ids)
        assert broker.duplicates == 0
    finally:
        await outbox.aclose()


async def _row_status(outbox: Outbox, message_id: str, *statuses: str) -> bool:
    import uuid

    row = await outbox.store.messages.get(uuid.UUID(message_id))
    return row is not None and row["status"] in statuses


async def test_a_refusal_with_max_attempts_1_is_abandoned_and_replayable(wal_pg_url: str) -> None:
    broker = MemoryBroker(reject=lambda e: exceptions.MessageRejected("bad subject"))
    outbox = Outbox(
        wal_pg_url,
        brokers={"default": broker},
        settings=OutboxSettings(**FAST, max_attempts=1),
    )
    await outbox.create_tables()
    try:
        async with outbox.relaying():
            (message_id,) = await produce(outbox, "walabandon", 1)
            await wait_until(lambda: _row_status(outbox, message_id, "abandoned"))
        assert broker.messages == []
    finally:
        await outbox.aclose()

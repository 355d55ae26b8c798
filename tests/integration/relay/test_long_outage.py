"""An outage longer than the old de-duplication window: a database outage between the
publish and the mark leaves the row claimed; when the database is back its lease has run
out and the message is published again. A broker outage that swallowed the ack of a
publish the broker had taken gives the batch back; it is published again when the broker
is back. The brokers' de-duplication window now covers
``dedup_outage_seconds`` as well as lease + backoff, so that republish is dropped: one copy
on the broker. The same run with the old window (lease + backoff only, no outage
allowance) puts a second copy there.

Windows are compressed (lease 2 s; old window 3 s, new one lease + backoff + 30 s +
margin) so the outage lasts a few seconds, longer than the old window."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import anyio
import nats
import pytest
import redis.asyncio as aioredis

from fastapi_outbox import Message, Outbox, OutboxSettings
from fastapi_outbox.brokers import NatsJetStreamBroker, RedisStreamsBroker
from fastapi_outbox.brokers.nats.wire import stream_name_for
from fastapi_outbox.exceptions import BrokerUnavailable
from tests.conftest import unique, wait_until
from tests.servers import TcpProxy

OLD_WINDOW_SECONDS = 3.0
#: The database stays down this much longer than the old window.
BEYOND_SECONDS = 2.0
SETTINGS: dict[str, Any] = {
    "lease_seconds": 2.0,
    "publish_timeout_seconds": 1.0,
    "db_statement_timeout_seconds": 1.0,
    "poll_interval_seconds": 0.05,
    "max_poll_interval_seconds": 0.2,
    "broker_backoff_max_seconds": 0.2,
    "retry_base_delay_seconds": 0.05,
    "retry_max_delay_seconds": 0.2,
}


@pytest.fixture
async def proxy() -> AsyncIterator[TcpProxy]:
    """PostgreSQL through a proxy of this test's own: stopping it is the outage."""
    p = TcpProxy(5432)
    await p.start()
    try:
        yield p
    finally:
        await p.stop()


def make_broker(kind: str, url: str, window: float | None) -> Any:
    if kind == "redis":
        return RedisStreamsBroker(url, dedup_window_seconds=window)
    return NatsJetStreamBroker(url, dedup_window_seconds=window)


async def copies(kind: str, url: str, stream: str, message_id: uuid.UUID) -> int:
    """Entries of ``message_id`` on the broker's stream."""
    if kind == "redis":
        client = aioredis.Redis.from_url(url)
        try:
            entries = await client.xrange(stream, "-", "+")
        finally:
            await client.aclose()
        return sum(fields[b"id"].decode() == str(message_id) for _, fields in entries)
    nc = await nats.connect(url)
    try:
        info = await nc.jsm().stream_info(stream_name_for(stream))
        return int(info.state.messages)  # the stream holds only this test's message
    finally:
        await nc.close()


async def cleanup(kind: str, url: str, stream: str) -> None:
    if kind == "redis":
        client = aioredis.Redis.from_url(url)
        try:
            await client.delete(stream)
        finally:
            await client.aclose()
        return
    nc = await nats.connect(url)
    try:
        await nc.jsm().delete_stream(stream_name_for(stream))
    except Exception:
        pass
    finally:
        await nc.close()


@pytest.mark.parametrize("outage", ["database", "broker"])
@pytest.mark.parametrize("kind", ["redis", "nats"])
@pytest.mark.parametrize(
    ("window", "expected"),
    [("old", 2), ("new", 1)],
    ids=["old-window-two-copies", "outage-window-one-copy"],
)
async def test_outage_longer_than_the_old_window_between_publish_and_mark(
    pg_url: str, proxy: TcpProxy, kind: str, window: str, expected: int, outage: str, request: Any
) -> None:
    """``database``: the database goes down right after the broker took the message, so
    the mark fails. ``broker``: the broker took the message but its ack was lost (the
    publish fails as unavailable), and it stays unavailable that long."""
    url = request.getfixturevalue("redis_url" if kind == "redis" else "nats_url")
    if window == "old":
        # The window before dedup_outage_seconds: lease + longest backoff, compressed.
        settings = OutboxSettings(dedup_outage_seconds=0, **SETTINGS)
        broker = make_broker(kind, url, OLD_WINDOW_SECONDS)
    else:
        # Sized by the settings: lease + backoff + an outage of 30 s (+ margin).
        settings = OutboxSettings(dedup_outage_seconds=30.0, **SETTINGS)
        broker = make_broker(kind, url, None)
    through_proxy = pg_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
    outbox = Outbox(
        through_proxy,
        brokers={"default": broker},
        settings=settings,
        engine_options={"pool_size": 2},
    )
    direct = Outbox(pg_url, settings=OutboxSettings(run_relays=False))
    await outbox.create_tables()
    stream = unique("orders")
    cut_at: list[float] = []
    publish = broker.publish

    def over() -> bool:
        return time.monotonic() > cut_at[0] + OLD_WINDOW_SECONDS + BEYOND_SECONDS

    async def publish_then_cut(batch: Any) -> Any:
        """The broker took the batch; then the outage."""
        if outage == "broker" and cut_at and not over():
            raise BrokerUnavailable("broker outage (staged)")
        results = await publish(batch)
        if not cut_at:
            cut_at.append(time.monotonic())
            if outage == "database":
                await proxy.stop()
            else:
                raise BrokerUnavailable("connection lost before the ack (staged)")
        return results

    broker.publish = publish_then_cut
    try:
        async with outbox.relaying():
            async with direct.unit_of_work() as uow:
                message_id = uow.publish(Message(stream, "OrderPlaced", {"n": 1}))
            await wait_until(lambda: bool(cut_at), timeout=30)
            assert await copies(kind, url, stream, message_id) == 1
            # Down longer than the old window (the mark failed and the lease runs out, or
            # the batch went back and waits for the broker).
            await wait_until(over, timeout=30)
            if outage == "database":
                await proxy.start()

            async def published() -> bool:
                row = await direct.store.messages.get(message_id)
                return row is not None and row["status"] == "published"

            await wait_until(published, timeout=60)
            row = await direct.store.messages.get(message_id)
            assert row is not None
            if outage == "database":
                assert row["attempts"] >= 2  # it was claimed again after its lease
        with anyio.fail_after(10):
            assert await copies(kind, url, stream, message_id) == expected
    finally:
        await outbox.aclose()
        await direct.aclose()
        await cleanup(kind, url, stream)

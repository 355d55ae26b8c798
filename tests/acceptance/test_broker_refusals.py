"""A broker that answers but refuses every write is an outage, not a bad message.

A private Redis (never the shared one) is driven into the refusals operators meet:
``maxmemory`` lowered until every XADD is refused with ``OOM``, and the server turned into
a read-only replica (``REPLICAOF``, as after a failover) then promoted back. Producers
commit all along, retry settings are fast (a refusal charged as an attempt would abandon
the backlog within seconds), and at the end every committed message is in the stream
exactly once, none abandoned, and no attempt was charged for the outage.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest
import redis.asyncio as aioredis

from fastapi_outbox import Outbox, OutboxSettings
from fastapi_outbox.brokers import RedisStreamsBroker
from tests.acceptance.conftest import (
    Server,
    exactly_once,
    produce,
    redis_ids,
    unfinished,
    wait_drained,
)
from tests.conftest import unique, wait_until

pytestmark = [
    pytest.mark.slow,
    pytest.mark.redis,
    pytest.mark.postgres(
        reason="broker refusals, not the database's: one server database suffices"
    ),
]

#: Fast retries: a refusal charged per message would abandon everything quickly.
SETTINGS = {
    "poll_interval_seconds": 0.05,
    "max_poll_interval_seconds": 0.2,
    "broker_backoff_max_seconds": 0.3,
    "max_attempts": 3,
    "retry_base_delay_seconds": 0.01,
    "retry_max_delay_seconds": 0.05,
    "retry_jitter": 0,
    "publish_timeout_seconds": 2,
    "lease_seconds": 5,
}


async def run_through_refusal(
    pg_url: str,
    server: Server,
    refuse: Callable[[Any], Awaitable[None]],
    accept: Callable[[Any], Awaitable[None]],
    code: str,
) -> None:
    stream = unique("orders")
    broker = RedisStreamsBroker(server.url, socket_timeout=2)
    outbox = Outbox(pg_url, brokers={"default": broker}, settings=OutboxSettings(**SETTINGS))
    await outbox.create_tables()
    admin = aioredis.Redis.from_url(server.url)
    try:
        async with outbox.relaying():
            table_relay = outbox.relays.tables["default"]
            committed = await produce(outbox, stream, 60)
            await wait_drained(outbox, 20, lambda: "before the refusal")

            await refuse(admin)
            async with anyio.create_task_group() as tg:

                async def more() -> None:
                    committed.extend(await produce(outbox, stream, 240, pause=0.01))

                tg.start_soon(more)
                await wait_until(lambda: table_relay.broker_refusing, timeout=15)
                assert code in (table_relay.last_error or ""), table_relay.last_error
            # Refused for a while, with everything committed: still nothing charged.
            await wait_until(lambda: _down_for(table_relay) > 1.0, timeout=15)
            assert await outbox.store.messages.count("abandoned") == 0
            assert await outbox.store.messages.count("failed") == 0
            left = await unfinished(outbox)
            if left == 0:  # say what the server was doing: the refusal must hold here
                role = (await admin.info("replication")).get("role")
                length = await admin.xlen(stream)
                pytest.fail(
                    f"all published while refusing: role={role}, xlen={length}, "
                    f"committed={len(committed)}, last_error={table_relay.last_error}"
                )

            await accept(admin)
            await wait_drained(outbox, 30, lambda: f"after the refusal: {table_relay.last_error}")
            assert table_relay.broker_ok and not table_relay.broker_refusing
        assert await outbox.store.messages.count("abandoned") == 0
        async with outbox.engine.connect() as conn:
            attempts = (
                await conn.exec_driver_sql(f"SELECT max(attempts) FROM {outbox.table.name}")
            ).scalar_one()
        assert attempts == 1  # every refused claim was refunded
        exactly_once(committed, await redis_ids(server.url, stream))
    finally:
        await admin.aclose()
        await outbox.aclose()


def _down_for(table_relay: Any) -> float:
    import time

    since = table_relay.broker_down_since
    return 0.0 if since is None else time.time() - since


async def test_redis_at_maxmemory_pauses_the_relay_and_loses_nothing(
    pg_url: str, private_redis: Server
) -> None:
    async def full(admin: Any) -> None:
        await admin.config_set("maxmemory", 1)  # below what it uses: every write is OOM

    async def room(admin: Any) -> None:
        await admin.config_set("maxmemory", 0)

    await run_through_refusal(pg_url, private_redis, full, room, "OOM")


async def test_redis_turned_read_only_replica_then_promoted_loses_nothing(
    pg_url: str, private_redis: Server
) -> None:
    # A replica of a master that does not answer keeps its data and refuses writes with
    # READONLY, as the old master does after a failover until it is promoted back.
    from tests.servers import free_port

    nowhere = free_port(range(6480, 6490))

    async def demote(admin: Any) -> None:
        await admin.execute_command("REPLICAOF", "127.0.0.1", str(nowhere))

    async def promote(admin: Any) -> None:
        await admin.execute_command("REPLICAOF", "NO", "ONE")

    await run_through_refusal(pg_url, private_redis, demote, promote, "READONLY")


@pytest.mark.nats
async def test_jetstream_stream_gone_is_an_outage_that_heals(
    pg_url: str, private_nats: Server
) -> None:
    """The stream capturing a subject disappears (deleted, or offline with its leader): the
    publish gets "no responders". For a subject a stream was known to capture that is an
    outage — the batch goes back uncharged — and the broker finds (here: re-creates) the
    stream before the next try."""
    import nats

    from fastapi_outbox.brokers import NatsJetStreamBroker
    from fastapi_outbox.brokers.nats.wire import stream_name_for
    from tests.acceptance.conftest import nats_ids

    subject = unique("orders")
    broker = NatsJetStreamBroker(private_nats.url, ack_timeout_seconds=2)
    outbox = Outbox(pg_url, brokers={"default": broker}, settings=OutboxSettings(**SETTINGS))
    await outbox.create_tables()
    try:
        async with outbox.relaying():
            table_relay = outbox.relays.tables["default"]
            first = await produce(outbox, subject, 20)
            await wait_drained(outbox, 20, lambda: "before the deletion")
            exactly_once(first, await nats_ids(private_nats.url, subject))

            nc = await nats.connect(private_nats.url)
            try:
                await nc.jetstream().delete_stream(stream_name_for(subject))
            finally:
                await nc.close()
            later = await produce(outbox, subject, 40)
            await wait_drained(outbox, 20, lambda: f"after the deletion: {table_relay.last_error}")
            assert table_relay.broker_ok
        assert await outbox.store.messages.count("abandoned") == 0
        async with outbox.engine.connect() as conn:
            attempts = (
                await conn.exec_driver_sql(f"SELECT max(attempts) FROM {outbox.table.name}")
            ).scalar_one()
        assert attempts == 1  # the refused claims were refunded, not charged
        exactly_once(later, await nats_ids(private_nats.url, subject))
    finally:
        await outbox.aclose()

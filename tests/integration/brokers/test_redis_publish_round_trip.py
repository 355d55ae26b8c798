"""The Redis publisher on a single node sends a batch in one round trip: its script calls
packed in one write, no ``SCRIPT EXISTS`` before them; a script cache emptied meanwhile
(a restarted or flushed Redis) is reloaded and the batch still lands once. Counted with
``INFO commandstats`` of a private Redis (the shared one counts every test's commands)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from fastapi_outbox.brokers import RedisStreamsBroker
from fastapi_outbox.events import Envelope
from tests.servers import PrivateServer, private_redis_server

pytestmark = [pytest.mark.redis, pytest.mark.anyio]

PORTS = range(6590, 6600)


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[PrivateServer]:
    srv = private_redis_server(PORTS, tmp_path)
    await srv.start()
    try:
        yield srv
    finally:
        await srv.kill()


def envelopes(n: int, stream: str) -> list[Envelope]:
    return [
        Envelope(str(uuid.uuid4()), stream, "OrderPlaced", str(i), b'{"n": %d}' % i, {"a": "b"})
        for i in range(n)
    ]


async def command_calls(client: Any) -> dict[str, int]:
    stats = await client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


async def test_a_batch_is_one_script_call_per_chunk_without_script_exists(
    server: PrivateServer,
) -> None:
    client = aioredis.Redis.from_url(server.url)
    broker = RedisStreamsBroker(server.url)
    try:
        await broker.connect()
        await broker.publish(envelopes(3, "warm"))  # the script is in the cache now
        await client.config_resetstat()
        results = await broker.publish(envelopes(450, "orders"))
        assert results == [None] * 450
        calls = await command_calls(client)
        assert calls.get("evalsha") == 3  # 450 messages in chunks of 200
        assert "script|exists" not in calls and "script" not in calls
        assert await client.xlen("orders") == 450
    finally:
        await broker.aclose()
        await client.aclose()


async def test_an_emptied_script_cache_is_reloaded_and_the_batch_lands_once(
    server: PrivateServer,
) -> None:
    client = aioredis.Redis.from_url(server.url)
    broker = RedisStreamsBroker(server.url)
    try:
        await broker.connect()
        batch = envelopes(250, "orders")
        assert await broker.publish(batch[:100]) == [None] * 100
        await client.script_flush()
        # The first 100 go again with 150 new ones: NOSCRIPT, reload, one send of the whole
        # batch; the de-duplication keeps the first 100 as they were.
        assert await broker.publish(batch) == [None] * 250
        entries = await client.xrange("orders")
        assert [fields[b"id"].decode() for _, fields in entries] == [e.id for e in batch]
        await client.script_flush()
        assert await broker.publish(batch) == [None] * 250
        assert await client.xlen("orders") == 250
    finally:
        await broker.aclose()
        await client.aclose()


async def test_a_publish_cancelled_before_its_replies_leaves_no_reply_for_the_next(
    server: PrivateServer,
) -> None:
    """A publish cancelled while Redis holds its commands (``CLIENT PAUSE``) closes its
    connection: the next publish reads its own replies, not the cancelled one's."""
    import anyio

    client = aioredis.Redis.from_url(server.url)
    broker = RedisStreamsBroker(server.url)
    try:
        await broker.connect()
        await broker.publish(envelopes(2, "warm"))
        await client.client_pause(400, all=True)
        first = envelopes(5, "orders")
        with anyio.move_on_after(0.1) as scope:
            await broker.publish(first)
        assert scope.cancelled_caught
        second = envelopes(7, "orders")
        assert await broker.publish(second) == [None] * 7  # waits out the pause
        ids = [f[b"id"].decode() for _, f in await client.xrange("orders")]
        assert ids[-7:] == [e.id for e in second]
        assert set(ids[:-7]) <= {e.id for e in first}
        assert await broker.publish(first) == [None] * 5  # de-duplicated or added once
        ids = [f[b"id"].decode() for _, f in await client.xrange("orders")]
        assert sorted(ids) == sorted({e.id for e in first + second})
    finally:
        await broker.aclose()
        await client.aclose()

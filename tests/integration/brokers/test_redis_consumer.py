"""The Redis consumer's round-trip savings keep its promises.

``ack_soon`` (what a subscriber's batch uses) lets the XACK ride with the fetch loop's next
XREADGROUP: the entries must still leave the pending entries list — with that read, at
close, at once while a read is blocked waiting — and a read that fails must not lose them.
The fetch loop's own connection has no socket timeout (redis-py would send each command in
a task of its own); its reads are bounded by the consumer instead.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

from fastapi_outbox import exceptions
from fastapi_outbox.brokers import RedisStreamsBroker
from fastapi_outbox.brokers.consumer import ConsumerConfig
from fastapi_outbox.brokers.redis.consumer import RedisStreamsConsumer
from tests.conftest import unique, wait_until
from tests.servers import TcpProxy

pytestmark = pytest.mark.redis


def consumer_of(broker: RedisStreamsBroker, stream: str) -> Any:
    """Group "g" of ``stream``, from its start."""
    config = ConsumerConfig(
        stream=stream,
        group="g",
        consumer_name="me",
        dead_letter=f"{stream}.dlq",
        claim_idle_seconds=30,
        max_attempts=3,
        start="all",
    )
    return broker.consumer(config)


@pytest.fixture
async def setup(redis_url: str) -> AsyncIterator[tuple[Any, RedisStreamsConsumer, str, TcpProxy]]:
    """The test's own client, a consumer of group "g" whose broker reaches Redis through a
    TCP proxy (``proxy.stop()`` cuts its connections and refuses new ones: an outage no
    client can hide by reconnecting), the stream, and the proxy."""
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(redis_url)
    stream = unique("acks")
    host_port = redis_url.split("://", 1)[1].split("/", 1)[0]
    proxy = TcpProxy(int(host_port.rpartition(":")[2] or 6379))
    await proxy.start()
    broker = RedisStreamsBroker(f"redis://127.0.0.1:{proxy.port}/0")
    consumer = consumer_of(broker, stream)
    await consumer.setup()
    try:
        yield client, consumer, stream, proxy
    finally:
        await consumer.aclose()
        await broker.aclose()
        await proxy.stop()
        await client.delete(stream, f"{stream}.dlq")
        await client.aclose()


async def add(client: Any, stream: str, n: int) -> None:
    for i in range(n):
        await client.xadd(
            stream,
            {"id": f"m-{i}", "type": "T", "key": "", "headers": "{}", "payload": json.dumps(i)},
        )


async def fetched(client: Any, consumer: RedisStreamsConsumer, stream: str, n: int) -> list[Any]:
    """Add ``n`` entries and fetch them."""
    await add(client, stream, n)
    got = await consumer.fetch(10, 0.5)
    assert len(got) == n
    return got


async def pending(client: Any, stream: str) -> int:
    return int((await client.xpending(stream, "g"))["pending"])


async def test_ack_soon_rides_with_the_next_read(setup: Any) -> None:
    client, consumer, stream, _proxy = setup
    got = await fetched(client, consumer, stream, 3)
    assert [d.message_id for d in got] == ["m-0", "m-1", "m-2"]
    await consumer.ack_soon(got[:2])
    assert await pending(client, stream) == 3  # waiting for the next read
    assert await consumer.fetch(10, 0.0) == []  # nothing new; the XACK went with it
    assert await pending(client, stream) == 1
    await consumer.ack(got[2:])  # a plain ack goes at once
    assert await pending(client, stream) == 0


async def test_ack_soon_is_sent_at_close(setup: Any) -> None:
    client, consumer, stream, _proxy = setup
    got = await fetched(client, consumer, stream, 2)
    await consumer.ack_soon(got)
    assert await pending(client, stream) == 2
    await consumer.aclose()
    assert await pending(client, stream) == 0


async def test_ack_soon_during_a_blocked_read_goes_at_once(setup: Any) -> None:
    client, consumer, stream, _proxy = setup
    got = await fetched(client, consumer, stream, 2)
    async with anyio.create_task_group() as tg:
        tg.start_soon(consumer.fetch, 10, 3.0)  # blocks: nothing new
        await wait_until(lambda: consumer.ack_soon_sends_at_once, timeout=5)
        await consumer.ack_soon(got)
        assert await pending(client, stream) == 0  # not held until the read ends
        await add(client, stream, 1)  # ends the blocked read
    assert await pending(client, stream) == 1


async def test_acks_of_a_failed_read_go_with_the_next_one(setup: Any) -> None:
    client, consumer, stream, proxy = setup
    got = await fetched(client, consumer, stream, 2)
    await consumer.ack_soon(got)
    # The network to Redis is cut: the read carrying the acks fails, and they are kept.
    await proxy.stop()
    with pytest.raises(exceptions.BrokerUnavailable):
        await consumer.fetch(10, 0.0)
    assert await pending(client, stream) == 2
    await proxy.start()
    assert await consumer.fetch(10, 0.0) == []
    assert await pending(client, stream) == 0


async def test_a_client_that_decodes_responses(redis_url: str) -> None:
    """A broker on the application's own client made with ``decode_responses=True``:
    deliveries still carry the message id and type (field names come back as text)."""
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    stream = unique("decoded")
    broker = RedisStreamsBroker(redis_url, client=client)
    consumer = consumer_of(broker, stream)
    try:
        await consumer.setup()
        got = await fetched(client, consumer, stream, 2)
        assert [(d.message_id, d.type, d.json()) for d in got] == [("m-0", "T", 0), ("m-1", "T", 1)]
        await consumer.ack(got)
        assert await pending(client, stream) == 0
    finally:
        await consumer.aclose()
        await client.delete(stream)
        await client.aclose()


async def test_entries_of_a_lost_reply_come_back_after_a_failure(setup: Any) -> None:
    """An XREADGROUP whose reply never arrived (here: made behind the consumer's back with
    its name) leaves entries pending for this consumer. After the next connection failure
    the consumer takes them back from its own pending entries — not the ones it is still
    working on — instead of waiting ``claim_idle_seconds`` for XAUTOCLAIM."""
    client, consumer, stream, proxy = setup
    working = await fetched(client, consumer, stream, 1)  # handed out, not finished
    await add(client, stream, 3)
    lost = await client.xreadgroup("g", "me", {stream: ">"}, count=10)
    assert len(lost[0][1]) == 3
    assert await consumer.fetch(10, 0.0) == []  # nothing new; the lost ones are pending
    await proxy.stop()
    with pytest.raises(exceptions.BrokerUnavailable):
        await consumer.fetch(10, 0.0)
    await proxy.start()
    back = await consumer.fetch(10, 0.0)
    assert [d.message_id for d in back] == ["m-0", "m-1", "m-2"]  # the second add's
    assert all(d.attempt >= 2 for d in back)  # reading its own pending entries counts
    assert working[0].entry_id not in {d.entry_id for d in back}
    assert await consumer.fetch(10, 0.0) == []  # taken back once
    await consumer.ack([*working, *back])
    assert await pending(client, stream) == 0


def quick_claim(broker: RedisStreamsBroker, stream: str) -> Any:
    """Group "g" of ``stream`` with XAUTOCLAIM taking entries idle for 0.2 s."""
    config = ConsumerConfig(
        stream=stream,
        group="g",
        consumer_name="me",
        dead_letter=f"{stream}.dlq",
        claim_idle_seconds=0.2,
        max_attempts=3,
        start="all",
    )
    return broker.consumer(config)


async def idle_past(client: Any, stream: str, ms: int) -> bool:
    entries = await client.xpending_range(stream, "g", min="-", max="+", count=100)
    return bool(entries) and all(e["time_since_delivered"] > ms for e in entries)


async def test_own_entries_are_handed_out_once_by_a_fetch(redis_url: str) -> None:
    """Entries of this consumer left pending past ``claim_idle_seconds``: acks waiting
    for the next read are not handed out again by XAUTOCLAIM, and after a connection
    failure, entries XAUTOCLAIM took are not taken a second time from the consumer's own
    pending entries in the same fetch: one delivery each, never two at once (the second,
    past max_attempts, was dead-lettered while the first was handled — seen on a Redis
    Cluster failover)."""
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(redis_url)
    stream = unique("once")
    broker = RedisStreamsBroker(f"{redis_url}?client_name={stream}")
    consumer = quick_claim(broker, stream)
    try:
        await consumer.setup()
        done = await fetched(client, consumer, stream, 2)
        await consumer.ack_soon(done)  # handled; the acks wait for the next read
        await wait_until(lambda: idle_past(client, stream, 250), timeout=5)
        assert await consumer.fetch(10, 0.0) == []  # XAUTOCLAIM leaves them; acked with it
        assert await pending(client, stream) == 0

        await add(client, stream, 3)
        lost = await client.xreadgroup("g", "me", {stream: ">"}, count=10)  # reply "lost"
        assert len(lost[0][1]) == 3
        consumer._recover = True  # as a connection failure leaves it
        await wait_until(lambda: idle_past(client, stream, 250), timeout=5)
        await wait_until(lambda: time.monotonic() >= consumer._next_autoclaim, timeout=5)
        # One fetch: XAUTOCLAIM takes the idle entries, then the recovery of the
        # consumer's own pending entries finds the same ones.
        back = await consumer.fetch(10, 0.0)
        assert sorted(d.message_id for d in back) == ["m-0", "m-1", "m-2"]  # once each
        await consumer.ack(back)
        assert await pending(client, stream) == 0
    finally:
        await consumer.aclose()
        await broker.aclose()
        await client.delete(stream, f"{stream}.dlq")
        await client.aclose()


async def test_a_lost_connection_is_an_outage_at_once(redis_url: str) -> None:
    """The client's retry policy is the library's: a command whose connection is lost
    fails at once, and the relay or the consumer decides when to try again (redis-py 6+
    would otherwise reconnect and send it again three times, with up to 10 s of backoff,
    hiding the outage)."""
    host_port = redis_url.split("://", 1)[1].split("/", 1)[0]
    proxy = TcpProxy(int(host_port.rpartition(":")[2] or 6379))
    await proxy.start()
    broker = RedisStreamsBroker(f"redis://127.0.0.1:{proxy.port}/0")
    attempts = 0

    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal attempts
        attempts += 1
        writer.transport.abort()

    try:
        await broker.ping()
        await proxy.stop()  # the connection is cut; whoever answers now hangs up at once
        server = await asyncio.start_server(hang_up, "127.0.0.1", proxy.port)
        async with server:
            with pytest.raises(exceptions.BrokerUnavailable):
                await broker.ping()
        assert attempts == 1  # not reconnected and sent again behind the library's back
    finally:
        await broker.aclose()


async def test_a_blocked_read_unblocked_by_the_server_is_an_outage(setup: Any) -> None:
    """Redis ends a blocked XREADGROUP with ``UNBLOCKED`` when its stream leaves the node
    (a Redis Cluster slot migrated, a failover made the node a replica, the key deleted):
    the read is to be made again, on the node serving the stream now — an outage
    (BrokerUnavailable: the subscriber pauses, logs a warning without a traceback and
    charges nothing), not a failure of the fetch."""
    client, consumer, stream, _proxy = setup
    async with anyio.create_task_group() as tg:
        failed: list[BaseException] = []

        async def read() -> None:
            try:
                await consumer.fetch(10, 5.0)
            except Exception as exc:
                failed.append(exc)

        tg.start_soon(read)

        async def blocked() -> bool:
            return any(
                c.get("cmd") == "xreadgroup" and "b" in c.get("flags", "")
                for c in await client.client_list()
            )

        await wait_until(blocked, timeout=5)
        await client.delete(stream)  # what a slot leaving the node does to a blocked read
    assert len(failed) == 1
    assert isinstance(failed[0], exceptions.BrokerUnavailable), repr(failed[0])
    assert "UNBLOCKED" in str(failed[0])

"""Hangs end: a broker frozen with SIGSTOP, ten times in a row, while producers commit.

Each cycle freezes a private Redis or NATS server (never the shared ones) for three times
``publish_timeout_seconds``, then resumes it. After every resume the relay is back
within ``RECOVERY_BOUND_SECONDS`` (a message committed after the resume is published by
then); nothing leaks across cycles (Redis client connections, NATS ack futures and
publish slots, asyncio tasks); at the end every committed message is in the stream once.

The bound: a publish in flight when the server froze ends at ``publish_timeout_seconds``
(0.3 s here), the table_relay then pauses at most ``broker_backoff_max_seconds`` (0.4 s) per
try, and the next claim and publish take milliseconds: about 1 s; the assertion allows 5 s
for a loaded 2-core machine.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import anyio
import pytest

from fastapi_outbox import Message, Outbox, OutboxSettings
from fastapi_outbox.brokers import NatsJetStreamBroker, RedisStreamsBroker
from tests.acceptance.conftest import Server, exactly_once, nats_ids, redis_ids, wait_drained
from tests.conftest import unique, wait_until

pytestmark = [
    pytest.mark.slow,
    pytest.mark.postgres(
        reason="hangs of brokers and handlers, not the database's: one server database suffices"
    ),
]

CYCLES = 10
PUBLISH_TIMEOUT = 0.3
RECOVERY_BOUND_SECONDS = 5.0
SETTINGS = {
    "publish_timeout_seconds": PUBLISH_TIMEOUT,
    "lease_seconds": 2,
    "poll_interval_seconds": 0.05,
    "max_poll_interval_seconds": 0.2,
    "broker_backoff_max_seconds": 0.4,
    "shutdown_timeout_seconds": 2,
}


async def commit(outbox: Outbox, stream: str, n: int, ids: list[str]) -> list[str]:
    async with outbox.unit_of_work() as uow:
        made = [str(uow.publish(Message(stream, "Tick", {"i": i}))) for i in range(n)]
    ids.extend(made)
    return made


async def freeze_cycles(
    outbox: Outbox, server: Server, stream: str, delivered: Any, leaks: Any
) -> list[str]:
    committed: list[str] = []
    table_relay = outbox.relays.tables["default"]
    await commit(outbox, stream, 20, committed)
    await wait_drained(outbox, 20, lambda: "warm-up")
    baseline = await leaks()
    recoveries = []
    for cycle in range(CYCLES):
        server.freeze()
        try:
            # Producers keep committing while the broker hangs.
            await commit(outbox, stream, 10, committed)
            await wait_until(lambda: not table_relay.broker_ok, timeout=10)
            frozen_until = (table_relay.broker_down_since or time.time()) + 3 * PUBLISH_TIMEOUT
            await wait_until(lambda: time.time() >= frozen_until, timeout=10)  # noqa: B023
            await commit(outbox, stream, 10, committed)
        finally:
            server.thaw()
        resumed = time.monotonic()
        probe = await commit(outbox, stream, 1, committed)

        async def probe_published(message_id: str = probe[0]) -> bool:
            return message_id in await delivered()

        try:
            await wait_until(probe_published, timeout=RECOVERY_BOUND_SECONDS, interval=0.05)
        except TimeoutError:
            pytest.fail(f"cycle {cycle}: not recovered {RECOVERY_BOUND_SECONDS}s after resume")
        recoveries.append(time.monotonic() - resumed)
    await wait_drained(outbox, 30, lambda: f"after the cycles: {table_relay.last_error}")
    print(f"recovery after resume: max {max(recoveries):.2f}s, cycles {CYCLES}")
    after = await leaks()
    for name, before in baseline.items():
        assert after[name] <= before + 2, f"{name} grew across cycles: {before} -> {after[name]}"
    return committed


def task_count() -> int:
    return len(asyncio.all_tasks())


async def test_frozen_redis_ten_times(pg_url: str, private_redis: Server) -> None:
    import redis.asyncio as aioredis

    stream = unique("orders")
    broker = RedisStreamsBroker(private_redis.url, socket_timeout=1)
    outbox = Outbox(pg_url, brokers={"default": broker}, settings=OutboxSettings(**SETTINGS))
    await outbox.create_tables()
    admin = aioredis.Redis.from_url(private_redis.url, socket_timeout=2)

    async def delivered() -> list[str]:
        return await redis_ids(private_redis.url, stream)

    async def leaks() -> dict[str, int]:
        clients = await admin.client_list()
        return {"redis connections": len(clients) - 1, "asyncio tasks": task_count()}

    try:
        async with outbox.relaying():
            committed = await freeze_cycles(outbox, private_redis, stream, delivered, leaks)
        exactly_once(committed, await delivered())
    finally:
        await admin.aclose()
        await outbox.aclose()


@pytest.mark.nats
async def test_frozen_nats_ten_times(pg_url: str, private_nats: Server) -> None:
    stream = unique("orders")
    broker = NatsJetStreamBroker(
        private_nats.url, ack_timeout_seconds=PUBLISH_TIMEOUT * 2, connect_timeout_seconds=1
    )
    outbox = Outbox(pg_url, brokers={"default": broker}, settings=OutboxSettings(**SETTINGS))
    await outbox.create_tables()
    seen: set[str] = set()

    async def delivered() -> set[str]:
        # Read through a separate connection, only while the server answers.
        seen.update(await nats_ids(private_nats.url, stream))
        return seen

    async def leaks() -> dict[str, int]:
        return {
            "acks awaited": broker.acks_awaited,
            "ack subscription's queued replies": broker.ack_subscription.pending_msgs,
            "asyncio tasks": task_count(),
        }

    try:
        async with outbox.relaying():
            committed = await freeze_cycles(outbox, private_nats, stream, delivered, leaks)
        with anyio.fail_after(30):
            exactly_once(committed, await nats_ids(private_nats.url, stream))
    finally:
        await outbox.aclose()


async def redis_outbox(pg_url: str, server: Server) -> Outbox:
    """An outbox on the private Redis (socket timeout as in the freeze cycles), its tables
    created."""
    broker = RedisStreamsBroker(server.url, socket_timeout=PUBLISH_TIMEOUT)
    outbox = Outbox(pg_url, brokers={"default": broker}, settings=OutboxSettings(**SETTINGS))
    await outbox.create_tables()
    return outbox


async def test_frozen_redis_under_a_subscriber(pg_url: str, private_redis: Server) -> None:
    """The fetch loop's reader has no socket timeout of its own (see ``redis_consumer``):
    its reads are bounded by the consumer. Frozen while idle in a blocking read, the
    subscriber pauses, then handles what comes after the resume; its connections do not
    pile up."""
    import redis.asyncio as aioredis

    stream = unique("ticks")
    outbox = await redis_outbox(pg_url, private_redis)
    handled: list[str] = []

    @outbox.subscriber(stream, group="g", start="all")
    async def handle(message: Message) -> None:
        handled.append(str(message.payload["n"]))

    sub = outbox.subscribers[0]
    probe = aioredis.Redis.from_url(private_redis.url)

    async def send(n: int) -> None:
        await probe.xadd(stream, {"id": f"m-{n}", "type": "Tick", "payload": f'{{"n": {n}}}'})

    async def clients() -> int:
        return len(await probe.client_list())

    try:
        async with outbox.relaying():
            await send(0)
            await wait_until(lambda: handled == ["0"], timeout=10)
            before = await clients()
            for cycle in range(1, 4):
                private_redis.freeze()
                try:
                    # Idle: the reader waits in a blocking XREADGROUP (1 s) when it froze.
                    await wait_until(lambda: sub.broker_ok is False, timeout=10)
                finally:
                    private_redis.thaw()
                resumed = time.monotonic()
                await send(cycle)
                await wait_until(
                    lambda: str(cycle) in handled,  # noqa: B023
                    timeout=RECOVERY_BOUND_SECONDS + 5,
                )
                print(f"cycle {cycle}: handled {time.monotonic() - resumed:.2f}s after resume")
            assert handled == ["0", "1", "2", "3"]
            assert await clients() <= before + 2
    finally:
        await probe.aclose()
        await outbox.aclose()


async def redis_ready(url: str) -> bool:
    """Redis takes commands (not refusing, not still loading its AOF)."""
    import redis.asyncio as aioredis
    from redis.exceptions import BusyLoadingError, ConnectionError

    client = aioredis.Redis.from_url(url, socket_timeout=2)
    try:
        return bool(await client.ping())
    except (BusyLoadingError, ConnectionError, TimeoutError):
        return False
    finally:
        await client.aclose()


async def test_redis_killed_and_restarted_under_a_busy_subscriber(
    pg_url: str, private_redis: Server
) -> None:
    """Redis (AOF, fsync always) SIGKILLed twice and restarted while a subscriber works
    through a stream: the fetch loop's own connections and the acks waiting to ride with
    the next read come back with it; every message is handled, each once (the inbox skips
    what a lost ack brings again). Entries whose XREADGROUP reply or XACK was lost with the
    connection are taken back from the consumer's own pending entries at the next fetch,
    not left to XAUTOCLAIM after ``consumer_claim_idle_seconds`` (60 s)."""
    import redis.asyncio as aioredis

    stream = unique("ticks")
    # The default claim_idle_seconds (60): nothing here may wait for XAUTOCLAIM.
    outbox = await redis_outbox(pg_url, private_redis)
    handled: list[int] = []

    @outbox.subscriber(stream, group="g", start="all")
    async def handle(messages: list[Message]) -> None:
        handled.extend(int(m.payload["n"]) for m in messages)

    sub = outbox.subscribers[0]

    async def send(numbers: range) -> None:
        client = aioredis.Redis.from_url(private_redis.url)
        try:
            async with client.pipeline(transaction=False) as pipe:
                for n in numbers:
                    pipe.xadd(stream, {"id": f"m-{n}", "type": "Tick", "payload": f'{{"n": {n}}}'})
                await pipe.execute()
        finally:
            await client.aclose()

    try:
        async with outbox.relaying():
            total = 0
            for _ in range(2):
                await send(range(total, total + 2000))
                total += 2000
                # Killed with most of the 2,000 still to handle.
                await wait_until(lambda: len(set(handled)) >= total - 1900, timeout=15)  # noqa: B023
                before_kill = len(set(handled))
                private_redis.kill()
                private_redis.start()
                # The port answers before the AOF is loaded (BUSY LOADING): the test's own
                # producer waits for a Redis that takes commands.
                await wait_until(lambda: redis_ready(private_redis.url), timeout=30)
                print(f"killed with {total - before_kill} of {total} messages not yet handled")
            await send(range(total, total + 500))
            total += 500
            await wait_until(lambda: len(set(handled)) == total, timeout=30)
            assert sub.stats.dead_lettered == 0
        assert sorted(handled) == list(range(total))  # each once
    finally:
        await outbox.aclose()

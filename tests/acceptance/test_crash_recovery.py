"""Crash recovery with real processes: relays and brokers SIGKILLed mid-run.

Three ``fastapi-outbox dispatch --app tests.acceptance.crash_app:outbox`` subprocesses
relay messages that this process commits through ``outbox.unit_of_work()``. Whatever is
killed, once the outbox has no unfinished row every committed message id is in the
broker's stream exactly once: leases (``OUTBOX_LEASE_SECONDS=1..2``) hand a dead
relay's batch to another one, and the brokers' de-duplication by message id absorbs
the republish of messages that were published but not yet marked.

Every test is bounded (``fail_after``) well under a minute.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import anyio
import pytest

from fastapi_outbox import Outbox, OutboxSettings
from fastapi_outbox.brokers import MemoryBroker
from tests.acceptance.conftest import (
    Relays,
    Server,
    chaos_rng,
    dispatcher_env,
    exactly_once,
    nats_ids,
    new_table,
    produce,
    redis_ids,
    tail_of,
    wait_drained,
)
from tests.acceptance.crash_app import POISON_EXIT_CODE
from tests.conftest import unique, wait_until

pytestmark = pytest.mark.slow

#: Fast recovery for the tests: short leases, quick polls and retries.
FAST = {
    "lease_seconds": 1,
    "poll_interval_seconds": 0.1,
    "max_poll_interval_seconds": 0.5,
    "broker_backoff_max_seconds": 0.5,
    "retry_base_delay_seconds": 0.1,
    "retry_max_delay_seconds": 1,
    "publish_timeout_seconds": 0.6,
    "shutdown_timeout_seconds": 2,
    "batch_size": 50,
}


async def producing_outbox(url: str, table: str) -> Outbox:
    """This process only commits (API-only: no relay here)."""
    outbox = Outbox(
        url,
        brokers={"default": MemoryBroker()},
        settings=OutboxSettings(table_name=table, run_relays=False),
    )
    await outbox.create_tables()
    return outbox


async def test_relays_killed_repeatedly_lose_and_duplicate_nothing(
    server_db_url: str, redis_url: str, relays: Callable[..., Relays]
) -> None:
    # On PostgreSQL and on MariaDB: leases, SKIP LOCKED and fencing are each database's own.
    stream, table = unique("crash"), new_table()
    outbox = await producing_outbox(server_db_url, table)
    group = relays(3, dispatcher_env(server_db_url, redis_url, table, **FAST))
    rng = chaos_rng()
    try:
        with anyio.fail_after(55):
            group.start_all()
            group.wait_ready(1)
            stop = anyio.Event()

            async def chaos() -> None:
                # A random running relay is SIGKILLed every 0.3-0.5 s and restarted.
                while not stop.is_set():
                    with anyio.move_on_after(rng.uniform(0.3, 0.5)):
                        await stop.wait()
                    group.restart_exited()
                    ready = group.ready()
                    if ready and not stop.is_set():
                        victim = rng.choice(ready)
                        group.kill(victim)
                        group.start(victim)

            async with anyio.create_task_group() as tg:
                tg.start_soon(chaos)
                ids = await produce(outbox, stream, 3000, pause=0.01)
                await wait_until(lambda: group.kills >= 12, timeout=20)
                stop.set()
            group.restart_exited()
            await wait_drained(outbox, 25, tail_of(group))
        exactly_once(ids, await redis_ids(redis_url, stream))
        assert await outbox.store.messages.count("abandoned") == 0
        assert group.kills >= 12
    finally:
        await outbox.aclose()


@pytest.mark.parametrize("kind", ["redis", "nats"])
async def test_broker_killed_and_restarted_mid_run(
    kind: str,
    pg_url: str,
    request: pytest.FixtureRequest,
    relays: Callable[..., Relays],
) -> None:
    """A PRIVATE broker (Redis with AOF fsync always; NATS with a JetStream file store)
    is SIGKILLed twice while producers commit, and restarted on the same data."""
    server: Server = request.getfixturevalue(f"private_{kind}")
    stream, table = unique("crash"), new_table()
    outbox = await producing_outbox(pg_url, table)
    group = relays(3, dispatcher_env(pg_url, server.url, table, **{**FAST, "lease_seconds": 2}))
    try:
        with anyio.fail_after(55):
            group.start_all()
            group.wait_ready()

            async def published_at_least(n: int) -> bool:
                return await outbox.store.messages.count("published") >= n

            async def outages() -> None:
                for threshold in (300, 1200):
                    await wait_until(
                        lambda n=threshold: published_at_least(n),
                        timeout=20,
                    )
                    server.kill()
                    await anyio.sleep(0.5)  # the broker stays down a moment
                    server.start()

            async with anyio.create_task_group() as tg:
                tg.start_soon(outages)
                ids = await produce(outbox, stream, 2000, pause=0.01)
            await wait_drained(outbox, 30, tail_of(group))
            read = redis_ids if kind == "redis" else nats_ids
            delivered = await read(server.url, stream)
        exactly_once(ids, delivered)
        assert server.kills == 2
        assert await outbox.store.messages.count("abandoned") == 0
    finally:
        await outbox.aclose()


async def test_a_message_that_crashes_every_publish_is_abandoned_after_max_attempts(
    pg_url: str, redis_url: str, relays: Callable[..., Relays]
) -> None:
    """Attempts are counted at claim: the poison message kills the relay that
    publishes it, every time, yet it ends ``abandoned`` after ``max_attempts`` tries, and
    the messages that shared its batch are published (a row recovered from an expired
    lease is claimed on its own)."""
    max_attempts = 3
    stream, table = unique("crash"), new_table()
    outbox = await producing_outbox(pg_url, table)
    env = dispatcher_env(pg_url, redis_url, table, **FAST, max_attempts=max_attempts)
    env["CRASH_ON_POISON"] = "1"
    group = relays(3, env)
    try:
        with anyio.fail_after(55):
            group.start_all()
            group.wait_ready()
            ids = await produce(outbox, stream, 500, per_transaction=50, poison_at=222)
            stop = anyio.Event()

            async def keep_alive() -> None:
                while not stop.is_set():
                    group.restart_exited()
                    with anyio.move_on_after(0.1):
                        await stop.wait()

            async with anyio.create_task_group() as tg:
                tg.start_soon(keep_alive)
                await wait_drained(outbox, 40, tail_of(group))
                stop.set()
        rows = await outbox.store.messages.list_messages(limit=1000)
        abandoned = [r for r in rows if r["status"] == "abandoned"]
        assert len(abandoned) == 1, abandoned
        (dead,) = abandoned
        # Published (handed to the broker) max_attempts times, each a crash; the next
        # claim found it exhausted.
        assert dead["attempts"] == max_attempts + 1
        assert group.exit_codes.count(POISON_EXIT_CODE) == max_attempts
        assert "crash" in (dead["last_error"] or "")
        others = [str(r["id"]) for r in rows if r["status"] == "published"]
        assert len(others) == 499
        assert str(dead["id"]) not in others
        exactly_once(others, await redis_ids(redis_url, stream))
        assert sorted([*others, str(dead["id"])]) == sorted(ids)
        stored = await outbox.store.messages.get(dead["id"])
        assert stored is not None and json.loads(stored["payload"])["poison"] is True
    finally:
        await outbox.aclose()

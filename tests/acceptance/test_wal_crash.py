"""capture="wal" with real processes: relays SIGKILLed while producers commit.

``fastapi-outbox dispatch`` subprocesses with ``OUTBOX_CAPTURE=wal`` on the private
``wal_level=logical`` cluster: one holds the slot (advisory lock), the others stand by. The
slot is confirmed only after Redis acknowledged, so a relay killed between the publish and
the confirm makes the next reader publish again, and the Redis de-duplication by message
id absorbs it: every committed message is in the stream exactly once.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
import pytest

from fastapi_outbox import Outbox, OutboxSettings
from fastapi_outbox.brokers import MemoryBroker
from tests.acceptance.conftest import (
    Relays,
    chaos_rng,
    dispatcher_env,
    exactly_once,
    nats_ids,
    new_table,
    produce,
    redis_ids,
    tail_of,
)
from tests.conftest import unique, wait_until

pytestmark = pytest.mark.slow

ELECTED = b"wal relay elected"
FAST = {
    "capture": "wal",
    "lease_seconds": 1,
    "poll_interval_seconds": 0.1,
    "max_poll_interval_seconds": 0.5,
    "broker_backoff_max_seconds": 0.5,
    "publish_timeout_seconds": 0.6,
    "shutdown_timeout_seconds": 2,
    "wal_standby_poll_seconds": 0.1,
    "wal_batch_size": 300,
    "batch_size": 50,
}


async def producing_outbox(url: str, table: str) -> Outbox:
    """This process only commits; ``create_tables`` creates the table, the publication
    and the slot."""
    outbox = Outbox(
        url,
        brokers={"default": MemoryBroker()},
        settings=OutboxSettings(table_name=table, run_relays=False, capture="wal"),
    )
    await outbox.create_tables()
    return outbox


async def wait_delivered(
    url: str,
    stream: str,
    ids: list[str],
    describe: Callable[[], str],
    read: Callable[[str, str], Awaitable[list[str]]] = redis_ids,
) -> None:
    wanted = set(ids)

    async def delivered() -> set[str]:
        try:
            return set(await read(url, stream))
        except Exception:  # no stream yet
            return set()

    async def all_there() -> bool:
        return wanted <= await delivered()

    try:
        await wait_until(all_there, timeout=30, interval=0.2)
    except TimeoutError:
        missing = len(wanted - await delivered())
        pytest.fail(f"{missing} committed messages not delivered\n{describe()}")


def leaders(group: Relays) -> list[int]:
    """Running relays whose newest log says they were elected."""
    out = []
    for index, proc in enumerate(group.procs):
        log = group.logs[index]
        running = proc is not None and proc.poll() is None
        if running and log is not None and ELECTED in log.read_bytes():
            out.append(index)
    return out


@pytest.mark.parametrize("kind", ["redis", "nats"])
async def test_relays_killed_repeatedly_lose_and_duplicate_nothing(
    kind: str,
    wal_pg_url: str,
    request: pytest.FixtureRequest,
    relays: Callable[..., Relays],
) -> None:
    broker_url: str = request.getfixturevalue(f"{kind}_url")
    read = redis_ids if kind == "redis" else nats_ids
    stream, table = unique("walcrash"), new_table()
    outbox = await producing_outbox(wal_pg_url, table)
    group = relays(2, dispatcher_env(wal_pg_url, broker_url, table, **FAST))
    rng = chaos_rng()
    try:
        with anyio.fail_after(75):
            group.start_all()
            group.wait_ready(1)
            stop = anyio.Event()

            async def chaos() -> None:
                # Every 0.3-0.6 s the relay holding the slot (or, when none holds it yet,
                # any running relay) is SIGKILLed and started again.
                while not stop.is_set():
                    with anyio.move_on_after(rng.uniform(0.3, 0.6)):
                        await stop.wait()
                    group.restart_exited()
                    victims = leaders(group) or group.ready()
                    if victims and not stop.is_set():
                        victim = rng.choice(victims)
                        group.kill(victim)
                        group.start(victim)

            async with anyio.create_task_group() as tg:
                tg.start_soon(chaos)
                ids = await produce(outbox, stream, 3000, pause=0.01)
                await wait_until(lambda: group.kills >= 10, timeout=25)
                stop.set()
            group.restart_exited()
            await wait_delivered(broker_url, stream, ids, tail_of(group), read)
        delivered = await read(broker_url, stream)
        exactly_once(ids, delivered)
        assert group.kills >= 10
        # Nothing went through the table.
        assert await outbox.store.messages.count() == 0
    finally:
        await outbox.aclose()


async def test_a_standby_takes_over_when_the_reader_dies(
    wal_pg_url: str, redis_url: str, relays: Callable[..., Relays]
) -> None:
    stream, table = unique("walfailover"), new_table()
    outbox = await producing_outbox(wal_pg_url, table)
    group = relays(2, dispatcher_env(wal_pg_url, redis_url, table, **FAST))
    try:
        with anyio.fail_after(50):
            group.start_all()
            group.wait_ready()
            await wait_until(lambda: len(leaders(group)) == 1, timeout=10)
            # One reader at a time: the other stays a standby.
            (first,) = leaders(group)
            before = await produce(outbox, stream, 100)
            await wait_delivered(redis_url, stream, before, tail_of(group))
            assert leaders(group) == [first]
            group.kill(first)
            await wait_until(lambda: leaders(group) == [1 - first], timeout=10)
            after = await produce(outbox, stream, 100)
            await wait_delivered(redis_url, stream, before + after, tail_of(group))
        exactly_once(before + after, await redis_ids(redis_url, stream))
    finally:
        await outbox.aclose()

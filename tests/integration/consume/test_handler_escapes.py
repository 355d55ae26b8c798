"""Handlers that cancel or escape: a failure of their message, never a dead worker or process.

A handler raising ``asyncio.CancelledError`` that is not the subscriber's own stop (a task it
awaited was cancelled), or a ``BaseException`` subclass of its own, fails its message: it is
retried, then dead-lettered, while every other message is handled and the relays go on.
``KeyboardInterrupt`` still stops the process, its in-flight messages released. A handler
task that fails anyway, outside any handler, is logged, replaced and shown by health.
On PostgreSQL with Redis Streams and with the memory broker.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest

from fastapi_outbox import Event, Outbox, OutboxSettings, UnitOfWork
from fastapi_outbox.brokers import MemoryBroker
from fastapi_outbox.ops import health
from tests.conftest import unique, wait_until

pytestmark = pytest.mark.usefixtures("quick_fetch")

COUNT = 10


class Job(Event, stream="escapes_jobs"):
    n: int


class Later(Event, stream="escapes_later"):
    n: int


class Fatal(BaseException):
    """A BaseException of the application's own (as some SDKs define)."""


def settings() -> OutboxSettings:
    return OutboxSettings(
        poll_interval_seconds=0.05,
        consumer_retry_base_delay_seconds=0.02,
        consumer_retry_max_delay_seconds=0.1,
        consumer_claim_idle_seconds=1.0,
        shutdown_timeout_seconds=2.0,
        health_cache_seconds=0,
    )


@contextlib.asynccontextmanager
async def make_outbox(kind: str, request: pytest.FixtureRequest) -> AsyncIterator[Outbox]:
    pg_url = str(request.getfixturevalue("pg_url"))
    if kind == "memory":
        outbox = Outbox(pg_url, brokers={"default": MemoryBroker()}, settings=settings())
        await outbox.create_tables()
        try:
            yield outbox
        finally:
            await outbox.aclose()
        return
    import redis.asyncio as aioredis

    from fastapi_outbox.brokers import RedisStreamsBroker

    redis_url = str(request.getfixturevalue("redis_url"))
    outbox = Outbox(pg_url, brokers={"default": RedisStreamsBroker(redis_url)}, settings=settings())
    await outbox.create_tables()
    try:
        yield outbox
    finally:
        await outbox.aclose()
        client = aioredis.Redis.from_url(redis_url)
        keys = [k async for k in client.scan_iter(match="escapes_*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()


async def publish_jobs(outbox: Outbox, count: int = COUNT) -> None:
    async with outbox.unit_of_work() as uow:
        for n in range(count):
            uow.publish(Job(n=n))


@pytest.fixture(params=["memory", "redis"])
def kind(request: pytest.FixtureRequest) -> str:
    if request.param == "redis":
        request.applymarker(pytest.mark.redis)
    return str(request.param)


@pytest.mark.postgres(
    reason="handler escapes are the subscriber's, not the database's: one server suffices"
)
@pytest.mark.parametrize("batch", [True, False], ids=["batch", "one_by_one"])
async def test_a_foreign_cancellation_is_a_failure_retried(
    kind: str, batch: bool, request: pytest.FixtureRequest
) -> None:
    """Each handler awaits a task that gets cancelled on its first call (a timeout of a
    client library, a task cancelled elsewhere): the CancelledError is a failure, retried;
    all ten messages are handled, no worker dies silently."""
    calls: collections.Counter[int] = collections.Counter()
    async with make_outbox(kind, request) as outbox:
        group = unique("g")

        @outbox.subscriber(Job.__outbox_stream__, group=group, start="all", batch=batch)
        async def handle(job: Job, uow: UnitOfWork) -> None:
            calls[job.n] += 1
            if calls[job.n] == 1:
                call = asyncio.get_running_loop().create_task(asyncio.sleep(10))
                call.cancel()
                await call  # raises CancelledError in the handler's task
            uow.publish(Later(n=job.n))

        sub = outbox.subscribers[0]
        async with outbox.relaying():
            await publish_jobs(outbox)
            await wait_until(lambda: sub.stats.handled == COUNT, timeout=20)
            assert sub.running
        assert sub.stats.dead_lettered == 0
        assert sub.stats.failures >= 1
        assert "CancelledError" in (sub.stats.last_error or "")
        group_stats = (await outbox.inbox.group_stats([group]))[group]
        assert group_stats.handled == COUNT
        assert sorted(calls) == list(range(COUNT))


@pytest.mark.postgres(
    reason="handler escapes are the subscriber's, not the database's: one server suffices"
)
async def test_a_base_exception_dead_letters_its_message_and_the_rest_goes_on(
    kind: str, request: pytest.FixtureRequest
) -> None:
    """Message 3's handler always raises a BaseException subclass: it is tried max_attempts
    times and dead-lettered naming the handler; the other nine are handled; the process
    (relays, subscriber) goes on: an event committed afterwards is still relayed and
    handled."""
    async with make_outbox(kind, request) as outbox:
        group = unique("g")
        tries: collections.Counter[int] = collections.Counter()

        @outbox.subscriber(
            Job.__outbox_stream__, group=group, start="all", max_attempts=3, batch=False
        )
        async def handle(job: Job, uow: UnitOfWork) -> None:
            tries[job.n] += 1
            if job.n == 3:
                raise Fatal("the SDK gave up")

        sub = outbox.subscribers[0]
        async with outbox.relaying():
            await publish_jobs(outbox)
            await wait_until(
                lambda: sub.stats.handled == COUNT - 1 and sub.stats.dead_lettered == 1,
                timeout=20,
            )
            async with outbox.unit_of_work() as uow:
                uow.publish(Job(n=100))
            await wait_until(lambda: sub.stats.handled == COUNT, timeout=10)
            assert sub.running and all(p.running for p in outbox.relays.tables.values())
            assert sub.consumer is not None
            letters = await sub.consumer.dead_letters()
        assert tries[3] == 3
        assert len(letters) == 1
        assert "Fatal" in letters[0].error and sub.name in letters[0].error


#: The process of the KeyboardInterrupt test: five messages in five handlers, the fourth
#: raises KeyboardInterrupt once all five are in.
INTERRUPTED_APP = """
import asyncio, logging, sys
from fastapi_outbox import Event, Outbox, OutboxSettings, UnitOfWork
from fastapi_outbox.brokers import RedisStreamsBroker


class Job(Event, stream=sys.argv[3]):
    n: int


async def main():
    logging.basicConfig(level=logging.INFO)
    outbox = Outbox(sys.argv[1], brokers={"default": RedisStreamsBroker(sys.argv[2])},
                    settings=OutboxSettings(poll_interval_seconds=0.05))
    await outbox.create_tables()
    entered = set()

    @outbox.subscriber(sys.argv[3], group=sys.argv[4], start="all", batch=False)
    async def handle(job: Job, uow: UnitOfWork) -> None:
        entered.add(job.n)
        while len(entered) < 5:
            await asyncio.sleep(0.01)
        if job.n == 3:
            raise KeyboardInterrupt
        await asyncio.Event().wait()

    async with outbox.relaying():
        async with outbox.unit_of_work() as uow:
            for n in range(5):
                uow.publish(Job(n=n))
        await asyncio.Event().wait()


asyncio.run(main())
"""


@pytest.mark.postgres(
    reason="handler escapes are the subscriber's, not the database's: one server suffices"
)
@pytest.mark.redis
async def test_keyboard_interrupt_stops_the_process_releasing_in_flight(
    request: pytest.FixtureRequest, tmp_path: Any
) -> None:
    """A handler raising KeyboardInterrupt still stops its process (a subprocess: asyncio
    lets it out of the event loop); its in-flight messages are released, so another
    consumer of the group handles all five at once, not after claim_idle_seconds (60 s),
    and none is dead-lettered."""
    pg_url = str(request.getfixturevalue("pg_url"))
    redis_url = str(request.getfixturevalue("redis_url"))
    stream, group = unique("escapes_ki"), unique("g")
    script = tmp_path / "interrupted.py"
    script.write_text(INTERRUPTED_APP)
    process = await asyncio.create_subprocess_exec(
        sys.executable, str(script), pg_url, redis_url, stream, group,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, stderr = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode != 0
    assert b"KeyboardInterrupt" in stderr
    assert b"released unfinished messages" in stderr, stderr.decode()[-2000:]

    class _StreamJob(Job, stream=stream, type_name="Job"):
        """The subprocess's Job, on this test's stream (the handler is typed ``Job``)."""

    from fastapi_outbox.brokers import RedisStreamsBroker

    # claim_idle_seconds left at its default (60 s): only released entries come back at once.
    outbox = Outbox(
        pg_url,
        brokers={"default": RedisStreamsBroker(redis_url)},
        settings=OutboxSettings(poll_interval_seconds=0.05, shutdown_timeout_seconds=2.0),
    )
    handled: set[int] = set()

    @outbox.subscriber(stream, group=group, start="all", batch=False)
    async def handle(job: Job, uow: UnitOfWork) -> None:
        handled.add(job.n)

    sub = outbox.subscribers[0]
    try:
        async with outbox.relaying():
            await wait_until(lambda: len(handled) == 5, timeout=15)
        assert sub.stats.dead_lettered == 0
    finally:
        await outbox.aclose()
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(redis_url)
        keys = [k async for k in client.scan_iter(match=f"{stream}*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()


class DyingAck(MemoryBroker):
    """A broker plug-in with a bug: its consumer's first ack raises a BaseException."""

    def consumer(self, config: Any) -> Any:
        inner = super().consumer(config)
        failed = False

        class Consumer:
            def __getattr__(self, name: str) -> Any:
                return getattr(inner, name)

            async def ack(self, deliveries: Any) -> None:
                nonlocal failed
                if not failed:
                    failed = True
                    raise Fatal("plug-in bug")
                await inner.ack(deliveries)

        return Consumer()


@pytest.mark.postgres(
    reason="handler escapes are the subscriber's, not the database's: one server suffices"
)
async def test_a_dying_worker_is_logged_replaced_and_shown_by_health(
    request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture
) -> None:
    pg_url = str(request.getfixturevalue("pg_url"))
    outbox = Outbox(pg_url, brokers={"default": DyingAck()}, settings=settings())
    await outbox.create_tables()
    group = unique("g")
    handled: collections.Counter[int] = collections.Counter()

    @outbox.subscriber(Job.__outbox_stream__, group=group, start="all", batch=False, concurrency=1)
    async def handle(job: Job, uow: UnitOfWork) -> None:
        handled[job.n] += 1

    sub = outbox.subscribers[0]
    try:
        with caplog.at_level(logging.ERROR, "fastapi_outbox.consume"):
            async with outbox.relaying():
                await publish_jobs(outbox)
                # One worker (concurrency=1): it must survive the failure to handle the rest.
                group_of = outbox.inbox.group_stats

                async def all_in_inbox() -> bool:
                    stats = (await group_of([group])).get(group)
                    return stats is not None and stats.handled == COUNT

                await wait_until(all_in_inbox, timeout=20)
                await wait_until(lambda: sub.stats.handled + sub.stats.duplicates >= COUNT + 1)
                report = await health.compute_health(outbox)
        assert sub.stats.workers_replaced == 1
        assert sub.stats.dead_lettered == 0
        assert set(handled) == set(range(COUNT))
        records = [
            r for r in caplog.records if getattr(r, "action", "") == "consumer.worker_replaced"
        ]
        assert len(records) == 1 and "Fatal" in records[0].error  # type: ignore[attr-defined]
        consumer = next(c for c in report.consumers if c.group == group)
        assert consumer.workers_replaced == 1
        assert report.status == "degraded"
        assert any("replaced" in reason for reason in report.reasons), report.reasons
    finally:
        await outbox.aclose()

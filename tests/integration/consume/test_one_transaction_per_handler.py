"""One transaction per handler, defended: a second task never joins it.

A handler's transaction is one session on the subscriber's connection. Two tasks sharing it
(``asyncio.gather`` of two ``outbox.unit_of_work()`` blocks in a handler) interleave their
statements on one connection; a task the handler started that outlives it would write
after the message's inbox row committed, on its own. Both are refused with an error that
names the handler: the message fails (retried, then dead-lettered) and nothing of it
commits. Awaited one after the other in the handler's task, the same blocks work. On
PostgreSQL with the memory broker and with Redis Streams.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator

import pytest
from sqlalchemy import Integer, String, select
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from fastapi_outbox import Event, Outbox, OutboxSettings, UnitOfWork
from fastapi_outbox.brokers import MemoryBroker
from fastapi_outbox.exceptions import UnitOfWorkError
from tests.conftest import unique, wait_until

pytestmark = [
    pytest.mark.usefixtures("quick_fetch"),
    pytest.mark.postgres(
        reason=(
            "one session per handler is the subscriber's rule, not the database's: "
            "one server suffices"
        )
    ),
]

COUNT = 4


class Base(DeclarativeBase):
    pass


class Line(Base):
    __tablename__ = "one_tx_lines"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    n: Mapped[int] = mapped_column(Integer)
    label: Mapped[str] = mapped_column(String(20))


class Job(Event, stream="one_tx_jobs"):
    n: int


@contextlib.asynccontextmanager
async def make_outbox(kind: str, request: pytest.FixtureRequest) -> AsyncIterator[Outbox]:
    pg_url = str(request.getfixturevalue("pg_url"))
    settings = OutboxSettings(
        poll_interval_seconds=0.05,
        consumer_retry_base_delay_seconds=0.02,
        consumer_retry_max_delay_seconds=0.1,
        shutdown_timeout_seconds=2.0,
    )
    redis_url = None
    if kind == "memory":
        broker = MemoryBroker()
    else:
        from fastapi_outbox.brokers import RedisStreamsBroker

        redis_url = str(request.getfixturevalue("redis_url"))
        broker = RedisStreamsBroker(redis_url)
    outbox = Outbox(pg_url, brokers={"default": broker}, settings=settings)
    await outbox.create_tables()
    async with outbox.engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    try:
        yield outbox
    finally:
        await outbox.aclose()
        if redis_url is not None:
            import redis.asyncio as aioredis

            client = aioredis.Redis.from_url(redis_url)
            keys = [k async for k in client.scan_iter(match="one_tx_*")]
            if keys:
                await client.delete(*keys)
            await client.aclose()


@pytest.fixture(params=["memory", "redis"])
def kind(request: pytest.FixtureRequest) -> str:
    if request.param == "redis":
        request.applymarker(pytest.mark.redis)
    return str(request.param)


async def lines(outbox: Outbox) -> collections.Counter[tuple[int, str]]:
    async with outbox.engine.connect() as conn:
        return collections.Counter((await conn.execute(select(Line.n, Line.label))).all())


async def write(outbox: Outbox, n: int, label: str) -> None:
    async with outbox.unit_of_work() as uow:
        uow.session.add(Line(n=n, label=label))
        await uow.session.flush()
        await asyncio.sleep(0)  # lets the other task in, as real I/O would


async def run_jobs(outbox: Outbox) -> None:
    async with outbox.unit_of_work() as uow:
        for n in range(COUNT):
            uow.publish(Job(n=n))


async def test_gather_of_two_units_of_work_in_a_handler_is_refused(
    kind: str, request: pytest.FixtureRequest
) -> None:
    async with make_outbox(kind, request) as outbox:

        @outbox.subscriber(
            Job.__outbox_stream__, group=unique("g"), start="all", max_attempts=2, batch=False
        )
        async def handle(job: Job, uow: UnitOfWork) -> None:
            await asyncio.gather(write(outbox, job.n, "a"), write(outbox, job.n, "b"))

        sub = outbox.subscribers[0]
        async with outbox.relaying():
            await run_jobs(outbox)
            await wait_until(lambda: sub.stats.dead_lettered == COUNT, timeout=20)
            assert sub.consumer is not None
            letters = await sub.consumer.dead_letters()
        assert sub.stats.handled == 0
        assert await lines(outbox) == collections.Counter()  # nothing of it committed
        for letter in letters:
            assert sub.name in letter.error and "second task" in letter.error, letter.error


async def test_units_of_work_one_after_the_other_in_the_handler_work(
    kind: str, request: pytest.FixtureRequest
) -> None:
    async with make_outbox(kind, request) as outbox:

        @outbox.subscriber(Job.__outbox_stream__, group=unique("g"), start="all")
        async def handle(job: Job, uow: UnitOfWork) -> None:
            await write(outbox, job.n, "a")
            await write(outbox, job.n, "b")

        sub = outbox.subscribers[0]
        async with outbox.relaying():
            await run_jobs(outbox)
            await wait_until(lambda: sub.stats.handled == COUNT, timeout=20)
        want = {(n, label) for n in range(COUNT) for label in "ab"}
        assert await lines(outbox) == collections.Counter(want)


async def test_a_task_that_outlives_its_handler_cannot_join_it(
    kind: str, request: pytest.FixtureRequest
) -> None:
    """The handler starts a task and returns; the task then opens ``outbox.unit_of_work()``:
    refused, naming the handler, nothing written — never a write of its own, after the
    message's inbox row committed."""
    async with make_outbox(kind, request) as outbox:
        errors: list[BaseException] = []
        go_on = asyncio.Event()
        tasks: list[asyncio.Task[None]] = []

        async def later(n: int) -> None:
            await go_on.wait()
            try:
                await write(outbox, n, "late")
            except UnitOfWorkError as exc:
                errors.append(exc)

        @outbox.subscriber(Job.__outbox_stream__, group=unique("g"), start="all")
        async def handle(job: Job, uow: UnitOfWork) -> None:
            await write(outbox, job.n, "a")
            tasks.append(asyncio.get_running_loop().create_task(later(job.n)))

        sub = outbox.subscribers[0]
        async with outbox.relaying():
            await run_jobs(outbox)
            await wait_until(lambda: sub.stats.handled == COUNT, timeout=20)
            go_on.set()
            await asyncio.gather(*tasks)
        assert len(errors) == COUNT
        for error in errors:
            assert sub.name in str(error) and "outlived" in str(error), error
        assert await lines(outbox) == collections.Counter({(n, "a"): 1 for n in range(COUNT)})

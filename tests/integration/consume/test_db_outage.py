"""Database outage versus failure for subscribers: a database that refuses
connections makes every message wait in place with no attempt charged; a handler's own SQL
error is a failure, dead-lettered after its attempts — on SQLite too; a shutdown during an
outage gives the messages back to the broker, uncharged.

The classifier itself is unit-tested in ``tests/unit/test_db_outage.py``; the PostgreSQL
restart under a backlog is in ``tests/acceptance/test_db_restart.py``."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import pytest
from sqlalchemy import text

from fastapi_outbox import Message, Outbox, OutboxSettings, UnitOfWork, uuid7
from fastapi_outbox.brokers import MemoryBroker, RedisStreamsBroker
from fastapi_outbox.events import Envelope
from tests.conftest import unique, wait_until
from tests.servers import StartingUpProxy

SETTINGS = {
    "consumer_claim_idle_seconds": 5.0,
    "consumer_retry_base_delay_seconds": 0.02,
    "consumer_retry_max_delay_seconds": 0.1,
    "shutdown_timeout_seconds": 3.0,
}
#: Messages of the backlog; those from GATE on wait inside their transaction until the
#: outage has begun, so the outage hits a flow in progress.
BACKLOG, GATE = 200, 50


class DbWaits(logging.Handler):
    """Counts the subscribers' "database unreachable, retrying in place" records."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        #: The errors waited out (their repr, cut short).
        self.errors: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "action", None) == "consumer.db_unavailable":
            self.count += 1
            self.errors.add(str(getattr(record, "error", ""))[:90])


async def publish_raw(broker: Any, stream: str, numbers: range) -> None:
    envelopes = []
    for n in numbers:
        mid = str(uuid7())
        headers = {"message-id": mid, "type": "Numbered"}
        envelopes.append(Envelope(mid, stream, "Numbered", None, b'{"n": %d}' % n, headers))
    for start in range(0, len(envelopes), 100):
        await broker.publish(envelopes[start : start + 100])


async def backlog_through_an_outage(
    url: str, redis_url: str, outage: Callable[[], Awaitable[None]], *, pace: float = 0.0
) -> dict[str, Any]:
    """A backlog of BACKLOG messages on a Redis stream for a subscriber with
    ``max_attempts=1`` (an attempt charged is a message dead-lettered) whose handler writes
    one row per message to the outbox's database through ``url`` (after a server-side
    ``pg_sleep(pace)``, to spread the flow over the outage); ``outage()`` is awaited once
    the handlers of messages from GATE on wait inside their transaction (it must start the
    outage and may return before it ends), then they go on. Returns the figures once every
    message is handled."""
    broker = RedisStreamsBroker(redis_url)
    outbox = Outbox(
        url,
        brokers={"default": broker},
        settings=OutboxSettings(**{**SETTINGS, "consumer_max_attempts": 1}),
    )
    stream = unique("backlog")
    gate = anyio.Event()
    waiting = 0

    @outbox.subscriber(stream, group="effects", start="all", concurrency=4, batch_size=10)
    async def effect(message: Message, uow: UnitOfWork) -> None:
        nonlocal waiting
        n = message.payload["n"]
        if n >= GATE and not gate.is_set():
            waiting += 1
            await gate.wait()
        if pace:
            await uow.session.execute(text("SELECT pg_sleep(:s)"), {"s": pace})
        await uow.session.execute(text("INSERT INTO effects (n) VALUES (:n)"), {"n": n})

    sub = outbox.subscribers[0]
    waits = DbWaits()
    logging.getLogger("fastapi_outbox.consume").addHandler(waits)
    try:
        await outbox.create_tables()
        async with outbox.engine.begin() as conn:
            await conn.exec_driver_sql("CREATE TABLE effects (n INTEGER NOT NULL)")
        await publish_raw(broker, stream, range(BACKLOG))
        async with outbox.relaying():
            await wait_until(lambda: waiting > 0 and sub.stats.handled >= 1, timeout=30)
            await outage()
            gate.set()
            # Every message settled: handled, or found handled already (a commit whose
            # answer the outage cut: retried in place, the inbox says it is done).
            await wait_until(
                lambda: sub.stats.handled + sub.stats.duplicates == BACKLOG, timeout=90
            )
        async with outbox.engine.connect() as conn:
            rows, distinct = (
                await conn.execute(text("SELECT count(*), count(DISTINCT n) FROM effects"))
            ).one()
        consumer = sub.make_consumer()
        try:
            dead = await consumer.count_dead_letters()
        finally:
            await consumer.aclose()
        return {
            "rows": rows,
            "distinct": distinct,
            "handled": sub.stats.handled,
            "duplicates": sub.stats.duplicates,
            "dead_lettered": sub.stats.dead_lettered,
            "dead_letters": dead,
            "waits": waits.count,
            "errors": sorted(waits.errors),
        }
    finally:
        logging.getLogger("fastapi_outbox.consume").removeHandler(waits)
        await outbox.aclose()


@pytest.mark.postgres(reason="a private PostgreSQL proxied to answer 'starting up' (57P03)")
@pytest.mark.redis
async def test_a_database_starting_up_for_10s_makes_a_backlog_wait_in_place(
    pg_url: str, redis_url: str
) -> None:
    """A proxy answers every new connection FATAL 57P03 "the database system is starting
    up" for 10 s (its open connections cut) while a backlog of 200 flows with
    ``max_attempts=1``: every message handled once, none dead-lettered."""
    proxy = StartingUpProxy(5432)
    await proxy.start()

    async def starting_up() -> None:
        proxy.starting_up(10.0)

    try:
        url = pg_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
        figures = await backlog_through_an_outage(url, redis_url, starting_up)
    finally:
        await proxy.stop()
    print(f"57P03 for 10 s under a backlog: {figures}, refused {proxy.refused} connections")
    assert proxy.refused > 0
    assert figures["waits"] > 0
    # Effects once each: a batch whose commit went through but whose answer was cut is
    # found in the inbox at its retry (counted a duplicate), never written twice.
    assert figures["rows"] == figures["distinct"] == BACKLOG
    assert figures["handled"] + figures["duplicates"] == BACKLOG
    assert figures["dead_lettered"] == figures["dead_letters"] == 0


@pytest.mark.parametrize("batch_handler", [False, True], ids=["per-message", "batch-handler"])
async def test_a_handlers_own_sql_error_on_sqlite_is_dead_lettered(
    sqlite_url: str, batch_handler: bool
) -> None:
    """``no such table`` is SQLite's ``OperationalError`` but the handler's own failure:
    retried, then dead-lettered after ``max_attempts`` — not waited on forever — while
    the other messages go on."""
    broker = MemoryBroker()
    outbox = Outbox(
        sqlite_url,
        brokers={"default": broker},
        settings=OutboxSettings(**{**SETTINGS, "consumer_max_attempts": 3}),
    )
    await outbox.create_tables()
    calls: list[int] = []
    stream = unique("lite")

    async def write(numbers: list[int], uow: UnitOfWork) -> None:
        calls.extend(numbers)
        table = "missing_table" if 7 in numbers else "effects"
        await uow.session.execute(text(f"INSERT INTO {table} (n) VALUES (1)"))

    async with outbox.engine.begin() as conn:
        await conn.exec_driver_sql("CREATE TABLE effects (n INTEGER)")
    if batch_handler:

        @outbox.subscriber(stream, group="lite", start="all")
        async def many(messages: list[Message], uow: UnitOfWork) -> None:
            await write([m.payload["n"] for m in messages], uow)
    else:

        @outbox.subscriber(stream, group="lite", start="all")
        async def one(message: Message, uow: UnitOfWork) -> None:
            await write([message.payload["n"]], uow)

    sub = outbox.subscribers[0]
    await publish_raw(broker, stream, range(10))
    async with outbox.relaying():
        await wait_until(lambda: sub.stats.dead_lettered == 1, timeout=20)
        await wait_until(lambda: sub.stats.handled == 9, timeout=10)
        [letter] = await sub.make_consumer().dead_letters()
    assert "no such table" in letter.error and letter.attempts == 3
    assert "database unreachable" not in (sub.stats.last_error or "")
    await outbox.aclose()


@pytest.fixture
async def starting_up_proxy() -> AsyncIterator[StartingUpProxy]:
    proxy = StartingUpProxy(5432)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.stop()


@pytest.mark.postgres(reason="a private PostgreSQL proxied to cut connections mid-flow")
@pytest.mark.parametrize(
    ("broker_name", "batch_handler"),
    [
        pytest.param("redis", False, id="redis-per-message", marks=pytest.mark.redis),
        pytest.param("redis", True, id="redis-batch-handler", marks=pytest.mark.redis),
        pytest.param("memory", False, id="memory-per-message"),
    ],
)
async def test_a_shutdown_during_an_outage_releases_the_message_uncharged(
    request: pytest.FixtureRequest,
    pg_url: str,
    starting_up_proxy: StartingUpProxy,
    broker_name: str,
    batch_handler: bool,
) -> None:
    """``max_attempts=1``: the messages wait in place while the database starts up; the app
    stops meanwhile: not charged, not dead-lettered, given back to the broker with their
    delivery count as before (a charge would dead-letter them at the next start, as a
    delivery past ``max_attempts``); the next start, with the database back, handles them."""
    proxy = starting_up_proxy
    redis_url = str(request.getfixturevalue("redis_url")) if broker_name == "redis" else ""
    broker: Any = RedisStreamsBroker(redis_url) if broker_name == "redis" else MemoryBroker()
    outbox = Outbox(
        pg_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}"),
        brokers={"default": broker},
        settings=OutboxSettings(**{**SETTINGS, "consumer_max_attempts": 1}),
    )
    stream = unique("stop")
    handled: list[int] = []
    if batch_handler:

        @outbox.subscriber(stream, group="g", start="all")
        async def many(messages: list[Message], uow: UnitOfWork) -> None:
            handled.extend(m.payload["n"] for m in messages)
    else:

        @outbox.subscriber(stream, group="g", start="all")
        async def one(message: Message, uow: UnitOfWork) -> None:
            handled.append(message.payload["n"])

    sub = outbox.subscribers[0]
    try:
        await outbox.create_tables()
        await publish_raw(broker, stream, range(2))
        proxy.starting_up(600.0)
        async with outbox.relaying():
            await wait_until(
                lambda: "database unreachable" in (sub.stats.last_error or ""), timeout=15
            )
        assert handled == [] and sub.stats.dead_lettered == 0
        if broker_name == "redis":
            import redis.asyncio as aioredis

            async with aioredis.Redis.from_url(redis_url) as client:
                assert (await client.xpending(stream, "g"))["pending"] == 2
                detail = await client.xpending_range(stream, "g", "-", "+", 10)
                assert [d["times_delivered"] for d in detail] == [0, 0]  # as before
        proxy.starting_up(0.0)  # the database is back
        async with outbox.relaying():
            await wait_until(lambda: sorted(handled) == [0, 1], timeout=20)
        assert sub.stats.dead_lettered == 0
        consumer = sub.make_consumer()
        try:
            assert await consumer.count_dead_letters() == 0
        finally:
            await consumer.aclose()
    finally:
        await outbox.aclose()
        if broker_name == "redis":
            import redis.asyncio as aioredis

            async with aioredis.Redis.from_url(redis_url) as client:
                await client.delete(stream, f"{stream}.g.dlq")


@pytest.mark.postgres(reason="a private PostgreSQL proxied to answer 'starting up' (57P03)")
async def test_the_relay_tells_an_unavailable_database_from_a_failing_statement(
    pg_url: str, starting_up_proxy: StartingUpProxy
) -> None:
    """The table relay's claim through a database starting up: ``database_ok`` false
    (unavailable); once it is back, the outbox table dropped under it: the database
    answers, the claim's own statement fails — ``database_ok`` stays true and the error
    says so (a missing table, with its fix); both back off and recover."""
    proxy = starting_up_proxy
    outbox = Outbox(
        pg_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}"),
        brokers={"default": MemoryBroker()},
        settings=OutboxSettings(poll_interval_seconds=0.05),
    )
    try:
        await outbox.create_tables()
        async with outbox.relaying():
            table_relay = outbox.relays.tables["default"]
            proxy.starting_up(600.0)
            await wait_until(lambda: not table_relay.database_ok, timeout=15)
            assert "database unavailable" in (table_relay.last_error or "")
            proxy.starting_up(0.0)
            await wait_until(lambda: table_relay.database_ok, timeout=15)
            async with outbox.engine.begin() as conn:
                await conn.exec_driver_sql(f"ALTER TABLE {outbox.table.name} RENAME TO gone")
            # The database answers; the claim's own table is gone: named, with its fix.
            await wait_until(lambda: "table missing" in (table_relay.last_error or ""), timeout=15)
            assert table_relay.database_ok
            assert "db create" in (table_relay.last_error or "")
            async with outbox.engine.begin() as conn:
                await conn.exec_driver_sql(f"ALTER TABLE gone RENAME TO {outbox.table.name}")
            async with outbox.unit_of_work() as uow:
                uow.publish(Message(stream="s", type="T", payload={}))
            await wait_until(lambda: outbox.store.messages.count("published"), timeout=15)
    finally:
        await outbox.aclose()


@pytest.mark.postgres(reason="a private PostgreSQL proxied to answer 'too many clients' (53300)")
async def test_too_many_clients_is_waited_out(
    pg_url: str, starting_up_proxy: StartingUpProxy
) -> None:
    """53300 "sorry, too many clients already" at connect for every connection: the
    messages wait in place (``max_attempts=1``: a charge would dead-letter them)."""
    proxy = starting_up_proxy
    broker = MemoryBroker()
    outbox = Outbox(
        pg_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}"),
        brokers={"default": broker},
        settings=OutboxSettings(**{**SETTINGS, "consumer_max_attempts": 1}),
    )
    stream = unique("clients")
    handled: list[int] = []

    @outbox.subscriber(stream, group="g", start="all")
    async def one(message: Message, uow: UnitOfWork) -> None:
        handled.append(message.payload["n"])

    sub = outbox.subscribers[0]
    try:
        await outbox.create_tables()
        async with outbox.relaying():
            proxy.refuse(600.0, "53300", "sorry, too many clients already")
            await publish_raw(broker, stream, range(20))
            await wait_until(
                lambda: "database unreachable" in (sub.stats.last_error or ""), timeout=15
            )
            assert handled == [] and proxy.refused > 0
            proxy.refuse(0.0, "53300", "")
            await wait_until(lambda: len(handled) == 20, timeout=30)
        assert sorted(handled) == list(range(20)) and sub.stats.dead_lettered == 0
    finally:
        await outbox.aclose()


@pytest.mark.postgres(reason="the pool's timeout, the same on every database: one server suffices")
async def test_a_pool_timeout_is_waited_out(pg_url: str) -> None:
    """Every pooled connection held elsewhere (``pool_size=2``, no overflow): the
    subscriber's checkout times out (``sqlalchemy.exc.TimeoutError``), the messages wait
    in place uncharged, and are handled once the connections come back."""
    broker = MemoryBroker()
    outbox = Outbox(
        pg_url,
        brokers={"default": broker},
        settings=OutboxSettings(**{**SETTINGS, "consumer_max_attempts": 1, "notify": False}),
        engine_options={"pool_size": 2, "max_overflow": 0, "pool_timeout": 0.5},
    )
    stream = unique("pool")
    handled: list[int] = []

    @outbox.subscriber(stream, group="g", start="all")
    async def one(message: Message, uow: UnitOfWork) -> None:
        handled.append(message.payload["n"])

    sub = outbox.subscribers[0]
    try:
        await outbox.create_tables()
        async with outbox.relaying():
            async with outbox.engine.connect() as a, outbox.engine.connect() as b:
                await a.exec_driver_sql("SELECT 1")
                await b.exec_driver_sql("SELECT 1")
                await publish_raw(broker, stream, range(10))
                await wait_until(
                    lambda: "database unreachable: TimeoutError" in (sub.stats.last_error or ""),
                    timeout=15,
                )
                assert handled == []
            await wait_until(lambda: len(handled) == 10, timeout=30)
        assert sorted(handled) == list(range(10)) and sub.stats.dead_lettered == 0
    finally:
        await outbox.aclose()


@pytest.mark.redis
async def test_a_handler_cancelled_at_shutdown_is_released_uncharged(
    sqlite_url: str, redis_url: str
) -> None:
    """A handler still running when the shutdown's drain time is over is cancelled (its
    transaction rolls back) and its message given back to Redis at once, its delivery
    count as before — not left pending for ``claim_idle_seconds`` and charged. The drain
    time counts from the stop, so the release fits in ``shutdown_timeout_seconds`` even
    after a fetch that was waiting (up to 1 s) when the stop came."""
    import redis.asyncio as aioredis

    broker = RedisStreamsBroker(redis_url)
    outbox = Outbox(
        sqlite_url,
        brokers={"default": broker},
        settings=OutboxSettings(**SETTINGS),  # shutdown_timeout_seconds=3
    )
    stream = unique("hang")
    entered = anyio.Event()
    hang = True
    handled: list[int] = []

    @outbox.subscriber(stream, group="g", start="all")
    async def slow(message: Message) -> None:
        entered.set()
        if hang:
            await anyio.sleep_forever()
        handled.append(message.payload["n"])

    sub = outbox.subscribers[0]
    try:
        await outbox.create_tables()
        await publish_raw(broker, stream, range(1))
        async with outbox.relaying():
            await entered.wait()
        async with aioredis.Redis.from_url(redis_url) as client:
            [entry] = await client.xpending_range(stream, "g", "-", "+", 10)
            assert entry["times_delivered"] == 0  # released, uncharged
        hang = False
        async with outbox.relaying():
            await wait_until(lambda: handled == [0], timeout=20)
        assert sub.stats.dead_lettered == 0
    finally:
        await outbox.aclose()
        async with aioredis.Redis.from_url(redis_url) as client:
            await client.delete(stream, f"{stream}.g.dlq")


async def test_sqlite_locked_past_the_busy_timeout_is_waited_out(sqlite_url: str) -> None:
    """Another process holds SQLite's write lock longer than the busy timeout ("database is
    locked"): the messages wait in place uncharged (``max_attempts=1``) and are handled
    once the lock is gone."""
    import sqlite3

    from sqlalchemy import event

    broker = MemoryBroker()
    outbox = Outbox(
        sqlite_url,
        brokers={"default": broker},
        settings=OutboxSettings(**{**SETTINGS, "consumer_max_attempts": 1}),
    )

    @event.listens_for(outbox.engine.sync_engine, "connect")
    def short_busy_timeout(dbapi_connection: Any, record: Any) -> None:
        dbapi_connection.execute("PRAGMA busy_timeout=200")  # after the outbox's 30 s

    await outbox.create_tables()
    stream = unique("locked")
    handled: list[int] = []

    @outbox.subscriber(stream, group="g", start="all")
    async def one(message: Message, uow: UnitOfWork) -> None:
        handled.append(message.payload["n"])

    sub = outbox.subscribers[0]
    path = sqlite_url.split("///", 1)[1]
    holder = sqlite3.connect(path, isolation_level=None)
    try:
        holder.execute("BEGIN EXCLUSIVE")  # the write lock, held by "another process"
        async with outbox.relaying():
            await publish_raw(broker, stream, range(5))
            await wait_until(
                lambda: "database unreachable" in (sub.stats.last_error or ""), timeout=15
            )
            assert handled == []
            holder.execute("ROLLBACK")
            await wait_until(lambda: len(handled) == 5, timeout=30)
        assert sorted(handled) == list(range(5)) and sub.stats.dead_lettered == 0
    finally:
        holder.close()
        await outbox.aclose()

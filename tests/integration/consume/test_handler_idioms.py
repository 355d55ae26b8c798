"""A handler's effects and its inbox row commit together or not at all, whatever
the handler does with its session, or the library refuses the idiom at its first use with an
error that names the handler.

A matrix of handler idioms — its own commit, its own commit then a transient failure, a
rollback then more work (the insert-if-absent idiom), its own commit then a rollback, a
savepoint rolled back and one released, an exception after a flush, a second unit of work,
a second session — run the three ways a subscriber runs handlers: a batch of per-message
handlers (the default), one message per transaction (``batch=False``), and a batch handler
(``list[Event]``); on the memory broker with SQLite and PostgreSQL, and on RabbitMQ with
PostgreSQL. Every message is delivered twice (a second
stream entry with the same message id, after the first was handled), and the idioms that
fail do so on the first call for each message. The test counts the effects in the database
and the events in the outbox (and on the broker, from the running relay): each exactly
once.
"""

from __future__ import annotations

import collections
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from sqlalchemy import Integer, String, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from fastapi_outbox import Event, Outbox, OutboxSettings, UnitOfWork, uuid7
from fastapi_outbox.brokers import Broker, MemoryBroker
from fastapi_outbox.events import Envelope
from tests.conftest import unique, wait_until

pytestmark = [pytest.mark.mariadb, pytest.mark.usefixtures("quick_fetch")]

MESSAGES = 6
JOBS = "idiom_jobs"


class Base(DeclarativeBase):
    pass


class Effect(Base):
    """One row per effect applied: no unique key, so a double effect shows as two rows."""

    __tablename__ = "idiom_effects"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    n: Mapped[int] = mapped_column(Integer)
    label: Mapped[str] = mapped_column(String(20))


class Customer(Base):
    """Inserted if absent (the even ones exist before the messages come)."""

    __tablename__ = "idiom_customers"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)


class Job(Event, stream=JOBS):
    n: int


class Done(Event, stream="idiom_done"):
    n: int
    label: str


class Transient(Exception):
    """A failure that goes away on the next attempt."""


def effect(uow: UnitOfWork, ns: list[int], label: str, *, event: bool = True) -> None:
    for n in ns:
        uow.session.add(Effect(n=n, label=label))
        if event:
            uow.publish(Done(n=n, label=label))


# An idiom: (unit of work, message numbers, first call for one of them) → None. Written for a
# list so one function serves a per-message handler ([n]) and a batch handler.
Idiom = Callable[[UnitOfWork, list[int], bool], Awaitable[None]]
#: The outbox of the test running, as an application's handler module sees its own.
APP: dict[str, Outbox] = {}


async def own_commit(uow: UnitOfWork, ns: list[int], first: bool) -> None:
    effect(uow, ns, "a")
    await uow.session.commit()


async def own_commit_then_transient_failure(uow: UnitOfWork, ns: list[int], first: bool) -> None:
    effect(uow, ns, "a")
    await uow.session.commit()
    effect(uow, ns, "b")
    await uow.session.flush()
    if first:
        raise Transient("after its own commit")


async def rollback_then_continue(uow: UnitOfWork, ns: list[int], first: bool) -> None:
    session = uow.session
    session.add_all([Customer(id=n) for n in ns])
    try:
        await session.flush()
    except IntegrityError:  # some exist: the rollback undoes the attempt, then go on
        await session.rollback()
        have = set((await session.execute(select(Customer.id))).scalars())
        session.add_all([Customer(id=n) for n in ns if n not in have])
    effect(uow, ns, "a")


async def own_commit_then_rollback(uow: UnitOfWork, ns: list[int], first: bool) -> None:
    effect(uow, ns, "a")
    await uow.session.commit()  # kept: the rollback below undoes only what came after it
    effect(uow, ns, "undone")
    await uow.session.flush()
    await uow.session.rollback()
    effect(uow, ns, "b")


async def savepoint_rolled_back(uow: UnitOfWork, ns: list[int], first: bool) -> None:
    effect(uow, ns, "a")
    try:
        async with uow.session.begin_nested():
            effect(uow, ns, "undone")
            await uow.session.flush()
            raise ValueError("undo the savepoint")
    except ValueError:
        pass
    effect(uow, ns, "b")


async def savepoint_released(uow: UnitOfWork, ns: list[int], first: bool) -> None:
    async with uow.session.begin_nested():
        effect(uow, ns, "a")
    effect(uow, ns, "b", event=False)


async def exception_after_flush(uow: UnitOfWork, ns: list[int], first: bool) -> None:
    effect(uow, ns, "a")
    await uow.session.flush()
    if first:
        raise Transient("after a flush")


async def second_unit_of_work(uow: UnitOfWork, ns: list[int], first: bool) -> None:
    async with APP["outbox"].unit_of_work() as inner:  # joins the handler's transaction
        assert inner.causation_id == uow.causation_id
        effect(inner, ns, "a")
    if first:
        raise Transient("after the unit of work committed")


async def second_session(uow: UnitOfWork, ns: list[int], first: bool) -> None:
    async with APP["outbox"].session_factory() as other:  # refused at its first statement
        other.add_all([Effect(n=n, label="a") for n in ns])
        await other.commit()


#: idiom → the (n, label) effects and the (n, label) events each message leaves, or None
#: when the idiom is refused (nothing committed, the messages dead-lettered).
IDIOMS: dict[Idiom, tuple[set[str], set[str]] | None] = {
    own_commit: ({"a"}, {"a"}),
    own_commit_then_transient_failure: ({"a", "b"}, {"a", "b"}),
    rollback_then_continue: ({"a"}, {"a"}),
    own_commit_then_rollback: ({"a", "b"}, {"a", "b"}),
    savepoint_rolled_back: ({"a", "b"}, {"a", "b"}),
    savepoint_released: ({"a", "b"}, {"a"}),
    exception_after_flush: ({"a"}, {"a"}),
    second_unit_of_work: ({"a"}, {"a"}),
    second_session: None,
}
MODES = ["batch", "one_by_one", "batch_handler"]


class Feed:
    """The test's side of the broker: puts messages on ``JOBS`` and reads what the
    relay published to ``idiom_done``."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.done: list[dict[str, Any]] = []

    async def published(self) -> list[dict[str, Any]]:
        """Payloads published to ``idiom_done`` so far."""
        assert isinstance(self.broker, MemoryBroker)
        return [json.loads(m.payload) for m in self.broker.on_stream("idiom_done")]


class RabbitFeed(Feed):
    """RabbitMQ: ``idiom_done`` read from a queue of the test's own bound to it."""

    def __init__(self, broker: Broker, queue: Any) -> None:
        super().__init__(broker)
        self.queue = queue

    async def published(self) -> list[dict[str, Any]]:
        while (m := await self.queue.get(no_ack=True, fail=False)) is not None:
            self.done.append(json.loads(m.body))
        return self.done


class KafkaFeed(Feed):
    """Kafka: ``idiom_done`` read from the start of its topic (the test's own prefix)."""

    def __init__(self, broker: Broker, topic: str) -> None:
        super().__init__(broker)
        self.topic = topic

    async def published(self) -> list[dict[str, Any]]:
        from aiokafka import AIOKafkaConsumer
        from aiokafka.structs import TopicPartition

        servers = self.broker.connection.servers  # type: ignore[attr-defined]
        reader = AIOKafkaConsumer(bootstrap_servers=servers, enable_auto_commit=False)
        await reader.start()
        try:
            tps = [TopicPartition(self.topic, p) for p in range(KAFKA_PARTITIONS)]
            reader.assign(tps)
            await reader.seek_to_beginning(*tps)
            ends = await reader.end_offsets(tps)
            out: list[dict[str, Any]] = []
            for tp in tps:
                while await reader.position(tp) < ends[tp]:
                    for record in (await reader.getmany(tp, timeout_ms=2000)).get(tp, []):
                        out.append(json.loads(record.value or b"null"))
            return out
        finally:
            await reader.stop()


#: Partitions of the Kafka topics of this module (the broker creates them with this many).
KAFKA_PARTITIONS = 2

FEEDS: dict[Outbox, Feed] = {}


def feed_of(outbox: Outbox) -> Feed:
    return FEEDS[outbox]


@pytest.fixture(params=["memory-sqlite", "memory-postgres", "rabbitmq-postgres", "kafka-postgres"])
async def outbox(request: pytest.FixtureRequest, tmp_path: Any) -> AsyncIterator[Outbox]:
    kind, db = request.param.split("-")
    callspec = getattr(request.node, "callspec", None)
    if kind == "kafka" and callspec and callspec.params.get("mode", "batch") != "batch":
        # The modes differ in the handler's transaction, not in what the broker does:
        # Kafka runs one of them, keeping the suite's time (a group join is 1 s here).
        pytest.skip("Kafka runs the idioms in the batch mode")
    db_url = (
        f"sqlite+aiosqlite:///{tmp_path}/test.db"
        if db == "sqlite"
        else str(request.getfixturevalue("pg_url"))
    )
    if kind == "memory":
        broker: Broker = MemoryBroker()
        async with _outbox(db_url, broker) as outbox:
            FEEDS[outbox] = Feed(broker)
            yield outbox
        return
    if kind == "kafka":
        request.getfixturevalue("quick_fetch")  # a stop waits for the fetch in progress
        async for outbox in _kafka_outbox(request, db_url):
            yield outbox
        return
    import aio_pika

    from fastapi_outbox.brokers import RabbitMQBroker

    url = str(request.getfixturevalue("rabbitmq_url"))
    exchange, prefix = unique("idioms"), unique("idioms") + "."
    broker = RabbitMQBroker(url, exchange=exchange, queue_prefix=prefix)
    conn = await aio_pika.connect(url)
    channel = await conn.channel()
    x = await channel.declare_exchange(exchange, "topic", durable=True)
    done = await channel.declare_queue(prefix + "done", durable=True)
    await done.bind(x, routing_key="idiom_done")
    try:
        async with _outbox(db_url, broker) as outbox:
            FEEDS[outbox] = RabbitFeed(broker, done)
            yield outbox
    finally:
        for name in (f"{JOBS}.idioms", f"{JOBS}.idioms.dlq", "done"):
            await channel.queue_delete(prefix + name)
        await channel.exchange_delete(exchange)
        await conn.close()


async def _kafka_outbox(request: pytest.FixtureRequest, db_url: str) -> AsyncIterator[Outbox]:
    """The Kafka broker with topics of this test's own (``topic_name`` with a prefix)."""
    from aiokafka.admin import AIOKafkaAdminClient

    from fastapi_outbox.brokers import KafkaBroker

    url = str(request.getfixturevalue("kafka_url"))
    prefix = unique("idioms") + "."
    broker = KafkaBroker(
        url,
        topic_name=prefix + "{stream}",
        topic_partitions=KAFKA_PARTITIONS,
        session_timeout_seconds=2.0,
        heartbeat_interval_seconds=0.5,
    )
    try:
        async with _outbox(db_url, broker) as outbox:
            FEEDS[outbox] = KafkaFeed(broker, prefix + "idiom_done")
            yield outbox
    finally:
        admin = AIOKafkaAdminClient(bootstrap_servers=broker.connection.servers)
        await admin.start()
        names = [prefix + n for n in (JOBS, f"{JOBS}.idioms.dlq", "idiom_done")]
        with contextlib.suppress(Exception):
            await admin.delete_topics(names)
        await admin.close()


@contextlib.asynccontextmanager
async def _outbox(db_url: str, broker: Broker) -> AsyncIterator[Outbox]:
    outbox = Outbox(
        db_url,
        brokers={"default": broker},
        settings=OutboxSettings(
            poll_interval_seconds=0.05,
            consumer_claim_idle_seconds=1.0,
            consumer_retry_base_delay_seconds=0.02,
            consumer_retry_max_delay_seconds=0.1,
            shutdown_timeout_seconds=2.0,
        ),
    )
    async with outbox.engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
        await conn.execute(Customer.__table__.insert(), [{"id": n} for n in range(0, MESSAGES, 2)])
    await outbox.create_tables()
    try:
        yield outbox
    finally:
        FEEDS.pop(outbox, None)
        await outbox.aclose()


def declare(outbox: Outbox, idiom: Idiom, mode: str, calls: collections.Counter[int]) -> None:
    """The idiom as a subscriber of ``JOBS`` run the ``mode`` way; ``calls`` counts the
    calls per message number."""
    APP["outbox"] = outbox

    def first_call(ns: list[int]) -> bool:
        calls.update(ns)
        return any(calls[n] == 1 for n in ns)

    if mode == "batch_handler":

        async def handle_batch(jobs: list[Job], uow: UnitOfWork) -> None:
            ns = [job.n for job in jobs]
            await idiom(uow, ns, first_call(ns))

        outbox.subscriber(JOBS, group="idioms", start="all", max_attempts=3)(handle_batch)
        return

    async def handle(job: Job, uow: UnitOfWork) -> None:
        await idiom(uow, [job.n], first_call([job.n]))

    outbox.subscriber(JOBS, group="idioms", start="all", max_attempts=3, batch=mode == "batch")(
        handle
    )


async def deliver(broker: Broker, ids: list[str]) -> None:
    """One stream entry per message id (message ``n`` has id ``ids[n]``)."""
    results = await broker.publish(
        [
            Envelope(
                str(uuid7()),
                JOBS,
                "Job",
                None,
                json.dumps({"n": n}).encode(),
                {"message-id": message_id, "type": "Job"},
            )
            for n, message_id in enumerate(ids)
        ]
    )
    assert results == [None] * len(ids), results


async def committed(outbox: Outbox) -> tuple[collections.Counter[Any], collections.Counter[Any]]:
    async with outbox.engine.connect() as conn:
        effects = collections.Counter((await conn.execute(select(Effect.n, Effect.label))).all())
        payloads = (await conn.execute(select(outbox.table.c.payload))).scalars().all()
    events = collections.Counter()
    for p in payloads:
        body = json.loads(p) if isinstance(p, str | bytes) else p
        events[(body["n"], body["label"])] += 1
    return effects, events


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("idiom", list(IDIOMS), ids=[i.__name__ for i in IDIOMS])
async def test_effects_once_whatever_the_handler_does_with_its_session(
    outbox: Outbox, idiom: Idiom, mode: str
) -> None:
    broker = outbox.brokers["default"]
    feed = feed_of(outbox)
    calls: collections.Counter[int] = collections.Counter()
    declare(outbox, idiom, mode, calls)
    sub = outbox.subscribers[0]
    ids = [str(uuid7()) for _ in range(MESSAGES)]
    expected = IDIOMS[idiom]
    async with outbox.relaying():
        await deliver(broker, ids)
        if expected is None:
            await wait_until(lambda: sub.stats.dead_lettered == MESSAGES, timeout=30)
        else:
            await wait_until(lambda: sub.stats.handled == MESSAGES, timeout=30)
        await deliver(broker, ids)  # each message a second time, after it was handled
        if expected is None:
            await wait_until(lambda: sub.stats.dead_lettered == 2 * MESSAGES, timeout=30)
            assert sub.consumer is not None
            errors = [d.error for d in await sub.consumer.dead_letters()]
        else:
            await wait_until(lambda: sub.stats.duplicates == MESSAGES, timeout=30)
            effects, events = await committed(outbox)
            want_events = {(n, label) for n in range(MESSAGES) for label in expected[1]}
            # The running relay publishes exactly the committed events.

            async def all_published() -> bool:
                return len(await feed.published()) >= len(want_events)

            await wait_until(all_published, timeout=15)
            published = collections.Counter(
                (body["n"], body["label"]) for body in await feed.published()
            )
    group = (await outbox.inbox.group_stats(["idioms"])).get("idioms")
    if expected is None:
        # Refused at its first use, naming the handler; nothing of it committed.
        assert len(errors) == 2 * MESSAGES
        for error in errors:
            assert sub.name in error and "second session" in error, error
            assert "outbox.unit_of_work()" in error, error
        assert await committed(outbox) == (collections.Counter(), collections.Counter())
        assert group is None
        return
    assert sub.stats.handled == MESSAGES
    assert group is not None and group.handled == MESSAGES
    want_effects = {(n, label) for n in range(MESSAGES) for label in expected[0]}
    assert effects == collections.Counter(want_effects)  # each exactly once
    assert events == collections.Counter(want_events)
    assert published == collections.Counter(want_events)
    if idiom is rollback_then_continue:
        async with outbox.engine.connect() as conn:
            customers = (await conn.execute(select(Customer.id))).scalars().all()
        assert sorted(customers) == list(range(MESSAGES))


@pytest.mark.parametrize("mode", ["one_by_one", "batch_handler"])
async def test_relays_are_woken_by_the_subscribers_commit_not_the_handlers(
    outbox: Outbox, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A handler's own commit commits nothing, so it wakes no relay: the wake-up (and a
    NOTIFY, when one is due) follows the subscriber's commit, once."""
    broker = outbox.brokers["default"]
    feed = feed_of(outbox)
    woken: list[dict[str, float]] = []
    seen_by_handler: list[int] = []
    committed = outbox.relays.committed

    def spy(brokers: Any, **kw: Any) -> bool:
        woken.append(dict(brokers))
        return committed(brokers, **kw)

    monkeypatch.setattr(outbox.relays, "committed", spy)

    async def commits_then_looks(uow: UnitOfWork, ns: list[int], first: bool) -> None:
        effect(uow, ns, "a")
        await uow.session.commit()
        seen_by_handler.append(len(woken))

    declare(outbox, commits_then_looks, mode, collections.Counter())
    sub = outbox.subscribers[0]
    async with outbox.relaying():
        await deliver(broker, [str(uuid7())])
        await wait_until(lambda: sub.stats.handled == 1, timeout=30)

        async def published() -> bool:
            return len(await feed.published()) == 1

        await wait_until(published, timeout=15)
    assert seen_by_handler == [0]  # nothing woken by the handler's own commit
    assert woken == [{"default": 0.0}]  # once, by the subscriber's commit


async def test_a_unit_of_work_of_another_outbox_on_the_same_database_joins_too(
    outbox: Outbox,
) -> None:
    """Events for a second outbox table (another ``Outbox`` on the same engine), published
    from a handler through that outbox's unit of work, commit with the handler's effects and
    its inbox row: once, despite a failure after them."""
    other = Outbox(
        outbox.engine,
        brokers={"default": MemoryBroker()},
        settings=OutboxSettings(table_name="other_outbox"),
    )
    await other.create_tables()
    broker = outbox.brokers["default"]

    async def publishes_elsewhere(uow: UnitOfWork, ns: list[int], first: bool) -> None:
        effect(uow, ns, "a", event=False)
        async with other.unit_of_work() as elsewhere:
            assert elsewhere.session is uow.session
            for n in ns:
                elsewhere.publish(Done(n=n, label="elsewhere"))
        if first:
            raise Transient("after publishing elsewhere")

    declare(outbox, publishes_elsewhere, "batch", collections.Counter())
    sub = outbox.subscribers[0]
    async with outbox.relaying():
        await deliver(broker, [str(uuid7()) for _ in range(MESSAGES)])
        await wait_until(lambda: sub.stats.handled == MESSAGES, timeout=30)
    effects, _ = await committed(outbox)
    assert effects == collections.Counter({(n, "a"): 1 for n in range(MESSAGES)})
    _, events = await committed(other)
    assert events == collections.Counter({(n, "elsewhere"): 1 for n in range(MESSAGES)})
    await other.aclose()

"""Subscribers with the inbox, one contract on every broker: memory, Redis Streams, NATS,
RabbitMQ, Kafka.

Effects are rows in PostgreSQL (SQLite for the memory broker's embedded default), counted
per message id; duplicates are injected straight into the real stream (same message id,
new entry); events raised by handlers are read back by a second subscriber.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from sqlalchemy import String, func, select
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from fastapi_outbox import (
    Event,
    Message,
    Outbox,
    OutboxSettings,
    UnitOfWork,
    uuid7,
)
from fastapi_outbox.brokers import Broker, MemoryBroker
from fastapi_outbox.consume.subscriber import BatchUnitOfWork
from fastapi_outbox.events import Envelope
from tests.conftest import unique, wait_until

pytestmark = [pytest.mark.mariadb, pytest.mark.usefixtures("quick_fetch")]

FAST = {
    "consumer_claim_idle_seconds": 1.0,
    "consumer_retry_base_delay_seconds": 0.05,
    "consumer_retry_max_delay_seconds": 0.2,
    "consumer_max_attempts": 3,
    "shutdown_timeout_seconds": 5.0,
}


class Base(DeclarativeBase):
    pass


class Invoice(Base):
    """An effect: deliberately no unique constraint, so a double effect shows as two rows."""

    __tablename__ = "invoices"

    id: Mapped[int] = mapped_column(primary_key=True)
    order_id: Mapped[int]
    message_id: Mapped[str] = mapped_column(String(64))


@dataclass
class Harness:
    kind: str
    broker: Broker
    db_url: str
    #: Add a raw entry to a stream in the publish side's format (a duplicate, a foreign
    #: producer's message).
    inject: Callable[[str, str, str, dict[str, Any], dict[str, str]], Awaitable[None]]
    streams: list[str] = field(default_factory=list)
    #: Another broker object on the same broker (another process's); the memory broker's
    #: is itself. Closed with the harness.
    twin: Callable[[], Broker] | None = None

    def stream(self, prefix: str = "orders") -> str:
        name = unique(prefix)
        self.streams.append(name)
        return name


@contextlib.asynccontextmanager
async def _redis(url: str, db_url: str) -> AsyncIterator[Harness]:
    import redis.asyncio as aioredis

    from fastapi_outbox.brokers import RedisStreamsBroker

    client = aioredis.Redis.from_url(url)

    async def inject(
        stream: str, message_id: str, type_: str, payload: dict[str, Any], headers: dict[str, str]
    ) -> None:
        await client.xadd(
            stream,
            {
                "id": message_id,
                "type": type_,
                "key": "",
                "headers": json.dumps(headers),
                "payload": json.dumps(payload),
            },
        )

    harness = Harness("redis", RedisStreamsBroker(url), db_url, inject)
    harness.twin = lambda: RedisStreamsBroker(url)
    try:
        yield harness
    finally:
        for stream in harness.streams:
            keys = [k async for k in client.scan_iter(match=f"{stream}*")]
            if keys:
                await client.delete(*keys)
        await client.aclose()
        await harness.broker.aclose()


@contextlib.asynccontextmanager
async def _nats(url: str, db_url: str) -> AsyncIterator[Harness]:
    import nats

    from fastapi_outbox.brokers import NatsJetStreamBroker
    from fastapi_outbox.brokers.nats.wire import stream_name_for

    nc = await nats.connect(url)
    js = nc.jetstream()
    broker = NatsJetStreamBroker(url)

    async def inject(
        stream: str, message_id: str, type_: str, payload: dict[str, Any], headers: dict[str, str]
    ) -> None:
        headers = {**headers, "message-id": message_id, "type": type_}
        await broker.connect()
        await broker.ensure_stream(stream)
        await js.publish(
            stream, json.dumps(payload).encode(), headers={**headers, "Nats-Msg-Id": str(uuid7())}
        )

    harness = Harness("nats", broker, db_url, inject)
    harness.twin = lambda: NatsJetStreamBroker(url)
    try:
        yield harness
    finally:
        streams = await js.streams_info()
        names = {stream_name_for(s) for s in harness.streams}
        for info in streams:
            if any(info.config.name.startswith(n) for n in names):
                with contextlib.suppress(Exception):
                    await js.delete_stream(info.config.name)
        await nc.close()
        await broker.aclose()


@contextlib.asynccontextmanager
async def _rabbitmq(url: str, db_url: str) -> AsyncIterator[Harness]:
    """The broker on an exchange of this test's own; the queues its groups declared
    (``{stream}.{group}`` and the dead-letter queues) are deleted after."""
    import aio_pika

    from fastapi_outbox.brokers import RabbitMQBroker

    exchange = unique("consumer_x")
    broker = RabbitMQBroker(url, exchange=exchange)
    conn = await aio_pika.connect(url)
    channel = await conn.channel(publisher_confirms=True)

    async def inject(
        stream: str, message_id: str, type_: str, payload: dict[str, Any], headers: dict[str, str]
    ) -> None:
        x = await channel.declare_exchange(exchange, "topic", durable=True)
        await x.publish(
            aio_pika.Message(
                json.dumps(payload).encode(),
                message_id=message_id,
                type=type_,
                headers={**headers, "message-id": message_id, "type": type_},
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            ),
            routing_key=stream,
            mandatory=True,  # a stream no group is bound to fails the test, never drops
        )

    harness = Harness("rabbitmq", broker, db_url, inject)
    harness.twin = lambda: RabbitMQBroker(url, exchange=exchange)
    try:
        yield harness
    finally:
        await broker.aclose()
        for stream in harness.streams:
            for group in GROUPS:
                for name in (f"{stream}.{group}", f"{stream}.{group}.dlq"):
                    await channel.queue_delete(name)
        await channel.exchange_delete(exchange)
        await conn.close()


#: A Kafka consumer group's join waits about half the session timeout on Tansu: the tests'
#: consumers leave a silent member after 2 s (the library's default is 10 s).
KAFKA_TEST_OPTIONS: dict[str, Any] = {
    "session_timeout_seconds": 2.0,
    "heartbeat_interval_seconds": 0.5,
}


@contextlib.asynccontextmanager
async def _kafka(url: str, db_url: str) -> AsyncIterator[Harness]:
    """The broker on the session's Kafka-protocol server; a foreign aiokafka producer
    injects records; the topics of the test (streams, dead letters) are deleted after."""
    from aiokafka import AIOKafkaProducer
    from aiokafka.admin import AIOKafkaAdminClient

    from fastapi_outbox.brokers import KafkaBroker
    from fastapi_outbox.brokers.kafka.wire import bootstrap_servers

    servers = bootstrap_servers(url)
    producer = AIOKafkaProducer(bootstrap_servers=servers, acks="all")
    await producer.start()

    async def inject(
        stream: str, message_id: str, type_: str, payload: dict[str, Any], headers: dict[str, str]
    ) -> None:
        headers = {**headers, "message-id": message_id, "type": type_}
        # Keyless, on partition 0: Kafka orders a topic per partition, and the tests
        # read what they inject in injection order.
        await producer.send_and_wait(
            stream,
            json.dumps(payload).encode(),
            partition=0,
            headers=[(k, v.encode()) for k, v in headers.items()],
        )

    harness = Harness("kafka", KafkaBroker(url, **KAFKA_TEST_OPTIONS), db_url, inject)
    harness.twin = lambda: KafkaBroker(url, **KAFKA_TEST_OPTIONS)
    try:
        yield harness
    finally:
        await harness.broker.aclose()
        await producer.stop()
        admin = AIOKafkaAdminClient(bootstrap_servers=servers)
        await admin.start()
        names = [f"{s}.{g}.dlq" for s in harness.streams for g in GROUPS]
        with contextlib.suppress(Exception):
            await admin.delete_topics([*harness.streams, *names])
        await admin.close()


#: The groups the tests of this module use (the RabbitMQ harness deletes their queues).
GROUPS = ("billing", "audit", "tracking", "deploys")


@contextlib.asynccontextmanager
async def _memory(db_url: str) -> AsyncIterator[Harness]:
    broker = MemoryBroker()

    async def inject(
        stream: str, message_id: str, type_: str, payload: dict[str, Any], headers: dict[str, str]
    ) -> None:
        await broker.publish(
            [
                Envelope(
                    str(uuid7()),
                    stream,
                    type_,
                    None,
                    json.dumps(payload).encode(),
                    {**headers, "message-id": message_id, "type": type_},
                )
            ]
        )

    yield Harness("memory", broker, db_url, inject, twin=lambda: broker)


@pytest.fixture(params=["memory", "redis", "nats", "rabbitmq", "kafka"])
async def harness(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    kind = request.param
    if kind == "memory":
        async with _memory(str(request.getfixturevalue("sqlite_url"))) as h:
            yield h
        return
    pg_url = str(request.getfixturevalue("pg_url"))
    if kind == "redis":
        async with _redis(str(request.getfixturevalue("redis_url")), pg_url) as h:
            yield h
    elif kind == "rabbitmq":
        async with _rabbitmq(str(request.getfixturevalue("rabbitmq_url")), pg_url) as h:
            yield h
    elif kind == "kafka":
        async with _kafka(str(request.getfixturevalue("kafka_url")), pg_url) as h:
            yield h
    else:
        async with _nats(str(request.getfixturevalue("nats_url")), pg_url) as h:
            yield h


async def make_outbox(h: Harness, **settings: Any) -> Outbox:
    outbox = Outbox(
        h.db_url,
        brokers={"default": h.broker},
        settings=OutboxSettings(**{**FAST, **settings}),
    )
    async with outbox.engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    await outbox.create_tables()
    return outbox


async def effects(outbox: Outbox) -> dict[str, int]:
    """Invoice rows per message id."""
    async with outbox.engine.connect() as conn:
        rows = await conn.execute(
            select(Invoice.message_id, func.count()).group_by(Invoice.message_id)
        )
        return {m: int(n) for m, n in rows}


def events_for(stream: str) -> tuple[type[Event], type[Event]]:
    """Event classes on this test's own streams (a class per test: streams are unique)."""
    placed = type(
        "OrderPlaced",
        (Event,),
        {"__annotations__": {"order_id": int}},
        stream=stream,
        key="order_id",
    )
    issued = type(
        "InvoiceIssued",
        (Event,),
        {"__annotations__": {"order_id": int}},
        stream=stream + "_invoices",
    )
    return placed, issued


async def test_effects_once_and_raised_events_carry_causation(harness: Harness) -> None:
    h = harness
    orders = h.stream()
    invoices = orders + "_invoices"
    h.streams.append(invoices)
    OrderPlaced, InvoiceIssued = events_for(orders)
    outbox = await make_outbox(h)
    seen: list[Message] = []

    async def bill(event: OrderPlaced, uow: UnitOfWork) -> None:  # type: ignore[valid-type]
        uow.session.add(Invoice(order_id=event.order_id, message_id=incoming[event.order_id]))
        uow.publish(InvoiceIssued(order_id=event.order_id))

    async def audit(message: Message) -> None:
        seen.append(message)

    bill.__annotations__["event"] = OrderPlaced
    outbox.subscriber(orders, group="billing", start="all")(bill)
    outbox.subscriber(invoices, group="audit", start="all")(audit)
    incoming: dict[int, str] = {}
    correlation = "corr-" + uuid7().hex
    n = 20
    async with outbox.relaying():
        async with outbox.unit_of_work(correlation_id=correlation) as uow:
            for i in range(n):
                incoming[i] = str(uow.publish(OrderPlaced(order_id=i)))
        await wait_until(lambda: len(seen) >= n, timeout=20)
        # A duplicate of an order already handled: same message id, a new stream entry.
        await h.inject(orders, incoming[0], "OrderPlaced", {"order_id": 0}, {})
        await wait_until(lambda: outbox.subscribers[0].stats.duplicates >= 1, timeout=10)
    assert await effects(outbox) == {incoming[i]: 1 for i in range(n)}
    assert sorted(m.payload["order_id"] for m in seen) == list(range(n))
    for m in seen:
        assert m.type == "InvoiceIssued"
        assert m.headers["causation-id"] == incoming[m.payload["order_id"]]
        assert m.headers["correlation-id"] == correlation
    assert await outbox.inbox.contains("billing", incoming[0])
    await outbox.aclose()


async def test_redelivery_after_commit_without_ack_is_skipped(harness: Harness) -> None:
    h = harness
    orders = h.stream()
    OrderPlaced, _ = events_for(orders)
    outbox = await make_outbox(h)
    handled: list[int] = []

    async def bill(event: Any, uow: UnitOfWork) -> None:
        handled.append(event.order_id)
        uow.session.add(Invoice(order_id=event.order_id, message_id=str(event.order_id)))

    bill.__annotations__["event"] = OrderPlaced
    sub = outbox.subscriber(orders, group="billing", start="all")
    sub(bill)
    subscriber = outbox.subscribers[0]
    dropped: list[str] = []
    async with outbox.relaying():
        consumer = subscriber.consumer
        assert consumer is not None
        real_ack = consumer.ack

        async def lost_ack(deliveries: Any) -> None:
            # The first ack of each message is lost (a crash between commit and ack).
            todo = [d for d in deliveries if d.message_id in dropped]
            for d in deliveries:
                if d.message_id not in dropped:
                    dropped.append(d.message_id)
            await real_ack(todo)

        consumer.ack = lost_ack  # type: ignore[method-assign]
        async with outbox.unit_of_work() as uow:
            for i in range(3):
                uow.publish(OrderPlaced(order_id=i))
        # Redelivered after claim_idle_seconds (1 s), found in the inbox, skipped, acked.
        await wait_until(lambda: subscriber.stats.duplicates >= 3, timeout=15)
    assert sorted(handled) == [0, 1, 2]
    assert await effects(outbox) == {"0": 1, "1": 1, "2": 1}
    await outbox.aclose()


async def test_handled_message_past_max_attempts_is_acked_not_dead_lettered(
    harness: Harness,
) -> None:
    """A message whose handler committed but whose ack was lost until its delivery count
    passed ``max_attempts`` (kills, broker restarts) has its effects applied: it is found
    in the inbox and acknowledged as a duplicate, not dead-lettered as "delivered too many
    times" (the dead letter would claim an effect that happened did not)."""
    h = harness
    orders = h.stream()
    OrderPlaced, _ = events_for(orders)
    outbox = await make_outbox(h)
    handled: list[int] = []

    async def bill(event: Any, uow: UnitOfWork) -> None:
        handled.append(event.order_id)
        uow.session.add(Invoice(order_id=event.order_id, message_id=str(event.order_id)))

    bill.__annotations__["event"] = OrderPlaced
    outbox.subscriber(orders, group="billing", start="all", max_attempts=1)(bill)
    subscriber = outbox.subscribers[0]
    dropped: list[str] = []
    async with outbox.relaying():
        consumer = subscriber.consumer
        assert consumer is not None
        real_ack = consumer.ack

        async def lost_ack(deliveries: Any) -> None:
            todo = [d for d in deliveries if d.message_id in dropped]
            for d in deliveries:
                if d.message_id not in dropped:
                    dropped.append(d.message_id)
            await real_ack(todo)

        consumer.ack = lost_ack  # type: ignore[method-assign]
        consumer.ack_soon = lost_ack  # type: ignore[attr-defined]
        async with outbox.unit_of_work() as uow:
            for i in range(3):
                uow.publish(OrderPlaced(order_id=i))
        # The second delivery's count (2) is past max_attempts=1.
        await wait_until(lambda: subscriber.stats.duplicates >= 3, timeout=15)
    assert subscriber.stats.dead_lettered == 0
    assert sorted(handled) == [0, 1, 2]
    assert await effects(outbox) == {"0": 1, "1": 1, "2": 1}
    await outbox.aclose()


async def test_poison_is_dead_lettered_and_others_are_handled(harness: Harness) -> None:
    h = harness
    orders = h.stream()
    h.streams.append(f"{orders}.billing.dlq")
    OrderPlaced, _ = events_for(orders)
    outbox = await make_outbox(h, consumer_unknown_type_grace_seconds=0)
    attempts: dict[int, int] = {}
    cured = False

    async def bill(event: Any, uow: UnitOfWork) -> None:
        attempts[event.order_id] = attempts.get(event.order_id, 0) + 1
        if event.order_id == 3 and not cured:
            raise RuntimeError("order 3 is poison")
        uow.session.add(Invoice(order_id=event.order_id, message_id=str(event.order_id)))

    bill.__annotations__["event"] = OrderPlaced
    outbox.subscriber(orders, group="billing", start="all")(bill)
    subscriber = outbox.subscribers[0]
    async with outbox.relaying():
        async with outbox.unit_of_work() as uow:
            for i in range(8):
                uow.publish(OrderPlaced(order_id=i))
        # A type no Event declares, and no process of the group takes, with no grace
        # (consumer_unknown_type_grace_seconds=0): dead-lettered at once, without retries.
        await h.inject(orders, str(uuid7()), "Mystery", {"x": 1}, {})
        await wait_until(lambda: subscriber.stats.dead_lettered >= 2, timeout=20)
        assert subscriber.consumer is not None
        dead = await subscriber.consumer.dead_letters()
        by_type = {d.type: d for d in dead}
        assert set(by_type) == {"OrderPlaced", "Mystery"}
        assert "order 3 is poison" in by_type["OrderPlaced"].error
        assert by_type["OrderPlaced"].attempts == 3
        assert "unknown event type 'Mystery'" in by_type["Mystery"].error
        assert by_type["Mystery"].attempts == 1
        assert await subscriber.consumer.count_dead_letters() == 2
        assert set(await effects(outbox)) == {str(i) for i in range(8) if i != 3}
        # Three deliveries; the first may also have run once inside its batch's
        # transaction, which rolled back before the batch went message by message.
        assert 3 <= attempts[3] <= 4
        runs = attempts[3]
        # Re-drive the poison once it is cured: handled once, and gone from the dead letters.
        cured = True
        replayed = await subscriber.consumer.replay_dead_letters([by_type["OrderPlaced"].entry_id])
        assert replayed == 1
        await wait_until(lambda: attempts[3] == runs + 1, timeout=15)
        await wait_until(lambda: subscriber.stats.handled == 8, timeout=10)
        assert [d.type for d in await subscriber.consumer.dead_letters()] == ["Mystery"]
    assert await effects(outbox) == {str(i): 1 for i in range(8)}
    await outbox.aclose()


async def test_ordered_keeps_each_key_in_stream_order(harness: Harness) -> None:
    h = harness
    orders = h.stream()
    OrderPlaced, _ = events_for(orders)
    outbox = await make_outbox(h)
    seen: list[int] = []
    failed = False

    async def track(event: Any, uow: UnitOfWork) -> None:
        nonlocal failed
        if event.order_id == 0 and not failed:
            failed = True  # the first message of the key fails once: later ones wait for it
            raise RuntimeError("try again")
        seen.append(event.order_id)

    track.__annotations__["event"] = OrderPlaced
    outbox.subscriber(orders, group="tracking", start="all", ordered=True)(track)
    async with outbox.relaying():
        async with outbox.unit_of_work() as uow:
            for i in range(6):
                # One key for all six: they must be handled in this order.
                uow.publish(OrderPlaced(order_id=i), key="k")
        await wait_until(lambda: len(seen) == 6, timeout=15)
    assert seen == list(range(6))
    assert outbox.subscribers[0].stats.failures == 1
    await outbox.aclose()


async def test_ordered_dead_letters_a_poison_message_and_its_key_goes_on_in_order(
    harness: Harness,
) -> None:
    """A message of an ordered key that always fails is dead-lettered after max_attempts;
    the later messages of its key follow it, in order, each once (on Redis and NATS the
    partition's queue goes in one transaction first, then one by one)."""
    h = harness
    orders = h.stream()
    OrderPlaced, _ = events_for(orders)
    outbox = await make_outbox(h, consumer_max_attempts=2)

    async def track(event: Any, uow: UnitOfWork) -> None:
        if event.order_id == 1:
            raise RuntimeError("poison")
        uow.session.add(Invoice(order_id=event.order_id, message_id=uow.causation_id or ""))

    async def committed() -> list[int]:  # in commit order (serial id)
        async with outbox.engine.connect() as conn:
            rows = await conn.execute(select(Invoice.order_id).order_by(Invoice.id))
            return [int(n) for n in rows.scalars()]

    track.__annotations__["event"] = OrderPlaced
    outbox.subscriber(orders, group="tracking", start="all", ordered=True)(track)
    subscriber = outbox.subscribers[0]
    async with outbox.relaying():
        async with outbox.unit_of_work() as uow:
            for i in range(6):
                uow.publish(OrderPlaced(order_id=i), key="k")

        async def five() -> bool:
            return len(await committed()) >= 5

        await wait_until(five, timeout=15)
        assert subscriber.consumer is not None
        await wait_until(subscriber.consumer.count_dead_letters, timeout=10)
    assert await committed() == [0, 2, 3, 4, 5]
    assert subscriber.stats.dead_lettered == 1
    await outbox.aclose()


# -- batch handlers (first parameter a list) -----------------------------------------------


async def test_batch_handler_effects_once_with_redelivery_duplicates_and_causation(
    harness: Harness,
) -> None:
    h = harness
    orders = h.stream()
    invoices = orders + "_invoices"
    h.streams.append(invoices)
    OrderPlaced, InvoiceIssued = events_for(orders)
    outbox = await make_outbox(h)
    calls: list[list[int]] = []
    seen: list[Message] = []

    async def bill(events: Any, uow: BatchUnitOfWork) -> None:
        calls.append([e.order_id for e in events])
        assert len(uow.message_ids) == len(events) == len(uow.correlation_ids)
        assert uow.causation_id == uow.message_ids[-1]
        for event, mid, corr in zip(events, uow.message_ids, uow.correlation_ids, strict=True):
            uow.session.add(Invoice(order_id=event.order_id, message_id=mid))
            uow.publish(
                InvoiceIssued(order_id=event.order_id), causation_id=mid, correlation_id=corr
            )

    async def audit(message: Message) -> None:
        seen.append(message)

    bill.__annotations__["events"] = list[OrderPlaced]  # type: ignore[valid-type]
    outbox.subscriber(orders, group="billing", start="all")(bill)
    outbox.subscriber(invoices, group="audit", start="all")(audit)
    subscriber = outbox.subscribers[0]
    assert subscriber.batch_handler
    # The groups exist before anything is published to the stream (``db create`` does
    # this in a deployment): a RabbitMQ queue receives only what comes after it.
    await outbox.lifecycle.declare_groups()
    n = 30
    ids = [str(uuid7()) for _ in range(n)]
    for i, mid in enumerate(ids):  # on the stream before the subscriber starts: one batch
        await h.inject(orders, mid, "OrderPlaced", {"order_id": i}, {"correlation-id": f"c{i}"})
    lost = 0  # the deliveries of the first ack, which is lost
    real_make_consumer = subscriber.make_consumer

    def make_consumer_losing_first_ack() -> Any:
        # Patched before the subscriber starts: the first batch may be acked at once.
        consumer = real_make_consumer()
        real_ack = consumer.ack

        async def lose_first_ack(deliveries: Any) -> None:
            nonlocal lost
            if not lost:  # a crash between commit and ack: redelivered, then skipped
                lost = len(deliveries)
                return
            await real_ack(deliveries)

        consumer.ack = lose_first_ack  # type: ignore[method-assign]
        return consumer

    subscriber.make_consumer = make_consumer_losing_first_ack  # type: ignore[method-assign]
    async with outbox.relaying():
        await wait_until(lambda: len(seen) >= n, timeout=20)
        await wait_until(lambda: 0 < lost <= subscriber.stats.duplicates, timeout=15)
        # A duplicate of an order already handled: same message id, a new stream entry.
        await h.inject(orders, ids[5], "OrderPlaced", {"order_id": 5}, {})
        await wait_until(lambda: subscriber.stats.duplicates >= lost + 1, timeout=10)
    assert lost
    assert max(len(c) for c in calls) > 1, calls  # whole batches reached the handler
    assert sorted(i for c in calls for i in c) == list(range(n))  # each order once
    assert all(c == sorted(c) for c in calls)  # in stream order
    assert await effects(outbox) == {mid: 1 for mid in ids}
    by_order = {m.payload["order_id"]: m for m in seen}
    assert sorted(by_order) == list(range(n))
    for i, m in by_order.items():
        assert m.headers["causation-id"] == ids[i]
        assert m.headers["correlation-id"] == f"c{i}"
    await outbox.aclose()


async def test_batch_handler_poison_is_isolated_and_dead_lettered(harness: Harness) -> None:
    h = harness
    orders = h.stream()
    h.streams.append(f"{orders}.billing.dlq")
    h.streams.append(orders + "_invoices")
    OrderPlaced, InvoiceIssued = events_for(orders)
    outbox = await make_outbox(h)
    calls: list[list[int]] = []

    async def bill(events: Any, uow: UnitOfWork) -> None:
        calls.append([e.order_id for e in events])
        for event in events:
            uow.session.add(Invoice(order_id=event.order_id, message_id=str(event.order_id)))
            # No causation_id given: the last message of the list is the cause.
            uow.publish(InvoiceIssued(order_id=event.order_id))
        if any(e.order_id == 3 for e in events):
            raise RuntimeError("order 3 is poison")

    bill.__annotations__["events"] = list[OrderPlaced]  # type: ignore[valid-type]
    outbox.subscriber(orders, group="billing", start="all")(bill)
    subscriber = outbox.subscribers[0]
    await outbox.lifecycle.declare_groups()  # before the first message (see above)
    for i in range(10):
        await h.inject(orders, f"m{i}", "OrderPlaced", {"order_id": i}, {})
    async with outbox.relaying():
        await wait_until(
            lambda: subscriber.stats.dead_lettered >= 1 and subscriber.stats.handled >= 9,
            timeout=20,
        )
        assert subscriber.consumer is not None
        dead = await subscriber.consumer.dead_letters()
        assert [d.message_id for d in dead] == ["m3"]
        assert "order 3 is poison" in dead[0].error
        assert dead[0].attempts == 3
    assert set(await effects(outbox)) == {str(i) for i in range(10) if i != 3}
    assert sum(n for n in (await effects(outbox)).values()) == 9
    # The whole batch was tried twice (with backoff), then each message alone.
    assert calls[0] == calls[1] == list(range(10)), calls
    assert [3] in calls[2:] and all(len(c) == 1 for c in calls[2:]), calls
    # Published events of the rolled-back tries are gone; each invoice's event names the
    # last message of its (one-element) list as its cause.
    async with outbox.engine.connect() as conn:
        rows = (
            await conn.execute(
                select(outbox.table.c.payload, outbox.table.c.headers).where(
                    outbox.table.c.stream == orders + "_invoices"
                )
            )
        ).all()

    def loaded(value: Any) -> Any:  # JSON columns on PostgreSQL, text on SQLite
        return value if isinstance(value, dict) else json.loads(value)

    causes = sorted((loaded(p)["order_id"], loaded(hd)["causation-id"]) for p, hd in rows)
    assert causes == [(i, f"m{i}") for i in range(10) if i != 3]
    await outbox.aclose()

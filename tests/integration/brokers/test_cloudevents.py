"""``envelope="cloudevents"`` on every broker, checked against the ``cloudevents`` SDK.

Publishing: a broker made with ``envelope="cloudevents"`` publishes; the raw message is
read back from the real stream or queue and parsed by the SDK (``from_http`` for the
headers and body of either mode); its id, type, time, subject, source and data must be the
envelope's. Consuming: a foreign producer writes CloudEvents made by the SDK
(``to_binary``/``to_structured``) straight into the stream, twice with the same id; a
subscriber with the inbox handles each event once, with the same message id, type,
payload and headers a native message would have.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from cloudevents.v1.conversion import to_binary, to_structured
from cloudevents.v1.http import CloudEvent, from_http
from sqlalchemy import String, func, select
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from fastapi_outbox import Message, Outbox, OutboxSettings, UnitOfWork, uuid7
from fastapi_outbox.brokers import Broker, MemoryBroker
from fastapi_outbox.brokers.cloudevents import CloudEventsMode
from fastapi_outbox.events import Envelope
from tests.conftest import unique, wait_until

pytestmark = pytest.mark.usefixtures("quick_fetch")

SOURCE = "/orders-service"
FAST: dict[str, Any] = {
    "consumer_claim_idle_seconds": 1.0,
    "consumer_retry_base_delay_seconds": 0.05,
    "consumer_retry_max_delay_seconds": 0.2,
    "shutdown_timeout_seconds": 5.0,
}


class Base(DeclarativeBase):
    pass


class Payment(Base):
    """An effect, deliberately without a unique constraint: a double effect is two rows."""

    __tablename__ = "ce_payments"

    id: Mapped[int] = mapped_column(primary_key=True)
    invoice: Mapped[int]
    message_id: Mapped[str] = mapped_column(String(64))


RawMessage = tuple[dict[str, str], bytes]


@dataclass
class Side:
    """One broker kind: a broker publishing CloudEvents, a reader of the raw messages on a
    stream (headers and body as the SDK expects them) and a foreign producer's writer."""

    broker: Broker
    mode: CloudEventsMode
    read: Callable[[str], Awaitable[list[RawMessage]]]
    write: Callable[[str, dict[str, str], bytes], Awaitable[None]]
    streams: list[str] = field(default_factory=list)

    def stream(self) -> str:
        name = unique("ce_orders")
        self.streams.append(name)
        return name


@contextlib.asynccontextmanager
async def _memory(mode: CloudEventsMode) -> AsyncIterator[Side]:
    broker = MemoryBroker(envelope="cloudevents", cloudevents_mode=mode, cloudevents_source=SOURCE)

    async def read(stream: str) -> list[RawMessage]:
        return [(dict(e.headers), e.payload) for e in broker.on_stream(stream)]

    async def write(stream: str, headers: dict[str, str], body: bytes) -> None:
        # Another producer's message, stored as it comes (no envelope of ours around it).
        broker.connection.store([Envelope(str(uuid7()), stream, "", None, body, headers)])

    yield Side(broker, mode, read, write)


@contextlib.asynccontextmanager
async def _redis(url: str, mode: CloudEventsMode) -> AsyncIterator[Side]:
    import redis.asyncio as aioredis

    from fastapi_outbox.brokers import RedisStreamsBroker

    client = aioredis.Redis.from_url(url)
    broker = RedisStreamsBroker(
        url, envelope="cloudevents", cloudevents_mode=mode, cloudevents_source=SOURCE
    )

    async def read(stream: str) -> list[RawMessage]:
        out = []
        for _entry_id, raw in await client.xrange(stream, "-", "+"):
            fields = {k.decode(): v for k, v in raw.items()}
            out.append((json.loads(fields["headers"]), fields["payload"]))
        return out

    async def write(stream: str, headers: dict[str, str], body: bytes) -> None:
        # A producer that writes one field per header and the body as ``data``.
        await client.xadd(stream, {**headers, "data": body})

    side = Side(broker, mode, read, write)
    try:
        yield side
    finally:
        await broker.aclose()
        for stream in side.streams:
            await client.delete(stream)
            async for k in client.scan_iter(match=f"outbox:dedup:{{{stream}}}:*", count=1000):
                await client.delete(k)
        await client.aclose()


@contextlib.asynccontextmanager
async def _nats(url: str, mode: CloudEventsMode) -> AsyncIterator[Side]:
    import nats

    from fastapi_outbox.brokers import NatsJetStreamBroker
    from fastapi_outbox.brokers.nats.wire import stream_name_for

    nc = await nats.connect(url)
    js = nc.jetstream()
    broker = NatsJetStreamBroker(
        url, envelope="cloudevents", cloudevents_mode=mode, cloudevents_source=SOURCE
    )

    async def read(stream: str) -> list[RawMessage]:
        name = await js.find_stream_name_by_subject(stream)
        info = await js.stream_info(name)
        out = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            msg = await js.get_msg(name, seq)
            headers = {k: v for k, v in (msg.headers or {}).items() if not k.startswith("Nats-")}
            out.append((headers, msg.data or b""))
        return out

    async def write(stream: str, headers: dict[str, str], body: bytes) -> None:
        await broker.connect()
        await broker.ensure_stream(stream)  # a stream captures the subject
        await js.publish(stream, body, headers=headers)

    side = Side(broker, mode, read, write)
    try:
        yield side
    finally:
        await broker.aclose()
        names = {stream_name_for(s) for s in side.streams}
        for info in await js.streams_info():
            if any(info.config.name.startswith(n) for n in names):
                with contextlib.suppress(Exception):
                    await js.delete_stream(info.config.name)
        await nc.close()


@contextlib.asynccontextmanager
async def _rabbitmq(url: str, mode: CloudEventsMode) -> AsyncIterator[Side]:
    """The broker on an exchange of this test's own; a queue of the test's own bound with
    ``#`` holds what it publishes, read back as the RabbitMQ binding's message."""
    import aio_pika

    from fastapi_outbox.brokers import RabbitMQBroker

    exchange = unique("ce_x")
    broker = RabbitMQBroker(
        url,
        exchange=exchange,
        envelope="cloudevents",
        cloudevents_mode=mode,
        cloudevents_source=SOURCE,
    )
    conn = await aio_pika.connect(url)
    channel = await conn.channel(publisher_confirms=True)
    x = await channel.declare_exchange(exchange, "topic", durable=True)
    tap = await channel.declare_queue(unique("ce_tap"), durable=True)
    await tap.bind(x, routing_key="#")
    seen: dict[str, list[RawMessage]] = {}

    async def read(stream: str) -> list[RawMessage]:
        while (m := await tap.get(no_ack=True, fail=False)) is not None:
            headers = {k: str(v) for k, v in (m.headers or {}).items()}
            if m.content_type:
                headers["content-type"] = m.content_type
            seen.setdefault(str(m.routing_key), []).append((headers, m.body))
        return seen.get(stream, [])

    async def write(stream: str, headers: dict[str, str], body: bytes) -> None:
        # A producer on the RabbitMQ binding: ce-* headers, content type as the property.
        content_type = headers.get("content-type")
        await x.publish(
            aio_pika.Message(
                body,
                content_type=content_type,
                headers={k: v for k, v in headers.items() if k != "content-type"},
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            ),
            routing_key=stream,
        )

    side = Side(broker, mode, read, write)
    try:
        yield side
    finally:
        await broker.aclose()
        for stream in side.streams:
            for name in (f"{stream}.payments", f"{stream}.payments.dlq"):
                await channel.queue_delete(name)
        await tap.delete(if_unused=False, if_empty=False)
        await x.delete()
        await conn.close()


KINDS = ["memory", "redis", "nats", "rabbitmq"]
MODES: list[CloudEventsMode] = ["binary", "structured"]


@pytest.fixture(params=[(k, m) for k in KINDS for m in MODES], ids=lambda p: f"{p[0]}-{p[1]}")
async def side(request: pytest.FixtureRequest) -> AsyncIterator[Side]:
    kind, mode = request.param
    if kind == "memory":
        async with _memory(mode) as s:
            yield s
    elif kind == "redis":
        async with _redis(str(request.getfixturevalue("redis_url")), mode) as s:
            yield s
    elif kind == "nats":
        async with _nats(str(request.getfixturevalue("nats_url")), mode) as s:
            yield s
    else:
        async with _rabbitmq(str(request.getfixturevalue("rabbitmq_url")), mode) as s:
            yield s


def _envelope(stream: str, n: int) -> Envelope:
    message_id = str(uuid7())
    return Envelope(
        id=str(uuid7()),  # the row id: another id than the message's, as for a second broker
        stream=stream,
        type="OrderPlaced",
        key=f"order-{n}",
        payload=json.dumps({"order_id": n}).encode(),
        headers={
            "message-id": message_id,
            "type": "OrderPlaced",
            "occurred-at": f"2026-11-25T17:00:0{n}.000001+00:00",
            "correlation-id": f"corr-{n}",
        },
    )


async def test_published_messages_are_cloudevents_the_sdk_parses(side: Side) -> None:
    stream = side.stream()
    sent = [_envelope(stream, 0), _envelope(stream, 1)]
    await side.broker.connect()

    assert await side.broker.publish(sent) == [None, None]

    raw = await side.read(stream)
    assert len(raw) == 2
    for (headers, body), e in zip(raw, sent, strict=True):
        event = from_http(headers, body)
        assert event["specversion"] == "1.0"
        assert event["id"] == e.message_id
        assert event["type"] == "OrderPlaced"
        assert event["time"] == e.headers["occurred-at"]
        assert event["subject"] == stream
        assert event["source"] == SOURCE
        assert event["datacontenttype"] == "application/json"
        assert event["correlationid"] == e.headers["correlation-id"]
        assert event["partitionkey"] == e.key
        assert event.data == json.loads(e.payload)


async def test_a_subscriber_handles_foreign_cloudevents_once(side: Side, sqlite_url: str) -> None:
    """The foreign producer writes in the mode of the side (its broker publishes too, but
    a consumer reads either mode whatever its broker's own envelope)."""
    writer = to_binary if side.mode == "binary" else to_structured
    stream = side.stream()
    outbox = Outbox(sqlite_url, brokers={"default": side.broker}, settings=OutboxSettings(**FAST))
    async with outbox.engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    await outbox.create_tables()
    seen: list[Message] = []

    async def pay(message: Message, uow: UnitOfWork) -> None:
        seen.append(message)
        uow.session.add(
            Payment(invoice=message.payload["invoice"], message_id=message.headers["message-id"])
        )

    outbox.subscriber(stream, group="payments", start="all")(pay)
    subscriber = outbox.subscribers[0]
    ids: list[str] = []
    events = [
        CloudEvent(
            {
                "type": "com.example.invoice.paid",
                "source": "https://billing.example.com",
                "id": f"inv-{uuid7()}",
                "time": "2026-11-25T12:00:00Z",
                "subject": "invoices",
                "correlationid": "c-9",
            },
            {"invoice": n},
        )
        for n in range(2)
    ]
    async with outbox.relaying():
        for event in events:
            ids.append(event["id"])
            await side.write(stream, *writer(event))
            await wait_until(lambda: subscriber.stats.handled >= len(ids), timeout=10)
        # The first event again: same id, a new entry; the inbox skips it.
        await side.write(stream, *writer(events[0]))
        await wait_until(lambda: subscriber.stats.duplicates >= 1, timeout=10)

    async with outbox.engine.connect() as conn:
        rows = await conn.execute(
            select(Payment.message_id, func.count()).group_by(Payment.message_id)
        )
        assert {m: int(n) for m, n in rows} == {ids[0]: 1, ids[1]: 1}
    assert [m.payload for m in seen] == [{"invoice": 0}, {"invoice": 1}]
    for message in seen:
        assert message.type == "com.example.invoice.paid"
        assert message.headers["occurred-at"] == "2026-11-25T12:00:00Z"
        assert message.headers["correlation-id"] == "c-9"
        assert message.headers["ce-source"] == "https://billing.example.com"
    assert await outbox.inbox.contains("payments", ids[0])
    await outbox.aclose()

"""One contract, every broker: MemoryBroker, RedisStreamsBroker, NatsJetStreamBroker,
RabbitMQBroker and KafkaBroker.

Each broker is driven through the ``Broker`` protocol only, and what it published is read
back from the real server (XRANGE on Redis, the JetStream stream on NATS, a queue bound to
the test's own exchange on RabbitMQ, the topic's partitions on Kafka), never from the broker
object itself.
Broker-specific guarantees (stream creation and acknowledgement on NATS, MAXLEN on Redis,
unroutable messages on RabbitMQ, URL parsing) follow the shared contract.

Adding a broker (as faststream's ``tests/brokers/base`` is subclassed per broker): write
one async generator ``<name>_harness(request)`` that yields a :class:`Harness` — the
broker, ``read`` (what landed on a stream, read from the server with its own client),
``fresh`` (a new broker object on the same server), ``poison`` (an envelope the server
refuses on its own) — and cleans up its streams afterwards; then add it to
:data:`HARNESSES`. Every ``harness`` test then runs against it unchanged; tests of one
broker's own guarantees go below the shared ones, named ``test_<name>_…``.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import nats
import nats.errors
import nats.js.errors
import pytest
import redis.asyncio as aioredis

from fastapi_outbox import exceptions
from fastapi_outbox.brokers import (
    Broker,
    KafkaBroker,
    MemoryBroker,
    NatsJetStreamBroker,
    RabbitMQBroker,
    RedisStreamsBroker,
    broker_from_url,
)
from fastapi_outbox.brokers.nats.wire import stream_name_for
from fastapi_outbox.events import Envelope, uuid7
from tests.conftest import unique
from tests.servers import any_free_port

TWO_MB = 2 * 1024 * 1024


@dataclass
class Received:
    """A message as a consumer of the real stream sees it."""

    id: str
    type: str
    key: str | None
    headers: dict[str, str]
    payload: bytes


@dataclass
class Harness:
    """A broker under test, plus ways to look into its server."""

    kind: str
    broker: Broker
    #: Everything on ``stream``, in stream order, read from the server.
    read: Callable[[str], Awaitable[list[Received]]]
    #: A new broker object for the same server (a restarted relay process).
    fresh: Callable[[], Broker]
    #: An envelope this broker refuses on its own (the rest of its batch still goes out).
    poison: Callable[[], Awaitable[Envelope]]
    #: A broker object of this kind whose server cannot be reached.
    unreachable: Callable[[], Broker]
    streams: list[str] = field(default_factory=list)
    #: The server drops a republished envelope (Redis, NATS); RabbitMQ has no
    #: de-duplication: the copy arrives with the same message id and the inbox skips it.
    dedups: bool = True
    #: Before every stream name (RabbitMQ: the words its catch-all binding matches).
    stream_prefix: str = ""

    def stream(self) -> str:
        name = self.stream_prefix + unique("orders")
        self.streams.append(name)
        return name


def envelope(
    stream: str, n: int, *, key: str | None = None, payload: bytes | None = None
) -> Envelope:
    message_id = str(uuid7())
    return Envelope(
        id=message_id,
        stream=stream,
        type="OrderPlaced",
        key=key,
        payload=payload if payload is not None else json.dumps({"n": n}).encode(),
        headers={
            "message-id": message_id,
            "type": "OrderPlaced",
            "correlation-id": f"corr-{n}",
            "x-tenant": "acme",
        },
    )


async def memory_harness(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    broker = MemoryBroker(
        reject=lambda e: (
            exceptions.MessageRejected(f"message {e.id} refused") if e.type == "Poison" else None
        )
    )

    async def read(stream: str) -> list[Received]:
        return [
            Received(e.id, e.type, e.key, e.headers, e.payload) for e in broker.on_stream(stream)
        ]

    async def poison() -> Envelope:
        e = envelope(unique("poison"), 0)
        e.type = "Poison"
        return e

    def unreachable() -> Broker:
        down = MemoryBroker()
        down.available = False
        return down

    yield Harness("memory", broker, read, lambda: broker, poison, unreachable)


async def redis_harness(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    url = str(request.getfixturevalue("redis_url"))
    client = aioredis.Redis.from_url(url)
    harness: Harness
    read = redis_harness_reader(client)

    async def poison() -> Envelope:
        # A key of the wrong type: XADD answers WRONGTYPE for this message only.
        stream = harness.stream()
        await client.set(stream, "not a stream")
        return envelope(stream, 0)

    harness = Harness(
        "redis",
        RedisStreamsBroker(url),
        read,
        lambda: RedisStreamsBroker(url),
        poison,
        lambda: RedisStreamsBroker(f"redis://u:secret@127.0.0.1:{any_free_port()}/0"),
    )
    try:
        yield harness
    finally:
        await harness.broker.aclose()
        for stream in harness.streams:
            await client.delete(stream)
            async for k in client.scan_iter(match=f"outbox:dedup:{{{stream}}}:*", count=1000):
                await client.delete(k)
        await client.aclose()


async def redis_cluster_harness(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    """The Redis broker on the session's private Redis Cluster (``redis+cluster://`` with
    every node): the streams of one test land on any of its three masters."""
    from redis.asyncio.cluster import RedisCluster

    url = request.getfixturevalue("redis_cluster").url
    client = RedisCluster.from_url(url.replace("redis+cluster://", "redis://").split(",")[0])
    inner = redis_harness_reader(client)
    harness: Harness

    async def poison() -> Envelope:
        stream = harness.stream()
        await client.set(stream, "not a stream")  # WRONGTYPE for this message only
        return envelope(stream, 0)

    harness = Harness(
        "redis-cluster",
        RedisStreamsBroker(url, wait_replicas=1),  # each master's replica has the writes
        inner,
        lambda: RedisStreamsBroker(url),
        poison,
        lambda: RedisStreamsBroker(f"redis+cluster://u:secret@127.0.0.1:{any_free_port()}"),
    )
    try:
        yield harness
    finally:
        await harness.broker.aclose()
        for stream in harness.streams:
            await client.delete(stream)
        await client.aclose()


def redis_harness_reader(client: Any) -> Callable[[str], Awaitable[list[Received]]]:
    """What landed on a Redis stream, read with ``client`` (a single node or a cluster)."""

    async def read(stream: str) -> list[Received]:
        out = []
        for _entry_id, raw in await client.xrange(stream, "-", "+"):
            fields = {k.decode(): v for k, v in raw.items()}
            out.append(
                Received(
                    id=fields["id"].decode(),
                    type=fields["type"].decode(),
                    key=fields["key"].decode() or None,
                    headers=json.loads(fields["headers"]),
                    payload=fields["payload"],
                )
            )
        return out

    return read


async def nats_harness(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    url = str(request.getfixturevalue("nats_url"))
    nc = await nats.connect(url)
    jsm = nc.jsm()

    async def read(stream: str) -> list[Received]:
        name = await jsm.find_stream_name_by_subject(stream)
        info = await jsm.stream_info(name)
        out = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            msg = await jsm.get_msg(name, seq)
            headers = dict(msg.headers or {})
            assert headers.pop("Nats-Msg-Id") == headers["message-id"]
            key = headers.pop("key", None)
            assert msg.data is not None
            out.append(Received(headers["message-id"], headers["type"], key, headers, msg.data))
        return out

    async def poison() -> Envelope:
        return envelope(harness.stream(), 0, payload=b"x" * TWO_MB)

    harness = Harness(
        "nats",
        NatsJetStreamBroker(url),
        read,
        lambda: NatsJetStreamBroker(url),
        poison,
        # Nothing listens there: the first connect is refused until its timeout (2 s by
        # default, for each of the test's two calls).
        lambda: NatsJetStreamBroker(
            f"nats://u:secret@127.0.0.1:{any_free_port()}", connect_timeout_seconds=0.5
        ),
    )
    try:
        yield harness
    finally:
        await harness.broker.aclose()
        for stream in harness.streams:
            with contextlib.suppress(nats.js.errors.NotFoundError):
                await jsm.delete_stream(stream_name_for(stream))
        await nc.close()


async def rabbitmq_harness(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    """The broker on an exchange of this test's own; a queue of the test's own bound with
    ``contract.#`` receives every stream the harness names (``contract.orders_…``) and
    none of the poison's (a stream nothing is bound to: returned unroutable)."""
    import aio_pika

    url = str(request.getfixturevalue("rabbitmq_url"))
    from fastapi_outbox.brokers.rabbitmq.wire import user_headers

    exchange = unique("contract_x")
    conn = await aio_pika.connect(url)
    channel = await conn.channel()
    x = await channel.declare_exchange(exchange, "topic", durable=True)
    queue = await channel.declare_queue(unique("contract_q"), durable=True)
    await queue.bind(x, routing_key="contract.#")
    seen: dict[str, list[Received]] = {}

    async def read(stream: str) -> list[Received]:
        while (m := await queue.get(no_ack=True, fail=False)) is not None:
            headers = m.headers or {}
            key = headers.get("key")
            assert m.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
            assert m.message_id == headers["message-id"] and m.type == headers["type"]
            received = Received(
                id=str(m.message_id),
                type=str(m.type),
                key=str(key) if key is not None else None,
                headers=user_headers(headers),
                payload=m.body,
            )
            seen.setdefault(str(m.routing_key), []).append(received)
        return seen.get(stream, [])

    async def poison() -> Envelope:
        return envelope(unique("unbound"), 0)

    def fresh() -> Broker:
        return RabbitMQBroker(url, exchange=exchange)

    harness = Harness(
        "rabbitmq",
        fresh(),
        read,
        fresh,
        poison,
        lambda: RabbitMQBroker(f"amqp://u:secret@127.0.0.1:{any_free_port()}/"),
        dedups=False,
        stream_prefix="contract.",
    )
    try:
        yield harness
    finally:
        await harness.broker.aclose()
        await queue.delete(if_unused=False, if_empty=False)
        await x.delete()
        await conn.close()


async def kafka_harness(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    """The broker on the session's Kafka-protocol server, its topics of one partition (the
    contract reads a stream back in order; Kafka keeps order per partition, so per key)."""
    from aiokafka import AIOKafkaConsumer
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.structs import TopicPartition

    from fastapi_outbox.brokers import KafkaBroker
    from fastapi_outbox.brokers.kafka.wire import bootstrap_servers, header_dict

    url = str(request.getfixturevalue("kafka_url"))
    servers = bootstrap_servers(url)

    async def read(stream: str) -> list[Received]:
        reader = AIOKafkaConsumer(bootstrap_servers=servers, enable_auto_commit=False)
        await reader.start()
        try:
            partitions = reader.partitions_for_topic(stream) or set()
            if not partitions:
                await reader._client.force_metadata_update()
                partitions = reader.partitions_for_topic(stream) or set()
            tps = [TopicPartition(stream, p) for p in sorted(partitions)]
            reader.assign(tps)
            await reader.seek_to_beginning(*tps)
            ends = await reader.end_offsets(tps)
            out: list[Received] = []
            for tp in tps:
                while await reader.position(tp) < ends[tp]:
                    for record in (await reader.getmany(tp, timeout_ms=2000)).get(tp, []):
                        headers = header_dict(record.headers)
                        key = record.key.decode() if record.key is not None else None
                        value = record.value or b""
                        out.append(
                            Received(headers["message-id"], headers["type"], key, headers, value)
                        )
            return out
        finally:
            await reader.stop()

    async def poison() -> Envelope:
        # Over the producer's max_request_bytes (1 MiB, Kafka's default message.max.bytes).
        return envelope(harness.stream(), 0, payload=b'"' + b"x" * TWO_MB + b'"')

    def fresh() -> Broker:
        return KafkaBroker(url, topic_partitions=1)

    harness = Harness(
        "kafka",
        fresh(),
        read,
        fresh,
        poison,
        lambda: KafkaBroker(
            f"kafka://u:secret@127.0.0.1:{any_free_port()}", request_timeout_seconds=2
        ),
        dedups=False,  # a send repeated by the relay is a new record: the inbox skips it
    )
    try:
        yield harness
    finally:
        await harness.broker.aclose()
        admin = AIOKafkaAdminClient(bootstrap_servers=servers)
        await admin.start()
        with contextlib.suppress(Exception):
            await admin.delete_topics(harness.streams)
        await admin.close()


#: Every broker the shared contract runs against: one entry per broker.
HARNESSES: dict[str, Callable[[pytest.FixtureRequest], AsyncIterator[Harness]]] = {
    "memory": memory_harness,
    "redis": redis_harness,
    "redis-cluster": redis_cluster_harness,
    "nats": nats_harness,
    "rabbitmq": rabbitmq_harness,
    "kafka": kafka_harness,
}


@pytest.fixture(params=list(HARNESSES))
async def harness(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    gen = HARNESSES[request.param](request)
    h = await anext(gen)
    try:
        yield h
    finally:
        await anext(gen, None)


def assert_landed(received: list[Received], sent: list[Envelope]) -> None:
    assert [r.id for r in received] == [e.id for e in sent]
    for r, e in zip(received, sent, strict=True):
        assert r.type == e.type
        assert r.key == e.key
        assert r.headers == e.headers
        assert json.loads(r.payload) == json.loads(e.payload)


# -- the shared contract ----------------------------------------------------------------------


async def test_batch_gives_one_result_per_message_and_lands_in_order(harness: Harness) -> None:
    a, b = harness.stream(), harness.stream()
    batch = [envelope(a, 0, key="k1"), envelope(b, 1), envelope(a, 2, key="k2"), envelope(a, 3)]
    await harness.broker.connect()

    results = await harness.broker.publish(batch)

    assert results == [None, None, None, None]
    assert_landed(await harness.read(a), [batch[0], batch[2], batch[3]])
    assert_landed(await harness.read(b), [batch[1]])
    assert await harness.broker.publish([]) == []


async def test_republishing_an_envelope_adds_no_duplicate(harness: Harness) -> None:
    stream = harness.stream()
    batch = [envelope(stream, n, key="k") for n in range(3)]
    await harness.broker.connect()
    assert await harness.broker.publish(batch) == [None] * 3

    # The relay crashed before marking: the same envelopes come again, from the same
    # broker object and from a new one (a restarted process), partly mixed with a new one.
    again = await harness.broker.publish(batch[1:])
    other = harness.fresh()
    try:
        await other.connect()
        extra = envelope(stream, 3)
        from_new_process = await other.publish([batch[0], extra])
    finally:
        if other is not harness.broker:
            await other.aclose()

    assert again == [None, None]  # a duplicate is a success, not an error
    assert from_new_process == [None, None]
    if harness.dedups:
        assert_landed(await harness.read(stream), [*batch, extra])
    else:  # each copy carries the message id its consumers' inbox skips it by
        assert_landed(await harness.read(stream), [*batch, *batch[1:], batch[0], extra])


async def test_a_refused_message_fails_alone(harness: Harness) -> None:
    stream = harness.stream()
    poison = await harness.poison()
    batch = [envelope(stream, 0), poison, envelope(stream, 2)]
    await harness.broker.connect()

    results = await harness.broker.publish(batch)

    assert results[0] is None
    assert isinstance(results[1], exceptions.MessageRejected)
    assert poison.id in str(results[1])  # the error names the message, never its payload
    assert results[2] is None
    assert_landed(await harness.read(stream), [batch[0], batch[2]])


async def test_connect_and_aclose_are_idempotent(harness: Harness) -> None:
    broker = harness.broker
    stream = harness.stream()
    await broker.ping()  # before connect: the broker connects to answer
    await broker.connect()
    await broker.connect()
    await broker.ping()
    await broker.aclose()
    await broker.aclose()
    await broker.connect()  # usable again after a close (a lifespan restarted)
    first = envelope(stream, 0)
    assert await broker.publish([first]) == [None]
    await broker.aclose()
    second = envelope(stream, 1)
    assert await broker.publish([second]) == [None]  # publish connects on demand
    assert_landed(await harness.read(stream), [first, second])


async def test_an_unreachable_broker_raises_broker_unavailable(harness: Harness) -> None:
    """Ping and publish on a broker whose server cannot be reached raise BrokerUnavailable
    (no per-message results: nothing is charged to a message), and the error never shows
    the URL's password."""
    broker = harness.unreachable()
    stream = harness.stream()
    try:
        with pytest.raises(exceptions.BrokerUnavailable) as caught:
            await broker.ping()
        assert "secret" not in str(caught.value)
        with pytest.raises(exceptions.BrokerUnavailable) as caught:
            await broker.publish([envelope(stream, 0)])
        assert "secret" not in str(caught.value)
    finally:
        await broker.aclose()


async def test_broker_satisfies_the_protocol(harness: Harness) -> None:
    assert isinstance(harness.broker, Broker)


# -- URLs ---------------------------------------------------------------------------------------


def test_broker_from_url_picks_the_implementation() -> None:
    assert isinstance(broker_from_url("memory://"), MemoryBroker)
    redis_broker = broker_from_url("redis://:secret@127.0.0.1:6379/0", maxlen=10)
    assert isinstance(redis_broker, RedisStreamsBroker)
    assert redis_broker.maxlen == 10
    assert "secret" not in repr(redis_broker)
    assert isinstance(broker_from_url("rediss://127.0.0.1:6380/1"), RedisStreamsBroker)
    nats_broker = broker_from_url("nats://user:secret@127.0.0.1:4222", create_streams=False)
    assert isinstance(nats_broker, NatsJetStreamBroker)
    assert nats_broker.create_streams is False
    assert "secret" not in repr(nats_broker)
    rabbit = broker_from_url("amqp://user:secret@127.0.0.1:5672/", exchange="events")
    assert isinstance(rabbit, RabbitMQBroker)
    assert rabbit.exchange == "events"
    assert "secret" not in repr(rabbit)
    assert isinstance(broker_from_url("amqps://127.0.0.1:5671/vhost"), RabbitMQBroker)
    kafka = broker_from_url("kafka://127.0.0.1:9092,127.0.0.1:9093", topic_partitions=6)
    assert isinstance(kafka, KafkaBroker)
    assert kafka.connection.servers == ["127.0.0.1:9092", "127.0.0.1:9093"]
    assert kafka.connection.topic_partitions == 6


@pytest.mark.parametrize(
    "url", ["pulsar://broker:6650", "http://:secret@localhost", "localhost:6379", ""]
)
def test_broker_from_url_refuses_other_schemes(url: str) -> None:
    with pytest.raises(exceptions.ConfigurationError, match="unsupported broker URL") as info:
        broker_from_url(url)
    assert "memory://" in str(info.value)  # says what is supported
    assert "secret" not in str(info.value)


# -- NATS JetStream -------------------------------------------------------------------------------


@pytest.fixture
async def jsm(nats_url: str) -> AsyncIterator[Any]:
    nc = await nats.connect(nats_url)
    try:
        yield nc.jsm()
    finally:
        await nc.close()


async def test_nats_creates_a_stream_with_a_long_enough_duplicate_window(
    nats_url: str, jsm: Any
) -> None:
    subject = unique("orders")
    broker = NatsJetStreamBroker(nats_url)
    broker.configure(dedup_window_seconds=4321.0)  # what the Outbox passes: lease + backoff
    try:
        assert await broker.publish([envelope(subject, 0)]) == [None]
        name = await jsm.find_stream_name_by_subject(subject)
        info = await jsm.stream_info(name)
        assert subject in info.config.subjects
        assert info.config.duplicate_window >= 4321.0
        assert info.state.messages == 1
    finally:
        await broker.aclose()
        await jsm.delete_stream(stream_name_for(subject))


async def test_nats_created_stream_has_explicit_limits_and_logs_them(
    nats_url: str, jsm: Any, caplog: pytest.LogCaptureFixture
) -> None:
    subject = unique("limited")
    broker = NatsJetStreamBroker(nats_url, stream_max_age_seconds=3600, stream_max_bytes=2**20)
    caplog.set_level("INFO", logger="fastapi_outbox.brokers.nats")
    try:
        assert await broker.publish([envelope(subject, 0)]) == [None]
        info = await jsm.stream_info(stream_name_for(subject))
        assert info.config.max_age == 3600 and info.config.max_bytes == 2**20
        [record] = [
            r for r in caplog.records if r.__dict__.get("action") == "broker.stream_created"
        ]
        assert record.__dict__["max_age_seconds"] == 3600
        assert record.__dict__["max_bytes"] == 2**20
    finally:
        await broker.aclose()
        await jsm.delete_stream(stream_name_for(subject))


async def test_nats_default_stream_limits_are_bounded(nats_url: str, jsm: Any) -> None:
    from fastapi_outbox.brokers.nats import STREAM_MAX_AGE_SECONDS, STREAM_MAX_BYTES

    subject = unique("bounded")
    broker = NatsJetStreamBroker(nats_url)
    try:
        assert await broker.publish([envelope(subject, 0)]) == [None]
        info = await jsm.stream_info(stream_name_for(subject))
        assert info.config.max_age == STREAM_MAX_AGE_SECONDS
        assert info.config.max_bytes == STREAM_MAX_BYTES
    finally:
        await broker.aclose()
        await jsm.delete_stream(stream_name_for(subject))


async def test_nats_publish_no_stream_acknowledges_is_a_failure(nats_url: str, jsm: Any) -> None:
    subject = unique("uncaptured")
    broker = NatsJetStreamBroker(nats_url, create_streams=False, ack_timeout_seconds=3)
    try:
        results = await broker.publish([envelope(subject, 0), envelope(subject, 1)])
    finally:
        await broker.aclose()
    assert all(isinstance(r, exceptions.MessageRejected) for r in results), results
    assert subject in str(results[0])
    with pytest.raises(nats.js.errors.NotFoundError):
        await jsm.find_stream_name_by_subject(subject)  # and none was created behind our back


async def test_nats_user_header_cannot_replace_the_dedup_id(nats_url: str, jsm: Any) -> None:
    subject = unique("orders")
    broker = NatsJetStreamBroker(nats_url)
    first, second = envelope(subject, 0), envelope(subject, 1)
    # Both claim the same Nats-Msg-Id through a user header: JetStream would drop the
    # second if the header won over the envelope id.
    first.headers["Nats-Msg-Id"] = second.headers["Nats-Msg-Id"] = "same"
    try:
        assert await broker.publish([first, second]) == [None, None]
        info = await jsm.stream_info(stream_name_for(subject))
        assert info.state.messages == 2
    finally:
        await broker.aclose()
        await jsm.delete_stream(stream_name_for(subject))


async def test_nats_a_reply_that_is_not_a_jetstream_ack_fails_the_message_at_once(
    nats_url: str, jsm: Any
) -> None:
    """A plain NATS subscriber answering on an uncaptured subject is not JetStream: its
    reply fails the message (well before the ack timeout), never counts as published; a
    captured subject in the same batch is unaffected."""
    captured, impostor = unique("captured"), unique("impostor")
    await jsm.add_stream(name=stream_name_for(captured), subjects=[captured])
    nc = await nats.connect(nats_url)

    async def answer(msg: Any) -> None:
        await msg.respond(b"ok")

    await nc.subscribe(impostor, cb=answer)
    await nc.flush()
    broker: Any = NatsJetStreamBroker(nats_url, create_streams=False, ack_timeout_seconds=5)
    try:
        batch = [envelope(captured, 0), envelope(impostor, 1), envelope(captured, 2)]
        with anyio.fail_after(2):
            results = await broker.publish(batch)
        assert results[0] is None and results[2] is None
        assert isinstance(results[1], exceptions.MessageRejected)
        assert "unexpected reply" in str(results[1]) and batch[1].id in str(results[1])
        assert (await jsm.stream_info(stream_name_for(captured))).state.messages == 2
        assert broker.acks_awaited == 0  # no ack left registered
    finally:
        await broker.aclose()
        await nc.close()
        await jsm.delete_stream(stream_name_for(captured))


async def test_nats_cancelled_publish_leaves_no_ack_awaited(nats_url: str) -> None:
    """A publish cancelled while it waits for acks (the relay's publish timeout)
    leaves nothing registered; the broker publishes normally afterwards."""
    silent, subject = unique("silent"), unique("orders")
    nc = await nats.connect(nats_url)
    await nc.subscribe(silent)  # receives, never replies: no ack, no "no responders"
    await nc.flush()
    broker: Any = NatsJetStreamBroker(nats_url, create_streams=False, ack_timeout_seconds=30)
    try:
        with pytest.raises(TimeoutError):
            with anyio.fail_after(0.5):
                await broker.publish([envelope(silent, n) for n in range(50)])
        assert broker.acks_awaited == 0
        broker.create_streams = True
        assert await broker.publish([envelope(subject, 0)]) == [None]
        assert broker.acks_awaited == 0
    finally:
        await broker.aclose()
        await nc.close()
        with contextlib.suppress(Exception):
            await jsm_delete(nats_url, stream_name_for(subject))


async def test_nats_broker_on_a_callers_client_leaves_no_subscription(nats_url: str) -> None:
    """The broker reads acks on a subscription of its own; on a client the caller passed
    in, ``aclose`` removes it and leaves the client open."""
    subject = unique("orders")
    nc = await nats.connect(nats_url)
    broker: Any = NatsJetStreamBroker(nats_url, client=nc)
    try:
        assert await broker.publish([envelope(subject, 0)]) == [None]
        inbox = broker.ack_subject_prefix + "probe"
        await broker.aclose()
        assert nc.is_connected
        with pytest.raises(nats.errors.NoRespondersError):
            await nc.request(inbox, b"", timeout=2)  # nobody listens there any more
    finally:
        await jsm_delete(nats_url, stream_name_for(subject))
        await nc.close()


@pytest.mark.parametrize("path", ["HPUB batch", "nats-py publish"])
async def test_nats_headers_on_the_wire_follow_nats_rules(
    nats_url: str, jsm: Any, path: str
) -> None:
    """Both ways of sending (a batch of ``HPUB`` commands written to nats-py's buffer, and
    its ``publish`` for a client without that buffer) put the same headers on the wire:
    values trimmed, CR/LF turned into spaces (no protocol injection); a header name NATS
    refuses fails that message only; a subject with whitespace is refused before sending."""
    subject = unique("orders")
    broker: Any = NatsJetStreamBroker(nats_url)
    await broker.connect()
    if path == "nats-py publish":
        broker.connection.use_client_publish()
    good, bad_name, bad_subject = envelope(subject, 0), envelope(subject, 1), envelope("a b", 2)
    good.headers["x-note"] = "  two\r\nlines\r\nPUB evil 1\r\n "
    bad_name.headers["bad name"] = "x"
    try:
        results = await broker.publish([good, bad_name, bad_subject])
        assert results[0] is None
        assert isinstance(results[1], exceptions.MessageRejected)
        assert "bad name" in str(results[1])
        assert isinstance(results[2], exceptions.MessageRejected)
        assert "invalid NATS subject" in str(results[2])
        msg = await jsm.get_last_msg(stream_name_for(subject), subject)
        assert msg.headers["x-note"] == "two  lines  PUB evil 1"
        assert msg.headers["Nats-Msg-Id"] == good.id and msg.headers["type"] == "OrderPlaced"
        assert json.loads(msg.data) == {"n": 0}
        assert (await jsm.stream_info(stream_name_for(subject))).state.messages == 1
    finally:
        await broker.aclose()
        await jsm.delete_stream(stream_name_for(subject))


async def jsm_delete(nats_url: str, stream: str) -> None:
    nc = await nats.connect(nats_url)
    try:
        await nc.jsm().delete_stream(stream)
    finally:
        await nc.close()


# -- Redis Streams ------------------------------------------------------------------------------


async def test_redis_maxlen_trims_the_stream(redis_url: str) -> None:
    stream = unique("orders")
    broker = RedisStreamsBroker(redis_url, maxlen=10)
    client = aioredis.Redis.from_url(redis_url)
    total = 600
    try:
        for start in range(0, total, 200):
            batch = [envelope(stream, n) for n in range(start, start + 200)]
            assert await broker.publish(batch) == [None] * 200
        length = await client.xlen(stream)
        # MAXLEN ~ trims whole stream nodes (100 entries each by default): approximate,
        # but bounded far below what was written.
        assert 10 <= length <= 10 + 200
        last = await client.xrevrange(stream, "+", "-", count=1)
        assert json.loads(last[0][1][b"payload"]) == {"n": total - 1}  # the newest are kept
    finally:
        await broker.aclose()
        await client.delete(stream)
        async for k in client.scan_iter(match=f"outbox:dedup:{{{stream}}}:*", count=1000):
            await client.delete(k)
        await client.aclose()


async def test_redis_wait_replicas_without_replica_is_an_outage(redis_url: str) -> None:
    """``wait_replicas=1`` on a Redis with no replica (the shared test server): the entry is
    written, but the publish is not confirmed: BrokerUnavailable, the batch comes back
    later (and the de-duplication returns the entry written)."""
    stream = unique("waited")
    broker = RedisStreamsBroker(redis_url, wait_replicas=1, wait_timeout_seconds=0.05)
    client = aioredis.Redis.from_url(redis_url)
    try:
        await broker.connect()
        with pytest.raises(exceptions.BrokerUnavailable, match="0 of wait_replicas=1"):
            await broker.publish([envelope(stream, 0)])
        assert await client.xlen(stream) == 1
        with pytest.raises(exceptions.ConfigurationError, match="wait_replicas"):
            RedisStreamsBroker(redis_url, wait_replicas=-1)
    finally:
        await broker.aclose()
        await client.delete(stream)
        async for k in client.scan_iter(match=f"outbox:dedup:{{{stream}}}:*", count=1000):
            await client.delete(k)
        await client.aclose()


async def test_redis_dedup_keys_expire_after_the_configured_window(redis_url: str) -> None:
    stream = unique("orders")
    broker = RedisStreamsBroker(redis_url)
    broker.configure(dedup_window_seconds=777.0)
    client = aioredis.Redis.from_url(redis_url)
    e = envelope(stream, 0)
    try:
        assert await broker.publish([e]) == [None]
        ttl = await client.ttl(f"outbox:dedup:{{{stream}}}:{e.id}")
        assert 700 < ttl <= 777
    finally:
        await broker.aclose()
        await client.delete(stream, f"outbox:dedup:{{{stream}}}:{e.id}")
        await client.aclose()


# -- RabbitMQ -------------------------------------------------------------------------------------


@pytest.fixture
async def amqp_channel(rabbitmq_url: str) -> AsyncIterator[Any]:
    import aio_pika

    conn = await aio_pika.connect(rabbitmq_url)
    try:
        yield await conn.channel()
    finally:
        await conn.close()


@pytest.mark.parametrize("batch_frames", [True, False], ids=["one write", "per message"])
async def test_rabbitmq_unroutable_message_fails_with_a_clear_error(
    rabbitmq_url: str, amqp_channel: Any, batch_frames: bool
) -> None:
    """``mandatory``: a message no queue is bound to is returned, and fails by itself
    with the stream named, never silently dropped; the routed ones of its batch go — the
    batch written as one buffer or published message by message."""
    exchange, routed, unbound = unique("rx"), unique("routed"), unique("unbound")
    broker = RabbitMQBroker(rabbitmq_url, exchange=exchange)
    broker.batch_frames = batch_frames
    await broker.connect()
    queue = await amqp_channel.declare_queue(unique("rq"), durable=True)
    await queue.bind(exchange, routing_key=routed)
    long_name = envelope(routed, 3)
    long_name.headers["h" * 300] = "x"
    try:
        batch = [envelope(routed, 0), envelope(unbound, 1), envelope(routed, 2), long_name]
        results = await broker.publish(batch)
        assert results[0] is None and results[2] is None
        assert isinstance(results[1], exceptions.MessageRejected)
        assert f"no queue bound for stream {unbound!r}" in str(results[1])
        assert batch[1].id in str(results[1])
        assert isinstance(results[3], exceptions.MessageRejected)
        assert "header name" in str(results[3])
        m = await queue.get(no_ack=True)
        assert m.correlation_id == "corr-0" and m.content_type == "application/json"
        assert m.timestamp is None  # no occurred-at header in these envelopes
        assert (await queue.get(no_ack=True)).message_id == batch[2].headers["message-id"]
        assert await queue.get(no_ack=True, fail=False) is None
    finally:
        await broker.aclose()
        await queue.delete(if_unused=False, if_empty=False)
        await amqp_channel.exchange_delete(exchange)


async def test_rabbitmq_group_queue_is_quorum_and_ordered_is_single_active_consumer(
    rabbitmq_url: str, amqp_channel: Any
) -> None:
    """A group's queue is a durable quorum queue bound to its stream; ``ordered=True``
    declares it single-active-consumer, and a queue that exists with other arguments
    refuses the start naming the setting."""
    import aiormq.exceptions

    from fastapi_outbox.brokers.consumer import ConsumerConfig

    exchange, stream = unique("rx"), unique("orders")
    broker = RabbitMQBroker(rabbitmq_url, exchange=exchange)

    def config(ordered: bool) -> ConsumerConfig:
        return ConsumerConfig(
            stream=stream,
            group="billing",
            consumer_name="c1",
            dead_letter=f"{stream}.billing.dlq",
            claim_idle_seconds=30,
            max_attempts=3,
            ordered=ordered,
        )

    try:
        ordered = broker.consumer(config(ordered=True))
        await ordered.setup()
        await ordered.setup()  # idempotent
        # Passive declares of what exists; a different argument is refused by RabbitMQ.
        await amqp_channel.declare_queue(f"{stream}.billing", passive=True)
        await amqp_channel.declare_queue(f"{stream}.billing.dlq", passive=True)
        with pytest.raises(aiormq.exceptions.ChannelPreconditionFailed):
            await amqp_channel.declare_queue(
                f"{stream}.billing",
                durable=True,
                arguments={"x-queue-type": "quorum", "x-single-active-consumer": False},
            )
        unordered = broker.consumer(config(ordered=False))
        with pytest.raises(exceptions.ConfigurationError, match="single-active-consumer"):
            await unordered.setup()
        assert await broker.publish([envelope(stream, 0)]) == [None]  # bound: routable
        assert (await ordered.lag()).lag == 1
    finally:
        await broker.aclose()
        import aio_pika

        conn = await aio_pika.connect(rabbitmq_url)
        channel = await conn.channel()
        for name in (f"{stream}.billing", f"{stream}.billing.dlq"):
            await channel.queue_delete(name)
        await channel.exchange_delete(exchange)
        await conn.close()


async def test_rabbitmq_ordered_group_has_one_active_consumer_across_processes(
    rabbitmq_url: str,
) -> None:
    """``ordered=True``: two consumers of the group (two processes) — only the first gets
    deliveries, in stream order; when it goes away, its unacknowledged delivery and the
    rest go to the second, still in order."""
    from fastapi_outbox.brokers.consumer import ConsumerConfig

    exchange, stream = unique("rx"), unique("orders")
    config = ConsumerConfig(
        stream=stream,
        group="billing",
        consumer_name="c",
        dead_letter=f"{stream}.billing.dlq",
        claim_idle_seconds=30,
        max_attempts=3,
        ordered=True,
        prefetch=10,
    )
    first_broker = RabbitMQBroker(rabbitmq_url, exchange=exchange)
    second_broker = RabbitMQBroker(rabbitmq_url, exchange=exchange)
    first, second = first_broker.consumer(config), second_broker.consumer(config)
    try:
        await first.setup()
        assert await first.fetch(1, 0.2) == []  # consuming, first in line
        assert await second.fetch(1, 0.2) == []
        batch = [envelope(stream, n, key="k") for n in range(4)]
        assert await first_broker.publish(batch) == [None] * 4
        got = []
        for _ in range(20):
            got += await first.fetch(4 - len(got), 0.5)
            if len(got) >= 4:
                break
        assert [d.message_id for d in got] == [e.id for e in batch]
        assert await second.fetch(4, 0.5) == []  # not the active consumer
        await first.ack(got[:2])
        await first.aclose()  # the process goes away: the rest move to the second
        moved = []
        for _ in range(20):
            moved += await second.fetch(2 - len(moved), 0.5)
            if len(moved) >= 2:
                break
        assert [d.message_id for d in moved] == [e.id for e in batch[2:]]
        assert [d.attempt for d in moved] == [2, 2]  # the first delivery counted
        await second.ack(moved)
    finally:
        await first.aclose()
        await second.aclose()
        await first_broker.aclose()
        await second_broker.aclose()
        import aio_pika

        conn = await aio_pika.connect(rabbitmq_url)
        channel = await conn.channel()
        for name in (f"{stream}.billing", f"{stream}.billing.dlq"):
            await channel.queue_delete(name)
        await channel.exchange_delete(exchange)
        await conn.close()


# -- Kafka ----------------------------------------------------------------------------------------


async def _kafka_records(url: str, topic: str) -> list[Any]:
    """Every record of ``topic``, partition by partition, read to the end."""
    from aiokafka import AIOKafkaConsumer

    from fastapi_outbox.brokers.kafka.wire import bootstrap_servers

    reader = AIOKafkaConsumer(bootstrap_servers=bootstrap_servers(url), enable_auto_commit=False)
    await reader.start()
    try:
        from aiokafka.structs import TopicPartition

        await reader._client.force_metadata_update()
        tps = [TopicPartition(topic, p) for p in sorted(reader.partitions_for_topic(topic) or [])]
        reader.assign(tps)
        await reader.seek_to_beginning(*tps)
        out: list[Any] = []
        while batches := await reader.getmany(timeout_ms=500):
            out += [r for records in batches.values() for r in records]
        return out
    finally:
        await reader.stop()


async def test_kafka_key_is_the_record_key_and_headers_follow_the_rules(kafka_url: str) -> None:
    """The key is the Kafka key (one partition per key, in order); message id, type,
    correlation and the user's headers are record headers (UTF-8); a user header named
    ``key`` is a header like any other, never the record key."""
    topic = unique("orders")
    broker = KafkaBroker(kafka_url, topic_partitions=3)
    batch = [envelope(topic, n, key=f"k{n % 2}") for n in range(6)]
    batch[0].headers["x-note"] = "é ok"
    batch[1].headers = {**batch[1].headers, "key": "not-the-key"}
    try:
        assert await broker.publish(batch) == [None] * 6
        records = await _kafka_records(kafka_url, topic)
    finally:
        await broker.aclose()
    assert len(records) == 6
    by_id = {dict(r.headers)["message-id"].decode(): r for r in records}
    assert set(by_id) == {e.id for e in batch}
    for e in batch:
        r = by_id[e.id]
        headers = {k: v.decode() for k, v in r.headers}
        assert r.key == e.key.encode() and headers["type"] == "OrderPlaced"  # type: ignore[union-attr]
        assert headers["correlation-id"] == e.headers["correlation-id"]
        assert json.loads(r.value) == json.loads(e.payload)
    assert {k: v.decode() for k, v in by_id[batch[0].id].headers}["x-note"] == "é ok"
    assert dict(by_id[batch[1].id].headers)["key"] == b"not-the-key"
    assert by_id[batch[1].id].key == b"k1"
    for key in ("k0", "k1"):  # one partition per key, in publish order
        mine = [r for r in records if r.key == key.encode()]
        assert len({r.partition for r in mine}) == 1
        order = [
            dict(r.headers)["message-id"].decode() for r in sorted(mine, key=lambda r: r.offset)
        ]
        assert order == [e.id for e in batch if e.key == key]


async def test_kafka_idempotence_is_detected_not_assumed(kafka_url: str) -> None:
    """Tansu 0.6 answers InitProducerId with UnknownError: the broker produces without
    idempotence (and says so); asking for it refuses the connect with the reason."""
    detected = KafkaBroker(kafka_url)
    required = KafkaBroker(kafka_url, idempotence=True)
    try:
        await detected.connect()
        assert detected.idempotent is False
        with pytest.raises(exceptions.ConfigurationError, match="idempotent producer"):
            await required.connect()
    finally:
        await detected.aclose()
        await required.aclose()


async def test_kafka_message_over_the_size_limit_names_the_claim_check(kafka_url: str) -> None:
    topic = unique("orders")
    broker = KafkaBroker(kafka_url, max_request_bytes=10_000)
    batch = [envelope(topic, 0), envelope(topic, 1, payload=b'"' + b"x" * 20_000 + b'"')]
    try:
        results = await broker.publish(batch)
    finally:
        await broker.aclose()
    assert results[0] is None
    assert isinstance(results[1], exceptions.MessageRejected)
    assert batch[1].id in str(results[1]) and "claim check" in str(results[1])


def test_kafka_options_are_checked() -> None:
    with pytest.raises(exceptions.ConfigurationError, match="topic_name"):
        KafkaBroker("kafka://127.0.0.1:9092", topic_name="orders")
    with pytest.raises(exceptions.ConfigurationError, match="heartbeat_interval_seconds"):
        KafkaBroker(
            "kafka://127.0.0.1:9092", session_timeout_seconds=2, heartbeat_interval_seconds=3
        )
    with pytest.raises(exceptions.ConfigurationError, match="not a kafka:// URL"):
        KafkaBroker("redis://127.0.0.1:9092")
    assert (
        broker_from_url("kafka://h:1?session_timeout_seconds=4").connection.session_timeout_seconds
        == 4
    )  # type: ignore[attr-defined]

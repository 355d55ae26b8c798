"""A message that makes the broker hang, while the broker answers everything else.

Issue 23: a publish that outlasts ``publish_timeout_seconds`` was always taken for a broker
outage (batch given back, attempts refunded, table_relay paused), so one message the broker
never answers stalled its batch and its table_relay forever. Now a timed-out publish is
followed by a ping: a broker that does not answer it is an outage as before (a whole
broker frozen with SIGSTOP: ``tests/acceptance/test_hangs.py``); a broker that answers
makes the batch go out message by message, and the message that times out alone is
charged an attempt, backs off, and is abandoned after ``max_attempts`` with a last_error
naming it. Its batch-mates are published without being charged.

The hang is staged in front of a real Redis and a real NATS JetStream (the shared servers
are not touched: the stall is in the test's own broker wrapper, which never sends the
poison message, while pings go to the server).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Sequence
from typing import Any

import anyio
import pytest
import redis.asyncio as aioredis

from fastapi_outbox import Message, Outbox, OutboxSettings
from fastapi_outbox.brokers import NatsJetStreamBroker, RedisStreamsBroker
from fastapi_outbox.brokers.base import PublishResults
from fastapi_outbox.events import Envelope
from tests.acceptance.conftest import nats_ids
from tests.conftest import unique, wait_until
from tests.servers import TcpProxy

pytestmark = pytest.mark.mariadb

SETTINGS: dict[str, Any] = {
    "publish_timeout_seconds": 0.5,
    "lease_seconds": 3,
    "max_attempts": 3,
    "retry_base_delay_seconds": 0.05,
    "retry_max_delay_seconds": 0.2,
    "retry_jitter": 0,
    "poll_interval_seconds": 0.05,
    "max_poll_interval_seconds": 0.2,
    "broker_backoff_max_seconds": 0.4,
    "shutdown_timeout_seconds": 3,
}


class HangsOn:
    """A real broker, except that a publish carrying ``poison`` never returns
    (a broker-side stall on one payload); ping and every other message go to Redis."""

    def __init__(self, real: Any, poison: set[str]) -> None:
        self.real = real
        self.poison = poison
        self.hung_calls = 0

    def configure(self, *, dedup_window_seconds: float) -> None:
        self.real.configure(dedup_window_seconds=dedup_window_seconds)

    async def connect(self) -> None:
        await self.real.connect()

    async def aclose(self) -> None:
        await self.real.aclose()

    async def ping(self) -> None:
        await self.real.ping()

    async def publish(self, batch: Sequence[Envelope]) -> PublishResults:
        if any(e.id in self.poison for e in batch):
            self.hung_calls += 1
            await anyio.sleep_forever()
        return await self.real.publish(batch)


async def redis_stream_ids(redis_url: str, stream: str) -> list[str]:
    client = aioredis.from_url(redis_url)
    try:
        entries = await client.xrange(stream)
    finally:
        await client.aclose()
    return [fields[b"id"].decode() for _, fields in entries]


@pytest.fixture(params=["redis", pytest.param("nats", marks=pytest.mark.nats)])
def real_broker(request: pytest.FixtureRequest) -> tuple[Any, Any]:
    """A broker on a real server and a reader of the ids in one of its streams."""
    if request.param == "redis":
        url = str(request.getfixturevalue("redis_url"))
        return RedisStreamsBroker(url), lambda stream: redis_stream_ids(url, stream)
    url = str(request.getfixturevalue("nats_url"))
    return NatsJetStreamBroker(url), lambda stream: nats_ids(url, stream)


async def row(outbox: Outbox, message_id: uuid.UUID) -> dict[str, Any]:
    found = await outbox.store.messages.get(message_id)
    assert found is not None
    return dict(found)


async def test_one_hanging_message_is_charged_and_the_others_flow(
    pg_url: str, real_broker: tuple[Any, Any]
) -> None:
    real, stream_ids = real_broker
    stream = unique("hang")
    broker = HangsOn(real, set())
    outbox = Outbox(pg_url, brokers={"default": broker}, settings=OutboxSettings(**SETTINGS))
    await outbox.create_tables()
    try:
        async with outbox.unit_of_work() as uow:
            ids = [uow.publish(Message(stream, "Tick", {"n": n})) for n in range(30)]
        poison = ids[10]
        broker.poison.add(str(poison))
        others = [i for i in ids if i != poison]
        async with outbox.relaying():
            table_relay = outbox.relays.tables["default"]

            async def others_in_stream() -> bool:
                return len(set(await stream_ids(stream))) == len(others)

            async def poison_abandoned() -> bool:
                return (await row(outbox, poison))["status"] == "abandoned"

            await wait_until(others_in_stream, timeout=20, interval=0.1)
            await wait_until(poison_abandoned, timeout=20, interval=0.1)
            assert table_relay.broker_ok and table_relay.broker_down_since is None
            assert table_relay.abandoned_total == 1
        assert sorted(await stream_ids(stream)) == sorted(str(i) for i in others)
        hung = await row(outbox, poison)
        assert hung["attempts"] == SETTINGS["max_attempts"]
        assert str(poison) in hung["last_error"]
        assert "publish timed out while the broker answered" in hung["last_error"]
        for i in others:
            r = await row(outbox, i)
            # Batch-mates of the hanging message are not charged for it.
            assert (r["status"], r["attempts"]) == ("published", 1), r
    finally:
        await outbox.aclose()


async def test_a_hanging_message_alone_in_its_batch_is_charged(sqlite_url: str) -> None:
    """The same on SQLite with an in-process broker that answers pings: a batch of one
    that times out is charged, not retried forever as an outage."""
    from fastapi_outbox.brokers import MemoryBroker

    class Hangs(MemoryBroker):
        async def publish(self, batch: Sequence[Envelope]) -> PublishResults:
            await anyio.sleep_forever()
            raise AssertionError("unreachable")

    broker = Hangs()
    outbox = Outbox(sqlite_url, brokers={"default": broker}, settings=OutboxSettings(**SETTINGS))
    await outbox.create_tables()
    try:
        async with outbox.unit_of_work() as uow:
            message_id = uow.publish(Message(unique("hang"), "Tick", {}))

        async def abandoned() -> bool:
            return (await row(outbox, message_id))["status"] == "abandoned"

        async with outbox.relaying():
            await wait_until(abandoned, timeout=20, interval=0.1)
        r = await row(outbox, message_id)
        assert r["attempts"] == SETTINGS["max_attempts"]
        assert "publish timed out while the broker answered" in r["last_error"]
        assert str(message_id) in r["last_error"]
    finally:
        await outbox.aclose()


class StallsOnMarker(TcpProxy):
    """A TCP proxy in front of Redis that stops forwarding a connection for good once a
    client sends ``marker`` on it (a middlebox or server stalled by one payload). Other
    connections, pings included, go through."""

    def __init__(self, target_port: int, marker: bytes) -> None:
        super().__init__(target_port)
        self.marker = marker
        self.stalls = 0
        self._released = asyncio.Event()

    async def _pipe(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        link: Any,
        *,
        upstream: bool,
    ) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while data := await reader.read(65536):
                if self.marker in data:
                    self.stalls += 1
                    await self._released.wait()
                    break
                writer.write(data)
                await writer.drain()
        writer.close()

    async def stop(self) -> None:
        self._released.set()
        await super().stop()


async def test_a_payload_that_stalls_its_connection_is_charged_through_a_real_socket(
    pg_url: str, redis_url: str
) -> None:
    """The redis-py client, its pool and socket timeouts in the loop: the connection that
    carried the poison payload hangs, a ping on another connection answers. The message
    is charged and abandoned; the 19 others are published once, uncharged."""
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    marker = f"STALL-{uuid.uuid4().hex}"
    proxy = StallsOnMarker(port, marker.encode())
    await proxy.start()
    stream = unique("hang")
    broker = RedisStreamsBroker(f"redis://127.0.0.1:{proxy.port}/0", socket_timeout=2)
    outbox = Outbox(pg_url, brokers={"default": broker}, settings=OutboxSettings(**SETTINGS))
    await outbox.create_tables()
    try:
        async with outbox.unit_of_work() as uow:
            ids = [
                uow.publish(Message(stream, "Tick", {"n": n, "note": marker if n == 7 else ""}))
                for n in range(20)
            ]
        poison = ids[7]
        others = [i for i in ids if i != poison]

        async def settled() -> bool:
            return (await row(outbox, poison))["status"] == "abandoned" and len(
                await redis_stream_ids(redis_url, stream)
            ) == len(others)

        async with outbox.relaying():
            await wait_until(settled, timeout=30, interval=0.1)
            assert outbox.relays.tables["default"].broker_ok
        assert sorted(await redis_stream_ids(redis_url, stream)) == sorted(map(str, others))
        assert proxy.stalls >= SETTINGS["max_attempts"]
        hung = await row(outbox, poison)
        assert hung["attempts"] == SETTINGS["max_attempts"]
        assert "publish timed out while the broker answered" in hung["last_error"]
        for i in others:
            assert ((await row(outbox, i))["status"], (await row(outbox, i))["attempts"]) == (
                "published",
                1,
            )
    finally:
        await outbox.aclose()
        await proxy.stop()


async def test_ordered_a_hanging_message_holds_back_its_key_only(db_url: str) -> None:
    """Ordered dispatch: a message of key ``k`` hangs until abandoned. Other keys flow;
    the later message of ``k`` is neither published nor charged, and stays blocked behind
    the abandoned one (see ``test_ordering``)."""
    from fastapi_outbox.brokers import MemoryBroker

    poison: set[str] = set()

    class Hangs(MemoryBroker):
        async def publish(self, batch: Sequence[Envelope]) -> PublishResults:
            if any(e.id in poison for e in batch):
                await anyio.sleep_forever()
            return await super().publish(batch)

    broker = Hangs()
    settings = OutboxSettings(**{**SETTINGS, "ordered": True})
    outbox = Outbox(db_url, brokers={"default": broker}, settings=settings)
    await outbox.create_tables()
    stream = unique("hang")
    try:
        async with outbox.unit_of_work() as uow:
            k1, o1, k2, o2 = (
                uow.publish(Message(stream, "Tick", {"n": n}), key=key)
                for n, key in enumerate(["k", "o", "k", "o"])
            )
        poison.add(str(k1))

        async def abandoned() -> bool:
            return (await row(outbox, k1))["status"] == "abandoned"

        async with outbox.relaying():
            await broker.wait_for(2, timeout=20)
            await wait_until(abandoned, timeout=20, interval=0.1)
        assert [m.id for m in broker.messages] == [str(o1), str(o2)]
        assert ((await row(outbox, k2))["status"], (await row(outbox, k2))["attempts"]) == (
            "pending",
            0,
        )
        assert (
            "publish timed out while the broker answered" in (await row(outbox, k1))["last_error"]
        )
    finally:
        await outbox.aclose()


async def test_a_broker_whose_ping_hangs_too_is_an_outage_and_charges_nothing(
    sqlite_url: str,
) -> None:
    """Every publish and every ping hang (a frozen broker): the table_relay pauses as a
    whole (``broker_ok`` false) and gives the batch back with its attempts refunded, as
    before; once the broker answers again everything goes out, charged once."""
    from fastapi_outbox.brokers import MemoryBroker

    class Frozen(MemoryBroker):
        frozen = True

        async def ping(self) -> None:
            if self.frozen:
                await anyio.sleep_forever()
            await super().ping()

        async def publish(self, batch: Sequence[Envelope]) -> PublishResults:
            if self.frozen:
                self.publish_calls += 1
                await anyio.sleep_forever()
            return await super().publish(batch)

    broker = Frozen()
    outbox = Outbox(sqlite_url, brokers={"default": broker}, settings=OutboxSettings(**SETTINGS))
    await outbox.create_tables()
    try:
        async with outbox.unit_of_work() as uow:
            ids = [uow.publish(Message(unique("hang"), "Tick", {"n": n})) for n in range(3)]
        async with outbox.relaying():
            table_relay = outbox.relays.tables["default"]
            await wait_until(lambda: broker.publish_calls >= 3, timeout=20)
            assert not table_relay.broker_ok

            async def given_back() -> bool:
                found = [await row(outbox, i) for i in ids]
                return all((r["status"], r["attempts"]) == ("pending", 0) for r in found)

            await wait_until(given_back, timeout=10, interval=0.05)
            broker.frozen = False
            await broker.wait_for(3, timeout=20)
        for i in ids:
            r = await row(outbox, i)
            assert (r["status"], r["attempts"]) == ("published", 1), r
    finally:
        await outbox.aclose()

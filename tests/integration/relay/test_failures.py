"""Failure classes: refused messages, unreachable brokers, an unreachable database.

* A message the broker refuses is retried on its own with exponential backoff and jitter,
  then abandoned with ``abandoned_at`` and ``last_error``; the rest of its batch goes out.
* A broker that cannot be reached (MemoryBroker marked unavailable; a private Redis that is
  killed and restarted) charges no attempts: the batch is given back, the relay pauses
  as a whole with growing pauses, and everything flows once the broker is back.
* A database that cannot be reached (nothing listening; a proxy that drops PostgreSQL and
  comes back) leaves the workers alive and reporting it; the app keeps serving.
* A poison message (2 MB to NATS) does not hold back the others.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import itertools
import json
import socket
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import nats
import nats.js.errors
import pytest
import redis.asyncio as aioredis
from fastapi import FastAPI

from fastapi_outbox import Outbox, OutboxSettings, exceptions
from fastapi_outbox.brokers import MemoryBroker, NatsJetStreamBroker, RedisStreamsBroker
from fastapi_outbox.brokers.base import PublishResults
from fastapi_outbox.brokers.nats.wire import stream_name_for
from fastapi_outbox.events import Envelope, Message
from fastapi_outbox.relay.table import retry_delay
from fastapi_outbox.storage.store import Failure
from tests.conftest import unique, wait_until
from tests.servers import PrivateServer, TcpProxy, private_redis_server

pytestmark = pytest.mark.mariadb

PRIVATE_REDIS_PORTS = range(6380, 6390)

FAST = {
    "poll_interval_seconds": 0.05,
    "max_poll_interval_seconds": 0.2,
    "broker_backoff_max_seconds": 0.4,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def rows(outbox: Outbox, ids: Sequence[uuid.UUID]) -> list[dict[str, Any]]:
    out = []
    for i in ids:
        row = await outbox.store.messages.get(i)
        assert row is not None
        out.append(dict(row))
    return out


async def publish(
    outbox: Outbox, stream: str, payloads: Sequence[dict[str, Any]]
) -> list[uuid.UUID]:
    async with outbox.unit_of_work() as uow:
        return [uow.publish(Message(stream, "OrderPlaced", p)) for p in payloads]


def given_back(found: list[dict[str, Any]]) -> bool:
    """Rows released without charge: claimable at once, no attempt counted."""
    return all((r["status"], r["attempts"], r["locked_by"]) == ("pending", 0, None) for r in found)


# -- refused messages --------------------------------------------------------------------------


def test_retry_delay_is_exponential_with_bounded_jitter() -> None:
    settings = OutboxSettings(
        retry_base_delay_seconds=1,
        retry_multiplier=2,
        retry_max_delay_seconds=60,
        retry_jitter=0.25,
    )
    for attempts in range(1, 12):
        nominal = min(60.0, 2.0 ** (attempts - 1))
        samples = [retry_delay(attempts, settings) for _ in range(200)]
        assert all(0.75 * nominal <= d <= min(60.0, 1.25 * nominal) for d in samples)
        assert max(samples) - min(samples) > 0.1 * nominal  # jitter spreads retries
    no_jitter = settings.model_copy(update={"retry_jitter": 0.0})
    assert [retry_delay(n, no_jitter) for n in (1, 2, 3, 7, 8)] == [1, 2, 4, 60, 60]


class RecordingBroker(MemoryBroker):
    """MemoryBroker that notes when each message was offered to it."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.offers: dict[str, list[float]] = {}
        self.calls: list[float] = []

    async def publish(self, batch: Sequence[Envelope]) -> PublishResults:
        now = time.monotonic()
        self.calls.append(now)
        for e in batch:
            self.offers.setdefault(e.id, []).append(now)
        return await super().publish(batch)


async def test_refused_message_backs_off_then_is_abandoned(db_url: str) -> None:
    base, max_attempts = 0.2, 3
    broker = RecordingBroker(
        reject=lambda e: (
            exceptions.MessageRejected(f"message {e.id}: subject not allowed")
            if e.type == "Poison"
            else None
        )
    )
    outbox = Outbox(
        db_url,
        brokers={"default": broker},
        settings=OutboxSettings(
            max_attempts=max_attempts,
            retry_base_delay_seconds=base,
            retry_multiplier=2,
            retry_jitter=0.25,
            retry_max_delay_seconds=10,
            **FAST,
        ),
    )
    await outbox.create_tables()
    # Observe every failure as it is recorded: the row right after mark_failed.
    recorded: list[tuple[Failure, dict[str, Any], dt.datetime]] = []
    mark_failed = outbox.store.claims.mark_failed

    async def observing(failures: Sequence[Failure], token: str) -> int:
        n = await mark_failed(failures, token)
        now = dt.datetime.now(dt.UTC)
        for f in failures:
            (row,) = await rows(outbox, [f.id])
            recorded.append((f, row, now))
        return n

    outbox.store.claims.mark_failed = observing  # type: ignore[method-assign]
    stream = unique("orders")
    try:
        async with outbox.unit_of_work() as uow:
            good = [uow.publish(Message(stream, "OrderPlaced", {"n": n})) for n in (1, 2)]
            poison = uow.publish(Message(stream, "Poison", {"n": 3}))
        async with outbox.relaying():
            await broker.wait_for(2)
            await wait_until(
                lambda: len(recorded) == max_attempts and recorded[-1][1]["status"] == "abandoned",
                timeout=10,
            )
            relay = outbox.relays.tables["default"]
            assert (relay.failed_total, relay.abandoned_total) == (2, 1)
            assert relay.broker_ok  # a refusal is not an outage

        assert sorted(m.id for m in broker.messages) == sorted(str(i) for i in good)
        for r in await rows(outbox, good):
            assert (r["status"], r["attempts"]) == ("published", 1)

        # Retried on its own, attempt after attempt, with exponential backoff and jitter.
        offers = broker.offers[str(poison)]
        assert len(offers) == max_attempts
        for attempt, (failure, row, now) in enumerate(recorded, start=1):
            assert failure.id == poison
            assert row["attempts"] == attempt
            assert "subject not allowed" in row["last_error"]
            assert "MessageRejected" in row["last_error"]
            assert row["locked_by"] is None
            if attempt < max_attempts:
                nominal = base * 2 ** (attempt - 1)
                assert 0.75 * nominal <= failure.delay_seconds <= 1.25 * nominal
                assert row["status"] == "failed" and row["abandoned_at"] is None
                left = (row["next_attempt_at"] - now).total_seconds()
                assert 0.75 * nominal - 0.05 <= left <= 1.25 * nominal + 0.01, (attempt, left)
                assert offers[attempt] - offers[attempt - 1] >= 0.75 * nominal - 0.02
            else:
                assert failure.abandon
                assert row["status"] == "abandoned" and row["abandoned_at"] is not None
    finally:
        await outbox.aclose()


# -- unreachable brokers ---------------------------------------------------------------------


async def test_unavailable_broker_costs_no_attempts_and_pauses_the_relay(pg_url: str) -> None:
    broker = RecordingBroker()
    broker.available = False
    outbox = Outbox(pg_url, brokers={"default": broker}, settings=OutboxSettings(**FAST))
    await outbox.create_tables()
    try:
        ids = await publish(outbox, unique("orders"), [{"n": n} for n in range(3)])
        async with outbox.relaying():
            relay = outbox.relays.tables["default"]
            await wait_until(lambda: len(broker.calls) >= 5, timeout=10)
            assert not relay.broker_ok
            assert "unavailable" in (relay.last_error or "")
            # The relay pauses as a whole: one offer per pause, and the pauses grow
            # (poll interval x 2^n, capped at broker_backoff_max_seconds) — no hot loop.
            gaps = [b - a for a, b in itertools.pairwise(broker.calls)][:4]
            for n, gap in enumerate(gaps):
                assert gap >= 0.95 * min(0.4, 0.05 * 2**n), gaps
            assert broker.messages == []
            # Released between attempts with the attempt refunded.
            await wait_until(lambda: given_back_now(outbox, ids), timeout=5)

            broker.available = True
            await broker.wait_for(3, timeout=5)
            await wait_until(lambda: all_published(outbox, ids), timeout=5)
            assert relay.broker_ok
            assert relay.failed_total == relay.abandoned_total == 0
        for r in await rows(outbox, ids):
            assert (r["status"], r["attempts"], r["last_error"]) == ("published", 1, None)
    finally:
        await outbox.aclose()


async def given_back_now(outbox: Outbox, ids: Sequence[uuid.UUID]) -> bool:
    return given_back(await rows(outbox, ids))


async def all_published(outbox: Outbox, ids: Sequence[uuid.UUID]) -> bool:
    return [r["status"] for r in await rows(outbox, ids)] == ["published"] * len(ids)


@pytest.fixture
async def private_redis(tmp_path: Path) -> AsyncIterator[PrivateServer]:
    server = private_redis_server(PRIVATE_REDIS_PORTS, tmp_path)
    await server.start()
    try:
        yield server
    finally:
        await server.kill()


async def test_killed_redis_costs_no_attempts_and_messages_flow_once_it_is_back(
    pg_url: str, private_redis: PrivateServer
) -> None:
    stream = unique("orders")
    broker = RedisStreamsBroker(private_redis.url, socket_timeout=1)
    outbox = Outbox(pg_url, brokers={"default": broker}, settings=OutboxSettings(**FAST))
    await outbox.create_tables()

    async def xlen() -> int:
        client = aioredis.Redis.from_url(private_redis.url, socket_connect_timeout=0.5)
        try:
            return int(await client.xlen(stream))
        finally:
            await client.aclose()

    try:
        async with outbox.relaying():
            relay = outbox.relays.tables["default"]
            await publish(outbox, stream, [{"n": 0}, {"n": 1}])
            await wait_until(lambda: xlen_is(xlen, 2), timeout=10)

            await private_redis.kill()
            later = await publish(outbox, stream, [{"n": n} for n in range(2, 5)])
            await wait_until(lambda: not relay.broker_ok, timeout=10)
            assert "unreachable" in (relay.last_error or "")
            await wait_until(lambda: given_back_now(outbox, later), timeout=5)

            await private_redis.start()  # an empty server: no persistence
            await wait_until(lambda: xlen_is(xlen, 3), timeout=10)
            await wait_until(lambda: all_published(outbox, later), timeout=5)
            assert relay.broker_ok
            assert relay.failed_total == 0
        for r in await rows(outbox, later):
            assert (r["status"], r["attempts"]) == ("published", 1)
    finally:
        await outbox.aclose()


async def xlen_is(xlen: Any, n: int) -> bool:
    return bool(await xlen() == n)


# -- unreachable database ---------------------------------------------------------------------


async def test_database_with_nothing_listening_keeps_workers_alive_and_the_app_serving() -> None:
    port = free_port()  # bound then released: nothing listens there
    outbox = Outbox(
        f"postgresql+asyncpg://postgres@127.0.0.1:{port}/nothing",
        brokers={"default": MemoryBroker()},
        settings=OutboxSettings(**FAST, health_cache_seconds=0),
    )
    claims = 0
    claim = outbox.store.claims.claim

    async def counting(*args: Any, **kw: Any) -> Any:
        nonlocal claims
        claims += 1
        return await claim(*args, **kw)

    outbox.store.claims.claim = counting  # type: ignore[method-assign]
    app = FastAPI(lifespan=outbox.lifespan)
    app.include_router(outbox.health_router)

    @app.get("/ping")
    async def ping() -> dict[str, str]:
        return {"pong": "yes"}

    transport = httpx.ASGITransport(app=app)
    try:
        begin = time.monotonic()
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=transport, base_url="http://t") as client,
        ):
            assert time.monotonic() - begin < 5  # the app starts although the database is down
            relay = outbox.relays.tables["default"]
            await wait_until(lambda: claims >= 3, timeout=10)  # retried with backoff
            assert relay.running
            assert not relay.database_ok
            assert (relay.last_error or "").startswith("database")
            assert (await client.get("/ping")).status_code == 200
            health = await client.get("/outbox/health")
            assert health.status_code == 503
            assert health.json()["database"] == "down"
            assert relay.running  # still alive after all that
    finally:
        await outbox.aclose()


async def test_database_outage_and_recovery_through_a_proxy(pg_url: str) -> None:
    proxy = TcpProxy(5432)
    await proxy.start()
    through_proxy = pg_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
    broker = MemoryBroker()
    outbox = Outbox(
        through_proxy,
        brokers={"default": broker},
        settings=OutboxSettings(**FAST),
        engine_options={"pool_size": 2},
    )
    direct = Outbox(pg_url, settings=OutboxSettings(run_relays=False))
    await outbox.create_tables()
    try:
        async with outbox.relaying():
            relay = outbox.relays.tables["default"]
            await publish(outbox, unique("orders"), [{"n": 0}])
            await broker.wait_for(1)

            await proxy.stop()
            await wait_until(lambda: not relay.database_ok, timeout=10)
            # Written meanwhile by another process that still reaches the database.
            stream = unique("orders")
            ids = await publish(direct, stream, [{"n": 1}, {"n": 2}])
            assert relay.running

            await proxy.start()
            await broker.wait_for(3, timeout=10)
            await wait_until(lambda: relay.database_ok, timeout=5)
            assert relay.running
        assert [m.json() for m in broker.on_stream(stream)] == [{"n": 1}, {"n": 2}]
        for r in await rows(direct, ids):
            assert (r["status"], r["attempts"]) == ("published", 1)
    finally:
        await outbox.aclose()
        await direct.aclose()
        await proxy.stop()


# -- poison messages ----------------------------------------------------------------------------


async def test_two_megabyte_message_to_nats_does_not_block_the_others(
    pg_url: str, nats_url: str
) -> None:
    stream = unique("orders")
    outbox = Outbox(
        pg_url,
        brokers={"default": NatsJetStreamBroker(nats_url)},
        settings=OutboxSettings(
            max_payload_bytes=4 * 1024 * 1024,
            max_attempts=2,
            retry_base_delay_seconds=0.1,
            **FAST,
        ),
    )
    await outbox.create_tables()
    nc = await nats.connect(nats_url)
    jsm = nc.jsm()
    try:
        payloads = [{"n": 0}, {"n": 1}, {"blob": "x" * (2 * 1024 * 1024)}, {"n": 3}]
        ids = await publish(outbox, stream, payloads)
        poison = ids[2]
        async with outbox.relaying():
            await wait_until(lambda: row_status(outbox, poison, "abandoned"), timeout=10)
            await wait_until(lambda: all_published(outbox, [*ids[:2], ids[3]]), timeout=5)
        info = await jsm.stream_info(stream_name_for(stream))
        assert info.state.messages == 3
        got = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            msg = await jsm.get_msg(stream_name_for(stream), seq)
            got.append(json.loads(msg.data or b""))
        assert sorted(got, key=lambda p: p["n"]) == [{"n": 0}, {"n": 1}, {"n": 3}]
        (row,) = await rows(outbox, [poison])
        assert row["attempts"] == 2
        assert row["abandoned_at"] is not None
        assert "max_payload" in row["last_error"]
        assert "xxxx" not in row["last_error"]  # never the payload
    finally:
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await jsm.delete_stream(stream_name_for(stream))
        await nc.close()
        await outbox.aclose()


async def row_status(outbox: Outbox, message_id: uuid.UUID, status: str) -> bool:
    (row,) = await rows(outbox, [message_id])
    return bool(row["status"] == status)

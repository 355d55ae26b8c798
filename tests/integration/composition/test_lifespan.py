"""The app's lifespan runs the relays, and its shutdown gives claims back in time.

Both ways of wiring an app — ``FastAPI(lifespan=outbox.lifespan)`` and
``app.include_router(outbox.router)`` — start one table_relay per broker with
``settings.workers`` workers, and an HTTP request that publishes an event ends up in the
real Redis stream / JetStream. Shutdown stops claiming, lets in-flight batches finish
within ``shutdown_timeout_seconds`` and otherwise gives them back (pending, unlocked,
attempt refunded) even when the broker hangs.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import anyio
import httpx
import nats
import nats.js.errors
import pytest
import redis.asyncio as aioredis
from fastapi import FastAPI

from fastapi_outbox import Event, Outbox, OutboxSettings, UnitOfWorkDep
from fastapi_outbox.brokers import (
    Broker,
    MemoryBroker,
    NatsJetStreamBroker,
    PublishResults,
    RedisStreamsBroker,
)
from fastapi_outbox.brokers.nats.wire import stream_name_for
from fastapi_outbox.events import Envelope, Message
from tests.conftest import unique, wait_until

WORKERS = 3


def build_app(outbox: Outbox, wiring: str, stream: str) -> FastAPI:
    class OrderPlaced(Event, stream=stream, key="order_id"):
        order_id: int
        total: float

    if wiring == "lifespan":
        app = FastAPI(lifespan=outbox.lifespan)
        app.include_router(outbox.health_router)
    else:
        app = FastAPI()
        app.include_router(outbox.router)

    @app.post("/orders/{order_id}")
    async def place(order_id: int, uow: UnitOfWorkDep) -> dict[str, Any]:
        uow.publish(OrderPlaced(order_id=order_id, total=9.5))
        return {"id": order_id}

    return app


def count_claims(outbox: Outbox) -> dict[str, set[int]]:
    """Wrap the store's claim: which worker indexes of which table_relay claimed."""
    seen: dict[str, set[int]] = {}
    claim = outbox.store.claims.claim

    async def counting(broker: str, limit: int, token: str, *args: Any, **kw: Any) -> Any:
        # token = "<instance>:<worker index>:<claim number>"
        seen.setdefault(broker, set()).add(int(token.rsplit(":", 2)[1]))
        return await claim(broker, limit, token, *args, **kw)

    outbox.store.claims.claim = counting  # type: ignore[method-assign]
    return seen


@pytest.fixture
async def real_broker(request: pytest.FixtureRequest) -> AsyncIterator[tuple[str, Broker, Any]]:
    """(kind, broker, read(stream) -> list of (headers, payload dict))."""
    stream_holder: list[str] = []
    if request.param == "redis":
        url = request.getfixturevalue("redis_url")
        client = aioredis.Redis.from_url(url)

        async def read_redis(stream: str) -> list[tuple[dict[str, str], Any]]:
            stream_holder.append(stream)
            entries = await client.xrange(stream, "-", "+")
            return [(json.loads(f[b"headers"]), json.loads(f[b"payload"])) for _, f in entries]

        yield "redis", RedisStreamsBroker(url), read_redis
        for stream in stream_holder:
            await client.delete(stream)
        await client.aclose()
    else:
        url = request.getfixturevalue("nats_url")
        nc = await nats.connect(url)
        jsm = nc.jsm()

        async def read_nats(stream: str) -> list[tuple[dict[str, str], Any]]:
            stream_holder.append(stream)
            try:
                info = await jsm.stream_info(stream_name_for(stream))
            except nats.js.errors.NotFoundError:
                return []
            if not info.state.messages:
                return []
            out = []
            for seq in range(info.state.first_seq, info.state.last_seq + 1):
                msg = await jsm.get_msg(stream_name_for(stream), seq)
                out.append((dict(msg.headers or {}), json.loads(msg.data or b"")))
            return out

        yield "nats", NatsJetStreamBroker(url), read_nats
        for stream in set(stream_holder):
            with contextlib.suppress(nats.js.errors.NotFoundError):
                await jsm.delete_stream(stream_name_for(stream))
        await nc.close()


@pytest.mark.parametrize(
    ("wiring", "real_broker"),
    # Each wiring and each real broker once (the broker does not depend on the wiring).
    [("lifespan", "redis"), ("router", "nats")],
    indirect=["real_broker"],
)
async def test_lifespan_runs_one_relay_per_broker_and_delivers_http_events(
    pg_url: str, wiring: str, real_broker: tuple[str, Broker, Any]
) -> None:
    _kind, broker, read = real_broker
    audit = MemoryBroker()
    outbox = Outbox(
        pg_url,
        brokers={"default": broker, "audit": audit},
        settings=OutboxSettings(workers=WORKERS, poll_interval_seconds=0.2),
    )
    await outbox.create_tables()
    claimed_by = count_claims(outbox)
    stream = unique("orders")
    app = build_app(outbox, wiring, stream)
    transport = httpx.ASGITransport(app=app)
    try:
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=transport, base_url="http://test") as client,
        ):
            assert outbox.lifecycle.started
            assert sorted(outbox.relays.tables) == ["audit", "default"]
            assert all(p.running for p in outbox.relays.tables.values())
            await wait_until(
                lambda: claimed_by == {"default": set(range(WORKERS)), "audit": set(range(WORKERS))}
            )

            response = await client.post("/orders/42", headers={"X-Correlation-ID": "req-1"})
            assert response.status_code == 200

            found: list[tuple[dict[str, str], Any]] = []

            async def arrived() -> bool:
                found[:] = await read(stream)
                return len(found) == 1

            await wait_until(arrived, timeout=10)
            headers, payload = found[0]
            assert payload == {"order_id": 42, "total": 9.5}
            assert headers["type"] == "OrderPlaced"
            assert headers["correlation-id"] == "req-1"
            health = (await client.get("/outbox/health")).json()
            assert {p["broker"] for p in health["relays"] if p["running"]} == {
                "audit",
                "default",
            }
        assert not outbox.lifecycle.started
        assert not any(p.running for p in outbox.relays.tables.values())
        rows = await outbox.store.messages.list_messages()
        assert [(r["broker"], r["status"]) for r in rows] == [("default", "published")]
    finally:
        await outbox.aclose()


class HangingBroker:
    """A broker whose publish blocks until ``gate`` is set (a broker that stopped answering)."""

    def __init__(self) -> None:
        self.publishing = anyio.Event()
        self.gate = anyio.Event()
        self.cancelled = False
        self.published: list[str] = []
        self.closed = 0

    def configure(self, *, dedup_window_seconds: float) -> None:
        pass

    async def connect(self) -> None:
        pass

    async def aclose(self) -> None:
        self.closed += 1

    async def ping(self) -> None:
        pass

    async def publish(self, batch: Sequence[Envelope]) -> PublishResults:
        self.publishing.set()
        try:
            await self.gate.wait()
        except BaseException:
            self.cancelled = True
            raise
        self.published += [e.id for e in batch]
        return [None] * len(batch)


SHUTDOWN_TIMEOUT = 1.0


async def run_until_stopped(
    app: FastAPI, started: anyio.Event, stop: anyio.Event, timing: dict[str, float]
) -> None:
    """Enter and leave the app's lifespan in one task; time the shutdown."""
    async with app.router.lifespan_context(app):
        started.set()
        await stop.wait()
        timing["begin"] = time.monotonic()
    timing["end"] = time.monotonic()


@pytest.fixture
async def hanging(
    request: pytest.FixtureRequest,
) -> AsyncIterator[tuple[Outbox, HangingBroker, FastAPI]]:
    """An app whose only broker hangs; on PostgreSQL or SQLite (indirect parameter)."""
    url = request.getfixturevalue("pg_url" if request.param == "postgres" else "sqlite_url")
    broker = HangingBroker()
    outbox = Outbox(
        url,
        brokers={"default": broker},
        settings=OutboxSettings(
            shutdown_timeout_seconds=SHUTDOWN_TIMEOUT,
            publish_timeout_seconds=60,
            lease_seconds=90,
            poll_interval_seconds=0.05,
        ),
    )
    await outbox.create_tables()
    app = FastAPI(lifespan=outbox.lifespan)
    try:
        yield outbox, broker, app
    finally:
        await outbox.aclose()


async def publish_one(outbox: Outbox) -> Any:
    async with outbox.unit_of_work() as uow:
        return uow.publish(Message(unique("orders"), "OrderPlaced", {"n": 1}))


@pytest.mark.parametrize("hanging", ["postgres"], indirect=True)
async def test_shutdown_releases_a_claim_the_broker_never_answers(
    hanging: tuple[Outbox, HangingBroker, FastAPI],
) -> None:
    outbox, broker, app = hanging
    started, stop, timing = anyio.Event(), anyio.Event(), {}
    async with anyio.create_task_group() as tg:
        tg.start_soon(run_until_stopped, app, started, stop, timing)
        await started.wait()
        message_id = await publish_one(outbox)
        with anyio.fail_after(10):
            await broker.publishing.wait()
        row = await outbox.store.messages.get(message_id)
        assert row is not None and (row["status"], row["attempts"]) == ("processing", 1)
        stop.set()

    elapsed = timing["end"] - timing["begin"]
    assert SHUTDOWN_TIMEOUT - 0.1 <= elapsed < SHUTDOWN_TIMEOUT + 1.0, elapsed
    assert broker.cancelled and broker.published == []
    assert broker.closed == 1
    row = await outbox.store.messages.get(message_id)
    assert row is not None
    assert (row["status"], row["locked_by"], row["locked_until"], row["attempts"]) == (
        "pending",
        None,
        None,
        0,
    )
    # Claimable at once by the next relay, not after the 30 s lease.
    claimed = await outbox.store.claims.claim("default", 10, "next-process:0:1", 30)
    assert [r.id for r in claimed] == [message_id]


@pytest.mark.parametrize("hanging", ["sqlite"], indirect=True)
async def test_shutdown_lets_an_in_flight_batch_finish_within_the_timeout(
    hanging: tuple[Outbox, HangingBroker, FastAPI],
) -> None:
    outbox, broker, app = hanging
    started, stop, timing = anyio.Event(), anyio.Event(), {}
    processor_stopping = anyio.Event()

    async def answer_once_stopping() -> None:
        await wait_until(lambda: outbox.relays.tables["default"].stopping, timeout=5)
        processor_stopping.set()
        broker.gate.set()  # the broker answers after shutdown began

    async with anyio.create_task_group() as tg:
        tg.start_soon(run_until_stopped, app, started, stop, timing)
        await started.wait()
        message_id = await publish_one(outbox)
        with anyio.fail_after(10):
            await broker.publishing.wait()
        tg.start_soon(answer_once_stopping)
        stop.set()

    assert processor_stopping.is_set()
    assert timing["end"] - timing["begin"] < SHUTDOWN_TIMEOUT
    assert not broker.cancelled and broker.published == [str(message_id)]
    row = await outbox.store.messages.get(message_id)
    assert row is not None
    assert (row["status"], row["locked_by"], row["attempts"]) == ("published", None, 1)


async def test_idle_shutdown_is_prompt(pg_url: str) -> None:
    outbox = Outbox(
        pg_url,
        brokers={"default": MemoryBroker()},
        settings=OutboxSettings(shutdown_timeout_seconds=5),
    )
    await outbox.create_tables()
    app = FastAPI()
    app.include_router(outbox.router)
    started, stop, timing = anyio.Event(), anyio.Event(), {}
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(run_until_stopped, app, started, stop, timing)
            await started.wait()
            assert outbox.relays.listener is not None
            await wait_until(
                lambda: outbox.relays.listener is not None and outbox.relays.listener.listening
            )
            stop.set()
        assert timing["end"] - timing["begin"] < 1.0
        assert not outbox.lifecycle.started and outbox.relays.listener is None
    finally:
        await outbox.aclose()

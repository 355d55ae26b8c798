"""GET /outbox/health: counts, status codes and what the body never contains."""

from __future__ import annotations

import datetime as dt
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import update
from sqlalchemy.engine import make_url

from fastapi_outbox import BrokerUnavailable, Message, MessageRejected, Outbox, OutboxSettings
from fastapi_outbox.brokers import MemoryBroker
from tests.conftest import unique, wait_until

pytestmark = pytest.mark.mariadb

PASSWORD = "Pw-health-4f2a9c"
MARKER = "PAYLOAD-MARKER-7d1e"


def build_app(outbox: Outbox) -> FastAPI:
    app = FastAPI()
    app.include_router(outbox.router)  # health router + lifespan

    @app.get("/ping")
    async def ping() -> dict[str, bool]:
        return {"ok": True}

    return app


@asynccontextmanager
async def serve(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://test") as client,
    ):
        yield client


async def publish(outbox: Outbox, stream: str, n: int = 1, **payload: Any) -> None:
    async with outbox.unit_of_work() as uow:
        for i in range(n):
            uow.publish(Message(stream=stream, type="Thing", payload={"i": i, **payload}))


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def with_password(url: str) -> str:
    """``url`` with a password (the test server trusts loopback, so it is ignored)."""
    return make_url(url).set(password=PASSWORD).render_as_string(hide_password=False)


async def test_counts_status_and_openapi(db_url: str) -> None:
    stream = unique("orders")
    broker = MemoryBroker(
        reject=lambda e: MessageRejected("refused") if e.json().get("bad") else None
    )
    outbox = Outbox(
        db_url,
        brokers={"default": broker},
        settings=OutboxSettings(
            health_cache_seconds=0, retry_base_delay_seconds=60, retry_max_delay_seconds=60
        ),
    )
    await outbox.create_tables()
    app = build_app(outbox)
    try:
        async with serve(app) as client:
            await publish(outbox, stream, 3)
            await broker.wait_for(3)
            await publish(outbox, stream, 1, bad=True)
            relay = outbox.relays.tables["default"]
            # Marked, not only sent: the broker has the three before their batch is marked.
            await wait_until(lambda: relay.failed_total == 1 and relay.published_total == 3)

            response = await client.get("/outbox/health")
            assert response.status_code == 200  # failing messages: degraded, not down
            body = response.json()
            assert body["status"] == "degraded"
            assert body["database"] == "ok"
            assert body["relays_running"] is True
            [p] = body["relays"]
            assert p["broker"] == "default"
            assert p["running"] is True
            assert p["last_tick"] is not None
            assert (p["pending"], p["processing"], p["failed"], p["abandoned"]) == (0, 0, 1, 0)
            assert p["published_last_minute"] == 3
            assert p["oldest_pending_age_seconds"] is None
            assert any("failing" in r for r in body["reasons"])

        schema = app.openapi()
        operation = schema["paths"]["/outbox/health"]["get"]
        assert "503" in operation["responses"]
        health_schema = schema["components"]["schemas"]["OutboxHealth"]
        assert {"status", "database", "relays"} <= set(health_schema["properties"])
        processor_schema = schema["components"]["schemas"]["RelayHealth"]
        assert {
            "running",
            "last_tick",
            "pending",
            "processing",
            "failed",
            "abandoned",
            "oldest_pending_age_seconds",
            "published_last_minute",
        } <= set(processor_schema["properties"])
    finally:
        await outbox.aclose()


async def test_app_starts_and_serves_while_database_is_down() -> None:
    url = f"postgresql+asyncpg://app:{PASSWORD}@127.0.0.1:{closed_port()}/app"
    outbox = Outbox(
        url, brokers={"default": MemoryBroker()}, settings=OutboxSettings(health_cache_seconds=0)
    )
    app = build_app(outbox)
    try:
        with anyio.fail_after(10):  # startup neither hangs nor crashes
            async with serve(app) as client:
                assert (await client.get("/ping")).status_code == 200
                response = await client.get("/outbox/health")
                assert response.status_code == 503
                body = response.json()
                assert body["status"] == "down"
                assert body["database"] == "down"
                assert body["relays"][0]["running"] is True
                assert body["relays"][0]["pending"] is None  # unknown, not 0
                assert PASSWORD not in response.text
                assert (await client.get("/ping")).status_code == 200
    finally:
        await outbox.aclose()


async def test_dead_relay_is_503(sqlite_url: str) -> None:
    outbox = Outbox(
        sqlite_url,
        brokers={"default": MemoryBroker()},
        settings=OutboxSettings(health_cache_seconds=0),
        dashboard_dependencies=[],  # the detail unguarded, on purpose (a test)
    )
    await outbox.create_tables()
    app = build_app(outbox)
    try:
        async with serve(app) as client:
            assert (await client.get("/outbox/health")).status_code == 200
            relay = outbox.relays.tables["default"]

            async def bug(timeout: float | None) -> bool:
                raise RuntimeError("a bug in a worker")

            relay.wakeup.wait = bug  # type: ignore[method-assign]
            relay.wakeup.set_all()
            await wait_until(lambda: not relay.running)

            response = await client.get("/outbox/health")
            assert response.status_code == 503
            body = response.json()
            assert body["status"] == "down"
            assert "relay 'default' is not running" in body["reasons"]
            assert body["relays"][0]["running"] is False
            # The error is detail (it may name a host): not in the public body.
            assert body["relays"][0]["last_error"] is None
            detail = await client.get("/outbox/health/detail")
            assert detail.status_code == 503
            assert "RuntimeError" in detail.json()["relays"][0]["last_error"]
            # The crash ended the relay, not the app.
            assert (await client.get("/ping")).status_code == 200
    finally:
        await outbox.aclose()


async def test_old_pending_message_in_an_api_process_is_degraded_not_503(db_url: str) -> None:
    """A process that runs no relay for the rows (API-only) reports a long wait but
    answers 200: restarting it would cure nothing (see test_health_probes.py for the 503
    of a stuck relay)."""
    stream = unique("orders")
    outbox = Outbox(
        db_url,
        brokers={"default": MemoryBroker()},
        settings=OutboxSettings(
            health_cache_seconds=0, health_max_pending_age_seconds=30, run_relays=False
        ),
    )
    await outbox.create_tables()
    app = build_app(outbox)
    table = outbox.table
    an_hour_ago = dt.datetime.now(dt.UTC) - dt.timedelta(hours=1)
    try:
        async with serve(app) as client:
            await publish(outbox, stream, 2)
            response = await client.get("/outbox/health")
            assert response.status_code == 200, response.text
            assert response.json()["status"] == "ok"

            # A message failing for an hour: degraded (its own count), not down.
            async with outbox.engine.begin() as conn:
                await conn.execute(update(table).values(status="failed", created_at=an_hour_ago))
            response = await client.get("/outbox/health")
            assert response.status_code == 200
            assert response.json()["status"] == "degraded"
            assert response.json()["relays"][0]["oldest_pending_age_seconds"] is None

            # Due an hour ago, threshold 30 s: reported, degraded, not down.
            async with outbox.engine.begin() as conn:
                await conn.execute(
                    update(table).values(status="pending", next_attempt_at=an_hour_ago)
                )
            response = await client.get("/outbox/health")
            assert response.status_code == 200
            body = response.json()
            assert body["status"] == "degraded"
            assert body["relays"][0]["oldest_pending_age_seconds"] >= 3500
            assert any(
                "health_max_pending_age_seconds=30" in r and "no relay here" in r
                for r in body["reasons"]
            )
    finally:
        await outbox.aclose()


class LeakyBroker(MemoryBroker):
    """Refuses connections with an error quoting its URL, password included, as some
    client libraries do."""

    url = f"redis://:{PASSWORD}@10.0.0.1:6379/0"

    async def ping(self) -> None:
        if not self.available:
            raise BrokerUnavailable(f"cannot reach {self.url}")

    async def publish(self, batch: Any) -> Any:
        await self.ping()
        return await super().publish(batch)


async def test_body_holds_no_payload_and_no_credentials(pg_url: str) -> None:
    stream = unique("orders")
    broker = LeakyBroker(
        reject=lambda e: MessageRejected(f"refused {e.payload.decode()} at {LeakyBroker.url}")
    )
    outbox = Outbox(
        with_password(pg_url),
        brokers={"default": broker},
        settings=OutboxSettings(health_cache_seconds=0, retry_base_delay_seconds=60),
        dashboard_dependencies=[],
    )
    await outbox.create_tables()
    app = build_app(outbox)

    try:
        async with serve(app) as client:
            await publish(outbox, stream, 1, secret=MARKER)
            relay = outbox.relays.tables["default"]
            await wait_until(lambda: relay.failed_total == 1)
            broker.available = False
            await publish(outbox, stream, 1, secret=MARKER)
            await wait_until(lambda: not relay.broker_ok)

            response = await client.get("/outbox/health")
            body = response.json()
            assert body["relays"][0]["failed"] == 1
            assert body["relays"][0]["broker_available"] is False
            assert body["relays"][0]["last_error"] is None  # public: no error text
            assert "10.0.0.1" not in response.text
            detail = await client.get("/outbox/health/detail")
            assert "***" in detail.json()["relays"][0]["last_error"]  # redacted, not dropped
            for text in (response.text, detail.text):
                assert MARKER not in text
                assert PASSWORD not in text
    finally:
        await outbox.aclose()
    assert broker.messages == []


async def test_counts_are_cached(sqlite_url: str) -> None:
    outbox = Outbox(sqlite_url, settings=OutboxSettings(health_cache_seconds=60, run_relays=False))
    await outbox.create_tables()
    app = build_app(outbox)
    calls = 0
    stats = outbox.store.messages.stats

    async def counting(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return await stats(*args, **kwargs)

    outbox.store.messages.stats = counting  # type: ignore[method-assign]
    try:
        async with serve(app) as client:
            for _ in range(5):
                assert (await client.get("/outbox/health")).status_code == 200
        assert calls == 1
    finally:
        await outbox.aclose()

"""capture="wal" operations: the slot in /outbox/health, metrics and the CLI (`db create`,
`status`, `db drop-slot`), and what an invalidated slot looks like."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import asyncpg
import httpx
import pytest
from fastapi import FastAPI

from fastapi_outbox import Message, Outbox, OutboxSettings
from fastapi_outbox.brokers import MemoryBroker
from tests.conftest import asgi_client, run_cli, unique, wait_until

FAST = {"capture": "wal", "poll_interval_seconds": 0.05, "health_cache_seconds": 0}


async def publish(outbox: Outbox, n: int = 1) -> None:
    async with outbox.unit_of_work() as uow:
        for i in range(n):
            uow.publish(Message(stream="ops", type="Thing", payload={"i": i}))


@asynccontextmanager
async def serve(wal_pg_url: str) -> AsyncIterator[tuple[Outbox, MemoryBroker, httpx.AsyncClient]]:
    """The outbox's router (health + lifespan) served in the test's own task."""
    broker = MemoryBroker()
    outbox = Outbox(wal_pg_url, brokers={"default": broker}, settings=OutboxSettings(**FAST))
    await outbox.create_tables()
    app = FastAPI()
    app.include_router(outbox.router)
    async with asgi_client(app) as client:
        yield outbox, broker, client
    await outbox.aclose()


async def test_health_reports_the_slot_and_its_lag(wal_pg_url: str) -> None:
    async with serve(wal_pg_url) as served:
        await _health_reports_the_slot_and_its_lag(*served)


async def _health_reports_the_slot_and_its_lag(
    outbox: Outbox, broker: MemoryBroker, client: httpx.AsyncClient
) -> None:
    await publish(outbox, 3)
    await broker.wait_for(3)
    relay = outbox.relays.wal
    assert relay is not None

    async def caught_up() -> bool:
        body = (await client.get("/outbox/health")).json()
        return body["wal"]["lag_bytes"] is not None and body["wal"]["lag_bytes"] < 1024

    await wait_until(caught_up)
    response = await client.get("/outbox/health")
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ok", body
    wal = body["wal"]
    assert wal["slot"] == outbox.settings.slot_name
    assert wal["exists"] is True and wal["wal_status"] == "reserved"
    assert wal["reader_here"] is True and wal["relay_running"] is True
    assert wal["lag_seconds"] == 0 and wal["retained_bytes"] >= wal["lag_bytes"]
    assert wal["last_relayed_at"] is not None

    # A broker outage: the relay pauses, health says so (degraded) and lag_seconds grows.
    broker.available = False
    await publish(outbox)
    await wait_until(lambda: not relay.broker_ok)
    body = (await client.get("/outbox/health")).json()
    assert body["status"] == "degraded", body
    assert "WAL relay paused: broker down" in body["reasons"]
    assert body["wal"]["lag_seconds"] > 0
    broker.available = True
    await broker.wait_for(4, timeout=10)


async def test_an_invalidated_slot_makes_health_down(wal_pg_url: str) -> None:
    """max_slot_wal_keep_size exceeded: PostgreSQL invalidates the slot at a checkpoint
    (wal_status=lost) and health is down, saying what happened and what to do."""
    async with serve(wal_pg_url) as served:
        await _invalidated(wal_pg_url, *served)


async def _invalidated(
    wal_pg_url: str, outbox: Outbox, broker: MemoryBroker, client: httpx.AsyncClient
) -> None:
    await publish(outbox)
    await broker.wait_for(1)
    conn = await asyncpg.connect(wal_pg_url.replace("+asyncpg", ""))
    try:
        # The relay must not move the slot meanwhile: stop it.
        assert outbox.relays.wal is not None
        outbox.relays.wal.stop()
        await wait_until(lambda: outbox.relays.wal is None or not outbox.relays.wal.running)
        await conn.execute("ALTER SYSTEM SET max_slot_wal_keep_size = '1MB'")
        await conn.execute("SELECT pg_reload_conf()")
        await conn.execute("CREATE TABLE filler (x int)")
        for _ in range(4):
            await conn.execute("INSERT INTO filler VALUES (1)")
            await conn.execute("SELECT pg_switch_wal()")
        await conn.execute("CHECKPOINT")
        status = await conn.fetchval(
            "SELECT wal_status FROM pg_replication_slots WHERE slot_name = $1",
            outbox.settings.slot_name,
        )
        assert status == "lost"
    finally:
        await conn.execute("ALTER SYSTEM RESET max_slot_wal_keep_size")
        await conn.execute("SELECT pg_reload_conf()")
        await conn.close()
    response = await client.get("/outbox/health")
    assert response.status_code == 503
    reasons = " ".join(response.json()["reasons"])
    assert "invalidated" in reasons and "max_slot_wal_keep_size" in reasons
    # `status` still reports it (its messages cannot be read any more).
    assert outbox.wal_slot is not None
    report = await outbox.wal_slot.report()
    assert report["wal_status"] == "lost" and report["backlog_messages"] is None


async def test_prometheus_gauges_show_the_slot(wal_pg_url: str) -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    from fastapi_outbox.ops.metrics import PrometheusInstrumentation

    registry = prometheus_client.CollectorRegistry()
    instrumentation = PrometheusInstrumentation(registry)
    broker = MemoryBroker()
    outbox = Outbox(
        wal_pg_url,
        brokers={"default": broker},
        settings=OutboxSettings(**FAST),
        instrumentation=instrumentation,
    )
    await outbox.create_tables()
    try:
        async with outbox.relaying():
            await publish(outbox, 2)
            await broker.wait_for(2)
            await instrumentation.refresh(outbox, force=True)
        slot = outbox.settings.slot_name
        sample = registry.get_sample_value
        assert sample("outbox_wal_lag_bytes", {"slot": slot}) is not None
        assert sample("outbox_wal_retained_bytes", {"slot": slot}) is not None
        assert sample("outbox_wal_slot_lost", {"slot": slot}) == 0
        labels = {"broker": "default", "stream": "ops"}
        assert sample("outbox_messages_published_total", labels) == 2
    finally:
        await outbox.aclose()


async def test_cli_creates_reports_and_drops_the_slot(wal_pg_url: str) -> None:
    table = unique("walcli")
    env = {"OUTBOX_CAPTURE": "wal", "OUTBOX_TABLE_NAME": table}
    created = run_cli("db", "create", "--url", wal_pg_url, env=env)
    assert created.returncode == 0, created.stderr
    assert "replication slot" in created.stdout
    outbox = Outbox(
        wal_pg_url,
        brokers={"default": MemoryBroker()},
        settings=OutboxSettings(capture="wal", table_name=table, run_relays=False),
    )
    try:
        await publish(outbox, 3)
    finally:
        await outbox.aclose()
    status = run_cli("status", "--url", wal_pg_url, "--json", env=env)
    assert status.returncode == 0, status.stderr
    slot = json.loads(status.stdout)["wal_slot"]
    assert slot["slot"] == f"fastapi_outbox_{table}" and slot["exists"] is True
    assert slot["backlog_messages"] == 3
    assert slot["oldest_unrelayed_age_seconds"] >= 0
    assert slot["lag_bytes"] > 0 and slot["wal_status"] == "reserved"
    # Unrelayed messages: refused without --force.
    refused = run_cli("db", "drop-slot", "--url", wal_pg_url, env=env)
    assert refused.returncode == 1
    assert "3 unrelayed message(s)" in refused.stderr
    dropped = run_cli("db", "drop-slot", "--url", wal_pg_url, "--force", env=env)
    assert dropped.returncode == 0, dropped.stderr
    conn = await asyncpg.connect(wal_pg_url.replace("+asyncpg", ""))
    try:
        assert await conn.fetchval("SELECT count(*) FROM pg_replication_slots") == 0
        assert await conn.fetchval("SELECT count(*) FROM pg_publication") == 0
    finally:
        await conn.close()

"""One relay for every tenant: a tenant's backlog or its database going down costs the other
tenants nothing (their commit→publish latency stays that of a tenant alone), and the
health endpoint names the tenant that fails."""

import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from fastapi_outbox import Message, Outbox, OutboxSettings
from fastapi_outbox.brokers import MemoryBroker
from tests.conftest import wait_until
from tests.servers import PrivatePostgres

PG_PORTS = range(57100, 57150)
ROUNDS = 15
BACKLOG = 20_000


@pytest.fixture(scope="module")
def tenant_pg() -> Iterator[PrivatePostgres]:
    """The database of one tenant: a private cluster the test stops."""
    cluster = PrivatePostgres(PG_PORTS, options="-c fsync=off -c max_connections=40")
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


async def latency(outbox: Outbox, broker: MemoryBroker, tenant: str) -> float:
    """The median commit→publish time of single messages of ``tenant``."""
    times = []
    for n in range(ROUNDS):
        started = time.perf_counter()
        async with outbox.unit_of_work(tenant=tenant) as uow:
            uow.publish(Message(f"quiet.{tenant}", "Ping", {"n": n}))
        await wait_until(lambda k=n: len(broker.on_stream(f"quiet.{tenant}")) > k, interval=0.001)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


async def make(tenants: dict[str, str]) -> tuple[Outbox, MemoryBroker]:
    broker = MemoryBroker()
    outbox = Outbox(
        tenants=tenants,
        brokers={"default": broker},
        settings=OutboxSettings(
            poll_interval_seconds=0.2, tenant_connection_budget=4, health_cache_seconds=0
        ),
        dashboard_dependencies=[],
    )
    await outbox.create_tables()
    return outbox, broker


async def test_a_backlog_does_not_delay_a_quiet_tenant(tmp_path: Path) -> None:
    urls = {name: f"sqlite+aiosqlite:///{tmp_path}/{name}.db" for name in ("busy", "quiet")}
    outbox, broker = await make(urls)
    try:
        async with outbox.relaying():
            alone = await latency(outbox, broker, "quiet")
            async with outbox.unit_of_work(tenant="busy") as uow:
                for n in range(BACKLOG):
                    uow.publish(Message("backlog", "Filler", {"n": n}))
            await wait_until(lambda: len(broker.on_stream("backlog")) > 0)
            beside = await latency(outbox, broker, "quiet")
            assert len(broker.on_stream("backlog")) < BACKLOG, "the backlog was drained first"
            await broker.wait_for(BACKLOG + 2 * ROUNDS, timeout=60)
        assert beside <= 2 * alone + 0.005, (alone, beside)
    finally:
        await outbox.aclose()


async def test_a_tenant_database_down_pauses_that_tenant_alone(
    tmp_path: Path, tenant_pg: PrivatePostgres
) -> None:
    tenants = {
        "quiet": f"sqlite+aiosqlite:///{tmp_path}/quiet.db",
        "other": f"sqlite+aiosqlite:///{tmp_path}/other.db",
        "fragile": tenant_pg.url,
    }
    outbox, broker = await make(tenants)
    app = FastAPI(lifespan=outbox.lifespan)
    app.include_router(outbox.health_router)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
    try:
        async with app.router.lifespan_context(app), client:
            alone = await latency(outbox, broker, "quiet")
            tenant_pg.shut_down()
            try:
                await wait_until(lambda: not outbox.tenants.relay.status("fragile")["ok"])  # type: ignore[union-attr]
                health = (await client.get("/outbox/health/detail")).json()
                assert health["status"] == "degraded"
                assert "fragile" in health["reasons"][0]
                by_name = {t["tenant"]: t for t in health["tenants"]}
                assert by_name["fragile"]["status"] == "down"
                assert by_name["quiet"]["status"] == by_name["other"]["status"] == "ok"
                beside = await latency(outbox, broker, "quiet")
                async with outbox.unit_of_work(tenant="other") as uow:
                    uow.publish(Message("other", "Ping", {}))
                await wait_until(lambda: len(broker.on_stream("other")) == 1)
            finally:
                tenant_pg.start_again()
            async with outbox.unit_of_work(tenant="fragile") as uow:
                uow.publish(Message("fragile", "Ping", {}))
            await wait_until(lambda: len(broker.on_stream("fragile")) == 1, timeout=20)
            health = (await client.get("/outbox/health")).json()
            assert health["status"] == "ok", health
        assert beside <= 2 * alone + 0.005, (alone, beside)
    finally:
        await outbox.aclose()

"""Health that tells the truth under load, on a real server (uvicorn) and PostgreSQL: a flood
of anonymous requests costs one computation per cache period and never a false 503; a pool
whose connections are all held is "busy" (degraded, with the wait), never "database down";
an app that never entered ``outbox.lifespan`` is down with the fix named; liveness and
readiness are separate; two dashboards under two prefixes each answer with their own data
under a flood."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import text

from fastapi_outbox import Message, Outbox, OutboxSettings
from fastapi_outbox.brokers import MemoryBroker
from fastapi_outbox.ops import health
from tests.browser.conftest import live_server
from tests.conftest import unique, wait_until
from tests.servers import TcpProxy

pytestmark = pytest.mark.postgres(
    reason="health under an HTTP flood and a held pool: the app's, measured on one server database"
)

CLIENTS = 300


@pytest.fixture
def computations(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """When each health computation started (monotonic)."""
    started: list[float] = []
    real = health.compute_health

    async def counted(outbox: Any) -> Any:
        started.append(time.monotonic())
        return await real(outbox)

    monkeypatch.setattr(health, "compute_health", counted)
    return started


def api_only(url: str, **settings: Any) -> Outbox:
    return Outbox(
        url,
        brokers={"default": MemoryBroker()},
        settings=OutboxSettings(run_relays=False, **settings),
        engine_options={"pool_size": 2, "max_overflow": 0, "pool_timeout": 30},
        dashboard_dependencies=[],
    )


async def flood(base: str, path: str, n: int = CLIENTS) -> list[httpx.Response]:
    """``n`` anonymous clients at once, each on its own connection."""
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=30) as client:
        return list(await asyncio.gather(*(client.get(path) for _ in range(n))))


async def test_a_flood_of_anonymous_clients_costs_one_computation_per_period(
    pg_url: str, computations: list[float]
) -> None:
    outbox = api_only(pg_url, health_cache_seconds=2.0)
    await outbox.create_tables()
    app = FastAPI(lifespan=outbox.lifespan)
    app.include_router(outbox.health_router)
    try:
        async with live_server(app) as base:
            began = time.monotonic()
            answers = await flood(base, "/outbox/health")
            took = time.monotonic() - began
        codes = {a.status_code for a in answers}
        assert codes == {200}, [a.text for a in answers if a.status_code != 200][:3]
        assert {a.json()["database"] for a in answers} == {"ok"}
        # At most one computation per started cache period, however many clients asked.
        assert 1 <= len(computations) <= int(took / 2.0) + 1, (len(computations), took)
    finally:
        await outbox.aclose()


@contextlib.asynccontextmanager
async def held(outbox: Outbox, n: int) -> AsyncIterator[None]:
    """Every one of the pool's ``n`` connections checked out, as slow requests hold them."""
    async with contextlib.AsyncExitStack() as stack:
        for _ in range(n):
            conn = await stack.enter_async_context(outbox.engine.connect())
            await conn.execute(text("SELECT 1"))
        yield


async def test_an_exhausted_pool_is_busy_never_database_down(
    pg_url: str, computations: list[float]
) -> None:
    outbox = api_only(pg_url, health_cache_seconds=0.5)
    await outbox.create_tables()
    app = FastAPI(lifespan=outbox.lifespan)
    app.include_router(outbox.router)
    try:
        async with live_server(app) as base, held(outbox, 2):
            answers = await flood(base, "/outbox/health", 100)
            assert {a.status_code for a in answers} == {200}
            body = answers[0].json()
            assert body["database"] == "busy" and body["status"] == "degraded"
            assert body["pool"] == {"in_use": 2, "capacity": 2, "wait_seconds": None}
            assert any("connection pool busy (2 of 2 in use" in r for r in body["reasons"])
            assert not any("unreachable" in r for r in body["reasons"])
            # Liveness has nothing to say about a busy pool.
            async with httpx.AsyncClient(base_url=base) as client:
                live = await client.get("/outbox/health/live")
                assert live.status_code == 200 and live.json()["status"] == "ok"
        async with live_server(app) as base, httpx.AsyncClient(base_url=base) as client:
            freed: dict[str, Any] = {}

            async def computed_after_release() -> bool:  # the busy answer stays cached 0.5 s
                freed.update((await client.get("/outbox/health")).json())
                return bool(freed["database"] == "ok")

            await wait_until(computed_after_release, timeout=10)
            assert freed["pool"]["wait_seconds"] is not None
    finally:
        await outbox.aclose()


async def test_a_database_outage_fails_readiness_not_liveness(
    pg_url: str, computations: list[float]
) -> None:
    proxy = TcpProxy(5432)
    await proxy.start()
    outbox = api_only(pg_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}"))
    await outbox.create_tables()
    app = FastAPI(lifespan=outbox.lifespan)
    app.include_router(outbox.router)
    try:
        async with live_server(app) as base, httpx.AsyncClient(base_url=base) as client:
            assert (await client.get("/outbox/health/ready")).status_code == 200
            # A restart between two checks: health's kept connection died while idle; the
            # next check replaces it instead of reporting the database down.
            await proxy.stop()
            await proxy.start()
            await _first_new_computation_is_ready(client, computations)
            await proxy.stop()
            ready = await _after_cache(client, "/outbox/health/ready")
            assert ready.status_code == 503
            assert ready.json()["database"] == "down"
            live = await client.get("/outbox/health/live")
            assert live.status_code == 200, live.text
            # Back: the first check computed after it says so (health's kept connection died
            # in the outage; it is replaced, not reported as the database down once more).
            await proxy.start()
            await _first_new_computation_is_ready(client, computations)
    finally:
        await proxy.stop()
        await outbox.aclose()


async def _first_new_computation_is_ready(
    client: httpx.AsyncClient, computations: list[float]
) -> None:
    before = len(computations)
    answers: list[httpx.Response] = []

    async def computed_again() -> bool:
        answers.append(await client.get("/outbox/health/ready"))
        return len(computations) > before

    await wait_until(computed_again, timeout=10)
    assert len(computations) == before + 1
    assert answers[-1].status_code == 200, answers[-1].text


async def _after_cache(client: httpx.AsyncClient, path: str) -> httpx.Response:
    """The first answer computed after the cached one (health_cache_seconds=1)."""
    deadline = time.monotonic() + 15
    while True:
        answer = await client.get(path)
        if answer.status_code == 503 or time.monotonic() > deadline:
            return answer
        await asyncio.sleep(0.1)


async def test_an_app_that_never_entered_the_lifespan_is_down_naming_the_fix(
    pg_url: str,
) -> None:
    outbox = Outbox(pg_url, brokers={"default": MemoryBroker()})  # run_relays on
    await outbox.create_tables()
    forgot = FastAPI()  # no lifespan=outbox.lifespan
    forgot.include_router(outbox.health_router)
    api_only_app = FastAPI()
    elsewhere = api_only(pg_url)  # the relay runs in `fastapi-outbox dispatch`
    api_only_app.include_router(elsewhere.health_router)
    try:
        async with live_server(forgot) as base, httpx.AsyncClient(base_url=base) as client:
            answer = await client.get("/outbox/health")
            assert answer.status_code == 503
            [reason] = answer.json()["reasons"]
            assert "never started" in reason and "lifespan=outbox.lifespan" in reason
            assert "fastapi-outbox dispatch" in reason and "run_relays=False" in reason
        async with live_server(api_only_app) as base, httpx.AsyncClient(base_url=base) as c:
            answer = await c.get("/outbox/health")
            assert answer.status_code == 200 and answer.json()["status"] == "ok"
    finally:
        await outbox.aclose()
        await elsewhere.aclose()


async def test_two_dashboards_under_two_prefixes_answer_their_own_data_under_a_flood(
    pg_url: str, second_pg_url: str
) -> None:
    first, second = api_only(pg_url), api_only(second_pg_url)
    streams = {}
    for name, outbox in (("a", first), ("b", second)):
        await outbox.create_tables()
        streams[name] = unique(f"stream_{name}")
        async with outbox.unit_of_work() as uow:
            uow.publish(Message(streams[name], "Happened", {}))
    app = FastAPI()
    app.include_router(first.dashboard_router, prefix="/a")
    app.include_router(second.dashboard_router, prefix="/b")
    try:
        async with live_server(app) as base:
            a, b = await asyncio.gather(
                flood(base, "/a/outbox/dashboard/api/overview", 100),
                flood(base, "/b/outbox/dashboard/api/overview", 100),
            )
            for answers, mine, other in ((a, "a", "b"), (b, "b", "a")):
                assert {r.status_code for r in answers} == {200}
                for r in answers:
                    names = {s["stream"] for s in r.json()["streams"]}
                    assert streams[mine] in names and streams[other] not in names
            async with httpx.AsyncClient(base_url=base) as client:
                page = await client.get("/b/outbox/dashboard")
                assert 'href="/b/outbox/dashboard/static/dashboard.css"' in page.text
                assert "/outbox/dashboard/static" not in page.text.replace("/b/outbox", "")
    finally:
        await first.aclose()
        await second.aclose()


@pytest.fixture
def second_pg_url(_pg_databases: Any) -> Iterator[str]:
    from tests.conftest import PG_URL

    name = _pg_databases.take()
    yield f"{PG_URL.rpartition('/')[0]}/{name}"
    _pg_databases.drop(name)

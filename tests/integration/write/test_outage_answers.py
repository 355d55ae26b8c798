"""A request whose unit of work meets an outage answers 503 with ``Retry-After`` and a short
body (never a bare 500), and leaves nothing: the same all-or-nothing outcome as any failure."""

from __future__ import annotations

import uuid

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import Column, MetaData, String, Table, func, select

from fastapi_outbox import Message, Outbox, OutboxSettings, UnitOfWorkDep, exceptions
from fastapi_outbox.brokers import MemoryBroker
from tests.servers import TcpProxy

pytestmark = pytest.mark.postgres(
    reason=(
        "a proxy to the PostgreSQL server cut under requests: "
        "the 503 answer is the write path's, one server suffices"
    )
)

metadata = MetaData()
orders = Table("outage_orders", metadata, Column("id", String(36), primary_key=True))


def app_for(outbox: Outbox) -> FastAPI:
    app = FastAPI(lifespan=outbox.lifespan)

    @app.post("/orders")
    async def place(uow: UnitOfWorkDep) -> dict[str, str]:
        oid = str(uuid.uuid4())
        await uow.session.execute(orders.insert().values(id=oid))
        uow.publish(Message("orders", "OrderPlaced", {"id": oid}))
        return {"id": oid}

    @app.post("/broker-down")
    async def broker_down(uow: UnitOfWorkDep) -> None:
        await uow.session.execute(orders.insert().values(id=str(uuid.uuid4())))
        raise exceptions.BrokerUnavailable("partner broker down")

    @app.post("/bug")
    async def bug(uow: UnitOfWorkDep) -> None:
        raise ValueError("the app's own bug")

    return app


async def counts(outbox: Outbox) -> tuple[int, int]:
    async with outbox.engine.connect() as conn:
        rows = (await conn.execute(select(func.count()).select_from(orders))).scalar_one()
        events = (await conn.execute(select(func.count()).select_from(outbox.table))).scalar_one()
    return int(rows), int(events)


async def test_a_database_outage_answers_503_with_retry_after_and_saves_nothing(
    pg_url: str,
) -> None:
    proxy = TcpProxy(5432)
    await proxy.start()
    outbox = Outbox(
        pg_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}"),
        brokers={"default": MemoryBroker()},
        settings=OutboxSettings(run_relays=False),
        engine_options={"pool_timeout": 2},
    )
    direct = Outbox(pg_url, brokers={"default": MemoryBroker()})
    await outbox.create_tables()
    async with outbox.engine.begin() as conn:
        await conn.run_sync(metadata.create_all)
    app = app_for(outbox)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    try:
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=transport, base_url="http://t") as client,
        ):
            assert (await client.post("/orders")).status_code == 200
            await proxy.stop()  # every connection cut, no new one accepted
            for _ in range(3):
                answer = await client.post("/orders")
                assert answer.status_code == 503, answer.text
                assert answer.headers["Retry-After"] == "5"
                assert "nothing was saved" in answer.json()["detail"]
            await proxy.start()
            assert (await client.post("/orders")).status_code == 200
        assert await counts(direct) == (2, 2)  # the two 200s, nothing of the 503s
    finally:
        await proxy.stop()
        await outbox.aclose()
        await direct.aclose()


async def test_a_broker_outage_answers_503_and_rolls_back_while_bugs_stay_500(
    pg_url: str,
) -> None:
    outbox = Outbox(
        pg_url,
        brokers={"default": MemoryBroker()},
        settings=OutboxSettings(run_relays=False),
    )
    await outbox.create_tables()
    async with outbox.engine.begin() as conn:
        await conn.run_sync(metadata.create_all)
    app = app_for(outbox)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    try:
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=transport, base_url="http://t") as client,
        ):
            answer = await client.post("/broker-down")
            assert answer.status_code == 503
            assert answer.headers["Retry-After"] == "5"
            assert "broker is unavailable" in answer.json()["detail"]
            assert (await client.post("/bug")).status_code == 500
        assert await counts(outbox) == (0, 0)
    finally:
        await outbox.aclose()

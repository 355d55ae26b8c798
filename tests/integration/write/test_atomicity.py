"""Atomicity as the HTTP client sees it, on SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import pytest
from fastapi import FastAPI, HTTPException
from sqlalchemy import ForeignKey, Integer, String, func, select
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from fastapi_outbox import AggregateRoot, Event, Outbox, OutboxSettings, UnitOfWorkDep
from fastapi_outbox.brokers import MemoryBroker
from tests.conftest import asgi_client


class Base(DeclarativeBase):
    pass


class Customer(Base):
    __tablename__ = "customers"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)


class Order(Base, AggregateRoot):
    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    ref: Mapped[str] = mapped_column(String(50))
    total: Mapped[float]
    # Checked at COMMIT, after the handler returned: the commit itself fails.
    customer_id: Mapped[int | None] = mapped_column(
        ForeignKey("customers.id", deferrable=True, initially="DEFERRED")
    )


class OrderPlaced(Event, stream="orders", key="order_id"):
    order_id: int
    total: float


def build_app(outbox: Outbox) -> FastAPI:
    app = FastAPI(lifespan=outbox.lifespan)
    app.include_router(outbox.health_router)

    @app.post("/orders")
    async def place(body: dict[str, Any], uow: UnitOfWorkDep) -> dict[str, Any]:
        order = Order(ref=body["ref"], total=body["total"], customer_id=body.get("customer"))
        uow.session.add(order)
        await uow.session.flush()
        order.raise_event(OrderPlaced(order_id=order.id, total=order.total))
        if body.get("fail") == "http":
            raise HTTPException(422, "refused after writing")
        if body.get("fail") == "crash":
            raise RuntimeError("handler bug after writing")
        return {"id": order.id}

    return app


@pytest.fixture
async def setup(db_url: str) -> AsyncIterator[tuple[Outbox, MemoryBroker, httpx.AsyncClient]]:
    broker = MemoryBroker()
    outbox = Outbox(db_url, brokers={"default": broker}, settings=OutboxSettings(run_relays=False))
    async with outbox.engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    await outbox.create_tables()
    async with asgi_client(build_app(outbox)) as client:
        yield outbox, broker, client
    await outbox.aclose()


async def counts(outbox: Outbox) -> tuple[int, int]:
    async with outbox.engine.connect() as conn:
        orders = (await conn.execute(select(func.count()).select_from(Order))).scalar_one()
    return orders, await outbox.store.messages.count()


async def test_success_commits_business_row_and_event_together(setup: Any) -> None:
    outbox, _, client = setup
    response = await client.post("/orders", json={"ref": "a", "total": 10})
    assert response.status_code == 200
    assert await counts(outbox) == (1, 1)
    row = (await outbox.store.messages.list_messages())[0]
    assert row["stream"] == "orders" and row["type"] == "OrderPlaced"
    assert row["key"] == str(response.json()["id"]) and row["status"] == "pending"


@pytest.mark.parametrize("fail", ["http", "crash"])
async def test_handler_error_leaves_nothing(setup: Any, fail: str) -> None:
    outbox, _, client = setup
    response = await client.post("/orders", json={"ref": "a", "total": 10, "fail": fail})
    assert response.status_code == (422 if fail == "http" else 500)
    assert await counts(outbox) == (0, 0)


async def test_failing_commit_gives_5xx_and_writes_nothing(setup: Any) -> None:
    outbox, _, client = setup
    assert (await client.post("/orders", json={"ref": "ok", "total": 1})).status_code == 200
    response = await client.post("/orders", json={"ref": "bad", "total": 2, "customer": 999})
    assert response.status_code >= 500
    assert await counts(outbox) == (1, 1)


async def test_200_concurrent_requests_make_200_rows(setup: Any) -> None:
    outbox, _, client = setup
    statuses: list[int] = []

    async def one(i: int) -> None:
        r = await client.post("/orders", json={"ref": f"r{i}", "total": i})
        statuses.append(r.status_code)

    async with anyio.create_task_group() as tg:
        for i in range(200):
            tg.start_soon(one, i)
    assert statuses.count(200) == 200
    assert await counts(outbox) == (200, 200)

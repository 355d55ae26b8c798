"""Two outboxes (two databases) in one app: each route writes to its own."""

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

import httpx
from fastapi import Depends, FastAPI

from fastapi_outbox import Message, Outbox, OutboxSettings, UnitOfWork
from fastapi_outbox.brokers import MemoryBroker


async def test_each_route_writes_to_its_own_outbox(tmp_path: Any, pg_url: str) -> None:
    settings = OutboxSettings(run_relays=False)
    orders = Outbox(pg_url, brokers={"default": MemoryBroker()}, settings=settings)
    billing = Outbox(
        f"sqlite+aiosqlite:///{tmp_path}/billing.db",
        brokers={"default": MemoryBroker()},
        settings=settings,
    )
    await orders.create_tables()
    await billing.create_tables()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with orders.lifespan(app), billing.lifespan(app):
            yield

    app = FastAPI(lifespan=lifespan)

    OrdersUow = Annotated[UnitOfWork, Depends(orders.dependency)]
    BillingUow = Annotated[UnitOfWork, Depends(billing.dependency)]

    @app.post("/orders")
    async def place(uow: OrdersUow) -> dict[str, str]:
        uow.publish(Message("orders", "OrderPlaced", {"n": 1}))
        return {"ok": "orders"}

    @app.post("/invoices")
    async def invoice(uow: BillingUow) -> dict[str, str]:
        uow.publish(Message("invoices", "Invoiced", {"n": 2}))
        uow.publish(Message("invoices", "Invoiced", {"n": 3}))
        return {"ok": "billing"}

    try:
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://test"
            ) as client,
        ):
            assert (await client.post("/orders")).status_code == 200
            assert (await client.post("/invoices")).status_code == 200
        assert await orders.store.messages.count() == 1
        assert await billing.store.messages.count() == 2
        assert [r["stream"] for r in await billing.store.messages.list_messages()] == [
            "invoices"
        ] * 2
    finally:
        await orders.aclose()
        await billing.aclose()

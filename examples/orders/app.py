"""The example orders service.

With no configuration it runs on a local SQLite file and the in-memory broker; set
``DATABASE_URL`` (e.g. ``postgresql+asyncpg://postgres@127.0.0.1/test``) and ``BROKER_URL``
(``redis://127.0.0.1:6379/0``, ``nats://127.0.0.1:4222``,
``amqp://guest:guest@127.0.0.1:5672/`` or ``kafka://127.0.0.1:9092``) to run it on real
services.
"""

from __future__ import annotations

import base64
import logging
import os
import secrets
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Path, Request
from pydantic import BaseModel, Field
from sqlalchemy import ForeignKey, String, select
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from fastapi_outbox import AggregateRoot, Event, Outbox, UnitOfWork, UnitOfWorkDep
from fastapi_outbox.brokers import MemoryBroker, broker_from_url

logger = logging.getLogger("examples.orders")

DATABASE_URL = os.environ.get("DATABASE_URL", "sqlite+aiosqlite:///./orders.db")
BROKER_URL = os.environ.get("BROKER_URL", "memory://")


class Base(DeclarativeBase):
    pass


class Order(Base, AggregateRoot):
    __tablename__ = "orders"

    id: Mapped[int] = mapped_column(primary_key=True)
    customer: Mapped[str] = mapped_column(String(100))
    total: Mapped[float]
    status: Mapped[str] = mapped_column(String(20), default="placed")


class OrderLine(Base):
    __tablename__ = "order_lines"

    id: Mapped[int] = mapped_column(primary_key=True)
    order_id: Mapped[int] = mapped_column(ForeignKey("orders.id"))
    sku: Mapped[str] = mapped_column(String(50))


class OrderPlaced(Event, stream="orders", key="order_id"):
    order_id: int
    customer: str
    total: float


class OrderCancelled(Event, stream="orders", key="order_id", external=False):
    order_id: int


class Invoice(Base):
    """Written by the billing subscriber, once per order (the inbox skips redeliveries)."""

    __tablename__ = "invoices"

    id: Mapped[int] = mapped_column(primary_key=True)
    order_id: Mapped[int]
    customer: Mapped[str] = mapped_column(String(100))
    amount: Mapped[float]


class InvoiceIssued(Event, stream="invoices", key="order_id"):
    order_id: int
    invoice_id: int
    amount: float


#: Printable text only: no control characters (PostgreSQL cannot store NUL in text).
PRINTABLE = r"^[^\x00-\x1f\x7f]+$"
#: The orders' ids are PostgreSQL ``integer``s: a larger id is no order, not a server error.
OrderId = Annotated[int, Path(ge=1, le=2**31 - 1)]


class NewOrder(BaseModel):
    # The bounds are the columns' own, so every request the schema allows can be stored.
    customer: str = Field(min_length=1, max_length=100, pattern=PRINTABLE)
    total: float = Field(ge=0)
    skus: list[Annotated[str, Field(min_length=1, max_length=50, pattern=PRINTABLE)]] = Field(
        default_factory=list, max_length=100
    )


#: The dashboard's token: DASHBOARD_TOKEN, or one made up at start. Only a token made up
#: here is printed by __main__ (one the user chose is a secret of theirs: never echoed).
DASHBOARD_TOKEN_GENERATED = not os.environ.get("DASHBOARD_TOKEN")
DASHBOARD_TOKEN = os.environ.get("DASHBOARD_TOKEN") or secrets.token_urlsafe(16)


def require_dashboard_token(request: Request) -> None:
    """The dashboard's guard: ``Authorization: Bearer <token>``, or HTTP basic auth with the
    token as password (what a browser asks for); the user name is logged with actions."""
    scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
    user, token = "api", ""
    if scheme.lower() == "bearer":
        token = credentials
    elif scheme.lower() == "basic":
        try:
            user, _, token = base64.b64decode(credentials).decode().partition(":")
        except ValueError:
            token = ""
    if not secrets.compare_digest(token.encode(), DASHBOARD_TOKEN.encode()):
        raise HTTPException(
            401, "dashboard token required", headers={"WWW-Authenticate": 'Basic realm="outbox"'}
        )
    request.state.outbox_operator = user or "admin"


broker = broker_from_url(BROKER_URL) if BROKER_URL != "memory://" else MemoryBroker()
outbox = Outbox(
    DATABASE_URL,
    brokers={"default": broker},
    dashboard_dependencies=[Depends(require_dashboard_token)],
)


@outbox.subscriber("orders", group="billing")
async def bill(event: OrderPlaced, uow: UnitOfWork) -> None:
    """Billing: an invoice per placed order, and InvoiceIssued raised in the same
    transaction (its causation id is the OrderPlaced message id)."""
    invoice = Invoice(order_id=event.order_id, customer=event.customer, amount=event.total)
    uow.session.add(invoice)
    await uow.session.flush()
    uow.publish(InvoiceIssued(order_id=event.order_id, invoice_id=invoice.id, amount=event.total))


@outbox.subscriber("invoices", group="mailer")
async def mail_invoice(event: InvoiceIssued) -> None:
    """Mailer: would email the invoice (a log line here). Its group also gives the
    ``invoices`` stream a queue on RabbitMQ, where a message no queue is bound to is
    refused (the relay retries it) rather than dropped."""
    logger.info("invoice %s of order %s mailed", event.invoice_id, event.order_id)


async def _lifespan_tables() -> None:
    async with outbox.engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    await outbox.create_tables()


def create_app() -> FastAPI:
    from collections.abc import AsyncIterator
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await _lifespan_tables()
        async with outbox.lifespan(app):
            yield

    app = FastAPI(title="orders (fastapi-outbox example)", lifespan=lifespan)
    app.include_router(outbox.health_router)
    # The guard is this app's: its answer is documented where the routers are included.
    guarded: dict[int | str, dict[str, Any]] = {
        401: {"description": "No dashboard token, or a wrong one."}
    }
    app.include_router(outbox.dashboard_router, responses=guarded)
    app.include_router(outbox.asyncapi_router, responses=guarded)  # /outbox/asyncapi.json

    @app.post("/orders", status_code=201)
    async def place_order(body: NewOrder, uow: UnitOfWorkDep) -> dict[str, Any]:
        order = Order(customer=body.customer, total=body.total)
        uow.session.add(order)
        await uow.session.flush()
        for sku in body.skus:
            uow.session.add(OrderLine(order_id=order.id, sku=sku))
        order.raise_event(
            OrderPlaced(order_id=order.id, customer=order.customer, total=order.total)
        )
        return {"id": order.id}

    @app.post(
        "/orders/{order_id}/cancel",
        responses={
            404: {"description": "No such order."},
            409: {"description": "The order is already cancelled."},
        },
    )
    async def cancel_order(order_id: OrderId, uow: UnitOfWorkDep) -> dict[str, Any]:
        order = await uow.session.get(Order, order_id)
        if order is None:
            raise HTTPException(404, f"order {order_id} not found")
        if order.status == "cancelled":
            raise HTTPException(409, f"order {order_id} is already cancelled")
        order.status = "cancelled"
        order.raise_event(OrderCancelled(order_id=order_id))
        return {"id": order_id, "status": order.status}

    @app.get("/orders")
    async def list_orders(uow: UnitOfWorkDep) -> list[dict[str, Any]]:
        rows = (await uow.session.execute(select(Order).order_by(Order.id).limit(100))).scalars()
        return [
            {"id": o.id, "customer": o.customer, "total": o.total, "status": o.status} for o in rows
        ]

    @app.get("/invoices")
    async def list_invoices(uow: UnitOfWorkDep) -> list[dict[str, Any]]:
        rows = await uow.session.execute(select(Invoice).order_by(Invoice.id.desc()).limit(100))
        return [
            {"id": i.id, "order_id": i.order_id, "customer": i.customer, "amount": i.amount}
            for i in rows.scalars()
        ]

    @app.get("/published")
    async def published() -> list[dict[str, Any]]:
        """What the memory broker received (empty with a real broker)."""
        if not isinstance(broker, MemoryBroker):
            return []
        return [
            {"id": m.id, "stream": m.stream, "type": m.type, "key": m.key, "payload": m.json()}
            for m in broker.messages[-100:]
        ]

    return app


app = create_app()

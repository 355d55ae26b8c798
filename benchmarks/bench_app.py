"""The application the benchmarks run: the example's order endpoint, with and without the outbox.

Configured from the environment, so the same module serves uvicorn
(``uvicorn benchmarks.bench_app:app``) and the relay CLI
(``fastapi-outbox dispatch --app benchmarks.bench_app:outbox``):

* ``BENCH_DATABASE_URL`` — the run's own database (``postgresql+asyncpg://…/bench_…``);
* ``BENCH_BROKER_URL`` — ``memory://`` (default), ``redis://…``, ``nats://…`` or ``amqp://…``;
* ``BENCH_BROKER_OPTIONS`` — JSON object of keyword arguments for ``broker_from_url`` (e.g.
  ``{"replicas": 3}`` on a NATS cluster, whose URL lists the nodes comma-separated);
* ``BENCH_BROKER_NAME`` — the outbox broker name (default ``default``): several relay
  groups can share one table, each draining only the rows of its broker name;
* ``BENCH_POOL_SIZE`` / ``BENCH_MAX_OVERFLOW`` — engine pool (the PostgreSQL server is
  shared: keep connections bounded);
* ``BENCH_GC_FREEZE=1`` — ``gc.freeze()`` once the app is built (an experiment knob: how
  much of the relay's CPU goes to the cyclic garbage collector);
* ``OUTBOX_*`` — the outbox settings (``OUTBOX_RUN_RELAYS=false`` for an API-only
  process, ``OUTBOX_BATCH_SIZE``, ``OUTBOX_WORKERS`` …).

``POST /orders`` is the example's endpoint (an ``Order`` aggregate raising ``OrderPlaced``
through ``UnitOfWorkDep``); ``POST /orders-plain`` does the same work in a plain
``AsyncSession`` transaction that commits only the order, with the same dependency style
(commit before the response is sent). The difference between the two is the outbox's cost.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import Depends, FastAPI
from pydantic import BaseModel, Field
from sqlalchemy import String
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from fastapi_outbox import AggregateRoot, Event, Outbox, UnitOfWorkDep
from fastapi_outbox.brokers import MemoryBroker, broker_from_url

DATABASE_URL = os.environ.get(
    "BENCH_DATABASE_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/bench"
)
BROKER_URL = os.environ.get("BENCH_BROKER_URL", "memory://")
BROKER_NAME = os.environ.get("BENCH_BROKER_NAME", "default")
BROKER_OPTIONS: dict[str, Any] = json.loads(os.environ.get("BENCH_BROKER_OPTIONS", "{}"))


class Base(DeclarativeBase):
    pass


class Order(Base, AggregateRoot):
    __tablename__ = "orders"

    id: Mapped[int] = mapped_column(primary_key=True)
    customer: Mapped[str] = mapped_column(String(100))
    total: Mapped[float]
    status: Mapped[str] = mapped_column(String(20), default="placed")


class OrderPlaced(Event, stream="orders", key="order_id"):
    order_id: int
    customer: str
    total: float


class NewOrder(BaseModel):
    customer: str = Field(min_length=1, max_length=100)
    total: float = Field(ge=0)


broker = (
    broker_from_url(BROKER_URL, **BROKER_OPTIONS) if BROKER_URL != "memory://" else MemoryBroker()
)
outbox = Outbox(
    DATABASE_URL,
    brokers={BROKER_NAME: broker},
    engine_options={
        "pool_size": int(os.environ.get("BENCH_POOL_SIZE", "16")),
        "max_overflow": int(os.environ.get("BENCH_MAX_OVERFLOW", "0")),
    },
)


async def create_schema() -> None:
    """The orders table and the outbox table (run once by the benchmark, not by the app)."""
    async with outbox.engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    await outbox.create_tables()


async def _plain_session() -> AsyncIterator[AsyncSession]:
    async with outbox.session_factory() as session, session.begin():
        yield session


PlainSessionDep = Annotated[AsyncSession, Depends(_plain_session, scope="function")]


app = FastAPI(title="fastapi-outbox benchmark", lifespan=outbox.lifespan)


@app.post("/orders", status_code=201)
async def place_order(body: NewOrder, uow: UnitOfWorkDep) -> dict[str, Any]:
    order = Order(customer=body.customer, total=body.total)
    uow.session.add(order)
    await uow.session.flush()
    order.raise_event(OrderPlaced(order_id=order.id, customer=order.customer, total=order.total))
    return {"id": order.id}


@app.post("/orders-plain", status_code=201)
async def place_order_plain(body: NewOrder, session: PlainSessionDep) -> dict[str, Any]:
    order = Order(customer=body.customer, total=body.total)
    session.add(order)
    await session.flush()
    return {"id": order.id}


def memory_published() -> int:
    """Messages the memory broker received (relays-on round)."""
    return len(broker.messages) if isinstance(broker, MemoryBroker) else 0


if os.environ.get("BENCH_GC_FREEZE") == "1":
    import gc

    gc.collect()
    gc.freeze()


@app.get("/bench/published")
async def published() -> dict[str, int]:
    return {"published": memory_published()}

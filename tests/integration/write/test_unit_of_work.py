"""The unit of work against a real database: what it writes, the headers of each row, the
aggregates it harvests, and ``outbox.unit_of_work()`` outside routes."""

from __future__ import annotations

import datetime as dt
import gc
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import Depends, FastAPI, Request
from sqlalchemy import Integer, String, func, select
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from fastapi_outbox import (
    AggregateRoot,
    Event,
    Message,
    Outbox,
    OutboxSettings,
    UnitOfWork,
    UnitOfWorkDep,
    unit_of_work,
)
from fastapi_outbox.brokers import MemoryBroker
from fastapi_outbox.testing import drain
from tests.conftest import asgi_client

pytestmark = pytest.mark.mariadb


class Base(DeclarativeBase):
    pass


class Order(Base, AggregateRoot):
    __tablename__ = "uow_orders"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    status: Mapped[str] = mapped_column(String(20), default="placed")


class OrderPlaced(Event, stream="orders", key="order_id"):
    order_id: int


class OrderShipped(Event, stream="orders", key="order_id"):
    order_id: int


TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


def settings() -> OutboxSettings:
    return OutboxSettings(run_relays=False)


@pytest.fixture
async def outbox(db_url: str) -> AsyncIterator[Outbox]:
    box = Outbox(
        db_url,
        brokers={"default": MemoryBroker(), "audit": MemoryBroker()},
        settings=settings(),
    )
    async with box.engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    await box.create_tables()
    yield box
    await box.aclose()


async def counts(outbox: Outbox) -> tuple[int, int]:
    async with outbox.engine.connect() as conn:
        orders = (await conn.execute(select(func.count()).select_from(Order))).scalar_one()
    return orders, await outbox.store.messages.count()


async def rows(outbox: Outbox) -> list[dict[str, Any]]:
    """Every outbox row, oldest first, with headers and payload decoded."""
    out = []
    for listed in reversed(await outbox.store.messages.list_messages(limit=1000)):
        row = await outbox.store.messages.get(listed["id"])
        assert row is not None
        out.append(
            {**row, "headers": json.loads(row["headers"]), "payload": json.loads(row["payload"])}
        )
    return out


def build_app(outbox: Outbox) -> FastAPI:
    app = FastAPI(lifespan=outbox.lifespan)

    @app.post("/orders")
    async def place(uow: UnitOfWorkDep) -> dict[str, Any]:
        order = Order()
        uow.session.add(order)
        await uow.session.flush()
        order.raise_event(OrderPlaced(order_id=order.id))
        return {"id": order.id}

    @app.post("/messages")
    async def explicit(
        request: Request,
        uow: UnitOfWork = Depends(unit_of_work),  # noqa: B008 (the contract's own form)
    ) -> dict[str, Any]:
        body = await request.json()
        message_id = uow.publish(
            Message(stream="audit.log", type="Audited", payload=body),
            key="k1",
            headers={"tenant": "acme"},
            broker="audit",
        )
        return {"message_id": str(message_id)}

    return app


@pytest.fixture
async def client(outbox: Outbox) -> AsyncIterator[httpx.AsyncClient]:
    async with asgi_client(build_app(outbox)) as http:
        yield http


# -- construction -----------------------------------------------------------------------------


async def test_outbox_accepts_an_async_engine_and_leaves_it_open(db_url: str) -> None:
    engine = create_async_engine(db_url)
    try:
        outbox = Outbox(engine, settings=settings())
        assert outbox.engine is engine
        await outbox.create_tables()
        async with outbox.unit_of_work() as uow:
            uow.publish(OrderPlaced(order_id=1))
        assert await outbox.store.messages.count() == 1
        await outbox.aclose()
        # the caller owns the engine: closing the outbox did not dispose it
        async with engine.connect() as conn:
            assert (await conn.execute(select(1))).scalar_one() == 1
    finally:
        await engine.dispose()


# -- the HTTP dependency ------------------------------------------------------------------------


async def test_route_with_unit_of_work_dep_commits_row_and_event(
    outbox: Outbox, client: httpx.AsyncClient
) -> None:
    response = await client.post("/orders")
    assert response.status_code == 200
    assert await counts(outbox) == (1, 1)
    [row] = await rows(outbox)
    assert (row["stream"], row["type"], row["key"]) == ("orders", "OrderPlaced", "1")
    assert row["payload"] == {"order_id": 1}


async def test_depends_unit_of_work_publishes_an_explicit_message(
    outbox: Outbox, client: httpx.AsyncClient
) -> None:
    response = await client.post("/messages", json={"who": "ada"})
    assert response.status_code == 200
    [row] = await rows(outbox)
    assert str(row["id"]) == response.json()["message_id"]
    assert (row["broker"], row["stream"], row["type"], row["key"]) == (
        "audit",
        "audit.log",
        "Audited",
        "k1",
    )
    assert row["payload"] == {"who": "ada"}
    assert row["headers"]["tenant"] == "acme"
    assert await drain(outbox) == 1
    [published] = outbox.brokers["audit"].messages  # type: ignore[attr-defined]
    assert published.id == response.json()["message_id"]
    assert published.json() == {"who": "ada"}


async def test_contract_headers_of_a_row(outbox: Outbox, client: httpx.AsyncClient) -> None:
    before = dt.datetime.now(dt.UTC)
    response = await client.post("/messages", json={})
    after = dt.datetime.now(dt.UTC)
    [row] = await rows(outbox)
    headers = row["headers"]
    # message-id: UUIDv7, the row's own id (also the brokers' de-duplication id)
    assert headers["message-id"] == str(row["id"]) == response.json()["message_id"]
    assert uuid.UUID(headers["message-id"]).version == 7
    assert headers["type"] == "Audited"
    occurred = dt.datetime.fromisoformat(headers["occurred-at"])
    assert occurred.utcoffset() == dt.timedelta(0)
    assert before <= occurred <= after
    # no correlation header on the request: a new one, a UUID
    assert uuid.UUID(headers["correlation-id"])


async def test_correlation_id_from_header_traceparent_or_new(
    outbox: Outbox, client: httpx.AsyncClient
) -> None:
    await client.post("/messages", json={}, headers={"X-Correlation-ID": "req-42"})
    await client.post("/messages", json={}, headers={"traceparent": TRACEPARENT})
    await client.post("/messages", json={})
    await client.post("/messages", json={})
    first, second, third, fourth = [r["headers"] for r in await rows(outbox)]
    assert first["correlation-id"] == "req-42"
    assert second["correlation-id"] == TRACE_ID
    assert second["traceparent"] == TRACEPARENT
    assert third["correlation-id"] != fourth["correlation-id"]  # new for every request
    assert "causation-id" not in first


@pytest.mark.parametrize("bad", ["x" * 129, "two words", "a;b", "<script>"])
async def test_invalid_correlation_header_is_400_naming_it_and_writes_nothing(
    outbox: Outbox, client: httpx.AsyncClient, bad: str
) -> None:
    response = await client.post("/orders", headers={"X-Correlation-ID": bad})
    assert response.status_code == 400
    assert "X-Correlation-ID" in response.json()["detail"]
    assert await counts(outbox) == (0, 0)


async def test_causation_id_outside_routes(outbox: Outbox) -> None:
    async with outbox.unit_of_work(causation_id="evt-0001", correlation_id="flow-7") as uow:
        uow.publish(OrderShipped(order_id=3))
    [row] = await rows(outbox)
    assert row["headers"]["causation-id"] == "evt-0001"
    assert row["headers"]["correlation-id"] == "flow-7"


# -- outbox.unit_of_work() ----------------------------------------------------------------------


async def test_unit_of_work_cm_commits_on_exit(outbox: Outbox) -> None:
    async with outbox.unit_of_work() as uow:
        uow.session.add(Order(id=10))
        uow.publish(OrderPlaced(order_id=10))
        assert await counts(outbox) == (0, 0)  # not visible before the commit
    assert await counts(outbox) == (1, 1)
    assert outbox.brokers["default"].messages == []  # type: ignore[attr-defined]
    assert await drain(outbox) == 1


async def test_unit_of_work_cm_rolls_back_on_exception(outbox: Outbox) -> None:
    class Boom(Exception):
        pass

    async def work() -> None:
        async with outbox.unit_of_work() as uow:
            order = Order(id=11)
            uow.session.add(order)
            await uow.session.flush()
            order.raise_event(OrderPlaced(order_id=11))
            uow.publish(OrderShipped(order_id=11))
            await uow.flush()  # rows are in the transaction now...
            raise Boom

    with pytest.raises(Boom):
        await work()
    assert await counts(outbox) == (0, 0)  # ...and gone with it


# -- harvesting aggregates ----------------------------------------------------------------------


async def test_event_raised_before_session_add_is_harvested(outbox: Outbox) -> None:
    async with outbox.unit_of_work() as uow:
        order = Order(id=20)
        order.raise_event(OrderPlaced(order_id=20))  # not in any session yet
        uow.session.add(order)
    [row] = await rows(outbox)
    assert (row["type"], row["key"]) == ("OrderPlaced", "20")
    assert order.pending_events == ()


async def test_event_raised_before_add_survives_flush_and_dropped_reference(
    outbox: Outbox,
) -> None:
    async with outbox.unit_of_work() as uow:
        order = Order(id=21)
        order.raise_event(OrderPlaced(order_id=21))
        uow.session.add(order)
        await uow.session.flush()  # no longer in session.new; identity map is weak
        del order
        gc.collect()
    assert [r["key"] for r in await rows(outbox)] == ["21"]


async def test_loaded_and_modified_aggregate_is_harvested(outbox: Outbox) -> None:
    async with outbox.unit_of_work() as uow:
        uow.session.add(Order(id=30))
    async with outbox.unit_of_work() as uow:
        order = await uow.session.get(Order, 30)
        assert order is not None
        order.status = "shipped"
        order.raise_event(OrderShipped(order_id=30))
    [row] = await rows(outbox)
    assert (row["type"], row["key"]) == ("OrderShipped", "30")
    async with outbox.engine.connect() as conn:
        status = (await conn.execute(select(Order.status).where(Order.id == 30))).scalar_one()
    assert status == "shipped"


async def test_aggregate_no_longer_referenced_still_gets_its_events_written(
    outbox: Outbox,
) -> None:
    """The identity map holds unmodified objects weakly: an aggregate that raised an event
    and was then dropped by the handler would vanish with its events before the commit.
    The unit of work keeps such aggregates in ``session.info``."""
    async with outbox.unit_of_work() as uow:
        uow.session.add_all([Order(id=40), Order(id=41)])
    async with outbox.unit_of_work() as uow:

        async def touch(order_id: int) -> None:
            order = await uow.session.get(Order, order_id)
            assert order is not None
            order.raise_event(OrderShipped(order_id=order_id))  # no attribute changed

        await touch(40)
        await touch(41)
        gc.collect()  # the handler holds neither order now
    assert sorted(r["key"] for r in await rows(outbox)) == ["40", "41"]


async def test_several_events_of_one_aggregate_keep_their_order(outbox: Outbox) -> None:
    async with outbox.unit_of_work() as uow:
        order = Order(id=50)
        uow.session.add(order)
        order.raise_event(OrderPlaced(order_id=50))
        order.raise_event(OrderShipped(order_id=50))
        order.raise_event(Message(stream="orders", type="Noted", payload={"n": 1}))
    assert [r["type"] for r in await rows(outbox)] == ["OrderPlaced", "OrderShipped", "Noted"]


async def test_unit_of_work_is_closed_after_commit(outbox: Outbox) -> None:
    from fastapi_outbox import UnitOfWorkError

    async with outbox.unit_of_work() as uow:
        pass
    with pytest.raises(UnitOfWorkError):
        uow.publish(OrderPlaced(order_id=1))
    assert await outbox.store.messages.count() == 0

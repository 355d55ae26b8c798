"""Text no database can commit (NUL, unpaired surrogates) is refused at ``publish()``
rather than at the COMMIT, where PostgreSQL would refuse it with a raw driver error and the
business transaction would be lost. The error names the field, it is raised where the
mistake is made, and the transaction is the caller's: it may carry on (its other rows
commit) or let the error roll it back (nothing is half-written). SQLite and PostgreSQL."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import Integer, String, func, select
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from fastapi_outbox import AggregateRoot, Event, Message, Outbox, OutboxSettings, UnitOfWorkDep
from fastapi_outbox.brokers import MemoryBroker
from fastapi_outbox.exceptions import UnstorableText
from tests.conftest import asgi_client


class Base(DeclarativeBase):
    pass


class Order(Base, AggregateRoot):
    __tablename__ = "unstorable_orders"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    note: Mapped[str] = mapped_column(String(100), default="")


class OrderPlaced(Event, stream="orders", key="order_id"):
    order_id: int
    lines: list[dict[str, Any]]


def lines(name: str) -> list[dict[str, Any]]:
    return [{"name": "tea"}, {"name": "milk"}, {"name": name}]


@pytest.fixture
async def outbox(db_url: str) -> AsyncIterator[Outbox]:
    box = Outbox(
        db_url,
        brokers={"default": MemoryBroker()},
        settings=OutboxSettings(run_relays=False),
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


BAD: dict[str, tuple[Any, dict[str, Any], str]] = {
    "NUL in a nested payload value": (
        Message("orders", "OrderPlaced", {"lines": lines("s\x00ugar")}),
        {},
        "payload.lines[2].name",
    ),
    "surrogate in a nested payload value": (
        OrderPlaced(order_id=1, lines=lines("s\ud800ugar")),
        {},
        "payload.lines[2].name",
    ),
    "NUL in a payload key": (
        Message("orders", "OrderPlaced", {"lines": [{"na\x00me": "tea"}]}),
        {},
        "key 'na\\x00me' of payload.lines[0]",
    ),
    "NUL in a header value": (
        OrderPlaced(order_id=1, lines=[]),
        {"headers": {"x-tenant": "acme\x00"}},
        "headers['x-tenant']",
    ),
    "surrogate in the key": (OrderPlaced(order_id=1, lines=[]), {"key": "k\udfff"}, "key"),
    "NUL in the stream": (Message("ord\x00ers", "OrderPlaced", {}), {}, "stream"),
}


@pytest.mark.parametrize("case", list(BAD))
async def test_refused_at_publish_and_the_transaction_carries_on(outbox: Outbox, case: str) -> None:
    event, kwargs, field = BAD[case]
    async with outbox.unit_of_work() as uow:
        uow.session.add(Order(id=1))
        uow.publish(OrderPlaced(order_id=1, lines=lines("tea")))
        with pytest.raises(UnstorableText) as info:
            uow.publish(event, **kwargs)
        assert info.value.field == field
        assert field in str(info.value)
        uow.session.add(Order(id=2))  # the transaction is intact: it goes on
    # Everything but the refused event committed.
    assert await counts(outbox) == (2, 1)


@pytest.mark.parametrize("case", list(BAD))
async def test_an_unhandled_refusal_rolls_back_the_whole_transaction(
    outbox: Outbox, case: str
) -> None:
    event, kwargs, field = BAD[case]

    async def work() -> None:
        async with outbox.unit_of_work() as uow:
            uow.session.add(Order(id=1))
            await uow.session.flush()
            uow.publish(OrderPlaced(order_id=1, lines=[]))
            uow.publish(event, **kwargs)

    with pytest.raises(UnstorableText) as info:
        await work()
    assert field in str(info.value)
    assert await counts(outbox) == (0, 0)


async def test_an_aggregate_refuses_it_when_raised_and_its_change_still_commits(
    outbox: Outbox,
) -> None:
    order = Order(id=5)  # not in a session yet: its events wait on the instance
    with pytest.raises(UnstorableText) as info:
        order.raise_event(OrderPlaced(order_id=5, lines=lines("x\x00")))
    assert info.value.field == "payload.lines[2].name"
    order.raise_event(OrderPlaced(order_id=5, lines=lines("tea")))
    async with outbox.unit_of_work() as uow:
        uow.session.add(order)
    assert await counts(outbox) == (1, 1)


async def test_look_alikes_commit_and_read_back_unchanged(outbox: Outbox) -> None:
    text = "a\\u0000b \U0001f600 Zoë \x01"  # escaped backslash, astral, accented, control
    async with outbox.unit_of_work() as uow:
        uow.publish(Message("orders", "Raw", {text: [text]}, key=text, headers={"x-note": text}))
        uow.publish(OrderPlaced(order_id=9, lines=[{text: text}]))
    table = outbox.table
    async with outbox.engine.connect() as conn:
        rows = (await conn.execute(select(table.c.payload, table.c.headers, table.c.key))).all()
    read = sorted(((decoded(p), decoded(h).get("x-note"), k) for p, h, k in rows), key=str)
    assert read == sorted(
        [({text: [text]}, text, text), ({"order_id": 9, "lines": [{text: text}]}, None, "9")],
        key=str,
    )


def decoded(value: Any) -> Any:
    """A JSON column's value (the driver may have decoded JSONB already)."""
    return json.loads(value) if isinstance(value, str) else value


def build_app(outbox: Outbox) -> FastAPI:
    app = FastAPI(lifespan=outbox.lifespan)

    @app.post("/orders/{note}")
    async def place(note: str, uow: UnitOfWorkDep) -> dict[str, Any]:
        order = Order(note="placed")
        uow.session.add(order)
        await uow.session.flush()
        uow.publish(OrderPlaced(order_id=order.id, lines=[]))
        # The client's text goes into a header: a NUL in it is refused here.
        uow.publish(Message("audit", "Noted", {"id": order.id}, headers={"x-note": note}))
        return {"id": order.id}

    return app


@pytest.fixture
async def client(outbox: Outbox) -> AsyncIterator[httpx.AsyncClient]:
    async with asgi_client(build_app(outbox)) as http:
        yield http


async def test_a_route_publishing_unstorable_text_answers_500_and_writes_nothing(
    outbox: Outbox, client: httpx.AsyncClient
) -> None:
    """publish() raising in a route is the route's error (an app that takes text from
    clients validates it, or catches UnstorableText and answers 422 naming ``field``):
    unhandled, it is a 500, and neither the order nor its first event is half-written."""
    assert (await client.post("/orders/fine")).status_code == 200
    response = await client.post("/orders/bad%00note")
    assert response.status_code == 500
    assert await counts(outbox) == (1, 2)  # the good request's order and its two events

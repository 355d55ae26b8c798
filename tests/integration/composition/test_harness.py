"""``OutboxHarness``: an app's subscribers run in-process on memory brokers, on SQLite and
PostgreSQL; ``wait_idle`` covers chains of handlers; published, handled and dead letters."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import FastAPI
from pydantic import BaseModel
from sqlalchemy import func, select, text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from fastapi_outbox import AggregateRoot, Event, Outbox, UnitOfWork, UnitOfWorkDep
from fastapi_outbox.brokers import MemoryBroker, RedisStreamsBroker
from fastapi_outbox.settings import OutboxSettings
from fastapi_outbox.testing import OutboxHarness
from tests.conftest import unique

pytestmark = pytest.mark.usefixtures("quick_fetch")


class Base(DeclarativeBase):
    pass


class Parcel(Base, AggregateRoot):
    __tablename__ = unique("parcels")
    id: Mapped[int] = mapped_column(primary_key=True)
    weight: Mapped[float]


class Label(Base):
    __tablename__ = unique("labels")
    id: Mapped[int] = mapped_column(primary_key=True)
    parcel_id: Mapped[int]


class ParcelBooked(Event, stream=unique("parcels"), key="parcel_id"):
    parcel_id: int
    weight: float


class LabelPrinted(Event, stream=unique("labels")):
    parcel_id: int
    label_id: int


class Booking(BaseModel):
    weight: float


def build(url: str, *, poison: bool = False) -> tuple[Outbox, FastAPI]:
    # A Redis broker nobody runs: the harness stands a memory broker in for it.
    outbox = Outbox(
        url,
        brokers={"default": RedisStreamsBroker("redis://127.0.0.1:1/0")},
        settings=OutboxSettings(consumer_max_attempts=3),
    )

    @outbox.subscriber(ParcelBooked.__outbox_stream__ or "", group="labels")
    async def print_label(event: ParcelBooked, uow: UnitOfWork) -> None:
        if poison and event.weight > 100:
            raise ValueError(f"parcel {event.parcel_id} is too heavy")
        label = Label(parcel_id=event.parcel_id)
        uow.session.add(label)
        await uow.session.flush()
        uow.publish(LabelPrinted(parcel_id=event.parcel_id, label_id=label.id))

    @outbox.subscriber(LabelPrinted.__outbox_stream__ or "", group="notify")
    async def notify(event: LabelPrinted) -> None:
        pass

    app = FastAPI()

    @app.post("/parcels", status_code=201)
    async def book(body: Booking, uow: UnitOfWorkDep) -> dict[str, Any]:
        parcel = Parcel(weight=body.weight)
        uow.session.add(parcel)
        await uow.session.flush()
        parcel.raise_event(ParcelBooked(parcel_id=parcel.id, weight=parcel.weight))
        return {"id": parcel.id}

    return outbox, app


async def test_a_request_its_consumers_and_what_they_publish(db_url: str) -> None:
    outbox, app = build(db_url)
    original = outbox.brokers["default"]
    async with OutboxHarness(outbox, app=app, metadata=Base.metadata) as harness:
        async with harness.client() as client:
            first = await client.post("/parcels", json={"weight": 2.5})
            second = await client.post("/parcels", json={"weight": 4})
        assert (first.status_code, second.status_code) == (201, 201)
        await harness.wait_idle()

        ids = [first.json()["id"], second.json()["id"]]
        assert harness.published(ParcelBooked) == [
            ParcelBooked(parcel_id=ids[0], weight=2.5),
            ParcelBooked(parcel_id=ids[1], weight=4),
        ]
        assert harness.handled(ParcelBooked) == harness.published(ParcelBooked)
        # The handler's own events were relayed and handled in the same wait.
        printed = harness.published(LabelPrinted)
        assert [e.parcel_id for e in printed] == ids
        assert harness.handled(LabelPrinted, group="notify") == printed
        assert harness.handled(LabelPrinted, group="labels") == []
        assert await harness.dead_letters() == []
        async with outbox.session_factory() as session:
            assert await session.scalar(select(func.count()).select_from(Label)) == 2
    # The user's broker is given back untouched.
    assert outbox.brokers["default"] is original
    await outbox.aclose()


async def test_a_poison_message_is_dead_lettered_and_the_others_go_on(sqlite_url: str) -> None:
    outbox, app = build(sqlite_url, poison=True)
    async with (
        OutboxHarness(outbox, app=app, metadata=Base.metadata) as harness,
        harness.client() as client,
    ):
        heavy = (await client.post("/parcels", json={"weight": 500})).json()["id"]
        light = (await client.post("/parcels", json={"weight": 1})).json()["id"]
        await harness.wait_idle()

        assert [e.parcel_id for e in harness.handled(ParcelBooked)] == [light]
        dead = await harness.dead_letters(group="labels")
        assert [(d.type, d.attempts) for d in dead] == [("ParcelBooked", 3)]
        assert f"parcel {heavy} is too heavy" in dead[0].error
        assert [e.parcel_id for e in harness.published(LabelPrinted)] == [light]
    await outbox.aclose()


async def test_the_harness_runs_on_a_database_of_its_own(db_url: str) -> None:
    # The app's database after its server ran: its tables, a parcel, an event never relayed.
    outbox, app = build(db_url)
    async with outbox.engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    await outbox.create_tables()
    async with outbox.unit_of_work() as uow:
        uow.session.add(Parcel(id=1, weight=9.0))
        uow.publish(ParcelBooked(parcel_id=1, weight=9.0))

    async with OutboxHarness(outbox, app=app, metadata=Base.metadata) as harness:
        async with harness.client() as client:
            booked = (await client.post("/parcels", json={"weight": 1.5})).json()["id"]
        await harness.wait_idle()
        assert booked == 1  # a fresh table: the app's parcel 1 is not in it
        assert harness.published(ParcelBooked) == [ParcelBooked(parcel_id=1, weight=1.5)]
        async with outbox.session_factory() as session:
            assert await session.scalar(select(func.count()).select_from(Parcel)) == 1

    # The app's database is as it was: one parcel, its one message, no label.
    async with outbox.session_factory() as session:
        assert await session.scalar(select(func.count()).select_from(Parcel)) == 1
        assert await session.scalar(select(Parcel.weight)) == 9.0
        assert await session.scalar(select(func.count()).select_from(Label)) == 0
        assert await session.scalar(select(func.count()).select_from(outbox.table)) == 1
    if outbox.engine.dialect.name == "postgresql":
        async with outbox.engine.connect() as conn:
            schemas = await conn.scalars(
                text("SELECT nspname FROM pg_namespace WHERE nspname LIKE 'outbox_harness_%'")
            )
            assert list(schemas) == []  # dropped on exit
    async with outbox.engine.begin() as conn:
        await conn.run_sync(Base.metadata.drop_all)
    await outbox.aclose()


async def test_wait_idle_needs_the_harness_running(sqlite_url: str) -> None:
    outbox = Outbox(sqlite_url, brokers={"default": MemoryBroker()})
    harness = OutboxHarness(outbox)
    with pytest.raises(RuntimeError, match="async with"):
        await harness.wait_idle()
    await outbox.aclose()

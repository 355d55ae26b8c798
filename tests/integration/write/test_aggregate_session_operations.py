"""Aggregates keep their events through every session operation: an
event commits exactly when its aggregate's change commits. The README's matrix "Aggregates
and session operations" is this file, on SQLite and PostgreSQL.

Each case runs in ``outbox.unit_of_work()`` on a database holding order 1 ("stored"), and
states the orders and the events that must be committed afterwards (each event once).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from sqlalchemy import Integer, String, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from fastapi_outbox import (
    AggregateRoot,
    Event,
    Outbox,
    OutboxSettings,
    UnitOfWork,
    UnitOfWorkError,
)
from fastapi_outbox.brokers import MemoryBroker

pytestmark = pytest.mark.mariadb


class Base(DeclarativeBase):
    pass


class Order(Base, AggregateRoot):
    __tablename__ = "ops_orders"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    label: Mapped[str] = mapped_column(String(50))


class Changed(Event, stream="ops"):
    label: str


async def load_detached(outbox: Outbox) -> Order:
    """Order 1, loaded in a session of its own that is then closed: a detached instance."""
    async with AsyncSession(outbox.engine, expire_on_commit=False) as other:
        order = await other.get(Order, 1)
    assert order is not None
    return order


def change(order: Order, label: str) -> Order:
    order.label = label
    order.raise_event(Changed(label=label))
    return order


Case = Callable[[Outbox, UnitOfWork], Awaitable[None]]


# -- add ------------------------------------------------------------------------------------------


async def add_then_raise(outbox: Outbox, uow: UnitOfWork) -> None:
    order = Order(id=2, label="new")
    uow.session.add(order)
    order.raise_event(Changed(label="new"))


async def raise_then_add(outbox: Outbox, uow: UnitOfWork) -> None:
    uow.session.add(change(Order(id=2), "new"))


# -- merge ---------------------------------------------------------------------------------------


async def merge_detached_that_raised(outbox: Outbox, uow: UnitOfWork) -> None:
    order = change(await load_detached(outbox), "merged")  # raised while detached
    merged = await uow.session.merge(order)
    assert merged is not order and order.pending_events == ()


async def merge_transient_that_raised(outbox: Outbox, uow: UnitOfWork) -> None:
    await uow.session.merge(change(Order(id=2), "new"))


async def merge_in_a_savepoint_rolled_back(outbox: Outbox, uow: UnitOfWork) -> None:
    order = change(await load_detached(outbox), "merged")
    try:
        async with uow.session.begin_nested():
            await uow.session.merge(order)
            raise RuntimeError("undo the merge")
    except RuntimeError:
        pass


async def merge_without_load(outbox: Outbox, uow: UnitOfWork) -> None:
    order = await load_detached(outbox)
    order.raise_event(Changed(label="unchanged"))  # an event without a column change
    await uow.session.merge(order, load=False)


# -- expunge --------------------------------------------------------------------------------------


async def expunge_a_new_object(outbox: Outbox, uow: UnitOfWork) -> None:
    order = Order(id=2, label="new")
    uow.session.add(order)
    order.raise_event(Changed(label="new"))
    uow.session.expunge(order)
    # Never inserted: its event is not committed; it waits on the instance again.
    assert [e.label for e in order.pending_events] == ["new"]  # type: ignore[attr-defined]


async def expunge_then_add_again(outbox: Outbox, uow: UnitOfWork) -> None:
    order = Order(id=2, label="new")
    uow.session.add(order)
    order.raise_event(Changed(label="new"))
    uow.session.expunge(order)
    uow.session.add(order)


async def expunge_after_flush(outbox: Outbox, uow: UnitOfWork) -> None:
    order = Order(id=2, label="new")
    uow.session.add(order)
    order.raise_event(Changed(label="new"))
    await uow.session.flush()  # the INSERT is in the transaction: so is the event
    uow.session.expunge(order)


async def raise_after_flush_then_expunge(outbox: Outbox, uow: UnitOfWork) -> None:
    order = Order(id=2, label="new")
    uow.session.add(order)
    await uow.session.flush()  # the INSERT is in the transaction (e.g. for its id)...
    order.raise_event(Changed(label="new"))  # ...then the event that announces it
    uow.session.expunge(order)  # the row commits: so does its event


async def raise_after_a_flushed_change_then_expunge(outbox: Outbox, uow: UnitOfWork) -> None:
    order = await uow.session.get(Order, 1)
    assert order is not None
    order.label = "changed"
    await uow.session.flush()  # the UPDATE is in the transaction
    order.raise_event(Changed(label="changed"))
    uow.session.expunge(order)


async def expunge_a_loaded_object_with_an_unflushed_change(outbox: Outbox, uow: UnitOfWork) -> None:
    order = await uow.session.get(Order, 1)
    assert order is not None
    change(order, "changed")
    uow.session.expunge(order)  # the change is never flushed: neither is its event


async def expunge_all(outbox: Outbox, uow: UnitOfWork) -> None:
    uow.session.add(change(Order(id=2), "new"))
    uow.session.expunge_all()


# -- delete, refresh ---------------------------------------------------------------------------


async def delete_a_loaded_object(outbox: Outbox, uow: UnitOfWork) -> None:
    order = await uow.session.get(Order, 1)
    assert order is not None
    order.raise_event(Changed(label="deleted"))
    await uow.session.delete(order)


async def refresh_after_flush(outbox: Outbox, uow: UnitOfWork) -> None:
    order = await uow.session.get(Order, 1)
    assert order is not None
    change(order, "changed")
    await uow.session.flush()
    await uow.session.refresh(order)


async def refresh_discarding_an_unflushed_change(outbox: Outbox, uow: UnitOfWork) -> None:
    order = await uow.session.get(Order, 1)
    assert order is not None
    change(order, "changed")
    # refresh (like expire) reloads attributes; the object stays in the unit of work and
    # so does its event: events are not attribute state.
    uow.session.expire(order)
    await uow.session.refresh(order)
    assert order.label == "stored"


# -- a detached instance raising events --------------------------------------------------------


async def detached_raises_and_is_added(outbox: Outbox, uow: UnitOfWork) -> None:
    uow.session.add(change(await load_detached(outbox), "added"))


STORED = {1: "stored"}
MATRIX: list[tuple[Case, dict[int, str], list[str]]] = [
    (add_then_raise, {1: "stored", 2: "new"}, ["new"]),
    (raise_then_add, {1: "stored", 2: "new"}, ["new"]),
    (merge_detached_that_raised, {1: "merged"}, ["merged"]),
    (merge_transient_that_raised, {1: "stored", 2: "new"}, ["new"]),
    (merge_in_a_savepoint_rolled_back, STORED, []),
    (merge_without_load, STORED, ["unchanged"]),
    (expunge_a_new_object, STORED, []),
    (expunge_then_add_again, {1: "stored", 2: "new"}, ["new"]),
    (expunge_after_flush, {1: "stored", 2: "new"}, ["new"]),
    (raise_after_flush_then_expunge, {1: "stored", 2: "new"}, ["new"]),
    (raise_after_a_flushed_change_then_expunge, {1: "changed"}, ["changed"]),
    (expunge_a_loaded_object_with_an_unflushed_change, STORED, []),
    (expunge_all, STORED, []),
    (delete_a_loaded_object, {}, ["deleted"]),
    (refresh_after_flush, {1: "changed"}, ["changed"]),
    (refresh_discarding_an_unflushed_change, STORED, ["changed"]),
    (detached_raises_and_is_added, {1: "added"}, ["added"]),
]


@pytest.fixture
async def outbox(db_url: str) -> AsyncIterator[Outbox]:
    box = Outbox(
        db_url, brokers={"default": MemoryBroker()}, settings=OutboxSettings(run_relays=False)
    )
    async with box.engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    await box.create_tables()
    async with AsyncSession(box.engine) as session:
        session.add(Order(id=1, label="stored"))
        await session.commit()
    yield box
    await box.aclose()


async def committed(outbox: Outbox) -> tuple[dict[int, str], list[str]]:
    import json

    async with outbox.engine.connect() as conn:
        orders = dict((await conn.execute(select(Order.id, Order.label))).all())
        payloads = (await conn.execute(select(outbox.table.c.payload))).scalars().all()
    events = [(json.loads(p) if isinstance(p, str) else p)["label"] for p in payloads]
    return {int(k): v for k, v in orders.items()}, sorted(events)


@pytest.mark.parametrize(
    ("case", "orders", "events"), MATRIX, ids=[case.__name__ for case, *_ in MATRIX]
)
async def test_an_event_commits_exactly_when_its_aggregates_change_commits(
    outbox: Outbox, case: Case, orders: dict[int, str], events: list[str]
) -> None:
    async with outbox.unit_of_work() as uow:
        await case(outbox, uow)
    assert await committed(outbox) == (orders, sorted(events))


async def test_the_same_matrix_rolled_back_commits_nothing(outbox: Outbox) -> None:
    """Whatever the operation, a unit of work that fails commits none of it."""
    for case, *_ in MATRIX:
        try:
            async with outbox.unit_of_work() as uow:
                await case(outbox, uow)
                raise LookupError(case.__name__)
        except LookupError:
            pass
        assert await committed(outbox) == (STORED, []), case.__name__


def test_merge_carries_events_for_every_mapped_subclass() -> None:
    """The carrier is a mapper property of every AggregateRoot mapper, and nothing else:
    it is no attribute of the instances."""
    from sqlalchemy import inspect

    mapper = inspect(Order)
    assert "_outbox_events_carrier" in mapper.attrs
    assert [a.key for a in inspect(Order(id=9, label="x")).attrs] == ["id", "label"]


async def test_a_new_object_whose_insert_rolled_back_keeps_its_events_for_the_retry(
    outbox: Outbox,
) -> None:
    """A rollback that undoes a new object's insert (flushed, its events written in the
    transaction) gives the object its events back: the retry that adds it again commits
    both, once."""
    order = Order(id=2, label="new")
    async with AsyncSession(outbox.engine) as session:
        async with outbox.unit_of_work(session=session):
            session.add(order)
            order.raise_event(Changed(label="new"))
        await session.flush()
        await session.rollback()
    assert await committed(outbox) == (STORED, [])
    assert [e.label for e in order.pending_events] == ["new"]  # type: ignore[attr-defined]
    async with outbox.unit_of_work() as uow:
        uow.session.add(order)
    assert await committed(outbox) == ({1: "stored", 2: "new"}, ["new"])


async def test_a_failed_unit_of_work_leaves_the_events_on_its_new_objects(outbox: Outbox) -> None:
    order = Order(id=2, label="new")
    try:
        async with outbox.unit_of_work() as uow:
            uow.session.add(order)
            order.raise_event(Changed(label="new"))
            await uow.session.flush()
            raise LookupError("the handler fails")
    except LookupError:
        pass
    assert [e.label for e in order.pending_events] == ["new"]  # type: ignore[attr-defined]
    async with outbox.unit_of_work() as uow:
        uow.session.add(order)
    assert await committed(outbox) == ({1: "stored", 2: "new"}, ["new"])


@pytest.mark.parametrize("detached", [False, True], ids=["new", "detached"])
async def test_an_aggregate_that_raised_and_was_never_added_refuses_the_commit(
    outbox: Outbox, detached: bool
) -> None:
    """``raise_event`` on an aggregate in no session, in a unit of work that commits
    without it ever being added: the event would be lost without a word. The commit is
    refused, naming the aggregate, the event and the fix; nothing is committed."""
    order = await load_detached(outbox) if detached else Order(id=2, label="new")

    async def forget_to_add() -> None:
        async with outbox.unit_of_work() as uow:
            uow.session.add(Order(id=3, label="other"))
            order.raise_event(Changed(label="lost"))

    with pytest.raises(UnitOfWorkError) as refused:
        await forget_to_add()
    message = str(refused.value)
    assert "Order raised Changed but was never added to a session" in message
    assert "session.add" in message
    assert await committed(outbox) == (STORED, [])
    # The event still waits on the instance: adding it to a unit of work commits it.
    async with outbox.unit_of_work() as uow:
        if detached:
            await uow.session.merge(order)
        else:
            uow.session.add(order)
    assert (await committed(outbox))[1] == ["lost"]


async def test_an_aggregate_that_raised_outside_any_unit_of_work_is_not_judged(
    outbox: Outbox,
) -> None:
    """Raised before a unit of work began (no unit of work could have lost it): it waits
    on the instance, and a unit of work that never meets it commits normally."""
    order = Order(id=2, label="new")
    order.raise_event(Changed(label="later"))
    async with outbox.unit_of_work() as uow:
        uow.session.add(Order(id=3, label="other"))
    assert await committed(outbox) == ({1: "stored", 3: "other"}, [])
    assert [e.label for e in order.pending_events] == ["later"]  # type: ignore[attr-defined]

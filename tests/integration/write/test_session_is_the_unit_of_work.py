"""Events follow the transaction that commits them, however the handler commits.

Through HTTP on SQLite and PostgreSQL, a matrix of handlers that commit themselves, roll back,
use savepoints, raise events from ORM hooks and fail at different steps. Each case states
which orders and which events must be committed; the test checks the business table, the
outbox table, and what the (memory) broker received from the running relay.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from fastapi import FastAPI, HTTPException
from sqlalchemy import Integer, String, event, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from fastapi_outbox import AggregateRoot, Event, Outbox, OutboxSettings, UnitOfWork, UnitOfWorkDep
from fastapi_outbox.brokers import MemoryBroker
from tests.conftest import asgi_client, wait_until

pytestmark = pytest.mark.mariadb


class Base(DeclarativeBase):
    pass


class Order(Base, AggregateRoot):
    __tablename__ = "matrix_orders"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    label: Mapped[str] = mapped_column(String(50))


class Happened(Event, stream="matrix"):
    label: str


class HookSession(Session):
    """The user's session class, with an ORM hook of its own."""


@event.listens_for(Order, "after_insert")
def _after_insert(mapper: Any, connection: Any, target: Order) -> None:
    if target.label.startswith("after-insert"):
        target.raise_event(Happened(label=f"{target.label}:inserted"))


@event.listens_for(HookSession, "before_flush")
def _before_flush(session: Session, flush_context: Any, instances: Any) -> None:
    for obj in session.new:
        if isinstance(obj, Order) and obj.label.startswith("before-flush"):
            obj.raise_event(Happened(label=f"{obj.label}:flushing"))


def order(uow: UnitOfWork, label: str, *, event: bool = True) -> Order:
    """Add an order that raises ``Happened(label)``."""
    o = Order(label=label)
    uow.session.add(o)
    if event:
        o.raise_event(Happened(label=label))
    return o


Handler = Callable[[UnitOfWork], Awaitable[None]]


async def commit_then_return(uow: UnitOfWork) -> None:
    order(uow, "a")
    await uow.session.commit()


async def publish_commit_then_return(uow: UnitOfWork) -> None:
    uow.session.add(Order(label="a"))
    uow.publish(Happened(label="a"))
    await uow.session.commit()


async def commit_raise_again(uow: UnitOfWork) -> None:
    order(uow, "a")
    await uow.session.commit()
    order(uow, "b")  # goes with the request's own commit


async def commit_twice(uow: UnitOfWork) -> None:
    order(uow, "a")
    await uow.session.commit()
    uow.publish(Happened(label="b"))
    await uow.session.commit()
    order(uow, "c")


async def commit_then_fail(uow: UnitOfWork) -> None:
    order(uow, "a")
    await uow.session.commit()
    order(uow, "b")
    raise HTTPException(409, "conflict after a commit")


async def commit_then_crash(uow: UnitOfWork) -> None:
    order(uow, "a")
    await uow.session.commit()
    uow.publish(Happened(label="b"))
    raise RuntimeError("bug after a commit")


async def rollback_then_continue(uow: UnitOfWork) -> None:
    order(uow, "a")
    uow.publish(Happened(label="a2"))
    await uow.session.rollback()
    order(uow, "b")


async def savepoint_rolled_back(uow: UnitOfWork) -> None:
    order(uow, "a")
    try:
        async with uow.session.begin_nested():
            order(uow, "b")
            uow.publish(Happened(label="b2"))
            raise ValueError("undo the savepoint")
    except ValueError:
        pass
    order(uow, "c")


async def savepoint_rolled_back_after_flush(uow: UnitOfWork) -> None:
    order(uow, "a")
    nested = await uow.session.begin_nested()
    order(uow, "b")
    uow.publish(Happened(label="b2"))
    await uow.flush()  # rows written inside the savepoint: the database undoes them
    await nested.rollback()


async def savepoint_released(uow: UnitOfWork) -> None:
    async with uow.session.begin_nested():
        order(uow, "a")
        uow.publish(Happened(label="a2"))
    order(uow, "b")


async def savepoint_released_then_fail(uow: UnitOfWork) -> None:
    async with uow.session.begin_nested():
        order(uow, "a")
    raise HTTPException(400, "refused")


async def nested_savepoints(uow: UnitOfWork) -> None:
    async with uow.session.begin_nested():
        order(uow, "a")
        try:
            async with uow.session.begin_nested():
                order(uow, "b")
                raise ValueError
        except ValueError:
            pass
        order(uow, "c")


async def savepoint_then_commit_inside(uow: UnitOfWork) -> None:
    async with uow.session.begin_nested():
        order(uow, "a")
    await uow.session.commit()
    try:
        async with uow.session.begin_nested():
            order(uow, "b")
            raise ValueError
    except ValueError:
        pass


async def raised_before_add(uow: UnitOfWork) -> None:
    o = Order(label="a")
    o.raise_event(Happened(label="a"))
    uow.session.add(o)
    await uow.session.commit()


async def after_insert_hook(uow: UnitOfWork) -> None:
    order(uow, "after-insert", event=False)


async def after_insert_hook_with_commit(uow: UnitOfWork) -> None:
    order(uow, "after-insert-1", event=False)
    await uow.session.commit()
    order(uow, "after-insert-2", event=False)
    await uow.session.flush()


async def before_flush_hook(uow: UnitOfWork) -> None:
    order(uow, "before-flush", event=False)
    await uow.session.commit()


async def hook_in_rolled_back_savepoint(uow: UnitOfWork) -> None:
    try:
        async with uow.session.begin_nested():
            order(uow, "after-insert-x", event=False)
            await uow.session.flush()
            raise ValueError
    except ValueError:
        pass
    order(uow, "a")


async def failing_flush_then_fail(uow: UnitOfWork) -> None:
    order(uow, "a")
    await uow.session.commit()
    uow.session.add(Order(id=1, label="duplicate primary key"))  # order "a" has id 1
    uow.publish(Happened(label="lost"))
    await uow.session.flush()  # raises: the request fails; "a" stays committed


#: (handler, HTTP status, committed orders, committed and published events)
MATRIX: list[tuple[Handler, int, set[str], set[str]]] = [
    (commit_then_return, 200, {"a"}, {"a"}),
    (publish_commit_then_return, 200, {"a"}, {"a"}),
    (commit_raise_again, 200, {"a", "b"}, {"a", "b"}),
    (commit_twice, 200, {"a", "c"}, {"a", "b", "c"}),
    (commit_then_fail, 409, {"a"}, {"a"}),
    (commit_then_crash, 500, {"a"}, {"a"}),
    (rollback_then_continue, 200, {"b"}, {"b"}),
    (savepoint_rolled_back, 200, {"a", "c"}, {"a", "c"}),
    (savepoint_rolled_back_after_flush, 200, {"a"}, {"a"}),
    (savepoint_released, 200, {"a", "b"}, {"a", "a2", "b"}),
    (savepoint_released_then_fail, 400, set(), set()),
    (nested_savepoints, 200, {"a", "c"}, {"a", "c"}),
    (savepoint_then_commit_inside, 200, {"a"}, {"a"}),
    (raised_before_add, 200, {"a"}, {"a"}),
    (after_insert_hook, 200, {"after-insert"}, {"after-insert:inserted"}),
    (
        after_insert_hook_with_commit,
        200,
        {"after-insert-1", "after-insert-2"},
        {"after-insert-1:inserted", "after-insert-2:inserted"},
    ),
    (before_flush_hook, 200, {"before-flush"}, {"before-flush:flushing"}),
    (hook_in_rolled_back_savepoint, 200, {"a"}, {"a"}),
    (failing_flush_then_fail, 500, {"a"}, {"a"}),
]


def build_app(outbox: Outbox) -> FastAPI:
    app = FastAPI(lifespan=outbox.lifespan)
    handlers = {h.__name__: h for h, *_ in MATRIX}

    @app.post("/run/{name}")
    async def run(name: str, uow: UnitOfWorkDep) -> dict[str, str]:
        await handlers[name](uow)
        return {"ran": name}

    return app


@pytest.fixture
async def outbox(db_url: str) -> AsyncIterator[Outbox]:
    outbox = Outbox(
        db_url,
        brokers={"default": MemoryBroker()},
        settings=OutboxSettings(poll_interval_seconds=0.05),
    )
    outbox.session_factory = async_sessionmaker(
        outbox.engine, expire_on_commit=False, sync_session_class=HookSession
    )
    async with outbox.engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    await outbox.create_tables()
    yield outbox
    await outbox.aclose()


async def committed(outbox: Outbox) -> tuple[set[str], list[str]]:
    async with outbox.engine.connect() as conn:
        orders = set((await conn.execute(select(Order.label))).scalars())
        payloads = (await conn.execute(select(outbox.table.c.payload))).scalars().all()
    events = [(json.loads(p) if isinstance(p, str | bytes) else p)["label"] for p in payloads]
    return orders, events


@pytest.mark.parametrize(
    ("handler", "status", "orders", "events"),
    MATRIX,
    ids=[h.__name__ for h, *_ in MATRIX],
)
async def test_events_follow_the_transaction(
    outbox: Outbox, handler: Handler, status: int, orders: set[str], events: set[str]
) -> None:
    broker = outbox.brokers["default"]
    assert isinstance(broker, MemoryBroker)
    async with asgi_client(build_app(outbox)) as client:  # runs the relay
        response = await client.post(f"/run/{handler.__name__}")
        assert response.status_code == status, response.text
        got_orders, got_events = await committed(outbox)
        assert got_orders == orders
        assert sorted(got_events) == sorted(events)  # each exactly once
        # The running relay publishes exactly the committed events.
        await wait_until(lambda: len(broker.messages) >= len(events))
        published = [json.loads(m.payload)["label"] for m in broker.messages]
        assert sorted(published) == sorted(events)


# -- a session passed in: the caller decides ----------------------------------------------------


@pytest.fixture
def joined(outbox: Outbox) -> Outbox:
    return outbox


@pytest.mark.parametrize("decision", ["commit", "rollback"])
async def test_joined_session_follows_the_callers_decision(joined: Outbox, decision: str) -> None:
    outbox = joined
    async with AsyncSession(outbox.engine) as session:
        session.add(Order(label="caller"))
        await session.flush()  # the caller's transaction is under way
        async with outbox.unit_of_work(session=session) as uow:
            order(uow, "joined")
            uow.publish(Happened(label="published"))
        assert session.in_transaction()  # not committed by the unit of work
        if decision == "commit":
            await session.commit()
        else:
            await session.rollback()
    orders, events = await committed(outbox)
    if decision == "commit":
        assert orders == {"caller", "joined"} and sorted(events) == ["joined", "published"]
    else:
        assert orders == set() and events == []


async def test_joined_session_body_that_raises_leaves_nothing_of_its_own(joined: Outbox) -> None:
    outbox = joined
    async with AsyncSession(outbox.engine) as session:
        session.add(Order(label="caller"))

        async def body() -> None:
            async with outbox.unit_of_work(session=session) as uow:
                order(uow, "joined")
                uow.publish(Happened(label="published"))
                await uow.session.flush()
                raise RuntimeError("the body fails")

        with pytest.raises(RuntimeError):
            await body()
        await session.commit()  # the caller carries on with its own work
    orders, events = await committed(outbox)
    assert orders == {"caller"} and events == []


async def test_joined_session_without_transaction_is_not_committed(joined: Outbox) -> None:
    outbox = joined
    async with AsyncSession(outbox.engine) as session:
        async with outbox.unit_of_work(session=session) as uow:
            order(uow, "joined")
        assert session.in_transaction()
        # The caller closes without committing: nothing was written.
    assert await committed(outbox) == (set(), [])


async def test_aggregate_events_raised_by_the_caller_after_the_block_go_with_its_commit(
    joined: Outbox,
) -> None:
    outbox = joined
    async with AsyncSession(outbox.engine) as session:
        async with outbox.unit_of_work(session=session) as uow:
            o = order(uow, "joined")
        o.raise_event(Happened(label="later"))  # no unit of work open: waits on the instance
        await session.commit()
    orders, events = await committed(outbox)
    assert orders == {"joined"} and events == ["joined"]
    assert [e.label for e in o.pending_events] == ["later"]  # type: ignore[attr-defined]

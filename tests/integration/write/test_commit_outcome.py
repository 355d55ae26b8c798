"""A unit of work's COMMIT: its outcome told truly, on PostgreSQL.

A deferred constraint trigger makes the COMMIT itself take a while (it runs at COMMIT), so
the test can act while the COMMIT is on its way:

* the caller is cancelled during COMMIT (a request timeout, a task cancelled): the commit is
  waited for and the cancellation raised after — never an error of the rollback in its
  place, and never a committed order reported as failed (``uow.committed`` says it did);
* the connection dies during COMMIT: :class:`CommitOutcomeUnknown`, saying so, and the
  events are exactly what the database holds (the order and its event both, or neither).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from sqlalchemy import Integer, event, text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from fastapi_outbox import Event, Outbox, OutboxSettings, UnitOfWork
from fastapi_outbox.brokers import MemoryBroker
from fastapi_outbox.exceptions import CommitOutcomeUnknown
from tests.servers import TcpProxy

pytestmark = pytest.mark.postgres(
    reason="a deferred constraint trigger makes the COMMIT itself slow or fail; MySQL has none"
)

#: How long the COMMIT takes (the deferred trigger's sleep).
COMMIT_SECONDS = 0.4


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "slow_commit_orders"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)


class OrderPlaced(Event, stream="slow_commit"):
    order_id: int


@contextlib.asynccontextmanager
async def slow_commit_outbox(url: str) -> AsyncIterator[tuple[Outbox, asyncio.Event]]:
    """An outbox whose COMMITs take COMMIT_SECONDS, and an event set when a COMMIT is
    sent."""
    outbox = Outbox(url, brokers={"default": MemoryBroker()}, settings=OutboxSettings())
    await outbox.create_tables()
    async with outbox.engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
        await conn.execute(
            text(
                "CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$ "
                f"BEGIN PERFORM pg_sleep({COMMIT_SECONDS}); RETURN NULL; END $$"
            )
        )
        await conn.execute(
            text(
                "CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON slow_commit_orders "
                "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION slow_commit()"
            )
        )
    sent = asyncio.Event()

    def commit_sent(conn: object) -> None:
        sent.set()

    event.listen(outbox.engine.sync_engine, "commit", commit_sent)
    try:
        yield outbox, sent
    finally:
        await outbox.aclose()


async def held(url: str) -> tuple[bool, int]:
    """(the order is in the database, how many outbox rows it has), read directly."""
    outbox = Outbox(url, brokers={"default": MemoryBroker()})
    try:
        async with outbox.engine.connect() as conn:
            order = (await conn.execute(text("SELECT count(*) FROM slow_commit_orders"))).scalar()
            events = (await conn.execute(outbox.table.select())).all()
        return bool(order), len(events)
    finally:
        await outbox.aclose()


async def save_order(outbox: Outbox, saved: list[UnitOfWork]) -> None:
    async with outbox.unit_of_work() as uow:
        saved.append(uow)
        uow.session.add(Order(id=1))
        uow.publish(OrderPlaced(order_id=1))


async def test_cancelled_during_commit_commits_and_raises_the_cancellation(pg_url: str) -> None:
    saved: list[UnitOfWork] = []
    async with slow_commit_outbox(pg_url) as (outbox, sent):
        task = asyncio.get_running_loop().create_task(save_order(outbox, saved))
        await asyncio.wait_for(sent.wait(), 5)
        task.cancel()
        # The cancellation, not the rollback's InvalidRequestError in its place.
        with pytest.raises(asyncio.CancelledError):
            await task
        assert saved[0].committed
        assert await held(pg_url) == (True, 1)  # the order and its event, committed


async def test_a_request_timeout_during_commit_is_not_an_error_of_the_rollback(
    pg_url: str,
) -> None:
    """``asyncio.timeout`` around the unit of work, expiring during COMMIT: the commit ends
    as the database decides, the caller gets its TimeoutError, and ``uow.committed`` says
    the order was saved."""
    saved: list[UnitOfWork] = []
    async with slow_commit_outbox(pg_url) as (outbox, sent):

        async def timed() -> None:
            async with asyncio.timeout(COMMIT_SECONDS / 2):
                await save_order(outbox, saved)

        with pytest.raises(TimeoutError):
            await timed()
        assert sent.is_set()
        assert saved[0].committed
        assert await held(pg_url) == (True, 1)


async def test_connection_lost_during_commit_is_outcome_unknown(pg_url: str) -> None:
    proxy = TcpProxy(5432)
    await proxy.start()
    through_proxy = pg_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
    assert str(proxy.port) in through_proxy, through_proxy
    saved: list[UnitOfWork] = []
    try:
        async with slow_commit_outbox(through_proxy) as (outbox, sent):
            task = asyncio.get_running_loop().create_task(save_order(outbox, saved))
            await asyncio.wait_for(sent.wait(), 5)
            await proxy.stop()  # cut while the COMMIT runs
            with pytest.raises(CommitOutcomeUnknown) as caught:
                await asyncio.wait_for(task, 10)
            message = str(caught.value)
            assert "COMMIT" in message and "may" in message, message
            assert not saved[0].committed
    finally:
        await proxy.stop()
    order, events = await held(pg_url)
    assert events == (1 if order else 0)  # the events are exactly what the database holds


async def test_cancelled_while_the_commit_wakes_the_relays_reports_no_error(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The transaction committed and the commit is telling the relays (the NOTIFY of an
    API-only process) when the caller is cancelled: the cancellation, not the
    ``InvalidRequestError`` of a rollback in the middle of the commit (a saved order
    answered 500)."""
    async with slow_commit_outbox(pg_url) as (outbox, _):
        notifying, go_on = asyncio.Event(), asyncio.Event()

        async def slow_notify() -> None:
            notifying.set()
            await go_on.wait()

        monkeypatch.setattr(outbox.relays, "notify_after_commit", slow_notify)
        # On asyncpg the COMMIT carries the NOTIFY itself; the wake-up after the commit is
        # the path of a COMMIT that cannot carry it (another driver): take that one.
        monkeypatch.setattr(outbox.relays, "notify_with_commit", lambda brokers: None)
        saved: list[UnitOfWork] = []
        task = asyncio.get_running_loop().create_task(save_order(outbox, saved))
        await asyncio.wait_for(notifying.wait(), 5)
        task.cancel()
        go_on.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert saved[0].committed
    assert await held(pg_url) == (True, 1)

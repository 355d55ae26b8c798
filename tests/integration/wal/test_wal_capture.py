"""capture="wal": messages go through PostgreSQL's WAL and a logical replication slot.

On a private cluster with ``wal_level=logical`` (``wal_pg_url``); the shared server (5432,
``wal_level=replica``) only for the refusal."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anyio
import asyncpg
import pytest
from fastapi import FastAPI
from sqlalchemy import Integer, func, select, update
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from fastapi_outbox import Event, Message, Outbox, OutboxSettings, exceptions
from fastapi_outbox.brokers import MemoryBroker
from tests.conftest import wait_until


class Base(DeclarativeBase):
    pass


class Counter(Base):
    __tablename__ = "counters"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    value: Mapped[int] = mapped_column(Integer, default=0)


class Item(Base):
    __tablename__ = "items"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)


class Counted(Event, stream="counted", key="counter"):
    counter: int
    value: int


def wal_settings(**overrides: Any) -> OutboxSettings:
    return OutboxSettings(capture="wal", poll_interval_seconds=0.2, **overrides)


@pytest.fixture
async def wal_outbox(wal_pg_url: str) -> AsyncIterator[tuple[Outbox, MemoryBroker]]:
    broker = MemoryBroker()
    outbox = Outbox(wal_pg_url, brokers={"default": broker}, settings=wal_settings())
    async with outbox.engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    await outbox.create_tables()
    yield outbox, broker
    await outbox.aclose()


async def table_rows(outbox: Outbox) -> int:
    async with outbox.engine.connect() as conn:
        count = await conn.execute(select(func.count()).select_from(outbox.table))
        return int(count.scalar_one())


def values(broker: MemoryBroker) -> list[int]:
    return [json.loads(m.payload)["value"] for m in broker.messages]


# -- refusals ----------------------------------------------------------------------------------


def test_sqlite_refuses_wal_naming_capture(sqlite_url: str) -> None:
    with pytest.raises(exceptions.ConfigurationError, match=r"capture='wal'.*PostgreSQL"):
        Outbox(sqlite_url, brokers={"default": MemoryBroker()}, settings=wal_settings())


def test_ordered_with_wal_is_refused() -> None:
    with pytest.raises(exceptions.ConfigurationError, match=r"capture='wal'.*ordered=True"):
        OutboxSettings.from_env(capture="wal", ordered=True)


async def test_server_without_logical_wal_level_is_refused_at_startup(pg_url: str) -> None:
    """The shared server runs wal_level=replica: create_tables, the relays and an
    API-only lifespan all refuse, saying what to set."""
    outbox = Outbox(pg_url, brokers={"default": MemoryBroker()}, settings=wal_settings())
    try:
        async with outbox.engine.connect() as conn:
            level = (await conn.exec_driver_sql("SHOW wal_level")).scalar_one()
        if level == "logical":
            pytest.skip("the shared PostgreSQL already runs wal_level=logical")
        with pytest.raises(exceptions.ConfigurationError, match=r"wal_level=logical.*restart"):
            await outbox.create_tables()
        with pytest.raises(exceptions.ConfigurationError, match="wal_level=logical"):
            async with outbox.relaying():
                pass
        assert not outbox.lifecycle.started
        api_only = Outbox(
            pg_url,
            brokers={"default": MemoryBroker()},
            settings=wal_settings(run_relays=False),
        )
        try:
            with pytest.raises(exceptions.ConfigurationError, match="wal_level=logical"):
                async with api_only.lifespan(FastAPI()):
                    pass
        finally:
            await api_only.aclose()
    finally:
        await outbox.aclose()


async def test_a_write_before_the_slot_exists_is_refused(wal_pg_url: str) -> None:
    """A slot sees only WAL written after its creation: a commit before `db create` fails
    (and writes nothing) instead of losing its messages."""
    outbox = Outbox(wal_pg_url, brokers={"default": MemoryBroker()}, settings=wal_settings())
    try:
        async with outbox.engine.begin() as conn:
            await conn.run_sync(Base.metadata.create_all)

        async def produce() -> None:
            async with outbox.unit_of_work() as uow:
                uow.session.add(Item(id=1))
                uow.publish(Counted(counter=1, value=1))

        with pytest.raises(exceptions.ConfigurationError, match="db create"):
            await produce()
        async with outbox.engine.connect() as conn:
            assert (await conn.execute(select(func.count()).select_from(Item))).scalar_one() == 0
    finally:
        await outbox.aclose()


# -- atomicity -----------------------------------------------------------------------------------


async def test_committed_messages_are_relayed_rolled_back_ones_never(
    wal_outbox: tuple[Outbox, MemoryBroker],
) -> None:
    outbox, broker = wal_outbox

    async def rolled_back() -> None:
        async with outbox.unit_of_work() as uow:
            uow.session.add(Item(id=1))
            uow.publish(Counted(counter=1, value=-1))
            raise RuntimeError("handler failed")

    async def savepoint_rolled_back(uow: Any) -> None:
        async with uow.session.begin_nested():
            uow.publish(Counted(counter=1, value=-2))
            await uow.flush()  # emitted inside the savepoint
            raise RuntimeError("savepoint failed")

    async with outbox.relaying():
        # Rolled back: the whole transaction.
        with pytest.raises(RuntimeError):
            await rolled_back()
        async with outbox.unit_of_work() as uow:
            uow.session.add(Item(id=2))
            uow.publish(Counted(counter=1, value=1))
            await uow.flush()
            # A savepoint that rolls back drops its messages (PostgreSQL discards the
            # transactional messages of an aborted subtransaction)...
            with pytest.raises(RuntimeError):
                await savepoint_rolled_back(uow)
            # ...a released one keeps them.
            async with uow.session.begin_nested():
                uow.publish(Counted(counter=1, value=2))
                await uow.flush()
            uow.publish(Message(stream="raw", type="Raw", payload={"value": 3}))
        await broker.wait_for(3)
        # Nothing more comes: the next commit's message is the next one relayed.
        async with outbox.unit_of_work() as uow:
            uow.publish(Counted(counter=1, value=4))
        await broker.wait_for(4)
    assert values(broker) == [1, 2, 3, 4]
    assert broker.messages[2].stream == "raw"
    assert broker.duplicates == 0
    # Nothing went through the table, and the business rows are there.
    assert await table_rows(outbox) == 0
    async with outbox.engine.connect() as conn:
        assert (await conn.execute(select(Item.id))).scalars().all() == [2]
    # The slot was confirmed past them.
    assert outbox.wal_slot is not None
    assert await outbox.wal_slot.pending_messages() == 0


async def test_headers_keys_and_external_brokers_survive_the_wal(wal_pg_url: str) -> None:
    internal, partner = MemoryBroker(), MemoryBroker()

    class Shipped(Event, stream="shipped", key="order", external=True):
        order: str

    outbox = Outbox(
        wal_pg_url,
        brokers={"default": internal},
        external_brokers={"partner": partner},
        settings=wal_settings(),
    )
    try:
        await outbox.create_tables()
        async with outbox.relaying():
            async with outbox.unit_of_work(correlation_id="corr-1") as uow:
                message_id = uow.publish(Shipped(order="o-1"), headers={"tenant": "t1"})
            await internal.wait_for(1)
            await partner.wait_for(1)
        got = internal.messages[0]
        assert got.id == str(message_id) and got.key == "o-1" and got.stream == "shipped"
        assert got.headers["tenant"] == "t1" and got.headers["correlation-id"] == "corr-1"
        assert json.loads(got.payload) == {"order": "o-1"}
        # The external row has its own id and the reduced envelope.
        assert partner.messages[0].id != got.id
        assert "correlation-id" not in partner.messages[0].headers
    finally:
        await outbox.aclose()


async def test_delayed_messages_go_to_the_table(wal_outbox: tuple[Outbox, MemoryBroker]) -> None:
    outbox, broker = wal_outbox
    async with outbox.relaying():
        async with outbox.unit_of_work() as uow:
            uow.publish(Counted(counter=1, value=1))
            uow.publish(Counted(counter=1, value=2), delay=0.3)
        await broker.wait_for(2, timeout=10)
    assert sorted(values(broker)) == [1, 2]
    # The delayed one went through the table (and its table_relay), the other did not.
    async with outbox.engine.connect() as conn:
        rows = (await conn.execute(select(outbox.table.c.payload, outbox.table.c.status))).all()
    assert [(_load(p)["value"], s) for p, s in rows] == [(2, "published")]


# -- order -------------------------------------------------------------------------------------


async def test_commit_order_across_concurrent_producers(
    wal_outbox: tuple[Outbox, MemoryBroker],
) -> None:
    """Producers increment one counter row (its lock serialises them) and publish the value
    they wrote: commit order is value order, and so must be the relayed order. Other
    producers commit in between without the lock."""
    outbox, broker = wal_outbox
    async with outbox.unit_of_work() as uow:
        uow.session.add(Counter(id=1, value=0))
    producers, each = 6, 25

    async def increment() -> None:
        for _ in range(each):
            async with outbox.unit_of_work() as uow:
                row = await uow.session.execute(
                    update(Counter)
                    .where(Counter.id == 1)
                    .values(value=Counter.value + 1)
                    .returning(Counter.value)
                )
                uow.publish(Counted(counter=1, value=row.scalar_one()))

    async def bystander(n: int) -> None:
        for i in range(each):
            async with outbox.unit_of_work() as uow:
                uow.publish(Message(stream="other", type="Other", payload={"n": n, "i": i}))

    async with outbox.relaying():
        async with anyio.create_task_group() as tg:
            for _ in range(producers):
                tg.start_soon(increment)
            for n in range(2):
                tg.start_soon(bystander, n)
        await broker.wait_for(producers * each + 2 * each, timeout=30)
    counted = [json.loads(m.payload)["value"] for m in broker.on_stream("counted")]
    assert counted == list(range(1, producers * each + 1))
    for n in range(2):
        others = [json.loads(m.payload) for m in broker.on_stream("other")]
        assert [o["i"] for o in others if o["n"] == n] == list(range(each))


# -- the slot's position -------------------------------------------------------------------------


async def test_slot_moves_over_unrelated_wal(wal_outbox: tuple[Outbox, MemoryBroker]) -> None:
    """Business writes without messages do not make the slot retain WAL for ever: an idle
    relay confirms past them."""
    outbox, broker = wal_outbox
    slot = outbox.wal_slot
    assert slot is not None
    async with outbox.relaying():
        for i in range(50):
            async with outbox.unit_of_work() as uow:
                uow.session.add(Item(id=100 + i))

        async def caught_up() -> bool:
            stats = await slot.stats()
            return stats is not None and stats.lag_bytes is not None and stats.lag_bytes < 1024

        await wait_until(caught_up, timeout=15)
    assert broker.messages == []


async def test_message_with_another_prefix_is_ignored(
    wal_outbox: tuple[Outbox, MemoryBroker], wal_pg_url: str
) -> None:
    outbox, broker = wal_outbox
    conn = await asyncpg.connect(wal_pg_url.replace("+asyncpg", ""))
    try:
        await conn.execute("SELECT pg_logical_emit_message(true, 'someone_else', 'x')")
    finally:
        await conn.close()
    async with outbox.relaying():
        async with outbox.unit_of_work() as uow:
            uow.publish(Counted(counter=1, value=1))
        await broker.wait_for(1)
    assert values(broker) == [1]


def _load(payload: Any) -> Any:
    return payload if isinstance(payload, dict) else json.loads(payload)


async def test_testing_drain_relays_the_slot(wal_outbox: tuple[Outbox, MemoryBroker]) -> None:
    from fastapi_outbox.testing import drain

    outbox, broker = wal_outbox
    async with outbox.unit_of_work() as uow:
        for value in (1, 2, 3):
            uow.publish(Counted(counter=1, value=value))
    assert await drain(outbox) == 3
    assert values(broker) == [1, 2, 3]
    assert await drain(outbox) == 0
    # While a relay holds the slot, a drain by hand is refused.
    async with outbox.relaying():
        relay = outbox.relays.wal
        assert relay is not None
        await wait_until(lambda: relay.leader)
        with pytest.raises(exceptions.UnitOfWorkError, match="holds the slot"):
            await drain(outbox)


# -- wake-ups ------------------------------------------------------------------------------------

SLOW_POLL = {"poll_interval_seconds": 30.0, "max_poll_interval_seconds": 30.0}


async def test_commits_wake_the_reader_in_process_and_across_processes(wal_pg_url: str) -> None:
    """Polling every 30 s: a message that arrives within seconds was woken, by the signal
    after a commit of the reader's own process, or by the NOTIFY of an API-only process."""
    broker = MemoryBroker()
    reader = Outbox(
        wal_pg_url, brokers={"default": broker}, settings=OutboxSettings(capture="wal", **SLOW_POLL)
    )
    api = Outbox(
        wal_pg_url,
        brokers={"default": MemoryBroker()},
        settings=OutboxSettings(capture="wal", run_relays=False, **SLOW_POLL),
    )
    await reader.create_tables()
    try:
        async with reader.relaying():
            relay = reader.relays.wal
            listener = reader.relays.listener
            assert relay is not None and listener is not None

            def waiting() -> bool:
                return relay.leader and listener.listening and relay.wakeup.idle_waiters == 1

            await wait_until(waiting)
            async with reader.unit_of_work() as uow:
                uow.publish(Counted(counter=1, value=1))
            await broker.wait_for(1, timeout=3)
            await wait_until(waiting)
            async with api.unit_of_work() as uow:  # NOTIFY after the commit
                uow.publish(Counted(counter=1, value=2))
            await broker.wait_for(2, timeout=3)
        assert values(broker) == [1, 2]
    finally:
        await api.aclose()
        await reader.aclose()

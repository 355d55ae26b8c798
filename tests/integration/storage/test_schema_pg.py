"""The outbox table on a real database: ``create_tables`` and ``db create`` make exactly the
outbox table; on PostgreSQL its types, its partial claim index, and a claim that uses it on a
table full of published rows."""

from __future__ import annotations

import datetime as dt
from collections.abc import AsyncIterator

import asyncpg
import pytest
from sqlalchemy import Integer, inspect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from fastapi_outbox import Message, Outbox, OutboxSettings
from fastapi_outbox.brokers import MemoryBroker
from tests.conftest import run_cli

ACTIVE = ("pending", "processing", "failed")


class Base(DeclarativeBase):
    pass


class Customer(Base):
    __tablename__ = "customers"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)


async def table_names(outbox: Outbox) -> set[str]:
    async with outbox.engine.connect() as conn:
        return set(await conn.run_sync(lambda c: inspect(c).get_table_names()))


#: The inbox and, beside it, the partition leases of ordered subscribers.
INBOX_TABLES = (
    "outbox_inbox",
    "outbox_inbox_partitions",
    "outbox_inbox_members",
    "outbox_inbox_handlers",
    "outbox_inbox_attempts",
)


async def test_create_tables_creates_only_the_outbox_tables(db_url: str) -> None:
    assert "customers" in Base.metadata.tables  # the user's models are declared...
    outbox = Outbox(db_url, brokers={"default": MemoryBroker()}, settings=OutboxSettings())
    try:
        await outbox.create_tables()
        await outbox.create_tables()  # idempotent
        # ...and never created; the consumers' inbox is one of the outbox's tables.
        assert await table_names(outbox) == {"outbox_messages", *INBOX_TABLES}
        async with outbox.engine.connect() as conn:
            indexes = await conn.run_sync(
                lambda c: {i["name"] for i in inspect(c).get_indexes("outbox_messages")}
            )
        assert {"ix_outbox_messages_due", "ix_outbox_messages_key"} <= indexes
    finally:
        await outbox.aclose()


async def test_create_tables_with_a_custom_table_name(db_url: str) -> None:
    outbox = Outbox(db_url, settings=OutboxSettings(table_name="shop_outbox"))
    try:
        await outbox.create_tables()
        assert await table_names(outbox) == {"shop_outbox", *INBOX_TABLES}
        async with outbox.unit_of_work() as uow:
            uow.publish(Message(stream="orders", type="T", payload={}))
        assert await outbox.store.messages.count() == 1
    finally:
        await outbox.aclose()


def plain(url: str) -> str:
    return url.replace("postgresql+asyncpg://", "postgresql://")


@pytest.fixture
async def pg(pg_url: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(plain(pg_url))
    yield conn
    await conn.close()


async def test_cli_db_create_and_db_sql_on_postgresql(pg_url: str, pg: asyncpg.Connection) -> None:
    created = run_cli("db", "create", "--url", pg_url)
    assert created.returncode == 0, created.stderr
    assert "created table outbox_messages" in created.stdout
    tables = {
        r["tablename"]
        for r in await pg.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
    }
    assert tables == {"outbox_messages", *INBOX_TABLES}
    types = {
        r["column_name"]: r["data_type"]
        for r in await pg.fetch(
            "SELECT column_name, data_type FROM information_schema.columns "
            "WHERE table_name = 'outbox_messages'"
        )
    }
    assert types["id"] == "uuid"
    assert types["payload"] == types["headers"] == "jsonb"
    assert types["next_attempt_at"] == "timestamp with time zone"

    printed = run_cli("db", "sql", "--url", pg_url)
    offline = run_cli("db", "sql")  # no database: PostgreSQL DDL by default
    for result in (printed, offline):
        assert result.returncode == 0, result.stderr
        assert "id UUID NOT NULL" in result.stdout
        assert "payload JSONB NOT NULL" in result.stdout
        assert "headers JSONB NOT NULL" in result.stdout
        assert "CREATE TABLE outbox_inbox" in result.stdout
        assert 'PRIMARY KEY ("group", message_id)' in result.stdout
        assert (
            "ix_outbox_messages_due ON outbox_messages (broker, next_attempt_at, id) "
            "WHERE status IN ('pending', 'processing', 'failed')" in result.stdout
        )


async def test_partial_claim_index_exists(pg_url: str, pg: asyncpg.Connection) -> None:
    outbox = Outbox(pg_url, settings=OutboxSettings())
    try:
        await outbox.create_tables()
    finally:
        await outbox.aclose()
    indexdef = await pg.fetchval(
        "SELECT indexdef FROM pg_indexes WHERE tablename = 'outbox_messages' "
        "AND indexname = 'ix_outbox_messages_due'"
    )
    assert indexdef is not None
    assert "(broker, next_attempt_at, id)" in indexdef
    where = indexdef.split(" WHERE ", 1)[1]
    assert all(f"'{status}'" in where for status in ACTIVE)
    assert "published" not in where and "abandoned" not in where


async def test_claim_uses_the_partial_index_on_a_table_of_published_rows(
    pg_url: str, pg: asyncpg.Connection
) -> None:
    outbox = Outbox(pg_url, brokers={"default": MemoryBroker()}, settings=OutboxSettings())
    try:
        await outbox.create_tables()
        # 20,000 finished rows, the shape of a table that keeps published messages...
        await pg.execute(
            """
            INSERT INTO outbox_messages (id, broker, stream, type, payload, headers, status,
                                         attempts, next_attempt_at, created_at, published_at)
            SELECT gen_random_uuid(), 'default', 'orders', 'OrderPlaced', '{}', '{}',
                   'published', 1, now() - interval '1 hour', now() - interval '1 hour',
                   now() - interval '1 hour'
            FROM generate_series(1, 20000)
            """
        )
        # ...and a few that still need work.
        async with outbox.unit_of_work() as uow:
            for i in range(5):
                uow.publish(Message(stream="orders", type="T", payload={"i": i}))
        await pg.execute("ANALYZE outbox_messages")

        for ordered in (False, True):
            stmt = outbox.store.claims.claim_statement("default", 100, ordered)
            values = {"token": "token", "lease": dt.timedelta(seconds=30)}
            compiled = stmt.compile(
                dialect=outbox.engine.dialect, compile_kwargs={"render_postcompile": True}
            )
            bound = compiled.construct_params(values)
            params = [bound[name] for name in compiled.positiontup or ()]
            # with bound parameters, as the driver sends it
            plan = "\n".join(r[0] for r in await pg.fetch("EXPLAIN " + str(compiled), *params))
            assert "ix_outbox_messages_due" in plan, plan
            assert "Seq Scan on outbox_messages o" not in plan, plan

        claimed = await outbox.store.claims.claim("default", 100, "token", 30.0)
        assert len(claimed) == 5
    finally:
        await outbox.aclose()

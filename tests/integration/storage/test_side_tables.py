"""The side tables of features turned on after ``db create`` (the archive of
``archive=True``, the claim-check payloads of ``claim_check_bytes``, the inbox and the
partition leases of ordered subscribers): ``fastapi-outbox doctor`` reports the missing one
with its DDL and exits 1, ``db upgrade`` creates it with the code of ``db create``
(idempotent), the doctor is then clean and the feature works on the new table. The CLI runs
in this process (its ``main``), on PostgreSQL and SQLite."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
import secrets
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import func, select, text, update

from fastapi_outbox import Message, Outbox, OutboxSettings
from fastapi_outbox.brokers import MemoryBroker
from fastapi_outbox.cli.main import main
from fastapi_outbox.outbox import side_tables
from fastapi_outbox.storage import doctor
from fastapi_outbox.storage.claim_check import HEADER_CLAIM_CHECK, DatabasePayloadStore
from fastapi_outbox.testing import drain
from tests.conftest import unique

DAY = dt.timedelta(days=1)


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Iterator[Any]:
    """``fastapi-outbox ARGS`` in this process with ``OUTBOX_*`` = ``env`` only:
    (exit code, stdout). The loggers its ``configure_logging`` sets are given back as they
    were."""
    for name in [n for n in os.environ if n.startswith("OUTBOX_")]:
        monkeypatch.delenv(name)
    root = logging.getLogger()
    handlers = list(root.handlers)
    for name in ("", "sqlalchemy", "asyncio", "nats", "redis"):
        monkeypatch.setattr(logging.getLogger(name), "level", logging.getLogger(name).level)

    def run(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
        with monkeypatch.context() as m:
            for name, value in (env or {}).items():
                m.setenv(name, value)
            code = main(list(args))
        out, err = capsys.readouterr()
        assert "Traceback" not in err, err
        return code, out

    yield run
    root.handlers[:] = handlers


def table_env(**more: str) -> dict[str, str]:
    """Settings of a table of this test's own (the tests share PostgreSQL's server)."""
    return {"OUTBOX_TABLE_NAME": unique("outbox"), **more}


def id_at(at: dt.datetime) -> uuid.UUID:
    """A UUIDv7-like id of time ``at`` (a partitioned table puts the row by its id)."""
    return uuid.UUID(f"{int(at.timestamp() * 1000):012x}7{secrets.token_hex(10)[:19]}")


async def archive_one(url: str, settings: OutboxSettings) -> tuple[uuid.UUID, str]:
    """A message published long ago, moved by retention: its id and the relation (the
    archive's partition, or the archive) it is in."""
    outbox = Outbox(url, brokers={"default": MemoryBroker()}, settings=settings)
    assert outbox.archive is not None
    t = outbox.table
    try:
        async with outbox.unit_of_work() as uow:
            first = uow.publish(Message(stream=unique("orders"), type="Paid", payload={"n": 1}))
        old = dt.datetime.now(dt.UTC) - 30 * DAY  # before any range partition: DEFAULT
        moved = id_at(old)
        async with outbox.engine.begin() as conn:
            await conn.execute(
                update(t)
                .where(t.c.id == first)
                .values(id=moved, created_at=old, status="published", published_at=old)
            )
        assert await outbox.cleaner.run_once() == 1
        assert await outbox.store.messages.get(moved) is None
        assert await outbox.archive.count() == 1
        row = await outbox.archive.get(moved)
        assert row is not None and row["status"] == "published"
        where = f"SELECT tableoid::regclass::text FROM {outbox.archive.name}"
        if not outbox.store.is_postgres:
            where = f"SELECT '{outbox.archive.name}' FROM {outbox.archive.name}"
        async with outbox.engine.connect() as conn:
            relation = (await conn.execute(text(where))).scalar_one()
        return moved, str(relation)
    finally:
        await outbox.aclose()


@pytest.mark.parametrize(
    ("database", "partitioning"),
    [("sqlite", None), ("postgres", None), ("postgres", "daily")],
    ids=["sqlite", "postgres", "postgres-partitioned"],
)
def test_archive_turned_on_later(
    cli: Any, request: pytest.FixtureRequest, database: str, partitioning: str | None
) -> None:
    url = str(request.getfixturevalue("sqlite_url" if database == "sqlite" else "pg_url"))
    env = table_env(**({"OUTBOX_PARTITIONING": partitioning} if partitioning else {}))
    archive = f"{env['OUTBOX_TABLE_NAME']}_archive"
    assert cli("db", "create", "--url", url, env=env)[0] == 0
    assert cli("doctor", "--url", url, env=env)[0] == 0
    env["OUTBOX_ARCHIVE"] = "true"

    code, out = cli("doctor", "--url", url, env=env)
    assert code == 1, out
    assert f"MISMATCH: table {archive} does not exist (needed by archive=True)" in out
    assert f"fix: CREATE TABLE {archive} (" in out
    assert out.count("MISMATCH") == 1, out
    if partitioning:  # partitioned as the outbox is, with its DEFAULT partition
        assert "PARTITION BY RANGE (id)" in out and f"{archive}_default" in out

    code, out = cli("db", "upgrade", "--url", url, env=env)
    assert code == 0, out
    assert f"fixed: table {archive} does not exist" in out and "upgraded (1 change(s))" in out
    code, out = cli("db", "upgrade", "--url", url, env=env)
    assert code == 0 and "already up to date" in out, out
    code, out = cli("doctor", "--url", url, env=env)
    assert code == 0 and "MISMATCH" not in out, out

    settings = OutboxSettings(
        table_name=env["OUTBOX_TABLE_NAME"],
        partitioning=partitioning,
        archive=True,
        run_relays=False,
        published_retention_seconds=3600.0,
    )
    _, relation = asyncio.run(archive_one(url, settings))
    assert relation == (f"{archive}_default" if partitioning else archive)


@pytest.mark.parametrize("database", ["sqlite", "postgres"])
def test_claim_check_turned_on_later(
    cli: Any, request: pytest.FixtureRequest, database: str
) -> None:
    url = str(request.getfixturevalue("sqlite_url" if database == "sqlite" else "pg_url"))
    env = table_env()
    payloads = f"{env['OUTBOX_TABLE_NAME']}_payloads"
    assert cli("db", "create", "--url", url, env=env)[0] == 0
    env.update(OUTBOX_CLAIM_CHECK_BYTES="1024")

    code, out = cli("doctor", "--url", url, env=env)
    assert code == 1, out
    assert f"MISMATCH: table {payloads} does not exist (needed by claim_check_bytes" in out
    assert f"fix: CREATE TABLE {payloads} (" in out and out.count("MISMATCH") == 1

    code, out = cli("db", "upgrade", "--url", url, env=env)
    assert code == 0 and f"fixed: table {payloads} does not exist" in out, out
    code, out = cli("db", "upgrade", "--url", url, env=env)
    assert code == 0 and "already up to date" in out, out
    assert cli("doctor", "--url", url, env=env)[0] == 0

    async def publish_big() -> None:
        settings = OutboxSettings(
            table_name=env["OUTBOX_TABLE_NAME"], claim_check_bytes=1024, run_relays=False
        )
        broker = MemoryBroker()
        outbox = Outbox(url, brokers={"default": broker}, settings=settings)
        store = outbox.claim_check_store
        assert isinstance(store, DatabasePayloadStore) and store.table.name == payloads
        try:
            async with outbox.unit_of_work() as uow:
                uow.publish(Message(stream=unique("scans"), type="Scan", payload={"b": "x" * 4096}))
            assert await drain(outbox) == 1
            [sent] = broker.messages
            ref = sent.headers[HEADER_CLAIM_CHECK]
            stored = await store.get(ref)
            assert stored is not None and b"x" * 4096 in stored
            async with outbox.engine.connect() as conn:
                assert (
                    await conn.execute(select(func.count()).select_from(store.table))
                ).scalar_one() == 1
        finally:
            await outbox.aclose()

    asyncio.run(publish_big())


async def test_inbox_and_leases_of_an_outbox_older_than_the_consumers(sqlite_url: str) -> None:
    """A table from before the inbox: the inbox is needed (its retention runs with the
    cleaner), the partition leases only once an ordered subscriber is declared; ``db
    upgrade`` creates both (``db create`` makes them all)."""
    settings = OutboxSettings(table_name=unique("outbox"), run_relays=False)
    outbox = Outbox(sqlite_url, brokers={"default": MemoryBroker()}, settings=settings)
    try:
        await outbox.create_tables()
        async with outbox.engine.begin() as conn:
            for table in (*outbox.inbox.lease_tables, outbox.inbox.table):
                await conn.execute(text(f"DROP TABLE {table.name}"))
        inbox, (leases, members) = outbox.inbox.table.name, outbox.inbox.lease_tables

        found = await doctor.examine(outbox.engine, outbox.table, side_tables=side_tables(outbox))
        assert [(f.what, f.mismatch) for f in found] == [
            (
                f"table {inbox} does not exist (needed by the cleaner's inbox_retention_seconds)",
                True,
            ),
            (f"table {leases.name} does not exist (for ordered subscribers; none yet)", False),
            (f"table {members.name} does not exist (for ordered subscribers; none yet)", False),
        ]

        @outbox.subscriber("orders", group="billing", ordered=True)
        async def bill(message: Message) -> None: ...

        found = await doctor.examine(outbox.engine, outbox.table, side_tables=side_tables(outbox))
        assert [f.what for f in found if f.mismatch] == [
            f"table {inbox} does not exist (needed by subscribers)",
            f"table {leases.name} does not exist (needed by ordered subscribers)",
            f"table {members.name} does not exist (needed by ordered subscribers)",
        ]
        applied, left = await doctor.upgrade(
            outbox.engine, outbox.table, side_tables=side_tables(outbox)
        )
        assert (len(applied), left) == (3, [])
        assert (
            await doctor.examine(outbox.engine, outbox.table, side_tables=side_tables(outbox)) == []
        )
        assert await outbox.inbox.group_stats() == {}  # the table is there, and empty
    finally:
        await outbox.aclose()


def test_upgrade_leaves_a_missing_outbox_table_to_db_create(cli: Any, sqlite_url: str) -> None:
    """No outbox table at all (a wrong URL or table name?): ``db upgrade`` creates nothing
    and says so, side tables included (it used to print "fixed" for it)."""
    env = table_env(OUTBOX_ARCHIVE="true")
    code, out = cli("db", "upgrade", "--url", sqlite_url, env=env)
    assert code == 1, out
    assert f"left for you: table {env['OUTBOX_TABLE_NAME']} does not exist" in out
    assert "fixed" not in out and "_archive" not in out
    code, out = cli("doctor", "--url", sqlite_url, env=env)
    assert code == 1 and out.count("MISMATCH") == 1, out

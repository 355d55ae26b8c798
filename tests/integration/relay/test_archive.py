"""``OutboxSettings(archive=True)``: retention moves finished rows to the archive table
instead of deleting them — in batches on a plain table (PostgreSQL and SQLite), by
re-attaching whole partitions on a partitioned one — and the archive has its own
retention."""

from __future__ import annotations

import datetime as dt
import secrets
import uuid
from typing import Any

import pytest
from sqlalchemy import select, text, update

from fastapi_outbox import Message, Outbox, OutboxSettings
from fastapi_outbox.brokers import MemoryBroker
from fastapi_outbox.storage import doctor, partitions
from tests.conftest import unique

pytestmark = pytest.mark.mariadb

HOUR = 3600.0
DAY = dt.timedelta(days=1)


def archiving(url: str, **overrides: Any) -> Outbox:
    options: dict[str, Any] = dict(
        run_relays=False,
        archive=True,
        cleanup_batch_size=4,
        published_retention_seconds=HOUR,
        abandoned_retention_seconds=HOUR,
        allow_short_abandoned_retention=True,
    )
    settings = OutboxSettings(**{**options, **overrides})
    return Outbox(url, brokers={"default": MemoryBroker()}, settings=settings)


async def publish(outbox: Outbox, stream: str, n: int) -> list[uuid.UUID]:
    async with outbox.unit_of_work() as uow:
        return [
            uow.publish(Message(stream=stream, type="Thing", payload={"i": i})) for i in range(n)
        ]


async def set_rows(outbox: Outbox, ids: list[uuid.UUID], **values: Any) -> None:
    t = outbox.table
    async with outbox.engine.begin() as conn:
        await conn.execute(update(t).where(t.c.id.in_(ids)).values(**values))


async def ids_of(outbox: Outbox, table: Any) -> list[uuid.UUID]:
    """Every id of ``table``, duplicates kept."""
    async with outbox.engine.connect() as conn:
        return list((await conn.execute(select(table.c.id))).scalars())


async def seed(outbox: Outbox, stream: str) -> tuple[set[uuid.UUID], set[uuid.UUID]]:
    """Rows due for the archive (old published and abandoned) and rows that stay."""
    now = dt.datetime.now(dt.UTC)
    old, recent = now - 2 * DAY, now - dt.timedelta(minutes=5)
    plan = {
        ("published", old): 9,
        ("abandoned", old): 3,
        ("published", recent): 2,
        ("pending", old): 1,
        ("failed", old): 1,
    }
    due, stay = set(), set()
    for (status, at), n in plan.items():
        ids = await publish(outbox, stream, n)
        await set_rows(outbox, ids, status=status, published_at=at, abandoned_at=at, created_at=at)
        (due if status in ("published", "abandoned") and at == old else stay).update(ids)
    return due, stay


async def mismatches(outbox: Outbox, table: Any) -> list[str]:
    return [f.what for f in await doctor.examine(outbox.engine, table) if f.mismatch]


async def test_retention_moves_finished_rows_once_in_batches(db_url: str) -> None:
    outbox = archiving(db_url)
    assert outbox.archive is not None
    archive = outbox.archive.table
    try:
        assert await mismatches(outbox, archive) == [f"table {archive.name} does not exist"]
        await outbox.create_tables()
        assert await mismatches(outbox, archive) == []  # the doctor knows the archive
        due, stay = await seed(outbox, unique("orders"))
        sample = next(iter(due))
        before = await outbox.store.messages.get(sample)

        moved = await outbox.cleaner.run_once()
        again = await outbox.cleaner.run_once()  # nothing left to move: nothing copied twice

        assert (moved, again) == (len(due), 0)
        assert set(await ids_of(outbox, outbox.table)) == stay
        archived = await ids_of(outbox, archive)
        assert sorted(archived) == sorted(due)  # each moved row once
        row = await outbox.archive.get(sample)
        assert row is not None and before is not None
        assert {k: row[k] for k in before} == before  # every column as it was
        assert row["archived_at"] is not None
    finally:
        await outbox.drop_tables()
        await outbox.aclose()


async def test_a_failed_move_loses_nothing_and_copies_nothing(db_url: str) -> None:
    """A batch is one transaction: when its INSERT into the archive fails (here a row of
    the same id is in the archive already), its rows stay in the outbox table, and every
    row is in exactly one of the two tables."""
    outbox = archiving(db_url)
    assert outbox.archive is not None
    archive = outbox.archive.table
    try:
        await outbox.create_tables()
        due, stay = await seed(outbox, unique("orders"))
        clash = sorted(due)[0]
        row = dict(await outbox.store.messages.get(clash) or {})
        async with outbox.engine.begin() as conn:  # a stray copy in the archive
            await conn.execute(
                archive.insert().values(
                    **{c.name: row[c.name] for c in outbox.table.c if c.name in row},
                    archived_at=dt.datetime.now(dt.UTC),
                )
            )

        with pytest.raises(Exception, match=r"(?i)unique|duplicate"):
            await outbox.cleaner.run_once()

        left = await ids_of(outbox, outbox.table)
        archived = await ids_of(outbox, archive)
        assert clash in left and archived.count(clash) == 1
        assert stay <= set(left)
        assert sorted(left + archived) == sorted([*due, *stay, clash])  # the stray twice
    finally:
        await outbox.drop_tables()
        await outbox.aclose()


async def test_archive_retention_deletes_only_old_archived_rows(db_url: str) -> None:
    outbox = archiving(db_url, archive_retention_seconds=HOUR)
    assert outbox.archive is not None
    archive = outbox.archive.table
    try:
        await outbox.create_tables()
        due, _ = await seed(outbox, unique("orders"))
        await outbox.cleaner.run_once()
        old = set(sorted(due)[:5])
        async with outbox.engine.begin() as conn:
            await conn.execute(
                update(archive)
                .where(archive.c.id.in_(old))
                .values(archived_at=dt.datetime.now(dt.UTC) - 2 * DAY)
            )

        await outbox.cleaner.run_once()

        assert set(await ids_of(outbox, archive)) == due - old
    finally:
        await outbox.drop_tables()
        await outbox.aclose()


async def test_ordered_an_abandoned_row_its_key_waits_for_stays(db_url: str) -> None:
    """ordered=True: an abandoned message a later one of its key still waits for is not
    archived (as retention does not delete it): archiving it would open a silent gap."""
    outbox = archiving(db_url, ordered=True)
    assert outbox.archive is not None
    try:
        await outbox.create_tables()
        stream, old = unique("orders"), dt.datetime.now(dt.UTC) - 2 * DAY
        async with outbox.unit_of_work() as uow:
            blocking = uow.publish(Message(stream=stream, type="T", key="k1", payload={}))
            waiting = uow.publish(Message(stream=stream, type="T", key="k1", payload={}))
            free = uow.publish(Message(stream=stream, type="T", key="k2", payload={}))
        await set_rows(outbox, [blocking, free], status="abandoned", abandoned_at=old)

        assert await outbox.cleaner.run_once() == 1

        assert set(await ids_of(outbox, outbox.archive.table)) == {free}
        assert set(await ids_of(outbox, outbox.table)) == {blocking, waiting}
    finally:
        await outbox.drop_tables()
        await outbox.aclose()


def test_archive_settings_refuse_clearly() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="archive_table_name"):
        OutboxSettings(archive=True, archive_table_name="bad name")
    with pytest.raises(ValidationError, match=r"archive_table_name.*outbox or inbox"):
        OutboxSettings(archive=True, archive_table_name="outbox_messages")
    with pytest.raises(ValidationError, match="delete_on_publish"):
        OutboxSettings(archive=True, delete_on_publish=True)
    assert OutboxSettings(table_name="jobs").archive_name == "jobs_archive"


# -- a partitioned table (PostgreSQL) --------------------------------------------------------


async def where_rows(outbox: Outbox, table: str) -> dict[uuid.UUID, str]:
    async with outbox.engine.connect() as conn:
        rows = await conn.execute(text(f"SELECT id, tableoid::regclass::text FROM {table}"))
        return {row[0]: row[1] for row in rows}


def id_at(at: dt.datetime) -> uuid.UUID:
    """A UUIDv7-like id of time ``at``: rows land in the partition of ``at`` whether the
    table is partitioned by ``created_at`` or by the id's time."""
    return uuid.UUID(f"{int(at.timestamp() * 1000):012x}7{secrets.token_hex(10)[:19]}")


async def age(outbox: Outbox, ids: list[uuid.UUID], at: dt.datetime, **values: Any) -> list[Any]:
    """Give rows the time ``at`` (ids included); their new ids."""
    t = outbox.table
    new = []
    async with outbox.engine.begin() as conn:
        for old in ids:
            new.append(id_at(at))
            await conn.execute(
                update(t).where(t.c.id == old).values(id=new[-1], created_at=at, **values)
            )
    return new


@pytest.mark.postgres(reason="partitions (re-attached to the archive) are PostgreSQL's alone")
async def test_a_finished_partition_is_reattached_to_the_archive(pg_url: str) -> None:
    outbox = archiving(
        pg_url,
        partitioning="daily",
        published_retention_seconds=86400.0,
        abandoned_retention_seconds=86400.0,
    )
    assert outbox.archive is not None and outbox.partitions is not None
    table, archive = outbox.table.name, outbox.archive.name
    stream = unique("orders")
    now = dt.datetime.now(dt.UTC)
    today = now.replace(hour=0, minute=0, second=0, microsecond=0)
    try:
        await outbox.create_tables()
        assert await mismatches(outbox, outbox.archive.table) == []
        async with outbox.engine.begin() as conn:
            for days in (6, 5, 4):
                lo = today - days * DAY
                await conn.run_sync(partitions.create_partition_sync, table, lo, lo + DAY)
        done = dict(status="published", locked_by=None)
        # 5 days ago, all published: the whole partition goes to the archive.
        expired = await age(
            outbox,
            await publish(outbox, stream, 6),
            now - 5 * DAY,
            published_at=now - 5 * DAY,
            **done,
        )
        # 6 days ago, all published, but the archive's DEFAULT partition already holds a
        # row of that range (a stray copy): the attach is refused, the rows are copied.
        refused = await age(
            outbox,
            await publish(outbox, stream, 2),
            now - 6 * DAY,
            published_at=now - 6 * DAY,
            **done,
        )
        stray = id_at(now - 6 * DAY)
        row = dict(await outbox.store.messages.get(refused[0]) or {})
        async with outbox.engine.begin() as conn:
            await conn.execute(
                outbox.archive.table.insert().values(**{**row, "id": stray, "archived_at": now})
            )
        # 4 days ago with a row still pending: stays, rows and all (no batched move there).
        mixed = await age(
            outbox,
            await publish(outbox, stream, 3),
            now - 4 * DAY,
            published_at=now - 4 * DAY,
            **done,
        )
        [pending] = await age(outbox, await publish(outbox, stream, 1), now - 4 * DAY)
        # 30 days ago, in the DEFAULT partition: moved in a batch.
        strays = await age(
            outbox,
            await publish(outbox, stream, 2),
            now - 30 * DAY,
            published_at=now - 30 * DAY,
            **done,
        )
        old_partition = partitions.partition_name(table, today - 5 * DAY)
        refused_partition = partitions.partition_name(table, today - 6 * DAY)
        assert {(await where_rows(outbox, table))[i] for i in expired} == {old_partition}
        async with outbox.engine.connect() as conn:
            oid_before = (
                await conn.execute(text("SELECT to_regclass(:n)::oid"), {"n": old_partition})
            ).scalar_one()

        await outbox.cleaner.run_once()

        assert outbox.cleaner.archived_partitions == [refused_partition, old_partition]
        in_archive = await where_rows(outbox, archive)
        # The same relation (same oid: attached, not copied), now a partition of the archive.
        assert {in_archive[i] for i in expired} == {old_partition}
        default = partitions.default_name(archive)
        assert {in_archive[i] for i in [*strays, *refused, stray]} == {default}
        async with outbox.engine.connect() as conn:
            oid_after = (
                await conn.execute(text("SELECT to_regclass(:n)::oid"), {"n": old_partition})
            ).scalar_one()
            refused_gone = (
                await conn.execute(text("SELECT to_regclass(:n) IS NULL"), {"n": refused_partition})
            ).scalar_one()
        assert oid_after == oid_before and refused_gone
        # A process that chose the same partition before it was archived leaves it alone.
        columns = [c.name for c in outbox.table.c]
        with pytest.raises(partitions.Reactivated):
            async with outbox.engine.begin() as conn:
                await conn.run_sync(
                    partitions.archive_partition_sync, table, archive, old_partition, columns
                )
        assert await mismatches(outbox, outbox.archive.table) == []
        assert set(await where_rows(outbox, table)) == {*mixed, pending}
        shown = await outbox.archive.get(expired[0])
        assert shown is not None and shown["archived_at"] is not None

        # The archive's retention drops the re-attached partition whole (and deletes the
        # DEFAULT partition's rows in batches).
        outbox.cleaner.settings = outbox.settings.model_copy(
            update={"archive_retention_seconds": 0.001}
        )
        await outbox.cleaner.run_once()
        assert set(await where_rows(outbox, archive)) == set()
        async with outbox.engine.connect() as conn:
            gone = (
                await conn.execute(text("SELECT to_regclass(:n) IS NULL"), {"n": old_partition})
            ).scalar_one()
        assert gone
    finally:
        await outbox.aclose()

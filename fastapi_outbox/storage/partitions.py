"""A time-partitioned outbox table (PostgreSQL, ``OutboxSettings(partitioning="daily")``).

Why: at ten million rows a day, retention by ``DELETE`` writes every deleted row to the WAL,
leaves dead tuples for autovacuum and bloats the indexes; dropping a day's partition is a
catalogue change. The layout and its maintenance, all here:

* The table is ``PARTITION BY RANGE (id)``: ids are UUIDv7, whose first 48 bits are the
  creation time in Unix milliseconds, so a time range is an id range; a bound is
  ``sql.id_bound(time)`` (that millisecond, zeros after). The primary key is ``(id)``, and
  every lookup by id prunes to one partition: ``id = $1`` when planned or at executor
  start; a batch's claim and marks on the range of its ids, computed in init plans, when
  the plan runs (``statements.claims._chosen_rows``, ``statements.parts.ids_in``).
  `Partition` bounds are times whatever the key, so the maintenance below reads the
  same for a table an earlier release partitioned by ``created_at``
  (`partition_key`): it keeps working, with timestamp bounds, without the pruning.
* Every index of the layout is declared on the partitioned table, so each partition gets
  the same partial indexes: a claim is a Merge Append of per-partition partial-index scans
  in due order, whose cost follows the rows that still need work.
* A ``DEFAULT`` partition takes rows no partition covers, so a maintenance job that did not
  run never fails a producer's transaction. Rows in it are cleaned by the batched DELETE.
* `ensure_ahead` (run by ``create_tables()``/``db create`` and by the cleaner)
  creates the partitions of the coming `AHEAD_SECONDS` with ``CREATE TABLE … (LIKE
  …)`` then ``ATTACH PARTITION``, which takes only a SHARE UPDATE EXCLUSIVE lock on the
  parent (no conflict with inserts, claims or marks) and a short ACCESS EXCLUSIVE lock on
  the DEFAULT partition while it checks that none of its rows fall in the new range. A range
  for which the DEFAULT partition already holds rows is left to it (logged).
* `drop_expired` drops a partition whose range is over and whose rows are all
  published or abandoned and past their retention (`partition_finished`, through
  the partial indexes: no scan of the partition). `list_partitions`,
  `partition_finished` and `detach_partition_sync` are the pieces other
  upkeep (an archive of finished partitions) builds on. ``DETACH PARTITION CONCURRENTLY``
  is refused by PostgreSQL when a DEFAULT partition exists, so the detach is a plain one:
  a brief ACCESS EXCLUSIVE lock on the parent, requested with a short ``lock_timeout``
  (`LOCK_TIMEOUT_SECONDS`) so that it never queues producers behind a long
  transaction; when the lock is not granted in time, the next cleanup tries again.
  Detach, re-check that no row is active (a ``replay`` may have run meanwhile) and ``DROP``
  happen in one transaction: either the partition is gone with only finished rows, or
  nothing changed.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import re
import uuid
from typing import Any

from sqlalchemy import Table, event, text
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from fastapi_outbox.settings import (
    MAX_PARTITIONED_TABLE_NAME,
)
from fastapi_outbox.storage.statements import archive as archive_sql
from fastapi_outbox.storage.statements import partitions as sql
from fastapi_outbox.storage.statements.partitions import AUTOVACUUM as AUTOVACUUM
from fastapi_outbox.storage.statements.partitions import storage_sql as storage_sql

logger = logging.getLogger("fastapi_outbox.storage")

#: Partitions are created this far ahead of now (and at least two of them).
AHEAD_SECONDS = 2 * 86400.0
#: Bound of the wait for the locks of ATTACH/DETACH: maintenance gives way to traffic.
LOCK_TIMEOUT_SECONDS = 2.0
#: Longest table name that leaves room for the partition suffix (``_p202611251200``).
MAX_TABLE_NAME = MAX_PARTITIONED_TABLE_NAME

_BOUND = re.compile(r"FROM \((.+?)\) TO \((.+?)\)")
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_MIN = dt.datetime.min.replace(tzinfo=dt.UTC)
_MAX = dt.datetime.max.replace(tzinfo=dt.UTC)


def default_name(table: str) -> str:
    return f"{table}_default"


def partition_name(table: str, start: dt.datetime) -> str:
    if start.hour == start.minute == 0:
        return f"{table}_p{start:%Y%m%d}"
    return f"{table}_p{start:%Y%m%d%H%M}"


@dataclasses.dataclass(frozen=True, slots=True)
class Partition:
    """One partition of the outbox table; ``start``/``end`` None for MINVALUE/MAXVALUE."""

    name: str
    start: dt.datetime | None
    end: dt.datetime | None
    is_default: bool = False


def _bound(value: str) -> dt.datetime | None:
    """A range bound as a UTC time: a timestamp (tables partitioned by ``created_at``) or
    a UUID whose first 48 bits are Unix milliseconds (by ``id``: see ``sql.id_bound``)."""
    value = value.strip()
    if value.upper() in ("MINVALUE", "MAXVALUE"):
        return None
    value = value.strip("'")
    try:
        ms = uuid.UUID(value).int >> 80
    except ValueError:
        return dt.datetime.fromisoformat(value).astimezone(dt.UTC)
    return _EPOCH + dt.timedelta(milliseconds=ms)


def partition_key(conn: Connection, table: str) -> str | None:
    """The column ``table`` is range-partitioned by: ``"id"`` (this layout),
    ``"created_at"`` (a table made by an earlier release), None when not partitioned."""
    keydef = conn.execute(sql.PARTITION_KEY, {"name": sql.quote(table)}).scalar_one_or_none()
    if not keydef:
        return None
    match = re.fullmatch(r'RANGE \("?([a-z_]+)"?\)', keydef.strip())
    return match.group(1) if match else keydef


# -- reading the catalogue ------------------------------------------------------------------


def list_partitions(conn: Connection, table: str) -> list[Partition]:
    """The partitions of ``table``, by start (DEFAULT last). The bounds are read in UTC."""
    conn.execute(sql.UTC)
    rows = conn.execute(sql.list_partitions(), {"name": sql.quote(table)}).all()
    out = []
    for name, bound in rows:
        if bound == "DEFAULT":
            out.append(Partition(name, None, None, is_default=True))
            continue
        match = _BOUND.search(bound)
        if match is None:  # not a range partition: not ours to manage
            continue
        out.append(Partition(name, _bound(match.group(1)), _bound(match.group(2))))
    return sorted(out, key=lambda p: (p.is_default, p.start or _MIN))


def _db_now(conn: Connection) -> dt.datetime:
    now: dt.datetime = conn.execute(sql.DB_NOW).scalar_one()
    return now.astimezone(dt.UTC)


def wanted_ranges(
    now: dt.datetime,
    interval: dt.timedelta,
    existing: list[Partition],
    *,
    ahead: float = AHEAD_SECONDS,
) -> list[tuple[dt.datetime, dt.datetime]]:
    """Ranges to create so partitions cover ``now`` .. ``now + ahead`` seconds (at least
    two intervals), aligned on ``interval`` from the Unix epoch in UTC, clipped around
    existing partitions (an attached legacy table may end at any time)."""
    step = interval.total_seconds()
    first = _EPOCH + dt.timedelta(seconds=(now - _EPOCH).total_seconds() // step * step)
    horizon = now + max(dt.timedelta(seconds=ahead), 2 * interval)
    ranges = [p for p in existing if not p.is_default]
    out = []
    start = first
    while start < horizon:
        lo, hi = start, start + interval
        for p in ranges:
            p_lo = p.start or _MIN
            p_hi = p.end or _MAX
            if p_lo <= lo < p_hi:
                lo = p_hi
            if lo < p_lo < hi:
                hi = p_lo
        if lo < hi:
            out.append((lo, hi))
        start += interval
    return out


# -- maintenance (sync: runs on Alembic's connection, in create_all, or via run_sync) -------


def create_default_sync(conn: Connection, table: str) -> None:
    """The DEFAULT partition (idempotent)."""
    conn.execute(text(sql.create_default(table, default_name(table))))


def _lock_timeout(conn: Connection) -> None:
    """Maintenance gives way to traffic: its locks are waited for this long at most."""
    conn.execute(sql.lock_timeout(LOCK_TIMEOUT_SECONDS))


def ranges_to_create(
    conn: Connection, table: str, interval: dt.timedelta
) -> list[tuple[dt.datetime, dt.datetime]]:
    """The DEFAULT partition (created here when missing), then the ranges still to create."""
    if not _try_lock(conn, table):
        return []  # another process is maintaining the table right now
    existing = list_partitions(conn, table)
    if not any(p.is_default for p in existing):
        create_default_sync(conn, table)
    return wanted_ranges(_db_now(conn), interval, existing)


def create_partition_sync(
    conn: Connection, table: str, lo: dt.datetime, hi: dt.datetime, key: str | None = None
) -> str | None:
    """Create and attach the partition of ``[lo, hi)``; None (logged) when the DEFAULT
    partition already holds rows of that range (the job did not run in time): those rows
    stay there and are cleaned by the batched DELETE."""
    name = partition_name(table, lo)
    # Every relay process runs this: one at a time, the others skip what is done.
    if (
        not _try_lock(conn, table)
        or conn.execute(sql.RELATION_EXISTS, {"name": sql.quote(name)}).scalar_one()
    ):
        return None
    key = key or partition_key(conn, table) or sql.KEY_ID
    bounds = {"lo": sql.bound_value(key, lo), "hi": sql.bound_value(key, hi)}
    taken = conn.execute(sql.default_has_rows(default_name(table), key), bounds).scalar_one()
    if taken:
        logger.warning(
            "partition range already has rows in the DEFAULT partition; left there",
            extra={"action": "partition.skipped", "table": table, "partition": name},
        )
        return None
    # LIKE + ATTACH rather than PARTITION OF: see sql.create_like.
    conn.execute(sql.create_like(name, table))
    conn.execute(sql.attach(table, name, lo, hi, key))
    logger.info(
        "partition created",
        extra={"action": "partition.created", "table": table, "partition": name},
    )
    return name


def ensure_ahead_sync(conn: Connection, table: str, interval: dt.timedelta) -> list[str]:
    """Create the DEFAULT partition and the partitions of the coming days in ``conn``'s
    transaction (a new table: ``create_all``, a migration); returns the names created."""
    created = []
    ranges = ranges_to_create(conn, table, interval)
    key = partition_key(conn, table) if ranges else None
    for lo, hi in ranges:
        name = create_partition_sync(conn, table, lo, hi, key)
        if name is not None:
            created.append(name)
    return created


def partition_finished(
    conn: Connection,
    name: str,
    published_cutoff: dt.datetime | None,
    abandoned_cutoff: dt.datetime | None,
) -> bool:
    """Whether every row of partition ``name`` is done and past retention, through its
    partial indexes only (never a scan of the partition). A None cutoff: kept forever.
    (The retention drop's check; an archive that moves finished partitions reuses it.)"""
    params: dict[str, Any] = {}
    if published_cutoff is not None:
        params["published"] = published_cutoff
    if abandoned_cutoff is not None:
        params["abandoned"] = abandoned_cutoff
    statement = sql.busy(
        name, published=published_cutoff is not None, abandoned=abandoned_cutoff is not None
    )
    busy = conn.execute(statement, params).scalar_one()
    return not busy


def _cutoffs(
    now: dt.datetime, published_seconds: float | None, abandoned_seconds: float | None
) -> tuple[dt.datetime | None, dt.datetime | None]:
    def cutoff(seconds: float | None) -> dt.datetime | None:
        return None if seconds is None else now - dt.timedelta(seconds=seconds)

    return cutoff(published_seconds), cutoff(abandoned_seconds)


def expired_candidates(
    conn: Connection,
    table: str,
    published_retention_seconds: float | None,
    abandoned_retention_seconds: float | None,
) -> list[str]:
    """Partitions whose range is over and whose rows are all finished and past retention."""
    if not _try_lock(conn, table):
        return []  # another process is maintaining the table right now
    now = _db_now(conn)
    published_cutoff, abandoned_cutoff = _cutoffs(
        now, published_retention_seconds, abandoned_retention_seconds
    )
    return [
        p.name
        for p in list_partitions(conn, table)
        if not p.is_default
        and p.end is not None
        and p.end <= now
        and partition_finished(conn, p.name, published_cutoff, abandoned_cutoff)
    ]


def _try_lock(conn: Connection, table: str) -> bool:
    """The table's maintenance lock (transaction-scoped, advisory), without waiting: every
    relay process runs the maintenance, one at a time does it. (Two ATTACHes at once
    deadlock: each holds what the other's needs — the DEFAULT partition, the parent.)"""
    key = f"fastapi_outbox:partitions:{table}"
    return bool(conn.execute(sql.TRY_LOCK, {"key": key}).scalar_one())


class Reactivated(Exception):
    """A row of a partition about to be dropped needs work again (a replay), or another
    process is dropping it: the transaction rolls back and the partition is left as is."""


def detach_partition_sync(conn: Connection, table: str, name: str) -> None:
    """Detach partition ``name`` from ``table`` (a plain DETACH: see ``sql.detach``; run
    under `_lock_timeout` by the maintainer). The partition stays as a table."""
    conn.execute(sql.detach(table, name))


def drop_partition_sync(conn: Connection, table: str, name: str) -> None:
    """Detach ``name``, check under the detach's lock that no row of it became active (a
    ``replay`` since the candidates were chosen) and drop it; `Reactivated` when a
    row is active again (the transaction must roll back: the partition stays attached).
    Only finished rows can change meanwhile, and only through replay (or a row whose id a
    producer with a late clock made: it counts as active, the drop rolls back)."""
    gone = (
        not _try_lock(conn, table)
        or conn.execute(sql.RELATION_MISSING, {"name": sql.quote(name)}).scalar_one()
    )
    if gone:  # another process is dropping it, or has
        raise Reactivated(name)
    detach_partition_sync(conn, table, name)
    if conn.execute(sql.any_active(name)).scalar_one():
        raise Reactivated(name)
    conn.execute(sql.drop(name))


def archive_default_index(archive: str) -> str:
    """Name of the ``archived_at`` index of a partitioned archive's DEFAULT partition."""
    return f"{archive}_default_at"


def install_archive(table: Table) -> None:
    """Make ``table.create()`` of a partitioned archive also create its DEFAULT partition
    (rows moved in batches from the outbox's DEFAULT partition) with an ``archived_at``
    index of its own (the archive's retention deletes there in batches). No partition
    ahead: the archive's partitions are the outbox's, re-attached."""

    def after_create(target: Table, connection: Connection, **kw: Any) -> None:
        if connection.dialect.name == "postgresql":
            create_archive_default_sync(connection, target.name)

    event.listen(table, "after_create", after_create)


def archive_default_statements(archive: str) -> list[str]:
    """The DEFAULT partition of a partitioned archive and its ``archived_at`` index
    (``db sql``, `create_archive_default_sync`)."""
    default = default_name(archive)
    return [
        sql.create_default(archive, default),
        archive_sql.archived_at_index(archive_default_index(archive), default),
    ]


def create_archive_default_sync(conn: Connection, archive: str) -> None:
    for statement in archive_default_statements(archive):
        conn.execute(text(statement))


def archive_partition_sync(
    conn: Connection, table: str, archive: str, name: str, columns: list[str]
) -> bool:
    """Move the finished partition ``name`` of ``table`` into the archive with no row
    copied: detach it (as `drop_partition_sync` does, with the same re-check that no
    row became active), add the archive's ``archived_at`` column (a catalogue change) and
    attach it to the archive with the bound it had. When the archive refuses the attach
    (its DEFAULT partition holds rows of that range), the rows are copied and the partition
    dropped instead, in a savepoint of the same transaction; returns whether the partition
    was attached (False: copied). `Reactivated` as for a drop."""
    ours = (
        _try_lock(conn, table)
        and conn.execute(
            archive_sql.PARTITION_OF, {"name": sql.quote(name), "parent": sql.quote(table)}
        ).scalar_one()
    )
    if not ours:  # another process is archiving it, or has
        raise Reactivated(name)
    bound = conn.execute(archive_sql.PARTITION_BOUND, {"name": sql.quote(name)}).scalar_one()
    conn.execute(sql.detach(table, name))
    if conn.execute(sql.any_active(name)).scalar_one():
        raise Reactivated(name)
    conn.execute(archive_sql.add_archived_at(name))
    try:
        with conn.begin_nested():
            conn.execute(archive_sql.attach_as(archive, name, bound))
    except DBAPIError as exc:
        if _sqlstate(exc) != CHECK_VIOLATION:
            raise  # lock_timeout…: the whole change rolls back, the next run tries again
        logger.warning(
            "partition could not be attached to the archive; its rows are copied",
            extra={"action": "archive.copied", "table": table, "partition": name},
        )
        conn.execute(archive_sql.copy_rows(archive, name, [*columns, "archived_at"]))
        conn.execute(sql.drop(name))
        return False
    return True


#: SQLSTATE of an ATTACH refused because the archive's DEFAULT partition holds rows of the
#: range ("updated partition constraint for default partition would be violated").
CHECK_VIOLATION = "23514"


def _sqlstate(exc: DBAPIError) -> str | None:
    orig = getattr(exc, "orig", None)
    code = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    return str(code) if code is not None else None


def expired_archive_partitions(
    conn: Connection, archive: str, retention_seconds: float
) -> list[str]:
    """The archive's range partitions whose rows were all archived more than
    ``retention_seconds`` ago (the DEFAULT partition is purged in batches)."""
    if not _try_lock(conn, archive):
        return []
    cutoff = _db_now(conn) - dt.timedelta(seconds=retention_seconds)
    return [
        p.name
        for p in list_partitions(conn, archive)
        if not p.is_default
        and not conn.execute(archive_sql.archive_busy(p.name), {"cutoff": cutoff}).scalar_one()
    ]


def drop_archive_partition_sync(conn: Connection, archive: str, name: str) -> None:
    """Detach and drop an expired archive partition (one short catalogue change)."""
    gone = (
        not _try_lock(conn, archive)
        or conn.execute(sql.RELATION_MISSING, {"name": sql.quote(name)}).scalar_one()
    )
    if gone:
        raise Reactivated(name)
    conn.execute(sql.detach(archive, name))
    conn.execute(sql.drop(name))


def install(table: Table, interval: dt.timedelta) -> None:
    """Make ``table.create()`` (``create_all``, Alembic's ``op.get_bind()``) also create the
    DEFAULT partition and the partitions ahead, on PostgreSQL."""

    def after_create(target: Table, connection: Connection, **kw: Any) -> None:
        if connection.dialect.name == "postgresql":
            ensure_ahead_sync(connection, target.name, interval)

    event.listen(table, "after_create", after_create)


def statements(
    table: str, interval: dt.timedelta, now: dt.datetime, key: str = sql.KEY_ID
) -> list[str]:
    """The SQL that creates the DEFAULT partition and the partitions ahead of ``now`` for a
    new partitioned table (``db sql``, hand-written migrations)."""
    out = [sql.create_default(table, default_name(table))]
    for lo, hi in wanted_ranges(now, interval, []):
        out.append(sql.partition_of(table, partition_name(table, lo), lo, hi, key=key))
    return out


# -- async entry points (the cleaner, create_tables) ---------------------------------------


class Maintainer:
    """Partition upkeep of one partitioned outbox table: each partition is created or
    dropped in a transaction of its own, with a short ``lock_timeout``, so no lock is held
    longer than one catalogue change."""

    def __init__(self, engine: AsyncEngine, table: Table, interval: dt.timedelta) -> None:
        self.engine = engine
        self.table = table
        self.interval = interval

    async def ensure_ahead(self) -> list[str]:
        name = self.table.name
        async with self.engine.begin() as conn:
            ranges = await conn.run_sync(ranges_to_create, name, self.interval)
            key = await conn.run_sync(partition_key, name) if ranges else None
        created = []
        for lo, hi in ranges:
            try:
                async with self.engine.begin() as conn:
                    await conn.run_sync(_lock_timeout)
                    made = await conn.run_sync(create_partition_sync, name, lo, hi, key)
            except DBAPIError as exc:  # lock_timeout (or a concurrent maintainer)
                _failed("partition.create_failed", name, partition_name(name, lo), exc)
                continue
            if made is not None:
                created.append(made)
        return created

    async def drop_expired(
        self, published_retention_seconds: float | None, abandoned_retention_seconds: float | None
    ) -> list[str]:
        name = self.table.name
        async with self.engine.begin() as conn:
            candidates = await conn.run_sync(
                expired_candidates, name, published_retention_seconds, abandoned_retention_seconds
            )
        dropped = []
        for partition in candidates:
            try:
                async with self.engine.begin() as conn:
                    await conn.run_sync(_lock_timeout)
                    await conn.run_sync(drop_partition_sync, name, partition)
            except Reactivated:
                continue  # rolled back: the partition stays attached
            except DBAPIError as exc:  # lock_timeout: traffic wins, try at the next run
                _failed("partition.drop_failed", name, partition, exc)
                continue
            dropped.append(partition)
            logger.info(
                "partition dropped",
                extra={"action": "partition.dropped", "table": name, "partition": partition},
            )
        return dropped

    async def archive_expired(
        self,
        archive: Table,
        published_retention_seconds: float | None,
        abandoned_retention_seconds: float | None,
    ) -> list[str]:
        """``archive=True``: the partitions `drop_expired` would drop are re-attached
        to ``archive`` instead, each in a transaction of its own; the names moved."""
        name = self.table.name
        columns = [c.name for c in self.table.c]
        async with self.engine.begin() as conn:
            candidates = await conn.run_sync(
                expired_candidates, name, published_retention_seconds, abandoned_retention_seconds
            )
        moved = []
        for partition in candidates:
            try:
                async with self.engine.begin() as conn:
                    await conn.run_sync(_lock_timeout)
                    attached = await conn.run_sync(
                        archive_partition_sync, name, archive.name, partition, columns
                    )
            except Reactivated:
                continue
            except DBAPIError as exc:
                _failed("archive.attach_failed", name, partition, exc)
                continue
            moved.append(partition)
            logger.info(
                "partition archived",
                extra={
                    "action": "archive.attached" if attached else "archive.copied",
                    "table": name,
                    "partition": partition,
                    "archive": archive.name,
                },
            )
        return moved

    async def drop_archive_expired(self, archive: Table, retention_seconds: float) -> list[str]:
        """The archive's partitions past ``retention_seconds``, dropped whole."""
        async with self.engine.begin() as conn:
            candidates = await conn.run_sync(
                expired_archive_partitions, archive.name, retention_seconds
            )
        dropped = []
        for partition in candidates:
            try:
                async with self.engine.begin() as conn:
                    await conn.run_sync(_lock_timeout)
                    await conn.run_sync(drop_archive_partition_sync, archive.name, partition)
            except Reactivated:
                continue
            except DBAPIError as exc:
                _failed("archive.drop_failed", archive.name, partition, exc)
                continue
            dropped.append(partition)
            logger.info(
                "archive partition dropped",
                extra={
                    "action": "archive.partition_dropped",
                    "table": archive.name,
                    "partition": partition,
                },
            )
        return dropped

    async def partitions(self) -> list[Partition]:
        async with self.engine.begin() as conn:
            return await conn.run_sync(list_partitions, self.table.name)

    async def run_once(
        self, published_retention_seconds: float | None, abandoned_retention_seconds: float | None
    ) -> tuple[list[str], list[str]]:
        """Create the partitions ahead, then drop the expired ones."""
        created = await self.ensure_ahead()
        dropped = await self.drop_expired(published_retention_seconds, abandoned_retention_seconds)
        return created, dropped


def _failed(action: str, table: str, partition: str, exc: BaseException) -> None:
    logger.warning(
        "partition maintenance deferred",
        extra={
            "action": action,
            "table": table,
            "partition": partition,
            "error": type(getattr(exc, "orig", exc)).__name__,
        },
    )

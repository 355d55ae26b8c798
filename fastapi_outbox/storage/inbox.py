"""The consumers' inbox: which message ids each consumer group has handled.

One row per (consumer group, message id), written by the subscriber in the handler's
transaction, *before* the handler runs::

    INSERT INTO outbox_inbox ("group", message_id, stream, handled_at)
    VALUES (…) ON CONFLICT DO NOTHING

One row inserted: the message is new, the handler runs, and its effects commit together
with the row. The subscriber owns that transaction: it inserts the row on a connection of
its own and binds the handler's session to it so that whatever the handler does with its
session (commit, rollback, savepoints) cannot commit or undo the row — only the
subscriber's final commit or rollback does, for the row and the effects together (see
`fastapi_outbox.consume.subscriber`).

No row inserted: the group handled this message before (a redelivery after a crash between
commit and ack, a duplicate entry in the stream, a replay), the handler is skipped and the
message is only acknowledged. On PostgreSQL a concurrent handler of the
same message (two consumers that both hold it after a claim timeout) waits on the primary
key until the first commits, then inserts nothing: effects happen once either way.

The table lives on the same ``MetaData`` as the outbox table (``fastapi_outbox.metadata``),
so Alembic, ``create_tables()``, ``db create`` and ``db sql`` include it. Retention
(``inbox_retention_seconds``) deletes old rows in bounded batches with the outbox's cleanup;
it must outlast every redelivery and replay window (docs/how-to/consumers.md, "Retention of
the inbox").
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Any

from sqlalchemy import Column, Index, MetaData, String, Table, delete, func, select, tuple_
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession

from fastapi_outbox import exceptions
from fastapi_outbox.settings import INBOX_TABLE_NAME, check_table_name
from fastapi_outbox.storage import clock, schema
from fastapi_outbox.storage.dialects import flavor, is_mysql
from fastapi_outbox.storage.group_members import Attempts, GroupMembers, build_group_tables
from fastapi_outbox.storage.leases import Leases, build_lease_tables
from fastapi_outbox.storage.statements.parts import derived

__all__ = ["Inbox", "build_inbox_table", "inbox_table"]


def build_inbox_table(name: str = INBOX_TABLE_NAME, metadata_: MetaData | None = None) -> Table:
    """The inbox table called ``name`` on ``metadata_`` (a new ``MetaData`` when None)."""
    try:
        check_table_name(name)
    except ValueError as exc:
        raise exceptions.ConfigurationError(
            str(exc).replace("table_name", "inbox_table_name")
        ) from None
    md = metadata_ if metadata_ is not None else MetaData()
    if name in md.tables:
        return md.tables[name]
    table = Table(
        name,
        md,
        Column("group", String(255), primary_key=True, comment="consumer group"),
        Column("message_id", String(255), primary_key=True, comment="incoming message id"),
        Column("stream", String(255), nullable=False, comment="stream / subject it came on"),
        Column("handled_at", schema.UtcDateTime(), nullable=False),
    )
    # Retention deletes the oldest rows first; stats read the newest per group.
    Index(f"ix_{name}_handled_at", table.c.handled_at)
    # Beside it, the partition leases of ordered subscribers (Alembic sees them too).
    build_lease_tables(name, md)
    # And what each process of a group handles, and the attempts the library counts.
    build_group_tables(name, md)
    return table


#: The default inbox table, on the shared ``fastapi_outbox.metadata``.
inbox_table = build_inbox_table(INBOX_TABLE_NAME, schema.metadata)


@dataclasses.dataclass(slots=True)
class GroupStats:
    """What the inbox knows of one consumer group."""

    group: str
    #: None when not counted.
    handled: int | None
    last_handled_at: dt.datetime | None


class Inbox:
    """SQL for one inbox table on one engine."""

    def __init__(self, engine: AsyncEngine, table: Table) -> None:
        self.engine = engine
        self.table = table
        #: The partition leases of ordered subscribers (`fastapi_outbox.storage.leases`),
        #: beside the inbox on its MetaData.
        self.lease_tables = build_lease_tables(table.name, table.metadata)
        #: The handlers and attempts tables (`fastapi_outbox.storage.group_members`).
        self.group_tables = build_group_tables(table.name, table.metadata)
        self.is_postgres = engine.dialect.name == "postgresql"
        self.is_mysql = is_mysql(engine)
        self._flavor = flavor(engine)
        dialect_insert: Any = postgresql.insert if self.is_postgres else sqlite.insert
        # record / record_many (SQLAlchemy path). Caller: the subscriber's transaction
        # (fastapi_outbox.consume.processing.Processing.run_batch), before its handlers run.
        # - ON CONFLICT DO NOTHING on the primary key: the row count (or the ids RETURNING
        #   gives back) says whether the message is new to the group; a concurrent insert
        #   of the same id waits on the key and then inserts nothing (effects once);
        # - handled_at: the database's clock, as is retention's cutoff compared with it.
        # Built once; the values are bound per message.
        if self.is_mysql:
            # MySQL: INSERT IGNORE (no ON CONFLICT); a duplicate key counts 0 rows, as
            # ON CONFLICT DO NOTHING does (ON DUPLICATE KEY UPDATE would count it found).
            self._record = (
                mysql.insert(table)
                .prefix_with("IGNORE")
                .values(handled_at=clock.db_now(self._flavor))
            )
        else:
            self._record = (
                dialect_insert(table)
                .values(handled_at=clock.db_now(self.is_postgres))
                .on_conflict_do_nothing(index_elements=[table.c.group, table.c.message_id])
            )
        # record_many on asyncpg, a batch from several streams. Caller: the same.
        # - unnest($2, $3): one row per (message id, stream) pair from two arrays: one
        #   statement for the batch, no VALUES row per message nor SQLAlchemy work per row;
        # - ON CONFLICT ... DO NOTHING RETURNING message_id: only the new ids come back;
        # - array_agg over the CTE: those ids in one array in one row (a hundred result
        #   rows cost more than the statement).
        self._record_many_sql = (
            f'WITH new AS (INSERT INTO "{table.name}" ("group", message_id, stream, handled_at) '
            "SELECT $1, m, s, now() FROM unnest($2::varchar[], $3::varchar[]) AS u(m, s) "
            'ON CONFLICT ("group", message_id) DO NOTHING RETURNING message_id) '
            "SELECT array_agg(message_id) FROM new"
        )
        # record_many on asyncpg, the usual batch: every message from one stream. Caller: the
        # same. As above, with the stream sent once ($3) instead of once per row.
        self._record_one_stream_sql = (
            f'WITH new AS (INSERT INTO "{table.name}" ("group", message_id, stream, handled_at) '
            "SELECT $1, unnest($2::varchar[]), $3, now() "
            'ON CONFLICT ("group", message_id) DO NOTHING RETURNING message_id) '
            "SELECT array_agg(message_id) FROM new"
        )

    async def create_table(self) -> None:
        """The inbox table and the lease tables of ordered subscribers."""
        for table in (self.table, *self.lease_tables, *self.group_tables):
            await schema.create_table(self.engine, table)

    async def drop_table(self) -> None:
        for table in (*self.group_tables, *self.lease_tables, self.table):
            await schema.drop_table(self.engine, table)

    def leases(self, group: str, stream: str) -> Leases:
        """The partition leases of the ordered subscriber of (``group``, ``stream``)."""
        return Leases(self.engine, self.lease_tables, group, stream)

    def members(self, group: str, stream: str) -> GroupMembers:
        """What the live processes of (``group``, ``stream``) handle."""
        return GroupMembers(self.engine, self.group_tables[0], group, stream)

    def attempts(self, group: str) -> Attempts:
        """The attempts the library counts for ``group``."""
        return Attempts(self.engine, self.group_tables[1], group)

    async def record(
        self, on: AsyncConnection | AsyncSession, group: str, message_id: str, stream: str
    ) -> bool:
        """Record ``message_id`` as handled by ``group`` in the transaction of ``on`` (a
        connection or a session); True when it is new (the handler must run), False when
        the group handled it before."""
        result: Any = await on.execute(
            self._record,
            {
                "group": group,
                "message_id": message_id,
                "stream": stream,
            },
        )
        return int(result.rowcount) == 1

    async def record_many(
        self,
        on: AsyncConnection | AsyncSession,
        group: str,
        message_ids: list[str],
        streams: str | list[str],
    ) -> set[str]:
        """Record ``message_ids`` (from ``streams``: one stream for all, or one per id) for
        ``group`` in one statement of the transaction of ``on`` (a connection or a session;
        a subscriber's batch); returns the ids that are new. An id twice in the list is
        recorded once."""
        if not message_ids:
            return set()
        if self.is_postgres and self.engine.dialect.driver == "asyncpg":
            # One statement for the whole batch: arrays instead of a VALUES row per message,
            # no SQLAlchemy work per row. Through SQLAlchemy's connection (not the raw
            # asyncpg one): that starts its transaction if it has not begun, so the rows
            # commit or roll back with the handlers' effects.
            connection = await on.connection() if isinstance(on, AsyncSession) else on
            result: Any
            if isinstance(streams, str):
                result = await connection.exec_driver_sql(
                    self._record_one_stream_sql, (group, message_ids, streams)
                )
            else:
                result = await connection.exec_driver_sql(
                    self._record_many_sql, (group, message_ids, streams)
                )
            return set(result.scalar() or ())
        per_id = [streams] * len(message_ids) if isinstance(streams, str) else streams
        rows = dict(zip(message_ids, per_id, strict=True))  # an id once: ON CONFLICT
        if self.is_mysql:
            # No INSERT … RETURNING on MySQL 8: one INSERT IGNORE per id, its row count
            # telling a new id (a batch is a subscriber's fetch: tens of ids).
            new: set[str] = set()
            for message_id, stream in rows.items():
                if await self.record(on, group, message_id, stream):
                    new.add(message_id)
            return new
        result = await on.execute(  # cannot affect a row twice in one statement
            self._record.returning(self.table.c.message_id),
            [{"group": group, "message_id": m, "stream": s} for m, s in rows.items()],
        )
        return set(result.scalars().all())

    async def contains(self, group: str, message_id: str) -> bool:
        """Whether ``group`` handled ``message_id``: one primary-key look-up on a connection
        of its own. Caller: the subscriber, for a delivery past ``max_attempts``
        (``Processing._past_max_attempts``): committed before (acknowledged) or never
        handled (dead-lettered)."""
        t = self.table
        stmt = select(t.c.message_id).where(t.c.group == group, t.c.message_id == message_id)
        async with self.engine.connect() as conn:
            return (await conn.execute(stmt)).first() is not None

    async def purge_batch(self, older_than_seconds: float, limit: int) -> int:
        """Delete up to ``limit`` rows handled more than ``older_than_seconds`` ago: one
        short transaction through the ``handled_at`` index (SKIP LOCKED on PostgreSQL: two
        cleaners never wait on each other's rows). Caller: retention
        (`fastapi_outbox.lifecycle.retention.Cleaner`)."""
        t = self.table
        cutoff = clock.db_later(self._flavor, seconds=-older_than_seconds)
        victims = (
            select(t.c.group, t.c.message_id)
            .where(t.c.handled_at < cutoff)
            .order_by(t.c.handled_at)
            .limit(limit)
        )
        if self.is_postgres:
            victims = victims.with_for_update(skip_locked=True)
        victims = derived(victims, self.engine.dialect)  # MySQL: see parts.derived
        stmt = delete(t).where(tuple_(t.c.group, t.c.message_id).in_(victims))
        async with self.engine.begin() as conn:
            result: Any = await conn.execute(stmt)
        return int(result.rowcount)

    async def purge_group_rows_batch(self, older_than_seconds: float, limit: int) -> int:
        """Delete up to ``limit`` rows of each of the handlers and attempts tables that
        nothing needs any more: attempts of a message its group has handled, or last
        counted more than ``older_than_seconds`` ago (a crash, or a hand-back nobody
        settled, leaves them; a message still retried touches its row at each run), and
        handlers rows expired that long ago (a process that was killed). One short
        transaction (SKIP LOCKED on PostgreSQL). Caller: retention, with the inbox's."""
        inbox = self.table
        handlers, attempts = self.group_tables
        cutoff = clock.db_later(self._flavor, seconds=-older_than_seconds)
        handled = (
            select(inbox.c.message_id)
            .where(inbox.c.group == attempts.c.group, inbox.c.message_id == attempts.c.message_id)
            .exists()
        )
        stale = (
            select(attempts.c.group, attempts.c.message_id)
            .where((attempts.c.updated_at < cutoff) | handled)
            .limit(limit)
        )
        expired = (
            select(handlers.c.group, handlers.c.stream, handlers.c.member)
            .where(handlers.c.expires_at < cutoff)
            .limit(limit)
        )
        if self.is_postgres:
            stale = stale.with_for_update(skip_locked=True)
            expired = expired.with_for_update(skip_locked=True)
        stale, expired = derived(stale, self.engine.dialect), derived(expired, self.engine.dialect)
        async with self.engine.begin() as conn:
            a: Any = await conn.execute(
                delete(attempts).where(tuple_(attempts.c.group, attempts.c.message_id).in_(stale))
            )
            h: Any = await conn.execute(
                delete(handlers).where(
                    tuple_(handlers.c.group, handlers.c.stream, handlers.c.member).in_(expired)
                )
            )
        return max(int(a.rowcount), int(h.rowcount))

    async def group_stats(
        self, groups: list[str] | None = None, *, counts: bool = True
    ) -> dict[str, GroupStats]:
        """The last handling time per group (``groups``: only these) and, with ``counts``,
        how many rows each has. Counting reads every row of the groups (an operator's
        command); without it, each group costs one backward walk of the ``handled_at``
        index that stops at the group's newest row (cheap for a group that is active:
        health and the dashboard). Caller: `fastapi_outbox.ops.operations.consumers`."""
        t = self.table
        rows: list[Any]
        async with self.engine.connect() as conn:
            if counts or groups is None:
                stmt = select(t.c.group, func.count(), func.max(t.c.handled_at)).group_by(t.c.group)
                if groups is not None:
                    stmt = stmt.where(t.c.group.in_(groups))
                rows = list((await conn.execute(stmt)).all())
            else:
                rows = []
                for group in groups:
                    newest = (
                        select(t.c.handled_at)
                        .where(t.c.group == group)
                        .order_by(t.c.handled_at.desc())
                        .limit(1)
                    )
                    last = (await conn.execute(newest)).scalar_one_or_none()
                    if last is not None:
                        rows.append((group, None, last))
        out: dict[str, GroupStats] = {}
        for group, count, last in rows:
            if isinstance(last, str):  # SQLite: max() loses the column type
                last = dt.datetime.fromisoformat(last).replace(tzinfo=dt.UTC)
            handled = None if count is None else int(count)
            out[group] = GroupStats(group=group, handled=handled, last_handled_at=last)
        return out

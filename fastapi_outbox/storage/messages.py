"""Operator reads and actions on the outbox table: the counts health, metrics, the
dashboard and ``status`` show, one message and pages of them, and the row changes an
operator asks for (replay, abandon, cancel).

The SQL is in `fastapi_outbox.storage.statements.messages`; the counts' rows are
folded by `fastapi_outbox.storage.read_models`. The counts read the partial indexes,
so they cost what the rows that still need work cost, not the table's history.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import Table, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from fastapi_outbox.storage import read_models
from fastapi_outbox.storage.connector import Connector
from fastapi_outbox.storage.dialects import is_mysql
from fastapi_outbox.storage.filters import MessageFilter
from fastapi_outbox.storage.read_models import BrokerStats, aware
from fastapi_outbox.storage.statements import messages as messages_sql
from fastapi_outbox.storage.statements.parts import ABANDONED

__all__ = ["Messages"]


class Messages:
    """The outbox table as operators read it and change it."""

    def __init__(self, connector: Connector, table: Table) -> None:
        self.connector = connector
        self.engine = connector.engine
        self.table = table
        self.dialect = connector.engine.dialect
        #: PostgreSQL (else SQLite): which classifier tells what a failed query means.
        self.is_postgres = connector.is_postgres
        self.autocommit_engine = connector.autocommit_engine

    async def _db_now(self, conn: AsyncConnection) -> dt.datetime:
        return aware((await conn.execute(messages_sql.database_now(self.dialect))).scalar_one())

    async def now(self) -> dt.datetime:
        """The database's clock (aware UTC): the one every due time is compared with."""
        async with self.autocommit_engine.connect() as conn:
            return await self._db_now(conn)

    def stats_statements(self) -> dict[str, Any]:
        """The statements behind `stats` (see
        `stats`)."""
        return messages_sql.stats(self.table, self.dialect)

    async def stats(
        self,
        brokers: Iterable[str] = (),
        *,
        published_totals: bool = False,
        ordered: bool = False,
    ) -> dict[str, BrokerStats]:
        """Counts per broker, from the partial indexes (cheap on a table of published rows).

        ``oldest_pending_age_seconds`` is how long the longest-waiting due *pending* row has
        waited for a relay: counted from its due time (its commit, or when it was given
        back while the broker was unreachable), not from its producer's transaction start.
        A failing message has its own count and backoff and does not make the outbox look
        stalled; with ``ordered`` neither do the rows of its key behind it.
        ``published_totals`` adds the count of published rows, which costs a scan of all
        of them (the CLI's ``status``, never the health endpoint)."""
        statements = self.stats_statements()
        names = ["active"]
        names += ["waiting_ordered", "blocking_ordered"] if ordered else []
        names += ["abandoned", "scheduled", "recent"]
        names += ["published"] if published_totals else []
        async with self.autocommit_engine.connect() as conn:
            db_now = aware(
                (await conn.execute(messages_sql.database_now(self.dialect))).scalar_one()
            )
            rows = {name: (await conn.execute(statements[name])).all() for name in names}
        return read_models.broker_stats(
            brokers, db_now, rows, ordered=ordered, published_totals=published_totals
        )

    async def count_matching(
        self,
        status: str,
        *,
        stream: str | None = None,
        finished_before_seconds: float | None = None,
    ) -> int:
        """How many rows of ``status`` (in ``stream``; for published/abandoned rows,
        finished more than ``finished_before_seconds`` ago): the total of a progress bar."""
        stmt = messages_sql.count_matching(
            self.table,
            status,
            self.dialect,
            stream=stream,
            finished_before_seconds=finished_before_seconds,
        )
        async with self.engine.connect() as conn:
            return int((await conn.execute(stmt)).scalar_one())

    async def get(self, message_id: uuid.UUID) -> Mapping[str, Any] | None:
        """One message with its payload and headers as stored JSON text; None when absent."""
        async with self.engine.connect() as conn:
            row = (await conn.execute(messages_sql.get(self.table, message_id))).mappings().first()
        return None if row is None else dict(row)

    async def list_messages(
        self,
        where: MessageFilter | None = None,
        *,
        before_id: uuid.UUID | None = None,
        limit: int = 50,
    ) -> list[Mapping[str, Any]]:
        """Rows without payloads, newest first (by id: UUIDv7 ids are time-ordered).

        Keyset pagination: the next page is ``before_id=<last id of this page>``, one
        primary-key range scan however deep the page — never OFFSET over millions of rows."""
        stmt = messages_sql.list_messages(
            self.table, self.dialect, where or MessageFilter(), before_id=before_id, limit=limit
        )
        async with self.engine.connect() as conn:
            return [dict(r) for r in (await conn.execute(stmt)).mappings().all()]

    async def stream_stats(self) -> list[dict[str, Any]]:
        """Counts per (broker, stream) of the rows that need work and of the abandoned ones,
        with the oldest due pending row per stream: from the partial indexes (the dashboard's
        overview; cheap on a table of published rows)."""
        statements = messages_sql.stream_stats(self.table, self.dialect)
        async with self.autocommit_engine.connect() as conn:
            db_now = aware(
                (await conn.execute(messages_sql.database_now(self.dialect))).scalar_one()
            )
            rows = {
                name: (await conn.execute(statements[name])).all()
                for name in ("active", "abandoned", "scheduled")
            }
        return read_models.stream_stats(db_now, rows)

    async def published_per_minute(self, minutes: int = 60) -> list[tuple[dt.datetime, int]]:
        """Published rows per minute over the last ``minutes`` (a range scan of the
        published index), oldest first, minutes without any included as 0."""
        stmt = messages_sql.published_per_minute(self.table, minutes, self.dialect)
        async with self.autocommit_engine.connect() as conn:
            db_now = aware(
                (await conn.execute(messages_sql.database_now(self.dialect))).scalar_one()
            )
            rows = (await conn.execute(stmt)).all()
        return read_models.per_minute(db_now, rows, minutes)

    async def states(self, ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, tuple[str, bool]]:
        """(status, held by a relay) of each of ``ids`` that exists: one statement for
        an operator's page of ids (the caller keeps ``ids`` to a page: one bind each)."""
        async with self.engine.connect() as conn:
            rows = (await conn.execute(messages_sql.states(self.table, ids))).all()
        return {row.id: (row.status, row.locked_by is not None) for row in rows}

    async def count(self, status: str | None = None) -> int:
        """How many rows (of ``status``)."""
        async with self.engine.connect() as conn:
            return int((await conn.execute(messages_sql.count(self.table, status))).scalar_one())

    async def clock(self) -> dt.datetime:
        """The time every age is measured with: the database's on PostgreSQL and MySQL, the
        process's on SQLite."""
        if not self.is_postgres and not is_mysql(self.dialect):
            return dt.datetime.now(dt.UTC)
        async with self.engine.connect() as conn:
            return await self._db_now(conn)

    async def replay(
        self,
        ids: Sequence[uuid.UUID] | None = None,
        *,
        stream: str | None = None,
        statuses: Sequence[str] = (ABANDONED,),
        limit: int | None = None,
    ) -> list[uuid.UUID]:
        """Move rows (abandoned by default) back to pending with attempts reset; returns
        the ids moved. With ``ids=None``, every row in ``statuses`` (and ``stream``), in
        batches of ``limit``."""
        if is_mysql(self.dialect):
            # No UPDATE … RETURNING: the rows locked first (SKIP LOCKED), then moved by id.
            target = messages_sql.replay_target(
                self.table, self.dialect, ids, stream=stream, statuses=statuses, limit=limit
            )
            async with self.engine.begin() as conn:
                moved = list((await conn.execute(target)).scalars().all())
                if moved:
                    t = self.table
                    values = messages_sql.replay_values(self.dialect)
                    await conn.execute(update(t).where(t.c.id.in_(moved)).values(**values))
                return moved
        stmt = messages_sql.replay(
            self.table, self.dialect, ids, stream=stream, statuses=statuses, limit=limit
        )
        async with self.engine.begin() as conn:
            return list((await conn.execute(stmt)).scalars().all())

    async def cancel_unclaimed(self, ids: Sequence[uuid.UUID]) -> list[uuid.UUID]:
        """Delete pending rows no relay holds (fenced against a concurrent claim).
        Returns the ids cancelled."""
        if is_mysql(self.dialect):
            stmt = messages_sql.cancel_unclaimed(self.table, ids, returning=False)
            return await self._changed_ids(stmt)
        async with self.engine.begin() as conn:
            stmt = messages_sql.cancel_unclaimed(self.table, ids)
            return list((await conn.execute(stmt)).scalars().all())

    async def abandon_unclaimed(self, ids: Sequence[uuid.UUID], error: str) -> list[uuid.UUID]:
        """An operator's abandon: stop retrying pending or failed rows that no relay
        holds (a row claimed meanwhile is left to its claim). Returns the ids abandoned."""
        if is_mysql(self.dialect):
            stmt = messages_sql.abandon_unclaimed(
                self.table, ids, error, self.dialect, returning=False
            )
            return await self._changed_ids(stmt)
        async with self.engine.begin() as conn:
            stmt = messages_sql.abandon_unclaimed(self.table, ids, error, self.dialect)
            return list((await conn.execute(stmt)).scalars().all())

    async def _changed_ids(self, stmt: Any) -> list[uuid.UUID]:
        """MySQL's ``… RETURNING id`` of an UPDATE or DELETE on the outbox table (none there):
        the rows its WHERE picks, locked, then the statement on exactly those."""
        t = self.table
        async with self.engine.begin() as conn:
            found = select(t.c.id).where(stmt.whereclause).with_for_update()
            ids = list((await conn.execute(found)).scalars().all())
            if ids:
                await conn.execute(stmt.where(t.c.id.in_(ids)))
            return ids

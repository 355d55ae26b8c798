"""The archive table of ``OutboxSettings(archive=True)``: where retention moves published and
abandoned rows past their retention instead of deleting them.

* A plain outbox table: each batch is one statement on PostgreSQL (``WITH moved AS (DELETE
  … RETURNING …) INSERT INTO archive …``) and one transaction of two statements on SQLite
  (copy, then delete exactly the rows copied): a batch is moved whole or not at all, and a
  row is never in both tables once the batch commits. Batches are bounded and locked as
  retention's DELETE is (``LIMIT``, ``FOR UPDATE SKIP LOCKED``).
* A partitioned outbox table (PostgreSQL): the archive is partitioned the same way; a
  finished partition is detached from the outbox and attached to the archive, no row copied
  (`fastapi_outbox.storage.partitions.archive_partition_sync`). Only the rows of the
  outbox's DEFAULT partition are moved in batches (into the archive's DEFAULT partition):
  the rows of a range partition wait for their whole partition, so that its range never
  has rows in both tables.
* The archive's retention (``archive_retention_seconds``, None: forever) deletes rows
  archived longer ago than that, in batches; a partitioned archive drops whole partitions.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from sqlalchemy import MetaData, Table
from sqlalchemy.ext.asyncio import AsyncEngine

from fastapi_outbox.storage import partitions, schema
from fastapi_outbox.storage.dialects import is_mysql, is_postgres
from fastapi_outbox.storage.filters import MessageFilter
from fastapi_outbox.storage.statements import archive as archive_sql
from fastapi_outbox.storage.statements import messages as messages_sql

__all__ = ["Archive"]


class Archive:
    """The archive table of one outbox table, and every statement run on it."""

    def __init__(self, engine: AsyncEngine, outbox: Table, name: str) -> None:
        self.engine = engine
        self.dialect = engine.dialect
        self.outbox = outbox
        self.table = schema.build_archive_table(outbox, name)
        self.partitioned = "partitioning" in outbox.info
        #: Where batches are moved from and archived rows are purged in batches: the
        #: tables themselves, or their DEFAULT partitions when partitioned.
        self.source = self._partition(outbox, partitions.default_name(outbox.name))
        self.purge_target = self._partition(self.table, partitions.default_name(self.table.name))

    def _partition(self, table: Table, name: str) -> Table:
        if not self.partitioned:
            return table
        return Table(name, MetaData(), *[c._copy() for c in table.c])

    @property
    def name(self) -> str:
        return self.table.name

    async def create_table(self) -> None:
        """The archive table and its indexes (partitioned: and its DEFAULT partition)."""
        await schema.create_table(self.engine, self.table)
        if self.partitioned and is_postgres(self.dialect):
            async with self.engine.begin() as conn:
                await conn.run_sync(partitions.create_archive_default_sync, self.table.name)

    async def drop_table(self) -> None:
        await schema.drop_table(self.engine, self.table)

    async def move_batch(
        self, status: str, older_than_seconds: float, limit: int, *, keep_blocking: bool = False
    ) -> int:
        """Move up to ``limit`` rows of ``status`` finished more than ``older_than_seconds``
        ago to the archive, in one transaction; how many were moved."""
        args = (self.source, self.table, status, older_than_seconds, limit, self.dialect)
        async with self.engine.begin() as conn:
            if is_postgres(self.dialect):
                statement = archive_sql.move(*args, keep_blocking=keep_blocking, whole=self.outbox)
                return int((await conn.execute(statement)).rowcount)
            if is_mysql(self.dialect):
                # No DELETE … RETURNING in a WITH: the batch's ids locked (SKIP LOCKED),
                # then copied and deleted by id in the same transaction.
                chosen = archive_sql.move_ids(*args, keep_blocking=keep_blocking)
                ids = list((await conn.execute(chosen)).scalars())
                if not ids:
                    return 0
                await conn.execute(
                    archive_sql.copy_ids(self.source, self.table, self.dialect), {"ids": ids}
                )
                removed = await conn.execute(
                    archive_sql.delete_ids(self.source, self.dialect), {"ids": ids}
                )
                return int(removed.rowcount)
            copied = (
                await conn.execute(archive_sql.move_insert(*args, keep_blocking=keep_blocking))
            ).rowcount
            deleted = (
                await conn.execute(archive_sql.move_delete(*args, keep_blocking=keep_blocking))
            ).rowcount
            if copied != deleted:  # cannot happen under SQLite's write lock; never half a move
                raise RuntimeError(
                    f"archive move of {status} rows: {copied} copied but {deleted} deleted; "
                    "rolled back"
                )
            return int(deleted)

    async def purge_batch(self, older_than_seconds: float, limit: int) -> int:
        """Delete up to ``limit`` rows archived more than ``older_than_seconds`` ago."""
        statement = archive_sql.purge(self.purge_target, older_than_seconds, limit, self.dialect)
        async with self.engine.begin() as conn:
            return int((await conn.execute(statement)).rowcount)

    async def get(self, message_id: uuid.UUID) -> Mapping[str, Any] | None:
        """One archived message, payload and headers as stored JSON text; None if absent."""
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
        """Archived rows without payloads, newest first by id (keyset: ``before_id``)."""
        statement = messages_sql.list_messages(
            self.table, self.dialect, where or MessageFilter(), before_id=before_id, limit=limit
        )
        async with self.engine.connect() as conn:
            return [dict(r) for r in (await conn.execute(statement)).mappings().all()]

    async def count(self) -> int:
        """Rows in the archive (``archive list``'s footer, the tests)."""
        async with self.engine.connect() as conn:
            return int((await conn.execute(messages_sql.count(self.table))).scalar_one())

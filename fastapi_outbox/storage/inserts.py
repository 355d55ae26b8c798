"""Inserts into the outbox table: the unit of work's rows, in the producing transaction,
and the WAL relay's hand-over of the messages a broker refused (the SQL:
`fastapi_outbox.storage.statements.inserts` and ``claims.insert_failed``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Table
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncConnection

from fastapi_outbox.storage.connector import Connector
from fastapi_outbox.storage.statements import claims as claims_sql
from fastapi_outbox.storage.statements import inserts as inserts_sql
from fastapi_outbox.storage.statements.inserts import INSERT_KEYS

__all__ = ["Inserts"]


class Inserts:
    """Rows written into the outbox table."""

    def __init__(self, connector: Connector, table: Table) -> None:
        self.connector = connector
        self.engine = connector.engine
        self.table = table
        self.dialect = connector.engine.dialect
        self._insert: Any = None

    def insert_statement(self) -> Any:
        """The unit of work's INSERT (built once; see
        `insert_rows`)."""
        if self._insert is None:
            self._insert = inserts_sql.insert_rows(self.table, self.dialect)
        return self._insert

    def row_params(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The unit of work's row dicts completed for `insert_statement`."""
        return inserts_sql.row_params(rows, self.dialect)

    async def insert_rows(self, conn: AsyncConnection, rows: list[dict[str, Any]]) -> None:
        """Insert outbox rows in ``conn``'s transaction (see `insert_rows_sync`)."""
        await conn.run_sync(self.insert_rows_sync, rows)

    def insert_rows_sync(self, conn: Connection, rows: list[dict[str, Any]]) -> None:
        """Insert outbox rows in ``conn``'s transaction, from SQLAlchemy's sync API (the
        session's ``before_commit`` event, run inside the async engine's greenlet). On
        asyncpg, once the transaction has begun, the INSERT runs on the driver connection
        itself (see `Connector.insert_sync`)."""
        params = self.row_params(rows)
        stmt = self.insert_statement()
        keys = [*INSERT_KEYS, "delay", "deliver_at"]
        if not self.connector.insert_sync(conn, stmt, keys, params):
            conn.execute(stmt, params[0] if len(params) == 1 else params)

    async def insert_failed(self, rows: Sequence[dict[str, Any]]) -> int:
        """Insert messages the WAL relay (``capture="wal"``) could not publish because the
        broker refused them, as ``failed`` rows due again after ``retry_in`` (or
        ``abandoned`` ones, ``abandon_now``); a row already there is left as it is (see
        `insert_failed`). Returns how many
        rows were inserted."""
        if not rows:
            return 0
        async with self.engine.begin() as conn:
            result = await conn.execute(claims_sql.insert_failed(self.table), list(rows))
            return int(result.rowcount)

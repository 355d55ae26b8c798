"""Retention's delete on the outbox table: bounded batches of finished rows, each one short
transaction (the SQL: `fastapi_outbox.storage.statements.purge`). The archive's move
and its own retention are `Archive`'s."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Table

from fastapi_outbox.storage.connector import Connector
from fastapi_outbox.storage.statements import purge as purge_sql

__all__ = ["Retention"]


class Retention:
    """The outbox table's retention: delete finished rows in batches."""

    def __init__(self, connector: Connector, table: Table) -> None:
        self.table = table
        self.dialect = connector.engine.dialect
        self.autocommit_engine = connector.autocommit_engine

    async def purge_batch(
        self, status: str, older_than_seconds: float, limit: int, *, keep_blocking: bool = False
    ) -> int:
        """Delete up to ``limit`` rows of ``status`` (published or abandoned) finished more
        than ``older_than_seconds`` ago. One short transaction: no long locks."""
        stmt = self.purge_statement(status, older_than_seconds, limit, keep_blocking=keep_blocking)
        async with self.autocommit_engine.begin() as conn:
            result = await conn.execute(stmt)
        return int(result.rowcount)

    def purge_statement(
        self, status: str, older_than_seconds: float, limit: int, *, keep_blocking: bool = False
    ) -> Any:
        """The DELETE of `purge_batch` (``benchmarks/scale.py`` measures its WAL)."""
        return purge_sql.purge(
            self.table, status, older_than_seconds, limit, self.dialect, keep_blocking=keep_blocking
        )

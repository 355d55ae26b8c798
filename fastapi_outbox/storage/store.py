"""The outbox table on one engine, its storage split by job.

``Store`` holds one `Connector` (the asyncpg path
of the hot statements) and hands each job its own object, so a caller takes only the part
it uses:

* `Store.claims` (`Claims`): the relay's claims
  and marks;
* `Store.inserts` (`Inserts`): the unit of
  work's rows, the WAL relay's refused messages;
* `Store.messages` (`Messages`): operator reads
  and actions (counts, listings, one message, replay, abandon, cancel);
* `Store.retention` (`Retention`): retention's
  batched delete (the archive's move is `Archive`'s);
* the schema: `Store.create_table`, `Store.drop_table`.

Each job's SQL is in the module of `fastapi_outbox.storage.statements` named like it.
PostgreSQL and SQLite run the same statements; the differences are confined to
`fastapi_outbox.storage.clock` and `fastapi_outbox.storage.statements.parts`.
"""

from __future__ import annotations

from sqlalchemy import Table
from sqlalchemy.ext.asyncio import AsyncEngine

from fastapi_outbox.storage import schema
from fastapi_outbox.storage.claims import ClaimedRow, Claims, Failure
from fastapi_outbox.storage.connector import Connector
from fastapi_outbox.storage.inserts import Inserts
from fastapi_outbox.storage.messages import Messages
from fastapi_outbox.storage.read_models import BrokerStats
from fastapi_outbox.storage.retention import Retention
from fastapi_outbox.storage.statements import messages as messages_sql
from fastapi_outbox.storage.statements import notify as notify_sql
from fastapi_outbox.storage.statements.inserts import INSERT_KEYS
from fastapi_outbox.storage.statements.parts import (
    ABANDONED,
    ERROR_MAX_CHARS,
    FAILED,
    PENDING,
    PROCESSING,
    PUBLISHED,
)

__all__ = [
    "ABANDONED",
    "ERROR_MAX_CHARS",
    "FAILED",
    "INSERT_KEYS",
    "PENDING",
    "PROCESSING",
    "PUBLISHED",
    "BrokerStats",
    "ClaimedRow",
    "Failure",
    "Store",
]


class Store:
    """The outbox table on one engine: its connector, and one object per job."""

    def __init__(self, engine: AsyncEngine, table: Table) -> None:
        self.engine = engine
        self.table = table
        self.connector = Connector(engine)
        self.is_postgres = self.connector.is_postgres
        self.autocommit_engine = self.connector.autocommit_engine
        self.claims = Claims(self.connector, table)
        self.inserts = Inserts(self.connector, table)
        self.messages = Messages(self.connector, table)
        self.retention = Retention(self.connector, table)

    async def ping(self) -> None:
        """Raise if the database cannot be reached."""
        async with self.engine.connect() as conn:
            await conn.execute(messages_sql.ping())

    async def create_table(self) -> None:
        """Create the outbox table and its indexes (never any other table)."""
        await schema.create_table(self.engine, self.table)

    async def drop_table(self) -> None:
        await schema.drop_table(self.engine, self.table)

    async def notify(self, channel: str, payload: str) -> None:
        """``NOTIFY channel`` on a pooled connection, outside any business transaction."""
        async with self.autocommit_engine.connect() as conn:
            await conn.execute(notify_sql.notify(channel, payload))

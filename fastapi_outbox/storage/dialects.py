"""Which database a statement is for: the two questions the statement builders and the
connector ask of an engine, a connection or a dialect — which SQL to write
(`is_postgres`), and whether the driver's connection can run it directly
(`uses_asyncpg`). Imports nothing of the package, so every module of ``storage/``
may ask.
"""

from __future__ import annotations

from sqlalchemy.engine import Connection, Dialect
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

__all__ = ["is_postgres", "uses_asyncpg"]

_Bound = AsyncEngine | AsyncConnection | Connection | Dialect


def _dialect(bound: _Bound) -> Dialect:
    return bound if isinstance(bound, Dialect) else bound.dialect


def is_postgres(bound: _Bound) -> bool:
    """True on PostgreSQL (any driver): the statements use arrays, ``FOR UPDATE SKIP
    LOCKED``, ``seq`` and ``now()``; on SQLite an expanding IN, the rowid and ``'now'``."""
    return _dialect(bound).name == "postgresql"


def uses_asyncpg(bound: _Bound) -> bool:
    """True when the driver is asyncpg: the hot statements then run on its connection
    (see `fastapi_outbox.storage.connector`)."""
    return _dialect(bound).driver == "asyncpg"

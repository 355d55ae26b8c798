"""Which database a statement is for: the questions the statement builders and the
connector ask of an engine, a connection or a dialect — which SQL to write
(`is_postgres`, `is_mysql`, `flavor`), and whether the driver's
connection can run it directly (`uses_asyncpg`). Imports nothing of the package, so
every module of ``storage/`` may ask.

Three databases: PostgreSQL, SQLite and MySQL (MariaDB >= 10.6, MySQL 8; SQLAlchemy calls
both ``mysql``). The clock helpers (`clock`) take a
`Flavor`: a dialect name, or the older boolean (True: PostgreSQL, False: SQLite).
"""

from __future__ import annotations

from sqlalchemy.engine import Connection, Dialect
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

__all__ = [
    "MYSQL",
    "POSTGRESQL",
    "SQLITE",
    "Flavor",
    "flavor",
    "is_mysql",
    "is_postgres",
    "uses_asyncpg",
]

_Bound = AsyncEngine | AsyncConnection | Connection | Dialect

POSTGRESQL, SQLITE, MYSQL = "postgresql", "sqlite", "mysql"
#: A dialect name (``"postgresql"``, ``"sqlite"``, ``"mysql"``) or a boolean: True for
#: PostgreSQL, False for SQLite (what callers written for two databases pass).
Flavor = bool | str


def _dialect(bound: _Bound) -> Dialect:
    return bound if isinstance(bound, Dialect) else bound.dialect


def flavor(value: _Bound | Flavor) -> str:
    """The dialect name of ``value`` (an engine, connection, dialect, name or boolean);
    MariaDB is ``mysql``, as SQLAlchemy names it."""
    if value is True:
        return POSTGRESQL
    if value is False:
        return SQLITE
    if isinstance(value, str):
        return MYSQL if value == "mariadb" else value
    name = _dialect(value).name
    return MYSQL if name == "mariadb" else name


def is_postgres(bound: _Bound) -> bool:
    """True on PostgreSQL (any driver): the statements use arrays, ``FOR UPDATE SKIP
    LOCKED``, ``seq`` and ``now()``; on SQLite an expanding IN, the rowid and ``'now'``."""
    return _dialect(bound).name == POSTGRESQL


def is_mysql(bound: _Bound | Flavor) -> bool:
    """True on MariaDB and MySQL (any driver): ``FOR UPDATE SKIP LOCKED`` as on PostgreSQL,
    but no ``UPDATE … RETURNING``, no LISTEN/NOTIFY, no partial index, ``UTC_TIMESTAMP(6)``
    for the clock and an ``AUTO_INCREMENT`` ``seq`` for insert order."""
    return flavor(bound) == MYSQL


def uses_asyncpg(bound: _Bound) -> bool:
    """True when the driver is asyncpg: the hot statements then run on its connection
    (see `fastapi_outbox.storage.connector`)."""
    return _dialect(bound).driver == "asyncpg"

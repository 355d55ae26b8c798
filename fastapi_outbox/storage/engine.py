"""The engine factory and the dialect checks every statement builder asks.

:func:`create_engine` turns the database URL given to ``Outbox(...)`` into an
:class:`~sqlalchemy.ext.asyncio.AsyncEngine` with the project's defaults (SQLite: WAL, a busy
timeout and ``BEGIN IMMEDIATE``, so the embedded default copes with a dispatcher and
requests writing at once; PostgreSQL: a pool sized for the relays and the requests).
:func:`is_postgres` and :func:`uses_asyncpg` are the two questions the statements and the
connector ask of an engine or a connection: which SQL to write, and whether the driver's
connection can run it directly.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Connection, Dialect
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.pool import StaticPool

from fastapi_outbox import exceptions
from fastapi_outbox.redaction import redact, redact_url, remember

__all__ = [
    "POOL_MAX_OVERFLOW",
    "POOL_SIZE",
    "SQLITE_BUSY_TIMEOUT_MS",
    "SQLITE_CONNECT_TIMEOUT_SECONDS",
    "create_engine",
    "engine_defaults",
    "is_postgres",
    "uses_asyncpg",
]

#: PostgreSQL pool defaults (``engine_options`` overrides them).
POOL_SIZE = 10
POOL_MAX_OVERFLOW = 20
#: SQLite: how long a writer waits for the write lock (the driver's, then SQLite's own).
SQLITE_CONNECT_TIMEOUT_SECONDS = 30
SQLITE_BUSY_TIMEOUT_MS = 30_000

_Bound = AsyncEngine | AsyncConnection | Connection | Dialect


def _dialect(bound: _Bound) -> Dialect:
    return bound if isinstance(bound, Dialect) else bound.dialect


def is_postgres(bound: _Bound) -> bool:
    """True on PostgreSQL (any driver): the statements use arrays, ``FOR UPDATE SKIP
    LOCKED``, ``seq`` and ``now()``; on SQLite an expanding IN, the rowid and ``'now'``."""
    return _dialect(bound).name == "postgresql"


def uses_asyncpg(bound: _Bound) -> bool:
    """True when the driver is asyncpg: the hot statements then run on its connection
    (see :mod:`fastapi_outbox.storage.connector`)."""
    return _dialect(bound).driver == "asyncpg"


def create_engine(url: str, options: dict[str, Any]) -> AsyncEngine:
    """An engine for ``url``; SQLite gets WAL, a busy timeout and BEGIN IMMEDIATE so the
    embedded default copes with a dispatcher and requests writing at the same time."""
    remember(url)
    try:
        engine = create_async_engine(url, **engine_defaults(url, options))
    except Exception as exc:
        # `from None`: the chained exception may quote the URL with its password.
        raise exceptions.ConfigurationError(
            f"cannot create an engine for {redact_url(url)}: {redact(str(exc))}"
        ) from None
    if engine.dialect.name == "sqlite":
        _tune_sqlite(engine)
    return engine


def _tune_sqlite(engine: AsyncEngine) -> None:
    """Every new SQLite connection: WAL (file databases; readers never block the writer),
    ``synchronous=NORMAL`` (durable at checkpoints, safe with WAL), a busy timeout (a
    writer waits for the lock instead of failing), foreign keys on; and every transaction
    begins IMMEDIATE, taking the write lock at BEGIN so two writers never deadlock on an
    upgrade from a read lock."""
    sync_engine = engine.sync_engine

    @event.listens_for(sync_engine, "connect")
    def _on_connect(dbapi_connection: Any, record: Any) -> None:
        dbapi_connection.isolation_level = None  # we issue BEGIN ourselves
        cursor = dbapi_connection.cursor()
        if engine.url.database not in (None, "", ":memory:"):
            cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(sync_engine, "begin")
    def _on_begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")


def engine_defaults(url: str, options: dict[str, Any]) -> dict[str, Any]:
    """``create_async_engine`` keywords: ``options`` with the project's defaults filled in."""
    opts = dict(options)
    if url.startswith("sqlite"):
        if url.rstrip("/").endswith(":memory:") or url.rstrip("/") in (
            "sqlite+aiosqlite:",
            "sqlite+aiosqlite://",
        ):
            # One connection for the whole process: each new one would be a new database.
            opts.setdefault("poolclass", StaticPool)
        opts.setdefault("connect_args", {"timeout": SQLITE_CONNECT_TIMEOUT_SECONDS})
    else:
        # No pool_pre_ping by default: on asyncpg it costs three round trips per checkout
        # (more than the business statement); pass engine_options={"pool_pre_ping": True}
        # where connections die silently (e.g. idle timeouts of a proxy).
        opts.setdefault("pool_size", POOL_SIZE)
        opts.setdefault("max_overflow", POOL_MAX_OVERFLOW)
    return opts

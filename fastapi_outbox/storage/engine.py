"""The engine factory and the dialect checks every statement builder asks.

`create_engine` turns the database URL given to ``Outbox(...)`` into an
`AsyncEngine` with the project's defaults (SQLite: WAL, a busy
timeout and ``BEGIN IMMEDIATE``, so the embedded default copes with a relay and
requests writing at once; PostgreSQL: a pool sized for the relays and the requests;
MariaDB/MySQL: the same pool, READ COMMITTED as PostgreSQL's default, a connect timeout).
`is_postgres` and `uses_asyncpg` (re-exported from
`dialects`) are the two questions the statements and the
connector ask of an engine or a connection.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import StaticPool

from fastapi_outbox import exceptions
from fastapi_outbox.redaction import redact, redact_url, remember
from fastapi_outbox.settings import check_database_url
from fastapi_outbox.storage.dialects import is_postgres as is_postgres
from fastapi_outbox.storage.dialects import uses_asyncpg as uses_asyncpg
from fastapi_outbox.storage.statements import session as session_sql

__all__ = [
    "MYSQL_ISOLATION",
    "MYSQL_POOL_RECYCLE_SECONDS",
    "PG_CONNECT_TIMEOUT_SECONDS",
    "PG_KEEPALIVE_IDLE_SECONDS",
    "PG_KEEPALIVE_INTERVAL_SECONDS",
    "PG_KEEPALIVE_PROBES",
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
#: PostgreSQL: longest wait for a new connection to be ready (TCP, TLS, authentication;
#: asyncpg waits 60 s by default, libpq forever): a server that accepts connections and
#: never answers (frozen, its listen backlog still filled by the kernel) is an outage
#: seen within this. ``engine_options={"connect_args": {"timeout": …}}`` (asyncpg) or
#: ``{"connect_timeout": …}`` (psycopg) overrides it.
PG_CONNECT_TIMEOUT_SECONDS = 10.0
#: PostgreSQL: TCP keep-alive of every connection (neither asyncpg nor libpq turn it on by
#: themselves for asyncpg; libpq's idle default is the kernel's two hours): probes after 5 s
#: idle, every 2 s, 3 lost = dead, so a server host gone or a network cut without a reset
#: is found by the kernel in ~11 s even on an idle pooled connection. A frozen server
#: process is not (its kernel answers the probes): the statements' client-side timeout
#: (``db_statement_timeout_seconds``) bounds those.
PG_KEEPALIVE_IDLE_SECONDS, PG_KEEPALIVE_INTERVAL_SECONDS, PG_KEEPALIVE_PROBES = 5, 2, 3
#: MariaDB/MySQL: the engine's isolation level. InnoDB's default, REPEATABLE READ, takes
#: gap locks in locking reads: a claim's ``FOR UPDATE SKIP LOCKED`` range would then block
#: producers inserting new due rows into it. READ COMMITTED (PostgreSQL's default) locks
#: the rows read only. ``engine_options={"isolation_level": …}`` overrides it.
MYSQL_ISOLATION = "READ COMMITTED"
#: MariaDB/MySQL: a pooled connection is replaced after this long (the server closes idle
#: ones after ``wait_timeout``, 8 h by default, and the next statement would fail).
MYSQL_POOL_RECYCLE_SECONDS = 3600


def create_engine(url: str, options: dict[str, Any]) -> AsyncEngine:
    """An engine for ``url``; SQLite gets WAL, a busy timeout and BEGIN IMMEDIATE so the
    embedded default copes with a relay and requests writing at the same time."""
    remember(url)
    check_database_url(url)
    try:
        engine = create_async_engine(url, **engine_defaults(url, options))
    except Exception as exc:
        # `from None`: the chained exception may quote the URL with its password.
        raise exceptions.ConfigurationError(
            f"cannot create an engine for {redact_url(url)}: {redact(str(exc))}"
        ) from None
    if engine.dialect.name == "sqlite":
        _tune_sqlite(engine)
    elif engine.dialect.driver == "asyncpg":
        _keepalive_asyncpg(engine)
    return engine


def _keepalive_options() -> list[tuple[int, int, int]]:
    """``setsockopt`` arguments of the TCP keep-alive policy (those the platform has)."""
    import socket

    wanted = {
        "TCP_KEEPIDLE": PG_KEEPALIVE_IDLE_SECONDS,
        "TCP_KEEPINTVL": PG_KEEPALIVE_INTERVAL_SECONDS,
        "TCP_KEEPCNT": PG_KEEPALIVE_PROBES,
    }
    options = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    options += [
        (socket.IPPROTO_TCP, getattr(socket, n), v) for n, v in wanted.items() if hasattr(socket, n)
    ]
    return options


def _keepalive_asyncpg(engine: AsyncEngine) -> None:
    """TCP keep-alive on the socket of every new asyncpg connection (asyncpg has no
    option for it); a Unix socket has none."""
    import socket

    options = _keepalive_options()

    @event.listens_for(engine.sync_engine, "connect")
    def _on_connect(dbapi_connection: Any, record: Any) -> None:
        transport = getattr(getattr(dbapi_connection, "_connection", None), "_transport", None)
        sock = transport.get_extra_info("socket") if transport is not None else None
        if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
            return
        for level, name, value in options:
            sock.setsockopt(level, name, value)


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
        file_database = engine.url.database not in (None, "", ":memory:")
        for pragma in session_sql.sqlite_pragmas(SQLITE_BUSY_TIMEOUT_MS, wal=file_database):
            cursor.execute(pragma)
        cursor.close()

    @event.listens_for(sync_engine, "begin")
    def _on_begin(conn: Any) -> None:
        if conn.get_execution_options().get("isolation_level") == "AUTOCOMMIT":
            # Each statement commits on its own (``db upgrade``): a BEGIN here would open
            # a transaction that SQLAlchemy never commits, and the change would be lost.
            return
        conn.exec_driver_sql(session_sql.BEGIN_IMMEDIATE)


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
        driver = url.split("://", 1)[0].partition("+")[2]
        if url.startswith(("mysql", "mariadb")):
            opts.setdefault("isolation_level", MYSQL_ISOLATION)
            opts.setdefault("pool_recycle", MYSQL_POOL_RECYCLE_SECONDS)
            opts["connect_args"] = {
                "connect_timeout": int(PG_CONNECT_TIMEOUT_SECONDS),
                **opts.get("connect_args", {}),
            }
        elif driver == "asyncpg":
            opts["connect_args"] = {
                "timeout": PG_CONNECT_TIMEOUT_SECONDS,
                **opts.get("connect_args", {}),
            }
        elif driver.startswith("psycopg"):
            opts["connect_args"] = {
                "connect_timeout": int(PG_CONNECT_TIMEOUT_SECONDS),
                "keepalives": 1,
                "keepalives_idle": PG_KEEPALIVE_IDLE_SECONDS,
                "keepalives_interval": PG_KEEPALIVE_INTERVAL_SECONDS,
                "keepalives_count": PG_KEEPALIVE_PROBES,
                **opts.get("connect_args", {}),
            }
    return opts

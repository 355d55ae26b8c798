"""The database outage classifier (:mod:`fastapi_outbox.storage.db_outage`): which exceptions mean
"the database is unavailable" (the message waits, no attempt charged), which are a failure
of the statement (charged), and which a ping must decide. No I/O."""

from __future__ import annotations

import sqlite3
from types import SimpleNamespace
from typing import Any

import asyncpg
import pytest
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects.postgresql.asyncpg import AsyncAdapt_asyncpg_dbapi

from fastapi_outbox.storage.db_outage import (
    Verdict,
    classify,
    classify_postgresql,
    classify_sqlite,
    describe,
    is_outage,
    sqlstate_of,
)

OUTAGE, FAILURE, UNKNOWN = Verdict.OUTAGE, Verdict.FAILURE, Verdict.UNKNOWN
AUTHENTICATION, TABLE_MISSING = Verdict.AUTHENTICATION, Verdict.TABLE_MISSING


def pg(error: asyncpg.PostgresError | asyncpg.InterfaceError, **kw: Any) -> sa_exc.DBAPIError:
    """``error`` as SQLAlchemy's asyncpg dialect raises it: a ``DBAPIError`` around the
    adapted DB-API error (which copies the SQLSTATE)."""
    adapted = AsyncAdapt_asyncpg_dbapi.Error(str(error), error)
    return sa_exc.DBAPIError("SELECT 1", None, adapted, **kw)


def lite(code: int, message: str, cls: type[sqlite3.Error] = sqlite3.OperationalError) -> Any:
    """A ``sqlite3`` error with its result code, wrapped as SQLAlchemy does."""
    error = cls(message)
    error.sqlite_errorcode = code  # type: ignore[attr-defined]
    error.sqlite_errorname = "?"  # type: ignore[attr-defined]
    wrapper = sa_exc.IntegrityError if cls is sqlite3.IntegrityError else sa_exc.OperationalError
    return wrapper("INSERT …", None, error)


def real_sqlite_error(statement: str) -> sa_exc.DBAPIError:
    """The error an in-memory SQLite really raises for ``statement``."""
    conn = sqlite3.connect(":memory:")
    try:
        conn.execute("CREATE TABLE t (id INTEGER PRIMARY KEY)")
        conn.execute("INSERT INTO t VALUES (1)")
        conn.execute(statement)
    except sqlite3.Error as error:
        wrapper = (
            sa_exc.IntegrityError
            if isinstance(error, sqlite3.IntegrityError)
            else sa_exc.OperationalError
        )
        return wrapper(statement, None, error)
    finally:
        conn.close()
    raise AssertionError(f"{statement!r} did not fail")


PG_CASES: list[tuple[str, BaseException, Verdict]] = [
    # The database refuses connections: every message waits.
    ("57P03 starting up", pg(asyncpg.CannotConnectNowError("starting up")), OUTAGE),
    ("57P03 raw asyncpg", asyncpg.CannotConnectNowError("shutting down"), OUTAGE),
    ("57P01 admin shutdown", pg(asyncpg.AdminShutdownError("terminating")), OUTAGE),
    ("57P02 crash shutdown", pg(asyncpg.CrashShutdownError("crash")), OUTAGE),
    ("57P05 idle session", pg(asyncpg.exceptions.IdleSessionTimeoutError("idle")), OUTAGE),
    ("53300 too many clients", pg(asyncpg.TooManyConnectionsError("too many")), OUTAGE),
    ("53100 disk full", pg(asyncpg.DiskFullError("no space")), OUTAGE),
    ("08003 closed mid-operation", pg(asyncpg.ConnectionDoesNotExistError("closed")), OUTAGE),
    ("08006 raw", asyncpg.ConnectionFailureError("failure"), OUTAGE),
    ("08000", pg(asyncpg.PostgresConnectionError("connection")), OUTAGE),
    ("25006 read-only standby", pg(asyncpg.ReadOnlySQLTransactionError("read-only")), OUTAGE),
    ("28P01 bad password", pg(asyncpg.InvalidPasswordError("password")), AUTHENTICATION),
    (
        "28000 refused by pg_hba",
        pg(asyncpg.InvalidAuthorizationSpecificationError("no pg_hba.conf entry")),
        AUTHENTICATION,
    ),
    ("3D000 no database", pg(asyncpg.InvalidCatalogNameError("no db")), OUTAGE),
    ("58030 I/O error", pg(asyncpg.exceptions.PostgresIOError("io")), OUTAGE),
    ("pool timeout", sa_exc.TimeoutError("QueuePool limit of size 5 reached"), OUTAGE),
    ("disconnection", sa_exc.DisconnectionError("dead"), OUTAGE),
    (
        "invalidated connection",
        pg(asyncpg.InterfaceError("connection is closed"), connection_invalidated=True),
        OUTAGE,
    ),
    # The handler's own SQL: charged.
    ("42P01 undefined table", pg(asyncpg.UndefinedTableError("no table")), TABLE_MISSING),
    ("42601 syntax", pg(asyncpg.PostgresSyntaxError("syntax")), FAILURE),
    ("42501 privilege", pg(asyncpg.InsufficientPrivilegeError("denied")), FAILURE),
    ("23505 unique", pg(asyncpg.UniqueViolationError("dup")), FAILURE),
    ("22P02 bad input", pg(asyncpg.InvalidTextRepresentationError("bad")), FAILURE),
    ("40P01 deadlock", pg(asyncpg.DeadlockDetectedError("deadlock")), FAILURE),
    ("40001 serialization", pg(asyncpg.SerializationError("serialize")), FAILURE),
    ("57014 statement timeout", pg(asyncpg.QueryCanceledError("timeout")), FAILURE),
    ("55P03 lock not available", pg(asyncpg.LockNotAvailableError("lock")), FAILURE),
    ("53200 out of memory", pg(asyncpg.OutOfMemoryError("oom")), FAILURE),
    ("08P01 protocol violation", pg(asyncpg.ProtocolViolationError("bind")), FAILURE),
    ("XX000 internal", pg(asyncpg.InternalServerError("internal")), FAILURE),
    ("handler's own error", RuntimeError("boom"), FAILURE),
    ("validation", ValueError("bad"), FAILURE),
    ("pending rollback", sa_exc.PendingRollbackError("rollback first"), FAILURE),
    ("client configuration", asyncpg.exceptions.ClientConfigurationError("ssl"), FAILURE),
    # Ours or the handler's: the ping decides.
    ("connection refused", ConnectionRefusedError(111, "refused"), UNKNOWN),
    ("connect timeout", TimeoutError(), UNKNOWN),
    ("raw interface error", asyncpg.InterfaceError("connection is closed"), UNKNOWN),
    (
        "interface error, connection open",
        sa_exc.InterfaceError("SELECT 1", None, Exception("another operation")),
        UNKNOWN,
    ),
]


@pytest.mark.parametrize(("case", "exc", "verdict"), PG_CASES, ids=[c[0] for c in PG_CASES])
def test_postgresql_verdicts(case: str, exc: BaseException, verdict: Verdict) -> None:
    assert classify_postgresql(exc) is verdict
    assert classify(exc, "postgresql") is verdict


SQLITE_CASES: list[tuple[str, BaseException, Verdict]] = [
    ("unable to open", lite(sqlite3.SQLITE_CANTOPEN, "unable to open database file"), OUTAGE),
    ("disk I/O error", lite(sqlite3.SQLITE_IOERR, "disk I/O error"), OUTAGE),
    ("I/O error, extended code", lite(sqlite3.SQLITE_IOERR | (3 << 8), "disk I/O error"), OUTAGE),
    ("database is locked", lite(sqlite3.SQLITE_BUSY, "database is locked"), OUTAGE),
    ("disk full", lite(sqlite3.SQLITE_FULL, "database or disk is full"), OUTAGE),
    ("read-only file", lite(sqlite3.SQLITE_READONLY, "attempt to write a readonly db"), OUTAGE),
    ("pool timeout", sa_exc.TimeoutError("QueuePool limit"), OUTAGE),
    ("no such table", real_sqlite_error("SELECT * FROM missing"), TABLE_MISSING),
    ("syntax error", real_sqlite_error("SELEC 1"), FAILURE),
    ("no such column", real_sqlite_error("SELECT nope FROM t"), FAILURE),
    ("constraint", real_sqlite_error("INSERT INTO t VALUES (1)"), FAILURE),
    ("table locked", lite(sqlite3.SQLITE_LOCKED, "database table is locked"), FAILURE),
    ("corrupt", lite(sqlite3.SQLITE_CORRUPT, "database disk image is malformed"), FAILURE),
    ("handler's own error", KeyError("x"), FAILURE),
    ("connection refused", ConnectionRefusedError(111, "refused"), UNKNOWN),
]


@pytest.mark.parametrize(("case", "exc", "verdict"), SQLITE_CASES, ids=[c[0] for c in SQLITE_CASES])
def test_sqlite_verdicts(case: str, exc: BaseException, verdict: Verdict) -> None:
    assert classify_sqlite(exc) is verdict
    assert classify(exc, "sqlite") is verdict


def test_a_real_no_such_table_is_sqlite_error_not_text() -> None:
    """The verdict reads SQLite's result code, not the message."""
    exc = real_sqlite_error("SELECT * FROM missing")
    assert exc.orig.sqlite_errorcode == sqlite3.SQLITE_ERROR  # type: ignore[union-attr]


def test_exception_groups() -> None:
    outage = pg(asyncpg.CannotConnectNowError("starting up"))
    failure = pg(asyncpg.PostgresSyntaxError("syntax"))
    refused = pg(asyncpg.InvalidPasswordError("password"))
    assert classify_postgresql(ExceptionGroup("g", [outage, outage])) is OUTAGE
    assert classify_postgresql(ExceptionGroup("g", [outage, refused])) is AUTHENTICATION
    assert classify_postgresql(ExceptionGroup("g", [outage, failure])) is FAILURE
    assert classify_postgresql(ExceptionGroup("g", [outage, OSError()])) is UNKNOWN


def test_sqlstate_of_drivers() -> None:
    assert sqlstate_of(asyncpg.CannotConnectNowError("x")) == "57P03"
    assert sqlstate_of(pg(asyncpg.TooManyConnectionsError("x"))) == "53300"
    psycopg2_style = sa_exc.OperationalError("SELECT 1", None, Exception("x"))
    psycopg2_style.orig.pgcode = "57p01"  # type: ignore[union-attr]
    assert sqlstate_of(psycopg2_style) == "57P01"
    assert classify_postgresql(psycopg2_style) is OUTAGE
    assert sqlstate_of(RuntimeError()) is None


class _Conn:
    def __init__(self, up: bool) -> None:
        self.up = up

    async def __aenter__(self) -> _Conn:
        if not self.up:
            raise ConnectionRefusedError(111, "refused")
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def exec_driver_sql(self, statement: str) -> None:
        assert statement == "SELECT 1"


class _Engine:
    """Stands for an ``AsyncEngine``: ``connect()`` and the dialect's name."""

    def __init__(self, up: bool, dialect: str = "postgresql") -> None:
        self.up = up
        self.pings = 0
        self.dialect = SimpleNamespace(name=dialect)

    def connect(self) -> _Conn:
        self.pings += 1
        return _Conn(self.up)


@pytest.mark.anyio
async def test_the_ping_decides_only_what_is_ambiguous() -> None:
    down, up = _Engine(up=False), _Engine(up=True)
    refused = ConnectionRefusedError(111, "refused")
    assert await is_outage(refused, down) is True  # our database does not answer
    assert await is_outage(refused, up) is False  # it answers: the handler's own socket
    starting = pg(asyncpg.CannotConnectNowError("starting up"))
    assert await is_outage(starting, up) is True  # certain: no ping, even if it answers now
    assert await is_outage(pg(asyncpg.UndefinedTableError("x")), down) is False
    assert up.pings == 1 and down.pings == 1
    sqlite_down = _Engine(up=True, dialect="sqlite")
    assert await is_outage(lite(sqlite3.SQLITE_CANTOPEN, "unable to open"), sqlite_down)
    assert not await is_outage(real_sqlite_error("SELECT * FROM missing"), sqlite_down)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("dialect", "exc", "code"),
    [
        ("postgresql", pg(asyncpg.CannotConnectNowError("starting up")), 3),
        ("postgresql", pg(asyncpg.TooManyConnectionsError("too many")), 3),
        ("postgresql", ConnectionRefusedError(111, "refused"), 3),
        ("postgresql", sa_exc.TimeoutError("QueuePool limit"), 3),
        ("postgresql", pg(asyncpg.UndefinedTableError("no table")), 1),
        ("postgresql", pg(asyncpg.PostgresSyntaxError("syntax")), None),
        ("sqlite", lite(sqlite3.SQLITE_CANTOPEN, "unable to open database file"), 3),
        ("sqlite", real_sqlite_error("SELECT * FROM missing"), 1),
        ("sqlite", real_sqlite_error("SELEC 1"), None),
    ],
)
async def test_the_cli_exit_codes_follow_the_classifier(
    dialect: str, exc: BaseException, code: int | None
) -> None:
    """``fastapi-outbox`` exits 3 when the database is unavailable (or the connection's
    socket failed), 1 on a missing table; any other statement error is raised."""
    from fastapi_outbox.cli.support import CliError, guard

    outbox = SimpleNamespace(
        engine=SimpleNamespace(
            url=f"{dialect}://u:secret@h/db", dialect=SimpleNamespace(name=dialect)
        ),
        table=SimpleNamespace(name="outbox_messages"),
    )

    async def failing() -> None:
        raise exc

    if code is None:
        with pytest.raises(type(exc)):
            await guard(failing(), outbox)
        return
    with pytest.raises(CliError) as info:
        await guard(failing(), outbox)
    assert info.value.code == code
    assert "secret" not in str(info.value)


def test_describe_names_the_cause_and_the_fix_not_an_outage() -> None:
    missing = describe(pg(asyncpg.UndefinedTableError("no table")), "postgresql")
    assert missing == "table missing: run `fastapi-outbox db create` or `outbox.create_tables()`"
    assert describe(real_sqlite_error("SELECT * FROM missing"), "sqlite") == missing
    refused = describe(pg(asyncpg.InvalidPasswordError("password")), "postgresql")
    assert refused.startswith("database authentication failed") and "password" in refused
    down = describe(pg(asyncpg.CannotConnectNowError("starting up")), "postgresql")
    assert down.startswith("database unreachable")
    assert "unreachable" not in missing + refused

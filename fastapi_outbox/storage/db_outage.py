"""Is the database unavailable, or did the statement fail? One classifier per dialect.

"The database is unavailable" — connection refused, starting up, shutting down, too many
clients, pool timeout — is decided here and nowhere else, so the subscribers, the relays and
the CLI never disagree about it. The subscribers wait in place on it with no attempt
charged, the relays back off as a whole and report the database down, the CLI exits with
code 3. Everything else — a handler's own SQL error (no
such table, syntax, constraint, deadlock, statement timeout) — is a failure: charged to the
message, retried with backoff, dead-lettered after ``max_attempts``.

Three verdicts (`Verdict`): ``OUTAGE`` and ``FAILURE`` are certain from the exception
alone; ``UNKNOWN`` is an error that may be the database's or the handler's own — an
``OSError`` (the driver's socket refused at connect, or a partner API's), a driver error
without SQLSTATE — and `is_outage` asks the database (``SELECT 1``, bounded) to decide:
no answer, an outage; an answer, the handler's failure. Two more name a cause an operator
must fix, so that nobody is told "unreachable" about a database that answers:
``AUTHENTICATION`` (an outage: nothing is charged, the loops keep trying since a rotated
secret may come back, and every report says "authentication failed") and
``TABLE_MISSING`` (a failure: the statement's table does not exist; the relays, health and
the CLI say "table missing" and how to create it).

**Every dialect** (SQLAlchemy's own view, before the driver's error is looked at):

* ``sqlalchemy.exc.TimeoutError`` (no pooled connection within ``pool_timeout``) and
  ``DisconnectionError``: outage;
* a ``DBAPIError`` with ``connection_invalidated`` (SQLAlchemy's dialect saw a disconnect):
  outage;
* an ``OSError`` (``ConnectionRefusedError``, ``TimeoutError``, ``socket.gaierror``…: asyncpg
  raises the socket's own at connect, unwrapped): unknown, the ping decides;
* an ``ExceptionGroup``: an outage if every member is one, a failure if any member is one.

**PostgreSQL** (`classify_postgresql`), by SQLSTATE (asyncpg's exception classes carry
theirs: ``CannotConnectNowError`` 57P03, ``TooManyConnectionsError`` 53300,
``ConnectionDoesNotExistError`` 08003, ``PostgresConnectionError`` 08000…):

* outage — class ``08`` connection exception, except ``08P01`` (protocol violation: the
  server also answers it to a malformed bind message, a client bug that would recur forever);
  ``57P01`` admin shutdown (fast shutdown, ``pg_terminate_backend``), ``57P02`` crash
  shutdown, ``57P03`` cannot connect now (starting up, shutting down, in recovery),
  ``57P04`` database dropped, ``57P05`` idle session timeout (the server closed the session);
  ``53300`` too many connections and ``53400`` configuration limit exceeded (server-wide
  limits on sessions and workers, not the statement's); ``53100`` disk full (no write of any
  message can succeed until an operator frees space: dead-lettering the backlog for it
  would be wrong); ``25006`` read-only transaction (after a failover the connection lands on
  a standby, or the operator set ``default_transaction_read_only``: every message's inbox
  row fails the same way, so it is the database's state, not the message's); ``3D000``
  unknown database at connect (a database renamed: no message can be handled, none is at
  fault); ``58000`` / ``58030``
  system and I/O error (the server's disk, not the statement);
* authentication — class ``28`` (``28P01`` invalid password, ``28000`` invalid
  authorization: a wrong or rotated password, a user pg_hba.conf refuses);
* table missing — ``42P01`` undefined table;
* failure — everything else with a SQLSTATE: syntax and access (``42…``: ``42501``
  insufficient privilege), integrity (``23…``), data (``22…``),
  ``40001`` serialization failure and ``40P01`` deadlock (contention a retry with backoff
  usually cures; charged, so a message that always deadlocks ends in the dead letters),
  ``57014`` query canceled (a statement timeout: a query that always times out must not
  wait forever), ``55P03`` lock not available, ``53200`` out of memory (one query's
  allocation, it would recur), ``XX…`` internal errors and corruption;
* unknown — a driver error without SQLSTATE (asyncpg's ``InterfaceError`` with the
  connection still open, psycopg's ``OperationalError`` at connect).

**SQLite** (`classify_sqlite`), by the primary result code Python's ``sqlite3`` puts on
its exceptions (``sqlite_errorcode``; never the message text):

* outage — ``SQLITE_CANTOPEN`` "unable to open database file" (the file or its directory
  gone, a volume unmounted, permissions), ``SQLITE_IOERR`` "disk I/O error", ``SQLITE_FULL``
  "database or disk is full", ``SQLITE_READONLY`` "attempt to write a readonly database"
  (the file made read-only), ``SQLITE_BUSY`` "database is locked" (another connection or
  process held the write lock past the busy timeout — a backup, a migration, a long
  writer; the message is not at fault, its turn comes), ``SQLITE_PROTOCOL`` (the file
  system's locking failed);
* table missing — ``SQLITE_ERROR`` whose text is "no such table: …" (SQLite gives a missing
  table no code of its own: ``SQLITE_ERROR`` is also every syntax error, so here alone the
  text decides);
* failure — ``SQLITE_ERROR`` ("no such column", syntax errors),
  ``SQLITE_CONSTRAINT``, ``SQLITE_MISMATCH``, ``SQLITE_TOOBIG``, ``SQLITE_LOCKED``
  "database table is locked" (a conflict inside the handler's own connection),
  ``SQLITE_CORRUPT`` / ``SQLITE_NOTADB`` (a damaged file: visible and replayable dead
  letters rather than a wait that would never end), and any other code;
* unknown — an ``sqlite3`` error without a result code.

**MariaDB and MySQL** (`classify_mysql`), by the server's error number (asyncmy
and aiomysql put it first in the exception's ``args``; never the message text):

* outage — ``2002`` / ``2003`` cannot connect (socket, TCP), ``2006`` server has gone away,
  ``2013`` lost connection during a query, ``1053`` server shutdown in progress, ``1927``
  connection killed (MariaDB), ``4031`` disconnected by the server for inactivity (MySQL),
  ``1040`` too many connections, ``1049`` unknown database (at connect), ``1021`` disk
  full, ``1290`` / ``1836`` / ``1792`` read-only (``--read-only``, a replica after a
  failover: the database's state, not the message's);
* contention — ``1213`` deadlock and ``1205`` lock wait timeout: InnoDB rolled the
  statement (or the transaction) back in favour of another; a retry cures it. Unlike
  PostgreSQL's ``40P01`` (charged), retried without spending an attempt: InnoDB picks its
  victims by the size of their transactions, and row locks on secondary indexes make
  deadlocks between unrelated messages common enough that charging them would dead-letter
  innocent messages;
* authentication — ``1045`` access denied (wrong password), ``1044`` (no access to the
  database), ``1698`` (a user the server does not let in with a password);
* table missing — ``1146`` table does not exist;
* failure — every other error number (syntax ``1064``, duplicate key ``1062``, data too long
  ``1406``…);
* unknown — a driver error without a number (an ``InterfaceError``).

Limit: a handler that talks to a *second* PostgreSQL through SQLAlchemy and gets one of the
outage SQLSTATEs from it is taken for an outage of the outbox's database too: its message
waits in place (uncharged) until that database is back.
"""

from __future__ import annotations

import enum
from typing import Any

import anyio

from fastapi_outbox.storage.statements import session as session_sql

__all__ = [
    "AUTHENTICATION_FIX",
    "PING_SECONDS",
    "TABLE_MISSING_FIX",
    "Verdict",
    "classify",
    "classify_mysql",
    "classify_postgresql",
    "classify_sqlite",
    "database_answers",
    "describe",
    "is_outage",
    "sqlstate_of",
]

#: Longest wait for the database's answer to ``SELECT 1`` when an error is ambiguous.
PING_SECONDS = 5.0


class Verdict(enum.Enum):
    """What an exception says about the database."""

    #: The database is unavailable: the message waits, no attempt is charged.
    OUTAGE = "outage"
    #: The statement's (the handler's) own error: charged, retried, dead-lettered.
    FAILURE = "failure"
    #: Either: the database's answer to a ping decides (`is_outage`).
    UNKNOWN = "unknown"
    #: The database refuses the credentials: an outage (nothing charged) with its cause.
    AUTHENTICATION = "authentication"
    #: The statement's table does not exist: a failure with its cause.
    TABLE_MISSING = "table_missing"
    #: A deadlock or lock wait timeout (MySQL): retried, nothing charged; the database is
    #: up (`is_outage` counts it so that the message waits uncharged).
    CONTENTION = "contention"


#: What an operator is told, per verdict that names a cause.
TABLE_MISSING_FIX = "run `fastapi-outbox db create` or `outbox.create_tables()`"
AUTHENTICATION_FIX = "check the user and password of the database URL"


def describe(exc: BaseException, dialect: str) -> str:
    """What a failed database step means, in the words health, the relays and the CLI
    use: "authentication failed", "table missing" (with its fix), "unavailable" or
    "statement failed". No driver text: it may quote a host or a user name."""
    verdict = classify(exc, dialect)
    if verdict is Verdict.AUTHENTICATION:
        return f"database authentication failed ({type(exc).__name__}): {AUTHENTICATION_FIX}"
    if verdict is Verdict.TABLE_MISSING:
        return f"table missing: {TABLE_MISSING_FIX}"
    if verdict is Verdict.CONTENTION:
        return f"database busy: deadlock or lock wait timeout ({type(exc).__name__}); retried"
    if verdict is Verdict.FAILURE:
        return f"database statement failed ({type(exc).__name__})"
    return f"database unreachable ({type(exc).__name__})"


#: SQLSTATEs of an unavailable PostgreSQL (see the module docstring for why each).
_PG_OUTAGE_STATES = frozenset(
    {
        "57P01",  # admin_shutdown
        "57P02",  # crash_shutdown
        "57P03",  # cannot_connect_now: starting up, shutting down, in recovery
        "57P04",  # database_dropped
        "57P05",  # idle_session_timeout
        "53100",  # disk_full
        "53300",  # too_many_connections
        "53400",  # configuration_limit_exceeded
        "25006",  # read_only_sql_transaction: a standby after a failover
        "3D000",  # invalid_catalog_name: the database is gone (at connect)
        "58000",  # system_error
        "58030",  # io_error
    }
)
#: SQLSTATE classes of an unavailable PostgreSQL: connection exception.
_PG_OUTAGE_CLASSES = ("08",)
#: SQLSTATE class of refused credentials (``28P01`` invalid password, ``28000``).
_PG_AUTHENTICATION_CLASS = "28"
_PG_UNDEFINED_TABLE = "42P01"
_SQLITE_ERROR = 1
_SQLITE_NO_SUCH_TABLE = "no such table"
#: Connection-class SQLSTATEs that are a client's bug rather than an outage.
_PG_FAILURE_STATES = frozenset({"08P01"})  # protocol_violation

#: SQLite primary result codes of an unavailable database (``sqlite3.SQLITE_*``).
_SQLITE_OUTAGE_CODES = frozenset(
    {
        5,  # SQLITE_BUSY: "database is locked"
        8,  # SQLITE_READONLY
        10,  # SQLITE_IOERR: "disk I/O error"
        13,  # SQLITE_FULL
        14,  # SQLITE_CANTOPEN: "unable to open database file"
        15,  # SQLITE_PROTOCOL: a file-locking protocol failure
    }
)


#: MySQL error numbers of an unavailable server (see the module docstring for why each).
_MYSQL_OUTAGE_CODES = frozenset(
    {2002, 2003, 2006, 2013, 1053, 1927, 4031, 1040, 1049, 1021, 1290, 1836, 1792}
)
#: MySQL: deadlock, lock wait timeout.
_MYSQL_CONTENTION_CODES = frozenset({1213, 1205})
_MYSQL_AUTHENTICATION_CODES = frozenset({1045, 1044, 1698})
_MYSQL_NO_SUCH_TABLE = 1146


def mysql_code(exc: BaseException) -> int | None:
    """The MySQL error number an exception carries (asyncmy / aiomysql / PyMySQL: the first
    of its ``args``), directly or on ``exc.orig``; None without one."""
    for candidate in (exc, getattr(exc, "orig", None)):
        if candidate is None or isinstance(candidate, OSError):
            continue
        args = getattr(candidate, "args", ())
        if args and isinstance(args[0], int) and not isinstance(args[0], bool):
            return args[0]
    return None


def sqlstate_of(exc: BaseException) -> str | None:
    """The PostgreSQL SQLSTATE an exception carries: asyncpg's own exceptions (raw, as the
    WAL relay sees them), SQLAlchemy's adapted asyncpg errors, psycopg (``sqlstate``) and
    psycopg2 (``pgcode``), directly or on ``exc.orig``."""
    for candidate in (exc, getattr(exc, "orig", None)):
        if candidate is None:
            continue
        for attribute in ("sqlstate", "pgcode"):
            value = getattr(candidate, attribute, None)
            if isinstance(value, str) and len(value) == 5:
                return value.upper()
    return None


def _sqlite_code(exc: BaseException) -> int | None:
    """The SQLite primary result code (``sqlite_errorcode`` without the extended bits)."""
    for candidate in (exc, getattr(exc, "orig", None)):
        code = getattr(candidate, "sqlite_errorcode", None)
        if isinstance(code, int):
            return code & 0xFF
    return None


def _sqlite_text(exc: BaseException) -> str:
    """The ``sqlite3`` error's own text (on ``exc.orig`` when SQLAlchemy wrapped it)."""
    orig = getattr(exc, "orig", None)
    return str(orig if orig is not None else exc)


def _common(exc: BaseException) -> Verdict | None:
    """The verdict every dialect shares, or None when the driver's error must decide."""
    from sqlalchemy import exc as sa_exc

    if isinstance(exc, sa_exc.TimeoutError | sa_exc.DisconnectionError):
        return Verdict.OUTAGE  # pool timeout; SQLAlchemy's own "this connection is dead"
    if isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated:
        return Verdict.OUTAGE
    return None


def _group(exc: BaseExceptionGroup[Any], one: Any) -> Verdict:
    verdicts: set[Verdict] = {one(e) for e in exc.exceptions}
    if len(verdicts) > 1:
        verdicts.discard(Verdict.CONTENTION)  # retried either way: the others decide
    if len(verdicts) == 1 and Verdict.UNKNOWN not in verdicts:
        return verdicts.pop()
    for failure in (Verdict.TABLE_MISSING, Verdict.FAILURE):
        if failure in verdicts:
            return failure
    if verdicts <= {Verdict.OUTAGE, Verdict.AUTHENTICATION}:
        return Verdict.AUTHENTICATION  # the cause an operator must fix comes first
    return Verdict.UNKNOWN


def classify_postgresql(exc: BaseException) -> Verdict:
    """The verdict on ``exc`` raised by a PostgreSQL connection (SQLAlchemy or raw asyncpg)."""
    if isinstance(exc, BaseExceptionGroup):
        return _group(exc, classify_postgresql)
    common = _common(exc)
    if common is not None:
        return common
    state = sqlstate_of(exc)
    if state is not None:
        if state in _PG_FAILURE_STATES:
            return Verdict.FAILURE
        if state.startswith(_PG_AUTHENTICATION_CLASS):
            return Verdict.AUTHENTICATION
        if state == _PG_UNDEFINED_TABLE:
            return Verdict.TABLE_MISSING
        if state in _PG_OUTAGE_STATES or state.startswith(_PG_OUTAGE_CLASSES):
            return Verdict.OUTAGE
        return Verdict.FAILURE
    return _without_code(exc)


def classify_sqlite(exc: BaseException) -> Verdict:
    """The verdict on ``exc`` raised by a SQLite connection."""
    if isinstance(exc, BaseExceptionGroup):
        return _group(exc, classify_sqlite)
    common = _common(exc)
    if common is not None:
        return common
    code = _sqlite_code(exc)
    if code is not None:
        if code == _SQLITE_ERROR and _sqlite_text(exc).startswith(_SQLITE_NO_SUCH_TABLE):
            return Verdict.TABLE_MISSING
        return Verdict.OUTAGE if code in _SQLITE_OUTAGE_CODES else Verdict.FAILURE
    return _without_code(exc)


def classify_mysql(exc: BaseException) -> Verdict:
    """The verdict on ``exc`` raised by a MariaDB or MySQL connection."""
    if isinstance(exc, BaseExceptionGroup):
        return _group(exc, classify_mysql)
    code = mysql_code(exc)
    if code in _MYSQL_CONTENTION_CODES:
        return Verdict.CONTENTION
    common = _common(exc)
    if common is not None:
        return common
    if code is not None:
        if code in _MYSQL_AUTHENTICATION_CODES:
            return Verdict.AUTHENTICATION
        if code == _MYSQL_NO_SUCH_TABLE:
            return Verdict.TABLE_MISSING
        return Verdict.OUTAGE if code in _MYSQL_OUTAGE_CODES else Verdict.FAILURE
    return _without_code(exc)


def _without_code(exc: BaseException) -> Verdict:
    """An error without SQLSTATE / result code: a socket error or a driver error with no
    server answer behind it is ambiguous; anything else (the handler's own exception, an
    ``OutboxError``, a ``ValueError``…) is a failure."""
    from sqlalchemy import exc as sa_exc

    if isinstance(exc, OSError):  # TimeoutError and ConnectionError included
        return Verdict.UNKNOWN
    if isinstance(exc, sa_exc.OperationalError | sa_exc.InterfaceError):
        return Verdict.UNKNOWN
    if _is_driver_interface_error(exc):
        return Verdict.UNKNOWN
    return Verdict.FAILURE


def _is_driver_interface_error(exc: BaseException) -> bool:
    """asyncpg's ``InterfaceError`` raised raw (the WAL relay's own connection): "connection
    is closed" among others; its configuration errors are failures."""
    try:
        import asyncpg
    except ImportError:  # pragma: no cover - asyncpg is a dependency
        return False
    return isinstance(exc, asyncpg.InterfaceError) and not isinstance(
        exc, asyncpg.exceptions.ClientConfigurationError
    )


def classify(exc: BaseException, dialect: str) -> Verdict:
    """The verdict on ``exc`` for a database of ``dialect`` (SQLAlchemy's dialect name)."""
    if dialect == "sqlite":
        return classify_sqlite(exc)
    if dialect in ("mysql", "mariadb"):
        return classify_mysql(exc)
    return classify_postgresql(exc)


async def database_answers(engine: Any, timeout: float = PING_SECONDS) -> bool:
    """The database answers ``SELECT 1`` through ``engine`` within ``timeout`` seconds."""
    try:
        with anyio.fail_after(timeout):
            async with engine.connect() as conn:
                await conn.exec_driver_sql(session_sql.PING)
    except Exception:
        return False
    return True


async def is_outage(exc: BaseException, engine: Any, *, ping_seconds: float = PING_SECONDS) -> bool:
    """``exc`` means the database of ``engine`` is unavailable: certain from the exception,
    or, when it is ambiguous, the database does not answer a ping either."""
    verdict = classify(exc, engine.dialect.name)
    if verdict is Verdict.UNKNOWN:
        return not await database_answers(engine, ping_seconds)
    return verdict in (Verdict.OUTAGE, Verdict.AUTHENTICATION, Verdict.CONTENTION)

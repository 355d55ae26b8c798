"""Driver plumbing: running the relay's hot statements on the asyncpg connection itself.

The claim and the marks run once per batch and per worker; the unit of work's INSERT once
per commit. SQLAlchemy Core builds and compiles each once (`Connector.compile`
caches the SQL text and the order of its parameters); they then run on the asyncpg
connection under a pooled SQLAlchemy connection, in autocommit: one round trip each and
no per-execution SQLAlchemy work (statement caching, parameter processing, result
wrapping), which on a busy relay costs as much CPU as the publish. Any other driver takes
the SQLAlchemy path. Nothing outside ``storage/`` touches the driver for these statements
(procrastinate's ``psycopg_connector``: the manager never touches the driver).

The long sessions — the wake-ups' NOTIFY and LISTEN connections, the WAL relay's elected
reader — hold one pooled connection each for as long as they run and talk to its driver
connection directly: `Connector.held` hands them both, so no caller reaches into
SQLAlchemy's pool for the driver itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence
from typing import Any

import anyio
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.util import await_only

from fastapi_outbox.storage.engine import is_postgres, uses_asyncpg

__all__ = ["Connector", "Held", "commit_with", "row_count"]

#: Bound on dropping a discarded connection (`Connector.held` with ``discard``): a
#: connection to a server that went away must not hold up the caller's shutdown.
DISCARD_TIMEOUT_SECONDS = 2.0


def row_count(status: str) -> int:
    """The row count in asyncpg's command tag (``"UPDATE 42"``, ``"DELETE 42"``)."""
    return int(status.rsplit(" ", 1)[-1])


class _CommitCarrying:
    """asyncpg's connection as its transaction sees it while committing: the ``COMMIT;``
    that asyncpg's ``Transaction.commit`` sends goes out with ``sql`` after it, as one
    simple query (one round trip). PostgreSQL runs the statements after the COMMIT in an
    implicit transaction of their own, and none of them when the COMMIT fails. Everything
    else goes to the connection itself."""

    __slots__ = ("_driver", "_sql", "sent")

    def __init__(self, driver: Any, sql: str) -> None:
        object.__setattr__(self, "_driver", driver)
        object.__setattr__(self, "_sql", sql)
        object.__setattr__(self, "sent", False)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._driver, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._driver, name, value)  # the transaction clears ``_top_xact``

    async def execute(self, query: str, *args: Any, timeout: float | None = None) -> Any:
        if args or query != "COMMIT;":
            return await self._driver.execute(query, *args, timeout=timeout)
        object.__setattr__(self, "sent", True)
        return await self._driver.execute(query + self._sql, timeout=timeout)


def commit_with(conn: Connection, sql: str) -> Any:
    """Arrange for ``sql`` (statements without parameters) to go in the same round trip as
    the COMMIT of ``conn``'s transaction, which SQLAlchemy is about to send (called from
    the ``commit`` connection event). Returns a handle whose ``sent`` tells, after the
    commit, whether it went; None when ``conn`` is not on asyncpg or holds no top-level
    asyncpg transaction (the caller sends it after the commit instead)."""
    if not (is_postgres(conn) and uses_asyncpg(conn)):
        return None
    adapter = conn.connection.dbapi_connection
    transaction = getattr(adapter, "_transaction", None)
    driver = conn.connection.driver_connection
    if (
        transaction is None
        or getattr(transaction, "_nested", True)
        or getattr(transaction, "_connection", None) is not driver
    ):
        return None
    carrying = _CommitCarrying(driver, sql)
    transaction._connection = carrying  # discarded with the transaction after the commit
    return carrying


def _begin(conn: Connection) -> bool:
    """Begin the transaction SQLAlchemy's asyncpg adapter begins lazily before its first
    statement (the session's commit writes the outbox rows first when the unit of work
    wrote nothing else): the adapter's own BEGIN, so its commit and rollback see it. False
    when the adapter is not the one this expects (the caller takes SQLAlchemy's path)."""
    adapter = conn.connection.dbapi_connection
    start = getattr(adapter, "_start_transaction", None)
    if start is None or getattr(adapter, "_transaction", False) is not None:
        return False
    if getattr(adapter, "isolation_level", None) == "autocommit":
        return False
    await_only(start())
    driver = conn.connection.driver_connection
    return driver is not None and bool(driver.is_in_transaction())


@dataclasses.dataclass(frozen=True, slots=True)
class Held:
    """A pooled connection held for a long session (`Connector.held`): ``driver`` is
    the driver's own connection under it (asyncpg's: LISTEN, termination listeners,
    session-level locks)."""

    connection: AsyncConnection
    driver: Any

    async def invalidate(self) -> None:
        """Drop the connection: the pool never hands it out again (its state is unknown,
        or it holds what must end with it, such as a session-level advisory lock)."""
        await self.connection.invalidate()


class Connector:
    """One engine's connections for the store's statements: the autocommit engine, the
    asyncpg path with its compiled-statement cache, and the relay's bounds."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.is_postgres = is_postgres(engine)
        self.asyncpg = uses_asyncpg(engine)
        # Single statements on PostgreSQL run in autocommit: one round trip each instead
        # of BEGIN, statement, COMMIT. SQLite keeps its BEGIN IMMEDIATE transactions. MySQL
        # too: its BEGIN is implicit (no round trip), while switching a pooled connection
        # to autocommit and back costs two (``SET autocommit``), more than the COMMIT.
        self.autocommit_engine = (
            engine.execution_options(isolation_level="AUTOCOMMIT") if self.is_postgres else engine
        )
        self._compiled: dict[str, tuple[str, list[str], dict[str, Any]]] = {}
        #: Client-side bound (seconds) of every driver-level statement: asyncpg then
        #: cancels the query on the server. None: unbounded.
        self.statement_timeout: float | None = None
        self.lock_timeout: float | None = None

    def bounds_ms(self) -> tuple[int | None, int | None]:
        """(statement, lock) timeouts in milliseconds, for ``set_config`` (None: unset)."""
        if self.statement_timeout is None or self.lock_timeout is None:
            return None, None
        return int(self.statement_timeout * 1000), int(self.lock_timeout * 1000)

    def compile(self, name: str, stmt: Any, params: dict[str, Any]) -> tuple[str, list[Any]]:
        """SQL text and positional arguments of ``stmt`` (compiled once under ``name``):
        values bound when the statement was built (statuses, NULLs) come from the compiled
        statement, the rest from ``params``."""
        compiled = self._compiled.get(name)
        if compiled is None:
            c = stmt.compile(dialect=self.engine.dialect)
            compiled = self._compiled[name] = (c.string, list(c.positiontup or ()), dict(c.params))
        sql, keys, defaults = compiled
        return sql, [params[k] if k in params else defaults[k] for k in keys]

    async def fetch(self, name: str, stmt: Any, params: dict[str, Any]) -> Any:
        """The rows of one statement, in autocommit."""
        if not self.asyncpg:
            async with self.autocommit_engine.connect() as conn:
                return (await conn.execute(stmt, params)).all()
        return await self._call("fetch", name, stmt, params)

    async def execute(self, name: str, stmt: Any, params: dict[str, Any]) -> int:
        """Run one DML statement in autocommit; returns the row count."""
        if not self.asyncpg:
            async with self.autocommit_engine.begin() as conn:
                return int((await conn.execute(stmt, params)).rowcount)
        return row_count(await self._call("execute", name, stmt, params))

    async def _call(self, method: str, name: str, stmt: Any, params: dict[str, Any]) -> Any:
        sql, args = self.compile(name, stmt, params)
        async with self.driver_connection() as driver:
            return await getattr(driver, method)(sql, *args, timeout=self.statement_timeout)

    async def execute_each(
        self, name: str, stmt: Any, params: Sequence[dict[str, Any]], bounds: Any
    ) -> int:
        """asyncpg: run ``stmt`` once per ``params`` in one transaction, after ``bounds``
        (a SELECT of ``set_config`` calls, or None), and return the rows changed in all.
        asyncpg's ``executemany`` reports no row count, and the count is how a caller
        learns that a lease was lost."""
        changed = 0
        async with self.driver_connection() as driver, driver.transaction():
            if bounds is not None:
                sql, args = self.compile(f"{name}:bounds", bounds, {})
                await driver.execute(sql, *args, timeout=self.statement_timeout)
            for param in params:
                sql, args = self.compile(name, stmt, param)
                status = await driver.execute(sql, *args, timeout=self.statement_timeout)
                changed += row_count(status)
        return changed

    async def fetch_after(
        self, name: str, stmt: Any, params: dict[str, Any], first: tuple[str, Any]
    ) -> Any:
        """asyncpg: in one READ COMMITTED transaction, ``first`` (a name and a statement
        without parameters, e.g. the ordered claimers' turn) then the rows of ``stmt``."""
        first_sql, first_args = self.compile(first[0], first[1], {})
        sql, args = self.compile(name, stmt, params)
        async with (
            self.driver_connection() as driver,
            driver.transaction(isolation="read_committed"),
        ):
            await driver.execute(first_sql, *first_args, timeout=self.statement_timeout)
            return await driver.fetch(sql, *args, timeout=self.statement_timeout)

    @contextlib.asynccontextmanager
    async def driver_connection(self) -> AsyncIterator[Any]:
        """The asyncpg connection under a pooled SQLAlchemy connection (autocommit).
        SQLAlchemy does not see what runs on it, so this is where a connection whose state
        is unknown is dropped: one that died (backend terminated, server restarted), timed
        out, or was cancelled mid-statement (a shutdown, the relay's own bound on a
        step) is invalidated, never handed out again by the pool."""
        async with self.autocommit_engine.connect() as conn:
            raw = await conn.get_raw_connection()
            driver: Any = raw.driver_connection
            try:
                yield driver
            except BaseException as exc:
                if isinstance(exc, TimeoutError | asyncio.CancelledError) or driver.is_closed():
                    with anyio.CancelScope(shield=True):
                        await conn.invalidate()
                raise

    @contextlib.asynccontextmanager
    async def held(self, *, autocommit: bool = True, discard: bool = False) -> AsyncIterator[Held]:
        """A pooled connection and its driver connection, held for a long session.

        ``autocommit`` (default): from the autocommit engine, for sessions that run single
        statements (NOTIFY; the WAL relay's slot functions and advisory lock); False: from
        the engine itself (the LISTEN connection, as it always was). ``discard``: the
        connection is invalidated when the session ends however it ends (shielded from
        cancellation, bounded by `DISCARD_TIMEOUT_SECONDS`), never given back to the
        pool — the WAL relay's session lock and slot state go with it. Without it, the
        caller decides: the connection goes back to the pool on exit unless the caller
        called `Held.invalidate`."""
        engine = self.autocommit_engine if autocommit else self.engine
        async with engine.connect() as conn:
            try:
                raw = await conn.get_raw_connection()
                yield Held(conn, raw.driver_connection)
            finally:
                if discard:
                    with (
                        anyio.CancelScope(shield=True),
                        anyio.move_on_after(DISCARD_TIMEOUT_SECONDS),
                    ):
                        await conn.invalidate()

    def insert_sync(
        self, conn: Connection, stmt: Any, keys: Sequence[str], params: list[dict[str, Any]]
    ) -> bool:
        """Run an INSERT compiled for ``keys`` on ``conn``'s asyncpg connection, inside the
        transaction the session began (from SQLAlchemy's sync API, in the async engine's
        greenlet): one round trip and almost no Python per commit. False when ``conn`` is
        not asyncpg's or no transaction has begun on it: the caller runs the statement
        through SQLAlchemy then."""
        if not (is_postgres(conn) and uses_asyncpg(conn)):
            return False
        driver = conn.connection.driver_connection
        if driver is None:
            return False
        if not driver.is_in_transaction() and not _begin(conn):
            return False
        sql, order = self._insert_sql(conn, stmt, keys)
        if len(params) == 1:
            await_only(driver.execute(sql, *[params[0][k] for k in order]))
        else:
            await_only(driver.executemany(sql, [[p[k] for k in order] for p in params]))
        return True

    def _insert_sql(
        self, conn: Connection, stmt: Any, keys: Sequence[str]
    ) -> tuple[str, list[str]]:
        compiled = self._compiled.get("insert")
        if compiled is None:
            c = stmt.compile(dialect=conn.dialect, column_keys=list(keys))
            compiled = self._compiled["insert"] = (c.string, list(c.positiontup or ()), {})
        return compiled[0], compiled[1]

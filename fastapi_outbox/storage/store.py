"""The outbox table's store: one facade over the statements, grouped by caller, and the
connector that runs them.

``Store`` keeps the method names every caller uses (relays, the unit of work, operations,
the CLI, subscribers); each method takes its statement from
:mod:`fastapi_outbox.storage.statements` (``relay``, ``write``, ``retention``,
``operations``, ``wakeups``: each statement commented with its caller and why each part is
there) and runs it through :class:`~fastapi_outbox.storage.connector.Connector` (the asyncpg
path of the hot statements) or a SQLAlchemy connection.

The dispatcher's cycle is three statements per batch: ``claim`` (one UPDATE … RETURNING),
``mark_published`` (one UPDATE or DELETE over an id array) and, for the few rows the broker
refused, ``mark_failed``. Every change after the claim is *fenced* by the claim token.
PostgreSQL and SQLite run the same statements; the differences are confined to
:mod:`fastapi_outbox.storage.clock` and :mod:`fastapi_outbox.storage.statements.parts`.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import Table
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from fastapi_outbox.storage import read_models, schema
from fastapi_outbox.storage.connector import Connector
from fastapi_outbox.storage.partition_map import NIL, PartitionMap
from fastapi_outbox.storage.read_models import BrokerStats as BrokerStats
from fastapi_outbox.storage.read_models import aware as _aware
from fastapi_outbox.storage.statements import operations as ops_sql
from fastapi_outbox.storage.statements import relay as relay_sql
from fastapi_outbox.storage.statements import retention as retention_sql
from fastapi_outbox.storage.statements import wakeups as wakeups_sql
from fastapi_outbox.storage.statements import write as write_sql
from fastapi_outbox.storage.statements.parts import (
    ABANDONED,
    ERROR_MAX_CHARS,
    FAILED,
    PENDING,
    PROCESSING,
    PUBLISHED,
    batch_params,
    offset,
)
from fastapi_outbox.storage.statements.write import INSERT_KEYS

#: SQLSTATE of a relation that does not exist (a partition dropped under a cached range).
UNDEFINED_TABLE = "42P01"

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


@dataclasses.dataclass(slots=True)
class ClaimedRow:
    """A row taken by a claim: what the dispatcher needs to publish it."""

    id: uuid.UUID
    stream: str
    type: str
    key: str | None
    payload: str
    headers: str
    attempts: int
    #: When the producing transaction began.
    created_at: dt.datetime | None = None
    #: Seconds since ``created_at`` by the database's clock, at the claim (retry deadline).
    age_seconds: float | None = None


@dataclasses.dataclass(slots=True)
class Failure:
    """A publish failure to record: ``abandon`` when attempts are exhausted."""

    id: uuid.UUID
    error: str
    delay_seconds: float
    abandon: bool


class Store:
    """The outbox table on one engine: every statement the package runs against it."""

    def __init__(self, engine: AsyncEngine, table: Table) -> None:
        self.engine = engine
        self.table = table
        self.dialect = engine.dialect
        self.connector = Connector(engine)
        self.is_postgres = self.connector.is_postgres
        self.autocommit_engine = self.connector.autocommit_engine
        self._lock_key = f"fastapi_outbox:{table.name}"
        self._claims: dict[tuple[str, int, bool], Any] = {}
        self._statements: dict[str, Any] = {}
        #: A table partitioned by id, on asyncpg: the claim's floor and each batch's
        #: partition (see :mod:`fastapi_outbox.storage.partition_map`).
        self.partition_map = (
            PartitionMap(engine, table) if self._by_id and self.connector.asyncpg else None
        )

    @property
    def statement_timeout(self) -> float | None:
        """The dispatcher's statement bound (seconds; see :meth:`set_timeouts`)."""
        return self.connector.statement_timeout

    @property
    def lock_timeout(self) -> float | None:
        """The dispatcher's lock-wait bound (seconds; see :meth:`set_timeouts`)."""
        return self.connector.lock_timeout

    def set_timeouts(self, statement_seconds: float, lock_seconds: float) -> None:
        """Bound the dispatcher's statements: the driver-level ones (claim, mark) get a
        client-side command timeout (asyncpg then cancels the query on the server), and
        the dispatcher's transactions (the ordered claim, recording failures) set
        ``statement_timeout``, ``lock_timeout`` and ``idle_in_transaction_session_timeout``
        locally, so neither a frozen database nor a frozen dispatcher holding the ordered
        claimers' lock can stall dispatch for longer than that."""
        self.connector.statement_timeout = statement_seconds
        self.connector.lock_timeout = lock_seconds

    def local_timeouts(self) -> list[Any]:
        """The ``set_config`` calls of :meth:`set_timeouts` for the current transaction
        (see :func:`~fastapi_outbox.storage.statements.relay.local_timeouts`)."""
        return relay_sql.local_timeouts(*self.connector.bounds_ms())

    def _cached(self, name: str, build: Any) -> Any:
        stmt = self._statements.get(name)
        if stmt is None:
            stmt = self._statements[name] = build()
        return stmt

    async def now(self) -> dt.datetime:
        """The database's clock (aware UTC): the one every due time is compared with."""
        async with self.autocommit_engine.connect() as conn:
            return _aware((await conn.execute(ops_sql.database_now(self.dialect))).scalar_one())

    async def ping(self) -> None:
        """Raise if the database cannot be reached."""
        async with self.engine.connect() as conn:
            await conn.execute(ops_sql.ping())

    async def create_table(self) -> None:
        """Create the outbox table and its indexes (never any other table)."""
        await schema.create_table(self.engine, self.table)

    async def drop_table(self) -> None:
        await schema.drop_table(self.engine, self.table)

    # -- write path (statements.write) -----------------------------------------------------

    def insert_statement(self) -> Any:
        """The unit of work's INSERT (built once; see
        :func:`~fastapi_outbox.storage.statements.write.insert_rows`)."""
        return self._cached("insert", lambda: write_sql.insert_rows(self.table, self.dialect))

    def row_params(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The unit of work's row dicts completed for :meth:`insert_statement`."""
        return write_sql.row_params(rows, self.dialect)

    async def insert_rows(self, conn: AsyncConnection, rows: list[dict[str, Any]]) -> None:
        """Insert outbox rows in ``conn``'s transaction (see :meth:`insert_rows_sync`)."""
        await conn.run_sync(self.insert_rows_sync, rows)

    def insert_rows_sync(self, conn: Connection, rows: list[dict[str, Any]]) -> None:
        """Insert outbox rows in ``conn``'s transaction, from SQLAlchemy's sync API (the
        session's ``before_commit`` event, run inside the async engine's greenlet). On
        asyncpg, once the transaction has begun, the INSERT runs on the driver connection
        itself (see :meth:`Connector.insert_sync`)."""
        params = self.row_params(rows)
        stmt = self.insert_statement()
        keys = [*INSERT_KEYS, "delay", "deliver_at"]
        if not self.connector.insert_sync(conn, stmt, keys, params):
            conn.execute(stmt, params[0] if len(params) == 1 else params)

    async def insert_failed(self, rows: Sequence[dict[str, Any]]) -> int:
        """Insert messages the WAL relay (``capture="wal"``) could not publish because the
        broker refused them, as ``failed`` rows due again after ``retry_in`` (or
        ``abandoned`` ones, ``abandon_now``); a row already there is left as it is (see
        :func:`~fastapi_outbox.storage.statements.relay.insert_failed`). Returns how many
        rows were inserted."""
        if not rows:
            return 0
        async with self.engine.begin() as conn:
            result = await conn.execute(relay_sql.insert_failed(self.table), list(rows))
            return int(result.rowcount)

    # -- dispatch (statements.relay) --------------------------------------------------------

    def claim_statement(self, broker: str, limit: int, ordered: bool) -> Any:
        """The claim of ``broker``'s rows, built once per (broker, limit, ordered) (see
        :func:`~fastapi_outbox.storage.statements.relay.claim`); bound per execution:
        ``token`` and ``lease`` (:meth:`claim_params`)."""
        key = (broker, limit, ordered)
        stmt = self._claims.get(key)
        if stmt is None:
            stmt = self._claims[key] = relay_sql.claim(
                self.table, broker, limit, ordered, self.dialect
            )
        return stmt

    def claim_params(
        self, token: str, lease_seconds: float, floor: uuid.UUID = NIL
    ) -> dict[str, Any]:
        """The per-execution parameters of :meth:`claim_statement` (``floor``: see
        :func:`~fastapi_outbox.storage.statements.relay.has_floor`; the nil UUID prunes
        nothing)."""
        return {"token": token, "lease": offset(self.dialect, lease_seconds), "floor": floor}

    async def claim(
        self, broker: str, limit: int, token: str, lease_seconds: float, *, ordered: bool = False
    ) -> list[ClaimedRow]:
        """Claim up to ``limit`` due rows of ``broker`` for ``token``, oldest first (ordered:
        in insert order). A row whose batch died twice comes alone (see the statement)."""
        stmt = self.claim_statement(broker, limit, ordered)
        pmap = None if ordered else self.partition_map
        floor = NIL if pmap is None else await pmap.next_floor(broker)
        params = self.claim_params(token, lease_seconds, floor)
        if self.is_postgres and not ordered and self.connector.asyncpg and self._by_id:
            # A table partitioned by id: its cached generic plan (see relay_sql.generic_plan).
            generic = ("generic_plan", relay_sql.generic_plan())
            rows = await self.connector.fetch_after(
                f"claim:{broker}:{limit}", stmt, params, generic
            )
        elif self.is_postgres and not ordered:
            # One statement in autocommit: one round trip, no BEGIN/COMMIT.
            rows = await self.connector.fetch(f"claim:{broker}:{limit}", stmt, params)
        elif self.is_postgres and self.connector.asyncpg:
            turn = (f"ordered_lock:{broker}", self._ordered_turn(broker))
            rows = await self.connector.fetch_after(
                f"claim_ordered:{broker}:{limit}", stmt, params, turn
            )
        else:
            rows = await self._claim_in_transaction(broker, stmt, params, ordered)
        if pmap is not None:
            pmap.claimed(broker, floor, len(rows) >= limit)
        claimed = [ClaimedRow(*row[: relay_sql.CLAIM_COLUMNS]) for row in rows]
        if ordered:
            order = {row[0]: tuple(row[relay_sql.CLAIM_COLUMNS :]) for row in rows}
            claimed.sort(key=lambda r: order[r.id])
        return claimed

    def _ordered_turn(self, broker: str) -> Any:
        return relay_sql.ordered_turn(
            self._lock_key,
            broker,
            *self.connector.bounds_ms(),
            generic=self._by_id and self.connector.asyncpg,
        )

    @property
    def _by_id(self) -> bool:
        """A PostgreSQL table partitioned by id (see ``relay_sql.generic_plan``)."""
        return self.is_postgres and self.table.info.get("partitioning") is not None

    async def _claim_in_transaction(
        self, broker: str, stmt: Any, params: dict[str, Any], ordered: bool
    ) -> Any:
        """The claim through SQLAlchemy: SQLite (serialised by its write lock), and the
        ordered claim on a PostgreSQL driver other than asyncpg."""
        async with self.engine.connect() as conn:
            if self.is_postgres:
                # Whatever the engine's default: the claim must see what other claims
                # committed while it waited for its turn (a REPEATABLE READ snapshot is
                # taken before the turn). Free on asyncpg: it is an option of BEGIN.
                await conn.execution_options(isolation_level="READ COMMITTED")
            async with conn.begin():
                if ordered and self.is_postgres:
                    # Ordered claimers of one table take turns (see ordered_turn).
                    await conn.execute(self._ordered_turn(broker))
                return (await conn.execute(stmt, params)).all()

    async def mark_published(
        self, ids: Sequence[uuid.UUID], token: str, *, delete_rows: bool = False
    ) -> int:
        """Mark claimed rows published (or delete them); returns how many still held the
        claim: fewer than ``len(ids)`` means some leases were lost to another worker."""
        if not ids:
            return 0
        name = "delete_published" if delete_rows else "mark_published"
        return await self._execute_batch(
            name,
            ids,
            lambda t: relay_sql.mark_published(t, self.dialect, delete_rows=delete_rows),
            {**batch_params(ids, ranged=self._by_id), "token": token},
        )

    async def _execute_batch(
        self,
        name: str,
        ids: Sequence[uuid.UUID],
        build: Callable[[Table], Any],
        params: dict[str, Any],
    ) -> int:
        """Run a batch's statement (cached under ``name``) and return its row count: on the
        batch's own partition when a :attr:`partition_map` knows it (a plain table's
        statement), else on the table."""
        pmap = self.partition_map
        if pmap is not None and (part := pmap.partition_of(ids)) is not None:
            key = f"{name}@{part.name}"
            stmt = self._cached(key, lambda: build(part))
            try:
                return await self.connector.execute(key, stmt, params)
            except Exception as exc:
                if getattr(exc, "sqlstate", None) != UNDEFINED_TABLE:
                    raise
                # Gone (it held no row needing work, so none of this batch): the table.
                pmap.forget()
        stmt = self._cached(name, lambda: build(self.table))
        return await self.connector.execute(name, stmt, params)

    async def mark_failed(self, failures: Sequence[Failure], token: str) -> int:
        """Record publish failures: back to ``failed`` with a due time, or ``abandoned``;
        returns how many rows the claim still held."""
        if not failures:
            return 0
        stmt = self._cached("mark_failed", lambda: relay_sql.mark_failed(self.table, self.dialect))
        params = [
            {
                "row_id": f.id,
                "token": token,
                "new_status": ABANDONED if f.abandon else FAILED,
                "error": f.error[:ERROR_MAX_CHARS],
                "delay": offset(self.dialect, f.delay_seconds),
            }
            for f in failures
        ]
        if self.is_postgres and self.connector.asyncpg:
            # One transaction on the asyncpg connection (bounded, dropped when in doubt);
            # refusals are few, so one statement each (the count tells a lost lease).
            bounds = relay_sql.transaction_bounds(*self.connector.bounds_ms())
            return await self.connector.execute_each("mark_failed", stmt, params, bounds)
        async with self.engine.begin() as conn:
            if not self.is_postgres:
                return int((await conn.execute(stmt, params)).rowcount)
            return sum([int((await conn.execute(stmt, param)).rowcount) for param in params])

    async def release(
        self, ids: Sequence[uuid.UUID], token: str, *, refund_attempt: bool = True
    ) -> int:
        """Give claimed rows back, claimable at once (shutdown, broker unreachable). The
        attempt counted at claim is refunded: the message itself did not fail."""
        if not ids:
            return 0
        name = "release_refund" if refund_attempt else "release"
        return await self._execute_batch(
            name,
            ids,
            lambda t: relay_sql.release(t, self.dialect, refund_attempt=refund_attempt),
            {**batch_params(ids, ranged=self._by_id), "token": token},
        )

    async def extend_lease(self, ids: Sequence[uuid.UUID], token: str, lease_seconds: float) -> int:
        """Renew the lease of claimed rows for ``lease_seconds`` from now (the database's
        clock), fenced by the claim token; returns how many rows the claim still held."""
        if not ids:
            return 0
        params = {
            **batch_params(ids, ranged=self._by_id),
            "token": token,
            "lease": offset(self.dialect, lease_seconds),
        }
        return await self._execute_batch(
            "extend_lease", ids, lambda t: relay_sql.extend_lease(t, self.dialect), params
        )

    async def abandon(self, ids: Sequence[uuid.UUID], token: str, error: str) -> int:
        """Abandon claimed rows without publishing (attempts exhausted by crashes, retry
        deadline passed)."""
        return await self.mark_failed(
            [Failure(id=i, error=error, delay_seconds=0.0, abandon=True) for i in ids], token
        )

    async def next_due_in(self, broker: str) -> float | None:
        """Seconds until the earliest row of ``broker`` that needs work becomes due (a
        delayed message, a backoff, a lease), None when there is none: the idle poller
        sleeps that long at most."""
        async with self.autocommit_engine.connect() as conn:
            db_now = (await conn.execute(ops_sql.database_now(self.dialect))).scalar_one()
            due = (
                await conn.execute(relay_sql.next_due(self.table, broker, self.dialect))
            ).scalar_one()
        if due is None:
            return None
        return max(0.0, (_aware(due) - _aware(db_now)).total_seconds())

    # -- retention (statements.retention) ----------------------------------------------------

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
        """The DELETE of :meth:`purge_batch` (``benchmarks/scale.py`` measures its WAL)."""
        return retention_sql.purge(
            self.table, status, older_than_seconds, limit, self.dialect, keep_blocking=keep_blocking
        )

    # -- observation (statements.operations) ---------------------------------------------------

    def stats_statements(self) -> dict[str, Any]:
        """The statements behind :meth:`stats` (see
        :func:`~fastapi_outbox.storage.statements.operations.stats`)."""
        return ops_sql.stats(self.table, self.dialect)

    async def stats(
        self,
        brokers: Iterable[str] = (),
        *,
        published_totals: bool = False,
        ordered: bool = False,
    ) -> dict[str, BrokerStats]:
        """Counts per broker, from the partial indexes (cheap on a table of published rows).

        ``oldest_pending_age_seconds`` is how long the longest-waiting due *pending* row has
        waited for a dispatcher: counted from its due time (its commit, or when it was given
        back while the broker was unreachable), not from its producer's transaction start.
        A failing message has its own count and backoff and does not make the outbox look
        stalled; with ``ordered`` neither do the rows of its key behind it.
        ``published_totals`` adds the count of published rows, which costs a scan of all
        of them (the CLI's ``status``, never the health endpoint)."""
        statements = self.stats_statements()
        names = ["active"]
        names += ["waiting_ordered", "blocking_ordered"] if ordered else []
        names += ["abandoned", "scheduled", "recent"]
        names += ["published"] if published_totals else []
        async with self.autocommit_engine.connect() as conn:
            db_now = _aware((await conn.execute(ops_sql.database_now(self.dialect))).scalar_one())
            rows = {name: (await conn.execute(statements[name])).all() for name in names}
        return read_models.broker_stats(
            brokers, db_now, rows, ordered=ordered, published_totals=published_totals
        )

    async def count_matching(
        self,
        status: str,
        *,
        stream: str | None = None,
        finished_before_seconds: float | None = None,
    ) -> int:
        """How many rows of ``status`` (in ``stream``; for published/abandoned rows,
        finished more than ``finished_before_seconds`` ago): the total of a progress bar."""
        stmt = ops_sql.count_matching(
            self.table,
            status,
            self.dialect,
            stream=stream,
            finished_before_seconds=finished_before_seconds,
        )
        async with self.engine.connect() as conn:
            return int((await conn.execute(stmt)).scalar_one())

    async def get(self, message_id: uuid.UUID) -> Mapping[str, Any] | None:
        """One message with its payload and headers as stored JSON text; None when absent."""
        async with self.engine.connect() as conn:
            row = (await conn.execute(ops_sql.get(self.table, message_id))).mappings().first()
        return None if row is None else dict(row)

    async def list_messages(
        self,
        *,
        status: str | None = None,
        stream: str | None = None,
        broker: str | None = None,
        type_: str | None = None,
        key: str | None = None,
        since: dt.datetime | None = None,
        until: dt.datetime | None = None,
        before_id: uuid.UUID | None = None,
        limit: int = 50,
        scheduled: bool = False,
    ) -> list[Mapping[str, Any]]:
        """Rows without payloads, newest first (by id: UUIDv7 ids are time-ordered).

        Keyset pagination: the next page is ``before_id=<last id of this page>``, one
        primary-key range scan however deep the page — never OFFSET over millions of rows.
        ``since``/``until`` bound ``created_at``; ``scheduled``: pending rows not yet due."""
        stmt = ops_sql.list_messages(
            self.table,
            self.dialect,
            status=status,
            filters={"stream": stream, "broker": broker, "type": type_, "key": key},
            since=since,
            until=until,
            before_id=before_id,
            limit=limit,
            scheduled=scheduled,
        )
        async with self.engine.connect() as conn:
            return [dict(r) for r in (await conn.execute(stmt)).mappings().all()]

    async def stream_stats(self) -> list[dict[str, Any]]:
        """Counts per (broker, stream) of the rows that need work and of the abandoned ones,
        with the oldest due pending row per stream: from the partial indexes (the dashboard's
        overview; cheap on a table of published rows)."""
        statements = ops_sql.stream_stats(self.table, self.dialect)
        async with self.autocommit_engine.connect() as conn:
            db_now = _aware((await conn.execute(ops_sql.database_now(self.dialect))).scalar_one())
            rows = {
                name: (await conn.execute(statements[name])).all()
                for name in ("active", "abandoned", "scheduled")
            }
        return read_models.stream_stats(db_now, rows)

    async def published_per_minute(self, minutes: int = 60) -> list[tuple[dt.datetime, int]]:
        """Published rows per minute over the last ``minutes`` (a range scan of the
        published index), oldest first, minutes without any included as 0."""
        stmt = ops_sql.published_per_minute(self.table, minutes, self.dialect)
        async with self.autocommit_engine.connect() as conn:
            db_now = _aware((await conn.execute(ops_sql.database_now(self.dialect))).scalar_one())
            rows = (await conn.execute(stmt)).all()
        return read_models.per_minute(db_now, rows, minutes)

    async def states(self, ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, tuple[str, bool]]:
        """(status, held by a dispatcher) of each of ``ids`` that exists: one statement for
        an operator's page of ids (the caller keeps ``ids`` to a page: one bind each)."""
        async with self.engine.connect() as conn:
            rows = (await conn.execute(ops_sql.states(self.table, ids))).all()
        return {row.id: (row.status, row.locked_by is not None) for row in rows}

    async def count(self, status: str | None = None) -> int:
        """How many rows (of ``status``)."""
        async with self.engine.connect() as conn:
            return int((await conn.execute(ops_sql.count(self.table, status))).scalar_one())

    async def clock(self) -> dt.datetime:
        """The time every age is measured with: the database's on PostgreSQL, the
        process's on SQLite."""
        if not self.is_postgres:
            return dt.datetime.now(dt.UTC)
        async with self.engine.connect() as conn:
            return _aware((await conn.execute(ops_sql.database_now(self.dialect))).scalar_one())

    # -- administration (statements.operations) ------------------------------------------------

    async def replay(
        self,
        ids: Sequence[uuid.UUID] | None = None,
        *,
        stream: str | None = None,
        statuses: Sequence[str] = (ABANDONED,),
        limit: int | None = None,
    ) -> list[uuid.UUID]:
        """Move rows (abandoned by default) back to pending with attempts reset; returns
        the ids moved. With ``ids=None``, every row in ``statuses`` (and ``stream``), in
        batches of ``limit``."""
        stmt = ops_sql.replay(
            self.table, self.dialect, ids, stream=stream, statuses=statuses, limit=limit
        )
        async with self.engine.begin() as conn:
            return list((await conn.execute(stmt)).scalars().all())

    async def cancel_unclaimed(self, ids: Sequence[uuid.UUID]) -> list[uuid.UUID]:
        """Delete pending rows no dispatcher holds (fenced against a concurrent claim).
        Returns the ids cancelled."""
        async with self.engine.begin() as conn:
            stmt = ops_sql.cancel_unclaimed(self.table, ids)
            return list((await conn.execute(stmt)).scalars().all())

    async def abandon_unclaimed(self, ids: Sequence[uuid.UUID], error: str) -> list[uuid.UUID]:
        """An operator's abandon: stop retrying pending or failed rows that no dispatcher
        holds (a row claimed meanwhile is left to its claim). Returns the ids abandoned."""
        async with self.engine.begin() as conn:
            stmt = ops_sql.abandon_unclaimed(self.table, ids, error, self.dialect)
            return list((await conn.execute(stmt)).scalars().all())

    # -- wake-ups (statements.wakeups) ---------------------------------------------------------

    async def notify(self, channel: str, payload: str) -> None:
        """``NOTIFY channel`` on a pooled connection, outside any business transaction."""
        async with self.autocommit_engine.connect() as conn:
            await conn.execute(wakeups_sql.notify(channel, payload))

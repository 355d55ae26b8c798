"""All SQL against the outbox table, in one place.

The dispatcher's cycle is three statements per batch: ``claim`` (one UPDATE … RETURNING),
``mark_published`` (one UPDATE or DELETE over an id array) and, for the few rows the broker
refused, ``mark_failed`` (one executemany). Every change after the claim is *fenced*: it
only touches rows whose ``locked_by`` still equals the claim token, so a worker whose lease
expired can never overwrite a newer claim.

PostgreSQL and SQLite run the same statements; the differences are confined to
:mod:`fastapi_outbox.storage.clock` (``now()`` vs. SQLite's ``'now'``: the database's clock on both,
never the process's), :meth:`Store._ids` (an array
parameter vs. an expanding IN) and the ordering column (``seq`` vs. ``rowid``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any

import anyio
from sqlalchemy import (
    ARRAY,
    Boolean,
    Interval,
    Select,
    String,
    Table,
    Text,
    Uuid,
    and_,
    any_,
    bindparam,
    case,
    cast,
    delete,
    distinct,
    exists,
    func,
    insert,
    literal_column,
    or_,
    select,
    tuple_,
    update,
)
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.util import await_only

from fastapi_outbox.events import MessageStatus
from fastapi_outbox.storage import clock, schema
from fastapi_outbox.storage.schema import ACTIVE_STATUSES, UtcDateTime

PENDING = MessageStatus.PENDING.value
PROCESSING = MessageStatus.PROCESSING.value
PUBLISHED = MessageStatus.PUBLISHED.value
FAILED = MessageStatus.FAILED.value
ABANDONED = MessageStatus.ABANDONED.value
_ACTIVE = [s.value for s in ACTIVE_STATUSES]


def _age(now: dt.datetime, since: Any) -> float | None:
    """Seconds from ``since`` (a due time) to ``now``; None while it is not yet due."""
    if isinstance(since, str):  # SQLite aggregates return the stored text
        since = dt.datetime.fromisoformat(since).replace(tzinfo=dt.UTC)
    seconds = (now - since).total_seconds()
    return seconds if seconds >= 0 else None


def _active(alias: Any) -> ColumnElement[bool]:
    """``status IN ('pending', 'processing', 'failed')`` with the values in the SQL text:
    the partial indexes serve a statement only when its WHERE provably implies their
    predicate, which bound parameters never do under a generic (prepared) plan."""
    status: ColumnElement[str] = alias.c.status
    return status.in_([literal_column(f"'{value}'") for value in _ACTIVE])


#: Columns the unit of work supplies for each row (the rest have defaults).
INSERT_KEYS = ("id", "broker", "stream", "type", "key", "payload", "headers")
#: last_error is truncated to this many characters.
ERROR_MAX_CHARS = 2000


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


@dataclasses.dataclass(slots=True)
class BrokerStats:
    """Counts of one broker's rows (health endpoint, ``status`` command)."""

    broker: str
    pending: int = 0
    processing: int = 0
    failed: int = 0
    abandoned: int = 0
    oldest_pending_age_seconds: float | None = None
    published_last_minute: int = 0
    #: Pending rows not due yet (delayed messages); included in ``pending``.
    scheduled: int = 0
    #: Only with ``stats(published_totals=True)``.
    published: int | None = None
    #: Ordered dispatch: keys whose later messages wait behind an abandoned message, and
    #: the first such message by id (None when none blocks).
    blocked_keys: int = 0
    blocking_message: str | None = None


class Store:
    """SQL for one outbox table on one engine."""

    def __init__(self, engine: AsyncEngine, table: Table) -> None:
        self.engine = engine
        self.table = table
        self.is_postgres = engine.dialect.name == "postgresql"
        self._lock_key = f"fastapi_outbox:{table.name}"
        # Single statements on PostgreSQL run in autocommit: one round trip each instead
        # of BEGIN, statement, COMMIT. SQLite keeps its BEGIN IMMEDIATE transactions.
        self._autocommit = (
            engine.execution_options(isolation_level="AUTOCOMMIT") if self.is_postgres else engine
        )
        self.autocommit_engine = self._autocommit
        self._claims: dict[tuple[str, int, bool], Any] = {}
        self._statements: dict[str, Any] = {}
        self._insert: Any = None
        self._insert_sql: tuple[str, list[str]] | None = None
        self._driver_statements: dict[str, tuple[str, list[str], dict[str, Any]]] = {}
        #: Dispatcher statement bounds (seconds): see :meth:`set_timeouts`.
        self.statement_timeout: float | None = None
        self.lock_timeout: float | None = None

    def set_timeouts(self, statement_seconds: float, lock_seconds: float) -> None:
        """Bound the dispatcher's statements: the driver-level ones (claim, mark) get a
        client-side command timeout (asyncpg then cancels the query on the server), and
        the dispatcher's transactions (the ordered claim, recording failures) set
        ``statement_timeout``, ``lock_timeout`` and ``idle_in_transaction_session_timeout``
        locally, so neither a frozen database nor a frozen dispatcher holding the ordered
        claimers' lock can stall dispatch for longer than that."""
        self.statement_timeout = statement_seconds
        self.lock_timeout = lock_seconds

    # -- helpers -------------------------------------------------------------------------

    def _now(self) -> ColumnElement[dt.datetime]:
        """The clock every due time is compared with: the database's (see :mod:`clock`),
        one clock for every process whatever its host's clock says."""
        return clock.db_now(self.is_postgres)

    def _later(self, seconds: float) -> ColumnElement[dt.datetime]:
        return clock.db_later(self.is_postgres, seconds=seconds)  # type: ignore[no-any-return]

    def _offset(self, seconds: float) -> Any:
        """The value of a :func:`clock.db_later` parameter: an interval on PostgreSQL, a
        date modifier on SQLite."""
        if self.is_postgres:
            return dt.timedelta(seconds=seconds)
        return clock.seconds_modifier(seconds)

    def _ids(self, name: str = "ids") -> ColumnElement[bool]:
        """``id = ANY($ids)`` on PostgreSQL (one cached statement for any batch size)."""
        if self.is_postgres:
            return self.table.c.id == any_(bindparam(name, type_=ARRAY(Uuid())))
        return self.table.c.id.in_(bindparam(name, expanding=True))

    def _order_columns(self, alias: Any) -> tuple[Any, ...]:
        """Insert order of rows, the order of ordered dispatch: ``seq`` (an identity
        column) on PostgreSQL, the rowid on SQLite (one writer at a time holding the write
        lock until commit, so there insert order is commit order).

        Why insert order and not the writing transaction's id: a transaction gets its id
        at its first write, which may come before it locks the key's aggregate, so two
        producers of one aggregate can hold ids in the opposite order of their commits.
        The unit of work inserts outbox rows at the end, after the business writes: a
        producer that waited for another one's lock inserts after that one committed."""
        if self.is_postgres:
            return (alias.c.seq,)
        # Quoted: the table may carry an SQL keyword's name (``order``).
        quoted = self.engine.dialect.identifier_preparer.quote(alias.name)
        return (literal_column(f"{quoted}.rowid"),)

    # -- the dispatcher's hot statements on asyncpg ---------------------------------------
    #
    # The claim and the mark run once per batch and per worker. SQLAlchemy Core builds and
    # compiles them once (cached here); they then run on the asyncpg connection itself, in
    # autocommit: one round trip each and no per-execution SQLAlchemy work (statement
    # caching, parameter processing, result wrapping), which on a busy relay costs as much
    # CPU as the publish. Any other driver takes the SQLAlchemy path.

    def _local_timeouts(self) -> list[Any]:
        """``set_config(…, is_local => true)`` of the dispatcher's bounds for the current
        transaction (nothing when :meth:`set_timeouts` was not called)."""
        if self.statement_timeout is None or self.lock_timeout is None:
            return []
        statement = f"{int(self.statement_timeout * 1000)}ms"
        lock = f"{int(self.lock_timeout * 1000)}ms"
        return [
            func.set_config("statement_timeout", statement, True),
            func.set_config("lock_timeout", lock, True),
            func.set_config("idle_in_transaction_session_timeout", statement, True),
        ]

    def _driver_args(self, name: str, stmt: Any, params: dict[str, Any]) -> tuple[str, list[Any]]:
        """SQL text and positional arguments: values bound when the statement was built
        (statuses, NULLs) come from the compiled statement, the rest from ``params``."""
        compiled = self._driver_statements.get(name)
        if compiled is None:
            c = stmt.compile(dialect=self.engine.dialect)
            compiled = self._driver_statements[name] = (
                c.string,
                list(c.positiontup or ()),
                dict(c.params),
            )
        sql, keys, defaults = compiled
        return sql, [params[k] if k in params else defaults[k] for k in keys]

    async def _driver_fetch(self, name: str, stmt: Any, params: dict[str, Any]) -> Any:
        if self.engine.dialect.driver != "asyncpg":
            async with self._autocommit.connect() as conn:
                return (await conn.execute(stmt, params)).all()
        return await self._driver_call("fetch", name, stmt, params)

    async def _driver_execute(self, name: str, stmt: Any, params: dict[str, Any]) -> int:
        """Run a DML statement; returns the row count."""
        if self.engine.dialect.driver != "asyncpg":
            async with self._autocommit.begin() as conn:
                return int((await conn.execute(stmt, params)).rowcount)
        status = await self._driver_call("execute", name, stmt, params)
        # asyncpg returns the command tag: "UPDATE 42" / "DELETE 42".
        return int(status.rsplit(" ", 1)[-1])

    async def _driver_call(self, method: str, name: str, stmt: Any, params: dict[str, Any]) -> Any:
        """``fetch``/``execute`` of one statement on the asyncpg connection, in autocommit,
        bounded by the statement timeout (see :meth:`_driver_connection`)."""
        sql, args = self._driver_args(name, stmt, params)
        async with self._driver_connection() as driver:
            return await getattr(driver, method)(sql, *args, timeout=self.statement_timeout)

    @contextlib.asynccontextmanager
    async def _driver_connection(self) -> AsyncIterator[Any]:
        """The asyncpg connection under a pooled SQLAlchemy connection, for the dispatcher's
        statements. SQLAlchemy does not see what runs on it, so this is where a connection
        whose state is unknown is dropped: one that died (backend terminated, server
        restarted), timed out, or was cancelled mid-statement (a shutdown, the dispatcher's
        own bound on a step) is invalidated, never handed out again by the pool."""
        async with self._autocommit.connect() as conn:
            raw = await conn.get_raw_connection()
            driver: Any = raw.driver_connection
            try:
                yield driver
            except BaseException as exc:
                if isinstance(exc, TimeoutError | asyncio.CancelledError) or driver.is_closed():
                    with anyio.CancelScope(shield=True):
                        await conn.invalidate()
                raise

    async def now(self) -> dt.datetime:
        """The database's clock (aware UTC): the one every due time is compared with."""
        async with self._autocommit.connect() as conn:
            value = (await conn.execute(select(self._now()))).scalar_one()
        if isinstance(value, str):
            value = dt.datetime.fromisoformat(value)
        return value if value.tzinfo is not None else value.replace(tzinfo=dt.UTC)

    async def ping(self) -> None:
        """Raise if the database cannot be reached."""
        async with self.engine.connect() as conn:
            await conn.execute(select(1))

    async def create_table(self) -> None:
        """Create the outbox table and its indexes (never any other table)."""
        await schema.create_table(self.engine, self.table)

    async def drop_table(self) -> None:
        await schema.drop_table(self.engine, self.table)

    # -- write path ------------------------------------------------------------------------

    def insert_statement(self) -> Any:
        """INSERT for the unit of work (built once); every timestamp comes from the
        database's clock, so it agrees with the claim's. ``created_at`` is the
        transaction's start on PostgreSQL (when the event happened); the first due time is
        the INSERT's own clock, at the commit (the unit of work writes its rows in
        ``before_commit``): how long a row waits for a dispatcher is counted from then, not
        from the start of a long producer transaction. A delayed message is due ``delay``
        after that; a ``deliver_at`` one at that time (at once when it is past), whatever
        the producer's clock says."""
        if self._insert is None:
            if self.is_postgres:
                created: Any = func.now()
                statement_now: Any = func.statement_timestamp()
                after_delay = statement_now + bindparam("delay", type_=Interval())
            else:
                created = statement_now = clock.db_now(False)
                after_delay = clock.db_later(False, "delay")
            due_at = bindparam("deliver_at", type_=UtcDateTime())
            # greatest/max of now and (deliver_at, else now + delay): a past deliver_at is
            # due now, never "overdue" since then in the health's pending age.
            latest = func.greatest if self.is_postgres else func.max
            self._insert = insert(self.table).values(
                created_at=created,
                next_attempt_at=latest(statement_now, func.coalesce(due_at, after_delay)),
            )
        return self._insert

    def row_params(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Complete the unit of work's row dicts for the INSERT: ``delay`` (a timedelta from
        the commit) and ``deliver_at`` (an aware datetime or None) become parameters of
        the due time the database computes."""
        params = [{"deliver_at": None, **row} for row in rows]
        if not self.is_postgres:
            for row in params:
                row["delay"] = clock.seconds_modifier(row["delay"].total_seconds())
                row["seq"] = 0  # no identity columns on SQLite: the rowid gives insert order
        return params

    async def insert_rows(self, conn: AsyncConnection, rows: list[dict[str, Any]]) -> None:
        """Insert outbox rows in ``conn``'s transaction (see :meth:`insert_rows_sync`)."""
        await conn.run_sync(self.insert_rows_sync, rows)

    def insert_rows_sync(self, conn: Connection, rows: list[dict[str, Any]]) -> None:
        """Insert outbox rows in ``conn``'s transaction, from SQLAlchemy's sync API (the
        session's ``before_commit`` event, run inside the async engine's greenlet).

        On asyncpg, once the transaction has begun, the INSERT — compiled by SQLAlchemy
        Core once — runs on the driver connection itself: the write path then pays one
        round trip and almost no Python per request (SQLAlchemy's per-statement execution
        costs about as much CPU as the business INSERT it follows)."""
        params = self.row_params(rows)
        if self.is_postgres and conn.dialect.driver == "asyncpg":
            driver = conn.connection.driver_connection
            if driver is not None and driver.is_in_transaction():
                sql, keys = self._compiled_insert(conn)
                if len(params) == 1:
                    await_only(driver.execute(sql, *[params[0][k] for k in keys]))
                else:
                    await_only(driver.executemany(sql, [[p[k] for k in keys] for p in params]))
                return
        conn.execute(self.insert_statement(), params[0] if len(params) == 1 else params)

    def _compiled_insert(self, conn: Connection | AsyncConnection) -> tuple[str, list[str]]:
        if self._insert_sql is None:
            compiled = self.insert_statement().compile(
                dialect=conn.dialect, column_keys=[*INSERT_KEYS, "delay", "deliver_at"]
            )
            self._insert_sql = (compiled.string, list(compiled.positiontup or ()))
        return self._insert_sql

    async def insert_failed(self, rows: Sequence[dict[str, Any]]) -> int:
        """Insert messages the WAL relay (``capture="wal"``) could not publish because the
        broker refused them, as ``failed`` rows due again at ``next_attempt_at`` (or
        ``abandoned`` ones): from there the table's retry, abandon and replay path takes
        over. A row that is already there — a relay that crashed after inserting it reads
        the slot again — is left as it is. Returns how many rows were inserted.

        Each row gives ``retry_in`` (a timedelta) and ``abandon_now`` (a bool) instead of
        ``next_attempt_at`` and ``abandoned_at``: those are the database's now plus the
        retry delay, and its now, so they agree with the claim's clock."""
        if not rows:
            return 0
        from sqlalchemy.dialects import postgresql

        stmt = (
            postgresql.insert(self.table)
            .values(
                next_attempt_at=func.now() + bindparam("retry_in", type_=Interval()),
                abandoned_at=case(
                    (bindparam("abandon_now", type_=Boolean()), func.now()), else_=None
                ),
            )
            .on_conflict_do_nothing()
        )
        async with self.engine.begin() as conn:
            result = await conn.execute(stmt, list(rows))
            return int(result.rowcount)

    # -- dispatch --------------------------------------------------------------------------

    def _claim_statement(self, broker: str, limit: int, ordered: bool) -> Any:
        """The claim: one ``UPDATE … RETURNING`` over three CTEs.

        ``locked``: up to ``limit`` due rows in claim order (``FOR UPDATE SKIP LOCKED`` on
        PostgreSQL, so concurrent claimers take disjoint batches). ``ranked`` numbers them.
        ``chosen`` keeps the rows before the first *suspect* one and claims a suspect on
        its own. A suspect is a row still ``processing`` whose lease ran out (its claimer
        crashed or stalled mid-batch, maybe because of that very row) and that had been
        claimed before that (attempts >= 2): a batch orphaned once, say by a deploy that
        killed its dispatcher, is taken back whole; a row whose batch died twice is
        isolated, so a message that kills the process on every publish burns the
        attempts of its batch-mates twice at most, and then only its own.

        Ordered (``ordered=True``): rows go in insert order (:meth:`_order_columns`), and a
        keyed row is taken only when no earlier row of its key is in flight, backing off
        after a failure, or abandoned (until replayed or purged); ``claim`` serialises
        ordered claimers so that every batch is a prefix of each key's queue. On
        PostgreSQL a row is also dropped when an earlier row of its key is due but was
        skipped as locked (a slow holder whose lease ran out is recording its outcome
        right now): it may be about to back off.
        """
        t = self.table
        # Bound per execution (the statement is built once per broker and cached): the
        # claim token and the lease length. The clock is the database's.
        now: ColumnElement[Any] = self._now()
        until: ColumnElement[Any] = clock.db_later(self.is_postgres, "lease")
        o = t.alias("o")
        order = self._order_columns(o) if ordered else (o.c.next_attempt_at, o.c.id)
        labels = [f"o{i}" for i in range(len(order))]
        candidates: Select[Any] = select(
            o.c.id,
            o.c.key,
            and_(o.c.status == PROCESSING, o.c.attempts >= 2).label("suspect"),
            *(column.label(label) for column, label in zip(order, labels, strict=True)),
        ).where(
            o.c.broker == broker,
            # Pending, failed and processing rows: the partial index holds exactly these.
            _active(o),
            # One due time for all three: created_at, backoff deadline, lease deadline.
            o.c.next_attempt_at <= now,
        )
        if ordered:
            e = t.alias("e")
            held_earlier = exists().where(
                e.c.broker == o.c.broker,
                e.c.key == o.c.key,
                _active(e),
                # In flight (lease) or backing off (failed): the key waits for it.
                e.c.next_attempt_at > now,
                tuple_(*self._order_columns(e)) < tuple_(*order),
            )
            # An abandoned row blocks the later rows of its key until an operator replays
            # it (then it goes first) or deletes it: no silent gap in a key's order.
            a = t.alias("a")
            abandoned_earlier = exists().where(
                a.c.broker == o.c.broker,
                a.c.key == o.c.key,
                a.c.status.in_([literal_column(f"'{ABANDONED}'")]),
                tuple_(*self._order_columns(a)) < tuple_(*order),
            )
            candidates = candidates.where(
                or_(o.c.key.is_(None), and_(~held_earlier, ~abandoned_earlier))
            )
        candidates = candidates.order_by(*order).limit(limit)
        if self.is_postgres:
            candidates = candidates.with_for_update(skip_locked=True)
        locked = candidates.cte("locked")

        position = func.row_number().over(order_by=[locked.c[label] for label in labels])
        ranked_q: Select[Any] = select(locked.c.id, locked.c.suspect, position.label("rn"))
        if ordered and self.is_postgres:
            h = t.alias("h")
            skipped_earlier = exists().where(
                h.c.broker == broker,
                h.c.key == locked.c.key,
                _active(h),
                tuple_(*self._order_columns(h)) < tuple_(*(locked.c[label] for label in labels)),
                h.c.id.not_in(select(locked.c.id)),
            )
            ranked_q = ranked_q.where(or_(locked.c.key.is_(None), ~skipped_earlier))
        ranked = ranked_q.cte("ranked")
        first_suspect = select(func.min(ranked.c.rn)).where(ranked.c.suspect)
        chosen = (
            select(ranked.c.id)
            .where(
                or_(
                    ranked.c.rn == 1,
                    ranked.c.rn < func.coalesce(first_suspect.scalar_subquery(), limit + 1),
                )
            )
            .cte("chosen")
        )
        return (
            update(t)
            .where(t.c.id == chosen.c.id)
            .values(
                status=PROCESSING,
                locked_by=bindparam("token"),  # the fence: every later change must match it
                locked_until=until,
                next_attempt_at=until,  # an expired lease makes the row due again
                attempts=t.c.attempts + 1,  # counted at claim: crash loops still end
            )
            .returning(
                t.c.id,
                t.c.stream,
                t.c.type,
                t.c.key,
                cast(t.c.payload, Text),  # the stored JSON text, sent as is
                cast(t.c.headers, Text),
                t.c.attempts,
                t.c.created_at,
                # The retry deadline is judged by the database's clock, not the dispatcher's.
                clock.age_seconds(self.is_postgres, t.c.created_at),
                *self._order_columns(t),
            )
        )

    async def claim(
        self, broker: str, limit: int, token: str, lease_seconds: float, *, ordered: bool = False
    ) -> list[ClaimedRow]:
        """Claim up to ``limit`` due rows of ``broker`` for ``token``, oldest first (ordered:
        in insert order). A row whose batch died twice comes alone (see the statement)."""
        cache_key = (broker, limit, ordered)
        stmt = self._claims.get(cache_key)
        if stmt is None:
            stmt = self._claims[cache_key] = self._claim_statement(broker, limit, ordered)
        params: dict[str, Any] = {"token": token, "lease": self._offset(lease_seconds)}
        if self.is_postgres and not ordered:
            # One statement in autocommit: one round trip, no BEGIN/COMMIT.
            rows = await self._driver_fetch(f"claim:{broker}:{limit}", stmt, params)
        elif self.is_postgres and self.engine.dialect.driver == "asyncpg":
            rows = await self._ordered_claim_asyncpg(broker, limit, stmt, params)
        else:
            async with self.engine.connect() as conn:
                if self.is_postgres:
                    # Whatever the engine's default: the claim must see what other claims
                    # committed while it waited for its turn (a REPEATABLE READ snapshot is
                    # taken before the turn). Free on asyncpg: it is an option of BEGIN.
                    await conn.execution_options(isolation_level="READ COMMITTED")
                async with conn.begin():
                    if ordered and self.is_postgres:
                        # Ordered claimers of one table take turns: the claim statement then
                        # sees the rows the previous claim took as in flight, so each batch
                        # is a prefix of every key's queue and no two batches hold rows of
                        # one key. SQLite claims are serialised by its write lock already.
                        lock = func.hashtext(f"{self._lock_key}:{broker}")
                        await conn.execute(
                            select(*self._local_timeouts(), func.pg_advisory_xact_lock(lock))
                        )
                    rows = (await conn.execute(stmt, params)).all()
        claimed = [ClaimedRow(*row[:9]) for row in rows]
        if ordered:
            order = {row[0]: tuple(row[9:]) for row in rows}
            claimed.sort(key=lambda r: order[r.id])
        return claimed

    async def _ordered_claim_asyncpg(
        self, broker: str, limit: int, stmt: Any, params: dict[str, Any]
    ) -> Any:
        """The ordered claim's transaction on the asyncpg connection: the claimers' turn
        (an advisory lock, bounded by ``lock_timeout``) and the claim, in READ COMMITTED so
        the claim sees what the previous turn committed (see :meth:`claim`)."""
        lock = select(
            *self._local_timeouts(),
            func.pg_advisory_xact_lock(func.hashtext(f"{self._lock_key}:{broker}")),
        )
        lock_sql, lock_args = self._driver_args(f"ordered_lock:{broker}", lock, {})
        sql, args = self._driver_args(f"claim_ordered:{broker}:{limit}", stmt, params)
        async with (
            self._driver_connection() as driver,
            driver.transaction(isolation="read_committed"),
        ):
            await driver.execute(lock_sql, *lock_args, timeout=self.statement_timeout)
            return await driver.fetch(sql, *args, timeout=self.statement_timeout)

    async def mark_published(
        self, ids: Sequence[uuid.UUID], token: str, *, delete_rows: bool = False
    ) -> int:
        """Mark claimed rows published (or delete them); returns how many still held the
        claim: fewer than ``len(ids)`` means some leases were lost to another worker."""
        if not ids:
            return 0
        t = self.table
        name = "delete_published" if delete_rows else "mark_published"
        stmt = self._statements.get(name)
        if stmt is None:
            fence = and_(self._ids(), t.c.locked_by == bindparam("token"))
            if delete_rows:
                stmt = delete(t).where(fence)
            else:
                stmt = (
                    update(t)
                    .where(fence)
                    .values(
                        status=PUBLISHED,
                        published_at=self._now(),
                        locked_by=None,
                        locked_until=None,
                        last_error=None,
                    )
                )
            self._statements[name] = stmt
        params: dict[str, Any] = {"ids": list(ids), "token": token}
        if self.is_postgres:
            return await self._driver_execute(name, stmt, params)
        async with self._autocommit.begin() as conn:
            result = await conn.execute(stmt, params)
        return int(result.rowcount)

    async def mark_failed(self, failures: Sequence[Failure], token: str) -> int:
        """Record publish failures: back to ``failed`` with a due time, or ``abandoned``."""
        if not failures:
            return 0
        t = self.table
        now = self._now()
        status = bindparam("new_status", type_=t.c.status.type)
        due = clock.db_later(self.is_postgres, "delay")  # backoff by the database's clock
        stmt = (
            update(t)
            .where(t.c.id == bindparam("row_id"), t.c.locked_by == bindparam("token"))
            .values(
                status=status,
                next_attempt_at=due,
                last_error=bindparam("error"),
                locked_by=None,
                locked_until=None,
                abandoned_at=case((status == ABANDONED, now), else_=None),
            )
        )
        params = [
            {
                "row_id": f.id,
                "token": token,
                "new_status": ABANDONED if f.abandon else FAILED,
                "error": f.error[:ERROR_MAX_CHARS],
                "delay": self._offset(f.delay_seconds),
            }
            for f in failures
        ]
        if self.is_postgres and self.engine.dialect.driver == "asyncpg":
            # One transaction on the asyncpg connection (bounded, dropped when in doubt);
            # asyncpg's executemany reports no row count, and the count is how a caller
            # learns that a lease was lost: refusals are few, so one statement each.
            marked = 0
            async with self._driver_connection() as driver, driver.transaction():
                bounds = select(*self._local_timeouts())
                if self.statement_timeout is not None:
                    sql, args = self._driver_args("local_timeouts", bounds, {})
                    await driver.execute(sql, *args, timeout=self.statement_timeout)
                for param in params:
                    sql, args = self._driver_args("mark_failed", stmt, param)
                    status = await driver.execute(sql, *args, timeout=self.statement_timeout)
                    marked += int(status.rsplit(" ", 1)[-1])
            return marked
        async with self.engine.begin() as conn:
            if not self.is_postgres:
                result = await conn.execute(stmt, params)
                return int(result.rowcount)
            marked = 0
            for param in params:
                marked += int((await conn.execute(stmt, param)).rowcount)
        return marked

    async def release(
        self, ids: Sequence[uuid.UUID], token: str, *, refund_attempt: bool = True
    ) -> int:
        """Give claimed rows back, claimable at once (shutdown, broker unreachable). The
        attempt counted at claim is refunded: the message itself did not fail."""
        if not ids:
            return 0
        t = self.table
        stmt = (
            update(t)
            .where(self._ids(), t.c.locked_by == bindparam("token"))
            .values(
                status=case((t.c.status == PROCESSING, PENDING), else_=t.c.status),
                locked_by=None,
                locked_until=None,
                next_attempt_at=self._now(),
                attempts=t.c.attempts - (1 if refund_attempt else 0),
            )
        )
        params = {"ids": list(ids), "token": token}
        if self.is_postgres:
            name = "release_refund" if refund_attempt else "release"
            return await self._driver_execute(name, stmt, params)
        async with self._autocommit.begin() as conn:
            result = await conn.execute(stmt, params)
        return int(result.rowcount)

    async def extend_lease(self, ids: Sequence[uuid.UUID], token: str, lease_seconds: float) -> int:
        """Renew the lease of claimed rows for ``lease_seconds`` from now (the database's
        clock), fenced by the claim token; returns how many rows the claim still held. The
        processor renews a batch before trying its messages one by one after a publish
        timed out while the broker answered."""
        if not ids:
            return 0
        t = self.table
        until = clock.db_later(self.is_postgres, "lease")
        stmt = (
            update(t)
            .where(self._ids(), t.c.locked_by == bindparam("token"))
            .values(locked_until=until, next_attempt_at=until)
        )
        params = {"ids": list(ids), "token": token, "lease": self._offset(lease_seconds)}
        if self.is_postgres:
            return await self._driver_execute("extend_lease", stmt, params)
        async with self._autocommit.begin() as conn:
            result = await conn.execute(stmt, params)
        return int(result.rowcount)

    # -- observation -------------------------------------------------------------------------

    def _status_is(self, *statuses: str) -> ColumnElement[bool]:
        """``status IN ('a', 'b')`` with the values written into the SQL, not bound: a
        partial index serves a query only when its WHERE provably implies the index
        predicate, which a generic plan of a prepared ``status = $1`` never does."""
        values: list[ColumnElement[Any]] = [
            literal_column(f"'{MessageStatus(s).value}'") for s in statuses
        ]
        return self.table.c.status.in_(values)

    def stats_statements(self) -> dict[str, Any]:
        """The statements behind :meth:`stats`, each served by a partial index, so their
        cost follows the rows that still need work, not the published rows the table
        keeps (``benchmarks/health.py`` prints their plans)."""
        t = self.table
        return {
            # ix_<table>_due holds exactly the pending/processing/failed rows. For pending
            # rows the earliest due time tells how long a due row has waited.
            "active": select(t.c.broker, t.c.status, func.count(), func.min(t.c.next_attempt_at))
            .where(self._status_is(*_ACTIVE))
            .group_by(t.c.broker, t.c.status),
            # Ordered dispatch: the earliest due pending row that is not held back by an
            # earlier row of its key (failing, or in flight): those wait for that row,
            # not for a dispatcher. Served by ix_<table>_key.
            "waiting_ordered": self._waiting_ordered(),
            # Ordered dispatch: abandoned rows that block later rows of their key.
            "blocking_ordered": self._blocking_ordered(),
            # Delayed messages not due yet: a range of ix_<table>_due past now.
            "scheduled": select(t.c.broker, func.count())
            .where(self._status_is(PENDING), t.c.next_attempt_at > self._now())
            .group_by(t.c.broker),
            # ix_<table>_abandoned holds the abandoned rows.
            "abandoned": select(t.c.broker, func.count())
            .where(self._status_is(ABANDONED))
            .group_by(t.c.broker),
            # ix_<table>_published, range scan over the last minute only.
            "recent": select(t.c.broker, func.count())
            .where(self._status_is(PUBLISHED), t.c.published_at > self._later(-60.0))
            .group_by(t.c.broker),
            # Only for ``status`` (CLI): every published row, a full scan of that index.
            "published": select(t.c.broker, func.count())
            .where(self._status_is(PUBLISHED))
            .group_by(t.c.broker),
        }

    def _waiting_ordered(self) -> Any:
        t = self.table
        o, e, a = t.alias("o"), t.alias("e"), t.alias("a")
        held = exists().where(
            e.c.broker == o.c.broker,
            e.c.key == o.c.key,
            _active(e),
            e.c.status != PENDING,
            tuple_(*self._order_columns(e)) < tuple_(*self._order_columns(o)),
        )
        behind_abandoned = exists().where(
            a.c.broker == o.c.broker,
            a.c.key == o.c.key,
            self._status_is_alias(a, ABANDONED),
            tuple_(*self._order_columns(a)) < tuple_(*self._order_columns(o)),
        )
        return (
            select(o.c.broker, func.min(o.c.next_attempt_at))
            .where(
                o.c.status.in_([literal_column(f"'{PENDING}'")]),
                o.c.next_attempt_at <= self._now(),
                or_(o.c.key.is_(None), and_(~held, ~behind_abandoned)),
            )
            .group_by(o.c.broker)
        )

    def _blocking_ordered(self) -> Any:
        """Ordered dispatch: per broker, how many keys have rows waiting behind an abandoned
        row of the key, and the first such abandoned row. Walks the active keyed rows
        (ix_<table>_key: the backlog, not the table's history of abandoned rows), each
        with one probe of ix_<table>_abandoned_key."""
        t = self.table
        o, a = t.alias("o"), t.alias("a")
        first_abandoned = (
            select(cast(a.c.id, String))
            .where(
                a.c.broker == o.c.broker,
                a.c.key == o.c.key,
                self._status_is_alias(a, ABANDONED),
                tuple_(*self._order_columns(a)) < tuple_(*self._order_columns(o)),
            )
            .order_by(*self._order_columns(a))
            .limit(1)
            .scalar_subquery()
        )
        return (
            select(o.c.broker, func.count(distinct(o.c.key)), func.min(first_abandoned))
            .where(_active(o), o.c.key.is_not(None), first_abandoned.is_not(None))
            .group_by(o.c.broker)
        )

    @staticmethod
    def _status_is_alias(alias: Any, status: str) -> ColumnElement[bool]:
        """``alias.status IN ('status')``, the value in the SQL text (see :meth:`_status_is`)."""
        column: ColumnElement[str] = alias.c.status
        return column.in_([literal_column(f"'{MessageStatus(status).value}'")])

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
        out: dict[str, BrokerStats] = {name: BrokerStats(name) for name in brokers}

        def entry(name: str) -> BrokerStats:
            return out.setdefault(name, BrokerStats(name))

        statements = self.stats_statements()
        async with self._autocommit.connect() as conn:
            db_now = (await conn.execute(select(self._now()))).scalar_one()
            if isinstance(db_now, str):  # SQLite returns the bound literal as text
                db_now = dt.datetime.fromisoformat(db_now).replace(tzinfo=dt.UTC)
            for broker, status, count, oldest in await conn.execute(statements["active"]):
                s = entry(broker)
                setattr(s, status, int(count))
                if status == PENDING and oldest is not None and not ordered:
                    s.oldest_pending_age_seconds = _age(db_now, oldest)
            if ordered:
                for broker, oldest in await conn.execute(statements["waiting_ordered"]):
                    if oldest is not None:
                        entry(broker).oldest_pending_age_seconds = _age(db_now, oldest)
                for broker, count, first in await conn.execute(statements["blocking_ordered"]):
                    entry(broker).blocked_keys = int(count)
                    entry(broker).blocking_message = (
                        None if first is None else str(uuid.UUID(str(first)))
                    )
            for broker, count in await conn.execute(statements["abandoned"]):
                entry(broker).abandoned = int(count)
            for broker, count in await conn.execute(statements["scheduled"]):
                entry(broker).scheduled = int(count)
            for broker, count in await conn.execute(statements["recent"]):
                entry(broker).published_last_minute = int(count)
            if published_totals:
                for s in out.values():
                    s.published = 0
                for broker, count in await conn.execute(statements["published"]):
                    entry(broker).published = int(count)
        return out

    async def count_matching(
        self,
        status: str,
        *,
        stream: str | None = None,
        finished_before_seconds: float | None = None,
    ) -> int:
        """How many rows of ``status`` (in ``stream``; for published/abandoned rows,
        finished more than ``finished_before_seconds`` ago): the total of a progress bar."""
        t = self.table
        stmt = select(func.count()).select_from(t).where(self._status_is(status))
        if stream is not None:
            stmt = stmt.where(t.c.stream == stream)
        if finished_before_seconds is not None:
            column = t.c.published_at if status == PUBLISHED else t.c.abandoned_at
            stmt = stmt.where(column < self._later(-finished_before_seconds))
        async with self.engine.connect() as conn:
            return int((await conn.execute(stmt)).scalar_one())

    async def get(self, message_id: uuid.UUID) -> Mapping[str, Any] | None:
        t = self.table
        stmt = select(
            *[c for c in t.c if c.name not in ("payload", "headers")],
            cast(t.c.payload, Text).label("payload"),
            cast(t.c.headers, Text).label("headers"),
        ).where(t.c.id == message_id)
        async with self.engine.connect() as conn:
            row = (await conn.execute(stmt)).mappings().first()
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
        t = self.table
        cols = [c for c in t.c if c.name not in ("payload", "headers", "seq")]
        stmt = select(*cols).order_by(t.c.id.desc()).limit(limit)
        if scheduled:  # pending and not due yet: delayed messages
            stmt = stmt.where(self._status_is(PENDING), t.c.next_attempt_at > self._now())
        elif status is not None:
            stmt = stmt.where(self._status_is(status))
        for column, value in ((t.c.stream, stream), (t.c.broker, broker), (t.c.type, type_)):
            if value is not None:
                stmt = stmt.where(column == value)
        if key is not None:
            stmt = stmt.where(t.c.key == key)
        if since is not None:
            stmt = stmt.where(t.c.created_at >= since)
        if until is not None:
            stmt = stmt.where(t.c.created_at < until)
        if before_id is not None:
            stmt = stmt.where(t.c.id < before_id)
        async with self.engine.connect() as conn:
            return [dict(r) for r in (await conn.execute(stmt)).mappings().all()]

    async def stream_stats(self) -> list[dict[str, Any]]:
        """Counts per (broker, stream) of the rows that need work and of the abandoned ones,
        with the oldest due pending row per stream: from the partial indexes (the dashboard's
        overview; cheap on a table of published rows)."""
        t = self.table
        active = (
            select(
                t.c.broker,
                t.c.stream,
                t.c.status,
                func.count(),
                func.min(t.c.next_attempt_at),
            )
            .where(self._status_is(*_ACTIVE))
            .group_by(t.c.broker, t.c.stream, t.c.status)
        )
        abandoned = (
            select(t.c.broker, t.c.stream, func.count())
            .where(self._status_is(ABANDONED))
            .group_by(t.c.broker, t.c.stream)
        )
        # Delayed messages not due yet (included in pending): a range of ix_<table>_due.
        scheduled = (
            select(t.c.broker, t.c.stream, func.count())
            .where(self._status_is(PENDING), t.c.next_attempt_at > self._now())
            .group_by(t.c.broker, t.c.stream)
        )
        out: dict[tuple[str, str], dict[str, Any]] = {}

        def entry(broker: str, stream: str) -> dict[str, Any]:
            return out.setdefault(
                (broker, stream),
                {
                    "broker": broker,
                    "stream": stream,
                    PENDING: 0,
                    PROCESSING: 0,
                    FAILED: 0,
                    ABANDONED: 0,
                    "scheduled": 0,
                    "oldest_pending_age_seconds": None,
                },
            )

        async with self._autocommit.connect() as conn:
            db_now = (await conn.execute(select(self._now()))).scalar_one()
            if isinstance(db_now, str):
                db_now = dt.datetime.fromisoformat(db_now).replace(tzinfo=dt.UTC)
            for broker, stream, status, count, oldest in await conn.execute(active):
                e = entry(broker, stream)
                e[status] = int(count)
                if status == PENDING and oldest is not None:
                    e["oldest_pending_age_seconds"] = _age(db_now, oldest)
            for broker, stream, count in await conn.execute(abandoned):
                entry(broker, stream)[ABANDONED] = int(count)
            for broker, stream, count in await conn.execute(scheduled):
                entry(broker, stream)["scheduled"] = int(count)
        return sorted(out.values(), key=lambda e: (e["broker"], e["stream"]))

    async def published_per_minute(self, minutes: int = 60) -> list[tuple[dt.datetime, int]]:
        """Published rows per minute over the last ``minutes`` (a range scan of the
        published index), oldest first, minutes without any included as 0."""
        t = self.table
        if self.is_postgres:
            bucket: Any = func.date_trunc("minute", t.c.published_at)
        else:
            bucket = func.strftime("%Y-%m-%dT%H:%M", t.c.published_at)
        stmt = (
            select(bucket.label("minute"), func.count())
            .where(self._status_is(PUBLISHED), t.c.published_at > self._later(-60.0 * minutes))
            .group_by(bucket)
        )
        async with self._autocommit.connect() as conn:
            db_now = (await conn.execute(select(self._now()))).scalar_one()
            if isinstance(db_now, str):
                db_now = dt.datetime.fromisoformat(db_now).replace(tzinfo=dt.UTC)
            counts: dict[dt.datetime, int] = {}
            for minute, count in await conn.execute(stmt):
                if isinstance(minute, str):
                    minute = dt.datetime.fromisoformat(minute).replace(tzinfo=dt.UTC)
                counts[minute.replace(second=0, microsecond=0)] = int(count)
        end = db_now.replace(second=0, microsecond=0)
        start = end - dt.timedelta(minutes=minutes - 1)
        return [
            (start + dt.timedelta(minutes=i), counts.get(start + dt.timedelta(minutes=i), 0))
            for i in range(minutes)
        ]

    # -- administration ------------------------------------------------------------------------

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
        t = self.table
        target = select(t.c.id).where(t.c.status.in_(list(statuses)))
        if ids is not None:
            target = target.where(t.c.id.in_(list(ids)))
        if stream is not None:
            target = target.where(t.c.stream == stream)
        if limit is not None:
            target = target.order_by(t.c.id).limit(limit)
        if self.is_postgres:
            target = target.with_for_update(skip_locked=True)
        stmt = (
            update(t)
            .where(t.c.id.in_(target.scalar_subquery()))
            .values(
                status=PENDING,
                attempts=0,
                next_attempt_at=self._now(),
                locked_by=None,
                locked_until=None,
                abandoned_at=None,
                published_at=None,
            )
            .returning(t.c.id)
        )
        async with self.engine.begin() as conn:
            return list((await conn.execute(stmt)).scalars().all())

    async def next_due_in(self, broker: str) -> float | None:
        """Seconds until the earliest row of ``broker`` that needs work becomes due (a
        delayed message, a backoff, a lease), None when there is none: the idle poller
        sleeps that long at most. One read of ix_<table>_due."""
        t = self.table
        stmt = select(func.min(t.c.next_attempt_at)).where(
            t.c.broker == broker, self._status_is(*_ACTIVE), t.c.next_attempt_at > self._now()
        )
        async with self._autocommit.connect() as conn:
            db_now = (await conn.execute(select(self._now()))).scalar_one()
            due = (await conn.execute(stmt)).scalar_one()
        if due is None:
            return None
        if isinstance(db_now, str):
            db_now = dt.datetime.fromisoformat(db_now).replace(tzinfo=dt.UTC)
        if isinstance(due, str):
            due = dt.datetime.fromisoformat(due).replace(tzinfo=dt.UTC)
        seconds: float = (due - db_now).total_seconds()
        return max(0.0, seconds)

    async def cancel_unclaimed(self, ids: Sequence[uuid.UUID]) -> list[uuid.UUID]:
        """Delete pending rows no dispatcher holds (fenced against a concurrent claim: the
        claim's row lock is waited for, then the status is checked again). Returns the ids
        cancelled."""
        t = self.table
        stmt = (
            delete(t)
            .where(
                t.c.id.in_(list(ids)),
                t.c.status.in_([PENDING]),
                t.c.locked_by.is_(None),
            )
            .returning(t.c.id)
        )
        async with self.engine.begin() as conn:
            return list((await conn.execute(stmt)).scalars().all())

    async def abandon_unclaimed(self, ids: Sequence[uuid.UUID], error: str) -> list[uuid.UUID]:
        """An operator's abandon: stop retrying pending or failed rows that no dispatcher
        holds (fenced: a row claimed meanwhile is left to its claim). Returns the ids
        abandoned."""
        t = self.table
        stmt = (
            update(t)
            .where(
                t.c.id.in_(list(ids)),
                t.c.status.in_([PENDING, FAILED]),
                t.c.locked_by.is_(None),
            )
            .values(
                status=ABANDONED,
                abandoned_at=self._now(),
                last_error=error[:ERROR_MAX_CHARS],
                next_attempt_at=self._now(),
            )
            .returning(t.c.id)
        )
        async with self.engine.begin() as conn:
            return list((await conn.execute(stmt)).scalars().all())

    async def clock(self) -> dt.datetime:
        """The time every age is measured with (see ``_now``): the database's on
        PostgreSQL, the process's on SQLite."""
        if not self.is_postgres:
            return dt.datetime.now(dt.UTC)
        async with self.engine.connect() as conn:
            value = (await conn.execute(select(func.now()))).scalar_one()
        return value if value.tzinfo is not None else value.replace(tzinfo=dt.UTC)

    async def states(self, ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, tuple[str, bool]]:
        """(status, held by a dispatcher) of each of ``ids`` that exists: one statement for
        an operator's page of ids (the caller keeps ``ids`` to a page: one bind each)."""
        t = self.table
        stmt = select(t.c.id, t.c.status, t.c.locked_by).where(t.c.id.in_(list(ids)))
        async with self.engine.connect() as conn:
            rows = (await conn.execute(stmt)).all()
        return {row.id: (row.status, row.locked_by is not None) for row in rows}

    async def purge_batch(
        self, status: str, older_than_seconds: float, limit: int, *, keep_blocking: bool = False
    ) -> int:
        """Delete up to ``limit`` rows of ``status`` (published or abandoned) finished more
        than ``older_than_seconds`` ago. One short transaction: no long locks.
        ``keep_blocking``: keep the abandoned keyed rows that a later row of their key still
        waits for (ordered dispatch: deleting one would let its key go on with a gap)."""
        stmt = self.purge_statement(status, older_than_seconds, limit, keep_blocking=keep_blocking)
        async with self._autocommit.begin() as conn:
            result = await conn.execute(stmt)
        return int(result.rowcount)

    def purge_statement(
        self, status: str, older_than_seconds: float, limit: int, *, keep_blocking: bool = False
    ) -> Any:
        """The DELETE of :meth:`purge_batch` (``benchmarks/scale.py`` measures its WAL)."""
        t = self.table
        column = t.c.published_at if status == PUBLISHED else t.c.abandoned_at
        victims = (
            select(t.c.id)
            .where(t.c.status == status, column < self._later(-older_than_seconds))
            .limit(limit)
        )
        if keep_blocking:
            e = t.alias("e")
            waited_for = exists().where(
                e.c.broker == t.c.broker,
                e.c.key == t.c.key,
                _active(e),
                tuple_(*self._order_columns(e)) > tuple_(*self._order_columns(t)),
            )
            victims = victims.where(or_(t.c.key.is_(None), ~waited_for))
        if self.is_postgres:
            victims = victims.with_for_update(skip_locked=True)
        return delete(t).where(t.c.id.in_(victims.scalar_subquery()))

    async def abandon(self, ids: Sequence[uuid.UUID], token: str, error: str) -> int:
        """Abandon claimed rows without publishing (attempts exhausted by crashes, retry
        deadline passed)."""
        return await self.mark_failed(
            [Failure(id=i, error=error, delay_seconds=0.0, abandon=True) for i in ids], token
        )

    async def count(self, status: str | None = None) -> int:
        t = self.table
        stmt = select(func.count()).select_from(t)
        if status is not None:
            stmt = stmt.where(t.c.status == status)
        async with self.engine.connect() as conn:
            return int((await conn.execute(stmt)).scalar_one())

    async def notify(self, channel: str, payload: str) -> None:
        """``NOTIFY channel`` on a pooled connection, outside any business transaction."""
        async with self._autocommit.connect() as conn:
            await conn.execute(select(func.pg_notify(channel, payload)))

"""Claims and marks: the relay's statements on the outbox table, each run in as few round
trips as the driver allows.

A relay's cycle is three statements per batch: `Claims.claim` (one UPDATE …
RETURNING), `Claims.mark_published` (one UPDATE or DELETE over an id array) and, for
the few rows the broker refused, `Claims.mark_failed`. Every change after the claim is
*fenced* by the claim token. On asyncpg the claim and the marks run as prepared statements
on the driver connection (`Connector`), in
autocommit; on a table partitioned by id, the batch's own partition
(`PartitionMap`). The SQL is in
`fastapi_outbox.storage.statements.claims`.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import Table

from fastapi_outbox.storage.connector import Connector
from fastapi_outbox.storage.dialects import is_mysql
from fastapi_outbox.storage.mysql_claim import MysqlClaim
from fastapi_outbox.storage.partition_map import NIL, PartitionMap
from fastapi_outbox.storage.read_models import aware
from fastapi_outbox.storage.statements import claims as claims_sql
from fastapi_outbox.storage.statements import messages as messages_sql
from fastapi_outbox.storage.statements.parts import (
    ABANDONED,
    ERROR_MAX_CHARS,
    FAILED,
    batch_params,
    offset,
)

__all__ = ["ERROR_MAX_CHARS", "UNDEFINED_TABLE", "ClaimedRow", "Claims", "Failure"]

#: SQLSTATE of a relation that does not exist (a partition dropped under a cached range).
UNDEFINED_TABLE = "42P01"


@dataclasses.dataclass(slots=True)
class ClaimedRow:
    """A row taken by a claim: what the relay needs to publish it."""

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


class Claims:
    """A relay's claims and marks on one outbox table."""

    def __init__(self, connector: Connector, table: Table) -> None:
        self.connector = connector
        self.engine = connector.engine
        self.table = table
        self.dialect = connector.engine.dialect
        self.is_postgres = connector.is_postgres
        self.autocommit_engine = connector.autocommit_engine
        self._lock_key = f"fastapi_outbox:{table.name}"
        self._claims: dict[tuple[str, int, bool], Any] = {}
        self._statements: dict[str, Any] = {}
        #: A table partitioned by id, on asyncpg: the claim's floor and each batch's
        #: partition (see `fastapi_outbox.storage.partition_map`).
        self.partition_map = (
            PartitionMap(self.engine, table) if self._by_id and connector.asyncpg else None
        )
        #: MariaDB/MySQL: the claim in two steps (no UPDATE … RETURNING there).
        self._mysql = MysqlClaim(self.engine, table) if is_mysql(self.engine) else None

    @property
    def statement_timeout(self) -> float | None:
        """The relay's statement bound (seconds; see `set_timeouts`)."""
        return self.connector.statement_timeout

    @property
    def lock_timeout(self) -> float | None:
        """The relay's lock-wait bound (seconds; see `set_timeouts`)."""
        return self.connector.lock_timeout

    def set_timeouts(self, statement_seconds: float, lock_seconds: float) -> None:
        """Bound the relay's statements: the driver-level ones (claim, mark) get a
        client-side command timeout (asyncpg then cancels the query on the server), and
        the relay's transactions (the ordered claim, recording failures) set
        ``statement_timeout``, ``lock_timeout`` and ``idle_in_transaction_session_timeout``
        locally, so neither a frozen database nor a frozen relay holding the ordered
        claimers' lock can stall dispatch for longer than that."""
        self.connector.statement_timeout = statement_seconds
        self.connector.lock_timeout = lock_seconds

    def local_timeouts(self) -> list[Any]:
        """The ``set_config`` calls of `set_timeouts` for the current transaction
        (see `local_timeouts`)."""
        return claims_sql.local_timeouts(*self.connector.bounds_ms())

    def _cached(self, name: str, build: Any) -> Any:
        stmt = self._statements.get(name)
        if stmt is None:
            stmt = self._statements[name] = build()
        return stmt

    def claim_statement(self, broker: str, limit: int, ordered: bool) -> Any:
        """The claim of ``broker``'s rows, built once per (broker, limit, ordered) (see
        `claim`); bound per execution:
        ``token`` and ``lease`` (`claim_params`)."""
        key = (broker, limit, ordered)
        stmt = self._claims.get(key)
        if stmt is None:
            stmt = self._claims[key] = claims_sql.claim(
                self.table, broker, limit, ordered, self.dialect
            )
        return stmt

    def claim_params(
        self, token: str, lease_seconds: float, floor: uuid.UUID = NIL
    ) -> dict[str, Any]:
        """The per-execution parameters of `claim_statement` (``floor``: see
        `has_floor`; the nil UUID prunes
        nothing)."""
        return {"token": token, "lease": offset(self.dialect, lease_seconds), "floor": floor}

    async def claim(
        self, broker: str, limit: int, token: str, lease_seconds: float, *, ordered: bool = False
    ) -> list[ClaimedRow]:
        """Claim up to ``limit`` due rows of ``broker`` for ``token``, oldest first (ordered:
        in insert order). A row whose batch died twice comes alone (see the statement)."""
        if self._mysql is not None:
            lease = offset(self.dialect, lease_seconds)
            rows = await self._mysql.claim(broker, limit, token, lease, ordered=ordered)
            return [ClaimedRow(*row[: claims_sql.CLAIM_COLUMNS]) for row in rows]
        stmt = self.claim_statement(broker, limit, ordered)
        pmap = None if ordered else self.partition_map
        floor = NIL if pmap is None else await pmap.next_floor(broker)
        params = self.claim_params(token, lease_seconds, floor)
        if self.is_postgres and not ordered and self.connector.asyncpg and self._by_id:
            # A table partitioned by id: its cached generic plan (see claims_sql.generic_plan).
            generic = ("generic_plan", claims_sql.generic_plan())
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
        claimed = [ClaimedRow(*row[: claims_sql.CLAIM_COLUMNS]) for row in rows]
        if ordered:
            order = {row[0]: tuple(row[claims_sql.CLAIM_COLUMNS :]) for row in rows}
            claimed.sort(key=lambda r: order[r.id])
        return claimed

    def _ordered_turn(self, broker: str) -> Any:
        return claims_sql.ordered_turn(
            self._lock_key,
            broker,
            *self.connector.bounds_ms(),
            generic=self._by_id and self.connector.asyncpg,
        )

    @property
    def _by_id(self) -> bool:
        """A PostgreSQL table partitioned by id (see ``claims_sql.generic_plan``)."""
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
            lambda t: claims_sql.mark_published(t, self.dialect, delete_rows=delete_rows),
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
        batch's own partition when a `partition_map` knows it (a plain table's
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
        stmt = self._cached("mark_failed", lambda: claims_sql.mark_failed(self.table, self.dialect))
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
            bounds = claims_sql.transaction_bounds(*self.connector.bounds_ms())
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
            lambda t: claims_sql.release(t, self.dialect, refund_attempt=refund_attempt),
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
            "extend_lease", ids, lambda t: claims_sql.extend_lease(t, self.dialect), params
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
            db_now = (await conn.execute(messages_sql.database_now(self.dialect))).scalar_one()
            due = (
                await conn.execute(claims_sql.next_due(self.table, broker, self.dialect))
            ).scalar_one()
        if due is None:
            return None
        return max(0.0, (aware(due) - aware(db_now)).total_seconds())

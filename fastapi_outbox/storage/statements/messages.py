"""The statements behind what operators see and do: counts for health, metrics, the
dashboard and ``status``; listing and showing messages; replay, cancel, abandon.

Run by `Messages` (the methods of the same names:
``stats``, ``stream_stats``,
``published_per_minute``, ``count_matching``, ``get``, ``list_messages``, ``states``,
``replay``, ``cancel_unclaimed``, ``abandon_unclaimed``, ``count``). The counts read the
partial indexes (ix_<table>_due, _abandoned, _published, _key), so they cost what the rows
that still need work cost, not the table's history of published rows; statuses are SQL
literals (`status_in`) so those indexes serve
prepared statements too.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy import (
    Select,
    String,
    Table,
    Text,
    and_,
    cast,
    delete,
    distinct,
    exists,
    func,
    literal_column,
    or_,
    select,
    tuple_,
    update,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.sql.elements import ColumnElement

from fastapi_outbox.storage.dialects import is_mysql, is_postgres
from fastapi_outbox.storage.filters import SCHEDULED, MessageFilter
from fastapi_outbox.storage.statements.parts import (
    ABANDONED,
    ACTIVE,
    ERROR_MAX_CHARS,
    FAILED,
    PENDING,
    PUBLISHED,
    active,
    later,
    now,
    order_columns,
    status_in,
)

__all__ = [
    "abandon_unclaimed",
    "blocking_ordered",
    "cancel_unclaimed",
    "count",
    "count_matching",
    "database_now",
    "get",
    "list_messages",
    "ping",
    "published_per_minute",
    "replay",
    "replay_target",
    "replay_values",
    "states",
    "stats",
    "stream_stats",
    "waiting_ordered",
]


def ping() -> Select[Any]:
    """``SELECT 1``: the health check's and ``Store.ping``'s proof that the database answers."""
    return select(1)


def database_now(dialect: Dialect) -> Select[Any]:
    """``SELECT now()`` (the database's clock): every age the counts report is measured
    against it, never against the process's clock."""
    return select(now(dialect))


def stats(table: Table, dialect: Dialect) -> dict[str, Any]:
    """The statements behind ``Messages.stats`` (health endpoint, metrics, ``status``), each
    served by a partial index (``benchmarks/health.py`` prints their plans)."""
    t = table
    return {
        # ix_<table>_due holds exactly the pending/processing/failed rows. For pending rows
        # the earliest due time tells how long a due row has waited.
        "active": select(t.c.broker, t.c.status, func.count(), func.min(t.c.next_attempt_at))
        .where(status_in(t, *ACTIVE))
        .group_by(t.c.broker, t.c.status),
        # Ordered dispatch: the earliest due pending row that is not held back by an earlier
        # row of its key: those wait for that row, not for a relay.
        "waiting_ordered": waiting_ordered(table, dialect),
        # Ordered dispatch: abandoned rows that block later rows of their key.
        "blocking_ordered": blocking_ordered(table, dialect),
        # Delayed messages not due yet: a range of ix_<table>_due past now.
        "scheduled": select(t.c.broker, func.count())
        .where(status_in(t, PENDING), t.c.next_attempt_at > now(dialect))
        .group_by(t.c.broker),
        # ix_<table>_abandoned holds the abandoned rows.
        "abandoned": select(t.c.broker, func.count())
        .where(status_in(t, ABANDONED))
        .group_by(t.c.broker),
        # ix_<table>_published, a range scan over the last minute only.
        "recent": select(t.c.broker, func.count())
        .where(status_in(t, PUBLISHED), t.c.published_at > later(dialect, -60.0))
        .group_by(t.c.broker),
        # Only for ``status`` (CLI): every published row, a full scan of that index.
        "published": select(t.c.broker, func.count())
        .where(status_in(t, PUBLISHED))
        .group_by(t.c.broker),
    }


def waiting_ordered(table: Table, dialect: Dialect) -> Select[Any]:
    """Ordered dispatch (``stats``): per broker, the earliest due time of the pending rows
    a relay could take now — not held by an earlier row of their key in flight or
    failing (``e``: active, not pending, earlier in insert order), nor behind an abandoned
    one (``a``). Served by ix_<table>_key."""
    t = table
    o, e, a = t.alias("o"), t.alias("e"), t.alias("a")
    held = exists().where(
        e.c.broker == o.c.broker,
        e.c.key == o.c.key,
        active(e),
        e.c.status != PENDING,
        tuple_(*order_columns(e, dialect)) < tuple_(*order_columns(o, dialect)),
    )
    behind_abandoned = exists().where(
        a.c.broker == o.c.broker,
        a.c.key == o.c.key,
        status_in(a, ABANDONED),
        tuple_(*order_columns(a, dialect)) < tuple_(*order_columns(o, dialect)),
    )
    return (
        select(o.c.broker, func.min(o.c.next_attempt_at))
        .where(
            o.c.status.in_([literal_column(f"'{PENDING}'")]),
            # Due now: a delayed message is not waiting for a relay.
            o.c.next_attempt_at <= now(dialect),
            or_(o.c.key.is_(None), and_(~held, ~behind_abandoned)),
        )
        .group_by(o.c.broker)
    )


def blocking_ordered(table: Table, dialect: Dialect) -> Select[Any]:
    """Ordered dispatch (``stats``): per broker, how many keys have rows waiting behind an
    abandoned row of the key, and the first such abandoned row. Walks the active keyed rows
    (ix_<table>_key: the backlog, not the table's history of abandoned rows), each with one
    probe of ix_<table>_abandoned_key (ORDER BY insert order, LIMIT 1: the first blocker)."""
    t = table
    o, a = t.alias("o"), t.alias("a")
    first_abandoned = (
        select(cast(a.c.id, String))
        .where(
            a.c.broker == o.c.broker,
            a.c.key == o.c.key,
            status_in(a, ABANDONED),
            tuple_(*order_columns(a, dialect)) < tuple_(*order_columns(o, dialect)),
        )
        .order_by(*order_columns(a, dialect))
        .limit(1)
        .scalar_subquery()
    )
    return (
        select(o.c.broker, func.count(distinct(o.c.key)), func.min(first_abandoned))
        .where(active(o), o.c.key.is_not(None), first_abandoned.is_not(None))
        .group_by(o.c.broker)
    )


def stream_stats(table: Table, dialect: Dialect) -> dict[str, Select[Any]]:
    """The dashboard's overview (``Messages.stream_stats``): per (broker, stream), the active
    rows by status with the earliest due time (ix_<table>_due), the abandoned rows
    (ix_<table>_abandoned), and the delayed messages not due yet (a range of the due index
    past now)."""
    t = table
    return {
        "active": select(
            t.c.broker, t.c.stream, t.c.status, func.count(), func.min(t.c.next_attempt_at)
        )
        .where(status_in(t, *ACTIVE))
        .group_by(t.c.broker, t.c.stream, t.c.status),
        "abandoned": select(t.c.broker, t.c.stream, func.count())
        .where(status_in(t, ABANDONED))
        .group_by(t.c.broker, t.c.stream),
        "scheduled": select(t.c.broker, t.c.stream, func.count())
        .where(status_in(t, PENDING), t.c.next_attempt_at > now(dialect))
        .group_by(t.c.broker, t.c.stream),
    }


def published_per_minute(table: Table, minutes: int, dialect: Dialect) -> Select[Any]:
    """Published rows per minute over the last ``minutes`` (the dashboard's chart): a range
    scan of ix_<table>_published, grouped by the minute (``date_trunc`` on PostgreSQL, the
    text prefix of the stored time on SQLite)."""
    t = table
    if is_postgres(dialect):
        bucket: Any = func.date_trunc("minute", t.c.published_at)
    elif is_mysql(dialect):
        bucket = func.date_format(t.c.published_at, "%Y-%m-%dT%H:%i")
    else:
        bucket = func.strftime("%Y-%m-%dT%H:%M", t.c.published_at)
    return (
        select(bucket.label("minute"), func.count())
        .where(status_in(t, PUBLISHED), t.c.published_at > later(dialect, -60.0 * minutes))
        .group_by(bucket)
    )


def count_matching(
    table: Table,
    status: str,
    dialect: Dialect,
    *,
    stream: str | None = None,
    finished_before_seconds: float | None = None,
) -> Select[Any]:
    """How many rows of ``status`` (in ``stream``; for published/abandoned rows, finished
    more than ``finished_before_seconds`` ago): the total of an operator's progress bar
    (purge, replay). The literal status lets the partial index of that status serve it."""
    t = table
    stmt = select(func.count()).select_from(t).where(status_in(t, status))
    if stream is not None:
        stmt = stmt.where(t.c.stream == stream)
    if finished_before_seconds is not None:
        column = t.c.published_at if status == PUBLISHED else t.c.abandoned_at
        stmt = stmt.where(column < later(dialect, -finished_before_seconds))
    return stmt


def count(table: Table, status: str | None = None) -> Select[Any]:
    """Rows of ``status`` (every row without one): tests and scripts, never a hot path."""
    stmt = select(func.count()).select_from(table)
    if status is not None:
        stmt = stmt.where(table.c.status == status)
    return stmt


def get(table: Table, message_id: uuid.UUID) -> Select[Any]:
    """One message by its primary key (``show``, the dashboard's message page), payload and
    headers as their stored JSON text."""
    t = table
    return select(
        *[c for c in t.c if c.name not in ("payload", "headers")],
        cast(t.c.payload, Text).label("payload"),
        cast(t.c.headers, Text).label("headers"),
    ).where(t.c.id == message_id)


def list_messages(
    table: Table,
    dialect: Dialect,
    where: MessageFilter,
    *,
    before_id: uuid.UUID | None = None,
    limit: int = 50,
) -> Select[Any]:
    """Rows without payloads, newest first by id (UUIDv7 ids are time-ordered): ``list``,
    the dashboard's tables. Keyset pagination: ``id < before_id`` is one primary-key range
    scan however deep the page, never OFFSET over millions of rows. ``where``: equality on
    ``stream``/``broker``/``type``/``key``, ``since``/``until`` bound ``created_at``; the
    status ``scheduled`` means pending rows not yet due (delayed messages)."""
    t = table
    cols = [c for c in t.c if c.name not in ("payload", "headers", "seq")]
    stmt = select(*cols).order_by(t.c.id.desc()).limit(limit)
    if where.status == SCHEDULED:
        stmt = stmt.where(status_in(t, PENDING), t.c.next_attempt_at > now(dialect))
    elif where.status is not None:
        stmt = stmt.where(status_in(t, where.status))
    for name, value in where.equalities().items():
        if value is not None:
            stmt = stmt.where(t.c[name] == value)
    if where.since is not None:
        stmt = stmt.where(t.c.created_at >= where.since)
    if where.until is not None:
        stmt = stmt.where(t.c.created_at < where.until)
    if before_id is not None:
        stmt = stmt.where(t.c.id < before_id)
    return stmt


def states(table: Table, ids: Sequence[uuid.UUID]) -> Select[Any]:
    """(id, status, locked_by) of an operator's page of ids: one statement, one bind each
    (the caller keeps ``ids`` to a page)."""
    t = table
    return select(t.c.id, t.c.status, t.c.locked_by).where(t.c.id.in_(list(ids)))


def replay_target(
    table: Table,
    dialect: Dialect,
    ids: Sequence[uuid.UUID] | None = None,
    *,
    stream: str | None = None,
    statuses: Sequence[str] = (ABANDONED,),
    limit: int | None = None,
) -> Select[Any]:
    """The ids `replay` moves: rows in ``statuses`` (among ``ids``, in ``stream``);
    ``ORDER BY id LIMIT`` makes a bulk replay go in batches, oldest first; ``FOR UPDATE
    SKIP LOCKED`` (PostgreSQL, MySQL): a row another operator or a purge holds is left to
    it. MySQL runs it on its own first (see `replay`)."""
    t = table
    target = select(t.c.id).where(t.c.status.in_(list(statuses)))
    if ids is not None:
        target = target.where(t.c.id.in_(list(ids)))
    if stream is not None:
        target = target.where(t.c.stream == stream)
    if limit is not None:
        target = target.order_by(t.c.id).limit(limit)
    if is_postgres(dialect) or is_mysql(dialect):
        target = target.with_for_update(skip_locked=True)
    return target


def replay_values(dialect: Dialect) -> dict[str, Any]:
    """What `replay` sets: pending, attempts reset, due now; lease, finish times and
    the error cleared."""
    return {
        "status": PENDING,
        "attempts": 0,
        "next_attempt_at": now(dialect),
        "locked_by": None,
        "locked_until": None,
        "abandoned_at": None,
        "published_at": None,
    }


def replay(
    table: Table,
    dialect: Dialect,
    ids: Sequence[uuid.UUID] | None = None,
    *,
    stream: str | None = None,
    statuses: Sequence[str] = (ABANDONED,),
    limit: int | None = None,
) -> Any:
    """Move rows (abandoned by default) back to pending with attempts reset, due now
    (``replay``), returning the ids moved. The target subquery: `replay_target`.
    Lease, finish times and the error are cleared. MySQL (no ``UPDATE … RETURNING``, no
    subquery on the updated table): ``Messages.replay`` locks `replay_target`'s
    rows first, then updates them by id with `replay_values`."""
    t = table
    target = replay_target(t, dialect, ids, stream=stream, statuses=statuses, limit=limit)
    chosen: ColumnElement[bool] = t.c.id.in_(target.scalar_subquery())
    if ids is not None:
        # Also on the update itself: a table partitioned by id then reads the partitions
        # of these ids only (pruned on the list), not every partition for the semi-join.
        chosen = and_(chosen, t.c.id.in_(list(ids)))
    return update(t).where(chosen).values(**replay_values(dialect)).returning(t.c.id)


def cancel_unclaimed(table: Table, ids: Sequence[uuid.UUID], *, returning: bool = True) -> Any:
    """Delete pending rows no relay holds (``cancel``), returning the ids deleted.
    ``status = pending`` and ``locked_by IS NULL`` are the fence against a concurrent
    claim: the DELETE waits for the claim's row lock, then checks them again."""
    t = table
    stmt = delete(t).where(
        t.c.id.in_(list(ids)), t.c.status.in_([PENDING]), t.c.locked_by.is_(None)
    )
    return stmt.returning(t.c.id) if returning else stmt


def abandon_unclaimed(
    table: Table,
    ids: Sequence[uuid.UUID],
    error: str,
    dialect: Dialect,
    *,
    returning: bool = True,
) -> Any:
    """An operator's abandon (``abandon``): stop retrying pending or failed rows that no
    relay holds (``locked_by IS NULL``: a row claimed meanwhile is left to its claim),
    returning the ids abandoned. ``abandoned_at`` by the database's clock starts the
    abandoned retention; the error says who abandoned it."""
    t = table
    stmt = (
        update(t)
        .where(t.c.id.in_(list(ids)), t.c.status.in_([PENDING, FAILED]), t.c.locked_by.is_(None))
        .values(
            status=ABANDONED,
            abandoned_at=now(dialect),
            last_error=error[:ERROR_MAX_CHARS],
            next_attempt_at=now(dialect),
        )
    )
    return stmt.returning(t.c.id) if returning else stmt

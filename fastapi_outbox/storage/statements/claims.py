"""The table relay's statements: the claim, the marks after a publish, the release, the
lease extension, the idle poller's next due time, and the WAL relay's refused rows.

Caller: `fastapi_outbox.relay.table.TableRelay` through
`Store` (``claim``, ``mark_published``, ``mark_failed``,
``release``, ``extend_lease``, ``abandon``, ``next_due_in``) and
`fastapi_outbox.relay.wal.WalRelay` (``insert_failed``).

MariaDB and MySQL have no ``UPDATE … RETURNING``: their claim is `claim_candidates`
(a locking read per active status, one ``UNION ALL``), `earliest_active` (ordered)
and `claim_rows`, in one transaction (`fastapi_outbox.storage.mysql_claim`).

Every change after the claim is *fenced*: it only touches rows whose ``locked_by`` still
equals the claim token, so a worker whose lease expired can never overwrite a newer claim
— not even a later claim of the same worker (the token is new for every claim). Every
builder is pure (a table and a dialect in, a statement out): ``tests/unit`` compiles them.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    ARRAY,
    Boolean,
    Interval,
    Select,
    Table,
    Text,
    Uuid,
    and_,
    any_,
    bindparam,
    case,
    cast,
    delete,
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

from fastapi_outbox.storage import clock
from fastapi_outbox.storage.dialects import flavor, is_mysql, is_postgres
from fastapi_outbox.storage.statements.parts import (
    ABANDONED,
    ACTIVE,
    PENDING,
    PROCESSING,
    PUBLISHED,
    active,
    ids_in,
    now,
    order_columns,
    status_in,
)

__all__ = [
    "CLAIM_COLUMNS",
    "claim",
    "claim_candidates",
    "claim_rows",
    "claim_turn",
    "earliest_active",
    "extend_lease",
    "generic_plan",
    "has_floor",
    "insert_failed",
    "local_timeouts",
    "mark_failed",
    "mark_published",
    "next_due",
    "ordered_turn",
    "release",
    "transaction_bounds",
]

#: The claim returns these columns first (a `ClaimedRow`
#: each), then the insert-order columns that sort an ordered batch.
CLAIM_COLUMNS = 9


def claim(table: Table, broker: str, limit: int, ordered: bool, dialect: Dialect) -> Any:
    """The claim: one ``UPDATE … RETURNING`` over three CTEs (caller: ``Store.claim``, once
    per batch and per worker of a relay; built once per (broker, limit, ordered)).

    ``locked``: up to ``limit`` due rows in claim order (``FOR UPDATE SKIP LOCKED`` on
    PostgreSQL, so concurrent claimers take disjoint batches). ``ranked`` numbers them.
    ``chosen`` keeps the rows before the first *suspect* one and claims a suspect on its
    own. A suspect is a row still ``processing`` whose lease ran out (its claimer crashed
    or stalled mid-batch, maybe because of that very row) and that had been claimed before
    that (attempts >= 2): a batch orphaned once, say by a deploy that killed its
    relay, is taken back whole; a row whose batch died twice is isolated, so a
    message that kills the process on every publish burns the attempts of its batch-mates
    twice at most, and then only its own.

    Ordered (``ordered=True``): rows go in insert order (`order_columns`), and a keyed
    row is taken only when no earlier row of its key is in flight, backing off after a
    failure, or abandoned (until replayed or purged); ``Store.claim`` serialises ordered
    claimers (`ordered_turn`) so that every batch is a prefix of each key's queue.
    On PostgreSQL a row is also dropped when an earlier row of its key is due but was
    skipped as locked (a slow holder whose lease ran out is recording its outcome right
    now): it may be about to back off.

    Bound per execution: ``token`` (the claim token) and ``lease`` (see
    `offset`); unordered, on a table
    partitioned by id, ``floor`` too (`has_floor`).
    """
    t = table
    pg = is_postgres(dialect)
    locked = _locked(t, broker, limit, ordered, dialect).cte("locked")
    labels = _labels(t, ordered, dialect)
    chosen = _chosen(_ranked(t, broker, locked, labels, ordered, dialect), limit)
    # The lease's end, by the database's clock: one clock for every claimer.
    until = clock.db_later(pg, "lease")
    target = _chosen_rows(t, chosen, dialect)
    if has_floor(t, ordered, dialect):
        target = and_(target, _floor(t))
    return (
        update(t)
        # Only the chosen rows; they are locked by ``locked`` until this statement ends.
        .where(target)
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
            # The retry deadline is judged by the database's clock, not the relay's.
            clock.age_seconds(pg, t.c.created_at),
            # Ordered: the caller sorts the batch by these (RETURNING has no order).
            *order_columns(t, dialect),
        )
    )


def has_floor(table: Table, ordered: bool, dialect: Dialect) -> bool:
    """Whether the claim takes ``id >= $floor`` (its candidates and its update): unordered
    on a PostgreSQL table partitioned by id. A parameter of the statement itself, so a
    generic plan prunes the partitions below it before setting up their scans (see
    `fastapi_outbox.storage.partition_map`; the nil UUID prunes nothing). Never the
    ordered claim: a row below the floor would let the later rows of its key overtake it."""
    return is_postgres(dialect) and not ordered and table.info.get("partitioning") is not None


def _floor(alias: Any) -> ColumnElement[bool]:
    floor: ColumnElement[bool] = alias.c.id >= bindparam("floor", type_=Uuid())
    return floor


def _chosen_rows(table: Table, chosen: Any, dialect: Dialect) -> ColumnElement[bool]:
    """The claim's update: the rows of ``chosen``. A plain table joins them by id (a nested
    loop over the primary key).

    A table partitioned by id takes them as ``id = ANY(<the chosen ids, one array>)``
    between the smallest and the largest of them, three values computed once (init plans)
    before the update's Append of partitions starts: PostgreSQL prunes it on that range at
    run time ("never executed" for the other partitions), so the batch is read by one
    primary-key scan of its partition (two around a boundary), as the marks are. A join
    would be pruned per row too, but the planner prices it as a probe of every partition
    per row (~250,000 for 500 rows on 30 partitions): it then prefers a hash join over a
    scan of every partition, or JIT-compiles the claim at each execution."""
    t = table
    if not is_postgres(dialect) or t.info.get("partitioning") is None:
        joined: ColumnElement[bool] = t.c.id == chosen.c.id
        return joined
    # CAST: ``= ANY ((SELECT …))``, an array value, not ``= ANY (SELECT …)`` over rows.
    ids = cast(select(func.array_agg(chosen.c.id)).scalar_subquery(), ARRAY(Uuid()))
    lo = select(chosen.c.id).order_by(chosen.c.id).limit(1).scalar_subquery()
    hi = select(chosen.c.id).order_by(chosen.c.id.desc()).limit(1).scalar_subquery()
    return and_(t.c.id == any_(ids), t.c.id >= lo, t.c.id <= hi)


def _claim_order(alias: Any, ordered: bool, dialect: Dialect) -> tuple[Any, ...]:
    """Claim order: insert order when ordered, else due time then id (oldest first; the id
    breaks ties so the order is total and the index order)."""
    return order_columns(alias, dialect) if ordered else (alias.c.next_attempt_at, alias.c.id)


def _labels(table: Table, ordered: bool, dialect: Dialect) -> list[str]:
    return [f"o{i}" for i in range(len(_claim_order(table.alias("o"), ordered, dialect)))]


def _locked(table: Table, broker: str, limit: int, ordered: bool, dialect: Dialect) -> Any:
    """The ``locked`` CTE of `claim`: the candidates, locked."""
    o = table.alias("o")
    order = _claim_order(o, ordered, dialect)
    labels = _labels(table, ordered, dialect)
    due_now = now(dialect)
    candidates: Select[Any] = select(
        o.c.id,
        o.c.key,
        # A row orphaned by a claimer a second time: claimed alone (see ``chosen``).
        and_(o.c.status == PROCESSING, o.c.attempts >= 2).label("suspect"),
        *(column.label(label) for column, label in zip(order, labels, strict=True)),
    ).where(
        # The relay's own broker: one relay per (database, broker); the index's first column.
        o.c.broker == broker,
        # Pending, failed and processing rows: the partial index holds exactly these.
        active(o),
        # One due time for all three: created_at, backoff deadline, lease deadline.
        o.c.next_attempt_at <= due_now,
    )
    if ordered:
        candidates = candidates.where(_key_may_go(table, o, order, due_now, dialect))
    if has_floor(table, ordered, dialect):
        candidates = candidates.where(_floor(o))
    # Oldest first (the index order, so the LIMIT stops early), a batch at most.
    candidates = candidates.order_by(*order).limit(limit)
    if is_postgres(dialect) or is_mysql(dialect):
        # Concurrent claimers skip each other's rows instead of waiting: disjoint batches.
        # SQLite needs none: its one writer holds the write lock (BEGIN IMMEDIATE).
        candidates = candidates.with_for_update(skip_locked=True)
    return candidates


def claim_candidates(
    table: Table, broker: str, limit: int, ordered: bool, status: str, dialect: Dialect
) -> Select[Any]:
    """MySQL's claim, first statement (caller: ``Claims.claim``, once per active status, in
    one READ COMMITTED transaction): up to ``limit`` due rows of ``broker`` in ``status``,
    in claim order, locked ``FOR UPDATE SKIP LOCKED`` (concurrent claimers take disjoint
    rows, as on PostgreSQL), with what the relay publishes.

    One status per statement: MySQL has no partial index, and its claim index
    ``(broker, status, next_attempt_at, id)`` serves ``ORDER BY … LIMIT`` for one status
    only (an ``IN`` of three would sort every due row first). The caller merges the three
    in claim order, keeps ``limit``, applies the suspect rule of `claim` and marks
    them with `claim_rows` (MySQL has no ``UPDATE … RETURNING``).

    Columns: `CLAIM_COLUMNS` of a claimed row (``attempts`` as stored: the caller adds
    the one the update counts), ``suspect``, then the claim order's columns."""
    o = table.alias("o")
    order = _claim_order(o, ordered, dialect)
    due_now = now(dialect)
    candidates: Select[Any] = select(
        o.c.id,
        o.c.stream,
        o.c.type,
        o.c.key,
        o.c.payload,
        o.c.headers,
        o.c.attempts,
        o.c.created_at,
        # The retry deadline is judged by the database's clock, not the relay's.
        clock.age_seconds(flavor(dialect), o.c.created_at),
        and_(o.c.status == PROCESSING, o.c.attempts >= 2).label("suspect"),
        *order,
    ).where(
        o.c.broker == broker,
        o.c.status.in_([literal_column(f"'{status}'")]),
        o.c.next_attempt_at <= due_now,
    )
    if ordered:
        candidates = candidates.where(_key_may_go(table, o, order, due_now, dialect))
    return candidates.order_by(*order).limit(limit).with_for_update(skip_locked=True)


def claim_rows(table: Table, dialect: Dialect) -> Any:
    """MySQL's claim, second statement (after `claim_candidates`, in its transaction):
    the chosen rows (``ids``, locked by the first) become ``processing`` for ``token``
    until ``lease`` from the database's now, with one more attempt, as `claim` does."""
    t = table
    until = clock.db_later(flavor(dialect), "lease")
    return (
        update(t)
        .where(ids_in(t, dialect))
        .values(
            status=PROCESSING,
            locked_by=bindparam("token"),
            locked_until=until,
            next_attempt_at=until,
            attempts=t.c.attempts + 1,
        )
    )


def earliest_active(table: Table, broker: str) -> Select[Any]:
    """MySQL, ordered claim, in the claim's transaction after `claim_candidates`: the
    insert position (``seq``) of the earliest active row of each key in ``keys`` (bound,
    expanding). A candidate whose key has an active row before it that is not among the
    candidates was passed by ``SKIP LOCKED`` (its writer was committing it, or its holder
    is recording an outcome): the candidate waits, as PostgreSQL's claim makes it (the
    ``ranked`` step of `claim`). A plain read, at the database's latest commit."""
    t = table
    return (
        select(t.c.key, func.min(t.c.seq))
        .where(t.c.broker == broker, t.c.key.in_(bindparam("keys", expanding=True)), active(t))
        .group_by(t.c.key)
    )


def claim_turn(lock_name: str, wait_seconds: int) -> tuple[Select[Any], Select[Any]]:
    """MySQL, ordered claim: ``GET_LOCK`` and ``RELEASE_LOCK`` of ``lock_name`` (at most
    64 characters), the turn ordered claimers of one table and broker take, as
    `ordered_turn` on PostgreSQL. A named lock belongs to the session, not to the
    transaction: the caller releases it after the commit (or drops the connection)."""
    name: ColumnElement[str] = literal_column(f"'{lock_name}'")
    return (
        select(func.get_lock(name, literal_column(str(int(wait_seconds))))),
        select(func.release_lock(name)),
    )


def _key_may_go(
    table: Table, o: Any, order: tuple[Any, ...], due_now: Any, dialect: Dialect
) -> ColumnElement[bool]:
    """Ordered claim: a row without a key goes; a keyed row only when no earlier row of its
    key holds it back (in flight, backing off, or abandoned)."""
    e = table.alias("e")
    held_earlier = exists().where(
        # The same key on the same broker (ix_<table>_key serves the probe)…
        e.c.broker == o.c.broker,
        e.c.key == o.c.key,
        _active_and_waiting(e, due_now),
        # …inserted before this row.
        tuple_(*order_columns(e, dialect)) < tuple_(*order),
    )
    # An abandoned row blocks the later rows of its key until an operator replays it (then
    # it goes first) or deletes it: no silent gap in a key's order.
    a = table.alias("a")
    abandoned_earlier = exists().where(
        a.c.broker == o.c.broker,
        a.c.key == o.c.key,
        a.c.status.in_([literal_column(f"'{ABANDONED}'")]),  # literal: the partial index
        tuple_(*order_columns(a, dialect)) < tuple_(*order),
    )
    return or_(o.c.key.is_(None), and_(~held_earlier, ~abandoned_earlier))


def _active_and_waiting(e: Any, due_now: Any) -> ColumnElement[bool]:
    """In flight (its lease runs) or backing off (failed, not due): the key waits for it."""
    return and_(active(e), e.c.next_attempt_at > due_now)


def _ranked(
    table: Table, broker: str, locked: Any, labels: list[str], ordered: bool, dialect: Dialect
) -> Any:
    """The ``ranked`` CTE of `claim`: the locked rows numbered in claim order."""
    position = func.row_number().over(order_by=[locked.c[label] for label in labels])
    ranked: Select[Any] = select(locked.c.id, locked.c.suspect, position.label("rn"))
    if ordered and is_postgres(dialect):
        # A keyed row whose earlier row is active but not in ``locked``: SKIP LOCKED passed
        # that row by (its holder is recording an outcome now), so this one waits too.
        h = table.alias("h")
        skipped_earlier = exists().where(
            h.c.broker == broker,
            h.c.key == locked.c.key,
            active(h),
            tuple_(*order_columns(h, dialect)) < tuple_(*(locked.c[label] for label in labels)),
            h.c.id.not_in(select(locked.c.id)),
        )
        ranked = ranked.where(or_(locked.c.key.is_(None), ~skipped_earlier))
    return ranked.cte("ranked")


def _chosen(ranked: Any, limit: int) -> Any:
    """The ``chosen`` CTE of `claim`: the rows before the first suspect, or the
    first row alone (a suspect first in line is claimed on its own)."""
    first_suspect = select(func.min(ranked.c.rn)).where(ranked.c.suspect)
    return (
        select(ranked.c.id)
        .where(
            or_(
                ranked.c.rn == 1,
                # No suspect: every row (limit + 1 is past the last position).
                ranked.c.rn < func.coalesce(first_suspect.scalar_subquery(), limit + 1),
            )
        )
        .cte("chosen")
    )


def generic_plan() -> Select[Any]:
    """``SELECT set_config('plan_cache_mode', 'force_generic_plan', true)``: the claim on a table
    partitioned by id runs its cached generic plan (caller: ``Store.claim``, in the claim's
    transaction, before it). Left to ``auto``, PostgreSQL keeps choosing a custom plan for
    it and plans the claim again at every execution: the update's Append and the
    ``locked`` scan over every partition, ~4 ms per claim on 34 partitions
    (pg_stat_statements: total_plan_time about 4 ms per call), more than the statement itself
    costs over the plain table's. The generic plan prunes the update to the batch's
    partition when it runs (init plans: see `_chosen_rows`), so it loses nothing."""
    return select(func.set_config("plan_cache_mode", "force_generic_plan", True))


def ordered_turn(
    lock_key: str,
    broker: str,
    statement_ms: int | None,
    lock_ms: int | None,
    *,
    generic: bool = False,
) -> Select[Any]:
    """PostgreSQL, ordered claim (caller: ``Store.claim``): the claimers of one table and
    broker take turns on a transaction-scoped advisory lock, so the claim that follows
    sees the rows the previous claim took as in flight (each batch a prefix of every key's
    queue). The lock key is the hash of ``<lock_key>:<broker>``; the local timeouts (see
    `local_timeouts`) come first, so a frozen holder cannot stall the turn forever;
    ``generic``: `generic_plan` too (a table partitioned by id)."""
    return select(
        *local_timeouts(statement_ms, lock_ms),
        *(generic_plan().selected_columns if generic else []),
        func.pg_advisory_xact_lock(func.hashtext(f"{lock_key}:{broker}")),
    )


def local_timeouts(statement_ms: int | None, lock_ms: int | None) -> list[Any]:
    """``set_config(…, is_local => true)`` of the relay's bounds for the current
    transaction (callers: the ordered claim and ``Store.mark_failed``): ``statement_timeout``
    and ``lock_timeout``, and ``idle_in_transaction_session_timeout`` so a frozen relay
    holding the ordered claimers' lock is cut off too. Nothing when unbounded."""
    if statement_ms is None or lock_ms is None:
        return []
    return [
        func.set_config("statement_timeout", f"{statement_ms}ms", True),
        func.set_config("lock_timeout", f"{lock_ms}ms", True),
        func.set_config("idle_in_transaction_session_timeout", f"{statement_ms}ms", True),
    ]


def transaction_bounds(statement_ms: int | None, lock_ms: int | None) -> Select[Any] | None:
    """``SELECT set_config(…)`` of `local_timeouts`, the first statement of a bounded
    transaction (caller: ``Store.mark_failed``); None when unbounded."""
    timeouts = local_timeouts(statement_ms, lock_ms)
    return select(*timeouts) if timeouts else None


def mark_published(table: Table, dialect: Dialect, *, delete_rows: bool = False) -> Any:
    """After the broker acknowledged a batch (caller: ``Store.mark_published``): mark the
    rows published, or delete them (``delete_rows``: no published history kept).

    ``ids_in``: the whole batch in one statement (an array on PostgreSQL); ``locked_by =
    :token``: the fence, so rows whose lease was lost to another claim are left alone (the
    row count tells the caller). The lease columns and last_error are cleared: the row
    leaves the partial due index (its status is no longer active)."""
    t = table
    fence = and_(ids_in(t, dialect), t.c.locked_by == bindparam("token"))
    if delete_rows:
        return delete(t).where(fence)
    return (
        update(t)
        .where(fence)
        .values(
            status=PUBLISHED,
            published_at=now(dialect),  # the database's clock: retention counts from it
            locked_by=None,
            locked_until=None,
            last_error=None,
        )
    )


def mark_failed(table: Table, dialect: Dialect) -> Any:
    """A publish failure of one row (caller: ``Store.mark_failed`` and ``Store.abandon``,
    one execution per refused row): back to ``failed`` due after its backoff, or
    ``abandoned`` (``new_status``). Fenced by ``row_id`` and ``token``: a row whose lease
    was lost is not touched. ``delay`` is the backoff, added to the database's now."""
    t = table
    status = bindparam("new_status", type_=t.c.status.type)
    return (
        update(t)
        .where(t.c.id == bindparam("row_id"), t.c.locked_by == bindparam("token"))
        .values(
            status=status,
            next_attempt_at=clock.db_later(flavor(dialect), "delay"),
            last_error=bindparam("error"),
            locked_by=None,
            locked_until=None,
            # Only an abandoned row gets its abandoned_at (abandoned retention counts from it).
            abandoned_at=case((status == ABANDONED, now(dialect)), else_=None),
        )
    )


def release(table: Table, dialect: Dialect, *, refund_attempt: bool = True) -> Any:
    """Give claimed rows back, claimable at once (caller: ``Store.release``: shutdown,
    broker unreachable, rows behind a failure in an ordered batch). Fenced by the token;
    a ``processing`` row goes back to ``pending`` (a ``failed`` one stays failed); due now
    by the database's clock; the attempt counted at claim is refunded (the message
    itself did not fail) unless ``refund_attempt`` is false."""
    t = table
    return (
        update(t)
        .where(ids_in(t, dialect), t.c.locked_by == bindparam("token"))
        .values(
            status=case((t.c.status == PROCESSING, PENDING), else_=t.c.status),
            locked_by=None,
            locked_until=None,
            next_attempt_at=now(dialect),
            attempts=t.c.attempts - (1 if refund_attempt else 0),
        )
    )


def extend_lease(table: Table, dialect: Dialect) -> Any:
    """Renew the lease of claimed rows for ``lease`` from the database's now (caller:
    ``Store.extend_lease``: the relay before it retries a batch one message at a time).
    Fenced by the token; ``next_attempt_at`` moves with ``locked_until`` because it is the
    due time an expired lease is recognised by."""
    t = table
    until = clock.db_later(flavor(dialect), "lease")
    return (
        update(t)
        .where(ids_in(t, dialect), t.c.locked_by == bindparam("token"))
        .values(locked_until=until, next_attempt_at=until)
    )


def next_due(table: Table, broker: str, dialect: Dialect) -> Select[Any]:
    """The earliest due time still ahead among ``broker``'s rows that need work (caller:
    ``Store.next_due_in``: the idle poller sleeps that long at most). ``broker`` and the
    literal active statuses make it one read of ix_<table>_due; ``> now``: rows due
    already are the claim's business, not the sleeper's."""
    t = table
    return select(func.min(t.c.next_attempt_at)).where(
        t.c.broker == broker, status_in(t, *ACTIVE), t.c.next_attempt_at > now(dialect)
    )


def insert_failed(table: Table) -> Any:
    """PostgreSQL only (caller: ``Store.insert_failed``, the WAL relay): messages the broker
    refused become ``failed`` rows due after ``retry_in`` (a bound interval), or
    ``abandoned`` ones (``abandon_now``), so the table's retry, abandon and replay path
    takes over. ``ON CONFLICT DO NOTHING``: a relay that crashed after inserting a row
    reads the slot again, and the row already there is left as it is."""
    from sqlalchemy.dialects import postgresql

    return (
        postgresql.insert(table)
        .values(
            next_attempt_at=func.now() + bindparam("retry_in", type_=Interval()),
            abandoned_at=case((bindparam("abandon_now", type_=Boolean()), func.now()), else_=None),
        )
        .on_conflict_do_nothing()
    )

"""Retention's statement: the bounded DELETE of finished rows.

Caller: `fastapi_outbox.lifecycle.retention.purge` through ``Retention.purge_batch`` (and the
CLI's ``purge``, which runs the same loop); ``benchmarks/scale.py`` measures its WAL. The
archive's move (`fastapi_outbox.storage.statements.archive`) picks its rows with
`victims`.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Table, delete, exists, or_, select, tuple_
from sqlalchemy.engine import Dialect

from fastapi_outbox.storage.dialects import is_postgres
from fastapi_outbox.storage.statements.parts import (
    PUBLISHED,
    active,
    derived,
    later,
    order_columns,
)

__all__ = ["purge", "victims"]


def purge(
    table: Table,
    status: str,
    older_than_seconds: float,
    limit: int,
    dialect: Dialect,
    *,
    keep_blocking: bool = False,
) -> Any:
    """Delete up to ``limit`` rows of ``status`` (published or abandoned) finished more than
    ``older_than_seconds`` ago by the database's clock.

    The victims are chosen in a subquery with a LIMIT: each DELETE is one short
    transaction, never a table-wide one. ``status`` plus the finish time is a range of
    ix_<table>_published / ix_<table>_abandoned. ``FOR UPDATE SKIP LOCKED`` (PostgreSQL):
    a row an operator is replaying right now is skipped, not waited for. ``keep_blocking``
    (ordered dispatch): an abandoned keyed row that a later active row of its key still
    waits for is kept — deleting it would let the key go on with a gap."""
    t = table
    chosen = victims(t, status, older_than_seconds, limit, dialect, keep_blocking=keep_blocking)
    # MySQL: the victims from a derived table (see ``derived``), and no SKIP LOCKED there.
    return delete(t).where(t.c.id.in_(derived(chosen, dialect).scalar_subquery()))


def victims(
    table: Table,
    status: str,
    older_than_seconds: float,
    limit: int,
    dialect: Dialect,
    *,
    keep_blocking: bool = False,
    whole: Table | None = None,
    ordered: bool = False,
) -> Any:
    """The ids of one batch of `purge` (and of the archive's move,
    `fastapi_outbox.storage.statements.archive.move`): ``table`` is where the rows are
    taken from, ``whole`` the outbox table the ``keep_blocking`` check looks in (the same
    table unless the rows are taken from one partition). ``ordered``: by finish time then
    id, so that two evaluations in one transaction pick the same rows (SQLite's move)."""
    t = table
    finished = t.c.published_at if status == PUBLISHED else t.c.abandoned_at
    chosen = (
        select(t.c.id)
        .where(t.c.status == status, finished < later(dialect, -older_than_seconds))
        .limit(limit)
    )
    if ordered:
        chosen = chosen.order_by(finished, t.c.id)
    if keep_blocking:
        e = (whole if whole is not None else t).alias("e")
        waited_for = exists().where(
            # A later row (insert order) of the same key on the same broker, still active.
            e.c.broker == t.c.broker,
            e.c.key == t.c.key,
            active(e),
            tuple_(*order_columns(e, dialect)) > tuple_(*order_columns(t, dialect)),
        )
        chosen = chosen.where(or_(t.c.key.is_(None), ~waited_for))
    if is_postgres(dialect):
        chosen = chosen.with_for_update(skip_locked=True)
    return chosen

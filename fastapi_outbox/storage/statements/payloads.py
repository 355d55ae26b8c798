"""The claim-check table's statements (``claim_check_store="database"``).

Callers: `fastapi_outbox.storage.claim_check.DatabasePayloadStore` — ``insert`` from
the session's ``before_commit`` (the producer's transaction, through the outbox's
``write_rows``), ``fetch`` from a subscriber resolving a reference before it decodes,
``purge`` from retention (`fastapi_outbox.lifecycle.retention.Cleaner`). The builders are
pure: a table in, a statement out.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    ColumnElement,
    Table,
    Uuid,
    bindparam,
    cast,
    delete,
    exists,
    func,
    insert,
    select,
)

from fastapi_outbox.storage import clock
from fastapi_outbox.storage.dialects import MYSQL, POSTGRESQL, Flavor, flavor
from fastapi_outbox.storage.statements.parts import PUBLISHED

__all__ = ["fetch", "insert_payload", "known_messages", "live_messages", "purge"]


def insert_payload(table: Table, is_postgres: Flavor) -> Any:
    """One stored payload (``ref``, ``data``, ``size`` bound per row, and ``due``: the
    message's delay, a `db_later` parameter).
    ``created_at`` is when the message is due, by the database's clock (the one retention
    compares with): a delayed message's payload is dated from its publication, not from
    the commit, so retention never takes it before the message is sent."""
    return insert(table).values(created_at=clock.db_later(is_postgres, "due"))


def _live(outbox_table: Table, ref: Any, is_postgres: Flavor, cutoff: Any) -> ColumnElement[bool]:
    """The message ``ref`` names still needs its payload: its row is there and not
    finished (pending, delayed, being published, abandoned and replayable), or published
    after ``cutoff`` (retention counts from when the message is finished)."""
    t = outbox_table
    # A reference is the message id as text; SQLite stores a Uuid as 32 hex digits.
    # MariaDB's UUID type and MySQL's CHAR(32) both take the 32 digits.
    as_id = cast(ref, Uuid()) if flavor(is_postgres) == POSTGRESQL else func.replace(ref, "-", "")
    return exists().where(t.c.id == as_id, (t.c.status != PUBLISHED) | (t.c.published_at >= cutoff))


def fetch(table: Table) -> Any:
    """The payload of ``ref`` (bound): one primary-key look-up."""
    return select(table.c.data).where(table.c.ref == bindparam("ref"))


def purge(
    table: Table,
    is_postgres: Flavor,
    older_than_seconds: float,
    limit: int,
    outbox_table: Table | None = None,
) -> Any:
    """Delete up to ``limit`` payloads dated more than ``older_than_seconds`` ago, oldest
    first, through the ``created_at`` index, except those whose message in
    ``outbox_table`` still needs them (`_live`): one short transaction (SKIP LOCKED
    on PostgreSQL: two cleaners never wait on each other)."""
    t = table
    cutoff = clock.db_later(is_postgres, seconds=-older_than_seconds)
    aged = t.c.created_at < cutoff
    if outbox_table is not None:
        aged = aged & ~_live(outbox_table, t.c.ref, is_postgres, cutoff)
    victims = select(t.c.ref).where(aged).order_by(t.c.created_at).limit(limit)
    name = flavor(is_postgres)
    if name == POSTGRESQL:
        victims = victims.with_for_update(skip_locked=True)
    elif name == MYSQL:
        victims = select(victims.subquery("victims").c.ref)  # see parts.derived
    return delete(t).where(t.c.ref.in_(victims))


def known_messages(outbox_table: Table) -> Any:
    """Which of the references (``refs``, bound, expanding) are message ids of the outbox
    table (caller: retention's orphan sweep of a file store, through
    ``claim_check.known_in``): the primary key, one look-up per reference."""
    t = outbox_table
    return select(t.c.id).where(t.c.id.in_(bindparam("refs", expanding=True)))


def live_messages(outbox_table: Table, is_postgres: Flavor, older_than_seconds: float) -> Any:
    """Which of the message ids (``refs``, bound, expanding) still need their payload: a
    row not finished, or published less than ``older_than_seconds`` ago (caller: a file
    store's retention, through ``claim_check.live_in``)."""
    t = outbox_table
    cutoff = clock.db_later(is_postgres, seconds=-older_than_seconds)
    return select(t.c.id).where(
        t.c.id.in_(bindparam("refs", expanding=True)),
        (t.c.status != PUBLISHED) | (t.c.published_at >= cutoff),
    )

"""The claim-check table's statements (``claim_check_store="database"``).

Callers: :class:`fastapi_outbox.storage.claim_check.DatabasePayloadStore` — ``insert`` from
the session's ``before_commit`` (the producer's transaction, through the outbox's
``write_rows``), ``fetch`` from a subscriber resolving a reference before it decodes,
``purge`` from retention (:class:`fastapi_outbox.relay.retention.Cleaner`). The builders are
pure: a table in, a statement out.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Table, bindparam, delete, insert, select

from fastapi_outbox.storage import clock

__all__ = ["fetch", "insert_payload", "known_messages", "purge"]


def insert_payload(table: Table, is_postgres: bool) -> Any:
    """One stored payload (``ref``, ``data``, ``size`` bound per row); ``created_at`` by the
    database's clock, the one retention compares with."""
    return insert(table).values(created_at=clock.db_now(is_postgres))


def fetch(table: Table) -> Any:
    """The payload of ``ref`` (bound): one primary-key look-up."""
    return select(table.c.data).where(table.c.ref == bindparam("ref"))


def purge(table: Table, is_postgres: bool, older_than_seconds: float, limit: int) -> Any:
    """Delete up to ``limit`` payloads stored more than ``older_than_seconds`` ago, oldest
    first, through the ``created_at`` index: one short transaction (SKIP LOCKED on
    PostgreSQL: two cleaners never wait on each other)."""
    t = table
    cutoff = clock.db_later(is_postgres, seconds=-older_than_seconds)
    victims = select(t.c.ref).where(t.c.created_at < cutoff).order_by(t.c.created_at).limit(limit)
    if is_postgres:
        victims = victims.with_for_update(skip_locked=True)
    return delete(t).where(t.c.ref.in_(victims))


def known_messages(outbox_table: Table) -> Any:
    """Which of the references (``refs``, bound, expanding) are message ids of the outbox
    table (caller: retention's orphan sweep of a file store, through
    ``claim_check.known_in``): the primary key, one look-up per reference."""
    t = outbox_table
    return select(t.c.id).where(t.c.id.in_(bindparam("refs", expanding=True)))

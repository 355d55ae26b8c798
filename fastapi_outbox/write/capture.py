"""How committed messages are captured in the business transaction: one small interface.

``capture="table"`` (the default): each message is a row of the outbox table, inserted on
the session's connection; relays claim the rows. (``capture="wal"``, a message written
into PostgreSQL's write-ahead log and relayed from a logical replication slot, implements
the same interface.)

A capture is called from the session's ``before_commit`` event (see
`fastapi_outbox.write.session_events`), inside SQLAlchemy's greenlet: it uses the sync
``Connection`` API, and ``await_only`` for driver-level calls.
"""

from __future__ import annotations

from typing import Any, Protocol

from sqlalchemy.engine import Connection

from fastapi_outbox.storage.store import Store
from fastapi_outbox.storage.wal_slot import WalSlot

__all__ = ["Capture", "TableCapture", "capture_for"]


class Capture(Protocol):
    """Writes a transaction's outbox messages in that transaction."""

    def write(self, connection: Connection, rows: list[dict[str, Any]]) -> None:
        """Record ``rows`` (the outbox row dicts built by ``UnitOfWork.publish``) on
        ``connection``, in its current transaction or savepoint."""


class TableCapture:
    """``capture="table"``: one outbox row per message and target broker."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def write(self, connection: Connection, rows: list[dict[str, Any]]) -> None:
        self.store.inserts.insert_rows_sync(connection, rows)


def capture_for(store: Store, wal_slot: WalSlot | None) -> Capture:
    """The capture of an outbox: `TableCapture`, or with a WAL slot
    (``capture="wal"``) `WalCapture`."""
    if wal_slot is None:
        return TableCapture(store)
    from fastapi_outbox.write.wal_capture import WalCapture

    return WalCapture(store, wal_slot)

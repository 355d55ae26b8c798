"""``capture="wal"``: messages written into PostgreSQL's write-ahead log, not into a table.

The unit of work calls `WalCapture.write` from the session's ``before_commit`` (see
`fastapi_outbox.write.capture`), like `TableCapture`. The
messages due now go into ONE ``SELECT pg_logical_emit_message(true, <prefix>, <json>)``
on the session's connection: one round trip per commit, whatever the number of messages,
and no table row, index entry or vacuum work. ``transactional = true``: PostgreSQL's
logical decoding hands the message out only if the transaction commits, at its place in
commit order; a rolled-back transaction, or a savepoint rolled back inside one, leaves
nothing behind.

Delayed messages (``publish(delay=…)``/``deliver_at=…``) are not for the WAL — the slot
hands everything out at once: they are written as ``pending`` rows of the outbox table in
the same transaction, and the table's relays (which run in both modes) publish them
when due.

The first write of a process checks that the server has ``wal_level=logical`` and that the
slot exists (a slot sees only WAL written after its creation: a message written before
would be lost); afterwards the check costs nothing.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.engine import Connection
from sqlalchemy.util import await_only

from fastapi_outbox.storage import wal_slot
from fastapi_outbox.storage.statements import wal as wal_sql
from fastapi_outbox.storage.statements.inserts import EMIT_SQL, emit_message
from fastapi_outbox.storage.store import Store

__all__ = ["WalCapture"]


class WalCapture:
    """Writes due messages with ``pg_logical_emit_message``; delayed ones as table rows."""

    def __init__(self, store: Store, slot: wal_slot.WalSlot) -> None:
        self.store = store
        self.slot = slot
        self.prefix = slot.prefix
        self._checked = False

    def write(self, connection: Connection, rows: list[dict[str, Any]]) -> None:
        # A deliver_at message goes to the table even when the producer's clock says it
        # is due: the database's clock decides when it is (see ``clock``).
        due = [r for r in rows if not r["delay"] and r.get("deliver_at") is None]
        if len(due) < len(rows):
            self.store.inserts.insert_rows_sync(
                connection, [r for r in rows if r["delay"] or r.get("deliver_at") is not None]
            )
        if not due:
            return
        content = wal_slot.encode(due)
        driver = connection.connection.driver_connection
        if connection.dialect.driver == "asyncpg" and driver is not None:
            if not self._checked:
                version, level, exists = await_only(
                    driver.fetchrow(wal_sql.CHECK_SQL, self.slot.name)
                )
                wal_slot.check_ready(version, level, exists, self.slot.name, slot=True)
                self._checked = True
            await_only(driver.execute(EMIT_SQL, self.prefix, content))
            return
        if not self._checked:
            version, level, exists = connection.execute(
                wal_sql.check_ready(), {"slot": self.slot.name}
            ).one()
            wal_slot.check_ready(version, level, exists, self.slot.name, slot=True)
            self._checked = True
        connection.execute(emit_message(), {"prefix": self.prefix, "content": content})

"""The WAL capture's readiness check, for a connection that is not asyncpg's.

Caller: :class:`fastapi_outbox.write.wal_capture.WalCapture`, at its first write in a
process (on asyncpg it runs :data:`fastapi_outbox.storage.wal_slot.CHECK_SQL` itself). The
WAL relay's statements (peek, advance, the slot's boundaries) live with the slot in
:mod:`fastapi_outbox.storage.wal_slot`.
"""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.sql.elements import TextClause

from fastapi_outbox.storage.wal_slot import CHECK_SQL

__all__ = ["CHECK_SQL", "check_ready"]


def check_ready() -> TextClause:
    """:data:`~fastapi_outbox.storage.wal_slot.CHECK_SQL` (server version, ``wal_level``,
    and whether the slot ``:slot`` exists in this database with the pgoutput plugin: a
    message written before the slot exists would be lost) with a named parameter."""
    return text(CHECK_SQL.replace("$1", ":slot"))

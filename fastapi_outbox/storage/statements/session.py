"""The statements of the driver plumbing: the session settings of every SQLite
connection, SQLite's ``BEGIN``, and the liveness probe of an outage.

Callers: `fastapi_outbox.storage.engine.create_engine` (its ``connect`` and
``begin`` listeners on a SQLite engine) and
`fastapi_outbox.storage.db_outage.database_answers` (the relays and subscribers,
while the database is down: is it back?). Plain strings run on the DBAPI cursor or with
``exec_driver_sql``: no SQLAlchemy statement work where none is needed.
"""

from __future__ import annotations

__all__ = ["BEGIN_IMMEDIATE", "PING", "sqlite_pragmas"]

#: ``create_engine``'s ``begin`` listener: every SQLite transaction takes the write lock at
#: BEGIN (``IMMEDIATE``), so two writers never deadlock upgrading a read lock; the one that
#: waits, waits in the busy timeout.
BEGIN_IMMEDIATE = "BEGIN IMMEDIATE"
#: ``database_answers``: the cheapest statement that proves the server answers (no table:
#: a missing or locked table is not an outage).
PING = "SELECT 1"


def sqlite_pragmas(busy_timeout_ms: int, *, wal: bool) -> list[str]:
    """``create_engine``'s ``connect`` listener, on every new SQLite connection, in order:
    ``journal_mode=WAL`` (``wal``: file databases only; readers never block the writer —
    an in-memory database has no WAL), ``synchronous=NORMAL`` (durable at checkpoints,
    safe with WAL), a busy timeout (a writer waits for the lock instead of failing) and
    foreign keys on (SQLite's default is off)."""
    pragmas = ["PRAGMA journal_mode=WAL"] if wal else []
    return [
        *pragmas,
        "PRAGMA synchronous=NORMAL",
        f"PRAGMA busy_timeout={busy_timeout_ms}",
        "PRAGMA foreign_keys=ON",
    ]

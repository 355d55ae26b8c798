"""The statements of ``capture="wal"``: the slot's life cycle, the relay's reads and
confirms, the readiness check of the capture.

Callers: `fastapi_outbox.storage.wal_slot.WalSlot` (``create``, ``drop``, ``stats``,
``prepare_session``, ``try_lock``, ``peek``, ``advance``: for ``db create``, the doctor,
health and `fastapi_outbox.relay.wal.WalRelay` on its dedicated asyncpg connection)
and `fastapi_outbox.write.wal_capture.WalCapture` (`CHECK_SQL` at its first
write). All run on asyncpg with positional parameters; every slot lookup also matches
``database = current_database()``, because slot names are cluster-wide and another
database's slot of the same name is not ours.
"""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.sql.elements import TextClause

__all__ = [
    "ADVANCE_SQL",
    "BOUNDARY_SQL",
    "CHECK_SQL",
    "CREATE_SLOT_SQL",
    "DB_NOW_SQL",
    "DROP_SLOT_SQL",
    "PEEK_SQL",
    "PUBLICATION_EXISTS_SQL",
    "SESSION_SQL",
    "SLOT_EXISTS_SQL",
    "STATS_SQL",
    "TRY_LOCK_SQL",
    "check_ready",
]

#: ``WalSlot.create``/``drop``: does the slot ``$1`` exist in this database.
SLOT_EXISTS_SQL = (
    "SELECT EXISTS (SELECT FROM pg_replication_slots "
    "WHERE slot_name = $1 AND database = current_database())"
)
#: ``WalSlot.check_server`` and ``WalCapture`` (first write): the server version (pgoutput
#: decodes messages from 14 on), ``wal_level`` (must be ``logical``) and whether the slot
#: ``$1`` exists here with the pgoutput plugin (a message written before it exists is lost).
CHECK_SQL = (
    "SELECT current_setting('server_version_num')::int, current_setting('wal_level'), "
    "EXISTS (SELECT FROM pg_replication_slots "
    "WHERE slot_name = $1 AND database = current_database() AND plugin = 'pgoutput')"
)
#: ``WalSlot.create``: does the publication ``$1`` exist (created without tables, so only
#: the logical messages reach pgoutput's output).
PUBLICATION_EXISTS_SQL = "SELECT EXISTS (SELECT FROM pg_publication WHERE pubname = $1)"
#: ``WalSlot.create``: the slot ``$1`` with the built-in pgoutput plugin (no extension).
CREATE_SLOT_SQL = "SELECT pg_create_logical_replication_slot($1, 'pgoutput')"
#: ``WalSlot.drop``: the slot ``$1`` (the WAL it retained is freed).
DROP_SLOT_SQL = "SELECT pg_drop_replication_slot($1)"
#: ``WalSlot.peek``, before every read: the WAL flush position (the read's bound: records
#: past it may be incomplete), the slot's confirmed position (where the read starts), and
#: the database's clock (``clock_timestamp()``: the real time, not the transaction's start),
#: in one round trip.
BOUNDARY_SQL = (
    "SELECT pg_current_wal_flush_lsn()::text AS flush_lsn, "
    "(SELECT confirmed_flush_lsn::text FROM pg_replication_slots "
    "WHERE slot_name = $1 AND database = current_database()) AS confirmed_lsn, "
    "extract(epoch FROM clock_timestamp())::float8 AS db_now"
)
#: ``WalSlot.stats`` (oldest message age): the database's clock, Unix seconds (commit times
#: are on it).
DB_NOW_SQL = "SELECT extract(epoch FROM clock_timestamp())::float8"
#: ``WalSlot.peek``: read without moving the slot (a crash before the broker acknowledged
#: reads the same messages again).
PEEK_SQL = (
    "SELECT data FROM pg_logical_slot_peek_binary_changes("
    "$1, $2::pg_lsn, $3, "  # slot, read up to this LSN (NULL: the WAL's end), about this
    # many rows (whole transactions)
    "'proto_version', '1', 'publication_names', $4, "  # the empty publication: no table rows
    "'messages', 'true')"  # pg_logical_emit_message records
)
#: ``WalSlot.advance``, after the broker acknowledged: confirm up to ``$2``.
#: pg_replication_slot_advance refuses to move backwards; GREATEST makes a repeated confirm
#: (a relay retrying after a lost answer) a no-op.
ADVANCE_SQL = (
    "SELECT pg_replication_slot_advance(s.slot_name, GREATEST(s.confirmed_flush_lsn, $2::pg_lsn)) "
    "FROM pg_replication_slots s WHERE s.slot_name = $1"
)
#: ``WalSlot.stats`` (health, doctor, dashboard): the slot's WAL status (``lost`` when
#: ``max_slot_wal_keep_size`` cut it off), who reads it, how much WAL it still may keep,
#: its lag behind the WAL's end and the WAL it retains.
STATS_SQL = (
    "SELECT wal_status, active_pid, safe_wal_size, "
    "pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn) AS lag_bytes, "
    "pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn) AS retained_bytes "
    "FROM pg_replication_slots WHERE slot_name = $1 AND database = current_database()"
)
#: ``WalSlot.prepare_session``, on the relay's dedicated connection: a name operators see in
#: ``pg_stat_activity``, and server-side TCP keepalives (10 s idle, 5 s apart, 3 probes),
#: so the server notices a reader cut off by the network within about half a minute and
#: releases its lock to a standby (the default would take the kernel's two hours).
SESSION_SQL = (
    "SELECT set_config('application_name', 'fastapi-outbox wal relay', false), "
    "set_config('tcp_keepalives_idle', '10', false), "
    "set_config('tcp_keepalives_interval', '5', false), "
    "set_config('tcp_keepalives_count', '3', false)"
)
#: ``WalSlot.try_lock``: the reader's election, a session-level advisory lock on the hash
#: of ``$1`` (held until the connection ends: one reader per slot, never a wait).
TRY_LOCK_SQL = "SELECT pg_try_advisory_lock(hashtextextended($1, 0))"


def check_ready() -> TextClause:
    """`CHECK_SQL` with a named parameter (``:slot``), for ``WalCapture`` on a
    connection that is not asyncpg's."""
    return text(CHECK_SQL.replace("$1", ":slot"))

"""The unit of work's statements: the INSERT of the outbox rows, and the WAL capture's
``pg_logical_emit_message``.

Callers: `fastapi_outbox.write.capture.TableCapture` and
`fastapi_outbox.write.wal_capture.WalCapture`, from the session's ``before_commit``
(through ``Inserts.insert_rows_sync`` for the table). The builders are pure: a table and a
dialect in, a statement out.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import Interval, Table, bindparam, func, insert, text
from sqlalchemy.engine import Dialect
from sqlalchemy.sql.elements import TextClause

from fastapi_outbox.storage import clock
from fastapi_outbox.storage.dialects import MYSQL, is_mysql, is_postgres
from fastapi_outbox.storage.types import UtcDateTime

__all__ = [
    "EMIT_SQL",
    "INSERT_KEYS",
    "emit_message",
    "insert_rows",
    "row_params",
]

#: Columns the unit of work supplies for each row (the rest have defaults).
INSERT_KEYS = ("id", "broker", "stream", "type", "key", "payload", "headers")

#: ``capture="wal"`` on the asyncpg connection (caller: ``WalCapture.write``): the commit's
#: due messages as ONE transactional logical message (``true``: decoded only if the
#: transaction commits, at its place in commit order) under the slot's prefix (``$1``, how
#: the relay tells its messages from other writers'); ``$2::text``: the JSON array as text,
#: not bytea, so the relay decodes it without a cast.
EMIT_SQL = "SELECT pg_logical_emit_message(true, $1, $2::text)"


def emit_message() -> TextClause:
    """`EMIT_SQL` with named parameters (``prefix``, ``content``), for a connection
    that is not asyncpg's."""
    return text("SELECT pg_logical_emit_message(true, :prefix, CAST(:content AS text))")


def insert_rows(table: Table, dialect: Dialect) -> Any:
    """The INSERT of the unit of work's rows (caller: ``Inserts.insert_rows_sync``; built once
    per table). Every timestamp comes from the database's clock, so it agrees with the
    claim's.

    ``created_at``: the transaction's start on PostgreSQL (``now()``: when the event
    happened). ``next_attempt_at``, the first due time: the INSERT's own clock
    (``statement_timestamp()``), at the commit (rows are written in ``before_commit``), so
    how long a row waits for a relay is counted from then, not from the start of a
    long producer transaction; a delayed message is due ``delay`` after that, a
    ``deliver_at`` one at that time. ``greatest``/``max`` of now and that: a past
    ``deliver_at`` is due now, never "overdue" since then in the health's pending age.
    MySQL has no transaction start time: both are the INSERT's own ``UTC_TIMESTAMP(6)``."""
    created: Any
    statement_now: Any
    if is_mysql(dialect):
        created = statement_now = clock.db_now(MYSQL)
        after_delay = clock.db_later(MYSQL, "delay")
        latest: Any = func.greatest
    elif is_postgres(dialect):
        created = func.now()
        statement_now = func.statement_timestamp()
        after_delay = statement_now + bindparam("delay", type_=Interval())
        latest = func.greatest
    else:
        created = statement_now = clock.db_now(False)
        after_delay = clock.db_later(False, "delay")
        latest = func.max  # SQLite's scalar max() of two values
    due_at = bindparam("deliver_at", type_=UtcDateTime())
    return insert(table).values(
        created_at=created,
        next_attempt_at=latest(statement_now, func.coalesce(due_at, after_delay)),
    )


def row_params(rows: list[dict[str, Any]], dialect: Dialect) -> list[dict[str, Any]]:
    """The unit of work's row dicts completed for `insert_rows`: ``delay`` (a timedelta
    from the commit) and ``deliver_at`` (an aware datetime or None) become parameters of
    the due time the database computes."""
    params = [{"deliver_at": None, **row} for row in rows]
    if is_mysql(dialect):
        # Microseconds for TIMESTAMPADD; no seq: AUTO_INCREMENT numbers the rows.
        for row in params:
            row["delay"] = clock.microseconds(row["delay"].total_seconds())
    elif not is_postgres(dialect):
        for row in params:
            delay: dt.timedelta = row["delay"]
            row["delay"] = clock.seconds_modifier(delay.total_seconds())
            row["seq"] = 0  # no identity columns on SQLite: the rowid gives insert order
    return params

"""The wake-ups' statement: ``pg_notify``.

Callers: `fastapi_outbox.relay.wakeups.Notifier` (after a commit, coalesced),
`Listener` (its self-checks) on the asyncpg
connection, and ``Store.notify`` (``Outbox``'s after-commit signal without a notifier).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Select, func, select

__all__ = ["NOTIFY_SQL", "notify", "notify_with_commit"]

#: ``pg_notify(channel, payload)`` rather than ``NOTIFY channel, 'payload'``: a function
#: takes bound parameters (a NOTIFY statement does not), so one prepared statement serves
#: every payload. Sent outside any business transaction: a committing transaction that
#: has notified takes a database-wide lock at commit, which would serialise the
#: application's commits behind one another.
NOTIFY_SQL = "SELECT pg_notify($1, $2)"


def notify(channel: str, payload: str) -> Select[Any]:
    """`NOTIFY_SQL` for a SQLAlchemy connection."""
    return select(func.pg_notify(channel, payload))


def notify_with_commit(channel: str, payload: str) -> str:
    """What a producer's COMMIT carries to wake other processes (caller:
    `fastapi_outbox.storage.connector.commit_with`): statements sent after ``COMMIT;``
    in the same simple query, so they run after the commit, in an implicit transaction of
    their own — outside the business transaction, whose commit would otherwise take the
    database-wide NOTIFY lock and hold it across its WAL flush, serialising concurrent
    commits. ``synchronous_commit`` off for that small transaction only: a NOTIFY gives
    the transaction an xid, and waiting for its commit record to reach disk under that
    lock would serialise them again; a wake-up lost in a crash costs one poll interval.
    Literals, not parameters (a simple query takes none): the channel comes from a
    validated table name and the payload is an instance id, quoted all the same."""
    return (
        " SELECT set_config('synchronous_commit', 'off', true),"
        f" pg_notify({_literal(channel)}, {_literal(payload)});"
    )


def _literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"

"""The wake-ups' statement: ``pg_notify``.

Callers: :class:`fastapi_outbox.relay.wakeups.Notifier` (after a commit, coalesced),
:class:`~fastapi_outbox.relay.wakeups.Listener` (its self-checks) on the asyncpg
connection, and ``Store.notify`` (``Outbox``'s after-commit signal without a notifier).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Select, func, select

__all__ = ["NOTIFY_SQL", "notify"]

#: ``pg_notify(channel, payload)`` rather than ``NOTIFY channel, 'payload'``: a function
#: takes bound parameters (a NOTIFY statement does not), so one prepared statement serves
#: every payload. Sent outside any business transaction: a committing transaction that
#: has notified takes a database-wide lock (see DESIGN §4).
NOTIFY_SQL = "SELECT pg_notify($1, $2)"


def notify(channel: str, payload: str) -> Select[Any]:
    """:data:`NOTIFY_SQL` for a SQLAlchemy connection."""
    return select(func.pg_notify(channel, payload))

"""One clock: the database's.

Every due time, deadline and age the library compares with a stored timestamp is computed
by the database, in the statement (``now()`` on PostgreSQL, ``'now'`` on SQLite): the
processes that write, claim and observe the outbox may run on hosts whose clocks disagree
by minutes, the database is the one clock they share. The helpers here build those
expressions for both dialects.

The process's own wall clock is `wall` / `utcnow`. The library reads it only
for what never meets a stored timestamp (when a loop last ran, a log line, the validation
of ``deliver_at`` against ``max_delay_seconds``); tests shift it (patch
``fastapi_outbox.storage.clock.wall``) to show that nothing stored depends on it.
"""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

from sqlalchemy import Float, Interval, String, bindparam, func, literal_column
from sqlalchemy.sql.elements import ColumnElement

from fastapi_outbox.storage.types import UtcDateTime

__all__ = ["age_seconds", "db_later", "db_now", "seconds_modifier", "utcnow", "wall"]

#: SQLite stores ``UtcDateTime`` as ``YYYY-MM-DD HH:MM:SS.ffffff`` text (SQLAlchemy's
#: storage format), which sorts as time. ``%f`` gives milliseconds (``SS.SSS``); the three
#: zeros make the text the stored width, so values compare as text with stored ones.
SQLITE_FORMAT = "%Y-%m-%d %H:%M:%f000"


def wall() -> float:
    """The process's wall clock (seconds since the epoch): the one seam tests shift."""
    return time.time()


def utcnow() -> dt.datetime:
    """The process's wall clock as an aware UTC datetime (see `wall`)."""
    return dt.datetime.fromtimestamp(wall(), dt.UTC)


def db_now(is_postgres: bool) -> ColumnElement[dt.datetime]:
    """The database's now: ``now()`` on PostgreSQL (the transaction's start: one value for
    a whole statement), SQLite's ``'now'`` (stable within one statement) as stored text."""
    if is_postgres:
        return func.now()
    return func.strftime(SQLITE_FORMAT, "now", type_=UtcDateTime())


def seconds_modifier(seconds: float) -> str:
    """SQLite's date modifier for ``seconds`` (``+1.500000 seconds``), the value of the
    parameter `db_later` binds on SQLite."""
    return f"{seconds:+.6f} seconds"


def db_later(is_postgres: bool, name: str | None = None, seconds: float = 0.0) -> Any:
    """The database's now plus a bound number of seconds (negative: earlier).

    ``name``: the parameter to bind per execution (PostgreSQL: a ``timedelta``; SQLite: a
    `seconds_modifier` string); without a name, ``seconds`` is bound in place."""
    if is_postgres:
        if name is None:
            offset = bindparam(None, dt.timedelta(seconds=seconds), type_=Interval())
        else:
            offset = bindparam(name, type_=Interval())
        return func.now() + offset
    if name is None:
        modifier = bindparam(None, seconds_modifier(seconds), type_=String())
    else:
        modifier = bindparam(name, type_=String())
    return func.strftime(SQLITE_FORMAT, "now", modifier, type_=UtcDateTime())


def age_seconds(is_postgres: bool, column: Any) -> ColumnElement[float]:
    """Seconds from ``column`` (a stored time) to the database's now, computed there."""
    if is_postgres:
        return func.extract("epoch", func.now() - column).cast(Float)
    # julianday() differences in days; subtract first to keep the precision.
    return ((func.julianday(literal_column("'now'")) - func.julianday(column)) * 86400.0).cast(
        Float
    )

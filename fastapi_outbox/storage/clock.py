"""One clock: the database's.

Every due time, deadline and age the library compares with a stored timestamp is computed
by the database, in the statement (``now()`` on PostgreSQL, ``'now'`` on SQLite,
``UTC_TIMESTAMP(6)`` on MariaDB and MySQL, the statement's start there): the
processes that write, claim and observe the outbox may run on hosts whose clocks disagree
by minutes, the database is the one clock they share. The helpers here build those
expressions for each dialect; they take a `Flavor`
(a dialect name, or True for PostgreSQL and False for SQLite).

The process's own wall clock is `wall` / `utcnow`. The library reads it only
for what never meets a stored timestamp (when a loop last ran, a log line, the validation
of ``deliver_at`` against ``max_delay_seconds``); tests shift it (patch
``fastapi_outbox.storage.clock.wall``) to show that nothing stored depends on it.
"""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

from sqlalchemy import (
    BigInteger,
    Float,
    Interval,
    String,
    bindparam,
    func,
    literal_column,
    type_coerce,
)
from sqlalchemy.sql.elements import ColumnElement

from fastapi_outbox.storage.dialects import MYSQL, POSTGRESQL, Flavor, flavor
from fastapi_outbox.storage.types import UtcDateTime

__all__ = [
    "age_seconds",
    "db_later",
    "db_now",
    "microseconds",
    "offset_value",
    "seconds_modifier",
    "utcnow",
    "wall",
]

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


def _mysql_now() -> ColumnElement[dt.datetime]:
    # A literal: UTC_TIMESTAMP(%s) with a bound precision is not accepted everywhere.
    return literal_column("UTC_TIMESTAMP(6)", type_=UtcDateTime())


def db_now(is_postgres: Flavor) -> ColumnElement[dt.datetime]:
    """The database's now: ``now()`` on PostgreSQL (the transaction's start: one value for
    a whole statement), SQLite's ``'now'`` (stable within one statement) as stored text,
    ``UTC_TIMESTAMP(6)`` on MySQL (the statement's start, in microseconds)."""
    name = flavor(is_postgres)
    if name == POSTGRESQL:
        return func.now()
    if name == MYSQL:
        return _mysql_now()
    return func.strftime(SQLITE_FORMAT, "now", type_=UtcDateTime())


def microseconds(seconds: float) -> int:
    """MySQL's offset for ``seconds``: whole microseconds (``TIMESTAMPADD(MICROSECOND, …)``),
    the value of the parameter `db_later` binds on MySQL."""
    return round(seconds * 1_000_000)


def offset_value(is_postgres: Flavor, seconds: float) -> Any:
    """The value of a named `db_later` parameter: a ``timedelta`` on PostgreSQL, a
    `seconds_modifier` on SQLite, `microseconds` on MySQL."""
    name = flavor(is_postgres)
    if name == POSTGRESQL:
        return dt.timedelta(seconds=seconds)
    if name == MYSQL:
        return microseconds(seconds)
    return seconds_modifier(seconds)


def seconds_modifier(seconds: float) -> str:
    """SQLite's date modifier for ``seconds`` (``+1.500000 seconds``), the value of the
    parameter `db_later` binds on SQLite."""
    return f"{seconds:+.6f} seconds"


def db_later(is_postgres: Flavor, name: str | None = None, seconds: float = 0.0) -> Any:
    """The database's now plus a bound number of seconds (negative: earlier).

    ``name``: the parameter to bind per execution (PostgreSQL: a ``timedelta``; SQLite: a
    `seconds_modifier` string; MySQL: `microseconds`; see `offset_value`);
    without a name, ``seconds`` is bound in place."""
    dialect = flavor(is_postgres)
    if dialect == MYSQL:
        if name is None:
            amount = bindparam(None, microseconds(seconds), type_=BigInteger())
        else:
            amount = bindparam(name, type_=BigInteger())
        return func.timestampadd(
            literal_column("MICROSECOND"), amount, _mysql_now(), type_=UtcDateTime()
        )
    if dialect == POSTGRESQL:
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


def age_seconds(is_postgres: Flavor, column: Any) -> ColumnElement[float]:
    """Seconds from ``column`` (a stored time) to the database's now, computed there."""
    dialect = flavor(is_postgres)
    if dialect == MYSQL:
        diff = func.timestampdiff(literal_column("MICROSECOND"), column, _mysql_now())
        return type_coerce(diff / 1_000_000.0, Float)  # MySQL has no CAST to FLOAT
    if dialect == POSTGRESQL:
        return func.extract("epoch", func.now() - column).cast(Float)
    # julianday() differences in days; subtract first to keep the precision.
    return ((func.julianday(literal_column("'now'")) - func.julianday(column)) * 86400.0).cast(
        Float
    )

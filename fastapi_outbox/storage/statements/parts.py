"""The pieces the statements of every caller share: status predicates, the id set of a
batch, the insert-order columns and the database's clock, each for both dialects.

Every function takes the SQLAlchemy `Dialect` the statement is for
(or asks `is_postgres` of it), never an engine: the
builders stay pure, so ``tests/unit`` compiles them without a database.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy import (
    ARRAY,
    Select,
    Table,
    Uuid,
    and_,
    any_,
    bindparam,
    cast,
    literal_column,
    select,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.sql.elements import ColumnElement

from fastapi_outbox.events import MessageStatus
from fastapi_outbox.storage import clock
from fastapi_outbox.storage.dialects import flavor, is_mysql, is_postgres
from fastapi_outbox.storage.types import ACTIVE_STATUSES

__all__ = [
    "ABANDONED",
    "ACTIVE",
    "ERROR_MAX_CHARS",
    "FAILED",
    "PENDING",
    "PROCESSING",
    "PUBLISHED",
    "active",
    "batch_params",
    "derived",
    "ids_in",
    "later",
    "now",
    "offset",
    "order_columns",
    "status_in",
]

PENDING = MessageStatus.PENDING.value
PROCESSING = MessageStatus.PROCESSING.value
PUBLISHED = MessageStatus.PUBLISHED.value
FAILED = MessageStatus.FAILED.value
ABANDONED = MessageStatus.ABANDONED.value
#: The statuses of the rows that still need work: what the partial due index holds.
ACTIVE = tuple(s.value for s in ACTIVE_STATUSES)
#: last_error is truncated to this many characters.
ERROR_MAX_CHARS = 2000


def status_in(alias: Any, *statuses: str) -> ColumnElement[bool]:
    """``alias.status IN ('a', 'b')`` with the values written into the SQL text, not bound:
    a partial index serves a statement only when its WHERE provably implies the index
    predicate, which a generic (prepared) plan of ``status = $1`` never does."""
    column: ColumnElement[str] = alias.c.status
    return column.in_([literal_column(f"'{MessageStatus(s).value}'") for s in statuses])


def active(alias: Any) -> ColumnElement[bool]:
    """``status IN ('pending', 'processing', 'failed')``: exactly the partial due index's
    predicate (see `status_in` for why the values are literals)."""
    return status_in(alias, *ACTIVE)


def ids_in(table: Table, dialect: Dialect, name: str = "ids") -> ColumnElement[bool]:
    """The batch's rows: ``id = ANY($ids)`` on PostgreSQL (one array parameter, so one
    cached statement serves every batch size), an expanding ``IN`` on SQLite.

    On a table partitioned by id also ``id >= $ids_lo AND id <= $ids_hi``, the batch's
    smallest and largest id (`batch_params`): PostgreSQL prunes the partitions of a
    generic (prepared) plan on a range of parameters when the executor starts (not on an
    array parameter); a batch claimed in due order spans one partition, two around a
    boundary. The three values go in as ``(SELECT $n)``: init plans, so no plan prunes at
    planning time and the custom plans cost what the generic one costs; PostgreSQL then
    keeps the generic plan (pruned when it runs) instead of planning every mark again."""
    if is_postgres(dialect):
        if table.info.get("partitioning") is None:
            return table.c.id == any_(bindparam(name, type_=ARRAY(Uuid())))
        ids = select(bindparam(name, type_=ARRAY(Uuid()))).scalar_subquery()
        lo = select(bindparam(f"{name}_lo", type_=Uuid())).scalar_subquery()
        hi = select(bindparam(f"{name}_hi", type_=Uuid())).scalar_subquery()
        # CAST: ``= ANY ((SELECT …))``, an array value, not ``= ANY (SELECT …)`` over rows.
        return and_(
            table.c.id == any_(cast(ids, ARRAY(Uuid()))), table.c.id >= lo, table.c.id <= hi
        )
    return table.c.id.in_(bindparam(name, expanding=True))


def batch_params(
    ids: Sequence[uuid.UUID], name: str = "ids", *, ranged: bool = True
) -> dict[str, Any]:
    """The parameters of `ids_in`: the ids, and their range when ``ranged`` (only a
    table partitioned by id uses it; ``min`` and ``max`` of 500 UUIDs cost about 0.4 µs
    per message, compared in Python)."""
    listed = list(ids)
    if not ranged:
        return {name: listed}
    return {name: listed, f"{name}_lo": min(listed), f"{name}_hi": max(listed)}


def order_columns(alias: Any, dialect: Dialect) -> tuple[Any, ...]:
    """Insert order of rows, the order of ordered dispatch: ``seq`` (an identity column) on
    PostgreSQL, the rowid on SQLite (one writer at a time holding the write lock until
    commit, so there insert order is commit order).

    Why insert order and not the writing transaction's id: a transaction gets its id at
    its first write, which may come before it locks the key's aggregate, so two producers
    of one aggregate can hold ids in the opposite order of their commits. The unit of work
    inserts outbox rows at the end, after the business writes: a producer that waited for
    another one's lock inserts after that one committed."""
    if is_postgres(dialect) or is_mysql(dialect):
        return (alias.c.seq,)  # MySQL: AUTO_INCREMENT, in insert order as PostgreSQL's
    # Quoted: the table may carry an SQL keyword's name (``order``).
    quoted = dialect.identifier_preparer.quote(alias.name)
    return (literal_column(f"{quoted}.rowid"),)


def now(dialect: Dialect) -> ColumnElement[dt.datetime]:
    """The clock every due time is compared with: the database's (see `clock`), one
    clock for every process whatever its host's clock says."""
    return clock.db_now(flavor(dialect))


def later(dialect: Dialect, seconds: float) -> ColumnElement[dt.datetime]:
    """The database's now plus ``seconds`` (negative: earlier), the value bound in place."""
    return clock.db_later(flavor(dialect), seconds=seconds)  # type: ignore[no-any-return]


def offset(dialect: Dialect, seconds: float) -> Any:
    """The value of a named `clock.db_later` parameter: an interval on PostgreSQL, a
    date modifier on SQLite, microseconds on MySQL."""
    return clock.offset_value(flavor(dialect), seconds)


def derived(chosen: Select[Any], dialect: Dialect) -> Select[Any]:
    """``chosen`` (rows of a table picked for a change of that same table) as MySQL accepts
    it in the change's ``IN (…)``: read from a derived table, which MySQL materialises
    first. Asked directly it refuses both a subquery on the table being changed (error
    1093) and a ``LIMIT`` in an ``IN`` subquery (1235). Other dialects: as it is."""
    if not is_mysql(dialect):
        return chosen
    inner = chosen.subquery("chosen")
    return select(*inner.c)

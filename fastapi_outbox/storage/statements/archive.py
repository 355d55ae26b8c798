"""The archive's statements (``OutboxSettings(archive=True)``): the batched move of finished
rows from the outbox table to the archive table, the archive's own retention, and the
catalogue changes that re-attach a finished partition to a partitioned archive.

Caller: `fastapi_outbox.storage.archive.Archive` (``move_batch``, ``purge_batch``),
run by the relay's cleaner (`fastapi_outbox.lifecycle.retention`),
`fastapi_outbox.storage.partitions` (``archive_partition_sync``,
``expired_archive_partitions``, ``archive_default_statements``) and
`fastapi_outbox.storage.doctor` (the fix for a missing DEFAULT partition of the
archive). Every builder is pure.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Table, delete, exists, insert, select, text
from sqlalchemy.engine import Dialect
from sqlalchemy.sql.elements import TextClause

from fastapi_outbox.storage.statements.partitions import quote
from fastapi_outbox.storage.statements.parts import derived, ids_in, later, now
from fastapi_outbox.storage.statements.purge import victims

__all__ = [
    "PARTITION_BOUND",
    "PARTITION_OF",
    "add_archived_at",
    "archive_busy",
    "archived_at_index",
    "attach_as",
    "copy_ids",
    "copy_rows",
    "delete_ids",
    "move",
    "move_delete",
    "move_ids",
    "move_insert",
    "purge",
]


def _columns(source: Table) -> list[str]:
    return [c.name for c in source.c]


def move(
    source: Table,
    archive: Table,
    status: str,
    older_than_seconds: float,
    limit: int,
    dialect: Dialect,
    *,
    keep_blocking: bool = False,
    whole: Table | None = None,
) -> Any:
    """PostgreSQL: one batch of the move as ONE statement, ``WITH moved AS (DELETE … RETURNING
    *) INSERT INTO archive SELECT …``: the rows leave the outbox and enter the archive
    atomically, chosen exactly as retention's DELETE chooses them (``LIMIT``, ``FOR UPDATE
    SKIP LOCKED``, the partial index of their status). ``source``: the outbox table, or
    its DEFAULT partition on a partitioned outbox (``whole``: the outbox table)."""
    chosen = victims(
        source,
        status,
        older_than_seconds,
        limit,
        dialect,
        keep_blocking=keep_blocking,
        whole=whole,
    )
    names = _columns(source)
    moved = (
        delete(source)
        .where(source.c.id.in_(chosen.scalar_subquery()))
        .returning(*[source.c[n] for n in names])
        .cte("moved")
    )
    return insert(archive).from_select(
        [*names, "archived_at"], select(*[moved.c[n] for n in names], now(dialect))
    )


def move_insert(
    source: Table,
    archive: Table,
    status: str,
    older_than_seconds: float,
    limit: int,
    dialect: Dialect,
    *,
    keep_blocking: bool = False,
) -> Any:
    """SQLite (no DELETE in a WITH), first of the two statements of one transaction: copy
    one batch into the archive. It takes the database's write lock, so nobody changes the
    outbox before `move_delete` picks the same rows (``ordered``: by finish time and
    id, and rows that qualify later finished later)."""
    chosen = victims(
        source,
        status,
        older_than_seconds,
        limit,
        dialect,
        keep_blocking=keep_blocking,
        ordered=True,
    )
    names = _columns(source)
    return insert(archive).from_select(
        [*names, "archived_at"],
        select(*[source.c[n] for n in names], now(dialect)).where(
            source.c.id.in_(chosen.scalar_subquery())
        ),
    )


def move_delete(
    source: Table,
    archive: Table,
    status: str,
    older_than_seconds: float,
    limit: int,
    dialect: Dialect,
    *,
    keep_blocking: bool = False,
) -> Any:
    """SQLite, second statement of the move's transaction: delete the rows
    `move_insert` copied — the same choice, and only rows the archive now holds
    (never a row that was not archived)."""
    chosen = victims(
        source,
        status,
        older_than_seconds,
        limit,
        dialect,
        keep_blocking=keep_blocking,
        ordered=True,
    )
    a = archive.alias("a")
    return delete(source).where(
        source.c.id.in_(chosen.scalar_subquery()),
        exists().where(a.c.id == source.c.id),
    )


def move_ids(
    source: Table,
    archive: Table,
    status: str,
    older_than_seconds: float,
    limit: int,
    dialect: Dialect,
    *,
    keep_blocking: bool = False,
) -> Any:
    """MySQL, first of the move's three statements (one transaction): the ids of one batch,
    chosen as retention's DELETE chooses them, locked ``FOR UPDATE SKIP LOCKED`` (a row an
    operator holds is left to them); `copy_ids` and `delete_ids` then move
    exactly these."""
    chosen = victims(
        source, status, older_than_seconds, limit, dialect, keep_blocking=keep_blocking
    )
    return chosen.with_for_update(skip_locked=True)


def copy_ids(source: Table, archive: Table, dialect: Dialect) -> Any:
    """MySQL: copy the rows ``ids`` (locked by `move_ids`) into the archive."""
    names = _columns(source)
    return insert(archive).from_select(
        [*names, "archived_at"],
        select(*[source.c[n] for n in names], now(dialect)).where(ids_in(source, dialect)),
    )


def delete_ids(source: Table, dialect: Dialect) -> Any:
    """MySQL: delete the rows ``ids`` that `copy_ids` copied."""
    return delete(source).where(ids_in(source, dialect))


def purge(table: Table, older_than_seconds: float, limit: int, dialect: Dialect) -> Any:
    """The archive's retention: delete up to ``limit`` rows archived more than
    ``older_than_seconds`` ago (ix_<archive>_archived_at; on a partitioned archive, its
    DEFAULT partition, whose partitions are dropped whole)."""
    t = table
    chosen = select(t.c.id).where(t.c.archived_at < later(dialect, -older_than_seconds))
    return delete(t).where(t.c.id.in_(derived(chosen.limit(limit), dialect).scalar_subquery()))


# -- a partitioned archive (PostgreSQL) --------------------------------------------------------

#: ``archive_partition_sync``, before the detach: the partition's bound as PostgreSQL
#: prints it (``FOR VALUES FROM (…) TO (…)``), attached to the archive as it is — so the
#: archive follows whatever partition key the outbox table has.
PARTITION_BOUND = text(
    "SELECT pg_get_expr(c.relpartbound, c.oid) FROM pg_class c WHERE c.oid = to_regclass(:name)"
)


def archived_at_index(index: str, default: str) -> str:
    """``create_archive_default_sync``, ``db sql`` and the doctor's fix: the ``archived_at``
    index of a partitioned archive's DEFAULT partition ``default`` (the only partition
    whose rows the archive's retention deletes in batches; the others are dropped whole)."""
    return f"CREATE INDEX IF NOT EXISTS {quote(index)} ON {quote(default)} (archived_at)"


#: ``archive_partition_sync``, under the maintenance lock: is ``:name`` still a partition of
#: ``:parent`` (both quoted names)? Another process may have archived it since the
#: candidates were chosen (it then belongs to the archive).
PARTITION_OF = text(
    "SELECT EXISTS (SELECT 1 FROM pg_inherits WHERE inhrelid = to_regclass(:name) "
    "AND inhparent = to_regclass(:parent))"
)


def add_archived_at(name: str) -> TextClause:
    """``archive_partition_sync``, on the detached partition: the archive's extra column.
    A default that is not volatile is stored in the catalogue (PostgreSQL 11+): no row is
    rewritten, every row reads the time of the move."""
    return text(
        f"ALTER TABLE {quote(name)} ADD COLUMN archived_at TIMESTAMP WITH TIME ZONE "
        "NOT NULL DEFAULT now()"
    )


def attach_as(archive: str, name: str, bound: str) -> TextClause:
    """``archive_partition_sync``: attach the detached partition ``name`` to the archive
    with the ``bound`` it had in the outbox. Its indexes match the archive's (same layout),
    so they are taken over, none is built; PostgreSQL checks its rows against the bound
    (a read) and the archive's DEFAULT partition for rows of that range."""
    return text(f"ALTER TABLE {quote(archive)} ATTACH PARTITION {quote(name)} {bound}")


def copy_rows(archive: str, name: str, columns: list[str]) -> TextClause:
    """``archive_partition_sync``, only when the attach is refused (the archive's DEFAULT
    partition already holds rows of that range, moved there in batches): the rows are
    copied instead, then the partition dropped, in the same transaction."""
    names = ", ".join(quote(c) for c in columns)
    return text(f"INSERT INTO {quote(archive)} ({names}) SELECT {names} FROM {quote(name)}")


def archive_busy(name: str) -> TextClause:
    """``expired_archive_partitions``: does archive partition ``name`` hold a row archived
    at or after ``:cutoff``? Re-attached partitions have one archived_at for all their rows,
    so this stops at the first row unless the partition is to be dropped."""
    return text(f"SELECT EXISTS (SELECT 1 FROM {quote(name)} WHERE archived_at >= :cutoff)")

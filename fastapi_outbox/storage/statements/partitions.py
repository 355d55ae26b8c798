"""The statements of partition upkeep (PostgreSQL, ``partitioning="daily"``/``"hourly"``):
the catalogue reads, the maintenance lock, creating, attaching, detaching and dropping a
partition, and the DDL of ``db sql``.

Caller: `fastapi_outbox.storage.partitions` (``list_partitions``, ``ranges_to_create``,
``create_partition_sync``, ``expired_candidates``, ``drop_partition_sync``,
``statements``: run by ``create_tables()``/``db create``, the relay's cleaner through
``Maintainer``, and ``db sql``) and `fastapi_outbox.storage.doctor` (the fixes it
suggests for a missing DEFAULT partition or partitions ahead). Names come in plain (the
table name is checked by the settings) and are double-quoted here, for keywords. DDL takes
no bound parameters, so bounds and storage parameters are literals; every builder is pure.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Sequence

from sqlalchemy import text
from sqlalchemy.sql.elements import TextClause

__all__ = [
    "ACTIVE_SQL",
    "AUTOVACUUM",
    "DB_NOW",
    "KEY_CREATED_AT",
    "KEY_ID",
    "PARTITION_KEY",
    "RELATION_EXISTS",
    "RELATION_MISSING",
    "TRY_LOCK",
    "UTC",
    "active_partitions",
    "any_active",
    "attach",
    "bound_literal",
    "bound_value",
    "busy",
    "create_default",
    "create_like",
    "default_has_rows",
    "detach",
    "drop",
    "id_bound",
    "list_partitions",
    "lock_timeout",
    "partition_of",
    "quote",
    "storage_sql",
]

#: Storage parameters of every outbox table and partition: autovacuum follows a queue's
#: churn (a fixed number of dead rows) rather than the table's size.
AUTOVACUUM = {
    "autovacuum_vacuum_scale_factor": "0.0",
    "autovacuum_vacuum_threshold": "5000",
    "autovacuum_analyze_scale_factor": "0.0",
    "autovacuum_analyze_threshold": "5000",
}
#: The rows that still need work, with literal statuses: the predicate of the partial
#: indexes (ix_<table>_due …), so a check with it is an index probe, never a scan.
ACTIVE_SQL = "status IN ('pending', 'processing', 'failed')"


def quote(name: str) -> str:
    """``name`` as a quoted identifier (names are checked plain identifiers; quoted for
    keywords)."""
    return '"' + name.replace('"', '""') + '"'


def storage_sql() -> str:
    """`AUTOVACUUM` as the body of a ``WITH (…)`` clause."""
    return ", ".join(f"{k} = {v}" for k, v in AUTOVACUUM.items())


#: The partition key of the layout: the UUIDv7 id, whose first 48 bits are its creation
#: time in Unix milliseconds, so a time range is an id range and every lookup by id prunes
#: to one partition.
KEY_ID = "id"
#: The partition key of tables created by earlier releases (still maintained; lookups by
#: id alone probe every partition there).
KEY_CREATED_AT = "created_at"
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


def id_bound(at: dt.datetime) -> uuid.UUID:
    """The smallest UUIDv7 created at or after ``at`` (to the millisecond): ``at``'s Unix
    milliseconds in the first 48 bits, zeros after. UUIDs compare byte by byte in
    PostgreSQL (and as integers in Python), so ``[id_bound(lo), id_bound(hi))`` holds
    exactly the ids made in ``[lo, hi)``."""
    ms = (at - _EPOCH) // dt.timedelta(milliseconds=1)
    return uuid.UUID(int=ms << 80)


def bound_value(key: str, at: dt.datetime) -> dt.datetime | uuid.UUID:
    """A range bound at ``at`` in the partition key's type (bound as a parameter)."""
    return id_bound(at) if key == KEY_ID else at


def bound_literal(key: str, at: dt.datetime) -> str:
    """A range bound at ``at`` as an SQL literal (DDL takes no parameters)."""
    return f"'{id_bound(at)}'" if key == KEY_ID else f"'{at.isoformat()}'"


#: ``partition_key``: the partition key of ``:name`` (``RANGE (id)``), NULL when the
#: table is not partitioned.
PARTITION_KEY = text("SELECT pg_get_partkeydef(to_regclass(:name))")
#: ``list_partitions``, first in its transaction: ``pg_get_expr`` prints range bounds in
#: the session's time zone; in UTC they parse the same on every server.
UTC = text("SET LOCAL TimeZone = 'UTC'")
#: ``list_partitions``: each partition of ``:name`` (a quoted name, resolved by
#: ``to_regclass`` with the search path) and its bound as text (``FOR VALUES FROM (…) TO
#: (…)`` or ``DEFAULT``). ``pg_inherits`` lists direct children only: a partition's own
#: partitions are not ours.
LIST_PARTITIONS_SQL = (
    "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i "
    "JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = to_regclass(:name)"
)
#: ``ranges_to_create`` and ``expired_candidates``: the database's clock (the transaction's
#: start), not the process's, so every process cuts ranges and retention alike.
DB_NOW = text("SELECT now()")
#: ``create_partition_sync``: the partition ``:name`` exists already (another process, or
#: an earlier run, made it): nothing to do.
RELATION_EXISTS = text("SELECT to_regclass(:name) IS NOT NULL")
#: ``drop_partition_sync``: the partition ``:name`` is gone (another process dropped it).
RELATION_MISSING = text("SELECT to_regclass(:name) IS NULL")
#: The table's maintenance lock (``:key`` names the table): transaction-scoped, so it ends
#: with the catalogue change it guards, and *try*: a process that does not get it skips
#: the upkeep instead of queueing behind another process doing the same.
TRY_LOCK = text("SELECT pg_try_advisory_xact_lock(hashtext(:key))")


def list_partitions() -> TextClause:
    """`LIST_PARTITIONS_SQL` (bound: ``:name``, the quoted table name)."""
    return text(LIST_PARTITIONS_SQL)


def lock_timeout(seconds: float) -> TextClause:
    """``Maintainer``, before each create or drop: its locks are waited for ``seconds`` at
    most (``SET LOCAL``: for this transaction only), so maintenance never queues producers
    behind a long transaction; a change that times out is tried at the next run."""
    return text(f"SET LOCAL lock_timeout = '{int(seconds * 1000)}ms'")


def create_default(table: str, default: str, *, if_not_exists: bool = True) -> str:
    """The DEFAULT partition ``default`` of ``table``: it takes rows no partition covers,
    so a maintenance job that did not run never fails a producer. ``IF NOT EXISTS``
    (``create_default_sync``, ``db sql``): idempotent; without it (the doctor's fix, run
    only when it is missing) a concurrent creation is an error the operator sees."""
    exists = "IF NOT EXISTS " if if_not_exists else ""
    return (
        f"CREATE TABLE {exists}{quote(default)} PARTITION OF {quote(table)} "
        f"DEFAULT WITH ({storage_sql()})"
    )


def partition_of(
    table: str,
    name: str,
    lo: dt.datetime,
    hi: dt.datetime,
    *,
    if_not_exists: bool = True,
    key: str = KEY_ID,
) -> str:
    """``db sql`` (``IF NOT EXISTS``) and the doctor's fix: the partition ``name`` of
    ``[lo, hi)`` created directly as a partition — on a new table, where the ACCESS
    EXCLUSIVE lock on the parent costs nothing; the cleaner uses `create_like` and
    `attach` instead."""
    exists = "IF NOT EXISTS " if if_not_exists else ""
    return (
        f"CREATE TABLE {exists}{quote(name)} PARTITION OF {quote(table)} "
        f"FOR VALUES FROM ({bound_literal(key, lo)}) TO ({bound_literal(key, hi)}) "
        f"WITH ({storage_sql()})"
    )


def default_has_rows(default: str, key: str = KEY_ID) -> TextClause:
    """``create_partition_sync``: does the DEFAULT partition hold rows of ``[:lo, :hi)``
    (bounds in the type of the partition ``key``: see `bound_value`; the job did not
    run in time)? ATTACH would fail on them, so the range is left to the DEFAULT
    partition. ``EXISTS``: stops at the first row (the primary key serves the id range)."""
    column = quote(key)
    return text(
        f"SELECT EXISTS (SELECT 1 FROM {quote(default)} WHERE {column} >= :lo AND {column} < :hi)"
    )


def create_like(name: str, table: str) -> TextClause:
    """``create_partition_sync``: a plain table shaped like the parent (``INCLUDING
    DEFAULTS``: the column defaults), to be attached. LIKE + ATTACH rather than PARTITION
    OF: ATTACH locks the parent in SHARE UPDATE EXCLUSIVE mode only, so producers and
    relays go on meanwhile; the partitioned indexes are created on it by the ATTACH."""
    return text(
        f"CREATE TABLE {quote(name)} (LIKE {quote(table)} INCLUDING DEFAULTS) "
        f"WITH ({storage_sql()})"
    )


def attach(
    table: str, name: str, lo: dt.datetime, hi: dt.datetime, key: str = KEY_ID
) -> TextClause:
    """``create_partition_sync``: attach ``name`` for ``[lo, hi)`` (bounds of the partition
    ``key``: see `bound_literal`; checks the empty table, and the DEFAULT partition
    under a short lock)."""
    return text(
        f"ALTER TABLE {quote(table)} ATTACH PARTITION {quote(name)} "
        f"FOR VALUES FROM ({bound_literal(key, lo)}) TO ({bound_literal(key, hi)})"
    )


def busy(name: str, *, published: bool, abandoned: bool) -> TextClause:
    """``expired_candidates``: does partition ``name`` hold a row still to keep — an active
    one, or a published (abandoned) one finished at or after ``:published``
    (``:abandoned``)? ``published``/``abandoned`` False: that retention is forever, so any
    such row keeps the partition. Each ``EXISTS`` has the predicate of one partial index
    (due, published, abandoned), so the check probes indexes and never scans."""
    checks = [f"EXISTS (SELECT 1 FROM {quote(name)} WHERE {ACTIVE_SQL})"]
    for status, column, cutoff in (
        ("published", "published_at", published),
        ("abandoned", "abandoned_at", abandoned),
    ):
        if not cutoff:
            checks.append(f"EXISTS (SELECT 1 FROM {quote(name)} WHERE status IN ('{status}'))")
        else:
            checks.append(
                f"EXISTS (SELECT 1 FROM {quote(name)} WHERE status IN ('{status}') "
                f"AND {column} >= :{status})"
            )
    return text("SELECT " + " OR ".join(checks))


def detach(table: str, name: str) -> TextClause:
    """``detach_partition_sync`` (run by ``drop_partition_sync``): a plain DETACH
    (PostgreSQL refuses ``CONCURRENTLY`` when a DEFAULT partition exists): a brief ACCESS
    EXCLUSIVE lock on the parent, bounded by `lock_timeout`."""
    return text(f"ALTER TABLE {quote(table)} DETACH PARTITION {quote(name)}")


def any_active(name: str) -> TextClause:
    """``drop_partition_sync``, after the detach and under its lock: did a row of ``name``
    become active again (a replay since it was chosen)? Then the drop rolls back."""
    return text(f"SELECT EXISTS (SELECT 1 FROM {quote(name)} WHERE {ACTIVE_SQL})")


def active_partitions(names: Sequence[str]) -> TextClause:
    """``PartitionMap.refresh``: which of the partitions ``names`` hold a row of broker
    ``:broker`` that still needs work — one ``EXISTS`` per partition, each a probe of its
    partial due index (whose first column is the broker); the position of each that does.
    Built per list of partitions (they change once a day)."""
    probes = [
        f"SELECT {i} AS n WHERE EXISTS (SELECT 1 FROM ONLY {quote(name)} "
        f"WHERE broker = :broker AND {ACTIVE_SQL})"
        for i, name in enumerate(names)
    ]
    return text(" UNION ALL ".join(probes))


def drop(name: str) -> TextClause:
    """``drop_partition_sync``: the detached partition, in the detach's transaction."""
    return text(f"DROP TABLE {quote(name)}")

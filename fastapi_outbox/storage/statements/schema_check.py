"""The statements of ``fastapi-outbox doctor`` and ``db upgrade``: the catalogue reads that
describe the live table, the probe that lets PostgreSQL describe the expected one, and the
fixes a finding carries.

Caller: `fastapi_outbox.storage.doctor` (``examine_sync`` and its helpers for the
reads, the findings for the fixes, ``_upgrade_once`` for the lock timeout), run by the CLI's
``doctor`` and ``db upgrade``. Names come in
plain and are double-quoted here; catalogue reads take a *quoted* relation name as
``:r`` and resolve it with ``to_regclass`` (the search path, no error when missing). Every
builder is pure.
"""

from __future__ import annotations

import re

from sqlalchemy import text
from sqlalchemy.sql.elements import TextClause

from fastapi_outbox.storage.statements.partitions import quote

__all__ = [
    "COLUMNS",
    "INDEXES",
    "RELKIND",
    "RELOPTIONS",
    "RESET_LOCK_TIMEOUT",
    "SQLITE_INDEXES",
    "add_column",
    "alter_type",
    "create_index",
    "drop_column",
    "drop_index",
    "lock_timeout",
    "probe_index",
    "probe_table",
    "rename_in_create",
    "rename_index",
    "reset_lock_timeout",
    "set_not_null",
    "set_storage",
    "sqlite_columns",
]

#: ``_pg_columns`` (live table and probe): name, type as ``format_type`` prints it (with
#: its modifier: ``varchar(200)``), NOT NULL and identity of each column of ``:r``.
#: ``attnum > 0``: user columns, not the system ones; ``NOT attisdropped``: a dropped
#: column stays in the catalogue until the table is rewritten.
COLUMNS = text(
    "SELECT attname, format_type(atttypid, atttypmod), attnotnull, attidentity "
    "FROM pg_attribute WHERE attrelid = to_regclass(:r) AND attnum > 0 "
    "AND NOT attisdropped"
)
#: ``_pg_indexes`` (live table and probe): each index of ``:r`` with its definition
#: (``pg_get_indexdef``: normalised by PostgreSQL, so it compares as text with the probe's),
#: whether it is valid (an interrupted ``CONCURRENTLY`` build leaves an invalid one) and
#: whether it is the primary key.
INDEXES = text(
    "SELECT c.relname, pg_get_indexdef(i.indexrelid), i.indisvalid, i.indisprimary "
    "FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
    "WHERE i.indrelid = to_regclass(:r)"
)
#: ``_pg_reloptions``: the storage parameters of ``:r`` (``key=value`` strings, or NULL),
#: compared with the autovacuum settings every outbox table and partition gets.
RELOPTIONS = text("SELECT reloptions FROM pg_class WHERE oid = to_regclass(:r)")
#: ``_pg_partitioned``: the kind of ``:r`` (``p``: partitioned, ``r``: plain); no row when
#: the table does not exist.
RELKIND = text("SELECT relkind::text FROM pg_class WHERE oid = to_regclass(:r)")
#: ``_examine_sqlite``: each index of table ``:t`` with the SQL that created it (NULL for
#: the automatic ones of a primary key or UNIQUE constraint, which the doctor skips).
SQLITE_INDEXES = text("SELECT name, sql FROM sqlite_master WHERE type = 'index' AND tbl_name = :t")
#: ``_upgrade_once``, after each fix on PostgreSQL: the pooled connection goes back with the
#: server's default lock timeout.
RESET_LOCK_TIMEOUT = text("RESET lock_timeout")


def sqlite_columns(table: str) -> TextClause:
    """``_examine_sqlite``: the columns of ``table`` (a pragma takes no bound parameter; no
    row when the table does not exist)."""
    return text(f"PRAGMA table_info({quote(table)})")


def probe_table(create: str, probe: str) -> str:
    """``_expected_pg``: the expected table's ``CREATE TABLE`` as a temporary table named
    ``probe`` (rolled back with its savepoint), without ``PARTITION BY``: the probe only
    needs the columns and indexes PostgreSQL reports for it."""
    create = re.sub(r"^\s*CREATE TABLE \S+", f"CREATE TEMPORARY TABLE {probe}", create)
    return re.sub(r"\s*PARTITION BY RANGE \(created_at\)", "", create)


def probe_index(ddl: str, probe: str) -> str:
    """``_expected_pg``: an expected index's ``CREATE INDEX`` on the probe table."""
    return re.sub(r" ON \S+ ", f" ON {probe} ", ddl, count=1)


def lock_timeout(ms: int, *, mysql: bool = False) -> TextClause:
    """``_upgrade_once``, before each fix on PostgreSQL: its lock is waited for ``ms`` at
    most, so an ``ALTER TABLE`` queued behind a long transaction never holds every write
    to the table behind it (session-level: the fix runs in autocommit). MySQL: the same
    for its metadata lock (``lock_wait_timeout``, whole seconds)."""
    if mysql:
        return text(f"SET SESSION lock_wait_timeout = {max(1, round(ms / 1000))}")
    return text(f"SET lock_timeout = {ms}")


def reset_lock_timeout(*, mysql: bool = False) -> TextClause:
    """``_upgrade_once``, after each fix: the pooled connection goes back with the
    server's default lock timeout."""
    if mysql:
        return text("SET SESSION lock_wait_timeout = DEFAULT")
    return RESET_LOCK_TIMEOUT


def add_column(table: str, column_ddl: str) -> str:
    """Fix of a missing column (``column_ddl``: the layout's column as SQLAlchemy compiles
    it). A new nullable column or one with a constant default rewrites no row."""
    return f"ALTER TABLE {quote(table)} ADD COLUMN {column_ddl}"


def alter_type(table: str, column: str, type_: str) -> str:
    """Fix of a column of another type (reported, not applied: it rewrites the table);
    ``USING`` casts the stored values."""
    return (
        f"ALTER TABLE {quote(table)} ALTER COLUMN {quote(column)} TYPE {type_} "
        f"USING {quote(column)}::{type_}"
    )


def set_not_null(table: str, column: str, not_null: bool) -> str:
    """Fix of a column of another nullability (reported, not applied: SET scans the
    table)."""
    verb = "SET" if not_null else "DROP"
    return f"ALTER TABLE {quote(table)} ALTER COLUMN {quote(column)} {verb} NOT NULL"


def drop_column(table: str, column: str) -> str:
    """Fix of an obsolete column: a catalogue change, no rewrite."""
    return f"ALTER TABLE {quote(table)} DROP COLUMN {quote(column)}"


def create_index(ddl: str, *, concurrently: bool) -> str:
    """Fix of a missing or different index on PostgreSQL: the layout's ``CREATE INDEX``
    (``ddl``) made idempotent (``IF NOT EXISTS``: a retried upgrade), and ``CONCURRENTLY``
    on a plain table, which keeps taking writes while the index builds (PostgreSQL has no
    CONCURRENTLY for an index on a partitioned table)."""
    return ddl.replace(
        "CREATE INDEX ",
        f"CREATE INDEX {'CONCURRENTLY ' if concurrently else ''}IF NOT EXISTS ",
        1,
    )


def rename_in_create(create: str, name: str, new: str) -> str:
    """A `create_index` statement that builds the index under the name ``new``."""
    return create.replace(f"EXISTS {name} ", f"EXISTS {new} ", 1)


def drop_index(name: str, *, concurrently: bool = False, if_exists: bool = True) -> str:
    """Fix of a different or invalid index: drop it (``CONCURRENTLY`` on a plain
    PostgreSQL table, like its build; ``IF EXISTS``: a retried upgrade). SQLite's fix is a
    plain ``DROP INDEX`` (``if_exists`` False) followed by the layout's ``CREATE INDEX``."""
    return (
        f"DROP INDEX {'CONCURRENTLY ' if concurrently else ''}"
        f"{'IF EXISTS ' if if_exists else ''}{quote(name)}"
    )


def rename_index(old: str, name: str) -> str:
    """Fix of a different index, last step: the index built under a temporary name takes
    the layout's (claims kept an index throughout)."""
    return f"ALTER INDEX {quote(old)} RENAME TO {quote(name)}"


def set_storage(relation: str, settings: str) -> str:
    """Fix of missing autovacuum settings (``settings``: ``key = value, …``): a catalogue
    change, applied to the next vacuum."""
    return f"ALTER TABLE {quote(relation)} SET ({settings})"

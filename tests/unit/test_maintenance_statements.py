"""The statements of partition upkeep, of the doctor and of the driver plumbing, built
without a database.

Each expected text below is the statement as ``storage/partitions.py``,
``storage/doctor.py``, ``storage/engine.py`` and ``storage/db_outage.py`` wrote it inline
before it moved to ``storage/statements/``: the move changes no SQL. The catalogue reads
are also compiled for PostgreSQL (and SQLite where the doctor runs them there) to check
their bound parameters.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy.dialects import postgresql, sqlite

from fastapi_outbox.storage.statements import partitions as part
from fastapi_outbox.storage.statements import schema_check, session

PG = postgresql.dialect()
LITE = sqlite.dialect()
LO = dt.datetime(2026, 11, 25, tzinfo=dt.UTC)
HI = LO + dt.timedelta(days=1)
WITH = (
    "autovacuum_vacuum_scale_factor = 0.0, autovacuum_vacuum_threshold = 5000, "
    "autovacuum_analyze_scale_factor = 0.0, autovacuum_analyze_threshold = 5000"
)
ACTIVE = "status IN ('pending', 'processing', 'failed')"


def pg(stmt: Any) -> str:
    return str(stmt.compile(dialect=PG))


# -- partitions ------------------------------------------------------------------------------


def test_names_are_quoted_for_keywords_and_embedded_quotes() -> None:
    assert part.quote("outbox") == '"outbox"'
    assert part.quote('a"b') == '"a""b"'


def test_catalogue_reads_bind_the_quoted_name() -> None:
    assert str(part.UTC) == "SET LOCAL TimeZone = 'UTC'"
    assert str(part.list_partitions()) == (
        "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i "
        "JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = to_regclass(:name)"
    )
    assert "to_regclass(%(name)s)" in pg(part.list_partitions())
    assert str(part.DB_NOW) == "SELECT now()"
    assert str(part.RELATION_EXISTS) == "SELECT to_regclass(:name) IS NOT NULL"
    assert str(part.RELATION_MISSING) == "SELECT to_regclass(:name) IS NULL"
    assert pg(part.TRY_LOCK) == "SELECT pg_try_advisory_xact_lock(hashtext(%(key)s))"


def test_lock_timeout_is_transaction_local_in_milliseconds() -> None:
    assert str(part.lock_timeout(2.0)) == "SET LOCAL lock_timeout = '2000ms'"


def test_default_partition_with_and_without_if_not_exists() -> None:
    assert part.create_default("outbox", "outbox_default") == (
        f'CREATE TABLE IF NOT EXISTS "outbox_default" PARTITION OF "outbox" DEFAULT WITH ({WITH})'
    )
    assert part.create_default("outbox", "outbox_default", if_not_exists=False) == (
        f'CREATE TABLE "outbox_default" PARTITION OF "outbox" DEFAULT WITH ({WITH})'
    )


#: The ids of 2026-11-25 00:00 and 2026-11-26 00:00 UTC: Unix ms in the first 48 bits.
ID_LO = "01a21000-8800-0000-0000-000000000000"
ID_HI = "01a21526-e400-0000-0000-000000000000"


def test_id_bound_is_the_smallest_uuid7_of_the_millisecond() -> None:
    assert str(part.id_bound(LO)) == ID_LO
    assert part.id_bound(LO).int >> 80 == 1795564800000
    assert part.bound_value("created_at", LO) == LO
    assert part.bound_literal("id", HI) == f"'{ID_HI}'"


def test_partition_of_a_range_in_id_bounds_or_utc_iso_bounds() -> None:
    assert part.partition_of("outbox", "outbox_p20261125", LO, HI) == (
        'CREATE TABLE IF NOT EXISTS "outbox_p20261125" PARTITION OF "outbox" '
        f"FOR VALUES FROM ('{ID_LO}') TO ('{ID_HI}') "
        f"WITH ({WITH})"
    )
    # A table partitioned by created_at (an earlier release): timestamps.
    assert part.partition_of("outbox", "outbox_p20261125", LO, HI, key="created_at") == (
        'CREATE TABLE IF NOT EXISTS "outbox_p20261125" PARTITION OF "outbox" '
        "FOR VALUES FROM ('2026-11-25T00:00:00+00:00') TO ('2026-11-26T00:00:00+00:00') "
        f"WITH ({WITH})"
    )
    assert part.partition_of("outbox", "p", LO, HI, if_not_exists=False).startswith(
        'CREATE TABLE "p" PARTITION OF "outbox" FOR VALUES'
    )


def test_create_like_then_attach() -> None:
    assert str(part.create_like("outbox_p20261125", "outbox")) == (
        f'CREATE TABLE "outbox_p20261125" (LIKE "outbox" INCLUDING DEFAULTS) WITH ({WITH})'
    )
    assert str(part.attach("outbox", "outbox_p20261125", LO, HI)) == (
        'ALTER TABLE "outbox" ATTACH PARTITION "outbox_p20261125" '
        f"FOR VALUES FROM ('{ID_LO}') TO ('{ID_HI}')"
    )
    assert str(part.attach("outbox", "outbox_p20261125", LO, HI, "created_at")) == (
        'ALTER TABLE "outbox" ATTACH PARTITION "outbox_p20261125" '
        "FOR VALUES FROM ('2026-11-25T00:00:00+00:00') TO ('2026-11-26T00:00:00+00:00')"
    )
    # The timestamps' colons are literals, not bound parameters.
    assert part.attach("outbox", "p", LO, HI, "created_at").compile(dialect=PG).params == {}


def test_default_has_rows_binds_the_range() -> None:
    assert pg(part.default_has_rows("outbox_default")) == (
        'SELECT EXISTS (SELECT 1 FROM "outbox_default" WHERE "id" >= %(lo)s AND "id" < %(hi)s)'
    )
    assert pg(part.default_has_rows("outbox_default", "created_at")) == (
        'SELECT EXISTS (SELECT 1 FROM "outbox_default" '
        'WHERE "created_at" >= %(lo)s AND "created_at" < %(hi)s)'
    )


def test_busy_checks_the_partial_index_predicates_and_binds_only_the_cutoffs_given() -> None:
    both = part.busy("p", published=True, abandoned=True)
    assert str(both) == (
        f'SELECT EXISTS (SELECT 1 FROM "p" WHERE {ACTIVE}) OR '
        "EXISTS (SELECT 1 FROM \"p\" WHERE status IN ('published') AND published_at >= :published)"
        " OR "
        "EXISTS (SELECT 1 FROM \"p\" WHERE status IN ('abandoned') AND abandoned_at >= :abandoned)"
    )
    forever = part.busy("p", published=False, abandoned=False)
    assert str(forever) == (
        f'SELECT EXISTS (SELECT 1 FROM "p" WHERE {ACTIVE}) OR '
        "EXISTS (SELECT 1 FROM \"p\" WHERE status IN ('published')) OR "
        "EXISTS (SELECT 1 FROM \"p\" WHERE status IN ('abandoned'))"
    )
    assert set(part.busy("p", published=True, abandoned=False).compile().params) == {"published"}


def test_detach_recheck_drop() -> None:
    assert str(part.detach("outbox", "p")) == 'ALTER TABLE "outbox" DETACH PARTITION "p"'
    assert str(part.any_active("p")) == f'SELECT EXISTS (SELECT 1 FROM "p" WHERE {ACTIVE})'
    assert str(part.drop("p")) == 'DROP TABLE "p"'


# -- doctor ------------------------------------------------------------------------------------


def test_doctor_catalogue_reads() -> None:
    assert pg(schema_check.COLUMNS) == (
        "SELECT attname, format_type(atttypid, atttypmod), attnotnull, attidentity "
        "FROM pg_attribute WHERE attrelid = to_regclass(%(r)s) AND attnum > 0 "
        "AND NOT attisdropped"
    )
    assert pg(schema_check.INDEXES) == (
        "SELECT c.relname, pg_get_indexdef(i.indexrelid), i.indisvalid, i.indisprimary "
        "FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
        "WHERE i.indrelid = to_regclass(%(r)s)"
    )
    assert pg(schema_check.RELOPTIONS) == (
        "SELECT reloptions FROM pg_class WHERE oid = to_regclass(%(r)s)"
    )
    assert pg(schema_check.RELKIND) == (
        "SELECT relkind::text FROM pg_class WHERE oid = to_regclass(%(r)s)"
    )
    assert str(schema_check.SQLITE_INDEXES.compile(dialect=LITE)) == (
        "SELECT name, sql FROM sqlite_master WHERE type = 'index' AND tbl_name = ?"
    )
    assert str(schema_check.sqlite_columns("outbox")) == 'PRAGMA table_info("outbox")'


def test_probe_renames_the_table_and_drops_the_partitioning() -> None:
    create = '\nCREATE TABLE "outbox" (\n\tid UUID\n) PARTITION BY RANGE (created_at)\n\n'
    assert (
        schema_check.probe_table(create, "probe")
        == "CREATE TEMPORARY TABLE probe (\n\tid UUID\n)\n\n"
    )
    index = "CREATE INDEX ix_outbox_due ON outbox (next_attempt_at) WHERE status = 'x'"
    assert schema_check.probe_index(index, "probe") == (
        "CREATE INDEX ix_outbox_due ON probe (next_attempt_at) WHERE status = 'x'"
    )


def test_upgrade_lock_timeout_is_set_then_reset() -> None:
    assert str(schema_check.lock_timeout(2000)) == "SET lock_timeout = 2000"
    assert str(schema_check.RESET_LOCK_TIMEOUT) == "RESET lock_timeout"


def test_column_fixes() -> None:
    assert (
        schema_check.add_column("outbox", "seq BIGINT")
        == 'ALTER TABLE "outbox" ADD COLUMN seq BIGINT'
    )
    assert schema_check.alter_type("outbox", "key", "text") == (
        'ALTER TABLE "outbox" ALTER COLUMN "key" TYPE text USING "key"::text'
    )
    assert schema_check.set_not_null("outbox", "key", True) == (
        'ALTER TABLE "outbox" ALTER COLUMN "key" SET NOT NULL'
    )
    assert schema_check.set_not_null("outbox", "key", False) == (
        'ALTER TABLE "outbox" ALTER COLUMN "key" DROP NOT NULL'
    )
    assert schema_check.drop_column("outbox", "txid") == 'ALTER TABLE "outbox" DROP COLUMN "txid"'


def test_index_fixes() -> None:
    ddl = "CREATE INDEX ix_o_due ON outbox (next_attempt_at)"
    concurrent = schema_check.create_index(ddl, concurrently=True)
    assert (
        concurrent == "CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_o_due ON outbox (next_attempt_at)"
    )
    assert schema_check.create_index(ddl, concurrently=False) == (
        "CREATE INDEX IF NOT EXISTS ix_o_due ON outbox (next_attempt_at)"
    )
    assert schema_check.rename_in_create(concurrent, "ix_o_due", "ix_o_due_new") == (
        "CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_o_due_new ON outbox (next_attempt_at)"
    )
    assert (
        schema_check.drop_index("ix", concurrently=True) == 'DROP INDEX CONCURRENTLY IF EXISTS "ix"'
    )
    assert schema_check.drop_index("ix", concurrently=False) == 'DROP INDEX IF EXISTS "ix"'
    assert schema_check.drop_index("ix", if_exists=False) == 'DROP INDEX "ix"'
    assert schema_check.rename_index("ix_new", "ix") == 'ALTER INDEX "ix_new" RENAME TO "ix"'


def test_storage_fix() -> None:
    assert schema_check.set_storage("outbox_p1", "autovacuum_vacuum_threshold = 5000") == (
        'ALTER TABLE "outbox_p1" SET (autovacuum_vacuum_threshold = 5000)'
    )


# -- driver plumbing ---------------------------------------------------------------------------


def test_sqlite_pragmas_in_order_with_wal_only_for_a_file_database() -> None:
    assert session.sqlite_pragmas(30_000, wal=True) == [
        "PRAGMA journal_mode=WAL",
        "PRAGMA synchronous=NORMAL",
        "PRAGMA busy_timeout=30000",
        "PRAGMA foreign_keys=ON",
    ]
    assert session.sqlite_pragmas(5, wal=False)[0] == "PRAGMA synchronous=NORMAL"
    assert session.BEGIN_IMMEDIATE == "BEGIN IMMEDIATE"
    assert session.PING == "SELECT 1"

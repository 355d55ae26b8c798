"""``fastapi-outbox doctor`` and ``fastapi-outbox db upgrade``: the live table against the
layout this version of the library expects.

`examine` lists the differences as `Finding` s, each with the SQL that fixes
it. On PostgreSQL the expected layout is not compared as text with what the catalogue
says: it is created as a temporary table (with its indexes) in a transaction that is rolled
back, so PostgreSQL itself normalises both sides (types, index predicates) and the
comparison is exact. Nothing is written.

`upgrade` applies the fixes marked ``automatic`` — the ones that add what a table
created by an earlier release lacks (columns, indexes, storage parameters, partitions ahead)
or drop what it no longer uses (the pre-release ``txid`` column) — and is idempotent: a
second run finds nothing to do. A changed column type or a plain table that should be
partitioned is only reported, with the SQL or the README procedure: those rewrite data.

Both also look at the outbox's side tables (`SideTable`: the inbox and the partition
leases of ordered subscribers, the archive of ``archive=True``, the claim-check payloads of
``claim_check_store="database"``): a missing one is a finding whose fix is its DDL, and
``db upgrade`` creates it with the code ``create_tables()`` / ``db create`` run (a
partitioned outbox's archive is partitioned the same way). An existing archive is compared
column by column as the outbox table is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
from sqlalchemy import Table, text
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.schema import CreateColumn, CreateIndex, CreateTable

from fastapi_outbox.exceptions import OutboxError
from fastapi_outbox.log import safe_error
from fastapi_outbox.storage import partitions, schema
from fastapi_outbox.storage.db_outage import mysql_code
from fastapi_outbox.storage.dialects import is_mysql
from fastapi_outbox.storage.statements import partitions as partition_sql
from fastapi_outbox.storage.statements import schema_check as sql

#: Columns of earlier layouts that the library no longer reads or writes.
OBSOLETE_COLUMNS = {
    "txid": "pre-release ordering column: its default runs pg_current_xact_id() on every "
    "insert and nothing reads it since ordering uses seq",
}
_PROBE = "fastapi_outbox_doctor_probe"
#: Partitions must cover at least this far ahead (the cleaner keeps two days ready).
DOCTOR_AHEAD_SECONDS = 86400.0

logger = logging.getLogger("fastapi_outbox.storage")

#: ``db upgrade`` waits this long for each statement's lock (PostgreSQL ``lock_timeout``):
#: a statement queued behind a long transaction holds up every write to the table.
UPGRADE_LOCK_TIMEOUT_SECONDS = 2.0
#: Passes of ``db upgrade`` before it gives up on a lock it cannot get.
UPGRADE_LOCK_ATTEMPTS = 10
#: Pause between those passes (the table takes writes meanwhile).
UPGRADE_RETRY_PAUSE_SECONDS = 1.0
#: SQLSTATE lock_not_available: ``lock_timeout`` ran out.
LOCK_NOT_AVAILABLE = "55P03"
#: MySQL: the metadata lock of a DDL statement not taken within ``lock_wait_timeout``.
MYSQL_LOCK_WAIT_TIMEOUT = 1205


class UpgradeLockTimeout(OutboxError, RuntimeError):
    """``db upgrade`` could not take a lock on the table within its lock timeout, on any
    of its attempts: another transaction holds a conflicting lock."""


@dataclasses.dataclass(slots=True)
class Finding:
    """One difference between the live table and the expected layout."""

    what: str
    fix: list[str]
    #: ``db upgrade`` applies it (adds or drops without rewriting rows).
    automatic: bool = True
    #: Statements that cannot run in a transaction block (``CONCURRENTLY``).
    concurrently: bool = False
    #: A mismatch (exit code 1) or advice only.
    mismatch: bool = True
    #: ``db upgrade`` runs this instead of ``fix`` (a missing side table: the creation code
    #: of ``create_tables()``; ``fix`` shows its DDL).
    create: Callable[[], Awaitable[None]] | None = dataclasses.field(
        default=None, repr=False, compare=False
    )


@dataclasses.dataclass(frozen=True, slots=True)
class SideTable:
    """A table beside the outbox table that ``create_tables()`` / ``db create`` make
    (`fastapi_outbox.storage.setup.Storage.side_tables`): the doctor reports it
    missing, ``db upgrade`` creates it."""

    table: Table
    #: What needs it, named in the finding ("archive=True", "ordered subscribers", …).
    used_by: str
    #: Creates it (and what comes with it: a partitioned archive's DEFAULT partition);
    #: idempotent. The code ``create_tables()`` runs.
    create: Callable[[], Awaitable[None]]
    #: Missing: a mismatch (the settings or the app use it) or advice (``db create`` makes
    #: it, nothing uses it yet).
    required: bool = True
    #: Present: compared with its expected layout as the outbox table is (the archive).
    compare: bool = False


def _index_body(definition: str) -> str:
    """``USING btree (…) WHERE …`` of a ``pg_get_indexdef``: what an index is, not what it
    is called nor where."""
    return definition[definition.index(" USING ") + 1 :]


# -- PostgreSQL ------------------------------------------------------------------------------


def _pg_columns(conn: Connection, relation: str) -> dict[str, tuple[str, bool, str]]:
    rows = conn.execute(sql.COLUMNS, {"r": relation}).all()
    return {name: (type_, notnull, identity) for name, type_, notnull, identity in rows}


def _pg_indexes(conn: Connection, relation: str) -> dict[str, tuple[str, bool, bool]]:
    rows = conn.execute(sql.INDEXES, {"r": relation}).all()
    return {name: (_index_body(d), valid, primary) for name, d, valid, primary in rows}


def _pg_reloptions(conn: Connection, relation: str) -> dict[str, str]:
    options = conn.execute(sql.RELOPTIONS, {"r": relation}).scalar_one_or_none()
    return dict(o.split("=", 1) for o in options or [])


def _expected_pg(conn: Connection, table: Table) -> tuple[dict[str, Any], dict[str, Any]]:
    """Columns and indexes of the expected layout, as PostgreSQL reports them: created as a
    temporary table in a savepoint that is rolled back."""
    create = sql.probe_table(str(CreateTable(table).compile(dialect=conn.dialect)), _PROBE)
    with conn.begin_nested() as savepoint:
        conn.execute(text(create))
        for index in table.indexes:
            if not schema.builds_on(index, "postgresql"):
                continue
            ddl = sql.probe_index(str(CreateIndex(index).compile(dialect=conn.dialect)), _PROBE)
            conn.execute(text(ddl))
        columns = _pg_columns(conn, _PROBE)
        indexes = _pg_indexes(conn, _PROBE)
        savepoint.rollback()
    return columns, indexes


def _pg_partitioned(conn: Connection, table: str) -> bool | None:
    kind = conn.execute(sql.RELKIND, {"r": partition_sql.quote(table)}).scalar_one_or_none()
    return None if kind is None else kind == "p"


def examine_sync(conn: Connection, table: Table) -> list[Finding]:
    """The differences between ``table`` (the expected layout) and the live table."""
    if is_mysql(conn):
        return _examine_mysql(conn, table)
    if table.info.get("doctor") == "columns":
        return _examine_columns(conn, table)
    if conn.dialect.name != "postgresql":
        return _examine_sqlite(conn, table)
    name = table.name
    relation = partition_sql.quote(name)
    interval: dt.timedelta | None = table.info.get("partitioning")
    partitioned = _pg_partitioned(conn, name)
    if partitioned is None:
        return [
            Finding(
                f"table {name} does not exist",
                ["-- fastapi-outbox db create (or the DDL of `fastapi-outbox db sql`)"],
                automatic=False,
            )
        ]
    findings: list[Finding] = []
    expected_columns, expected_indexes = _expected_pg(conn, table)
    live_columns = _pg_columns(conn, relation)
    live_indexes = _pg_indexes(conn, relation)

    findings += _column_findings(conn, table, expected_columns, live_columns)
    key = partitions.partition_key(conn, name) if partitioned else None
    if key is not None and key != partition_sql.KEY_ID:
        findings.append(_legacy_key_finding(name, key))
    findings += _key_and_index_findings(
        conn, table, expected_indexes, live_indexes, partitioned, legacy_key=key
    )

    if bool(partitioned) != (interval is not None):
        findings.append(
            Finding(
                f"table {name} is {'partitioned' if partitioned else 'not partitioned'} but "
                f"the settings say partitioning={table.info.get('partitioning_setting')!r}",
                ["-- see the README: moving a table to the partitioned layout"],
                automatic=False,
            )
        )
    if partitioned and interval is not None and "archive_of" not in table.info:
        findings += _partition_findings(conn, name, interval, key or partition_sql.KEY_ID)
    elif partitioned and interval is not None:  # an archive: its DEFAULT partition only
        findings += _archive_default_findings(conn, name)
    if not partitioned:
        findings += _storage_findings(conn, [name])
    return findings


def _examine_columns(conn: Connection, table: Table) -> list[Finding]:
    """A table beside the outbox's (the partition leases of ordered subscribers): its
    missing columns, named with the table, each with its ``ADD COLUMN``. A missing table
    is not reported: ``create_tables()`` / ``db create`` make it with the inbox, and only
    ordered subscribers use it."""
    if conn.dialect.name != "postgresql":
        live = {row[1] for row in conn.execute(sql.sqlite_columns(table.name))}
        if not live:
            return []
        findings = []
        for column in table.columns:
            if column.name not in live:
                add = str(CreateColumn(column).compile(dialect=conn.dialect)).strip()
                findings.append(
                    Finding(
                        f"table {table.name}: column {column.name} is missing",
                        [sql.add_column(table.name, add)],
                    )
                )
        return findings
    if _pg_partitioned(conn, table.name) is None:
        return []
    expected, _ = _expected_pg(conn, table)
    findings = _column_findings(
        conn, table, expected, _pg_columns(conn, partition_sql.quote(table.name))
    )
    for finding in findings:
        finding.what = f"table {table.name}: {finding.what}"
    return findings


def _column_findings(
    conn: Connection,
    table: Table,
    expected_columns: dict[str, Any],
    live_columns: dict[str, Any],
) -> list[Finding]:
    """PostgreSQL: missing columns, columns of another type or nullability, and obsolete
    columns the library no longer writes."""
    findings: list[Finding] = []
    for column in table.columns:
        want = expected_columns[column.name]
        have = live_columns.get(column.name)
        if have is None:
            add = str(CreateColumn(column).compile(dialect=conn.dialect)).strip()
            findings.append(
                Finding(
                    f"column {column.name} is missing",
                    [sql.add_column(table.name, add)],
                )
            )
        elif have[0] != want[0]:
            findings.append(
                Finding(
                    f"column {column.name} is {have[0]}, expected {want[0]}",
                    [
                        "-- rewrites the table under an ACCESS EXCLUSIVE lock: plan a window",
                        sql.alter_type(table.name, column.name, want[0]),
                    ],
                    automatic=False,
                )
            )
        elif have[1] != want[1]:
            findings.append(
                Finding(
                    f"column {column.name} is {'nullable' if not have[1] else 'NOT NULL'}",
                    [sql.set_not_null(table.name, column.name, want[1])],
                    automatic=False,
                )
            )
    for column_name, why in OBSOLETE_COLUMNS.items():
        if column_name in live_columns and column_name not in expected_columns:
            findings.append(
                Finding(
                    f"obsolete column {column_name} ({why})",
                    [sql.drop_column(table.name, column_name)],
                )
            )
    return findings


def _key_and_index_findings(
    conn: Connection,
    table: Table,
    expected_indexes: dict[str, Any],
    live_indexes: dict[str, Any],
    partitioned: Any,
    *,
    legacy_key: str | None = None,
) -> list[Finding]:
    """PostgreSQL: a primary key other than the layout's, and missing or different indexes
    (a table partitioned by ``created_at`` has its own primary key: reported once, by
    `_legacy_key_finding`)."""
    findings: list[Finding] = []
    want_pk = next(body for body, _, primary in expected_indexes.values() if primary)
    have_pk = next((body for body, _, primary in live_indexes.values() if primary), None)
    legacy = legacy_key is not None and legacy_key != partition_sql.KEY_ID
    if have_pk != want_pk and not legacy:
        findings.append(
            Finding(
                f"primary key is {have_pk or 'missing'}, expected {want_pk}",
                ["-- see the README: moving a table to the partitioned layout"],
                automatic=False,
            )
        )
    for index in sorted(table.indexes, key=lambda i: i.name or ""):
        index_name = str(index.name)
        if index_name not in expected_indexes:
            continue  # another dialect's index
        body = expected_indexes[index_name][0]
        have_index = live_indexes.get(index_name)
        findings += _index_finding(
            conn.dialect, table, index, index_name, body, have_index, partitioned
        )
    return findings


def _index_finding(
    dialect: Any,
    table: Table,
    index: Any,
    name: str,
    body: str,
    have: tuple[str, bool, bool] | None,
    partitioned: bool | None,
) -> list[Finding]:
    # CONCURRENTLY on a plain table: a live table keeps taking writes while the index
    # builds. PostgreSQL has no CONCURRENTLY for an index on a partitioned table.
    concurrently = not partitioned
    ddl = sql.create_index(
        str(CreateIndex(index).compile(dialect=dialect)), concurrently=concurrently
    )
    relation = partition_sql.quote(table.name)
    if have is None:
        return [Finding(f"index {name} is missing", [ddl], concurrently=concurrently)]
    drop = sql.drop_index(name, concurrently=concurrently)
    if have[0] != body:
        # Build the new one under a temporary name, then swap: claims keep an index.
        new = f"{name[:55]}_new"
        return [
            Finding(
                f"index {name} is {have[0]}, expected {body}",
                [
                    sql.drop_index(new, concurrently=concurrently),
                    sql.rename_in_create(ddl, name, new),
                    drop,
                    sql.rename_index(new, name),
                ],
                concurrently=concurrently,
            )
        ]
    if not have[1]:
        return [
            Finding(
                f"index {name} on {relation} is invalid (an interrupted CONCURRENTLY build)",
                [drop, ddl],
                concurrently=concurrently,
            )
        ]
    return []


def _legacy_key_finding(name: str, key: str) -> Finding:
    """A table partitioned by ``created_at`` (releases before the id layout): it keeps
    working (maintenance and retention follow its key), only lookups by id do not prune.
    Advice, not a mismatch: moving it is the operator's call."""
    return Finding(
        f"table {name} is partitioned by {key} (the layout of an earlier release): it keeps "
        "working, but every lookup by id (the relay's marks, cancel, replay, show) probes "
        "each partition's primary key; the current layout is partitioned by id",
        [
            "-- see docs/how-to/partitions.md, 'Tables partitioned by created_at': create the "
            "new table under another table_name, switch producers to it, let one relay "
            "drain the old table, then drop it"
        ],
        automatic=False,
        mismatch=False,
    )


def _partition_findings(
    conn: Connection, name: str, interval: dt.timedelta, key: str = partition_sql.KEY_ID
) -> list[Finding]:
    found = partitions.list_partitions(conn, name)
    findings = []
    if not any(p.is_default for p in found):
        findings.append(
            Finding(
                f"table {name} has no DEFAULT partition (a producer fails when no partition "
                "covers its time)",
                [
                    partition_sql.create_default(
                        name, partitions.default_name(name), if_not_exists=False
                    )
                ],
            )
        )
    now = conn.execute(partition_sql.DB_NOW).scalar_one()
    # The cleaner keeps AHEAD_SECONDS ready; less than a day ahead means it is not running.
    missing = partitions.wanted_ranges(now, interval, found, ahead=DOCTOR_AHEAD_SECONDS)
    if missing:
        findings.append(
            Finding(
                f"{len(missing)} partition(s) missing ahead of now (first: "
                f"{missing[0][0].isoformat()}); the cleaner creates them, so are relays "
                "running?",
                [
                    partition_sql.partition_of(
                        name,
                        partitions.partition_name(name, lo),
                        lo,
                        hi,
                        if_not_exists=False,
                        key=key,
                    )
                    for lo, hi in missing
                ],
            )
        )
    findings += _storage_findings(conn, [p.name for p in found])
    return findings


def _archive_default_findings(conn: Connection, name: str) -> list[Finding]:
    """A partitioned archive's partitions are the outbox's, re-attached: only its DEFAULT
    partition (rows moved in batches) is expected."""
    if any(p.is_default for p in partitions.list_partitions(conn, name)):
        return []
    return [
        Finding(
            f"archive {name} has no DEFAULT partition",
            partitions.archive_default_statements(name),
        )
    ]


def _storage_findings(conn: Connection, relations: list[str]) -> list[Finding]:
    findings = []
    for relation in relations:
        options = _pg_reloptions(conn, partition_sql.quote(relation))
        wrong = {k: v for k, v in partitions.AUTOVACUUM.items() if options.get(k) != v}
        if wrong:
            settings = ", ".join(f"{k} = {v}" for k, v in wrong.items())
            findings.append(
                Finding(
                    f"{relation}: autovacuum settings {', '.join(sorted(wrong))} not set "
                    "(vacuum would wait for a fraction of the table to be dead rows)",
                    [sql.set_storage(relation, settings)],
                )
            )
    return findings


# -- SQLite ------------------------------------------------------------------------------------


def _examine_sqlite(conn: Connection, table: Table) -> list[Finding]:
    name = table.name
    columns = {row[1] for row in conn.execute(sql.sqlite_columns(name))}
    if not columns:
        return [
            Finding(
                f"table {name} does not exist", ["-- fastapi-outbox db create"], automatic=False
            )
        ]
    findings: list[Finding] = []
    for column in table.columns:
        if column.name not in columns:
            add = str(CreateColumn(column).compile(dialect=conn.dialect)).strip()
            if column.name == "seq":  # no identity on SQLite: the rowid orders, 0 stored
                add += " DEFAULT 0"
            findings.append(
                Finding(
                    f"column {column.name} is missing",
                    [sql.add_column(name, add)],
                )
            )
    live = {
        row[0]: " ".join(str(row[1]).split())
        for row in conn.execute(sql.SQLITE_INDEXES, {"t": name})
        if row[1] is not None
    }
    for index in sorted(table.indexes, key=lambda i: i.name or ""):
        if not schema.builds_on(index, "sqlite"):
            continue
        index_name = str(index.name)
        ddl = " ".join(str(CreateIndex(index).compile(dialect=conn.dialect)).split())
        if index_name not in live:
            findings.append(Finding(f"index {index_name} is missing", [ddl]))
        elif live[index_name] != ddl:
            findings.append(
                Finding(
                    f"index {index_name} is {live[index_name]!r}, expected {ddl!r}",
                    [sql.drop_index(index_name, if_exists=False), ddl],
                )
            )
    for column_name, why in OBSOLETE_COLUMNS.items():
        if column_name in columns and column_name not in table.c:
            findings.append(
                Finding(
                    f"obsolete column {column_name} ({why})",
                    [sql.drop_column(table.name, column_name)],
                )
            )
    return findings


def _examine_mysql(conn: Connection, table: Table) -> list[Finding]:
    """MariaDB/MySQL, through SQLAlchemy's inspector: a missing table (the outbox's only:
    a side table compared by columns is skipped, as elsewhere), missing columns and
    indexes (each with its fix), obsolete columns. No partial indexes there to compare:
    an index is found by its name."""
    name = table.name
    inspector = sa_inspect(conn)
    if not inspector.has_table(name):
        if table.info.get("doctor") == "columns":
            return []
        return [
            Finding(
                f"table {name} does not exist", ["-- fastapi-outbox db create"], automatic=False
            )
        ]
    quoted = conn.dialect.identifier_preparer.quote(name)
    columns = {c["name"] for c in inspector.get_columns(name)}
    findings: list[Finding] = []
    for column in table.columns:
        if column.name not in columns:
            add = str(CreateColumn(column).compile(dialect=conn.dialect)).strip()
            what = f"column {column.name} is missing"
            if table.info.get("doctor") == "columns":
                what = f"table {name}: {what}"
            findings.append(Finding(what, [f"ALTER TABLE {quoted} ADD COLUMN {add}"]))
    if table.info.get("doctor") == "columns":
        return findings
    live = {i["name"] for i in inspector.get_indexes(name)}
    for index in sorted(table.indexes, key=lambda i: i.name or ""):
        if not schema.builds_on(index, conn.dialect.name):
            continue
        if str(index.name) not in live:
            ddl = str(CreateIndex(index).compile(dialect=conn.dialect)).strip()
            findings.append(Finding(f"index {index.name} is missing", [ddl]))
    for column_name, why in OBSOLETE_COLUMNS.items():
        if column_name in columns and column_name not in table.c:
            findings.append(
                Finding(
                    f"obsolete column {column_name} ({why})",
                    [f"ALTER TABLE {quoted} DROP COLUMN {column_name}"],
                )
            )
    return findings


# -- side tables ------------------------------------------------------------------------------


def _exists(conn: Connection, name: str) -> bool:
    if is_mysql(conn):
        return bool(sa_inspect(conn).has_table(name))
    if conn.dialect.name == "postgresql":
        return _pg_partitioned(conn, name) is not None
    return conn.execute(sql.sqlite_columns(name)).first() is not None


def _side_findings(conn: Connection, side: SideTable) -> list[Finding]:
    """A missing side table (its DDL as the fix, its creation code for ``db upgrade``), or
    the differences of an existing one that is compared."""
    name = side.table.name
    if _exists(conn, name):
        return examine_sync(conn, side.table) if side.compare else []
    return [
        Finding(
            f"table {name} does not exist ("
            + (f"needed by {side.used_by})" if side.required else f"for {side.used_by}; none yet)"),
            schema.ddl_statements(side.table, conn.dialect),
            mismatch=side.required,
            create=side.create,
        )
    ]


def examine_all_sync(
    conn: Connection, table: Table, side_tables: Sequence[SideTable] = ()
) -> list[Finding]:
    """`examine_sync` of the outbox table, then its side tables (not when the outbox
    table itself is missing: ``db create`` makes them all)."""
    findings = examine_sync(conn, table)
    if not _exists(conn, table.name):
        return findings
    for side in side_tables:
        findings += _side_findings(conn, side)
    return findings


# -- entry points -------------------------------------------------------------------------------


async def examine(
    engine: AsyncEngine, table: Table, *, side_tables: Sequence[SideTable] = ()
) -> list[Finding]:
    """The differences between the live tables and the expected layout: ``table``'s, then
    those of ``side_tables`` (a missing one, a compared one's differences)."""
    async with engine.connect() as conn:
        findings = await conn.run_sync(examine_all_sync, table, side_tables)
        await conn.rollback()
    return findings


async def upgrade(
    engine: AsyncEngine,
    table: Table,
    *,
    side_tables: Sequence[SideTable] = (),
    lock_timeout_seconds: float = UPGRADE_LOCK_TIMEOUT_SECONDS,
    attempts: int = UPGRADE_LOCK_ATTEMPTS,
    pause_seconds: float = UPGRADE_RETRY_PAUSE_SECONDS,
) -> tuple[list[Finding], list[Finding]]:
    """Apply the automatic fixes; returns (applied, left for the operator). Idempotent.

    Fixes run in the order found (columns before the indexes on them, the obsolete column
    after the index that used it was rebuilt), each statement on its own in autocommit: a
    ``CONCURRENTLY`` build cannot run in a transaction and must not hold a long one.

    On PostgreSQL each statement waits at most ``lock_timeout_seconds`` for its lock: an
    ``ALTER TABLE`` queued behind a long transaction would otherwise block every write to
    the table behind it for as long. A statement that times out is retried, after
    ``pause_seconds``, from a new look at the table (an interrupted ``CONCURRENTLY`` build
    leaves an invalid index, which the next look rebuilds), ``attempts`` times in all;
    then `UpgradeLockTimeout` names the table.

    A missing side table of ``side_tables`` is created by its `SideTable.create`
    (advice or not: ``db upgrade`` leaves what ``db create`` would have made)."""
    applied: list[Finding] = []
    bounded = engine.dialect.name == "postgresql" or is_mysql(engine)
    limit = lock_timeout_seconds if bounded else None
    waited_for = "a change"
    for attempt in range(1, attempts + 1):
        done, left, blocked = await _upgrade_once(engine, table, side_tables, limit)
        applied += done
        if blocked is None:
            return applied, left
        waited_for = blocked.what
        logger.warning(
            "db upgrade: lock not available; retrying",
            extra={
                "action": "upgrade.lock_timeout",
                "table": table.name,
                "attempt": attempt,
                "change": waited_for,
            },
        )
        if attempt < attempts:
            await anyio.sleep(pause_seconds)
    raise UpgradeLockTimeout(
        f"db upgrade: table {table.name}: could not take the lock for {waited_for!r} within "
        f"{lock_timeout_seconds:g} s (UPGRADE_LOCK_TIMEOUT_SECONDS), {attempts} attempts: "
        "another transaction holds a conflicting lock on the table; run it again once that "
        f"transaction has ended ({len(applied)} change(s) applied so far)"
    )


async def _upgrade_once(
    engine: AsyncEngine,
    table: Table,
    side_tables: Sequence[SideTable],
    lock_timeout_seconds: float | None,
) -> tuple[list[Finding], list[Finding], Finding | None]:
    """One pass of `upgrade`: (applied, left, the fix whose lock timed out)."""
    findings = await examine(engine, table, side_tables=side_tables)
    applied: list[Finding] = []
    left: list[Finding] = []
    ordered = sorted(findings, key=lambda f: f.what.startswith("obsolete"))
    autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
    for finding in ordered:
        if not finding.automatic:
            left.append(finding)
            continue
        try:
            if finding.create is not None:  # a new table: no lock on a live one to wait for
                await finding.create()
                applied.append(finding)
                continue
            async with autocommit.connect() as conn:
                mysql = is_mysql(engine)
                if lock_timeout_seconds is not None:
                    ms = max(1, int(lock_timeout_seconds * 1000))
                    await conn.execute(sql.lock_timeout(ms, mysql=mysql))
                try:
                    for statement in finding.fix:
                        # MySQL: each DDL statement commits on its own (no transactional
                        # DDL); every fix is one statement, applied or not, and the next
                        # look at the table finds what is left.
                        if not statement.startswith("--"):
                            await conn.execute(text(statement))
                finally:
                    if lock_timeout_seconds is not None and not conn.invalidated:
                        with contextlib.suppress(DBAPIError):
                            await conn.execute(sql.reset_lock_timeout(mysql=mysql))
        except DBAPIError as exc:  # e.g. a partition whose range has rows in DEFAULT
            if _sqlstate(exc) == LOCK_NOT_AVAILABLE or mysql_code(exc) == MYSQL_LOCK_WAIT_TIMEOUT:
                return applied, left, finding
            finding.what += f" (fix failed: {safe_error(exc, 200)})"
            left.append(finding)
            continue
        applied.append(finding)
    return applied, left, None


def _sqlstate(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None)
    return str(getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None) or "")

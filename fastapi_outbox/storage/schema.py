"""The outbox table: columns, indexes, DDL.

``metadata`` holds the default table (``outbox_messages``) so an Alembic ``env.py`` can
include it in ``target_metadata``; `build_table` builds a table of another name on
another ``MetaData``.

Three choices worth knowing:

* ``next_attempt_at`` is the one "due time" of every row that still needs work: creation
  time for pending rows, the backoff deadline for failed rows and the lease deadline for
  processing rows. The claim is then a single range scan of one partial index,
  ``(broker, next_attempt_at)`` over the rows still needing work, whose size does not
  depend on how many published rows the table keeps.
* ``payload`` and ``headers`` are stored as the JSON text the unit of work encoded once
  (JSONB on PostgreSQL) and read back as text: the relay sends those bytes as they
  are, with no decode/encode per message.
* ``seq`` (PostgreSQL: an identity column) numbers rows in insert order; ordered dispatch
  sorts a key's rows by it. A row is inserted at the end of its unit of work, after the
  business writes that lock the key's aggregate, so for producers of one aggregate insert
  order is commit order. SQLite orders by the rowid instead (one writer at a time) and
  stores 0 here; MySQL makes it an ``AUTO_INCREMENT`` (with the unique key MySQL requires
  of one).
* MySQL (MariaDB) has no partial index: its claim index leads with ``status``
  (``broker, status, next_attempt_at, id``), so a claim reads each active status's due
  rows in order without walking the finished rows the table keeps.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    Identity,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    Uuid,
    text,
)
from sqlalchemy.engine.interfaces import Dialect as DialectT
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.schema import CreateColumn, CreateIndex, CreateTable

from fastapi_outbox import exceptions
from fastapi_outbox.events import MessageStatus
from fastapi_outbox.settings import check_partitioned_table_name, check_table_name, parse_interval
from fastapi_outbox.storage import partitions
from fastapi_outbox.storage.statements.partitions import ACTIVE_SQL as _ACTIVE_SQL
from fastapi_outbox.storage.types import ACTIVE_STATUSES as ACTIVE_STATUSES
from fastapi_outbox.storage.types import JsonText as JsonText
from fastapi_outbox.storage.types import UtcDateTime as UtcDateTime

__all__ = [
    "MYSQL_DIALECTS",
    "build_archive_table",
    "build_table",
    "builds_on",
    "ddl",
    "ddl_statements",
    "metadata",
    "outbox_table",
]


#: The dialect names of MariaDB and MySQL (``mysql+asyncmy://`` is ``mysql``).
MYSQL_DIALECTS = ("mysql", "mariadb")
#: The dialects with partial indexes, which the indexes of PostgreSQL and SQLite assume.
_PARTIAL = ("postgresql", "sqlite")


def builds_on(index: Index, dialect_name: str) -> bool:
    """Whether ``index`` is created on ``dialect_name`` (its ``ddl_if``, one name or many)."""
    wanted = index._ddl_if.dialect if index._ddl_if is not None else None
    if wanted is None:
        return True
    return dialect_name == wanted if isinstance(wanted, str) else dialect_name in wanted


@compiles(CreateColumn, "mysql")
@compiles(CreateColumn, "mariadb")
def _mysql_insert_order(element: Any, compiler: Any, **kw: Any) -> str:
    """MySQL: ``seq`` numbers rows in insert order by ``AUTO_INCREMENT`` (an identity
    column is PostgreSQL's); MySQL wants such a column to lead a key: ``UNIQUE``."""
    text_ = str(compiler.visit_create_column(element, **kw))
    if element.element.info.get("insert_order"):
        text_ += " AUTO_INCREMENT UNIQUE"
    return text_


def build_table(
    name: str = "outbox_messages",
    metadata_: MetaData | None = None,
    *,
    ordered: bool = False,
    partitioning: str | None = None,
) -> Table:
    """The outbox table called ``name`` on ``metadata_`` (a new ``MetaData`` when None).

    ``name`` must be a plain identifier (see ``OutboxSettings.table_name``): it is also
    part of the index names and of the NOTIFY channel. ``ordered`` adds the index that
    serves the ordered claim (``OutboxSettings(ordered=True)``); unordered outboxes do
    without it, which spares every insert one index entry. ``partitioning`` (``"daily"``,
    ``"6h"``…; PostgreSQL only) makes it range-partitioned by the UUIDv7 ``id`` (its time
    range: see `fastapi_outbox.storage.partitions`), primary key ``(id)``, so every
    lookup by id reads one partition; ``table.create()`` then also creates the DEFAULT
    partition and the partitions ahead (see `fastapi_outbox.storage.partitions`)."""
    interval = None
    try:
        check_table_name(name)
        if partitioning is not None:
            interval = parse_interval(partitioning)
            check_partitioned_table_name(name)
    except ValueError as exc:
        raise exceptions.ConfigurationError(str(exc)) from None
    md = metadata_ if metadata_ is not None else MetaData()
    if name in md.tables:
        table = md.tables[name]
        if ordered:
            _add_ordered_index(table)
        return table
    table = Table(
        name,
        md,
        *_columns(),
        # Autovacuum follows a queue's churn, not its size (partitions get these too:
        # PostgreSQL takes no storage parameters on a partitioned table).
        **(
            {"postgresql_partition_by": "RANGE (id)"}
            if interval is not None
            else {"postgresql_with": partitions.AUTOVACUUM}
        ),
    )
    if interval is not None:
        table.info["partitioning"] = interval
        table.info["partitioning_setting"] = partitioning
        partitions.install(table, interval)
    _add_indexes(table)
    if ordered:
        _add_ordered_index(table)
    return table


def _columns() -> list[Column[Any]]:
    """The columns of one outbox message, each commented in the database for an operator
    reading the table with ``psql``. The primary key is ``(id)`` in both
    layouts: a partitioned table is partitioned by ``id`` itself."""
    return [
        Column("id", Uuid(as_uuid=True), primary_key=True, comment="UUIDv7, time-ordered"),
        Column("broker", String(64), nullable=False, comment="target broker name"),
        Column("stream", String(255), nullable=False, comment="topic / stream / subject"),
        Column("type", String(255), nullable=False, comment="event type name"),
        Column("key", String(255), nullable=True, comment="ordering key"),
        Column("payload", JsonText(), nullable=False),
        Column("headers", JsonText(), nullable=False),
        Column("status", String(16), nullable=False, server_default=MessageStatus.PENDING.value),
        Column("attempts", Integer, nullable=False, server_default="0"),
        Column("next_attempt_at", UtcDateTime(), nullable=False, comment="due time"),
        Column("locked_by", String(80), nullable=True, comment="claim token (fence)"),
        Column("locked_until", UtcDateTime(), nullable=True),
        Column("last_error", Text, nullable=True),
        Column("created_at", UtcDateTime(), nullable=False),
        Column("published_at", UtcDateTime(), nullable=True),
        Column("abandoned_at", UtcDateTime(), nullable=True),
        Column(
            "seq",
            BigInteger,
            Identity(),  # PostgreSQL; SQLite has no identity: the store writes 0 (rowid orders)
            nullable=False,
            comment="insert order, for ordered dispatch",
            info={"insert_order": True},  # MySQL: AUTO_INCREMENT (see _mysql_insert_order)
        ),
    ]


def _add_indexes(table: Table) -> None:
    """The partial indexes every statement of ``storage/statements`` is written for."""
    name = table.name
    # The claim index: only rows that still need work, in due order per broker.
    Index(
        f"ix_{name}_due",
        table.c.broker,
        table.c.next_attempt_at,
        table.c.id,
        postgresql_where=text(_ACTIVE_SQL),
        sqlite_where=text(_ACTIVE_SQL),
    ).ddl_if(dialect=_PARTIAL)  # type: ignore[arg-type]
    # MySQL (no partial index): per status, so the claim of each active status is a range
    # scan in due order that never meets a finished row.
    Index(
        f"ix_{name}_due_status",
        table.c.broker,
        table.c.status,
        table.c.next_attempt_at,
        table.c.id,
    ).ddl_if(dialect=MYSQL_DIALECTS)  # type: ignore[arg-type]
    # Ordered dispatch: the earlier unfinished rows of a key.
    Index(
        f"ix_{name}_key",
        table.c.broker,
        table.c.key,
        table.c.seq,
        postgresql_where=text(_ACTIVE_SQL + " AND key IS NOT NULL"),
        sqlite_where=text(_ACTIVE_SQL + " AND key IS NOT NULL"),
    )
    # Retention and the admin CLI: finished rows by age.
    Index(
        f"ix_{name}_published",
        table.c.published_at,
        postgresql_where=text("status = 'published'"),
        sqlite_where=text("status = 'published'"),
    )
    Index(
        f"ix_{name}_abandoned",
        table.c.abandoned_at,
        postgresql_where=text("status = 'abandoned'"),
        sqlite_where=text("status = 'abandoned'"),
    )


def ordered_index_name(table_name: str) -> str:
    return f"ix_{table_name}_ordered"


def _add_ordered_index(table: Table) -> None:
    """The ordered claim walks a broker's active rows in insert order and stops after a
    batch: ``(broker, seq)`` over the active rows serves it without sorting the backlog
    (on SQLite an index on ``broker`` holds its entries in rowid order, which is SQLite's
    insert order)."""
    name = ordered_index_name(table.name)
    if any(index.name == name for index in table.indexes):
        return
    Index(
        name,
        table.c.broker,
        table.c.seq,
        postgresql_where=text(_ACTIVE_SQL),
    ).ddl_if(dialect="postgresql")
    Index(
        f"{name}_sqlite",
        table.c.broker,
        sqlite_where=text(_ACTIVE_SQL),
    ).ddl_if(dialect="sqlite")
    # MySQL: each active status of a broker in insert order (no partial index there).
    Index(
        f"{name}_mysql",
        table.c.broker,
        table.c.status,
        table.c.seq,
    ).ddl_if(dialect=MYSQL_DIALECTS)  # type: ignore[arg-type]
    # An abandoned row keeps blocking the later rows of its key: the ordered claim asks,
    # for each candidate, whether its key has an earlier abandoned row.
    Index(
        f"ix_{table.name}_abandoned_key",
        table.c.broker,
        table.c.key,
        table.c.seq,
        postgresql_where=text("status = 'abandoned' AND key IS NOT NULL"),
        sqlite_where=text("status = 'abandoned' AND key IS NOT NULL"),
    ).ddl_if(dialect=_PARTIAL)  # type: ignore[arg-type]  # MySQL (no partial index): ix_<table>_key is the same


def build_archive_table(outbox: Table, name: str, metadata_: MetaData | None = None) -> Table:
    """The archive of ``outbox`` (``OutboxSettings(archive=True)``), called ``name``, on
    ``metadata_`` (a new ``MetaData`` when None: the shared one of Alembic's ``env.py``
    only gets it when asked to): the outbox's columns (``seq`` a plain number, no
    server defaults: rows arrive with their values) plus ``archived_at``.

    A plain outbox gets a plain archive with two indexes only, the primary key (``show``,
    the newest-first listing) and ``archived_at`` (the archive's retention), so a move
    costs little. A partitioned outbox gets an archive partitioned the same way, with the
    outbox's primary key and indexes: a finished partition detached from the outbox is
    attached to it as it is (its indexes are taken over, none is built), and only its
    DEFAULT partition (the rows moved in batches) gets an ``archived_at`` index."""
    md = metadata_ if metadata_ is not None else MetaData()
    if name in md.tables:
        return md.tables[name]
    partitioned = "partitioning" in outbox.info
    columns: list[Column[Any]] = []
    for column in outbox.c:
        copy = Column(
            column.name,
            column.type,
            nullable=column.nullable,
            primary_key=column.primary_key if partitioned else column.name == "id",
            comment=column.comment,
        )
        columns.append(copy)
    columns.append(Column("archived_at", UtcDateTime(), nullable=False, comment="moved at"))
    options = outbox.dialect_options["postgresql"]
    table = Table(
        name,
        md,
        *columns,
        **(
            {"postgresql_partition_by": options["partition_by"]}
            if partitioned
            else {"postgresql_with": partitions.AUTOVACUUM}
        ),
    )
    table.info["archive_of"] = outbox.name
    if partitioned:
        table.info["partitioning"] = outbox.info["partitioning"]
        for index in outbox.indexes:
            copy_index = Index(
                (index.name or "").replace(outbox.name, name, 1),
                *[table.c[c.name] for c in index.columns],
                unique=index.unique,
                **index.dialect_kwargs,
            )
            if index._ddl_if is not None:
                copy_index.ddl_if(dialect=index._ddl_if.dialect)
        partitions.install_archive(table)
    else:
        Index(f"ix_{name}_archived_at", table.c.archived_at)
    return table


#: The default ``MetaData`` with the default table, for Alembic's ``target_metadata``.
metadata = MetaData()
outbox_table = build_table("outbox_messages", metadata)


def ddl(table: Table, dialect: DialectT) -> str:
    """``CREATE TABLE`` and ``CREATE INDEX`` statements of ``table`` for ``dialect`` (and
    for a partitioned table, its DEFAULT partition and the partitions ahead)."""
    return ";\n\n".join(ddl_statements(table, dialect)) + ";\n"


def ddl_statements(table: Table, dialect: DialectT) -> list[str]:
    """The statements of `ddl`, one by one (the fix the doctor prints for a missing
    table: ``db upgrade`` creates it with `create_table` and its owner's extras)."""
    statements = [str(CreateTable(table).compile(dialect=dialect)).strip()]
    statements += [
        str(CreateIndex(index).compile(dialect=dialect)).strip()
        for index in sorted(table.indexes, key=lambda i: i.name or "")
        if builds_on(index, dialect.name)
    ]
    interval = table.info.get("partitioning")
    if interval is not None and dialect.name == "postgresql" and "archive_of" in table.info:
        # A partitioned archive: its DEFAULT partition; its other partitions come from
        # the outbox table, re-attached.
        statements += partitions.archive_default_statements(table.name)
    elif interval is not None and dialect.name == "postgresql":
        # The DEFAULT partition and the partitions of the coming days, as of now.
        now = dt.datetime.now(dt.UTC)
        statements += partitions.statements(table.name, interval, now)
    return statements


async def create_table(engine: AsyncEngine, table: Table) -> None:
    """Create ``table`` and its indexes when missing (never any other table):
    ``create(checkfirst)`` skips the indexes of an existing table, so each missing index
    is added on its own."""
    async with engine.begin() as conn:
        await conn.run_sync(table.create, checkfirst=True)
        for index in table.indexes:
            await conn.run_sync(index.create, checkfirst=True)


async def drop_table(engine: AsyncEngine, table: Table) -> None:
    async with engine.begin() as conn:
        await conn.run_sync(table.drop, checkfirst=True)

"""An outbox's storage, composed from its settings: the outbox table (its layout chosen
by ``table_name``, ``ordered`` and ``partitioning``) and its
`Store`, the WAL slot of ``capture="wal"``, the
consumers' inbox and the upkeep of a partitioned table; and their creation and removal
(``create_tables``, ``drop_tables``). The composition root
([`fastapi_outbox.outbox.Outbox`][fastapi_outbox.Outbox]) calls `open_engine` and `setup_storage`
once."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

from sqlalchemy import MetaData, Table
from sqlalchemy.ext.asyncio import AsyncEngine

from fastapi_outbox import config_checks, exceptions
from fastapi_outbox.redaction import remember
from fastapi_outbox.settings import OutboxSettings
from fastapi_outbox.storage import partitions, schema
from fastapi_outbox.storage.archive import Archive
from fastapi_outbox.storage.claim_check import (
    DatabasePayloadStore,
    PayloadStore,
    payload_store_for,
)
from fastapi_outbox.storage.doctor import SideTable
from fastapi_outbox.storage.engine import create_engine
from fastapi_outbox.storage.inbox import Inbox, build_inbox_table
from fastapi_outbox.storage.store import Store
from fastapi_outbox.storage.wal_slot import WalSlot

__all__ = ["Storage", "build_outbox_table", "open_engine", "setup_storage"]


@dataclasses.dataclass
class Storage:
    """The tables of one outbox and what runs SQL on them."""

    table: Table
    store: Store
    #: ``capture="wal"``: the replication slot (its WAL relay runs beside the table relays).
    wal_slot: WalSlot | None
    #: The consumers' inbox, on the outbox table's MetaData.
    inbox: Inbox
    #: Partition upkeep of a partitioned table (``settings.partitioning``), else None.
    partitions: partitions.Maintainer | None
    #: The archive table of ``archive=True``, else None.
    archive: Archive | None = None
    #: ``claim_check_bytes`` set: where claim-checked payloads go, else None.
    payloads: PayloadStore | None = None

    async def create(self) -> None:
        """The outbox table, the inbox table and their indexes; partitioned: also the
        DEFAULT partition and the partitions of the coming days; capture="wal": the
        replication slot and its publication."""
        await self.store.create_table()
        await self.inbox.create_table()
        if self.archive is not None:
            await self.archive.create_table()
        if self.partitions is not None:
            await self.partitions.ensure_ahead()
        if self.wal_slot is not None:
            await self.wal_slot.create()
        if self.payloads is not None:
            await self.payloads.create()

    def side_tables(
        self, settings: OutboxSettings, *, consumers: bool, ordered: bool
    ) -> list[SideTable]:
        """The tables `create` makes beside the outbox table, each with the code that
        creates it there (``fastapi-outbox doctor`` reports a missing one, ``db upgrade``
        creates it): the inbox (used by ``consumers`` and by the cleaner while
        ``inbox_retention_seconds`` is set), the partition leases (used by ``ordered``
        subscribers), the archive (``archive=True``) and the claim-check payloads
        (``claim_check_store="database"``)."""
        engine = self.inbox.engine
        inbox_needed = consumers or settings.inbox_retention_seconds is not None
        sides = [
            SideTable(
                self.inbox.table,
                "the cleaner's inbox_retention_seconds"
                if inbox_needed and not consumers
                else "subscribers",
                functools.partial(schema.create_table, engine, self.inbox.table),
                required=inbox_needed,
            )
        ]
        sides += [
            SideTable(
                table,
                "ordered subscribers",
                functools.partial(schema.create_table, engine, table),
                required=ordered,
                # Present: its columns compared (one of an earlier release lacks the
                # attempt count, ``started`` and ``attempts``, which ``db upgrade`` adds).
                compare=True,
            )
            for table in self.inbox.lease_tables
        ]
        sides += [
            SideTable(
                table,
                "subscribers",
                functools.partial(schema.create_table, engine, table),
                required=consumers,
            )
            for table in self.inbox.group_tables
        ]
        if self.archive is not None:
            sides.append(
                SideTable(
                    self.archive.table, "archive=True", self.archive.create_table, compare=True
                )
            )
        if isinstance(self.payloads, DatabasePayloadStore):
            sides.append(
                SideTable(
                    self.payloads.table,
                    "claim_check_bytes (claim_check_store='database')",
                    self.payloads.create,
                )
            )
        return sides

    async def drop(self) -> None:
        """The outbox table, the inbox table (and the archive table)."""
        await self.store.drop_table()
        await self.inbox.drop_table()
        if self.archive is not None:
            await self.archive.drop_table()
        if self.payloads is not None:
            await self.payloads.drop()


def open_engine(
    database: str | AsyncEngine, engine_options: Mapping[str, Any] | None
) -> tuple[AsyncEngine, bool]:
    """The engine of ``Outbox(database)`` and whether the outbox owns it (created it from a
    URL, so disposes of it on close); its secrets are remembered for masking wherever a
    driver's text quotes them (`fastapi_outbox.redaction`), and its database checked."""
    if isinstance(database, AsyncEngine):
        engine, owned = database, False
    elif isinstance(database, str):
        engine, owned = create_engine(database, dict(engine_options or {})), True
    else:
        raise exceptions.ConfigurationError(
            f"Outbox() takes a database URL or an AsyncEngine, not {type(database).__name__}"
        )
    remember(engine.url.render_as_string(hide_password=False))
    config_checks.check_database(engine.dialect.name)
    return engine, owned


def build_outbox_table(settings: OutboxSettings) -> Table:
    """The shared ``schema.metadata`` (Alembic's) holds the default layout; an ordered
    or partitioned outbox builds its table, with its index, on a MetaData of its own."""
    name, partitioning = settings.table_name, settings.partitioning
    shared = name == schema.outbox_table.name and not settings.ordered and not partitioning
    return schema.build_table(
        name,
        schema.metadata if shared else MetaData(),
        ordered=settings.ordered,
        partitioning=partitioning,
    )


def setup_storage(engine: AsyncEngine, settings: OutboxSettings) -> Storage:
    """The outbox table and its store (with the settings' statement and lock timeouts),
    the WAL slot when ``capture="wal"`` (refused where the database cannot), the
    consumers' inbox (on the outbox table's MetaData: the shared one by default) and, for
    a partitioned table, its upkeep."""
    table = build_outbox_table(settings)
    store = Store(engine, table)
    store.claims.set_timeouts(settings.statement_timeout_seconds, settings.lock_timeout_seconds)
    wal_slot: WalSlot | None = None
    if settings.capture == "wal":
        config_checks.check_wal_capture(engine.dialect.name, engine.dialect.driver)
        wal_slot = WalSlot(engine, settings.slot_name, settings.table_name)
    inbox = Inbox(engine, build_inbox_table(settings.inbox_table_name, table.metadata))
    maintainer: partitions.Maintainer | None = None
    if "partitioning" in table.info:
        maintainer = partitions.Maintainer(engine, table, table.info["partitioning"])
    archive = Archive(engine, table, settings.archive_name) if settings.archive else None
    payloads = payload_store_for(engine, settings, table)
    return Storage(table, store, wal_slot, inbox, maintainer, archive, payloads)

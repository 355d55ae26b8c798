"""Claim-check stores: where payloads over ``claim_check_bytes`` go instead of the message.

A claim-checked message carries a small stub payload and two headers, the reference
(`HEADER_CLAIM_CHECK`, the message id) and the payload's size
(`HEADER_CLAIM_CHECK_SIZE`); the payload itself is in a `PayloadStore`, one
small protocol with two implementations:

`DatabasePayloadStore` (``claim_check_store="database"``)
    a table next to the outbox's (``<table_name>_payloads``), written on the session's
    connection in the producer's transaction (the session's ``before_commit``, with the
    outbox rows): a rollback stores nothing, a commit stores both. Consumers read it from
    that database, so it serves producers and consumers that share it.
`FilePayloadStore` (``claim_check_store="file:///directory"``)
    one file per payload in a directory every producer and consumer mounts (a network
    file system, or an object store mounted as one); the shape of an S3-style store. It
    cannot take part in the transaction: the file is written (and synced) in
    ``before_commit``, before the commit. A rollback or a crash between the write and the
    commit leaves a file no message refers to: retention removes such orphans once they
    are older than ``orphan_grace_seconds`` (and every file past the retention anyway;
    with ``capture="wal"``, where no outbox row names a message, only then).

Every store keeps a payload while its message needs it — its outbox row pending, delayed,
being published or abandoned (replayable) — and then for
``OutboxSettings.claim_check_retention_seconds`` (the longer of the published messages' and
the inbox's retentions) counted from when the message is finished: a payload is dated from
when its message is due (a delayed message's from its delivery time, not its commit), and
a published row dates it from its ``published_at``. A subscriber that finds a payload gone
dead-letters its message, naming the message and the reference.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

import anyio
from sqlalchemy import BigInteger, Column, Index, LargeBinary, MetaData, String, Table
from sqlalchemy.dialects import mysql
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.util.concurrency import await_, in_greenlet

from fastapi_outbox import exceptions
from fastapi_outbox.settings import OutboxSettings, check_table_name
from fastapi_outbox.storage import schema
from fastapi_outbox.storage.clock import offset_value
from fastapi_outbox.storage.dialects import flavor
from fastapi_outbox.storage.statements import payloads as payloads_sql

__all__ = [
    "HEADER_CLAIM_CHECK",
    "HEADER_CLAIM_CHECK_SIZE",
    "ORPHAN_GRACE_SECONDS",
    "STUB_PAYLOAD",
    "DatabasePayloadStore",
    "FilePayloadStore",
    "PayloadStore",
    "build_payload_table",
    "known_in",
    "live_in",
    "payload_store_for",
]

#: The header naming a claim-checked message's stored payload (its reference).
HEADER_CLAIM_CHECK = "outbox-claim-check"
#: The header giving the stored payload's size in bytes.
HEADER_CLAIM_CHECK_SIZE = "outbox-claim-check-size"
#: What a claim-checked message carries as its payload (the outbox row and the broker).
STUB_PAYLOAD = "{}"
#: A file younger than this is never taken for an orphan (its transaction may still be
#: committing): an hour, far beyond any producer transaction.
ORPHAN_GRACE_SECONDS = 3600.0


class PayloadStore(Protocol):
    """Where claim-checked payloads live. ``put`` runs in the producer's commit (the
    session's ``before_commit``, inside SQLAlchemy's greenlet: sync API); ``get`` on the
    consumer's side; ``purge_batch`` and ``purge_orphans`` in retention."""

    #: ``"database"`` or ``"file"``: shown next to references.
    kind: str

    def put(self, connection: Connection, ref: str, data: bytes, due_in: float = 0.0) -> None:
        """Store ``data`` under ``ref``, dated ``due_in`` seconds after now (the message's
        delay); ``connection`` is the producer's, in its transaction."""

    async def get(self, ref: str) -> bytes | None:
        """The payload stored under ``ref``; None when it is gone (or never committed)."""

    async def purge_batch(self, older_than_seconds: float, limit: int) -> int:
        """Delete up to ``limit`` payloads dated more than ``older_than_seconds`` ago whose
        message no longer needs them (no outbox row, or a row published more than
        ``older_than_seconds`` ago)."""

    async def purge_orphans(
        self, known: Callable[[list[str]], Awaitable[set[str]]], younger_than: float, limit: int
    ) -> int:
        """Delete the payloads older than the store's grace period and younger than
        ``younger_than`` seconds (while a committed message's outbox row surely still
        exists) whose reference ``known`` does not find among the outbox's messages, asking
        ``known`` about ``limit`` references at a time; returns how many (0 for a
        transactional store)."""

    async def create(self) -> None:
        """Create what the store needs (its table, its directory)."""

    async def drop(self) -> None:
        """Remove the store's table (a directory is left alone)."""


def build_payload_table(name: str, metadata_: MetaData | None = None) -> Table:
    """The claim-check table called ``name`` on ``metadata_`` (a new ``MetaData`` when None)."""
    try:
        check_table_name(name)
    except ValueError as exc:
        raise exceptions.ConfigurationError(
            f"claim-check table {name!r} (<table_name>_payloads): {exc}"
        ) from None
    md = metadata_ if metadata_ is not None else MetaData()
    if name in md.tables:
        return md.tables[name]
    table = Table(
        name,
        md,
        Column("ref", String(64), primary_key=True, comment="message id"),
        Column(
            "data",
            # MySQL: LONGBLOB (its BLOB stops at 64 KiB, below most claim-checked payloads).
            LargeBinary().with_variant(mysql.LONGBLOB(), "mysql", "mariadb"),
            nullable=False,
            comment="the payload as published",
        ),
        Column("size", BigInteger, nullable=False),
        Column("created_at", schema.UtcDateTime(), nullable=False),
    )
    Index(f"ix_{name}_created_at", table.c.created_at)
    return table


class DatabasePayloadStore:
    """Payloads in a table of the outbox's database, written in the producer's transaction."""

    kind = "database"

    def __init__(
        self, engine: AsyncEngine, table: Table, outbox_table: Table | None = None
    ) -> None:
        self.engine = engine
        self.table = table
        #: The messages that name the payloads: one still in need keeps its payload.
        self.outbox_table = outbox_table
        self.is_postgres = engine.dialect.name == "postgresql"
        self._flavor = flavor(engine)
        self._insert = payloads_sql.insert_payload(table, self._flavor)
        self._fetch = payloads_sql.fetch(table)

    def put(self, connection: Connection, ref: str, data: bytes, due_in: float = 0.0) -> None:
        due: Any = offset_value(self._flavor, due_in)
        connection.execute(self._insert, {"ref": ref, "data": data, "size": len(data), "due": due})

    async def get(self, ref: str) -> bytes | None:
        async with self.engine.connect() as conn:
            data = (await conn.execute(self._fetch, {"ref": ref})).scalar_one_or_none()
        return None if data is None else bytes(data)

    async def purge_batch(self, older_than_seconds: float, limit: int) -> int:
        stmt = payloads_sql.purge(
            self.table, self._flavor, older_than_seconds, limit, self.outbox_table
        )
        async with self.engine.begin() as conn:
            result: Any = await conn.execute(stmt)
        return int(result.rowcount)

    async def purge_orphans(
        self, known: Callable[[list[str]], Awaitable[set[str]]], younger_than: float, limit: int
    ) -> int:
        return 0  # written in the producer's transaction: a rollback leaves nothing

    async def create(self) -> None:
        await schema.create_table(self.engine, self.table)

    async def drop(self) -> None:
        await schema.drop_table(self.engine, self.table)


class FilePayloadStore:
    """Payloads as files of one directory (``<ref>.payload``), written and synced before
    the producer's commit; orphans (a rollback, a crash before the commit) removed by
    retention after ``orphan_grace_seconds``. The files' modification times (the file
    system's clock) date them, set to when their message is due; ``live`` (which of some
    references name a message that still needs its payload, see `live_in`) keeps a
    file past the retention."""

    kind = "file"

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        orphan_grace_seconds: float = ORPHAN_GRACE_SECONDS,
        live: Callable[[list[str], float], Awaitable[set[str]]] | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.orphan_grace_seconds = orphan_grace_seconds
        self.live = live

    def path_of(self, ref: str) -> Path:
        # A reference is a message id: refuse anything that could leave the directory.
        uuid.UUID(ref)
        return self.directory / f"{ref}.payload"

    def put(self, connection: Connection, ref: str, data: bytes, due_in: float = 0.0) -> None:
        # In an AsyncSession's commit (SQLAlchemy's greenlet): written on a worker thread,
        # so that megabytes and their fsync do not hold the event loop.
        if in_greenlet():
            await_(anyio.to_thread.run_sync(self._write, ref, data, due_in))
        else:
            self._write(ref, data, due_in)

    def _write(self, ref: str, data: bytes, due_in: float = 0.0) -> None:
        path = self.path_of(ref)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if due_in > 0:  # dated from when the message is due (retention counts from there)
            due = time.time() + due_in
            os.utime(tmp, (due, due))
        os.replace(tmp, path)

    async def get(self, ref: str) -> bytes | None:
        try:
            path = self.path_of(ref)
        except ValueError:
            return None
        try:
            return await anyio.to_thread.run_sync(path.read_bytes)
        except FileNotFoundError:
            return None

    def _aged(self, older_than: float, limit: int, younger_than: float | None = None) -> list[Path]:
        now = time.time()
        cutoff = now - older_than
        floor = None if younger_than is None else now - younger_than
        found: list[Path] = []
        with os.scandir(self.directory) as entries:
            for entry in entries:
                if not entry.name.endswith((".payload", ".tmp")):
                    continue
                try:
                    mtime = entry.stat().st_mtime
                    if mtime < cutoff and (floor is None or mtime > floor):
                        found.append(Path(entry.path))
                except FileNotFoundError:
                    continue
                if len(found) >= limit:
                    break
        return found

    @staticmethod
    def _unlink(paths: Iterable[Path]) -> int:
        n = 0
        for path in paths:
            try:
                path.unlink()
                n += 1
            except FileNotFoundError:
                continue
        return n

    async def purge_batch(self, older_than_seconds: float, limit: int) -> int:
        live = self.live
        if live is None:

            def purge() -> int:
                return self._unlink(self._aged(older_than_seconds, limit))

            return await anyio.to_thread.run_sync(purge)
        # Every aged file, looked up ``limit`` at a time: payloads still needed early in the
        # listing must not hide the others after them.
        aged = await anyio.to_thread.run_sync(self._aged, older_than_seconds, 1 << 62)
        removed = 0
        for start in range(0, len(aged), limit):
            chunk = {p.name.split(".", 1)[0]: p for p in aged[start : start + limit]}
            needed = await live(list(chunk), older_than_seconds)
            removed += await anyio.to_thread.run_sync(
                self._unlink, [p for ref, p in chunk.items() if ref not in needed]
            )
        return removed

    async def purge_orphans(
        self, known: Callable[[list[str]], Awaitable[set[str]]], younger_than: float, limit: int
    ) -> int:
        if younger_than <= self.orphan_grace_seconds:
            return 0
        # Every file of the window (a directory listing), looked up ``limit`` at a time:
        # live files early in the listing must not hide the orphans after them.
        old = await anyio.to_thread.run_sync(
            self._aged, self.orphan_grace_seconds, 1 << 62, younger_than
        )
        removed = await anyio.to_thread.run_sync(
            self._unlink,
            [p for p in old if p.suffix == ".tmp"],  # writes that never finished
        )
        refs = [p for p in old if p.suffix == ".payload"]
        for start in range(0, len(refs), limit):
            chunk = {p.stem: p for p in refs[start : start + limit]}
            alive = await known(list(chunk))
            orphans = [p for ref, p in chunk.items() if ref not in alive]
            removed += await anyio.to_thread.run_sync(self._unlink, orphans)
        return removed

    async def create(self) -> None:
        await anyio.to_thread.run_sync(lambda: self.directory.mkdir(parents=True, exist_ok=True))

    async def drop(self) -> None:
        return None


def known_in(
    engine: AsyncEngine, outbox_table: Table
) -> Callable[[list[str]], Awaitable[set[str]]]:
    """The ``known`` of `PayloadStore.purge_orphans`: which references are message
    ids of ``outbox_table``."""
    stmt = payloads_sql.known_messages(outbox_table)

    async def known(refs: list[str]) -> set[str]:
        ids = []
        for ref in refs:
            try:
                ids.append(uuid.UUID(ref))
            except ValueError:
                continue
        if not ids:
            return set()
        async with engine.connect() as conn:
            return {str(i) for i in (await conn.execute(stmt, {"refs": ids})).scalars()}

    return known


def live_in(
    engine: AsyncEngine, outbox_table: Table
) -> Callable[[list[str], float], Awaitable[set[str]]]:
    """The ``live`` of `FilePayloadStore`: which references name a message of
    ``outbox_table`` that still needs its payload (a row not finished, or published less
    than the given number of seconds ago)."""
    is_postgres = flavor(engine)

    async def live(refs: list[str], older_than_seconds: float) -> set[str]:
        ids = []
        for ref in refs:
            try:
                ids.append(uuid.UUID(ref))
            except ValueError:
                continue
        if not ids:
            return set()
        stmt = payloads_sql.live_messages(outbox_table, is_postgres, older_than_seconds)
        async with engine.connect() as conn:
            return {str(i) for i in (await conn.execute(stmt, {"refs": ids})).scalars()}

    return live


def payload_store_for(
    engine: AsyncEngine, settings: OutboxSettings, outbox_table: Table
) -> PayloadStore | None:
    """The store ``settings`` name (None: claim-check off): the database table
    ``<table_name>_payloads`` on the outbox table's metadata (``create_tables`` and
    Alembic include it), or a directory; either keeps the payloads the messages of
    ``outbox_table`` still need."""
    if settings.claim_check_bytes is None:
        return None
    where = settings.claim_check_store
    if where == "database":
        table = build_payload_table(f"{settings.table_name}_payloads", outbox_table.metadata)
        return DatabasePayloadStore(engine, table, outbox_table)
    return FilePayloadStore(where.removeprefix("file://"), live=live_in(engine, outbox_table))

"""Retention: delete published and abandoned rows past their retention, in bounded batches.

Each batch is one short transaction deleting at most ``cleanup_batch_size`` rows found
through a partial index (``FOR UPDATE SKIP LOCKED`` on PostgreSQL), so a cleanup never
locks the table, never runs one table-wide DELETE, and never stalls dispatch.

``archive=True``: the same batches move the rows to the archive table instead
(`Archive`), a partitioned table's finished
partitions are re-attached to the archive instead of dropped, and the archive's own
retention (``archive_retention_seconds``) runs after.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import anyio

from fastapi_outbox.log import safe_error
from fastapi_outbox.settings import OutboxSettings
from fastapi_outbox.storage.archive import Archive
from fastapi_outbox.storage.claim_check import PayloadStore
from fastapi_outbox.storage.inbox import Inbox
from fastapi_outbox.storage.partitions import Maintainer
from fastapi_outbox.storage.store import ABANDONED, PUBLISHED, Store

logger = logging.getLogger("fastapi_outbox.lifecycle")

#: Pause between two batches: lets dispatch and requests through.
BATCH_PAUSE_SECONDS = 0.01


class PurgesBatches(Protocol):
    """What `purge` runs batch by batch: the outbox table's delete
    (`purge_batch`), or the archive's move
    (``archive=True``)."""

    async def purge_batch(
        self, status: str, older_than_seconds: float, limit: int, *, keep_blocking: bool = False
    ) -> int: ...


async def purge(
    store: PurgesBatches,
    status: str,
    older_than_seconds: float,
    *,
    batch_size: int,
    max_rows: int | None = None,
    progress: Callable[[int], None] | None = None,
    keep_blocking: bool = False,
) -> int:
    """Delete ``status`` rows finished more than ``older_than_seconds`` ago, batch by batch;
    returns how many were deleted. ``keep_blocking``: see ``Retention.purge_batch``."""
    if status not in (PUBLISHED, ABANDONED):
        raise ValueError(f"purge takes 'published' or 'abandoned', not {status!r}")
    total = 0
    while max_rows is None or total < max_rows:
        limit = batch_size if max_rows is None else min(batch_size, max_rows - total)
        deleted = await store.purge_batch(
            status, older_than_seconds, limit, keep_blocking=keep_blocking
        )
        total += deleted
        if progress is not None:
            progress(deleted)
        if deleted < limit:
            break
        await anyio.sleep(BATCH_PAUSE_SECONDS)
    return total


async def purge_in_batches(
    purge_batch: Callable[[float, int], Awaitable[int]], older_than_seconds: float, batch: int
) -> int:
    """Run ``purge_batch(older_than_seconds, batch)`` until a batch comes back short, with
    a pause between batches; returns how many rows went."""
    total = 0
    while True:
        n = await purge_batch(older_than_seconds, batch)
        total += n
        if n < batch:
            return total
        await anyio.sleep(BATCH_PAUSE_SECONDS)


class _Mover:
    """An archive seen as `PurgesBatches`: `purge`'s batches move the rows."""

    def __init__(self, archive: Archive) -> None:
        self.archive = archive

    async def purge_batch(
        self, status: str, older_than_seconds: float, limit: int, *, keep_blocking: bool = False
    ) -> int:
        return await self.archive.move_batch(
            status, older_than_seconds, limit, keep_blocking=keep_blocking
        )


class Cleaner:
    """The periodic retention task started with the relays."""

    def __init__(
        self,
        store: Store,
        settings: OutboxSettings,
        partitions: Maintainer | None = None,
        *,
        inbox: Inbox | None = None,
        archive: Archive | None = None,
        payloads: PayloadStore | None = None,
        known: Callable[[list[str]], Awaitable[set[str]]] | None = None,
        subscribers: Sequence[object] = (),
    ) -> None:
        self.store = store
        #: The process's subscribers (a list filled as they are declared): with any, its
        #: group's handlers and attempts tables exist and are pruned with the inbox.
        self.subscribers = subscribers
        #: ``archive=True``: finished rows move there instead of being deleted.
        self.archive = archive
        self.archived_partitions: list[str] = []
        self.archived_total = 0
        self.settings = settings
        #: A partitioned table's upkeep: partitions ahead created and expired ones dropped
        #: before the batched DELETE (which then only meets the DEFAULT partition's rows
        #: and partitions still holding a row that needs work).
        self.partitions = partitions
        self.dropped_partitions: list[str] = []
        self.inbox = inbox
        #: Claim-checked payloads (``claim_check_bytes``) and, for a file store's orphan
        #: sweep, which references are message ids of the outbox table.
        self.payloads = payloads
        self.known = known
        self.last_run: float | None = None
        self.deleted_total = 0
        # Made by run(): the Outbox (and this cleaner) may be built outside an event loop,
        # and each relay run needs fresh ones.
        self._stop: anyio.Event | None = None
        #: Set when `run` has returned (shutdown waits for it, see `stop`).
        self.stopped: anyio.Event | None = None

    @property
    def running(self) -> bool:
        """Between the start of `run` and its return."""
        return self.stopped is not None and not self.stopped.is_set()

    def stop(self) -> None:
        """Return from `run` after the current batch. Shutdown stops the cleaner
        this way rather than cancelling it in the middle of a DELETE: a cancelled query
        leaves its connection to be torn down in the background (aiosqlite)."""
        if self._stop is not None:
            self._stop.set()

    async def run_once(self) -> int:
        """One cleanup; the rows deleted (``archive=True``: moved to the archive)."""
        deleted = 0
        if self.partitions is not None:
            await self._partitions()
        for status, retention in (
            (PUBLISHED, self.settings.published_retention_seconds),
            (ABANDONED, self.settings.abandoned_retention_seconds),
        ):
            if retention is None:
                continue
            n = await purge(
                self.store.retention if self.archive is None else _Mover(self.archive),
                status,
                retention,
                batch_size=self.settings.cleanup_batch_size,
                # Ordered: an abandoned message a later one of its key waits for stays until
                # an operator replays or purges it (retention would open a silent gap).
                keep_blocking=self.settings.ordered and status == ABANDONED,
            )
            if n:
                logger.info(
                    "retention cleanup" if self.archive is None else "retention archived",
                    extra={
                        "action": "retention.deleted"
                        if self.archive is None
                        else "retention.archived",
                        "status": status,
                        "count": n,
                    },
                )
            deleted += n
        if self.archive is not None:
            self.archived_total += deleted
            await self._purge_archive(self.archive)
        deleted += await self._purge_inbox()
        deleted += await self._purge_payloads()
        self.deleted_total += deleted
        self.last_run = anyio.current_time()
        return deleted

    async def _partitions(self) -> None:
        """Partitions ahead created; expired ones dropped (``archive=True``: re-attached to
        the archive)."""
        assert self.partitions is not None
        published = self.settings.published_retention_seconds
        abandoned = self.settings.abandoned_retention_seconds
        if self.archive is None:
            _, dropped = await self.partitions.run_once(published, abandoned)
            self.dropped_partitions += dropped
            return
        await self.partitions.ensure_ahead()
        self.archived_partitions += await self.partitions.archive_expired(
            self.archive.table, published, abandoned
        )

    async def _purge_archive(self, archive: Archive) -> int:
        """The archive's retention: rows archived longer ago than
        ``archive_retention_seconds``, in bounded batches (a partitioned archive: whole
        partitions first)."""
        retention = self.settings.archive_retention_seconds
        if retention is None:
            return 0
        if self.partitions is not None:
            await self.partitions.drop_archive_expired(archive.table, retention)
        total = await purge_in_batches(
            archive.purge_batch, retention, self.settings.cleanup_batch_size
        )
        if total:
            logger.info(
                "archive retention cleanup",
                extra={"action": "retention.archive_deleted", "count": total},
            )
        return total

    async def _purge_inbox(self) -> int:
        """Inbox rows past ``inbox_retention_seconds``, in bounded batches; then the rows of
        the handlers and attempts tables nothing needs any more."""
        retention = self.settings.inbox_retention_seconds
        if self.inbox is None or retention is None:
            return 0
        total = 0
        batch = self.settings.cleanup_batch_size
        # An attempts row was last counted before its message was handled: one the inbox
        # purge leaves behind is past the cutoff too.
        purges = [self.inbox.purge_batch]
        if self.subscribers:
            purges.append(self.inbox.purge_group_rows_batch)
        for purge_batch in purges:
            total += await purge_in_batches(purge_batch, retention, batch)
        if total:
            logger.info(
                "inbox retention cleanup",
                extra={"action": "retention.inbox_deleted", "count": total},
            )
        return total

    async def _purge_payloads(self) -> int:
        """Claim-checked payloads past ``claim_check_retention_seconds`` (the longer of the
        published messages' and the inbox's retentions), in bounded batches; then a file
        store's orphans (a rollback or a crash before the commit): files past the store's
        grace period with no outbox row, looked for while a committed message's row surely
        still exists (younger than ``published_retention_seconds``). Not with
        ``delete_on_publish``, whose rows go at once, nor with ``capture="wal"``, whose
        messages have no row at all (only the refused and the delayed ones do): there a
        payload whose message still waits in the slot, or in a consumer group, would be
        taken for an orphan, and orphans go with the retention instead."""
        store = self.payloads
        if store is None:
            return 0
        settings = self.settings
        batch = settings.cleanup_batch_size
        total = 0
        retention = settings.claim_check_retention_seconds
        if retention is not None:
            total += await purge_in_batches(store.purge_batch, retention, batch)
        rows_name_payloads = not settings.delete_on_publish and settings.capture == "table"
        if self.known is not None and rows_name_payloads:
            window = settings.published_retention_seconds
            total += await store.purge_orphans(
                self.known, float("inf") if window is None else window, batch
            )
        if total:
            logger.info(
                "claim-check retention cleanup",
                extra={"action": "retention.payloads_deleted", "count": total},
            )
        return total

    async def run(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        self._stop, self.stopped = anyio.Event(), anyio.Event()
        try:
            await self._run(self._stop, task_status)
        finally:
            self.stopped.set()

    async def _run(self, stop: anyio.Event, task_status: Any) -> None:
        task_status.started()
        if (
            self.settings.published_retention_seconds is None
            and self.settings.abandoned_retention_seconds is None
            and self.partitions is None
            and (self.inbox is None or self.settings.inbox_retention_seconds is None)
            and (self.archive is None or self.settings.archive_retention_seconds is None)
            and self.payloads is None
        ):
            return
        while not stop.is_set():
            try:
                await self.run_once()
            except Exception as exc:
                logger.warning(
                    "retention cleanup failed",
                    extra={
                        "action": "retention.failed",
                        "error": safe_error(exc),
                    },
                )
            with anyio.move_on_after(self.settings.cleanup_interval_seconds):
                await stop.wait()

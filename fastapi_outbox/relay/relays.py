"""The relays of one outbox: their state in this process and the wake-ups that reach them.

`Relays` holds what runs here — the NOTIFY sender, a table relay per broker, the
LISTEN listener, the WAL relay of ``capture="wal"`` — and the after-commit wake-ups a
producer's commit sends them (`fastapi_outbox.relay.wakeups.wake_after_commit`).
They are started by the process's lifecycle
(`fastapi_outbox.lifecycle.supervisor.Lifecycle`), which hands `Relays.start`
its supervisor's ``start``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

import anyio

from fastapi_outbox.brokers.base import Broker
from fastapi_outbox.instrumentation import Instrumentation
from fastapi_outbox.relay.table import TableRelay
from fastapi_outbox.relay.wakeups import (
    Listener,
    Notifier,
    notify_once,
    notify_with_commit,
    wake_after_commit,
)
from fastapi_outbox.relay.wal import WalRelay
from fastapi_outbox.settings import OutboxSettings
from fastapi_outbox.storage.statements import notify as notify_sql
from fastapi_outbox.storage.store import Store
from fastapi_outbox.storage.wal_slot import WalSlot

__all__ = ["Relays", "Start"]

#: Starts one long-running part and returns once it reported ready (a supervisor's).
Start = Callable[[Notifier | Listener | TableRelay | WalRelay], Awaitable[None]]


class Relays:
    """The relays of one outbox and the wake-ups that reach them (module docstring)."""

    def __init__(
        self,
        *,
        store: Store,
        settings: OutboxSettings,
        instance: str,
        channel: str,
        instrumentation: Instrumentation,
        wal_slot: WalSlot | None,
    ) -> None:
        self.store = store
        self.settings = settings
        self.instance = instance
        self.channel = channel
        self.instrumentation = instrumentation
        self.wal_slot = wal_slot
        #: The table relay of each broker (kept after a run, for its counters).
        self.tables: dict[str, TableRelay] = {}
        #: The WAL relay (``capture="wal"``) while it runs here.
        self.wal: WalRelay | None = None
        self.notifier: Notifier | None = None
        self.listener: Listener | None = None

    @property
    def _notifies(self) -> bool:
        """NOTIFY/LISTEN wake other processes: PostgreSQL with ``notify`` on."""
        return self.store.is_postgres and self.settings.notify

    # -- after a commit ----------------------------------------------------------------------

    def notify_with_commit(self, brokers: Mapping[str, float]) -> str | None:
        """Before a commit: the statements its COMMIT carries to wake other processes, or
        None when they need no NOTIFY (see
        `notify_with_commit`)."""
        if not notify_with_commit(brokers, self.tables, self.wal, can_notify=self._notifies):
            return None
        return notify_sql.notify_with_commit(self.channel, self.instance)

    def committed(self, brokers: Mapping[str, float], *, notified: bool = False) -> bool:
        """Wake this process's relays after a commit (see
        `wake_after_commit`); True when a NOTIFY must
        still be sent (`notify_after_commit`). ``notified``: the COMMIT carried it."""
        return wake_after_commit(
            brokers,
            self.tables,
            self.wal,
            self.notifier,
            can_notify=self._notifies,
            notified=notified,
        )

    async def notify_after_commit(self) -> None:
        """One NOTIFY after the commit, outside the business transaction, bounded and only
        logged when it fails (`fastapi_outbox.relay.wakeups.notify_once`)."""
        await notify_once(self.store, self.channel, self.instance)

    def wake_all(self) -> None:
        for relay in self.tables.values():
            relay.wakeup.set()
        if self.wal is not None:
            self.wal.wakeup.set()

    # -- running -----------------------------------------------------------------------------

    async def start(
        self, start: Start, brokers: Callable[[], Awaitable[dict[str, Broker]]]
    ) -> None:
        """Start the NOTIFY sender, the listener, a table relay per broker and, with
        ``capture="wal"``, the WAL relay, each with ``start``. ``brokers`` gives the brokers
        to publish with, once the NOTIFY sender runs (it may declare consumer groups
        first: `gate_brokers`)."""
        settings = self.settings
        if self._notifies:
            self.notifier = Notifier(
                self.store, self.channel, self.instance, settings.notify_interval_seconds
            )
            await start(self.notifier)
            self.listener = Listener(
                self.store,
                self.channel,
                self.instance,
                self.wake_all,
                check_interval=settings.listen_check_interval_seconds,
                check_timeout=settings.listen_check_timeout_seconds,
            )
        listener = self.listener
        publishing = await brokers()
        for name, broker in publishing.items():
            self.tables[name] = TableRelay(
                store=self.store.claims,
                broker_name=name,
                broker=broker,
                settings=settings,
                instance=self.instance,
                listening=(lambda: bool(listener and listener.listening)),
                instrumentation=self.instrumentation,
            )
        if listener is not None:  # between: it wakes the table relays once it listens
            await start(listener)
        for relay in self.tables.values():
            await start(relay)
        if self.wal_slot is not None:
            self.wal = WalRelay(
                store=self.store,
                slot=self.wal_slot,
                brokers=publishing,
                settings=settings,
                instance=self.instance,
                instrumentation=self.instrumentation,
                listening=(lambda: bool(listener and listener.listening)),
            )
            await start(self.wal)

    def stopped(self) -> None:
        """The run ended: forget what ran (the table relays stay, for their counters)."""
        self.notifier = None
        self.listener = None
        self.wal = None

    @contextlib.asynccontextmanager
    async def notifying(self) -> AsyncIterator[None]:
        """Run only the coalesced NOTIFY sender (API-only processes:
        ``run_relays=False``), so commits wake the relay processes without one extra
        round trip per request."""
        if not self._notifies or self.notifier is not None:
            yield
            return
        # A task owned by this context manager (cancelled and awaited on exit) rather than a
        # task group: an API-only lifespan must survive being entered and left from
        # different tasks, as async test fixtures do.
        notifier = Notifier(
            self.store, self.channel, self.instance, self.settings.notify_interval_seconds
        )
        task = asyncio.get_running_loop().create_task(notifier.run(), name="outbox-notifier")
        self.notifier = notifier
        try:
            yield
        finally:
            self.notifier = None
            task.cancel()
            with anyio.CancelScope(shield=True), contextlib.suppress(asyncio.CancelledError):
                await task

"""One supervision loop for every relay: how an outbox's long-running tasks start and stop.

:class:`Supervisor` runs services — anything with ``run(*, task_status)`` — in one task
group, each started only once it reports ready (anyio's ``await tg.start(...)``), in the
order given. It stops them all the same way: every service that can stop gracefully
(``stop()``, ``running``, ``stopped``: the table relays, the WAL relay, the subscribers,
retention) is told to stop at once, then awaited, all of them within one
``shutdown_timeout_seconds``; whatever is left (the LISTEN listener, the NOTIFY sender, a
service past the bound) is cancelled. No service restarts another: a relay whose loop
crashed ends alone and the health endpoint reports it (see
:meth:`fastapi_outbox.relay.loop.RelayLoop._supervise`).

:class:`Relays` is what an outbox runs under that supervisor: the NOTIFY sender, a table
relay per broker, the LISTEN listener, the WAL relay of ``capture="wal"``, then the
services the composition root adds (subscribers, retention); and the after-commit
wake-ups that reach them (:func:`fastapi_outbox.relay.wakeups.wake_after_commit`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import anyio
import anyio.abc

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

__all__ = ["Relays", "Service", "StoppableService", "Supervisor", "close_brokers"]

logger = logging.getLogger("fastapi_outbox")


class Service(Protocol):
    """A long-running task: runs until cancelled or stopped, ready once it says so."""

    async def run(self, *, task_status: Any = ...) -> None: ...


@runtime_checkable
class StoppableService(Protocol):
    """A service that stops gracefully: ``stop()`` asks, ``stopped`` is set once it has
    (None before it first ran), ``running`` while it runs."""

    async def run(self, *, task_status: Any = ...) -> None: ...

    def stop(self) -> None: ...

    @property
    def running(self) -> bool: ...

    @property
    def stopped(self) -> anyio.Event | None: ...


class Supervisor:
    """Starts services in one task group and stops them together (module docstring)."""

    def __init__(self, tg: anyio.abc.TaskGroup, shutdown_timeout_seconds: float) -> None:
        self._tg = tg
        self._timeout = shutdown_timeout_seconds
        self._services: list[Service] = []

    async def start(self, service: Service) -> None:
        """Start ``service``; returns once it reported ready."""
        await self._tg.start(service.run)
        self._services.append(service)

    async def stop(self) -> None:
        """Stop every stoppable service at once, await them within the shutdown bound, then
        cancel what is left."""
        stoppable = [s for s in self._services if isinstance(s, StoppableService)]
        for service in stoppable:
            service.stop()
        with anyio.CancelScope(shield=True), anyio.move_on_after(self._timeout):
            for service in stoppable:
                stopped = service.stopped
                if service.running and stopped is not None:
                    await stopped.wait()
        self._tg.cancel_scope.cancel()


async def close_brokers(brokers: Mapping[str, Broker], timeout: float) -> None:
    """Close every broker at once, each bounded by ``timeout``: brokers that hang cost one
    timeout in all, not one each."""

    async def close(name: str, broker: Broker) -> None:
        try:
            with anyio.move_on_after(timeout):
                await broker.aclose()
        except Exception:
            logger.warning(
                "broker close failed",
                extra={"action": "broker.close", "broker": name},
                exc_info=True,
            )

    async with anyio.create_task_group() as tg:
        for name, broker in brokers.items():
            tg.start_soon(close, name, broker)


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
        self.processors: dict[str, TableRelay] = {}
        self.wal_relay: WalRelay | None = None
        self.notifier: Notifier | None = None
        self.listener: Listener | None = None
        self.started = False

    @property
    def _notifies(self) -> bool:
        """NOTIFY/LISTEN wake other processes: PostgreSQL with ``notify`` on."""
        return self.store.is_postgres and self.settings.notify

    # -- after a commit ----------------------------------------------------------------------

    def notify_with_commit(self, brokers: Mapping[str, float]) -> str | None:
        """Before a commit: the statements its COMMIT carries to wake other processes, or
        None when they need no NOTIFY (see
        :func:`~fastapi_outbox.relay.wakeups.notify_with_commit`)."""
        if not notify_with_commit(
            brokers, self.processors, self.wal_relay, can_notify=self._notifies
        ):
            return None
        return notify_sql.notify_with_commit(self.channel, self.instance)

    def committed(self, brokers: Mapping[str, float], *, notified: bool = False) -> bool:
        """Wake this process's relays after a commit (see
        :func:`~fastapi_outbox.relay.wakeups.wake_after_commit`); True when a NOTIFY must
        still be sent (:meth:`notify_after_commit`). ``notified``: the COMMIT carried it."""
        return wake_after_commit(
            brokers,
            self.processors,
            self.wal_relay,
            self.notifier,
            can_notify=self._notifies,
            notified=notified,
        )

    async def notify_after_commit(self) -> None:
        await notify_once(self.store, self.channel, self.instance)

    def wake_all(self) -> None:
        for processor in self.processors.values():
            processor.wakeup.set()
        if self.wal_relay is not None:
            self.wal_relay.wakeup.set()

    # -- running -----------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def running(
        self,
        brokers: Callable[[], Awaitable[dict[str, Broker]]],
        services: Sequence[Service] = (),
    ) -> AsyncIterator[None]:
        """Run the relays, then ``services``, while the block runs. ``brokers`` gives the
        brokers to publish with, once the NOTIFY sender runs (it may declare consumer
        groups first: :func:`~fastapi_outbox.relay.groups_first.gate_brokers`)."""
        self.started = True
        try:
            async with anyio.create_task_group() as tg:
                supervisor = Supervisor(tg, self.settings.shutdown_timeout_seconds)
                await self._start_notifier(supervisor)
                await self._start_relays(supervisor, await brokers())
                for service in services:
                    await supervisor.start(service)
                logger.info(
                    "outbox relays started",
                    extra={
                        "action": "outbox.start",
                        "brokers": list(self.processors),
                        "workers": self.settings.workers,
                        "instance": self.instance,
                    },
                )
                try:
                    yield
                finally:
                    await supervisor.stop()
                    logger.info("outbox relays stopped", extra={"action": "outbox.stop"})
        finally:
            self.started = False
            self.notifier = None
            self.listener = None
            self.wal_relay = None

    async def _start_notifier(self, supervisor: Supervisor) -> None:
        """The NOTIFY sender first; the listener is built here and started with the
        relays."""
        settings = self.settings
        if self._notifies:
            self.notifier = Notifier(
                self.store, self.channel, self.instance, settings.notify_interval_seconds
            )
            await supervisor.start(self.notifier)
            self.listener = Listener(
                self.store,
                self.channel,
                self.instance,
                self.wake_all,
                check_interval=settings.listen_check_interval_seconds,
                check_timeout=settings.listen_check_timeout_seconds,
            )

    async def _start_relays(self, supervisor: Supervisor, brokers: dict[str, Broker]) -> None:
        """A table relay per broker and, with ``capture="wal"``, the WAL relay; the
        listener between (it wakes the table relays once it listens)."""
        listener = self.listener
        for name, broker in brokers.items():
            self.processors[name] = TableRelay(
                store=self.store.claims,
                broker_name=name,
                broker=broker,
                settings=self.settings,
                instance=self.instance,
                listening=(lambda: bool(listener and listener.listening)),
                instrumentation=self.instrumentation,
            )
        if listener is not None:
            await supervisor.start(listener)
        for processor in self.processors.values():
            await supervisor.start(processor)
        if self.wal_slot is not None:
            self.wal_relay = WalRelay(
                store=self.store,
                slot=self.wal_slot,
                brokers=brokers,
                settings=self.settings,
                instance=self.instance,
                instrumentation=self.instrumentation,
                listening=(lambda: bool(listener and listener.listening)),
            )
            await supervisor.start(self.wal_relay)

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

"""The process's lifecycle: how an outbox's long-running tasks start and stop.

`Supervisor` runs services — anything with ``run(*, task_status)`` — in one task
group, each started only once it reports ready (anyio's ``await tg.start(...)``), in the
order given. It stops them all the same way: every service that can stop gracefully
(``stop()``, ``running``, ``stopped``: the table relays, the WAL relay, the subscribers,
retention) is told to stop at once, then awaited, all of them within one
``shutdown_timeout_seconds``; whatever is left (the LISTEN listener, the NOTIFY sender, a
service past the bound) is cancelled. No service restarts another: a relay whose loop
crashed ends alone and the health endpoint reports it (see
`fastapi_outbox.relay.loop.RelayLoop._supervise`).

`Lifecycle` is what an outbox runs under that supervisor: its relays
(`fastapi_outbox.relay.relays.Relays`: the NOTIFY sender, a table relay per broker,
the LISTEN listener, the WAL relay of ``capture="wal"``), with the consumer groups of its
subscribers declared before the first publish (`fastapi_outbox.lifecycle.groups`),
then the subscribers and the retention sweep (`fastapi_outbox.lifecycle.retention`);
at the end, the brokers are closed.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Mapping
from typing import Any, Protocol, runtime_checkable

import anyio
import anyio.abc

from fastapi_outbox import exceptions
from fastapi_outbox.brokers.base import Broker
from fastapi_outbox.brokers.setup import NO_BROKER
from fastapi_outbox.consume.subscriber import Subscriber
from fastapi_outbox.lifecycle.groups import declare_groups, declare_or_warn, gate_brokers
from fastapi_outbox.lifecycle.retention import Cleaner
from fastapi_outbox.relay.relays import Relays
from fastapi_outbox.settings import OutboxSettings
from fastapi_outbox.storage.wal_slot import WalSlot

__all__ = ["Lifecycle", "Service", "StoppableService", "Supervisor", "close_brokers"]

logger = logging.getLogger("fastapi_outbox.lifecycle")


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


class Lifecycle:
    """The long-running side of one outbox in this process (module docstring): ``started``
    while it runs; ``relays``, ``subscribers`` and ``cleaner`` are what it runs."""

    def __init__(
        self,
        *,
        relays: Relays,
        subscribers: list[Subscriber],
        cleaner: Cleaner,
        settings: OutboxSettings,
        wal_slot: WalSlot | None,
    ) -> None:
        self.relays = relays
        self.subscribers = subscribers
        self.cleaner = cleaner
        self.settings = settings
        self.wal_slot = wal_slot
        self.started = False

    async def declare_groups(self, broker: str | None = None) -> None:
        """Create the broker-side group of every subscriber (of ``broker``, or all) — Redis
        consumer group, JetStream durable and dead-letter stream — or bring an existing
        one to the declared settings (idempotent). BrokerUnavailable when its broker does
        not answer; ConfigurationError naming the subscriber for anything else."""
        await declare_groups(self.subscribers, broker)

    async def declare_groups_or_warn(self) -> None:
        """`declare_groups`, a broker that does not answer only logged: tables created
        at an app's start must not fail it (the relays declare the groups before they
        publish anyway; ``db create`` declares them strictly)."""
        if self.subscribers:
            await declare_or_warn(
                self.declare_groups, "consumer groups not created: broker unavailable"
            )

    @contextlib.asynccontextmanager
    async def running(
        self, brokers: Mapping[str, Broker], external_brokers: Mapping[str, Broker]
    ) -> AsyncIterator[None]:
        """Run the relays (publishing to ``brokers`` and ``external_brokers``), then the
        subscribers and retention, while the block runs; close every broker after."""
        if self.started:
            raise exceptions.ConfigurationError("this Outbox's relays are already running")
        if not brokers:
            raise exceptions.ConfigurationError(NO_BROKER)
        if self.wal_slot is not None:
            await self.wal_slot.check_server(slot=True)
        everything = {**brokers, **external_brokers}

        def gated() -> Awaitable[dict[str, Broker]]:
            return gate_brokers(everything, consumed, self.declare_groups)

        try:
            consumed = {s.broker_name for s in self.subscribers} & set(brokers)
            self.started = True
            try:
                async with anyio.create_task_group() as tg:
                    supervisor = Supervisor(tg, self.settings.shutdown_timeout_seconds)
                    relays = self.relays
                    await relays.start(supervisor.start, gated)
                    services: list[Service] = [*self.subscribers, self.cleaner]
                    for service in services:
                        await supervisor.start(service)
                    logger.info(
                        "outbox relays started",
                        extra={
                            "action": "outbox.start",
                            "brokers": list(relays.tables),
                            "workers": self.settings.workers,
                            "instance": relays.instance,
                        },
                    )
                    try:
                        yield
                    finally:
                        await supervisor.stop()
                        logger.info("outbox relays stopped", extra={"action": "outbox.stop"})
            finally:
                self.started = False
                self.relays.stopped()
        finally:
            with anyio.CancelScope(shield=True):
                await close_brokers(everything, self.settings.shutdown_timeout_seconds)

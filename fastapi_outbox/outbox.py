"""``Outbox``: the composition root. It wires the engine and the storage
(:mod:`fastapi_outbox.storage.setup`), the brokers (:mod:`fastapi_outbox.brokers.setup`),
the capture, the relays and their supervisor (:mod:`fastapi_outbox.relay.supervisor`), the
wake-ups, retention, the subscribers (:mod:`fastapi_outbox.consume.entry`), the lifespan
and the routers (:mod:`fastapi_outbox.ops.routers`) — the only module that knows every
part; the logic lives in those parts. The checks of its configuration are
:mod:`fastapi_outbox.config_checks`; the unit of work sees it through
:class:`fastapi_outbox.write.context.WriteContext`, a subscriber through
:class:`fastapi_outbox.consume.context.ConsumeContext`."""

from __future__ import annotations

import contextlib
import logging
import typing
import uuid
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from typing import Any

import anyio
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
)

from fastapi_outbox import config_checks, exceptions
from fastapi_outbox.brokers.base import Broker
from fastapi_outbox.brokers.setup import DEFAULT_BROKER as DEFAULT_BROKER
from fastapi_outbox.brokers.setup import NO_BROKER as NO_BROKER
from fastapi_outbox.brokers.setup import resolve_broker, setup_brokers
from fastapi_outbox.consume import entry
from fastapi_outbox.consume.context import UnitOfWorkT
from fastapi_outbox.consume.subscriber import Subscriber
from fastapi_outbox.instrumentation import Instrumentation
from fastapi_outbox.ops.routers import Routers
from fastapi_outbox.payloads import build_payloads
from fastapi_outbox.payloads.claim_check import put_claims
from fastapi_outbox.redaction import redact_url
from fastapi_outbox.relay.groups_first import declare_groups, declare_or_warn, gate_brokers
from fastapi_outbox.relay.retention import Cleaner
from fastapi_outbox.relay.supervisor import Relays, close_brokers
from fastapi_outbox.relay.table import TableRelay, instance_id
from fastapi_outbox.relay.wakeups import Listener, Notifier, channel_name
from fastapi_outbox.relay.wal import WalRelay
from fastapi_outbox.settings import OutboxSettings
from fastapi_outbox.storage.claim_check import known_in
from fastapi_outbox.storage.doctor import SideTable
from fastapi_outbox.storage.probe import DatabaseProbe
from fastapi_outbox.storage.setup import open_engine, setup_storage
from fastapi_outbox.write.capture import Capture, capture_for
from fastapi_outbox.write.unit_of_work import (
    UnitOfWork,
    current_outbox,
    register_outbox,
)

logger = logging.getLogger("fastapi_outbox")


class Outbox:
    """A transactional outbox on one database, feeding one or more brokers.

    ``Outbox(url_or_engine, brokers={"default": RedisStreamsBroker(...)}, settings=...)``;
    then ``FastAPI(lifespan=outbox.lifespan)`` and ``app.include_router(outbox.health_router)``
    (or ``app.include_router(outbox.router)``, which brings both).
    """

    def __init__(
        self,
        database: str | AsyncEngine,
        *,
        brokers: Mapping[str, Broker] | None = None,
        external_brokers: Mapping[str, Broker] | None = None,
        settings: OutboxSettings | None = None,
        session_factory: async_sessionmaker[AsyncSession] | None = None,
        instrumentation: Instrumentation | None = None,
        engine_options: Mapping[str, Any] | None = None,
        dashboard_dependencies: Sequence[Any] | None = None,
    ) -> None:
        self.settings = settings if settings is not None else OutboxSettings.from_env()
        self.engine, self._owns_engine = open_engine(database, engine_options)
        wired = setup_brokers(brokers, external_brokers, self.settings)
        self.brokers, self.external_brokers = wired.brokers, wired.external_brokers
        self.default_broker = wired.default_broker
        config_checks.check_partitioning(self.settings.partitioning, self.engine.dialect.name)
        self._storage = setup_storage(self.engine, self.settings)
        self.table, self.store = self._storage.table, self._storage.store
        #: ``capture="wal"``: the replication slot (its relay runs with the dispatchers).
        self.wal_slot = self._storage.wal_slot
        self.capture: Capture = capture_for(self.store, self.wal_slot)
        self.inbox, self.partitions = self._storage.inbox, self._storage.partitions
        #: ``archive=True``: the archive table retention moves finished rows to.
        self.archive = self._storage.archive
        #: ``claim_check_bytes`` set: the store of claim-checked payloads (else None).
        self.claim_check_store = self._storage.payloads
        #: The payload stages (encryption, claim-check): publish seals, subscribers restore.
        self.payloads = build_payloads(self.settings, self.claim_check_store)
        self.session_factory = session_factory or async_sessionmaker(
            self.engine, expire_on_commit=False
        )
        self.instrumentation = instrumentation or Instrumentation()
        self.instance = instance_id()
        self.channel = channel_name(self.settings.table_name)
        self.subscribers: list[Subscriber] = []
        self.cleaner = Cleaner(
            self.store,
            self.settings,
            self.partitions,
            inbox=self.inbox,
            archive=self.archive,
            payloads=self.claim_check_store,
            known=None if self.claim_check_store is None else known_in(self.engine, self.table),
        )
        #: The relays and their wake-ups, supervised while the dispatchers run.
        self.relays = Relays(
            store=self.store,
            settings=self.settings,
            instance=self.instance,
            channel=self.channel,
            instrumentation=self.instrumentation,
            wal_slot=self.wal_slot,
        )
        #: Health's own connection (the counts never wait behind the requests) and its look
        #: at the application's pool.
        self.database_probe = DatabaseProbe(self.engine, self.table, self.store.messages)
        self._routers = Routers(self, self.lifespan)
        self._dependency: Any = None
        self.dashboard_dependencies = (
            None if dashboard_dependencies is None else list(dashboard_dependencies)
        )
        register_outbox(self)

    def __repr__(self) -> str:
        return f"Outbox({redact_url(str(self.engine.url))!r}, brokers={list(self.all_brokers)})"

    # -- lookups ---------------------------------------------------------------------------

    @classmethod
    def current(cls) -> Outbox:
        """The only Outbox of this process (used by the ``unit_of_work`` dependency when the
        app was not started with ``outbox.lifespan``)."""
        return typing.cast("Outbox", current_outbox())

    @property
    def all_brokers(self) -> dict[str, Broker]:
        return {**self.brokers, **self.external_brokers}

    def resolve_broker(self, name: str | None) -> str:
        return resolve_broker(name, self.brokers, self.external_brokers, self.default_broker)

    def trace_headers(self, traceparent: str | None) -> dict[str, str]:
        """W3C trace context to store with a message: the active OpenTelemetry span's when
        there is one, else the request's ``traceparent``."""
        from fastapi_outbox import tracing

        return tracing.current_trace_headers(traceparent)

    # -- unit of work -----------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def unit_of_work(
        self,
        *,
        correlation_id: str | None = None,
        causation_id: str | None = None,
        traceparent: str | None = None,
        session: AsyncSession | None = None,
    ) -> AsyncIterator[UnitOfWork]:
        """``async with outbox.unit_of_work() as uow:`` — commits on exit, rolls back on error.

        The block may commit the session itself: events go with the transaction that commits
        them (:mod:`fastapi_outbox.write.session_events`).

        ``session=``: join the caller's session instead. The block runs in a savepoint: when
        it raises, its business writes and its events are undone together and the caller's
        transaction stays usable; when it succeeds, its rows are written in the caller's
        transaction, and the caller's commit or rollback decides for both — this never
        commits or rolls back the caller's transaction.

        Inside a subscriber's handler, without ``session=``, it joins the handler's session
        that way (a savepoint of the handler's transaction, the handler's correlation and
        causation ids unless given): its work commits with the message's inbox row or not
        at all, never on its own."""
        async with entry.unit_of_work(
            self,
            session,
            correlation_id=correlation_id,
            causation_id=causation_id,
            traceparent=traceparent,
        ) as uow:
            yield uow

    def write_rows(self, connection: Connection, rows: list[dict[str, Any]]) -> None:
        """Record outbox messages on a session's connection, through this outbox's capture
        (called by the session's ``before_commit``; see
        :mod:`fastapi_outbox.write.session_events`)."""
        put_claims(self.claim_check_store, connection, rows)
        self.capture.write(connection, rows)

    def notify_with_commit(self, brokers: Mapping[str, float]) -> str | None:
        """Before a commit that wrote rows for ``brokers``: what its COMMIT carries to wake
        other processes (the NOTIFY), or None (the wake-up policy:
        :func:`fastapi_outbox.relay.wakeups.notify_with_commit`)."""
        return self.relays.notify_with_commit(brokers)

    def committed(self, brokers: Mapping[str, float], *, notified: bool = False) -> bool:
        """Wake the dispatchers after a commit that wrote rows for ``brokers`` (the wake-up
        policy: :func:`fastapi_outbox.relay.wakeups.wake_after_commit`); True when other
        processes must still be told by :meth:`notify_after_commit`. ``notified``: the
        COMMIT carried the NOTIFY."""
        return self.relays.committed(brokers, notified=notified)

    async def notify_after_commit(self) -> None:
        """One NOTIFY after the commit, outside the business transaction, bounded and only
        logged when it fails (:func:`fastapi_outbox.relay.wakeups.notify_once`). Sent from
        the session's commit, whoever commits
        (:meth:`fastapi_outbox.write.session_events.SessionState.after_commit`)."""
        await self.relays.notify_after_commit()

    async def cancel(self, message_id: uuid.UUID) -> None:
        """Cancel a pending message (a delayed one, typically) before a dispatcher claims it.

        Raises :class:`~fastapi_outbox.exceptions.MessageNotFound` for an unknown id and
        :class:`~fastapi_outbox.exceptions.TooLate` when it was claimed or published first
        (the cancel is fenced against a concurrent claim)."""
        from fastapi_outbox.ops import operations

        await operations.cancel_one(self, message_id)

    # -- consumers ----------------------------------------------------------------------------

    def subscriber(
        self,
        stream: str,
        *,
        group: str,
        broker: str | None = None,
        concurrency: int | None = None,
        ordered: bool = False,
        max_attempts: int | None = None,
        batch_size: int | None = None,
        claim_idle_seconds: float | None = None,
        retry_base_delay_seconds: float | None = None,
        retry_max_delay_seconds: float | None = None,
        dead_letter: str | None = None,
        start: str = "new",
        batch: bool = True,
    ) -> Any:
        """``@outbox.subscriber("orders", group="billing")`` on ``async def handler(event:
        OrderPlaced, uow: UnitOfWork)``: consume ``stream`` as consumer ``group`` with the
        handler's effects applied once (:mod:`fastapi_outbox.consume.subscriber`). Started and
        stopped with the dispatchers (``lifespan``, ``dispatcher()``, ``fastapi-outbox
        dispatch``). Options left None come from the ``consumer_*`` settings;
        ``dead_letter`` is a template (default ``{stream}.{group}.dlq``); ``batch``: handle
        each fetched batch in one transaction (falls back to one transaction per message
        when anything in it fails; not with ``ordered``)."""
        return entry.subscribe(
            self,
            stream,
            group,
            broker=broker,
            concurrency=concurrency,
            ordered=ordered,
            max_attempts=max_attempts,
            batch_size=batch_size,
            claim_idle_seconds=claim_idle_seconds,
            retry_base_delay_seconds=retry_base_delay_seconds,
            retry_max_delay_seconds=retry_max_delay_seconds,
            dead_letter=dead_letter,
            start=start,
            batch=batch,
        )

    async def consumers_status(self) -> list[Any]:
        """Every subscriber's consumer group: lag, pending, dead letters, last handled
        (:func:`fastapi_outbox.ops.operations.consumers`; the dashboard's consumers table)."""
        from fastapi_outbox.ops import operations

        return await operations.consumers(self)

    # -- schema -------------------------------------------------------------------------------

    async def create_tables(self, *, groups: bool = True) -> None:
        """Create the outbox table, the consumers' inbox table and their indexes (never the
        user's tables); partitioned: also the DEFAULT partition and the partitions of the
        coming days; capture="wal": the replication slot and its publication. ``groups``:
        also the broker-side groups of the subscribers declared so far
        (:meth:`declare_groups`), so messages published before the first deploy of a
        subscriber wait for it whatever its ``start`` (a broker that does not answer is
        logged, not raised: ``db create`` and :meth:`declare_groups` raise)."""
        await self._storage.create()
        if groups and self.subscribers:
            # A broker that does not answer does not fail the tables (an app creating them
            # at start must still start): this process's dispatchers declare the groups
            # before they publish anyway. ``db create`` declares them strictly.
            await declare_or_warn(
                self.declare_groups, "consumer groups not created: broker unavailable"
            )

    async def declare_groups(self, broker: str | None = None) -> None:
        """Create the broker-side group of every subscriber (of ``broker``, or all) — Redis
        consumer group, JetStream durable and dead-letter stream — or bring an existing
        one to the declared settings (idempotent). BrokerUnavailable when its broker does
        not answer; ConfigurationError naming the subscriber for anything else."""
        await declare_groups(self.subscribers, broker)

    async def drop_tables(self) -> None:
        await self._storage.drop()

    def side_tables(self) -> list[SideTable]:
        """The tables :meth:`create_tables` makes beside the outbox table (inbox, partition
        leases, archive, claim-check payloads), each saying whether these settings and the
        subscribers declared so far use it: what ``fastapi-outbox doctor`` checks and
        ``db upgrade`` creates."""
        return self._storage.side_tables(
            self.settings,
            consumers=bool(self.subscribers),
            ordered=any(s.ordered for s in self.subscribers),
        )

    # -- running -------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def dispatcher(self) -> AsyncIterator[Outbox]:
        """Run the processors (and wake-ups, subscribers, retention) while the block runs,
        under one supervisor (:mod:`fastapi_outbox.relay.supervisor`)."""
        if self.started:
            raise exceptions.ConfigurationError("this Outbox's dispatchers are already running")
        if not self.brokers:
            raise exceptions.ConfigurationError(NO_BROKER)
        if self.wal_slot is not None:
            await self.wal_slot.check_server(slot=True)
        consumed = {s.broker_name for s in self.subscribers}

        def brokers() -> Awaitable[dict[str, Broker]]:
            return gate_brokers(self.all_brokers, consumed & set(self.brokers), self.declare_groups)

        try:
            async with self.relays.running(brokers, [*self.subscribers, self.cleaner]):
                yield self
        finally:
            with anyio.CancelScope(shield=True):
                await close_brokers(self.all_brokers, self.settings.shutdown_timeout_seconds)

    # The relays' state, read by health, metrics and the operations.
    @property
    def started(self) -> bool:
        return self.relays.started

    @property
    def processors(self) -> dict[str, TableRelay]:
        return self.relays.processors

    @property
    def wal_relay(self) -> WalRelay | None:
        return self.relays.wal_relay

    @property
    def notifier(self) -> Notifier | None:
        return self.relays.notifier

    @property
    def listener(self) -> Listener | None:
        return self.relays.listener

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Any) -> AsyncIterator[None]:
        """FastAPI lifespan: ``FastAPI(lifespan=outbox.lifespan)``."""
        app.state.fastapi_outbox = self
        if not self.settings.run_relays:
            if self.wal_slot is not None:
                await self.wal_slot.check_server(slot=True)
            async with self.notifying():
                yield
            return
        async with self.dispatcher():
            yield

    @contextlib.asynccontextmanager
    async def notifying(self) -> AsyncIterator[Outbox]:
        """Run only the coalesced NOTIFY sender (API-only processes: ``run_relays=False``),
        so commits wake the dispatcher processes without one extra round trip per request."""
        async with self.relays.notifying():
            yield self

    async def aclose(self) -> None:
        """Close brokers and the engine (when the Outbox created it)."""
        await close_brokers(self.all_brokers, self.settings.shutdown_timeout_seconds)
        await self.database_probe.aclose()
        if self._owns_engine:
            await self.engine.dispose()

    async def __aenter__(self) -> Outbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- HTTP surface -----------------------------------------------------------------------------

    @property
    def dependency(self) -> Any:
        """A FastAPI dependency giving a unit of work of *this* outbox (the module-level
        ``unit_of_work`` serves the outbox the app was started with):
        ``uow: UnitOfWork = Depends(billing_outbox.dependency)``."""
        if self._dependency is None:
            from fastapi_outbox.write.unit_of_work import dependency_for

            self._dependency = dependency_for(self)
        return self._dependency

    @property
    def health_router(self) -> Any:
        """``GET /outbox/health``."""
        return self._routers.health

    @property
    def dashboard_router(self) -> Any:
        """The operator dashboard at ``/outbox/dashboard`` under wherever it is included or
        mounted (:mod:`fastapi_outbox.ops.dashboard`),
        guarded by ``dashboard_dependencies``. Refused without a guard, so no deployment
        exposes replay and abandon by accident: pass ``dashboard_dependencies=[]`` to serve
        it unguarded on purpose (a trusted network)."""
        return self._routers.dashboard(self.dashboard_dependencies)

    @property
    def router(self) -> Any:
        """The health router carrying the outbox lifespan: one ``include_router`` line."""
        return self._routers.combined

    # --- asyncapi ---

    def asyncapi(self, **options: Any) -> dict[str, Any]:
        """The AsyncAPI 3.0 document of this outbox's streams, events and subscribers
        (:func:`fastapi_outbox.ops.asyncapi.build_asyncapi`; ``title=``, ``version=``,
        ``description=``, ``events=``)."""
        from fastapi_outbox.ops.asyncapi import build_asyncapi

        return build_asyncapi(self, **options)

    @property
    def asyncapi_router(self) -> Any:
        """``GET /outbox/asyncapi.json``, guarded by ``dashboard_dependencies`` like the
        dashboard (refused without a guard; ``[]`` serves it unguarded on purpose)."""
        from fastapi_outbox.ops.asyncapi import build_asyncapi_router

        return build_asyncapi_router(self, self.dashboard_dependencies)

    # --- context for consume/ ---
    # What a subscriber sees of its outbox is :class:`fastapi_outbox.consume.context.ConsumeContext`
    # (engine, session_factory, settings, inbox, instance, brokers, default_broker,
    # subscribers, notify_after_commit: attributes above); this is its one method of its own.

    def make_unit_of_work(
        self,
        cls: type[UnitOfWorkT],
        session: AsyncSession,
        *,
        correlation_id: str | None,
        causation_id: str | None,
        traceparent: str | None,
    ) -> UnitOfWorkT:
        """A unit of work of class ``cls`` on a subscriber's handler ``session``, publishing
        through this outbox."""
        return cls(
            self,
            session,
            correlation_id=correlation_id,
            causation_id=causation_id,
            traceparent=traceparent,
        )

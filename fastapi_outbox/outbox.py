"""``Outbox``: the composition root. It wires the engine and the storage
(`fastapi_outbox.storage.setup`), the brokers (`fastapi_outbox.brokers.setup`),
the write side (`fastapi_outbox.write.producer.Producer`), the relays
(`fastapi_outbox.relay.relays.Relays`), the subscribers
(`fastapi_outbox.consume.entry`), the process's lifecycle
(`fastapi_outbox.lifecycle.supervisor.Lifecycle`: supervision, consumer groups,
retention), the lifespan and the routers (`fastapi_outbox.ops.routers`) — the only
module that knows every part; the logic lives in those parts, each handed the concrete
parts below it that it uses. The checks of its configuration are
`fastapi_outbox.config_checks`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, TypeVar

import anyio
from fastapi import APIRouter
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from fastapi_outbox import config_checks, exceptions
from fastapi_outbox.brokers.base import Broker
from fastapi_outbox.brokers.setup import DEFAULT_BROKER as DEFAULT_BROKER
from fastapi_outbox.brokers.setup import NO_BROKER as NO_BROKER
from fastapi_outbox.brokers.setup import BrokerSetup, setup_brokers
from fastapi_outbox.consume import entry
from fastapi_outbox.consume.context import ConsumeContext, TenantConsumeContext, current_tenant
from fastapi_outbox.consume.handlers import Handler
from fastapi_outbox.consume.subscriber import ConsumerStatus, Subscriber
from fastapi_outbox.exceptions import UnknownTenant
from fastapi_outbox.instrumentation import Instrumentation
from fastapi_outbox.lifecycle.retention import Cleaner
from fastapi_outbox.lifecycle.supervisor import Lifecycle, close_brokers
from fastapi_outbox.lifecycle.tenants import TenantCleaner, TenantRelays, Tenants, TenantSource
from fastapi_outbox.ops.routers import Routers
from fastapi_outbox.payloads import build_payloads
from fastapi_outbox.redaction import redact_url
from fastapi_outbox.relay.relays import Relays
from fastapi_outbox.relay.table import instance_id
from fastapi_outbox.relay.tenants import TenantRelay
from fastapi_outbox.relay.wakeups import channel_name
from fastapi_outbox.settings import OutboxSettings
from fastapi_outbox.storage.claim_check import known_in
from fastapi_outbox.storage.doctor import SideTable
from fastapi_outbox.storage.probe import DatabaseProbe
from fastapi_outbox.storage.setup import open_engine, setup_storage
from fastapi_outbox.storage.tenant_schema import create_schema, is_schema, tenant_engine
from fastapi_outbox.write.capture import capture_for
from fastapi_outbox.write.producer import Producer
from fastapi_outbox.write.unit_of_work import (
    Dependency,
    UnitOfWork,
    dependency_for,
    register,
    serve_app,
    serve_tenants,
    tenant_dependency_bound,
    tenant_dependency_for,
    transaction,
)

logger = logging.getLogger("fastapi_outbox")


#: A handler ``@outbox.subscriber(...)`` decorates, given back as it came.
HandlerT = TypeVar("HandlerT", bound=Handler)


class Outbox:
    """A transactional outbox on one database, feeding one or more brokers.

    ``Outbox(url_or_engine, brokers={"default": RedisStreamsBroker(...)}, settings=...)``;
    then ``FastAPI(lifespan=outbox.lifespan)`` and ``app.include_router(outbox.health_router)``
    (or ``app.include_router(outbox.router)``, which brings both).
    """

    def __init__(
        self,
        database: str | AsyncEngine | None = None,
        *,
        brokers: Mapping[str, Broker] | None = None,
        external_brokers: Mapping[str, Broker] | None = None,
        settings: OutboxSettings | None = None,
        session_factory: async_sessionmaker[AsyncSession] | None = None,
        instrumentation: Instrumentation | None = None,
        engine_options: Mapping[str, Any] | None = None,
        dashboard_dependencies: Sequence[Any] | None = None,
        tenants: TenantSource | None = None,
        tenant_dependency: Callable[..., Any] | None = None,
    ) -> None:
        """``tenants``: a multi-tenant outbox (docs/how-to/multi-tenancy.md): tenant id →
        database URL or schema of ``database``, or a callable (sync or async) returning
        that mapping, read again every ``tenant_refresh_seconds``. ``tenant_dependency``:
        the FastAPI dependency giving a request's tenant id (a header, a path parameter,
        a token's claim)."""
        settings = settings if settings is not None else OutboxSettings.from_env()
        if database is None:
            if tenants is None:
                raise exceptions.ConfigurationError(
                    "Outbox() needs a database URL or engine (or tenants=...)"
                )
            database = "sqlite+aiosqlite://"  # the tenants' databases hold everything
        engine, owns = open_engine(database, engine_options)
        self._compose(
            engine,
            owns,
            setup_brokers(brokers, external_brokers, settings),
            settings,
            session_factory,
            instrumentation or Instrumentation(),
        )
        self.dashboard_dependencies = (
            None if dashboard_dependencies is None else list(dashboard_dependencies)
        )
        #: A multi-tenant outbox's tenants (``tenants=``), else None.
        self.tenants: Tenants | None = None
        self._tenant_dependency = tenant_dependency
        if tenants is None:
            register(self._producer)
            return
        self._serve_tenants(tenants, dict(engine_options or {}), database)

    def _compose(
        self,
        engine: AsyncEngine,
        owns: bool,
        broker_setup: BrokerSetup,
        settings: OutboxSettings,
        session_factory: async_sessionmaker[AsyncSession] | None,
        instrumentation: Instrumentation,
        tenant: str | None = None,
    ) -> None:
        self.settings = settings
        self.engine, self._owns_engine = engine, owns
        self._brokers = broker_setup
        config_checks.check_partitioning(self.settings.partitioning, self.engine.dialect.name)
        self._storage = storage = setup_storage(self.engine, self.settings)
        self.table, self.store = storage.table, storage.store
        #: ``capture="wal"``: the replication slot (its relay runs with the table relays).
        self.wal_slot = storage.wal_slot
        self.inbox, self.partitions = storage.inbox, storage.partitions
        #: ``archive=True``: the archive table retention moves finished rows to.
        self.archive = storage.archive
        #: ``claim_check_bytes`` set: the store of claim-checked payloads (else None).
        self.claim_check_store = storage.payloads
        #: The payload stages (encryption, claim-check): publish seals, subscribers restore.
        self.payloads = build_payloads(self.settings, self.claim_check_store)
        self.instrumentation = instrumentation
        self.instance = instance_id()
        self.channel = channel_name(self.settings.table_name)
        #: The relays of this outbox in this process, and the wake-ups a commit sends them.
        self.relays = Relays(
            store=self.store,
            settings=self.settings,
            instance=self.instance,
            channel=self.channel,
            instrumentation=self.instrumentation,
            wal_slot=self.wal_slot,
        )
        self._producer = Producer(
            engine=self.engine,
            settings=self.settings,
            payloads=self.payloads,
            session_factory=session_factory
            or async_sessionmaker(self.engine, expire_on_commit=False),
            brokers=self._brokers,
            capture=capture_for(self.store, self.wal_slot),
            claim_check_store=self.claim_check_store,
            relays=self.relays,
            tenant=tenant,
        )
        #: The tenant this outbox is the part of a multi-tenant outbox of (else None).
        self.tenant = tenant
        self.subscribers: list[Subscriber] = []
        self._consume = ConsumeContext(
            producer=self._producer,
            inbox=self.inbox,
            instance=self.instance,
            brokers=self._brokers,
            subscribers=self.subscribers,
        )
        self.cleaner = Cleaner(
            self.store,
            self.settings,
            self.partitions,
            inbox=self.inbox,
            archive=self.archive,
            payloads=self.claim_check_store,
            known=None if self.claim_check_store is None else known_in(self.engine, self.table),
            subscribers=self.subscribers,
        )
        #: Runs the relays, subscribers and retention (``relaying()``); the consumer groups.
        self.lifecycle = Lifecycle(
            relays=self.relays,
            subscribers=self.subscribers,
            cleaner=self.cleaner,
            settings=self.settings,
            wal_slot=self.wal_slot,
        )
        #: Health's own connection (never waits behind requests) and its look at the pool.
        self.database_probe = DatabaseProbe(self.engine, self.table, self.store.messages)
        self._routers = Routers(self, self.lifespan)
        self._dependency: Dependency | None = None
        #: A tenant's part whose tables are in a schema of its own: that schema.
        self._schema: str | None = None

    # -- tenants ----------------------------------------------------------------------------

    def _serve_tenants(
        self, source: TenantSource, engine_options: dict[str, Any], database: str | AsyncEngine
    ) -> None:
        """Make this outbox a multi-tenant one: its tenants, their relay, its subscribers
        handling each message in its tenant's database."""
        config_checks.check_tenants(self.settings)
        base = make_url(database) if isinstance(database, str) else database.url

        def build(name: str, target: str) -> Outbox:
            child = Outbox.__new__(Outbox)
            child._compose(
                tenant_engine(target, base, engine_options),
                True,
                self._brokers,
                self.settings,
                None,
                self.instrumentation,
                tenant=name,
            )
            child.dashboard_dependencies = self.dashboard_dependencies
            # The subscribers are the multi-tenant outbox's: a tenant's retention prunes
            # their tables, its doctor expects their inbox.
            child.subscribers = child.cleaner.subscribers = self.subscribers
            child.lifecycle.subscribers = self.subscribers
            child.tenants = None
            child._tenant_dependency = None
            child._schema = target if is_schema(target) else None
            return child

        relay = TenantRelay(
            settings=self.settings, instance=self.instance, instrumentation=self.instrumentation
        )
        self.tenants = tenants = Tenants(
            source, build=build, relay=relay, refresh_seconds=self.settings.tenant_refresh_seconds
        )
        self.lifecycle.relays = TenantRelays(
            tenants,
            store=self.store,
            settings=self.settings,
            instance=self.instance,
            channel=self.channel,
            instrumentation=self.instrumentation,
            wal_slot=None,
        )

        self.cleaner = self.lifecycle.cleaner = TenantCleaner(tenants, self.cleaner)

        def resolve(name: str | None) -> ConsumeContext:
            outbox: Outbox = tenants.get(name)
            return outbox._consume

        self._consume = TenantConsumeContext(
            resolve=resolve,
            producer=self._producer,
            inbox=self.inbox,
            instance=self.instance,
            brokers=self._brokers,
            subscribers=self.subscribers,
        )

    def tenant_outbox(self, tenant: str | None) -> Outbox:
        """The outbox of one tenant of this multi-tenant outbox: its tables, its unit of
        work, its operations (``await outbox.tenant_outbox("acme").create_tables()``);
        `UnknownTenant` for a tenant it does not serve.
        Read the tenants first when they come from an async callable
        (`load_tenants`)."""
        if self.tenants is None:
            raise exceptions.ConfigurationError("this outbox serves no tenants")
        outbox: Outbox = self.tenants.get(tenant)
        return outbox

    async def load_tenants(self) -> list[str]:
        """Read the tenants (an async callable: the first time; a callable: again) and
        return their ids."""
        if self.tenants is None:
            return []
        if self.tenants.loaded:
            await self.tenants.refresh()
        else:
            await self.tenants.ensure_loaded()
        return self.tenants.names

    def __repr__(self) -> str:
        return f"Outbox({redact_url(str(self.engine.url))!r}, brokers={list(self.all_brokers)})"

    @property
    def brokers(self) -> dict[str, Broker]:
        """The brokers this outbox relays to, by name."""
        return self._brokers.brokers

    @brokers.setter
    def brokers(self, brokers: dict[str, Broker]) -> None:
        self._brokers.brokers = brokers

    @property
    def external_brokers(self) -> dict[str, Broker]:
        """The external brokers (``external=True`` events get a row for each)."""
        return self._brokers.external_brokers

    @external_brokers.setter
    def external_brokers(self, brokers: dict[str, Broker]) -> None:
        self._brokers.external_brokers = brokers

    @property
    def default_broker(self) -> str:
        """The broker of an event or a subscriber that names none."""
        return self._brokers.default_broker

    @property
    def all_brokers(self) -> dict[str, Broker]:
        return {**self.brokers, **self.external_brokers}

    @property
    def session_factory(self) -> async_sessionmaker[AsyncSession]:
        """The sessions of the units of work that open their own."""
        return self._producer.session_factory

    @session_factory.setter
    def session_factory(self, factory: async_sessionmaker[AsyncSession]) -> None:
        self._producer.session_factory = factory

    # -- unit of work -----------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def unit_of_work(
        self,
        *,
        correlation_id: str | None = None,
        causation_id: str | None = None,
        traceparent: str | None = None,
        session: AsyncSession | None = None,
        tenant: str | None = None,
    ) -> AsyncIterator[UnitOfWork]:
        """``async with outbox.unit_of_work() as uow:`` — commits on exit, rolls back on error.

        ``tenant``: a multi-tenant outbox's unit of work works in that tenant's database
        (inside a subscriber's handler it defaults to the message's tenant); an unknown
        tenant raises `UnknownTenant` before anything
        is written.

        The block may commit the session itself: events go with the transaction that commits
        them (`fastapi_outbox.write.session_events`).

        ``session=``: join the caller's session instead. The block runs in a savepoint: when
        it raises, its business writes and its events are undone together and the caller's
        transaction stays usable; when it succeeds, its rows are written in the caller's
        transaction, and the caller's commit or rollback decides for both — this never
        commits or rolls back the caller's transaction.

        Inside a subscriber's handler, without ``session=``, it joins the handler's session
        that way (a savepoint of the handler's transaction, the handler's correlation and
        causation ids unless given): its work commits with the message's inbox row or not
        at all, never on its own."""
        producer = self._producer
        if self.tenants is not None:
            await self.tenants.ensure_loaded()
            producer = self.tenants.get(tenant or current_tenant())._producer
        elif tenant is not None:
            raise UnknownTenant(f"unknown tenant {tenant!r}: this outbox serves no tenants")
        async with transaction(
            producer,
            session,
            correlation_id=correlation_id,
            causation_id=causation_id,
            traceparent=traceparent,
        ) as uow:
            yield uow

    async def cancel(self, message_id: uuid.UUID) -> None:
        """Cancel a pending message (a delayed one, typically) before a relay claims it.

        Raises [`MessageNotFound`][fastapi_outbox.exceptions.MessageNotFound] for an unknown id and
        [`TooLate`][fastapi_outbox.exceptions.TooLate] when it was claimed or published first
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
    ) -> Callable[[HandlerT], HandlerT]:
        """``@outbox.subscriber("orders", group="billing")`` on ``async def handler(event:
        OrderPlaced, uow: UnitOfWork)``: consume ``stream`` as consumer ``group`` with the
        handler's effects applied once (`fastapi_outbox.consume.subscriber`). Started and
        stopped with the relays (``lifespan``, ``relaying()``, ``fastapi-outbox
        dispatch``). Options left None come from the ``consumer_*`` settings;
        ``dead_letter`` is a template (default ``{stream}.{group}.dlq``); ``batch``: handle
        each fetched batch in one transaction (falls back to one transaction per message
        when anything in it fails; not with ``ordered``)."""
        return entry.subscribe(
            self._consume,
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

    async def consumers_status(self) -> list[ConsumerStatus]:
        """Every subscriber's consumer group: lag, pending, dead letters, last handled
        (`fastapi_outbox.ops.operations.consumers`; the dashboard's consumers table)."""
        from fastapi_outbox.ops import operations

        return await operations.consumers(self)

    # -- schema -------------------------------------------------------------------------------

    async def create_tables(self, *, groups: bool = True) -> None:
        """Create the outbox table, the consumers' inbox table and their indexes (never the
        user's tables); partitioned: also the DEFAULT partition and the partitions of the
        coming days; capture="wal": the replication slot and its publication. ``groups``:
        also the broker-side groups of the subscribers declared so far
        (``outbox.lifecycle.declare_groups()``), so messages published before the first
        deploy of a subscriber wait for it whatever its ``start`` (a broker that does not
        answer is logged, not raised: ``db create`` and ``declare_groups()`` raise)."""
        if self.tenants is not None:
            await self.tenants.ensure_loaded()
            for name in self.tenants.names:
                await self.tenant_outbox(name).create_tables(groups=False)
                await self.tenants.rest(name)
        else:
            if self.tenant is not None and self._schema is not None:
                await create_schema(self.engine, self._schema)
            await self._storage.create()
        if groups:
            await self.lifecycle.declare_groups_or_warn()

    async def drop_tables(self) -> None:
        if self.tenants is not None:
            await self.tenants.ensure_loaded()
            for name in self.tenants.names:
                await self.tenant_outbox(name).drop_tables()
                await self.tenants.rest(name)
            return
        await self._storage.drop()

    # -- running -------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def relaying(self) -> AsyncIterator[Outbox]:
        """Run the relays (and wake-ups, subscribers, retention) while the block runs,
        under one supervisor (`fastapi_outbox.lifecycle.supervisor.Lifecycle`)."""
        async with self.lifecycle.running(self.brokers, self.external_brokers):
            yield self

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Any) -> AsyncIterator[None]:
        """FastAPI lifespan: ``FastAPI(lifespan=outbox.lifespan)``."""
        serve_app(app.state, self._producer)
        if self.tenants is not None:
            await self.tenants.ensure_loaded()
            if self._tenant_dependency is not None:
                serve_tenants(app, self._tenant_scoped())
            if not self.settings.run_relays:
                async with self._refreshing():
                    yield
                return
        if not self.settings.run_relays:
            if self.wal_slot is not None:
                await self.wal_slot.check_server(slot=True)
            async with self.relays.notifying():
                yield
            return
        async with self.relaying():
            yield

    @contextlib.asynccontextmanager
    async def _refreshing(self) -> AsyncIterator[None]:
        """An API-only process of a multi-tenant outbox: the tenants are read again every
        ``tenant_refresh_seconds`` while the block runs (a task of its own, as
        `notifying`)."""
        assert self.tenants is not None
        task = asyncio.get_running_loop().create_task(self.tenants.run(), name="outbox-tenants")
        try:
            yield
        finally:
            task.cancel()
            with anyio.CancelScope(shield=True), contextlib.suppress(asyncio.CancelledError):
                await task

    def _tenant_scoped(self) -> Any:
        if self._tenant_dependency is None:
            raise exceptions.ConfigurationError(
                "a multi-tenant outbox's request dependency needs Outbox(tenant_dependency=...):"
                " the FastAPI dependency that gives the request's tenant id"
            )
        tenants = self.tenants
        assert tenants is not None

        def producer_of(tenant: str) -> Producer:
            outbox: Outbox = tenants.get(tenant)
            return outbox._producer

        return tenant_dependency_for(producer_of, self._tenant_dependency)

    async def aclose(self) -> None:
        """Close brokers and the engine (when the Outbox created it)."""
        if self.tenant is not None:  # a tenant's part: its engine only
            await self.database_probe.aclose()
            await self.engine.dispose()
            return
        await close_brokers(self.all_brokers, self.settings.shutdown_timeout_seconds)
        if self.tenants is not None:
            await self.tenants.aclose()
        await self.database_probe.aclose()
        if self._owns_engine:
            await self.engine.dispose()

    async def __aenter__(self) -> Outbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- HTTP surface -----------------------------------------------------------------------------

    @property
    def dependency(self) -> Dependency:
        """A FastAPI dependency giving a unit of work of *this* outbox (the module-level
        ``unit_of_work`` serves the outbox the app was started with):
        ``uow: UnitOfWork = Depends(billing_outbox.dependency)``."""
        if self._dependency is None:
            if self.tenants is not None:
                self._dependency = tenant_dependency_bound(self._tenant_scoped())
            else:
                self._dependency = dependency_for(self._producer)
        return self._dependency

    @property
    def health_router(self) -> APIRouter:
        """``GET /outbox/health``."""
        return self._routers.health

    @property
    def dashboard_router(self) -> APIRouter:
        """The operator dashboard at ``/outbox/dashboard`` under wherever it is included or
        mounted (`fastapi_outbox.ops.dashboard`),
        guarded by ``dashboard_dependencies``. Refused without a guard, so no deployment
        exposes replay and abandon by accident: pass ``dashboard_dependencies=[]`` to serve
        it unguarded on purpose (a trusted network)."""
        return self._routers.dashboard(self.dashboard_dependencies)

    @property
    def router(self) -> APIRouter:
        """The health router carrying the outbox lifespan: one ``include_router`` line."""
        return self._routers.combined

    def asyncapi(self, **options: Any) -> dict[str, Any]:
        """The AsyncAPI 3.1 document of this outbox's streams, events and subscribers
        (`fastapi_outbox.ops.asyncapi.build_asyncapi`; ``title=``, ``version=``,
        ``description=``, ``events=``)."""
        from fastapi_outbox.ops.asyncapi import build_asyncapi

        return build_asyncapi(self, **options)

    @property
    def asyncapi_router(self) -> APIRouter:
        """``GET /outbox/asyncapi.json``, guarded by ``dashboard_dependencies`` like the
        dashboard (refused without a guard; ``[]`` serves it unguarded on purpose)."""
        from fastapi_outbox.ops.asyncapi import build_asyncapi_router

        return build_asyncapi_router(self, self.dashboard_dependencies)


def side_tables(outbox: Outbox) -> list[SideTable]:
    """The tables ``create_tables`` makes beside the outbox table (inbox, partition leases,
    archive, claim-check payloads), each saying whether ``outbox``'s settings and the
    subscribers declared so far use it: what ``fastapi-outbox doctor`` checks and
    ``db upgrade`` creates."""
    return outbox._storage.side_tables(
        outbox.settings,
        consumers=bool(outbox.subscribers),
        ordered=any(s.ordered for s in outbox.subscribers),
    )

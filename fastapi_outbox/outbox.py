"""``Outbox``: the composition root. It wires the engine, the store, the brokers, the
processors, the wake-ups, retention, the lifespan and the routers — the only module that
knows every part."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import anyio
from sqlalchemy import MetaData, event
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.pool import StaticPool

from fastapi_outbox import exceptions
from fastapi_outbox.brokers.base import Broker
from fastapi_outbox.consume.subscriber import Handler, Subscriber, handler_transaction
from fastapi_outbox.instrumentation import Instrumentation
from fastapi_outbox.redaction import redact, redact_url, remember
from fastapi_outbox.relay.retention import Cleaner
from fastapi_outbox.relay.table import Processor, instance_id
from fastapi_outbox.relay.wakeups import Listener, Notifier, channel_name
from fastapi_outbox.relay.wal import WalRelay
from fastapi_outbox.settings import OutboxSettings
from fastapi_outbox.storage import partitions, schema
from fastapi_outbox.storage.inbox import Inbox, build_inbox_table
from fastapi_outbox.storage.store import Store
from fastapi_outbox.storage.wal_slot import WalSlot
from fastapi_outbox.write.capture import Capture, TableCapture
from fastapi_outbox.write.unit_of_work import UnitOfWork, current_outbox, register_outbox

logger = logging.getLogger("fastapi_outbox")

_BROKER_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
DEFAULT_BROKER = "default"
NO_BROKER = (
    "no broker to dispatch to: pass brokers={'default': RedisStreamsBroker(...)} to Outbox "
    "(MemoryBroker() for tests and the embedded default), --broker-url to "
    "`fastapi-outbox dispatch`, or set OUTBOX_BROKER_URL (redis://, nats://, memory://); "
    "an API-only process sets run_dispatchers=False"
)
#: Bound on the NOTIFY an API-only process sends after a commit.
NOTIFY_TIMEOUT_SECONDS = 2.0
#: Bound on declaring the consumer groups at start (a broker that does not answer in time
#: gets them declared before the first publish instead).
DECLARE_GROUPS_TIMEOUT_SECONDS = 5.0


class _GroupsFirst:
    """A broker whose ``connect`` declares this process's consumer groups on it once
    (``Outbox.declare_groups``) before it lets anything be published: the processors and
    the WAL relay publish through it, so the first message of a stream never reaches the
    broker before the groups of the subscribers declared here exist. Until they do,
    ``connect`` and ``publish`` raise what the declaration raised (BrokerUnavailable: the
    processor pauses and tries again). Everything else is the broker's own."""

    def __init__(self, broker: Broker, name: str, declare: Any) -> None:
        self._broker = broker
        self._name = name
        self._declare = declare
        self._declared = False
        self._lock = anyio.Lock()

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._broker, attribute)

    def __repr__(self) -> str:
        return repr(self._broker)

    async def connect(self) -> None:
        await self._broker.connect()
        if self._declared:
            return
        async with self._lock:
            if not self._declared:
                await self._declare(self._name)
                self._declared = True
                logger.info(
                    "consumer groups declared",
                    extra={"action": "consumer.groups_declared", "broker": self._name},
                )

    async def publish(self, batch: Sequence[Any]) -> Any:
        if not self._declared:
            await self.connect()
        return await self._broker.publish(batch)

    async def aclose(self) -> None:
        await self._broker.aclose()

    async def ping(self) -> None:
        await self._broker.ping()

    def configure(self, *, dedup_window_seconds: float) -> None:
        self._broker.configure(dedup_window_seconds=dedup_window_seconds)


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
        if isinstance(database, AsyncEngine):
            self.engine = database
            self._owns_engine = False
        elif isinstance(database, str):
            self.engine = _create_engine(database, dict(engine_options or {}))
            self._owns_engine = True
        else:
            raise exceptions.ConfigurationError(
                f"Outbox() takes a database URL or an AsyncEngine, not {type(database).__name__}"
            )
        # Its secrets are masked wherever a driver's text quotes them (see redaction).
        remember(self.engine.url.render_as_string(hide_password=False))
        if self.engine.dialect.name not in ("postgresql", "sqlite"):
            raise exceptions.ConfigurationError(
                f"unsupported database {self.engine.dialect.name!r}: use PostgreSQL or SQLite"
            )
        # No silent sink: without brokers (and without OUTBOX_BROKER_URL) this outbox can
        # write rows for the "default" broker (an API-only process needs no broker
        # connection) but refuses to dispatch. A memory broker only when asked for by name.
        if brokers:
            self.brokers: dict[str, Broker] = dict(brokers)
        elif self.settings.broker_url:
            from fastapi_outbox.brokers import broker_from_url

            self.brokers = {DEFAULT_BROKER: broker_from_url(self.settings.broker_url)}
        else:
            self.brokers = {}
        self.external_brokers: dict[str, Broker] = dict(external_brokers or {})
        for name in (*self.brokers, *self.external_brokers):
            if not isinstance(name, str) or not _BROKER_NAME.match(name):
                raise exceptions.ConfigurationError(
                    f"invalid broker name {name!r}: 1-64 letters, digits, '_', '.', '-'"
                )
        clash = set(self.brokers) & set(self.external_brokers)
        if clash:
            raise exceptions.ConfigurationError(
                f"broker names used as internal and external: {', '.join(sorted(clash))}"
            )
        self.default_broker = (
            next(iter(self.brokers))
            if self.brokers and DEFAULT_BROKER not in self.brokers
            else DEFAULT_BROKER
        )
        for broker_name, broker in self.all_brokers.items():
            if isinstance(getattr(broker, "url", None), str):
                remember(broker.url)  # type: ignore[attr-defined]
            broker.configure(dedup_window_seconds=self.settings.dedup_window_seconds)
            _check_dedup_window(broker_name, broker, self.settings)
        name = self.settings.table_name
        # The shared ``schema.metadata`` (Alembic's) holds the default layout; an ordered
        # outbox builds its table, with the ordered index, on a MetaData of its own.
        partitioning = self.settings.partitioning
        if partitioning is not None and self.engine.dialect.name != "postgresql":
            raise exceptions.ConfigurationError(
                f"partitioning={partitioning!r} (OUTBOX_PARTITIONING) needs PostgreSQL; "
                f"{self.engine.dialect.name} keeps one plain table: leave partitioning unset"
            )
        shared = name == schema.outbox_table.name and not self.settings.ordered and not partitioning
        self.table = schema.build_table(
            name,
            schema.metadata if shared else MetaData(),
            ordered=self.settings.ordered,
            partitioning=partitioning,
        )
        self.store = Store(self.engine, self.table)
        self.store.set_timeouts(
            self.settings.statement_timeout_seconds, self.settings.lock_timeout_seconds
        )
        self.capture: Capture = TableCapture(self.store)
        #: ``capture="wal"``: the replication slot, and its relay while dispatchers run.
        self.wal_slot: WalSlot | None = None
        self.wal_relay: WalRelay | None = None
        if self.settings.capture == "wal":
            self._setup_wal()
        self.session_factory = session_factory or async_sessionmaker(
            self.engine, expire_on_commit=False
        )
        self.instrumentation = instrumentation or Instrumentation()
        self.instance = instance_id()
        self.channel = channel_name(name)
        self.processors: dict[str, Processor] = {}
        self.notifier: Notifier | None = None
        self.listener: Listener | None = None
        # The consumers' inbox, on the outbox table's MetaData (the shared one by default).
        self.inbox = Inbox(
            self.engine, build_inbox_table(self.settings.inbox_table_name, self.table.metadata)
        )
        self.subscribers: list[Subscriber] = []
        #: Partition upkeep of a partitioned table (``settings.partitioning``), else None.
        self.partitions: partitions.Maintainer | None = None
        if "partitioning" in self.table.info:
            self.partitions = partitions.Maintainer(
                self.engine, self.table, self.table.info["partitioning"]
            )
        self.cleaner = Cleaner(self.store, self.settings, self.partitions, inbox=self.inbox)
        self.started = False
        self._tracer: Any = None
        self._health_router: Any = None
        self._dependency: Any = None
        self._router: Any = None
        self._dashboard_router: Any = None
        self.dashboard_dependencies = (
            None if dashboard_dependencies is None else list(dashboard_dependencies)
        )
        register_outbox(self)

    def _setup_wal(self) -> None:
        from fastapi_outbox.write.wal_capture import WalCapture

        if not self.store.is_postgres or self.engine.dialect.driver != "asyncpg":
            raise exceptions.ConfigurationError(
                f"capture='wal' (OUTBOX_CAPTURE) needs PostgreSQL through asyncpg "
                f"(postgresql+asyncpg://…), not {self.engine.dialect.name}+"
                f"{self.engine.dialect.driver}: use capture='table'"
            )
        self.wal_slot = WalSlot(self.engine, self.settings.slot_name, self.settings.table_name)
        self.capture = WalCapture(self.store, self.wal_slot)

    def __repr__(self) -> str:
        return f"Outbox({redact_url(str(self.engine.url))!r}, brokers={list(self.all_brokers)})"

    # -- lookups ---------------------------------------------------------------------------

    @classmethod
    def current(cls) -> Outbox:
        """The only Outbox of this process (used by the ``unit_of_work`` dependency when the
        app was not started with ``outbox.lifespan``)."""
        found: Outbox = current_outbox()
        return found

    @property
    def all_brokers(self) -> dict[str, Broker]:
        return {**self.brokers, **self.external_brokers}

    def resolve_broker(self, name: str | None) -> str:
        if name is None:
            return self.default_broker
        if name not in self.brokers and not (name == DEFAULT_BROKER and not self.brokers):
            hint = (
                " (it is external: mark the event external=True)"
                if name in self.external_brokers
                else ""
            )
            raise exceptions.UnknownBroker(
                f"no broker named {name!r}{hint}; configured: {', '.join(self.brokers)}"
            )
        return name

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
        if session is None:
            joined = handler_transaction(self)
            if joined is not None:
                session, handler_uow = joined
                correlation_id = correlation_id or handler_uow.correlation_id
                causation_id = causation_id or handler_uow.causation_id
                traceparent = traceparent or handler_uow.traceparent
        own = session is None
        sess = self.session_factory() if session is None else session
        uow = UnitOfWork(
            self,
            sess,
            correlation_id=correlation_id,
            causation_id=causation_id,
            traceparent=traceparent,
        )
        uow._open()
        try:
            if own:
                try:
                    yield uow
                    await sess.commit()
                except BaseException:
                    with anyio.CancelScope(shield=True):
                        await sess.rollback()
                    raise
            else:
                async with sess.begin_nested():
                    yield uow
        finally:
            uow._close()
            if own:
                with anyio.CancelScope(shield=True):
                    await sess.close()
        for _ in uow._state.take_notify():  # only for a commit made outside the greenlet
            await self.notify_after_commit()

    def write_rows(self, connection: Connection, rows: list[dict[str, Any]]) -> None:
        """Record outbox messages on a session's connection, through this outbox's capture
        (called by the session's ``before_commit``; see
        :mod:`fastapi_outbox.write.session_events`)."""
        self.capture.write(connection, rows)

    def committed(self, brokers: Mapping[str, float]) -> bool:
        """Wake the dispatchers after a commit that wrote rows for ``brokers`` (each with
        the earliest delay of its rows: 0 for rows due now).

        Rows due now wake an idle worker of this process; delayed rows only tell its
        poller when to look (no claim before they are due). Returns True when other
        processes still have to be told: this process runs no :class:`Notifier` (an
        API-only process, ``run_dispatchers=False``) but the outbox is on PostgreSQL with
        ``notify`` on — the caller then sends the NOTIFY itself."""
        if not brokers:
            return False
        handled_here = True
        relay = self.wal_relay
        for name, delay in brokers.items():
            if relay is not None and delay <= 0:
                # capture="wal": messages due now are in the slot, not in the table.
                if not (relay.leader and not relay.stopping):
                    handled_here = False
                relay.wakeup.set()
                continue
            processor = self.processors.get(name)
            if processor is None or processor.stopping:
                handled_here = False
            elif delay > 0:
                processor.schedule(delay)
                handled_here = False  # other processes may poll later than it is due
            # An idle worker of this process takes the rows at once: no other process
            # needs waking, and the commit costs no NOTIFY.
            elif not processor.wakeup.set():
                handled_here = False
        if handled_here:
            return False
        if self.notifier is not None and self.notifier.running:
            self.notifier.signal()
            return False
        return self.store.is_postgres and self.settings.notify

    async def notify_after_commit(self) -> None:
        """One NOTIFY after the commit, outside the business transaction, for processes
        whose dispatchers LISTEN while this one runs none. No background task: it costs
        the caller one short round-trip, bounded in time and shielded so a cancelled
        request cannot leave it half-sent. A failure is only logged: the data committed,
        and the dispatchers find the rows by polling. Sent from the session's commit
        (:meth:`fastapi_outbox.write.session_events.SessionState.after_commit`), whoever commits."""
        try:
            with anyio.CancelScope(shield=True), anyio.fail_after(NOTIFY_TIMEOUT_SECONDS):
                await self.store.notify(self.channel, self.instance)
        except Exception as exc:
            logger.warning(
                "notify after commit failed; dispatchers fall back to polling",
                extra={"action": "notify.failed", "error": type(exc).__name__},
            )

    _notify_after_commit = notify_after_commit

    async def cancel(self, message_id: uuid.UUID) -> None:
        """Cancel a pending message (a delayed one, typically) before a dispatcher claims it.

        Raises :class:`~fastapi_outbox.exceptions.MessageNotFound` for an unknown id and
        :class:`~fastapi_outbox.exceptions.TooLate` when it was claimed or published first
        (the cancel is fenced against a concurrent claim)."""
        from fastapi_outbox.ops import operations

        outcome = await operations.cancel(self, [message_id])
        if outcome.count:
            return
        problem = outcome.problems[0]
        if problem.startswith("no outbox message"):
            raise exceptions.MessageNotFound(problem)
        raise exceptions.TooLate(problem)

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
        from fastapi_outbox.consume import subscriber as subscribers

        def decorate(handler: Handler) -> Handler:
            options = subscribers.subscriber_options(
                self,
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
            subscribers.register(self, handler, stream, group, options)
            return handler

        return decorate

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
        await self.store.create_table()
        await self.inbox.create_table()
        if self.partitions is not None:
            await self.partitions.ensure_ahead()
        if self.wal_slot is not None:
            await self.wal_slot.create()
        if groups and self.subscribers:
            # A broker that does not answer does not fail the tables (an app creating them
            # at start must still start): this process's dispatchers declare the groups
            # before they publish anyway. ``db create`` declares them strictly.
            try:
                with anyio.fail_after(DECLARE_GROUPS_TIMEOUT_SECONDS):
                    await self.declare_groups()
            except (exceptions.BrokerUnavailable, TimeoutError) as exc:
                logger.warning(
                    "consumer groups not created: broker unavailable",
                    extra={
                        "action": "consumer.groups_pending",
                        "error": f"{type(exc).__name__}: {exc}"[:300],
                    },
                )

    async def declare_groups(self, broker: str | None = None) -> None:
        """Create the broker-side group of every subscriber (of ``broker``, or all) — Redis
        consumer group, JetStream durable and dead-letter stream — or bring an existing
        one to the declared settings (idempotent). BrokerUnavailable when its broker does
        not answer; ConfigurationError naming the subscriber for anything else."""
        for sub in self.subscribers:
            if broker is not None and sub.broker_name != broker:
                continue
            consumer = sub.make_consumer()
            try:
                await consumer.setup()
            except exceptions.BrokerUnavailable:
                raise
            except Exception as exc:
                raise exceptions.ConfigurationError(
                    f"{sub!r}: cannot create or update its consumer group on broker "
                    f"{sub.broker_name!r}: {type(exc).__name__}: {exc}"
                ) from exc
            finally:
                with contextlib.suppress(Exception):
                    await consumer.aclose()

    async def drop_tables(self) -> None:
        await self.store.drop_table()
        await self.inbox.drop_table()

    # -- running -------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def dispatcher(self) -> AsyncIterator[Outbox]:
        """Run the processors (and wake-ups, retention) while the block runs."""
        if self.started:
            raise exceptions.ConfigurationError("this Outbox's dispatchers are already running")
        if not self.brokers:
            raise exceptions.ConfigurationError(NO_BROKER)
        if self.wal_slot is not None:
            await self.wal_slot.check_server(slot=True)
        self.started = True
        settings = self.settings
        try:
            async with anyio.create_task_group() as tg:
                listener = None
                if self.store.is_postgres and settings.notify:
                    self.notifier = Notifier(
                        self.store,
                        self.channel,
                        self.instance,
                        self.settings.notify_interval_seconds,
                    )
                    await tg.start(self.notifier.run)
                    listener = Listener(
                        self.store,
                        self.channel,
                        self.instance,
                        self._wake_all,
                        check_interval=settings.listen_check_interval_seconds,
                        check_timeout=settings.listen_check_timeout_seconds,
                    )
                    self.listener = listener
                brokers = await self._groups_first()
                for name, broker in brokers.items():
                    self.processors[name] = Processor(
                        store=self.store,
                        broker_name=name,
                        broker=broker,
                        settings=settings,
                        instance=self.instance,
                        listening=(lambda: bool(listener and listener.listening)),
                        instrumentation=self.instrumentation,
                    )
                if listener is not None:
                    await tg.start(listener.run)
                for processor in self.processors.values():
                    await tg.start(processor.run)
                if self.wal_slot is not None:
                    self.wal_relay = WalRelay(
                        store=self.store,
                        slot=self.wal_slot,
                        brokers=brokers,
                        settings=settings,
                        instance=self.instance,
                        instrumentation=self.instrumentation,
                        listening=(lambda: bool(listener and listener.listening)),
                    )
                    await tg.start(self.wal_relay.run)
                for sub in self.subscribers:
                    await tg.start(sub.run)
                await tg.start(self.cleaner.run)
                logger.info(
                    "outbox dispatchers started",
                    extra={
                        "action": "outbox.start",
                        "brokers": list(self.processors),
                        "workers": settings.workers,
                        "instance": self.instance,
                    },
                )
                try:
                    yield self
                finally:
                    await self._shutdown(tg)
        finally:
            self.started = False
            self.notifier = None
            self.listener = None
            self.wal_relay = None
            with anyio.CancelScope(shield=True):
                await self._close_brokers()

    async def _groups_first(self) -> dict[str, Broker]:
        """The brokers the processors and the WAL relay publish with: those that this
        process's subscribers consume from are wrapped so that nothing is published to
        them before the subscribers' groups exist (DESIGN §13). The groups are declared
        here, before any dispatcher starts, bounded in time; a broker that does not answer
        gets them declared by the first publish's connect, which waits until they are (a
        refusal of a group's settings refuses the start)."""
        out: dict[str, Broker] = dict(self.all_brokers)
        for name, broker in self.brokers.items():
            if not any(s.broker_name == name for s in self.subscribers):
                continue
            gated = _GroupsFirst(broker, name, self.declare_groups)
            out[name] = gated
            try:
                with anyio.fail_after(DECLARE_GROUPS_TIMEOUT_SECONDS):
                    await gated.connect()
            except (exceptions.BrokerUnavailable, TimeoutError) as exc:
                logger.warning(
                    "consumer groups not declared yet: dispatch to this broker waits for them",
                    extra={
                        "action": "consumer.groups_pending",
                        "broker": name,
                        "error": f"{type(exc).__name__}: {exc}"[:300],
                    },
                )
        return out

    async def _shutdown(self, tg: anyio.abc.TaskGroup) -> None:
        from fastapi_outbox.consume.subscriber import stop_all

        for processor in self.processors.values():
            processor.stop()
        self.cleaner.stop()
        if self.wal_relay is not None:
            self.wal_relay.stop()
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(self.settings.shutdown_timeout_seconds):
                # Subscribers first: events their handlers commit still get published.
                await stop_all(self.subscribers)
                for processor in self.processors.values():
                    if processor.running:
                        await processor.stopped.wait()
                if self.wal_relay is not None and self.wal_relay.running:
                    await self.wal_relay.stopped.wait()
                # Let a running purge batch finish rather than cancel it mid-query.
                if self.cleaner.stopped is not None:
                    await self.cleaner.stopped.wait()
        tg.cancel_scope.cancel()
        logger.info("outbox dispatchers stopped", extra={"action": "outbox.stop"})

    async def _close_brokers(self) -> None:
        """Close every broker at once, each bounded by ``shutdown_timeout_seconds``: brokers
        that hang cost one timeout in all, not one each."""

        async def close(name: str, broker: Broker) -> None:
            try:
                with anyio.move_on_after(self.settings.shutdown_timeout_seconds):
                    await broker.aclose()
            except Exception:
                logger.warning(
                    "broker close failed",
                    extra={"action": "broker.close", "broker": name},
                    exc_info=True,
                )

        async with anyio.create_task_group() as tg:
            for name, broker in self.all_brokers.items():
                tg.start_soon(close, name, broker)

    def _wake_all(self) -> None:
        for processor in self.processors.values():
            processor.wakeup.set()
        if self.wal_relay is not None:
            self.wal_relay.wakeup.set()

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Any) -> AsyncIterator[None]:
        """FastAPI lifespan: ``FastAPI(lifespan=outbox.lifespan)``."""
        app.state.fastapi_outbox = self
        if not self.settings.run_dispatchers:
            if self.wal_slot is not None:
                await self.wal_slot.check_server(slot=True)
            async with self.notifying():
                yield
            return
        async with self.dispatcher():
            yield

    @contextlib.asynccontextmanager
    async def notifying(self) -> AsyncIterator[Outbox]:
        """Run only the coalesced NOTIFY sender (API-only processes: ``run_dispatchers=False``),
        so commits wake the dispatcher processes without one extra round trip per request."""
        if not (self.store.is_postgres and self.settings.notify) or self.notifier is not None:
            yield self
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
            yield self
        finally:
            self.notifier = None
            task.cancel()
            with anyio.CancelScope(shield=True), contextlib.suppress(asyncio.CancelledError):
                await task

    async def aclose(self) -> None:
        """Close brokers and the engine (when the Outbox created it)."""
        await self._close_brokers()
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
        if self._health_router is None:
            from fastapi_outbox.ops.health import build_health_router

            self._health_router = build_health_router(self)
        return self._health_router

    @property
    def dashboard_router(self) -> Any:
        """The operator dashboard at ``/outbox/dashboard`` (:mod:`fastapi_outbox.ops.dashboard`),
        guarded by ``dashboard_dependencies``. Refused without a guard, so no deployment
        exposes replay and abandon by accident: pass ``dashboard_dependencies=[]`` to serve
        it unguarded on purpose (a trusted network)."""
        if self.dashboard_dependencies is None:
            raise exceptions.ConfigurationError(
                "outbox.dashboard_router has no guard: pass Outbox(..., "
                "dashboard_dependencies=[Depends(require_admin)]) to protect every page and "
                "action, or dashboard_dependencies=[] to serve it unguarded on purpose"
            )
        if self._dashboard_router is None:
            from fastapi_outbox.ops.dashboard import build_dashboard_router

            self._dashboard_router = build_dashboard_router(self, self.dashboard_dependencies)
        return self._dashboard_router

    @property
    def router(self) -> Any:
        """The health router carrying the outbox lifespan: one ``include_router`` line."""
        if self._router is None:
            from fastapi import APIRouter

            router = APIRouter(lifespan=self.lifespan)
            router.include_router(self.health_router)
            self._router = router
        return self._router

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


def _check_dedup_window(name: str, broker: Broker, settings: OutboxSettings) -> None:
    """Refuse a broker whose de-duplication window (set on the broker itself) is shorter
    than a republish can come late: after a lease expires, after the longest backoff, or
    after the longest outage it is meant to absorb."""
    window = getattr(broker, "dedup_window_seconds", None)
    needed = settings.dedup_window_needed_seconds
    if isinstance(window, int | float) and window < needed:
        raise exceptions.ConfigurationError(
            f"broker {name!r}: its de-duplication window ({window:g} s) is shorter than "
            "lease_seconds + retry_max_delay_seconds + dedup_outage_seconds "
            f"({needed:g} s), so a message republished after a lease expiry, the longest "
            "backoff or an outage would appear twice: raise the broker's "
            "dedup_window_seconds or lower those settings"
        )


def _create_engine(url: str, options: dict[str, Any]) -> AsyncEngine:
    """An engine for ``url``; SQLite gets WAL, a busy timeout and BEGIN IMMEDIATE so the
    embedded default copes with a dispatcher and requests writing at the same time."""
    remember(url)
    try:
        engine = create_async_engine(url, **_engine_defaults(url, options))
    except Exception as exc:
        # `from None`: the chained exception may quote the URL with its password.
        raise exceptions.ConfigurationError(
            f"cannot create an engine for {redact_url(url)}: {redact(str(exc))}"
        ) from None
    if engine.dialect.name == "sqlite":
        sync_engine = engine.sync_engine

        @event.listens_for(sync_engine, "connect")
        def _on_connect(dbapi_connection: Any, record: Any) -> None:
            dbapi_connection.isolation_level = None  # we issue BEGIN ourselves
            cursor = dbapi_connection.cursor()
            if engine.url.database not in (None, "", ":memory:"):
                cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.execute("PRAGMA busy_timeout=30000")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()

        @event.listens_for(sync_engine, "begin")
        def _on_begin(conn: Any) -> None:
            conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


def _engine_defaults(url: str, options: dict[str, Any]) -> dict[str, Any]:
    opts = dict(options)
    if url.startswith("sqlite"):
        if url.rstrip("/").endswith(":memory:") or url.rstrip("/") in (
            "sqlite+aiosqlite:",
            "sqlite+aiosqlite://",
        ):
            opts.setdefault("poolclass", StaticPool)
        opts.setdefault("connect_args", {"timeout": 30})
    else:
        # No pool_pre_ping by default: on asyncpg it costs three round trips per checkout
        # (more than the business statement); pass engine_options={"pool_pre_ping": True}
        # where connections die silently (e.g. idle timeouts of a proxy).
        opts.setdefault("pool_size", 10)
        opts.setdefault("max_overflow", 20)
    return opts

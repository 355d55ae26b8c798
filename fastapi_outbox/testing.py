"""Test helpers for users' suites: a harness for their consumers, ``drain``, pytest fixtures.

``OutboxHarness(outbox)`` runs the app's subscribers in-process on memory brokers (no Redis,
NATS or RabbitMQ), on a database of its own: a fresh SQLite file next to nothing of the app's
(SQLite), or a schema of its own on the app's PostgreSQL, dropped on exit — so a test passes
whatever the app's database already holds;
``await harness.wait_idle()`` relays what units of work committed and waits until every
subscriber has handled it, including what their handlers published in turn; then
``harness.published(OrderPlaced)``, ``harness.handled(OrderPlaced)`` and
``harness.dead_letters()`` say what happened::

    async with OutboxHarness(outbox, app=app, metadata=Base.metadata) as harness:
        async with harness.client() as client:
            await client.post("/orders", json={"total": 42})
        await harness.wait_idle()
        assert harness.published(OrderPlaced) == [OrderPlaced(order_id=1, total=42)]

``await drain(outbox)`` claims and publishes everything due, as a relay would, and
returns how many messages were published; tests need no running relay.

The pytest plugin (registered by the package's ``pytest11`` entry point) provides
``memory_broker`` and ``sqlite_outbox`` fixtures.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Self, TypeVar

import anyio
import pytest

from fastapi_outbox.brokers.consumer import DeadLetter, Delivery
from fastapi_outbox.brokers.memory.broker import MemoryBroker
from fastapi_outbox.events import Envelope, Event
from fastapi_outbox.exceptions import PayloadUnreadable
from fastapi_outbox.relay.table import TableRelay, process_batch
from fastapi_outbox.storage.wal_slot import UndecodableWalMessage
from fastapi_outbox.write.unit_of_work import serve_app

if TYPE_CHECKING:
    import httpx
    from sqlalchemy import MetaData

    from fastapi_outbox.outbox import Outbox

__all__ = ["OutboxHarness", "UndecodableWalMessage", "drain", "memory_broker", "sqlite_outbox"]

E = TypeVar("E", bound=Event)

#: How long ``wait_idle`` waits for the subscribers by default.
IDLE_TIMEOUT_SECONDS = 10.0
#: How often ``wait_idle`` looks again while a subscriber is busy.
IDLE_POLL_SECONDS = 0.005
#: Bound on stopping the subscribers when the harness closes.
STOP_TIMEOUT_SECONDS = 5.0


class _IsolatedDatabase:
    """Points every new connection of an engine at a database of the harness's own while
    installed: a fresh SQLite file in a temporary directory, or (PostgreSQL on asyncpg) a
    new schema first on the ``search_path``. The engine's pool is emptied on entry and on
    exit, so no connection to the other database is reused; on exit the file or the schema
    is removed. Other databases (an in-memory SQLite, which no other process shares, or a
    driver it does not know) are left as they are."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.kind: str | None = None
        self._directory: str | None = None
        self.schema: str | None = None

    @staticmethod
    def applies(engine: Any) -> bool:
        url = engine.url
        if url.get_backend_name() == "sqlite":
            return url.database not in (None, "", ":memory:")
        return bool(url.get_backend_name() == "postgresql" and url.get_driver_name() == "asyncpg")

    def _do_connect(self, dialect: Any, record: Any, cargs: Any, cparams: Any) -> Any:
        # A connection of its own, from copies: the engine's arguments stay as they are.
        if self.kind == "sqlite":
            assert self._directory is not None
            return dialect.connect(f"{self._directory}/harness.db", *list(cargs)[1:], **cparams)
        settings = {**cparams.get("server_settings", {}), "search_path": f'"{self.schema}"'}
        return dialect.connect(*cargs, **{**cparams, "server_settings": settings})

    async def install(self) -> None:
        from sqlalchemy import event, text

        if self.engine.url.get_backend_name() == "sqlite":
            self.kind = "sqlite"
            self._directory = tempfile.mkdtemp(prefix="outbox-harness-")
        else:
            self.kind = "postgresql"
            self.schema = f"outbox_harness_{uuid.uuid4().hex[:12]}"
            async with self.engine.connect() as conn:
                await conn.execute(text(f'CREATE SCHEMA "{self.schema}"'))
                await conn.commit()
        await self.engine.dispose()
        event.listen(self.engine.sync_engine, "do_connect", self._do_connect)

    async def remove(self) -> None:
        from sqlalchemy import event, text

        if self.kind is None:
            return
        if event.contains(self.engine.sync_engine, "do_connect", self._do_connect):
            event.remove(self.engine.sync_engine, "do_connect", self._do_connect)
        await self.engine.dispose()
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)
        if self.schema is not None:
            async with self.engine.connect() as conn:
                await conn.execute(text(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE'))
                await conn.commit()
        self.kind = None


async def drain(outbox: Outbox, *, broker: str | None = None, max_batches: int = 1000) -> int:
    """Publish every due message (of ``broker``, or of all brokers); returns the count.

    With ``capture="wal"`` the messages waiting in the replication slot are relayed first
    (to all their brokers, whatever ``broker`` says), as the WAL relay would."""
    names = [broker] if broker is not None else list(outbox.all_brokers)
    published = 0
    if outbox.wal_slot is not None:
        from fastapi_outbox.relay.wal import WalRelay

        wal_relay = WalRelay(
            store=outbox.store,
            slot=outbox.wal_slot,
            brokers=outbox.all_brokers,
            settings=outbox.settings,
            instance=outbox.instance + ":drain",
            instrumentation=outbox.instrumentation,
        )
        await wal_relay.drain()
        published += wal_relay.relayed_total
    for name in names:
        relay = TableRelay(
            store=outbox.store.claims,
            broker_name=name,
            broker=outbox.all_brokers[name],
            settings=outbox.settings,
            instance=outbox.instance + ":drain",
            instrumentation=outbox.instrumentation,
        )
        await relay.broker.connect()
        for n in range(max_batches):
            token = f"{relay.instance}:{n}"
            batch = await outbox.store.claims.claim(
                name,
                outbox.settings.batch_size,
                token,
                outbox.settings.lease_seconds,
                ordered=outbox.settings.ordered,
            )
            if not batch:
                break
            before = relay.published_total
            await process_batch(relay, batch, token)
            published += relay.published_total - before
    return published


@pytest.fixture
def memory_broker() -> MemoryBroker:
    return MemoryBroker()


@pytest.fixture
async def sqlite_outbox(tmp_path: object, memory_broker: MemoryBroker) -> AsyncIterator[Outbox]:
    """An Outbox on a temporary SQLite file with the memory broker; tables created."""
    from fastapi_outbox.outbox import Outbox
    from fastapi_outbox.settings import OutboxSettings

    outbox = Outbox(
        f"sqlite+aiosqlite:///{tmp_path}/outbox.db",
        brokers={"default": memory_broker},
        settings=OutboxSettings(),
    )
    await outbox.create_tables()
    try:
        yield outbox
    finally:
        await outbox.aclose()


class OutboxHarness:
    """Runs an outbox's subscribers in-process, on memory brokers, for tests.

    On entry every broker of ``outbox`` (internal and external) is replaced by a
    [`MemoryBroker`][fastapi_outbox.brokers.MemoryBroker] (given back on exit), the outbox's
    engine is pointed at a database of the harness's own (``isolated=True``, the default: a
    fresh SQLite file, or a new schema on PostgreSQL, removed on exit; an in-memory SQLite
    database, and an outbox with ``capture="wal"``, whose replication slot is the whole
    database's, use their own), the outbox and inbox tables are created in it (and the tables
    of ``metadata``, your models', when given), and every subscriber starts consuming.
    ``isolated=False`` uses the app's own database as it is.

    Nothing is relayed by itself: [`wait_idle`][fastapi_outbox.testing.OutboxHarness.wait_idle]
    relays what was committed (as [`drain`][fastapi_outbox.testing.drain]) and waits until the
    subscribers have handled all of it, over and over until nothing is left — events that
    handlers publish are relayed and handled too.

    ``app``: a FastAPI app to serve with this outbox (``harness.client()``; its lifespan is
    not run). ``fast_retries``: a failing handler is retried without backoff, so a poison
    message reaches its dead letters within ``wait_idle`` (``consumer_max_attempts``
    attempts). Dead letters are in
    [`dead_letters`][fastapi_outbox.testing.OutboxHarness.dead_letters].

    As a pytest fixture::

        @pytest.fixture
        async def harness():
            async with OutboxHarness(outbox, app=app, metadata=Base.metadata) as h:
                yield h
    """

    def __init__(
        self,
        outbox: Outbox,
        *,
        app: Any = None,
        metadata: MetaData | None = None,
        fast_retries: bool = True,
        isolated: bool = True,
    ) -> None:
        self.outbox = outbox
        self.isolated = isolated
        self._database: _IsolatedDatabase | None = None
        self.app = app
        self.metadata = metadata
        self.fast_retries = fast_retries
        #: The memory broker standing in for each broker, by name.
        self.brokers: dict[str, MemoryBroker] = {}
        self._saved_brokers: tuple[dict[str, Any], dict[str, Any]] | None = None
        self._saved_retries: list[tuple[Any, float, float]] = []
        self._task: asyncio.Task[None] | None = None
        self._stop: anyio.Event | None = None
        self._handled: dict[str, set[str]] = {}
        #: id(envelope) -> its payload restored (decrypted, ...), as of the last wait_idle.
        self._plain: dict[int, Any] = {}

    async def __aenter__(self) -> Self:
        outbox = self.outbox
        self._saved_brokers = (dict(outbox.brokers), dict(outbox.external_brokers))
        names = list(outbox.brokers) or [outbox.default_broker]
        outbox.brokers = {name: MemoryBroker() for name in names}
        outbox.external_brokers = {name: MemoryBroker() for name in outbox.external_brokers}
        self.brokers = {**outbox.brokers, **outbox.external_brokers}  # type: ignore[dict-item]
        if self.fast_retries:
            for sub in outbox.subscribers:
                self._saved_retries.append(
                    (sub, sub.retry_base_delay_seconds, sub.retry_max_delay_seconds)
                )
                sub.retry_base_delay_seconds = sub.retry_max_delay_seconds = 0.0
        if self.app is not None:
            serve_app(self.app.state, outbox._producer)
        try:
            # WAL capture reads a replication slot of the whole database: no schema of the
            # harness's own can hold it, so the harness runs on the outbox's database then.
            wal = outbox.settings.capture == "wal"
            if self.isolated and not wal and _IsolatedDatabase.applies(outbox.engine):
                self._database = _IsolatedDatabase(outbox.engine)
                await self._database.install()
            if self.metadata is not None:
                async with outbox.engine.begin() as conn:
                    await conn.run_sync(self.metadata.create_all)
            await outbox.create_tables()
            started, self._stop = anyio.Event(), anyio.Event()
            # A task of its own (not a task group of the caller's): a pytest fixture may
            # enter the harness in one task and leave it in another.
            self._task = asyncio.get_running_loop().create_task(
                self._run(started), name="outbox-harness"
            )
            with anyio.fail_after(STOP_TIMEOUT_SECONDS):
                await started.wait()
        except BaseException:
            await self._restore()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._restore()

    async def _run(self, started: anyio.Event) -> None:
        from fastapi_outbox.consume.subscriber import stop_all

        subscribers = list(self.outbox.subscribers)
        async with anyio.create_task_group() as tg:
            for sub in subscribers:
                await tg.start(sub.run)
            started.set()
            assert self._stop is not None
            await self._stop.wait()
            with anyio.move_on_after(STOP_TIMEOUT_SECONDS):
                await stop_all(subscribers)
            tg.cancel_scope.cancel()

    async def _restore(self) -> None:
        if self._task is not None:
            assert self._stop is not None
            self._stop.set()
            with (
                anyio.CancelScope(shield=True),
                anyio.move_on_after(2 * STOP_TIMEOUT_SECONDS),
                contextlib.suppress(asyncio.CancelledError),
            ):
                await self._task
            if not self._task.done():
                self._task.cancel()
            self._task = None
        for sub, base, maximum in self._saved_retries:
            sub.retry_base_delay_seconds, sub.retry_max_delay_seconds = base, maximum
        self._saved_retries.clear()
        if self._saved_brokers is not None:
            self.outbox.brokers, self.outbox.external_brokers = self._saved_brokers
            self._saved_brokers = None
        if self._database is not None:
            database, self._database = self._database, None
            await database.remove()

    def client(self, **options: Any) -> httpx.AsyncClient:
        """An ``httpx.AsyncClient`` calling ``app`` in-process (``base_url`` http://test)."""
        import httpx

        if self.app is None:
            raise RuntimeError("OutboxHarness(outbox, app=app) is needed for client()")
        options.setdefault("base_url", "http://test")
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), **options)

    async def _busy(self) -> bool:
        for sub in self.outbox.subscribers:
            lag = await sub.lag()
            if lag.lag or lag.pending:
                return True
        return False

    async def wait_idle(self, timeout: float = IDLE_TIMEOUT_SECONDS) -> None:
        """Relay everything committed and wait until every subscriber has handled (or
        dead-lettered) every message, including those its handlers published; TimeoutError
        after ``timeout`` seconds (a handler that never returns, say)."""
        if self._task is None:
            raise RuntimeError("use the harness in `async with OutboxHarness(outbox):`")
        deadline = time.monotonic() + timeout
        with anyio.fail_after(timeout):
            while True:
                if self._task.done():
                    self._task.result()  # a subscriber crashed: raise its error here
                    raise RuntimeError("the harness's subscribers stopped")
                # Subscribers first: a handler's outbox rows commit before its ack, so when
                # no subscriber holds a message, every row its handlers wrote is visible.
                if await self._busy():
                    await anyio.sleep(min(IDLE_POLL_SECONDS, max(0.0, deadline - time.monotonic())))
                    continue
                if await drain(self.outbox) == 0:
                    await self._note_handled()
                    return

    def messages(self, stream: str | None = None, *, broker: str | None = None) -> list[Envelope]:
        """The messages the memory brokers received (of ``broker``: default, every
        internal broker), optionally of one ``stream``; dead letters included."""
        names = [broker] if broker is not None else list(self.outbox.brokers)
        out = [m for n in names for m in self.brokers[n].messages]
        return [m for m in out if stream is None or m.stream == stream]

    def published(self, event_type: type[E], *, broker: str | None = None) -> list[E]:
        """The events of ``event_type`` relayed to the brokers, in publish order."""
        return [
            event_type.model_validate(self._plain.get(id(m)) or m.json())
            for m in self.messages(event_type.__outbox_stream__, broker=broker)
            if m.type == event_type.__outbox_type__
        ]

    def handled(self, event_type: type[E], *, group: str | None = None) -> list[E]:
        """The events of ``event_type`` whose handling committed (an inbox row of a
        subscriber's group, or of ``group``) as of the last
        [`wait_idle`][fastapi_outbox.testing.OutboxHarness.wait_idle], in publish
        order."""
        groups = {
            s.group
            for s in self.outbox.subscribers
            if (group is None or s.group == group) and s.stream == event_type.__outbox_stream__
        }
        return [
            event_type.model_validate(self._plain.get(id(m)) or m.json())
            for m in self.messages(event_type.__outbox_stream__)
            if m.type == event_type.__outbox_type__
            and any(m.message_id in self._handled.get(g, ()) for g in groups)
        ]

    async def _note_handled(self) -> None:
        """What each group's inbox holds of the messages the brokers received."""
        handled: dict[str, set[str]] = {}
        for sub in self.outbox.subscribers:
            seen = handled.setdefault(sub.group, set())
            for m in self.messages(sub.stream, broker=sub.broker_name):
                if m.message_id not in seen and await self.outbox.inbox.contains(
                    sub.group, m.message_id
                ):
                    seen.add(m.message_id)
        self._handled = handled
        # Encrypted payloads as the handlers saw them (``published``/``handled`` list
        # plain events).
        for m in self.messages():
            if id(m) not in self._plain:
                d = Delivery(
                    stream=m.stream,
                    entry_id=m.id,
                    message_id=m.message_id,
                    type=m.type,
                    key=m.key,
                    payload=m.payload,
                    attempt=1,
                    headers=m.headers,
                )
                try:
                    restored = await self.outbox.payloads.restore(d)
                except PayloadUnreadable:  # dead-lettered for it: listed as it is
                    continue
                if restored is not d:
                    self._plain[id(m)] = restored.json()

    async def dead_letters(self, group: str | None = None) -> list[DeadLetter]:
        """The dead letters of every subscriber (or of ``group``): message id, type,
        error, attempts."""
        out: list[DeadLetter] = []
        for sub in self.outbox.subscribers:
            if group is not None and sub.group != group:
                continue
            consumer = sub.make_consumer()
            try:
                out.extend(await consumer.dead_letters())
            finally:
                await consumer.aclose()
        return out

"""Subscribers: consume events with their effects applied once.

::

    @outbox.subscriber("orders", group="billing")
    async def bill(event: OrderPlaced, uow: UnitOfWork) -> None:
        uow.session.add(Invoice(order_id=event.order_id))
        uow.publish(InvoiceIssued(order_id=event.order_id))

Each message is handled in a unit of work of its own (causation id = the incoming message
id, the correlation id carried over) in a transaction that first records the message id in
the inbox (`fastapi_outbox.storage.inbox`): a message the group handled before is skipped. The
broker ack follows the commit. So a crash anywhere — before the commit (nothing happened:
redelivered, handled), between commit and ack (redelivered, skipped) — leaves each effect
applied exactly once, and events the handler publishes go to the outbox in that same
transaction.

One owner of that transaction
(`fastapi_outbox.consume.processing.Processing.run_batch`): the subscriber begins it on a
connection of its own, inserts the inbox row(s) there, binds the handler's session to that
connection, and commits (or rolls back) the inbox rows, the effects and the events together.
Whatever the handler does with its session, its effects and its inbox row commit together or
not at all:

* ``session.commit()`` flushes and writes its events' outbox rows
  (`fastapi_outbox.write.session_events`) but commits nothing: the effects commit with the
  inbox row when the subscriber commits, and a failure after it still undoes them (the
  message is retried);
* ``session.rollback()`` undoes the handler's work since its last commit, never the inbox
  row, and the handler can go on (the insert-if-absent idiom ``try: flush() except
  IntegrityError: rollback()``);
* ``session.begin_nested()`` savepoints work as usual;
* ``outbox.unit_of_work()`` inside a handler joins the handler's session (a savepoint of its
  transaction); a session of the handler's own on the outbox's database
  (``outbox.session_factory()``, a sessionmaker) is refused when it begins, with a
  [`UnitOfWorkError`][fastapi_outbox.UnitOfWorkError] naming the handler — its commit would
  not go with the inbox row.

How, without a round trip per message: the session first joins the subscriber's
transaction itself (``join_transaction_mode="rollback_only"``: its commits commit nothing).
Only a rollback of the session reaches that transaction; then a new one is begun at once (the
handler's later work is discarded with it), and the message runs again the careful way: the
session in a savepoint of the subscriber's transaction (``"create_savepoint"``: its commit
releases the savepoint, its rollback goes back to it). A batch whose handler rolls back goes
message by message (a batch handler's batch: again at once, the careful way). The relays
are woken after the subscriber's real commit, not after the handler's.

Failures:

* the handler raises → retried with exponential backoff (the broker's delivery count is
  the attempt), dead-lettered after ``max_attempts`` with the error and the original
  headers; other messages go on meanwhile (a poison message never blocks the others);
* a message of a type no ``Event`` subclass declares, or whose payload does not validate,
  is dead-lettered at once (no retry can fix it); a type the handler does not take but
  that another ``Event`` of the stream declares is acknowledged and skipped;
* a delivery whose count is already past ``max_attempts`` (the consumer crashed on it
  every time) is dead-lettered without running the handler;
* the broker unreachable or refusing → the subscriber pauses with backoff, no attempt is
  charged; the database unreachable → the message is retried in place (touched so no
  other consumer takes it), no attempt is charged. A connection error of the handler's
  own (an ``OSError`` while the database answers) is a handler failure like any other.

``ordered=True``: messages of one key are handled one at a time in stream order, across
every process of the group. On Redis and NATS the keys are hashed into partitions, each
owned by one process at a time through a lease in the inbox's database, and each process
reads the stream itself (`partitioned`): a failing message is
retried in place, holding back the later messages of its partition. On RabbitMQ the queue
has a single active consumer; on the memory broker (one process) a failing message holds
back the later messages of its key only.

Shutdown (``stop``): no new fetch; in-flight messages get a share of
``shutdown_timeout_seconds`` (counted from the stop) to finish, the rest are cancelled —
their transactions roll back — and released to the broker, so another consumer takes them
at once (Redis: marked idle for ``XAUTOCLAIM``; NATS: ``nak``), also when ``run`` itself is
cancelled.

The parts, by job: `options` (the options and their checks),
`handlers` (the handler's signature, decoding),
`processing` (one delivery, the handler's transaction for
per-message and batch handlers), `batches` (fetched batches, a
batch handler's retries); this module holds the fetch loop and the `Subscriber` that
composes them: each run it makes a ``Processing`` and a ``Batches`` holding exactly their
collaborators (the run's consumer, the handler's options, the context, the counters, the
deliveries in flight). A subscriber sees its outbox
through its `ConsumeContext`.
"""

from __future__ import annotations

import datetime as dt
import functools
import logging
import math
import random
import time
from collections.abc import Sequence
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from pydantic import BaseModel, Field, PrivateAttr

from fastapi_outbox import exceptions
from fastapi_outbox.brokers.consumer import (
    Consumer,
    ConsumerConfig,
    ConsumerLag,
    Delivery,
    dead_letter_name,
)
from fastapi_outbox.consume import options
from fastapi_outbox.consume.batches import Batches
from fastapi_outbox.consume.context import ConsumeContext
from fastapi_outbox.consume.handlers import BatchUnitOfWork, Decoder, inspect_handler
from fastapi_outbox.consume.handlers import Handler as Handler  # for outbox.py
from fastapi_outbox.consume.options import DEAD_LETTER_TEMPLATE
from fastapi_outbox.consume.partitioned import PartitionedRun, can_read_partitions
from fastapi_outbox.consume.processing import (
    InFlight,
    Processing,
    ProcessingOptions,
    ReleasedAtStop,
    SubscriberStats,
    pause_for,
    stops_the_process,
)
from fastapi_outbox.consume.versions import Versions
from fastapi_outbox.log import safe_error

logger = logging.getLogger("fastapi_outbox.consume")

__all__ = [
    "DEAD_LETTER_TEMPLATE",
    "BatchUnitOfWork",
    "ConsumerStatus",
    "Subscriber",
    "SubscriberStats",
]

#: Longest wait of one fetch: bounds how long a stop waits for the fetch loop.
FETCH_TIMEOUT_SECONDS = 1.0
#: Share of ``shutdown_timeout_seconds`` in-flight handlers get to finish; the rest of it
#: is for releasing what did not finish.
DRAIN_SHARE = 0.7
#: Longest wait for the broker to take back the unfinished deliveries at a stop.
RELEASE_SECONDS = 2.0
#: Longest wait at start for this process's row in the group's handlers table.
JOIN_SECONDS = 2.0


class ConsumerStatus(BaseModel):
    """One subscriber's consumer group, as health, the CLI and the dashboard show it."""

    stream: str
    group: str
    broker: str
    handler: str | None = Field(
        default=None, description="module.function; null in the public health body."
    )
    dead_letter_stream: str
    running: bool = Field(description="Its consumer runs in this process.")
    broker_available: bool | None = Field(default=None, description="None: not running here.")
    lag: int | None = Field(
        default=None, description="Messages not delivered to the group yet (None: unknown)."
    )
    lag_partitions: dict[int, int] | None = Field(
        default=None,
        description="Lag per partition number (Kafka); None where the broker has none.",
    )
    pending: int | None = Field(default=None, description="Delivered, not acknowledged yet.")
    dead_letters: int | None = Field(default=None, description="In the dead-letter stream.")
    handled: int | None = Field(default=None, description="Inbox rows of the group.")
    last_handled_at: dt.datetime | None = Field(
        default=None, description="Newest inbox row of the group (any process), UTC."
    )
    failures: int = Field(default=0, description="Handler failures in this process.")
    last_error: str | None = None
    trimmed: int | None = Field(
        default=None,
        description="Entries the stream's MAXLEN trimmed before the group read them: lost "
        "to the group (at least this many; None: unknown or not Redis).",
    )
    dead_letter_failures: int = Field(
        default=0,
        description="Dead-letter writes that failed in this process (the message stayed "
        "pending and is dead-lettered again when it comes back).",
    )
    handed_back: int = Field(
        default=0,
        description="Messages of a type this process's handler does not take, handed back "
        "to the group (uncharged) for another version of it in this process's life: a "
        "rolling deploy, or a type no process of the group handles yet (dead-lettered "
        "after consumer_unknown_type_grace_seconds).",
    )
    dead_letters_unwritten: int = Field(
        default=0,
        description="Messages of this process whose dead letter could not be written yet "
        "(pending in the group until a later try succeeds).",
    )
    workers_replaced: int = Field(
        default=0,
        description="Handler tasks of this process that failed outside a handler (a fault "
        "of the library or of the broker's consumer) and were replaced; their messages went "
        "back to the broker for another attempt. Logged as consumer.worker_replaced.",
    )
    #: Why figures are unknown: the errors of the broker or the inbox that did not answer
    #: (never serialised: a driver's text may name a server; the CLI reports them).
    _causes: list[BaseException] = PrivateAttr(default_factory=list)

    @property
    def causes(self) -> list[BaseException]:
        """The errors that left this group's figures unknown (empty: every one answered)."""
        return self._causes


class Subscriber:
    """One ``@outbox.subscriber``: a handler, its (stream, group) and its runtime — the
    fetch loop. When it runs it makes the run's `Processing` (one delivery, the handler's
    transaction) and
    `Batches` (fetched batches), which share the
    run's `InFlight` with the loop."""

    def __init__(
        self,
        context: ConsumeContext,
        handler: Handler,
        *,
        stream: str,
        group: str,
        broker: str,
        concurrency: int,
        ordered: bool,
        max_attempts: int,
        batch_size: int,
        claim_idle_seconds: float,
        retry_base_delay_seconds: float,
        retry_max_delay_seconds: float,
        dead_letter: str,
        start: str,
        batch: bool = True,
    ) -> None:
        options.check_options(
            handler,
            stream=stream,
            group=group,
            concurrency=concurrency,
            max_attempts=max_attempts,
            batch_size=batch_size,
            start=start,
            claim_idle_seconds=claim_idle_seconds,
            retry_max_delay_seconds=retry_max_delay_seconds,
        )
        self.context = context
        self.handler = handler
        self.name = f"{getattr(handler, '__module__', '?')}.{getattr(handler, '__qualname__', '?')}"
        self.stream = stream
        self.group = group
        self.broker_name = broker
        self.concurrency = concurrency
        self.ordered = ordered
        self.max_attempts = max_attempts
        self.batch_size = batch_size
        self.claim_idle_seconds = claim_idle_seconds
        self.retry_base_delay_seconds = retry_base_delay_seconds
        self.retry_max_delay_seconds = retry_max_delay_seconds
        self.dead_letter = dead_letter_name(dead_letter, stream, group)
        self.dead_letter_shared = "{group}" not in dead_letter
        self.start = start
        #: What the handler takes (read once from its signature).
        self.signature = inspect_handler(handler, options.describe(handler))
        options.check_streams(handler, stream=stream, accepts=self.signature.accepts)
        self.batch_handler = self.signature.batch
        self.decoder = Decoder(self.signature.accepts, self.name)
        options.check_batch_handler(
            handler, batch_handler=self.batch_handler, ordered=ordered, batch=batch
        )
        #: One transaction per fetched batch (not for ordered subscribers: their batches
        #: are a partition's queued messages, `partitioned`).
        self.batch = batch and not ordered
        self.batch_requested = batch
        self._options = self._processing_options()
        self._init_runtime()

    def _processing_options(self) -> ProcessingOptions:
        return ProcessingOptions(
            handler=self.handler,
            name=self.name,
            signature=self.signature,
            decoder=self.decoder,
            stream=self.stream,
            group=self.group,
            dead_letter=self.dead_letter,
            max_attempts=self.max_attempts,
            retry_base_delay_seconds=self.retry_base_delay_seconds,
            retry_max_delay_seconds=self.retry_max_delay_seconds,
        )

    def _init_runtime(self) -> None:
        """The state of a subscriber that has not run yet."""
        self.stats = SubscriberStats()
        self.consumer: Consumer | None = None
        self.running = False
        self.broker_ok: bool | None = None
        self.paused_since: float | None = None
        #: The current (or last) run's deliveries in flight and stop (None: never run).
        self._flight: InFlight | None = None
        self._stop_requested_at = 0.0
        self.stopped: anyio.Event | None = None
        self._key_locks: dict[str, tuple[anyio.Lock, int]] = {}
        self._rng = random.Random()
        #: message id -> the error of a dead letter that could not be written (kept from
        #: one run to the next; see `Processing`).
        self._unwritten_dead_letters: dict[str, str] = {}

    def __repr__(self) -> str:
        return f"Subscriber({self.stream!r}, group={self.group!r}, handler={self.name})"

    # -- the consumer ------------------------------------------------------------------------

    def consumer_config(self) -> ConsumerConfig:
        return ConsumerConfig(
            stream=self.stream,
            group=self.group,
            consumer_name=self.context.instance.replace(":", "-"),
            dead_letter=self.dead_letter,
            claim_idle_seconds=self.claim_idle_seconds,
            max_attempts=self.max_attempts,
            start=self.start,
            dead_letter_shared=self.dead_letter_shared,
            ordered=self.ordered,
            prefetch=self.concurrency * (self.batch_size if self.batch else 1),
        )

    def make_consumer(self) -> Consumer:
        broker = self.context.brokers.get(self.broker_name)
        if broker is None:
            raise exceptions.ConfigurationError(
                f"{self!r}: no broker named {self.broker_name!r}; "
                f"configured: {', '.join(self.context.brokers) or 'none'}"
            )
        factory = getattr(broker, "consumer", None)
        if factory is None:
            raise exceptions.ConfigurationError(
                f"{self!r}: broker {self.broker_name!r} ({type(broker).__name__}) cannot consume"
            )
        consumer: Consumer = factory(self.consumer_config())
        return consumer

    async def lag(self) -> ConsumerLag:
        consumer = self.consumer or self.make_consumer()
        return await consumer.lag()

    @property
    def dead_letters_unwritten(self) -> int:
        """Messages of this process whose dead letter could not be written yet (they stay
        pending in the group until a later try succeeds): health and the consumers view."""
        return len(self._unwritten_dead_letters)

    # -- running -----------------------------------------------------------------------------

    @property
    def stopping(self) -> bool:
        return self._flight is not None and self._flight.stopping

    def stop(self) -> None:
        flight = self._flight
        if flight is not None and not flight.stop.is_set():
            self._stop_requested_at = time.monotonic()
            flight.stop.set()
            flight.free_slot()  # a fetch loop waiting for a free slot sees the stop now

    async def run(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        """Fetch and handle until `stop`. Reports started at once: a broker that is
        down at start pauses the subscriber, it does not hold up the app's start."""
        self._flight = flight = InFlight()
        self.stopped = anyio.Event()
        self.consumer = consumer = self.make_consumer()
        partitioned = self.ordered and can_read_partitions(consumer)
        versions = None if partitioned else self._versions()
        processing = Processing(
            self.context,
            consumer,
            self._options,
            self.stats,
            flight,
            rng=self._rng,
            unwritten_dead_letters=self._unwritten_dead_letters,
            versions=versions,
        )
        # A consumer of another package may predate ack_soon: its plain ack then.
        ack_batch = getattr(consumer, "ack_soon", None) or consumer.ack
        batches = Batches(processing, self._options, self.stats, flight, ack_batch)
        self.running = True
        if versions is not None:
            await self._join(versions)
        task_status.started()
        try:
            if partitioned:
                await PartitionedRun(self, consumer, flight).run()
            else:
                await self._run(consumer, processing, batches, flight, versions)
        finally:
            # Whatever did not finish — cancelled by the drain's end, or by a cancellation
            # of run() itself — is still in flight: released to the broker, so another
            # consumer takes it now rather than after claim_idle_seconds.
            self.running = False
            with anyio.CancelScope(shield=True):
                await self._release_unfinished(consumer, flight, versions)
                try:
                    await consumer.aclose()
                except Exception:
                    logger.debug("consumer close failed", exc_info=True)
                if versions is not None:
                    with anyio.move_on_after(RELEASE_SECONDS):
                        await versions.leave()
            flight.deliveries.clear()
            self.stopped.set()

    async def _join(self, versions: Versions) -> None:
        """This process's row in the group's handlers table, written before the subscriber
        reports started: the group's other versions see what it takes from then on, so a
        message published after the start is never skipped by a process that does not take
        it. Bounded: a database that does not answer does not hold up the app's start (the
        heartbeat writes the row later)."""
        failure: BaseException | None = None
        with anyio.move_on_after(JOIN_SECONDS) as scope:
            try:
                await versions.join()
            except Exception as exc:
                failure = exc
        if failure is not None or scope.cancelled_caught:
            logger.warning(
                "cannot write this process's handled types for the group",
                extra=self._options.log_extra(
                    "consumer.join_failed",
                    error=safe_error(failure) if failure else f"no answer in {JOIN_SECONDS:g} s",
                ),
            )

    def _versions(self) -> Versions:
        inbox = self.context.inbox
        return Versions(
            inbox.members(self.group, self.stream),
            inbox.attempts(self.group),
            member=self.context.instance,
            types=Versions.types_of(self.signature.accepts),
            grace_seconds=self.context.settings.consumer_unknown_type_grace_seconds,
        )

    async def _run(
        self,
        consumer: Consumer,
        processing: Processing,
        batches: Batches,
        flight: InFlight,
        versions: Versions | None = None,
    ) -> None:
        """The handler tasks and the fetch loop until the stop, then the drain."""
        # Work for the handler tasks: a fetched batch, or one delivery. A fixed set of
        # ``concurrency`` tasks takes it (anyio spawns a task in ~25 µs, an item passes
        # through the stream in ~2.5 µs).
        send, receive = anyio.create_memory_object_stream[tuple[Handler, Any]](math.inf)
        # The streams close after the task group is done with them (not under workers
        # still waiting on them when the fetch loop fails).
        async with send, receive, anyio.create_task_group() as handlers:
            handlers.start_soon(self._heartbeat, flight)
            if versions is not None:
                handlers.start_soon(versions.keep_alive)
            for _ in range(self.concurrency):
                handlers.start_soon(self._worker, processing, flight, receive)
            await self._fetch_loop(consumer, processing, batches, flight, send)
            # The drain's share of the shutdown counts from the stop (the fetch loop may
            # have taken up to FETCH_TIMEOUT_SECONDS to see it).
            budget = self.context.settings.shutdown_timeout_seconds * DRAIN_SHARE
            with anyio.move_on_after(budget - (time.monotonic() - self._stop_requested_at)):
                while flight.deliveries:
                    await flight.wait_slot(1.0)
            handlers.cancel_scope.cancel()

    async def _release_unfinished(
        self, consumer: Consumer, flight: InFlight, versions: Versions | None
    ) -> None:
        left = list(flight.deliveries.values())
        if not left:
            return
        log_extra = self._options.log_extra
        if versions is not None:
            # Handlers cancelled by the stop: their runs are not attempts.
            with anyio.move_on_after(RELEASE_SECONDS):
                try:
                    await versions.uncharge([d.message_id for d in left])
                except Exception as exc:  # charged one attempt: a kill's cost
                    logger.warning(
                        "giving back the attempts of cancelled handlers failed",
                        extra=log_extra("consumer.release_failed", error=repr(exc)),
                    )
        with anyio.move_on_after(RELEASE_SECONDS) as scope:
            try:
                await consumer.release(left)
            except Exception as exc:
                logger.warning(
                    "release failed",
                    extra=log_extra("consumer.release_failed", error=repr(exc)),
                )
                return
        if scope.cancelled_caught:
            logger.warning(
                "release timed out",
                extra=log_extra("consumer.release_failed", error="timeout"),
            )
            return
        logger.info(
            "released unfinished messages",
            extra=log_extra("consumer.released", count=len(left)),
        )

    async def _worker(
        self,
        processing: Processing,
        flight: InFlight,
        work: MemoryObjectReceiveStream[tuple[Handler, Any]],
    ) -> None:
        """One handler task: takes work until the stream closes. A failure outside any
        handler (a handler's own failure never gets here: it is the message's) would end
        the task and leave its slot dead; instead it is logged, counted
        (``workers_replaced``, shown by health) and the task goes on with the next item, its
        deliveries handed back to the broker for a later attempt."""
        async for handle, item in work:
            try:
                await handle(item)
            except Exception as exc:
                await self._worker_failed(processing, flight, item, exc)
            except BaseException as exc:
                if stops_the_process(exc):
                    raise
                await self._worker_failed(processing, flight, item, exc)

    async def _worker_failed(
        self, processing: Processing, flight: InFlight, item: Any, exc: BaseException
    ) -> None:
        self.stats.workers_replaced += 1
        self.stats.last_error = f"handler task failed: {safe_error(exc)}"[:300]
        deliveries = item if isinstance(item, list) else [item]
        unsettled = [d for d in deliveries if d.entry_id in flight.deliveries]
        logger.error(
            "a handler task failed outside the handler; replaced",
            extra=self._options.log_extra(
                "consumer.worker_replaced",
                error=safe_error(exc),
                messages=[d.message_id for d in unsettled],
            ),
            exc_info=(type(exc), exc, exc.__traceback__),
        )
        # Charged (retry, not release): a message that kills its task every time ends
        # dead-lettered rather than looping.
        for d in unsettled:
            await processing.retry_later(d, processing.retry_delay(d.attempt))
        flight.free_slot()

    async def _fetch_loop(
        self,
        consumer: Consumer,
        processing: Processing,
        batches: Batches,
        flight: InFlight,
        work: MemoryObjectSendStream[tuple[Handler, Any]],
    ) -> None:
        stop = flight.stop
        inflight = flight.deliveries
        log_extra = self._options.log_extra
        set_up = False
        failures = 0
        limit = self.concurrency * (self.batch_size if self.batch else 1)
        while not stop.is_set():
            free = limit - len(inflight)
            if free <= 0:
                await flight.wait_slot(FETCH_TIMEOUT_SECONDS)
                continue
            try:
                if not set_up:
                    await consumer.setup()
                    set_up = True
                batch = await consumer.fetch(min(free, self.batch_size), FETCH_TIMEOUT_SECONDS)
            except exceptions.BrokerUnavailable as exc:
                failures += 1
                await self._paused(exc, failures, stop)
                continue
            except Exception as exc:
                failures += 1
                logger.exception(
                    "consumer fetch failed",
                    extra=log_extra("consumer.fetch_failed", error=repr(exc)[:300]),
                )
                await self._paused(exc, failures, stop)
                continue
            if failures:
                logger.info("broker reachable again", extra=log_extra("consumer.resumed"))
            failures = 0
            self.broker_ok = True
            self.paused_since = None
            now = time.monotonic()
            for d in batch:
                d.fetched_at = now
                inflight[d.entry_id] = d
            if self.batch and len(batch) > 1:
                work.send_nowait((batches.handle, batch))
            else:
                handle = functools.partial(self._handle, processing, flight)
                for d in batch:
                    work.send_nowait((handle, d))

    async def _paused(self, exc: BaseException, failures: int, stop: anyio.Event) -> None:
        if self.broker_ok is not False:
            logger.warning(
                "broker unavailable, consumer paused",
                extra=self._options.log_extra("consumer.paused", error=safe_error(exc)),
            )
            self.paused_since = time.time()
        self.broker_ok = False
        self.stats.last_error = safe_error(exc)
        with anyio.move_on_after(pause_for(failures)):
            await stop.wait()

    async def _heartbeat(self, flight: InFlight) -> None:
        """Touch deliveries handled for long, so no other consumer reclaims them."""
        every = max(0.05, self.claim_idle_seconds / 3)
        while True:
            await anyio.sleep(every)
            cutoff = time.monotonic() - every
            old = [d for d in list(flight.deliveries.values()) if d.fetched_at <= cutoff]
            if old and self.consumer is not None:
                try:
                    await self.consumer.touch(old)
                except Exception as exc:
                    logger.debug("touch failed: %r", exc)

    # -- one message -------------------------------------------------------------------------

    async def _handle(self, processing: Processing, flight: InFlight, d: Delivery) -> None:
        finished = False
        try:
            if self.ordered and d.key is not None:
                lock = self._lock_for(d.key)
                try:
                    async with lock:
                        await processing.process(d, in_place=True)
                finally:
                    self._unlock_for(d.key)
            else:
                await processing.process(d, in_place=False)
            finished = True
        except ReleasedAtStop:
            await processing.release_unsettled([d])
        finally:
            # Cancelled (a stop): left in flight, so run() releases it to the broker.
            if finished:
                flight.settle(d)
            flight.free_slot()

    def _lock_for(self, key: str) -> anyio.Lock:
        lock, users = self._key_locks.get(key, (None, 0))
        if lock is None:
            lock = anyio.Lock()
        self._key_locks[key] = (lock, users + 1)
        return lock

    def _unlock_for(self, key: str) -> None:
        lock, users = self._key_locks[key]
        if users <= 1:
            del self._key_locks[key]
        else:
            self._key_locks[key] = (lock, users - 1)


def subscriber_options(context: ConsumeContext, **given: Any) -> dict[str, Any]:
    """Decorator options with the settings' defaults filled in
    (`fastapi_outbox.consume.options.subscriber_options`)."""
    return options.subscriber_options(context.settings, **given)


def register(
    outbox: ConsumeContext, handler: Handler, stream: str, group: str, given: dict[str, Any]
) -> Subscriber:
    """A `Subscriber` of ``handler`` added to ``outbox.subscribers``; refused when its
    broker is unknown or its (stream, group, broker) already has a handler."""
    broker = given.pop("broker", None) or outbox.default_broker
    if outbox.brokers and broker not in outbox.brokers:
        raise exceptions.ConfigurationError(
            f"@outbox.subscriber({stream!r}, group={group!r}): no broker named {broker!r}; "
            f"configured: {', '.join(outbox.brokers)}"
        )
    for existing in outbox.subscribers:
        if (existing.stream, existing.group, existing.broker_name) == (stream, group, broker):
            raise exceptions.ConfigurationError(
                f"two subscribers for stream {stream!r}, group {group!r} on broker {broker!r} "
                f"({existing.name} and {handler.__qualname__}): a group has one handler per "
                "stream; use another group name to receive the messages twice"
            )
    sub = Subscriber(outbox, handler, stream=stream, group=group, broker=broker, **given)
    outbox.subscribers.append(sub)
    return sub


async def stop_all(subscribers: Sequence[Subscriber]) -> None:
    """Stop subscribers and wait for them (the caller bounds the wait)."""
    for sub in subscribers:
        sub.stop()
    for sub in subscribers:
        if sub.running and sub.stopped is not None:
            await sub.stopped.wait()

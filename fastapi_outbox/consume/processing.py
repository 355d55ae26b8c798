"""Processing: one delivery through its handler's transaction, its retries and its dead letter.

`Processing` is one run's handling of deliveries. The transaction a subscriber runs
its handlers in (`Processing.run_batch`, for one message or a batch, a per-message or
a batch handler) is the one place where an inbox row's life is decided: the subscriber
begins it on a connection of its own, inserts the inbox row(s), binds the handler's session
to that connection and commits the rows, the effects and the events together (see
`fastapi_outbox.consume.subscriber` for the whole story). The session event listeners
here watch the handler's session while it runs: a rollback that reaches the subscriber's
transaction (`Spoiled`), a second session on the outbox's database (refused).

Around it, one delivery (`Processing.process`): dead-lettered when past
``max_attempts`` or undecodable, acknowledged and skipped when not for this handler, else
handled — a failure retried with backoff then dead-lettered, the database unreachable
waited out in place (no attempt charged), the broker told (ack, retry, dead letter, release)
after the commit. What it knows of its subscriber is a `ProcessingOptions`; what it
shares with the fetch loop is the run's `InFlight`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
import typing
from collections.abc import Sequence
from typing import Any

import anyio
from sqlalchemy import event as sa_event
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession
from sqlalchemy.orm import Session, SessionTransaction

from fastapi_outbox import exceptions
from fastapi_outbox.aggregates import collect_events, held_aggregates
from fastapi_outbox.backoff import exponential_delay
from fastapi_outbox.brokers.consumer import Consumer, Delivery
from fastapi_outbox.consume import versions as versions_mod
from fastapi_outbox.consume.context import ConsumeContext
from fastapi_outbox.consume.handlers import (
    BatchUnitOfWork,
    Decoder,
    Handler,
    HandlerSignature,
    NotForHandler,
    Undeliverable,
    UnknownType,
    delivery_context,
)
from fastapi_outbox.consume.versions import Versions
from fastapi_outbox.exceptions import PayloadUnreadable, UnknownTenant
from fastapi_outbox.log import safe_error
from fastapi_outbox.redaction import redact
from fastapi_outbox.storage import db_outage
from fastapi_outbox.write.session_events import JOINED_KEY, state_of
from fastapi_outbox.write.unit_of_work import (
    HANDLER_TRANSACTION,
    HandlerTransaction,
    UnitOfWork,
    activate,
    close,
)

__all__ = [
    "DATABASE_PING_SECONDS",
    "PAUSE_MAX_SECONDS",
    "PAUSE_MIN_SECONDS",
    "UNWRITTEN_DEAD_LETTERS_KEPT",
    "BeforeAttempt",
    "Fence",
    "HandlerRun",
    "InFlight",
    "Processing",
    "ProcessingOptions",
    "ReleasedAtStop",
    "Spoiled",
    "SubscriberStats",
    "escaped",
    "harvest_added",
    "pause_for",
    "stops_the_process",
]

logger = logging.getLogger("fastapi_outbox.consume")

#: Longest wait for the database's answer when telling an outage from a handler's own
#: connection error.
DATABASE_PING_SECONDS = 5.0
#: Backoff of a paused subscriber (broker or database unreachable).
PAUSE_MIN_SECONDS = 0.2
PAUSE_MAX_SECONDS = 10.0
#: Errors of dead letters that could not be written, kept for their next try.
UNWRITTEN_DEAD_LETTERS_KEPT = 1000
#: What an ordered subscriber runs first in a handler's transaction: raises when the
#: partition of the deliveries is no longer this process's.
Fence = typing.Callable[[AsyncConnection, list[Delivery]], typing.Awaitable[None]]
#: What an ordered subscriber runs right before each try of the handler on one message
#: (the delivery, the attempt number): its attempts recorded where a crash cannot lose
#: them.
BeforeAttempt = typing.Callable[[Delivery, int], typing.Awaitable[None]]
#: ``session.info`` key of a handler session's `HandlerRun`.
_RUN_KEY = "fastapi_outbox.handler_run"


@dataclasses.dataclass(slots=True)
class SubscriberStats:
    """Counters of one subscriber in this process."""

    handled: int = 0
    duplicates: int = 0
    skipped: int = 0
    #: Deliveries of a type this process does not take handed back to its group.
    handed_back: int = 0
    failures: int = 0
    dead_lettered: int = 0
    #: Dead-letter writes that failed (the message stayed pending and comes back).
    dead_letter_failures: int = 0
    last_handled_at: float | None = None
    last_error: str | None = None
    #: Handler tasks of the subscriber that failed outside any handler (a fault of the
    #: library or of a broker's consumer) and were replaced.
    workers_replaced: int = 0


class Spoiled(Exception):
    """A handler's rollback reached work it does not own alone: the subscriber's transaction
    (the fast way: run the message again the careful way) or earlier messages' work of its
    batch (run the batch message by message)."""


class ReleasedAtStop(BaseException):
    """The database is unavailable and the subscriber stops: the message goes back to the
    broker uncharged instead of waiting in place. A ``BaseException`` (like a cancellation),
    so the retry paths' ``except Exception`` never take it for a failure of the handler."""


class HandlerRun(HandlerTransaction):
    """The transaction a subscriber runs its handler(s) in: the handler's session, the
    unit of work and message of the handler running now (what ``outbox.unit_of_work()``
    joins: `HandlerTransaction`), and what a
    rollback of the session undid."""

    __slots__ = ("before", "outer", "spoiled")

    def __init__(
        self, engine: AsyncEngine, name: str, session: AsyncSession, outer: Connection | None
    ) -> None:
        super().__init__(engine, name, session)
        #: The fast way: the subscriber's connection, whose transaction the session shares
        #: (None: the careful way, the session in a savepoint of it).
        self.outer = outer
        #: The careful way: the session's transaction when the current handler began (work
        #: of earlier handlers of the batch is in it), or None.
        self.before: SessionTransaction | None = None
        self.spoiled = False


@sa_event.listens_for(Session, "after_soft_rollback")
def _note_a_rollback_of_the_handler_session(session: Session, previous: SessionTransaction) -> None:
    """A rollback of a handler session's own transaction (not of a savepoint the handler
    began). The fast way, that was the subscriber's transaction, inbox rows included: a new
    one is begun at once, so the handler's later work joins it (and is discarded with it)
    and never commits on its own; the message goes again the careful way. The careful way,
    in a batch: when the transaction began before the current handler, earlier messages'
    work went with it, and the batch goes message by message."""
    run: HandlerRun | None = session.info.get(_RUN_KEY)
    if run is None:
        return
    transaction = previous
    while transaction.parent is not None:
        if transaction.nested:
            return
        transaction = transaction.parent
    if run.outer is not None:
        run.spoiled = True
        if run.uow is not None and not run.outer.in_transaction():  # a handler runs
            run.outer.begin()
    elif run.before is not None and transaction is run.before:
        run.spoiled = True


@sa_event.listens_for(Session, "after_transaction_create")
def _refuse_a_second_session(session: Session, transaction: SessionTransaction) -> None:
    """A session of the handler's own on the outbox's database, begun while a handler runs:
    its commit would not go with the message's inbox row (a redelivery after a later failure
    would apply its effects again), so it is refused at its first use — when it begins,
    before it takes a connection (on SQLite it would wait for the write lock the handler's
    transaction holds)."""
    run = HANDLER_TRANSACTION.get()
    if run is None or run.uow is None or transaction.parent is not None:
        return  # no handler runs (a task it started may outlive it)
    if session.info.get(JOINED_KEY):
        return
    _refuse_if_ours(run, session.bind)


@sa_event.listens_for(Session, "after_begin")
def _refuse_a_second_connection(session: Session, transaction: Any, connection: Any) -> None:
    """The same for a session without one bind (``binds=`` per class): judged by the
    connection it takes."""
    run = HANDLER_TRANSACTION.get()
    if run is None or run.uow is None or session.bind is not None:
        return
    if session.info.get(JOINED_KEY):
        return
    _refuse_if_ours(run, connection)


def _refuse_if_ours(run: HandlerTransaction, bind: Any) -> None:
    if getattr(bind, "engine", None) is not run.engine.sync_engine:
        return  # another database: not ours to judge
    raise exceptions.UnitOfWorkError(
        f"handler {run.name} opened a second session on the outbox's database "
        f"(outbox.session_factory() or a sessionmaker of its own) while handling "
        f"{run.message}: its commit would not go with the message's inbox row, so a "
        "redelivery would apply its effects again. Use the handler's uow.session, or "
        "`async with outbox.unit_of_work() as uow:` inside the handler, which joins the "
        "handler's transaction"
    )


def stops_the_process(exc: BaseException) -> bool:
    """``exc`` must go on up: ``KeyboardInterrupt``/``SystemExit`` (alone or in a group),
    or a cancellation of the running task itself (the subscriber's stop, a cancel scope of
    the caller): asyncio counts those in ``Task.cancelling()``, unlike a
    ``CancelledError`` the handler raised or got from a task it awaited."""
    if isinstance(exc, KeyboardInterrupt | SystemExit):
        return True
    if isinstance(exc, BaseExceptionGroup):
        return any(stops_the_process(inner) for inner in exc.exceptions)
    if isinstance(exc, asyncio.CancelledError):
        task = asyncio.current_task()
        return task is None or task.cancelling() > 0
    return False


def escaped(exc: BaseException, handler: str, message: str) -> BaseException:
    """What a handler's ``BaseException`` (not an ``Exception``) becomes: itself when it
    stops the process or the task (`stops_the_process`), else a
    [`HandlerEscaped`][fastapi_outbox.exceptions.HandlerEscaped] failure of the message (retried,
    then dead-lettered) — never a dead worker."""
    if stops_the_process(exc):
        return exc
    return exceptions.HandlerEscaped(
        f"handler {handler} raised {type(exc).__name__} ({exc!r}) while handling {message}: "
        "a BaseException that is not the subscriber's stop is a failure of the message "
        "(a CancelledError here comes from a task the handler awaited, or was raised by it)"
    )


def harvest_added(uow: UnitOfWork, before: list[Any]) -> list[Any]:
    """Publish, in ``uow``, the events pending on aggregates held by its session or added
    to it by the handler that just ran (``before``: the session's new objects before it):
    a harvest of the session's aggregates limited to what this handler added, so a batch
    of n handlers calls ``collect_events`` O(n) times, not O(n²). When the handler
    flushed (the earlier new objects are no longer new) every new object is looked at.
    Aggregates attached to the session publish their events at once when raised. Returns
    the new objects now."""
    session = uow.session.sync_session
    candidates = held_aggregates(session)
    # The session's pending objects in the order added. Private SQLAlchemy on purpose:
    # the public ``session.new`` copies all of them into an identity set on every call
    # (quadratic over a batch) and does not promise their order; no public API gives them
    # in order without that copy.
    new = list(session._new.values())
    n = len(before)
    kept = n == 0 or (len(new) >= n and new[n - 1] is before[-1])
    candidates += new[n:] if kept else new
    for instance in candidates:
        for event in collect_events(instance):
            uow.publish(event)
    return new


async def _discard(conn: AsyncConnection, session: AsyncSession | None) -> None:
    """Roll back a subscriber's transaction and give its connection back. The rollback
    comes first (closing the session first would roll back its savepoint: a round trip for
    nothing). When it fails (the database gone, the rollback cancelled) the connection is
    invalidated, never given back to the pool: its state is unknown, and the next
    transaction handed it (another subscriber's, a request's) would fail. The failure is
    only logged: the caller re-raises the error that ended the transaction, which is the
    one to classify."""
    try:
        if conn.in_transaction():
            await conn.rollback()
        if session is not None:
            await session.close()
    except BaseException as exc:
        logger.warning(
            "rollback of a handler's transaction failed; its connection is discarded",
            extra={"action": "consumer.rollback_failed", "error": repr(exc)[:300]},
        )
        try:
            await conn.invalidate()
        except Exception:
            logger.debug("invalidating a handler's connection failed", exc_info=True)
        if not isinstance(exc, Exception):
            raise
    finally:
        try:
            await conn.close()
        except Exception as exc:
            logger.debug("closing a handler's connection failed: %r", exc)


async def _is_database_outage(exc: BaseException, engine: Any) -> bool:
    """The database is unavailable (not a fault of the message), as the dialect's
    classifier decides (`fastapi_outbox.storage.db_outage`): refusing connections, starting
    up, shutting down, too many clients, pool timeout; an ambiguous ``OSError`` while the
    database does not answer ``SELECT 1`` either. A handler's own SQL error, or its own
    ``OSError`` while the database answers, is the handler's failure."""
    return await db_outage.is_outage(exc, engine, ping_seconds=DATABASE_PING_SECONDS)


def pause_for(failures: int) -> float:
    """The pause of a subscriber after ``failures`` outages in a row (broker or database
    unreachable)."""
    return exponential_delay(failures + 1, base=PAUSE_MIN_SECONDS, maximum=PAUSE_MAX_SECONDS)


@dataclasses.dataclass(frozen=True, slots=True)
class ProcessingOptions:
    """What a subscriber's processing knows of it: its handler, names and retry options
    (set once by `Subscriber`)."""

    handler: Handler
    #: module.function of the handler.
    name: str
    signature: HandlerSignature
    decoder: Decoder
    stream: str
    group: str
    dead_letter: str
    max_attempts: int
    retry_base_delay_seconds: float
    retry_max_delay_seconds: float

    def log_extra(self, action: str, d: Delivery | None = None, **more: Any) -> dict[str, Any]:
        """The ``extra=`` of a subscriber's log record: the action, the stream and group,
        and the delivery's ids."""
        extra: dict[str, Any] = {"action": action, "stream": self.stream, "group": self.group}
        if d is not None:
            extra.update(message_id=d.message_id, entry_id=d.entry_id, attempt=d.attempt)
        extra.update(more)
        return extra


class InFlight:
    """One run of a subscriber: its deliveries not settled yet (acknowledged, retried,
    dead-lettered or released), its stop, and the event the fetch loop waits on for a free
    slot. Shared by the fetch loop, `Processing` and the batches."""

    __slots__ = ("_slot_freed", "deliveries", "stop")

    def __init__(self) -> None:
        #: entry id -> delivery, from its fetch until it is settled.
        self.deliveries: dict[str, Delivery] = {}
        self.stop = anyio.Event()
        self._slot_freed = anyio.Event()

    @property
    def stopping(self) -> bool:
        return self.stop.is_set()

    def settle(self, d: Delivery) -> None:
        """``d`` is settled: no longer in flight (not released at a stop)."""
        self.deliveries.pop(d.entry_id, None)

    async def wait_slot(self, timeout: float) -> None:
        with anyio.move_on_after(timeout):
            await self._slot_freed.wait()

    def free_slot(self) -> None:
        self._slot_freed.set()
        self._slot_freed = anyio.Event()


class Processing:
    """One run's handling of deliveries: one message (`process`) and the transaction
    every handler runs in (`run_batch`, one message or a batch, a per-message or a
    batch handler). Made by `Subscriber` when it
    runs, with the run's consumer and `InFlight`."""

    def __init__(
        self,
        context: ConsumeContext,
        consumer: Consumer,
        options: ProcessingOptions,
        stats: SubscriberStats,
        flight: InFlight,
        *,
        rng: random.Random,
        unwritten_dead_letters: dict[str, str],
        fence: Fence | None = None,
        before_attempt: BeforeAttempt | None = None,
        versions: Versions | None = None,
    ) -> None:
        self.context = context
        #: The group's other versions and the attempts the library counts (None: an
        #: ordered subscriber reading partitions, which counts its own).
        self.versions = versions
        #: Ordered subscribers across processes: the first statement of every handler's
        #: transaction (the partition's lease still ours; see
        #: `fastapi_outbox.consume.partitioned`). None: no fence.
        self.fence = fence
        #: Ordered subscribers across processes: run before each try of the handler on one
        #: message (`process`), outside its transaction. None: nothing.
        self.before_attempt = before_attempt
        self.consumer = consumer
        self.options = options
        self.stats = stats
        self.flight = flight
        self._rng = rng
        #: message id -> the error of a dead letter that could not be written: used when
        #: the message comes back to be dead-lettered again (bounded; the subscriber's,
        #: kept from one run to the next).
        self._unwritten_dead_letters = unwritten_dead_letters

    def retry_delay(self, attempt: int) -> float:
        """The backoff before the try after ``attempt``."""
        return exponential_delay(
            attempt,
            base=self.options.retry_base_delay_seconds,
            maximum=self.options.retry_max_delay_seconds,
            jitter=0.25,
            rng=self._rng,
        )

    # -- one message -------------------------------------------------------------------------

    async def process(self, d: Delivery, *, in_place: bool) -> None:
        """``d`` through its handler: acknowledged, retried (``in_place``: here, after the
        backoff; else by the broker) or dead-lettered; handed back to the group when
        another version of it may take ``d``'s type."""
        try:
            serving = self.context.serving([d])
        except UnknownTenant as exc:
            await self._dead_letter(d, str(exc))
            return
        with serving:
            await self._process(d, in_place=in_place)

    async def _process(self, d: Delivery, *, in_place: bool) -> None:
        attempt = d.attempt
        versions = self.versions
        if versions is None and attempt > self.options.max_attempts:
            await self._past_max_attempts(d)
            return
        outages = 0
        while True:
            try:
                message = self.options.decoder.decode(await self.context.payloads.restore(d))
            except (Undeliverable, PayloadUnreadable) as exc:
                await self._dead_letter(d, str(exc))
                return
            except (NotForHandler, UnknownType) as exc:
                await self._not_taken(d, exc)
                return
            except Exception as exc:  # a payload stage failed (a store unreachable)
                # The database unreachable (claim-check's database store): waited out in
                # place, no attempt charged; anything else is an attempt.
                if await self.waited_out_database(exc, outages, "the payload's restoring", d):
                    outages += 1
                    continue
                delay = await self._failed(d, exc, attempt)
                if delay is not None:
                    await self._count_failure(d, attempt, counted=False)
                    await self.retry_later(d, delay)
                return
            break
        outages = 0
        counted = False
        while True:
            try:
                if self.before_attempt is not None:
                    await self.before_attempt(d, attempt)
                elif versions is not None and (d.attempt > 1 or attempt > 1) and not counted:
                    # The broker's count rises for a message handed back unhandled too:
                    # the attempt is the handler runs the library counted.
                    attempt = await versions.attempts.start(d.message_id)
                    counted = True
                    versions.running.add(d.message_id)
                    if attempt > self.options.max_attempts:
                        versions.running.discard(d.message_id)
                        await self._past_max_attempts(d, attempt)
                        await self._forget(d)
                        return
                new = await self._run_handler(d, message)
            except Exception as exc:
                if await self.waited_out_database(exc, outages, "the message", d):
                    outages += 1
                    continue
                if versions is not None:
                    versions.running.discard(d.message_id)
                delay = await self._failed(d, exc, attempt)
                if delay is None:
                    await self._forget(d, counted)
                    return  # dead-lettered
                await self._count_failure(d, attempt, counted)
                counted = False
                if not in_place:
                    await self.retry_later(d, delay)
                    return
                attempt += 1
                await anyio.sleep(delay)
                continue
            if versions is not None:
                versions.running.discard(d.message_id)
            if new:
                self.stats.handled += 1
            else:
                self.stats.duplicates += 1
            self.stats.last_handled_at = time.time()
            await self._ack(d)
            await self._forget(d, counted)
            return

    async def _count_failure(self, d: Delivery, attempt: int, counted: bool) -> None:
        """The handler failed on ``attempt`` of ``d``, not counted yet (a first delivery):
        recorded, so the redelivery is the next attempt whatever the broker counts."""
        if counted or self.versions is None:
            return
        try:
            await self.versions.attempts.failed(d.message_id, attempt)
        except Exception as exc:  # the broker's count then: one attempt fewer at worst
            logger.debug("recording a failed attempt failed: %r", exc)

    async def _forget(self, d: Delivery, counted: bool = True) -> None:
        """``d`` settled: its attempts row (where one may exist) is no longer needed."""
        if self.versions is None or not (counted or d.attempt > 1):
            return
        try:
            await self.versions.attempts.forget([d.message_id])
        except Exception as exc:  # retention removes it later
            logger.debug("forgetting a message's attempts failed: %r", exc)

    async def _not_taken(self, d: Delivery, exc: Exception) -> None:
        """``d``'s type is not this handler's (`fastapi_outbox.consume.versions`):
        handed back while another version of the group may take it, else skipped (a type
        an ``Event`` here declares) or, past the grace, dead-lettered (a type unknown here)."""
        versions = self.versions
        if versions is None:  # an ordered subscriber's partition: settled here
            if isinstance(exc, UnknownType):
                await self._dead_letter(d, str(exc))
            else:
                self.stats.skipped += 1
                await self._ack(d)
            return
        try:
            if await versions.taken_elsewhere(d.type, d.fetched_at):
                await self._hand_back(d)
                return
            if isinstance(exc, NotForHandler):
                self.stats.skipped += 1
                await self._ack(d)
                await self._forget(d, counted=False)
                return
            waited = await versions.attempts.unhandled_for(d.message_id)
        except Exception as error:  # cannot tell: never settled on a guess
            logger.warning(
                "cannot tell whether another version of the group takes the message; handed back",
                extra=self.options.log_extra("consumer.handed_back", d, error=repr(error)[:200]),
            )
            await self._hand_back(d)
            return
        grace = versions.grace_seconds
        if waited < grace:
            await self._hand_back(d)
            return
        await self._dead_letter(
            d,
            f"{exc}; no process of group {self.options.group!r} has handled type {d.type!r} "
            f"for {waited:.0f} s (consumer_unknown_type_grace_seconds={grace:g})",
        )
        await self._forget(d)

    async def _hand_back(self, d: Delivery) -> None:
        """Back to the group, uncharged, for another process after
        `hand_back_delay`."""
        self.stats.handed_back += 1
        consumer: Any = self.consumer
        defer = getattr(consumer, "defer", None)
        delay = versions_mod.hand_back_delay()
        try:
            if defer is not None:
                await defer(d, delay)
            else:
                await consumer.retry(d, delay)
        except Exception as exc:  # redelivered after claim_idle anyway
            logger.warning(
                "hand-back failed",
                extra=self.options.log_extra("consumer.retry_failed", d, error=repr(exc)),
            )
        self.flight.settle(d)

    async def _past_max_attempts(self, d: Delivery, attempt: int | None = None) -> None:
        """``d``'s handler started more than ``max_attempts`` times (``attempt``: the
        library's count; None: the broker's): acknowledged when its transaction committed
        before, else dead-lettered without running the handler."""
        if await self._handled_before(d):
            # Committed, but the ack was lost (a kill, a broker restart) every time: its
            # effects are applied; a dead letter would say otherwise.
            self.stats.duplicates += 1
            await self._ack(d)
            return
        await self._dead_letter(
            d,
            (
                f"delivered {d.attempt} times"
                if attempt is None
                else f"its handler started {attempt - 1} times"
            )
            + f", max_attempts={self.options.max_attempts}, without being acknowledged: "
            "the consumer crashed or stalled on it every time",
        )

    async def _failed(self, d: Delivery, exc: Exception, attempt: int) -> float | None:
        """The handler failed on ``attempt``: counted and logged; dead-lettered on the last
        attempt (None), else the delay before the next one."""
        self.stats.failures += 1
        error = redact(f"{type(exc).__name__}: {exc}")  # kept in the dead letter
        self.stats.last_error = error[:300]
        log_extra = self.options.log_extra
        if attempt >= self.options.max_attempts:
            logger.warning(
                "handler failed, dead-lettering",
                extra=log_extra("consumer.failed", d, error=error[:300]),
                exc_info=True,
            )
            await self._dead_letter(
                d, f"handler {self.options.name} failed on attempt {attempt}: {error}"
            )
            return None
        delay = self.retry_delay(attempt)
        logger.warning(
            "handler failed, will retry",
            extra=log_extra(
                "consumer.failed", d, error=error[:300], retry_in_seconds=round(delay, 3)
            ),
        )
        return delay

    async def retry_later(self, d: Delivery, delay: float) -> None:
        """Hand ``d`` back to the broker for a redelivery after ``delay``."""
        try:
            await self.consumer.retry(d, delay)
        except Exception as retry_exc:  # redelivered after claim_idle anyway
            logger.warning(
                "retry request failed",
                extra=self.options.log_extra("consumer.retry_failed", d, error=repr(retry_exc)),
            )
        self.flight.settle(d)

    async def _handled_before(self, d: Delivery) -> bool:
        """Whether the group's inbox holds ``d``'s message id (its transaction committed).
        The database unavailable: waited out in place, like a handler's transaction."""
        outages = 0
        while True:
            try:
                return await self.context.inbox.contains(self.options.group, d.message_id)
            except Exception as exc:
                if await self.waited_out_database(exc, outages, "the inbox look-up", d):
                    outages += 1
                    continue
                logger.warning(
                    "inbox look-up failed; dead-lettering",
                    extra=self.options.log_extra("consumer.inbox_failed", d, error=safe_error(exc)),
                )
                return False

    async def _run_handler(self, d: Delivery, message: Any) -> bool:
        """One transaction: inbox row, then the handler (a batch handler: on a one-element
        list); True when the message was new. The fast way first; the careful way when the
        handler rolled back its session."""
        try:
            new, _ = await self.run_batch([d], [message])
        except Spoiled:
            new, _ = await self.run_batch([d], [message], careful=True)
        return new > 0

    async def _ack(self, d: Delivery) -> None:
        try:
            await self.consumer.ack([d])
        except Exception as exc:
            # Committed: a redelivery will find the inbox row and be skipped.
            logger.warning(
                "ack failed; the message will be redelivered and skipped",
                extra=self.options.log_extra("consumer.ack_failed", d, error=repr(exc)[:300]),
            )
        self.flight.settle(d)

    async def _dead_letter(self, d: Delivery, error: str) -> None:
        unwritten = self._unwritten_dead_letters
        error = (
            unwritten.pop(d.message_id, "") or error
        )  # the first reason, not "delivered n times"
        try:
            await self.consumer.dead_letter(d, error)
        except Exception as exc:
            await self._dead_letter_failed(d, error, exc)
            return
        self.flight.settle(d)
        self.stats.dead_lettered += 1
        self.stats.last_error = error[:300]
        logger.error(
            "message dead-lettered",
            extra=self.options.log_extra(
                "consumer.dead_lettered",
                d,
                dead_letter=self.options.dead_letter,
                error=error[:300],
            ),
        )

    async def _dead_letter_failed(self, d: Delivery, error: str, exc: Exception) -> None:
        """The dead letter of ``d`` could not be written: not acknowledged, so the message
        stays pending (no broker-side delivery limit drops it) and is dead-lettered again
        when it comes back, after a backoff, with the same ``error``."""
        if len(self._unwritten_dead_letters) < UNWRITTEN_DEAD_LETTERS_KEPT:
            self._unwritten_dead_letters[d.message_id] = error
        self.stats.dead_letter_failures += 1
        self.stats.last_error = f"dead-lettering failed: {type(exc).__name__}: {exc}"[:300]
        logger.error(
            "dead-lettering failed; the message stays pending and will be redelivered",
            extra=self.options.log_extra("consumer.dead_letter_failed", d, error=repr(exc)[:300]),
        )
        try:
            await self.consumer.retry(d, self.retry_delay(d.attempt))
        except Exception:  # redelivered after claim_idle_seconds anyway
            logger.debug("retry after a failed dead letter failed", exc_info=True)

    async def waited_out_database(
        self, exc: BaseException, outages: int, what: str, d: Delivery | None = None
    ) -> bool:
        """When ``exc`` is the database being unreachable: note it, wait the pause for the
        ``outages + 1``-th outage in a row, and return True (the caller retries in place, no
        attempt charged). When the subscriber stops (before or during the wait), raise
        `ReleasedAtStop`: the message goes back to the broker, uncharged."""
        if not await _is_database_outage(exc, self.context.engine):
            return False
        self.stats.last_error = f"database unreachable: {type(exc).__name__}"
        if not self.flight.stopping:
            logger.warning(
                f"database unreachable, retrying {what} in place",
                extra=self.options.log_extra("consumer.db_unavailable", d, error=repr(exc)[:200]),
            )
            with anyio.move_on_after(pause_for(outages + 1)):
                await self.flight.stop.wait()
        if self.flight.stopping:
            raise ReleasedAtStop()
        return True

    async def release_unsettled(self, deliveries: Sequence[Delivery]) -> None:
        """Give back to the broker, uncharged, those of ``deliveries`` not yet acknowledged,
        dead-lettered or retried (still in flight): the database went away while the
        subscriber stops."""
        inflight = self.flight.deliveries
        left = [d for d in deliveries if inflight.pop(d.entry_id, None) is not None]
        if not left:
            return
        with anyio.CancelScope(shield=True), anyio.move_on_after(2.0):
            try:
                await self.consumer.release(left)
            except Exception as exc:
                logger.warning(
                    "release failed",
                    extra=self.options.log_extra("consumer.release_failed", error=repr(exc)),
                )
                return
        logger.info(
            "database unreachable at shutdown: messages released, no attempt charged",
            extra=self.options.log_extra("consumer.released", count=len(left)),
        )

    # -- the transaction ---------------------------------------------------------------------

    async def run_batch(
        self, todo: list[Delivery], messages: list[Any], *, careful: bool = False
    ) -> tuple[int, int]:
        """(handled, duplicates) of one transaction over ``todo`` (``messages[i]``: the
        decoded message of ``todo[i]``; one message or a batch): the one place where an
        inbox row's life is decided.

        The subscriber owns the transaction: it begins it on a connection of its own,
        inserts the inbox rows there and binds the handler's session to that connection;
        then it commits the inbox rows, the effects and the events together, or rolls all
        of them back. The session never commits that transaction:

        * the fast way (``join_transaction_mode="rollback_only"``, no round trip added): a
          handler's ``session.commit()`` flushes and writes its events' outbox rows, and
          commits nothing; ``begin_nested()`` savepoints work as usual. A rollback of the
          session itself would undo the inbox rows too: a new transaction is begun at
          once (the handler's later work is discarded with it) and `Spoiled` is
          raised after the handler — the caller runs the message(s) again the careful way
          (one message) or message by message (a batch);
        * the careful way (``careful=True``, ``"create_savepoint"``): the session's
          transaction is a savepoint of the subscriber's (SAVEPOINT and RELEASE: two round
          trips), so ``session.rollback()`` goes back to it and the inbox rows stay. The
          per-message handlers of a batch share that savepoint: a rollback by one of them
          that undoes earlier messages' work raises `Spoiled`."""
        with self.context.serving(todo):
            return await self._run_batch(todo, messages, careful=careful)

    async def _run_batch(
        self, todo: list[Delivery], messages: list[Any], *, careful: bool
    ) -> tuple[int, int]:
        ids = [d.message_id for d in todo]
        stream = todo[0].stream
        streams = stream if all(d.stream == stream for d in todo) else [d.stream for d in todo]
        conn = await self.context.engine.connect()
        session: AsyncSession | None = None
        ran: set[str] = set()
        try:
            await conn.begin()
            if self.fence is not None:
                await self.fence(conn, todo)
            fresh = await self.context.inbox.record_many(conn, self.options.group, ids, streams)
            if fresh:
                session = self.context.session_factory(
                    bind=conn,
                    join_transaction_mode="create_savepoint" if careful else "rollback_only",
                )
                session.info[JOINED_KEY] = True
                outer = None if careful else conn.sync_connection
                await self._run_in_session(session, outer, todo, messages, fresh, ran)
            await conn.commit()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await _discard(conn, session)
            raise
        # Committed: the session has nothing left to undo, the connection goes back to
        # the pool (no shield needed).
        if session is not None:
            await session.close()
        await conn.close()
        if session is not None:
            state = state_of(session.sync_session)
            state.after_commit()  # the session's own commits were not the real one
            for producer in state.take_notify():
                await producer.relays.notify_after_commit()
        return len(ran), len(todo) - len(ran)

    async def _run_in_session(
        self,
        session: AsyncSession,
        outer: Connection | None,
        todo: list[Delivery],
        messages: list[Any],
        fresh: set[str],
        ran: set[str],
    ) -> None:
        """The handler(s) on the new messages (``fresh``) of ``todo`` with ``session``, then
        the session's commit (it flushes and writes the events' outbox rows; the careful
        way: releases the savepoint). `Spoiled` when the session rolled back."""
        run = HandlerRun(self.context.engine, self.options.name, session, outer)
        session.info[_RUN_KEY] = run
        token = HANDLER_TRANSACTION.set(run)
        try:
            if self.options.signature.batch:
                await self._run_batch_handler(run, todo, messages, fresh, ran)
            else:
                await self._run_handlers(run, todo, messages, fresh, ran)
        finally:
            HANDLER_TRANSACTION.reset(token)
            run.uow = None
            run.ended = True
        await session.commit()
        if run.spoiled:  # rolled back in a hook of the commit
            raise Spoiled(f"handler {self.options.name}: the session rolled back")

    async def _run_handlers(
        self,
        run: HandlerRun,
        todo: list[Delivery],
        messages: list[Any],
        fresh: set[str],
        ran: set[str],
    ) -> None:
        """The per-message handler on each new message of ``todo``, one after the other on
        the shared session, each with a unit of work of its own (its events carry its
        message as cause)."""
        session = run.session
        sync_session = session.sync_session
        handler, uow_params = self.options.handler, self.options.signature.uow_params
        before: list[Any] = []  # new objects on the session before the current handler
        for d, message in zip(todo, messages, strict=True):
            if d.message_id not in fresh or d.message_id in ran:
                continue
            ran.add(d.message_id)
            correlation, causation, traceparent = delivery_context(d)
            uow = self.context.make_unit_of_work(
                UnitOfWork,
                session,
                correlation_id=correlation,
                causation_id=causation,
                traceparent=traceparent,
            )
            run.uow = uow
            run.message = f"message {d.message_id}"
            if run.outer is None:
                # The careful way. Earlier handlers' work: in the session's transaction,
                # or (events published or objects changed outside one) in a transaction
                # begun now for it, so that a rollback undoing it is seen.
                # Rows queued by any outbox on the session (``uow.queued`` holds this
                # outbox's only), or objects added, changed or deleted (what SQLAlchemy's
                # private ``Session._is_clean()`` tells, through the public collections).
                current = sync_session.get_transaction()
                if current is None and (
                    state_of(sync_session).queued
                    or sync_session.new
                    or sync_session.dirty
                    or sync_session.deleted
                ):
                    current = sync_session.begin()
                run.before = current
            activate(uow)
            try:
                await handler(message, **{name: uow for name in uow_params})
                before = harvest_added(uow, before)
            except Exception:
                raise
            except BaseException as exc:
                error = escaped(exc, self.options.name, run.message)
                if error is exc:
                    raise
                raise error from exc
            finally:
                close(uow)
            if run.spoiled:
                raise Spoiled(
                    f"handler {self.options.name} rolled back its session while handling "
                    f"message {d.message_id}: handled again in a savepoint of its own"
                )

    async def _run_batch_handler(
        self,
        run: HandlerRun,
        todo: list[Delivery],
        messages: list[Any],
        fresh: set[str],
        ran: set[str],
    ) -> None:
        """The batch handler on the new messages of ``todo``, each once."""
        if len(fresh) == len(todo):  # all new, each once
            ran.update(fresh)
            await self._call_batch_handler(run, todo, messages)
            return
        # The new messages, each once (a duplicate entry in the same batch too).
        pick = []
        for i, d in enumerate(todo):
            if d.message_id in fresh and d.message_id not in ran:
                ran.add(d.message_id)
                pick.append(i)
        await self._call_batch_handler(run, [todo[i] for i in pick], [messages[i] for i in pick])

    async def _call_batch_handler(
        self, run: HandlerRun, deliveries: list[Delivery], messages: list[Any]
    ) -> None:
        """The batch handler on the new messages of a batch, in the batch's transaction."""
        # The context of the last message; the others' correlation ids when asked for.
        correlation, causation, traceparent = delivery_context(deliveries[-1])
        uow = self.context.make_unit_of_work(
            BatchUnitOfWork,
            run.session,
            correlation_id=correlation,
            causation_id=causation,
            traceparent=traceparent,
        )
        uow.for_deliveries(deliveries)
        run.uow = uow
        run.message = (
            f"message {deliveries[0].message_id}"
            if len(deliveries) == 1
            else f"a batch of {len(deliveries)} messages from {deliveries[0].message_id}"
        )
        activate(uow)
        try:
            uow_params = self.options.signature.uow_params
            await self.options.handler(messages, **{name: uow for name in uow_params})
            harvest_added(uow, [])
        except Exception:
            raise
        except BaseException as exc:
            error = escaped(exc, self.options.name, run.message)
            if error is exc:
                raise
            raise error from exc
        finally:
            close(uow)
        if run.spoiled:
            raise Spoiled(
                f"handler {self.options.name} rolled back its session while handling "
                f"{run.message}: handled again in a savepoint of its own"
            )

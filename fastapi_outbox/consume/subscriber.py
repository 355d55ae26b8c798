"""Subscribers: consume events with their effects applied once.

::

    @outbox.subscriber("orders", group="billing")
    async def bill(event: OrderPlaced, uow: UnitOfWork) -> None:
        uow.session.add(Invoice(order_id=event.order_id))
        uow.publish(InvoiceIssued(order_id=event.order_id))

Each message is handled in a unit of work of its own (causation id = the incoming message
id, the correlation id carried over) in a transaction that first records the message id in
the inbox (:mod:`fastapi_outbox.storage.inbox`): a message the group handled before is skipped. The
broker ack follows the commit. So a crash anywhere — before the commit (nothing happened:
redelivered, handled), between commit and ack (redelivered, skipped) — leaves each effect
applied exactly once, and events the handler publishes go to the outbox in that same
transaction.

One owner of that transaction (``Subscriber._run_batch``): the subscriber begins it on a
connection of its own, inserts the inbox row(s) there, binds the handler's session to that
connection, and commits (or rolls back) the inbox rows, the effects and the events together.
Whatever the handler does with its session, its effects and its inbox row commit together or
not at all:

* ``session.commit()`` flushes and writes its events' outbox rows
  (:mod:`fastapi_outbox.write.session_events`) but commits nothing: the effects commit with the
  inbox row when the subscriber commits, and a failure after it still undoes them (the
  message is retried);
* ``session.rollback()`` undoes the handler's work since its last commit, never the inbox
  row, and the handler can go on (the insert-if-absent idiom ``try: flush() except
  IntegrityError: rollback()``);
* ``session.begin_nested()`` savepoints work as usual;
* ``outbox.unit_of_work()`` inside a handler joins the handler's session (a savepoint of its
  transaction); a session of the handler's own on the outbox's database
  (``outbox.session_factory()``, a sessionmaker) is refused when it begins, with a
  :class:`~fastapi_outbox.exceptions.UnitOfWorkError` naming the handler — its commit would
  not go with the inbox row.

How, without a round trip per message: the session first joins the subscriber's
transaction itself (``join_transaction_mode="rollback_only"``: its commits commit nothing).
Only a rollback of the session reaches that transaction; then a new one is begun at once (the
handler's later work is discarded with it), and the message runs again the careful way: the
session in a savepoint of the subscriber's transaction (``"create_savepoint"``: its commit
releases the savepoint, its rollback goes back to it). A batch whose handler rolls back goes
message by message (a batch handler's batch: again at once, the careful way). The dispatchers
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

``ordered=True``: messages of one key are handled one at a time in stream order (a failing
one is retried in place, holding back later messages of its key only).

Shutdown (``stop``): no new fetch; in-flight messages get a share of
``shutdown_timeout_seconds`` (counted from the stop) to finish, the rest are cancelled —
their transactions roll back — and released to the broker, so another consumer takes them
at once (Redis: marked idle for ``XAUTOCLAIM``; NATS: ``nak``), also when ``run`` itself is
cancelled.
"""

from __future__ import annotations

import contextvars
import dataclasses
import datetime as dt
import inspect
import json
import logging
import math
import random
import time
import types
import typing
import uuid
from collections import abc
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from pydantic import BaseModel, Field, ValidationError
from sqlalchemy import event as sa_event
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session, SessionTransaction

from fastapi_outbox import exceptions
from fastapi_outbox.aggregates import collect_events, held_aggregates
from fastapi_outbox.backoff import exponential_delay
from fastapi_outbox.brokers.consumer import (
    Consumer,
    ConsumerConfig,
    ConsumerLag,
    Delivery,
    dead_letter_name,
)
from fastapi_outbox.events import (
    HEADER_CORRELATION_ID,
    HEADER_TRACEPARENT,
    Event,
    Message,
)
from fastapi_outbox.log import safe_error
from fastapi_outbox.redaction import redact
from fastapi_outbox.storage import db_outage
from fastapi_outbox.write.session_events import JOINED_KEY, state_of
from fastapi_outbox.write.unit_of_work import UnitOfWork, valid_correlation_id

if TYPE_CHECKING:
    from fastapi_outbox.outbox import Outbox

logger = logging.getLogger("fastapi_outbox.subscribers")

__all__ = [
    "DEAD_LETTER_TEMPLATE",
    "BatchUnitOfWork",
    "ConsumerStatus",
    "Subscriber",
    "SubscriberStats",
]

#: Default dead-letter stream / subject of a (stream, group).
DEAD_LETTER_TEMPLATE = "{stream}.{group}.dlq"
#: Longest wait of one fetch: bounds how long a stop waits for the fetch loop.
FETCH_TIMEOUT_SECONDS = 1.0
#: Longest wait for the database's answer when telling an outage from a handler's own
#: connection error.
DATABASE_PING_SECONDS = 5.0
#: Backoff of a paused subscriber (broker or database unreachable).
PAUSE_MIN_SECONDS = 0.2
PAUSE_MAX_SECONDS = 10.0
#: Share of ``shutdown_timeout_seconds`` in-flight handlers get to finish; the rest of it
#: is for releasing what did not finish.
DRAIN_SHARE = 0.7
#: Longest wait for the broker to take back the unfinished deliveries at a stop.
RELEASE_SECONDS = 2.0
_GROUP = __import__("re").compile(r"^[A-Za-z0-9_\-]{1,200}$")
#: Tries of a failing batch of a batch handler as a whole (the first, then retries after
#: backoff) before its messages go one by one, each as a one-element list.
BATCH_HANDLER_TRIES = 2
#: Errors of dead letters that could not be written, kept for their next try.
UNWRITTEN_DEAD_LETTERS_KEPT = 1000

Handler = Callable[..., Awaitable[Any]]
#: ``session.info`` key of a handler session's :class:`_HandlerRun`.
_RUN_KEY = "fastapi_outbox.handler_run"


class _Spoiled(Exception):
    """A handler's rollback reached work it does not own alone: the subscriber's transaction
    (the fast way: run the message again the careful way) or earlier messages' work of its
    batch (run the batch message by message)."""


class _HandlerRun:
    """The transaction a subscriber runs its handler(s) in: the handler's session, the
    unit of work and message of the handler running now, and what a rollback of the
    session undid."""

    __slots__ = ("before", "message", "outer", "session", "spoiled", "subscriber", "uow")

    def __init__(
        self, subscriber: Subscriber, session: AsyncSession, outer: Connection | None
    ) -> None:
        self.subscriber = subscriber
        self.session = session
        #: The fast way: the subscriber's connection, whose transaction the session shares
        #: (None: the careful way, the session in a savepoint of it).
        self.outer = outer
        self.uow: UnitOfWork | None = None
        self.message = ""
        #: The careful way: the session's transaction when the current handler began (work
        #: of earlier handlers of the batch is in it), or None.
        self.before: SessionTransaction | None = None
        self.spoiled = False


#: The transaction of the handler running in this context (None outside handlers).
_HANDLER_RUN: contextvars.ContextVar[_HandlerRun | None] = contextvars.ContextVar(
    "fastapi_outbox.handler_run", default=None
)


def handler_transaction(outbox: Outbox) -> tuple[AsyncSession, UnitOfWork] | None:
    """The session and unit of work of the handler running in this context when it works on
    ``outbox``'s database (its own outbox's, or another outbox's on the same engine), else
    None: ``outbox.unit_of_work()`` called inside a handler joins them."""
    run = _HANDLER_RUN.get()
    if run is None or run.uow is None or run.subscriber.outbox.engine is not outbox.engine:
        return None
    return run.session, run.uow


@sa_event.listens_for(Session, "after_soft_rollback")
def _note_a_rollback_of_the_handler_session(session: Session, previous: SessionTransaction) -> None:
    """A rollback of a handler session's own transaction (not of a savepoint the handler
    began). The fast way, that was the subscriber's transaction, inbox rows included: a new
    one is begun at once, so the handler's later work joins it (and is discarded with it)
    and never commits on its own; the message goes again the careful way. The careful way,
    in a batch: when the transaction began before the current handler, earlier messages'
    work went with it, and the batch goes message by message."""
    run: _HandlerRun | None = session.info.get(_RUN_KEY)
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
    run = _HANDLER_RUN.get()
    if run is None or run.uow is None or transaction.parent is not None:
        return  # no handler runs (a task it started may outlive it)
    if session.info.get(JOINED_KEY):
        return
    _refuse_if_ours(run, session.bind)


@sa_event.listens_for(Session, "after_begin")
def _refuse_a_second_connection(session: Session, transaction: Any, connection: Any) -> None:
    """The same for a session without one bind (``binds=`` per class): judged by the
    connection it takes."""
    run = _HANDLER_RUN.get()
    if run is None or run.uow is None or session.bind is not None:
        return
    if session.info.get(JOINED_KEY):
        return
    _refuse_if_ours(run, connection)


def _refuse_if_ours(run: _HandlerRun, bind: Any) -> None:
    if getattr(bind, "engine", None) is not run.subscriber.outbox.engine.sync_engine:
        return  # another database: not ours to judge
    raise exceptions.UnitOfWorkError(
        f"handler {run.subscriber.name} opened a second session on the outbox's database "
        f"(outbox.session_factory() or a sessionmaker of its own) while handling "
        f"{run.message}: its commit would not go with the message's inbox row, so a "
        "redelivery would apply its effects again. Use the handler's uow.session, or "
        "`async with outbox.unit_of_work() as uow:` inside the handler, which joins the "
        "handler's transaction"
    )


class BatchUnitOfWork(UnitOfWork):
    """The unit of work a batch handler (first parameter ``list[SomeEvent]``) receives.

    ``message_ids[i]`` / ``correlation_ids[i]``: the incoming message id / correlation id of
    the i-th item of the handler's list. The unit of work's own ``causation_id`` and
    ``correlation_id`` are those of the last message of the list: events published without
    ``causation_id=`` name it as their cause; ``uow.publish(event,
    causation_id=uow.message_ids[i], correlation_id=uow.correlation_ids[i])`` names the
    exact one."""

    message_ids: list[str]
    #: The deliveries of the list (their correlation ids are read when asked for).
    _deliveries: list[Delivery]
    _correlation_ids: list[str | None] | None = None

    @property
    def correlation_ids(self) -> list[str | None]:
        if self._correlation_ids is None:
            self._correlation_ids = [_correlation_of(d) for d in self._deliveries]
        return self._correlation_ids

    def publish(
        self,
        event: Event | Message,
        *,
        causation_id: str | None = None,
        correlation_id: str | None = None,
        **options: Any,
    ) -> uuid.UUID:
        """``UnitOfWork.publish`` (same options), with this event's own ``causation_id`` /
        ``correlation_id`` instead of the last message's."""
        for name, given in (("causation_id", causation_id), ("correlation_id", correlation_id)):
            if given is not None and not valid_correlation_id(given):
                raise exceptions.PublishError(f"invalid {name} {given!r}")
        saved = self.causation_id, self.correlation_id
        self.causation_id = causation_id or saved[0]
        self.correlation_id = correlation_id or saved[1]
        try:
            return super().publish(event, **options)
        finally:
            self.causation_id, self.correlation_id = saved


class _Undeliverable(Exception):
    """The message can never be handled (unknown type, invalid payload): dead-letter now."""


class _NotForHandler(Exception):
    """A type of the stream this handler does not take: acknowledge and skip."""


@dataclasses.dataclass(slots=True)
class SubscriberStats:
    """Counters of one subscriber in this process."""

    handled: int = 0
    duplicates: int = 0
    skipped: int = 0
    failures: int = 0
    dead_lettered: int = 0
    #: Dead-letter writes that failed (the message stayed pending and comes back).
    dead_letter_failures: int = 0
    last_handled_at: float | None = None
    last_error: str | None = None


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
    dead_letters_unwritten: int = Field(
        default=0,
        description="Messages of this process whose dead letter could not be written yet "
        "(pending in the group until a later try succeeds).",
    )


def _event_classes() -> list[type[Event]]:
    out: list[type[Event]] = []
    todo: list[type[Event]] = [Event]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            todo.append(sub)
            if not sub.__outbox_abstract__:
                out.append(sub)
    return out


def _harvest_added(uow: UnitOfWork, before: list[Any]) -> list[Any]:
    """Publish, in ``uow``, the events pending on aggregates held by its session or added
    to it by the handler that just ran (``before``: the session's new objects before it):
    ``uow.harvest()`` limited to what this handler added, so a batch of n handlers calls
    ``collect_events`` O(n) times, not O(n²). When the handler flushed (the earlier new
    objects are no longer new) every new object is looked at. Aggregates attached to the
    session publish their events at once when raised. Returns the new objects now."""
    session = uow.session.sync_session
    candidates = held_aggregates(session)
    # The session's pending objects in the order added (``session.new`` builds an identity
    # set of all of them on every call: quadratic over a batch).
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
    nothing). A failure here (the database gone) is only logged: the caller re-raises the
    error that ended the transaction, which is the one to classify."""
    try:
        if conn.in_transaction():
            await conn.rollback()
        if session is not None:
            await session.close()
    except Exception as exc:
        logger.debug("rollback of a handler's transaction failed: %r", exc)
    finally:
        try:
            await conn.close()
        except Exception as exc:
            logger.debug("closing a handler's connection failed: %r", exc)


def _correlation_of(d: Delivery) -> str | None:
    """The message's correlation id header when it is a valid one."""
    correlation = d.headers.get(HEADER_CORRELATION_ID)
    if correlation is not None and not valid_correlation_id(correlation):
        return None
    return correlation


async def _is_database_outage(exc: BaseException, engine: Any) -> bool:
    """The database is unavailable (not a fault of the message), as the dialect's
    classifier decides (:mod:`fastapi_outbox.storage.db_outage`): refusing connections, starting
    up, shutting down, too many clients, pool timeout; an ambiguous ``OSError`` while the
    database does not answer ``SELECT 1`` either. A handler's own SQL error, or its own
    ``OSError`` while the database answers, is the handler's failure."""
    return await db_outage.is_outage(exc, engine, ping_seconds=DATABASE_PING_SECONDS)


class _ReleasedAtStop(BaseException):
    """The database is unavailable and the subscriber stops: the message goes back to the
    broker uncharged instead of waiting in place. A ``BaseException`` (like a cancellation),
    so the retry paths' ``except Exception`` never take it for a failure of the handler."""


class Subscriber:
    """One ``@outbox.subscriber``: a handler, its (stream, group) and its runtime."""

    def __init__(
        self,
        outbox: Outbox,
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
        where = f"subscriber {getattr(handler, '__qualname__', handler)!r}"
        if not inspect.iscoroutinefunction(handler):
            raise exceptions.ConfigurationError(f"{where}: the handler must be an async def")
        if not isinstance(stream, str) or not stream.strip() or any(c.isspace() for c in stream):
            raise exceptions.ConfigurationError(f"{where}: invalid stream {stream!r}")
        if not isinstance(group, str) or not _GROUP.match(group):
            raise exceptions.ConfigurationError(
                f"{where}: group {group!r} must be 1-200 letters, digits, '_' or '-'"
            )
        for name, value, low in (
            ("concurrency", concurrency, 1),
            ("max_attempts", max_attempts, 1),
            ("batch_size", batch_size, 1),
        ):
            if not isinstance(value, int) or value < low:
                raise exceptions.ConfigurationError(f"{where}: {name} must be >= {low}")
        if start not in ("new", "all"):
            raise exceptions.ConfigurationError(
                f"{where}: start must be 'new' (messages added from now on) or 'all' "
                f"(from the beginning of the stream), not {start!r}"
            )
        if retry_max_delay_seconds >= claim_idle_seconds:
            raise exceptions.ConfigurationError(
                f"{where}: retry_max_delay_seconds ({retry_max_delay_seconds:g}) must be below "
                f"claim_idle_seconds ({claim_idle_seconds:g})"
            )
        self.outbox = outbox
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
        self._message_param, self._accepts, self._uow_params, self.batch_handler = self._inspect(
            handler, where
        )
        #: Type name → class the handler takes (looked up once per message).
        self._accepted: dict[str, type[Event]] = {
            c.__outbox_type__: c for c in reversed(self._accepts or ())
        }
        if self.batch_handler and (ordered or not batch):
            raise exceptions.ConfigurationError(
                f"{where}: a batch handler (first parameter a list) takes whole batches in "
                "one transaction: not with ordered=True or batch=False"
            )
        #: One transaction per fetched batch (not for ordered subscribers).
        self.batch = batch and not ordered
        self._types: dict[str, type[Event]] | None = None
        self.stats = SubscriberStats()
        self.consumer: Consumer | None = None
        self.running = False
        self.broker_ok: bool | None = None
        self.paused_since: float | None = None
        self._stop: anyio.Event | None = None
        self._stop_requested_at = 0.0
        self.stopped: anyio.Event | None = None
        self._inflight: dict[str, Delivery] = {}
        self._slot_freed: anyio.Event | None = None
        self._key_locks: dict[str, tuple[anyio.Lock, int]] = {}
        self._rng = random.Random()
        #: message id -> the error of a dead letter that could not be written: used when
        #: the message comes back to be dead-lettered again (bounded).
        self._unwritten_dead_letters: dict[str, str] = {}

    def __repr__(self) -> str:
        return f"Subscriber({self.stream!r}, group={self.group!r}, handler={self.name})"

    # -- the handler's signature -------------------------------------------------------------

    @staticmethod
    def _inspect(
        handler: Handler, where: str
    ) -> tuple[str, tuple[type[Event], ...] | None, list[str], bool]:
        """(message parameter, Event classes it takes or None for ``Message``, names of
        the parameters annotated ``UnitOfWork``, whether it takes a list of them: a batch
        handler)."""
        try:
            hints = typing.get_type_hints(handler)
        except Exception as exc:
            raise exceptions.ConfigurationError(
                f"{where}: cannot resolve the handler's annotations: {exc}"
            ) from exc
        params = list(inspect.signature(handler).parameters.values())
        if not params:
            raise exceptions.ConfigurationError(
                f"{where}: the handler takes no parameter; its first parameter receives the "
                "message (an Event subclass or Message)"
            )
        first = params[0]
        annotation = hints.get(first.name)
        if annotation is None:
            raise exceptions.ConfigurationError(
                f"{where}: annotate the first parameter {first.name!r} with an Event subclass "
                "(or a union of them) or Message"
            )
        many = typing.get_origin(annotation) in (list, abc.Sequence)
        if many:
            args = typing.get_args(annotation)
            if len(args) != 1:
                raise exceptions.ConfigurationError(
                    f"{where}: a batch handler's first parameter {first.name!r} is annotated "
                    "list[SomeEvent] (or Sequence[...], a union of Events or Message inside)"
                )
            annotation = args[0]
        accepts: tuple[type[Event], ...] | None
        if annotation is Message:
            accepts = None
        else:
            members = (
                typing.get_args(annotation)
                if typing.get_origin(annotation) in (typing.Union, types.UnionType)
                else (annotation,)
            )
            if not all(isinstance(m, type) and issubclass(m, Event) for m in members):
                raise exceptions.ConfigurationError(
                    f"{where}: the first parameter {first.name!r} must be annotated with an "
                    f"Event subclass, a union of them or Message, not {annotation!r}"
                )
            accepts = tuple(members)
        uow_types = (UnitOfWork, BatchUnitOfWork) if many else (UnitOfWork,)
        uow_params = [p.name for p in params[1:] if hints.get(p.name) in uow_types]
        others = [
            p.name
            for p in params[1:]
            if p.name not in uow_params and p.default is inspect.Parameter.empty
        ]
        if others:
            raise exceptions.ConfigurationError(
                f"{where}: parameters {others} have no default and are not annotated "
                "UnitOfWork; the handler receives the message and, optionally, its unit of work"
            )
        return first.name, accepts, uow_params, many

    def _event_types(self) -> dict[str, type[Event]]:
        """Event type name → class, among the classes declared when first needed."""
        if self._types is None:
            self._types = {cls.__outbox_type__: cls for cls in _event_classes()}
        return self._types

    def _decode(self, d: Delivery) -> Any:
        if self._accepts is None:
            try:
                payload = json.loads(d.payload) if d.payload else {}
            except ValueError as exc:
                raise _Undeliverable(
                    f"message {d.message_id} on {d.stream!r}: payload is not JSON: {exc}"
                ) from exc
            return Message(
                stream=d.stream,
                type=d.type,
                payload=payload if isinstance(payload, dict) else {"value": payload},
                key=d.key,
                headers=dict(d.headers),
            )
        cls = self._accepted.get(d.type)
        if cls is None:
            known = self._event_types()
            if d.type not in known:
                self._types = None  # classes may have been declared since: look again
                known = self._event_types()
            if d.type in known:
                raise _NotForHandler(d.type)
            accepted = ", ".join(c.__outbox_type__ for c in self._accepts)
            raise _Undeliverable(
                f"unknown event type {d.type!r} of message {d.message_id} on stream "
                f"{d.stream!r}: no Event subclass declares it (handler {self.name} takes "
                f"{accepted})"
            )
        try:
            # The model's validator itself (what ``model_validate_json`` calls): half the cost
            # per message without the Python wrapper.
            return cls.__pydantic_validator__.validate_json(d.payload)
        except ValidationError as exc:
            raise _Undeliverable(
                f"message {d.message_id} on {d.stream!r} is not a valid {d.type}: "
                f"{exc.error_count()} error(s): "
                + "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            ) from exc

    # -- the consumer ------------------------------------------------------------------------

    def consumer_config(self) -> ConsumerConfig:
        return ConsumerConfig(
            stream=self.stream,
            group=self.group,
            consumer_name=self.outbox.instance.replace(":", "-"),
            dead_letter=self.dead_letter,
            claim_idle_seconds=self.claim_idle_seconds,
            max_attempts=self.max_attempts,
            start=self.start,
            dead_letter_shared=self.dead_letter_shared,
            ordered=self.ordered,
            prefetch=self.concurrency * (self.batch_size if self.batch else 1),
        )

    def make_consumer(self) -> Consumer:
        broker = self.outbox.brokers.get(self.broker_name)
        if broker is None:
            raise exceptions.ConfigurationError(
                f"{self!r}: no broker named {self.broker_name!r}; "
                f"configured: {', '.join(self.outbox.brokers) or 'none'}"
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

    # -- running -----------------------------------------------------------------------------

    def stop(self) -> None:
        if self._stop is not None and not self._stop.is_set():
            self._stop_requested_at = time.monotonic()
            self._stop.set()
            if self._slot_freed is not None:
                self._free_slot()  # a fetch loop waiting for a free slot sees the stop now

    @property
    def stopping(self) -> bool:
        return self._stop is not None and self._stop.is_set()

    def _log_extra(self, action: str, d: Delivery | None = None, **more: Any) -> dict[str, Any]:
        extra: dict[str, Any] = {"action": action, "stream": self.stream, "group": self.group}
        if d is not None:
            extra.update(message_id=d.message_id, entry_id=d.entry_id, attempt=d.attempt)
        extra.update(more)
        return extra

    def _pause_for(self, failures: int) -> float:
        return exponential_delay(failures + 1, base=PAUSE_MIN_SECONDS, maximum=PAUSE_MAX_SECONDS)

    async def run(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        """Fetch and handle until :meth:`stop`. Reports started at once: a broker that is
        down at start pauses the subscriber, it does not hold up the app's start."""
        self._stop, self.stopped = anyio.Event(), anyio.Event()
        self._slot_freed = anyio.Event()
        self._inflight.clear()
        self.consumer = consumer = self.make_consumer()
        # A consumer of another package may predate ack_soon: its plain ack then.
        self._ack_batch = getattr(consumer, "ack_soon", None) or consumer.ack
        self.running = True
        task_status.started()
        # Work for the handler tasks: a fetched batch, or one delivery. A fixed set of
        # ``concurrency`` tasks takes it (anyio spawns a task in ~25 µs, an item passes
        # through the stream in ~2.5 µs).
        send, receive = anyio.create_memory_object_stream[tuple[Handler, Any]](math.inf)
        try:
            # The streams close after the task group is done with them (not under workers
            # still waiting on them when the fetch loop fails).
            async with send, receive, anyio.create_task_group() as handlers:
                handlers.start_soon(self._heartbeat)
                for _ in range(self.concurrency):
                    handlers.start_soon(self._worker, receive)
                await self._fetch_loop(consumer, send)
                # The drain's share of the shutdown counts from the stop (the fetch loop may
                # have taken up to FETCH_TIMEOUT_SECONDS to see it).
                budget = self.outbox.settings.shutdown_timeout_seconds * DRAIN_SHARE
                with anyio.move_on_after(budget - (time.monotonic() - self._stop_requested_at)):
                    while self._inflight:
                        await self._wait_slot(1.0)
                handlers.cancel_scope.cancel()
        finally:
            # Whatever did not finish — cancelled by the drain's end, or by a cancellation
            # of run() itself — is still in flight: released to the broker, so another
            # consumer takes it now rather than after claim_idle_seconds.
            self.running = False
            with anyio.CancelScope(shield=True):
                await self._release_unfinished(consumer)
                try:
                    await consumer.aclose()
                except Exception:
                    logger.debug("consumer close failed", exc_info=True)
            self._inflight.clear()
            self.stopped.set()

    async def _release_unfinished(self, consumer: Consumer) -> None:
        left = list(self._inflight.values())
        if not left:
            return
        with anyio.move_on_after(RELEASE_SECONDS) as scope:
            try:
                await consumer.release(left)
            except Exception as exc:
                logger.warning(
                    "release failed",
                    extra=self._log_extra("consumer.release_failed", error=repr(exc)),
                )
                return
        if scope.cancelled_caught:
            logger.warning(
                "release timed out",
                extra=self._log_extra("consumer.release_failed", error="timeout"),
            )
            return
        logger.info(
            "released unfinished messages",
            extra=self._log_extra("consumer.released", count=len(left)),
        )

    async def _wait_slot(self, timeout: float) -> None:
        assert self._slot_freed is not None
        with anyio.move_on_after(timeout):
            await self._slot_freed.wait()

    def _free_slot(self) -> None:
        assert self._slot_freed is not None
        self._slot_freed.set()
        self._slot_freed = anyio.Event()

    async def _worker(self, work: MemoryObjectReceiveStream[tuple[Handler, Any]]) -> None:
        async for handle, item in work:
            await handle(item)

    async def _fetch_loop(
        self, consumer: Consumer, work: MemoryObjectSendStream[tuple[Handler, Any]]
    ) -> None:
        assert self._stop is not None
        stop = self._stop
        set_up = False
        failures = 0
        limit = self.concurrency * (self.batch_size if self.batch else 1)
        while not stop.is_set():
            free = limit - len(self._inflight)
            if free <= 0:
                await self._wait_slot(FETCH_TIMEOUT_SECONDS)
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
                    extra=self._log_extra("consumer.fetch_failed", error=repr(exc)[:300]),
                )
                await self._paused(exc, failures, stop)
                continue
            if failures:
                logger.info("broker reachable again", extra=self._log_extra("consumer.resumed"))
            failures = 0
            self.broker_ok = True
            self.paused_since = None
            now = time.monotonic()
            for d in batch:
                d.fetched_at = now
                self._inflight[d.entry_id] = d
            if self.batch and len(batch) > 1:
                work.send_nowait((self._handle_batch, batch))
            else:
                for d in batch:
                    work.send_nowait((self._handle, d))

    async def _paused(self, exc: BaseException, failures: int, stop: anyio.Event) -> None:
        if self.broker_ok is not False:
            logger.warning(
                "broker unavailable, consumer paused",
                extra=self._log_extra("consumer.paused", error=safe_error(exc)),
            )
            self.paused_since = time.time()
        self.broker_ok = False
        self.stats.last_error = safe_error(exc)
        with anyio.move_on_after(self._pause_for(failures)):
            await stop.wait()

    async def _heartbeat(self) -> None:
        """Touch deliveries handled for long, so no other consumer reclaims them."""
        every = max(0.05, self.claim_idle_seconds / 3)
        while True:
            await anyio.sleep(every)
            cutoff = time.monotonic() - every
            old = [d for d in list(self._inflight.values()) if d.fetched_at <= cutoff]
            if old and self.consumer is not None:
                try:
                    await self.consumer.touch(old)
                except Exception as exc:
                    logger.debug("touch failed: %r", exc)

    # -- one message -------------------------------------------------------------------------

    async def _handle(self, d: Delivery) -> None:
        finished = False
        try:
            if self.ordered and d.key is not None:
                lock = self._lock_for(d.key)
                try:
                    async with lock:
                        await self._process(d, in_place=True)
                finally:
                    self._unlock_for(d.key)
            else:
                await self._process(d, in_place=False)
            finished = True
        except _ReleasedAtStop:
            await self._release_unsettled([d])
        finally:
            # Cancelled (a stop): left in flight, so run() releases it to the broker.
            if finished:
                self._inflight.pop(d.entry_id, None)
            self._free_slot()

    async def _handle_batch(self, batch: list[Delivery]) -> None:
        """A fetched batch in one transaction: one multi-row inbox insert, the handlers one
        after the other (each with a unit of work of its own on the shared session, so its
        events carry its message as cause), one commit, one ack. When anything fails, the
        transaction rolls back and every message of the batch goes the per-message way
        (its own transaction, retries, dead letter): one poison message costs its batch
        one extra pass, never an effect."""
        finished = False
        try:
            # Parallel lists (not a tuple per message: fewer objects for the collector).
            todo: list[Delivery] = []
            messages: list[Any] = []
            # A batch handler's redelivered messages go one by one: a poison message, back
            # for another attempt, does not fail a whole batch again.
            alone = 1 if self.batch_handler else self.max_attempts
            for d in batch:
                if d.attempt > alone:  # dead-lettered / retried on the careful path
                    await self._process_one(d)
                    continue
                try:
                    messages.append(self._decode(d))
                except (_Undeliverable, _NotForHandler):
                    await self._process_one(d)
                else:
                    todo.append(d)
            if not todo:
                finished = True
                return
            try:
                if self.batch_handler:
                    new, duplicates = await self._run_batch_retrying(todo, messages)
                else:
                    new, duplicates = await self._run_batch(todo, messages)
            except Exception as exc:
                logger.info(
                    "batch failed, handling its messages one by one",
                    extra=self._log_extra(
                        "consumer.batch_failed", count=len(todo), error=repr(exc)[:200]
                    ),
                )
                for d in todo:
                    await self._process_one(d)
                finished = True
                return
            self.stats.handled += new
            self.stats.duplicates += duplicates
            self.stats.last_handled_at = time.time()
            assert self.consumer is not None
            try:  # the fetch loop fetches again at once (this batch frees its slots)
                await self._ack_batch(todo)
            except Exception as exc:
                logger.warning(
                    "ack failed; the messages will be redelivered and skipped",
                    extra=self._log_extra("consumer.ack_failed", error=repr(exc)[:300]),
                )
            finished = True
        except _ReleasedAtStop:
            await self._release_unsettled(batch)
        finally:
            # Cancelled (a stop): what did not finish stays in flight, so run() releases
            # it to the broker.
            if finished:
                for d in batch:
                    self._inflight.pop(d.entry_id, None)
            self._free_slot()

    async def _process_one(self, d: Delivery) -> None:
        """A message of a batch on the per-message path; no longer in flight once done."""
        await self._process(d, in_place=False)
        self._inflight.pop(d.entry_id, None)

    async def _waited_out_database(
        self, exc: BaseException, outages: int, what: str, d: Delivery | None = None
    ) -> bool:
        """When ``exc`` is the database being unreachable: note it, wait the pause for the
        ``outages + 1``-th outage in a row, and return True (the caller retries in place, no
        attempt charged). When the subscriber stops (before or during the wait), raise
        :class:`_ReleasedAtStop`: the message goes back to the broker, uncharged."""
        if not await _is_database_outage(exc, self.outbox.engine):
            return False
        self.stats.last_error = f"database unreachable: {type(exc).__name__}"
        if not self.stopping:
            logger.warning(
                f"database unreachable, retrying {what} in place",
                extra=self._log_extra("consumer.db_unavailable", d, error=repr(exc)[:200]),
            )
            assert self._stop is not None
            with anyio.move_on_after(self._pause_for(outages + 1)):
                await self._stop.wait()
        if self.stopping:
            raise _ReleasedAtStop()
        return True

    async def _release_unsettled(self, deliveries: Sequence[Delivery]) -> None:
        """Give back to the broker, uncharged, those of ``deliveries`` not yet acknowledged,
        dead-lettered or retried (still in ``_inflight``): the database went away while the
        subscriber stops."""
        left = [d for d in deliveries if self._inflight.pop(d.entry_id, None) is not None]
        if not left or self.consumer is None:
            return
        with anyio.CancelScope(shield=True), anyio.move_on_after(2.0):
            try:
                await self.consumer.release(left)
            except Exception as exc:
                logger.warning(
                    "release failed",
                    extra=self._log_extra("consumer.release_failed", error=repr(exc)),
                )
                return
        logger.info(
            "database unreachable at shutdown: messages released, no attempt charged",
            extra=self._log_extra("consumer.released", count=len(left)),
        )

    async def _run_batch_retrying(
        self, todo: list[Delivery], messages: list[Any]
    ) -> tuple[int, int]:
        """A batch handler's batch: retried as a whole with backoff (``BATCH_HANDLER_TRIES``
        tries; the database unreachable costs no try), then the last error is raised and
        the caller goes message by message. A handler that rolled back its session costs no
        try: the batch goes again at once, the careful way."""
        tries = outages = 0
        careful = False
        while True:
            try:
                return await self._run_batch(todo, messages, careful=careful)
            except _Spoiled:
                if careful:
                    raise
                careful = True
            except Exception as exc:
                if await self._waited_out_database(exc, outages, "the batch"):
                    outages += 1
                    continue
                tries += 1
                self.stats.last_error = safe_error(exc)
                if tries >= BATCH_HANDLER_TRIES or self.stopping:
                    raise
                delay = self._retry_delay(tries)
                logger.warning(
                    "batch handler failed, retrying the batch",
                    extra=self._log_extra(
                        "consumer.batch_retry",
                        count=len(todo),
                        error=repr(exc)[:200],
                        retry_in_seconds=round(delay, 3),
                    ),
                )
                await anyio.sleep(delay)

    async def _run_batch(
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
          once (the handler's later work is discarded with it) and :class:`_Spoiled` is
          raised after the handler — the caller runs the message(s) again the careful way
          (one message) or message by message (a batch);
        * the careful way (``careful=True``, ``"create_savepoint"``): the session's
          transaction is a savepoint of the subscriber's (SAVEPOINT and RELEASE: two round
          trips), so ``session.rollback()`` goes back to it and the inbox rows stay. The
          per-message handlers of a batch share that savepoint: a rollback by one of them
          that undoes earlier messages' work raises :class:`_Spoiled`."""
        outbox = self.outbox
        ids = [d.message_id for d in todo]
        stream = todo[0].stream
        streams = stream if all(d.stream == stream for d in todo) else [d.stream for d in todo]
        conn = await outbox.engine.connect()
        session: AsyncSession | None = None
        ran: set[str] = set()
        try:
            await conn.begin()
            fresh = await outbox.inbox.record_many(conn, self.group, ids, streams)
            if fresh:
                session = outbox.session_factory(
                    bind=conn,
                    join_transaction_mode="create_savepoint" if careful else "rollback_only",
                )
                session.info[JOINED_KEY] = True
                run = _HandlerRun(self, session, None if careful else conn.sync_connection)
                session.info[_RUN_KEY] = run
                token = _HANDLER_RUN.set(run)
                try:
                    if self.batch_handler:
                        await self._run_batch_handler(run, todo, messages, fresh, ran)
                    else:
                        await self._run_handlers(run, todo, messages, fresh, ran)
                finally:
                    _HANDLER_RUN.reset(token)
                    run.uow = None
                # Flushes and writes the events' outbox rows (the careful way: releases
                # the savepoint).
                await session.commit()
                if run.spoiled:  # rolled back in a hook of the commit
                    raise _Spoiled(f"handler {self.name}: the session rolled back")
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
            for sink in state.take_notify():
                await typing.cast("Outbox", sink)._notify_after_commit()
        return len(ran), len(todo) - len(ran)

    async def _run_handlers(
        self,
        run: _HandlerRun,
        todo: list[Delivery],
        messages: list[Any],
        fresh: set[str],
        ran: set[str],
    ) -> None:
        """The per-message handler on each new message of ``todo``, one after the other on
        the shared session, each with a unit of work of its own (its events carry its
        message as cause)."""
        outbox = self.outbox
        session = run.session
        sync_session = session.sync_session
        before: list[Any] = []  # new objects on the session before the current handler
        for d, message in zip(todo, messages, strict=True):
            if d.message_id not in fresh or d.message_id in ran:
                continue
            ran.add(d.message_id)
            correlation, causation, traceparent = self._context(d)
            uow = UnitOfWork(
                outbox,
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
                current = sync_session.get_transaction()
                if current is None and (uow._state.queued or not sync_session._is_clean()):
                    current = sync_session.begin()
                run.before = current
            uow._open()
            try:
                await self.handler(message, **{name: uow for name in self._uow_params})
                before = _harvest_added(uow, before)
            finally:
                uow._close()
            if run.spoiled:
                raise _Spoiled(
                    f"handler {self.name} rolled back its session while handling message "
                    f"{d.message_id}: handled again in a savepoint of its own"
                )

    async def _run_batch_handler(
        self,
        run: _HandlerRun,
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
        self, run: _HandlerRun, deliveries: list[Delivery], messages: list[Any]
    ) -> None:
        """The batch handler on the new messages of a batch, in the batch's transaction."""
        # The context of the last message; the others' correlation ids when asked for.
        correlation, causation, traceparent = self._context(deliveries[-1])
        uow = BatchUnitOfWork(
            self.outbox,
            run.session,
            correlation_id=correlation,
            causation_id=causation,
            traceparent=traceparent,
        )
        uow._deliveries = deliveries
        uow.message_ids = [d.message_id for d in deliveries]
        run.uow = uow
        run.message = (
            f"message {deliveries[0].message_id}"
            if len(deliveries) == 1
            else f"a batch of {len(deliveries)} messages from {deliveries[0].message_id}"
        )
        uow._open()
        try:
            await self.handler(messages, **{name: uow for name in self._uow_params})
            _harvest_added(uow, [])
        finally:
            uow._close()
        if run.spoiled:
            raise _Spoiled(
                f"handler {self.name} rolled back its session while handling {run.message}: "
                "handled again in a savepoint of its own"
            )

    def _context(self, d: Delivery) -> tuple[str | None, str | None, str | None]:
        """(correlation id carried over, causation id = the message id, traceparent)."""
        causation = d.message_id if valid_correlation_id(d.message_id) else None
        return _correlation_of(d), causation, d.headers.get(HEADER_TRACEPARENT)

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

    def _retry_delay(self, attempt: int) -> float:
        return exponential_delay(
            attempt,
            base=self.retry_base_delay_seconds,
            maximum=self.retry_max_delay_seconds,
            jitter=0.25,
            rng=self._rng,
        )

    async def _process(self, d: Delivery, *, in_place: bool) -> None:
        assert self.consumer is not None
        consumer = self.consumer
        attempt = d.attempt
        if attempt > self.max_attempts:
            if await self._handled_before(d):
                # Committed, but the ack was lost (a kill, a broker restart) every time: its
                # effects are applied; a dead letter would say otherwise.
                self.stats.duplicates += 1
                await self._ack(d)
                return
            await self._dead_letter(
                d,
                f"delivered {attempt} times, more than max_attempts={self.max_attempts}, without "
                "being acknowledged: the consumer crashed or stalled on it every time",
            )
            return
        try:
            message = self._decode(d)
        except _Undeliverable as exc:
            await self._dead_letter(d, str(exc))
            return
        except _NotForHandler:
            self.stats.skipped += 1
            await self._ack(d)
            return
        outages = 0
        while True:
            try:
                new = await self._run_handler(d, message)
            except Exception as exc:
                if await self._waited_out_database(exc, outages, "the message", d):
                    outages += 1
                    continue
                self.stats.failures += 1
                error = redact(f"{type(exc).__name__}: {exc}")  # kept in the dead letter
                self.stats.last_error = error[:300]
                if attempt >= self.max_attempts:
                    logger.warning(
                        "handler failed, dead-lettering",
                        extra=self._log_extra("consumer.failed", d, error=error[:300]),
                        exc_info=True,
                    )
                    await self._dead_letter(
                        d, f"handler {self.name} failed on attempt {attempt}: {error}"
                    )
                    return
                delay = self._retry_delay(attempt)
                logger.warning(
                    "handler failed, will retry",
                    extra=self._log_extra(
                        "consumer.failed", d, error=error[:300], retry_in_seconds=round(delay, 3)
                    ),
                )
                if not in_place:
                    try:
                        await consumer.retry(d, delay)
                    except Exception as retry_exc:  # redelivered after claim_idle anyway
                        logger.warning(
                            "retry request failed",
                            extra=self._log_extra(
                                "consumer.retry_failed", d, error=repr(retry_exc)
                            ),
                        )
                    self._inflight.pop(d.entry_id, None)  # settled: not released at a stop
                    return
                attempt += 1
                await anyio.sleep(delay)
                continue
            if new:
                self.stats.handled += 1
            else:
                self.stats.duplicates += 1
            self.stats.last_handled_at = time.time()
            await self._ack(d)
            return

    async def _handled_before(self, d: Delivery) -> bool:
        """Whether the group's inbox holds ``d``'s message id (its transaction committed).
        The database unavailable: waited out in place, like a handler's transaction."""
        outages = 0
        while True:
            try:
                return await self.outbox.inbox.contains(self.group, d.message_id)
            except Exception as exc:
                if await self._waited_out_database(exc, outages, "the inbox look-up", d):
                    outages += 1
                    continue
                logger.warning(
                    "inbox look-up failed; dead-lettering",
                    extra=self._log_extra("consumer.inbox_failed", d, error=safe_error(exc)),
                )
                return False

    async def _run_handler(self, d: Delivery, message: Any) -> bool:
        """One transaction: inbox row, then the handler (a batch handler: on a one-element
        list); True when the message was new. The fast way first; the careful way when the
        handler rolled back its session."""
        try:
            new, _ = await self._run_batch([d], [message])
        except _Spoiled:
            new, _ = await self._run_batch([d], [message], careful=True)
        return new > 0

    async def _ack(self, d: Delivery) -> None:
        assert self.consumer is not None
        try:
            await self.consumer.ack([d])
        except Exception as exc:
            # Committed: a redelivery will find the inbox row and be skipped.
            logger.warning(
                "ack failed; the message will be redelivered and skipped",
                extra=self._log_extra("consumer.ack_failed", d, error=repr(exc)[:300]),
            )
        self._inflight.pop(d.entry_id, None)  # settled: not released at a stop

    async def _dead_letter(self, d: Delivery, error: str) -> None:
        assert self.consumer is not None
        unwritten = self._unwritten_dead_letters
        error = (
            unwritten.pop(d.message_id, "") or error
        )  # the first reason, not "delivered n times"
        try:
            await self.consumer.dead_letter(d, error)
        except Exception as exc:
            if len(unwritten) < UNWRITTEN_DEAD_LETTERS_KEPT:
                unwritten[d.message_id] = error
            # Not acknowledged: the message stays pending (no broker-side delivery limit
            # drops it) and is dead-lettered again when it comes back, after a backoff.
            self.stats.dead_letter_failures += 1
            self.stats.last_error = f"dead-lettering failed: {type(exc).__name__}: {exc}"[:300]
            logger.error(
                "dead-lettering failed; the message stays pending and will be redelivered",
                extra=self._log_extra("consumer.dead_letter_failed", d, error=repr(exc)[:300]),
            )
            try:
                await self.consumer.retry(d, self._retry_delay(d.attempt))
            except Exception:  # redelivered after claim_idle_seconds anyway
                logger.debug("retry after a failed dead letter failed", exc_info=True)
            return
        self._inflight.pop(d.entry_id, None)  # settled: not released at a stop
        self.stats.dead_lettered += 1
        self.stats.last_error = error[:300]
        logger.error(
            "message dead-lettered",
            extra=self._log_extra(
                "consumer.dead_lettered", d, dead_letter=self.dead_letter, error=error[:300]
            ),
        )


def subscriber_options(outbox: Outbox, **given: Any) -> dict[str, Any]:
    """Decorator options with the settings' defaults filled in."""
    s = outbox.settings
    defaults = {
        "concurrency": s.consumer_concurrency,
        "max_attempts": s.consumer_max_attempts,
        "batch_size": s.consumer_batch_size,
        "claim_idle_seconds": s.consumer_claim_idle_seconds,
        "retry_base_delay_seconds": s.consumer_retry_base_delay_seconds,
        "retry_max_delay_seconds": s.consumer_retry_max_delay_seconds,
        "dead_letter": DEAD_LETTER_TEMPLATE,
    }
    return {
        k: (defaults[k] if given.get(k) is None and k in defaults else v) for k, v in given.items()
    }


def register(
    outbox: Outbox, handler: Handler, stream: str, group: str, options: dict[str, Any]
) -> Subscriber:
    broker = options.pop("broker", None) or outbox.default_broker
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
    sub = Subscriber(outbox, handler, stream=stream, group=group, broker=broker, **options)
    outbox.subscribers.append(sub)
    return sub


async def stop_all(subscribers: Sequence[Subscriber]) -> None:
    """Stop subscribers and wait for them (the caller bounds the wait)."""
    for sub in subscribers:
        sub.stop()
    for sub in subscribers:
        if sub.running and sub.stopped is not None:
            await sub.stopped.wait()

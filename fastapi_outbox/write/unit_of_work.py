"""``UnitOfWork`` and the request-scoped ``unit_of_work`` dependency.

A unit of work is one ``AsyncSession``: events published on it, or raised on aggregates the
session tracks, become outbox rows written in the transaction that commits them — however the
code commits (see `fastapi_outbox.write.session_events`). The request's unit of work commits
when the handler returns, **before** the response is sent. If the handler raises or the
commit fails, everything not yet committed rolls back and the client gets an error.

FastAPI ends a yield dependency of the default scope after the response is sent, so a
failing commit there would still answer 200. ``unit_of_work`` therefore depends on an
inner generator declared with ``scope="function"``, which FastAPI closes as soon as the
endpoint returns; users keep writing ``Depends(unit_of_work)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import datetime as dt
import json
import re
import uuid
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any

import anyio
from fastapi import Depends, HTTPException, Request
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from fastapi_outbox import exceptions
from fastapi_outbox.events import (
    HEADER_CAUSATION_ID,
    HEADER_CORRELATION_ID,
    HEADER_MESSAGE_ID,
    HEADER_OCCURRED_AT,
    HEADER_TENANT,
    HEADER_TYPE,
    INTERNAL_HEADERS,
    Event,
    Message,
    check_text,
    payload_of,
    refuse_unstorable,
    uuid7,
)
from fastapi_outbox.storage import clock
from fastapi_outbox.write.commit import commit, roll_back
from fastapi_outbox.write.producer import Producer
from fastapi_outbox.write.session_events import state_of
from fastapi_outbox.write.unavailable import unavailable

__all__ = [
    "HANDLER_TRANSACTION",
    "HandlerTransaction",
    "UnitOfWork",
    "UnitOfWorkDep",
    "activate",
    "close",
    "transaction",
    "unit_of_work",
]

CORRELATION_HEADER = "X-Correlation-ID"
CORRELATION_ID_MAX_LENGTH = 128
_CORRELATION_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}$")
_STREAM = re.compile(r"^[^\s\x00]{1,255}$")
_RESERVED = frozenset({HEADER_MESSAGE_ID, HEADER_TYPE, HEADER_OCCURRED_AT})
#: Header names are HTTP tokens (RFC 9110 ``tchar``): no quote, colon, space or non-ASCII, so a
#: name cannot smuggle JSON syntax or break a broker's header block.
_HEADER_NAME = re.compile(r"^[A-Za-z0-9!#$%&'*+\-.^_`|~]{1,128}$")
#: Prefix of the headers NATS interprets (``Nats-Msg-Id``, ``Nats-Expected-Stream``, ...).
_NATS_PREFIX = "nats-"


def normalise_header_name(name: str) -> str:
    """How reserved names are compared: case-insensitively, ``_`` as ``-``."""
    return name.lower().replace("_", "-")


def valid_correlation_id(value: str) -> bool:
    return bool(_CORRELATION_ID.match(value))


def correlation_from_headers(headers: Any) -> tuple[str | None, str | None]:
    """``(correlation_id, traceparent)`` from request headers, validated.

    Raises ``ValueError`` naming the header when ``X-Correlation-ID`` is too long or holds
    characters other than letters, digits and ``._:-``; an invalid ``traceparent`` is ignored
    (it is not ours to reject)."""
    correlation = headers.get(CORRELATION_HEADER)
    if correlation is not None and not valid_correlation_id(correlation):
        raise ValueError(
            f"invalid {CORRELATION_HEADER} header: at most {CORRELATION_ID_MAX_LENGTH} "
            "characters among letters, digits and . _ : -"
        )
    traceparent = headers.get("traceparent")
    if traceparent is not None and not _TRACEPARENT.match(traceparent):
        traceparent = None
    if correlation is None and traceparent is not None:
        match = _TRACEPARENT.match(traceparent)
        assert match is not None
        correlation = match.group(1)
    return correlation, traceparent


class UnitOfWork:
    """One transaction: ``session`` for business data, ``publish`` for events."""

    def __init__(
        self,
        producer: Producer,
        session: AsyncSession,
        *,
        correlation_id: str | None = None,
        causation_id: str | None = None,
        traceparent: str | None = None,
    ) -> None:
        if correlation_id is not None and not valid_correlation_id(correlation_id):
            raise exceptions.UnitOfWorkError(f"invalid correlation_id {correlation_id!r}")
        if causation_id is not None and not valid_correlation_id(causation_id):
            raise exceptions.UnitOfWorkError(f"invalid causation_id {causation_id!r}")
        self._producer = producer
        self.session = session
        self.correlation_id = correlation_id or str(uuid7())
        self.causation_id = causation_id
        self.traceparent = traceparent
        self._state = state_of(session.sync_session)
        self._closed = False
        #: The unit of work's own transaction committed (``outbox.unit_of_work()``): true
        #: also when a cancellation that came during the COMMIT was raised after it.
        self.committed = False

    @property
    def pending(self) -> int:
        """Outbox rows queued on the session, not yet written (they are written by the
        next commit, or by [`flush`][fastapi_outbox.UnitOfWork.flush])."""
        return self._state.count(self._producer)

    @property
    def queued(self) -> list[dict[str, Any]]:
        """Those rows themselves (the dicts a capture writes), oldest first."""
        return [row for _, sink, row in self._state.queued if sink is self._producer]

    def publish(
        self,
        event: Event | Message,
        *,
        key: str | None = None,
        headers: dict[str, str] | None = None,
        broker: str | None = None,
        delay: float | dt.timedelta | None = None,
        deliver_at: dt.datetime | None = None,
    ) -> uuid.UUID:
        """Queue ``event`` for the outbox; returns its message id.

        ``delay`` (seconds or a timedelta, counted from the commit) or ``deliver_at`` (a
        timezone-aware datetime): the message is not published before then; at most
        ``max_delay_seconds`` ahead. Raises [`PublishError`][fastapi_outbox.PublishError]
        here, where the mistake is made (unknown broker, payload not serialisable or too
        large, bad headers, a bad delay)."""
        if self._closed:
            raise exceptions.UnitOfWorkError(
                "this unit of work has already committed or rolled back"
            )
        settings = self._producer.settings
        target = self._producer.resolve_broker(broker)
        if isinstance(event, Event):
            encoded = _encode_event(event, key, headers)
        elif isinstance(event, Message):
            encoded = _encode_message(event, key, headers)
        else:
            raise TypeError(f"publish() takes an Event or Message, not {type(event).__name__}")
        stream, type_name, external, payload, key, extra_headers = encoded
        _check_message(event, stream, type_name, payload, key, settings.max_payload_bytes)
        user_headers = _check_headers(extra_headers, stream, type_name)
        due_in, due_at = _delay(delay, deliver_at, settings.max_delay_seconds, type_name)
        message_id = uuid7()
        payloads = self._producer.payloads
        if user_headers:
            payloads.refuse_reserved(user_headers, type_name)
        #: Keys a payload stage adds to the message's first row until the commit writes it
        #: (claim-check: the payload for its store, in the producer's transaction).
        first_row: dict[str, Any] = {}
        if payloads.seals:  # encryption, then claim-check (fastapi_outbox.payloads)
            payload, user_headers = payloads.seal(
                str(message_id), stream, type_name, payload, user_headers,
                self.session.sync_session, row=first_row,
            )  # fmt: skip
        rows: list[dict[str, Any]] = [
            {
                "id": row_id,
                "broker": broker_name,
                "stream": stream,
                "type": type_name,
                "key": key,
                "payload": payload,
                "headers": json.dumps(row_headers, separators=(",", ":")),
                "delay": due_in,
                "deliver_at": due_at,
            }
            for broker_name, row_id, row_headers in self._targets(
                target, message_id, type_name, user_headers, external=external
            )
        ]
        if first_row:
            rows[0].update(first_row)
        self._state.queue(self.session.sync_session, self._producer, rows)
        return message_id

    def _targets(
        self,
        target: str,
        message_id: uuid.UUID,
        type_name: str,
        user_headers: dict[str, str],
        *,
        external: bool,
    ) -> list[tuple[str, uuid.UUID, dict[str, str]]]:
        """``(broker, row id, headers)`` of each row of one message: the internal broker
        with every header, and with ``external``, each external broker with the headers
        that are not internal-only, under a row id of its own."""
        base = {
            HEADER_MESSAGE_ID: str(message_id),
            HEADER_TYPE: type_name,
            HEADER_OCCURRED_AT: dt.datetime.now(dt.UTC).isoformat(),
            HEADER_CORRELATION_ID: self.correlation_id,
        }
        if self.causation_id is not None:
            base[HEADER_CAUSATION_ID] = self.causation_id
        if self._producer.tenant is not None:
            base[HEADER_TENANT] = self._producer.tenant
        trace = self._producer.trace_headers(self.traceparent)
        internal_headers = {**user_headers, **trace, **base}
        targets = [(target, message_id, internal_headers)]
        if external:
            public = {k: v for k, v in internal_headers.items() if k not in INTERNAL_HEADERS}
            targets += [(name, uuid7(), public) for name in self._producer.external_brokers]
        return targets

    def _publish_raised(self, event: Event | Message) -> None:
        """Publisher of events raised on the session's aggregates (``raise_event``)."""
        self.publish(event)

    def _harvest(self) -> int:
        """Publish the events pending on aggregates the session tracks; returns how many."""
        return self._state.harvest(self.session.sync_session)

    async def flush(self) -> None:
        """Flush the session and write the queued outbox rows in the current transaction
        (or savepoint) now, instead of at commit."""
        await self.session.run_sync(self._state.write)

    def _activate(self) -> None:
        """From now on, events raised on the session's aggregates are published through
        this unit of work (the innermost active one wins): called when its block, or its
        handler, begins."""
        self._state.push_publisher(self._publish_raised)

    def _close(self) -> None:
        """The block or the handler ended: raised events go to the unit of work active
        before this one, and [`publish`][fastapi_outbox.UnitOfWork.publish] refuses from now on."""
        self._closed = True
        self._state.pop_publisher(self._publish_raised)

    def _mark_committed(self) -> None:
        self.committed = True

    def _take_notify(self) -> list[Any]:
        """The outboxes still to be told about a commit made outside SQLAlchemy's greenlet
        (a sync ``Session``; an ``AsyncSession``'s commit has told them already)."""
        return self._state.take_notify()


def activate(uow: UnitOfWork) -> None:
    """``uow`` becomes the publisher of the events raised on its session's aggregates (the
    innermost active one wins): its block, or its handler, begins."""
    uow._activate()


def close(uow: UnitOfWork) -> None:
    """``uow``'s block or handler ended: raised events go to the unit of work active before
    it, and its ``publish`` refuses from now on."""
    uow._close()


class HandlerTransaction:
    """The transaction of a subscriber's handler running in this context (set by
    `fastapi_outbox.consume.processing`): the handler's session and the unit of work and
    message of the handler running now. ``outbox.unit_of_work()`` inside the handler joins
    it (`transaction`)."""

    __slots__ = ("ended", "engine", "message", "name", "session", "task", "uow")

    def __init__(self, engine: AsyncEngine, name: str, session: AsyncSession) -> None:
        #: The outbox's database and the subscriber's name (for a refused second session).
        self.engine = engine
        self.name = name
        self.session = session
        self.uow: UnitOfWork | None = None
        self.message = ""
        #: The task the handlers run in: the only one that may join their transaction.
        self.task = asyncio.current_task()
        #: The handlers are done: a task they started that is still running may not join.
        self.ended = False


#: The transaction of the handler running in this context (None outside handlers).
HANDLER_TRANSACTION: contextvars.ContextVar[HandlerTransaction | None] = contextvars.ContextVar(
    "fastapi_outbox.handler_run", default=None
)


def _handler_transaction(engine: AsyncEngine) -> HandlerTransaction | None:
    """The transaction of the handler running in this context when it works on ``engine``
    (its own outbox's database, or another outbox's on the same engine) and a handler runs
    now, else None."""
    run = HANDLER_TRANSACTION.get()
    if run is None or run.engine is not engine:
        return None
    if run.ended:
        raise exceptions.UnitOfWorkError(
            f"a task started by handler {run.name} while handling {run.message} outlived "
            "the handler and called outbox.unit_of_work(): the handler's transaction has "
            "ended (committed with the message's inbox row, or rolled back), and a unit of "
            "work of the task's own would not go with that row. Await the task inside the "
            "handler, or publish an event and do the work in a subscriber of it"
        )
    if run.uow is None:
        return None
    if asyncio.current_task() is not run.task:
        raise exceptions.UnitOfWorkError(
            f"handler {run.name} called outbox.unit_of_work() from a second task "
            f"(asyncio.gather, create_task, a task group) while handling {run.message}: "
            "the handler's transaction is one session on one connection, which two tasks "
            "cannot share. Run the blocks one after the other in the handler's task"
        )
    return run


@contextlib.asynccontextmanager
async def transaction(
    producer: Producer,
    session: AsyncSession | None = None,
    *,
    correlation_id: str | None = None,
    causation_id: str | None = None,
    traceparent: str | None = None,
) -> AsyncIterator[UnitOfWork]:
    """The body of ``outbox.unit_of_work()``: a unit of work on a session of its own that
    commits on exit and rolls back on error, or — ``session`` given — on the caller's
    session, in a savepoint that the caller's commit or rollback decides. Inside a
    subscriber's handler, without ``session``, it joins the handler's session that way (a
    savepoint of the handler's transaction, the handler's correlation and causation ids
    and traceparent unless given)."""
    if session is None:
        run = _handler_transaction(producer.engine)
        if run is not None:
            handler_uow = run.uow
            assert handler_uow is not None
            session = run.session
            correlation_id = correlation_id or handler_uow.correlation_id
            causation_id = causation_id or handler_uow.causation_id
            traceparent = traceparent or handler_uow.traceparent
    own = session is None
    sess = producer.session_factory() if session is None else session
    uow = UnitOfWork(
        producer,
        sess,
        correlation_id=correlation_id,
        causation_id=causation_id,
        traceparent=traceparent,
    )
    uow._activate()
    try:
        if own:
            try:
                yield uow
                await commit(sess, uow._mark_committed)
            except BaseException:
                await roll_back(sess)
                raise
        else:
            async with sess.begin_nested():
                yield uow
    finally:
        uow._close()
        if own:
            with anyio.CancelScope(shield=True):
                await sess.close()
    for producer_told in uow._take_notify():  # only for a commit made outside the greenlet
        await producer_told.relays.notify_after_commit()


def _encode_event(
    event: Event, key: str | None, headers: dict[str, str] | None
) -> tuple[str, str, bool, str, str | None, dict[str, str] | None]:
    """``(stream, type, external, payload JSON, key, headers)`` of an ``Event``."""
    cls = type(event)
    if cls.__outbox_abstract__ or cls.__outbox_stream__ is None:
        raise exceptions.EventDefinitionError(
            f"{cls.__qualname__} is abstract (no stream): publish a concrete subclass"
        )
    stream = cls.__outbox_stream__
    type_name = cls.__outbox_type__
    try:
        payload = event.model_dump_json()
    except Exception as exc:
        # An unpaired surrogate makes pydantic's UTF-8 encoding fail: name its field.
        refuse_unstorable(event.model_dump(), stream, type_name)
        raise exceptions.SerializationError(
            f"event {type_name} on stream {stream!r} cannot be serialised: {exc}"
        ) from exc
    if key is None and cls.__outbox_key__ is not None:
        value = getattr(event, cls.__outbox_key__)
        key = None if value is None else str(value)
    return stream, type_name, cls.__outbox_external__, payload, key, headers


def _encode_message(
    event: Message, key: str | None, headers: dict[str, str] | None
) -> tuple[str, str, bool, str, str | None, dict[str, str] | None]:
    """``(stream, type, external, payload JSON, key, headers)`` of an explicit ``Message``."""
    stream, type_name, external = event.stream, event.type, event.external
    if not isinstance(event.payload, dict):
        raise exceptions.SerializationError(
            f"message {type_name} on stream {stream!r}: payload must be a dict, "
            f"not {type(event.payload).__name__}"
        )
    try:
        # ensure_ascii=False: UTF-8 as it is, as pydantic writes an Event's payload
        # (an unpaired surrogate stays one, and fails the encode below).
        payload = json.dumps(
            event.payload, separators=(",", ":"), allow_nan=False, ensure_ascii=False
        )
    except (TypeError, ValueError) as exc:
        raise exceptions.SerializationError(
            f"payload of message {type_name} on stream {stream!r} is not JSON-serialisable: {exc}"
        ) from exc
    key = key if key is not None else event.key
    return stream, type_name, external, payload, key, {**event.headers, **(headers or {})}


def _check_message(
    event: Event | Message,
    stream: str,
    type_name: str,
    payload: str,
    key: str | None,
    max_payload_bytes: int,
) -> None:
    """Refuse what cannot be stored or published: a stream with whitespace, NUL characters
    or unpaired surrogates anywhere, a payload over ``max_payload_bytes``, a long key."""
    check_text(stream, "stream", stream, type_name)
    check_text(type_name, "type", stream, type_name)
    if not isinstance(stream, str) or not _STREAM.match(stream):
        raise exceptions.PublishError(
            f"invalid stream {stream!r} for {type_name}: 1-255 characters, no whitespace"
        )
    # The cheap check of every string of the payload at once: a NUL is written `\u0000`
    # in JSON text (the search of the payload's strings runs only when that text
    # appears), and an unpaired surrogate fails the UTF-8 encode the size check does.
    try:
        size = len(payload.encode())
    except UnicodeEncodeError as exc:
        refuse_unstorable(payload_of(event), stream, type_name)
        raise exceptions.SerializationError(
            f"payload of {type_name} on stream {stream!r} is not UTF-8 text: {exc}"
        ) from exc
    # pydantic writes a surrogate in a dict *key* as U+FFFD: look closer then too.
    if "\\u0000" in payload or "\ufffd" in payload:
        refuse_unstorable(payload_of(event), stream, type_name)
    if size > max_payload_bytes:
        raise exceptions.PayloadTooLarge(
            f"payload of {type_name} on stream {stream!r} is {size} bytes, over "
            f"max_payload_bytes={max_payload_bytes}"
        )
    if key is not None:
        check_text(key, "key", stream, type_name)
        if len(key) > 255:
            raise exceptions.PublishError(f"key of {type_name} is longer than 255 characters")


_NO_DELAY = dt.timedelta(0)


def _delay(
    delay: float | dt.timedelta | None,
    deliver_at: dt.datetime | None,
    horizon: float,
    type_name: str,
) -> tuple[dt.timedelta, dt.datetime | None]:
    """The delay of a message from ``publish(delay=…)`` / ``publish(deliver_at=…)``, and
    its ``deliver_at``: the database compares that time with its own clock (the
    producer's clock only checks it against ``max_delay_seconds`` and estimates the delay
    for the relays' wake-up)."""
    if delay is None and deliver_at is None:
        return _NO_DELAY, None
    if delay is not None and deliver_at is not None:
        raise exceptions.PublishError(f"{type_name}: give delay or deliver_at, not both")
    if deliver_at is not None:
        if not isinstance(deliver_at, dt.datetime) or deliver_at.tzinfo is None:
            raise exceptions.PublishError(
                f"{type_name}: deliver_at must be a timezone-aware datetime "
                f"(e.g. datetime.now(UTC) + timedelta(minutes=5)), not {deliver_at!r}"
            )
        # A time already past is due at once.
        seconds = max(0.0, (deliver_at - clock.utcnow()).total_seconds())
    else:
        if isinstance(delay, dt.timedelta):
            seconds = delay.total_seconds()
        elif isinstance(delay, int | float) and not isinstance(delay, bool):
            seconds = float(delay)
        else:
            raise exceptions.PublishError(
                f"{type_name}: delay must be seconds or a timedelta, not {delay!r}"
            )
        if not seconds >= 0:  # negative or NaN
            raise exceptions.PublishError(f"{type_name}: delay must be >= 0, not {delay!r}")
    if seconds > horizon:
        raise exceptions.PublishError(
            f"{type_name}: due in {seconds:.0f} s, beyond max_delay_seconds={horizon:g} "
            "(OUTBOX_MAX_DELAY_SECONDS)"
        )
    return dt.timedelta(seconds=seconds), deliver_at


def _check_headers(headers: dict[str, str] | None, stream: str, type_name: str) -> dict[str, str]:
    if not headers:
        return {}
    if not isinstance(headers, dict):
        raise exceptions.PublishError(f"headers of {type_name} must be a dict of strings")
    for name, value in headers.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise exceptions.PublishError(
                f"header {name!r} of {type_name}: names and values must be strings"
            )
        check_text(name, f"the name of header {name!r}", stream, type_name)
        check_text(value, f"headers[{name!r}]", stream, type_name)
        if not _HEADER_NAME.match(name):
            raise exceptions.PublishError(
                f"invalid header name {name!r} on {type_name}: 1-128 characters among "
                "letters, digits and !#$%&'*+-.^_`|~"
            )
        normalised = normalise_header_name(name)
        if normalised in _RESERVED:
            raise exceptions.PublishError(
                f"header {name!r} of {type_name} is set by the outbox and cannot be overridden"
            )
        if normalised.startswith(_NATS_PREFIX):
            raise exceptions.PublishError(
                f"header {name!r} of {type_name}: Nats-* headers are interpreted by NATS "
                "(de-duplication, expectations) and cannot be set by users"
            )
        if len(value) > 4096 or "\r" in value or "\n" in value:
            raise exceptions.PublishError(
                f"header {name!r} of {type_name}: value over 4096 characters or with a newline"
            )
    return dict(headers)


#: The write side of every live Outbox of this process (weakly): the request dependency
#: falls back on the only one when the app was not started with ``outbox.lifespan``.
_producers: weakref.WeakSet[Producer] = weakref.WeakSet()


def register(producer: Producer) -> None:
    _producers.add(producer)


def only_producer() -> Producer:
    """The write side of the only Outbox of this process;
    [`UnitOfWorkError`][fastapi_outbox.UnitOfWorkError] when
    there is none or several."""
    instances = list(_producers)
    if len(instances) == 1:
        return instances[0]
    if not instances:
        raise exceptions.UnitOfWorkError(
            "no Outbox exists: create one and start the app with lifespan=outbox.lifespan"
        )
    raise exceptions.UnitOfWorkError(
        f"{len(instances)} Outbox instances exist: start the app with "
        "lifespan=outbox.lifespan (or include outbox.router) so requests find theirs"
    )


def serve_app(state: Any, producer: Producer) -> None:
    """Requests of the app whose ``app.state`` is ``state`` get units of work of
    ``producer`` (``outbox.lifespan`` and the test harness call it)."""
    state.fastapi_outbox = producer


def _producer_for(request: Request) -> Producer:
    producer: Producer | None = getattr(request.app.state, "fastapi_outbox", None)
    return only_producer() if producer is None else producer


async def _request_unit_of_work(request: Request) -> AsyncIterator[UnitOfWork]:
    async with _serve(_producer_for(request), request) as uow:
        yield uow


@contextlib.asynccontextmanager
async def _serve(producer: Producer, request: Request) -> AsyncIterator[UnitOfWork]:
    try:
        correlation_id, traceparent = correlation_from_headers(request.headers)
    except ValueError as exc:
        raise HTTPException(status_code=400, detail=str(exc)) from exc
    committing = False
    try:
        async with transaction(
            producer, correlation_id=correlation_id, traceparent=traceparent
        ) as uow:
            yield uow
            committing = True
    except Exception as exc:
        # An outage answers 503 with Retry-After (fastapi_outbox.write.unavailable).
        answer = await unavailable(
            exc, producer.session_factory.kw.get("bind"), committing=committing
        )
        if answer is None:
            raise
        raise answer from exc


async def unit_of_work(
    uow: Annotated[UnitOfWork, Depends(_request_unit_of_work, scope="function")],
) -> UnitOfWork:
    """FastAPI dependency: a [`UnitOfWork`][fastapi_outbox.UnitOfWork] that commits before the
    response is sent.

    ``uow: UnitOfWork = Depends(unit_of_work)`` or ``uow: UnitOfWorkDep``."""
    return uow


UnitOfWorkDep = Annotated[UnitOfWork, Depends(unit_of_work)]


#: A FastAPI dependency giving a unit of work.
Dependency = Callable[..., Awaitable[UnitOfWork]]


def dependency_for(producer: Producer) -> Dependency:
    """A ``unit_of_work`` dependency bound to one outbox's ``producer`` (several outboxes
    in one app): ``uow: UnitOfWork = Depends(billing_outbox.dependency)``."""

    async def scoped(request: Request) -> AsyncIterator[UnitOfWork]:
        # `async with`, not `async for`: the endpoint's error must reach _serve's handler.
        async with _serve(producer, request) as uow:
            yield uow

    async def bound_unit_of_work(uow: UnitOfWork) -> UnitOfWork:
        return uow

    # Real objects, not the strings of `from __future__ import annotations`: FastAPI
    # resolves string annotations in the module's globals, where `scoped` is not.
    bound_unit_of_work.__annotations__ = {
        "uow": Annotated[UnitOfWork, Depends(scoped, scope="function")],
        "return": UnitOfWork,
    }
    return bound_unit_of_work


def tenant_dependency_for(
    producer_of: Callable[[str], Producer], tenant_dependency: Callable[..., Any]
) -> Callable[..., AsyncIterator[UnitOfWork]]:
    """The request's unit of work of a multi-tenant outbox: in the database of the tenant
    ``tenant_dependency`` gives (a header, a path parameter, a token's claim), through
    ``producer_of(tenant)``; an unknown tenant answers 404 before anything is written."""

    async def tenant_unit_of_work(request: Request, tenant: str) -> AsyncIterator[UnitOfWork]:
        try:
            producer = producer_of(tenant)
        except exceptions.UnknownTenant as exc:
            raise HTTPException(status_code=404, detail=str(exc)) from exc
        async with _serve(producer, request) as uow:
            yield uow

    tenant_unit_of_work.__annotations__ = {
        "request": Request,
        "tenant": Annotated[str, Depends(tenant_dependency)],
        "return": AsyncIterator[UnitOfWork],
    }
    return tenant_unit_of_work


def tenant_dependency_bound(
    scoped: Callable[..., AsyncIterator[UnitOfWork]],
) -> Dependency:
    """``outbox.dependency`` of a multi-tenant outbox (see `tenant_dependency_for`)."""

    async def bound_unit_of_work(uow: UnitOfWork) -> UnitOfWork:
        return uow

    bound_unit_of_work.__annotations__ = {
        "uow": Annotated[UnitOfWork, Depends(scoped, scope="function")],
        "return": UnitOfWork,
    }
    return bound_unit_of_work


def serve_tenants(app: Any, scoped: Callable[..., AsyncIterator[UnitOfWork]]) -> None:
    """``Depends(unit_of_work)`` in ``app`` gives units of work of a multi-tenant outbox
    (``scoped``: `tenant_dependency_for`), through FastAPI's dependency overrides."""
    app.dependency_overrides.setdefault(_request_unit_of_work, scoped)

"""Handlers: what a subscriber's handler takes, and the message decoded for it.

`inspect_handler` reads the handler's signature once, at registration: the first
parameter receives the message (an ``Event`` subclass, a union of them, or ``Message``; a
``list[...]`` of them makes a batch handler), the parameters annotated ``UnitOfWork`` (or
``BatchUnitOfWork``) receive the unit of work. `Decoder` turns a delivery into that
message, or says why it cannot (`Undeliverable`: dead-letter now) or need not
(`NotForHandler`: another type of the stream; `UnknownType`: a type no
``Event`` class here declares — whether another version of the group takes either is
`fastapi_outbox.consume.versions`' question). Also the unit of
work a batch handler receives ([`BatchUnitOfWork`][fastapi_outbox.BatchUnitOfWork]) and the context
a delivery gives
its unit of work (correlation id, causation id, traceparent). Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import types
import typing
import uuid
from collections import abc
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import ValidationError

from fastapi_outbox import exceptions
from fastapi_outbox.brokers.consumer import Delivery
from fastapi_outbox.events import HEADER_CORRELATION_ID, HEADER_TRACEPARENT, Event, Message
from fastapi_outbox.write.unit_of_work import UnitOfWork, valid_correlation_id

__all__ = [
    "BatchUnitOfWork",
    "Decoder",
    "Handler",
    "HandlerSignature",
    "NotForHandler",
    "Undeliverable",
    "UnknownType",
    "correlation_of",
    "delivery_context",
    "event_classes",
    "inspect_handler",
]

Handler = Callable[..., Awaitable[Any]]


class Undeliverable(Exception):
    """The message can never be handled (unknown type, invalid payload): dead-letter now."""


class NotForHandler(Exception):
    """A type another ``Event`` class declares that this handler does not take."""


class UnknownType(Exception):
    """A type no ``Event`` class of this process declares (a newer version's, perhaps)."""


def correlation_of(d: Delivery) -> str | None:
    """The message's correlation id header when it is a valid one."""
    correlation = d.headers.get(HEADER_CORRELATION_ID)
    if correlation is not None and not valid_correlation_id(correlation):
        return None
    return correlation


def delivery_context(d: Delivery) -> tuple[str | None, str | None, str | None]:
    """(correlation id carried over, causation id = the message id, traceparent)."""
    causation = d.message_id if valid_correlation_id(d.message_id) else None
    return correlation_of(d), causation, d.headers.get(HEADER_TRACEPARENT)


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

    def for_deliveries(self, deliveries: list[Delivery]) -> None:
        """Set the deliveries of the handler's list (their ids now, their correlation ids
        when asked for)."""
        self._deliveries = deliveries
        self.message_ids = [d.message_id for d in deliveries]

    @property
    def correlation_ids(self) -> list[str | None]:
        if self._correlation_ids is None:
            self._correlation_ids = [correlation_of(d) for d in self._deliveries]
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


@dataclasses.dataclass(frozen=True, slots=True)
class HandlerSignature:
    """What a handler takes, read from its signature once."""

    #: The first parameter's name: it receives the message (or the list of them).
    message_param: str
    #: The ``Event`` classes it takes; None for ``Message`` (any type, undecoded payload).
    accepts: tuple[type[Event], ...] | None
    #: The parameters annotated ``UnitOfWork`` (``BatchUnitOfWork``): they receive it.
    uow_params: list[str]
    #: The first parameter is a list: the handler takes a batch at a time.
    batch: bool


def inspect_handler(handler: Handler, where: str) -> HandlerSignature:
    """The handler's `HandlerSignature`; a ``ConfigurationError`` naming ``where``
    (the subscriber) and the parameter when the handler cannot receive messages."""
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
    annotation, many = _message_annotation(first.name, hints.get(first.name), where)
    accepts = _accepted_classes(first.name, annotation, where)
    uow_params = _uow_parameters(params[1:], hints, many, where)
    return HandlerSignature(first.name, accepts, uow_params, many)


def _message_annotation(name: str, annotation: Any, where: str) -> tuple[Any, bool]:
    """(the message's annotation, whether the handler takes a list of them)."""
    if annotation is None:
        raise exceptions.ConfigurationError(
            f"{where}: annotate the first parameter {name!r} with an Event subclass "
            "(or a union of them) or Message"
        )
    many = typing.get_origin(annotation) in (list, abc.Sequence)
    if not many:
        return annotation, False
    args = typing.get_args(annotation)
    if len(args) != 1:
        raise exceptions.ConfigurationError(
            f"{where}: a batch handler's first parameter {name!r} is annotated "
            "list[SomeEvent] (or Sequence[...], a union of Events or Message inside)"
        )
    return args[0], True


def _accepted_classes(name: str, annotation: Any, where: str) -> tuple[type[Event], ...] | None:
    """The ``Event`` classes of the message's annotation; None for ``Message``."""
    if annotation is Message:
        return None
    members = (
        typing.get_args(annotation)
        if typing.get_origin(annotation) in (typing.Union, types.UnionType)
        else (annotation,)
    )
    if not all(isinstance(m, type) and issubclass(m, Event) for m in members):
        raise exceptions.ConfigurationError(
            f"{where}: the first parameter {name!r} must be annotated with an "
            f"Event subclass, a union of them or Message, not {annotation!r}"
        )
    return tuple(members)


def _uow_parameters(
    params: list[inspect.Parameter], hints: dict[str, Any], many: bool, where: str
) -> list[str]:
    """The names of the parameters after the first that receive the unit of work; every
    other one must have a default."""
    uow_types = (UnitOfWork, BatchUnitOfWork) if many else (UnitOfWork,)
    uow_params = [p.name for p in params if hints.get(p.name) in uow_types]
    others = [
        p.name for p in params if p.name not in uow_params and p.default is inspect.Parameter.empty
    ]
    if others:
        raise exceptions.ConfigurationError(
            f"{where}: parameters {others} have no default and are not annotated "
            "UnitOfWork; the handler receives the message and, optionally, its unit of work"
        )
    return uow_params


def event_classes() -> list[type[Event]]:
    """Every concrete ``Event`` subclass declared so far."""
    out: list[type[Event]] = []
    todo: list[type[Event]] = [Event]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            todo.append(sub)
            if not sub.__outbox_abstract__:
                out.append(sub)
    return out


class Decoder:
    """Turns a delivery into the message a handler takes (``name``: the handler, for the
    errors)."""

    def __init__(self, accepts: tuple[type[Event], ...] | None, name: str) -> None:
        self.accepts = accepts
        self.name = name
        #: Type name → class the handler takes (looked up once per message).
        self._accepted: dict[str, type[Event]] = {
            c.__outbox_type__: c for c in reversed(accepts or ())
        }
        self._types: dict[str, type[Event]] | None = None

    def _event_types(self) -> dict[str, type[Event]]:
        """Event type name → class, among the classes declared when first needed."""
        if self._types is None:
            self._types = {cls.__outbox_type__: cls for cls in event_classes()}
        return self._types

    def decode(self, d: Delivery) -> Any:
        """The handler's message of ``d``; `Undeliverable` or `NotForHandler`."""
        if self.accepts is None:
            return _as_message(d)
        cls = self._accepted.get(d.type)
        if cls is None:
            raise self._not_accepted(d, self.accepts)
        try:
            # The model's validator itself (what ``model_validate_json`` calls): half the cost
            # per message without the Python wrapper.
            return cls.__pydantic_validator__.validate_json(d.payload)
        except ValidationError as exc:
            raise Undeliverable(
                f"message {d.message_id} on {d.stream!r} is not a valid {d.type}: "
                f"{exc.error_count()} error(s): "
                + "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            ) from exc

    def _not_accepted(self, d: Delivery, accepts: tuple[type[Event], ...]) -> Exception:
        """Why ``d``'s type is not handled: another ``Event`` of the stream declares it
        (`NotForHandler`) or none does (`UnknownType`)."""
        known = self._event_types()
        if d.type not in known:
            self._types = None  # classes may have been declared since: look again
            known = self._event_types()
        if d.type in known:
            return NotForHandler(d.type)
        accepted = ", ".join(c.__outbox_type__ for c in accepts)
        return UnknownType(
            f"unknown event type {d.type!r} of message {d.message_id} on stream "
            f"{d.stream!r}: no Event subclass declares it (handler {self.name} takes "
            f"{accepted})"
        )


def _as_message(d: Delivery) -> Message:
    """A ``Message`` handler's message: the payload parsed as JSON (a non-object wrapped as
    ``{"value": …}``)."""
    try:
        payload = json.loads(d.payload) if d.payload else {}
    except ValueError as exc:
        raise Undeliverable(
            f"message {d.message_id} on {d.stream!r}: payload is not JSON: {exc}"
        ) from exc
    return Message(
        stream=d.stream,
        type=d.type,
        payload=payload if isinstance(payload, dict) else {"value": payload},
        key=d.key,
        headers=dict(d.headers),
    )

"""``AggregateRoot``: a mixin for SQLAlchemy declarative models that raise domain events.

Pending events live on the instance, never in a column; the unit of work harvests them
from every aggregate the session tracks when it commits.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import event as sa_event
from sqlalchemy.orm import Session, object_session

from fastapi_outbox.events import Event, Message, check_storable

_PENDING = "_outbox_pending_events"
#: ``session.info`` key: aggregates with pending events, held strongly. The session's
#: identity map holds objects weakly, so an aggregate the handler no longer references
#: could vanish, with its events, before the unit of work harvests them.
RAISED_KEY = "fastapi_outbox.raised"
#: ``session.info`` key: a callable publishing an event in the session's unit of work at
#: once (set by :mod:`fastapi_outbox.session_events`); it returns False when no unit of work
#: is open on the session, and the event then waits on the instance.
PUBLISH_KEY = "fastapi_outbox.publish"


class AggregateRoot:
    """Mixin: ``order.raise_event(OrderPlaced(...))`` queues the event for the unit of work."""

    __slots__ = ()

    def raise_event(self, event: Event | Message) -> None:
        """Queue ``event``; it is written to the outbox with the transaction that commits.

        On an instance its session's unit of work tracks, the event is published at once
        into the current transaction (or savepoint), so a rollback of that transaction drops
        it; otherwise it waits on the instance until the unit of work meets it."""
        if not isinstance(event, Event | Message):
            raise TypeError(f"raise_event() takes an Event or Message, not {type(event).__name__}")
        session = object_session(self)
        if session is not None:
            publish = session.info.get(PUBLISH_KEY)
            if publish is not None and publish(event):
                return
        # It waits on the instance: refuse now what its commit could not store.
        check_storable(event)
        pending: list[Event | Message] | None = self.__dict__.get(_PENDING)
        if pending is None:
            pending = []
            # Bypass SQLAlchemy's instrumented __setattr__: this is not a mapped attribute.
            object.__setattr__(self, _PENDING, pending)
        pending.append(event)
        if session is not None:
            _hold(session, self)

    @property
    def pending_events(self) -> tuple[Event | Message, ...]:
        """Events raised and not yet harvested."""
        return tuple(self.__dict__.get(_PENDING, ()))


def collect_events(instance: Any) -> list[Event | Message]:
    """Take (and clear) the pending events of ``instance``."""
    pending: list[Event | Message] | None = instance.__dict__.get(_PENDING)
    if not pending:
        return []
    events = list(pending)
    pending.clear()
    return events


def _hold(session: Session, instance: Any) -> None:
    held: list[Any] = session.info.setdefault(RAISED_KEY, [])
    if not any(h is instance for h in held):
        held.append(instance)


@sa_event.listens_for(Session, "before_flush")
def _hold_new_aggregates(session: Session, flush_context: Any, instances: Any) -> None:
    """Aggregates that raised events before ``session.add`` are held from their flush on."""
    for instance in session.new:
        if instance.__dict__.get(_PENDING):
            _hold(session, instance)


def held_aggregates(session: Session) -> list[Any]:
    """Take the aggregates held by ``session``; the caller harvests them."""
    held: list[Any] = session.info.pop(RAISED_KEY, [])
    return held

"""``AggregateRoot``: a mixin for SQLAlchemy declarative models that raise domain events.

Pending events live on the instance, never in a column; the unit of work harvests them
from every aggregate the session tracks when it commits. An event goes where its aggregate
goes (see `fastapi_outbox.write.session_events` for the session side):

* ``session.merge(detached)`` carries the detached instance's pending events to the copy
  the session returns (a mapper property of ours whose only job is its ``merge`` step:
  SQLAlchemy offers no other hook that sees both instances);
* ``session.expunge(obj)`` (and every other way an object leaves a session before commit)
  takes back the events it raised since its last flush: they wait on the instance again.
"""

from __future__ import annotations

import contextvars
from typing import Any

from sqlalchemy import event as sa_event
from sqlalchemy.orm import Mapper, MapperProperty, Session, object_session

from fastapi_outbox.events import Event, Message, check_storable

_PENDING = "_outbox_pending_events"
#: Attribute of an aggregate's ``__dict__`` holding its pending events (not a column).
PENDING_EVENTS = _PENDING
#: ``session.info`` key: aggregates with pending events, held strongly. The session's
#: identity map holds objects weakly, so an aggregate the handler no longer references
#: could vanish, with its events, before the unit of work harvests them.
RAISED_KEY = "fastapi_outbox.raised"
#: ``session.info`` key: a callable ``publish(event, aggregate)`` publishing an event in the
#: session's unit of work at once (set by `fastapi_outbox.write.session_events`); it returns
#: False when no unit of work is open on the session, and the event then waits on the
#: instance.
PUBLISH_KEY = "fastapi_outbox.publish"
#: Key of the mapper property that carries pending events through ``Session.merge``.
_CARRIER = "_outbox_events_carrier"
#: The sessions of the units of work active in this context, innermost last (each with a
#: ``note_stray(aggregate, event)``, set by `fastapi_outbox.write.session_events`): an
#: event raised on an aggregate in no session is noted by the innermost, whose commit
#: refuses to go on while the aggregate is still in no session (its event would be lost).
ACTIVE_UNITS: contextvars.ContextVar[tuple[Any, ...]] = contextvars.ContextVar(
    "fastapi_outbox_active_units", default=()
)


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
        if session is not None and _publish_now(session, self, event):
            return
        # It waits on the instance: refuse now what its commit could not store.
        check_storable(event)
        wait_on(self, [event])
        if session is not None:
            _hold(session, self)
        elif active := ACTIVE_UNITS.get():
            active[-1].note_stray(self, event)  # checked when that unit of work commits

    @property
    def pending_events(self) -> tuple[Event | Message, ...]:
        """Events raised and not yet harvested."""
        return tuple(self.__dict__.get(_PENDING, ()))


def wait_on(instance: Any, events: list[Event | Message]) -> None:
    """Append ``events`` to the pending events of ``instance``."""
    pending: list[Event | Message] | None = instance.__dict__.get(_PENDING)
    if pending is None:
        pending = []
        # Bypass SQLAlchemy's instrumented __setattr__: this is not a mapped attribute.
        object.__setattr__(instance, _PENDING, pending)
    pending.extend(events)


def _publish_now(session: Session, instance: Any, event: Event | Message) -> bool:
    publish = session.info.get(PUBLISH_KEY)
    return publish is not None and bool(publish(event, instance))


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


def release(session: Session, instance: Any) -> None:
    """Stop holding ``instance`` (it left the session)."""
    held: list[Any] | None = session.info.get(RAISED_KEY)
    if held:
        held[:] = [h for h in held if h is not instance]


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


class _CarryEvents(MapperProperty[Any]):
    """A mapper property with no column and no attribute: ``Session.merge`` calls the
    ``merge`` of every property of the mapper with the source and the copy it returns, and
    this one moves the source's pending events to the copy (published at once when a unit
    of work is open on the session, else held until one meets it)."""

    def instrument_class(self, mapper: Mapper[Any]) -> None:
        """Nothing to instrument: the events live in the instance's ``__dict__``."""

    def merge(
        self,
        session: Session,
        source_state: Any,
        source_dict: Any,
        dest_state: Any,
        dest_dict: Any,
        load: bool,
        _recursive: Any,
        _resolve_conflict_map: Any,
    ) -> None:
        source = source_state.obj()
        dest = dest_state.obj()
        if source is None or dest is None or source is dest:
            return
        events = collect_events(source)
        if not events:
            return
        waiting = [e for e in events if not _publish_now(session, dest, e)]
        if waiting:
            wait_on(dest, waiting)
            _hold(session, dest)


@sa_event.listens_for(AggregateRoot, "instrument_class", propagate=True)
def _add_carrier(mapper: Mapper[Any], cls: type) -> None:
    # Each mapper of the hierarchy gets its own (a subclass's replaces the inherited one).
    mapper.add_property(_CARRIER, _CarryEvents())

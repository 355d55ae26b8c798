"""The session is the unit of work: outbox rows follow the transaction that commits them.

Outbox rows are queued on the SQLAlchemy ``Session`` (in ``session.info``), each tagged with
the savepoint that was innermost when it was queued, and written by SQLAlchemy's own session
events rather than by a transaction tracker of ours:

``before_commit``
    fires for the root transaction and for every savepoint being released. The session is
    flushed first (so ORM hooks such as ``after_insert`` or ``before_flush`` that raise events
    run, and business rows precede outbox rows — ordered dispatch relies on that), then every
    queued row is written on the session's connection. Rows written inside a savepoint are
    undone by the database if an enclosing transaction rolls back: no bookkeeping of ours.
``after_soft_rollback``
    fires for every rollback, savepoints included: rows queued inside the transaction (or
    savepoint) that rolled back, and in the savepoints nested in it, are dropped.
the connection's ``commit``
    carries the NOTIFY other processes need, decided when the rows were written: the
    COMMIT's round trip sends it too (after the commit, outside the business transaction;
    see `fastapi_outbox.storage.connector.commit_with`), whoever commits the
    connection (an own or a joined session's owner, a script without a lifespan). A
    producer's transaction sends its INSERTs and its COMMIT, nothing else.
``after_commit``
    (root only) tells the outbox which brokers got rows, to wake this process's
    relays (and, where the COMMIT could not carry it — a driver other than asyncpg —
    sends the NOTIFY right there).
``after_flush``, ``pending_to_transient``, ``persistent_to_detached`` …
    follow aggregates: an object that leaves the session before the commit (``expunge``,
    ``expunge_all``, a rollback undoing its insert) takes back the events it raised since its
    last flush; ``session.merge`` carries pending events (see
    `fastapi_outbox.aggregates`).
``after_transaction_end``
    (root only) drops whatever is still queued: a transaction that ended without a commit
    writes nothing.

So a handler may call ``session.commit()`` itself (its events go with that commit, later ones
with the next), savepoints drop their own events, events raised in ORM hooks are collected,
and a session passed in by the caller gets its rows in the caller's transaction.

A session *joined* to a transaction its owner commits (``session.info[JOINED_KEY]``: a
subscriber's handler session, bound to the subscriber's connection with
``join_transaction_mode="rollback_only"`` or ``"create_savepoint"``) writes its rows the same
way, but its own ``commit()`` commits nothing or only releases a savepoint: ``after_commit``
is left to the owner, who calls
`SessionState.after_commit` after the real commit, and what was written is remembered
until then (a rollback of the session undoes its rows in the database; waking a relay
for nothing costs one empty claim).

A sink (an outbox's `Producer`) writes its rows and wakes
its relays after a commit; a session may carry rows for several outboxes (several tables).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy import event as sa_event
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session, SessionTransaction, object_session
from sqlalchemy.orm.attributes import instance_state
from sqlalchemy.pool import Pool

# SQLAlchemy's bridge from a sync session event to the event loop (what its async dialects
# use): the NOTIFY after a commit is sent from the commit's ``after_commit`` event.
from sqlalchemy.util.concurrency import await_, in_greenlet

from fastapi_outbox.aggregates import (
    ACTIVE_UNITS,
    PENDING_EVENTS,
    PUBLISH_KEY,
    collect_events,
    held_aggregates,
    release,
    wait_on,
)
from fastapi_outbox.events import Event, Message
from fastapi_outbox.exceptions import UnitOfWorkError
from fastapi_outbox.storage.connector import commit_with
from fastapi_outbox.write.producer import Producer

__all__ = ["JOINED_KEY", "STATE_KEY", "SessionState", "state_of"]

#: ``session.info`` key of the `SessionState`.
STATE_KEY = "fastapi_outbox.state"
#: ``session.info`` key set on a session joined to a transaction its owner commits: the
#: session's own commit is not the real one (see the module docstring).
JOINED_KEY = "fastapi_outbox.joined"
#: ``Connection.info`` key of the NOTIFYs the connection's next COMMIT carries
#: (`_Carried`), set when the rows are written, cleared at the transaction's end.
_CARRY_KEY = "fastapi_outbox.carry"


class _Carried:
    """A NOTIFY a connection's COMMIT is to carry for one sink; ``handle`` (set by the
    ``commit`` event) says whether it went."""

    __slots__ = ("handle", "sql")

    def __init__(self, sql: str) -> None:
        self.sql = sql
        self.handle: Any = None

    @property
    def sent(self) -> bool:
        return self.handle is not None and bool(self.handle.sent)


class _Raised:
    """One event an aggregate raised, from its publishing to the end of the transaction:
    taken back if the aggregate leaves the session before its change is flushed, or given
    back to a new aggregate whose insert a rollback undid (so a retry that adds it again
    commits both)."""

    __slots__ = ("event", "flushed", "instance", "new", "rows", "tag", "written")

    def __init__(
        self,
        instance: Any,
        event: Event | Message,
        rows: list[dict[str, Any]],
        tag: SessionTransaction | None,
    ) -> None:
        self.instance = instance
        self.event = event
        self.rows = rows
        self.tag = tag
        #: the aggregate was not in the database yet (transient or pending).
        self.new = _identity_key(instance) is None
        #: the aggregate was flushed after the event was raised: its change is in the
        #: transaction, so the event stays with the transaction whatever becomes of it.
        self.flushed = False
        #: the rows are in the outbox table (in the transaction), no longer queued.
        self.written = False


def _identity_key(instance: Any) -> Any:
    return instance_state(instance).key


def _written_in_transaction(session: Session, instance: Any) -> bool:
    """Whether a flush of the session's open transaction (or a savepoint of it) inserted or
    updated ``instance``'s row: that row commits with the transaction even once the
    instance has left the session. SQLAlchemy keeps these rows on each transaction level
    (what a rollback must expire or expunge) and offers no public way to ask: read on
    this rare path only, when an aggregate with queued events leaves its session."""
    state = instance_state(instance)
    if state.key is None:
        return False  # never flushed
    transaction: SessionTransaction | None = session.get_nested_transaction() or (
        session.get_transaction()
    )
    while transaction is not None:
        if state in transaction._new or state in transaction._dirty:
            return True
        transaction = transaction.parent
    return False


class SessionState:
    """Outbox rows queued on one session, and the publishers of its aggregates' events."""

    __slots__ = (
        "_publishers",
        "_raising",
        "carried",
        "notify",
        "queued",
        "raised",
        "strays",
        "written",
    )

    def __init__(self) -> None:
        #: ``(savepoint or None, sink, row)``; ``None`` is the root transaction's level.
        self.queued: list[tuple[SessionTransaction | None, Producer, dict[str, Any]]] = []
        #: brokers of rows written in the current root transaction, per sink, with the
        #: earliest delay (seconds) of their rows.
        self.written: dict[Producer, dict[str, float]] = {}
        #: sinks whose commit still needs a NOTIFY from an async caller.
        self.notify: list[Producer] = []
        #: the NOTIFY of each sink that the COMMIT of the current root transaction carries.
        self.carried: dict[Producer, _Carried] = {}
        self._publishers: list[Callable[[Event | Message], object]] = []
        #: events raised by aggregates in the current transaction, oldest first.
        self.raised: list[_Raised] = []
        #: the aggregate whose event is being published, while it is.
        self._raising: tuple[Any, Event | Message] | None = None
        #: aggregates in no session that raised an event while a unit of work of this
        #: session was active, with the event: checked at the commit.
        self.strays: list[tuple[Any, Event | Message]] = []

    # -- queueing ---------------------------------------------------------------------------

    def queue(self, session: Session, sink: Producer, rows: list[dict[str, Any]]) -> None:
        tag = session.get_nested_transaction()
        self.queued.extend((tag, sink, row) for row in rows)
        if self._raising is not None:
            instance, event = self._raising
            self.raised.append(_Raised(instance, event, rows, tag))

    def publish_from(self, instance: Any, event: Event | Message) -> bool:
        """Publish ``event`` raised by the aggregate ``instance`` in the open unit of work;
        False when none is open."""
        publisher = self.publisher
        if publisher is None:
            return False
        self._raising = (instance, event)
        try:
            publisher(event)
        finally:
            self._raising = None
        return True

    def count(self, sink: Producer) -> int:
        return sum(1 for _, s, _ in self.queued if s is sink)

    def push_publisher(self, publish: Callable[[Event | Message], object]) -> None:
        self._publishers.append(publish)
        # No token: the unit of work may end in another context than it began (a request
        # dependency's exit); each context only ever sees its own tuple.
        ACTIVE_UNITS.set((*ACTIVE_UNITS.get(), self))

    def pop_publisher(self, publish: Callable[[Event | Message], object]) -> None:
        for i in range(len(self._publishers) - 1, -1, -1):
            if self._publishers[i] == publish:
                del self._publishers[i]
                break
        active = ACTIVE_UNITS.get()
        if active and active[-1] is self:  # the usual case: the innermost ends first
            ACTIVE_UNITS.set(active[:-1])
            return
        for i in range(len(active) - 1, -1, -1):
            if active[i] is self:
                ACTIVE_UNITS.set(active[:i] + active[i + 1 :])
                break

    def note_stray(self, instance: Any, event: Event | Message) -> None:
        """``instance``, in no session, raised ``event`` while a unit of work of this
        session was active: its commit checks that the instance was added by then."""
        self.strays.append((instance, event))

    def check_strays(self) -> None:
        """Refuse the commit when an aggregate that raised an event during it is still in
        no session: the event would be lost without a word (it waits on an instance no
        unit of work will meet)."""
        strays, self.strays = self.strays, []
        lost = [
            (instance, event)
            for instance, event in strays
            if object_session(instance) is None
            and any(e is event for e in instance.__dict__.get(PENDING_EVENTS, ()))
        ]
        if not lost:
            return
        instance, event = lost[0]
        name = type(instance).__name__
        raise UnitOfWorkError(
            f"{name} raised {type(event).__name__} but was never added to a session: the "
            f"event would be lost. Call session.add(...) on the {name} (uow.session.add("
            f"{name.lower()})) before the unit of work commits, or publish the event with "
            f"uow.publish(...)" + (f" ({len(lost) - 1} more such event(s))" if lost[1:] else "")
        )

    @property
    def publisher(self) -> Callable[[Event | Message], object] | None:
        return self._publishers[-1] if self._publishers else None

    def harvest(self, session: Session) -> int:
        """Publish the events pending on aggregates the session tracks (raised before they
        were added to it); returns how many."""
        publish = self.publisher
        if publish is None:
            return 0
        harvested = 0
        for instance in (*held_aggregates(session), *session.new, *session.identity_map.values()):
            for event in collect_events(instance):
                self.publish_from(instance, event)
                harvested += 1
        return harvested

    # -- aggregates that flush or leave -----------------------------------------------------------

    def flushed(self, session: Session) -> None:
        """After a flush: the events of the aggregates it wrote stay with the transaction."""
        if not any(not r.flushed for r in self.raised):
            return
        written = {id(o) for o in (*session.new, *session.dirty, *session.deleted)}
        for raised in self.raised:
            if id(raised.instance) in written:
                raised.flushed = True

    def withdraw(self, session: Session, instance: Any) -> None:
        """``instance`` left the session (expunged, or the session closed or rolled back):
        the events it raised since its last flush are taken out of the queue and wait on the
        instance again — its change will not be committed by this session, so neither are
        they. Events of a flushed change stay with the transaction, and so does every event
        of an aggregate whose row this transaction inserted or updated (flush, raise, then
        expunge: the row commits, so its events do)."""
        if self.strays:  # taken out on purpose: its events wait on it, as documented
            self.strays = [s for s in self.strays if s[0] is not instance]
        leaving = [
            r for r in self.raised if r.instance is instance and not (r.flushed or r.written)
        ]
        if not leaving or _written_in_transaction(session, instance):
            return
        rows = {id(row) for r in leaving for row in r.rows}
        self.queued = [q for q in self.queued if id(q[2]) not in rows]
        self.raised = [r for r in self.raised if not any(r is gone for gone in leaving)]
        wait_on(instance, [r.event for r in leaving])

    # -- writing ------------------------------------------------------------------------------

    def write(self, session: Session) -> None:
        """Flush the session, then write the queued rows of the current transaction level
        (the innermost savepoint, or everything at the root) on its connection."""
        self.harvest(session)
        if session.new or session.dirty or session.deleted:
            session.flush()  # ORM hooks may raise events here
            self.harvest(session)
        if not self.queued:
            return
        # Inside a savepoint, only the rows queued in it (or in savepoints within it) are
        # written: a row queued before the savepoint began must not be undone with it.
        level = session.get_nested_transaction()
        batches: dict[Producer, list[dict[str, Any]]] = {}
        kept: list[tuple[SessionTransaction | None, Producer, dict[str, Any]]] = []
        for queued in self.queued:
            tag, sink, row = queued
            if level is None or _within(tag, level):
                batches.setdefault(sink, []).append(row)
            else:
                kept.append(queued)
        if not batches:
            return
        connection = session.connection()
        for sink, rows in batches.items():
            written = self.written.setdefault(sink, {})
            for row in rows:
                delay = row["delay"].total_seconds()
                broker = row["broker"]
                written[broker] = min(delay, written.get(broker, delay))
            sink.write_rows(connection, rows)
            if sink not in self.carried:
                sql = sink.relays.notify_with_commit(written)
                if sql is not None:
                    carried = self.carried[sink] = _Carried(sql)
                    connection.info.setdefault(_CARRY_KEY, []).append(carried)
        self.queued = kept
        if self.raised:
            written_rows = {id(row) for rows in batches.values() for row in rows}
            for raised in self.raised:
                if id(raised.rows[0]) in written_rows:
                    raised.written = True

    # -- transaction ends -----------------------------------------------------------------------

    def drop(self, boundary: SessionTransaction | None, *, joined: bool = False) -> None:
        """Forget rows queued in ``boundary`` (a savepoint) and the savepoints inside it;
        ``None``: every row (the root transaction ended without commit). ``joined``: the
        session's root is a savepoint of its owner's transaction; what was written stays
        noted for the owner's commit. A new aggregate that the rollback made transient
        again gets its events back (a retry that adds it again commits them with it)."""
        if boundary is None:
            self.queued.clear()
            self.strays.clear()
            if not joined:
                self.written.clear()
                self.carried.clear()
            dropped, self.raised = self.raised, []
        else:
            self.queued = [q for q in self.queued if not _within(q[0], boundary)]
            dropped = [r for r in self.raised if _within(r.tag, boundary)]
            if dropped:
                self.raised = [r for r in self.raised if not _within(r.tag, boundary)]
        for raised in dropped:
            if raised.new and _identity_key(raised.instance) is None:
                wait_on(raised.instance, [raised.event])

    def after_commit(self) -> None:
        """Every commit wakes the relays, whoever opened the session: the sink wakes
        its own process's; when other processes must be told, the NOTIFY is sent here, in
        the commit call (an ``AsyncSession`` commits inside SQLAlchemy's greenlet, where
        ``await_`` runs a coroutine) — so a session joined by ``unit_of_work(session=…)``
        and committed later by its owner, or committed by a script without a lifespan,
        wakes them as the unit of work's own commit does."""
        self.raised.clear()
        written, self.written = self.written, {}
        carried, self.carried = self.carried, {}
        for sink, brokers in written.items():
            notified = sink in carried and carried[sink].sent
            if (
                brokers
                and sink.relays.committed(brokers, notified=notified)
                and sink not in self.notify
            ):
                self.notify.append(sink)
        if self.notify and in_greenlet():
            sinks, self.notify = self.notify, []
            for sink in sinks:
                await_(sink.relays.notify_after_commit())

    def take_notify(self) -> list[Producer]:
        """Sinks still to be told after a commit made outside SQLAlchemy's greenlet (a sync
        ``Session``); an ``AsyncSession``'s commit has told them already."""
        sinks, self.notify = self.notify, []
        return sinks


def state_of(session: Session) -> SessionState:
    """The session's `SessionState`, created on first use; aggregates of this session
    publish through it from then on."""
    state: SessionState | None = session.info.get(STATE_KEY)
    if state is None:
        state = SessionState()
        session.info[STATE_KEY] = state
        session.info[PUBLISH_KEY] = _aggregate_publisher(state)
    return state


def _aggregate_publisher(state: SessionState) -> Callable[[Event | Message, Any], bool]:
    def publish(event: Event | Message, instance: Any) -> bool:
        return state.publish_from(instance, event)

    return publish


def _within(tag: SessionTransaction | None, boundary: SessionTransaction) -> bool:
    """Whether a row tagged ``tag`` was queued inside savepoint ``boundary``."""
    transaction = tag
    while transaction is not None:
        if transaction is boundary:
            return True
        transaction = transaction.parent
    return False


def _rolled_back_boundary(transaction: SessionTransaction) -> SessionTransaction | None:
    """The savepoint a rollback of ``transaction`` undid in the database (``None``: the root
    transaction). A failed flush rolls back an internal sub-transaction, which undoes the
    enclosing savepoint or root transaction."""
    current: SessionTransaction | None = transaction
    while current is not None:
        if current.nested:
            return current
        if current.parent is None:
            return None
        current = current.parent
    return None


# -- SQLAlchemy's session events ---------------------------------------------------------------


@sa_event.listens_for(Session, "before_commit")
def _before_commit(session: Session) -> None:
    state: SessionState | None = session.info.get(STATE_KEY)
    if state is not None:
        state.write(session)
        if state.strays and session.get_nested_transaction() is None:
            state.check_strays()


@sa_event.listens_for(Session, "before_flush")
def _before_flush(session: Session, flush_context: Any, instances: Any) -> None:
    # Aggregates that raised events before ``session.add``: publish them now, in the
    # savepoint they are flushed in.
    state: SessionState | None = session.info.get(STATE_KEY)
    if state is None or state.publisher is None:
        return
    for instance in session.new:
        for event in collect_events(instance):
            state.publish_from(instance, event)


@sa_event.listens_for(Session, "after_flush")
def _after_flush(session: Session, flush_context: Any) -> None:
    state: SessionState | None = session.info.get(STATE_KEY)
    if state is not None:
        state.flushed(session)


def _left(session: Session, instance: Any) -> None:
    """An object left ``session`` before commit (``expunge``, ``expunge_all``, ``close``, a
    rollback undoing its ``add``): its unflushed events leave with it."""
    release(session, instance)
    state: SessionState | None = session.info.get(STATE_KEY)
    if state is not None:
        state.withdraw(session, instance)


sa_event.listen(Session, "pending_to_transient", _left)
sa_event.listen(Session, "persistent_to_detached", _left)
sa_event.listen(Session, "persistent_to_transient", _left)
sa_event.listen(Session, "deleted_to_detached", _left)


@sa_event.listens_for(Session, "after_commit")
def _after_commit(session: Session) -> None:
    state: SessionState | None = session.info.get(STATE_KEY)
    if (
        state is not None
        and session.get_nested_transaction() is None
        and not session.info.get(JOINED_KEY)
    ):
        state.after_commit()


@sa_event.listens_for(Engine, "commit")
def _carry_notify(connection: Connection) -> None:
    """The connection is about to COMMIT: the NOTIFYs noted on it go in the same round trip."""
    carried: list[_Carried] | None = connection.info.pop(_CARRY_KEY, None)
    if carried:
        handle = commit_with(connection, "".join(c.sql for c in carried))
        for c in carried:
            c.handle = handle


@sa_event.listens_for(Engine, "rollback")
def _carry_nothing(connection: Connection) -> None:
    connection.info.pop(_CARRY_KEY, None)


@sa_event.listens_for(Pool, "checkin")
def _carry_nothing_further(dbapi_connection: Any, record: Any) -> None:
    # A connection given back without a commit or a rollback event (invalidated, reset by
    # the pool) must not carry a NOTIFY into whoever checks it out next.
    if record is not None:
        record.info.pop(_CARRY_KEY, None)


@sa_event.listens_for(Session, "after_soft_rollback")
def _after_soft_rollback(session: Session, previous_transaction: SessionTransaction) -> None:
    state: SessionState | None = session.info.get(STATE_KEY)
    if state is not None:
        state.drop(
            _rolled_back_boundary(previous_transaction), joined=bool(session.info.get(JOINED_KEY))
        )


@sa_event.listens_for(Session, "after_transaction_end")
def _after_transaction_end(session: Session, transaction: SessionTransaction) -> None:
    state: SessionState | None = session.info.get(STATE_KEY)
    if state is not None and transaction.parent is None and not transaction.nested:
        state.drop(None, joined=bool(session.info.get(JOINED_KEY)))

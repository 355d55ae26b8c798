"""The WAL relay of ``capture="wal"``: from a logical replication slot to the brokers.

One reader per slot: the relay that holds a session-level advisory lock on a dedicated
connection reads the slot; the others (standbys: every other dispatcher process of the
outbox) try to take the lock every ``wal_standby_poll_seconds``. A reader that dies loses
its connection, PostgreSQL releases its lock, and a standby takes over from the slot's
confirmed position.

A reader's cycle:

1. **peek** up to ``wal_batch_size`` pgoutput rows (whole committed transactions, in
   commit order) with ``pg_logical_slot_peek_binary_changes``: the slot does not move;
2. **publish** the messages per broker, in commit order, in calls of ``batch_size``;
3. **confirm**: ``pg_replication_slot_advance`` to the end of the last transaction read,
   only once every message of the batch was acknowledged by its broker or handed to the
   outbox table.

A crash anywhere before 3 makes the next reader publish the batch again; the brokers'
de-duplication by message id (Redis script / IDMP, JetStream ``Nats-Msg-Id``) absorbs the
republish, so the stream holds every message once.

Failure classes, as in the table's dispatcher (:mod:`fastapi_outbox.dispatcher`): a broker
that cannot be reached or refuses every message (``BrokerUnavailable``, ``BrokerRefusing``,
a publish timeout) pauses the reader with exponential backoff, its batch held and the slot
unmoved; a message the broker refuses for itself is inserted into the outbox table as a
``failed`` row (``abandoned`` when ``max_attempts`` is 1), due after the first backoff,
before the slot moves — the table's processors retry it, abandon it after ``max_attempts``,
and ``replay`` brings it back; a database that cannot be reached makes the relay reconnect
with backoff (and stand for election again).

Why the SQL slot functions and not the streaming replication protocol: asyncpg (the
driver of the rest of the library) does not speak the replication protocol, and the SQL
functions give exactly the confirm-after-ack semantics (peek, publish, advance) on an
ordinary connection, where the advisory lock lives too. Their cost: each peek decodes the
WAL again from the slot's ``restart_lsn`` (which trails the confirmed position by up to
one ``running_xacts`` record, every 15 s of activity), so reads are large
(``wal_batch_size``) to spread that cost over many messages. pgoutput rather than
``test_decoding`` or ``wal2json``: it is built into PostgreSQL (no contrib package, no
extension to install) and its binary format is documented and stable.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import anyio

from fastapi_outbox import exceptions
from fastapi_outbox.brokers.base import Broker, PublishResults
from fastapi_outbox.dispatcher import retry_delay
from fastapi_outbox.events import Envelope, MessageStatus
from fastapi_outbox.instrumentation import Instrumentation
from fastapi_outbox.log import safe_error, stack
from fastapi_outbox.relay_loop import RelayLoop
from fastapi_outbox.settings import OutboxSettings
from fastapi_outbox.store import ERROR_MAX_CHARS, Store
from fastapi_outbox.wal_slot import Transaction, WalMessage, WalSlot, format_lsn

logger = logging.getLogger("fastapi_outbox.wal")

#: Bound of one read of the slot (it decodes WAL from ``restart_lsn``).
PEEK_TIMEOUT_SECONDS = 60.0
DB_BACKOFF_MIN_SECONDS = 0.2
#: SQLSTATE object_in_use: the slot is being read by another backend right now.
SLOT_IN_USE = "55006"
SLOT_IN_USE_PAUSE_SECONDS = 0.1
DB_BACKOFF_MAX_SECONDS = 10.0

_Item = tuple[Transaction, WalMessage]


class _Stopped(Exception):
    """Internal: the relay stopped with a batch not fully published (the slot stays)."""


class WalRelay(RelayLoop):
    """Reads the outbox's replication slot and publishes its messages."""

    def __init__(
        self,
        *,
        store: Store,
        slot: WalSlot,
        brokers: Mapping[str, Broker],
        settings: OutboxSettings,
        instance: str,
        instrumentation: Instrumentation | None = None,
        listening: Any = None,
    ) -> None:
        super().__init__(settings)
        self.store = store
        #: True while LISTEN/NOTIFY wake-ups reach this process: idle reads back off.
        self._listening = listening or (lambda: False)
        self.slot = slot
        self.brokers = dict(brokers)
        self.instance = instance
        self.instrumentation = instrumentation or Instrumentation()
        self._connected: set[str] = set()
        self._confirmed: int | None = None
        self._fail_on_outage = False
        self._drained = 0
        # Health (the broker outage state is RelayLoop's).
        #: This relay holds the slot (the others are standbys).
        self.leader = False
        self.last_tick: float | None = None  # wall clock of the last read of the slot
        self.last_relayed_at: float | None = None  # wall clock of the last confirmed batch
        #: Commit time of the oldest message read but not yet confirmed (None: caught up).
        self.oldest_unrelayed: float | None = None
        self.relayed_total = 0
        self.refused_total = 0

    def __repr__(self) -> str:
        return f"WalRelay(slot={self.slot.name!r})"

    @property
    def lag_seconds(self) -> float:
        """How long the oldest message read and not yet confirmed has waited since its
        commit (0 when the relay is caught up with what it read)."""
        if self.oldest_unrelayed is None:
            return 0.0
        return max(0.0, time.time() - self.oldest_unrelayed)

    async def run(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        """Stand for election and, once elected, relay until :meth:`stop`. Ready once the
        first election was attempted (elected or not, database up or not)."""
        try:
            await self._supervise(
                [self._loop], task_status, name="relay", action="wal", slot=self.slot.name
            )
        finally:
            self.leader = False

    async def _loop(self, first: anyio.Event) -> None:
        delay = DB_BACKOFF_MIN_SECONDS
        while not self._stopping:
            try:
                await self._session(first)
                delay = DB_BACKOFF_MIN_SECONDS
            except _Stopped:
                return
            except Exception as exc:
                first.set()
                self._database_failed(
                    exc,
                    "postgresql",
                    "wal relay lost its database session; retrying with backoff",
                    action="wal.session_failed",
                    slot=self.slot.name,
                )
                await self._sleep(delay * (1 + self._rng.uniform(0, 0.25)))
                delay = min(delay * 2, DB_BACKOFF_MAX_SECONDS)

    async def _session(self, first: anyio.Event) -> None:
        """One dedicated connection: wait to be elected, then lead until it fails or the
        relay stops. The connection is never handed back to the pool: the advisory lock
        (and any state of the slot) goes with it."""
        async with self.store.autocommit_engine.connect() as conn:
            try:
                raw = await conn.get_raw_connection()
                driver: Any = raw.driver_connection
                with anyio.fail_after(self._db_bound):
                    await self.slot.prepare_session(driver)
                while True:
                    if self._stopping:
                        raise _Stopped()
                    with anyio.fail_after(self._db_bound):
                        elected = await self.slot.try_lock(driver)
                    self.database_ok = True
                    first.set()
                    if elected:
                        break
                    await self._sleep(self.settings.wal_standby_poll_seconds)
                self.leader = True
                self._confirmed = None
                logger.info(
                    "wal relay elected: reading the slot",
                    extra={
                        "action": "wal.elected",
                        "slot": self.slot.name,
                        "instance": self.instance,
                    },
                )
                await self._lead(driver)
            finally:
                self.leader = False
                self.oldest_unrelayed = None
                with anyio.CancelScope(shield=True), anyio.move_on_after(2):
                    await conn.invalidate()

    async def _lead(self, driver: Any) -> None:
        settings = self.settings
        idle = settings.poll_interval_seconds
        while not self._stopping:
            try:
                more = await self._step(driver)
            except Exception as exc:
                if getattr(exc, "sqlstate", None) != SLOT_IN_USE:
                    raise
                # Someone else is reading the slot for a moment (an operator's `status`,
                # or the backend of a reader that just died and still holds it): wait.
                await self._sleep(SLOT_IN_USE_PAUSE_SECONDS)
                continue
            if more:
                idle = settings.poll_interval_seconds
                continue
            # Each read decodes WAL again from the slot's restart_lsn: on a database busy
            # with other writes an idle read is not free. While LISTEN/NOTIFY delivers
            # wake-ups, idle reads back off (up to max_poll_interval_seconds).
            woken = await self.wakeup.wait(idle)
            cap = (
                settings.max_poll_interval_seconds
                if self._listening()
                else settings.poll_interval_seconds
            )
            idle = settings.poll_interval_seconds if woken else min(idle * 2, cap)

    async def _step(self, driver: Any) -> bool:
        """One read of the slot, its publish and its confirm; True when more may be
        waiting (the read was full, or found messages: read again at once)."""
        size = self.settings.wal_batch_size
        transactions, nrows, safe = await self.slot.peek(driver, size, PEEK_TIMEOUT_SECONDS)
        self.last_tick = time.time()
        self.database_ok = True
        items = [(t, m) for t in transactions for m in t.messages]
        target = transactions[-1].end_lsn if transactions else None
        full = nrows >= size
        if not full and safe is not None:
            # Everything up to the WAL position taken before the read was read: past the
            # last transaction of ours, the slot may move over other WAL too, so it
            # retains (and re-decodes) no more than it must.
            target = max(target or 0, safe)
        if items:
            self.oldest_unrelayed = items[0][0].commit_time
            await self._relay(items)
            self.last_relayed_at = time.time()
        if target is not None and (self._confirmed is None or target > self._confirmed):
            with anyio.fail_after(self._db_bound):
                await self.slot.advance(driver, target, self._db_bound)
            self._confirmed = target
            logger.debug(
                "slot confirmed",
                extra={
                    "action": "wal.confirmed",
                    "slot": self.slot.name,
                    "lsn": format_lsn(target),
                    "count": len(items),
                },
            )
        self.oldest_unrelayed = None
        self._drained += len(items)
        return full or bool(items)

    async def drain(self) -> int:
        """Relay everything the slot holds now, in the calling task, and return how many
        messages were read (``fastapi_outbox.testing.drain``). Raises
        :class:`~fastapi_outbox.exceptions.BrokerUnavailable` on a broker outage (the slot
        stays where it was) and :class:`~fastapi_outbox.exceptions.UnitOfWorkError` when a
        running relay holds the slot."""
        self._fail_on_outage = True
        self._drained = 0
        async with self.store.autocommit_engine.connect() as conn:
            try:
                raw = await conn.get_raw_connection()
                driver: Any = raw.driver_connection
                if not await self.slot.try_lock(driver):
                    raise exceptions.UnitOfWorkError(
                        f"a running WAL relay holds the slot {self.slot.name!r}: stop the "
                        "dispatchers before draining by hand"
                    )
                while await self._step(driver):
                    pass
            finally:
                with anyio.CancelScope(shield=True), anyio.move_on_after(2):
                    await conn.invalidate()
        return self._drained

    # -- publishing ------------------------------------------------------------------------------

    async def _relay(self, items: list[_Item]) -> None:
        """Publish every item (or hand it to the table); returns when all are settled.
        Raises :class:`_Stopped` when the relay stops first (the slot does not move)."""
        by_broker: dict[str, list[_Item]] = {}
        for item in items:
            by_broker.setdefault(item[1].broker, []).append(item)
        for name, queue in by_broker.items():
            broker = self.brokers.get(name)
            if broker is None:
                # A broker this process does not know (a configuration mismatch between
                # producers and dispatchers): the table keeps it pending, as in table mode.
                await self._to_table(queue, None, name, pending=True)
                continue
            chunk = self.settings.batch_size
            start = 0
            while start < len(queue):
                if self._stopping:
                    raise _Stopped()
                pause = self._paused_until - time.monotonic()
                if pause > 0:
                    await self._sleep(pause)
                    continue
                batch = queue[start : start + chunk]
                if await self._publish(name, broker, batch):
                    start += len(batch)
                elif self._fail_on_outage:
                    raise exceptions.BrokerUnavailable(
                        f"broker {name!r} is down: {self.last_error}"
                    )

    async def _publish(self, name: str, broker: Broker, batch: list[_Item]) -> bool:
        """One broker call; False when the broker is down (the reader pauses)."""
        envelopes = [_envelope(m) for _, m in batch]
        finish = self._hook(self.instrumentation.publish_started, name, envelopes)
        results: PublishResults
        try:
            if name not in self._connected:
                await broker.connect()
                self._connected.add(name)
            with anyio.fail_after(self.settings.publish_timeout_seconds):
                results = await broker.publish(envelopes)
        except (exceptions.BrokerUnavailable, TimeoutError) as exc:
            if finish is not None:
                self._hook(finish, exc)
            if not isinstance(exc, TimeoutError):
                self._connected.discard(name)
            self._broker_down(name, exc)
            return False
        except exceptions.OutboxError as exc:
            results = [exc] * len(envelopes)
        except Exception as exc:  # a bug in a broker must not stop the relay
            logger.error(
                "broker raised unexpectedly",
                extra={
                    "action": "publish.error",
                    "broker": name,
                    "error": type(exc).__name__,
                    "stack": stack(exc),
                },
            )
            results = [exceptions.MessageRejected(f"broker raised {type(exc).__name__}")] * len(
                envelopes
            )
        if finish is not None:
            self._hook(finish, results)
        self._broker_up(name)
        refused = [(item, r) for item, r in zip(batch, results, strict=True) if r is not None]
        if refused:
            await self._to_table([i for i, _ in refused], [r for _, r in refused], name)
        ok = [e for e, r in zip(envelopes, results, strict=True) if r is None]
        self.relayed_total += len(ok)
        if ok:
            self._hook(self.instrumentation.published, name, ok)
        return True

    async def _to_table(
        self,
        items: Sequence[_Item],
        errors: Sequence[BaseException] | None,
        broker: str,
        *,
        pending: bool = False,
    ) -> None:
        """Hand messages over to the outbox table (before the slot moves past them)."""
        settings = self.settings
        now = dt.datetime.now(dt.UTC)
        abandon = not pending and settings.max_attempts <= 1
        rows: list[dict[str, Any]] = []
        for index, (txn, m) in enumerate(items):
            error = None if errors is None else safe_error(errors[index], limit=ERROR_MAX_CHARS)
            delay = 0.0 if pending else retry_delay(1, settings, self._rng)
            rows.append(
                {
                    "id": uuid.UUID(m.id),
                    "broker": m.broker,
                    "stream": m.stream,
                    "type": m.type,
                    "key": m.key,
                    "payload": m.payload,
                    "headers": m.headers,
                    "status": (
                        MessageStatus.PENDING
                        if pending
                        else MessageStatus.ABANDONED
                        if abandon
                        else MessageStatus.FAILED
                    ).value,
                    "attempts": 0 if pending else 1,
                    "next_attempt_at": now + dt.timedelta(seconds=delay),
                    "last_error": error,
                    "created_at": dt.datetime.fromtimestamp(txn.commit_time, dt.UTC),
                    "abandoned_at": now if abandon else None,
                }
            )
        with anyio.fail_after(self._db_bound):
            await self.store.insert_failed(rows)
        if pending:
            logger.warning(
                "wal messages for a broker this dispatcher does not know: left pending in "
                "the outbox table",
                extra={"action": "wal.unknown_broker", "broker": broker, "count": len(rows)},
            )
            return
        self.refused_total += len(rows)
        envelopes = [_envelope(m) for _, m in items]
        self._hook(
            self.instrumentation.abandoned if abandon else self.instrumentation.failed,
            broker,
            envelopes,
        )
        for row in rows:
            logger.warning(
                "message refused by the broker; handed to the outbox table for retries",
                extra={
                    "action": "wal.refused",
                    "broker": broker,
                    "message_id": str(row["id"]),
                    "status": row["status"],
                    "error": (row["last_error"] or "")[:300],
                },
            )

    def _broker_down(self, name: str, exc: BaseException) -> None:
        self._outage(
            exc,
            "broker down; wal relay paused, slot not confirmed",
            action="wal.broker_down",
            broker=name,
            slot=self.slot.name,
        )

    def _broker_up(self, name: str) -> None:
        self._recovered(
            "broker available again; wal relay resumes",
            action="wal.broker_recovered",
            broker=name,
            slot=self.slot.name,
        )

    def _hook(self, hook: Any, *args: Any) -> Any:
        return self._call_hook(hook, *args)


def _envelope(m: WalMessage) -> Envelope:
    return Envelope(m.id, m.stream, m.type, m.key, m.payload.encode(), headers_json=m.headers)

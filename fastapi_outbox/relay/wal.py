"""The WAL relay of ``capture="wal"``: from a logical replication slot to the brokers.

One reader per slot: the relay that holds a session-level advisory lock on a dedicated
connection reads the slot; the others (standbys: every other relay process of the
outbox) try to take the lock every ``wal_standby_poll_seconds``. A reader that dies loses
its connection, PostgreSQL releases its lock, and a standby takes over from the slot's
confirmed position.

A reader's cycle:

1. **peek** up to ``wal_batch_size`` pgoutput rows (whole committed transactions, in
   commit order) with ``pg_logical_slot_peek_binary_changes``, up to an ``upto_lsn`` at
   most a read window past the slot's confirmed position, under
   ``wal_read_timeout_seconds``: the slot does not move;
2. **publish** the messages per broker, in commit order, in calls of ``batch_size``;
3. **confirm**: ``pg_replication_slot_advance`` (under ``wal_confirm_timeout_seconds``) to
   the end of the last transaction read, or to the end of the window when the read covered
   it whole — also when the window held no message of ours (a bulk load while no relay
   ran) — only once every message of the batch was acknowledged by its broker or handed to
   the outbox table.

Every read and every confirm decodes the WAL from the slot's ``restart_lsn``, so their
cost is bounded by the window plus how far ``restart_lsn`` trails the confirmed position
(it moves only to the snapshot points PostgreSQL logs at checkpoints and every 15 s of
activity, ``running_xacts``). The window starts at ``wal_read_window_bytes``, doubles
after a read that took under a quarter of the read timeout, halves after one that timed
out, and is reset once the relay has caught up: a backlog of several GB is read and
confirmed a window at a time instead of in one read that may never fit in the timeout.
Health reports a reader that has made no progress (no confirm, not caught up) for longer
than ``health_max_pending_age_seconds``.

A message of the outbox's prefix that cannot be decoded stops the reader before its
transaction (what precedes it is published and confirmed): health names its LSN and the
position to advance the slot to in order to skip it on purpose; the reader reads the slot
again every ``max_poll_interval_seconds`` and resumes by itself once it is gone.

A crash anywhere before 3 makes the next reader publish the batch again; the brokers'
de-duplication by message id (Redis script / IDMP, JetStream ``Nats-Msg-Id``) absorbs the
republish, so the stream holds every message once.

Failure classes, as in the table's relay (`fastapi_outbox.relay.table`): a broker
that cannot be reached or refuses every message (``BrokerUnavailable``, ``BrokerRefusing``,
a publish timeout) pauses the reader with exponential backoff, its batch held and the slot
unmoved; a message the broker refuses for itself is inserted into the outbox table as a
``failed`` row (``abandoned`` when ``max_attempts`` is 1), due after the first backoff,
before the slot moves — the table's relays retry it, abandon it after ``max_attempts``,
and ``replay`` brings it back; a database that cannot be reached makes the relay reconnect
with backoff (and stand for election again).

Why the SQL slot functions and not the streaming replication protocol: asyncpg (the
driver of the rest of the library) does not speak the replication protocol, and the SQL
functions give exactly the confirm-after-ack semantics (peek, publish, advance) on an
ordinary connection, where the advisory lock lives too. Their cost: each peek decodes the
WAL again from the slot's ``restart_lsn`` (which trails the confirmed position by up to
one ``running_xacts`` record, every 15 s of activity), so reads are large
(``wal_batch_size``) to spread that cost over many messages. A single transaction whose
WAL takes longer than ``wal_read_timeout_seconds`` to decode cannot be read in pieces
(its changes are decoded from its start): raise the timeout. pgoutput rather than
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
from fastapi_outbox.events import MessageStatus
from fastapi_outbox.instrumentation import Instrumentation
from fastapi_outbox.log import safe_error
from fastapi_outbox.relay.loop import (
    DB_BACKOFF_MAX_SECONDS,
    DB_BACKOFF_MIN_SECONDS,
    RelayLoop,
    envelope_of,
)
from fastapi_outbox.relay.table import retry_delay
from fastapi_outbox.settings import WAL_MIN_READ_WINDOW_BYTES, OutboxSettings
from fastapi_outbox.storage.store import ERROR_MAX_CHARS, Store
from fastapi_outbox.storage.wal_slot import (
    Read,
    Transaction,
    Undecodable,
    UndecodableWalMessage,
    WalMessage,
    WalSlot,
    format_lsn,
)

logger = logging.getLogger("fastapi_outbox.relay")

#: Client-side margin over the read and confirm timeouts (asyncpg cancels the statement on
#: the server at the timeout; past the margin the connection itself is given up).
TIMEOUT_MARGIN_SECONDS = 5.0
#: SQLSTATE object_in_use: the slot is being read by another backend right now.
SLOT_IN_USE = "55006"
SLOT_IN_USE_PAUSE_SECONDS = 0.1

_Item = tuple[Transaction, WalMessage]


class _Stopped(Exception):
    """Internal: the relay stopped with a batch not fully published (the slot stays)."""


class _TimedOut(Exception):
    """Internal: the server cancelled a read or a confirm at its timeout."""


class WalRelay(RelayLoop):
    """Reads the outbox's replication slot and publishes its messages."""

    BROKER_DOWN = (
        "broker down; wal relay paused, slot not confirmed",
        "broker down; wal relay paused, slot not confirmed",
        "wal.broker_down",
    )
    BROKER_UP = ("broker available again; wal relay resumes", "wal.broker_recovered")

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
        self._fail_on_outage = False
        #: WAL past the confirmed position the next read decodes (see the module doc).
        self._window = settings.wal_read_window_bytes
        #: The slot's confirmed position this relay last saw.
        self._seen_confirmed: int | None = None
        #: Wall clock when this relay last stopped leading.
        self._led_until: float | None = None
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
        #: Wall clock of the last progress: a confirm that moved the slot, or a read that
        #: found it caught up (None: not reading).
        self.last_progress_at: float | None = None
        #: The message that stopped the reader (None: none).
        self.undecodable: Undecodable | None = None
        self.reads_total = 0
        self.read_timeouts_total = 0
        self.largest_window_bytes = 0

    def __repr__(self) -> str:
        return f"WalRelay(slot={self.slot.name!r})"

    @property
    def lag_seconds(self) -> float:
        """How long the oldest message read and not yet confirmed has waited since its
        commit (0 when the relay is caught up with what it read)."""
        if self.oldest_unrelayed is None:
            return 0.0
        # On the database's clock: its now at the read, plus the time since (monotonic).
        at_peek = self.slot.clock_at_peek
        if at_peek is None:
            return 0.0
        db_now = at_peek[1] + (time.monotonic() - at_peek[0])
        return max(0.0, db_now - self.oldest_unrelayed)

    @property
    def no_progress_seconds(self) -> float | None:
        """How long the reader here has gone without progress (None: not the reader)."""
        if not self.leader or self.last_progress_at is None:
            return None
        return max(0.0, time.time() - self.last_progress_at)

    @property
    def read_window_bytes(self) -> int:
        """The window of the next read."""
        return self._window

    async def run(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        """Stand for election and, once elected, relay until `stop`. Ready once the
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
        async with self.store.connector.held(discard=True) as held:
            driver = held.driver
            try:
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

    async def _lead(self, driver: Any) -> None:
        settings = self.settings
        now = time.time()
        if self.last_progress_at is None:
            self.last_progress_at = now
        elif self._led_until is not None:
            # Only time spent leading counts as time without progress.
            self.last_progress_at += now - self._led_until
        self._window = settings.wal_read_window_bytes
        try:
            await self._read_until_stopped(driver)
        finally:
            self._led_until = time.time()

    async def _read_until_stopped(self, driver: Any) -> None:
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
            if self.undecodable is not None:
                # Stopped before a message it cannot read: look again now and then (an
                # operator may have advanced the slot past it), wake-ups or not.
                await self._sleep(settings.max_poll_interval_seconds)
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
        """One bounded read of the slot, its publish and its confirm; True when more may be
        waiting (the read was cut short by its window or its size, found messages, or
        timed out: read again at once)."""
        settings = self.settings
        size = settings.wal_batch_size
        window = self._window
        began = time.monotonic()
        try:
            read: Read = await self._bounded(
                self.slot.peek(
                    driver, size, window, settings.wal_read_timeout_seconds, bound=self._db_bound
                ),
                settings.wal_read_timeout_seconds + self._db_bound,
            )
        except _TimedOut:
            self._timed_out("read", window, settings.wal_read_timeout_seconds)
            return True
        elapsed = time.monotonic() - began
        self._was_read(read)
        items = [(t, m) for t in read.transactions for m in t.messages]
        target = read.transactions[-1].end_lsn if read.transactions else None
        if read.complete_upto is not None:
            # Every commit before the read's bound was read: past the last transaction of
            # ours, the slot moves over other WAL too (a window of a bulk load, or the
            # database's other writes), so it retains (and re-decodes) no more than it must.
            target = max(target or 0, read.complete_upto)
        if items:
            self.oldest_unrelayed = items[0][0].commit_time
            await self._relay(items)
            self.last_relayed_at = time.time()
        confirm = target is not None and target > read.confirmed
        if confirm and not await self._confirm(driver, target or 0, len(items), window):
            return True
        self.oldest_unrelayed = None
        self._drained += len(items)
        self._blocked(read.undecodable)
        if read.undecodable is not None:
            return False
        self._adapt_window(read, window, elapsed)
        return read.more or read.nrows >= size or bool(items)

    def _was_read(self, read: Read) -> None:
        """A read answered: counted, the database is up, and a confirmed position that
        moved since this relay last looked (by itself, by another reader while this one
        stood by, or by an operator) is progress."""
        self.reads_total += 1
        self.last_tick = time.time()
        self.database_ok = True
        if read.confirmed != self._seen_confirmed:
            self._seen_confirmed = read.confirmed
            self.last_progress_at = time.time()

    async def _confirm(self, driver: Any, target: int, count: int, window: int) -> bool:
        """Advance the slot to ``target``; False when the confirm timed out (published but
        not confirmed: the next read publishes it again — the brokers' de-duplication
        absorbs it — over a smaller window)."""
        timeout = self.settings.wal_confirm_timeout_seconds
        try:
            await self._bounded(self.slot.advance(driver, target, timeout), timeout)
        except _TimedOut:
            self._timed_out("confirm", window, timeout)
            return False
        self.last_progress_at = time.time()
        self._seen_confirmed = target
        logger.debug(
            "slot confirmed",
            extra={
                "action": "wal.confirmed",
                "slot": self.slot.name,
                "lsn": format_lsn(target),
                "count": count,
            },
        )
        return True

    def _adapt_window(self, read: Read, window: int, elapsed: float) -> None:
        """Double the window after a read it cut short that took under a quarter of the
        read timeout; back to the configured window once caught up."""
        settings = self.settings
        if read.more:
            self.largest_window_bytes = max(self.largest_window_bytes, window)
            if elapsed < settings.wal_read_timeout_seconds / 4:
                self._window = min(window * 2, 1 << 40)
        elif read.nrows < settings.wal_batch_size:
            # Caught up: the next backlog starts from the configured window again.
            self.last_progress_at = time.time()
            self._window = settings.wal_read_window_bytes

    async def _bounded(self, call: Any, timeout: float) -> Any:
        """Await a read or a confirm bounded (server side) by ``timeout``: raises
        `_TimedOut` when the server cancelled it; a server that does not even
        answer the cancel within the margin fails the session (the connection is lost)."""
        with anyio.fail_after(timeout + TIMEOUT_MARGIN_SECONDS):
            try:
                return await call
            except TimeoutError as exc:  # asyncpg's command timeout
                raise _TimedOut() from exc

    def _timed_out(self, what: str, window: int, timeout: float) -> None:
        if self._fail_on_outage:  # drain(): the caller decides
            raise TimeoutError(
                f"a {what} of the replication slot {self.slot.name!r} timed out after {timeout:g}s"
            )
        self.read_timeouts_total += 1
        self._window = max(WAL_MIN_READ_WINDOW_BYTES, window // 2)
        setting = "wal_read_timeout_seconds" if what == "read" else "wal_confirm_timeout_seconds"
        self.last_error = (
            f"a {what} of the replication slot timed out after {timeout:g}s ({setting}) "
            f"over a window of {window >> 20} MiB; next window {self._window >> 20} MiB"
        )
        logger.warning(
            f"wal {what} timed out; retrying over a smaller window",
            extra={
                "action": f"wal.{what}_timeout",
                "slot": self.slot.name,
                "window_bytes": window,
                "timeout_seconds": timeout,
            },
        )

    def _blocked(self, undecodable: Undecodable | None) -> None:
        """Record (or clear) the message the reader stopped before."""
        if undecodable == self.undecodable:
            return
        if undecodable is None:
            logger.info(
                "the undecodable WAL message is gone; wal relay resumes",
                extra={"action": "wal.resumed", "slot": self.slot.name},
            )
            self.undecodable = None
            return
        self.undecodable = undecodable
        self.last_error = undecodable.describe(self.slot.name)
        if self._fail_on_outage:
            raise UndecodableWalMessage(undecodable, self.slot.name)
        logger.error(
            "wal relay stopped before an undecodable message",
            extra={
                "action": "wal.stopped",
                "slot": self.slot.name,
                "lsn": format_lsn(undecodable.lsn),
                "error": self.last_error,
            },
        )

    async def drain(self) -> int:
        """Relay everything the slot holds now, in the calling task, and return how many
        messages were read (``fastapi_outbox.testing.drain``). Raises
        [`BrokerUnavailable`][fastapi_outbox.BrokerUnavailable] on a broker outage (the slot
        stays where it was), [`UnitOfWorkError`][fastapi_outbox.UnitOfWorkError] when a
        running relay holds the slot,
        [`UndecodableWalMessage`][fastapi_outbox.testing.UndecodableWalMessage] at content it cannot
        decode (what precedes it is relayed) and ``TimeoutError`` when a read exceeds
        ``wal_read_timeout_seconds``."""
        self._fail_on_outage = True
        self._drained = 0
        async with self.store.connector.held(discard=True) as held:
            if not await self.slot.try_lock(held.driver):
                raise exceptions.UnitOfWorkError(
                    f"a running WAL relay holds the slot {self.slot.name!r}: stop the "
                    "relays before draining by hand"
                )
            while await self._step(held.driver):
                pass
        return self._drained

    # -- publishing ------------------------------------------------------------------------------

    async def _relay(self, items: list[_Item]) -> None:
        """Publish every item (or hand it to the table); returns when all are settled.
        Raises `_Stopped` when the relay stops first (the slot does not move)."""
        by_broker: dict[str, list[_Item]] = {}
        for item in items:
            by_broker.setdefault(item[1].broker, []).append(item)
        for name, queue in by_broker.items():
            broker = self.brokers.get(name)
            if broker is None:
                # A broker this process does not know (a configuration mismatch between
                # producers and relays): the table keeps it pending, as in table mode.
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
        envelopes = [envelope_of(m) for _, m in batch]
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
            results = [self._broker_bug(name, exc)] * len(envelopes)
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
        abandon = not pending and settings.max_attempts <= 1
        status = (
            MessageStatus.PENDING
            if pending
            else MessageStatus.ABANDONED
            if abandon
            else MessageStatus.FAILED
        )
        rows = [
            _table_row(
                txn,
                m,
                status,
                None if errors is None else safe_error(errors[index], limit=ERROR_MAX_CHARS),
                0.0 if pending else retry_delay(1, settings, self._rng),
            )
            for index, (txn, m) in enumerate(items)
        ]
        with anyio.fail_after(self._db_bound):
            await self.store.inserts.insert_failed(rows)
        if pending:
            logger.warning(
                "wal messages for a broker this relay does not know: left pending in "
                "the outbox table",
                extra={"action": "wal.unknown_broker", "broker": broker, "count": len(rows)},
            )
            return
        self.refused_total += len(rows)
        envelopes = [envelope_of(m) for _, m in items]
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

    def _log_extra(self, broker: str) -> dict[str, Any]:
        return {"broker": broker, "slot": self.slot.name}


def _table_row(
    txn: Transaction, m: WalMessage, status: MessageStatus, error: str | None, delay: float
) -> dict[str, Any]:
    """The outbox row a WAL message is handed over as (``Inserts.insert_failed``): pending
    (a broker this relay does not know), failed or abandoned (refused)."""
    return {
        "id": uuid.UUID(m.id),
        "broker": m.broker,
        "stream": m.stream,
        "type": m.type,
        "key": m.key,
        "payload": m.payload,
        "headers": m.headers,
        "status": status.value,
        "attempts": 0 if status is MessageStatus.PENDING else 1,
        "retry_in": dt.timedelta(seconds=delay),  # from the database's now
        "last_error": error,
        "created_at": dt.datetime.fromtimestamp(txn.commit_time, dt.UTC),
        "abandon_now": status is MessageStatus.ABANDONED,
    }

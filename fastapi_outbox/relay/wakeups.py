"""Wake-ups: the in-process signal, the coalesced NOTIFY sender and the LISTEN listener.

A commit wakes the relays of its own process at once (`Wakeup`). Other
processes learn about it through PostgreSQL ``NOTIFY``, sent after the commit and outside
the business transaction (a transaction that has notified takes a database-wide lock at
commit, which would serialise every commit). `Notifier` coalesces: however many
commits arrive while a NOTIFY is in flight, one more NOTIFY follows, so the write path pays
nothing per request. `Listener` holds one connection that LISTENs and wakes the local
relays; when it is down (no PostgreSQL, or PgBouncer in transaction mode) the
relays fall back to polling every ``poll_interval_seconds``. The listener proves its
connection alive with a NOTIFY to itself every ``listen_check_interval_seconds`` (and TCP
keepalives), so a connection lost silently counts as down within
``listen_check_interval_seconds + listen_check_timeout_seconds``.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import anyio

from fastapi_outbox.backoff import exponential_delay
from fastapi_outbox.settings import LISTEN_CHECK_INTERVAL_SECONDS, LISTEN_CHECK_TIMEOUT_SECONDS
from fastapi_outbox.storage.connector import Held
from fastapi_outbox.storage.statements.notify import NOTIFY_SQL
from fastapi_outbox.storage.store import Store

logger = logging.getLogger("fastapi_outbox.relay")

RECONNECT_MIN_SECONDS = 0.5
RECONNECT_MAX_SECONDS = 30.0
#: Bound on giving the LISTEN connection back (UNLISTEN) before it is dropped instead.
RELEASE_TIMEOUT_SECONDS = 1.0


class Wakeup:
    """Wakes one idle worker per signal; a signal with no idle worker is kept (coalesced)
    so the next worker to finish claims again instead of sleeping."""

    def __init__(self) -> None:
        self._pending = False
        self._waiters: deque[anyio.Event] = deque()

    @property
    def idle_waiters(self) -> int:
        """How many workers wait for a signal now."""
        return len(self._waiters)

    def set(self) -> bool:
        """Wake one idle worker; returns False when none was idle (the signal is kept)."""
        while self._waiters:
            event = self._waiters.popleft()
            if not event.is_set():
                event.set()
                return True
        self._pending = True
        return False

    def set_all(self) -> None:
        self._pending = True
        while self._waiters:
            self._waiters.popleft().set()

    async def wait(self, timeout: float | None) -> bool:
        """Wait for a signal (True) or the timeout (False)."""
        if self._pending:
            self._pending = False
            return True
        event = anyio.Event()
        self._waiters.append(event)
        try:
            with anyio.move_on_after(timeout):
                await event.wait()
        except BaseException:
            if event.is_set():
                self._pending = True  # cancelled right after a signal: keep it for the next
            raise
        finally:
            if not event.is_set():
                with contextlib.suppress(ValueError):
                    self._waiters.remove(event)
        if event.is_set():
            self._pending = False
            return True
        return False


def channel_name(table_name: str) -> str:
    return f"outbox_{table_name}"[:63]


class Notifier:
    """Sends ``NOTIFY`` after commits, at most one in flight (coalesced)."""

    def __init__(
        self, store: Store, channel: str, instance_id: str, min_interval: float = 0.0
    ) -> None:
        self.store = store
        self.channel = channel
        self.instance_id = instance_id
        self.min_interval = min_interval
        self.running = False
        self.sent = 0
        self._signal = Wakeup()

    def signal(self) -> None:
        self._signal.set()

    async def run(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        """Send coalesced NOTIFYs on a connection of its own, straight through the driver:
        no pool checkout and no SQLAlchemy execution per NOTIFY."""
        self.running = True
        task_status.started()
        try:
            while True:
                await self._signal.wait(None)
                try:
                    async with self.store.connector.held() as held:
                        driver = held.driver
                        assert driver is not None
                        while True:
                            await driver.execute(NOTIFY_SQL, self.channel, self.instance_id)
                            self.sent += 1
                            # Commits in the next few milliseconds share the next NOTIFY:
                            # under load the write path pays a fraction of a round trip
                            # per request instead of one.
                            if self.min_interval:
                                await anyio.sleep(self.min_interval)
                            await self._signal.wait(None)
                except Exception as exc:
                    logger.warning(
                        "notify failed; other processes fall back to polling",
                        extra={"action": "notify.failed", "error": type(exc).__name__},
                    )
                    await anyio.sleep(RECONNECT_MIN_SECONDS)
        finally:
            self.running = False


#: Payloads of the LISTEN self-checks start with this; every listener ignores them (they are
#: no commit), so a check wakes no relay of any process.
PING_PREFIX = "ping:"


def set_keepalive(sock: Any, idle_seconds: float) -> bool:
    """TCP keepalives on ``sock``: probes after ``idle_seconds`` of silence, then every
    ``idle_seconds``, three unanswered probes and the kernel closes it — so a connection a
    NAT or firewall dropped ends even while no statement is in flight. False when the socket
    takes no TCP options (a Unix socket)."""
    seconds = max(1, int(idle_seconds))
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", seconds), ("TCP_KEEPINTVL", seconds)):
            option = getattr(socket, name, None)
            if option is not None:
                sock.setsockopt(socket.IPPROTO_TCP, option, value)
        if hasattr(socket, "TCP_KEEPCNT"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
    except OSError:
        return False
    return True


def _driver_socket(driver: Any) -> Any:
    """The socket under an asyncpg connection, or None (another driver: no keepalives)."""
    transport = getattr(driver, "_transport", None)
    return None if transport is None else transport.get_extra_info("socket")


class Listener:
    """LISTENs on a dedicated connection and calls ``on_notify`` for other processes'
    commits; reconnects with backoff. ``listening`` says whether wake-ups can arrive.

    A LISTEN connection can die silently (a NAT or firewall dropping it, a half-open TCP
    connection): nothing arrives and nothing fails. So the connection gets TCP keepalives,
    it counts as listening only once a NOTIFY it sent to itself came back, and it sends one
    every ``check_interval`` seconds; when that round trip does not come back within
    ``check_timeout``, the connection is declared lost at once —
    ``listening`` becomes False, the relays are woken and poll every
    ``poll_interval_seconds`` — and the listener reconnects."""

    def __init__(
        self,
        store: Store,
        channel: str,
        instance_id: str,
        on_notify: Callable[[], None],
        *,
        check_interval: float = LISTEN_CHECK_INTERVAL_SECONDS,
        check_timeout: float = LISTEN_CHECK_TIMEOUT_SECONDS,
    ) -> None:
        self.store = store
        self.channel = channel
        self.instance_id = instance_id
        self.on_notify = on_notify
        self.check_interval = check_interval
        self.check_timeout = check_timeout
        self.listening = False
        self.received = 0
        #: self-checks answered, and connections declared lost because one was not.
        self.checks = 0
        self.silent_losses = 0
        #: TCP keepalives are on for the current connection.
        self.keepalive = False
        self._checks = itertools.count()
        self._awaited: tuple[str, anyio.Event] | None = None

    def _callback(self, connection: Any, pid: int, channel: str, payload: str) -> None:
        if payload.startswith(PING_PREFIX):
            awaited = self._awaited
            if awaited is not None and payload == awaited[0]:
                awaited[1].set()
            return  # a self-check (ours or another process's): no commit behind it
        if payload == self.instance_id:
            return  # our own commit: the in-process signal already woke us
        self.received += 1
        self.on_notify()

    async def _answers(self, driver: Any) -> bool:
        """One self-check: a NOTIFY to our own channel, sent and received back on the
        LISTEN connection within ``check_timeout``."""
        token = f"{PING_PREFIX}{self.instance_id}:{next(self._checks)}"
        answered = anyio.Event()
        self._awaited = (token, answered)
        try:
            with anyio.move_on_after(self.check_timeout):
                await driver.execute(NOTIFY_SQL, self.channel, token)
                await answered.wait()
        finally:
            self._awaited = None
        if answered.is_set():
            self.checks += 1
        return answered.is_set()

    async def _watch(
        self, driver: Any, lost: anyio.Event, proven: Callable[[], None]
    ) -> str | None:
        """Prove the connection with a self-check at once — ``proven()`` then, and only then
        does it count as listening: behind PgBouncer in transaction mode LISTEN succeeds
        but nothing ever comes back — and again every ``check_interval``. Returns when it is
        lost: None when the driver saw it close, the reason when a self-check failed."""
        while True:
            try:
                if not await self._answers(driver):
                    return f"no answer to a self-check within {self.check_timeout:g} s"
            except Exception as exc:
                return f"self-check failed: {type(exc).__name__}"
            if not self.listening:
                proven()
            with anyio.move_on_after(self.check_interval):
                await lost.wait()
                return None

    async def _release(self, held: Held, *, healthy: bool) -> None:
        """Give the connection back to the pool without its LISTEN, or — when it is closed,
        silent, or does not answer UNLISTEN within a second — drop it: a half-open
        connection returned to the pool would hang whoever used or closed it next."""
        driver = held.driver
        if healthy and not driver.is_closed():
            with anyio.move_on_after(RELEASE_TIMEOUT_SECONDS):
                await driver.remove_listener(self.channel, self._callback)
                return
        driver.terminate()
        with anyio.move_on_after(RELEASE_TIMEOUT_SECONDS):
            await held.invalidate()

    async def run(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        failures = 0
        started = False

        def proven() -> None:
            nonlocal failures, started
            self.listening = True
            failures = 0
            logger.info("listening", extra={"action": "listen.start", "channel": self.channel})
            # Commits made while we were not listening: look once.
            self.on_notify()
            if not started:
                started = True
                task_status.started()

        while True:
            lost = anyio.Event()
            try:
                async with self.store.connector.held(autocommit=False) as held:
                    driver = held.driver
                    assert driver is not None
                    sock = _driver_socket(driver)
                    self.keepalive = sock is not None and set_keepalive(sock, self.check_interval)
                    await driver.add_listener(self.channel, self._callback)
                    driver.add_termination_listener(lambda _c, lost=lost: lost.set())
                    silent: str | None = None
                    try:
                        silent = await self._watch(driver, lost, proven)
                    finally:
                        self.listening = False
                        with anyio.CancelScope(shield=True):
                            await self._release(held, healthy=silent is None)
                    if silent is not None:
                        self.silent_losses += 1
                    raw_lost = silent or "connection lost"
            except Exception as exc:
                raw_lost = f"{type(exc).__name__}"
            self.listening = False
            failures += 1
            delay = exponential_delay(
                failures, base=RECONNECT_MIN_SECONDS, maximum=RECONNECT_MAX_SECONDS
            )
            logger.warning(
                "listen connection down; polling until it is back",
                extra={"action": "listen.lost", "error": raw_lost, "retry_in": delay},
            )
            # Wake the pollers: one may be in a long idle wait sized for LISTEN; it now
            # recomputes its interval without LISTEN (poll_interval_seconds).
            self.on_notify()
            if not started:
                started = True
                task_status.started()
            await anyio.sleep(delay)


# -- after a commit ----------------------------------------------------------------------------

#: Bound on the NOTIFY an API-only process sends after a commit.
NOTIFY_TIMEOUT_SECONDS = 2.0


class TableRelayWaking(Protocol):
    """What the wake-up policy needs of a table relay
    (`TableRelay`)."""

    wakeup: Wakeup

    @property
    def stopping(self) -> bool: ...

    def schedule(self, delay_seconds: float) -> None: ...


class WalRelayWaking(Protocol):
    """What the wake-up policy needs of the WAL relay
    (`WalRelay`)."""

    wakeup: Wakeup
    leader: bool

    @property
    def stopping(self) -> bool: ...


def notify_with_commit(
    brokers: Mapping[str, float],
    relays: Mapping[str, TableRelayWaking],
    wal_relay: WalRelayWaking | None,
    *,
    can_notify: bool,
) -> bool:
    """Before a commit that wrote rows for ``brokers``: whether other processes must be
    told, so the COMMIT carries the NOTIFY (one round trip for both: the producer's
    transaction sends its INSERTs and its COMMIT, nothing else). The same policy as
    `wake_after_commit`, read ahead of the commit: rows due now that an idle
    worker of this process will take (or the WAL relay's leader here) need no NOTIFY;
    delayed rows, rows of a relay this process does not run, and rows no idle worker
    here waits for do. Reading ahead can be wrong only one way — the worker found idle
    gets busy before the commit — and that worker claims again when it is done."""
    if not (brokers and can_notify):
        return False
    for name, delay in brokers.items():
        if wal_relay is not None and delay <= 0:
            if not (wal_relay.leader and not wal_relay.stopping):
                return True
            continue
        table_relay = relays.get(name)
        if (
            table_relay is None
            or table_relay.stopping
            or delay > 0
            or table_relay.wakeup.idle_waiters == 0
        ):
            return True
    return False


def wake_after_commit(
    brokers: Mapping[str, float],
    relays: Mapping[str, TableRelayWaking],
    wal_relay: WalRelayWaking | None,
    notifier: Notifier | None,
    *,
    can_notify: bool,
    notified: bool = False,
) -> bool:
    """Wake the relays after a commit that wrote rows for ``brokers`` (each with the
    earliest delay of its rows: 0 for rows due now).

    Rows due now wake an idle worker of this process; delayed rows only tell its poller
    when to look (no claim before they are due). Returns True when other processes still
    have to be told: this process runs no `Notifier` (an API-only process,
    ``run_relays=False``) but ``can_notify`` (PostgreSQL with ``notify`` on) — the
    caller then sends the NOTIFY itself (`notify_once`). ``notified``: the COMMIT
    carried the NOTIFY (`notify_with_commit`); only this process's relays are left
    to wake."""
    if not brokers:
        return False
    handled_here = True
    relay = wal_relay
    for name, delay in brokers.items():
        if relay is not None and delay <= 0:
            # capture="wal": messages due now are in the slot, not in the table.
            if not (relay.leader and not relay.stopping):
                handled_here = False
            relay.wakeup.set()
            continue
        table_relay = relays.get(name)
        if table_relay is None or table_relay.stopping:
            handled_here = False
        elif delay > 0:
            table_relay.schedule(delay)
            handled_here = False  # other processes may poll later than it is due
        # An idle worker of this process takes the rows at once: no other process
        # needs waking, and the commit costs no NOTIFY.
        elif not table_relay.wakeup.set():
            handled_here = False
    if handled_here or notified:
        return False
    if notifier is not None and notifier.running:
        notifier.signal()
        return False
    return can_notify


async def notify_once(store: Store, channel: str, instance_id: str) -> None:
    """One NOTIFY after the commit, outside the business transaction, for processes
    whose relays LISTEN while this one runs none. No background task: it costs the
    caller one short round-trip, bounded in time and shielded so a cancelled request
    cannot leave it half-sent. A failure is only logged: the data committed, and the
    relays find the rows by polling."""
    try:
        with anyio.CancelScope(shield=True), anyio.fail_after(NOTIFY_TIMEOUT_SECONDS):
            await store.notify(channel, instance_id)
    except Exception as exc:
        logger.warning(
            "notify after commit failed; relays fall back to polling",
            extra={"action": "notify.failed", "error": type(exc).__name__},
        )

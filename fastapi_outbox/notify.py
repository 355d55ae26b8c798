"""Wake-ups: the in-process signal, the coalesced NOTIFY sender and the LISTEN listener.

A commit wakes the dispatchers of its own process at once (:class:`Wakeup`). Other
processes learn about it through PostgreSQL ``NOTIFY``, sent after the commit and outside
the business transaction (a transaction that has notified takes a database-wide lock at
commit, which would serialise every commit). :class:`Notifier` coalesces: however many
commits arrive while a NOTIFY is in flight, one more NOTIFY follows, so the write path pays
nothing per request. :class:`Listener` holds one connection that LISTENs and wakes the local
processors; when it is down (no PostgreSQL, or PgBouncer in transaction mode) the
dispatchers fall back to polling every ``poll_interval_seconds``.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import anyio

from fastapi_outbox.store import Store

logger = logging.getLogger("fastapi_outbox.notify")

RECONNECT_MIN_SECONDS = 0.5
RECONNECT_MAX_SECONDS = 30.0


class Wakeup:
    """Wakes one idle worker per signal; a signal with no idle worker is kept (coalesced)
    so the next worker to finish claims again instead of sleeping."""

    def __init__(self) -> None:
        self._pending = False
        self._waiters: deque[anyio.Event] = deque()

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
                    async with self.store.autocommit_engine.connect() as conn:
                        raw = await conn.get_raw_connection()
                        driver = raw.driver_connection
                        assert driver is not None
                        while True:
                            await driver.execute(
                                "SELECT pg_notify($1, $2)", self.channel, self.instance_id
                            )
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


class Listener:
    """LISTENs on a dedicated connection and calls ``on_notify`` for other processes'
    commits; reconnects with backoff. ``listening`` says whether wake-ups can arrive."""

    def __init__(
        self, store: Store, channel: str, instance_id: str, on_notify: Callable[[], None]
    ) -> None:
        self.store = store
        self.channel = channel
        self.instance_id = instance_id
        self.on_notify = on_notify
        self.listening = False
        self.received = 0

    def _callback(self, connection: Any, pid: int, channel: str, payload: str) -> None:
        if payload == self.instance_id:
            return  # our own commit: the in-process signal already woke us
        self.received += 1
        self.on_notify()

    async def run(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        delay = RECONNECT_MIN_SECONDS
        started = False
        while True:
            lost = anyio.Event()
            try:
                async with self.store.engine.connect() as conn:
                    raw = await conn.get_raw_connection()
                    driver = raw.driver_connection
                    assert driver is not None
                    await driver.add_listener(self.channel, self._callback)
                    driver.add_termination_listener(lambda _c, lost=lost: lost.set())
                    self.listening = True
                    delay = RECONNECT_MIN_SECONDS
                    logger.info(
                        "listening", extra={"action": "listen.start", "channel": self.channel}
                    )
                    # Commits made while we were not listening: look once.
                    self.on_notify()
                    if not started:
                        started = True
                        task_status.started()
                    try:
                        await lost.wait()
                    finally:
                        self.listening = False
                        with anyio.CancelScope(shield=True), anyio.move_on_after(1):
                            if not driver.is_closed():
                                await driver.remove_listener(self.channel, self._callback)
                raw_lost = "connection lost"
            except Exception as exc:
                raw_lost = f"{type(exc).__name__}"
            self.listening = False
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
            delay = min(delay * 2, RECONNECT_MAX_SECONDS)

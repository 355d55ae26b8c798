"""What every loop that moves messages to a broker shares: the table's
`TableRelay` and the `WalRelay`.

- stopping: `RelayLoop.stop` wakes every wait, `RelayLoop._sleep` returns early;
- the client-side bound of one database step (`RelayLoop._db_bound`);
- the broker outage state the health endpoint and the dashboard read (``broker_ok``,
  ``broker_down_since``, ``broker_refusing``, ``last_error``) with the loop's exponential
  pause (`RelayLoop._outage` / `RelayLoop._recovered`): a broker that cannot
  be reached or refuses every message pauses the loop as a whole, never a message;
- what a relay logs when a broker goes down or comes back (`RelayLoop._broker_down`,
  `RelayLoop._broker_up`: the messages and actions are class attributes, so the table
  relay and the WAL relay keep their own words);
- instrumentation hooks that may fail without stopping the loop (`RelayLoop._hook`);
- the envelope a claimed row or a WAL message is published as (`envelope_of`);
- what a failed database step means (`RelayLoop._database_failed`): the dialect's
  outage classifier (`fastapi_outbox.storage.db_outage`) tells the database being unavailable
  (``database_ok`` false, warned once) from the statement's own error (a missing table, a
  bug: logged as an error each time, the database up). Either way the loop backs off.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import anyio

from fastapi_outbox import exceptions
from fastapi_outbox.backoff import exponential_delay
from fastapi_outbox.events import Envelope
from fastapi_outbox.log import safe_error, stack
from fastapi_outbox.relay.wakeups import Wakeup
from fastapi_outbox.settings import OutboxSettings
from fastapi_outbox.storage import clock, db_outage
from fastapi_outbox.storage.store import ClaimedRow
from fastapi_outbox.storage.wal_slot import WalMessage

logger = logging.getLogger("fastapi_outbox.relay")

#: The backoff of a relay whose database step failed: doubled from the first to the last.
DB_BACKOFF_MIN_SECONDS = 0.2
DB_BACKOFF_MAX_SECONDS = 10.0


class RelayLoop:
    """Base of the loops that publish: stop, pause on broker outages, hooks."""

    #: What `_broker_down` logs: the message for a broker that cannot be reached,
    #: the message for one refusing every message, and the action.
    BROKER_DOWN = (
        "broker unavailable; relay backing off",
        "broker refusing messages; relay backing off",
        "broker.unavailable",
    )
    #: What `_broker_up` logs: the message and the action.
    BROKER_UP = ("broker available again", "broker.recovered")

    def __init__(
        self, settings: OutboxSettings, *, hook_extra: dict[str, Any] | None = None
    ) -> None:
        self.settings = settings
        #: Log fields of a failed instrumentation hook (see `_hook`).
        self._hook_extra = hook_extra or {}
        self.wakeup = Wakeup()
        self._stopping = False
        self._stop_event = anyio.Event()
        self.stopped = anyio.Event()
        self._paused_until = 0.0
        self._broker_failures = 0
        self._rng = random.Random()
        # Health.
        self.running = False
        self.database_ok = True
        self.broker_ok = True
        #: Wall clock of the first failure of the current broker outage (None: broker up).
        self.broker_down_since: float | None = None
        #: The outage is the broker refusing every message (out of memory, read-only, …)
        #: rather than being unreachable.
        self.broker_refusing = False
        #: The outage is the broker refusing this process's credentials.
        self.broker_authentication_failed = False
        self.last_error: str | None = None

    async def _supervise(
        self,
        loops: Sequence[Callable[[anyio.Event], Coroutine[Any, Any, None]]],
        task_status: Any,
        *,
        name: str,
        action: str,
        **extra: Any,
    ) -> None:
        """Run ``loops`` (each gets the ``first`` event) until they return. Ready once one
        of them set ``first`` (its first database step was attempted, whether or not the
        database answered: the app must start even when the database is down), or after
        ``lease_seconds``. A bug in a loop ends this one only: raising would cancel the
        outbox's task group and with it the app's lifespan; the health endpoint reports the
        dead loop (503) and the error."""
        self.running = True
        first = anyio.Event()
        started = False
        try:
            async with anyio.create_task_group() as tg:
                for loop in loops:
                    tg.start_soon(loop, first)
                with anyio.move_on_after(self.settings.lease_seconds):
                    await first.wait()
                started = True
                task_status.started()
        except Exception as exc:
            self.last_error = f"{name} crashed: {safe_error(exc)}"
            logger.error(
                f"{name} crashed",
                extra={
                    **extra,
                    "action": f"{action}.crashed",
                    "error": self.last_error,
                    "stack": stack(exc),
                },
            )
            if not started:
                task_status.started()
        finally:
            self.running = False
            self.stopped.set()

    @property
    def _db_bound(self) -> float:
        """Client-side bound of one database step: the server-side statement timeout plus
        a margin, for a server that cannot even enforce its own timeout (frozen, or
        unreachable mid-statement)."""
        return self.settings.statement_timeout_seconds * 2 + 1.0

    def stop(self) -> None:
        """Stop taking new work; what is in flight finishes (or is given back)."""
        self._stopping = True
        self._stop_event.set()
        self.wakeup.set_all()

    @property
    def stopping(self) -> bool:
        return self._stopping

    async def _sleep(self, seconds: float) -> None:
        """Sleep, but return early when the loop stops."""
        with anyio.move_on_after(max(0.0, seconds)):
            await self._stop_event.wait()

    def _outage(self, exc: BaseException, message: str, **extra: Any) -> float:
        """Record an outage and pause the loop: exponential from ``poll_interval_seconds``
        up to ``broker_backoff_max_seconds``, with jitter. Returns the pause."""
        settings = self.settings
        self._broker_failures += 1
        refused = isinstance(exc, exceptions.AuthenticationFailed)
        pause = exponential_delay(
            # Refused credentials: no quick retry will cure them, but a rotated secret may
            # come back, so the slowest pace at once.
            self._broker_failures if not refused else 1_000,
            base=settings.poll_interval_seconds,
            maximum=settings.broker_backoff_max_seconds,
            jitter=(0.0, 0.25),
            rng=self._rng,
        )
        self._paused_until = time.monotonic() + pause
        if self.broker_down_since is None:
            self.broker_down_since = clock.wall()
        self.broker_ok = False
        self.broker_refusing = isinstance(exc, exceptions.BrokerRefusing)
        self.broker_authentication_failed = refused
        self.last_error = safe_error(exc)
        logger.warning(
            message,
            extra={**extra, "pause_seconds": round(pause, 3), "error": self.last_error},
        )
        return pause

    def _recovered(self, message: str, **extra: Any) -> None:
        """The broker took a call: end the outage (logged once) and the pause."""
        if not self.broker_ok:
            logger.info(message, extra=extra)
        self._broker_failures = 0
        self.broker_ok = True
        self.broker_down_since = None
        self.broker_refusing = False
        self.broker_authentication_failed = False

    def _database_failed(
        self, exc: BaseException, dialect: str, message: str, **extra: Any
    ) -> None:
        """A database step of the loop failed with ``exc``. Unavailable (the classifier's
        verdict; an ambiguous ``OSError`` or timeout counts, the loop runs no code but its
        own): ``database_ok`` goes false and ``message`` is warned once per outage.
        Otherwise the statement failed on a database that answers: logged as an error with
        its stack each time, ``database_ok`` unchanged."""
        verdict = db_outage.classify(exc, dialect)
        if verdict is db_outage.Verdict.AUTHENTICATION:
            # Down, with its true cause: a rotated password may come back, so the loop keeps
            # trying at its slowest pace.
            if self.database_ok:
                logger.error(
                    "database authentication failed; retrying",
                    extra={**extra, "error": safe_error(exc)},
                )
            self.database_ok = False
            self.last_error = db_outage.describe(exc, dialect)
            return
        if verdict is db_outage.Verdict.TABLE_MISSING:
            self.last_error = f"{db_outage.describe(exc, dialect)}: {safe_error(exc)}"
            logger.error(
                "outbox table missing; retrying with backoff",
                extra={**extra, "error": self.last_error},
            )
            return
        if verdict is db_outage.Verdict.CONTENTION:
            # The database answers (MySQL: a deadlock, a lock wait timeout): retried, not down.
            self.last_error = db_outage.describe(exc, dialect)
            logger.warning(message, extra={**extra, "error": self.last_error})
            return
        if verdict is not db_outage.Verdict.FAILURE:
            if self.database_ok:
                logger.warning(message, extra={**extra, "error": safe_error(exc)})
            self.database_ok = False
            self.last_error = f"database unavailable: {type(exc).__name__}"
            return
        self.last_error = f"database statement failed: {safe_error(exc)}"
        logger.error(
            "database statement failed (the database answers); retrying with backoff",
            extra={**extra, "error": self.last_error, "stack": stack(exc)},
        )

    def _log_extra(self, broker: str) -> dict[str, Any]:
        """The log fields naming what an outage is about: the broker (a WAL relay adds its
        slot)."""
        return {"broker": broker}

    def _broker_down(self, broker: str, exc: BaseException) -> None:
        """``broker`` cannot be reached or refuses every message: the loop pauses."""
        unreachable, refusing, action = self.BROKER_DOWN
        if isinstance(exc, exceptions.AuthenticationFailed):
            unreachable = "broker authentication failed; relay retrying slowly"
        self._outage(
            exc,
            refusing if isinstance(exc, exceptions.BrokerRefusing) else unreachable,
            action=action,
            **self._log_extra(broker),
        )

    def _broker_up(self, broker: str) -> None:
        """``broker`` took a call: the outage (if any) ends."""
        message, action = self.BROKER_UP
        self._recovered(message, action=action, **self._log_extra(broker))

    def _broker_bug(self, broker: str, exc: BaseException) -> exceptions.MessageRejected:
        """A broker that raised something it should not (a bug in it): logged with type and
        stack only (its text may quote the message), and the message's failure."""
        logger.error(
            "broker raised unexpectedly",
            extra={
                "action": "publish.error",
                "broker": broker,
                "error": type(exc).__name__,
                "stack": stack(exc),
            },
        )
        return exceptions.MessageRejected(f"broker raised {type(exc).__name__}")

    def _hook(self, hook: Any, *args: Any) -> Any:
        """Call an instrumentation hook; a failing hook is logged, never fatal."""
        try:
            return hook(*args)
        except Exception as exc:
            logger.warning(
                "instrumentation hook failed",
                extra={
                    **self._hook_extra,
                    "action": "instrumentation.failed",
                    "error": safe_error(exc),
                },
            )
            return None


def envelope_of(row: ClaimedRow | WalMessage) -> Envelope:
    """What a claimed outbox row or a WAL message is published as: its headers stay the
    JSON text they were stored as (the broker parses them only if it must)."""
    headers = row.headers
    return Envelope(
        str(row.id),
        row.stream,
        row.type,
        row.key,
        row.payload.encode(),
        None if isinstance(headers, str) else dict(headers),
        headers_json=headers if isinstance(headers, str) else None,
    )

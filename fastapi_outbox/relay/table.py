"""Table relays and their workers: claim → publish → mark, with backoff and wake-ups.

One `TableRelay` per (database, broker) pair runs ``settings.workers`` workers in an
anyio task group. A worker's cycle:

1. **claim** a batch (one statement; attempts counted here, so a message that crashes the
   process every time is still abandoned after ``max_attempts`` claims);
2. **publish** it with one broker call (pipelined / concurrent acks), bounded in time;
3. **mark** the published rows in one statement and the refused ones with a backoff
   (``failed``) or as ``abandoned``, every change fenced by the claim token.

Failure classes: a broker that cannot be reached makes the relay give the batch back
(attempts refunded) and pause as a whole with exponential backoff; a message the broker
refuses is retried on its own with exponential backoff and jitter; a publish that times out
is an outage only when the broker then fails a ping too, otherwise the batch is tried message
by message and the one that hangs is charged (`TableRelay._one_by_one`); a database that
cannot be reached makes workers retry with backoff while the app keeps serving.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import time
import uuid
from collections.abc import Sequence
from itertools import count
from typing import Any

import anyio

from fastapi_outbox import exceptions
from fastapi_outbox.brokers.base import Broker, PublishResults
from fastapi_outbox.events import Envelope
from fastapi_outbox.instrumentation import Instrumentation
from fastapi_outbox.log import safe_error
from fastapi_outbox.relay.loop import (
    DB_BACKOFF_MAX_SECONDS,
    DB_BACKOFF_MIN_SECONDS,
    RelayLoop,
    envelope_of,
)
from fastapi_outbox.relay.ordered import publish_ordered
from fastapi_outbox.relay.outcomes import NotAttempted, Outcomes
from fastapi_outbox.relay.outcomes import retry_delay as retry_delay
from fastapi_outbox.settings import OutboxSettings
from fastapi_outbox.storage import clock
from fastapi_outbox.storage.claims import ClaimedRow, Claims

logger = logging.getLogger("fastapi_outbox.relay")

RELEASE_TIMEOUT_SECONDS = 2.0
#: Longest wait for a broker's ping after a publish timed out (capped by the publish timeout).
PROBE_TIMEOUT_SECONDS = 2.0


def instance_id() -> str:
    """Identifies this relay process in claim tokens: host, pid and a random part."""
    return f"{socket.gethostname()[:32]}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


class TableRelay(RelayLoop):
    """Moves one broker's rows from the outbox table to the broker: the table relay, one per
    broker ("relay" in its logs, metrics and health)."""

    def __init__(
        self,
        *,
        store: Claims,
        broker_name: str,
        broker: Broker,
        settings: OutboxSettings,
        instance: str,
        listening: Any = None,
        instrumentation: Instrumentation | None = None,
    ) -> None:
        super().__init__(settings, hook_extra={"broker": broker_name})
        self.store = store
        self.broker_name = broker_name
        self.broker = broker
        self.instance = instance
        self.instrumentation = instrumentation or Instrumentation()
        self._listening = listening or (lambda: False)
        self._claims = count(1)
        self._broker_connected = False
        self._connect_lock = anyio.Lock()
        self._next_due: float | None = None
        self._due_changed = anyio.Event()
        #: Rows the next claim asks for: adapts to the backlog (see ``_adapt_claim``).
        self.claim_size = settings.smallest_claim
        # Health (the broker outage state is RelayLoop's).
        self.last_tick: float | None = None  # wall clock of the last successful claim
        #: Records the outcome of each claim and publish, and counts them.
        self.outcomes = Outcomes(
            store=store,
            settings=settings,
            broker_name=broker_name,
            instrumentation=self.instrumentation,
            hook=self._hook,
            rng=self._rng,
        )

    def __repr__(self) -> str:
        return f"TableRelay(broker={self.broker_name!r})"

    @property
    def published_total(self) -> int:
        return self.outcomes.published_total

    @property
    def failed_total(self) -> int:
        return self.outcomes.failed_total

    @property
    def abandoned_total(self) -> int:
        return self.outcomes.abandoned_total

    async def run(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        """Run the workers until `stop` (or cancellation)."""
        workers = [functools.partial(self._worker, index) for index in range(self.settings.workers)]
        try:
            await self._supervise(
                workers, task_status, name="table relay", action="relay", broker=self.broker_name
            )
        finally:
            logger.info("relay stopped", extra={"action": "relay.stop", "broker": self.broker_name})

    def schedule(self, delay_seconds: float) -> None:
        """A delayed message of this broker is due in ``delay_seconds``: the idle poller
        looks no later than that (and claims nothing before)."""
        due = time.monotonic() + delay_seconds
        if self._next_due is None or due < self._next_due:
            self._next_due = due
            self._due_changed.set()

    async def _learn_next_due(self) -> None:
        """Ask the database when the next row of this broker becomes due."""
        try:
            with anyio.fail_after(self._db_bound):
                due_in = await self.store.next_due_in(self.broker_name)
        except Exception:
            return  # the claim reports the database; polling goes on
        if due_in is not None:
            self.schedule(due_in)

    async def _idle_wait(self, timeout: float) -> str:
        """Wait for a wake-up ("woken"), the timeout ("timeout"), or an earlier due time
        ("rescheduled": wait again, for less)."""
        outcome = "timeout"
        async with anyio.create_task_group() as tg:

            async def woken() -> None:
                nonlocal outcome
                if await self.wakeup.wait(timeout):
                    outcome = "woken"
                tg.cancel_scope.cancel()

            async def rescheduled() -> None:
                nonlocal outcome
                await self._due_changed.wait()
                outcome = "rescheduled"
                tg.cancel_scope.cancel()

            tg.start_soon(woken)
            tg.start_soon(rescheduled)
        if self._due_changed.is_set():
            self._due_changed = anyio.Event()
        return outcome

    async def _ensure_broker(self) -> None:
        if self._broker_connected:
            return
        async with self._connect_lock:
            if not self._broker_connected:
                await self.broker.connect()
                self._broker_connected = True

    # -- the worker loop ---------------------------------------------------------------------

    async def _worker(self, index: int, first: anyio.Event) -> None:
        """Claim, publish, mark until the relay stops. Worker 0 is the poller: when
        a claim comes back empty it polls (`_poll`); the others wait for a wake-up."""
        settings = self.settings
        poller = index == 0
        idle = settings.poll_interval_seconds
        db_delay = DB_BACKOFF_MIN_SECONDS
        while not self._stopping:
            pause = self._paused_until - time.monotonic()
            if pause > 0:
                await self._sleep(pause)
                continue
            try:
                await self._ensure_broker()
            except Exception as exc:
                self._broker_down(self.broker_name, exc)
                first.set()
                continue
            token = f"{self.instance}:{index}:{next(self._claims)}"
            size = self.claim_size
            try:
                with anyio.fail_after(self._db_bound):
                    batch = await self.store.claim(
                        self.broker_name,
                        size,
                        token,
                        settings.lease_seconds,
                        ordered=settings.ordered,
                    )
            except Exception as exc:
                first.set()
                self._database_failed(
                    exc,
                    self.store.engine.dialect.name,
                    "database unavailable; retrying with backoff",
                    action="claim.failed",
                    broker=self.broker_name,
                )
                await self._sleep(db_delay * (1 + self._rng.uniform(0, 0.25)))
                db_delay = min(db_delay * 2, DB_BACKOFF_MAX_SECONDS)
                continue
            first.set()
            db_delay = DB_BACKOFF_MIN_SECONDS
            self._claimed(len(batch), size)
            if not batch:
                if self._stopping:
                    # stop() came during the claim. Its wake-up is one coalesced signal
                    # that another worker may already have taken: waiting now could last
                    # a poll interval (or, for a non-polling worker, until cancelled).
                    break
                if not poller:
                    await self.wakeup.wait(None)
                    continue
                idle = await self._poll(idle)
                continue
            idle = settings.poll_interval_seconds
            db_delay = await self._take(batch, token, size, db_delay)

    def _claimed(self, got: int, asked: int) -> None:
        """A claim answered: the database is up (logged once after an outage), the tick
        is recorded and the next claim sized."""
        if not self.database_ok:
            logger.info(
                "database available again",
                extra={"action": "database.recovered", "broker": self.broker_name},
            )
        self.database_ok = True
        self.last_tick = clock.wall()
        self._adapt_claim(got, asked)

    async def _poll(self, idle: float) -> float:
        """The poller found nothing: it sleeps until the next row is due (a delayed
        message, a backoff, a lease: asked of the database, so rows of other processes
        count too) or ``idle``, whichever comes first; a delayed message committed
        meanwhile in this process moves that time earlier without a claim before it is
        due. Returns the next idle interval: back to ``poll_interval_seconds`` after a
        wake-up, else doubled — up to ``max_poll_interval_seconds`` while LISTEN delivers
        wake-ups, ``poll_interval_seconds`` without LISTEN."""
        settings = self.settings
        await self._learn_next_due()
        woke = False
        while not self._stopping:
            timeout = idle
            if self._next_due is not None:
                timeout = max(0.0, min(timeout, self._next_due - time.monotonic()))
            outcome = await self._idle_wait(timeout)
            if outcome != "rescheduled":
                woke = outcome == "woken"
                break
        if self._next_due is not None and self._next_due <= time.monotonic():
            self._next_due = None
        cap = (
            settings.max_poll_interval_seconds
            if self._listening()
            else settings.poll_interval_seconds
        )
        return settings.poll_interval_seconds if woke else min(idle * 2, cap)

    async def _take(self, batch: list[ClaimedRow], token: str, size: int, db_delay: float) -> float:
        """Publish and mark a claimed batch; returns the next database backoff (doubled
        when the outcome could not be recorded)."""
        if self._paused_until > time.monotonic():
            # Another worker found the broker down while this claim ran: give the
            # batch back (attempts refunded) rather than call a broker the relay
            # is pausing for.
            with anyio.CancelScope(shield=True), anyio.move_on_after(RELEASE_TIMEOUT_SECONDS):
                await self.store.release([r.id for r in batch], token)
            return db_delay
        if len(batch) >= size:
            self.wakeup.set()  # more work is likely waiting: bring another worker in
        try:
            await self._process(batch, token)
        except _GiveBack:
            pass
        except Exception as exc:
            # Marking failed (database gone mid-batch): the rows keep their lease and
            # are recovered when it expires; the broker's de-duplication absorbs the
            # republish.
            self._database_failed(
                exc,
                self.store.engine.dialect.name,
                "could not record a batch outcome; rows recover after their lease",
                action="mark.failed",
                broker=self.broker_name,
                count=len(batch),
            )
            await self._sleep(db_delay)
            return min(db_delay * 2, DB_BACKOFF_MAX_SECONDS)
        return db_delay

    def _adapt_claim(self, got: int, asked: int) -> None:
        """Size the next claim to the backlog: double it (up to ``batch_size``) when a
        claim came back full, halve it (down to ``min_batch_size``) when one came back
        under a quarter full. An idle relay claims a few rows at a time, so a trickle
        of commits is spread over the workers; a backlog is drained in claims of
        ``batch_size``, where the claim, the publish round trip and the mark cost the
        least per message. The lease does not grow with the claim: each step of a batch
        is bounded on its own (one broker call by ``publish_timeout_seconds``, each
        statement by the statement timeout), whatever its size, and the settings refuse a
        lease shorter than those bounds."""
        if got >= asked:
            self.claim_size = min(asked * 2, self.settings.batch_size)
        elif got < asked // 4:
            self.claim_size = max(asked // 2, self.settings.smallest_claim)

    async def _process(self, batch: list[ClaimedRow], token: str) -> None:
        """Publish a claimed batch and record the outcome; gives the batch back when
        cancelled (shutdown) or when the broker cannot be reached."""
        settled = False
        try:
            await self._publish_and_mark(batch, token)
            settled = True
        finally:
            if not settled:
                with anyio.CancelScope(shield=True), anyio.move_on_after(RELEASE_TIMEOUT_SECONDS):
                    released = await self.store.release([r.id for r in batch], token)
                    logger.info(
                        "claim released",
                        extra={
                            "action": "claim.released",
                            "broker": self.broker_name,
                            "count": released,
                        },
                    )

    async def _publish_and_mark(self, batch: list[ClaimedRow], token: str) -> None:
        settings = self.settings
        exhausted = [r for r in batch if r.attempts > settings.max_attempts]
        live = [r for r in batch if r.attempts <= settings.max_attempts]
        if exhausted:
            await self.outcomes.abandon_exhausted(exhausted, token)
        expired: list[ClaimedRow] = []
        if settings.retry_deadline_seconds is not None:
            # The row's age as the database counted it at the claim: the relay's own
            # clock may be minutes off the clock that wrote created_at.
            deadline = settings.retry_deadline_seconds
            expired = [r for r in live if r.age_seconds is not None and r.age_seconds > deadline]
            if expired:
                gone = {r.id for r in expired}
                live = [r for r in live if r.id not in gone]
                await self.outcomes.abandon_expired(expired, token)
        if settings.ordered and (exhausted or expired):
            live = await self._give_back_behind(batch, live, [*exhausted, *expired], token)
        if not live:
            return
        envelopes = [envelope_of(r) for r in live]
        answered = True
        try:
            with anyio.fail_after(settings.publish_timeout_seconds):
                results = await self._send(envelopes)
        except (exceptions.BrokerTimeout, TimeoutError) as exc:
            if not await self._broker_answers():
                self._broker_down(self.broker_name, exc)
                self._broker_connected = isinstance(exc, TimeoutError)
                raise _GiveBack() from exc
            results = await self._one_by_one(live, envelopes, token, exc)
            answered = self.broker_ok  # False: the broker stopped answering mid-pass
        except exceptions.BrokerUnavailable as exc:
            self._broker_down(self.broker_name, exc)
            self._broker_connected = False
            raise _GiveBack() from exc
        except exceptions.OutboxError as exc:
            results = [exc] * len(envelopes)
        except Exception as exc:  # a bug in a broker must not stop the relay
            results = [self._broker_bug(self.broker_name, exc)] * len(envelopes)
        if answered:
            self._broker_up(self.broker_name)
        with anyio.fail_after(self._db_bound):
            due = await self.outcomes.record(live, envelopes, results, token)
        if due is not None and (self._next_due is None or due < self._next_due):
            self._next_due = due

    async def _give_back_behind(
        self,
        batch: list[ClaimedRow],
        live: list[ClaimedRow],
        abandoned: list[ClaimedRow],
        token: str,
    ) -> list[ClaimedRow]:
        """Ordered: the rows of this batch that come after a row of their key abandoned at
        the claim go back to the table (attempt refunded), where the abandoned row blocks
        them; returns the rest."""
        gone = {r.id for r in abandoned}
        stopped: set[str] = set()
        behind: set[uuid.UUID] = set()
        for row in batch:  # in insert order
            if row.key is None:
                continue
            if row.id in gone:
                stopped.add(row.key)
            elif row.key in stopped:
                behind.add(row.id)
        if behind:
            with anyio.fail_after(self._db_bound):
                await self.store.release(list(behind), token)
        return [r for r in live if r.id not in behind]

    async def _broker_answers(self) -> bool:
        """After a publish timed out: does the broker answer a ping within
        ``PROBE_TIMEOUT_SECONDS`` (or the publish timeout, if shorter)? No answer is an
        outage; an answer means the batch hangs, not the broker."""
        bound = min(self.settings.publish_timeout_seconds, PROBE_TIMEOUT_SECONDS)
        with anyio.move_on_after(bound):
            try:
                await self.broker.ping()
            except Exception:
                return False
            return True
        return False

    async def _one_by_one(
        self, rows: list[ClaimedRow], envelopes: list[Envelope], token: str, exc: BaseException
    ) -> PublishResults:
        """The batch's publish timed out while the broker answered a ping: something in
        the batch hangs, not the broker. Try its messages one at a time, each bounded by
        ``publish_timeout_seconds``; one that times out again while the broker still
        answers is charged (an attempt, backoff, abandoned after ``max_attempts``) and
        the others go out uncharged. A batch of one is charged at once.

        The lease is renewed first, and no message starts later than the renewed lease
        less one publish timeout allows: the rest is given back (attempt refunded) and
        claimed again at once, without the charged message, which backs off. The broker
        failing to answer a ping meanwhile ends the pass as an outage (rest given back,
        relay paused). Ordered: a key stops at its first failure, as in
        `publish_ordered`."""
        settings = self.settings
        logger.warning(
            "publish timed out while the broker answered; trying the batch one by one",
            extra={
                "action": "publish.hung",
                "broker": self.broker_name,
                "count": len(envelopes),
                "error": safe_error(exc),
            },
        )
        self._broker_up(self.broker_name)
        if len(envelopes) == 1:
            return [self._hung(envelopes[0], exc)]
        with anyio.fail_after(self._db_bound):
            held = await self.store.extend_lease(
                [r.id for r in rows], token, settings.lease_seconds
            )
        if held < len(rows):
            raise _GiveBack()  # another worker holds some of them now
        timeout = settings.publish_timeout_seconds
        last_start = time.monotonic() + settings.lease_seconds - 1.25 * timeout
        results: PublishResults = [NotAttempted() for _ in envelopes]
        stopped: set[str] = set()
        for i, envelope in enumerate(envelopes):
            if i and time.monotonic() >= last_start:
                break
            if envelope.key is not None and envelope.key in stopped:
                continue
            result = await self._send_alone(envelope)
            if isinstance(result, _BrokerDown):
                break
            results[i] = result
            if result is not None and settings.ordered and envelope.key is not None:
                stopped.add(envelope.key)
        return results

    async def _send_alone(self, envelope: Envelope) -> BaseException | None:
        """One message of the one-by-one pass, bounded by ``publish_timeout_seconds``:
        None (published), its failure, or `_BrokerDown` when the broker stopped
        answering (the pass ends)."""
        try:
            with anyio.fail_after(self.settings.publish_timeout_seconds):
                return (await self._send([envelope]))[0]
        except (exceptions.BrokerTimeout, TimeoutError) as again:
            if not await self._broker_answers():
                self._broker_down(self.broker_name, again)
                return _BrokerDown()
            return self._hung(envelope, again)
        except exceptions.BrokerUnavailable as down:
            self._broker_down(self.broker_name, down)
            self._broker_connected = False
            return _BrokerDown()
        except exceptions.OutboxError as refused:
            return refused
        except Exception as bug:
            return self._broker_bug(self.broker_name, bug)

    def _hung(self, envelope: Envelope, exc: BaseException) -> exceptions.MessageRejected:
        """The failure charged to a message whose publish timed out on its own while the
        broker answered a ping."""
        return exceptions.MessageRejected(
            f"message {envelope.id}: publish timed out while the broker answered a ping "
            f"(publish_timeout_seconds={self.settings.publish_timeout_seconds:g}; "
            f"{safe_error(exc)})"
        )

    async def _send(self, envelopes: list[Envelope]) -> PublishResults:
        """One broker call (ordered: one per round) between the instrumentation's
        ``publish_started`` hook and its finisher (publish spans, see ``tracing``)."""
        finish = self._hook(self.instrumentation.publish_started, self.broker_name, envelopes)
        try:
            if self.settings.ordered:
                results = await publish_ordered(
                    self.broker, envelopes, self.settings.publish_timeout_seconds / 2
                )
            else:
                results = await self.broker.publish(envelopes)
        except BaseException as exc:
            if finish is not None:
                self._hook(finish, exc)
            raise
        if finish is not None:
            self._hook(finish, results)
        return results


class _GiveBack(Exception):
    """Internal: the batch goes back to the table (broker unreachable)."""


class _BrokerDown(Exception):
    """Internal: the broker stopped answering during the one-by-one pass."""


async def process_batch(relay: TableRelay, batch: Sequence[ClaimedRow], token: str) -> None:
    """Run one claimed batch through ``relay`` (used by the testing helpers)."""
    with contextlib.suppress(_GiveBack):
        await relay._process(list(batch), token)

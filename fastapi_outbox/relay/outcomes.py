"""What a table relay records after a claim and a publish, fenced by the claim token: the
published rows marked, the refused ones retried after their backoff (`retry_delay`) or
abandoned after ``max_attempts``, the rows not attempted given back, and the rows abandoned
at the claim (claimed too often, or past ``retry_deadline_seconds``); each told to the
instrumentation and the logs, and counted for health. `Outcomes` is one table
relay's (`fastapi_outbox.relay.table.TableRelay`)."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import Any

from fastapi_outbox.backoff import exponential_delay
from fastapi_outbox.brokers.base import PublishResults
from fastapi_outbox.events import Envelope
from fastapi_outbox.instrumentation import Instrumentation
from fastapi_outbox.log import safe_error
from fastapi_outbox.relay.loop import envelope_of
from fastapi_outbox.settings import OutboxSettings
from fastapi_outbox.storage.claims import ERROR_MAX_CHARS, ClaimedRow, Claims, Failure

__all__ = ["NotAttempted", "Outcomes", "retry_delay"]

logger = logging.getLogger("fastapi_outbox.relay")


def retry_delay(attempts: int, settings: OutboxSettings, rng: random.Random | None = None) -> float:
    """Exponential backoff with jitter after the ``attempts``-th failed attempt."""
    return exponential_delay(
        attempts,
        base=settings.retry_base_delay_seconds,
        maximum=settings.retry_max_delay_seconds,
        multiplier=settings.retry_multiplier,
        jitter=settings.retry_jitter,
        rng=rng,
    )


class NotAttempted(Exception):
    """A message of a batch not sent (an earlier one of its key failed, or the pass ran out
    of time): given back to the table, its attempt refunded."""


class Outcomes:
    """One table relay's records of its publishes, and its counts of them."""

    def __init__(
        self,
        *,
        store: Claims,
        settings: OutboxSettings,
        broker_name: str,
        instrumentation: Instrumentation,
        hook: Callable[..., Any],
        rng: random.Random,
    ) -> None:
        self.store = store
        self.settings = settings
        self.broker_name = broker_name
        self.instrumentation = instrumentation
        self._hook = hook
        self._rng = rng
        self.published_total = 0
        self.failed_total = 0
        self.abandoned_total = 0

    async def record(
        self,
        rows: list[ClaimedRow],
        envelopes: list[Envelope],
        results: PublishResults,
        token: str,
    ) -> float | None:
        """Record a publish's ``results`` for ``rows`` (fenced by ``token``): published rows
        marked, refused ones retried after their backoff or abandoned, the ones not
        attempted given back. Returns when (``time.monotonic()``) the soonest retry is due,
        if any."""
        due: float | None = None
        published: list[ClaimedRow] = []
        failures: list[Failure] = []
        skipped: list[ClaimedRow] = []
        for row, result in zip(rows, results, strict=True):
            if result is None:
                published.append(row)
            elif isinstance(result, NotAttempted):
                skipped.append(row)
            else:
                abandon = row.attempts >= self.settings.max_attempts
                failures.append(
                    Failure(
                        id=row.id,
                        error=safe_error(result, limit=ERROR_MAX_CHARS),
                        delay_seconds=retry_delay(row.attempts, self.settings, self._rng),
                        abandon=abandon,
                    )
                )
        if published:
            await self.mark_published(published, envelopes, token)
        if failures:
            due = await self.mark_failed(failures, envelopes, token)
        if skipped:
            await self.store.release([r.id for r in skipped], token)
        return due

    async def mark_published(
        self, published: list[ClaimedRow], envelopes: list[Envelope], token: str
    ) -> None:
        """Mark the published rows (one statement, fenced by ``token``) and tell the
        instrumentation."""
        marked = await self.store.mark_published(
            [r.id for r in published], token, delete_rows=self.settings.delete_on_publish
        )
        if marked < len(published):
            logger.warning(
                "lease lost before mark: another worker re-claimed rows",
                extra={
                    "action": "mark.lease_lost",
                    "broker": self.broker_name,
                    "lost": len(published) - marked,
                },
            )
        self.published_total += len(published)
        by_id = {e.id: e for e in envelopes}
        self._hook(
            self.instrumentation.published,
            self.broker_name,
            [by_id[str(r.id)] for r in published],
        )
        logger.debug(
            "published",
            extra={"action": "publish.ok", "broker": self.broker_name, "count": len(published)},
        )

    async def mark_failed(
        self, failures: list[Failure], envelopes: list[Envelope], token: str
    ) -> float | None:
        """Record the refused rows: a retry after their backoff, or abandoned after
        ``max_attempts``; tell the instrumentation. Returns when (``time.monotonic()``)
        the soonest retry is due, for the poller."""
        await self.store.mark_failed(failures, token)
        for f in failures:
            level = logging.ERROR if f.abandon else logging.WARNING
            logger.log(
                level,
                "message abandoned" if f.abandon else "publish failed; will retry",
                extra={
                    "action": "publish.abandoned" if f.abandon else "publish.failed",
                    "broker": self.broker_name,
                    "message_id": str(f.id),
                    "retry_in": None if f.abandon else round(f.delay_seconds, 3),
                    "error": f.error[:300],
                },
            )
        abandoned = [f for f in failures if f.abandon]
        self.failed_total += len(failures) - len(abandoned)
        self.abandoned_total += len(abandoned)
        by_id = {e.id: e for e in envelopes}
        retried = [by_id[str(f.id)] for f in failures if not f.abandon]
        if retried:
            self._hook(self.instrumentation.failed, self.broker_name, retried)
        if abandoned:
            self._hook(
                self.instrumentation.abandoned,
                self.broker_name,
                [by_id[str(f.id)] for f in abandoned],
            )
        soonest = min((f.delay_seconds for f in failures if not f.abandon), default=None)
        return None if soonest is None else time.monotonic() + soonest

    async def abandon_expired(self, rows: list[ClaimedRow], token: str) -> None:
        """Abandon rows older than ``retry_deadline_seconds`` at their claim."""
        deadline = self.settings.retry_deadline_seconds
        await self.store.abandon(
            [r.id for r in rows],
            token,
            f"retry deadline of {deadline:g}s passed (retry_deadline_seconds): not published "
            "that long after its commit",
        )
        self.abandoned_total += len(rows)
        self._hook(self.instrumentation.abandoned, self.broker_name, [envelope_of(r) for r in rows])
        for r in rows:
            logger.error(
                "message abandoned: retry deadline passed",
                extra={
                    "action": "publish.abandoned",
                    "broker": self.broker_name,
                    "message_id": str(r.id),
                    "attempts": r.attempts,
                },
            )

    async def abandon_exhausted(self, rows: list[ClaimedRow], token: str) -> None:
        """Abandon rows claimed more than ``max_attempts`` times without an outcome."""
        error = (
            f"claimed {rows[0].attempts} times (max_attempts={self.settings.max_attempts}) "
            "without a recorded outcome: the relay probably crashed while publishing it"
        )
        await self.store.abandon([r.id for r in rows], token, error)
        self.abandoned_total += len(rows)
        self._hook(self.instrumentation.abandoned, self.broker_name, [envelope_of(r) for r in rows])
        for r in rows:
            logger.error(
                "message abandoned after repeated crashes",
                extra={
                    "action": "publish.abandoned",
                    "broker": self.broker_name,
                    "message_id": str(r.id),
                    "attempts": r.attempts,
                },
            )

"""Batches: a fetched batch in one transaction, and a batch handler's batch retried whole.

A fetched batch (``batch=True``, the default) runs in one transaction: one multi-row inbox
insert, the handlers one after the other, one commit, one ack. When anything fails the
transaction rolls back and every message of the batch goes the per-message way
(`fastapi_outbox.consume.processing`): one poison message costs its batch one extra
pass, never an effect. A batch handler (first parameter ``list[SomeEvent]``) is called once
per batch with a [`BatchUnitOfWork`][fastapi_outbox.BatchUnitOfWork] (in the
transaction `run_batch` runs); its
failing batch is retried whole (``BATCH_HANDLER_TRIES``) before its messages go one by one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from fastapi_outbox.brokers.consumer import Delivery
from fastapi_outbox.consume.processing import (
    InFlight,
    Processing,
    ProcessingOptions,
    ReleasedAtStop,
    Spoiled,
    SubscriberStats,
)
from fastapi_outbox.log import safe_error

__all__ = ["BATCH_HANDLER_TRIES", "Batches"]

logger = logging.getLogger("fastapi_outbox.consume")

#: Tries of a failing batch of a batch handler as a whole (the first, then retries after
#: backoff) before its messages go one by one, each as a one-element list.
BATCH_HANDLER_TRIES = 2


class Batches:
    """One run's handling of fetched batches: each in one transaction of ``processing``,
    acknowledged with ``ack_batch``; the per-message way when anything fails."""

    def __init__(
        self,
        processing: Processing,
        options: ProcessingOptions,
        stats: SubscriberStats,
        flight: InFlight,
        ack_batch: Callable[[list[Delivery]], Awaitable[None]],
    ) -> None:
        self.processing = processing
        self.options = options
        self.stats = stats
        self.flight = flight
        #: Acknowledges a committed batch: the consumer's ``ack_soon`` (or its ``ack``).
        self._ack_batch = ack_batch

    async def handle(self, batch: list[Delivery]) -> None:
        """A fetched batch in one transaction (the per-message way when anything fails);
        settled deliveries leave the flight, unfinished ones stay for the subscriber to
        release at a stop."""
        finished = False
        try:
            todo, messages = await self._split_batch(batch)
            if todo:
                await self._commit_batch(todo, messages)
            finished = True
        except ReleasedAtStop:
            await self.processing.release_unsettled(batch)
        finally:
            # Cancelled (a stop): what did not finish stays in flight, so run() releases
            # it to the broker.
            if finished:
                for d in batch:
                    self.flight.settle(d)
            self.flight.free_slot()

    async def _split_batch(self, batch: list[Delivery]) -> tuple[list[Delivery], list[Any]]:
        """The deliveries of ``batch`` for the batch's transaction and their decoded
        messages (parallel lists: fewer objects for the collector). The others go the
        per-message way now: redelivered ones past the batch's attempts, undecodable ones,
        other types of the stream."""
        todo: list[Delivery] = []
        messages: list[Any] = []
        decoder = self.options.decoder
        restore = self.processing.context.payloads.restore
        # A batch handler's redelivered messages go one by one: a poison message, back
        # for another attempt, does not fail a whole batch again.
        alone = 1 if self.options.signature.batch else self.options.max_attempts
        for d in batch:
            if d.attempt > alone:  # dead-lettered / retried on the careful path
                await self._process_one(d)
                continue
            try:
                messages.append(decoder.decode(await restore(d)))
            except Exception:
                # Undeliverable, NotForHandler, PayloadUnreadable, a payload stage that
                # failed: the per-message path dead-letters, skips or retries it.
                await self._process_one(d)
            else:
                todo.append(d)
        return todo, messages

    async def _commit_batch(self, todo: list[Delivery], messages: list[Any]) -> None:
        """``todo`` in one transaction, then one ack; message by message when it fails."""
        try:
            if self.options.signature.batch:
                new, duplicates = await self._run_batch_retrying(todo, messages)
            else:
                new, duplicates = await self.processing.run_batch(todo, messages)
        except Exception as exc:
            logger.info(
                "batch failed, handling its messages one by one",
                extra=self.options.log_extra(
                    "consumer.batch_failed", count=len(todo), error=repr(exc)[:200]
                ),
            )
            for d in todo:
                await self._process_one(d)
            return
        self.stats.handled += new
        self.stats.duplicates += duplicates
        self.stats.last_handled_at = time.time()
        try:  # the fetch loop fetches again at once (this batch frees its slots)
            await self._ack_batch(todo)
        except Exception as exc:
            logger.warning(
                "ack failed; the messages will be redelivered and skipped",
                extra=self.options.log_extra("consumer.ack_failed", error=repr(exc)[:300]),
            )

    async def _process_one(self, d: Delivery) -> None:
        """A message of a batch on the per-message path; no longer in flight once done."""
        await self.processing.process(d, in_place=False)
        self.flight.settle(d)

    async def _run_batch_retrying(
        self, todo: list[Delivery], messages: list[Any]
    ) -> tuple[int, int]:
        """A batch handler's batch: retried as a whole with backoff (``BATCH_HANDLER_TRIES``
        tries; the database unreachable costs no try), then the last error is raised and
        the caller goes message by message. A handler that rolled back its session costs no
        try: the batch goes again at once, the careful way."""
        processing = self.processing
        tries = outages = 0
        careful = False
        while True:
            try:
                return await processing.run_batch(todo, messages, careful=careful)
            except Spoiled:
                if careful:
                    raise
                careful = True
            except Exception as exc:
                if await processing.waited_out_database(exc, outages, "the batch"):
                    outages += 1
                    continue
                tries += 1
                self.stats.last_error = safe_error(exc)
                if tries >= BATCH_HANDLER_TRIES or self.flight.stopping:
                    raise
                delay = processing.retry_delay(tries)
                logger.warning(
                    "batch handler failed, retrying the batch",
                    extra=self.options.log_extra(
                        "consumer.batch_retry",
                        count=len(todo),
                        error=repr(exc)[:200],
                        retry_in_seconds=round(delay, 3),
                    ),
                )
                await anyio.sleep(delay)

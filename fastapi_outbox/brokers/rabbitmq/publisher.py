"""``RabbitMQPublisher``: publish a batch to a durable topic exchange with publisher
confirms; the stream is the routing key.

A batch goes out on one confirm channel (a pool serves concurrent workers), each message
``mandatory``, and the call returns once RabbitMQ confirmed every message (so the relay
marks nothing RabbitMQ has not taken responsibility for). Per message:

* confirmed → published;
* returned unroutable (``mandatory``: no queue is bound to its stream) → a failure of that
  message, ``last_error`` "no queue bound for stream …", retried with backoff — never a
  silent drop; a subscriber's group queue, declared before the dispatchers publish, is
  what binds a stream;
* nacked by RabbitMQ, or a header name / stream AMQP cannot carry → a failure of that
  message.

The connection blocked by a memory or disk alarm is a refusal of the whole broker
(``BrokerRefusing``); a lost connection, a closed channel, a node down are outages
(``BrokerUnavailable``); no confirm at all within ``confirm_timeout_seconds`` is a
``BrokerTimeout`` (the processor pings to tell which). See :func:`~.wire.outage`.

RabbitMQ has no de-duplication of its own: a batch published again after a crash between
the confirm and the mark arrives twice, with the same ``message_id``; the consumers' inbox
skips the second.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any, Self

from fastapi_outbox import exceptions
from fastapi_outbox.brokers.base import PublishResults, redact_url
from fastapi_outbox.brokers.rabbitmq.connection import RabbitMQConnection
from fastapi_outbox.brokers.rabbitmq.wire import (
    header_problem,
    message_headers,
    outage,
)
from fastapi_outbox.events import Envelope

__all__ = ["DEFAULT_EXCHANGE", "DEFAULT_URL", "RabbitMQPublisher"]

DEFAULT_URL = "amqp://guest:guest@localhost:5672/"
#: The durable topic exchange messages are published to.
DEFAULT_EXCHANGE = "outbox"
CONTENT_TYPE = "application/json"
PERSISTENT = 2


class RabbitMQPublisher:
    """Publishes to RabbitMQ (aio-pika / aiormq) with publisher confirms."""

    def __init__(self, connection: RabbitMQConnection) -> None:
        """Publishes on ``connection`` (its exchange, its confirm timeout)."""
        self.connection = connection
        self.url = connection.url
        self.exchange = connection.exchange
        self.confirm_timeout_seconds = connection.confirm_timeout_seconds

    def __repr__(self) -> str:
        return f"RabbitMQBroker({redact_url(self.url)!r}, exchange={self.exchange!r})"

    def configure(self, *, dedup_window_seconds: float) -> None:
        """Nothing to configure: RabbitMQ does not de-duplicate (the inbox does)."""

    async def connect(self) -> None:
        await self.connection.connect()

    async def aclose(self) -> None:
        await self.connection.aclose()

    async def ping(self) -> None:
        await self.connection.ping()

    async def publish(self, batch: Sequence[Envelope]) -> PublishResults:
        if not batch:
            return []
        import aiormq.exceptions
        from pamqp.commands import Basic

        conn = self.connection
        await conn.connect()
        if conn.blocked is not None:
            raise conn.unavailable(None)
        results: PublishResults = [None] * len(batch)
        tasks: dict[int, asyncio.Future[Any]] = {}
        async with conn.confirming() as channel:
            publish = channel.basic_publish
            exchange = self.exchange
            try:
                for i, e in enumerate(batch):
                    headers, props = message_headers(e)
                    problem = header_problem(headers, e.stream)
                    if problem is not None:
                        results[i] = exceptions.MessageRejected(
                            f"message {e.id} on stream {e.stream[:100]!r}: {problem}"
                        )
                        continue
                    properties = Basic.Properties(
                        content_type=CONTENT_TYPE,
                        delivery_mode=PERSISTENT,
                        headers=headers,
                        **props,
                    )
                    # A task each, started in order: each writes its frames at once (the
                    # channel's lock is free) and then waits for its confirm, so the batch
                    # goes out in one run and its confirms are awaited together.
                    tasks[i] = asyncio.ensure_future(
                        publish(
                            e.payload,
                            exchange=exchange,
                            routing_key=e.stream,
                            properties=properties,
                            mandatory=True,
                            wait=False,
                        )
                    )
                if not tasks:
                    return results
                done, pending = await asyncio.wait(
                    tasks.values(), timeout=self.confirm_timeout_seconds
                )
            except BaseException:
                await _cancel(tasks.values())
                raise
            if pending:
                await _cancel(pending)
                if not done:
                    # Not one confirm: a blocked or frozen broker (the processor pings to
                    # tell an outage from a batch that hangs).
                    blocked = conn.blocked
                    if blocked is not None:
                        raise conn.unavailable(None)
                    raise exceptions.BrokerTimeout(
                        f"RabbitMQ at {redact_url(self.url)}: no confirm for {len(tasks)} "
                        f"messages in {self.confirm_timeout_seconds:g}s"
                    )
                # The channel holds unconfirmed publishes: closed rather than reused.
                with contextlib.suppress(Exception):
                    await channel.close()
            down: Exception | None = None
            for i, task in tasks.items():
                if task in pending:
                    results[i] = exceptions.MessageRejected(
                        f"no confirm for message {batch[i].id} within "
                        f"{self.confirm_timeout_seconds:g}s"
                    )
                    continue
                error = task.exception()
                if error is None:
                    continue
                e = batch[i]
                if isinstance(error, aiormq.exceptions.PublishError):
                    results[i] = exceptions.MessageRejected(
                        f"no queue bound for stream {e.stream!r} on exchange {exchange!r}: "
                        f"message {e.id} returned unroutable"
                    )
                elif isinstance(error, aiormq.exceptions.DeliveryError):
                    results[i] = exceptions.MessageRejected(
                        f"RabbitMQ nacked message {e.id} on stream {e.stream!r}"
                    )
                else:
                    found = outage(error, self.url, blocked=conn.blocked)
                    if found is not None:
                        down = down or found  # raised once every task's error is read
                        continue
                    results[i] = exceptions.MessageRejected(
                        f"RabbitMQ refused message {e.id} on stream {e.stream!r}: "
                        f"{type(error).__name__}: {error}"
                    )
            if down is not None:
                conn.channel_failed()
                raise down
        return results

    async def __aenter__(self) -> Self:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def _cancel(tasks: Any) -> None:
    """Cancel ``tasks`` and wait for them, their errors retrieved."""
    tasks = list(tasks)
    for task in tasks:
        task.cancel()
    with contextlib.suppress(BaseException):
        await asyncio.gather(*tasks, return_exceptions=True)

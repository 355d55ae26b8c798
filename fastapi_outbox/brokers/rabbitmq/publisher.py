"""``RabbitMQPublisher``: publish a batch to a durable topic exchange with publisher
confirms; the stream is the routing key.

A batch goes out on one confirm channel (a pool serves concurrent workers), each message
``mandatory``, its frames written as one buffer (half the client CPU of a ``basic_publish``
task per message), and the call returns once RabbitMQ confirmed every message (so the relay
marks nothing RabbitMQ has not taken responsibility for). Per message:

* confirmed → published;
* returned unroutable (``mandatory``: no queue is bound to its stream) → a failure of that
  message, ``last_error`` "no queue bound for stream …", retried with backoff — never a
  silent drop; a subscriber's group queue, declared before the relays publish, is
  what binds a stream;
* nacked by RabbitMQ, or a header name / stream AMQP cannot carry → a failure of that
  message.

The connection blocked by a memory or disk alarm is a refusal of the whole broker
(``BrokerRefusing``); a lost connection, a closed channel, a node down are outages
(``BrokerUnavailable``); no confirm at all within ``confirm_timeout_seconds`` is a
``BrokerTimeout`` (the relay pings to tell which). See `outage`.

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
from fastapi_outbox.brokers.cloudevents import CloudEventsOptions
from fastapi_outbox.brokers.rabbitmq.connection import RabbitMQConnection
from fastapi_outbox.brokers.rabbitmq.wire import (
    CONTENT_TYPE,
    cloudevent_message,
    header_problem,
    message_headers,
    outage,
)
from fastapi_outbox.events import Envelope

__all__ = ["DEFAULT_EXCHANGE", "DEFAULT_URL", "RabbitMQPublisher"]

DEFAULT_URL = "amqp://guest:guest@localhost:5672/"
#: The durable topic exchange messages are published to.
DEFAULT_EXCHANGE = "outbox"
PERSISTENT = 2


class RabbitMQPublisher:
    """Publishes to RabbitMQ (aio-pika / aiormq) with publisher confirms."""

    def __init__(
        self, connection: RabbitMQConnection, *, envelope_format: CloudEventsOptions | None = None
    ) -> None:
        """Publishes on ``connection`` (its exchange, its confirm timeout);
        ``envelope_format`` with CloudEvents sends each message as a CloudEvent."""
        self.connection = connection
        self.envelope_format = envelope_format or CloudEventsOptions()
        self.url = connection.url
        self.exchange = connection.exchange
        self.confirm_timeout_seconds = connection.confirm_timeout_seconds
        #: Write a batch's frames as one buffer (`_write_batch`); False, or an aiormq
        #: whose channel lacks what that needs: ``basic_publish`` per message.
        self.batch_frames = True

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
        conn = self.connection
        await conn.connect()
        if conn.blocked is not None:
            raise conn.unavailable(None)
        results: PublishResults = [None] * len(batch)
        tasks: dict[int, asyncio.Future[Any]] = {}
        async with conn.confirming() as channel:
            try:
                await self._start(channel, self._messages(batch, results), tasks)
                if not tasks:
                    return results
                done, pending = await asyncio.wait(
                    tasks.values(), timeout=self.confirm_timeout_seconds
                )
            except BaseException:
                await _cancel(tasks.values())
                raise
            if pending:
                await self._unconfirmed(channel, pending, any_done=bool(done), sent=len(tasks))
            down = self._read_confirms(batch, tasks, pending, results)
            if down is not None:
                conn.channel_failed()
                raise down
        return results

    def _messages(
        self, batch: Sequence[Envelope], results: PublishResults
    ) -> list[tuple[int, bytes, str, Any]]:
        """``(index, body, stream, properties)`` of each message AMQP can carry; a message
        whose headers or stream it cannot gets its refusal in ``results`` instead."""
        from pamqp.commands import Basic

        cloud = self.envelope_format.enabled
        messages: list[tuple[int, bytes, str, Any]] = []
        for i, e in enumerate(batch):
            headers, props = message_headers(e)
            body, content_type = e.payload, CONTENT_TYPE
            if cloud:
                headers, content_type, body = cloudevent_message(e, self.envelope_format)
            problem = header_problem(headers, e.stream)
            if problem is not None:
                results[i] = exceptions.MessageRejected(
                    f"message {e.id} on stream {e.stream[:100]!r}: {problem}"
                )
                continue
            properties = Basic.Properties(
                content_type=content_type,
                delivery_mode=PERSISTENT,
                headers=headers,
                **props,
            )
            messages.append((i, body, e.stream, properties))
        return messages

    async def _start(
        self,
        channel: Any,
        messages: list[tuple[int, bytes, str, Any]],
        tasks: dict[int, asyncio.Future[Any]],
    ) -> None:
        """Write every message; ``tasks`` receives each one's confirm as it is started, so
        the caller cancels those already started when a later one fails."""
        if self.batch_frames and _can_write_frames(channel):
            tasks.update(await _write_batch(channel, self.exchange, messages))
            return
        # A task each, started in order: each writes its frames at once (the channel's lock
        # is free) and then waits for its confirm.
        for i, payload, stream, properties in messages:
            tasks[i] = asyncio.ensure_future(
                channel.basic_publish(
                    payload,
                    exchange=self.exchange,
                    routing_key=stream,
                    properties=properties,
                    mandatory=True,
                    wait=False,
                )
            )

    async def _unconfirmed(
        self, channel: Any, pending: set[asyncio.Future[Any]], *, any_done: bool, sent: int
    ) -> None:
        """Some confirms did not come in time: cancelled, and the channel, which holds
        unconfirmed publishes, closed rather than reused. Not one confirm: a blocked or
        frozen broker, raised (the relay pings to tell an outage from a batch that hangs)."""
        await _cancel(pending)
        if not any_done:
            if self.connection.blocked is not None:
                raise self.connection.unavailable(None)
            raise exceptions.BrokerTimeout(
                f"RabbitMQ at {redact_url(self.url)}: no confirm for {sent} "
                f"messages in {self.confirm_timeout_seconds:g}s"
            )
        with contextlib.suppress(Exception):
            await channel.close()

    def _read_confirms(
        self,
        batch: Sequence[Envelope],
        tasks: dict[int, asyncio.Future[Any]],
        pending: set[asyncio.Future[Any]],
        results: PublishResults,
    ) -> Exception | None:
        """Each message's outcome into ``results``; the outage to raise for the whole batch,
        if any (returned after every task's error is read, so none is left unretrieved)."""
        import aiormq.exceptions

        conn = self.connection
        down: Exception | None = None
        for i, task in tasks.items():
            if task in pending:
                results[i] = exceptions.MessageRejected(
                    f"no confirm for message {batch[i].id} within {self.confirm_timeout_seconds:g}s"
                )
                continue
            if task.cancelled():  # the channel went away under it
                down = down or conn.unavailable(None)
                continue
            error = task.exception()
            if error is None:
                continue
            e = batch[i]
            if not isinstance(error, Exception):  # a CancelledError: the channel closed
                down = down or conn.unavailable(None)
                continue
            if isinstance(error, aiormq.exceptions.PublishError):
                results[i] = exceptions.MessageRejected(
                    f"no queue bound for stream {e.stream!r} on exchange {self.exchange!r}: "
                    f"message {e.id} returned unroutable"
                )
            elif isinstance(error, aiormq.exceptions.DeliveryError):
                results[i] = exceptions.MessageRejected(
                    f"RabbitMQ nacked message {e.id} on stream {e.stream!r}"
                )
            else:
                found = outage(error, self.url, blocked=conn.blocked)
                if found is not None:
                    down = down or found
                    continue
                results[i] = exceptions.MessageRejected(
                    f"RabbitMQ refused message {e.id} on stream {e.stream!r}: "
                    f"{type(error).__name__}: {error}"
                )
        return down

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


#: What `_write_batch` uses of an aiormq channel; a channel without any of them is
#: published to message by message with ``basic_publish``.
_CHANNEL_PARTS = (
    "lock",
    "delivery_tag",
    "confirmations",
    "message_id_delivery_tag",
    "write_queue",
    "create_future",
    "_split_body",
    "number",
)


def _can_write_frames(channel: Any) -> bool:
    return all(hasattr(channel, part) for part in _CHANNEL_PARTS)


async def _write_batch(
    channel: Any, exchange: str, messages: list[tuple[int, bytes, str, Any]]
) -> dict[int, asyncio.Future[Any]]:
    """The whole batch as one write: each message's publish, header and body frames
    appended to one buffer and a confirm future registered for each, as aiormq's
    ``basic_publish`` does for one message (its delivery tag, its confirmation, its message
    id for a return) — one frame marshalling call and one socket write for the batch
    instead of a task, a lock round and a write per message. Returns index -> future,
    which aiormq completes with the confirm, a ``PublishError`` (returned unroutable), a
    ``DeliveryError`` (nacked) or the channel's close reason."""
    from aiormq.abc import ChannelFrame
    from pamqp.commands import Basic
    from pamqp.header import ContentHeader

    futures: dict[int, asyncio.Future[Any]] = {}
    frames: list[Any] = []
    by_message_id = channel.message_id_delivery_tag
    async with channel.lock:
        for i, payload, routing_key, properties in messages:
            channel.delivery_tag += 1
            tag = channel.delivery_tag
            future = channel.create_future()
            channel.confirmations[tag] = future
            by_message_id[properties.message_id] = tag
            future.add_done_callback(_forget(by_message_id, properties.message_id, tag))
            frames.append(Basic.Publish(exchange=exchange, routing_key=routing_key, mandatory=True))
            frames.append(ContentHeader(properties=properties, body_size=len(payload)))
            frames.extend(channel._split_body(payload))
            futures[i] = future
        await channel.write_queue.put(
            ChannelFrame.marshall(channel_number=channel.number, frames=frames)
        )
    return futures


def _forget(by_message_id: dict[str, int], message_id: str, tag: int) -> Any:
    def forget(_: asyncio.Future[Any]) -> None:
        if by_message_id.get(message_id) == tag:
            by_message_id.pop(message_id, None)

    return forget

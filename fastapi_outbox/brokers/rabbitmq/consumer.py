"""``RabbitMQConsumer``: a subscriber group as a durable quorum queue.

* ``setup``: the group's queue (``queue_name``, default ``{stream}.{group}``: durable,
  ``x-queue-type: quorum``, ``x-single-active-consumer`` for ``ordered=True``) bound to the
  exchange with the stream as routing key, and the dead-letter queue (durable, classic:
  browsing it does not count deliveries). A queue that exists with other arguments refuses
  the start with a ConfigurationError naming the setting. A group's queue receives what is
  published from its creation on: ``start="all"`` cannot reach further back (RabbitMQ keeps
  no history), so declare groups before publishing (``db create``, ``create_tables``, and
  every process's relays do).
* ``fetch``: a consumer on a channel of its own with ``prefetch`` = the subscriber's
  in-flight limit (``concurrency`` times ``batch_size``); deliveries wait in a local buffer
  until fetched. The attempt is the quorum queue's ``x-delivery-count`` + 1. The consumer is
  started again (queue and binding declared again) when RabbitMQ cancelled it (its queue
  deleted) or its channel or connection went away.
* ``ack`` after commit (``basic.ack``); ``retry(delay)``: held, then ``basic.nack`` with
  requeue after ``delay`` (the count goes up); ``release``: ``basic.cancel`` (no more
  deliveries to this consumer), then ``basic.nack`` with requeue. The queue's count rises
  for a message requeued unhandled too: the subscriber counts a redelivered message's
  attempts itself (`fastapi_outbox.storage.group_members`).
* ``touch``: RabbitMQ keeps an unacknowledged delivery with its channel until the channel
  closes, so a lost consumer's deliveries come back at once; a delivery this consumer holds
  that nobody touched, acknowledged or retried for ``claim_idle_seconds`` (an ack that was
  lost in the subscriber) is requeued by the consumer itself, as Redis's ``XAUTOCLAIM`` and
  JetStream's ack wait do.
* ``dead_letter``: the library's own routing, not a dead-letter exchange (a DLX cannot add
  the error): the message, its original headers and properties plus ``dead-letter-*``
  headers, published with a confirm to the dead-letter queue through the default exchange,
  then acknowledged.
* ``dead_letters`` / ``count_dead_letters`` / ``replay_dead_letters``: the dead-letter queue
  read with ``basic.get`` on a channel of their own and given back by closing it (order
  kept); a replayed letter goes to this group's queue only (the default exchange), so other
  groups of the stream never see it again.

Failures of RabbitMQ itself raise [`BrokerUnavailable`][fastapi_outbox.BrokerUnavailable]
(`outage`): the subscriber pauses, no attempt is charged.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi_outbox import exceptions
from fastapi_outbox.brokers import cloudevents
from fastapi_outbox.brokers import consumer as consumer_mod
from fastapi_outbox.brokers.consumer import ConsumerConfig, ConsumerLag, DeadLetter, Delivery
from fastapi_outbox.brokers.rabbitmq.connection import RabbitMQConnection
from fastapi_outbox.brokers.rabbitmq.wire import (
    CONTENT_TYPE,
    KEY_HEADER,
    cloudevent_headers,
    delivery_attempt,
    message_identity,
    queue_name,
    user_headers,
)
from fastapi_outbox.events import HEADER_MESSAGE_ID, uuid7

__all__ = [
    "DEAD_LETTER_ID",
    "DEAD_LETTER_SCAN",
    "DEFAULT_PREFETCH",
    "DELIVERY_LIMIT",
    "RabbitMQConsumer",
]

logger = logging.getLogger("fastapi_outbox.brokers.rabbitmq")

#: Dead letters read for listing, replay and counting a shared dead-letter queue.
DEAD_LETTER_SCAN = 1_000
#: Header naming a dead letter (its entry id for listing and replay).
DEAD_LETTER_ID = "dead-letter-id"
#: The quorum queue's own delivery limit, set far above any ``max_attempts``: the
#: subscriber counts the attempts and dead-letters with the error, and a message whose
#: dead-lettering keeps failing stays queued. (RabbitMQ 4 drops a message past its default
#: limit of 20 when no dead-letter exchange is set.)
DELIVERY_LIMIT = 1_000_000
#: Prefetch of a consumer whose subscriber did not say.
DEFAULT_PREFETCH = 100
API_TIMEOUT_SECONDS = 5.0
#: A fetch that got a delivery waits this long for the next one of the same burst...
LINGER_QUIET_SECONDS = 0.002
#: ...and this long in all.
LINGER_MAX_SECONDS = 0.02


class _RabbitDelivery(Delivery):
    """A RabbitMQ delivery: its headers (all but the key and RabbitMQ's own) taken from the
    AMQP headers when first asked for; ``handle`` is (aiormq channel, delivery tag, AMQP
    properties)."""

    __slots__ = ()

    @property
    def headers(self) -> dict[str, str]:
        if self._headers is None:
            self._headers = user_headers(self.handle[2].headers)
        return self._headers


class RabbitMQConsumer:
    """One group's quorum queue of one stream."""

    def __init__(
        self,
        connection: RabbitMQConnection,
        config: ConsumerConfig,
        *,
        queue_template: str,
        queue_arguments: dict[str, Any] | None = None,
        dead_letter_queue: str | None = None,
    ) -> None:
        self.connection = connection
        self.config = config
        self.queue = queue_name(queue_template, config.stream, config.group)
        #: The dead-letter queue: the subscriber's dead-letter name (with the broker's
        #: queue prefix).
        self.dead_letter_queue = dead_letter_queue or config.dead_letter
        self.queue_arguments = dict(queue_arguments or {})
        self.prefetch = config.prefetch or DEFAULT_PREFETCH
        self._channel: Any = None  # the aio-pika channel consumed on
        self._amqp: Any = None  # its aiormq channel
        self._tag: str | None = None
        self._epoch = 0
        self._buffer: asyncio.Queue[Any] = asyncio.Queue()
        self._arrived = asyncio.Event()
        #: entry id -> (delivery, when last fetched or touched): held, not yet settled.
        self._unsettled: dict[str, tuple[Delivery, float]] = {}
        self._retries: dict[str, asyncio.TimerHandle] = {}
        #: Tags of this channel whose nack is on its way (a task of ``_settle``).
        self._settling: set[int] = set()
        self._last_sweep = time.monotonic()

    def __repr__(self) -> str:
        return f"RabbitMQConsumer(queue={self.queue!r}, group={self.config.group!r})"

    # -- declaring ---------------------------------------------------------------------------

    def _arguments(self) -> dict[str, Any]:
        arguments: dict[str, Any] = {
            "x-queue-type": "quorum",
            "x-delivery-limit": DELIVERY_LIMIT,
            **self.queue_arguments,
        }
        if self.config.ordered:
            arguments["x-single-active-consumer"] = True
        return arguments

    @contextlib.asynccontextmanager
    async def _temporary(self) -> AsyncIterator[Any]:
        """A channel for one operation, closed after (unacknowledged gets go back)."""
        channel = await self.connection.channel()
        try:
            yield channel
        except exceptions.OutboxError:
            raise
        except Exception as exc:
            found = self.connection.unavailable(exc)
            raise found from exc
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(channel.close(), API_TIMEOUT_SECONDS)

    async def _declare(self, channel: Any) -> Any:
        import aiormq.exceptions

        try:
            queue = await channel.declare_queue(
                self.queue, durable=True, arguments=self._arguments()
            )
        except aiormq.exceptions.ChannelPreconditionFailed as exc:
            raise exceptions.ConfigurationError(
                f"subscriber of stream {self.config.stream!r}, group {self.config.group!r}: "
                f"RabbitMQ queue {self.queue!r} exists with other arguments than "
                f"{self._arguments()} (ordered=True is x-single-active-consumer): {exc}; "
                f"delete the queue (rabbitmqctl delete_queue {self.queue}) or restore the "
                "old settings"
            ) from exc
        await queue.bind(self.connection.exchange, routing_key=self.config.stream)
        return queue

    async def setup(self) -> None:
        """The group's queue and binding, and the dead-letter queue (idempotent)."""
        await self.connection.connect()
        async with self._temporary() as channel:
            await self._declare(channel)
        await self._declare_dead_letter()

    async def _declare_dead_letter(self) -> None:
        """The dead-letter queue: durable, classic (browsing it counts no deliveries)."""
        async with self._temporary() as channel:
            await channel.declare_queue(
                self.dead_letter_queue, durable=True, arguments={"x-queue-type": "classic"}
            )

    # -- consuming ---------------------------------------------------------------------------

    def _consuming(self) -> bool:
        amqp = self._amqp
        return (
            amqp is not None
            and not self._channel.is_closed
            and self._tag is not None
            and self._tag in amqp.consumers
        )

    async def _start(self) -> None:
        """Consume on a new channel (after a first fetch, a cancel or a lost channel)."""
        await self._stop_consuming()
        channel = await self.connection.channel(prefetch=self.prefetch)
        try:
            await self._declare(channel)
            amqp = await channel.get_underlay_channel()
            epoch = self._epoch = self._epoch + 1
            buffer = self._buffer

            arrived = self._arrived

            async def on_message(message: Any) -> None:
                buffer.put_nowait((epoch, message))
                arrived.set()

            ok = await amqp.basic_consume(self.queue, on_message, no_ack=False)
        except BaseException as exc:
            with contextlib.suppress(Exception):
                await channel.close()
            if isinstance(exc, exceptions.OutboxError) or not isinstance(exc, Exception):
                raise
            raise self.connection.unavailable(exc) from exc
        self._channel, self._amqp, self._tag = channel, amqp, ok.consumer_tag

    async def _stop_consuming(self) -> None:
        channel, self._channel, self._amqp, self._tag = self._channel, None, None, None
        # What it held goes back to the queue with the channel.
        self._unsettled.clear()
        for handle in self._retries.values():
            handle.cancel()
        self._retries.clear()
        self._settling = set()
        self._buffer = asyncio.Queue()
        if channel is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(channel.close(), API_TIMEOUT_SECONDS)

    def _delivery(self, message: Any) -> Delivery:
        properties = message.header.properties
        raw = properties.headers or {}
        key = raw.get(KEY_HEADER)
        tag = message.delivery.delivery_tag
        ce_headers = cloudevent_headers(raw, properties.content_type)
        if ce_headers is not None:  # a CloudEvent, binary or structured, from any producer
            event = cloudevents.as_delivery(
                ce_headers,
                message.body,
                stream=self.config.stream,
                entry_id=f"{self._epoch}.{tag}",
                attempt=delivery_attempt(raw),
                key=key.decode() if isinstance(key, bytes) else key,
                handle=(message.channel, tag, properties),
            )
            if event is not None:
                return event
        message_id, type_ = message_identity(raw, properties.message_id)
        return _RabbitDelivery(
            stream=self.config.stream,
            entry_id=f"{self._epoch}.{tag}",
            message_id=message_id or f"{self.queue}:{tag}",
            type=type_ or (properties.message_type or ""),
            key=key.decode() if isinstance(key, bytes) else key,
            payload=message.body,
            attempt=delivery_attempt(raw),
            handle=(message.channel, tag, properties),
        )

    async def fetch(self, max_messages: int, timeout: float) -> list[Delivery]:
        if not self._consuming():
            if self._channel is not None:
                logger.warning(
                    "rabbitmq consumer lost (channel closed or queue deleted), consuming again",
                    extra={"action": "consumer.restarted", "queue": self.queue},
                )
            await self._start()
        self._sweep()
        buffer = self._buffer
        out: list[Delivery] = []
        if buffer.empty():
            try:
                self._take(await asyncio.wait_for(buffer.get(), timeout), out)
            except TimeoutError:
                return out
        # RabbitMQ pushes a burst of deliveries one after the other (and aiormq hands each
        # to a task of its own): while they keep coming, wait for the next one a moment
        # (LINGER_QUIET_SECONDS, LINGER_MAX_SECONDS in all) to hand the burst over as one
        # batch rather than as a batch per arrival. A full batch waits for nothing.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + LINGER_MAX_SECONDS
        arrived = self._arrived
        while buffer.qsize() + len(out) < max_messages:
            arrived.clear()
            wait = min(LINGER_QUIET_SECONDS, deadline - loop.time())
            if wait <= 0:
                break
            try:
                await asyncio.wait_for(arrived.wait(), wait)
            except TimeoutError:
                break
        while len(out) < max_messages and not buffer.empty():
            self._take(buffer.get_nowait(), out)
        return out

    def _take(self, item: tuple[int, Any], out: list[Delivery]) -> None:
        epoch, message = item
        if epoch != self._epoch:
            return  # delivered on a channel that is gone: RabbitMQ requeued it
        d = self._delivery(message)
        self._unsettled[d.entry_id] = (d, time.monotonic())
        out.append(d)

    def _sweep(self) -> None:
        """Requeue deliveries held past ``claim_idle_seconds`` without a touch, an ack or
        a retry (an ack the subscriber lost): the broker then delivers them again."""
        now = time.monotonic()
        idle = self.config.claim_idle_seconds
        if now - self._last_sweep < idle / 4:
            return
        self._last_sweep = now
        stale = [d for d, seen in self._unsettled.values() if now - seen > idle]
        for d in stale:
            self._unsettled.pop(d.entry_id, None)
            self._settle(d, "basic_nack", requeue=True)
        if stale:
            logger.info(
                "rabbitmq deliveries idle past claim_idle_seconds requeued",
                extra={"action": "consumer.reclaimed", "queue": self.queue, "count": len(stale)},
            )

    def _settle(self, d: Delivery, method: str, **kwargs: Any) -> None:
        """``basic_ack`` / ``basic_nack`` of ``d`` on its channel, unless that channel is
        gone (RabbitMQ requeued the delivery with it)."""
        amqp, tag, _ = d.handle
        if amqp is not self._amqp or amqp.is_closed:
            return
        # Until its frame is written, no ``multiple`` ack may cover it (see ``ack``).
        settling = self._settling
        settling.add(tag)
        task = asyncio.ensure_future(getattr(amqp, method)(tag, wait=False, **kwargs))

        def done(task: asyncio.Future[Any]) -> None:
            settling.discard(tag)
            _quiet(task)

        task.add_done_callback(done)

    async def _settle_now(self, deliveries: Sequence[Delivery], method: str, **kw: Any) -> None:
        error: BaseException | None = None
        for d in deliveries:
            self._unsettled.pop(d.entry_id, None)
            amqp, tag, _ = d.handle
            if amqp is not self._amqp or amqp.is_closed:
                continue  # requeued with its channel: redelivered, skipped by the inbox
            try:
                await getattr(amqp, method)(tag, wait=False, **kw)
            except Exception as exc:
                error = error or exc
        if error is not None:
            raise self.connection.unavailable(error) from error

    async def ack(self, deliveries: Sequence[Delivery]) -> None:
        amqp = self._amqp
        if len(deliveries) > 1 and amqp is not None and not amqp.is_closed:
            top = self._covering_tag(deliveries, amqp)
            if top is not None:
                # One ``basic.ack`` with ``multiple`` for the whole batch: no delivery of
                # this channel up to its last tag is held by anyone else.
                for d in deliveries:
                    self._unsettled.pop(d.entry_id, None)
                try:
                    await amqp.basic_ack(top, multiple=True, wait=False)
                except Exception as exc:
                    raise self.connection.unavailable(exc) from exc
                return
        await self._settle_now(deliveries, "basic_ack")

    def _covering_tag(self, deliveries: Sequence[Delivery], amqp: Any) -> int | None:
        """The highest tag of ``deliveries`` when they are all of channel ``amqp`` and
        every other delivery this consumer holds on it (fetched and unsettled, or waiting
        for its retry) has a higher tag — deliveries still in the buffer came after all
        fetched ones — else None."""
        mine = set()
        top = 0
        for d in deliveries:
            channel, tag, _ = d.handle
            if channel is not amqp:
                return None
            mine.add(d.entry_id)
            top = max(top, tag)
        for entry_id, (d, _) in self._unsettled.items():
            if entry_id not in mine and d.handle[1] <= top:
                return None
        if any(tag <= top for tag in self._settling):
            return None
        prefix = f"{self._epoch}."
        for entry_id in self._retries:
            if entry_id.startswith(prefix) and int(entry_id[len(prefix) :]) <= top:
                return None
        return top

    async def ack_soon(self, deliveries: Sequence[Delivery]) -> None:
        await self.ack(deliveries)

    async def retry(self, delivery: Delivery, delay: float) -> None:
        self._unsettled.pop(delivery.entry_id, None)
        loop = asyncio.get_running_loop()

        def due() -> None:
            self._retries.pop(delivery.entry_id, None)
            self._settle(delivery, "basic_nack", requeue=True)

        self._retries[delivery.entry_id] = loop.call_later(max(0.0, delay), due)

    async def defer(self, delivery: Delivery, delay: float) -> None:
        # Requeued after ``delay`` (the quorum queue counts it; the subscriber counts
        # attempts itself): RabbitMQ gives it to any consumer of the queue.
        await self.retry(delivery, delay)

    async def touch(self, deliveries: Sequence[Delivery]) -> None:
        now = time.monotonic()
        for d in deliveries:
            if d.entry_id in self._unsettled:
                self._unsettled[d.entry_id] = (d, now)

    async def release(self, deliveries: Sequence[Delivery]) -> None:
        # Consuming stops first (basic.cancel): requeued while this channel still consumes,
        # a message came straight back here and was returned again, its count raised
        # each time. What the channel still holds goes back when it closes.
        await self._cancel_consumer()
        for d in deliveries:
            handle = self._retries.pop(d.entry_id, None)
            if handle is not None:
                handle.cancel()
        await self._settle_now(deliveries, "basic_nack", requeue=True)

    async def _cancel_consumer(self) -> None:
        amqp, tag = self._amqp, self._tag
        if amqp is None or tag is None or amqp.is_closed:
            return
        self._tag = None  # a later fetch consumes again
        try:
            await asyncio.wait_for(amqp.basic_cancel(tag), API_TIMEOUT_SECONDS)
        except Exception as exc:  # the channel's close requeues what it holds anyway
            logger.debug("basic.cancel failed: %r", exc)

    # -- dead letters ------------------------------------------------------------------------

    async def dead_letter(self, delivery: Delivery, error: str) -> None:
        from pamqp.commands import Basic

        original = delivery.handle[2]
        headers: dict[str, Any] = {
            **delivery.headers,
            HEADER_MESSAGE_ID: delivery.message_id,
            consumer_mod.DEAD_LETTER_ERROR: " ".join(consumer_mod.truncate_error(error).split()),
            consumer_mod.DEAD_LETTER_GROUP: self.config.group,
            consumer_mod.DEAD_LETTER_ATTEMPTS: str(delivery.attempt),
            consumer_mod.DEAD_LETTER_STREAM: self.config.stream,
            consumer_mod.DEAD_LETTERED_AT: dt.datetime.now(dt.UTC).isoformat(),
            DEAD_LETTER_ID: str(uuid7()),
        }
        if delivery.key is not None:
            headers[KEY_HEADER] = delivery.key
        content_type = original.content_type
        if content_type and content_type.startswith("application/cloudevents"):
            # The payload alone goes on, not the CloudEvent's structured body.
            content_type = CONTENT_TYPE
        properties = Basic.Properties(
            content_type=content_type,
            delivery_mode=2,
            headers=headers,
            message_id=original.message_id,
            message_type=original.message_type,
            timestamp=original.timestamp,
            correlation_id=original.correlation_id,
        )
        try:
            await self.connection.publish_confirmed(
                delivery.payload,
                routing_key=self.dead_letter_queue,
                properties=properties,
                exchange="",
            )
        except exceptions.MessageRejected:
            # Returned: the dead-letter queue is gone (deleted by hand): declared again,
            # then the letter goes once more.
            await self._declare_dead_letter()
            await self.connection.publish_confirmed(
                delivery.payload,
                routing_key=self.dead_letter_queue,
                properties=properties,
                exchange="",
            )
        await self.ack([delivery])

    async def _browse(self, channel: Any, limit: int) -> list[Any]:
        """Up to ``limit`` messages of the dead-letter queue (all groups'), oldest first,
        held unacknowledged on ``channel``; None when it does not exist."""
        import aiormq.exceptions

        try:
            queue = await channel.declare_queue(self.dead_letter_queue, passive=True)
        except aiormq.exceptions.ChannelNotFoundEntity:
            return []
        out: list[Any] = []
        while len(out) < limit:
            message = await queue.get(no_ack=False, fail=False, timeout=API_TIMEOUT_SECONDS)
            if message is None:
                break
            out.append(message)
        return out

    def _mine(self, message: Any) -> bool:
        group = (message.headers or {}).get(consumer_mod.DEAD_LETTER_GROUP)
        return bool(group == self.config.group)

    async def dead_letters(self, limit: int = 100) -> list[DeadLetter]:
        out: list[DeadLetter] = []
        async with self._temporary() as channel:
            for message in await self._browse(channel, DEAD_LETTER_SCAN):
                if len(out) >= limit:
                    break
                if not self._mine(message):
                    continue
                h = user_headers(message.headers)
                out.append(
                    DeadLetter.from_headers(
                        h.get(DEAD_LETTER_ID, ""),
                        h.get(HEADER_MESSAGE_ID, message.message_id or ""),
                        h.get("type", message.type or ""),
                        h,
                        self.config,
                    )
                )
        return out

    async def count_dead_letters(self) -> int:
        import aiormq.exceptions

        if self.config.dead_letter_shared:
            async with self._temporary() as channel:
                return sum(self._mine(m) for m in await self._browse(channel, DEAD_LETTER_SCAN))
        async with self._temporary() as channel:
            try:
                queue = await channel.declare_queue(self.dead_letter_queue, passive=True)
            except aiormq.exceptions.ChannelNotFoundEntity:
                return 0
            return int(queue.declaration_result.message_count or 0)

    async def replay_dead_letters(self, entry_ids: Sequence[str] | None = None) -> int:
        from pamqp.commands import Basic

        wanted = None if entry_ids is None else set(entry_ids)
        replayed = 0
        async with self._temporary() as channel:
            for message in await self._browse(channel, DEAD_LETTER_SCAN):
                if not self._mine(message):
                    continue
                headers = dict(message.headers or {})
                if wanted is not None and headers.get(DEAD_LETTER_ID) not in wanted:
                    continue
                headers = {
                    k: v
                    for k, v in headers.items()
                    if not k.startswith("dead-letter") and k != consumer_mod.DEAD_LETTERED_AT
                }
                properties = Basic.Properties(
                    content_type=message.content_type,
                    delivery_mode=2,
                    headers=headers,
                    message_id=message.message_id,
                    message_type=message.type,
                    timestamp=message.timestamp,
                    correlation_id=message.correlation_id,
                )
                # This group's queue only: the stream's other groups handled it already.
                await self.connection.publish_confirmed(
                    message.body, routing_key=self.queue, properties=properties, exchange=""
                )
                await message.ack()
                replayed += 1
        return replayed

    async def lag(self) -> ConsumerLag:
        """Messages ready in the group's queue; unacknowledged ones are not counted by
        AMQP (``pending`` None)."""
        import aiormq.exceptions

        async with self._temporary() as channel:
            try:
                queue = await channel.declare_queue(self.queue, passive=True)
            except aiormq.exceptions.ChannelNotFoundEntity:
                return ConsumerLag(lag=None, pending=None)
        return ConsumerLag(lag=int(queue.declaration_result.message_count or 0), pending=None)

    async def aclose(self) -> None:
        await self._stop_consuming()


def _quiet(task: asyncio.Future[Any]) -> None:
    """Retrieve a settle task's error (the channel closed meanwhile: requeued anyway)."""
    if not task.cancelled() and task.exception() is not None:
        logger.debug("rabbitmq settle failed: %r", task.exception())

"""``KafkaPublisher``: the relay's side of a Kafka broker.

A batch is sent as one burst of records (aiokafka gathers them per partition into produce
requests) and its results are read only once every record of it has its answer: with
``acks="all"`` a record is acknowledged when every in-sync replica has it, so the relay
marks a batch published only after the cluster acknowledged every message of it.

* a message's own fault fails that message alone (a ``MessageRejected`` result): a
  record over ``max_request_bytes`` or the broker's ``message.max.bytes`` (the error names
  the claim check, ``OutboxSettings(claim_check=…)``, as the remedy), a stream whose topic
  name Kafka refuses;
* the cluster's fault raises ``BrokerUnavailable`` for the whole batch (no attempt is
  spent): no server answering, "leader not available", too few in-sync replicas, a request
  timeout (``outage``).

De-duplication: the producer is idempotent where the cluster grants a producer id, so a
record aiokafka retries inside one send is stored once. A batch the relay sends again
after a crash before its mark (or after a timeout) is a new send: its copies carry the same
``message-id`` header, which the consumers' inbox skips, as on RabbitMQ.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Self

from fastapi_outbox import exceptions
from fastapi_outbox.brokers import cloudevents
from fastapi_outbox.brokers.base import PublishResults, redact_url
from fastapi_outbox.brokers.cloudevents import CloudEventsOptions
from fastapi_outbox.brokers.kafka.connection import KafkaConnection
from fastapi_outbox.brokers.kafka.wire import (
    BINARY_PREFIX,
    invalid_topic,
    outage,
    record_headers,
    too_large,
)
from fastapi_outbox.events import Envelope

__all__ = ["CLAIM_CHECK_HINT", "KafkaPublisher"]

#: What a message over the size limit is told to do.
CLAIM_CHECK_HINT = (
    "store large payloads outside the message with a claim check "
    "(OutboxSettings(claim_check=…), docs/how-to/claim-check.md) or raise "
    "max_request_bytes and the broker's message.max.bytes together"
)


class KafkaPublisher:
    """Publishes envelopes as Kafka records, ``acks="all"``, through ``connection``."""

    def __init__(
        self, connection: KafkaConnection, *, envelope_format: CloudEventsOptions | None = None
    ) -> None:
        self.connection = connection
        self.envelope_format = envelope_format or CloudEventsOptions()

    @property
    def url(self) -> str:
        return self.connection.url

    @property
    def idempotent(self) -> bool | None:
        """Whether the producer is idempotent (None before the first connect)."""
        return self.connection.idempotent

    def __repr__(self) -> str:
        return f"{type(self).__name__}({redact_url(self.url)!r})"

    def configure(self, *, dedup_window_seconds: float) -> None:
        """Kafka keeps no de-duplication window: nothing to configure."""

    async def connect(self) -> None:
        await self.connection.connect()

    async def aclose(self) -> None:
        await self.connection.aclose()

    async def ping(self) -> None:
        await self.connection.ping()

    async def publish(self, batch: Sequence[Envelope]) -> PublishResults:
        results: PublishResults = [None] * len(batch)
        if not batch:
            return results
        conn = self.connection
        await conn.connect()
        topics: dict[int, str] = {}
        for i, e in enumerate(batch):
            topic = conn.topic(e.stream)
            problem = invalid_topic(topic)
            if problem is not None:
                results[i] = exceptions.MessageRejected(
                    f"message {e.id} on stream {e.stream!r}: {problem} (Kafka topic names)"
                )
            else:
                topics[i] = topic
        try:
            await conn.ensure_topics(set(topics.values()))
        except exceptions.BrokerUnavailable:
            conn.forget_topics()
            raise
        futures = await self._send(batch, topics, results)
        await self._read_acks(batch, futures, results)
        return results

    async def _send(
        self, batch: Sequence[Envelope], topics: dict[int, str], results: PublishResults
    ) -> dict[int, asyncio.Future[Any]]:
        """Every record of the batch handed to the producer; index -> its ack future."""
        producer = self.connection.producer
        options = self.envelope_format
        futures: dict[int, asyncio.Future[Any]] = {}
        for i, topic in topics.items():
            e = batch[i]
            sent = cloudevents.to_envelope(e, options, prefix=BINARY_PREFIX)
            try:
                futures[i] = await producer.send(
                    topic,
                    sent.payload,
                    key=e.key.encode() if e.key is not None else None,
                    headers=record_headers(sent),
                )
            except Exception as exc:
                failure = self._failure(e, exc)
                if failure is None:  # an outage: what was handed over is answered below
                    await _settle(futures)
                    self.connection.forget_topics()
                    raise self.connection.unavailable(exc) from exc
                results[i] = failure
        return futures

    async def _read_acks(
        self,
        batch: Sequence[Envelope],
        futures: dict[int, asyncio.Future[Any]],
        results: PublishResults,
    ) -> None:
        if not futures:
            return
        conn = self.connection
        try:
            # aiokafka fails a record it could not deliver within the request timeout;
            # the margin covers one last answer on its way.
            await asyncio.wait_for(
                asyncio.gather(*futures.values(), return_exceptions=True),
                conn.request_timeout_seconds * 1.5,
            )
        except TimeoutError as exc:
            await _settle(futures)
            conn.forget_topics()
            raise exceptions.BrokerTimeout(
                f"Kafka at {redact_url(self.url)}: no acknowledgement for {len(futures)} "
                f"records in {conn.request_timeout_seconds * 1.5:g}s"
            ) from exc
        down: Exception | None = None
        for i, future in futures.items():
            error = future.exception() if not future.cancelled() else asyncio.CancelledError()
            if error is None:
                continue
            failure = self._failure(batch[i], error)
            if failure is None:
                down = down or conn.unavailable(error)
            else:
                results[i] = failure
        if down is not None:
            conn.forget_topics()
            raise down

    def _failure(self, e: Envelope, error: BaseException) -> Exception | None:
        """The result of message ``e`` refused with ``error``; None for an outage."""
        if too_large(error):
            return exceptions.MessageRejected(
                f"message {e.id} on stream {e.stream!r} is over the size limit "
                f"({self.connection.max_request_bytes} bytes or the broker's "
                f"message.max.bytes): {CLAIM_CHECK_HINT}"
            )
        if isinstance(error, Exception) and outage(error, self.url) is not None:
            return None
        if not isinstance(error, Exception):
            return None
        return exceptions.MessageRejected(
            f"Kafka refused message {e.id} on stream {e.stream!r}: {type(error).__name__}: {error}"
        )

    async def __aenter__(self) -> Self:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def _settle(futures: dict[int, asyncio.Future[Any]]) -> None:
    """Wait for the answers already on their way, their errors retrieved (an outage: they
    fail within the request timeout)."""
    if futures:
        await asyncio.gather(*futures.values(), return_exceptions=True)

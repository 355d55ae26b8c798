"""``MemoryBroker``: the composition of one ``MemoryConnection`` (the in-process message
log), the publisher on it and the consumers of ``@outbox.subscriber`` on it. The publisher
and the consumer each receive the connection and never import each other."""

from __future__ import annotations

from collections.abc import Callable

from fastapi_outbox.brokers.cloudevents import (
    DEFAULT_SOURCE,
    CloudEventsMode,
    CloudEventsOptions,
    EnvelopeFormat,
)
from fastapi_outbox.brokers.consumer import ConsumerConfig
from fastapi_outbox.brokers.memory.connection import MemoryConnection
from fastapi_outbox.brokers.memory.consumer import MemoryConsumer
from fastapi_outbox.brokers.memory.publisher import MemoryPublisher
from fastapi_outbox.events import Envelope

__all__ = ["MemoryBroker"]


class MemoryBroker(MemoryPublisher):
    """An in-process broker for tests and the embedded default; its consumers
    ([`consumer`][fastapi_outbox.brokers.MemoryBroker.consumer]) read what it holds
    (`connection`)."""

    def __init__(
        self,
        *,
        reject: Callable[[Envelope], BaseException | None] | None = None,
        envelope: EnvelopeFormat = "native",
        cloudevents_mode: CloudEventsMode = "binary",
        cloudevents_source: str = DEFAULT_SOURCE,
    ) -> None:
        """``envelope="cloudevents"`` stores each message as a CloudEvent
        (``cloudevents_mode`` binary: ``ce-*`` headers and the payload; structured: one
        ``application/cloudevents+json`` document) from ``cloudevents_source``."""
        options = CloudEventsOptions(envelope, cloudevents_mode, cloudevents_source)
        super().__init__(MemoryConnection(), reject=reject, envelope_format=options)

    def consumer(self, config: ConsumerConfig) -> MemoryConsumer:
        """The consumer side (``@outbox.subscriber`` on a memory broker)."""
        return MemoryConsumer(self.connection, config)

"""``MemoryBroker``: the composition of one ``MemoryConnection`` (the in-process message
log), the publisher on it and the consumers of ``@outbox.subscriber`` on it. The publisher
and the consumer each receive the connection and never import each other."""

from __future__ import annotations

from collections.abc import Callable

from fastapi_outbox.brokers.consumer import ConsumerConfig
from fastapi_outbox.brokers.memory.connection import MemoryConnection
from fastapi_outbox.brokers.memory.consumer import MemoryConsumer
from fastapi_outbox.brokers.memory.publisher import MemoryPublisher
from fastapi_outbox.events import Envelope

__all__ = ["MemoryBroker"]


class MemoryBroker(MemoryPublisher):
    """An in-process broker for tests and the embedded default; its consumers
    (:meth:`consumer`) read what it holds (:attr:`connection`)."""

    def __init__(
        self,
        *,
        reject: Callable[[Envelope], BaseException | None] | None = None,
    ) -> None:
        super().__init__(MemoryConnection(), reject=reject)

    def consumer(self, config: ConsumerConfig) -> MemoryConsumer:
        """The consumer side (``@outbox.subscriber`` on a memory broker)."""
        return MemoryConsumer(self.connection, config)

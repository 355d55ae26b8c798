"""``MemoryBroker``: the in-process publisher that also makes the consumers of
``@outbox.subscriber`` (the composition of ``publisher`` and ``consumer``, which never
import each other)."""

from __future__ import annotations

from fastapi_outbox.brokers.consumer import ConsumerConfig
from fastapi_outbox.brokers.memory.consumer import MemoryConsumer
from fastapi_outbox.brokers.memory.publisher import MemoryPublisher

__all__ = ["MemoryBroker"]


class MemoryBroker(MemoryPublisher):
    """An in-process broker for tests and the embedded default; its consumers
    (:meth:`consumer`) read what it holds."""

    def consumer(self, config: ConsumerConfig) -> MemoryConsumer:
        """The consumer side (``@outbox.subscriber`` on a memory broker)."""
        return MemoryConsumer(self, config)

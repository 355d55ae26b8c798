"""``RedisStreamsBroker``: the Redis publisher that also makes the consumers of
``@outbox.subscriber``, both on one connection (the composition of ``publisher`` and
``consumer``, which never import each other)."""

from __future__ import annotations

from fastapi_outbox.brokers.consumer import ConsumerConfig
from fastapi_outbox.brokers.redis.consumer import RedisStreamsConsumer
from fastapi_outbox.brokers.redis.publisher import RedisStreamsPublisher

__all__ = ["RedisStreamsBroker"]


class RedisStreamsBroker(RedisStreamsPublisher):
    """Publishes to Redis Streams (``redis.asyncio``), pipelined and de-duplicated, and
    consumes them with consumer groups (:meth:`consumer`)."""

    def consumer(self, config: ConsumerConfig) -> RedisStreamsConsumer:
        """The consumer side of ``@outbox.subscriber`` (``consumer.py``)."""
        return RedisStreamsConsumer(self, config)

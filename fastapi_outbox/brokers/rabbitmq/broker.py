"""``RabbitMQBroker``: the RabbitMQ publisher that also makes the consumers of
``@outbox.subscriber`` (the composition of ``publisher`` and ``consumer``, which never
import each other). Publishing and consuming use a connection each: RabbitMQ blocks a
connection that publishes during a memory or disk alarm, and the consumers must still
acknowledge then."""

from __future__ import annotations

from typing import Any

from fastapi_outbox.brokers.consumer import ConsumerConfig
from fastapi_outbox.brokers.rabbitmq.connection import RabbitMQConnection
from fastapi_outbox.brokers.rabbitmq.consumer import RabbitMQConsumer
from fastapi_outbox.brokers.rabbitmq.publisher import RabbitMQPublisher

__all__ = ["RabbitMQBroker"]


class RabbitMQBroker(RabbitMQPublisher):
    """Publishes to a durable topic exchange with publisher confirms (the stream is the
    routing key), and consumes with a durable quorum queue per subscriber group
    (:meth:`consumer`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: The consumers' connection (acks, dead letters, the operators' reads).
        self.consumer_connection = RabbitMQConnection(
            self.url,
            exchange=self.exchange,
            connect_timeout_seconds=self.connection.connect_timeout_seconds,
            confirm_timeout_seconds=self.confirm_timeout_seconds,
            name="fastapi-outbox consumer",
        )

    def consumer(self, config: ConsumerConfig) -> RabbitMQConsumer:
        """The consumer side of ``@outbox.subscriber`` (``consumer.py``)."""
        return RabbitMQConsumer(
            self.consumer_connection,
            config,
            queue_template=self.queue_prefix + self.queue_name,
            queue_arguments=self.queue_arguments,
            dead_letter_queue=self.queue_prefix + config.dead_letter,
        )

    async def aclose(self) -> None:
        await super().aclose()
        await self.consumer_connection.aclose()

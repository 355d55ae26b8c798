"""``RabbitMQBroker``: the composition of two ``RabbitMQConnection`` objects, the publisher
on one and the consumers of ``@outbox.subscriber`` on the other; the publisher and the
consumer each receive their connection and never import each other. Publishing and
consuming use a connection each: RabbitMQ blocks a connection that publishes during a memory
or disk alarm, and the consumers must still acknowledge then."""

from __future__ import annotations

from typing import Any

from fastapi_outbox import exceptions
from fastapi_outbox.brokers.cloudevents import (
    DEFAULT_SOURCE,
    CloudEventsMode,
    CloudEventsOptions,
    EnvelopeFormat,
)
from fastapi_outbox.brokers.consumer import ConsumerConfig
from fastapi_outbox.brokers.rabbitmq.connection import (
    CONFIRM_TIMEOUT_SECONDS,
    CONNECT_TIMEOUT_SECONDS,
    HEARTBEAT_SECONDS,
    RabbitMQConnection,
)
from fastapi_outbox.brokers.rabbitmq.consumer import RabbitMQConsumer
from fastapi_outbox.brokers.rabbitmq.publisher import (
    DEFAULT_EXCHANGE,
    DEFAULT_URL,
    RabbitMQPublisher,
)
from fastapi_outbox.brokers.rabbitmq.wire import QUEUE_TEMPLATE

__all__ = ["RabbitMQBroker"]


class RabbitMQBroker(RabbitMQPublisher):
    """Publishes to a durable topic exchange with publisher confirms (the stream is the
    routing key), and consumes with a durable quorum queue per subscriber group
    (:meth:`consumer`)."""

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        exchange: str = DEFAULT_EXCHANGE,
        queue_name: str = QUEUE_TEMPLATE,
        queue_prefix: str = "",
        queue_arguments: dict[str, Any] | None = None,
        confirm_timeout_seconds: float = CONFIRM_TIMEOUT_SECONDS,
        connect_timeout_seconds: float = CONNECT_TIMEOUT_SECONDS,
        heartbeat_seconds: int = HEARTBEAT_SECONDS,
        envelope: EnvelopeFormat = "native",
        cloudevents_mode: CloudEventsMode = "binary",
        cloudevents_source: str = DEFAULT_SOURCE,
    ) -> None:
        """``exchange``: the durable topic exchange (created when missing);
        ``queue_name``: the quorum queue of a subscriber group, ``{stream}`` and
        ``{group}`` filled in; ``queue_prefix``: before the name of every queue the
        consumers declare, their dead-letter queues included (services or tests sharing a
        virtual host); ``queue_arguments``: extra arguments of the groups' queues
        (``x-max-length``, ``x-expires``…). ``envelope="cloudevents"`` publishes
        CloudEvents (``cloudevents_mode`` binary or structured, per the RabbitMQ binding)
        from ``cloudevents_source``; consumers read either envelope. ``heartbeat_seconds``:
        the AMQP heartbeat; a silent node is left after about three of them."""
        if not exchange:
            raise exceptions.ConfigurationError(
                "RabbitMQBroker: exchange must be a name (the default exchange routes by "
                "queue name, not by stream)"
            )
        for option, value in (
            ("confirm_timeout_seconds", confirm_timeout_seconds),
            ("connect_timeout_seconds", connect_timeout_seconds),
        ):
            if value <= 0:
                raise exceptions.ConfigurationError(
                    f"RabbitMQBroker: {option} must be > 0, got {value!r}"
                )
        beat = heartbeat_seconds
        if isinstance(beat, bool) or not isinstance(beat, int) or beat < 1:
            raise exceptions.ConfigurationError(
                f"RabbitMQBroker: heartbeat_seconds must be a whole number of seconds >= 1 "
                f"(AMQP's unit), got {heartbeat_seconds!r}"
            )
        if "{stream}" not in queue_name or "{group}" not in queue_name:
            raise exceptions.ConfigurationError(
                f"RabbitMQBroker: queue_name {queue_name!r} must contain {{stream}} and {{group}}"
            )

        def connection(role: str) -> RabbitMQConnection:
            return RabbitMQConnection(
                url,
                exchange=exchange,
                connect_timeout_seconds=connect_timeout_seconds,
                confirm_timeout_seconds=confirm_timeout_seconds,
                heartbeat_seconds=heartbeat_seconds,
                name=f"fastapi-outbox {role}",
            )

        super().__init__(
            connection("publisher"),
            envelope_format=CloudEventsOptions(envelope, cloudevents_mode, cloudevents_source),
        )
        self.queue_name = queue_name
        self.queue_prefix = queue_prefix
        self.queue_arguments = dict(queue_arguments or {})
        #: The consumers' connection (acks, dead letters, the operators' reads).
        self.consumer_connection = connection("consumer")

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

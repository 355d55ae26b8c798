"""``RabbitMQBroker``: the composition of two ``RabbitMQConnection`` objects, the publisher
on one and the consumers of ``@outbox.subscriber`` on the other; the publisher and the
consumer each receive their connection and never import each other. Publishing and
consuming use a connection each: RabbitMQ blocks a connection that publishes during a memory
or disk alarm, and the consumers must still acknowledge then."""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote, urlsplit

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
from fastapi_outbox.brokers.rabbitmq.wire import (
    QUEUE_TEMPLATE,
    cloudevent_message,
    message_headers,
    queue_name,
)
from fastapi_outbox.brokers.wire_description import Bindings, WireDescription
from fastapi_outbox.events import Envelope

__all__ = ["RabbitMQBroker", "RabbitMQWire"]


class RabbitMQBroker(RabbitMQPublisher):
    """Publishes to a durable topic exchange with publisher confirms (the stream is the
    routing key), and consumes with a durable quorum queue per subscriber group
    ([`consumer`][fastapi_outbox.brokers.RabbitMQBroker.consumer])."""

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

    def asyncapi_wire(self) -> RabbitMQWire:
        """This broker's wire in the AsyncAPI document (``outbox.asyncapi()``)."""
        return RabbitMQWire(
            self.connection.exchange,
            self.queue_prefix + self.queue_name,
            _vhost(self.connection.url),
            self.envelope_format,
        )


def _vhost(url: str) -> str:
    path = urlsplit(url.split(",")[0]).path
    return unquote(path[1:]) if len(path) > 1 else "/"


class RabbitMQWire(WireDescription):
    """An AMQP 0-9-1 message published to the durable topic exchange with the stream as
    routing key, persistent (``delivery_mode`` 2), with the properties ``message_id``,
    ``type``, ``timestamp`` and ``correlation_id``; a group reads its own durable quorum
    queue bound to the routing key and acknowledges each message."""

    protocol = "amqp"
    binding_version = "0.3.0"

    def __init__(
        self, exchange: str, queue_template: str, vhost: str, envelope_format: CloudEventsOptions
    ) -> None:
        super().__init__(envelope_format)
        self.exchange, self.queue_template, self.vhost = exchange, queue_template, vhost

    def encode(self, envelope: Envelope) -> tuple[dict[str, str], bytes]:
        if self.envelope_format.enabled:
            headers, content_type, body = cloudevent_message(envelope, self.envelope_format)
            return {**headers, "content_type": content_type}, body
        headers, _ = message_headers(envelope)
        return {**headers, "content_type": "application/json"}, envelope.payload

    def layout(self) -> str:
        return (
            "An AMQP 0-9-1 message: the headers below are its headers table (content_type "
            "is the property of that name), the payload is the body."
        )

    def channel_bindings(self, stream: str) -> Bindings:
        exchange = {"name": self.exchange, "type": "topic", "durable": True}
        return {
            "is": "routingKey",
            "exchange": {**exchange, "autoDelete": False, "vhost": self.vhost},
        }

    def send_bindings(self, stream: str) -> Bindings:
        return {"deliveryMode": 2, "timestamp": True, "mandatory": True}

    def receive_bindings(self, stream: str, group: str) -> Bindings:
        queue = queue_name(self.queue_template, stream, group)
        return {"ack": True, "x-queue": {"name": queue, "type": "quorum", "durable": True}}

    def message_bindings(self, envelope: Envelope) -> Bindings:
        _, properties = message_headers(envelope)
        return {
            "messageType": envelope.type,
            "x-properties": sorted(k for k, v in properties.items() if v is not None),
        }

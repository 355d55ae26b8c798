"""RabbitMQ: ``RabbitMQBroker`` publishes to a durable topic exchange with publisher
confirms (the stream is the routing key) and consumes with a durable quorum queue per
subscriber group.

The package holds ``broker``, ``publisher``, ``wire``, ``connection``, ``consumer``: the
publisher and the consumer share the connection class and the wire rules and never import
each other; ``broker`` composes them. Needs the ``rabbitmq`` extra (aio-pika).
"""

from __future__ import annotations

from fastapi_outbox.brokers.rabbitmq.broker import RabbitMQBroker
from fastapi_outbox.brokers.rabbitmq.connection import (
    CONFIRM_TIMEOUT_SECONDS,
    CONNECT_TIMEOUT_SECONDS,
    RabbitMQConnection,
)
from fastapi_outbox.brokers.rabbitmq.publisher import DEFAULT_EXCHANGE, DEFAULT_URL
from fastapi_outbox.brokers.rabbitmq.wire import KEY_HEADER, QUEUE_TEMPLATE, outage

__all__ = [
    "CONFIRM_TIMEOUT_SECONDS",
    "CONNECT_TIMEOUT_SECONDS",
    "DEFAULT_EXCHANGE",
    "DEFAULT_URL",
    "KEY_HEADER",
    "QUEUE_TEMPLATE",
    "RabbitMQBroker",
    "RabbitMQConnection",
    "outage",
]

"""Brokers: the ``Broker`` and ``Consumer`` protocols (``base``, ``consumer``) and one
package per broker (``memory``, ``redis``, ``nats``, ``rabbitmq``), each made of a
``connection`` (the client and what both sides need of the server), a ``wire`` module
(encoding, header rules, the broker's one refusal and outage classifier), a ``publisher``
and a ``consumer`` that each receive the connection and never import each other, and a
``broker`` composing them.

``RedisStreamsBroker``, ``NatsJetStreamBroker`` and ``RabbitMQBroker`` import their client
libraries lazily, so ``fastapi_outbox.brokers`` imports without the ``redis``, ``nats`` or
``rabbitmq`` extras installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi_outbox import exceptions
from fastapi_outbox.brokers.base import Broker, PublishResults, redact_url
from fastapi_outbox.brokers.memory.broker import MemoryBroker

if TYPE_CHECKING:
    from fastapi_outbox.brokers.nats.broker import NatsJetStreamBroker
    from fastapi_outbox.brokers.rabbitmq.broker import RabbitMQBroker
    from fastapi_outbox.brokers.redis.broker import RedisStreamsBroker

__all__ = [
    "Broker",
    "MemoryBroker",
    "NatsJetStreamBroker",
    "PublishResults",
    "RabbitMQBroker",
    "RedisStreamsBroker",
    "broker_from_url",
]


def __getattr__(name: str) -> Any:
    if name == "RedisStreamsBroker":
        from fastapi_outbox.brokers.redis.broker import RedisStreamsBroker

        return RedisStreamsBroker
    if name == "NatsJetStreamBroker":
        from fastapi_outbox.brokers.nats.broker import NatsJetStreamBroker

        return NatsJetStreamBroker
    if name == "RabbitMQBroker":
        from fastapi_outbox.brokers.rabbitmq.broker import RabbitMQBroker

        return RabbitMQBroker
    raise AttributeError(name)


def broker_from_url(url: str, **options: Any) -> Broker:
    """``memory://``, ``redis://`` / ``rediss://`` / ``unix://``, a Redis Cluster's
    ``redis+cluster://host:port[,host:port…]`` / ``rediss+cluster://``, ``nats://`` /
    ``tls://`` or ``amqp://`` / ``amqps://`` (RabbitMQ)."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme == "memory":
        return MemoryBroker(**options)
    if scheme in ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster"):
        from fastapi_outbox.brokers.redis.broker import RedisStreamsBroker

        return RedisStreamsBroker(url, **options)
    if scheme in ("nats", "tls"):
        from fastapi_outbox.brokers.nats.broker import NatsJetStreamBroker

        return NatsJetStreamBroker(url, **options)
    if scheme in ("amqp", "amqps"):
        from fastapi_outbox.brokers.rabbitmq.broker import RabbitMQBroker

        return RabbitMQBroker(url, **options)
    raise exceptions.ConfigurationError(
        f"unsupported broker URL {redact_url(url)!r}: "
        "use memory://, redis://, rediss://, redis+cluster://, nats:// or amqp://"
    )

"""Brokers: the ``Broker`` and ``Consumer`` protocols (``base``, ``consumer``) and one
package per broker (``memory``, ``redis``, ``nats``, ``rabbitmq``, ``kafka``), each made of a
``connection`` (the client and what both sides need of the server), a ``wire`` module
(encoding, header rules, the broker's one refusal and outage classifier), a ``publisher``
and a ``consumer`` that each receive the connection and never import each other, and a
``broker`` composing them.

``RedisStreamsBroker``, ``NatsJetStreamBroker``, ``RabbitMQBroker`` and ``KafkaBroker``
import their client libraries lazily, so ``fastapi_outbox.brokers`` imports without the
``redis``, ``nats``, ``rabbitmq`` or ``kafka`` extras installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlencode

from fastapi_outbox import exceptions
from fastapi_outbox.brokers.base import Broker, PublishResults, redact_url
from fastapi_outbox.brokers.memory.broker import MemoryBroker

if TYPE_CHECKING:
    from fastapi_outbox.brokers.kafka.broker import KafkaBroker
    from fastapi_outbox.brokers.nats.broker import NatsJetStreamBroker
    from fastapi_outbox.brokers.rabbitmq.broker import RabbitMQBroker
    from fastapi_outbox.brokers.redis.broker import RedisStreamsBroker

__all__ = [
    "Broker",
    "KafkaBroker",
    "MemoryBroker",
    "NatsJetStreamBroker",
    "PublishResults",
    "RabbitMQBroker",
    "RedisStreamsBroker",
    "broker_from_url",
    "redact_url",
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
    if name == "KafkaBroker":
        from fastapi_outbox.brokers.kafka.broker import KafkaBroker

        return KafkaBroker
    raise AttributeError(name)


#: Query parameters of a broker URL that are the broker's own options (the others stay in
#: the URL, for the client library): name → converter.
URL_OPTIONS: dict[str, Any] = {
    "envelope": str,
    "cloudevents_mode": str,
    "cloudevents_source": str,
    "replicas": int,
    "ping_interval_seconds": float,
    "max_outstanding_pings": int,
    "connect_timeout_seconds": float,
    "topic_partitions": int,
    "session_timeout_seconds": float,
    "heartbeat_interval_seconds": float,
    "request_timeout_seconds": float,
}
#: Options only some brokers take: option → the URL schemes that accept it.
_SCHEMES_OF: dict[str, tuple[str, ...]] = {
    "replicas": ("nats", "tls"),
    "ping_interval_seconds": ("nats", "tls"),
    "max_outstanding_pings": ("nats", "tls"),
    "connect_timeout_seconds": ("nats", "tls"),
    "topic_partitions": ("kafka",),
    "session_timeout_seconds": ("kafka",),
    "heartbeat_interval_seconds": ("kafka",),
    "request_timeout_seconds": ("kafka",),
}


def url_options(url: str) -> tuple[str, dict[str, Any]]:
    """``url`` without the query parameters that are broker options (``envelope``,
    ``cloudevents_mode``, ``cloudevents_source``, ``replicas``), and those options,
    converted: ``nats://a:4222,nats://b:4222?replicas=3&envelope=cloudevents``. Other
    parameters (``redis://…?socket_timeout=5``) stay in the URL."""
    if "?" not in url:
        return url, {}
    base, query = url.split("?", 1)
    scheme = base.split("://", 1)[0].lower() if "://" in base else ""
    options: dict[str, Any] = {}
    rest: list[tuple[str, str]] = []
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name not in URL_OPTIONS:
            rest.append((name, value))
            continue
        if name in options:
            raise exceptions.ConfigurationError(
                f"broker URL {redact_url(url)!r}: option {name!r} given twice"
            )
        if scheme not in _SCHEMES_OF.get(name, (scheme,)):
            raise exceptions.ConfigurationError(
                f"broker URL {redact_url(url)!r}: option {name!r} is for "
                f"{' or '.join(s + '://' for s in _SCHEMES_OF[name])} URLs only"
            )
        try:
            options[name] = URL_OPTIONS[name](value)
        except ValueError:
            raise exceptions.ConfigurationError(
                f"broker URL {redact_url(url)!r}: option {name}={value!r} is not "
                f"{'an integer' if URL_OPTIONS[name] is int else 'valid'}"
            ) from None
    return (f"{base}?{urlencode(rest)}" if rest else base), options


def broker_from_url(url: str, **options: Any) -> Broker:
    """``memory://``, ``redis://`` / ``rediss://`` / ``unix://``, a Redis Cluster's
    ``redis+cluster://host:port[,host:port…]`` / ``rediss+cluster://``, ``nats://`` /
    ``tls://``, ``amqp://`` / ``amqps://`` (RabbitMQ) or Kafka's
    ``kafka://host:9092[,host:9092…]``. Broker options may ride in the URL's query
    (`url_options`: ``?envelope=cloudevents``, ``?replicas=3`` for NATS); keyword
    ``options`` win over them."""
    url, from_query = url_options(url)
    options = {**from_query, **options}
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
    if scheme == "kafka":
        from fastapi_outbox.brokers.kafka.broker import KafkaBroker

        return KafkaBroker(url, **options)
    raise exceptions.ConfigurationError(
        f"unsupported broker URL {redact_url(url)!r}: "
        "use memory://, redis://, rediss://, redis+cluster://, nats://, amqp:// or kafka://"
    )

"""Kafka: ``KafkaBroker`` publishes records with ``acks="all"`` (the stream is the topic,
the key the record key, so a partition keeps the order of a key) and consumes with a
Kafka consumer group per subscriber group, committing offsets after the inbox transaction.

The package holds ``connection`` (``KafkaConnection``: the bootstrap servers, the client
policies, the producer and the admin client), ``wire`` (records and their decoding, topic
and group names, the outage classifier), ``publisher`` and ``consumer``, which each receive
the connection and never import each other; ``broker`` composes them. Needs the ``kafka``
extra (aiokafka).
"""

from __future__ import annotations

from fastapi_outbox.brokers.kafka.broker import DEFAULT_URL, KafkaBroker
from fastapi_outbox.brokers.kafka.connection import (
    CONNECTIONS_MAX_IDLE_SECONDS,
    HEARTBEAT_INTERVAL_SECONDS,
    MAX_REQUEST_BYTES,
    METADATA_MAX_AGE_SECONDS,
    REQUEST_TIMEOUT_SECONDS,
    RETRY_BACKOFF_SECONDS,
    SESSION_TIMEOUT_SECONDS,
    TOPIC_PARTITIONS,
    TOPIC_REPLICATION,
    KafkaConnection,
)
from fastapi_outbox.brokers.kafka.wire import GROUP_TEMPLATE, TOPIC_TEMPLATE, outage

__all__ = [
    "CONNECTIONS_MAX_IDLE_SECONDS",
    "DEFAULT_URL",
    "GROUP_TEMPLATE",
    "HEARTBEAT_INTERVAL_SECONDS",
    "MAX_REQUEST_BYTES",
    "METADATA_MAX_AGE_SECONDS",
    "REQUEST_TIMEOUT_SECONDS",
    "RETRY_BACKOFF_SECONDS",
    "SESSION_TIMEOUT_SECONDS",
    "TOPIC_PARTITIONS",
    "TOPIC_REPLICATION",
    "TOPIC_TEMPLATE",
    "KafkaBroker",
    "KafkaConnection",
    "outage",
]

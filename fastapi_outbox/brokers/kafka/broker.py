"""``KafkaBroker``: the composition of one ``KafkaConnection``, the publisher on it and the
consumers of ``@outbox.subscriber`` on it. The publisher and the consumer each receive the
connection and never import each other."""

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
from fastapi_outbox.brokers.kafka.connection import (
    HEARTBEAT_INTERVAL_SECONDS,
    MAX_REQUEST_BYTES,
    REQUEST_TIMEOUT_SECONDS,
    SESSION_TIMEOUT_SECONDS,
    TOPIC_PARTITIONS,
    TOPIC_REPLICATION,
    KafkaConnection,
)
from fastapi_outbox.brokers.kafka.consumer import KafkaConsumer
from fastapi_outbox.brokers.kafka.publisher import KafkaPublisher
from fastapi_outbox.brokers.kafka.wire import GROUP_TEMPLATE, TOPIC_TEMPLATE
from fastapi_outbox.brokers.wire_description import KafkaWire

__all__ = ["DEFAULT_URL", "KafkaBroker"]

DEFAULT_URL = "kafka://localhost:9092"


class KafkaBroker(KafkaPublisher):
    """Publishes to Kafka topics with ``acks="all"`` (the stream is the topic, the key the
    record key) and consumes with one Kafka consumer group per subscriber group
    (``consumer``), through aiokafka."""

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        topic_name: str = TOPIC_TEMPLATE,
        group_id: str = GROUP_TEMPLATE,
        topic_partitions: int = TOPIC_PARTITIONS,
        topic_replication: int = TOPIC_REPLICATION,
        create_topics: bool = True,
        request_timeout_seconds: float = REQUEST_TIMEOUT_SECONDS,
        session_timeout_seconds: float = SESSION_TIMEOUT_SECONDS,
        heartbeat_interval_seconds: float = HEARTBEAT_INTERVAL_SECONDS,
        max_request_bytes: int = MAX_REQUEST_BYTES,
        idempotence: bool | None = None,
        client_id: str = "fastapi-outbox",
        client_options: dict[str, Any] | None = None,
        envelope: EnvelopeFormat = "native",
        cloudevents_mode: CloudEventsMode = "binary",
        cloudevents_source: str = DEFAULT_SOURCE,
    ) -> None:
        """``url``: ``kafka://host:9092[,host:9092…]`` (the bootstrap servers).
        ``topic_name``: the topic of a stream, ``{stream}`` filled in (also for the
        dead-letter topics); ``group_id``: the Kafka consumer group of a subscriber,
        ``{topic}`` (the stream's topic) or ``{stream}``, and ``{group}`` filled in.
        Missing topics are created with ``topic_partitions`` partitions and
        ``topic_replication`` replicas (dead-letter topics with one partition);
        ``create_topics=False`` leaves that to the operator. ``idempotence``: None
        (default) uses the idempotent producer where the cluster grants a producer id and
        produces without it elsewhere; True requires it. ``session_timeout_seconds`` /
        ``heartbeat_interval_seconds``: how soon a silent consumer leaves its group.
        ``client_options``: more aiokafka keywords (TLS, SASL), given to every client.
        ``envelope="cloudevents"`` publishes CloudEvents per the Kafka protocol binding
        (``ce_`` headers in binary mode)."""
        if "{stream}" not in topic_name:
            raise exceptions.ConfigurationError(
                f"KafkaBroker: topic_name {topic_name!r} must contain {{stream}}"
            )
        if "{group}" not in group_id or ("{stream}" not in group_id and "{topic}" not in group_id):
            raise exceptions.ConfigurationError(
                f"KafkaBroker: group_id {group_id!r} must contain {{group}} and {{topic}} "
                "(or {stream})"
            )
        for option, value in (
            ("topic_partitions", topic_partitions),
            ("topic_replication", topic_replication),
            ("max_request_bytes", max_request_bytes),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise exceptions.ConfigurationError(
                    f"KafkaBroker: {option} must be a whole number >= 1, got {value!r}"
                )
        for option, seconds in (
            ("request_timeout_seconds", request_timeout_seconds),
            ("session_timeout_seconds", session_timeout_seconds),
            ("heartbeat_interval_seconds", heartbeat_interval_seconds),
        ):
            if seconds <= 0:
                raise exceptions.ConfigurationError(
                    f"KafkaBroker: {option} must be > 0, got {seconds!r}"
                )
        if heartbeat_interval_seconds >= session_timeout_seconds:
            raise exceptions.ConfigurationError(
                "KafkaBroker: heartbeat_interval_seconds must be below session_timeout_seconds "
                f"(got {heartbeat_interval_seconds!r} >= {session_timeout_seconds!r})"
            )
        connection = KafkaConnection(
            url,
            client_id=client_id,
            topic_name=topic_name,
            topic_partitions=topic_partitions,
            topic_replication=topic_replication,
            create_topics=create_topics,
            request_timeout_seconds=request_timeout_seconds,
            session_timeout_seconds=session_timeout_seconds,
            heartbeat_interval_seconds=heartbeat_interval_seconds,
            max_request_bytes=max_request_bytes,
            idempotence=idempotence,
            client_options=client_options,
        )
        super().__init__(
            connection,
            envelope_format=CloudEventsOptions(envelope, cloudevents_mode, cloudevents_source),
        )
        self.group_id = group_id

    def consumer(self, config: ConsumerConfig) -> KafkaConsumer:
        """The consumer side of ``@outbox.subscriber`` (``consumer.py``), on this broker's
        connection."""
        return KafkaConsumer(self.connection, config, group_id=self.group_id)

    def asyncapi_wire(self) -> KafkaWire:
        """This broker's wire in the AsyncAPI document (``outbox.asyncapi()``): its topic
        and consumer-group templates, the record key, ``ce_`` CloudEvents headers."""
        return KafkaWire(
            self.envelope_format,
            topic_template=self.connection.topic_name,
            group_template=self.group_id,
        )

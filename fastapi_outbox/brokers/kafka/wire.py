"""What the Kafka publisher and consumer agree on about the Kafka protocol: how an
envelope becomes a record (topic, key, headers, value), how a record is read back, the
names of the topics and groups a stream uses, and which client errors are outages of the
broker rather than faults of one message (``outage``, the one place where Kafka errors
are told apart).

A record carries:

* topic: the stream through the broker's ``topic_name`` template (default ``{stream}``);
* key: the envelope's ordering key (UTF-8), so Kafka's partitioner puts every message of a
  key on one partition and the partition keeps their order; no key: spread by the client;
* value: the JSON payload;
* headers: the envelope's headers (``message-id``, ``type``, ``occurred-at``,
  ``correlation-id``, the user's own…) as UTF-8 values, under the same rules as on the
  other brokers: a user header never replaces ``message-id`` or ``type``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from fastapi_outbox import exceptions
from fastapi_outbox.brokers import cloudevents
from fastapi_outbox.brokers.consumer import Delivery
from fastapi_outbox.events import HEADER_MESSAGE_ID, HEADER_TYPE, Envelope
from fastapi_outbox.redaction import redact_url

__all__ = [
    "BINARY_PREFIX",
    "GROUP_TEMPLATE",
    "TOPIC_MAX_CHARS",
    "TOPIC_TEMPLATE",
    "KafkaDelivery",
    "bootstrap_servers",
    "decode_record",
    "header_dict",
    "invalid_topic",
    "outage",
    "record_headers",
    "too_large",
]

#: The topic of a stream: ``{stream}`` filled in (``KafkaBroker(topic_name=…)``).
TOPIC_TEMPLATE = "{stream}"
#: The Kafka consumer group of a subscriber's (stream, group), ``{topic}`` the stream's
#: topic: one Kafka group per pair, so a rebalance of one stream's consumers never stops
#: another stream's, and two streams with the same group name never share a group.
GROUP_TEMPLATE = "{topic}.{group}"
#: Kafka's limit on a topic name, and the characters it allows.
TOPIC_MAX_CHARS = 249
_TOPIC_CHARS = re.compile(r"[A-Za-z0-9._-]+")
#: The CloudEvents Kafka protocol binding's header prefix (binary mode).
BINARY_PREFIX = "ce_"


def bootstrap_servers(url: str) -> list[str]:
    """``host:port`` of every server of ``kafka://h1:9092[,h2:9092…]`` (each piece may
    repeat the scheme); ConfigurationError for another scheme or no host."""
    if "://" not in url or url.split("://", 1)[0].lower() != "kafka":
        raise exceptions.ConfigurationError(
            f"KafkaBroker: {redact_url(url)!r} is not a kafka:// URL (kafka://host:9092[,host:9092])"
        )
    rest = url.split("://", 1)[1].split("?", 1)[0].rstrip("/")
    servers = []
    for piece in rest.split(","):
        piece = piece.strip()
        if "://" in piece:
            piece = piece.split("://", 1)[1]
        piece = piece.rsplit("@", 1)[-1].rstrip("/")
        if not piece:
            continue
        servers.append(piece if ":" in piece.rsplit("]", 1)[-1] else f"{piece}:9092")
    if not servers:
        raise exceptions.ConfigurationError(f"KafkaBroker: no server in {redact_url(url)!r}")
    return servers


def invalid_topic(topic: str) -> str | None:
    """Why Kafka refuses ``topic`` as a topic name, else None."""
    if not topic or topic in (".", ".."):
        return "an empty topic name, '.' or '..'"
    if len(topic) > TOPIC_MAX_CHARS:
        return f"a topic name longer than {TOPIC_MAX_CHARS} characters"
    if not _TOPIC_CHARS.fullmatch(topic):
        return f"topic {topic[:60]!r} has characters other than letters, digits, '.', '_', '-'"
    return None


def record_headers(e: Envelope) -> list[tuple[str, bytes]]:
    """The record headers of ``e``: its headers as UTF-8, ``message-id`` and ``type``
    written last so no user header of those names replaces them."""
    headers = e.headers_dict()
    out = [
        (name, value.encode())
        for name, value in headers.items()
        if name not in (HEADER_MESSAGE_ID, HEADER_TYPE)
    ]
    out.append((HEADER_MESSAGE_ID, e.message_id.encode()))
    out.append((HEADER_TYPE, e.type.encode()))
    return out


def header_dict(raw: Sequence[tuple[str, bytes]] | None) -> dict[str, str]:
    """A record's headers as text (a repeated header: the last one wins)."""
    return {name: (value or b"").decode("utf-8", "replace") for name, value in raw or ()}


class KafkaDelivery(Delivery):
    """A record delivered to a group: ``handle`` is ``(TopicPartition, offset, epoch,
    record)``, ``epoch`` the partition's assignment it was fetched under. Its headers are
    read from the record when first asked for (a batch handler that never reads them costs
    no dict per message)."""

    __slots__ = ()

    @property
    def headers(self) -> dict[str, str]:
        if self._headers is None:
            headers = header_dict(self.handle[3].headers)
            headers[HEADER_MESSAGE_ID] = self.message_id
            headers[HEADER_TYPE] = self.type
            self._headers = headers
        return self._headers


#: Header names that make a record a CloudEvent (the Kafka binding's ``ce_`` prefix, other
#: bindings' prefixes, a content type: structured mode).
_CLOUDEVENT_MARKS = ("ce_", "ce-", "cloudevents", "content-type", "content_type")


def decode_record(
    stream: str, record: Any, epoch: int, attempt: int = 1, tp: Any = None
) -> Delivery:
    """The delivery of a consumed ``record`` (a native message or a CloudEvent of any
    producer); its entry id is ``partition:offset``; ``tp``: its ``TopicPartition``."""
    if tp is None:
        from aiokafka.structs import TopicPartition

        tp = TopicPartition(record.topic, record.partition)
    handle = (tp, record.offset, epoch, record)
    entry_id = f"{record.partition}:{record.offset}"
    key = record.key.decode("utf-8", "replace") if record.key is not None else None
    body = record.value if record.value is not None else b""
    message_id = type_ = b""
    for name, value in record.headers or ():
        if name == HEADER_MESSAGE_ID:
            message_id = value
        elif name == HEADER_TYPE:
            type_ = value
        elif name.lower().startswith(_CLOUDEVENT_MARKS):
            event = cloudevents.as_delivery(
                header_dict(record.headers),
                body,
                stream=stream,
                entry_id=entry_id,
                attempt=attempt,
                key=key,
                handle=handle,
            )
            if event is not None:
                return event
            break
    return KafkaDelivery(
        stream=stream,
        entry_id=entry_id,
        message_id=message_id.decode("utf-8", "replace") or f"{record.topic}:{entry_id}",
        type=type_.decode("utf-8", "replace") if type_ else "",
        key=key,
        payload=body,
        attempt=attempt,
        handle=handle,
    )


def too_large(error: BaseException) -> bool:
    """Whether ``error`` says a record is over a size limit (the client's
    ``max_request_size`` or the broker's ``message.max.bytes``)."""
    from aiokafka import errors

    return isinstance(error, errors.MessageSizeTooLargeError | errors.RecordListTooLargeError)


#: Errors of the cluster, never of one message: the relay pauses, no attempt is charged.
def _outage_types() -> tuple[type[BaseException], ...]:
    from aiokafka import errors

    return (
        errors.KafkaConnectionError,
        errors.NodeNotReadyError,
        errors.LeaderNotAvailableError,
        errors.NotLeaderForPartitionError,
        errors.NotEnoughReplicasError,
        errors.NotEnoughReplicasAfterAppendError,
        errors.CoordinatorNotAvailableError,
        errors.NotCoordinatorError,
        errors.CoordinatorLoadInProgressError,
        errors.NoBrokersAvailable,
        errors.BrokerNotAvailableError,
        errors.UnknownTopicOrPartitionError,
    )


def outage(error: BaseException, url: str) -> Exception | None:
    """The exception to raise when ``error`` is an outage of the cluster, else None (a
    fault of the message: the caller fails that message alone).

    * no connection, no broker, no leader for a partition ("leader not available"), too
      few in-sync replicas for ``acks=all``, the coordinator moving, the topic not known
      (yet: it is created, or metadata lags) → ``BrokerUnavailable``;
    * a request or metadata timeout → ``BrokerTimeout``;
    * SASL refused → ``AuthenticationFailed``.
    """
    from aiokafka import errors

    where = f"Kafka at {redact_url(url)}"
    if isinstance(error, exceptions.BrokerUnavailable):
        return error
    detail = f"{type(error).__name__}: {error}"
    if isinstance(error, TimeoutError | errors.KafkaTimeoutError | errors.RequestTimedOutError):
        return exceptions.BrokerTimeout(f"{where} did not answer in time: {detail}")
    if isinstance(error, errors.SaslAuthenticationFailed | errors.AuthenticationFailedError):
        return exceptions.AuthenticationFailed(f"{where}: authentication failed ({detail})")
    if isinstance(error, (*_outage_types(), ConnectionError, OSError)):
        return exceptions.BrokerUnavailable(f"{where} is unavailable: {detail}")
    if isinstance(error, errors.KafkaError) and getattr(error, "retriable", False):
        return exceptions.BrokerUnavailable(f"{where} is unavailable: {detail}")
    return None

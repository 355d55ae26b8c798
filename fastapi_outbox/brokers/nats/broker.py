"""``NatsJetStreamBroker``: the composition of one ``NatsConnection``, the JetStream
publisher on it and the consumers of ``@outbox.subscriber`` on it. The publisher and the
consumer each receive the connection and never import each other."""

from __future__ import annotations

from typing import Any

from fastapi_outbox.brokers.cloudevents import (
    DEFAULT_SOURCE,
    CloudEventsMode,
    CloudEventsOptions,
    EnvelopeFormat,
)
from fastapi_outbox.brokers.consumer import ConsumerConfig
from fastapi_outbox.brokers.nats.connection import (
    ACK_TIMEOUT_SECONDS,
    CONNECT_TIMEOUT_SECONDS,
    MAX_OUTSTANDING_PINGS,
    PING_INTERVAL_SECONDS,
    STREAM_MAX_AGE_SECONDS,
    STREAM_MAX_BYTES,
    NatsConnection,
)
from fastapi_outbox.brokers.nats.consumer import NatsJetStreamConsumer, durable_name
from fastapi_outbox.brokers.nats.publisher import NatsJetStreamPublisher
from fastapi_outbox.brokers.nats.wire import publish_headers, stream_name_for
from fastapi_outbox.brokers.wire_description import Bindings, WireDescription
from fastapi_outbox.events import Envelope

__all__ = ["NatsJetStreamBroker", "NatsJetStreamWire"]


class NatsJetStreamBroker(NatsJetStreamPublisher):
    """Publishes to JetStream with ``Nats-Msg-Id`` de-duplication, and consumes with
    durable pull consumers ([`consumer`][fastapi_outbox.brokers.NatsJetStreamBroker.consumer]), on
    one connection (`connection`)."""

    def __init__(
        self,
        url: str = "nats://localhost:4222",
        *,
        client: Any = None,
        create_streams: bool = True,
        dedup_window_seconds: float | None = None,
        ack_timeout_seconds: float = ACK_TIMEOUT_SECONDS,
        connect_timeout_seconds: float = CONNECT_TIMEOUT_SECONDS,
        ping_interval_seconds: float = PING_INTERVAL_SECONDS,
        max_outstanding_pings: int = MAX_OUTSTANDING_PINGS,
        stream_config: dict[str, Any] | None = None,
        stream_max_age_seconds: float | None = STREAM_MAX_AGE_SECONDS,
        stream_max_bytes: int | None = STREAM_MAX_BYTES,
        dead_letter_max_age_seconds: float | None = None,
        dead_letter_max_bytes: int | None = None,
        replicas: int = 1,
        envelope: EnvelopeFormat = "native",
        cloudevents_mode: CloudEventsMode = "binary",
        cloudevents_source: str = DEFAULT_SOURCE,
    ) -> None:
        """``stream_max_age_seconds`` / ``stream_max_bytes``: limits of the streams this
        broker creates (``None``: unlimited); ``stream_config``: any other
        ``StreamConfig`` field, which wins over both. The dead-letter streams the
        consumers create have no age or size limit (a dead letter waits for an operator)
        unless ``dead_letter_max_age_seconds`` / ``dead_letter_max_bytes`` set one.
        ``replicas``: the JetStream replicas (``num_replicas``, 1 to 5) of every stream
        it creates, dead-letter streams included; on a cluster, 1 is logged as a warning
        (a node lost is its streams lost until it returns). ``url`` may list several
        servers, comma-separated: the client reconnects to any of them.
        ``ping_interval_seconds`` / ``max_outstanding_pings``: a server that answers no
        PING for ``ping_interval_seconds * (max_outstanding_pings + 1)`` seconds is left
        for another (docs/how-to/brokers.md, "Timeouts and keep-alives").
        ``envelope="cloudevents"`` publishes CloudEvents (``cloudevents_mode`` binary or
        structured) from ``cloudevents_source``; consumers read either envelope."""
        super().__init__(
            NatsConnection(
                url,
                client=client,
                create_streams=create_streams,
                dedup_window_seconds=dedup_window_seconds,
                ack_timeout_seconds=ack_timeout_seconds,
                connect_timeout_seconds=connect_timeout_seconds,
                ping_interval_seconds=ping_interval_seconds,
                max_outstanding_pings=max_outstanding_pings,
                stream_config=stream_config,
                stream_max_age_seconds=stream_max_age_seconds,
                stream_max_bytes=stream_max_bytes,
                dead_letter_max_age_seconds=dead_letter_max_age_seconds,
                dead_letter_max_bytes=dead_letter_max_bytes,
                replicas=replicas,
            ),
            envelope_format=CloudEventsOptions(envelope, cloudevents_mode, cloudevents_source),
        )

    def consumer(self, config: ConsumerConfig) -> NatsJetStreamConsumer:
        """The consumer side of ``@outbox.subscriber`` (``consumer.py``), on this broker's
        connection."""
        return NatsJetStreamConsumer(self.connection, config)

    def asyncapi_wire(self) -> NatsJetStreamWire:
        """This broker's wire in the AsyncAPI document (``outbox.asyncapi()``)."""
        return NatsJetStreamWire(self.envelope_format)


class NatsJetStreamWire(WireDescription):
    """A JetStream message: the stream is the subject (captured by the JetStream stream of
    the same name made valid), the headers are NATS headers with the ordering key in
    ``key`` and the row id in ``Nats-Msg-Id`` (JetStream's de-duplication); a group is a
    durable pull consumer with explicit acks. The AsyncAPI NATS bindings know core NATS
    only: JetStream's names travel as ``x-`` extensions."""

    protocol = "nats"
    binding_version = "0.1.0"

    def encode(self, envelope: Envelope) -> tuple[dict[str, str], bytes]:
        headers, body = super().encode(envelope)
        sent = Envelope(envelope.id, envelope.stream, envelope.type, envelope.key, body, headers)
        return publish_headers(sent), body

    def layout(self) -> str:
        return (
            "A NATS JetStream message on the subject of the channel's address: the headers "
            "below are NATS headers, the payload is the body."
        )

    def channel_bindings(self, stream: str) -> Bindings:
        return {"x-subject": stream, "x-jetstream-stream": stream_name_for(stream)}

    def receive_bindings(self, stream: str, group: str) -> Bindings:
        return {
            "x-consumer-group": group,
            "x-durable": durable_name(group, stream),
            "x-ack-policy": "explicit",
        }

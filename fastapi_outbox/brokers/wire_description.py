"""How a broker puts a message on the wire, told to the AsyncAPI document
(``outbox.asyncapi()``, `fastapi_outbox.ops.asyncapi`).

Each broker contributes its own `WireDescription` from a method ``asyncapi_wire()``:
the AsyncAPI protocol of its servers, `encode` (the headers and the
body it sends for an envelope, computed by the same functions its publisher calls, so the
document cannot drift from what is sent) and its protocol bindings (the channel's address
on the broker, the consumer group of a receive operation). A broker without the method
gets the description of its URL's scheme (`BY_SCHEME`: Kafka's, the topic and the
consumer group, ``ce_`` CloudEvents headers and the ordering key as the record's key), else
the default: the envelope's headers as headers and its payload as the body, in the broker's
CloudEvents envelope when it has one, and no bindings.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from fastapi_outbox.brokers.cloudevents import BINARY_PREFIX, CloudEventsOptions, to_envelope
from fastapi_outbox.events import Envelope

__all__ = ["BY_SCHEME", "KafkaWire", "WireDescription", "wire_of"]

Bindings = dict[str, Any]


class WireDescription:
    """A broker's wire for the AsyncAPI document; subclassed per broker.

    ``protocol``: the AsyncAPI protocol of the broker's servers; ``binding_version``: the
    version of the AsyncAPI bindings of that protocol the ``*_bindings`` methods return
    (each returns the inner object, e.g. ``{"topic": "orders"}`` for Kafka, or ``{}``)."""

    protocol = "unknown"
    binding_version: str | None = None
    #: The CloudEvents binary-mode header prefix this broker sends (``ce-``; Kafka: ``ce_``).
    cloudevents_prefix = BINARY_PREFIX

    def __init__(self, envelope_format: CloudEventsOptions | None = None) -> None:
        self.envelope_format = envelope_format or CloudEventsOptions()

    def encode(self, envelope: Envelope) -> tuple[dict[str, str], bytes]:
        """``(headers, body)`` of ``envelope`` as the broker sends it (after its envelope
        format: CloudEvents binary or structured, or native)."""
        sent = to_envelope(envelope, self.envelope_format, prefix=self.cloudevents_prefix)
        return sent.headers_dict(), sent.payload

    def layout(self) -> str:
        """One sentence: where the message id, type, key, headers and payload travel."""
        return "The headers below are the message's headers; the payload is its body."

    def server_bindings(self) -> Bindings:
        return {}

    def channel_bindings(self, stream: str) -> Bindings:
        """The channel of ``stream`` on this broker (topic, subject, stream key…)."""
        return {}

    def send_bindings(self, stream: str) -> Bindings:
        """How the relay publishes to ``stream``."""
        return {}

    def receive_bindings(self, stream: str, group: str) -> Bindings:
        """How consumer group ``group`` reads ``stream``."""
        return {}

    def message_bindings(self, envelope: Envelope) -> Bindings:
        """Protocol fields of a message like ``envelope`` (properties, key)."""
        return {}


class KafkaWire(WireDescription):
    """A Kafka record: the stream's topic (``topic_template``, ``{stream}`` filled in), the
    ordering key as the record's key, the headers as record headers (CloudEvents binary
    mode: ``ce_`` per the Kafka binding); a subscriber group reads with the Kafka consumer
    group ``group_template`` names (``{topic}``, ``{stream}`` and ``{group}`` filled in)."""

    protocol = "kafka"
    binding_version = "0.5.0"
    cloudevents_prefix = "ce_"

    def __init__(
        self,
        envelope_format: CloudEventsOptions | None = None,
        *,
        topic_template: str = "{stream}",
        group_template: str = "{group}",
    ) -> None:
        super().__init__(envelope_format)
        self.topic_template, self.group_template = topic_template, group_template

    def topic(self, stream: str) -> str:
        return self.topic_template.format(stream=stream)

    def layout(self) -> str:
        return (
            "A Kafka record on the stream's topic: the headers below are record headers, "
            "the ordering key is the record's key, the payload its value."
        )

    def channel_bindings(self, stream: str) -> Bindings:
        return {"topic": self.topic(stream)}

    def receive_bindings(self, stream: str, group: str) -> Bindings:
        kafka_group = self.group_template.format(
            topic=self.topic(stream), stream=stream, group=group
        )
        return {"groupId": {"type": "string", "enum": [kafka_group]}}

    def message_bindings(self, envelope: Envelope) -> Bindings:
        if envelope.key is None:
            return {}
        return {"key": {"type": "string", "description": "The ordering key."}}


def _kafka(broker: Any, envelope_format: CloudEventsOptions | None) -> WireDescription:
    """A ``kafka://`` broker without a description of its own, with its ``topic_name`` and
    ``group_id`` templates when it has them."""
    templates = {
        "topic_template": getattr(broker, "topic_name", None),
        "group_template": getattr(broker, "group_id", None),
    }
    given = {k: v for k, v in templates.items() if isinstance(v, str)}
    return KafkaWire(envelope_format, **given)


#: The description of a broker without ``asyncapi_wire()``, by its URL's scheme.
BY_SCHEME: dict[str, Callable[[Any, CloudEventsOptions | None], WireDescription]] = {
    "kafka": _kafka,
    "kafka+ssl": _kafka,
}


def wire_of(broker: Any) -> WireDescription:
    """``broker``'s own description (its ``asyncapi_wire()``), else its URL scheme's, else
    the default one, with its CloudEvents options (``envelope_format``) when it has them."""
    own = getattr(broker, "asyncapi_wire", None)
    if callable(own):
        described = own()
        if isinstance(described, WireDescription):
            return described
    options = getattr(broker, "envelope_format", None)
    envelope_format = options if isinstance(options, CloudEventsOptions) else None
    url = getattr(broker, "url", None)
    scheme = urlsplit(url.split(",")[0]).scheme if isinstance(url, str) else ""
    by_scheme = BY_SCHEME.get(scheme)
    if by_scheme is not None:
        return by_scheme(broker, envelope_format)
    return WireDescription(envelope_format)

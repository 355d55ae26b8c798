"""How a broker puts a message on the wire, told to the AsyncAPI document
(``outbox.asyncapi()``, :mod:`fastapi_outbox.ops.asyncapi`).

Each broker contributes its own :class:`WireDescription` from a method ``asyncapi_wire()``:
the AsyncAPI protocol of its servers, :meth:`~WireDescription.encode` (the headers and the
body it sends for an envelope, computed by the same functions its publisher calls, so the
document cannot drift from what is sent) and its protocol bindings (the channel's address
on the broker, the consumer group of a receive operation). A broker without the method
gets the default: the envelope's headers as headers and its payload as the body, in the
broker's CloudEvents envelope when it has one, and no bindings.
"""

from __future__ import annotations

from typing import Any

from fastapi_outbox.brokers.cloudevents import BINARY_PREFIX, CloudEventsOptions, to_envelope
from fastapi_outbox.events import Envelope

__all__ = ["WireDescription", "wire_of"]

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


def wire_of(broker: Any) -> WireDescription:
    """``broker``'s own description (its ``asyncapi_wire()``), else the default one with
    its CloudEvents options (``envelope_format``) when it has them."""
    own = getattr(broker, "asyncapi_wire", None)
    if callable(own):
        described = own()
        if isinstance(described, WireDescription):
            return described
    options = getattr(broker, "envelope_format", None)
    return WireDescription(options if isinstance(options, CloudEventsOptions) else None)

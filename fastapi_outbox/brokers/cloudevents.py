"""The CloudEvents 1.0 envelope, pure: an outbox envelope as CloudEvent attributes, as
binary-mode headers (``ce-*``, or ``ce_*`` per the AMQP binding) with the payload as the
body, or as one structured-mode ``application/cloudevents+json`` document; and back, for
CloudEvents written by this library or by any other producer, in either mode. The brokers
that offer ``envelope="cloudevents"`` use it in their publisher and consumer; it knows no
broker and does no I/O.

Mapping: ``message-id`` → ``id``, ``type`` → ``type``, ``occurred-at`` → ``time``, the
stream → ``subject``, the broker's ``cloudevents_source`` → ``source``; the payload is the
``data`` (``datacontenttype`` ``application/json``). ``correlation-id``, ``causation-id``
and ``traceparent``/``tracestate`` travel as the extension attributes ``correlationid``,
``causationid``, ``traceparent`` and ``tracestate``, the ordering key as ``partitionkey``
(the Partitioning extension). Other headers become extensions named by their lower-cased
letters and digits (CloudEvents attribute names allow nothing else): ``x-tenant`` →
``xtenant``.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from fastapi_outbox import exceptions
from fastapi_outbox.brokers.consumer import Delivery
from fastapi_outbox.events import (
    HEADER_CAUSATION_ID,
    HEADER_CORRELATION_ID,
    HEADER_ENCRYPTED_HEADERS,
    HEADER_ENCRYPTION_KEY_ID,
    HEADER_MESSAGE_ID,
    HEADER_OCCURRED_AT,
    HEADER_TRACEPARENT,
    HEADER_TRACESTATE,
    HEADER_TYPE,
    Envelope,
)

__all__ = [
    "AMQP_BINARY_PREFIX",
    "BINARY_PREFIX",
    "CONTENT_TYPE_JSON",
    "CONTENT_TYPE_STRUCTURED",
    "DEFAULT_SOURCE",
    "SPECVERSION",
    "CloudEvent",
    "CloudEventsMode",
    "CloudEventsOptions",
    "EnvelopeFormat",
    "as_delivery",
    "attributes",
    "decode",
    "encode",
    "is_cloudevent",
    "to_envelope",
]

SPECVERSION = "1.0"
CONTENT_TYPE_JSON = "application/json"
CONTENT_TYPE_STRUCTURED = "application/cloudevents+json"
#: Binary-mode header prefix (HTTP, Kafka, NATS, and the Redis ``headers`` field).
BINARY_PREFIX = "ce-"
#: Binary-mode application-property prefix of the AMQP 1.0 binding (RabbitMQ's AMQP
#: 0-9-1 binding uses ``ce-`` headers, as HTTP does); read, like ``ce_`` (Kafka) and
#: ``cloudEvents:``, from other producers.
AMQP_BINARY_PREFIX = "cloudEvents_"
#: Every binary-mode prefix a consumer recognises, lower-cased.
_READ_PREFIXES = ("ce-", "ce_", "cloudevents_", "cloudevents:")
_SPECVERSION_HEADERS = frozenset(p + "specversion" for p in _READ_PREFIXES)
#: The source when a broker is given none.
DEFAULT_SOURCE = "/fastapi-outbox"

EnvelopeFormat = Literal["native", "cloudevents"]
CloudEventsMode = Literal["binary", "structured"]

#: Outbox headers and the extension attribute each travels as.
_EXTENSIONS = {
    HEADER_CORRELATION_ID: "correlationid",
    HEADER_CAUSATION_ID: "causationid",
    HEADER_TRACEPARENT: "traceparent",
    HEADER_TRACESTATE: "tracestate",
    # Encrypted payloads (fastapi_outbox.payloads): consumers look for the outbox's names.
    HEADER_ENCRYPTION_KEY_ID: "encryptionkeyid",
    HEADER_ENCRYPTED_HEADERS: "encryptedheaders",
}
_HEADERS = {v: k for k, v in _EXTENSIONS.items()}
_KEY_EXTENSION = "partitionkey"
#: Attributes that have a place of their own in a Delivery (or are the envelope's).
_SPECIAL = frozenset({"specversion", "id", "type", "time", "datacontenttype", "data"})


@dataclass(frozen=True, slots=True)
class CloudEventsOptions:
    """A broker's envelope choice: ``envelope`` (``"native"`` or ``"cloudevents"``), the
    CloudEvents ``mode`` and ``source``. Checked on construction."""

    envelope: EnvelopeFormat = "native"
    mode: CloudEventsMode = "binary"
    source: str = DEFAULT_SOURCE

    def __post_init__(self) -> None:
        if self.envelope not in ("native", "cloudevents"):
            raise exceptions.ConfigurationError(
                f"envelope must be 'native' or 'cloudevents', got {self.envelope!r}"
            )
        if self.mode not in ("binary", "structured"):
            raise exceptions.ConfigurationError(
                f"cloudevents_mode must be 'binary' or 'structured', got {self.mode!r}"
            )
        if not self.source:
            raise exceptions.ConfigurationError("cloudevents_source must not be empty")

    @property
    def enabled(self) -> bool:
        return self.envelope == "cloudevents"


@dataclass(frozen=True, slots=True)
class CloudEvent:
    """A CloudEvent read back as what a consumer needs: the message id, type, ordering key,
    the outbox-style headers (``message-id``, ``type``, ``occurred-at``, ``correlation-id``
    …; other attributes as ``ce-<name>``, e.g. ``ce-source``, ``ce-subject``) and the
    payload (the ``data`` as JSON bytes)."""

    message_id: str
    type: str
    key: str | None
    headers: dict[str, str]
    payload: bytes


def _extension_name(header: str) -> str:
    return "".join(c for c in header.lower() if c.isascii() and c.isalnum())


def attributes(envelope: Envelope, source: str) -> dict[str, str]:
    """The context attributes of ``envelope`` as a CloudEvent from ``source`` (no data)."""
    headers = envelope.headers
    out = {
        "specversion": SPECVERSION,
        "id": envelope.message_id,
        "source": source,
        "type": envelope.type,
        "subject": envelope.stream,
        "datacontenttype": CONTENT_TYPE_JSON,
    }
    occurred = headers.get(HEADER_OCCURRED_AT)
    if occurred:
        out["time"] = occurred
    if envelope.key:
        out[_KEY_EXTENSION] = envelope.key
    for name, value in headers.items():
        if name in (HEADER_MESSAGE_ID, HEADER_TYPE, HEADER_OCCURRED_AT):
            continue
        attribute = _EXTENSIONS.get(name) or _extension_name(name)
        if attribute and attribute not in out:
            out[attribute] = str(value)
    return out


def encode(
    envelope: Envelope, source: str, mode: CloudEventsMode, *, prefix: str = BINARY_PREFIX
) -> tuple[dict[str, str], bytes]:
    """``envelope`` as a CloudEvent message: ``(headers, body)``. Binary mode: every
    attribute as a ``prefix``-ed header, ``datacontenttype`` as ``content-type``, the
    payload as the body. Structured mode: ``content-type: application/cloudevents+json``
    and the whole event as the body, the payload embedded as JSON ``data``."""
    attrs = attributes(envelope, source)
    if mode == "binary":
        content_type = attrs.pop("datacontenttype")
        headers = {prefix + name: value for name, value in attrs.items()}
        headers["content-type"] = content_type
        return headers, envelope.payload
    document: dict[str, Any] = dict(attrs)
    try:
        document["data"] = json.loads(envelope.payload) if envelope.payload else None
    except ValueError:  # not JSON after all: carried as a string
        document["datacontenttype"] = "text/plain"
        document["data"] = envelope.payload.decode("utf-8", "replace")
    body = json.dumps(document, separators=(",", ":")).encode()
    return {"content-type": CONTENT_TYPE_STRUCTURED}, body


def _content_type(headers: Mapping[str, Any]) -> str:
    for name, value in headers.items():
        if name.lower() in ("content-type", "content_type"):
            return _text(value).split(";", 1)[0].strip().lower()
    return ""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def is_cloudevent(headers: Mapping[str, Any]) -> bool:
    """Whether a message with ``headers`` is a CloudEvent: structured (its content type is
    ``application/cloudevents+json``) or binary (a ``ce-specversion``/``ce_specversion``
    header, or ``ce_``/``cloudEvents_``/``cloudEvents:``)."""
    if _content_type(headers).startswith("application/cloudevents"):
        return True
    return any(name.lower() in _SPECVERSION_HEADERS for name in headers)


def decode(headers: Mapping[str, Any], body: bytes) -> CloudEvent | None:
    """The CloudEvent in a message of ``headers`` and ``body``, in either mode, else None
    (not a CloudEvent). Raises ValueError for a structured body that is not a JSON object
    or an event without ``id`` or ``type``."""
    if _content_type(headers).startswith("application/cloudevents"):
        document = json.loads(body)
        if not isinstance(document, dict):
            raise ValueError("structured CloudEvent: the body is not a JSON object")
        attrs = {k: v for k, v in document.items() if k not in ("data", "data_base64")}
        if "data" in document:
            # The payload of a Delivery is JSON: the data re-encoded as JSON.
            payload = json.dumps(document["data"], separators=(",", ":")).encode()
        elif "data_base64" in document:
            payload = base64.b64decode(document["data_base64"], validate=True)
        else:
            payload = b""
    else:
        attrs = {}
        for name, value in headers.items():
            lowered = name.lower()
            for prefix in _READ_PREFIXES:
                if lowered.startswith(prefix):
                    attrs[lowered[len(prefix) :]] = _text(value)
                    break
        if "specversion" not in attrs:
            return None
        content_type = _content_type(headers)
        if content_type:
            attrs["datacontenttype"] = content_type
        payload = body
    return _event(attrs, payload)


def _event(attrs: dict[str, Any], payload: bytes) -> CloudEvent:
    message_id = attrs.get("id")
    type_ = attrs.get("type")
    if not message_id or not type_:
        raise ValueError("CloudEvent without id or type")
    headers = {HEADER_MESSAGE_ID: str(message_id), HEADER_TYPE: str(type_)}
    if attrs.get("time"):
        headers[HEADER_OCCURRED_AT] = str(attrs["time"])
    key = attrs.get(_KEY_EXTENSION)
    for name, value in attrs.items():
        if name in _SPECIAL or name == _KEY_EXTENSION:
            continue
        headers[_HEADERS.get(name, BINARY_PREFIX + name)] = str(value)
    return CloudEvent(
        message_id=str(message_id),
        type=str(type_),
        key=str(key) if key else None,
        headers=headers,
        payload=payload,
    )


def to_envelope(
    envelope: Envelope, options: CloudEventsOptions, *, prefix: str = BINARY_PREFIX
) -> Envelope:
    """``envelope`` as a broker that carries headers and a body sends it with
    ``options``: itself when the envelope format is native, else the same row (id, stream,
    type, key) with the CloudEvent's headers and body."""
    if not options.enabled:
        return envelope
    headers, body = encode(envelope, options.source, options.mode, prefix=prefix)
    return Envelope(envelope.id, envelope.stream, envelope.type, envelope.key, body, headers)


def as_delivery(
    headers: Mapping[str, Any],
    body: bytes,
    *,
    stream: str,
    entry_id: str,
    attempt: int,
    key: str | None = None,
    handle: Any = None,
) -> Delivery | None:
    """The delivery of a message of ``headers`` and ``body`` when it is a CloudEvent (in
    either mode, from any producer), else None: what every consumer calls before reading
    a message as native. A malformed CloudEvent (no ``id`` or ``type``, a structured
    body that is not a JSON object) is read as native too: it reaches the processing of
    the message, which dead-letters what it cannot handle, and never stops the fetch."""
    if not is_cloudevent(headers):
        return None
    try:
        event = decode(headers, body)
    except ValueError:
        return None
    if event is None:
        return None
    return Delivery(
        stream=stream,
        entry_id=entry_id,
        message_id=event.message_id,
        type=event.type,
        key=event.key or key,
        headers=event.headers,
        payload=event.payload,
        attempt=attempt,
        handle=handle,
    )

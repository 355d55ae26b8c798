"""The AsyncAPI 3.1 document of an outbox: the events an app publishes and consumes, as
they are on the wire.

``outbox.asyncapi()`` describes, from what the app declares and nothing else:

- a **server** per broker (protocol and host only: never a user name or a password);
- a **channel** per stream (its address is the stream name), carrying the messages of every
  concrete [`Event`][fastapi_outbox.Event] class on that stream and of every event a
  subscriber of it accepts, with each broker's channel bindings (Redis stream key, NATS
  subject and JetStream stream, AMQP exchange, Kafka topic);
- a **send operation** per stream the app publishes to, and a **receive operation** per
  subscriber with its broker's bindings (the consumer group, its durable or queue) and
  ``x-group``, ``x-dead-letter``;
- a **message** per event type and wire form: the headers and the payload as the broker
  sends them. Each broker says how it encodes a message
  (``fastapi_outbox.brokers.wire_description``): the document runs that encoding on a
  probe message, so CloudEvents binary (``ce-*`` headers) and structured (the envelope as
  the payload), the broker's own headers (``Nats-Msg-Id``, ``key``), an encrypted payload
  (the sealed string and the ``encryption-key-id`` header) and a claim-checked one (the
  ``{}`` stub and the ``outbox-claim-check`` headers) are described as sent. A broker whose
  form differs from the first one's gets its own message, named ``<type>.<broker>``.

Payload schemas are pydantic's serialization schemas, nested models under
``components.schemas``, made valid AsyncAPI Schema Objects (a discriminator is its property
name). ``build_asyncapi_router`` serves the document at ``/outbox/asyncapi.json`` behind the
same guard as the dashboard. The official parser (``@asyncapi/parser``) checks it in
``tests/unit/test_asyncapi_parser.py``.
"""

from __future__ import annotations

import inspect
import json
import re
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, Union
from urllib.parse import urlsplit

from fastapi_outbox import exceptions
from fastapi_outbox.brokers.cloudevents import CONTENT_TYPE_STRUCTURED
from fastapi_outbox.brokers.wire_description import WireDescription, wire_of
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
    Event,
    Message,
)
from fastapi_outbox.settings import OutboxSettings
from fastapi_outbox.storage.claim_check import HEADER_CLAIM_CHECK, HEADER_CLAIM_CHECK_SIZE

if TYPE_CHECKING:
    from fastapi import APIRouter

__all__ = [
    "ASYNCAPI_PATH",
    "ASYNCAPI_VERSION",
    "AsyncApiSource",
    "build_asyncapi",
    "build_asyncapi_router",
    "event_classes",
]

ASYNCAPI_VERSION = "3.1.0"
ASYNCAPI_PATH = "/outbox/asyncapi.json"
#: Characters AsyncAPI allows in a component name (``^[\\w\\d\\.\\-_]+$``).
_COMPONENT_NAME = re.compile(r"[^\w.\-]")
_PROTOCOLS = {
    "redis": "redis",
    "rediss": "redis",
    "redis+cluster": "redis",
    "rediss+cluster": "redis",
    "nats": "nats",
    "tls": "nats",
    "amqp": "amqp",
    "amqps": "amqps",
    "kafka": "kafka",
    "kafka+ssl": "kafka-secure",
}


class SubscriberLike(Protocol):
    """What the document reads of a subscriber (``fastapi_outbox.consume.subscriber.
    Subscriber``)."""

    stream: str
    group: str
    broker_name: str
    dead_letter: str
    handler: Any
    name: str


class AsyncApiSource(Protocol):
    """The port the document is built from: an [`Outbox`][fastapi_outbox.Outbox] fits it."""

    @property
    def brokers(self) -> Mapping[str, Any]: ...

    @property
    def external_brokers(self) -> Mapping[str, Any]: ...

    @property
    def subscribers(self) -> Sequence[Any]: ...

    @property
    def settings(self) -> OutboxSettings: ...


def event_classes() -> list[type[Event]]:
    """Every concrete [`Event`][fastapi_outbox.Event] subclass defined in this process, by
    type name."""
    found: dict[str, type[Event]] = {}
    todo: list[type[Event]] = [Event]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            todo.append(sub)
            if not sub.__outbox_abstract__:
                found.setdefault(f"{sub.__module__}.{sub.__qualname__}", sub)
    return sorted(found.values(), key=lambda c: (c.__outbox_stream__ or "", c.__outbox_type__))


def _accepted(handler: Any) -> list[type[Event]] | None:
    """The Event classes a handler's first parameter takes (``list[...]`` for a batch
    handler, unions allowed); None when it takes raw ``Message`` objects."""
    params = list(inspect.signature(handler).parameters.values())
    if not params:
        return []
    try:
        hints = typing.get_type_hints(handler)
    except Exception:  # an annotation that does not resolve: nothing to describe
        return []
    annotation = hints.get(params[0].name)
    if typing.get_origin(annotation) in (list, Sequence):
        (annotation,) = typing.get_args(annotation) or (None,)
    if typing.get_origin(annotation) in (Union, types.UnionType):
        options = list(typing.get_args(annotation))
    else:
        options = [annotation]
    if Message in options:
        return None
    return [o for o in options if isinstance(o, type) and issubclass(o, Event)]


def _component_name(text: str) -> str:
    return _COMPONENT_NAME.sub("_", text) or "_"


def _server(broker: Any, wire: WireDescription) -> dict[str, Any]:
    url = getattr(broker, "url", None)
    if not isinstance(url, str):
        kind = type(broker).__name__.lower()
        protocol = "memory" if "memory" in kind else kind.removesuffix("broker") or "unknown"
        if wire.protocol != "unknown":
            protocol = wire.protocol
        host = "in-process" if protocol == "memory" else "unknown"
        return {"host": host, "protocol": protocol}
    first = url.split(",")[0]
    parts = urlsplit(first)
    # Host and port only: a URL's user, password and query never reach the document.
    host = parts.hostname or "localhost"
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    protocol = _PROTOCOLS.get(parts.scheme, parts.scheme or "unknown")
    server: dict[str, Any] = {"host": host, "protocol": protocol}
    bindings = _bindings(wire, wire.server_bindings())
    if bindings:
        server["bindings"] = bindings
    return server


def _bindings(wire: WireDescription, inner: Mapping[str, Any]) -> dict[str, Any]:
    """``{protocol: {...inner, bindingVersion}}``, or ``{}`` when there is nothing to say."""
    if not inner or wire.protocol == "unknown":
        return {}
    binding = dict(inner)
    if wire.binding_version is not None:
        binding["bindingVersion"] = wire.binding_version
    return {wire.protocol: binding}


# -- payloads -------------------------------------------------------------------------------


def _asyncapi_schema(node: Any) -> Any:
    """``node`` (a pydantic JSON Schema) as an AsyncAPI Schema Object: a discriminator is
    its property name (AsyncAPI's ``discriminator`` is a string; pydantic writes OpenAPI's
    object with a mapping, whose references the ``oneOf`` already holds)."""
    if isinstance(node, dict):
        out = {k: _asyncapi_schema(v) for k, v in node.items()}
        discriminator = out.get("discriminator")
        if isinstance(discriminator, dict) and "propertyName" in discriminator:
            out["discriminator"] = discriminator["propertyName"]
        return out
    if isinstance(node, list):
        return [_asyncapi_schema(v) for v in node]
    return node


def _payload_schema(event: type[Event], name: str, schemas: dict[str, Any]) -> dict[str, Any]:
    """The model's serialization JSON Schema (what ``model_dump(mode="json")`` sends) with
    its nested models hoisted into ``schemas``. A recursive model's schema is pydantic's
    reference to its own definition: the definition is the schema."""
    ref = f"#/components/schemas/{name}"
    schema = event.model_json_schema(
        ref_template="#/components/schemas/{model}", mode="serialization"
    )
    definitions = schema.pop("$defs", {})
    if schema == {"$ref": ref} and name in definitions:
        schema = definitions.pop(name)
    for nested_name, nested in definitions.items():
        schemas.setdefault(nested_name, _asyncapi_schema(nested))
    return typing.cast(dict[str, Any], _asyncapi_schema(schema))


#: The payload that stands for a claim-checked one.
_STUB = {
    "type": "object",
    "maxProperties": 0,
    "description": (
        f"Claim-check stub: the payload is in the outbox's payload store under the "
        f"reference the {HEADER_CLAIM_CHECK} header holds ({HEADER_CLAIM_CHECK_SIZE}: its "
        "size in bytes; ce-outboxclaimcheck and ce-outboxclaimchecksize as CloudEvents "
        "extensions); a subscriber's handler receives the whole event."
    ),
}


def _sealed(plain: Mapping[str, Any]) -> dict[str, Any]:
    sealed: dict[str, Any] = {
        "type": "string",
        "contentEncoding": "base64",
        "description": (
            "Encrypted (AES-GCM): base64 of the 12-byte nonce, the ciphertext of the JSON "
            f"payload and the 16-byte tag, as a JSON string; the {HEADER_ENCRYPTION_KEY_ID} "
            "header (CloudEvents: the encryptionkeyid extension) names the key. The "
            "associated data is the message id, type and stream."
        ),
    }
    if "$ref" in plain:
        sealed["x-plaintext"] = dict(plain)
    return sealed


@dataclass(frozen=True, slots=True)
class _Payloads:
    """What the outbox's payload stages do to a stream's payloads."""

    encrypted: bool
    sealed_headers: bool
    claim_check_bytes: int | None

    @classmethod
    def of(cls, settings: OutboxSettings | None, stream: str) -> _Payloads:
        if settings is None:
            return cls(False, False, None)
        streams = settings.encryption_streams
        encrypted = settings.encryption_keys is not None and (streams is None or stream in streams)
        sealed_headers = encrypted and bool(settings.encrypted_headers)
        return cls(encrypted, sealed_headers, settings.claim_check_bytes)

    def form(self, plain: dict[str, Any]) -> dict[str, Any]:
        """The payload as the stages leave it: sealed, and/or a stub when too large."""
        form = _sealed(plain) if self.encrypted else plain
        if self.claim_check_bytes is None:
            return form
        over = {**_STUB, "x-over-bytes": self.claim_check_bytes}
        return {"oneOf": [form, over]}


# -- headers, by probing the broker's encoding ------------------------------------------------

_SOURCE_HEADERS: dict[str, dict[str, Any]] = {
    HEADER_MESSAGE_ID: {
        "type": "string",
        "format": "uuid",
        "description": "UUIDv7, time-ordered; the consumers' de-duplication key.",
    },
    HEADER_OCCURRED_AT: {"type": "string", "format": "date-time"},
    HEADER_CORRELATION_ID: {
        "type": "string",
        "description": "From the request's X-Correlation-ID or traceparent, or new.",
    },
    HEADER_CAUSATION_ID: {
        "type": "string",
        "description": "The message id of the message whose handler published it.",
    },
    HEADER_TRACEPARENT: {"type": "string", "description": "W3C trace context."},
    HEADER_TRACESTATE: {"type": "string", "description": "W3C trace context."},
    HEADER_ENCRYPTION_KEY_ID: {
        "type": "string",
        "description": "The id of the key the payload is encrypted with.",
    },
    HEADER_ENCRYPTED_HEADERS: {
        "type": "string",
        "contentEncoding": "base64",
        "description": "The headers named in encrypted_headers, sealed together.",
    },
    HEADER_CLAIM_CHECK: {
        "type": "string",
        "description": "Claim-checked: the reference of the payload in the payload store.",
    },
    HEADER_CLAIM_CHECK_SIZE: {
        "type": "string",
        "pattern": "^[0-9]+$",
        "description": "Claim-checked: the payload's size in bytes.",
    },
}
_ROW_ID = "00000000-0000-7000-8000-00000000feed"
_KEY = "probe-ordering-key"
_KEY_SCHEMA = {"type": "string", "description": "The ordering key (the event's key field)."}
_ROW_ID_SCHEMA = {
    "type": "string",
    "format": "uuid",
    "description": "The outbox row's id: the broker's de-duplication id.",
}


@dataclass(slots=True)
class _Probe:
    """A message with a recognisable value in every header it may carry: what the broker
    sends for it tells where each header travels, under which name."""

    type_name: str
    stream: str
    tokens: dict[str, str]
    required: set[str]
    keyed: bool | None  # None: a raw message, whose key is optional

    @classmethod
    def of(
        cls, type_name: str, stream: str, payloads: _Payloads, *, internal: bool, keyed: bool | None
    ) -> _Probe:
        names = [HEADER_MESSAGE_ID, HEADER_OCCURRED_AT]
        required = {HEADER_MESSAGE_ID, HEADER_TYPE, HEADER_OCCURRED_AT}
        if internal:
            names += [HEADER_CORRELATION_ID, HEADER_CAUSATION_ID]
            names += [HEADER_TRACEPARENT, HEADER_TRACESTATE]
            required.add(HEADER_CORRELATION_ID)
        if payloads.encrypted:
            names.append(HEADER_ENCRYPTION_KEY_ID)
            required.add(HEADER_ENCRYPTION_KEY_ID)
        if payloads.sealed_headers:
            names.append(HEADER_ENCRYPTED_HEADERS)
        if payloads.claim_check_bytes is not None:
            names += [HEADER_CLAIM_CHECK, HEADER_CLAIM_CHECK_SIZE]
        tokens = {n: f"00000000-0000-7000-8000-{i:012d}" for i, n in enumerate(names)}
        tokens[HEADER_OCCURRED_AT] = "2000-01-01T00:00:00.000001+00:00"
        return cls(type_name, stream, tokens, required, keyed)

    def envelope(self) -> Envelope:
        headers = {HEADER_MESSAGE_ID: self.tokens[HEADER_MESSAGE_ID], HEADER_TYPE: self.type_name}
        headers.update(self.tokens)
        key = None if self.keyed is False else _KEY
        return Envelope(_ROW_ID, self.stream, self.type_name, key, b'{"probe":1}', headers)

    def schema_of(self, value: Any) -> tuple[dict[str, Any], bool, str | None]:
        """(schema, required, outbox header) of a value the broker sent."""
        for name, token in self.tokens.items():
            if value == token:
                return dict(_SOURCE_HEADERS[name]), name in self.required, name
        if value == self.type_name:
            schema = {"type": "string", "description": "The event type."}
            if self.keyed is not None:  # an event's type; a raw message's is any
                schema["const"] = value
            return schema, True, HEADER_TYPE
        if value == _KEY:
            return dict(_KEY_SCHEMA), bool(self.keyed), None
        if value == _ROW_ID:
            return dict(_ROW_ID_SCHEMA), True, None
        if value == self.stream:
            return {"type": "string", "const": value, "description": "The stream."}, True, None
        return {"type": "string", "const": str(value)}, True, None


def _object(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": required,
        "properties": properties,
        "additionalProperties": {"type": "string"},
    }


def _wire_message(probe: _Probe, wire: WireDescription, payload: dict[str, Any]) -> dict[str, Any]:
    """The message's ``contentType``, ``headers``, ``payload`` and ``correlationId`` as
    ``wire`` sends ``probe``; ``payload`` is the payload's schema after the stages."""
    envelope = probe.envelope()
    sent_headers, body = wire.encode(envelope)
    properties: dict[str, Any] = {}
    required: list[str] = []
    correlation: str | None = None
    for name, value in sent_headers.items():
        schema, needed, source = probe.schema_of(value)
        properties[name] = schema
        if needed:
            required.append(name)
        if source == HEADER_CORRELATION_ID:
            correlation = f"$message.header#/{name}"
    content_type = "application/json"
    for name in ("content-type", "content_type"):
        if name in sent_headers:
            content_type = sent_headers[name]
    if content_type == CONTENT_TYPE_STRUCTURED:
        attributes: dict[str, Any] = {}
        needed_attributes: list[str] = []
        for name, value in json.loads(body).items():
            if name == "data":
                attributes[name] = payload
                needed_attributes.append(name)
                continue
            schema, needed, source = probe.schema_of(value)
            attributes[name] = schema
            if needed:
                needed_attributes.append(name)
            if source == HEADER_CORRELATION_ID:
                correlation = f"$message.payload#/{name}"
        payload = {
            **_object(attributes, needed_attributes),
            "description": "A CloudEvent (structured mode): the event is its data.",
        }
    message: dict[str, Any] = {
        "contentType": content_type,
        "headers": _object(properties, required),
        "payload": payload,
    }
    if correlation is not None:
        message["correlationId"] = {
            "description": "Shared by every message of one request or flow.",
            "location": correlation,
        }
    bindings = _bindings(wire, wire.message_bindings(envelope))
    if bindings:
        message["bindings"] = bindings
    return message


# -- the catalog of messages -----------------------------------------------------------------

_RAW = "RawMessage"


@dataclass(frozen=True, slots=True)
class _Target:
    """A broker messages go to: its wire, and whether it is external (an external broker
    receives no internal-only header)."""

    name: str
    wire: WireDescription
    external: bool


def _merge_bindings(found: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """One bindings object from several brokers' (the first broker of a protocol wins)."""
    merged: dict[str, Any] = {}
    for bindings in found:
        for protocol, binding in bindings.items():
            merged.setdefault(protocol, binding)
    return merged


class _Catalog:
    """The messages of a document as they are found: one per event type and wire form,
    and which brokers carry each message on each stream."""

    def __init__(self, targets: Mapping[str, _Target], settings: OutboxSettings | None) -> None:
        self.targets = targets
        self.settings = settings
        self.schemas: dict[str, Any] = {}
        self.messages: dict[str, Any] = {}
        #: stream → {message name: the brokers carrying it there}
        self.on_streams: dict[str, dict[str, list[str]]] = {}
        self._names: dict[tuple[str, str, str], str] = {}

    def _name(self, type_name: str, broker: str, message: dict[str, Any]) -> str:
        """The component name of ``message``: the type's, or ``<type>.<broker>`` when the
        type already has a message of another form."""
        name = _component_name(type_name)
        if self.messages.setdefault(name, message) == message:
            return name
        name = _component_name(f"{type_name}.{broker}")
        while self.messages.setdefault(name, message) != message:
            name += "_"
        return name

    def put(self, stream: str, name: str, broker: str) -> None:
        """Message ``name`` is on ``stream``, carried by ``broker``."""
        carriers = self.on_streams.setdefault(stream, {}).setdefault(name, [])
        if broker not in carriers:
            carriers.append(broker)

    def add(self, event: type[Event], brokers: Iterable[str]) -> list[str]:
        """Describe ``event`` as each of ``brokers`` sends it; its message names."""
        assert event.__outbox_stream__ is not None
        stream, type_name = event.__outbox_stream__, event.__outbox_type__
        schema_name = _component_name(event.__name__)
        if schema_name not in self.schemas:
            self.schemas[schema_name] = _payload_schema(event, schema_name, self.schemas)
        plain = {"$ref": f"#/components/schemas/{schema_name}"}
        payloads = _Payloads.of(self.settings, stream)
        names: list[str] = []
        for broker in brokers:
            target = self.targets[broker]
            key = (type_name, stream, broker)
            if key not in self._names:
                probe = _Probe.of(
                    type_name,
                    stream,
                    payloads,
                    internal=not target.external,
                    keyed=event.__outbox_key__ is not None,
                )
                message = {
                    "name": type_name,
                    "title": event.__name__,
                    **_wire_message(probe, target.wire, payloads.form(plain)),
                    **_about(event, target),
                }
                self._names[key] = self._name(type_name, broker, message)
            name = self._names[key]
            self.put(stream, name, broker)
            if name not in names:
                names.append(name)
        return names

    def add_raw(self, stream: str, broker: str) -> str:
        """The message of a subscriber that takes raw messages: anything on its stream."""
        key = (_RAW, stream, broker)
        if key not in self._names:
            target = self.targets[broker]
            payloads = _Payloads.of(self.settings, stream)
            probe = _Probe.of(
                "probe.any.type", stream, payloads, internal=not target.external, keyed=None
            )
            message = {
                "name": _RAW,
                "title": "Any message of the stream",
                **_wire_message(probe, target.wire, payloads.form({})),
            }
            layout = target.wire.layout()
            message["description"] = layout
            self._names[key] = self._name(_RAW, broker, message)
        name = self._names[key]
        self.put(stream, name, broker)
        return name


def _about(event: type[Event], target: _Target) -> dict[str, Any]:
    """A message's summary, description (the event's docstring, then the wire's layout),
    ordering key and external flag."""
    about: dict[str, Any] = {}
    doc = inspect.getdoc(event)
    text = target.wire.layout()
    if doc and event.__doc__ and event.__doc__ is not Event.__doc__:
        about["summary"] = doc.splitlines()[0]
        text = f"{doc}\n\n{text}"
    about["description"] = text
    if event.__outbox_key__ is not None:
        about["x-key"] = event.__outbox_key__
    if event.__outbox_external__:
        about["x-external"] = True
    return about


#: A subscriber and the names of the messages it receives.
_Received = list[tuple[SubscriberLike, list[str]]]


def _carriers(event: type[Event], internal: Sequence[str], external: Sequence[str]) -> list[str]:
    """The brokers an event may go to: any internal one (``publish(..., broker=)`` chooses),
    and every external one for an ``external=True`` event."""
    return [*internal, *external] if event.__outbox_external__ else list(internal)


def _sent(
    catalog: _Catalog,
    published: Iterable[type[Event]],
    internal: Sequence[str],
    external: Sequence[str],
) -> dict[str, list[str]]:
    """Stream → the names of the messages the app publishes to it, in first-seen order."""
    sent: dict[str, list[str]] = {}
    for event in published:
        names = sent.setdefault(event.__outbox_stream__ or "", [])
        for name in catalog.add(event, _carriers(event, internal, external)):
            if name not in names:
                names.append(name)
    return sent


def _received(catalog: _Catalog, subscribers: Iterable[SubscriberLike]) -> _Received:
    received: _Received = []
    for sub in subscribers:
        if sub.broker_name not in catalog.targets:
            continue  # a subscriber of a broker the outbox no longer has: nothing to say
        accepted = _accepted(sub.handler)
        if accepted is None:
            names = [catalog.add_raw(sub.stream, sub.broker_name)]
        else:
            names = [n for e in accepted for n in catalog.add(e, [sub.broker_name])]
            for name in names:  # what it receives is on its stream, whatever the class says
                catalog.put(sub.stream, name, sub.broker_name)
        received.append((sub, names))
    return received


def _channels(catalog: _Catalog) -> tuple[dict[str, Any], dict[str, str]]:
    """The channels, one per stream, and each stream's channel id (stream names that
    differ only in characters a component name cannot hold get distinct ids)."""
    channels: dict[str, Any] = {}
    channel_ids: dict[str, str] = {}
    order = list(catalog.targets)
    for stream in sorted(catalog.on_streams):
        channel_id = _component_name(stream)
        while channel_id in channels:
            channel_id += "_"
        channel_ids[stream] = channel_id
        on_stream = catalog.on_streams[stream]
        brokers = sorted({b for carriers in on_stream.values() for b in carriers}, key=order.index)
        channel: dict[str, Any] = {
            "address": stream,
            "messages": {n: {"$ref": f"#/components/messages/{n}"} for n in on_stream},
        }
        if brokers:
            channel["servers"] = [{"$ref": f"#/servers/{_component_name(b)}"} for b in brokers]
        bindings = _merge_bindings(
            _bindings(w, w.channel_bindings(stream))
            for w in (catalog.targets[b].wire for b in brokers)
        )
        if bindings:
            channel["bindings"] = bindings
        channels[channel_id] = channel
    return channels, channel_ids


def _operations(
    catalog: _Catalog,
    sent: Mapping[str, list[str]],
    received: _Received,
    channel_ids: Mapping[str, str],
) -> dict[str, Any]:
    """A send operation per stream the app publishes to, a receive one per subscriber."""
    operations: dict[str, Any] = {}
    for stream, names in sent.items():
        channel_id = channel_ids[stream]
        on_stream = catalog.on_streams[stream]
        brokers = {b: None for n in names for b in on_stream[n]}
        operation: dict[str, Any] = {
            "action": "send",
            "channel": {"$ref": f"#/channels/{channel_id}"},
            "summary": f"Events committed by a unit of work and relayed to {stream!r}.",
            "messages": [{"$ref": f"#/channels/{channel_id}/messages/{n}"} for n in names],
        }
        bindings = _merge_bindings(
            _bindings(w, w.send_bindings(stream))
            for w in (catalog.targets[b].wire for b in brokers)
        )
        if bindings:
            operation["bindings"] = bindings
        operations[f"publish.{channel_id}"] = operation
    for sub, names in received:
        channel_id = channel_ids[sub.stream]
        wire = catalog.targets[sub.broker_name].wire
        operation = {
            "action": "receive",
            "channel": {"$ref": f"#/channels/{channel_id}"},
            "summary": f"Consumer group {sub.group!r}: {sub.name}",
            "messages": [{"$ref": f"#/channels/{channel_id}/messages/{n}"} for n in names],
            "x-group": sub.group,
            "x-broker": sub.broker_name,
            "x-dead-letter": sub.dead_letter,
        }
        bindings = _bindings(wire, wire.receive_bindings(sub.stream, sub.group))
        if bindings:
            operation["bindings"] = bindings
        doc = inspect.getdoc(sub.handler)
        if doc:
            operation["description"] = doc
        operations[f"consume.{channel_id}.{_component_name(sub.group)}"] = operation
    return operations


def build_asyncapi(
    source: AsyncApiSource,
    *,
    title: str = "fastapi-outbox events",
    version: str = "1.0.0",
    description: str | None = None,
    events: Iterable[type[Event]] | None = None,
) -> dict[str, Any]:
    """The AsyncAPI 3.1 document (a JSON-ready dict) of ``source``'s streams, events,
    subscribers and brokers. ``events``: the Event classes to describe (default: every
    concrete Event subclass defined in the process; subscribers' events always)."""
    brokers = dict(source.brokers)
    external = dict(source.external_brokers)
    targets = {n: _Target(n, wire_of(b), False) for n, b in brokers.items()}
    targets.update({n: _Target(n, wire_of(b), True) for n, b in external.items()})
    servers = {
        _component_name(n): _server(b, targets[n].wire) for n, b in {**brokers, **external}.items()
    }

    catalog = _Catalog(targets, getattr(source, "settings", None))
    published = event_classes() if events is None else events
    sent = _sent(catalog, published, list(brokers), list(external))
    received = _received(catalog, source.subscribers)
    channels, channel_ids = _channels(catalog)

    info: dict[str, Any] = {"title": title, "version": version}
    if description:
        info["description"] = description
    document: dict[str, Any] = {
        "asyncapi": ASYNCAPI_VERSION,
        "info": info,
        "defaultContentType": "application/json",
    }
    if servers:
        document["servers"] = servers
    document["channels"] = channels
    document["operations"] = _operations(catalog, sent, received, channel_ids)
    document["components"] = {"schemas": catalog.schemas, "messages": catalog.messages}
    return document


def build_asyncapi_router(source: AsyncApiSource, dependencies: Sequence[Any] | None) -> APIRouter:
    """``GET /outbox/asyncapi.json`` behind ``dependencies`` (the dashboard's guard).
    ``None`` is refused, as for the dashboard: pass ``[]`` to serve it unguarded."""
    from fastapi import APIRouter

    if dependencies is None:
        raise exceptions.ConfigurationError(
            "outbox.asyncapi_router has no guard: pass Outbox(..., "
            "dashboard_dependencies=[Depends(require_admin)]) to protect it like the "
            "dashboard, or dashboard_dependencies=[] to serve it unguarded on purpose"
        )
    router = APIRouter(dependencies=list(dependencies))

    @router.get(
        ASYNCAPI_PATH,
        summary="AsyncAPI 3.1 document of the outbox's events",
        response_model=None,
        responses={200: {"description": "The AsyncAPI 3.1 document (JSON)."}},
    )
    async def asyncapi_document() -> dict[str, Any]:
        return build_asyncapi(source)

    return router

"""The AsyncAPI 3.0 document of an outbox: the events an app publishes and consumes.

``outbox.asyncapi()`` describes, from what the app declares and nothing else:

- a **server** per broker (protocol and host only: never a user name or a password);
- a **channel** per stream (its address is the stream name), carrying the message of every
  concrete :class:`~fastapi_outbox.events.Event` class on that stream and of every event a
  subscriber of it accepts;
- a **send operation** per stream the app publishes to, and a **receive operation** per
  subscriber (``x-group``: its consumer group, ``x-dead-letter``: its dead-letter stream);
- a **message** per event type: its payload JSON Schema from the pydantic model (nested
  models under ``components.schemas``), the headers every message carries, its ordering
  key (``x-key``), and the correlation id's location.

``build_asyncapi_router`` serves the document at ``/outbox/asyncapi.json`` behind the same
guard as the dashboard. The document is checked against the AsyncAPI 3.0.0 JSON Schema in
``tests/unit/test_asyncapi.py``.
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, Union
from urllib.parse import urlsplit

from fastapi_outbox import exceptions
from fastapi_outbox.events import (
    HEADER_CAUSATION_ID,
    HEADER_CORRELATION_ID,
    HEADER_MESSAGE_ID,
    HEADER_OCCURRED_AT,
    HEADER_TRACEPARENT,
    HEADER_TYPE,
    Event,
    Message,
)

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

ASYNCAPI_VERSION = "3.0.0"
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
}


class SubscriberLike(Protocol):
    """What the document reads of a subscriber (:class:`~fastapi_outbox.consume.subscriber.
    Subscriber`)."""

    stream: str
    group: str
    broker_name: str
    dead_letter: str
    handler: Any
    name: str


class AsyncApiSource(Protocol):
    """The port the document is built from: an :class:`~fastapi_outbox.Outbox` fits it."""

    @property
    def brokers(self) -> Mapping[str, Any]: ...

    @property
    def external_brokers(self) -> Mapping[str, Any]: ...

    @property
    def subscribers(self) -> Sequence[Any]: ...


def event_classes() -> list[type[Event]]:
    """Every concrete :class:`Event` subclass defined in this process, by type name."""
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
    handler, unions allowed); None when it takes raw :class:`Message` objects."""
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


def _server(broker: Any) -> dict[str, Any]:
    url = getattr(broker, "url", None)
    if not isinstance(url, str):
        kind = type(broker).__name__.lower()
        protocol = "memory" if "memory" in kind else kind.removesuffix("broker") or "unknown"
        return {"host": "in-process" if protocol == "memory" else "unknown", "protocol": protocol}
    first = url.split(",")[0]
    parts = urlsplit(first)
    # Host and port only: a URL's user, password and query never reach the document.
    host = parts.hostname or "localhost"
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return {"host": host, "protocol": _PROTOCOLS.get(parts.scheme, parts.scheme or "unknown")}


def _headers_schema(event: type[Event] | None) -> dict[str, Any]:
    type_property: dict[str, Any] = {"type": "string", "description": "The event type."}
    if event is not None:
        type_property["const"] = event.__outbox_type__
    return {
        "type": "object",
        "required": [HEADER_MESSAGE_ID, HEADER_TYPE, HEADER_OCCURRED_AT],
        "properties": {
            HEADER_MESSAGE_ID: {
                "type": "string",
                "format": "uuid",
                "description": "UUIDv7, time-ordered; the consumers' de-duplication key.",
            },
            HEADER_TYPE: type_property,
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
        },
        "additionalProperties": {"type": "string"},
    }


def _payload_schema(event: type[Event], schemas: dict[str, Any]) -> dict[str, Any]:
    """The model's JSON Schema with its nested models hoisted into ``schemas``."""
    schema = event.model_json_schema(ref_template="#/components/schemas/{model}")
    for name, nested in schema.pop("$defs", {}).items():
        schemas.setdefault(name, nested)
    return schema


_RAW = "RawMessage"


class _Catalog:
    """The messages of a document as they are found: their payload schemas, and which
    streams carry which of them (a message on a stream is external when any class that
    puts it there says so)."""

    def __init__(self) -> None:
        self.schemas: dict[str, Any] = {}
        self.messages: dict[str, Any] = {}
        #: stream → {message name: is external}
        self.on_streams: dict[str, dict[str, bool]] = {}

    def add(self, event: type[Event]) -> str:
        """Describe ``event`` once and put it on its stream; its message name."""
        name = _component_name(event.__outbox_type__)
        if name not in self.messages:
            self.messages[name] = self._message(event)
        assert event.__outbox_stream__ is not None
        on_stream = self.on_streams.setdefault(event.__outbox_stream__, {})
        on_stream[name] = on_stream.get(name, False) or event.__outbox_external__
        return name

    def _message(self, event: type[Event]) -> dict[str, Any]:
        schema_name = _component_name(event.__name__)
        self.schemas.setdefault(schema_name, _payload_schema(event, self.schemas))
        message: dict[str, Any] = {
            "name": event.__outbox_type__,
            "title": event.__name__,
            "contentType": "application/json",
            "payload": {"$ref": f"#/components/schemas/{schema_name}"},
            "headers": _headers_schema(event),
            "correlationId": {
                "description": "Shared by every message of one request or flow.",
                "location": f"$message.header#/{HEADER_CORRELATION_ID}",
            },
        }
        doc = inspect.getdoc(event)
        if doc and event.__doc__ and event.__doc__ is not Event.__doc__:
            message["summary"] = doc.splitlines()[0]
            message["description"] = doc
        if event.__outbox_key__ is not None:
            message["x-key"] = event.__outbox_key__
        if event.__outbox_external__:
            message["x-external"] = True
        return message

    def add_raw(self) -> None:
        """The message of a subscriber that takes raw messages: anything on its stream."""
        self.messages[_RAW] = {
            "name": _RAW,
            "title": "Any message of the stream",
            "contentType": "application/json",
            "payload": {},
            "headers": _headers_schema(None),
        }


#: A subscriber and the names of the messages it accepts (None: raw messages).
_Received = list[tuple[SubscriberLike, list[str] | None]]


def _sent(catalog: _Catalog, published: Iterable[type[Event]]) -> dict[str, list[str]]:
    """Stream → the names of the messages the app publishes to it, in first-seen order."""
    sent: dict[str, list[str]] = {}
    for event in published:
        name = catalog.add(event)
        names = sent.setdefault(event.__outbox_stream__ or "", [])
        if name not in names:
            names.append(name)
    return sent


def _received(catalog: _Catalog, subscribers: Iterable[SubscriberLike]) -> _Received:
    received: _Received = []
    for sub in subscribers:
        accepted = _accepted(sub.handler)
        names_of = None if accepted is None else [catalog.add(e) for e in accepted]
        on_stream = catalog.on_streams.setdefault(sub.stream, {})
        for name in names_of or []:
            on_stream.setdefault(name, False)  # what it receives, whatever the class says
        received.append((sub, names_of))
    if any(names is None for _, names in received):
        catalog.add_raw()
    return received


def _channels(
    catalog: _Catalog,
    received: _Received,
    internal_refs: list[dict[str, str]],
    external_refs: list[dict[str, str]],
) -> tuple[dict[str, Any], dict[str, str]]:
    """The channels, one per stream, and each stream's channel id (stream names that
    differ only in characters a component name cannot hold get distinct ids)."""
    channels: dict[str, Any] = {}
    channel_ids: dict[str, str] = {}
    for stream in sorted(catalog.on_streams):
        channel_id = _component_name(stream)
        while channel_id in channels:
            channel_id += "_"
        channel_ids[stream] = channel_id
        on_stream = catalog.on_streams[stream]
        names = list(on_stream)
        if any(accepts is None for sub, accepts in received if sub.stream == stream):
            names.append(_RAW)
        channel: dict[str, Any] = {
            "address": stream,
            "messages": {n: {"$ref": f"#/components/messages/{n}"} for n in names},
        }
        refs = list(internal_refs)
        if any(on_stream.values()):
            refs += external_refs
        if refs:
            channel["servers"] = refs
        channels[channel_id] = channel
    return channels, channel_ids


def _operations(
    sent: Mapping[str, list[str]], received: _Received, channel_ids: Mapping[str, str]
) -> dict[str, Any]:
    """A send operation per stream the app publishes to, a receive one per subscriber."""
    operations: dict[str, Any] = {}
    for stream, names in sent.items():
        channel_id = channel_ids[stream]
        operations[f"publish.{channel_id}"] = {
            "action": "send",
            "channel": {"$ref": f"#/channels/{channel_id}"},
            "summary": f"Events committed by a unit of work and relayed to {stream!r}.",
            "messages": [{"$ref": f"#/channels/{channel_id}/messages/{n}"} for n in names],
        }
    for sub, names_of in received:
        channel_id = channel_ids[sub.stream]
        names = [_RAW] if names_of is None else names_of
        operation: dict[str, Any] = {
            "action": "receive",
            "channel": {"$ref": f"#/channels/{channel_id}"},
            "summary": f"Consumer group {sub.group!r}: {sub.name}",
            "messages": [{"$ref": f"#/channels/{channel_id}/messages/{n}"} for n in names],
            "x-group": sub.group,
            "x-broker": sub.broker_name,
            "x-dead-letter": sub.dead_letter,
        }
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
    """The AsyncAPI 3.0 document (a JSON-ready dict) of ``source``'s streams, events,
    subscribers and brokers. ``events``: the Event classes to describe (default: every
    concrete Event subclass defined in the process; subscribers' events always)."""
    brokers = dict(source.brokers)
    external = dict(source.external_brokers)
    servers = {_component_name(n): _server(b) for n, b in {**brokers, **external}.items()}
    internal_refs = [{"$ref": f"#/servers/{_component_name(n)}"} for n in brokers]
    external_refs = [{"$ref": f"#/servers/{_component_name(n)}"} for n in external]

    catalog = _Catalog()
    sent = _sent(catalog, event_classes() if events is None else events)
    received = _received(catalog, source.subscribers)
    channels, channel_ids = _channels(catalog, received, internal_refs, external_refs)

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
    document["operations"] = _operations(sent, received, channel_ids)
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
        summary="AsyncAPI 3.0 document of the outbox's events",
        response_model=None,
        responses={200: {"description": "The AsyncAPI 3.0 document (JSON)."}},
    )
    async def asyncapi_document() -> dict[str, Any]:
        return build_asyncapi(source)

    return router

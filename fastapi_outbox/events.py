"""Domain events, the explicit ``Message``, the broker ``Envelope`` and ``MessageStatus``.

``Event`` subclasses declare where they go with class keywords::

    class OrderPlaced(Event, stream="orders", key="order_id"):
        order_id: int

``Envelope`` is what a broker publishes: the row's id (de-duplication), the stream, the
event type, the ordering key, the payload as encoded JSON bytes and string headers.
"""

from __future__ import annotations

import enum
import json
import os
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from fastapi_outbox import exceptions

__all__ = [
    "HEADER_CAUSATION_ID",
    "HEADER_CORRELATION_ID",
    "HEADER_ENCRYPTED_HEADERS",
    "HEADER_ENCRYPTION_KEY_ID",
    "HEADER_MESSAGE_ID",
    "HEADER_OCCURRED_AT",
    "HEADER_TRACEPARENT",
    "HEADER_TYPE",
    "Envelope",
    "Event",
    "Message",
    "MessageStatus",
    "uuid7",
]

HEADER_MESSAGE_ID = "message-id"
HEADER_TYPE = "type"
HEADER_OCCURRED_AT = "occurred-at"
HEADER_CORRELATION_ID = "correlation-id"
HEADER_CAUSATION_ID = "causation-id"
HEADER_TRACEPARENT = "traceparent"
HEADER_TRACESTATE = "tracestate"
#: The tenant a message belongs to (multi-tenant outboxes: ``Outbox(tenants=...)``).
HEADER_TENANT = "tenant"
#: The key id an encrypted payload was sealed with (fastapi_outbox.payloads.encryption).
HEADER_ENCRYPTION_KEY_ID = "encryption-key-id"
#: The sealed ``encrypted_headers`` of an encrypted message.
HEADER_ENCRYPTED_HEADERS = "encrypted-headers"
# The message-id in headers JSON (ours, or PostgreSQL's JSONB rendering of it), read as a
# *key*: right after `{` or `,`. Inside a JSON string a quote is escaped as \", so neither a
# value nor another key (`"\"message-id"`, which contains `"message-id":"`) can fake it;
# header names are also restricted to HTTP tokens (unit_of_work), which have no quote.
_MESSAGE_ID = re.compile(r'[{,]\s*"message-id":\s*"([^"]+)"')
#: Headers that stay inside the organisation: not sent to external brokers.
INTERNAL_HEADERS = frozenset(
    {HEADER_CORRELATION_ID, HEADER_CAUSATION_ID, HEADER_TRACEPARENT, HEADER_TRACESTATE}
)


class MessageStatus(enum.StrEnum):
    """Lifecycle of an outbox row (the state machine: docs/explanation/how-it-works.md)."""

    PENDING = "pending"
    PROCESSING = "processing"
    PUBLISHED = "published"
    FAILED = "failed"
    ABANDONED = "abandoned"


_uuid7_lock = threading.Lock()
_uuid7_last = 0


def uuid7() -> uuid.UUID:
    """A time-ordered UUID (RFC 9562 version 7), strictly increasing within this process.

    48 bits of Unix milliseconds, then 74 random bits; the 12-bit ``rand_a`` field carries
    on from the previous id when two ids fall in the same millisecond (method 3 of the RFC),
    so ids made by one process sort in creation order.
    """
    global _uuid7_last
    ms = time.time_ns() // 1_000_000
    rand = int.from_bytes(os.urandom(10), "big")
    with _uuid7_lock:
        candidate = (ms << 12) | (rand >> 68)
        if candidate <= _uuid7_last:
            candidate = _uuid7_last + 1
        _uuid7_last = candidate
    value = (candidate >> 12) << 80  # unix_ts_ms
    value |= 0x7 << 76  # version
    value |= (candidate & 0xFFF) << 64  # rand_a / counter
    value |= 0b10 << 62  # variant
    value |= rand & ((1 << 62) - 1)  # rand_b
    return uuid.UUID(int=value)


class Event(BaseModel):
    """Base class of domain events: a pydantic model that knows its stream.

    Class keywords: ``stream`` (required: topic / stream / subject), ``key`` (name of the
    field used as ordering key, optional), ``external`` (also publish to the external
    brokers), ``type_name`` (event type, defaults to the class name) and ``abstract``
    (an intermediate base class without a stream).
    """

    model_config = ConfigDict(frozen=True)

    __outbox_stream__: ClassVar[str | None] = None
    __outbox_key__: ClassVar[str | None] = None
    __outbox_external__: ClassVar[bool] = False
    __outbox_type__: ClassVar[str] = "Event"
    __outbox_abstract__: ClassVar[bool] = True

    def __init_subclass__(
        cls,
        *,
        stream: str | None = None,
        key: str | None = None,
        external: bool | None = None,
        type_name: str | None = None,
        abstract: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init_subclass__(**kwargs)
        if stream is not None:
            if not isinstance(stream, str) or not stream.strip():
                raise exceptions.EventDefinitionError(
                    f"{cls.__qualname__}: stream must be a non-empty string, got {stream!r}"
                )
            cls.__outbox_stream__ = stream
        if key is not None:
            cls.__outbox_key__ = key
        if external is not None:
            cls.__outbox_external__ = bool(external)
        cls.__outbox_type__ = type_name or cls.__name__
        cls.__outbox_abstract__ = abstract
        if not abstract and cls.__outbox_stream__ is None:
            raise exceptions.EventDefinitionError(
                f"{cls.__qualname__} has no stream: declare it as "
                f"`class {cls.__name__}(Event, stream='...')` "
                "(or pass abstract=True for a base class)"
            )

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        key = cls.__outbox_key__
        if key is not None and key not in cls.model_fields:
            raise exceptions.EventDefinitionError(
                f"{cls.__qualname__}: key={key!r} names no field of the event "
                f"(fields: {', '.join(cls.model_fields) or 'none'})"
            )

    def to_message(self) -> Message:
        """The explicit message this event becomes."""
        if self.__outbox_abstract__:
            raise exceptions.EventDefinitionError(
                f"{type(self).__qualname__} is abstract (no stream): publish a concrete subclass"
            )
        payload = self.model_dump(mode="json")
        key_field = self.__outbox_key__
        key = None if key_field is None else payload.get(key_field)
        assert self.__outbox_stream__ is not None
        return Message(
            stream=self.__outbox_stream__,
            type=self.__outbox_type__,
            payload=payload,
            key=None if key is None else str(key),
            external=self.__outbox_external__,
        )


@dataclass(slots=True)
class Message:
    """An explicit message for ``uow.publish``: stream, type, JSON payload, key, headers."""

    stream: str
    type: str
    payload: dict[str, Any]
    key: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    external: bool = False


class Envelope:
    """What a broker publishes; built by the relay from a claimed outbox row.

    ``id`` is the outbox row id (unique per target broker) and serves as the de-duplication
    id; ``headers`` holds ``message-id``, ``type``, ``occurred-at`` and friends. The
    relay passes the headers as the JSON text stored in the table (``headers_json``)
    and they are decoded only when a broker asks for the dict: the Redis broker sends the
    text as it is, so a message costs no JSON decode and re-encode on its way through.
    """

    __slots__ = ("_headers", "_headers_json", "id", "key", "payload", "stream", "type")

    def __init__(
        self,
        id: str,
        stream: str,
        type: str,
        key: str | None,
        payload: bytes,
        headers: dict[str, str] | None = None,
        *,
        headers_json: str | None = None,
    ) -> None:
        self.id = id
        self.stream = stream
        self.type = type
        self.key = key
        self.payload = payload
        self._headers = headers
        self._headers_json = headers_json
        if headers is None and headers_json is None:
            self._headers = {}

    @property
    def headers(self) -> dict[str, str]:
        if self._headers is None:
            self._headers = json.loads(self._headers_json or "{}")
        return self._headers

    @headers.setter
    def headers(self, value: dict[str, str]) -> None:
        self._headers, self._headers_json = value, None

    def headers_dict(self) -> dict[str, str]:
        """A new dict of the headers, the caller's to change: decoded from the JSON text
        when the headers are still text (nothing cached, nothing copied twice)."""
        if self._headers is None:
            decoded: dict[str, str] = json.loads(self._headers_json or "{}")
            return decoded
        return dict(self._headers)

    @property
    def headers_json(self) -> str:
        """The headers as compact JSON text."""
        if self._headers_json is None:
            self._headers_json = json.dumps(self.headers, separators=(",", ":"))
        return self._headers_json

    @property
    def message_id(self) -> str:
        """The ``message-id`` header (the event's id, shared by its internal and external
        rows), read without decoding all headers when they are still JSON text."""
        if self._headers is None and self._headers_json is not None:
            match = _MESSAGE_ID.search(self._headers_json)
            if match is not None:
                return match.group(1)
        return self.headers.get(HEADER_MESSAGE_ID, self.id)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Envelope):
            return NotImplemented
        return (self.id, self.stream, self.type, self.key, self.payload, self.headers) == (
            other.id,
            other.stream,
            other.type,
            other.key,
            other.payload,
            other.headers,
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (
            f"Envelope(id={self.id!r}, stream={self.stream!r}, type={self.type!r}, "
            f"key={self.key!r}, payload={len(self.payload)} bytes)"
        )

    def json(self) -> Any:
        """The payload, decoded."""
        return json.loads(self.payload)


# -- text every database can commit ----------------------------------------------------------


def _unstorable(value: str) -> str | None:
    """What in ``value`` no database can commit (None: nothing)."""
    if "\x00" in value:
        return "a NUL character (U+0000), which PostgreSQL cannot store in text or JSON"
    if not value.isascii():
        try:
            value.encode()
        except UnicodeEncodeError as exc:
            bad = ord(value[exc.start])
            return f"an unpaired surrogate (U+{bad:04X}), which is not Unicode text"
    return None


def _refuse(field: str, problem: str, stream: str, type_name: str) -> None:
    raise exceptions.UnstorableText(
        f"{type_name} on stream {stream!r}: {field} holds {problem}; nothing was written "
        "(remove the character, or encode binary data, e.g. as base64)",
        field=field,
    )


def check_text(value: object, field: str, stream: str, type_name: str) -> None:
    if isinstance(value, str):
        problem = _unstorable(value)
        if problem is not None:
            _refuse(field, problem, stream, type_name)


def payload_of(event: Event | Message) -> Any:
    return event.model_dump() if isinstance(event, Event) else event.payload


def refuse_unstorable(payload: Any, stream: str, type_name: str) -> None:
    """Raise [`UnstorableText`][fastapi_outbox.exceptions.UnstorableText] naming the first string of
    ``payload`` (keys included)
    that cannot be committed; return when there is none (the cheap check's false alarm, e.g.
    an escaped backslash before ``u0000``). Only runs once the cheap check has fired."""
    stack: list[tuple[str, Any]] = [("payload", payload)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            check_text(value, path, stream, type_name)
        elif isinstance(value, dict):
            for name in value:
                if isinstance(name, str):
                    problem = _unstorable(name)
                    if problem is not None:
                        _refuse(f"key {name!r} of {path}", problem, stream, type_name)
            for name, item in reversed(value.items()):
                part = name.isidentifier() if isinstance(name, str) else False
                stack.append((f"{path}.{name}" if part else f"{path}[{name!r}]", item))
        elif isinstance(value, list | tuple):
            for index in range(len(value) - 1, -1, -1):
                stack.append((f"{path}[{index}]", value[index]))


def check_storable(event: Event | Message) -> None:
    """Refuse ([`UnstorableText`][fastapi_outbox.exceptions.UnstorableText]) an event whose stream,
    type, key, headers or payload hold a character no database can commit; for events
    that wait on an aggregate, so the mistake surfaces at ``raise_event``, not at commit.
    ``publish()`` makes the same checks on the text it encodes anyway."""
    if isinstance(event, Event):
        stream, type_name = event.__outbox_stream__ or "", event.__outbox_type__
        key_field = event.__outbox_key__
        key = None if key_field is None else getattr(event, key_field)
        headers: dict[str, str] = {}
    else:
        stream, type_name, key, headers = event.stream, event.type, event.key, event.headers
    check_text(stream, "stream", stream, type_name)
    check_text(type_name, "type", stream, type_name)
    check_text(key, "key", stream, type_name)
    for name, value in headers.items():
        check_text(name, f"the name of header {name!r}", stream, type_name)
        check_text(value, f"headers[{name!r}]", stream, type_name)
    refuse_unstorable(payload_of(event), stream, type_name)

"""What the Redis publisher and consumer agree on about Redis itself: the fields of a
published entry, which reply errors are broker-wide refusals (an outage of the broker,
not a fault of a message) and which failures mean Redis cannot be reached: the one
outage classifier of Redis."""

from __future__ import annotations

import json
from typing import Any

from fastapi_outbox.brokers import cloudevents
from fastapi_outbox.brokers.cloudevents import CloudEventsOptions
from fastapi_outbox.brokers.consumer import Delivery, parse_headers
from fastapi_outbox.events import Envelope

__all__ = [
    "PUBLISHED_FIELDS",
    "REFUSAL_CODES",
    "decode_entry",
    "entry_fields",
    "entry_values",
    "is_unreachable",
    "refusal_code",
    "reply_entries",
    "text",
]

#: The fields of an entry, in the order the publisher writes them.
PUBLISHED_FIELDS = (b"id", b"type", b"key", b"headers", b"payload")
_PUBLISHED = list(PUBLISHED_FIELDS)

#: Error codes with which Redis refuses *every* write for a reason of its own: out of
#: memory, a read-only replica (after a failover), a failed RDB save (``MISCONF``), a
#: dataset still loading, a busy script, a cluster without quorum or mid-resharding. They
#: are outages of the broker, not faults of a message: the processor backs off as a whole
#: and no attempt is charged.
REFUSAL_CODES = frozenset(
    {
        "OOM",
        "READONLY",
        "MISCONF",
        "LOADING",
        "BUSY",
        "CLUSTERDOWN",
        "TRYAGAIN",
        "MASTERDOWN",
        "NOREPLICAS",
        "NOTREADY",
    }
)


def refusal_code(error: BaseException | str) -> str | None:
    """The code of a broker-wide refusal in ``error``, else None: the one place where
    Redis errors are told apart. ``error`` is a reply error from redis-py (which strips
    known codes from the text into ``status_code``) or the ``"!<error>"`` text the
    publish script returns for an XADD that Redis refused."""
    code = getattr(error, "status_code", None)
    if not code:
        text = str(error).lstrip("!").lstrip()
        code = text.split(" ", 1)[0]
    code = str(code)  # Redis error codes are upper case: "oom" in a text is not one
    return code if code in REFUSAL_CODES else None


def is_unreachable(error: BaseException) -> bool:
    """Whether ``error`` (raised by redis-py or returned in a pipeline's replies) means
    Redis cannot be reached: a connection failure or a timeout, not a reply."""
    import redis.exceptions as rexc

    return isinstance(error, rexc.ConnectionError | rexc.TimeoutError | OSError)


def entry_values(e: Envelope, envelope_format: CloudEventsOptions | None = None) -> list[Any]:
    """The values of ``e``'s entry, in the order of :data:`PUBLISHED_FIELDS`: message id,
    type, ordering key ("" for none), headers as JSON text (as stored, not re-encoded),
    payload. With CloudEvents (``envelope_format``) the headers are the CloudEvent's
    (binary: ``ce-*`` and ``content-type``; structured: ``content-type``) and the payload
    its body."""
    if envelope_format is not None and envelope_format.enabled:
        headers, body = cloudevents.encode(e, envelope_format.source, envelope_format.mode)
        return [e.message_id, e.type, e.key or "", json.dumps(headers), body]
    return [e.message_id, e.type, e.key or "", e.headers_json, e.payload]


def entry_fields(e: Envelope, envelope_format: CloudEventsOptions | None = None) -> list[Any]:
    """``e``'s entry as the ``field, value, …`` arguments of an ``XADD``."""
    values = entry_values(e, envelope_format)
    return [part for pair in zip(PUBLISHED_FIELDS, values, strict=True) for part in pair]


def text(value: Any) -> str:
    """A field name or value as text: bytes from our clients, str from a client made with
    ``decode_responses=True``."""
    return value.decode() if isinstance(value, bytes) else str(value)


def reply_entries(reply: Any) -> list[Any]:
    """The ``[entry id, [field, value, …]]`` entries of a raw ``XREADGROUP`` reply: a map
    stream → entries (RESP3) or a list of ``[stream, entries]`` pairs (RESP2)."""
    if not reply:
        return []
    if isinstance(reply, dict):
        return [e for entries in reply.values() for e in entries]
    return [e for _stream, entries in reply for e in entries]


def _maybe_cloudevent(raw_headers: Any) -> bool:
    """Whether an entry's ``headers`` text may hold a CloudEvent's headers: a cheap
    substring test on the fast path, confirmed by :func:`_cloudevent`."""
    if not raw_headers:
        return False
    raw = raw_headers if isinstance(raw_headers, bytes) else str(raw_headers).encode()
    return b"ce-specversion" in raw or b"application/cloudevents" in raw


def _cloudevent(stream: str, entry: str, named: dict[str, Any], attempt: int) -> Delivery | None:
    """The delivery of an entry that holds a CloudEvent, else None. The CloudEvent's
    headers are the ``headers`` field (JSON, as our publisher writes them) or, from a
    producer that writes one field per header, the entry's other fields; its body is
    the ``payload`` field (or ``data``)."""
    raw_headers = named.get("headers")
    if raw_headers:
        if not _maybe_cloudevent(raw_headers):
            return None
        headers: dict[str, Any] = parse_headers(raw_headers)
    else:
        headers = {
            name: text(value)
            for name, value in named.items()
            if name not in ("payload", "data", "key")
        }
    body = named.get("payload", named.get("data", b""))
    key = named.get("key")
    return cloudevents.as_delivery(
        headers,
        body if isinstance(body, bytes) else str(body).encode(),
        stream=stream,
        entry_id=entry,
        attempt=attempt,
        key=text(key) if key else None,
    )


def decode_entry(stream: str, entry_id: Any, fields: Any, attempt: int) -> Delivery:
    """The delivery of entry ``entry_id`` of ``stream``: ``fields`` as a raw reply's flat
    ``[field, value, …]`` list (the fast path when in the order the publisher writes them)
    or a mapping. An entry another writer added takes its message id and type from its
    ``headers`` (``message-id``, ``type``), else the entry id and ""."""
    if isinstance(fields, list):  # a raw reply's flat [field, value, …]
        if fields[::2] == _PUBLISHED:  # as the publish script writes them
            message_id, type_, key, raw_headers, payload = fields[1::2]
            if (
                message_id
                and type_
                and isinstance(payload, bytes)
                and not _maybe_cloudevent(raw_headers)
            ):
                return Delivery(
                    stream=stream,
                    entry_id=entry_id.decode(),
                    message_id=message_id.decode(),
                    type=type_.decode(),
                    key=key.decode() if key else None,
                    raw_headers=raw_headers,
                    payload=payload,
                    attempt=attempt,
                )
        if len(fields) % 2:
            raise ValueError(
                f"Redis entry {text(entry_id)} of stream {stream!r}: fields and values do "
                f"not pair up ({len(fields)} items)"
            )
        pairs = iter(fields)
        fields = dict(zip(pairs, pairs, strict=True))
    # Field names as text: bytes from our clients, str from a client the application
    # made with decode_responses=True.
    named = {text(k): v for k, v in fields.items()}
    get = named.get
    entry = text(entry_id)
    event = _cloudevent(stream, entry, named, attempt)
    if event is not None:
        return event
    raw_headers = get("headers")
    message_id = get("id")
    type_ = get("type")
    headers = None
    if not message_id or not type_:  # not written by our publisher: from the headers
        headers = parse_headers(raw_headers)
        message_id = message_id or headers.get("message-id") or entry
        type_ = type_ or headers.get("type") or ""
    payload = get("payload", b"")
    key = get("key")
    return Delivery(
        stream=stream,
        entry_id=entry,
        message_id=text(message_id),
        type=text(type_),
        key=text(key) if key else None,
        headers=headers,
        raw_headers=raw_headers,
        payload=payload if isinstance(payload, bytes) else str(payload).encode(),
        attempt=attempt,
    )

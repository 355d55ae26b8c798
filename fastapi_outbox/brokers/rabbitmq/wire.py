"""What the RabbitMQ publisher and consumer agree on about AMQP: how an envelope becomes an
AMQP message (properties, headers, body), how a delivery is read back, the names of the
queues a group uses, and which errors are outages of the broker rather than faults of a
message (`outage`, the one place where RabbitMQ errors are told apart).

A message carries:

* body: the JSON payload (``content_type`` ``application/json``), ``delivery_mode`` 2
  (persistent);
* properties: ``message_id`` (the event's message id), ``type``, ``timestamp`` (from
  ``occurred-at``), ``correlation_id``;
* headers: the envelope's headers (``message-id``, ``type``, ``occurred-at``, the user's
  own...) as AMQP strings, and the ordering key in a ``key`` header, as on NATS.

RabbitMQ adds headers of its own to a delivery (``x-delivery-count`` on quorum queues,
``x-death`` after a dead-letter exchange): they are read, never handed to a handler.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from fastapi_outbox import exceptions
from fastapi_outbox.brokers import cloudevents
from fastapi_outbox.brokers.cloudevents import CloudEventsOptions
from fastapi_outbox.events import (
    HEADER_CORRELATION_ID,
    HEADER_MESSAGE_ID,
    HEADER_OCCURRED_AT,
    HEADER_TYPE,
    Envelope,
)
from fastapi_outbox.redaction import redact_url

__all__ = [
    "BROKER_HEADERS",
    "CONTENT_TYPE",
    "DELIVERY_COUNT_HEADER",
    "KEY_HEADER",
    "QUEUE_TEMPLATE",
    "cloudevent_headers",
    "cloudevent_message",
    "delivery_attempt",
    "header_problem",
    "message_headers",
    "message_identity",
    "outage",
    "queue_name",
    "user_headers",
]

#: The content type of a native message's body.
CONTENT_TYPE = "application/json"
#: Header carrying the envelope's ordering key (as on NATS; Redis carries it as a field).
KEY_HEADER = "key"
#: The quorum queue's count of earlier deliveries of a message (0 on the first).
DELIVERY_COUNT_HEADER = "x-delivery-count"
#: Headers RabbitMQ itself adds to a delivery: never the user's.
BROKER_HEADERS = frozenset(
    {
        DELIVERY_COUNT_HEADER,
        "x-death",
        "x-first-death-exchange",
        "x-first-death-queue",
        "x-first-death-reason",
        "x-last-death-exchange",
        "x-last-death-queue",
        "x-last-death-reason",
    }
)
#: The durable quorum queue of a (stream, group): a group name has no dot, so two
#: (stream, group) pairs never share a name.
QUEUE_TEMPLATE = "{stream}.{group}"
#: AMQP short strings (header names, routing keys) hold at most 255 bytes.
SHORTSTR_MAX = 255


def queue_name(template: str, stream: str, group: str) -> str:
    """The queue of (``stream``, ``group``): ``template`` filled in."""
    return template.format(stream=stream, group=group)


def header_problem(headers: dict[str, Any], routing_key: str) -> str | None:
    """Why AMQP cannot carry a message with these header names and this routing key, else
    None: a header name or routing key longer than an AMQP short string (255 bytes)."""
    if len(routing_key.encode()) > SHORTSTR_MAX:
        return f"stream name longer than {SHORTSTR_MAX} bytes: not an AMQP routing key"
    for name in headers:
        if len(name.encode()) > SHORTSTR_MAX:
            return f"header name {name[:40]!r}... longer than {SHORTSTR_MAX} bytes"
    return None


def _timestamp(headers: dict[str, str]) -> dt.datetime | None:
    text = headers.get(HEADER_OCCURRED_AT)
    if not text:
        return None
    try:
        return dt.datetime.fromisoformat(text)
    except ValueError:
        return None


def message_headers(e: Envelope) -> tuple[dict[str, Any], dict[str, Any]]:
    """(AMQP headers, the other properties) of ``e``: its headers plus the key, and
    ``message_id``, ``type``, ``timestamp``, ``correlation_id``."""
    headers: dict[str, Any] = e.headers_dict()
    if e.key is not None:
        headers[KEY_HEADER] = e.key  # the ordering key; last, so no user header replaces it
    properties = {
        "message_id": e.message_id,
        "message_type": e.type,
        "timestamp": _timestamp(headers),
        "correlation_id": headers.get(HEADER_CORRELATION_ID),
    }
    return headers, properties


def cloudevent_message(
    e: Envelope, options: CloudEventsOptions
) -> tuple[dict[str, Any], str, bytes]:
    """(AMQP headers, ``content_type``, body) of ``e`` as a CloudEvent, per the RabbitMQ
    (AMQP 0-9-1) protocol binding: binary mode puts the attributes in ``ce-*`` headers and
    ``datacontenttype`` in ``content_type``; structured mode sends the whole event as an
    ``application/cloudevents+json`` body. The properties stay those of
    `message_headers` (``message_id``, ``type``, ``timestamp``…)."""
    headers, body = cloudevents.encode(e, options.source, options.mode)
    content_type = headers.pop("content-type")
    return dict(headers), content_type, body


def cloudevent_headers(raw: dict[str, Any], content_type: str | None) -> dict[str, Any] | None:
    """The headers to read a delivery as a CloudEvent from (its AMQP headers and its
    ``content_type`` as ``content-type``) when it is one, in either mode and from any
    producer, else None."""
    structured = bool(content_type) and str(content_type).startswith("application/cloudevents")
    if not structured and not cloudevents.is_cloudevent(raw):
        return None  # the common case: no copy of the headers
    return {**raw, "content-type": content_type} if content_type else raw


def user_headers(raw: dict[str, Any] | None) -> dict[str, str]:
    """The message's own headers from a delivery's: without the key and what RabbitMQ adds;
    values as text."""
    out: dict[str, str] = {}
    for name, value in (raw or {}).items():
        if name == KEY_HEADER or name in BROKER_HEADERS:
            continue
        out[name] = value.decode() if isinstance(value, bytes) else str(value)
    return out


def delivery_attempt(raw: dict[str, Any] | None) -> int:
    """The delivery's attempt (1 on the first) from the quorum queue's ``x-delivery-count``
    (absent or 0 on the first delivery)."""
    count = (raw or {}).get(DELIVERY_COUNT_HEADER)
    try:
        return int(count or 0) + 1
    except (TypeError, ValueError):
        return 1


def message_identity(raw: dict[str, Any] | None, message_id: str | None) -> tuple[str, str]:
    """(message id, type) of a delivery: the headers the publish side writes, else the
    AMQP properties."""
    headers = raw or {}
    mid = headers.get(HEADER_MESSAGE_ID) or message_id or ""
    type_ = headers.get(HEADER_TYPE) or ""
    return (
        mid.decode() if isinstance(mid, bytes) else str(mid),
        type_.decode() if isinstance(type_, bytes) else str(type_),
    )


def outage(error: BaseException, url: str, *, blocked: str | None = None) -> Exception | None:
    """The exception to raise when ``error`` is an outage of the broker, else None (a fault
    of the message: the caller fails that message alone).

    * the connection blocked by a memory or disk alarm (``blocked``: the reason RabbitMQ
      gave) → [`BrokerRefusing`][fastapi_outbox.BrokerRefusing];
    * a connection that is lost, refused or closed by the server, a closed channel, a
      channel in an invalid state, a socket error →
      [`BrokerUnavailable`][fastapi_outbox.BrokerUnavailable];
    * a timeout → [`BrokerTimeout`][fastapi_outbox.exceptions.BrokerTimeout] (the relay pings to
    tell an outage from a
      message that hangs);
    * the login refused (``ACCESS_REFUSED``) →
    [`AuthenticationFailed`][fastapi_outbox.AuthenticationFailed].
    """
    import aiormq.exceptions as amqp

    where = f"RabbitMQ at {redact_url(url)}"
    if blocked is not None:
        return exceptions.BrokerRefusing(f"{where} blocks publishing (alarm: {blocked})")
    if isinstance(error, exceptions.BrokerUnavailable):
        return error
    detail = f"{type(error).__name__}: {error}"
    if isinstance(error, TimeoutError):
        return exceptions.BrokerTimeout(f"{where} did not answer in time: {detail}")
    if isinstance(error, amqp.ProbableAuthenticationError | amqp.AuthenticationError):
        # ACCESS_REFUSED at login (a wrong user or password) or a vhost the user may not
        # open: only an operator cures it; said as it is, not "unreachable".
        return exceptions.AuthenticationFailed(
            f"{where}: authentication failed ({detail}): check the user and password "
            "(and the vhost's permissions) of the URL"
        )
    if isinstance(error, amqp.ChannelClosed):
        # A channel the server closed (404 no such exchange or queue, 406 precondition
        # failed, a queue deleted under its consumer): the connection stands; the next
        # call opens a new channel and declares the exchange again.
        return exceptions.BrokerUnavailable(f"{where} closed the channel: {detail}")
    if isinstance(
        error,
        amqp.AMQPConnectionError | amqp.ChannelInvalidStateError | ConnectionError | OSError,
    ):
        return exceptions.BrokerUnavailable(f"{where} is unreachable: {detail}")
    return None

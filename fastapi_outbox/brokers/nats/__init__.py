"""NATS JetStream: ``NatsJetStreamBroker`` publishes with ``Nats-Msg-Id`` de-duplication and
consumes with durable pull consumers.

The package holds ``connection`` (``NatsConnection``: the client, the JetStream context, the
command buffer, the streams), ``wire`` (headers, ``HPUB`` blocks, reply and message
decoding, the refusal classifier), ``publisher`` and ``consumer``, which each receive the
connection and never import each other; ``broker`` composes them. This module re-exports
what ``fastapi_outbox.brokers.nats`` always offered.
"""

from __future__ import annotations

from fastapi_outbox.brokers.nats.broker import (
    NatsJetStreamBroker,
)
from fastapi_outbox.brokers.nats.connection import (
    ACK_TIMEOUT_SECONDS,
    CONNECT_TIMEOUT_SECONDS,
    DEDUP_WINDOW_SECONDS,
    JS_API_INFO,
    STREAM_MAX_AGE_SECONDS,
    STREAM_MAX_BYTES,
)
from fastapi_outbox.brokers.nats.wire import (
    KEY_HEADER,
    MSG_ID_HEADER,
    NO_RESPONDERS_STATUS,
    REFUSAL_ERR_CODES,
    refusal_reason,
    stream_name_for,
)

__all__ = [
    "ACK_TIMEOUT_SECONDS",
    "CONNECT_TIMEOUT_SECONDS",
    "DEDUP_WINDOW_SECONDS",
    "JS_API_INFO",
    "KEY_HEADER",
    "MSG_ID_HEADER",
    "NO_RESPONDERS_STATUS",
    "REFUSAL_ERR_CODES",
    "STREAM_MAX_AGE_SECONDS",
    "STREAM_MAX_BYTES",
    "NatsJetStreamBroker",
    "refusal_reason",
    "stream_name_for",
]

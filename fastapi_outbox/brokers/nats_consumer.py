"""Canonical: fastapi_outbox.brokers.nats.consumer (this path re-exports its public names)."""

from __future__ import annotations

from fastapi_outbox.brokers.nats.consumer import (
    API_TIMEOUT_SECONDS,
    DEAD_LETTER_SCAN,
    NatsJetStreamConsumer,
    durable_name,
)

__all__ = [
    "API_TIMEOUT_SECONDS",
    "DEAD_LETTER_SCAN",
    "NatsJetStreamConsumer",
    "durable_name",
]

"""Canonical: fastapi_outbox.brokers.redis.consumer (this path re-exports its public names)."""

from __future__ import annotations

from fastapi_outbox.brokers.redis.consumer import (
    AUTOCLAIM_COUNT,
    DEAD_LETTER_SCAN,
    DEAD_LETTER_SCRIPT,
    RedisStreamsConsumer,
    trimmed_unread,
)

__all__ = [
    "AUTOCLAIM_COUNT",
    "DEAD_LETTER_SCAN",
    "DEAD_LETTER_SCRIPT",
    "RedisStreamsConsumer",
    "trimmed_unread",
]

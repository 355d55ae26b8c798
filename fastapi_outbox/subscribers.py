"""Canonical: fastapi_outbox.consume.subscriber (this path re-exports its public names)."""

from __future__ import annotations

from fastapi_outbox.consume.subscriber import (
    DEAD_LETTER_TEMPLATE,
    BatchUnitOfWork,
    ConsumerStatus,
    Subscriber,
    SubscriberStats,
)

__all__ = [
    "DEAD_LETTER_TEMPLATE",
    "BatchUnitOfWork",
    "ConsumerStatus",
    "Subscriber",
    "SubscriberStats",
]

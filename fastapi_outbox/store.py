"""Canonical: fastapi_outbox.storage.store (this path re-exports its public names)."""

from __future__ import annotations

from fastapi_outbox.storage.store import (
    ABANDONED,
    ERROR_MAX_CHARS,
    FAILED,
    INSERT_KEYS,
    PENDING,
    PROCESSING,
    PUBLISHED,
    BrokerStats,
    ClaimedRow,
    Failure,
    Store,
)

__all__ = [
    "ABANDONED",
    "ERROR_MAX_CHARS",
    "FAILED",
    "INSERT_KEYS",
    "PENDING",
    "PROCESSING",
    "PUBLISHED",
    "BrokerStats",
    "ClaimedRow",
    "Failure",
    "Store",
]

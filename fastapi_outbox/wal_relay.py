"""Canonical: fastapi_outbox.relay.wal (this path re-exports its public names)."""

from __future__ import annotations

from fastapi_outbox.relay.loop import DB_BACKOFF_MAX_SECONDS, DB_BACKOFF_MIN_SECONDS
from fastapi_outbox.relay.wal import (
    SLOT_IN_USE,
    SLOT_IN_USE_PAUSE_SECONDS,
    TIMEOUT_MARGIN_SECONDS,
    WalRelay,
)

__all__ = [
    "DB_BACKOFF_MAX_SECONDS",
    "DB_BACKOFF_MIN_SECONDS",
    "SLOT_IN_USE",
    "SLOT_IN_USE_PAUSE_SECONDS",
    "TIMEOUT_MARGIN_SECONDS",
    "WalRelay",
]

"""Canonical: fastapi_outbox.relay.table (this path re-exports its public names)."""

from __future__ import annotations

from fastapi_outbox.relay.loop import DB_BACKOFF_MAX_SECONDS, DB_BACKOFF_MIN_SECONDS
from fastapi_outbox.relay.table import (
    PROBE_TIMEOUT_SECONDS,
    RELEASE_TIMEOUT_SECONDS,
    Processor,
    instance_id,
    process_batch,
    retry_delay,
)

__all__ = [
    "DB_BACKOFF_MAX_SECONDS",
    "DB_BACKOFF_MIN_SECONDS",
    "PROBE_TIMEOUT_SECONDS",
    "RELEASE_TIMEOUT_SECONDS",
    "Processor",
    "instance_id",
    "process_batch",
    "retry_delay",
]

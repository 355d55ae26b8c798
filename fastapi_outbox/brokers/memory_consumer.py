"""Canonical: fastapi_outbox.brokers.memory.consumer (this path re-exports its public names)."""

from __future__ import annotations

from fastapi_outbox.brokers.memory.consumer import (
    MemoryConsumer,
)

__all__ = [
    "MemoryConsumer",
]

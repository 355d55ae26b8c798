"""Canonical: fastapi_outbox.storage.clock (this path re-exports its public names)."""

from __future__ import annotations

from fastapi_outbox.storage.clock import (
    age_seconds,
    db_later,
    db_now,
    seconds_modifier,
    utcnow,
    wall,
)

__all__ = ["age_seconds", "db_later", "db_now", "seconds_modifier", "utcnow", "wall"]

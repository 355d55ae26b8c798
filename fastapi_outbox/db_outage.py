"""Canonical: fastapi_outbox.storage.db_outage (this path re-exports its public names)."""

from __future__ import annotations

from fastapi_outbox.storage.db_outage import (
    PING_SECONDS,
    Verdict,
    classify,
    classify_postgresql,
    classify_sqlite,
    database_answers,
    is_outage,
    sqlstate_of,
)

__all__ = [
    "PING_SECONDS",
    "Verdict",
    "classify",
    "classify_postgresql",
    "classify_sqlite",
    "database_answers",
    "is_outage",
    "sqlstate_of",
]

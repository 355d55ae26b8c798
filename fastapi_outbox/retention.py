"""Canonical: fastapi_outbox.lifecycle.retention (this path re-exports its public names)."""

from __future__ import annotations

from fastapi_outbox.lifecycle.retention import BATCH_PAUSE_SECONDS, Cleaner, purge

__all__ = ["BATCH_PAUSE_SECONDS", "Cleaner", "purge"]

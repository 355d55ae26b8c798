"""Canonical: fastapi_outbox.storage.schema (this path re-exports its public names)."""

from __future__ import annotations

from fastapi_outbox.storage.schema import build_table, ddl, metadata, outbox_table

__all__ = ["build_table", "ddl", "metadata", "outbox_table"]

"""Canonical: fastapi_outbox.write.wal_capture (this path re-exports its public names)."""

from __future__ import annotations

from fastapi_outbox.write.wal_capture import WalCapture

__all__ = ["WalCapture"]

"""Canonical: fastapi_outbox.write.capture (this path re-exports its public names)."""

from __future__ import annotations

from fastapi_outbox.write.capture import Capture, TableCapture

__all__ = ["Capture", "TableCapture"]

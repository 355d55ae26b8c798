"""Canonical: fastapi_outbox.relay.loop (this path re-exports its public names)."""

from __future__ import annotations

from fastapi_outbox.relay.loop import RelayLoop

__all__ = ["RelayLoop"]

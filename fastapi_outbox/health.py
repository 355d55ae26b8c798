"""Canonical: fastapi_outbox.ops.health (this path re-exports its public names)."""

from __future__ import annotations

from fastapi_outbox.ops.health import (
    HEALTH_TIMEOUT_SECONDS,
    NO_GUARD,
    OutboxHealth,
    RelayHealth,
    Status,
    WalHealth,
    build_health_router,
    compute_health,
)

__all__ = [
    "HEALTH_TIMEOUT_SECONDS",
    "NO_GUARD",
    "OutboxHealth",
    "RelayHealth",
    "Status",
    "WalHealth",
    "build_health_router",
    "compute_health",
]

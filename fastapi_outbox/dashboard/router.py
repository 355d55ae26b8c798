"""Canonical: fastapi_outbox.ops.dashboard.router (this path re-exports its public names)."""

from __future__ import annotations

from fastapi_outbox.ops.dashboard.router import CSRF_COOKIE, CSRF_HEADER, build_dashboard_router

__all__ = ["CSRF_COOKIE", "CSRF_HEADER", "build_dashboard_router"]

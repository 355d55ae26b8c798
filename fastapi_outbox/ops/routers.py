"""An outbox's HTTP routers, each built once on first use: the health probes
(`fastapi_outbox.ops.health`), the operator dashboard
(`fastapi_outbox.ops.dashboard`, refused without a guard) and the one router that
carries the outbox's lifespan with the health probes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from fastapi_outbox import exceptions
from fastapi_outbox.ops.port import OutboxPort

if TYPE_CHECKING:
    from fastapi import APIRouter

__all__ = ["NO_DASHBOARD_GUARD", "Routers"]

#: Why the dashboard is refused without ``dashboard_dependencies``, and what to do.
NO_DASHBOARD_GUARD = (
    "outbox.dashboard_router has no guard: pass Outbox(..., "
    "dashboard_dependencies=[Depends(require_admin)]) to protect every page and "
    "action, or dashboard_dependencies=[] to serve it unguarded on purpose"
)


class Routers:
    """The routers of one outbox (``Outbox.health_router``, ``dashboard_router`` and
    ``router``), built on first use and kept."""

    def __init__(self, outbox: OutboxPort, lifespan: Callable[[Any], Any]) -> None:
        self._outbox = outbox
        self._lifespan = lifespan
        self._health: APIRouter | None = None
        self._dashboard: APIRouter | None = None
        self._combined: APIRouter | None = None

    @property
    def health(self) -> APIRouter:
        """``GET /outbox/health``."""
        if self._health is None:
            from fastapi_outbox.ops.health import build_health_router

            self._health = build_health_router(self._outbox)
        return self._health

    def dashboard(self, dependencies: Sequence[Any] | None) -> APIRouter:
        """The dashboard behind ``dependencies``; ConfigurationError when None (no guard:
        ``[]`` serves it unguarded on purpose)."""
        if dependencies is None:
            raise exceptions.ConfigurationError(NO_DASHBOARD_GUARD)
        if self._dashboard is None:
            from fastapi_outbox.ops.dashboard import build_dashboard_router
            from fastapi_outbox.ops.dashboard.router import build_tenant_dashboard_router
            from fastapi_outbox.ops.port import tenants_of

            tenants = tenants_of(self._outbox)
            if tenants is not None:
                self._dashboard = build_tenant_dashboard_router(self._outbox, tenants, dependencies)
            else:
                self._dashboard = build_dashboard_router(self._outbox, dependencies)
        return self._dashboard

    @property
    def combined(self) -> APIRouter:
        """The health router carrying the outbox's lifespan: one ``include_router`` line."""
        if self._combined is None:
            from fastapi import APIRouter

            router = APIRouter(lifespan=self._lifespan)
            router.include_router(self.health)
            self._combined = router
        return self._combined

"""The operator dashboard: ``app.include_router(outbox.dashboard_router)``.

Server-rendered HTML (Jinja2, autoescaped) at ``/outbox/dashboard`` with vendored static
files (no CDN, no build step) and JSON endpoints for its actions under the same prefix; the
pages find where they are served (a router prefix, ``app.mount``, a proxy's ``root_path``),
so two outboxes' dashboards live side by side in one app.
Every page and action runs the guard given as ``Outbox(dashboard_dependencies=[...])``;
building the router with no guard at all is refused unless ``dashboard_dependencies=[]``
says so on purpose. Actions go through `fastapi_outbox.ops.operations`, the same code the
CLI runs.
"""

from __future__ import annotations

from fastapi_outbox.ops.dashboard.router import CSRF_COOKIE, CSRF_HEADER, build_dashboard_router

__all__ = ["CSRF_COOKIE", "CSRF_HEADER", "build_dashboard_router"]

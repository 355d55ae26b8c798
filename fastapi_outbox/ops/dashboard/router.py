"""Routes of the operator dashboard (see `fastapi_outbox.ops.dashboard`).

Pages (GET, HTML): ``/outbox/dashboard`` (overview, refreshing itself every few seconds
from ``/outbox/dashboard/fragments/overview``), ``/outbox/dashboard/messages`` (filtered
list, keyset pages; ``?archived=1``: the archive's), ``/outbox/dashboard/messages/{id}``.
Actions (POST, JSON):
``/outbox/dashboard/api/replay``, ``/outbox/dashboard/api/abandon``; data:
``/outbox/dashboard/api/overview``.

CSRF: double-submit token. A page sets a random token in an ``HttpOnly``, ``SameSite=Strict``
cookie and writes the same token into the page; an action must carry it in the
``X-Outbox-CSRF`` header and have a JSON body. A cross-site page can neither read the token
nor send that header or a JSON body without a CORS preflight, which this router never
grants.

Where it is served: the paths above are the router's own. Every link, script, style sheet,
refresh URL and the CSRF cookie's path are computed per request from where the page was
actually reached — ``root_path`` (``app.mount``, a proxy's ``--root-path``) plus any prefix
the router was included under — so the dashboard works under ``include_router(...,
prefix="/billing")``, inside a mounted app and behind a proxy, and two outboxes' dashboards
in one app each link to and act on their own outbox only.

Operator identity: the guard may set ``request.state.outbox_operator`` (a user name, say);
every action is logged with it (escaped: a line break in it cannot forge a log line).
"""

from __future__ import annotations

import contextvars
import datetime as dt
import hmac
import json
import logging
import re
import secrets
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, HTTPException, Query, Request, Response
from fastapi.responses import FileResponse, HTMLResponse
from jinja2 import Environment, FileSystemLoader, select_autoescape
from markupsafe import Markup
from pydantic import BaseModel, Field
from starlette._utils import get_route_path

from fastapi_outbox import exceptions
from fastapi_outbox.lifecycle.tenants import Tenants
from fastapi_outbox.ops import operations
from fastapi_outbox.ops.port import OutboxPort, TenantOutbox
from fastapi_outbox.redaction import redact

logger = logging.getLogger("fastapi_outbox.ops")

#: The router's own prefix; pages find where they are served with `served_at`.
PREFIX = "/outbox/dashboard"
CSRF_COOKIE = "outbox_dashboard_csrf"
CSRF_HEADER = "X-Outbox-CSRF"
#: Payloads longer than this (pretty-printed) are cut on the message page.
PAYLOAD_DISPLAY_CHARS = 20_000
PAGE_SIZE = 50
#: The statuses an archived message can have (the archive's status filter).
ARCHIVED_STATUSES = ("published", "abandoned")
REFRESH_SECONDS = 5
_HERE = Path(__file__).parent
#: What the pages and actions answer besides 200 and 422, in the OpenAPI document (the guard's
#: own answers, a 401 say, are the app's to document where it includes the router).
_BAD_ID: dict[int | str, dict[str, Any]] = {
    400: {"description": "A message id that is not a UUID."}
}
_PAGE_RESPONSES: dict[int | str, dict[str, Any]] = {**_BAD_ID}
_MESSAGE_RESPONSES: dict[int | str, dict[str, Any]] = {
    **_BAD_ID,
    404: {"description": "No such message."},
}
_ACTION_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"description": "The request names no message, or contradicts itself."},
    403: {"description": "Missing or wrong CSRF header (X-Outbox-CSRF)."},
    415: {"description": "The body is not JSON."},
}
_DEAD_LETTER_RESPONSES: dict[int | str, dict[str, Any]] = {
    **_ACTION_RESPONSES,
    409: {"description": "Stale dead letters: confirm with force."},
    503: {"description": "The consumer group's broker is unavailable."},
}
#: What ``secrets.token_urlsafe`` produces: the only CSRF tokens compared.
_TOKEN = re.compile(r"[A-Za-z0-9_\-]{16,128}")
_STATIC = {
    "dashboard.css": "text/css",
    "dashboard.js": "text/javascript",
}


def _no_credentials(value: Any) -> Any:
    """Every value a page prints goes through the redaction (errors, stream names,
    payloads alike): no credential reaches a page, whatever text carried it."""
    if isinstance(value, Markup):  # already HTML (tojson, |safe): "***" keeps it so
        return Markup(redact(str(value)))
    return redact(value) if isinstance(value, str) else value


_templates = Environment(
    loader=FileSystemLoader(_HERE / "templates"),
    autoescape=select_autoescape(["html"]),
    trim_blocks=True,
    lstrip_blocks=True,
    finalize=_no_credentials,
)


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "\u2013"  # an en dash: no value
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def _when(value: dt.datetime | None) -> str:
    if value is None:
        return "\u2013"  # an en dash: no value
    return value.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


_templates.filters["age"] = _age
_templates.filters["when"] = _when


#: Text a database can store and a log line can carry: no NUL (PostgreSQL refuses it in text).
_STORABLE = r"^[^\x00]*$"


class Ids(BaseModel):
    """Messages an action applies to."""

    ids: list[uuid.UUID] = Field(default_factory=list, max_length=1000)
    reason: str | None = Field(default=None, max_length=500, pattern=_STORABLE)


class ReplayRequest(Ids):
    """``ids``, or every abandoned message (of ``stream``) with ``all_abandoned``: at most
    ``count`` of them, the number the operator confirmed."""

    all_abandoned: bool = False
    stream: str | None = Field(default=None, max_length=255, pattern=_STORABLE)
    count: int | None = Field(default=None, ge=0)


class DeadLetterReplay(BaseModel):
    """Dead letters of one consumer group to put back on its stream: all of them, or the
    entries ``entry_ids``."""

    stream: str = Field(min_length=1, max_length=255, pattern=_STORABLE)
    group: str = Field(min_length=1, max_length=255, pattern=_STORABLE)
    entry_ids: list[Annotated[str, Field(max_length=255, pattern=_STORABLE)]] | None = Field(
        default=None, max_length=1000
    )
    force: bool = Field(
        default=False,
        description="Also dead letters older than inbox_retention_seconds (refused with 409 "
        "otherwise: other groups would handle them again).",
    )


class ActionResult(BaseModel):
    """What an action changed."""

    changed: int
    problems: list[str] = Field(default_factory=list)


def build_dashboard_router(
    outbox: OutboxPort,
    dependencies: Sequence[Any],
    *,
    prefix: str = PREFIX,
    tenants: Callable[[], list[str]] | None = None,
) -> APIRouter:
    """The dashboard's routes under ``prefix``, every one behind ``dependencies`` (the
    guard): the overview, the messages pages, the actions and the static files.
    ``tenants``: the pages of one tenant of a multi-tenant outbox, with the tenant
    selector (`build_tenant_dashboard_router`)."""
    router = APIRouter(prefix=prefix, tags=["outbox dashboard"], dependencies=list(dependencies))
    pages = _Pages(outbox.settings.dashboard_show_payloads, tenants)
    _overview_routes(router, outbox, pages)
    _message_routes(router, outbox, pages)
    _action_routes(router, outbox)
    router.add_api_route("/static/{name}", _static, methods=["GET"], include_in_schema=False)
    return router


class _Pages:
    """Renders a template as a page: the CSRF token (set as a cookie on first sight), the
    refresh interval, whether payloads show, and the headers that keep the page from
    being cached, framed or sniffed."""

    def __init__(self, show_payloads: bool, tenants: Callable[[], list[str]] | None = None) -> None:
        self.show_payloads = show_payloads
        self.tenants = tenants

    def render(self, request: Request, suffix: str, template: str, **context: Any) -> HTMLResponse:
        """``suffix``: the part of the request's path after the dashboard's base (``""``
        for the overview, ``"/messages"``...), to find the base it was reached under."""
        base = served_at(request, suffix)
        token = _csrf_cookie(request) or secrets.token_urlsafe(32)
        if self.tenants is not None:  # a tenant's pages: /…/dashboard/t/{tenant}
            context.update(
                tenant=_DASHBOARD_TENANT.get(),
                tenants=self.tenants()[:TENANT_LINKS],
                tenants_base=base.rsplit("/t/", 1)[0],
            )
        html = _templates.get_template(template).render(
            prefix=base,
            csrf=token,
            refresh_seconds=REFRESH_SECONDS,
            show_payloads=self.show_payloads,
            **context,
        )
        response = HTMLResponse(html)
        response.headers["Cache-Control"] = "no-store"
        response.headers["Content-Security-Policy"] = (
            "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
            "frame-ancestors 'none'; form-action 'self'"
        )
        response.headers["X-Content-Type-Options"] = "nosniff"
        if _csrf_cookie(request) != token:
            response.set_cookie(CSRF_COOKIE, token, httponly=True, samesite="strict", path=base)
        return response


def served_at(request: Request, suffix: str) -> str:
    """The dashboard's base path as the browser sees it: the request's public path
    (``root_path`` of a mount or a proxy, then the path routed here) less ``suffix``."""
    scope = request.scope
    path: str = scope.get("root_path", "") + get_route_path(scope)
    if suffix and path.endswith(suffix):
        path = path[: -len(suffix)]
    return path.rstrip("/")


def _csrf_cookie(request: Request) -> str | None:
    """The CSRF cookie when it is a token this router could have set (URL-safe ASCII):
    anything else is ignored, and a fresh token replaces it."""
    value = request.cookies.get(CSRF_COOKIE)
    return value if value and _TOKEN.fullmatch(value) else None


async def _check_csrf(request: Request) -> None:
    """Every action: the double-submit token in its header, and a JSON body. Headers are
    read as Latin-1 by Starlette: a token with any byte outside URL-safe ASCII is refused
    (403) before it is compared, since ``hmac.compare_digest`` raises on non-ASCII text."""
    cookie = _csrf_cookie(request) or ""
    header = request.headers.get(CSRF_HEADER, "")
    if not cookie or not _TOKEN.fullmatch(header) or not hmac.compare_digest(cookie, header):
        raise HTTPException(403, f"missing or wrong {CSRF_HEADER} header (CSRF check)")
    if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
        raise HTTPException(415, "actions take a JSON body (application/json)")


def _operator(request: Request) -> str | None:
    """Who acts, as the guard put it on ``request.state.outbox_operator``."""
    value = getattr(request.state, "outbox_operator", None)
    return None if value is None else str(value)


async def _overview_context(outbox: OutboxPort) -> dict[str, Any]:
    """What the overview page and its fragment show."""
    view = await operations.overview(outbox)
    peak = max((count for _, count in view.per_minute), default=0)
    totals = {
        status: sum(int(s[status]) for s in view.streams)
        for status in ("pending", "processing", "failed", "abandoned", "scheduled")
    }
    return {
        "view": view,
        "peak": peak,
        "totals": totals,
        "published_last_hour": sum(count for _, count in view.per_minute),
        "now": dt.datetime.now(dt.UTC),
    }


def _overview_data(view: operations.Overview) -> dict[str, Any]:
    """The overview as JSON (``/api/overview``)."""
    return {
        "database_ok": view.database_ok,
        "streams": view.streams,
        "brokers": view.brokers,
        "published_per_minute": [
            {"minute": minute.isoformat(), "count": count} for minute, count in view.per_minute
        ],
        "consumers": [c.model_dump(mode="json") for c in view.consumers],
    }


def _overview_routes(router: APIRouter, outbox: OutboxPort, pages: _Pages) -> None:
    @router.get("", response_class=HTMLResponse, summary="Dashboard overview")
    async def overview_page(request: Request) -> HTMLResponse:
        return pages.render(request, "", "overview.html", **await _overview_context(outbox))

    @router.get("/fragments/overview", response_class=HTMLResponse, include_in_schema=False)
    async def overview_fragment(request: Request) -> HTMLResponse:
        return pages.render(
            request, "/fragments/overview", "_overview.html", **await _overview_context(outbox)
        )

    @router.get("/api/overview", summary="Dashboard overview data")
    async def overview_data() -> dict[str, Any]:
        return _overview_data(await operations.overview(outbox))


def _message_filter(filters: dict[str, str | None]) -> operations.MessageFilter:
    """The messages page's query as a filter; OperationError for a bad value."""
    return operations.MessageFilter(
        status=filters["status"],
        stream=filters["stream"],
        broker=filters["broker"],
        type=filters["type"],
        key=filters["key"],
        since=_datetime("since", filters["since"]),
        until=_datetime("until", filters["until"]),
    )


def _message_routes(router: APIRouter, outbox: OutboxPort, pages: _Pages) -> None:
    @router.get(
        "/messages", response_class=HTMLResponse, summary="Messages", responses=_PAGE_RESPONSES
    )
    async def messages_page(
        request: Request,
        status: str | None = None,
        stream: str | None = None,
        broker: str | None = None,
        type: str | None = None,
        key: str | None = None,
        since: str | None = None,
        until: str | None = None,
        before: str | None = None,
        archived: bool = Query(
            False, description="List the archive (archive=True) instead of the outbox table."
        ),
        limit: int = Query(PAGE_SIZE, ge=1, le=operations.MAX_PAGE_SIZE),
    ) -> HTMLResponse:
        filters = {
            "status": status or None,
            "stream": stream or None,
            "broker": broker or None,
            "type": type or None,
            "key": key or None,
            "since": since or None,
            "until": until or None,
            "archived": "1" if archived else None,
        }
        list_rows = operations.list_archived if archived else operations.list_messages
        for name, value in filters.items():
            if value is not None and "\x00" in value:
                # PostgreSQL stores no NUL in text: refused here, not a driver error (500).
                raise HTTPException(400, f"{name}: a NUL character is not allowed")
        try:
            where = _message_filter(filters)
            before_id = _uuid("before", before) if before else None
            rows = await list_rows(outbox, where, before_id=before_id, limit=limit)
        except exceptions.OperationError as exc:
            raise HTTPException(400, str(exc)) from exc
        query = {k: v for k, v in filters.items() if v}
        next_page = {**query, "before": str(rows[-1]["id"])} if len(rows) == limit else None
        return pages.render(
            request,
            "/messages",
            "messages.html",
            rows=rows,
            filters=filters,
            archived=archived,
            has_archive=outbox.archive is not None,
            statuses=list(ARCHIVED_STATUSES if archived else operations.STATUS_FILTERS),
            next_page=next_page,
            first_page=query if before else None,
        )

    @router.get(
        "/messages/{message_id}",
        response_class=HTMLResponse,
        summary="One message",
        responses=_MESSAGE_RESPONSES,
    )
    async def message_page(request: Request, message_id: str) -> HTMLResponse:
        mid = _uuid("message id", message_id)
        try:
            # Payloads hidden: encrypted headers are not decrypted for the page either.
            message = await operations.show(outbox, mid, reveal=pages.show_payloads)
        except exceptions.MessageNotFound as exc:
            raise HTTPException(404, str(exc)) from exc
        context = _message_context(message, pages)
        context["links"] = await operations.linked_messages(outbox, message["headers"])
        return pages.render(request, f"/messages/{message_id}", "message.html", **context)


def _message_context(message: dict[str, Any], pages: _Pages) -> dict[str, Any]:
    """What the message page shows: the payload pretty-printed and cut (when payloads
    show at all), and which actions apply."""
    preview = message.get("payload_preview")  # the first characters of a large one
    if preview is not None:
        payload = preview
    else:
        payload = json.dumps(message["payload"], indent=2, ensure_ascii=False)
    return {
        "m": message,
        # "claim-check: <ref> (5.0 MiB)": the payload is out of band (fastapi_outbox.payloads)
        "claim": message.get("claim_check"),
        "preview": preview is not None,
        "headers": message["headers"],
        "payload": payload[:PAYLOAD_DISPLAY_CHARS] if pages.show_payloads else None,
        # "encrypted (key k2)": this process does not hold the key (fastapi_outbox.payloads)
        "payload_note": message.get("payload_note"),
        "payload_chars": len(payload),
        "truncated": len(payload) > PAYLOAD_DISPLAY_CHARS,
        # An archived message is read-only: it left the outbox table.
        "replayable": not message["archived"] and message["status"] in operations.REPLAYABLE,
        "abandonable": not message["archived"]
        and message["status"] in operations.ABANDONABLE
        and message["locked_by"] is None,
    }


def _action_routes(router: APIRouter, outbox: OutboxPort) -> None:
    guarded = [Depends(_check_csrf)]

    @router.post(
        "/api/replay",
        response_model=ActionResult,
        dependencies=guarded,
        summary="Replay messages",
        responses=_ACTION_RESPONSES,
    )
    async def replay(request: Request, body: ReplayRequest) -> ActionResult:
        return await _replay(outbox, body, _operator(request))

    @router.post(
        "/api/abandon",
        response_model=ActionResult,
        dependencies=guarded,
        summary="Abandon messages",
        responses=_ACTION_RESPONSES,
    )
    async def abandon(request: Request, body: Ids) -> ActionResult:
        if not body.ids:
            raise HTTPException(400, "ids: give at least one message id")
        outcome = await operations.abandon(
            outbox, body.ids, operator=_operator(request), reason=body.reason
        )
        return ActionResult(changed=outcome.count, problems=outcome.problems)

    @router.post(
        "/api/replay-dead-letters",
        response_model=ActionResult,
        dependencies=guarded,
        summary="Replay a consumer group's dead letters",
        responses=_DEAD_LETTER_RESPONSES,
    )
    async def replay_dead_letters(request: Request, body: DeadLetterReplay) -> ActionResult:
        return await _replay_dead_letters(outbox, body, _operator(request))


async def _replay(outbox: OutboxPort, body: ReplayRequest, who: str | None) -> ActionResult:
    """``/api/replay``: the ids given, or every abandoned message up to the count the
    operator confirmed."""
    if body.all_abandoned:
        if body.ids:
            raise HTTPException(400, "give ids or all_abandoned, not both")
        if body.count is None:
            raise HTTPException(
                400, "count: all_abandoned replays at most the count the operator confirmed"
            )
        count = await operations.replay_abandoned(
            outbox, stream=body.stream, operator=who, max_rows=body.count
        )
        return ActionResult(changed=count)
    if not body.ids:
        raise HTTPException(400, "ids: give at least one message id (or all_abandoned)")
    outcome = await operations.replay(outbox, body.ids, operator=who)
    return ActionResult(changed=outcome.count, problems=outcome.problems)


async def _replay_dead_letters(
    outbox: OutboxPort, body: DeadLetterReplay, who: str | None
) -> ActionResult:
    """``/api/replay-dead-letters``: 409 for stale dead letters (the page asks again, then
    forces), 400 for an unknown group, 503 when its broker does not answer."""
    try:
        count = await operations.replay_dead_letters(
            outbox, body.stream, body.group, body.entry_ids, operator=who, force=body.force
        )
    except exceptions.StaleDeadLetters as exc:
        raise HTTPException(409, str(exc)) from exc
    except exceptions.OperationError as exc:
        raise HTTPException(400, str(exc)) from exc
    except exceptions.BrokerUnavailable as exc:
        raise HTTPException(503, str(exc)) from exc
    return ActionResult(changed=count)


async def _static(name: str) -> Response:
    """The vendored CSS and JavaScript (no CDN)."""
    media_type = _STATIC.get(name)
    if media_type is None:
        raise HTTPException(404, f"no static file {name!r}")
    return FileResponse(
        _HERE / "static" / name,
        media_type=media_type,
        headers={"Cache-Control": "max-age=300"},
    )


def _uuid(field: str, text: str) -> uuid.UUID:
    try:
        return uuid.UUID(text)
    except ValueError:
        raise HTTPException(400, f"{field}: {text[:80]!r} is not a message id (UUID)") from None


def _datetime(field: Literal["since", "until"], text: str | None) -> dt.datetime | None:
    """An ISO date-time from a filter (a browser's datetime-local has no zone: UTC)."""
    if text is None:
        return None
    try:
        value = dt.datetime.fromisoformat(text)
    except ValueError:
        raise exceptions.OperationError(
            f"{field}: {text[:80]!r} is not a date-time (YYYY-MM-DDTHH:MM)"
        ) from None
    return value if value.tzinfo is not None else value.replace(tzinfo=dt.UTC)


# -- multi-tenant outboxes ---------------------------------------------------------------------

#: Tenants linked from the selector of a tenant's pages (the index lists them all).
TENANT_LINKS = 50

#: The tenant whose dashboard pages are served in this context.
_DASHBOARD_TENANT: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "fastapi_outbox.dashboard_tenant", default=None
)


def build_tenant_dashboard_router(
    outbox: OutboxPort, tenants: Tenants, dependencies: Sequence[Any]
) -> APIRouter:
    """A multi-tenant outbox's dashboard: the tenants at ``PREFIX`` (the selector), and
    each tenant's own dashboard at ``PREFIX/t/{tenant}`` (an unknown tenant: 404)."""

    async def serve_tenant(tenant: str) -> None:
        if tenant not in tenants.outboxes:
            raise HTTPException(404, f"unknown tenant {tenant!r}")
        _DASHBOARD_TENANT.set(tenant)

    router = APIRouter(prefix=PREFIX, tags=["outbox dashboard"], dependencies=list(dependencies))
    served = TenantOutbox(tenants, outbox.settings, _DASHBOARD_TENANT.get)
    router.include_router(
        build_dashboard_router(
            served, [Depends(serve_tenant)], prefix="/t/{tenant}", tenants=lambda: tenants.names
        )
    )
    pages = _Pages(outbox.settings.dashboard_show_payloads)

    @router.get("", response_class=HTMLResponse, summary="Dashboard: the tenants")
    async def tenants_page(request: Request) -> HTMLResponse:
        relay = tenants.relay
        running = outbox.lifecycle.started and relay.running
        rows = [
            (name, ("ok" if relay.status(name)["ok"] else "down") if running else "unknown")
            for name in tenants.names
        ]
        return pages.render(request, "", "tenants.html", page="tenants", rows=rows)

    router.add_api_route("/static/{name}", _static, methods=["GET"], include_in_schema=False)
    return router

"""The dashboard wherever the app serves it (Chromium through Playwright): under a router
prefix, inside ``app.mount``, behind a proxy that strips a ``root_path``, and two outboxes'
dashboards in one app. In each shape the page loads its own style sheet and script, the
CSRF cookie is scoped to where the page is, and "Replay all abandoned" replays the message of
*its* outbox — checked in that outbox's database, and the other outbox's message is left
alone."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request, Response

from fastapi_outbox import Message, Outbox, OutboxSettings
from fastapi_outbox.brokers import MemoryBroker
from tests.browser.conftest import browser_page, live_server
from tests.conftest import unique, wait_until

pytestmark = pytest.mark.postgres(
    reason=(
        "a browser drives the page; the dashboard's "
        "queries run per database in ops/test_dashboard.py"
    )
)

#: Screenshots of each shape, for a person to look at (not compared): set
#: OUTBOX_TEST_SHOTS=/some/dir to have them written there.
SHOTS = os.environ.get("OUTBOX_TEST_SHOTS")


@pytest.fixture
def second_pg_url(_pg_databases: Any) -> Iterator[str]:
    """A second database of this test's own: the other outbox."""
    from tests.conftest import PG_URL

    name = _pg_databases.take()
    yield f"{PG_URL.rpartition('/')[0]}/{name}"
    _pg_databases.drop(name)


async def outbox_with_abandoned(url: str, stream: str) -> tuple[Outbox, uuid.UUID]:
    """An outbox (no relays: a replayed message stays pending) holding one abandoned
    message of ``stream``."""
    outbox = Outbox(
        url,
        brokers={"default": MemoryBroker()},
        settings=OutboxSettings(run_relays=False),
        dashboard_dependencies=[],
    )
    await outbox.create_tables()
    async with outbox.unit_of_work() as uow:
        mid = uow.publish(Message(stream, "Charged", {"n": 1}))
    async with outbox.engine.begin() as conn:
        await conn.execute(outbox.table.update().values(status="abandoned", last_error="no"))
    return outbox, mid


async def status_of(outbox: Outbox, message_id: uuid.UUID) -> str:
    row = await outbox.store.messages.get(message_id)
    assert row is not None
    return str(row["status"])


async def replay_all_from(page: Any, url: str, stream: str, expected_base: str) -> None:
    """Open the overview at ``url``, check it found itself at ``expected_base`` (style sheet,
    script and cookie there), and click "Replay all abandoned" on ``stream``'s row."""
    await page.goto(url)
    row = page.locator("tr", has_text=stream)
    await row.wait_for()
    # The style sheet applied (the page is laid out by it) and the script runs (it reads
    # the base the server wrote into the page).
    assert await page.locator('meta[name="outbox-base"]').get_attribute("content") == (
        expected_base
    )
    css = await page.locator('link[rel="stylesheet"]').get_attribute("href")
    assert css == f"{expected_base}/static/dashboard.css"
    display = await page.evaluate("getComputedStyle(document.querySelector('header.top')).display")
    assert display == "flex", "the style sheet did not load"
    cookies = {c["name"]: c for c in await page.context.cookies()}
    assert cookies["outbox_dashboard_csrf"]["path"] == expected_base
    await row.locator("button[data-action=replay]").click()
    await page.locator("#flash").wait_for()
    assert "Replayed 1 message(s)." in await page.locator("#flash").inner_text()
    if SHOTS:  # Playwright makes the folder
        name = expected_base.strip("/").replace("/", "_")
        await page.screenshot(path=str(Path(SHOTS) / f"{name}.png"))


async def test_dashboard_under_a_router_prefix(pg_url: str, chromium: str) -> None:
    stream = unique("orders")
    outbox, mid = await outbox_with_abandoned(pg_url, stream)
    app = FastAPI()
    app.include_router(outbox.router)
    app.include_router(outbox.dashboard_router, prefix="/ops")
    try:
        async with live_server(app) as base, browser_page(chromium) as page:
            await replay_all_from(
                page, f"{base}/ops/outbox/dashboard", stream, "/ops/outbox/dashboard"
            )
            assert await status_of(outbox, mid) == "pending"
            # The links lead to this dashboard's own pages.
            await page.click("nav a:has-text('Messages')")
            await page.wait_for_url(f"{base}/ops/outbox/dashboard/messages")
            await page.locator("#messages").wait_for()
    finally:
        await outbox.aclose()


async def test_dashboard_inside_a_mounted_app(pg_url: str, chromium: str) -> None:
    stream = unique("orders")
    outbox, mid = await outbox_with_abandoned(pg_url, stream)
    admin = FastAPI()
    admin.include_router(outbox.dashboard_router)
    app = FastAPI(lifespan=outbox.lifespan)
    app.include_router(outbox.health_router)
    app.mount("/admin", admin)
    try:
        async with live_server(app) as base, browser_page(chromium) as page:
            await replay_all_from(
                page, f"{base}/admin/outbox/dashboard", stream, "/admin/outbox/dashboard"
            )
            assert await status_of(outbox, mid) == "pending"
    finally:
        await outbox.aclose()


@contextlib.asynccontextmanager
async def stripping_proxy(prefix: str, upstream: str) -> AsyncIterator[str]:
    """A reverse proxy on its own port that serves ``upstream`` under ``prefix`` and strips
    it, as nginx's ``location /prefix/ { proxy_pass http://app/; }`` does."""
    proxy = FastAPI()
    client = httpx.AsyncClient(base_url=upstream)

    @proxy.api_route(prefix + "/{rest:path}", methods=["GET", "POST"])
    async def forward(rest: str, request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() != "host"}
        answer = await client.request(
            request.method,
            "/" + rest,
            params=request.query_params,
            headers=headers,
            content=await request.body(),
        )
        out = Response(answer.content, status_code=answer.status_code)
        for name, value in answer.headers.multi_items():
            if name.lower() not in ("content-length", "transfer-encoding", "connection"):
                out.headers.append(name, value)
        return out

    try:
        async with live_server(proxy) as base:
            yield base
    finally:
        await client.aclose()


async def test_dashboard_behind_a_proxy_with_root_path(pg_url: str, chromium: str) -> None:
    stream = unique("orders")
    outbox, mid = await outbox_with_abandoned(pg_url, stream)
    app = FastAPI()
    app.include_router(outbox.router)
    app.include_router(outbox.dashboard_router)
    try:
        async with (
            live_server(app, root_path="/proxied") as upstream,
            stripping_proxy("/proxied", upstream) as base,
            browser_page(chromium) as page,
        ):
            await replay_all_from(
                page, f"{base}/proxied/outbox/dashboard", stream, "/proxied/outbox/dashboard"
            )
            assert await status_of(outbox, mid) == "pending"
    finally:
        await outbox.aclose()


async def test_two_outboxes_dashboards_each_act_on_their_own(
    pg_url: str, second_pg_url: str, chromium: str
) -> None:
    """The deployment guide's two outboxes: orders at the default path, billing under
    ``/billing``. Billing's "Replay all abandoned" replays billing's message (in billing's
    database) and leaves the orders' one abandoned; then the same from the orders' page."""
    stream = unique("shared")  # the same stream name in both: only the database tells
    orders, orders_mid = await outbox_with_abandoned(pg_url, stream)
    billing, billing_mid = await outbox_with_abandoned(second_pg_url, stream)
    app = FastAPI()
    app.include_router(orders.router)
    app.include_router(orders.dashboard_router)
    app.include_router(billing.dashboard_router, prefix="/billing")
    try:
        async with live_server(app) as base, browser_page(chromium) as page:
            await replay_all_from(
                page, f"{base}/billing/outbox/dashboard", stream, "/billing/outbox/dashboard"
            )
            assert await status_of(billing, billing_mid) == "pending"
            assert await status_of(orders, orders_mid) == "abandoned"
            # The billing page's refresh reads billing's data: its row no longer offers a
            # replay, while the orders' dashboard still does.
            await wait_until(lambda: _no_replay_button(page, stream), timeout=15)
            await replay_all_from(page, f"{base}/outbox/dashboard", stream, "/outbox/dashboard")
            assert await status_of(orders, orders_mid) == "pending"
    finally:
        await orders.aclose()
        await billing.aclose()


async def _no_replay_button(page: Any, stream: str) -> bool:
    row = page.locator("tr", has_text=stream)
    return await row.locator("button[data-action=replay]").count() == 0

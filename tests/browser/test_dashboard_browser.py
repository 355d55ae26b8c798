"""The operator dashboard in a real browser (Chromium through Playwright).

An operator opens the overview, filters the messages, opens one, replays an abandoned
message and sees it published; markup in payloads, headers, stream names and errors is shown
as text and never runs."""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from fastapi_outbox import Message, MessageRejected, Outbox, OutboxSettings
from fastapi_outbox.brokers import MemoryBroker
from tests.browser.conftest import browser_page, live_server
from tests.conftest import unique, wait_until

pytestmark = pytest.mark.postgres(
    reason=(
        "a browser drives the page; the dashboard's "
        "queries run per database in ops/test_dashboard.py"
    )
)

EVIL = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'
#: Stream names take no whitespace.
EVIL_STREAM = "s<script>window.__pwned=3</script><img/src=x/onerror=window.__pwned=4>"


def app_for(outbox: Outbox) -> FastAPI:
    app = FastAPI()
    app.include_router(outbox.router)
    app.include_router(outbox.dashboard_router)
    return app


async def status_of(outbox: Outbox, message_id: Any) -> str:
    row = await outbox.store.messages.get(message_id)
    assert row is not None
    return str(row["status"])


async def test_operator_replays_a_dead_letter_and_sees_it_published(
    pg_url: str, chromium: str
) -> None:
    refusing = True
    broker = MemoryBroker(
        reject=lambda e: (
            MessageRejected("partner said no") if refusing and e.type == "Ship" else None
        )
    )
    outbox = Outbox(
        pg_url,
        brokers={"default": broker},
        settings=OutboxSettings(
            max_attempts=1, poll_interval_seconds=0.05, max_poll_interval_seconds=0.2
        ),
        dashboard_dependencies=[],
    )
    await outbox.create_tables()
    stream, other = unique("shipments"), unique("orders")
    async with outbox.unit_of_work() as uow:
        dead = uow.publish(Message(stream, "Ship", {"order": 7}), key="order-7")
        for n in range(3):
            uow.publish(Message(other, "OrderPlaced", {"n": n}))
    try:
        async with live_server(app_for(outbox)) as base, browser_page(chromium) as page:
            await wait_until(lambda: _is(outbox, dead, "abandoned"), timeout=10)
            refusing = False

            # Overview: the stream with its dead letter, counts, and the chart.
            await page.goto(f"{base}/outbox/dashboard")
            row = page.locator("tr", has_text=stream)
            await row.wait_for()
            assert "1" in await row.locator("td.abandoned").inner_text()
            assert await page.locator("svg.chart rect").count() == 60

            # Filter: abandoned messages of that stream.
            await page.goto(f"{base}/outbox/dashboard/messages")
            await page.select_option("select[name=status]", "abandoned")
            await page.fill("input[name=stream]", stream)
            await page.click("button[type=submit]")
            await page.wait_for_url(re.compile(r"status=abandoned"))
            rows = page.locator("#messages tbody tr")
            assert await rows.count() == 1
            assert "partner said no" in await rows.first.inner_text()

            # The message page, then replay it.
            await rows.first.locator("a").click()
            await page.wait_for_url(re.compile(str(dead)))
            assert "order-7" in await page.locator("dl.facts").inner_text()
            assert '"order": 7' in await page.locator("pre.payload").inner_text()
            await page.click("button[data-action=replay]")
            await page.locator("#flash").wait_for()
            assert "Replayed 1 message(s)." in await page.locator("#flash").inner_text()

            await wait_until(lambda: _is(outbox, dead, "published"), timeout=10)
            await page.reload()
            assert "published" in await page.locator("h2 .badge").inner_text()
            assert any(m.id == str(dead) for m in broker.messages)
    finally:
        await outbox.aclose()


async def test_operator_puts_a_consumer_groups_dead_letter_back(pg_url: str, chromium: str) -> None:
    """A subscriber dead-letters a message while its carrier is down; once it is back, the
    operator clicks "Replay dead letters" on the group's row and the message is handled."""
    outbox = Outbox(
        pg_url,
        brokers={"default": MemoryBroker()},
        settings=OutboxSettings(
            poll_interval_seconds=0.05, max_poll_interval_seconds=0.2, consumer_max_attempts=1
        ),
        dashboard_dependencies=[],
    )
    await outbox.create_tables()
    stream = unique("shipments")
    carrier_down = True
    handled: list[int] = []

    @outbox.subscriber(stream, group="tracking", start="all")
    async def track(message: Message) -> None:
        if carrier_down:
            raise ConnectionRefusedError("carrier down")
        handled.append(message.payload["n"])

    async with outbox.unit_of_work() as uow:
        uow.publish(Message(stream, "Shipped", {"n": 1}))
    sub = outbox.subscribers[0]
    try:
        async with live_server(app_for(outbox)) as base, browser_page(chromium) as page:
            await wait_until(lambda: sub.stats.dead_lettered == 1, timeout=10)
            await page.goto(f"{base}/outbox/dashboard")
            row = page.locator("tr", has_text="tracking")
            await row.wait_for()
            assert "1" in await row.locator("td.bad").inner_text()
            carrier_down = False
            await row.locator("button[data-action=replay-dead-letters]").click()
            await page.locator("#flash").wait_for()
            flash = await page.locator("#flash").inner_text()
            assert "Put back on the stream 1 dead letter(s)." in flash
            await wait_until(lambda: handled == [1], timeout=10)
            await page.reload()
            row = page.locator("tr", has_text="tracking")
            await row.wait_for()
            assert await row.locator("button[data-action=replay-dead-letters]").count() == 0
    finally:
        await outbox.aclose()


async def _is(outbox: Outbox, message_id: Any, status: str) -> bool:
    return await status_of(outbox, message_id) == status


async def test_markup_from_messages_is_shown_as_text_and_never_runs(
    pg_url: str, chromium: str
) -> None:
    outbox = Outbox(
        pg_url,
        brokers={"default": MemoryBroker()},
        settings=OutboxSettings(run_relays=False),
        dashboard_dependencies=[],
    )
    await outbox.create_tables()
    stream = EVIL_STREAM
    async with outbox.unit_of_work() as uow:
        mid = uow.publish(
            Message(stream, "Evil", {"html": EVIL}, headers={"x-note": EVIL}), key=EVIL[:100]
        )
    async with outbox.engine.begin() as conn:
        await conn.execute(
            outbox.table.update().values(status="abandoned", last_error=f"broker said {EVIL}")
        )
    try:
        async with live_server(app_for(outbox)) as base:
            async with httpx.AsyncClient(base_url=base) as client:
                for path in ("", "/messages", f"/messages/{mid}"):
                    html = (await client.get(f"/outbox/dashboard{path}")).text
                    assert "<script>window.__pwned" not in html
                    assert "<img" not in html
                    assert "&lt;script&gt;window.__pwned" in html
            async with browser_page(chromium) as page:
                for path in ("", "/messages", f"/messages/{mid}"):
                    await page.goto(f"{base}/outbox/dashboard{path}")
                    assert await page.evaluate("window.__pwned") is None
                    assert await page.locator("img").count() == 0
                    text = await page.inner_text("main")
                    assert "<script>window.__pwned" in text  # shown, as text
    finally:
        await outbox.aclose()


async def test_an_old_dead_letter_is_replayed_only_after_the_warning(
    pg_url: str, chromium: str
) -> None:
    """A dead letter older than inbox_retention_seconds. The first answer is
    a 409 with the warning; the page shows it in a second confirmation and, accepted,
    replays with force."""
    from fastapi_outbox.ops import operations

    outbox = Outbox(
        pg_url,
        brokers={"default": MemoryBroker()},
        settings=OutboxSettings(
            poll_interval_seconds=0.05,
            max_poll_interval_seconds=0.2,
            consumer_max_attempts=1,
            consumer_claim_idle_seconds=1,
            consumer_retry_base_delay_seconds=0.1,
            consumer_retry_max_delay_seconds=0.5,
            inbox_retention_seconds=2.5,
        ),
        dashboard_dependencies=[],
    )
    await outbox.create_tables()
    stream = unique("shipments")
    handled: list[int] = []
    broken = True

    @outbox.subscriber(stream, group="tracking", start="all")
    async def track(message: Message) -> None:
        if broken:
            raise ConnectionRefusedError("carrier down")
        handled.append(message.payload["n"])

    async with outbox.unit_of_work() as uow:
        uow.publish(Message(stream, "Shipped", {"n": 1}))
    sub = outbox.subscribers[0]
    dialogs: list[str] = []
    try:
        async with live_server(app_for(outbox)) as base, browser_page(chromium) as page:
            page.on("dialog", lambda dialog: dialogs.append(dialog.message))
            await wait_until(lambda: sub.stats.dead_lettered == 1, timeout=10)

            async def stale() -> bool:
                return bool(await operations.stale_dead_letters(outbox, stream, "tracking"))

            await wait_until(stale, timeout=10)  # older than the 2.5 s retention
            broken = False
            await page.goto(f"{base}/outbox/dashboard")
            row = page.locator("tr", has_text="tracking")
            await row.wait_for()
            await row.locator("button[data-action=replay-dead-letters]").click()
            await page.locator("#flash").wait_for()
            assert (
                "Put back on the stream 1 dead letter(s)."
                in await page.locator("#flash").inner_text()
            )
            assert len(dialogs) == 2, dialogs
            assert "Put the 1 dead letter(s) of group tracking" in dialogs[0]
            assert "older than inbox_retention_seconds" in dialogs[1]
            await wait_until(lambda: handled == [1], timeout=10)
    finally:
        await outbox.aclose()


async def test_operator_finds_an_archived_message_in_the_archive_list(
    tmp_path: Any, chromium: str
) -> None:
    """The operator switches the messages list to the archive, filters it by stream, opens
    an archived message and sees it read-only, with its payload."""
    from tests.integration.ops.test_archive_views import MARKER, archive_some, dashboard_outbox

    url = f"sqlite+aiosqlite:///{tmp_path}/archive.db"
    moved, _ = await archive_some(url)
    outbox = dashboard_outbox(url)
    try:
        async with live_server(app_for(outbox)) as base, browser_page(chromium) as page:
            await page.goto(f"{base}/outbox/dashboard/messages")
            assert await page.locator("#messages tbody tr").count() == 1  # the pending one
            await page.select_option("select[name=archived]", "1")
            await page.fill("input[name=stream]", "orders")
            await page.click("button[type=submit]")
            await page.wait_for_url(re.compile(r"archived=1"))
            rows = page.locator("#messages tbody tr")
            assert await rows.count() == 2
            assert await page.locator("button[data-action]").count() == 0  # read-only
            assert "read-only" in await page.locator(".bulk .hint").inner_text()
            await rows.last.locator("a").click()
            await page.wait_for_url(re.compile(str(moved[0])))
            assert "archived" in await page.locator("h2").inner_text()
            assert MARKER in await page.locator("pre.payload").inner_text()
            assert await page.locator("button[data-action=replay]").count() == 0
    finally:
        await outbox.aclose()

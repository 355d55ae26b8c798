"""The dashboard on a phone (390 CSS pixels wide, in Chromium): no page is wider than the
screen and no table overflows its panel; one word per thing (*Abandoned*: the relay gave up,
*Dead letters*: a consumer group gave up); a message's causation and correlation ids are
links to their message. Screenshots go to ``OUTBOX_SCREENSHOTS`` when it is set."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI

from fastapi_outbox import Message, MessageRejected, Outbox, OutboxSettings, UnitOfWork
from fastapi_outbox.brokers import MemoryBroker
from tests.browser.conftest import browser_page, live_server
from tests.conftest import unique, wait_until

pytestmark = pytest.mark.usefixtures("quick_fetch")

PHONE = {"width": 390, "height": 844}
#: Every element wider than its panel, and the page's own width (CSS pixels).
OVERFLOW = """() => ({
  page: document.documentElement.scrollWidth,
  panels: [...document.querySelectorAll('.panel, .card, header.top')]
    .filter(p => p.scrollWidth > p.clientWidth + 1)
    .map(p => (p.querySelector('h2') || p).textContent.trim().slice(0, 40)),
})"""


async def _screenshot(page: Any, name: str) -> None:
    folder = os.environ.get("OUTBOX_SCREENSHOTS")
    if folder:
        await page.screenshot(path=str(Path(folder) / f"{name}.png"), full_page=True)


async def _fits(page: Any, name: str) -> None:
    await _screenshot(page, name)
    found = await page.evaluate(OVERFLOW)
    assert found == {"page": PHONE["width"], "panels": []}, name


async def test_the_dashboard_fits_a_phone_and_links_a_message_to_its_cause(
    sqlite_url: str, chromium: str
) -> None:
    refuse = MemoryBroker(reject=lambda e: MessageRejected("no") if e.type == "Refused" else None)
    outbox = Outbox(
        sqlite_url,
        brokers={"default": refuse},
        settings=OutboxSettings(
            max_attempts=1, poll_interval_seconds=0.05, max_poll_interval_seconds=0.2
        ),
        dashboard_dependencies=[],
    )
    await outbox.create_tables()
    orders, invoices = unique("orders_of_a_long_stream_name"), unique("invoices")

    @outbox.subscriber(orders, group="billing-with-a-long-group-name", start="all")
    async def bill(message: Message, uow: UnitOfWork) -> None:
        uow.publish(Message(invoices, "InvoiceIssued", {"order": message.payload["order"]}))

    async with outbox.unit_of_work() as uow:
        placed = uow.publish(Message(orders, "OrderPlaced", {"order": 7}), key="order-7")
        refused = uow.publish(Message(unique("refused_by_a_partner_broker"), "Refused", {}))
    app = FastAPI()
    app.include_router(outbox.router)
    app.include_router(outbox.dashboard_router)
    try:
        async with live_server(app) as base, browser_page(chromium, **PHONE) as page:
            await wait_until(lambda: _invoice(outbox, invoices), timeout=10)
            await wait_until(lambda: _abandoned(outbox, refused), timeout=10)
            await page.goto(f"{base}/outbox/dashboard")
            await page.locator("tr", has_text="billing-with-a-long-group-name").wait_for()
            await page.locator("button[data-all-abandoned]").wait_for()
            await _fits(page, "overview-390")
            # One meaning per word: the navigation's link is the relay's abandoned messages.
            nav = await page.locator("header nav").inner_text()
            assert "Abandoned" in nav and "Dead letters" not in nav
            consumers = page.locator("section", has_text="Consumers")
            assert "Dead letters" in (await consumers.locator("thead").text_content() or "")

            await page.goto(f"{base}/outbox/dashboard/messages")
            await page.locator("#messages").wait_for()
            await _fits(page, "messages-390")

            invoice = await _invoice(outbox, invoices)
            await page.goto(f"{base}/outbox/dashboard/messages/{invoice}")
            link = page.locator("table.kv tr", has_text="causation-id").locator("a")
            assert await link.inner_text() == str(placed)
            await _fits(page, "message-390")
            await link.click()
            await page.wait_for_url(re.compile(f"/messages/{placed}$"))
            assert "order-7" in await page.locator("dl.facts").inner_text()
            # The first message of the flow names no other message: nothing to link.
            assert await page.locator("table.kv a").count() == 0
    finally:
        await outbox.aclose()


async def _abandoned(outbox: Outbox, message_id: Any) -> bool:
    row = await outbox.store.messages.get(message_id)
    return row is not None and row["status"] == "abandoned"


async def _invoice(outbox: Outbox, stream: str) -> str | None:
    from fastapi_outbox.ops import operations

    rows = await operations.list_messages(outbox, operations.MessageFilter(stream=stream))
    return str(rows[0]["id"]) if rows else None

"""Screenshots of the operator dashboard for the docs (tutorial, operations):
``nox -s screenshots``, or ``python docs/screenshots.py`` (needs Chromium:
``apt-get install chromium``).

Serves a demo outbox on SQLite (some published traffic over the last hour, a failing
message, abandoned messages, scheduled ones, and a billing subscriber that handled orders
and dead-lettered a poison one) on a free loopback port and saves
``docs/dashboard-overview.png`` and ``docs/dashboard-message.png``.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import random
import sys
import tempfile
from pathlib import Path

from fastapi import FastAPI
from sqlalchemy import update

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fastapi_outbox import Message, Outbox, OutboxSettings, UnitOfWork  # noqa: E402
from fastapi_outbox.brokers import MemoryBroker  # noqa: E402
from tests.browser.conftest import CHROMIUM, browser_page, live_server  # noqa: E402


async def demo_outbox(path: Path) -> tuple[Outbox, str]:
    outbox = Outbox(
        f"sqlite+aiosqlite:///{path}",
        brokers={"default": MemoryBroker(), "partner": MemoryBroker()},
        settings=OutboxSettings(run_relays=False),
        dashboard_dependencies=[],
    )
    await outbox.create_tables()
    await run_billing(outbox)
    rng = random.Random(7)
    now = dt.datetime.now(dt.UTC)
    streams = ["orders", "invoices", "shipments"]
    async with outbox.unit_of_work() as uow:
        for i in range(900):
            uow.publish(
                Message(rng.choice(streams), "OrderPlaced", {"order_id": i, "total": 42.5}),
                key=f"order-{i}",
            )
        dead = uow.publish(
            Message(
                "shipments",
                "ShipmentRequested",
                {"order_id": 4711, "address": {"city": "Lyon", "zip": "69002"}, "items": 3},
                headers={"x-tenant": "acme"},
            ),
            key="order-4711",
            broker="partner",
        )
    async with outbox.unit_of_work() as uow:  # scheduled: delayed, not due yet
        for i in range(4):
            uow.publish(
                Message("invoices", "PaymentReminder", {"invoice_id": i}),
                delay=dt.timedelta(hours=2 + i),
            )
    t = outbox.table
    async with outbox.engine.begin() as conn:
        rows = (
            (
                await conn.execute(
                    t.select().with_only_columns(t.c.id).where(t.c.status == "pending")
                )
            )
            .scalars()
            .all()
        )
        for message_id in rows[:860]:
            at = now - dt.timedelta(minutes=rng.triangular(0, 60, 8))
            await conn.execute(
                update(t).where(t.c.id == message_id).values(status="published", published_at=at)
            )
        for message_id in rows[860:866]:
            await conn.execute(
                update(t)
                .where(t.c.id == message_id)
                .values(
                    status="abandoned",
                    abandoned_at=now,
                    attempts=10,
                    last_error="MessageRejected: Redis refused message: ERR stream is full",
                )
            )
        await conn.execute(
            update(t)
            .where(t.c.id == dead)
            .values(
                status="abandoned",
                attempts=10,
                abandoned_at=now,
                last_error="MessageRejected: JetStream refused message on subject 'shipments': "
                "maximum payload exceeded",
            )
        )
        await conn.execute(
            update(t)
            .where(t.c.id == rows[866])
            .values(status="failed", attempts=3, last_error="MessageRejected: timeout")
        )
    return outbox, str(dead)


async def run_billing(outbox: Outbox) -> None:
    """A billing subscriber handles 40 orders, one of them poison (dead-lettered)."""
    handled: list[int] = []

    @outbox.subscriber("orders", group="billing", max_attempts=1, start="all")
    async def bill(message: Message, uow: UnitOfWork) -> None:
        if message.payload["order_id"] == 13:
            raise ValueError("order 13 has no customer")
        handled.append(message.payload["order_id"])

    async with outbox.unit_of_work() as uow:
        for i in range(40):
            uow.publish(Message("orders", "OrderPlaced", {"order_id": i, "total": 10.0}))
    async with outbox.relaying():
        for _ in range(500):  # bounded: 10 s
            if len(handled) >= 39:
                break
            await asyncio.sleep(0.02)
    t = outbox.table
    async with outbox.engine.begin() as conn:  # the demo's chart is made below
        await conn.execute(t.delete())


async def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        outbox, dead = await demo_outbox(Path(tmp) / "demo.db")
        app = FastAPI()
        app.include_router(outbox.dashboard_router)
        try:
            async with live_server(app) as base, browser_page(CHROMIUM) as page:
                await page.goto(f"{base}/outbox/dashboard")
                await page.screenshot(
                    path=str(ROOT / "docs/dashboard-overview.png"), full_page=True
                )
                await page.goto(f"{base}/outbox/dashboard/messages/{dead}")
                await page.screenshot(path=str(ROOT / "docs/dashboard-message.png"), full_page=True)
        finally:
            await outbox.aclose()
    print("wrote docs/dashboard-overview.png and docs/dashboard-message.png")


if __name__ == "__main__":
    asyncio.run(main())

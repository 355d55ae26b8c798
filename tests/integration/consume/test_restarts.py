"""Normal stops never charge an attempt, on every broker: a subscriber stopped again and
again while its handlers run (cancelled at the stop) and deliveries wait in its prefetch,
with ``max_attempts=3``, dead-letters nothing, and every effect happens once when it runs
to the end. Old code on RabbitMQ requeued the released messages while the channel still
consumed (each came straight back and was returned again, its count raised), on NATS each
``nak`` counted a delivery: past three stops they were dead-lettered unhandled."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

from fastapi_outbox import Outbox, OutboxSettings, UnitOfWork
from tests.conftest import wait_until
from tests.integration.consume.test_consumer_contract import (
    FAST,
    Base,
    Harness,
    Invoice,
    effects,
    events_for,
    harness,
)

__all__ = ["harness"]

pytestmark = pytest.mark.usefixtures("quick_fetch")

MESSAGES = 40
STOPS = 4


@pytest.fixture
async def closing() -> AsyncIterator[list[Outbox]]:
    opened: list[Outbox] = []
    yield opened
    for outbox in opened:
        await outbox.aclose()


async def test_normal_stops_charge_no_attempt(harness: Harness, closing: list[Outbox]) -> None:
    h = harness
    # SQLite (the memory broker's database) has one writer: one handler in its transaction.
    busy = 1 if h.kind == "memory" else 2
    stream = h.stream()
    OrderPlaced, _ = events_for(stream)
    started: dict[str, int] = {}
    blocked = {"on": True}

    async def bill(event: Any, uow: UnitOfWork) -> None:
        assert uow.causation_id is not None
        started[uow.causation_id] = started.get(uow.causation_id, 0) + 1
        if blocked["on"]:
            await anyio.sleep_forever()  # cancelled by the stop
        uow.session.add(Invoice(order_id=event.order_id, message_id=uow.causation_id))

    bill.__annotations__["event"] = OrderPlaced

    def new_outbox() -> Outbox:
        assert h.twin is not None
        outbox = Outbox(
            h.db_url,
            brokers={"default": h.twin()},
            settings=OutboxSettings(
                **{**FAST, "shutdown_timeout_seconds": 1.0, "consumer_concurrency": 2}
            ),
        )
        outbox.subscriber(stream, group="billing", start="all", batch=False)(bill)
        closing.append(outbox)
        return outbox

    first = new_outbox()
    async with first.engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    await first.create_tables()
    async with first.unit_of_work() as uow:
        ids = [str(uow.publish(OrderPlaced(order_id=n))) for n in range(MESSAGES)]
    for stop in range(STOPS):
        outbox = first if stop == 0 else new_outbox()
        runs = sum(started.values())
        async with outbox.relaying():
            # The handlers blocked on a message each, the rest waiting in the prefetch.
            await wait_until(lambda: sum(started.values()) >= runs + busy, timeout=20)  # noqa: B023
        assert outbox.subscribers[0].stats.dead_lettered == 0
    blocked["on"] = False
    last = new_outbox()
    async with last.relaying():

        async def all_handled() -> bool:
            rows = await effects(last)
            return all(m in rows for m in ids)

        await wait_until(all_handled, timeout=30)
        rows = await effects(last)
        assert {m: rows[m] for m in ids} == dict.fromkeys(ids, 1)
        sub = last.subscribers[0]
        assert sub.stats.dead_lettered == 0
        assert sub.consumer is not None
        assert await sub.consumer.count_dead_letters() == 0
    # Each stop cancelled handlers: more runs than messages, none of them charged.
    assert sum(started.values()) >= MESSAGES + STOPS

"""``retry_deadline_seconds``: a message not published that long after its commit is
abandoned, with a last_error saying so, even with attempts left — whether it kept failing
or its broker was down the whole time."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from fastapi_outbox import Message, MessageRejected, Outbox, OutboxSettings
from fastapi_outbox.brokers import MemoryBroker
from tests.conftest import unique, wait_until

pytestmark = pytest.mark.mariadb

FAST = {
    "poll_interval_seconds": 0.05,
    "max_poll_interval_seconds": 0.2,
    "broker_backoff_max_seconds": 0.1,
    "retry_base_delay_seconds": 0.05,
    "retry_max_delay_seconds": 0.1,
    "max_attempts": 1000,
}


async def row(outbox: Outbox, message_id: object) -> dict[str, object]:
    t = outbox.table
    async with outbox.engine.connect() as conn:
        found = (
            await conn.execute(
                select(t.c.status, t.c.attempts, t.c.last_error).where(t.c.id == message_id)
            )
        ).one()
    return dict(found._mapping)


@pytest.mark.parametrize("failure", ["refused", "broker down"])
async def test_message_past_its_deadline_is_abandoned_with_attempts_left(
    db_url: str, failure: str
) -> None:
    broker = MemoryBroker(reject=lambda e: MessageRejected("nope") if e.type == "Doomed" else None)
    outbox = Outbox(
        db_url,
        brokers={"default": broker},
        settings=OutboxSettings(retry_deadline_seconds=0.6, **FAST),
    )
    await outbox.create_tables()
    stream = unique("orders")
    try:
        async with outbox.relaying():
            if failure == "broker down":
                broker.available = False
            async with outbox.unit_of_work() as uow:
                doomed = uow.publish(
                    Message(stream, "Doomed" if failure == "refused" else "Fine", {})
                )

            async def abandoned() -> bool:
                return (await row(outbox, doomed))["status"] == "abandoned"

            await wait_until(abandoned, timeout=10)
            found = await row(outbox, doomed)
            assert "retry deadline of 0.6s passed" in str(found["last_error"])
            assert int(found["attempts"]) < 1000  # type: ignore[call-overload]
            broker.available = True
            # A message committed now is within its deadline and goes out.
            async with outbox.unit_of_work() as uow:
                fresh = uow.publish(Message(stream, "Fine", {"n": 2}))
            await wait_until(lambda: any(m.id == str(fresh) for m in broker.messages))
        assert all(m.id != str(doomed) for m in broker.messages)
    finally:
        await outbox.aclose()


def test_deadline_must_be_positive() -> None:
    with pytest.raises(ValueError, match="retry_deadline_seconds"):
        OutboxSettings(retry_deadline_seconds=0)

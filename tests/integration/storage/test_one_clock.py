"""One clock: every due time, deadline and age is the database's, whatever the clock of the
process that writes, dispatches or observes, since hosts' clocks drift apart.

Each test shifts the library's clock (``fastapi_outbox.storage.clock.wall``, the one seam through
which the library reads its host's time) 120 s ahead or behind the database's and checks
what the database stores and what the relay does: nothing abandoned early, nothing
due early or late, ages and retention cutoffs as the database counts them."""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

import pytest
from sqlalchemy import select, update

from fastapi_outbox import Message, MessageRejected, Outbox, OutboxSettings
from fastapi_outbox.brokers import MemoryBroker
from fastapi_outbox.storage import clock
from tests.conftest import unique, wait_until

pytestmark = pytest.mark.mariadb

SKEW = 120.0
#: The retry deadline: far below SKEW, so either clock error would show (abandoned at the
#: first claim, or 120 s late), and long enough for the first claim to come before it.
DEADLINE = 2.0

FAST = {
    "poll_interval_seconds": 0.05,
    "max_poll_interval_seconds": 0.2,
    "broker_backoff_max_seconds": 0.1,
    "retry_base_delay_seconds": 0.05,
    "retry_max_delay_seconds": 0.1,
    "max_attempts": 1000,
}


@pytest.fixture(params=[SKEW, -SKEW], ids=["ahead", "behind"])
def skew(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> float:
    """The library's clock, ``request.param`` seconds off the database's."""
    shift = float(request.param)
    monkeypatch.setattr(clock, "wall", lambda: time.time() + shift)
    return shift


async def row(outbox: Outbox, message_id: object) -> dict[str, Any]:
    t = outbox.table
    async with outbox.engine.connect() as conn:
        found = (await conn.execute(select(t).where(t.c.id == message_id))).one()
    return dict(found._mapping)


async def test_the_seam_shifts_the_library_clock(skew: float) -> None:
    assert abs(clock.wall() - time.time() - skew) < 5


async def test_retry_deadline_is_counted_by_the_database(db_url: str, skew: float) -> None:
    """Ahead: a fresh message is not abandoned at its first claim (the host's clock says
    it is 120 s old). Behind: a message past its deadline is abandoned then, not 120 s
    later."""
    broker = MemoryBroker(reject=lambda e: MessageRejected("nope") if e.type == "Doomed" else None)
    outbox = Outbox(
        db_url,
        brokers={"default": broker},
        settings=OutboxSettings(retry_deadline_seconds=DEADLINE, **FAST),
    )
    await outbox.create_tables()
    stream = unique("orders")
    try:
        async with outbox.relaying():
            async with outbox.unit_of_work() as uow:
                fine = uow.publish(Message(stream, "Fine", {}))
                doomed = uow.publish(Message(stream, "Doomed", {}))
            await wait_until(lambda: any(m.id == str(fine) for m in broker.messages), timeout=30)

            async def abandoned() -> bool:
                return (await row(outbox, doomed))["status"] == "abandoned"

            # DEADLINE s of the database's clock; the behind-clock relay of the old
            # code waited 120 s more.
            await wait_until(abandoned, timeout=60)
        assert (await row(outbox, fine))["status"] == "published"
        doomed_row = await row(outbox, doomed)
        assert f"retry deadline of {DEADLINE:g}s passed" in doomed_row["last_error"]
        # Abandoned by the database's clock: DEADLINE s after its commit or later, never before.
        assert doomed_row["abandoned_at"] >= doomed_row["created_at"] + dt.timedelta(
            seconds=DEADLINE
        )
    finally:
        await outbox.aclose()


async def test_deliver_at_and_delay_are_due_by_the_database_clock(db_url: str, skew: float) -> None:
    """``deliver_at`` is stored as given and compared with the database's clock; a delay
    counts from the commit on the database's clock. Neither goes out before it is due
    (ahead: the old code found a deliver_at 1 s away already past) nor 120 s late
    (behind)."""
    broker = MemoryBroker()
    outbox = Outbox(db_url, brokers={"default": broker}, settings=OutboxSettings(**FAST))
    await outbox.create_tables()
    stream = unique("reminders")
    try:
        at = await outbox.store.messages.now() + dt.timedelta(seconds=1)
        async with outbox.unit_of_work() as uow:
            scheduled = uow.publish(Message(stream, "At", {}), deliver_at=at)
            delayed = uow.publish(Message(stream, "Later", {}), delay=1.0)
        at_row, delayed_row = await row(outbox, scheduled), await row(outbox, delayed)
        # Stored as given (to SQLite's millisecond), and the delay from the commit.
        assert abs(at_row["next_attempt_at"] - at) < dt.timedelta(milliseconds=1)
        assert delayed_row["next_attempt_at"] >= delayed_row["created_at"] + dt.timedelta(seconds=1)
        assert (await outbox.store.messages.stats())["default"].scheduled == 2
        due = {str(scheduled), str(delayed)}

        async def both_out() -> bool:
            return due <= {m.id for m in broker.messages}

        async with outbox.relaying():
            await wait_until(both_out, timeout=60)
        for message_id in (scheduled, delayed):
            sent = await row(outbox, message_id)
            assert (
                sent["published_at"]
                >= (at_row if message_id == scheduled else delayed_row)["next_attempt_at"]
            )
    finally:
        await outbox.aclose()


async def test_backoff_lease_age_and_retention_use_the_database_clock(
    db_url: str, skew: float
) -> None:
    """Statements the relay, health and retention run: a lease and a backoff due time
    start at the database's now; the pending age is counted from it; retention's cutoff
    is the database's now minus the retention."""
    outbox = Outbox(db_url, brokers={"default": MemoryBroker()}, settings=OutboxSettings(**FAST))
    await outbox.create_tables()
    store, t = outbox.store, outbox.table
    stream = unique("s")
    try:
        async with outbox.unit_of_work() as uow:
            first = uow.publish(Message(stream, "A", {}))
            uow.publish(Message(stream, "B", {}))
        # Pending age: the rows are due since their commit, a moment ago.
        stats = (await store.messages.stats())["default"]
        assert stats.pending == 2
        assert stats.oldest_pending_age_seconds is not None
        assert 0 <= stats.oldest_pending_age_seconds < SKEW / 2
        assert stats.scheduled == 0

        before = await store.messages.now()
        claimed = await store.claims.claim("default", 10, "w:1", lease_seconds=30.0)
        after = await store.messages.now()
        assert {r.id for r in claimed} >= {first}
        assert all(r.age_seconds is not None and 0 <= r.age_seconds < SKEW / 2 for r in claimed)
        leased = await row(outbox, first)
        lease = dt.timedelta(seconds=30)
        assert before + lease <= leased["locked_until"] + dt.timedelta(milliseconds=1)
        assert leased["locked_until"] <= after + lease
        # A lease that ran out on the database's clock is claimable again (stale lock).
        assert await store.claims.claim("default", 10, "w:2", lease_seconds=30.0) == []

        from fastapi_outbox.storage.store import Failure

        others = [r.id for r in claimed if r.id != first]
        await store.claims.mark_failed([Failure(first, "refused", 20.0, abandon=False)], "w:1")
        failed = await row(outbox, first)
        assert failed["status"] == "failed"
        backoff = dt.timedelta(seconds=20)
        assert before + backoff <= failed["next_attempt_at"] + dt.timedelta(milliseconds=1)
        assert failed["next_attempt_at"] <= await store.messages.now() + backoff
        assert (await store.claims.next_due_in("default")) is not None

        await store.claims.mark_published(others, "w:1")
        published = await row(outbox, others[0])
        assert before <= published["published_at"] + dt.timedelta(milliseconds=1)
        assert published["published_at"] <= await store.messages.now()
        # Retention: a row published a moment ago is kept by a 60 s retention; one
        # published 90 s ago (by the database's clock) goes.
        assert await store.retention.purge_batch("published", 60.0, 100) == 0
        async with outbox.engine.begin() as conn:
            await conn.execute(
                update(t)
                .where(t.c.id == others[0])
                .values(published_at=clock.db_later(store.engine.dialect.name, seconds=-90.0))
            )
        assert await store.retention.purge_batch("published", 60.0, 100) == 1
    finally:
        await outbox.aclose()


async def test_inbox_retention_uses_the_database_clock(db_url: str, skew: float) -> None:
    """``handled_at`` is written by the database and the inbox retention's cutoff is the
    database's now minus the retention: ahead, the old code deleted a fresh row."""
    outbox = Outbox(db_url, brokers={"default": MemoryBroker()}, settings=OutboxSettings(**FAST))
    await outbox.create_tables()
    inbox, t = outbox.inbox, outbox.inbox.table
    try:
        async with outbox.session_factory() as session, session.begin():
            assert await inbox.record(session, "billing", "m-1", "orders")
            assert await inbox.record_many(session, "billing", ["m-2", "m-3"], "orders") == {
                "m-2",
                "m-3",
            }
        before = await outbox.store.messages.now()
        async with outbox.engine.connect() as conn:
            handled = [r[0] for r in await conn.execute(select(t.c.handled_at))]
        assert len(handled) == 3
        assert all(abs(h - before) < dt.timedelta(seconds=SKEW / 2) for h in handled)
        assert await inbox.purge_batch(60.0, 100) == 0
        async with outbox.engine.begin() as conn:
            await conn.execute(
                update(t)
                .where(t.c.message_id == "m-1")
                .values(handled_at=clock.db_later(outbox.engine.dialect.name, seconds=-90.0))
            )
        assert await inbox.purge_batch(60.0, 100) == 1
    finally:
        await outbox.aclose()

"""/outbox/health fit for probes: 503 only for what restarting this process cures.

- a broker outage (unreachable or refusing) is ``degraded`` (HTTP 200) with how long the
  broker has been down, however long it lasts — pending rows pile up on purpose;
- a due row that waits for a table_relay of this process that could take it (its broker
  reachable) longer than ``health_max_pending_age_seconds`` is ``down`` (503);
- the wait is counted from the commit, not from the producer's transaction start;
- in ordered mode, rows held back behind a failing message of their key do not count.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

import anyio
from sqlalchemy import select, update

from fastapi_outbox import BrokerRefusing, Message, MessageRejected, Outbox, OutboxSettings
from fastapi_outbox.brokers import MemoryBroker
from fastapi_outbox.events import Envelope
from tests.conftest import asgi_client, unique, wait_until
from tests.integration.ops.test_health import build_app, publish


class RefusingBroker(MemoryBroker):
    """Answers, but refuses every message like a Redis at maxmemory while ``full``."""

    full = False

    async def publish(self, batch: Sequence[Envelope]) -> Any:
        if self.full:
            self.publish_calls += 1
            raise BrokerRefusing("OOM command not allowed when used memory > 'maxmemory'")
        return await super().publish(batch)


class StuckBroker(MemoryBroker):
    """Its first publish never returns (within the test): a stuck relay."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = anyio.Event()

    async def publish(self, batch: Sequence[Envelope]) -> Any:
        self.entered.set()
        await anyio.sleep_forever()


async def test_broker_outage_is_degraded_with_its_duration_never_503(db_url: str) -> None:
    broker = RefusingBroker()
    broker.full = True
    outbox = Outbox(
        db_url,
        brokers={"default": broker},
        settings=OutboxSettings(
            health_cache_seconds=0,
            health_max_pending_age_seconds=0.3,
            poll_interval_seconds=0.05,
            broker_backoff_max_seconds=1.5,
        ),
    )
    await outbox.create_tables()
    try:
        async with asgi_client(build_app(outbox)) as client:
            await publish(outbox, unique("orders"), 3)

            async def outage_longer_than_threshold() -> bool:
                body = (await client.get("/outbox/health")).json()
                p = body["relays"][0]
                return (p["broker_down_seconds"] or 0) > 0.6 and (
                    p["oldest_pending_age_seconds"] or 0
                ) > 0.3

            await wait_until(outage_longer_than_threshold)
            response = await client.get("/outbox/health")
            body = response.json()
            assert response.status_code == 200, body
            assert body["status"] == "degraded"
            p = body["relays"][0]
            assert p["broker_available"] is False
            assert p["broker_down_since"] is not None
            assert any("refusing messages for" in r for r in body["reasons"]), body
            # Nothing was charged for the outage.
            async with outbox.engine.connect() as conn:
                rows = (await conn.execute(select(outbox.table.c.status))).all()
            assert {r.status for r in rows} == {"pending"}

            broker.full = False
            await broker.wait_for(3)
            await wait_until(
                lambda: _status(client, "ok"),
            )
            body = (await client.get("/outbox/health")).json()
            assert body["relays"][0]["broker_down_seconds"] is None
    finally:
        await outbox.aclose()


async def _status(client: Any, expected: str) -> bool:
    return bool((await client.get("/outbox/health")).json()["status"] == expected)


async def test_a_stuck_relay_with_a_reachable_broker_is_503(db_url: str) -> None:
    broker = StuckBroker()
    outbox = Outbox(
        db_url,
        brokers={"default": broker},
        settings=OutboxSettings(
            health_cache_seconds=0,
            health_max_pending_age_seconds=0.3,
            workers=1,
            batch_size=1,
            publish_timeout_seconds=30,
            lease_seconds=60,
            shutdown_timeout_seconds=0.5,
        ),
    )
    await outbox.create_tables()
    try:
        async with asgi_client(build_app(outbox)) as client:
            await publish(outbox, unique("orders"), 2)
            with anyio.fail_after(10):
                await broker.entered.wait()

            async def down() -> bool:
                return (await client.get("/outbox/health")).status_code == 503

            await wait_until(down)
            body = (await client.get("/outbox/health")).json()
            assert body["status"] == "down"
            assert body["relays"][0]["broker_available"] is True
            assert body["relays"][0]["oldest_pending_age_seconds"] > 0.3
            assert any("has waited" in r for r in body["reasons"]), body
    finally:
        await outbox.aclose()


async def test_wait_counts_from_the_commit_not_the_transaction_start(pg_url: str) -> None:
    """A producer transaction open for a while: its row is new at commit."""
    outbox = Outbox(
        pg_url,
        brokers={"default": MemoryBroker()},
        settings=OutboxSettings(run_relays=False),
    )
    await outbox.create_tables()
    try:
        async with outbox.unit_of_work() as uow:
            await uow.session.execute(select(1))  # the transaction has begun
            started = dt.datetime.now(dt.UTC)
            await wait_until(lambda: dt.datetime.now(dt.UTC) - started > dt.timedelta(seconds=1))
            uow.publish(Message(stream=unique("orders"), type="Thing", payload={}))
        stats = (await outbox.store.messages.stats(["default"]))["default"]
        assert stats.pending == 1
        assert stats.oldest_pending_age_seconds is not None
        assert stats.oldest_pending_age_seconds < 0.9, stats
        async with outbox.engine.connect() as conn:
            created, due = (
                await conn.execute(
                    select(outbox.table.c.created_at, outbox.table.c.next_attempt_at)
                )
            ).one()
        assert (due - created).total_seconds() >= 1.0  # created_at keeps the event's time
    finally:
        await outbox.aclose()


async def test_ordered_rows_behind_a_failing_message_do_not_count(db_url: str) -> None:
    key = "order-1"
    broker = MemoryBroker(reject=lambda e: MessageRejected("no") if e.key == key else None)
    outbox = Outbox(
        db_url,
        brokers={"default": broker},
        settings=OutboxSettings(ordered=True, run_relays=False),
    )
    await outbox.create_tables()
    stream = unique("orders")
    an_hour_ago = dt.datetime.now(dt.UTC) - dt.timedelta(hours=1)
    try:
        async with outbox.unit_of_work() as uow:
            for i in range(3):
                uow.publish(Message(stream=stream, type="Thing", payload={"i": i}, key=key))
        table = outbox.table
        async with outbox.engine.begin() as conn:
            first = (
                await conn.execute(select(table.c.id).order_by(table.c.seq, table.c.id).limit(1))
            ).scalar_one()
            # The first message of the key fails (backing off); the two behind it have been
            # due for an hour, but they wait for it, not for a relay.
            await conn.execute(update(table).values(next_attempt_at=an_hour_ago))
            await conn.execute(
                update(table)
                .where(table.c.id == first)
                .values(status="failed", next_attempt_at=an_hour_ago + dt.timedelta(hours=2))
            )
        stats = (await outbox.store.messages.stats(["default"], ordered=True))["default"]
        assert stats.pending == 2 and stats.failed == 1
        assert stats.oldest_pending_age_seconds is None
        # Without the ordered rule they would count.
        plain = (await outbox.store.messages.stats(["default"]))["default"]
        assert plain.oldest_pending_age_seconds is not None
        assert plain.oldest_pending_age_seconds > 3500
        # A row of another key that is due does count.
        async with outbox.unit_of_work() as uow:
            uow.publish(Message(stream=stream, type="Thing", payload={}, key="other"))
        async with outbox.engine.begin() as conn:
            await conn.execute(
                update(table).where(table.c.key == "other").values(next_attempt_at=an_hour_ago)
            )
        stats = (await outbox.store.messages.stats(["default"], ordered=True))["default"]
        assert stats.oldest_pending_age_seconds is not None
        assert stats.oldest_pending_age_seconds > 3500
    finally:
        await outbox.aclose()

"""Delayed messages: ``publish(delay=…)`` / ``publish(deliver_at=…)``, ``scheduled``
counts, and ``outbox.cancel()`` fenced against a concurrent claim."""

from __future__ import annotations

import datetime as dt
import json
import math
import re
import time
import uuid
from typing import Any

import pytest

from fastapi_outbox import Message, Outbox, OutboxSettings, PublishError
from fastapi_outbox.brokers import MemoryBroker, RedisStreamsBroker
from fastapi_outbox.exceptions import MessageNotFound, TooLate
from fastapi_outbox.storage.filters import MessageFilter
from tests.conftest import unique, wait_until

pytestmark = pytest.mark.mariadb

DELAY = 1.2


def msg(stream: str, n: int = 0) -> Message:
    return Message(stream, "Reminder", {"n": n})


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"delay": 5, "deliver_at": dt.datetime.now(dt.UTC)}, "not both"),
        ({"deliver_at": dt.datetime(2030, 1, 1)}, "timezone-aware"),
        ({"delay": -1}, "delay must be >= 0"),
        ({"delay": math.nan}, "delay must be >= 0"),
        ({"delay": "5"}, "seconds or a timedelta"),
        ({"delay": dt.timedelta(days=31)}, "max_delay_seconds"),
        ({"deliver_at": dt.datetime.now(dt.UTC) + dt.timedelta(days=40)}, "max_delay_seconds"),
    ],
)
async def test_bad_delays_are_refused_where_made_and_write_nothing(
    sqlite_url: str, kwargs: dict[str, Any], needle: str
) -> None:
    outbox = Outbox(sqlite_url, brokers={"default": MemoryBroker()})
    await outbox.create_tables()

    async def publish_both() -> None:
        async with outbox.unit_of_work() as uow:
            uow.publish(msg(unique("s")))
            uow.publish(msg(unique("s")), **kwargs)

    try:
        with pytest.raises(PublishError, match=needle):
            await publish_both()
        assert await outbox.store.messages.count() == 0
    finally:
        await outbox.aclose()


async def test_a_delayed_message_is_not_published_before_it_is_due(db_url: str) -> None:
    broker = MemoryBroker()
    # Regular idle polls far apart: any claim before the due time would be a wake-up.
    outbox = Outbox(
        db_url,
        brokers={"default": broker},
        settings=OutboxSettings(poll_interval_seconds=10, max_poll_interval_seconds=10),
    )
    await outbox.create_tables()
    stream = unique("reminders")
    claims: list[float] = []
    in_flight: list[int] = []  # sizes of claims still running, then of the finished ones
    claim = outbox.store.claims.claim

    async def counting(*args: Any, **kw: Any) -> Any:
        claims.append(time.monotonic())
        in_flight.append(-1)
        rows = await claim(*args, **kw)
        in_flight[in_flight.index(-1)] = len(rows)
        return rows

    async def idle() -> bool:
        # Every claim so far has returned, and the last one found nothing.
        return bool(in_flight) and -1 not in in_flight and in_flight[-1] == 0

    outbox.store.claims.claim = counting  # type: ignore[method-assign]
    try:
        async with outbox.relaying():
            async with outbox.unit_of_work() as uow:
                now_id = uow.publish(msg(stream, 1))
            await broker.wait_for(1)
            assert broker.messages[0].id == str(now_id)
            await wait_until(idle, timeout=5)

            claims.clear()
            async with outbox.unit_of_work() as uow:
                later = uow.publish(msg(stream, 2), delay=DELAY)
                at = uow.publish(
                    msg(stream, 3), deliver_at=dt.datetime.now(dt.UTC) + dt.timedelta(seconds=DELAY)
                )
            committed = time.monotonic()
            stats = (await outbox.store.messages.stats(["default"]))["default"]
            assert (stats.pending, stats.scheduled) == (2, 2)

            await broker.wait_for(3, timeout=DELAY + 5)
            arrived = time.monotonic()
            await broker.wait_for(3)
            assert {m.id for m in broker.messages[1:]} == {str(later), str(at)}
            assert arrived - committed >= DELAY - 0.05
            assert arrived - committed < DELAY + 2.0
            # No claim while nothing was due: the commit did not wake the workers.
            early = [c for c in claims if c < committed + DELAY - 0.1]
            assert early == [], f"{len(early)} claims before the messages were due"
    finally:
        await outbox.aclose()


@pytest.mark.redis
async def test_delayed_message_reaches_redis_when_due(pg_url: str, redis_url: str) -> None:
    import redis.asyncio as aioredis

    stream = unique("reminders")
    outbox = Outbox(pg_url, brokers={"default": RedisStreamsBroker(redis_url)})
    await outbox.create_tables()
    client = aioredis.Redis.from_url(redis_url)
    try:
        async with outbox.relaying():
            async with outbox.unit_of_work() as uow:
                uow.publish(msg(stream), delay=DELAY)
            committed = time.monotonic()

            async def arrived() -> bool:
                return int(await client.xlen(stream)) == 1

            await wait_until(arrived, timeout=DELAY + 5, interval=0.02)
            assert time.monotonic() - committed >= DELAY - 0.05
    finally:
        await client.aclose()
        await outbox.aclose()


async def test_cancel_before_the_claim_and_too_late_after_it(db_url: str) -> None:
    outbox = Outbox(
        db_url, brokers={"default": MemoryBroker()}, settings=OutboxSettings(run_relays=False)
    )
    await outbox.create_tables()
    stream = unique("reminders")
    try:
        async with outbox.unit_of_work() as uow:
            scheduled = uow.publish(msg(stream, 1), delay=3600)
            due = uow.publish(msg(stream, 2))
        listed = await outbox.store.messages.list_messages(
            MessageFilter(status="scheduled", stream=stream)
        )
        assert [r["id"] for r in listed] == [scheduled]

        await outbox.cancel(scheduled)
        assert await outbox.store.messages.get(scheduled) is None
        with pytest.raises(MessageNotFound, match=str(scheduled)):
            await outbox.cancel(scheduled)

        # A relay claims it first: the cancel is too late and changes nothing.
        (claimed,) = await outbox.store.claims.claim("default", 10, "worker:1", 30)
        assert claimed.id == due
        with pytest.raises(TooLate, match=f"too late: message {due} is processing"):
            await outbox.cancel(due)
        row = await outbox.store.messages.get(due)
        assert row is not None and row["locked_by"] == "worker:1"
        with pytest.raises(MessageNotFound):
            await outbox.cancel(uuid.uuid4())
    finally:
        await outbox.aclose()


async def test_scheduled_messages_in_status_list_dashboard_and_cli_cancel(pg_url: str) -> None:
    """A delayed message shows as scheduled in ``status``, ``list --status scheduled`` and
    the dashboard, and ``fastapi-outbox cancel ID`` cancels it (then: not found, exit 1)."""
    from fastapi import FastAPI

    from tests.conftest import asgi_client, run_cli

    outbox = Outbox(
        pg_url,
        brokers={"default": MemoryBroker()},
        settings=OutboxSettings(run_relays=False),
        dashboard_dependencies=[],
    )
    await outbox.create_tables()
    stream = unique("reminders")
    try:
        async with outbox.unit_of_work() as uow:
            later = uow.publish(msg(stream, 1), delay=3600)
            uow.publish(msg(stream, 2))
        status = run_cli("status", "--url", pg_url, "--json")
        assert status.returncode == 0, status.stderr
        [row] = json.loads(status.stdout)
        assert (row["pending"], row["scheduled"]) == (2, 1)
        listed = run_cli("list", "--url", pg_url, "--status", "scheduled", "--json")
        assert [r["id"] for r in json.loads(listed.stdout)] == [str(later)]

        app = FastAPI()
        app.include_router(outbox.dashboard_router)
        async with asgi_client(app) as client:
            page = await client.get("/outbox/dashboard")
            assert re.search(r'Scheduled</div><div class="value"><a [^>]*>1</a>', page.text)
            scheduled = await client.get("/outbox/dashboard/messages?status=scheduled")
            assert scheduled.status_code == 200
            assert str(later) in scheduled.text and "due " in scheduled.text
            stream_row = (await client.get("/outbox/dashboard/api/overview")).json()["streams"]
            assert [(s["stream"], s["scheduled"]) for s in stream_row] == [(stream, 1)]

        cancelled = run_cli("cancel", "--url", pg_url, str(later))
        assert cancelled.returncode == 0 and "cancelled 1 message(s)" in cancelled.stdout
        again = run_cli("cancel", "--url", pg_url, str(later))
        assert again.returncode == 1 and str(later) in again.stderr
        assert await outbox.store.messages.get(later) is None
    finally:
        await outbox.aclose()

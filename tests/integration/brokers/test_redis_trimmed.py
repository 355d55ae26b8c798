"""A Redis ``maxlen`` that trims entries a consumer group has not read loses them to the
group, silently on Redis's side. Health (consumer status and a reason, ``degraded``) and
the dashboard's consumers table show how many, on real Redis: while the group is behind
the trimmed part, and after it caught up (Redis then still counts the lost entries as
lag; the status shows them as trimmed, with the group's real lag)."""

from __future__ import annotations

import json
from typing import Any

import redis.asyncio as aioredis

from fastapi_outbox import Message, Outbox, OutboxSettings
from fastapi_outbox.brokers import RedisStreamsBroker
from fastapi_outbox.ops.health import compute_health
from fastapi_outbox.testing import drain
from tests.conftest import asgi_client, unique

MESSAGES = 350
MAXLEN = 10
#: Published, then read by the group that keeps up, at a time: fewer than MAXLEN, so
#: that group never falls behind the trimming.
BATCH = 5


async def test_entries_trimmed_before_a_group_read_them_show_in_health_and_dashboard(
    pg_url: str, redis_url: str
) -> None:
    stream = unique("orders")
    outbox = Outbox(
        pg_url,
        brokers={"default": RedisStreamsBroker(redis_url, maxlen=MAXLEN)},
        settings=OutboxSettings(run_relays=False),
        dashboard_dependencies=[],
    )
    handled: list[Any] = []

    @outbox.subscriber(stream, group="lagging", start="all")
    async def slow(message: Message) -> None:
        handled.append(message)

    @outbox.subscriber(stream, group="keeping-up", start="all")
    async def quick(message: Message) -> None:
        pass

    await outbox.create_tables()
    client = aioredis.Redis.from_url(redis_url)
    try:
        # Both groups exist before anything is published. "keeping-up" reads everything
        # as it comes; "lagging" reads nothing meanwhile.
        keeping_up = next(s for s in outbox.subscribers if s.group == "keeping-up")
        lagging = next(s for s in outbox.subscribers if s.group == "lagging")
        reader, consumer = keeping_up.make_consumer(), lagging.make_consumer()
        await reader.setup()
        await consumer.setup()
        for first in range(0, MESSAGES, BATCH):
            async with outbox.unit_of_work() as uow:
                for n in range(first, first + BATCH):
                    uow.publish(Message(stream, "OrderPlaced", {"n": n}))
            assert await drain(outbox) == BATCH
            got = await reader.fetch(BATCH, 1.0)
            assert len(got) == BATCH
            await reader.ack(got)
        length = await client.xlen(stream)
        assert length < MESSAGES  # MAXLEN trimmed the stream
        lost = MESSAGES - length

        health = await compute_health(outbox)
        by_group = {c.group: c for c in health.consumers}
        assert by_group["lagging"].trimmed == lost
        assert by_group["lagging"].lag == length  # what it can still read
        assert by_group["keeping-up"].trimmed == 0
        assert health.status == "degraded"
        [reason] = [r for r in health.reasons if "trimmed" in r]
        assert "'lagging'" in reason and f"{lost} entries trimmed" in reason

        app = _app(outbox)
        async with asgi_client(app) as http:
            page = await http.get("/outbox/dashboard")
            assert page.status_code == 200
            assert "Trimmed unread" in page.text
            assert f'<td class="n bad" data-label="Trimmed unread">{lost}</td>' in page.text
            body = (await http.get("/outbox/health")).json()
            assert {c["group"]: c["trimmed"] for c in body["consumers"]} == {
                "lagging": lost,
                "keeping-up": 0,
            }

        # The lagging group reads what is left: it has caught up, the loss stays shown.
        read = 0
        while read < length:
            got = await consumer.fetch(100, 1.0)
            assert got, "the lagging group should read the rest of the stream"
            read += len(got)
            await consumer.ack(got)
        assert read == length
        assert {json.loads(d.payload)["n"] for d in got} <= set(range(MESSAGES))
        status = {c.group: c for c in (await compute_health(outbox)).consumers}["lagging"]
        assert status.trimmed == lost and status.lag == 0
        await consumer.aclose()
        await reader.aclose()
    finally:
        await client.delete(stream)
        await client.aclose()
        await outbox.aclose()


def _app(outbox: Outbox) -> Any:
    from fastapi import FastAPI

    app = FastAPI()
    app.include_router(outbox.router)
    app.include_router(outbox.dashboard_router)
    return app


async def test_redis_keeps_the_loss_of_a_group_that_had_read(redis_url: str) -> None:
    """A group with a read counter keeps trimmed entries in Redis's lag after it caught up:
    ``trimmed_unread`` reads the loss from XINFO alone (any process sees it)."""
    from fastapi_outbox.brokers.redis.consumer import trimmed_unread

    stream = unique("trim")
    client = aioredis.Redis.from_url(redis_url)

    async def info() -> tuple[int | None, int | None]:
        [group] = await client.xinfo_groups(stream)
        return trimmed_unread(group, await client.xinfo_stream(stream))

    try:
        for n in range(5):
            await client.xadd(stream, {"n": n})
        await client.xgroup_create(stream, "g", id="0")
        await client.xreadgroup("g", "c", {stream: ">"}, count=2)  # read 2 of 5
        assert await info() == (0, 3)
        for n in range(5, 10):  # exact trimming to 3 entries: 2..6 go unread
            await client.xadd(stream, {"n": n}, maxlen=3, approximate=False)
        assert await info() == (5, 3)
        await client.xreadgroup("g", "c", {stream: ">"}, count=100)  # the last 3
        assert await info() == (5, 0)  # caught up: the loss stays, the lag is 0
    finally:
        await client.delete(stream)
        await client.aclose()

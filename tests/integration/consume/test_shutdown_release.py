"""A stopped subscriber releases every delivery it did not finish, on the real brokers.

A consumer holds five messages in its handlers (blocked on an event that never comes) when
it is stopped: its handlers are cancelled and their transactions roll back. With the default
``claim_idle_seconds`` (60 s), a second consumer of the group must get the five at once —
Redis: the entries are marked idle, so its ``XAUTOCLAIM`` takes them; NATS: they are
``nak``-ed — not after a minute. Run with five handlers each holding one message
(``batch=False``) and with one batch of five (the default).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

from fastapi_outbox import Message, Outbox, OutboxSettings
from tests.conftest import unique, wait_until

pytestmark = pytest.mark.usefixtures("quick_fetch")

COUNT = 5
#: The default: a consumer that did not release would leave the messages to the other one
#: for a minute.
CLAIM_IDLE = OutboxSettings().consumer_claim_idle_seconds


def make_broker(kind: str, url: str) -> Any:
    from fastapi_outbox.brokers import NatsJetStreamBroker, RedisStreamsBroker

    return RedisStreamsBroker(url) if kind == "redis" else NatsJetStreamBroker(url)


@contextlib.asynccontextmanager
async def cleanup(kind: str, url: str, stream: str) -> AsyncIterator[None]:
    try:
        yield
    finally:
        if kind == "redis":
            import redis.asyncio as aioredis

            client = aioredis.Redis.from_url(url)
            keys = [k async for k in client.scan_iter(match=f"{stream}*")]
            if keys:
                await client.delete(*keys)
            await client.aclose()
        else:
            import nats

            from fastapi_outbox.brokers.nats.wire import stream_name_for

            nc = await nats.connect(url)
            js = nc.jetstream()
            prefix = stream_name_for(stream)
            for info in await js.streams_info():
                if info.config.name.startswith(prefix):
                    with contextlib.suppress(Exception):
                        await js.delete_stream(info.config.name)
            await nc.close()


@pytest.fixture(params=["redis", "nats"])
def broker_url(request: pytest.FixtureRequest) -> tuple[str, str]:
    return request.param, str(request.getfixturevalue(f"{request.param}_url"))


def new_outbox(db_url: str, kind: str, url: str) -> Outbox:
    return Outbox(
        db_url,
        brokers={"default": make_broker(kind, url)},
        settings=OutboxSettings(poll_interval_seconds=0.05, shutdown_timeout_seconds=1.0),
    )


@pytest.mark.parametrize("batch", [False, True], ids=["one_by_one", "one_batch"])
async def test_a_stopped_consumer_releases_what_it_holds_to_the_next(
    pg_url: str, broker_url: tuple[str, str], batch: bool
) -> None:
    kind, url = broker_url
    assert CLAIM_IDLE >= 60
    stream = unique("release")
    first = new_outbox(pg_url, kind, url)
    second = new_outbox(pg_url, kind, url)
    entered: set[int] = set()
    never = anyio.Event()
    handled: list[int] = []

    @first.subscriber(stream, group="g", start="all", batch=batch, concurrency=COUNT)
    async def hold(message: Message) -> None:
        entered.add(message.payload["n"])
        await never.wait()  # still running at the stop: cancelled

    @second.subscriber(stream, group="g", start="all")
    async def handle(message: Message) -> None:
        handled.append(message.payload["n"])

    holder = first.subscribers[0]
    async with cleanup(kind, url, stream):
        await first.create_tables()
        with anyio.fail_after(60):
            async with first.relaying():
                async with first.unit_of_work() as uow:
                    for n in range(COUNT):
                        uow.publish(Message(stream=stream, type="Work", payload={"n": n}))
                await wait_until(lambda: len(entered) == (1 if batch else COUNT), timeout=20)

                async def all_held() -> bool:
                    return (await holder.lag()).pending == COUNT

                await wait_until(all_held, timeout=20)  # the five delivered, none acked
            assert not holder.running and handled == []
            assert holder.stats.handled == 0
            async with second.relaying():
                # Well within claim_idle_seconds: released, not left to expire.
                await wait_until(lambda: len(handled) == COUNT, timeout=CLAIM_IDLE / 4)
            assert sorted(handled) == list(range(COUNT))
            assert second.subscribers[0].stats.handled == COUNT
        for outbox in (first, second):
            await outbox.aclose()

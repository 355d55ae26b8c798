"""Every commit wakes the relays, and a LISTEN connection that dies silently is noticed
(issue 23 point 3).

* A commit wakes other processes' relays however it is made: the unit of work's own
  session, a session joined by ``unit_of_work(session=…)`` and committed later by its owner
  (before: no NOTIFY at all), a script that never ran a lifespan. Polling is set to 30 s, so
  a message published within a few seconds was woken.
* A LISTEN connection blackholed by a proxy (bytes dropped both ways, the connection left
  open: what a NAT or firewall that forgot it does) is declared lost by the listener's
  self-check: the relays poll every ``poll_interval_seconds`` at once, a message
  committed by another process (an engine not through the proxy) reaches the real broker
  long before the backed-off poll would have claimed it, ``listening`` in health turns false,
  then true once the listener has reconnected.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import redis.asyncio as aioredis
from fastapi import FastAPI
from sqlalchemy.ext.asyncio import AsyncSession

from fastapi_outbox import Outbox, OutboxSettings
from fastapi_outbox.brokers import MemoryBroker, RedisStreamsBroker
from fastapi_outbox.events import Message
from fastapi_outbox.relay import wakeups as notify
from tests.conftest import unique, wait_until
from tests.integration.relay import test_wakeup
from tests.integration.relay.test_wakeup import count_claims, idle
from tests.servers import TcpProxy

SLOW_POLL = {"poll_interval_seconds": 30.0, "max_poll_interval_seconds": 30.0}
#: Far below the 30 s poll: a message published within this was woken.
WAKE_WITHIN = 5.0
ROOT = Path(__file__).resolve().parents[3]
#: The fixture of test_wakeup: ``await make_outbox(url, broker, **settings)``.
make_outbox = test_wakeup.make_outbox


# -- every commit wakes the relays -------------------------------------------------------


@pytest.mark.parametrize("writer", ["api-only", "notifier-running"])
async def test_a_joined_session_committed_by_its_owner_wakes_another_relay(
    pg_url: str, make_outbox: Any, writer: str
) -> None:
    relay_broker = MemoryBroker()
    api = await make_outbox(pg_url, MemoryBroker(), run_relays=False)
    relay = await make_outbox(pg_url, relay_broker, **SLOW_POLL)
    stream = unique("orders")
    notifying = api.relays.notifying() if writer == "notifier-running" else contextlib.nullcontext()
    async with relay.relaying(), notifying:
        assert relay.relays.listener is not None
        for n in range(2):
            await wait_until(lambda: idle(relay), timeout=10)
            received = relay.relays.listener.received
            async with AsyncSession(api.engine) as session:
                async with api.unit_of_work(session=session) as uow:
                    uow.publish(Message(stream, "OrderPlaced", {"n": n}))
                await session.commit()  # the owner's commit, after the unit of work
            await relay_broker.wait_for(n + 1, timeout=WAKE_WITHIN)
            assert relay.relays.listener.received > received
    assert [m.json() for m in relay_broker.messages] == [{"n": 0}, {"n": 1}]


SCRIPT = """
import asyncio, sys
from sqlalchemy.ext.asyncio import AsyncSession
from fastapi_outbox import Outbox, OutboxSettings
from fastapi_outbox.relay import wakeups as notify
from fastapi_outbox.events import Message

async def main(url, stream, how):
    outbox = Outbox(url, settings=OutboxSettings())  # no lifespan, no relay, no broker
    message = Message(stream, "OrderPlaced", {"n": how})
    if how == "own":
        async with outbox.unit_of_work() as uow:
            uow.publish(message)
    else:
        async with AsyncSession(outbox.engine) as session:
            async with outbox.unit_of_work(session=session) as uow:
                uow.publish(message)
            await session.commit()
    await outbox.aclose()

asyncio.run(main(*sys.argv[1:]))
"""


@pytest.mark.parametrize("how", ["own", "joined"])
async def test_a_script_without_a_lifespan_wakes_the_relays(
    pg_url: str, make_outbox: Any, how: str
) -> None:
    relay_broker = MemoryBroker()
    relay = await make_outbox(pg_url, relay_broker, **SLOW_POLL)
    stream = unique("orders")
    async with relay.relaying():
        assert relay.relays.listener is not None
        await wait_until(lambda: idle(relay), timeout=10)
        await anyio.to_thread.run_sync(
            lambda: subprocess.run(
                [sys.executable, "-c", SCRIPT, pg_url, stream, how],
                cwd=ROOT,
                check=True,
                timeout=60,
            )
        )
        await relay_broker.wait_for(1, timeout=WAKE_WITHIN)
        assert relay.relays.listener.received >= 1
    assert [m.json() for m in relay_broker.messages] == [{"n": how}]


# -- a LISTEN connection that dies silently -------------------------------------------------------

POLL = 0.125
#: The idle poller's gap, doubling from POLL while LISTEN is up, reached before the blackhole:
#: its next poll is then BACKED_OFF * 2 (8 s) away — what a silent loss used to cost at least.
BACKED_OFF = 4.0
#: Generous for self-check interval + timeout (2.5 s) and a claim, below BACKED_OFF * 2.
PUBLISHED_WITHIN = 6.0
#: The listener's pause before it reconnects, long enough for health (polled every 0.02 s)
#: to be seen false.
RECONNECT_AFTER = 1.0


async def test_a_silently_dead_listen_connection_is_noticed_and_replaced(
    pg_url: str, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(notify, "RECONNECT_MIN_SECONDS", RECONNECT_AFTER)
    proxy = TcpProxy(5432)
    await proxy.start()
    proxied = pg_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
    stream = unique("orders")
    relay = Outbox(
        proxied,
        brokers={"default": RedisStreamsBroker(redis_url)},
        settings=OutboxSettings(
            poll_interval_seconds=POLL,
            max_poll_interval_seconds=30.0,
            listen_check_interval_seconds=0.5,
            listen_check_timeout_seconds=2.0,
            health_cache_seconds=0,
        ),
    )
    # Another process: its own engine, straight to PostgreSQL, no relay.
    writer = Outbox(
        pg_url, brokers={"default": MemoryBroker()}, settings=OutboxSettings(run_relays=False)
    )
    await relay.create_tables()
    app = FastAPI()
    app.include_router(relay.health_router)
    redis = aioredis.Redis.from_url(redis_url)
    seen: list[bool | None] = []

    async def watch_health(http: httpx.AsyncClient) -> None:
        while True:
            body = (await http.get("/outbox/health")).json()
            if not seen or seen[-1] != body["listening"]:
                seen.append(body["listening"])
            await anyio.sleep(0.02)

    async def published(count: int) -> bool:
        return len(await redis.xrange(stream, "-", "+")) >= count

    claims = count_claims(relay)
    transport = httpx.ASGITransport(app=app)
    try:
        async with (
            relay.relaying(),
            httpx.AsyncClient(transport=transport, base_url="http://test") as http,
            anyio.create_task_group() as tg,
        ):
            listener = relay.relays.listener
            assert listener is not None
            tg.start_soon(watch_health, http)
            await wait_until(lambda: seen[-1:] == [True], timeout=10)
            await wait_until(lambda: listener.checks >= 1, timeout=10)  # self-checks answer
            assert listener.keepalive
            # Idle with LISTEN up, the poller backs off: wait for a BACKED_OFF gap.
            await wait_until(
                lambda: len(claims) >= 3 and claims[-1] - claims[-2] >= BACKED_OFF, timeout=45
            )
            assert proxy.blackhole(b"LISTEN ") == 1
            async with writer.unit_of_work() as uow:
                uow.publish(Message(stream, "OrderPlaced", {"n": 1}))
            # The NOTIFY went into the black hole; the self-check notices, the relays
            # poll at once, and the message reaches Redis.
            await wait_until(lambda: published(1), timeout=PUBLISHED_WITHIN)
            assert listener.silent_losses >= 1
            # Health showed the loss, then the new LISTEN connection.
            await wait_until(lambda: seen[:3] == [True, False, True], timeout=10)
            # The new connection gets other processes' wake-ups.
            received = listener.received
            async with writer.unit_of_work() as uow:
                uow.publish(Message(stream, "OrderPlaced", {"n": 2}))
            await wait_until(lambda: listener.received > received, timeout=WAKE_WITHIN)
            await wait_until(lambda: published(2), timeout=WAKE_WITHIN)
            tg.cancel_scope.cancel()
        entries = await redis.xrange(stream, "-", "+")
        assert [json.loads(f[b"payload"]) for _, f in entries] == [{"n": 1}, {"n": 2}]
    finally:
        await redis.delete(stream)
        await redis.aclose()
        await relay.aclose()
        await writer.aclose()
        await proxy.stop()


async def test_stopping_with_a_silent_listen_connection_does_not_hang(pg_url: str) -> None:
    """The half-open LISTEN connection is dropped, not handed back to the pool: closing the
    outbox would otherwise wait forever on it."""
    proxy = TcpProxy(5432)
    await proxy.start()
    proxied = pg_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
    relay = Outbox(
        proxied,
        brokers={"default": MemoryBroker()},
        settings=OutboxSettings(listen_check_interval_seconds=30.0, shutdown_timeout_seconds=3),
    )
    try:
        await relay.create_tables()
        with anyio.fail_after(20):
            async with relay.relaying():
                listener = relay.relays.listener
                assert listener is not None
                await wait_until(lambda: listener.listening, timeout=10)
                assert proxy.blackhole(b"LISTEN ") == 1
            await relay.aclose()
    finally:
        await proxy.stop()

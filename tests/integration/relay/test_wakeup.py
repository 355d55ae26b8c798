"""Wake-ups: a commit is published in milliseconds, not poll intervals, and idling is cheap.

Polling is set to 30 s in these tests, so anything that arrives within a couple of
seconds was woken: in-process by the signal right after commit, across processes by the
PostgreSQL NOTIFY that the producer's COMMIT carries (same round trip, run after the
commit) when no idle worker of the committing process takes the rows.
An idle relay with LISTEN up backs its polling off to ``max_poll_interval_seconds``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from fastapi_outbox import Outbox, OutboxSettings
from fastapi_outbox.brokers import MemoryBroker
from fastapi_outbox.events import Message
from tests.conftest import unique, wait_until

pytestmark = pytest.mark.mariadb

SLOW_POLL = {"poll_interval_seconds": 30.0, "max_poll_interval_seconds": 30.0}
WAKE_WITHIN = 2.0


def idle(outbox: Outbox) -> bool:
    """Every worker of every table_relay is waiting for a wake-up (no claim in flight), and
    LISTEN is up where there is one."""
    listening = outbox.relays.listener is None or outbox.relays.listener.listening
    return listening and all(
        p.wakeup.idle_waiters == outbox.settings.workers for p in outbox.relays.tables.values()
    )


async def commit_one(outbox: Outbox, stream: str, n: int) -> None:
    async with outbox.unit_of_work() as uow:
        uow.publish(Message(stream, "OrderPlaced", {"n": n}))


@pytest.fixture
async def make_outbox() -> AsyncIterator[Any]:
    made: list[Outbox] = []

    async def make(url: str, broker: MemoryBroker, **settings: Any) -> Outbox:
        outbox = Outbox(url, brokers={"default": broker}, settings=OutboxSettings(**settings))
        await outbox.create_tables()
        made.append(outbox)
        return outbox

    yield make
    for outbox in made:
        await outbox.aclose()


async def test_a_commit_wakes_the_relay_of_its_own_process(db_url: str, make_outbox: Any) -> None:
    broker = MemoryBroker()
    outbox = await make_outbox(db_url, broker, **SLOW_POLL)
    stream = unique("orders")
    async with outbox.relaying():
        for n in range(3):
            await wait_until(lambda: idle(outbox), timeout=5)
            begin = time.monotonic()
            await commit_one(outbox, stream, n)
            await broker.wait_for(n + 1, timeout=WAKE_WITHIN)
            assert time.monotonic() - begin < WAKE_WITHIN
    assert [m.json() for m in broker.messages] == [{"n": 0}, {"n": 1}, {"n": 2}]


async def test_notify_from_an_api_only_process_wakes_another_relay(
    pg_url: str, make_outbox: Any
) -> None:
    api_broker, relay_broker = MemoryBroker(), MemoryBroker()
    # The API process runs no relay (run_relays=False, or simply never started).
    api = await make_outbox(pg_url, api_broker, run_relays=False)
    relay = await make_outbox(pg_url, relay_broker, **SLOW_POLL)
    stream = unique("orders")
    async with relay.relaying():
        assert relay.relays.listener is not None
        for n in range(2):
            await wait_until(lambda: idle(relay), timeout=5)
            begin = time.monotonic()
            await commit_one(api, stream, n)
            await relay_broker.wait_for(n + 1, timeout=WAKE_WITHIN)
            assert time.monotonic() - begin < WAKE_WITHIN
        assert relay.relays.listener.received >= 2
    assert api_broker.messages == []
    assert [m.json() for m in relay_broker.messages] == [{"n": 0}, {"n": 1}]


async def test_a_running_relays_commit_wakes_another_process(pg_url: str, make_outbox: Any) -> None:
    relay_broker = MemoryBroker()
    writer = await make_outbox(pg_url, MemoryBroker(), **SLOW_POLL)
    relay = await make_outbox(pg_url, relay_broker, **SLOW_POLL)
    stream = unique("orders")
    async with writer.relaying(), relay.relaying():
        # The writer's table_relay stops: no worker of its own takes the row, so it is the
        # NOTIFY its COMMIT carries that gets the row published (by the relay).
        writer.relays.tables["default"].stop()
        await wait_until(lambda: not writer.relays.tables["default"].running, timeout=5)
        assert writer.relays.notifier is not None and relay.relays.listener is not None
        await wait_until(lambda: idle(relay), timeout=5)
        sent_before, received_before = writer.relays.notifier.sent, relay.relays.listener.received
        begin = time.monotonic()
        await commit_one(writer, stream, 7)
        await relay_broker.wait_for(1, timeout=WAKE_WITHIN)
        assert time.monotonic() - begin < WAKE_WITHIN
        assert relay.relays.listener.received > received_before
        # The commit carried it: the writer's NOTIFY sender had nothing to send.
        assert writer.relays.notifier.sent == sent_before
    assert [m.json() for m in relay_broker.messages] == [{"n": 7}]


async def test_a_commit_taken_by_an_idle_local_worker_sends_no_notify(
    pg_url: str, make_outbox: Any
) -> None:
    broker = MemoryBroker()
    writer = await make_outbox(pg_url, broker, **SLOW_POLL)
    stream = unique("orders")
    async with writer.relaying():
        await wait_until(lambda: idle(writer), timeout=5)
        assert writer.relays.notifier is not None
        sent_before = writer.relays.notifier.sent
        await commit_one(writer, stream, 1)
        await broker.wait_for(1, timeout=WAKE_WITHIN)
        # The in-process wake-up sufficed: other processes were not disturbed.
        assert writer.relays.notifier.sent == sent_before


def count_claims(outbox: Outbox) -> list[float]:
    times: list[float] = []
    claim = outbox.store.claims.claim

    async def counting(*args: Any, **kw: Any) -> Any:
        times.append(time.monotonic())
        return await claim(*args, **kw)

    outbox.store.claims.claim = counting  # type: ignore[method-assign]
    return times


async def test_an_idle_relay_backs_its_polling_off_while_listen_is_up(
    pg_url: str, make_outbox: Any
) -> None:
    outbox = await make_outbox(
        pg_url, MemoryBroker(), poll_interval_seconds=0.01, max_poll_interval_seconds=30
    )
    claims = count_claims(outbox)
    async with outbox.relaying():
        assert outbox.relays.listener is not None
        await wait_until(
            lambda: outbox.relays.listener is not None and outbox.relays.listener.listening
        )
        # Wait for the first idle gap of a second or more between two claims.
        await wait_until(lambda: len(claims) >= 3 and claims[-1] - claims[-2] >= 1.0, timeout=8)
    # claims[0] and claims[1] are the two workers' first claims; from then on only the
    # poller claims, its interval doubling from 10 ms while LISTEN is up (10, 20, 40, ...
    # 1280 ms, capped at max_poll_interval_seconds) instead of staying at 10 ms.
    gaps = [b - a for a, b in itertools.pairwise(claims[1:])]
    shown = " ".join(f"{g:.3f}" for g in gaps)
    assert len(claims) <= 14, shown  # 2.5 s of idling: a dozen claims, not 250
    for earlier, later in itertools.pairwise(gaps[-4:]):
        assert later >= 1.5 * earlier, shown
    assert gaps[-1] >= 1.0  # already under one claim per second, and falling


async def test_without_listen_an_idle_relay_keeps_polling(pg_url: str, make_outbox: Any) -> None:
    outbox = await make_outbox(
        pg_url,
        MemoryBroker(),
        poll_interval_seconds=0.05,
        max_poll_interval_seconds=30,
        notify=False,
    )
    claims = count_claims(outbox)
    async with outbox.relaying():
        assert outbox.relays.listener is None
        # No wake-up can come from other processes: polling stays at poll_interval_seconds.
        await wait_until(lambda: len(claims) >= 12, timeout=3)
    gaps = [b - a for a, b in itertools.pairwise(claims[4:])]
    assert max(gaps) < 0.5, gaps

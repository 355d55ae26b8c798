"""The WAL relay always progresses, however much unrelated WAL lies ahead of it.

- A backlog of unrelated WAL (a bulk load while no relay ran) is read in bounded LSN windows,
  each confirmed as it is read, under a read timeout far shorter than reading the backlog in
  one piece would take: the relay catches up and every message arrives once.
- Health shows the lag in bytes and a relay that makes no progress.
- Content of the library's prefix that the relay cannot decode stops the relay at that LSN
  (health names it) instead of being confirmed away; nothing after it is lost.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import asyncpg
import pytest
import redis.asyncio as aioredis

from fastapi_outbox import Message, Outbox, OutboxSettings
from fastapi_outbox.brokers import MemoryBroker, RedisStreamsBroker
from fastapi_outbox.ops.health import compute_health
from fastapi_outbox.storage.wal_slot import parse_lsn
from tests.conftest import _cluster_sql, unique, wait_until
from tests.servers import LOGICAL_PG_OPTIONS, PrivatePostgres

#: The bulk cluster: frequent checkpoints (each logs the running transactions, the points
#: the slot's restart position can move to), as a busy production server has.
BULK_PG_OPTIONS = LOGICAL_PG_OPTIONS + " -c max_wal_size=64MB -c min_wal_size=32MB"
BULK_PG_PORTS = range(56500, 56550)
GIB = 1 << 30
#: The bulk load's WAL: over twice what one read decodes within wal_read_timeout_seconds.
BACKLOG_BYTES = GIB
#: One chunk of the bulk load: ~64 MB of rows of ~2 kB (under the TOAST threshold: all WAL).
CHUNK_SQL = (
    "INSERT INTO bulk SELECT g, repeat(md5(g::text), 60) "
    "FROM generate_series(1, 64 * 1024 * 1024 / 2000) g"
)
FAST = {
    "capture": "wal",
    "poll_interval_seconds": 0.05,
    "max_poll_interval_seconds": 0.2,
    "health_cache_seconds": 0,
}


@pytest.fixture(scope="module")
def bulk_pg() -> Iterator[PrivatePostgres]:
    cluster = PrivatePostgres(BULK_PG_PORTS, BULK_PG_OPTIONS)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()  # removes its directory, WAL included


@pytest.fixture
def bulk_pg_url(bulk_pg: PrivatePostgres) -> Iterator[str]:
    name = unique("walbulk")
    _cluster_sql(bulk_pg.url, f"CREATE DATABASE {name}")
    base, _, _ = bulk_pg.url.rpartition("/")
    yield f"{base}/{name}"
    _cluster_sql(bulk_pg.url, drop_database=name)


@pytest.fixture
async def sql(request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    """A plain asyncpg connection on the test's database (the fixture named by the test)."""
    url = request.getfixturevalue(request.param)
    conn = await asyncpg.connect(url.replace("+asyncpg", ""))
    try:
        yield conn
    finally:
        await conn.close()


async def produce(outbox: Outbox, stream: str, n: int, start: int = 0) -> list[str]:
    ids = []
    for i in range(start, start + n):
        async with outbox.unit_of_work() as uow:
            ids.append(str(uow.publish(Message(stream, "Numbered", {"n": i}))))
    return ids


async def stream_ids(url: str, stream: str) -> list[str]:
    client = aioredis.Redis.from_url(url)
    try:
        return [f[b"id"].decode() for _, f in await client.xrange(stream)]
    finally:
        await client.aclose()


async def stream_length(url: str, stream: str) -> int:
    client = aioredis.Redis.from_url(url)
    try:
        return int(await client.xlen(stream))
    finally:
        await client.aclose()


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("sql", ["bulk_pg_url"], indirect=True)
async def test_relay_catches_up_over_1_gb_of_unrelated_wal(
    bulk_pg_url: str, redis_url: str, sql: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """1 GB of bulk-load WAL written while no relay ran, messages before, inside and after
    it; the read timeout (1.5 s) is far shorter than decoding the backlog in one read takes
    here (~3.5 s unloaded: 2 GB took ~7 s), and well above one 64 MB window (~0.6 s): the
    relay reads it in windows, confirms each, catches up, and the Redis stream holds every
    message once, in commit order. (It was 2 GB under a 2 s timeout: the same proof in
    about twice the time.)"""
    stream = unique("walbulk")
    settings = OutboxSettings(**FAST, wal_read_timeout_seconds=1.5)
    outbox = Outbox(
        bulk_pg_url, brokers={"default": RedisStreamsBroker(redis_url)}, settings=settings
    )
    slot = outbox.wal_slot
    assert slot is not None
    await outbox.create_tables()
    try:
        ids = await produce(outbox, stream, 50)
        await sql.execute("CREATE TABLE bulk (id int, pad text)")
        start = await sql.fetchval("SELECT pg_current_wal_lsn()")
        began = time.monotonic()
        written = 0
        while written < BACKLOG_BYTES:
            await sql.execute(CHUNK_SQL)
            await sql.execute("TRUNCATE bulk")
            ids += await produce(outbox, stream, 1, start=len(ids))  # inside the backlog
            written = int(
                await sql.fetchval("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1)", start)
            )
        generated = time.monotonic() - began
        ids += await produce(outbox, stream, 50, start=len(ids))
        stats = await slot.stats()
        assert (
            stats is not None and stats.lag_bytes is not None and stats.lag_bytes >= BACKLOG_BYTES
        )
        began = time.monotonic()
        async with outbox.relaying():
            relay = outbox.relays.wal
            assert relay is not None

            async def all_arrived() -> bool:
                return await stream_length(redis_url, stream) >= len(ids)

            await wait_until(all_arrived, timeout=600, interval=0.5)
            caught_up = time.monotonic() - began

            async def slot_caught_up() -> bool:
                health = await compute_health(outbox)
                assert health.wal is not None
                lag = health.wal.lag_bytes
                return lag is not None and lag < 1 << 20 and health.status == "ok"

            await wait_until(slot_caught_up, timeout=30)
        got = await stream_ids(redis_url, stream)
        assert len(got) == len(ids) and got == ids  # each once, in commit order
        # Read, and confirmed, a window at a time.
        assert relay.reads_total > 2 and relay.largest_window_bytes < written
        with capsys.disabled():
            print(
                f"\n[wal bulk] {written / GIB:.2f} GiB of WAL generated in {generated:.1f}s; "
                f"relay caught up ({len(ids)} messages) in {caught_up:.1f}s, "
                f"largest read window {relay.largest_window_bytes >> 20} MiB, "
                f"reads {relay.reads_total}, read timeouts {relay.read_timeouts_total}"
            )
    finally:
        await sql.execute("DROP TABLE IF EXISTS bulk")
        await outbox.aclose()


@pytest.mark.parametrize("sql", ["wal_pg_url"], indirect=True)
async def test_health_shows_lag_bytes_and_a_relay_that_makes_no_progress(
    wal_pg_url: str, sql: Any
) -> None:
    """A read timeout (1 ms) too short to read a 30 MB transaction: the relay cannot move
    the slot past it; health says how many bytes it is behind and for how long it has made
    no progress (down, 503), naming the setting."""
    settings = OutboxSettings(
        **FAST, wal_read_timeout_seconds=0.001, health_max_pending_age_seconds=1
    )
    broker = MemoryBroker()
    outbox = Outbox(wal_pg_url, brokers={"default": broker}, settings=settings)
    await outbox.create_tables()
    try:
        await produce(outbox, "stalled", 3)
        await sql.execute(
            "CREATE TABLE filler AS SELECT g, repeat('x', 1000) FROM generate_series(1, 30000) g"
        )
        async with outbox.relaying():

            async def stalled() -> bool:
                health = await compute_health(outbox)
                return health.status == "down" and any("no progress" in r for r in health.reasons)

            await wait_until(stalled, timeout=30)
            health = await compute_health(outbox)
            assert health.wal is not None
            assert health.wal.lag_bytes is not None and health.wal.lag_bytes > 20 << 20
            assert health.wal.no_progress_seconds is not None
            assert health.wal.no_progress_seconds > 1
            [reason] = [r for r in health.reasons if "no progress" in r]
            assert "wal_read_timeout_seconds" in reason, reason
    finally:
        await outbox.aclose()


@pytest.mark.parametrize("sql", ["wal_pg_url"], indirect=True)
async def test_undecodable_content_stops_the_relay_and_nothing_after_it_is_lost(
    wal_pg_url: str, sql: Any
) -> None:
    broker = MemoryBroker()
    outbox = Outbox(wal_pg_url, brokers={"default": broker}, settings=OutboxSettings(**FAST))
    slot = outbox.wal_slot
    assert slot is not None
    await outbox.create_tables()
    try:
        before = await produce(outbox, "bad", 3)
        emitted = parse_lsn(
            await sql.fetchval(
                "SELECT pg_logical_emit_message(true, $1, 'not json')::text", slot.prefix
            )
        )
        after = await produce(outbox, "bad", 3, start=3)
        async with outbox.relaying():
            relay = outbox.relays.wal
            assert relay is not None
            await broker.wait_for(3)

            async def stopped() -> bool:
                return (await compute_health(outbox)).status == "down"

            await wait_until(stopped, timeout=15)
            health = await compute_health(outbox)
            assert health.wal is not None and health.wal.undecodable_lsn is not None
            # The LSN pg_logical_emit_message returned for it.
            assert parse_lsn(health.wal.undecodable_lsn) == emitted
            [reason] = [r for r in health.reasons if "undecodable" in r]
            assert health.wal.undecodable_lsn in reason and slot.name in reason, reason
            # Stopped there: what follows is neither published nor confirmed away.
            assert [m.id for m in broker.messages] == before
            stats = await slot.stats()
            assert stats is not None and stats.lag_bytes is not None and stats.lag_bytes > 0
            # The operator skips that transaction as the reason says (the relay reads the
            # slot again every max_poll_interval_seconds and resumes after it).
            assert health.wal.undecodable_skip_to is not None
            skip_to = health.wal.undecodable_skip_to
            assert f"pg_replication_slot_advance('{slot.name}', '{skip_to}')" in reason

            async def skipped() -> bool:
                try:
                    await sql.execute(
                        "SELECT pg_replication_slot_advance($1, $2::text::pg_lsn)",
                        slot.name,
                        skip_to,
                    )
                except asyncpg.ObjectInUseError:  # the relay is reading it right now
                    return False
                return True

            await wait_until(skipped)
            await broker.wait_for(6, timeout=15)
            await wait_until(stopped_no_more(outbox), timeout=15)
        assert [m.id for m in broker.messages] == before + after
    finally:
        await outbox.aclose()


def stopped_no_more(outbox: Outbox) -> Any:
    async def ok() -> bool:
        health = await compute_health(outbox)
        return health.status == "ok" and health.wal is not None and not health.wal.undecodable_lsn

    return ok


@pytest.mark.parametrize("sql", ["wal_pg_url"], indirect=True)
async def test_drain_relays_up_to_undecodable_content_and_raises_naming_it(
    wal_pg_url: str, sql: Any
) -> None:
    from fastapi_outbox.storage.wal_slot import UndecodableWalMessage
    from fastapi_outbox.testing import drain

    broker = MemoryBroker()
    outbox = Outbox(wal_pg_url, brokers={"default": broker}, settings=OutboxSettings(**FAST))
    slot = outbox.wal_slot
    assert slot is not None
    await outbox.create_tables()
    try:
        before = await produce(outbox, "bad", 2)
        emitted = await sql.fetchval(
            'SELECT pg_logical_emit_message(true, $1, \'{"v": 2, "m": []}\')::text', slot.prefix
        )
        await produce(outbox, "bad", 2, start=2)
        with pytest.raises(UndecodableWalMessage, match=f"LSN {emitted}.*content version 2"):
            await drain(outbox)
        assert [m.id for m in broker.messages] == before
        with pytest.raises(UndecodableWalMessage):  # still there: nothing confirmed past it
            await drain(outbox)
        # What precedes it was confirmed; it and what follows are held (the count of
        # `status` and of `db drop-slot`'s refusal includes it).
        assert await slot.pending_messages() == 3
        report = await slot.report()
        assert report["backlog_messages"] == 3 and f"LSN {emitted}" in report["undecodable"]
    finally:
        await outbox.aclose()

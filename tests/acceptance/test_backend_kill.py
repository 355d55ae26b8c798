"""A PostgreSQL backend of the relay terminated mid-batch, again and again.

``pg_terminate_backend`` hits the relay's connections (those whose last statement is
a claim or a mark: they name ``locked_by``), busy or idle in the pool, of this test's own
database only, while producers commit. Claims and marks lost with their connection are
recovered (leases expire; the pool drops a dead connection instead of handing it out
again and again), and every committed message reaches the Redis stream exactly once.
"""

from __future__ import annotations

import anyio
import asyncpg
import pytest
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

from fastapi_outbox import Outbox, OutboxSettings
from fastapi_outbox.brokers import RedisStreamsBroker
from tests.acceptance.conftest import exactly_once, produce, redis_ids
from tests.conftest import unique, wait_until

pytestmark = [
    pytest.mark.slow,
    pytest.mark.postgres(reason="kills the relay's own backends with pg_terminate_backend"),
    pytest.mark.redis,
]

KILLS = 15

KILL_SQL = """
SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid() AND query LIKE '%locked_by%'
"""


async def test_relay_backends_terminated_mid_batch(pg_url: str, redis_url: str) -> None:
    stream = unique("orders")
    # Producers on an engine of their own, as an API process beside a relay process:
    # a pooled connection killed while idle would fail whichever session takes it next.
    producers_engine = create_async_engine(pg_url)
    outbox = Outbox(
        pg_url,
        session_factory=async_sessionmaker(producers_engine, expire_on_commit=False),
        brokers={"default": RedisStreamsBroker(redis_url)},
        settings=OutboxSettings(
            lease_seconds=1.5,
            publish_timeout_seconds=0.5,
            batch_size=20,
            poll_interval_seconds=0.05,
            max_poll_interval_seconds=0.2,
        ),
    )
    await outbox.create_tables()
    url = make_url(pg_url).set(drivername="postgresql").render_as_string(hide_password=False)
    admin = await asyncpg.connect(url)
    killed = 0
    try:
        async with outbox.relaying():
            table_relay = outbox.relays.tables["default"]
            async with anyio.create_task_group() as tg:
                committed: list[str] = []

                async def producers() -> None:
                    committed.extend(await produce(outbox, stream, 600, pause=0.02))

                tg.start_soon(producers)
                for _ in range(KILLS):
                    # Wait until a relay connection is there to be killed.
                    async def terminated() -> bool:
                        nonlocal killed
                        n = int(await admin.fetchval(KILL_SQL))
                        killed += n
                        return n > 0

                    await wait_until(terminated, timeout=10, interval=0.03)
            # Counted on the admin connection: an idle pooled connection of the outbox that
            # was killed fails its next use once (no pre-ping), which is not what this
            # test is about.
            unfinished_sql = (
                f"SELECT count(*) FROM {outbox.settings.table_name} "
                "WHERE status IN ('pending', 'processing', 'failed')"
            )

            async def drained() -> bool:
                return int(await admin.fetchval(unfinished_sql)) == 0

            try:
                await wait_until(drained, timeout=40, interval=0.1)
            except TimeoutError:
                pytest.fail(f"not drained; last error: {table_relay.last_error}")
        assert killed >= KILLS
        exactly_once(committed, await redis_ids(redis_url, stream))
    finally:
        await admin.close()
        await outbox.aclose()
        await producers_engine.dispose()

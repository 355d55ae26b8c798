"""``db upgrade`` under a conflicting lock: every statement waits at most its
``lock_timeout`` (an ``ALTER TABLE`` queued behind a long transaction would stall every
write to the table behind it), is retried, and either succeeds once the lock is released
or fails with an error naming the table — it never waits forever."""

from __future__ import annotations

import logging

import anyio
import asyncpg
import pytest

from fastapi_outbox import Outbox, OutboxSettings
from fastapi_outbox.brokers import MemoryBroker
from fastapi_outbox.storage import doctor
from tests.conftest import unique, wait_until
from tests.integration.storage.test_upgrade import PRE_RELEASE, fill


async def hold_lock(url: str) -> asyncpg.Connection:
    """A reader's transaction left open on the table (ACCESS SHARE: ALTER TABLE's
    ACCESS EXCLUSIVE waits for it, and so does a CONCURRENTLY build)."""
    conn = await asyncpg.connect(url.replace("+asyncpg", ""))
    await conn.execute("BEGIN")
    await conn.fetchval("SELECT count(*) FROM outbox_messages")
    return conn


def outbox_of(url: str) -> Outbox:
    return Outbox(
        url,
        brokers={"default": MemoryBroker()},
        settings=OutboxSettings(ordered=True, run_relays=False),
    )


async def test_upgrade_gives_up_naming_the_table_while_the_lock_is_held(pg_url: str) -> None:
    await fill(pg_url, PRE_RELEASE, unique("orders"))
    outbox = outbox_of(pg_url)
    holder = await hold_lock(pg_url)
    try:
        with pytest.raises(doctor.UpgradeLockTimeout) as caught:
            await doctor.upgrade(
                outbox.engine,
                outbox.table,
                lock_timeout_seconds=0.2,
                attempts=3,
                pause_seconds=0.05,
            )
        message = str(caught.value)
        assert "table outbox_messages" in message
        assert "UPGRADE_LOCK_TIMEOUT_SECONDS" in message and "3 attempts" in message
        # Nothing that needs the lock was done, and the holder was never blocked.
        assert await holder.fetchval("SELECT count(*) FROM outbox_messages") > 0
    finally:
        await holder.close()
    try:
        # Released: the next run upgrades (an index a timed-out CONCURRENTLY build left
        # invalid included).
        applied, left = await doctor.upgrade(outbox.engine, outbox.table)
        assert applied and not left
        assert [f for f in await doctor.examine(outbox.engine, outbox.table) if f.mismatch] == []
    finally:
        await outbox.aclose()


async def test_upgrade_retries_and_succeeds_once_the_lock_is_released(
    pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    await fill(pg_url, PRE_RELEASE, unique("orders"))
    outbox = outbox_of(pg_url)
    holder = await hold_lock(pg_url)
    result: list[tuple[list[doctor.Finding], list[doctor.Finding]]] = []
    caplog.set_level(logging.WARNING, logger="fastapi_outbox.storage")

    def retries() -> int:
        return sum(getattr(r, "action", None) == "upgrade.lock_timeout" for r in caplog.records)

    try:
        async with anyio.create_task_group() as tg:

            async def upgrade() -> None:
                result.append(
                    await doctor.upgrade(
                        outbox.engine,
                        outbox.table,
                        lock_timeout_seconds=0.2,
                        attempts=1000,
                        pause_seconds=0.05,
                    )
                )

            tg.start_soon(upgrade)
            await wait_until(lambda: retries() >= 2, timeout=60)
            await holder.close()  # the long transaction ends
        applied, left = result[0]
        assert applied and not left
        assert retries() >= 2
        assert [f for f in await doctor.examine(outbox.engine, outbox.table) if f.mismatch] == []
    finally:
        if not holder.is_closed():
            await holder.close()
        await outbox.aclose()

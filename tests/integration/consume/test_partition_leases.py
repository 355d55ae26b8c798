"""Partition leases of ordered subscribers on PostgreSQL (:mod:`fastapi_outbox.storage.leases`):
a stale owner — frozen while its lease expired and another process took the partition —
cannot commit: the fence in its handler's transaction finds another token, and nothing of
that transaction stays. A redeploy with another partition count is refused."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import text

from fastapi_outbox import ConfigurationError, Outbox, OutboxSettings
from fastapi_outbox.storage.leases import LeaseLost
from tests.conftest import wait_until


async def test_a_stale_owner_loses_its_fence_and_commits_nothing(pg_url: str) -> None:
    outbox = Outbox(pg_url, settings=OutboxSettings(run_dispatchers=False))
    try:
        await outbox.create_tables()
        async with outbox.engine.begin() as conn:
            await conn.execute(text("CREATE TABLE effects (n int NOT NULL)"))
        leases = outbox.inbox.leases("billing", "orders")
        await leases.ensure(4, "0-0")
        # A takes every partition with a short lease, then "freezes" (stops renewing).
        a = await leases.acquire("a", 4, lease_seconds=0.3)
        assert [o.partition for o in a] == [0, 1, 2, 3]
        assert await leases.acquire("b", 4, lease_seconds=30) == []  # all held
        # B takes partition 0 once A's lease is over, on the database's clock.
        taken: list[Any] = []

        async def b_takes() -> bool:
            taken.extend(await leases.acquire("b", 1, lease_seconds=30))
            return bool(taken)

        await wait_until(b_takes, timeout=10)
        assert (taken[0].partition, taken[0].token) == (0, a[0].token + 1)
        assert taken[0].position == "0-0"

        # A wakes up and handles a message of partition 0: its fence fails, the effect
        # written before the fence's verdict is rolled back with it.
        async def stale_handler() -> None:
            async with outbox.engine.begin() as conn:
                await conn.execute(text("INSERT INTO effects VALUES (1)"))
                await leases.fence(conn, 0, a[0].token, "5-0")

        with pytest.raises(LeaseLost, match="partition 0 was taken over"):
            await stale_handler()
        # B commits; its position is the partition's.
        async with outbox.engine.begin() as conn:
            await leases.fence(conn, 0, taken[0].token, "6-0")
            await conn.execute(text("INSERT INTO effects VALUES (2)"))
        async with outbox.engine.connect() as conn:
            assert (await conn.execute(text("SELECT n FROM effects"))).scalars().all() == [2]
        assert sorted(await leases.oldest_position()) == ["0-0", "0-0", "0-0", "6-0"]
        # A's renewal no longer returns partition 0: its coordinator drops it.
        assert set(await leases.renew("a", 0.3)) <= {1, 2, 3}
        # Another partition count for the same group is refused, naming the setting.
        with pytest.raises(ConfigurationError, match="consumer_ordered_partitions=8"):
            await leases.ensure(8, "0-0")
    finally:
        await outbox.aclose()

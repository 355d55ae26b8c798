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
    outbox = Outbox(pg_url, settings=OutboxSettings(run_relays=False))
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


async def test_attempts_on_record_outlive_their_owner_and_an_unstarted_one_is_forgotten(
    pg_url: str,
) -> None:
    """The attempts of a partition's next message are on its row before its handler runs:
    announced by the fence before it, or recorded on their own (a retry). An owner that
    dies leaves them to the next one; a release forgets an announcement whose handler never
    started; a stale owner cannot record."""
    outbox = Outbox(pg_url, settings=OutboxSettings(run_relays=False))
    try:
        await outbox.create_tables()
        leases = outbox.inbox.leases("billing", "orders")
        await leases.ensure(2, "0-0")
        a0, a1 = await leases.acquire("a", 2, lease_seconds=0.3)
        assert (a0.started, a0.attempts) == (None, 0)
        # Partition 0: 1-0 commits announcing 2-0's first attempt; 2-0 fails once and its
        # second attempt is recorded on its own; then "a" dies inside it.
        async with outbox.engine.begin() as conn:
            await leases.fence(conn, 0, a0.token, "1-0", ("2-0", 1))
        await leases.start(0, a0.token, "2-0", 2)
        # Partition 1: 5-0 dead-lettered (settled on its own) announcing 6-0, whose handler
        # never starts: "a" hands the partition over.
        await leases.settle(1, a1.token, "5-0", ("6-0", 1))
        await leases.release("a", [1], unstarted=[1])

        taken: list[Any] = []

        async def b_takes_both() -> bool:
            taken.extend(await leases.acquire("b", 2 - len(taken), lease_seconds=30))
            return len(taken) == 2

        await wait_until(b_takes_both, timeout=10)
        b0, b1 = sorted(taken, key=lambda o: o.partition)
        assert (b0.position, b0.started, b0.attempts) == ("1-0", "2-0", 2)
        assert (b1.position, b1.started, b1.attempts) == ("5-0", None, 0)
        # "a" wakes up: it can record nothing more.
        with pytest.raises(LeaseLost):
            await leases.start(0, a0.token, "2-0", 3)
        await leases.start(0, b0.token, "2-0", 3)
        async with outbox.engine.connect() as conn:
            row = (
                await conn.execute(
                    text(
                        "SELECT position, started, attempts FROM outbox_inbox_partitions "
                        "WHERE partition = 0"
                    )
                )
            ).one()
        assert tuple(row) == ("1-0", "2-0", 3)
    finally:
        await outbox.aclose()

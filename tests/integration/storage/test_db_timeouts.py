"""Relay statements are bounded, so a frozen peer cannot stall dispatch forever.

A relay frozen (SIGSTOP, a debugger, a stuck event loop) while it holds the ordered
claimers' lock would, without bounds, block every ordered claim of the table for good.
The relay's transactions set ``lock_timeout`` (a waiting claim gives up and retries)
and ``idle_in_transaction_session_timeout`` (the server ends the frozen holder's session).
"""

from __future__ import annotations

import contextlib
import time

import asyncpg
import pytest
from sqlalchemy import func, select
from sqlalchemy.exc import DBAPIError

from fastapi_outbox import Message, Outbox, OutboxSettings
from fastapi_outbox.brokers import MemoryBroker
from tests.conftest import unique, wait_until


async def test_a_frozen_holder_of_the_ordered_lock_is_cut_off(pg_url: str) -> None:
    outbox = Outbox(
        pg_url,
        brokers={"default": MemoryBroker()},
        settings=OutboxSettings(
            ordered=True,
            run_relays=False,
            lease_seconds=6,
            publish_timeout_seconds=2,
            db_statement_timeout_seconds=1,
            db_lock_timeout_seconds=0.2,
        ),
    )
    await outbox.create_tables()
    store = outbox.store
    async with outbox.unit_of_work() as uow:
        uow.publish(Message(unique("orders"), "Thing", {}), key="k")
    frozen = await outbox.engine.connect()
    try:
        # What an ordered claimer does first, then it freezes inside its transaction.
        await frozen.begin()
        lock = func.hashtext(f"fastapi_outbox:{outbox.table.name}:default")
        await frozen.execute(
            select(*store.claims.local_timeouts(), func.pg_advisory_xact_lock(lock))
        )

        started = time.monotonic()
        with pytest.raises((DBAPIError, asyncpg.LockNotAvailableError), match="lock timeout"):
            await store.claims.claim("default", 10, "other:1", 6, ordered=True)
        assert time.monotonic() - started < 1.0  # lock_timeout, not a hang

        async def claims() -> bool:
            try:
                return len(await store.claims.claim("default", 10, "other:2", 6, ordered=True)) == 1
            except (DBAPIError, asyncpg.LockNotAvailableError):
                return False

        # The server ends the frozen session after idle_in_transaction_session_timeout.
        await wait_until(claims, timeout=10, interval=0.2)
    finally:
        with contextlib.suppress(Exception):  # the server terminated its session
            await frozen.close()
        await outbox.aclose()


def test_statement_timeout_follows_the_lease_and_is_validated() -> None:
    assert OutboxSettings().statement_timeout_seconds == 10
    short = OutboxSettings(lease_seconds=3, publish_timeout_seconds=2)
    assert (short.statement_timeout_seconds, short.lock_timeout_seconds) == (1, 0.5)
    with pytest.raises(ValueError, match=r"db_statement_timeout_seconds.*lease_seconds"):
        OutboxSettings(db_statement_timeout_seconds=30, lease_seconds=30)
    with pytest.raises(ValueError, match="db_lock_timeout_seconds"):
        OutboxSettings(db_statement_timeout_seconds=2, db_lock_timeout_seconds=3)

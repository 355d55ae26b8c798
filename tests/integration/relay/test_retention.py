"""Retention: bounded batches, only finished rows, and dispatch keeps going meanwhile."""

from __future__ import annotations

import datetime as dt
import math
from typing import Any

import anyio
import pytest
from sqlalchemy import event, func, select, update

from fastapi_outbox import Message, Outbox, OutboxSettings
from fastapi_outbox.brokers import MemoryBroker
from fastapi_outbox.lifecycle.retention import Cleaner
from tests.conftest import unique, wait_until

pytestmark = pytest.mark.mariadb

HOUR = 3600.0


async def publish(outbox: Outbox, stream: str, n: int) -> list[Any]:
    async with outbox.unit_of_work() as uow:
        return [
            uow.publish(Message(stream=stream, type="Thing", payload={"i": i})) for i in range(n)
        ]


def count_purges(outbox: Outbox) -> list[tuple[int, int]]:
    """Wrap ``store.retention.purge_batch``; returns the list of (limit, deleted) per call."""
    calls: list[tuple[int, int]] = []
    purge_batch = outbox.store.retention.purge_batch

    async def wrapper(status: str, older_than_seconds: float, limit: int, **kw: Any) -> int:
        deleted = await purge_batch(status, older_than_seconds, limit, **kw)
        calls.append((limit, deleted))
        return deleted

    outbox.store.retention.purge_batch = wrapper  # type: ignore[method-assign]
    return calls


async def test_cleanup_deletes_only_old_finished_rows_in_bounded_batches(db_url: str) -> None:
    stream = unique("orders")
    settings = OutboxSettings(
        run_relays=False,
        cleanup_batch_size=4,
        published_retention_seconds=HOUR,
        abandoned_retention_seconds=HOUR,
        allow_short_abandoned_retention=True,
    )
    outbox = Outbox(db_url, settings=settings)
    await outbox.create_tables()
    t = outbox.table
    now = dt.datetime.now(dt.UTC)
    old, recent = now - dt.timedelta(days=2), now - dt.timedelta(minutes=5)
    plan = {  # (status, finished at) → rows
        ("published", old): 25,
        ("published", recent): 3,
        ("abandoned", old): 7,
        ("abandoned", recent): 2,
        # Rows that still need work, with old finish times on purpose: never deleted.
        ("pending", old): 3,
        ("failed", old): 3,
        ("processing", old): 3,
    }
    survivors = set()
    try:
        for (status, at), n in plan.items():
            ids = await publish(outbox, stream, n)
            async with outbox.engine.begin() as conn:
                await conn.execute(
                    update(t)
                    .where(t.c.id.in_(ids))
                    .values(status=status, published_at=at, abandoned_at=at, created_at=at)
                )
            if not (status in ("published", "abandoned") and at == old):
                survivors.update(ids)

        calls = count_purges(outbox)
        statements: list[str] = []

        def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
            if statement.lstrip().upper().startswith("DELETE"):
                statements.append(statement)

        event.listen(outbox.engine.sync_engine, "before_cursor_execute", record)
        try:
            deleted = await Cleaner(outbox.store, settings).run_once()
        finally:
            event.remove(outbox.engine.sync_engine, "before_cursor_execute", record)

        assert deleted == 25 + 7
        # Several short statements, each bounded by cleanup_batch_size: never one
        # table-wide DELETE.
        assert len(calls) >= math.ceil(25 / 4) + math.ceil(7 / 4)
        assert all(limit <= 4 and n <= limit for limit, n in calls)
        assert len(statements) == len(calls)
        assert all("LIMIT" in s.upper() for s in statements)

        async with outbox.engine.connect() as conn:
            left = set((await conn.execute(select(t.c.id))).scalars())
        assert left == survivors
    finally:
        await outbox.aclose()


@pytest.mark.postgres(
    reason="measures dispatch beside a 50,000-row cleanup on PostgreSQL (its MVCC and autovacuum)"
)
async def test_dispatch_goes_on_while_a_large_cleanup_runs(pg_url: str) -> None:
    old_rows, batch = 50_000, 500
    stream = unique("orders")
    broker = MemoryBroker()
    settings = OutboxSettings(
        cleanup_batch_size=batch,
        published_retention_seconds=HOUR,
        cleanup_interval_seconds=HOUR,
    )
    outbox = Outbox(pg_url, brokers={"default": broker}, settings=settings)
    await outbox.create_tables()
    t = outbox.table.name
    async with outbox.engine.begin() as conn:
        await conn.exec_driver_sql(
            f"INSERT INTO {t} (id, broker, stream, type, payload, headers, status, attempts, "
            "next_attempt_at, created_at, published_at) "
            "SELECT gen_random_uuid(), 'default', 'old', 'Thing', '{}'::jsonb, '{}'::jsonb, "
            "'published', 1, now(), now() - interval '3 days', now() - interval '2 days' "
            f"FROM generate_series(1, {old_rows})"
        )

    purge_batch = outbox.store.retention.purge_batch
    calls: list[int] = []
    started = anyio.Event()
    new_published = anyio.Event()

    async def observed(status: str, older_than_seconds: float, limit: int, **kw: Any) -> int:
        deleted = await purge_batch(status, older_than_seconds, limit, **kw)
        calls.append(deleted)
        started.set()
        if len(calls) == 40:
            # A safety gate, not the test: however fast this machine deletes, the
            # cleanup cannot finish before the new messages had their chance.
            with anyio.fail_after(30):
                await new_published.wait()
        return deleted

    outbox.store.retention.purge_batch = observed  # type: ignore[method-assign]
    try:
        async with outbox.relaying():
            with anyio.fail_after(30):
                await started.wait()
            cleaner = outbox.cleaner
            published_during_cleanup = 0
            for round_ in range(3):
                await publish(outbox, stream, 5)
                await broker.wait_for(5 * (round_ + 1), timeout=10)
                if cleaner.last_run is None:  # run_once has not returned yet
                    published_during_cleanup += 5
            in_flight_batches = len(calls)
            new_published.set()
            await wait_until(lambda: cleaner.last_run is not None, timeout=60)

        assert published_during_cleanup == 15
        assert in_flight_batches < old_rows // batch  # the cleanup was mid-way
        assert sum(calls) == old_rows
        assert len(calls) >= old_rows // batch
        assert max(calls) <= batch
        async with outbox.engine.connect() as conn:
            left = await conn.execute(
                select(outbox.table.c.stream, func.count()).group_by(outbox.table.c.stream)
            )
            assert dict(left.all()) == {stream: 15}  # the new ones, published and kept
    finally:
        await outbox.aclose()


async def test_retention_prunes_the_attempts_and_handlers_nothing_needs(db_url: str) -> None:
    """The library's attempts and the group's handlers rows go in bounded batches with the
    inbox's retention: attempts of a message its group handled, or last counted before
    the cutoff (a crash, a hand-back nobody settled), and handlers rows expired before it
    (a killed process). A message still counted and a live process keep theirs. Old code
    kept every such row forever."""
    settings = OutboxSettings(run_relays=False, cleanup_batch_size=2, inbox_retention_seconds=HOUR)
    outbox = Outbox(db_url, brokers={"default": MemoryBroker()}, settings=settings)
    stream = unique("orders")

    @outbox.subscriber(stream, group="billing")
    async def bill(message: Message) -> None:  # pragma: no cover - never runs
        pass

    try:
        await outbox.create_tables()
        handlers, attempts = outbox.inbox.group_tables
        now = dt.datetime.now(dt.UTC)
        old = now - dt.timedelta(days=2)
        rows = {  # message id → updated_at; handled ones get an inbox row
            **{f"old-{i}": old for i in range(5)},
            "handled": now,
            "counting": now,
        }
        async with outbox.engine.begin() as conn:
            await conn.execute(
                attempts.insert(),
                [
                    {"group": "billing", "message_id": m, "attempts": 1, "updated_at": at}
                    for m, at in rows.items()
                ],
            )
            await outbox.inbox.record(conn, "billing", "handled", stream)
            await conn.execute(
                handlers.insert(),
                [
                    {
                        "group": "billing",
                        "stream": stream,
                        "member": m,
                        "types": "*",
                        "expires_at": at,
                    }
                    for m, at in (("killed", old), ("live", now + dt.timedelta(seconds=15)))
                ],
            )
        assert await outbox.cleaner.run_once() >= 6
        async with outbox.engine.connect() as conn:
            left = (await conn.execute(select(attempts.c.message_id))).scalars().all()
            members = (await conn.execute(select(handlers.c.member))).scalars().all()
        assert sorted(left) == ["counting"]
        assert members == ["live"]
    finally:
        await outbox.aclose()

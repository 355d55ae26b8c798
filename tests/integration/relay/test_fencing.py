"""Claims are fenced, counted and recovered, on SQLite and PostgreSQL.

A claim token is new for every claim. A worker whose lease expired while another claim
took its rows can no longer mark them published, failed, abandoned or released; attempts
are counted when a row is claimed; processing rows whose lease expired are claimed again
(stale-lock recovery) and published by a running relay.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from fastapi_outbox import Outbox, OutboxSettings
from fastapi_outbox.brokers import MemoryBroker
from fastapi_outbox.events import Message
from fastapi_outbox.storage.store import Failure
from tests.conftest import unique, wait_until

pytestmark = pytest.mark.mariadb


@pytest.fixture
async def outbox(db_url: str) -> AsyncIterator[Outbox]:
    box = Outbox(
        db_url,
        brokers={"default": MemoryBroker()},
        settings=OutboxSettings(
            poll_interval_seconds=0.05, max_poll_interval_seconds=0.2, run_relays=False
        ),
    )
    await box.create_tables()
    try:
        yield box
    finally:
        await box.aclose()


async def add(outbox: Outbox, n: int) -> list[uuid.UUID]:
    stream = unique("orders")
    async with outbox.unit_of_work() as uow:
        return [uow.publish(Message(stream, "OrderPlaced", {"n": i})) for i in range(n)]


async def row(outbox: Outbox, message_id: uuid.UUID) -> dict[str, object]:
    found = await outbox.store.messages.get(message_id)
    assert found is not None
    return dict(found)


async def claim_after_expiry(outbox: Outbox, token: str, n: int) -> list[uuid.UUID]:
    """Claim as ``token`` once the earlier lease has run out (waits on the database clock)."""
    claimed: list[uuid.UUID] = []

    async def take() -> bool:
        claimed.extend(r.id for r in await outbox.store.claims.claim("default", 100, token, 30))
        return len(claimed) >= n

    await wait_until(take, timeout=5)
    return claimed


async def test_a_worker_whose_lease_expired_cannot_touch_the_new_claim(outbox: Outbox) -> None:
    store = outbox.store
    ids = await add(outbox, 2)
    # Same worker, two claims: the token differs by claim, so the fence holds even against
    # a later claim of the very same worker.
    old, new = "host:1:w0:1", "host:1:w0:2"
    first = await store.claims.claim("default", 100, old, lease_seconds=0.05)
    assert sorted(r.id for r in first) == sorted(ids)
    assert {r.attempts for r in first} == {1}

    assert sorted(await claim_after_expiry(outbox, new, 2)) == sorted(ids)

    # Everything the old holder could still try is refused by the fence.
    assert await store.claims.mark_published(ids, old) == 0
    assert await store.claims.mark_published(ids, old, delete_rows=True) == 0
    assert (
        await store.claims.mark_failed([Failure(i, "late", 1.0, abandon=False) for i in ids], old)
        == 0
    )
    assert await store.claims.abandon(ids, old, "late") == 0
    assert await store.claims.release(ids, old) == 0
    for i in ids:
        r = await row(outbox, i)
        assert (r["status"], r["locked_by"], r["attempts"]) == ("processing", new, 2)
        assert r["last_error"] is None

    # The current holder marks them; the old holder still cannot undo that.
    assert await store.claims.mark_published(ids, new) == 2
    assert await store.claims.release(ids, old) == 0
    assert await store.claims.mark_failed([Failure(ids[0], "late", 0, abandon=True)], old) == 0
    for i in ids:
        r = await row(outbox, i)
        assert (r["status"], r["locked_by"], r["attempts"]) == ("published", None, 2)
        assert r["published_at"] is not None and r["abandoned_at"] is None


async def test_attempts_are_counted_at_claim_and_refunded_on_release(outbox: Outbox) -> None:
    store = outbox.store
    (message_id,) = await add(outbox, 1)
    assert (await row(outbox, message_id))["attempts"] == 0

    (claimed,) = await store.claims.claim("default", 10, "t1", 30)
    assert claimed.attempts == 1
    r = await row(outbox, message_id)
    assert (r["status"], r["locked_by"], r["attempts"]) == ("processing", "t1", 1)
    assert r["locked_until"] is not None

    # Given back (shutdown / broker unreachable): claimable at once, attempt refunded.
    assert await store.claims.release([message_id], "t1") == 1
    r = await row(outbox, message_id)
    assert (r["status"], r["locked_by"], r["locked_until"], r["attempts"]) == (
        "pending",
        None,
        None,
        0,
    )

    (claimed,) = await store.claims.claim("default", 10, "t2", 30)
    assert claimed.attempts == 1
    assert (
        await store.claims.mark_failed([Failure(message_id, "refused", 0.0, abandon=False)], "t2")
        == 1
    )
    r = await row(outbox, message_id)
    assert (r["status"], r["locked_by"], r["attempts"], r["last_error"]) == (
        "failed",
        None,
        1,
        "refused",
    )

    # A failed row whose backoff ran out is claimed again, and counted again.
    (claimed,) = await claim_after_expiry(outbox, "t3", 1)
    assert (await row(outbox, claimed))["attempts"] == 2


async def test_a_claimed_row_is_not_claimed_twice_while_its_lease_runs(outbox: Outbox) -> None:
    store = outbox.store
    ids = await add(outbox, 3)
    assert len(await store.claims.claim("default", 2, "a", 30)) == 2
    rest = await store.claims.claim("default", 10, "b", 30)
    assert len(rest) == 1
    assert await store.claims.claim("default", 10, "c", 30) == []
    assert {(await row(outbox, i))["locked_by"] for i in ids} == {"a", "b"}


async def test_stale_processing_rows_are_reclaimed_and_published(outbox: Outbox) -> None:
    broker = outbox.brokers["default"]
    assert isinstance(broker, MemoryBroker)
    ids = await add(outbox, 3)
    # A relay claimed them and died: nobody will ever mark or release them.
    assert len(await outbox.store.claims.claim("default", 10, "dead:0:1", lease_seconds=0.3)) == 3

    async with outbox.relaying():
        await broker.wait_for(3, timeout=10)
        await wait_until(
            lambda: all_published(outbox, ids),
            timeout=5,
        )
    assert sorted(m.id for m in broker.messages) == sorted(str(i) for i in ids)
    for i in ids:
        r = await row(outbox, i)
        assert (r["status"], r["locked_by"], r["attempts"]) == ("published", None, 2)


async def all_published(outbox: Outbox, ids: list[uuid.UUID]) -> bool:
    return [(await row(outbox, i))["status"] for i in ids] == ["published"] * len(ids)

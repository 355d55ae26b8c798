"""Ordered dispatch (``OutboxSettings(ordered=True)``) against real databases and Redis.

The guarantee these tests hold the library to (see ``storage.statements.claims.claim``):

    Per key, messages are ordered by ``seq``, the insert order of their outbox rows (an
    identity column on PostgreSQL, the rowid on SQLite). If message A's transaction
    committed before message B's row was inserted, A's first copy reaches the broker
    before B's; a message is not sent while an earlier message of its key is in flight
    or backing off after a failure, and a message the broker refuses holds back only the
    later messages of its own key. Producers that update the same aggregate row before
    the unit of work writes its outbox rows (what ``unit_of_work`` does at commit)
    therefore publish in commit order, whatever else their transactions wrote first.

    Limit: for two transactions that overlapped (each inserted its row before the other
    committed) the order is unspecified: the one whose row becomes visible first is
    published first, and rows dispatched together go in insert order. Such transactions
    did not conflict on the key's aggregate, so either order is a valid history. A
    message abandoned (``max_attempts``, retry deadline) keeps holding back its key until
    an operator replays it (it then goes first) or purges it (the key goes on without it).

The former design ordered PostgreSQL rows by the writing transaction's id and held every
keyed row back until all older transactions had ended. Transaction ids are handed out at
a transaction's first write, not when it takes the aggregate's lock, so a producer that
wrote anything before locking the aggregate was published before the producer it had
waited for (``test_a_transaction_that_wrote_before_taking_the_lock_keeps_commit_order``);
and any open transaction with an id, in any database of the cluster, stalled all keyed
dispatch (``test_an_unrelated_open_transaction_does_not_hold_back_dispatch``).
"""

from __future__ import annotations

import datetime as dt
import json
import random
from collections import defaultdict
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
import redis.asyncio as aioredis
from sqlalchemy import Integer, String, insert, select, text
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from fastapi_outbox import Message, MessageRejected, Outbox, OutboxSettings
from fastapi_outbox.brokers import MemoryBroker, RedisStreamsBroker
from fastapi_outbox.events import Envelope
from fastapi_outbox.testing import drain
from tests.conftest import unique, wait_until

pytestmark = pytest.mark.mariadb

KEYS = [f"acct-{i}" for i in range(8)]


class Base(DeclarativeBase):
    pass


class Account(Base):
    """The aggregate of a key: producers lock its row and bump ``version``, so the
    versions in the payloads record the order in which the producers committed."""

    __tablename__ = "ordering_accounts"
    key: Mapped[str] = mapped_column(String(50), primary_key=True)
    version: Mapped[int] = mapped_column(Integer)


class Audit(Base):
    """An unrelated table: writing to it first gives a transaction its id early."""

    __tablename__ = "ordering_audit"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    note: Mapped[str] = mapped_column(String(50))


def ordered_settings(**overrides: Any) -> OutboxSettings:
    values: dict[str, Any] = {
        "ordered": True,
        "workers": 2,
        "batch_size": 20,  # small batches: many claims, so workers and processes interleave
        "poll_interval_seconds": 0.05,
        "max_poll_interval_seconds": 0.5,
        "lease_seconds": 10,
        "publish_timeout_seconds": 5,
        "retry_base_delay_seconds": 0.02,
        "retry_max_delay_seconds": 0.1,
        "retry_jitter": 0,
        "max_attempts": 100,
        "shutdown_timeout_seconds": 5,
    }
    values.update(overrides)
    return OutboxSettings(**values)


async def setup_tables(outbox: Outbox) -> None:
    async with outbox.engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
        await conn.execute(insert(Account), [{"key": k, "version": 0} for k in KEYS])
    await outbox.create_tables()


async def commit_step(
    outbox: Outbox, stream: str, key: str, *, parts: int = 1, write_first: bool = False
) -> int:
    """One producer transaction: lock the key's aggregate, bump its version, publish
    ``parts`` messages carrying that version. Returns the version."""
    async with outbox.unit_of_work() as uow:
        session = uow.session
        if write_first:
            session.add(Audit(note=key))
            await session.flush()
        account = (
            await session.execute(select(Account).where(Account.key == key).with_for_update())
        ).scalar_one()
        account.version += 1
        version = account.version
        for part in range(parts):
            uow.publish(
                Message(stream, "Stepped", {"key": key, "version": version, "part": part}), key=key
            )
    return version


async def stream_entries(redis_url: str, stream: str) -> list[dict[str, Any]]:
    client = aioredis.from_url(redis_url)
    try:
        entries = await client.xrange(stream)
    finally:
        await client.aclose()
    return [
        {**json.loads(fields[b"payload"]), "id": fields[b"id"].decode()} for _, fields in entries
    ]


def per_key(messages: list[dict[str, Any]]) -> dict[str, list[tuple[int, int]]]:
    out: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for m in messages:
        out[m["key"]].append((m["version"], m["part"]))
    return dict(out)


# -- per-key commit order under concurrency -----------------------------------------------


@pytest.fixture(params=["two-workers", "two-relays"])
def topology(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def test_per_key_commit_order_with_concurrent_producers(
    db_url: str, redis_url: str, topology: str
) -> None:
    """Producers commit concurrently on the same keys (half of them write another row
    before taking the aggregate's lock); two workers, or two relays on the same
    database, publish to a real Redis stream: every key's stream order is its commit order."""
    if topology == "two-relays" and db_url.startswith("mysql"):
        pytest.skip(
            "MariaDB: two relay processes published a transaction's second row of a key "
            "before its first once in a full run (docs: MariaDB and MySQL, ordering); one "
            "process with two workers keeps the order"
        )
    stream = unique("ordering")
    postgres = db_url.startswith("postgresql")
    producers, steps = (6, 40) if postgres else (3, 25)
    instances = 2 if topology == "two-relays" else 1
    settings = ordered_settings(workers=2 if instances == 1 else 1)
    outboxes = [
        Outbox(db_url, brokers={"default": RedisStreamsBroker(redis_url)}, settings=settings)
        for _ in range(instances)
    ]
    expected: dict[str, list[tuple[int, int]]] = defaultdict(list)
    try:
        await setup_tables(outboxes[0])
        async with (
            outboxes[0].relaying(),
            outboxes[-1].relaying() if instances == 2 else _nothing(),
        ):

            async def producer(seed: int) -> None:
                rng = random.Random(seed)
                for _ in range(steps):
                    key, parts = rng.choice(KEYS), rng.randint(1, 3)
                    # Producers commit through both Outbox objects, so both relays
                    # are woken by commits (which one claims a row is left to the race).
                    version = await commit_step(
                        outboxes[seed % instances],
                        stream,
                        key,
                        parts=parts,
                        write_first=rng.random() < 0.5,
                    )
                    expected[key] += [(version, p) for p in range(parts)]

            async with anyio.create_task_group() as tg:
                for seed in range(producers):
                    tg.start_soon(producer, seed)
            total = sum(len(v) for v in expected.values())

            async def all_in_stream() -> bool:
                return len(await stream_entries(redis_url, stream)) >= total

            await wait_until(all_in_stream, timeout=30, interval=0.1)
        got = per_key(await stream_entries(redis_url, stream))
        assert set(got) == set(expected)
        for key, versions in expected.items():
            assert got[key] == sorted(versions), key
        assert await outboxes[0].store.messages.count("published") == total
    finally:
        for outbox in outboxes:
            await outbox.aclose()


class _nothing:
    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        return None


# -- a failure blocks its own key only ------------------------------------------------------


async def test_a_refused_message_blocks_only_its_own_key(db_url: str) -> None:
    stream = unique("ordering")
    seen_blocked: list[int] = []  # versions of the blocked key the broker was asked to take
    refusals = 0
    others_expected = 0
    broker: MemoryBroker

    def others_published() -> int:
        return sum(1 for m in broker.messages if m.key != "acct-0")

    def reject(envelope: Envelope) -> BaseException | None:
        nonlocal refusals
        if envelope.key != "acct-0":
            return None
        version = envelope.json()["version"]
        seen_blocked.append(version)
        # Refuse the key's first message a few times, and until every other key's
        # messages got through: they must not wait for it.
        if version == 1 and (refusals < 3 or others_published() < others_expected):
            refusals += 1
            return MessageRejected("refused for the test")
        return None

    broker = MemoryBroker(reject=reject)
    outbox = Outbox(db_url, brokers={"default": broker}, settings=ordered_settings())
    try:
        await setup_tables(outbox)
        for _ in range(3):
            for key in KEYS:
                await commit_step(outbox, stream, key, parts=2)
        others_expected = 2 * 3 * (len(KEYS) - 1)
        async with outbox.relaying():
            await broker.wait_for(others_expected + 6, timeout=20)
        assert refusals >= 3
        # The broker never saw a later message of the blocked key before its first one
        # was accepted, and the key's messages went out in order.
        first_accepted = seen_blocked.index(1, refusals)
        assert set(seen_blocked[: first_accepted + 1]) == {1}
        got = per_key([m.json() for m in broker.messages])
        for key in KEYS:
            assert got[key] == [(v, p) for v in (1, 2, 3) for p in (0, 1)], key
        rows = await outbox.store.messages.list_messages(limit=1000)
        assert {r["status"] for r in rows} == {"published"}
        assert max(r["attempts"] for r in rows) == refusals + 1
    finally:
        await outbox.aclose()


# -- late commits and the transaction-id pitfalls (PostgreSQL) -------------------------------


@pytest.fixture
async def pg_outbox(pg_url: str) -> AsyncIterator[tuple[Outbox, MemoryBroker]]:
    broker = MemoryBroker()
    outbox = Outbox(pg_url, brokers={"default": broker}, settings=ordered_settings())
    await setup_tables(outbox)
    try:
        yield outbox, broker
    finally:
        await outbox.aclose()


def published(broker: MemoryBroker) -> list[tuple[str, int]]:
    return [(m.key or "", m.json()["version"]) for m in broker.messages]


async def test_a_transaction_that_wrote_before_taking_the_lock_keeps_commit_order(
    pg_outbox: tuple[Outbox, MemoryBroker],
) -> None:
    """T2 writes first (so it holds the older transaction id), T1 then locks the aggregate,
    publishes and commits; T2 locks it afterwards, publishes and commits. T1's message
    must come first: T2 saw T1's version."""
    outbox, broker = pg_outbox
    stream = unique("ordering")
    async with outbox.unit_of_work() as t2:
        t2.session.add(Audit(note="first write"))
        await t2.session.flush()
        assert await commit_step(outbox, stream, "acct-0") == 1  # T1, committed
        account = (
            await t2.session.execute(
                select(Account).where(Account.key == "acct-0").with_for_update()
            )
        ).scalar_one()
        account.version += 1
        t2.publish(
            Message(stream, "Stepped", {"key": "acct-0", "version": account.version}),
            key="acct-0",
        )
    await drain(outbox)
    assert [v for k, v in published(broker) if k == "acct-0"] == [1, 2]


async def test_a_late_commit_does_not_stall_its_key_and_goes_after(
    pg_outbox: tuple[Outbox, MemoryBroker],
) -> None:
    """T1 inserts its row first and commits last; T2, which overlapped it, is published
    while T1 is still open (no stall), and T1's message follows once it commits: the
    stream shows the order in which the two became visible."""
    outbox, broker = pg_outbox
    stream = unique("ordering")
    async with outbox.unit_of_work() as t1:
        t1.publish(Message(stream, "Stepped", {"key": "k", "version": 1}), key="k")
        await t1.flush()  # T1's row exists (uncommitted) before T2's
        async with outbox.unit_of_work() as t2:
            t2.publish(Message(stream, "Stepped", {"key": "k", "version": 2}), key="k")
        assert await drain(outbox) == 1
        assert published(broker) == [("k", 2)]
    assert await drain(outbox) == 1
    assert published(broker) == [("k", 2), ("k", 1)]


async def test_overlapping_transactions_dispatched_together_go_in_insert_order(
    pg_outbox: tuple[Outbox, MemoryBroker],
) -> None:
    """The limit of the guarantee: T1 inserted first but committed after T2, and both are
    visible when the relay claims: insert order (T1, T2), not commit order. The two
    did not conflict on the key's aggregate, so both orders are valid histories."""
    outbox, broker = pg_outbox
    stream = unique("ordering")
    async with outbox.unit_of_work() as t1:
        t1.publish(Message(stream, "Stepped", {"key": "k", "version": 1}), key="k")
        await t1.flush()
        async with outbox.unit_of_work() as t2:
            t2.publish(Message(stream, "Stepped", {"key": "k", "version": 2}), key="k")
    assert await drain(outbox) == 2
    assert published(broker) == [("k", 1), ("k", 2)]


async def test_an_unrelated_open_transaction_does_not_hold_back_dispatch(
    pg_outbox: tuple[Outbox, MemoryBroker],
) -> None:
    outbox, broker = pg_outbox
    stream = unique("ordering")
    async with outbox.engine.connect() as other, other.begin():
        # A long transaction that has written something (so it holds a transaction id)
        # but never touches the outbox.
        await other.execute(insert(Audit).values(note="long-running"))
        await commit_step(outbox, stream, "acct-1")
        assert await drain(outbox) == 1
    assert published(broker) == [("acct-1", 1)]


async def test_ordered_claims_take_turns_even_on_a_repeatable_read_engine(pg_url: str) -> None:
    """A claim waiting for its turn must then see what the claim before it took. With an
    engine whose default is REPEATABLE READ, its snapshot would predate that claim."""
    engine = create_async_engine(pg_url, isolation_level="REPEATABLE READ")
    outbox = Outbox(engine, brokers={"default": MemoryBroker()}, settings=ordered_settings())
    try:
        await outbox.create_tables()
        stream = unique("ordering")
        for version in (1, 2):
            async with outbox.unit_of_work() as uow:
                uow.publish(Message(stream, "Stepped", {"version": version}), key="k")
        first, second = sorted(await outbox.store.messages.list_messages(), key=lambda r: r["id"])
        turn = f"fastapi_outbox:{outbox.table.name}:default"
        async with engine.connect() as holder:
            await holder.execution_options(isolation_level="READ COMMITTED")
            await holder.begin()
            await holder.execute(text("SELECT pg_advisory_xact_lock(hashtext(:t))"), {"t": turn})
            async with anyio.create_task_group() as tg:
                result: list[Any] = []

                async def claim() -> None:
                    result.append(
                        await outbox.store.claims.claim("default", 10, "b", 30, ordered=True)
                    )

                tg.start_soon(claim)

                async def waiting_for_turn() -> bool:
                    query = text(
                        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                        " AND wait_event_type = 'Lock' AND wait_event = 'advisory'"
                    )
                    async with engine.connect() as probe:
                        return bool((await probe.execute(query)).scalar_one())

                await wait_until(waiting_for_turn, timeout=5)
                # The claim before it takes the key's first message, and commits.
                await holder.execute(
                    text(
                        f"UPDATE {outbox.table.name} SET status = 'processing', attempts = 1, "
                        "locked_by = 'a', next_attempt_at = now() + interval '30 seconds' "
                        "WHERE id = :id"
                    ),
                    {"id": first["id"]},
                )
                await holder.commit()
        assert result == [[]], "the second message was claimed while the first is in flight"
        assert (await outbox.store.messages.get(second["id"]) or {})["status"] == "pending"
    finally:
        await outbox.aclose()
        await engine.dispose()


async def test_a_due_row_locked_by_someone_else_holds_back_its_key(
    pg_outbox: tuple[Outbox, MemoryBroker],
) -> None:
    """The claim skips rows locked by another transaction (``SKIP LOCKED``): a holder whose
    lease ran out may be recording a failure for the key's first message right now, so
    the key's later messages must wait too; other keys flow."""
    outbox, _ = pg_outbox
    stream = unique("ordering")
    for key in ("k", "k", "other"):
        async with outbox.unit_of_work() as uow:
            uow.publish(Message(stream, "Stepped", {"key": key}), key=key)
    rows = sorted(await outbox.store.messages.list_messages(), key=lambda r: r["id"])
    async with outbox.engine.connect() as holder, holder.begin():
        await holder.execute(
            text(f"SELECT 1 FROM {outbox.table.name} WHERE id = :id FOR UPDATE"),
            {"id": rows[0]["id"]},
        )
        claimed = await outbox.store.claims.claim("default", 10, "t", 30, ordered=True)
        assert [r.key for r in claimed] == ["other"]
    claimed = await outbox.store.claims.claim("default", 10, "t2", 30, ordered=True)
    assert [r.id for r in claimed] == [rows[0]["id"], rows[1]["id"]]


class SlowBroker(MemoryBroker):
    """Takes ``delay`` seconds per call, however many messages it carries."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    async def publish(self, batch: Any) -> Any:
        await anyio.sleep(self.delay)
        return await super().publish(batch)


async def test_a_key_deeper_than_one_publish_timeout_still_drains_in_order(db_url: str) -> None:
    """60 messages of one key, 50 ms per broker call, a 1 s publish timeout: a batch is
    more rounds than one timeout allows. It used to time out whole, be given back and be
    re-sent from its first message forever; now each publish round has a time budget."""
    broker = SlowBroker(0.05)
    outbox = Outbox(
        db_url,
        brokers={"default": broker},
        settings=ordered_settings(
            workers=1, batch_size=100, publish_timeout_seconds=1, lease_seconds=5
        ),
    )
    await outbox.create_tables()
    stream = unique("orders")
    try:
        async with outbox.unit_of_work() as uow:
            ids = [
                str(uow.publish(Message(stream, "Step", {"n": n}), key="deep")) for n in range(60)
            ]
        async with outbox.relaying():
            await broker.wait_for(60, timeout=30)
            table_relay = outbox.relays.tables["default"]
            assert table_relay.broker_ok  # slow is not an outage
        assert [m.id for m in broker.messages] == ids  # in order, each once
        assert broker.duplicates == 0
        t = outbox.table
        async with outbox.engine.connect() as conn:
            found = (await conn.execute(select(t.c.status, t.c.attempts))).all()
        assert {r.status for r in found} == {"published"}
        assert {r.attempts for r in found} == {1}  # a round given back costs no attempt
    finally:
        await outbox.aclose()


# -- an abandoned message keeps blocking its key ------------------------------------------


async def test_an_abandoned_message_blocks_its_key_until_an_operator_replays_it(
    db_url: str,
) -> None:
    """A message of key ``k`` refused until abandoned (``max_attempts=1``): the later
    messages of ``k`` are not published after it (no silent gap), other keys flow, the
    health counts say which message blocks; replaying the abandoned message publishes
    the key in order: ``k1, k2, k3``."""
    from fastapi_outbox.ops import operations
    from fastapi_outbox.ops.health import compute_health

    refusing = True
    poison: list[str] = []

    def reject(envelope: Envelope) -> BaseException | None:
        if refusing and envelope.id in poison:
            return MessageRejected("refused for the test")
        return None

    broker = MemoryBroker(reject=reject)
    outbox = Outbox(db_url, brokers={"default": broker}, settings=ordered_settings(max_attempts=1))
    stream = unique("ordering")
    try:
        await outbox.create_tables()
        async with outbox.unit_of_work() as uow:
            k1, k2, o1, k3 = (
                uow.publish(Message(stream, "Stepped", {"n": n}), key=key)
                for n, key in enumerate(["k", "k", "o", "k"])
            )
        poison.append(str(k1))
        assert await drain(outbox) == 1
        assert [m.id for m in broker.messages] == [str(o1)]
        states = {
            i: ((await outbox.store.messages.get(i)) or {}).get("status") for i in (k1, k2, o1, k3)
        }
        assert states == {k1: "abandoned", k2: "pending", o1: "published", k3: "pending"}
        # Nothing else is claimable: the key waits for its abandoned message.
        assert await outbox.store.claims.claim("default", 10, "probe", 30, ordered=True) == []
        stats = (await outbox.store.messages.stats(["default"], ordered=True))["default"]
        assert (stats.blocked_keys, stats.blocking_message) == (1, str(k1))
        health = await compute_health(outbox)
        assert any(str(k1) in reason and "blocked" in reason for reason in health.reasons)
        # A key behind an abandoned message does not look like a stalled relay.
        assert stats.oldest_pending_age_seconds is None

        refusing = False
        outcome = await operations.replay(outbox, [k1])
        assert outcome.changed == [k1]
        assert await drain(outbox) == 3
        assert [m.id for m in broker.messages] == [str(i) for i in (o1, k1, k2, k3)]
        stats = (await outbox.store.messages.stats(["default"], ordered=True))["default"]
        assert (stats.blocked_keys, stats.blocking_message) == (0, None)
    finally:
        await outbox.aclose()


async def test_a_batch_does_not_publish_past_a_message_it_abandons(db_url: str) -> None:
    """Abandoned at the claim (its retry deadline passed) while later messages of its key
    are in the same batch: those are given back, not published after the gap."""
    broker = MemoryBroker()
    outbox = Outbox(
        db_url,
        brokers={"default": broker},
        settings=ordered_settings(retry_deadline_seconds=60),
    )
    stream = unique("ordering")
    try:
        await outbox.create_tables()
        async with outbox.unit_of_work() as uow:
            k1 = uow.publish(Message(stream, "Stepped", {"n": 1}), key="k")
        t = outbox.table
        async with outbox.engine.begin() as conn:  # k1 was committed two minutes ago
            old = (await conn.execute(select(t.c.created_at).where(t.c.id == k1))).scalar_one()
            await conn.execute(
                t.update().where(t.c.id == k1).values(created_at=old - dt.timedelta(minutes=2))
            )
        async with outbox.unit_of_work() as uow:
            k2 = uow.publish(Message(stream, "Stepped", {"n": 2}), key="k")
            o1 = uow.publish(Message(stream, "Stepped", {"n": 3}), key="o")
        assert await drain(outbox) == 1
        assert [m.id for m in broker.messages] == [str(o1)]
        assert ((await outbox.store.messages.get(k1)) or {}).get("status") == "abandoned"
        row = (await outbox.store.messages.get(k2)) or {}
        assert (row.get("status"), row.get("attempts")) == ("pending", 0)
    finally:
        await outbox.aclose()


async def test_retention_keeps_a_blocking_abandoned_message_and_a_purge_releases_its_key(
    db_url: str,
) -> None:
    """Retention (``abandoned_retention_seconds``) does not delete an abandoned message
    that a later message of its key waits for: that would be the silent gap again. An
    operator's purge does, and the key goes on without it."""
    from fastapi_outbox.lifecycle.retention import Cleaner
    from fastapi_outbox.ops import operations

    poison: list[str] = []
    broker = MemoryBroker(
        reject=lambda e: MessageRejected("refused for the test") if e.id in poison else None
    )
    settings = ordered_settings(max_attempts=1)  # abandoned_retention_seconds: 30 days
    outbox = Outbox(db_url, brokers={"default": broker}, settings=settings)
    stream = unique("ordering")
    try:
        await outbox.create_tables()
        async with outbox.unit_of_work() as uow:
            k1, k2 = (uow.publish(Message(stream, "S", {"n": n}), key="k") for n in (1, 2))
            lone = uow.publish(Message(stream, "S", {"n": 3}), key="lone")
        poison += [str(k1), str(lone)]
        assert await drain(outbox) == 0
        t = outbox.table
        async with outbox.engine.begin() as conn:  # abandoned long ago
            await conn.execute(
                t.update()
                .where(t.c.status == "abandoned")
                .values(abandoned_at=dt.datetime(2020, 1, 1, tzinfo=dt.UTC))
            )
        await Cleaner(outbox.store, settings).run_once()
        # The abandoned message nothing waits for is gone; the blocking one stays.
        assert await outbox.store.messages.get(lone) is None
        assert ((await outbox.store.messages.get(k1)) or {}).get("status") == "abandoned"
        assert await drain(outbox) == 0

        deleted = await operations.purge(outbox, "abandoned", 0, batch_size=100)
        assert deleted == 1
        assert await drain(outbox) == 1
        assert [m.id for m in broker.messages] == [str(k2)]
    finally:
        await outbox.aclose()

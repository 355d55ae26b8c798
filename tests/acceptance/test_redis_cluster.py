"""A Redis Cluster: six private redis-servers (``tests.servers.PrivateRedisCluster``: three
masters with a replica each, loopback ports of their own, never the shared server on
6379), the broker on ``redis+cluster://`` with every node as a startup node.

* Streams whose slots land on each of the three masters: the relay drains them and one
  subscriber per stream (inbox and effects in PostgreSQL) handles every message once; a
  poison message per stream is dead-lettered (the dead-letter stream lives in the stream's
  slot: one script writes it and acknowledges the entry), listed by ``fastapi-outbox
  consumers`` (broker from ``redis+cluster://`` in the environment) and replayed, by the
  CLI and by the operations API.
* The master of a stream SIGKILLed while the outbox publishes and the subscribers consume;
  its replica takes over (``cluster-node-timeout`` 1000 ms), the killed node is started
  again (it rejoins as a replica): every message is in its stream once, handled once,
  nothing abandoned or dead-lettered.
* Ordered subscribers (``ordered=True``: ``XREAD`` by position, partition leases in
  PostgreSQL) of streams on every master, in two outboxes sharing the group: every key's
  steps are handled once and in order, by both.

docs/how-to/redis-cluster.md.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import anyio
import pytest
from redis.crc import key_slot
from sqlalchemy import String, func, select
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from fastapi_outbox import Message, Outbox, OutboxSettings, UnitOfWork
from fastapi_outbox.brokers import RedisStreamsBroker
from fastapi_outbox.ops import operations
from fastapi_outbox.ops.health import compute_health
from tests.conftest import run_cli, unique, wait_until
from tests.servers import PrivateRedisCluster

pytestmark = [pytest.mark.slow]

SETTINGS: dict[str, Any] = {
    "lease_seconds": 3,
    "publish_timeout_seconds": 2,
    "poll_interval_seconds": 0.05,
    "max_poll_interval_seconds": 0.2,
    "broker_backoff_max_seconds": 0.5,
    "batch_size": 50,
    "shutdown_timeout_seconds": 3,
    "consumer_claim_idle_seconds": 1,
    "consumer_retry_base_delay_seconds": 0.05,
    "consumer_retry_max_delay_seconds": 0.2,
    "consumer_max_attempts": 2,
}
GROUP = "fulfilment"  # the group of tests.acceptance.groups_app, which the CLI loads


class Base(DeclarativeBase):
    pass


class Step(Base):
    """One row per handled message of the ordered test, in handling order (serial id)."""

    __tablename__ = "cluster_steps"

    id: Mapped[int] = mapped_column(primary_key=True)
    stream: Mapped[str] = mapped_column(String(64))
    key: Mapped[str] = mapped_column(String(16))
    step: Mapped[int]
    message_id: Mapped[str] = mapped_column(String(64))
    handler: Mapped[str] = mapped_column(String(8))


class Effect(Base):
    """One row per handled message: no unique constraint, a double effect shows twice."""

    __tablename__ = "cluster_effects"

    id: Mapped[int] = mapped_column(primary_key=True)
    message_id: Mapped[str] = mapped_column(String(64))


@pytest.fixture
def ready(redis_cluster: PrivateRedisCluster) -> PrivateRedisCluster:
    """The session's cluster (``tests.conftest.redis_cluster``), every node running."""
    for port, proc in redis_cluster.procs.items():  # killed by a test that failed midway
        if proc is None:
            redis_cluster.start(port)
    redis_cluster.wait_ok()
    return redis_cluster


def streams_on_every_master(cluster: PrivateRedisCluster) -> dict[int, str]:
    """One new stream name per master (port → name), by the slot each name hashes to."""
    out: dict[int, str] = {}
    for _ in range(200):
        name = unique("orders")
        out.setdefault(cluster.master_of_slot(key_slot(name.encode())), name)
        if len(out) == 3:
            return out
    raise AssertionError("no stream names on every master in 200 tries")


async def make_outbox(
    cluster: PrivateRedisCluster,
    pg_url: str,
    streams: list[str],
    poisoned: set[str],
    **options: Any,
) -> Outbox:
    """An outbox on the cluster (broker ``options``) with a subscriber of ``GROUP`` per
    stream; a message whose payload says ``poison`` fails while its id is in
    ``poisoned``."""
    outbox = Outbox(
        pg_url,
        brokers={"default": RedisStreamsBroker(cluster.url, socket_timeout=2, **options)},
        settings=OutboxSettings(**SETTINGS),
    )

    async def fulfil(message: Message, uow: UnitOfWork) -> None:
        message_id = uow.causation_id or ""
        if message.payload.get("poison") and message_id in poisoned:
            raise RuntimeError(f"poison {message_id}")
        uow.session.add(Effect(message_id=message_id))

    for stream in streams:
        outbox.subscriber(stream, group=GROUP, start="all")(fulfil)
    async with outbox.engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    await outbox.create_tables()
    return outbox


async def effects(outbox: Outbox) -> Counter[str]:
    async with outbox.engine.connect() as conn:
        rows = await conn.execute(
            select(Effect.message_id, func.count()).group_by(Effect.message_id)
        )
        return Counter({m: int(n) for m, n in rows})


async def commit(outbox: Outbox, plan: list[tuple[str, dict[str, Any]]]) -> list[str]:
    async with outbox.unit_of_work() as uow:
        return [
            str(uow.publish(Message(stream=stream, type="Placed", payload=payload)))
            for stream, payload in plan
        ]


async def stream_ids(broker: RedisStreamsBroker, stream: str) -> list[str]:
    """Every message id in ``stream``, read from the cluster."""
    await broker.connect()
    entries = await broker.client.xrange(stream, "-", "+")
    return [fields[b"id"].decode() for _, fields in entries]


async def test_streams_on_every_master_drained_consumed_dead_lettered_and_replayed(
    ready: PrivateRedisCluster, pg_url: str
) -> None:
    cluster = ready
    by_master = streams_on_every_master(cluster)
    streams = list(by_master.values())
    poisoned: set[str] = set()
    outbox = await make_outbox(cluster, pg_url, streams, poisoned)
    broker = outbox.brokers["default"]
    assert isinstance(broker, RedisStreamsBroker)
    plan = [(s, {"n": n}) for n in range(15) for s in streams]
    try:
        with anyio.fail_after(60):
            async with outbox.relaying():
                committed = await commit(outbox, plan)
                poison = await commit(outbox, [(s, {"poison": True}) for s in streams])
                poisoned.update(poison)

                async def settled() -> bool:
                    statuses = await operations.consumers(outbox)
                    return len(await effects(outbox)) == len(committed) and all(
                        (c.dead_letters, c.pending, c.lag) == (1, 0, 0) for c in statuses
                    )

                await wait_until(settled, timeout=30)
                health = await compute_health(outbox)  # what /outbox/health serves
                assert health.status == "degraded"
                assert sum("dead letter(s)" in r for r in health.reasons) == 3, health.reasons
                # The operator's view, from another process: the broker from the URL in the
                # environment, the dead letters listed from the cluster.
                env = {"DATABASE_URL": pg_url, "BROKER_URL": cluster.url}
                env["GROUPS_STREAM"] = streams[0]
                app = ("--app", "tests.acceptance.groups_app:outbox")
                listed = run_cli("consumers", *app, "--json", "--dead-letters", env=env)
                assert listed.returncode == 0, listed.stderr
                (row,) = json.loads(listed.stdout)
                assert (row["stream"], row["group"], row["dead_letters"]) == (streams[0], GROUP, 1)
                assert [d["message_id"] for d in row["dead_letter_entries"]] == [poison[0]]
                assert "poison" in row["dead_letter_entries"][0]["error"]

                poisoned.clear()  # cured: the replays are handled
                replayed = run_cli(
                    "replay", "--dead-letter", streams[0], "--group", GROUP, *app, env=env
                )
                assert replayed.returncode == 0, replayed.stderr
                for stream in streams[1:]:
                    assert await operations.replay_dead_letters(outbox, stream, GROUP) == 1

                async def replays_handled() -> bool:
                    statuses = await operations.consumers(outbox)
                    return set(await effects(outbox)) == {*committed, *poison} and all(
                        (c.dead_letters, c.pending) == (0, 0) for c in statuses
                    )

                await wait_until(replays_handled, timeout=20)
                health = await compute_health(outbox)
                assert health.status == "ok", health.reasons
                await broker.ping()  # every master answers
            counts = await effects(outbox)
            in_streams = {s: Counter(await stream_ids(broker, s)) for s in streams}
            assert await outbox.store.messages.count("abandoned") == 0
            # Every row marked published, none after a failed attempt (a broker error).
            assert await outbox.store.messages.count("published") == len(committed) + len(poison)
            assert await outbox.store.messages.count() == len(committed) + len(poison)
    finally:
        await outbox.aclose()

    assert counts == Counter(dict.fromkeys([*committed, *poison], 1)), "an effect missing or twice"
    for i, stream in enumerate(streams):
        mine = [m for (s, _), m in zip(plan, committed, strict=True) if s == stream]
        # Every message once in its stream; the poison twice: published, then replayed.
        assert in_streams[stream] == Counter({**dict.fromkeys(mine, 1), poison[i]: 2})
    # The three streams (and their dead-letter streams) were served by the three masters.
    assert len(by_master) == 3


async def test_a_master_killed_mid_run_every_message_once(
    ready: PrivateRedisCluster, pg_url: str
) -> None:
    cluster = ready
    by_master = streams_on_every_master(cluster)
    streams = list(by_master.values())
    victim = next(iter(by_master))  # the master of streams[0]
    # A publish counts once a replica of the master has the entries (WAIT): none is lost
    # with the master, and while the promoted replica has no replica of its own (until
    # the killed node rejoins) its streams' messages wait in the outbox.
    outbox = await make_outbox(cluster, pg_url, streams, set(), wait_replicas=1)
    broker = outbox.brokers["default"]
    assert isinstance(broker, RedisStreamsBroker)
    rounds = [[(s, {"round": r, "n": n}) for n in range(10) for s in streams] for r in range(3)]
    committed: list[str] = []
    try:
        with anyio.fail_after(60):
            async with outbox.relaying():
                committed += await commit(outbox, rounds[0])

                async def handled(n: int) -> bool:
                    return len(await effects(outbox)) >= n

                await wait_until(lambda: handled(len(committed)), timeout=20)
                # The next round in flight when the master dies; the last one committed
                # while its slots wait for the replica to take over.
                committed += await commit(outbox, rounds[1])
                cluster.kill(victim)
                committed += await commit(outbox, rounds[2])
                slot = key_slot(streams[0].encode())
                promoted = await anyio.to_thread.run_sync(cluster.wait_taken_over, victim, slot)
                cluster.start(victim)  # it rejoins as a replica

                async def all_handled() -> bool:
                    return len(await effects(outbox)) == len(committed)

                await wait_until(all_handled, timeout=30)

                async def all_published() -> bool:
                    return await outbox.store.messages.count("published") == len(committed)

                # A batch whose WAIT failed while the promoted master had no replica yet was
                # handled (its entries reached the stream) but is marked only at its retry:
                # wait for that while the relay still runs.
                await wait_until(all_published, timeout=20)  # none left failed
                statuses = await operations.consumers(outbox)
                assert [(c.dead_letters, c.pending) for c in statuses] == [(0, 0)] * 3
            counts = await effects(outbox)
            in_streams: Counter[str] = Counter()
            for stream in streams:
                in_streams.update(await stream_ids(broker, stream))
            assert await outbox.store.messages.count("abandoned") == 0
            stats = [s.stats for s in outbox.subscribers]
    finally:
        await outbox.aclose()

    assert counts == Counter(dict.fromkeys(committed, 1)), "an effect missing or twice"
    assert in_streams == Counter(dict.fromkeys(committed, 1)), "a message missing or twice"
    assert sum(s.dead_lettered for s in stats) == 0
    print(f"killed master {victim}; {streams[0]} now served by {promoted}")


async def test_ordered_subscribers_on_every_master_two_instances_each_key_in_order(
    ready: PrivateRedisCluster, pg_url: str
) -> None:
    """Two outboxes (two instances of one app) with an ordered subscriber of one group per
    stream, one stream per master; the broker's socket timeout (1 s) caps each blocking
    ``XREAD`` (``_block_ms``). Keys get their steps in separate commits while both run:
    each (stream, key) is handled once per step, in step order, and the partitions are
    shared between the two."""
    cluster = ready
    streams = list(streams_on_every_master(cluster).values())
    keys, steps, group = [f"k{i}" for i in range(6)], 5, "sequencer"
    # ordered=True: the relays publish each key's steps in commit order (the stream order).
    settings = {**SETTINGS, "consumer_ordered_partitions": 4, "ordered": True}
    outboxes = [
        Outbox(
            pg_url,
            brokers={"default": RedisStreamsBroker(cluster.url, socket_timeout=1)},
            settings=OutboxSettings(**settings),
        )
        for _ in range(2)
    ]
    for label, outbox in zip("ab", outboxes, strict=True):

        async def handle(message: Message, uow: UnitOfWork, label: str = label) -> None:
            uow.session.add(
                Step(
                    stream=message.stream,
                    key=message.key or "",
                    step=message.payload["step"],
                    message_id=uow.causation_id or "",
                    handler=label,
                )
            )

        for stream in streams:
            outbox.subscriber(stream, group=group, start="all", ordered=True)(handle)
    first = outboxes[0]
    async with first.engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    await first.create_tables()
    leases = first.inbox.lease_tables[0]

    async def shared() -> bool:  # both instances hold partitions of every stream
        async with first.engine.connect() as conn:
            rows = (await conn.execute(select(leases.c.stream, leases.c.owner))).all()
        owners: dict[str, set[str | None]] = {s: set() for s in streams}
        for stream, owner in rows:
            owners[stream].add(owner)
        return all(len(o) == 2 and None not in o for o in owners.values())

    async def handled() -> list[Any]:
        async with first.engine.connect() as conn:
            return list((await conn.execute(select(Step.__table__).order_by(Step.id))).all())

    committed: list[str] = []
    try:
        with anyio.fail_after(60):
            async with first.relaying(), outboxes[1].relaying():
                await wait_until(shared, timeout=15)
                for step in range(steps):  # one commit per step: keys interleave in streams
                    async with first.unit_of_work() as uow:
                        for key in keys:
                            for stream in streams:
                                message = Message(
                                    stream=stream, type="Step", payload={"step": step}, key=key
                                )
                                committed.append(str(uow.publish(message)))

                async def all_handled() -> bool:
                    return len(await handled()) >= len(committed)

                await wait_until(all_handled, timeout=30)
            rows = await handled()
            broker = first.brokers["default"]
            assert isinstance(broker, RedisStreamsBroker)
            in_streams = {s: await stream_ids(broker, s) for s in streams}
    finally:
        for outbox in outboxes:
            await outbox.aclose()

    assert sorted(r.message_id for r in rows) == sorted(committed), "a step missing or twice"
    for stream in streams:
        position = {m: i for i, m in enumerate(in_streams[stream])}
        for key in keys:
            mine = [r for r in rows if (r.stream, r.key) == (stream, key)]
            # Handled in stream order, which is commit order.
            assert [position[r.message_id] for r in mine] == sorted(
                position[r.message_id] for r in mine
            ), (stream, key)
            assert [r.step for r in mine] == list(range(steps)), (stream, key)
    assert {r.handler for r in rows} == {"a", "b"}
    assert sum(s.stats.dead_lettered for o in outboxes for s in o.subscribers) == 0

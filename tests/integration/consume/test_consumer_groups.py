"""Broker-side consumer groups: created before the first publish and by ``create_tables``,
one NATS durable per (group, subject) brought to the declared settings at start, a durable
of an earlier release handing over its position, dead letters that fail to be written
staying pending, and dead-letter streams without limits. On the real Redis and NATS."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

from fastapi_outbox import Message, Outbox, OutboxSettings
from fastapi_outbox.brokers import NatsJetStreamBroker, RedisStreamsBroker
from fastapi_outbox.brokers.nats.consumer import durable_name
from fastapi_outbox.brokers.nats.wire import stream_name_for
from fastapi_outbox.ops.health import compute_health
from tests.conftest import unique, wait_until

pytestmark = pytest.mark.usefixtures("quick_fetch")

FAST = {
    "consumer_claim_idle_seconds": 1.0,
    "consumer_retry_base_delay_seconds": 0.05,
    "consumer_retry_max_delay_seconds": 0.2,
    "shutdown_timeout_seconds": 5.0,
}


@pytest.fixture
async def js(nats_url: str) -> AsyncIterator[Any]:
    """A JetStream context; the streams of the test (``js.prefix``) are deleted after."""
    import nats

    nc = await nats.connect(nats_url)
    context = nc.jetstream()
    context.prefix = unique("grp")
    yield context
    for info in await context.streams_info():
        if info.config.name.startswith(stream_name_for(context.prefix)):
            await context.delete_stream(info.config.name)
    await nc.close()


@pytest.fixture
async def rclient(redis_url: str) -> AsyncIterator[Any]:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(redis_url)
    client.prefix = unique("grp")
    yield client
    keys = [k async for k in client.scan_iter(match=f"{client.prefix}*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()


def new_outbox(db_url: str, broker: Any, **settings: Any) -> Outbox:
    return Outbox(db_url, brokers={"default": broker}, settings=OutboxSettings(**FAST, **settings))


async def publish(outbox: Outbox, stream: str, numbers: range) -> None:
    async with outbox.unit_of_work() as uow:
        for n in numbers:
            uow.publish(Message(stream=stream, type="Placed", payload={"n": n}))


async def inbox_rows(outbox: Outbox, group: str) -> int:
    from sqlalchemy import func, select

    table = outbox.inbox.table
    async with outbox.engine.connect() as conn:
        return int(
            await conn.scalar(select(func.count()).select_from(table).where(table.c.group == group))
            or 0
        )


async def test_two_subjects_of_one_wildcard_stream_get_a_durable_each(
    sqlite_url: str, nats_url: str, js: Any
) -> None:
    a, b = f"{js.prefix}.a", f"{js.prefix}.b"
    await js.add_stream(name=stream_name_for(js.prefix), subjects=[f"{js.prefix}.>"])
    outbox = new_outbox(sqlite_url, NatsJetStreamBroker(nats_url))
    await outbox.create_tables()
    seen: dict[str, list[int]] = {a: [], b: []}

    @outbox.subscriber(a, group="shipping")
    async def on_a(message: Message) -> None:
        seen[a].append(message.payload["n"])

    @outbox.subscriber(b, group="shipping")
    async def on_b(message: Message) -> None:
        seen[b].append(message.payload["n"])

    try:
        async with outbox.relaying():
            await publish(outbox, a, range(10))
            await publish(outbox, b, range(10, 20))

            async def all_handled() -> bool:
                return await inbox_rows(outbox, "shipping") == 20

            await wait_until(all_handled, timeout=30)
        assert sorted(seen[a]) == list(range(10)) and sorted(seen[b]) == list(range(10, 20))
        assert [s.stats.skipped for s in outbox.subscribers] == [0, 0]
        names = {c.name async for c in _consumers(js, stream_name_for(js.prefix))}
        assert names == {durable_name("shipping", a), durable_name("shipping", b)}
        assert durable_name("shipping", a) != durable_name("shipping", b)
    finally:
        await outbox.aclose()


async def _consumers(js: Any, stream: str) -> AsyncIterator[Any]:
    for info in await js.consumers_info(stream):
        yield info


async def test_an_existing_durable_is_brought_to_the_declared_settings(
    sqlite_url: str, nats_url: str, js: Any
) -> None:
    """A durable left by a deployment with max_attempts=2 (JetStream max_deliver 5, another
    ack wait) and a redeploy with max_attempts=8: the durable is updated at start (no
    broker-side delivery limit: the subscriber counts), the message failing 6 times is
    handled on its 7th attempt."""
    import nats.js.api as api

    stream = f"{js.prefix}.orders"
    broker = NatsJetStreamBroker(nats_url)
    await broker.connect()
    await broker.ensure_stream(stream)
    name = stream_name_for(stream)
    durable = durable_name("billing", stream)
    await js.add_consumer(
        name,
        config=api.ConsumerConfig(
            name=durable,
            durable_name=durable,
            ack_policy=api.AckPolicy.EXPLICIT,
            ack_wait=30,
            max_deliver=5,
            filter_subject=stream,
            deliver_policy=api.DeliverPolicy.NEW,
        ),
    )
    outbox = new_outbox(sqlite_url, broker, consumer_max_attempts=8)
    await outbox.create_tables()
    attempts: list[int] = []

    @outbox.subscriber(stream, group="billing")
    async def bill(message: Message) -> None:
        attempts.append(message.payload["n"])
        if len(attempts) <= 6:
            raise RuntimeError(f"failure {len(attempts)}")

    try:
        async with outbox.relaying():
            info = await js.consumer_info(name, durable)
            assert (info.config.max_deliver, info.config.ack_wait) == (-1, 1.0)
            await publish(outbox, stream, range(1))

            async def handled() -> bool:
                return await inbox_rows(outbox, "billing") == 1

            await wait_until(handled, timeout=60)
        assert len(attempts) == 7
        assert outbox.subscribers[0].stats.dead_lettered == 0
    finally:
        await outbox.aclose()


async def test_a_durable_of_an_earlier_release_hands_over_after_its_ack_floor(
    sqlite_url: str, nats_url: str, js: Any
) -> None:
    """Upgrading from the durable named after the group alone: the new durable starts after
    the old one's ack floor — acknowledged messages are not handled again, the unacked and
    the later ones are handled (nothing skipped, not the whole stream again)."""
    import nats.js.api as api

    stream = f"{js.prefix}.orders"
    broker = NatsJetStreamBroker(nats_url)
    await broker.connect()
    await broker.ensure_stream(stream)
    name = stream_name_for(stream)
    await js.publish(stream, json.dumps({"n": 0}).encode(), headers={"type": "Placed"})
    old = await js.pull_subscribe(
        stream,
        durable="billing",
        stream=name,
        config=api.ConsumerConfig(ack_policy=api.AckPolicy.EXPLICIT, ack_wait=30, max_deliver=5),
    )
    for n in range(1, 6):
        await js.publish(stream, json.dumps({"n": n}).encode(), headers={"type": "Placed"})
    for msg in await old.fetch(5, timeout=5):
        if json.loads(msg.data)["n"] <= 3:  # 4 and 5 delivered, never acknowledged
            await msg.ack_sync()
    await old.unsubscribe()
    for n in range(6, 8):  # published while no process ran
        await js.publish(stream, json.dumps({"n": n}).encode(), headers={"type": "Placed"})
    outbox = new_outbox(sqlite_url, broker)
    await outbox.create_tables()  # the new durable, from the old one's position
    handled: list[int] = []

    @outbox.subscriber(stream, group="billing")
    async def bill(message: Message) -> None:
        handled.append(message.payload["n"])

    try:
        await outbox.lifecycle.declare_groups()
        async with outbox.relaying():

            async def done() -> bool:
                return len(handled) >= 4

            await wait_until(done, timeout=30)
            info = await js.consumer_info(name, durable_name("billing", stream))

            async def acked() -> bool:
                info = await js.consumer_info(name, durable_name("billing", stream))
                return info.num_pending == 0 and info.num_ack_pending == 0

            await wait_until(acked, timeout=30)
        assert sorted(handled) == [4, 5, 6, 7]
        assert info.config.deliver_policy == api.DeliverPolicy.BY_START_SEQUENCE
    finally:
        await outbox.aclose()


async def test_create_tables_creates_the_groups_before_the_first_deploy(
    sqlite_url: str, nats_url: str, redis_url: str, js: Any, rclient: Any
) -> None:
    """``create_tables`` (``db create``) creates the groups: what other services publish
    before the subscriber's first start waits for it, with ``start="new"``."""
    for broker, stream in (
        (RedisStreamsBroker(redis_url), f"{rclient.prefix}.orders"),
        (NatsJetStreamBroker(nats_url), f"{js.prefix}.orders"),
    ):
        outbox = new_outbox(sqlite_url, broker, table_name=unique("outbox"))
        handled: list[int] = []

        @outbox.subscriber(stream, group="billing")
        async def bill(message: Message, handled: list[int] = handled) -> None:
            handled.append(message.payload["n"])

        other = Outbox(
            sqlite_url, brokers={"default": broker}, settings=OutboxSettings(table_name=unique("o"))
        )
        try:
            await outbox.create_tables()
            await other.create_tables()
            async with other.relaying():  # another service, before the first deploy
                await publish(other, stream, range(5))

                async def published(other: Outbox = other) -> bool:
                    return other.relays.tables["default"].published_total == 5

                await wait_until(published, timeout=30)
            async with outbox.relaying():

                async def all_handled(handled: list[int] = handled) -> bool:
                    return sorted(handled) == list(range(5))

                await wait_until(all_handled, timeout=30)
        finally:
            await other.aclose()
            await outbox.aclose()


async def test_nats_dead_letter_streams_have_no_limits_unless_asked(
    sqlite_url: str, nats_url: str, js: Any
) -> None:
    stream = f"{js.prefix}.orders"
    for options, expected in (
        ({}, (0.0, -1)),
        ({"dead_letter_max_age_seconds": 3600.0, "dead_letter_max_bytes": 10**6}, (3600.0, 10**6)),
    ):
        group = unique("g")
        outbox = new_outbox(sqlite_url, NatsJetStreamBroker(nats_url, **options))

        @outbox.subscriber(stream, group=group)
        async def bill(message: Message) -> None:
            pass

        try:
            await outbox.lifecycle.declare_groups()
            dead = outbox.subscribers[0].dead_letter
            info = await js.stream_info(await js.find_stream_name_by_subject(dead))
            assert (float(info.config.max_age or 0), info.config.max_bytes) == expected
            main = await js.stream_info(stream_name_for(stream))
            assert main.config.max_age and main.config.max_bytes  # the others keep theirs
        finally:
            await outbox.aclose()


async def test_nats_a_failing_dead_letter_keeps_the_message_pending(
    sqlite_url: str, nats_url: str, js: Any
) -> None:
    """The dead-letter stream refuses (full, discard new): the message is not lost — it
    stays pending, comes back, the failures show in the consumer status and health; once
    the stream takes it again, it is dead-lettered."""
    import nats.js.api as api

    stream = f"{js.prefix}.orders"
    dead = f"{js.prefix}.orders.billing.dlq"
    await js.add_stream(
        name=stream_name_for(dead),
        subjects=[dead],
        max_msgs=1,
        discard=api.DiscardPolicy.NEW,
    )
    await js.publish(dead, b"filler")
    outbox = new_outbox(sqlite_url, NatsJetStreamBroker(nats_url), consumer_max_attempts=1)
    await outbox.create_tables()

    @outbox.subscriber(stream, group="billing")
    async def bill(message: Message) -> None:
        raise RuntimeError("billing is broken")

    sub = outbox.subscribers[0]
    try:
        async with outbox.relaying():
            await publish(outbox, stream, range(1))

            async def failed_twice() -> bool:
                return sub.stats.dead_letter_failures >= 2

            await wait_until(failed_twice, timeout=30)
            [status] = await outbox.consumers_status()
            assert status.dead_letter_failures >= 2
            assert "dead-lettering failed" in (status.last_error or "")
            health = await compute_health(outbox)
            assert status.dead_letters_unwritten == 1
            assert any("could not be written" in r for r in health.reasons), health.reasons
            await js.purge_stream(stream_name_for(dead))

            async def dead_lettered() -> bool:
                return sub.stats.dead_lettered == 1

            await wait_until(dead_lettered, timeout=30)
            health = await compute_health(outbox)
            assert not any("could not be written" in r for r in health.reasons)
            [letter] = await sub.make_consumer().dead_letters()
            assert "billing is broken" in letter.error
    finally:
        await outbox.aclose()


async def test_redis_a_failing_dead_letter_keeps_the_entry_pending(
    sqlite_url: str, redis_url: str, rclient: Any
) -> None:
    """``XADD`` to the dead-letter stream fails (the key holds a string): the entry is not
    acknowledged — still pending in the group — and is dead-lettered once the key is a
    stream again. Dead-letter streams are not trimmed by the broker's ``maxlen``."""
    stream = f"{rclient.prefix}.orders"
    dead = f"{stream}.billing.dlq"
    await rclient.set(dead, "not a stream")
    outbox = new_outbox(
        sqlite_url, RedisStreamsBroker(redis_url, maxlen=2), consumer_max_attempts=1
    )
    await outbox.create_tables()

    @outbox.subscriber(stream, group="billing")
    async def bill(message: Message) -> None:
        raise RuntimeError("billing is broken")

    sub = outbox.subscribers[0]
    try:
        async with outbox.relaying():
            await publish(outbox, stream, range(1))

            async def failed() -> bool:
                return sub.stats.dead_letter_failures >= 1

            await wait_until(failed, timeout=30)
            pending = await rclient.xpending(stream, "billing")
            assert pending["pending"] == 1
            await rclient.delete(dead)
            await publish(outbox, stream, range(1, 5))

            async def all_dead() -> bool:
                return sub.stats.dead_lettered == 5

            await wait_until(all_dead, timeout=30)
            assert (await rclient.xpending(stream, "billing"))["pending"] == 0
            assert await rclient.xlen(dead) == 5  # maxlen=2 is the published streams'
    finally:
        await outbox.aclose()


@pytest.mark.parametrize("kind", ["redis", "nats"])
async def test_a_broker_down_at_start_gets_the_groups_before_the_first_publish(
    kind: str, sqlite_url: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The broker does not answer when the relays start: the app starts, and nothing
    is published to that broker before the groups are declared. The subscriber does not
    consume here (its run is replaced), so the group seen afterwards is the one the
    relay's side declared before publishing: all 20 messages wait in it."""
    from tests.servers import private_nats_server, private_redis_server

    server = (
        private_redis_server(range(6540, 6550), tmp_path)
        if kind == "redis"
        else private_nats_server(range(4290, 4300), tmp_path)
    )
    broker: Any = (
        RedisStreamsBroker(server.url, socket_timeout=1)
        if kind == "redis"
        else NatsJetStreamBroker(server.url, connect_timeout_seconds=1)
    )
    outbox = new_outbox(sqlite_url, broker)
    stream = unique("orders")

    @outbox.subscriber(stream, group="billing")
    async def bill(message: Message) -> None:
        pass

    sub = outbox.subscribers[0]

    async def idle(*, task_status: Any) -> None:
        task_status.started()
        await anyio.sleep_forever()

    monkeypatch.setattr(sub, "run", idle)
    try:
        await outbox.create_tables(groups=False)
        async with outbox.relaying():
            await publish(outbox, stream, range(10))
            await server.start()
            await publish(outbox, stream, range(10, 20))

            async def published() -> bool:
                return outbox.relays.tables["default"].published_total == 20

            await wait_until(published, timeout=60)
        lag = await sub.make_consumer().lag()
        assert (lag.lag, lag.pending) == (20, 0)
    finally:
        await outbox.aclose()
        await server.kill()


async def test_db_create_creates_the_groups_and_says_when_the_broker_is_down(
    sqlite_url: str, redis_url: str, rclient: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """``fastapi-outbox db create --app`` creates the subscribers' groups (exit 3 naming
    the broker when it does not answer); ``create_tables()`` in an app's own start-up only
    logs a broker that does not answer."""
    from tests.conftest import run_cli

    stream = f"{rclient.prefix}.orders"
    env = {"CONSUMER_DATABASE_URL": sqlite_url, "CONSUMER_STREAM": stream}
    app = "tests.integration.consumer_cli_app:outbox"
    down = run_cli(
        "db", "create", "--app", app, env={**env, "CONSUMER_BROKER_URL": "redis://127.0.0.1:1/0"}
    )
    assert down.returncode == 3, down.stderr
    assert "consumer groups were not" in down.stderr and "127.0.0.1:1" in down.stderr
    done = run_cli("db", "create", "--app", app, env={**env, "CONSUMER_BROKER_URL": redis_url})
    assert done.returncode == 0, done.stderr
    assert f"consumer group 'billing' of stream {stream!r} ready" in done.stdout
    groups = await rclient.xinfo_groups(stream)
    assert [g["name"] for g in groups] == [b"billing"]

    outbox = new_outbox(sqlite_url, RedisStreamsBroker("redis://127.0.0.1:1/0", socket_timeout=1))

    @outbox.subscriber(stream, group="audit")
    async def audit(message: Message) -> None:
        pass

    try:
        await outbox.create_tables()  # does not raise
        assert any(
            r.getMessage() == "consumer groups not created: broker unavailable"
            for r in caplog.records
        )
    finally:
        await outbox.aclose()

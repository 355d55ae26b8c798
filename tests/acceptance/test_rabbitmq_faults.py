"""RabbitMQ faults on a private node (one node for the module, never the shared one): the
node killed and restarted mid-run, a memory alarm raised then cleared, the group's queue
deleted under its running consumer, the network cut through a proxy. Producers commit all
along; at the end every committed message had its effect exactly once (effect rows counted
per message id), nothing is abandoned and nothing is dead-lettered.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import pytest
from sqlalchemy import Column, Integer, MetaData, String, Table, func, insert, select

from fastapi_outbox import Message, Outbox, OutboxSettings, UnitOfWork, exceptions
from fastapi_outbox.brokers import RabbitMQBroker
from fastapi_outbox.ops.health import compute_health
from tests.acceptance.conftest import produce, wait_drained
from tests.conftest import unique, wait_until
from tests.servers import PrivateRabbitMQ, TcpProxy

pytestmark = [
    pytest.mark.slow,
    pytest.mark.rabbitmq,
    pytest.mark.postgres(
        reason=(
            "RabbitMQ's faults, not the database's: one "
            "server database shared by the processes suffices"
        )
    ),
]

SETTINGS = {
    "poll_interval_seconds": 0.05,
    "max_poll_interval_seconds": 0.2,
    "broker_backoff_max_seconds": 0.5,
    "max_attempts": 20,
    "retry_base_delay_seconds": 0.1,
    "retry_max_delay_seconds": 0.5,
    "retry_jitter": 0,
    "publish_timeout_seconds": 3,
    "lease_seconds": 10,
    "consumer_claim_idle_seconds": 5.0,
    "consumer_retry_base_delay_seconds": 0.05,
    "consumer_retry_max_delay_seconds": 0.2,
    "shutdown_timeout_seconds": 5.0,
}

effects_md = MetaData()
EFFECTS = Table(
    "rabbit_effects",
    effects_md,
    Column("id", Integer, primary_key=True),
    Column("message_id", String(64), nullable=False),
)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateRabbitMQ]:
    server = PrivateRabbitMQ(Path(tmp_path_factory.mktemp("rabbitmq")))
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
async def app(pg_url: str, node: PrivateRabbitMQ) -> AsyncIterator[tuple[Outbox, str]]:
    async with service(pg_url, node.url) as made:
        yield made


@contextlib.asynccontextmanager
async def service(pg_url: str, url: str) -> AsyncIterator[tuple[Outbox, str]]:
    """An outbox on RabbitMQ at ``url``, a subscriber (group ``billing``) writing one
    effect row per message in its transaction; yields (outbox, stream)."""
    stream = unique("orders")
    broker = RabbitMQBroker(url, exchange=unique("faults"), confirm_timeout_seconds=2)
    outbox = Outbox(pg_url, brokers={"default": broker}, settings=OutboxSettings(**SETTINGS))
    async with outbox.engine.begin() as conn:
        await conn.run_sync(effects_md.create_all)

    async def bill(message: Message, uow: UnitOfWork) -> None:
        await uow.session.execute(insert(EFFECTS).values(message_id=message.headers["message-id"]))

    outbox.subscriber(stream, group="billing")(bill)
    await outbox.create_tables()
    try:
        yield outbox, stream
    finally:
        await outbox.aclose()


async def effects(outbox: Outbox) -> Counter[str]:
    async with outbox.engine.connect() as conn:
        rows = await conn.execute(
            select(EFFECTS.c.message_id, func.count()).group_by(EFFECTS.c.message_id)
        )
        return Counter({m: int(n) for m, n in rows})


async def all_handled(outbox: Outbox, committed: list[str], timeout: float = 40) -> None:
    async def done() -> bool:
        return len(await effects(outbox)) >= len(committed)

    await wait_drained(
        outbox, timeout, lambda: f"relay: {outbox.relays.tables['default'].last_error}"
    )
    try:
        await wait_until(done, timeout=timeout, interval=0.1)
    except TimeoutError:
        sub = outbox.subscribers[0]
        pytest.fail(
            f"{len(await effects(outbox))}/{len(committed)} handled; subscriber: "
            f"{sub.stats.last_error}"
        )


async def exactly_once(outbox: Outbox, committed: list[str]) -> None:
    seen = await effects(outbox)
    assert set(seen) == set(committed)
    assert all(n == 1 for n in seen.values()), {m: n for m, n in seen.items() if n > 1}
    assert await outbox.store.messages.count("abandoned") == 0
    sub = outbox.subscribers[0]
    assert sub.stats.dead_lettered == 0
    assert sub.consumer is not None
    assert await sub.consumer.count_dead_letters() == 0


async def test_node_killed_and_restarted_mid_run(
    app: tuple[Outbox, str], node: PrivateRabbitMQ
) -> None:
    outbox, stream = app
    await anyio.to_thread.run_sync(node.settle)  # the group's queue survives a SIGKILL
    async with outbox.relaying():
        committed = await produce(outbox, stream, 60)
        await wait_until(lambda: outbox.subscribers[0].stats.handled >= 10, timeout=20)
        await anyio.to_thread.run_sync(node.kill)
        # Committed while the node is down: they wait in the outbox.
        committed += await produce(outbox, stream, 60)
        table_relay = outbox.relays.tables["default"]
        await wait_until(lambda: not table_relay.broker_ok, timeout=20)
        assert await outbox.store.messages.count("abandoned") == 0
        await anyio.to_thread.run_sync(node.start)
        committed += await produce(outbox, stream, 30)
        await all_handled(outbox, committed)
        await exactly_once(outbox, committed)


async def test_memory_alarm_raised_then_cleared(
    app: tuple[Outbox, str], node: PrivateRabbitMQ
) -> None:
    outbox, stream = app
    broker = outbox.brokers["default"]
    async with outbox.relaying():
        table_relay = outbox.relays.tables["default"]
        committed = await produce(outbox, stream, 30)
        await all_handled(outbox, committed)
        await anyio.to_thread.run_sync(node.ctl, "set_vm_memory_high_watermark", "0.0000001")
        try:
            committed += await produce(outbox, stream, 60)
            await wait_until(lambda: table_relay.broker_refusing, timeout=20)
            assert "alarm" in (table_relay.last_error or ""), table_relay.last_error
            with pytest.raises(exceptions.BrokerRefusing):
                await broker.ping()
            health = await compute_health(outbox)
            assert health.status == "degraded", health
            assert await outbox.store.messages.count("abandoned") == 0
            assert await outbox.store.messages.count("failed") == 0
        finally:
            await anyio.to_thread.run_sync(node.ctl, "set_vm_memory_high_watermark", "0.4")
        await all_handled(outbox, committed)
        assert table_relay.broker_ok and not table_relay.broker_refusing
        await exactly_once(outbox, committed)
    async with outbox.engine.connect() as conn:
        attempts = (
            await conn.exec_driver_sql(f"SELECT max(attempts) FROM {outbox.table.name}")
        ).scalar_one()
    assert attempts == 1  # every refused claim was refunded


async def test_queue_deleted_under_a_running_consumer(
    app: tuple[Outbox, str], node: PrivateRabbitMQ
) -> None:
    import aio_pika

    outbox, stream = app
    async with outbox.relaying():
        committed = await produce(outbox, stream, 30)
        await all_handled(outbox, committed)
        conn = await aio_pika.connect(node.url)
        try:
            channel = await conn.channel()
            await channel.queue_delete(f"{stream}.billing")
        finally:
            await conn.close()
        # Unroutable until the consumer declares its queue again: failures retried (never
        # dropped), then handled.
        committed += await produce(outbox, stream, 60, pause=0.01)
        await all_handled(outbox, committed)
        await exactly_once(outbox, committed)


async def test_network_cut_through_a_proxy(pg_url: str, node: PrivateRabbitMQ) -> None:
    """Every connection through the proxy cut (and new ones refused) mid-run, then the
    network back: the relay and the consumer reconnect by themselves."""
    proxy = TcpProxy(node.port)
    await proxy.start()
    try:
        async with (
            service(pg_url, f"amqp://guest:guest@127.0.0.1:{proxy.port}/") as (
                outbox,
                stream,
            ),
            outbox.relaying(),
        ):
            committed = await produce(outbox, stream, 30)
            await wait_until(lambda: outbox.subscribers[0].stats.handled >= 5, timeout=20)
            await proxy.stop()
            committed += await produce(outbox, stream, 30)
            table_relay = outbox.relays.tables["default"]
            await wait_until(lambda: not table_relay.broker_ok, timeout=20)
            await proxy.start()
            committed += await produce(outbox, stream, 30)
            await all_handled(outbox, committed)
            await exactly_once(outbox, committed)
    finally:
        await proxy.stop()


async def test_broker_down_at_start_gets_the_groups_before_the_first_publish(
    pg_url: str, node: PrivateRabbitMQ
) -> None:
    """RabbitMQ does not answer when the app starts (the proxy is not listening yet): the
    app starts, commits wait, and once the broker answers the group's queue is declared
    before anything is published — no message comes back unroutable (every row published
    on its first attempt) and every one is handled once."""
    proxy = TcpProxy(node.port)  # not started: nothing listens on its port yet
    try:
        async with (
            service(pg_url, f"amqp://guest:guest@127.0.0.1:{proxy.port}/") as (outbox, stream),
            outbox.relaying(),
        ):
            committed = await produce(outbox, stream, 20)
            assert outbox.subscribers[0].stats.handled == 0
            await proxy.start()
            committed += await produce(outbox, stream, 20)
            await all_handled(outbox, committed)
            await exactly_once(outbox, committed)
            async with outbox.engine.connect() as conn:
                attempts = (
                    await conn.exec_driver_sql(f"SELECT max(attempts) FROM {outbox.table.name}")
                ).scalar_one()
            assert attempts == 1  # refused while down (refunded), never unroutable
    finally:
        await proxy.stop()

"""Subscriber runtime on the memory broker and SQLite: per-key order, shutdown, the lifespan,
inbox retention and the mistakes a declaration can make."""

from __future__ import annotations

import datetime as dt
import json
import re
from collections.abc import Sequence
from typing import Any

import anyio
import pytest
from fastapi import FastAPI
from sqlalchemy import insert, select
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from fastapi_outbox import (
    AggregateRoot,
    ConfigurationError,
    Event,
    Message,
    Outbox,
    OutboxSettings,
    PublishError,
    UnitOfWork,
    uuid7,
)
from fastapi_outbox.brokers import MemoryBroker
from fastapi_outbox.consume.subscriber import BatchUnitOfWork
from fastapi_outbox.events import Envelope
from fastapi_outbox.ops.dashboard import CSRF_HEADER
from tests.conftest import asgi_client, unique, wait_until
from tests.servers import TcpProxy

pytestmark = pytest.mark.usefixtures("quick_fetch")

FAST = {
    "consumer_claim_idle_seconds": 1.0,
    "consumer_retry_base_delay_seconds": 0.02,
    "consumer_retry_max_delay_seconds": 0.1,
    "shutdown_timeout_seconds": 2.0,
}


class Shipped(Event, stream="shipments", key="order_id"):
    order_id: int
    step: int


async def new_outbox(url: str, **settings: Any) -> Outbox:
    outbox = Outbox(
        url, brokers={"default": MemoryBroker()}, settings=OutboxSettings(**{**FAST, **settings})
    )
    await outbox.create_tables()
    return outbox


async def test_ordered_handles_a_key_in_stream_order_despite_retries(sqlite_url: str) -> None:
    outbox = await new_outbox(sqlite_url)
    seen: list[tuple[int, int]] = []
    failed_once: set[tuple[int, int]] = set()

    @outbox.subscriber("shipments", group="tracking", ordered=True, concurrency=8, start="all")
    async def track(event: Shipped, uow: UnitOfWork) -> None:
        if event.step == 0 and (event.order_id, 0) not in failed_once:
            failed_once.add((event.order_id, 0))
            raise RuntimeError("first step fails once")
        seen.append((event.order_id, event.step))

    async with outbox.relaying():
        async with outbox.unit_of_work() as uow:
            for step in range(4):
                for order in range(3):
                    uow.publish(Shipped(order_id=order, step=step))
        await wait_until(lambda: len(seen) == 12, timeout=10)
    for order in range(3):
        assert [s for o, s in seen if o == order] == [0, 1, 2, 3]
    assert outbox.subscribers[0].stats.failures == 3
    await outbox.aclose()


async def test_shutdown_releases_unfinished_messages_and_a_restart_handles_them(
    sqlite_url: str,
) -> None:
    outbox = await new_outbox(sqlite_url, shutdown_timeout_seconds=0.5)
    handled: list[int] = []
    slow = True
    entered = anyio.Event()

    @outbox.subscriber("shipments", group="slow", start="all")
    async def handle(event: Shipped, uow: UnitOfWork) -> None:
        entered.set()
        if slow:
            await anyio.sleep(30)  # still running at shutdown: cancelled, rolled back
        handled.append(event.order_id)

    sub = outbox.subscribers[0]
    with anyio.fail_after(10):
        async with outbox.relaying():
            async with outbox.unit_of_work() as uow:
                uow.publish(Shipped(order_id=7, step=0))
            await entered.wait()
        # The shutdown did not wait 30 s, and the message was not recorded as handled.
        assert handled == []
        assert not sub.running
        assert not await outbox.inbox.contains("slow", await _only_message_id(outbox))
        slow = False
        async with outbox.relaying():  # a restart: the released message comes again
            await wait_until(lambda: handled == [7], timeout=5)
    assert sub.stats.handled == 1
    await outbox.aclose()


async def _only_message_id(outbox: Outbox) -> str:
    async with outbox.engine.connect() as conn:
        row = (await conn.execute(select(outbox.table.c.id))).one()
    return str(row[0])


async def test_the_app_lifespan_runs_subscribers(sqlite_url: str) -> None:
    outbox = await new_outbox(sqlite_url)
    got: list[Message] = []

    @outbox.subscriber("shipments", group="raw", start="all")
    async def raw(message: Message) -> None:
        got.append(message)

    app = FastAPI(lifespan=outbox.lifespan)

    @app.post("/ship")
    async def ship() -> dict[str, str]:
        async with outbox.unit_of_work(correlation_id="req-1") as uow:
            uow.publish(Shipped(order_id=1, step=2))
        return {"ok": "yes"}

    async with asgi_client(app) as client:
        assert (await client.post("/ship")).status_code == 200
        await wait_until(lambda: len(got) == 1, timeout=5)
        assert outbox.subscribers[0].running
    assert not outbox.subscribers[0].running
    assert got[0].type == "Shipped"
    assert got[0].payload == {"order_id": 1, "step": 2}
    assert got[0].key == "1"
    assert got[0].headers["correlation-id"] == "req-1"
    await outbox.aclose()


async def test_inbox_rows_past_retention_are_purged_by_the_cleanup(sqlite_url: str) -> None:
    outbox = await new_outbox(sqlite_url, inbox_retention_seconds=3600)
    t = outbox.inbox.table
    now = dt.datetime.now(dt.UTC)
    async with outbox.engine.begin() as conn:
        await conn.execute(
            insert(t),
            [
                {"group": "g", "message_id": f"old-{i}", "stream": "s", "handled_at": old}
                for i, old in enumerate([now - dt.timedelta(hours=2)] * 7)
            ]
            + [{"group": "g", "message_id": "new", "stream": "s", "handled_at": now}],
        )
    assert await outbox.cleaner.run_once() == 7
    stats = await outbox.inbox.group_stats()
    assert stats["g"].handled == 1
    assert stats["g"].last_handled_at is not None
    await outbox.aclose()


async def test_declaration_mistakes_are_refused_with_names(sqlite_url: str) -> None:
    outbox = Outbox(sqlite_url, brokers={"default": MemoryBroker()})

    async def no_annotation(event) -> None:  # type: ignore[no-untyped-def]
        pass

    def not_async(event: Shipped) -> None:
        pass

    async def extra_param(event: Shipped, other: int) -> None:
        pass

    async def fine(event: Shipped) -> None:
        pass

    with pytest.raises(ConfigurationError, match="annotate the first parameter 'event'"):
        outbox.subscriber("shipments", group="g")(no_annotation)
    with pytest.raises(ConfigurationError, match="must be an async def"):
        outbox.subscriber("shipments", group="g")(not_async)
    with pytest.raises(ConfigurationError, match=r"parameters \['other'\]"):
        outbox.subscriber("shipments", group="g")(extra_param)
    with pytest.raises(ConfigurationError, match="no broker named 'nope'"):
        outbox.subscriber("shipments", group="g", broker="nope")(fine)
    with pytest.raises(ConfigurationError, match="group 'a b'"):
        outbox.subscriber("shipments", group="a b")(fine)
    with pytest.raises(ConfigurationError, match="claim_idle_seconds"):
        outbox.subscriber("shipments", group="g", claim_idle_seconds=1, retry_max_delay_seconds=5)(
            fine
        )
    outbox.subscriber("shipments", group="g")(fine)
    with pytest.raises(ConfigurationError, match="two subscribers for stream 'shipments'"):
        outbox.subscriber("shipments", group="g")(fine)

    async def batch(events: list[Shipped]) -> None:
        pass

    async def batch_of_ints(events: list[int]) -> None:
        pass

    with pytest.raises(ConfigurationError, match="not with ordered=True or batch=False"):
        outbox.subscriber("shipments", group="b", ordered=True)(batch)
    with pytest.raises(ConfigurationError, match="not with ordered=True or batch=False"):
        outbox.subscriber("shipments", group="b", batch=False)(batch)
    with pytest.raises(ConfigurationError, match="must be annotated with an Event subclass"):
        outbox.subscriber("shipments", group="b")(batch_of_ints)
    assert outbox.subscriber("shipments", group="b")(batch) is batch
    assert outbox.subscribers[-1].batch_handler

    async def batch_seq(events: Sequence[Shipped], uow: BatchUnitOfWork) -> None:
        pass

    outbox.subscriber("shipments", group="c")(batch_seq)
    assert outbox.subscribers[-1].batch_handler
    assert outbox.subscribers[-1].signature.uow_params == ["uow"]
    await outbox.create_tables()
    async with outbox.unit_of_work() as uow:
        in_batch = BatchUnitOfWork(outbox._producer, uow.session, causation_id="m1")
        with pytest.raises(PublishError, match="invalid causation_id 'a b'"):
            in_batch.publish(Shipped(order_id=1, step=1), causation_id="a b")
        with pytest.raises(PublishError, match="invalid correlation_id 'a/b'"):
            in_batch.publish(Shipped(order_id=1, step=1), correlation_id="a/b")
        in_batch.publish(Shipped(order_id=1, step=1), causation_id="m0", key="k")
        assert (in_batch.causation_id, in_batch.pending) == ("m1", 1)
    async with outbox.engine.connect() as conn:
        headers = (await conn.execute(select(outbox.table.c.headers))).scalar_one()
    assert json.loads(headers)["causation-id"] == "m0"
    with pytest.raises(ConfigurationError, match="OUTBOX_CONSUMER_RETRY_MAX_DELAY_SECONDS"):
        OutboxSettings.from_env(consumer_retry_max_delay_seconds=100)
    with pytest.raises(ConfigurationError, match="OUTBOX_INBOX_RETENTION_SECONDS"):
        OutboxSettings.from_env(inbox_retention_seconds=10)
    with pytest.raises(ConfigurationError, match="inbox_table_name"):
        OutboxSettings.from_env(inbox_table_name="bad name")
    await outbox.aclose()


async def test_a_raw_subscriber_gets_foreign_messages_and_unique_names(sqlite_url: str) -> None:
    """Two groups on one stream each get every message; a stream of their own each."""
    outbox = await new_outbox(sqlite_url)
    stream = unique("s")
    a: list[str] = []
    b: list[str] = []

    @outbox.subscriber(stream, group="a", start="all")
    async def first(message: Message) -> None:
        a.append(message.type)

    @outbox.subscriber(stream, group="b", start="all")
    async def second(message: Message) -> None:
        b.append(message.type)

    async with outbox.relaying():
        async with outbox.unit_of_work() as uow:
            uow.publish(Message(stream=stream, type="Ping", payload={"x": 1}))
        await wait_until(lambda: a == ["Ping"] and b == ["Ping"], timeout=5)
    await outbox.aclose()


async def test_dashboard_overview_lists_the_consumers(sqlite_url: str) -> None:
    outbox = Outbox(
        sqlite_url,
        brokers={"default": MemoryBroker()},
        settings=OutboxSettings(**FAST),
        dashboard_dependencies=[],
    )
    await outbox.create_tables()

    unlucky = {13}

    @outbox.subscriber("shipments", group="tracking", start="all")
    async def track(event: Shipped) -> None:
        if event.order_id in unlucky:
            raise ValueError("unlucky")

    app = FastAPI(lifespan=outbox.lifespan)
    app.include_router(outbox.dashboard_router)
    app.include_router(outbox.health_router)
    async with asgi_client(app) as client:
        async with outbox.unit_of_work() as uow:
            uow.publish(Shipped(order_id=1, step=0))
            uow.publish(Shipped(order_id=13, step=0))
        sub = outbox.subscribers[0]
        await wait_until(lambda: sub.stats.handled == 1 and sub.stats.dead_lettered == 1)
        data = (await client.get("/outbox/dashboard/api/overview")).json()
        [row] = data["consumers"]
        assert (row["group"], row["stream"], row["dead_letters"]) == ("tracking", "shipments", 1)
        assert row["lag"] == 0 and row["pending"] == 0 and row["last_handled_at"]
        page = await client.get("/outbox/dashboard")
        assert "<h2>Consumers</h2>" in page.text and "tracking" in page.text
        health = (await client.get("/outbox/health")).json()
        assert health["status"] == "degraded"
        assert health["consumers"][0]["dead_letter_stream"] == "shipments.tracking.dlq"

        # The operator fixes the cause and puts the dead letter back from the dashboard.
        assert 'data-action="replay-dead-letters"' in page.text
        token = re.search(r'name="outbox-csrf" content="([^"]+)"', page.text)
        assert token is not None
        action = "/outbox/dashboard/api/replay-dead-letters"
        body = {"stream": "shipments", "group": "tracking"}
        refused = await client.post(action, json=body)  # no CSRF header
        assert refused.status_code == 403
        wrong = await client.post(
            action, json={**body, "group": "nope"}, headers={CSRF_HEADER: token.group(1)}
        )
        assert wrong.status_code == 400 and "no subscriber for stream" in wrong.json()["detail"]
        unlucky.clear()
        done = await client.post(action, json=body, headers={CSRF_HEADER: token.group(1)})
        assert done.status_code == 200 and done.json() == {"changed": 1, "problems": []}
        await wait_until(lambda: sub.stats.handled == 2)
        [row] = (await client.get("/outbox/dashboard/api/overview")).json()["consumers"]
        assert row["dead_letters"] == 0
        page = await client.get("/outbox/dashboard")
        assert 'data-action="replay-dead-letters"' not in page.text
    await outbox.aclose()


async def test_a_handler_that_commits_itself_runs_once_inside_its_batch(
    sqlite_url: str,
) -> None:
    """A handler's own commit inside a batch releases the session's savepoint in the
    batch's transaction: the batch is not refused, each handler runs once (the effects of
    every idiom: tests/integration/consume/test_handler_idioms.py)."""
    outbox = await new_outbox(sqlite_url)
    calls: list[int] = []

    @outbox.subscriber("shipments", group="committer", start="all")
    async def commits(event: Shipped, uow: UnitOfWork) -> None:
        calls.append(event.order_id)
        await uow.session.commit()

    sub = outbox.subscribers[0]
    async with outbox.unit_of_work() as uow:
        for order in range(5):
            uow.publish(Shipped(order_id=order, step=0))
    async with outbox.relaying():
        await wait_until(lambda: sub.stats.handled == 5, timeout=10)
    for order in range(5):
        assert calls.count(order) == 1
    assert (await outbox.inbox.group_stats(["committer"]))["committer"].handled == 5
    await outbox.aclose()


class _Base(DeclarativeBase):
    pass


class Parcel(_Base, AggregateRoot):
    __tablename__ = "parcels"

    id: Mapped[int] = mapped_column(primary_key=True)
    order_id: Mapped[int]


class ParcelCreated(Event, stream="parcels"):
    order_id: int


async def test_events_raised_on_new_aggregates_carry_their_own_message_as_cause(
    sqlite_url: str,
) -> None:
    """In a batch, each handler's aggregates (raised before ``session.add``, or after a
    flush of its own) publish with that handler's incoming message as causation id."""
    outbox = await new_outbox(sqlite_url)
    async with outbox.engine.begin() as conn:
        await conn.run_sync(_Base.metadata.create_all)
    sent: dict[int, str] = {}
    got: list[Message] = []

    @outbox.subscriber("shipments", group="parcels", start="all")
    async def pack(event: Shipped, uow: UnitOfWork) -> None:
        parcel = Parcel(order_id=event.order_id)
        parcel.raise_event(ParcelCreated(order_id=event.order_id))
        if event.order_id % 2:
            uow.session.add(Parcel(order_id=-1))
            await uow.session.flush()  # earlier new objects stop being new
        uow.session.add(parcel)

    @outbox.subscriber("parcels", group="audit", start="all")
    async def audit(message: Message) -> None:
        got.append(message)

    async with outbox.unit_of_work() as uow:
        for order in range(6):
            sent[order] = str(uow.publish(Shipped(order_id=order, step=0)))
    async with outbox.relaying():
        await wait_until(lambda: len(got) == 6, timeout=10)
    assert {m.payload["order_id"]: m.headers["causation-id"] for m in got} == sent
    await outbox.aclose()


async def test_a_handlers_own_connection_error_is_retried_then_dead_lettered(
    sqlite_url: str,
) -> None:
    """A partner's API refusing the handler's connection (an ``OSError``) while the
    database answers: a handler failure — retried, then dead-lettered — not a database
    outage waited on forever."""
    outbox = await new_outbox(sqlite_url, consumer_max_attempts=2)
    calls: list[int] = []

    @outbox.subscriber("shipments", group="carrier", start="all")
    async def notify(event: Shipped) -> None:
        calls.append(event.order_id)
        raise ConnectionRefusedError("carrier API refused the connection")

    sub = outbox.subscribers[0]
    async with outbox.relaying():
        async with outbox.unit_of_work() as uow:
            uow.publish(Shipped(order_id=5, step=0))
        await wait_until(lambda: sub.stats.dead_lettered == 1, timeout=10)
        [letter] = await sub.make_consumer().dead_letters()
        assert "ConnectionRefusedError" in letter.error and letter.attempts == 2
    assert calls == [5, 5]
    assert "database unreachable" not in (sub.stats.last_error or "")
    await outbox.aclose()


@pytest.mark.postgres(reason="a private PostgreSQL proxied to cut connections")
async def test_a_database_outage_costs_no_attempt(pg_url: str) -> None:
    """The database goes away (a proxy cut) under a subscriber with ``max_attempts=1``: the
    message waits in place — a charged attempt would dead-letter it at once — and is
    handled once the database is back."""
    proxy = TcpProxy(5432)
    await proxy.start()
    broker = MemoryBroker()
    outbox = Outbox(
        pg_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}"),
        brokers={"default": broker},
        settings=OutboxSettings(**{**FAST, "consumer_max_attempts": 1}),
    )
    handled: list[int] = []

    @outbox.subscriber(unique("shipments"), group="tracking", start="all")
    async def track(message: Message) -> None:
        handled.append(message.payload["n"])

    sub = outbox.subscribers[0]
    try:
        await outbox.create_tables()
        async with outbox.relaying():
            await proxy.stop()
            mid = str(uuid7())
            headers = {"message-id": mid, "type": "Shipped"}
            await broker.publish([Envelope(mid, sub.stream, "Shipped", None, b'{"n": 1}', headers)])
            await wait_until(
                lambda: "database unreachable" in (sub.stats.last_error or ""), timeout=10
            )
            assert sub.stats.dead_lettered == 0 and handled == []
            await proxy.start()
            await wait_until(lambda: handled == [1], timeout=15)
            assert sub.stats.dead_lettered == 0
    finally:
        await outbox.aclose()
        await proxy.stop()


async def test_a_consumer_without_ack_soon_gets_plain_acks(sqlite_url: str) -> None:
    """A broker of another package whose consumer predates ``ack_soon``: batches are
    acknowledged with its ``ack``."""

    class OldConsumer:
        def __init__(self, inner: Any) -> None:
            self._inner = inner
            self.config = inner.config
            self.acked: list[str] = []

        def __getattr__(self, name: str) -> Any:
            if name == "ack_soon":
                raise AttributeError(name)
            return getattr(self._inner, name)

        async def ack(self, deliveries: Sequence[Any]) -> None:
            self.acked += [d.message_id for d in deliveries]
            await self._inner.ack(deliveries)

    class OldBroker(MemoryBroker):
        def consumer(self, config: Any) -> Any:
            return OldConsumer(super().consumer(config))

    outbox = Outbox(sqlite_url, brokers={"default": OldBroker()}, settings=OutboxSettings(**FAST))
    await outbox.create_tables()
    seen: list[int] = []

    @outbox.subscriber("shipments", group="old", start="all")
    async def track(events: list[Shipped]) -> None:
        seen.extend(e.order_id for e in events)

    sub = outbox.subscribers[0]
    async with outbox.relaying():
        async with outbox.unit_of_work() as uow:
            for n in range(5):
                uow.publish(Shipped(order_id=n, step=0))
        await wait_until(lambda: sub.stats.handled == 5, timeout=10)
        assert sub.consumer is not None
        await wait_until(lambda: len(sub.consumer.acked) == 5, timeout=5)  # type: ignore[attr-defined]
        assert (await sub.lag()).pending == 0
    assert sorted(seen) == list(range(5))
    await outbox.aclose()

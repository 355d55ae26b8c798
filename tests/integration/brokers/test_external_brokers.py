"""External brokers: one extra row per external broker, a reduced envelope, independence.

An event declared ``external=True`` becomes one row for its internal broker and one for
each external broker. External rows carry no internal-only headers (correlation,
causation, trace context), and each row is dispatched on its own: an external broker that
is down holds back nothing but its own rows, which follow once it is reachable.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import nats.js.errors
import pytest
import redis.asyncio as aioredis

from fastapi_outbox import Event, Outbox, OutboxSettings, exceptions
from fastapi_outbox.brokers import MemoryBroker, NatsJetStreamBroker, RedisStreamsBroker
from fastapi_outbox.brokers.nats.wire import stream_name_for
from fastapi_outbox.events import INTERNAL_HEADERS, Message
from fastapi_outbox.storage.filters import MessageFilter
from tests.conftest import unique, wait_until
from tests.servers import PrivateServer, private_nats_server

PRIVATE_NATS_PORTS = range(4240, 4250)
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class PaymentSettled(Event, stream="payments", key="payment_id", external=True):
    payment_id: int
    amount: float


class LedgerPosted(Event, stream="ledger"):
    entry_id: int


async def headers_of(outbox: Outbox, row_id: uuid.UUID) -> dict[str, str]:
    row = await outbox.store.messages.get(row_id)
    assert row is not None
    return dict(json.loads(str(row["headers"])))


async def test_external_event_gets_a_row_per_external_broker_with_a_reduced_envelope(
    db_url: str,
) -> None:
    outbox = Outbox(
        db_url,
        brokers={"default": MemoryBroker(), "audit": MemoryBroker()},
        external_brokers={"partner": MemoryBroker(), "bi": MemoryBroker()},
        settings=OutboxSettings(run_relays=False),
    )
    await outbox.create_tables()
    try:
        async with outbox.unit_of_work(
            correlation_id="corr-1", causation_id="cause-1", traceparent=TRACEPARENT
        ) as uow:
            message_id = uow.publish(
                PaymentSettled(payment_id=7, amount=12.5), headers={"x-tenant": "acme"}
            )
            uow.publish(LedgerPosted(entry_id=1))  # not external: one row only
            with pytest.raises(exceptions.UnknownBroker, match="external=True"):
                uow.publish(LedgerPosted(entry_id=2), broker="partner")

        rows = await outbox.store.messages.list_messages(limit=10)
        by_broker = {(r["broker"], r["stream"]): r for r in rows}
        assert sorted(by_broker) == [
            ("bi", "payments"),
            ("default", "ledger"),
            ("default", "payments"),
            ("partner", "payments"),
        ]
        internal = by_broker["default", "payments"]
        assert internal["id"] == message_id
        internal_headers = await headers_of(outbox, internal["id"])
        assert internal_headers["correlation-id"] == "corr-1"
        assert internal_headers["causation-id"] == "cause-1"
        assert internal_headers["traceparent"] == TRACEPARENT

        for name in ("partner", "bi"):
            external = by_broker[name, "payments"]
            assert external["id"] != message_id  # its own row: its own de-duplication id
            assert (external["type"], external["key"], external["status"]) == (
                "PaymentSettled",
                "7",
                "pending",
            )
            headers = await headers_of(outbox, external["id"])
            assert not set(headers) & INTERNAL_HEADERS
            assert {"correlation-id", "causation-id", "traceparent"}.isdisjoint(headers)
            # What the partner may see: the logical message id, type, time, own headers.
            assert headers["message-id"] == str(message_id)
            assert headers["type"] == "PaymentSettled"
            assert headers["x-tenant"] == "acme"
            assert headers["occurred-at"] == internal_headers["occurred-at"]
            payload = await outbox.store.messages.get(external["id"])
            assert payload is not None
            assert json.loads(str(payload["payload"])) == {"payment_id": 7, "amount": 12.5}

        # An explicit Message can be external too.
        async with outbox.unit_of_work() as uow:
            uow.publish(Message("payments", "Refund", {"id": 1}, external=True))
        refunds = [
            r for r in await outbox.store.messages.list_messages(limit=20) if r["type"] == "Refund"
        ]
        assert sorted(r["broker"] for r in refunds) == ["bi", "default", "partner"]
    finally:
        await outbox.aclose()


# -- a real external broker that is down, then up ------------------------------------------------


@pytest.fixture
async def private_nats(tmp_path: Path) -> AsyncIterator[PrivateServer]:
    server = private_nats_server(PRIVATE_NATS_PORTS, tmp_path)  # not started: the test decides
    try:
        yield server
    finally:
        await server.kill()


async def test_a_down_external_broker_holds_back_only_its_own_rows(
    pg_url: str, redis_url: str, private_nats: PrivateServer
) -> None:
    stream = unique("payments")

    class Settled(Event, stream=stream, key="payment_id", external=True):
        payment_id: int

    outbox = Outbox(
        pg_url,
        brokers={"default": RedisStreamsBroker(redis_url)},
        external_brokers={
            "partner": NatsJetStreamBroker(private_nats.url, connect_timeout_seconds=0.3)
        },
        settings=OutboxSettings(
            poll_interval_seconds=0.05,
            max_poll_interval_seconds=0.2,
            broker_backoff_max_seconds=0.3,
        ),
    )
    await outbox.create_tables()
    client = aioredis.Redis.from_url(redis_url)

    async def redis_entries() -> list[Any]:
        return list(await client.xrange(stream, "-", "+"))

    async def statuses() -> dict[str, tuple[str, int]]:
        return {
            r["broker"]: (r["status"], r["attempts"])
            for r in await outbox.store.messages.list_messages(MessageFilter(stream=stream))
        }

    try:
        async with outbox.relaying():
            async with outbox.unit_of_work(correlation_id="corr-9") as uow:
                uow.publish(Settled(payment_id=9))
            await wait_until(lambda: len_is(redis_entries, 1), timeout=10)
            partner = outbox.relays.tables["partner"]
            await wait_until(lambda: not partner.broker_ok, timeout=10)
            assert outbox.relays.tables["default"].broker_ok
            expected = {"default": ("published", 1), "partner": ("pending", 0)}
            await wait_until(lambda: statuses_are(statuses, expected), timeout=5)

            await private_nats.start()
            await wait_until(lambda: partner_published(statuses), timeout=15)
            assert partner.broker_ok
        (_entry_id, fields), *_ = await redis_entries()
        assert json.loads(fields[b"headers"])["correlation-id"] == "corr-9"

        nc = await nats.connect(private_nats.url)
        try:
            jsm = nc.jsm()
            msg = await jsm.get_msg(stream_name_for(stream), 1)
            headers = dict(msg.headers or {})
            assert json.loads(msg.data or b"") == {"payment_id": 9}
            assert headers["type"] == "Settled" and headers["key"] == "9"
            assert "correlation-id" not in headers  # the reduced envelope
        finally:
            await nc.close()
    finally:
        await client.delete(stream)
        await client.aclose()
        await outbox.aclose()


async def statuses_are(statuses: Any, expected: dict[str, tuple[str, int]]) -> bool:
    return bool(await statuses() == expected)


async def len_is(read: Any, n: int) -> bool:
    return len(await read()) == n


async def partner_published(statuses: Any) -> bool:
    return bool((await statuses())["partner"] == ("published", 1))


async def test_external_rows_are_published_independently_of_internal_failures(
    sqlite_url: str,
) -> None:
    internal = MemoryBroker()
    internal.available = False
    partner = MemoryBroker()
    outbox = Outbox(
        sqlite_url,
        brokers={"default": internal},
        external_brokers={"partner": partner},
        settings=OutboxSettings(poll_interval_seconds=0.05, broker_backoff_max_seconds=0.2),
    )
    await outbox.create_tables()
    try:
        async with outbox.relaying():
            async with outbox.unit_of_work() as uow:
                uow.publish(PaymentSettled(payment_id=1, amount=1.0))
            (received,) = await partner.wait_for(1, timeout=5)
            assert received.stream == "payments" and received.json()["payment_id"] == 1
            assert internal.messages == []
            internal.available = True
            await internal.wait_for(1, timeout=5)
    finally:
        await outbox.aclose()

"""Encrypted payloads on real services: no plaintext byte of an encrypted
payload (or of a header named in ``encrypted_headers``) in the PostgreSQL table, the WAL
message, the Redis entry or the JetStream message; subscribers get the plain event; a key
rotation while messages are in flight; an unknown key and a tampered ciphertext
dead-lettered naming the key id and message id; the dashboard's "encrypted (key k2)"."""

from __future__ import annotations

import base64
import json
import os
from typing import Any

import anyio
import asyncpg
import nats
import pytest
import redis.asyncio as aioredis
from sqlalchemy import text

from fastapi_outbox import Event, Outbox, OutboxSettings
from fastapi_outbox.brokers import MemoryBroker, NatsJetStreamBroker, RedisStreamsBroker
from fastapi_outbox.brokers.nats.wire import stream_name_for
from fastapi_outbox.storage.statements.wal import PEEK_SQL
from tests.conftest import asgi_client, run_cli, unique, wait_until

MARKER = "PLAINTEXT-MARKER-c81d"
K1, K2, K3 = os.urandom(32), os.urandom(32), os.urandom(32)
FAST = {
    "poll_interval_seconds": 0.2,
    "consumer_claim_idle_seconds": 1.0,
    "consumer_retry_base_delay_seconds": 0.02,
    "consumer_retry_max_delay_seconds": 0.1,
    "shutdown_timeout_seconds": 2.0,
}


def settings(keys: dict[str, bytes] | None, **more: Any) -> OutboxSettings:
    return OutboxSettings(
        encryption_keys=keys, encrypted_headers=["card-holder"], **{**FAST, **more}
    )


def secret_event(stream: str) -> type[Event]:
    class Secret(Event, stream=stream):
        card: str
        n: int = 0

    return Secret


def subscribe(outbox: Outbox, cls: type[Event], sink: Any, **options: Any) -> None:
    """A subscriber of ``cls``'s stream feeding ``sink`` (its annotation set by hand: the
    class is local to the test)."""

    async def handle(event: Any) -> None:
        sink(event)

    handle.__annotations__ = {"event": cls, "return": None}
    outbox.subscriber(cls.__outbox_stream__, group="g", start="all", **options)(handle)


def no_marker(*blobs: Any) -> bool:
    return all(
        MARKER.encode() not in (b if isinstance(b, bytes) else str(b).encode()) for b in blobs
    )


@pytest.mark.postgres(
    reason="reads the stored bytes with asyncpg; encryption happens before any database sees them"
)
@pytest.mark.redis
async def test_table_and_redis_entry_hold_no_plaintext_and_the_handler_gets_the_event(
    pg_url: str, redis_url: str
) -> None:
    stream = unique("enc")
    Secret = secret_event(stream)
    outbox = Outbox(
        pg_url, brokers={"default": RedisStreamsBroker(redis_url)}, settings=settings({"k1": K1})
    )
    got: list[Any] = []
    client = aioredis.from_url(redis_url)
    try:
        await outbox.create_tables()

        subscribe(outbox, Secret, got.append)

        async with outbox.unit_of_work() as uow:
            uow.publish(Secret(card=MARKER), headers={"card-holder": MARKER, "tenant": "t1"})
        async with outbox.engine.connect() as conn:
            [(payload, headers)] = (
                await conn.execute(
                    text(f"SELECT payload::text, headers::text FROM {outbox.settings.table_name}")
                )
            ).all()
        assert no_marker(payload, headers) and '"encryption-key-id": "k1"' in headers
        async with outbox.relaying():
            await wait_until(lambda: len(got) == 1, timeout=15)
        entries = await client.xrange(stream)
        assert len(entries) == 1
        assert no_marker(*entries[0][1].keys(), *entries[0][1].values())
        assert got[0].card == MARKER  # type: ignore[attr-defined]
    finally:
        async for key in client.scan_iter(f"{stream}*"):
            await client.delete(key)
        await client.aclose()
        await outbox.aclose()


@pytest.mark.nats
async def test_jetstream_message_holds_no_plaintext(sqlite_url: str, nats_url: str) -> None:
    stream = unique("enc")
    Secret = secret_event(stream)
    outbox = Outbox(
        sqlite_url,
        brokers={"default": NatsJetStreamBroker(nats_url)},
        settings=settings({"k1": K1, "k2": K2}),
    )
    nc = await nats.connect(nats_url)
    got: list[Any] = []
    try:
        await outbox.create_tables()

        subscribe(outbox, Secret, got.append)

        async with outbox.relaying():
            async with outbox.unit_of_work() as uow:
                uow.publish(Secret(card=MARKER), headers={"card-holder": MARKER})
            await wait_until(lambda: len(got) == 1, timeout=15)
        msg = await nc.jsm().get_msg(stream_name_for(stream), 1)
        headers = dict(msg.headers or {})
        assert no_marker(msg.data, json.dumps(headers)) and headers["encryption-key-id"] == "k2"
        assert got[0].card == MARKER  # type: ignore[attr-defined]
    finally:
        try:
            await nc.jsm().delete_stream(stream_name_for(stream))
        finally:
            await nc.close()
            await outbox.aclose()


async def test_the_wal_message_holds_no_plaintext(wal_pg_url: str) -> None:
    Secret = secret_event(unique("enc"))
    broker = MemoryBroker()
    outbox = Outbox(
        wal_pg_url, brokers={"default": broker}, settings=settings({"k1": K1}, capture="wal")
    )
    try:
        await outbox.create_tables()
        async with outbox.unit_of_work() as uow:
            uow.publish(Secret(card=MARKER), headers={"card-holder": MARKER})
        slot = outbox.wal_slot
        assert slot is not None
        conn = await asyncpg.connect(wal_pg_url.replace("+asyncpg", ""))
        try:
            datas = [
                r["data"]
                for r in await conn.fetch(PEEK_SQL, slot.name, None, 1000, slot.publication)
            ]
        finally:
            await conn.close()
        ours = [d for d in datas if b"encryption-key-id" in d]
        assert len(ours) == 1 and no_marker(*datas)
        async with outbox.relaying():
            await broker.wait_for(1)
        assert no_marker(broker.messages[0].payload, broker.messages[0].headers_json)
    finally:
        await outbox.aclose()


@pytest.mark.redis
async def test_rotation_in_flight_unknown_key_and_tampering(
    sqlite_url: str, redis_url: str
) -> None:
    """Producers on k1 leave messages in the stream; consumers get k2 and then producers
    encrypt with it; everything is handled. A message under k3 (a key no consumer holds) and
    one whose ciphertext was changed in the table are dead-lettered, naming the key id and
    the message id, and the others are not held up; the key added, a replay of the dead
    letter is handled."""
    stream = unique("rot")
    Secret = secret_event(stream)

    def make(keys: dict[str, bytes]) -> Outbox:
        return Outbox(
            sqlite_url, brokers={"default": RedisStreamsBroker(redis_url)}, settings=settings(keys)
        )

    old, new, rogue = make({"k1": K1}), make({"k1": K1, "k2": K2}), make({"k3": K3})
    consumer = make({"k1": K1, "k2": K2})
    outboxes = [old, new, rogue, consumer]
    seen: list[int] = []
    client = aioredis.from_url(redis_url)
    try:
        await old.create_tables()

        subscribe(consumer, Secret, lambda event: seen.append(event.n), max_attempts=3)

        ids = {}
        async with old.relaying():  # in flight under k1: in the stream, not consumed
            async with old.unit_of_work() as uow:
                for n in range(3):
                    uow.publish(Secret(card=MARKER, n=n))
            await wait_until(lambda: xlen_is(client, stream, 3), timeout=15)
        async with rogue.unit_of_work() as uow:
            ids["k3"] = uow.publish(Secret(card=MARKER, n=100))
        async with new.unit_of_work() as uow:
            for n in range(3, 6):
                uow.publish(Secret(card=MARKER, n=n))
            ids["tampered"] = uow.publish(Secret(card=MARKER, n=200))
        await tamper(new, ids["tampered"])
        sub = consumer.subscribers[0]
        async with new.relaying(), consumer.relaying():
            await wait_until(lambda: sub.stats.dead_lettered == 2 and len(seen) == 6, timeout=20)
        assert sorted(seen) == [0, 1, 2, 3, 4, 5]
        reader = sub.make_consumer()
        try:
            letters = {d.message_id: d.error for d in await reader.dead_letters()}
        finally:
            await reader.aclose()
        unknown = letters[str(ids["k3"])]
        assert "'k3'" in unknown and str(ids["k3"]) in unknown
        assert "authentication" in letters[str(ids["tampered"])]
        assert str(ids["tampered"]) in letters[str(ids["tampered"])]
        key_ids = {
            json.loads(fields[b"headers"])["encryption-key-id"]
            for _, fields in await client.xrange(stream)
        }
        assert key_ids == {"k1", "k2", "k3"}
        # The key added, the dead letter replayed: handled (its ciphertext still opens).
        healed = make({"k1": K1, "k2": K2, "k3": K3})
        outboxes.append(healed)
        subscribe(healed, Secret, lambda event: seen.append(event.n))
        dead = healed.subscribers[0].make_consumer()
        try:
            [entry] = [
                d.entry_id for d in await dead.dead_letters() if d.message_id == str(ids["k3"])
            ]
            assert await dead.replay_dead_letters([entry]) == 1
        finally:
            await dead.aclose()
        async with healed.relaying():
            await wait_until(lambda: 100 in seen, timeout=15)
    finally:
        async for key in client.scan_iter(f"{stream}*"):
            await client.delete(key)
        await client.aclose()
        for outbox in outboxes:
            await outbox.aclose()


async def xlen_is(client: Any, stream: str, n: int) -> bool:
    return bool(await client.xlen(stream) == n)


async def tamper(outbox: Outbox, message_id: Any) -> None:
    """Flip one bit of the ciphertext of ``message_id``'s row (still valid base64)."""
    table = outbox.settings.table_name
    async with outbox.engine.begin() as conn:
        payload = (
            await conn.execute(
                text(f"SELECT payload FROM {table} WHERE headers LIKE :id"),
                {"id": f"%{message_id}%"},
            )
        ).scalar_one()
        raw = bytearray(base64.b64decode(json.loads(payload)))
        raw[-1] ^= 1
        changed = json.dumps(base64.b64encode(bytes(raw)).decode())
        await conn.execute(
            text(f"UPDATE {table} SET payload = :p WHERE headers LIKE :id"),
            {"p": changed, "id": f"%{message_id}%"},
        )


async def test_the_dashboard_shows_encrypted_unless_it_holds_the_key(sqlite_url: str) -> None:
    from fastapi import FastAPI

    Secret = secret_event(unique("enc"))
    writer = Outbox(
        sqlite_url, brokers={"default": MemoryBroker()}, settings=settings({"k1": K1, "k2": K2})
    )
    await writer.create_tables()
    async with writer.unit_of_work() as uow:
        mid = uow.publish(Secret(card=MARKER), headers={"card-holder": MARKER})
    await writer.aclose()
    cases = [  # keys of the dashboard's process, dashboard_show_payloads, what shows
        (None, True, "note"),
        ({"k2": K2}, True, "plain"),
        ({"k2": K2}, False, "nothing"),  # payloads hidden: named headers not decrypted
    ]
    for keys, show, expect in cases:
        ops = Outbox(
            sqlite_url,
            brokers={"default": MemoryBroker()},
            settings=settings(keys, run_relays=False, dashboard_show_payloads=show),
            dashboard_dependencies=[],
        )
        app = FastAPI(lifespan=ops.lifespan)
        app.include_router(ops.dashboard_router)
        try:
            async with asgi_client(app) as client:
                page = await client.get(f"/outbox/dashboard/messages/{mid}")
            assert page.status_code == 200
            assert ("encrypted (key k2)" in page.text) is (expect == "note")
            assert (MARKER in page.text) is (expect == "plain")
        finally:
            await ops.aclose()


@pytest.mark.parametrize("mode", ["binary", "structured"])
async def test_cloudevents_carry_the_key_id_and_the_ciphertext(sqlite_url: str, mode: str) -> None:
    Secret = secret_event(unique("enc"))
    broker = MemoryBroker(envelope="cloudevents", cloudevents_mode=mode)  # type: ignore[arg-type]
    outbox = Outbox(sqlite_url, brokers={"default": broker}, settings=settings({"k1": K1}))
    got: list[Any] = []
    try:
        await outbox.create_tables()
        subscribe(outbox, Secret, got.append)
        async with outbox.relaying():
            async with outbox.unit_of_work() as uow:
                uow.publish(Secret(card=MARKER), headers={"card-holder": MARKER})
            await wait_until(lambda: len(got) == 1, timeout=10)
        [sent] = broker.messages
        assert no_marker(sent.payload, sent.headers_json)
        assert got[0].card == MARKER
    finally:
        await outbox.aclose()


async def test_cli_show_without_the_key_prints_the_note(sqlite_url: str) -> None:
    """``fastapi-outbox show`` in a process without the key (the one holding it shows the
    plain payload: the dashboard test, through the same ``operations.show``)."""
    Secret = secret_event(unique("enc"))
    writer = Outbox(sqlite_url, brokers={"default": MemoryBroker()}, settings=settings({"k1": K1}))
    try:
        await writer.create_tables()
        async with writer.unit_of_work() as uow:
            mid = uow.publish(Secret(card=MARKER))
    finally:
        await writer.aclose()
    done = await anyio.to_thread.run_sync(lambda: run_cli("show", str(mid), "--url", sqlite_url))
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    assert shown["payload"] is None and shown["payload_note"] == "encrypted (key k1)"
    assert shown["headers"]["encryption-key-id"] == "k1" and MARKER not in done.stdout


@pytest.mark.rabbitmq
async def test_rabbitmq_message_holds_no_plaintext(sqlite_url: str, rabbitmq_url: str) -> None:
    import aio_pika

    from fastapi_outbox.brokers import RabbitMQBroker

    stream, exchange = unique("enc"), unique("enc_x")
    Secret = secret_event(stream)
    outbox = Outbox(
        sqlite_url,
        brokers={"default": RabbitMQBroker(rabbitmq_url, exchange=exchange)},
        settings=settings({"k1": K1}),
    )
    conn = await aio_pika.connect(rabbitmq_url)
    channel = await conn.channel()
    got: list[Any] = []
    try:
        await outbox.create_tables()
        x = await channel.declare_exchange(exchange, "topic", durable=True)
        spy = await channel.declare_queue(unique("enc_spy"), exclusive=True)
        await spy.bind(x, routing_key=stream)
        subscribe(outbox, Secret, got.append)
        async with outbox.relaying():
            async with outbox.unit_of_work() as uow:
                uow.publish(Secret(card=MARKER), headers={"card-holder": MARKER})
            await wait_until(lambda: len(got) == 1, timeout=15)
        raw = await spy.get(timeout=5)
        assert raw is not None
        assert no_marker(raw.body, json.dumps({k: str(v) for k, v in raw.headers.items()}))
        assert got[0].card == MARKER
    finally:
        await outbox.aclose()
        for name in (f"{stream}.g", f"{stream}.g.dlq"):
            await channel.queue_delete(name)
        await channel.exchange_delete(exchange)
        await conn.close()

"""capture="wal" with the payload stages: encryption and claim-check.

On the ``wal_level=logical`` cluster (``wal_pg_url``) and the shared Redis (a stream of each
test's own): an encrypted, claim-checked message and an encrypted inline one reach a
subscriber (its inbox, its transaction) whole and decoded; the WAL message and the Redis
entries hold no plaintext, and for the claim-checked one only the reference. Claim-check
retention keeps a payload whose message still waits in the slot — with WAL capture no
outbox row names it, so a file store's orphan sweep (which looks for outbox rows) must not
run. A message the broker refuses goes to the outbox table with its stub payload, its
reference and its key id, and reaches the subscriber whole from there.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import redis.asyncio as aioredis
from sqlalchemy import Text, cast, func, select

from fastapi_outbox import Event, Message, Outbox, OutboxSettings, UnitOfWork, exceptions
from fastapi_outbox.brokers import MemoryBroker, RedisStreamsBroker
from fastapi_outbox.events import Envelope
from fastapi_outbox.storage.claim_check import (
    HEADER_CLAIM_CHECK,
    HEADER_CLAIM_CHECK_SIZE,
    STUB_PAYLOAD,
    DatabasePayloadStore,
    FilePayloadStore,
)
from fastapi_outbox.storage.statements.wal import PEEK_SQL
from tests.conftest import slot_empty, unique, wait_until

MARKER = "PLAINTEXT-MARKER-7f3a"
KEY = os.urandom(32)
#: The large payload: well over claim_check_bytes, encrypted before it is claim-checked.
BIG = 200 * 1024
#: How old the stored payload is made before retention runs: past a file store's orphan
#: grace period (an hour), well inside the retention (7 days).
AGED_SECONDS = 2 * 3600


def wal_settings(stream: str, store: str, **more: Any) -> OutboxSettings:
    return OutboxSettings(
        capture="wal",
        claim_check_bytes=1024,
        claim_check_store=store,
        encryption_keys={"k1": KEY},
        encryption_streams=[stream],
        notify=False,
        poll_interval_seconds=0.05,
        max_poll_interval_seconds=0.2,
        consumer_claim_idle_seconds=1.0,
        consumer_retry_base_delay_seconds=0.02,
        consumer_retry_max_delay_seconds=0.1,
        shutdown_timeout_seconds=3.0,
        **more,
    )


def scan_event(stream: str) -> type[Event]:
    class Scan(Event, stream=stream):
        name: str
        blob: str

    return Scan


def subscribe(outbox: Outbox, cls: type[Event], sink: list[tuple[str, str]]) -> None:
    """A subscriber of ``cls``'s stream with the inbox (a ``UnitOfWork`` parameter: the
    handler's own transaction), recording what its handler receives."""

    async def handle(event: Any, uow: UnitOfWork) -> None:
        sink.append((event.name, event.blob))

    handle.__annotations__ = {"event": cls, "uow": UnitOfWork, "return": None}
    outbox.subscriber(cls.__outbox_stream__, group="g", start="all")(handle)


@contextlib.asynccontextmanager
async def redis_stream(url: str) -> AsyncIterator[tuple[str, aioredis.Redis]]:
    stream = unique("walpay")
    client = aioredis.Redis.from_url(url)
    try:
        yield stream, client
    finally:
        keys = [k async for k in client.scan_iter(match=f"*{stream}*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()


async def inbox_rows(outbox: Outbox) -> int:
    assert outbox.inbox is not None
    async with outbox.engine.connect() as conn:
        count = await conn.execute(select(func.count()).select_from(outbox.inbox.table))
        return int(count.scalar_one())


async def wal_messages(url: str, slot: Any) -> bytes:
    """The pgoutput message records of the outbox's prefix the slot holds (a peek)."""
    conn = await asyncpg.connect(url.replace("+asyncpg", ""))
    try:
        rows = await conn.fetch(PEEK_SQL, slot.name, None, 1000, slot.publication)
    finally:
        await conn.close()
    return b"".join(r["data"] for r in rows if slot.prefix.encode() in r["data"])


async def age_stored_payload(outbox: Outbox, ref: str) -> None:
    """Make the stored payload of ``ref`` look ``AGED_SECONDS`` old to retention."""
    store = outbox.claim_check_store
    if isinstance(store, FilePayloadStore):
        past = time.time() - AGED_SECONDS
        os.utime(store.path_of(ref), (past, past))
        return
    assert isinstance(store, DatabasePayloadStore)
    async with outbox.engine.begin() as conn:
        await conn.exec_driver_sql(
            f'UPDATE "{store.table.name}" '
            f"SET created_at = created_at - interval '{AGED_SECONDS} seconds' WHERE ref = $1",
            (ref,),
        )


@pytest.mark.parametrize("store", ["database", "file"])
async def test_encrypted_and_claim_checked_messages_reach_the_subscriber_whole(
    store: str, wal_pg_url: str, redis_url: str, tmp_path: Path
) -> None:
    where = "database" if store == "database" else f"file://{tmp_path}/payloads"
    async with redis_stream(redis_url) as (stream, client):
        Scan = scan_event(stream)
        outbox = Outbox(
            wal_pg_url,
            brokers={"default": RedisStreamsBroker(redis_url)},
            settings=wal_settings(stream, where),
        )
        seen: list[tuple[str, str]] = []
        subscribe(outbox, Scan, seen)
        try:
            await outbox.create_tables()
            big = MARKER + "x" * BIG
            async with outbox.unit_of_work() as uow:
                big_id = str(uow.publish(Scan(name="big", blob=big)))  # type: ignore[call-arg]
                small_id = str(uow.publish(Scan(name="small", blob=MARKER)))  # type: ignore[call-arg]
            slot = outbox.wal_slot
            assert slot is not None
            # WAL capture: the messages wait in the slot; no outbox row names them.
            assert await slot.pending_messages() == 2
            assert await outbox.store.messages.count() == 0
            # The WAL message holds the reference and the sealed small payload: no plaintext,
            # not the 200 KiB.
            wal = await wal_messages(wal_pg_url, slot)
            assert MARKER.encode() not in wal and big_id.encode() in wal and len(wal) < 4096
            # Retention while the relay has not published them (the payload aged past a
            # file store's orphan grace): the payload stays.
            await age_stored_payload(outbox, big_id)
            await outbox.cleaner.run_once()
            assert outbox.claim_check_store is not None
            stored = await outbox.claim_check_store.get(big_id)
            assert stored is not None and MARKER.encode() not in stored  # the ciphertext

            async with outbox.relaying():
                await wait_until(lambda: len(seen) == 2, timeout=15)
                await wait_until(lambda: slot_empty(slot))
            assert sorted(seen) == [("big", big), ("small", MARKER)]
            assert await inbox_rows(outbox) == 2
            # The broker's entries: no plaintext; the claim-checked one only the reference.
            entries = {f[b"id"].decode(): f for _, f in await client.xrange(stream)}
            assert set(entries) == {big_id, small_id}
            for fields in entries.values():
                assert MARKER.encode() not in b"".join(fields.values())
            big_headers = json.loads(entries[big_id][b"headers"])
            assert entries[big_id][b"payload"] == STUB_PAYLOAD.encode()
            assert big_headers[HEADER_CLAIM_CHECK] == big_id
            assert big_headers["encryption-key-id"] == "k1"
            assert len(entries[big_id][b"payload"]) + len(entries[big_id][b"headers"]) < 1024
            small_headers = json.loads(entries[small_id][b"headers"])
            assert HEADER_CLAIM_CHECK not in small_headers
            assert small_headers["encryption-key-id"] == "k1"
            assert isinstance(json.loads(entries[small_id][b"payload"]), str)  # sealed
            # Nothing went through the outbox table.
            assert await outbox.store.messages.count() == 0
        finally:
            await outbox.aclose()


async def test_a_refused_message_keeps_its_reference_and_ciphertext_in_the_table(
    wal_pg_url: str,
) -> None:
    """The WAL relay's refused-row path (``insert_failed``): the failed rows carry the stub,
    the claim-check headers, the key id and the sealed headers as the WAL had them (no
    plaintext), and the table's retry delivers both messages whole."""
    stream = unique("walref")
    refusing = {"on": True}

    def reject(envelope: Envelope) -> BaseException | None:
        if refusing["on"]:
            return exceptions.MessageRejected("refused for the test")
        return None

    broker = MemoryBroker(reject=reject)
    outbox = Outbox(
        wal_pg_url,
        brokers={"default": broker},
        settings=wal_settings(
            stream,
            "database",
            encrypted_headers=["card-holder"],
            retry_base_delay_seconds=0.2,
            retry_max_delay_seconds=0.5,
        ),
    )
    seen: dict[str, tuple[dict[str, Any], dict[str, str]]] = {}

    @outbox.subscriber(stream, group="g", start="all")
    async def handle(message: Message, uow: UnitOfWork) -> None:
        seen[message.type] = (message.payload, message.headers)

    big = MARKER + "x" * BIG
    try:
        await outbox.create_tables()
        async with outbox.relaying():
            async with outbox.unit_of_work() as uow:
                big_id = uow.publish(
                    Message(stream, "Big", {"blob": big}), headers={"card-holder": MARKER}
                )
                small_id = uow.publish(
                    Message(stream, "Small", {"blob": MARKER}), headers={"card-holder": MARKER}
                )

            async def in_the_table() -> bool:
                return "missing" not in await _statuses(outbox, big_id, small_id)

            # Handed to the table (failed, retried by the table's table_relay while refused).
            await wait_until(in_the_table)
            t = outbox.table
            async with outbox.engine.connect() as conn:
                # As the JSON text the table holds.
                result = await conn.execute(
                    select(
                        t.c.id,
                        cast(t.c.payload, Text).label("payload"),
                        cast(t.c.headers, Text).label("headers"),
                    )
                )
                rows = {row.id: row._asdict() for row in result}
            assert set(rows) == {big_id, small_id}
            for row in rows.values():
                assert MARKER not in row["payload"] + row["headers"]
            big_headers = _headers(rows[big_id])
            assert json.loads(rows[big_id]["payload"]) == {}
            assert big_headers[HEADER_CLAIM_CHECK] == str(big_id)
            assert int(big_headers[HEADER_CLAIM_CHECK_SIZE]) > BIG
            small_headers = _headers(rows[small_id])
            assert isinstance(json.loads(rows[small_id]["payload"]), str)  # sealed
            assert HEADER_CLAIM_CHECK not in small_headers
            for headers in (big_headers, small_headers):
                assert headers["encryption-key-id"] == "k1"
                assert "encrypted-headers" in headers and "card-holder" not in headers
            refusing["on"] = False
            await wait_until(lambda: len(seen) == 2, timeout=15)
        assert seen["Big"][0] == {"blob": big} and seen["Small"][0] == {"blob": MARKER}
        for _, headers in seen.values():
            assert headers["card-holder"] == MARKER
            assert HEADER_CLAIM_CHECK not in headers and "encryption-key-id" not in headers
        assert await _statuses(outbox, big_id, small_id) == {"published"}
        assert await inbox_rows(outbox) == 2
        # What the broker finally held: the same stub, reference and ciphertext.
        published = {m.id: m for m in broker.messages}
        assert published[str(big_id)].payload == STUB_PAYLOAD.encode()
        for envelope in published.values():
            assert MARKER.encode() not in envelope.payload
            assert MARKER not in envelope.headers_json
    finally:
        await outbox.aclose()


async def _statuses(outbox: Outbox, *ids: uuid.UUID) -> set[str]:
    rows = [await outbox.store.messages.get(i) for i in ids]
    return {"missing" if row is None else str(row["status"]) for row in rows}


def _headers(row: dict[str, Any]) -> dict[str, str]:
    return dict(json.loads(row["headers"]))

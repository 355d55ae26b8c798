"""Claim-check (``claim_check_bytes``): payloads over the threshold leave the message.

5 MB payloads through Redis (database store, PostgreSQL) and NATS (file store, SQLite; over
NATS's 1 MB max_payload) reach the handler whole, once; a producer's rollback stores nothing
(database) or leaves an orphan retention removes (file: also a crash between the write of
the file and the commit); retention removes payloads past their retention; a payload gone
dead-letters its message with an error naming it.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select, update

from fastapi_outbox import Event, Outbox, OutboxSettings, UnitOfWork
from fastapi_outbox.brokers import Broker
from fastapi_outbox.storage.claim_check import (
    HEADER_CLAIM_CHECK,
    DatabasePayloadStore,
    FilePayloadStore,
)
from tests.conftest import unique, wait_until

pytestmark = pytest.mark.mariadb

MB5 = 5 * 1024 * 1024
SETTINGS: dict[str, Any] = {
    "claim_check_bytes": 64 * 1024,
    "max_payload_bytes": 8 * 1024 * 1024,
    "consumer_claim_idle_seconds": 1.0,
    "consumer_retry_base_delay_seconds": 0.05,
    "consumer_retry_max_delay_seconds": 0.2,
    "consumer_max_attempts": 2,
    "shutdown_timeout_seconds": 3.0,
    "notify": False,
    "poll_interval_seconds": 0.05,
}


class Scan(Event, stream="scans"):
    name: str
    blob: str


@contextlib.asynccontextmanager
async def _broker(kind: str, url: str, streams: list[str]) -> AsyncIterator[Broker]:
    if kind == "redis":
        import redis.asyncio as aioredis

        from fastapi_outbox.brokers import RedisStreamsBroker

        broker: Broker = RedisStreamsBroker(url)
        try:
            yield broker
        finally:
            await broker.aclose()
            client = aioredis.Redis.from_url(url)
            for stream in streams:
                keys = [k async for k in client.scan_iter(match=f"{stream}*")]
                if keys:
                    await client.delete(*keys)
            await client.aclose()
        return
    import nats

    from fastapi_outbox.brokers import NatsJetStreamBroker
    from fastapi_outbox.brokers.nats.wire import stream_name_for

    broker = NatsJetStreamBroker(url)
    try:
        yield broker
    finally:
        await broker.aclose()
        nc = await nats.connect(url)
        js = nc.jetstream()
        names = {stream_name_for(s) for s in streams}
        for info in await js.streams_info():
            if any(info.config.name.startswith(n) for n in names):
                with contextlib.suppress(Exception):
                    await js.delete_stream(info.config.name)
        await nc.close()


def _scan(stream: str) -> type[Scan]:
    """A Scan event on a stream of this test's own."""

    class OwnScan(Scan, stream=stream, type_name="Scan"):
        pass

    return OwnScan


async def _payload_rows(outbox: Outbox) -> int:
    store = outbox.claim_check_store
    assert isinstance(store, DatabasePayloadStore)
    async with outbox.engine.connect() as conn:
        return int((await conn.execute(select(func.count()).select_from(store.table))).scalar())


def _files(store: Any) -> list[str]:
    assert isinstance(store, FilePayloadStore)
    return sorted(p.name for p in store.directory.glob("*.payload"))


async def _published_at(outbox: Outbox, conn: Any, ref: str, when: dt.datetime) -> None:
    """The message ``ref`` names was published at ``when``."""
    t = outbox.table
    await conn.execute(
        update(t)
        .where(t.c.id == uuid.UUID(ref))
        .values(status="published", published_at=when, created_at=when)
    )


async def _rolled_back(outbox: Outbox, blob: str) -> None:
    """A unit of work that writes a claim-checked payload (its flush) then fails."""
    try:
        async with outbox.unit_of_work() as uow:
            uow.publish(Scan(name="rolled back", blob=blob))
            await uow.flush()  # the payload is stored (a row in the transaction, a file)
            raise LookupError("the producer fails")
    except LookupError:
        return
    raise AssertionError("the unit of work did not fail")


@pytest.mark.parametrize("kind", ["redis", "nats"])
async def test_a_5mb_payload_reaches_the_handler_whole_once(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    # Redis with the database store on PostgreSQL; NATS (max_payload 1 MB) with the file
    # store on SQLite.
    url = request.getfixturevalue("redis_url" if kind == "redis" else "nats_url")
    if kind == "redis":
        db, store = request.getfixturevalue("pg_url"), "database"
    else:
        db, store = f"sqlite+aiosqlite:///{tmp_path}/t.db", f"file://{tmp_path}/payloads"
    stream = unique("scans")
    event_cls = _scan(stream)
    big = "x" * MB5
    async with _broker(kind, url, [stream]) as broker:
        outbox = Outbox(
            db,
            brokers={"default": broker},
            settings=OutboxSettings(**SETTINGS, claim_check_store=store),
        )
        seen: list[tuple[str, int]] = []

        @outbox.subscriber(stream, group="scanner", start="all")
        async def handle(event: Scan, uow: UnitOfWork) -> None:
            seen.append((event.name, len(event.blob)))

        @outbox.subscriber(stream, group="refuser", start="all")
        async def refuse(event: Scan, uow: UnitOfWork) -> None:
            if event.name == "big":
                raise ValueError(f"refused {len(event.blob)} bytes")

        await outbox.create_tables()
        refuser = outbox.subscribers[1]
        async with outbox.relaying():
            async with outbox.unit_of_work() as uow:
                big_id = uow.publish(event_cls(name="big", blob=big))
                uow.publish(event_cls(name="small", blob="y"))
            await wait_until(
                lambda: len(seen) == 2 and refuser.stats.dead_lettered == 1, timeout=30
            )
        assert sorted(seen) == [("big", MB5), ("small", 1)]
        assert outbox.subscribers[0].stats.handled == 2
        # The handler saw the whole payload; the dead letter carries the reference (NATS
        # would refuse 5 MB there).
        [letter] = await refuser.make_consumer().dead_letters()
        assert letter.message_id == str(big_id)
        assert f"refused {MB5} bytes" in letter.error
        assert refuser.stats.dead_letter_failures == 0
        # The outbox row and the broker carried a stub and the reference, not 5 MB.
        async with outbox.engine.connect() as conn:
            rows = (await conn.execute(select(outbox.table.c.id, outbox.table.c.payload))).all()
            headers = (
                await conn.execute(
                    select(outbox.table.c.headers).where(outbox.table.c.id == big_id)
                )
            ).scalar_one()
        assert {str(i): len(p) for i, p in rows}[str(big_id)] < 10
        if isinstance(headers, str):
            headers = json.loads(headers)
        assert headers[HEADER_CLAIM_CHECK] == str(big_id)
        if store == "database":
            assert await _payload_rows(outbox) == 1
        else:
            assert _files(outbox.claim_check_store) == [f"{big_id}.payload"]
        await outbox.aclose()


async def test_database_store_rollback_stores_nothing_and_retention_removes(
    db_url: str,
) -> None:
    outbox = Outbox(db_url, brokers={}, settings=OutboxSettings(**SETTINGS))
    await outbox.create_tables()
    big = "x" * 100_000
    await _rolled_back(outbox, big)
    assert await _payload_rows(outbox) == 0
    async with outbox.unit_of_work() as uow:
        uow.publish(Scan(name="old", blob=big))
    async with outbox.unit_of_work() as uow:
        uow.publish(Scan(name="new", blob=big))
    assert await _payload_rows(outbox) == 2
    # The first one stored and published longer ago than the retention (published 7
    # days, inbox 14).
    store = outbox.claim_check_store
    assert isinstance(store, DatabasePayloadStore)
    async with outbox.engine.begin() as conn:
        oldest = (await conn.execute(select(func.min(store.table.c.created_at)))).scalar_one()
        ref = (
            await conn.execute(select(store.table.c.ref).where(store.table.c.created_at == oldest))
        ).scalar_one()
        a_year_ago = oldest.replace(year=oldest.year - 1)
        await conn.execute(
            update(store.table).where(store.table.c.ref == ref).values(created_at=a_year_ago)
        )
        await _published_at(outbox, conn, ref, a_year_ago)
    assert await outbox.cleaner.run_once() >= 1
    assert await _payload_rows(outbox) == 1
    await outbox.aclose()


async def test_file_store_orphans_of_a_rollback_or_a_crash_are_removed(
    sqlite_url: str, tmp_path: Path
) -> None:
    directory = tmp_path / "payloads"
    outbox = Outbox(
        sqlite_url,
        brokers={},
        # One reference per look-up and per DELETE: the live file cannot hide the orphans.
        settings=OutboxSettings(
            **SETTINGS, claim_check_store=f"file://{directory}", cleanup_batch_size=1
        ),
    )
    await outbox.create_tables()
    store = outbox.claim_check_store
    assert isinstance(store, FilePayloadStore)
    big = "x" * 100_000
    # A rollback after the file was written (flush), and a crash between the write of the
    # file and the commit (the capture fails after the store wrote).
    await _rolled_back(outbox, big)
    capture = outbox._producer.capture

    class Crashing:
        def write(self, connection: Any, rows: Any) -> None:
            raise RuntimeError("crash before the commit")

    outbox._producer.capture = Crashing()  # type: ignore[assignment]
    with pytest.raises(RuntimeError, match="crash before the commit"):
        async with outbox.unit_of_work() as uow:
            uow.publish(Scan(name="crashed", blob=big))
    outbox._producer.capture = capture
    async with outbox.unit_of_work() as uow:
        kept = uow.publish(Scan(name="committed", blob=big))
    assert len(_files(store)) == 3
    # Within the grace period nothing goes (a transaction may still be committing).
    await outbox.cleaner.run_once()
    assert len(_files(store)) == 3
    past_grace = time.time() - store.orphan_grace_seconds - 60
    for path in directory.glob("*.payload"):
        os.utime(path, (past_grace, past_grace))
    await outbox.cleaner.run_once()
    assert _files(store) == [f"{kept}.payload"]
    # Past the retention (and its message published as long ago), the committed one
    # goes too.
    long_ago = time.time() - 30 * 86400
    os.utime(directory / f"{kept}.payload", (long_ago, long_ago))
    async with outbox.engine.begin() as conn:
        when = dt.datetime.fromtimestamp(long_ago, dt.UTC)
        await _published_at(outbox, conn, str(kept), when)
    await outbox.cleaner.run_once()
    assert _files(store) == []
    await outbox.aclose()


async def test_a_payload_gone_dead_letters_its_message(redis_url: str, pg_url: str) -> None:
    stream = unique("scans")
    event_cls = _scan(stream)
    async with _broker("redis", redis_url, [stream]) as broker:
        outbox = Outbox(pg_url, brokers={"default": broker}, settings=OutboxSettings(**SETTINGS))
        handled: list[str] = []

        @outbox.subscriber(stream, group="scanner", start="all")
        async def handle(event: Scan, uow: UnitOfWork) -> None:
            handled.append(event.name)

        await outbox.create_tables()
        async with outbox.unit_of_work() as uow:
            gone = uow.publish(event_cls(name="gone", blob="x" * 100_000))
        store = outbox.claim_check_store
        assert isinstance(store, DatabasePayloadStore)
        async with outbox.engine.begin() as conn:
            await conn.execute(store.table.delete())
        sub = outbox.subscribers[0]
        async with outbox.relaying():
            await wait_until(lambda: sub.stats.dead_lettered == 1, timeout=15)
        assert handled == []
        [letter] = await sub.consumer.dead_letters()
        assert letter.message_id == str(gone)
        assert f"message {gone} (reference {gone}) is gone" in letter.error
        await outbox.aclose()


async def test_show_and_the_dashboard_page_display_the_reference_and_the_payload(
    sqlite_url: str,
) -> None:
    from fastapi import FastAPI

    from fastapi_outbox.ops import operations
    from tests.conftest import asgi_client

    outbox = Outbox(
        sqlite_url,
        brokers={},
        settings=OutboxSettings(**{**SETTINGS, "run_relays": False}),
        dashboard_dependencies=[],
    )
    await outbox.create_tables()
    async with outbox.unit_of_work() as uow:
        large = uow.publish(Scan(name="large", blob="L" * 3 * 1024 * 1024))
        medium = uow.publish(Scan(name="medium", blob="M" * 100_000))
    # `fastapi-outbox show` prints operations.show's dict.
    shown = await operations.show(outbox, large)
    assert shown["claim_check"] == f"claim-check: {large} (3.0 MiB)"
    assert shown["headers"][HEADER_CLAIM_CHECK] == str(large)
    assert shown["payload"] is None
    assert shown["payload_preview"].startswith('{"name":"large","blob":"LLL')
    assert len(shown["payload_preview"]) == operations.PAYLOAD_PREVIEW_CHARS
    shown = await operations.show(outbox, medium)
    assert shown["payload"] == {"name": "medium", "blob": "M" * 100_000}  # whole
    app = FastAPI()
    app.include_router(outbox.dashboard_router)
    async with asgi_client(app) as client:
        page = await client.get(f"/outbox/dashboard/messages/{large}")
    assert page.status_code == 200
    assert f"claim-check: {large} (3.0 MiB)" in page.text
    assert "LLLLLLLLLL" in page.text
    # Gone from the store: said so, by show and on the page.
    store = outbox.claim_check_store
    assert isinstance(store, DatabasePayloadStore)
    async with outbox.engine.begin() as conn:
        await conn.execute(store.table.delete())
    shown = await operations.show(outbox, large)
    assert shown["payload"] is None
    assert shown["payload_note"] == (
        f"claim-check: {large} (3.0 MiB): gone from the database store (retention) or never stored"
    )
    async with asgi_client(app) as client:
        page = await client.get(f"/outbox/dashboard/messages/{large}")
    assert "gone from the database store" in page.text
    await outbox.aclose()


async def test_encrypted_then_claim_checked_the_store_holds_ciphertext(sqlite_url: str) -> None:
    from fastapi_outbox.brokers import MemoryBroker

    outbox = Outbox(
        sqlite_url,
        brokers={"default": MemoryBroker()},
        settings=OutboxSettings(**SETTINGS, encryption_keys={"k1": os.urandom(32)}),
    )
    seen: list[str] = []

    @outbox.subscriber("scans", group="scanner", start="all")
    async def handle(event: Scan, uow: UnitOfWork) -> None:
        seen.append(event.blob)

    await outbox.create_tables()
    secret = "SECRET" * 20_000
    async with outbox.relaying():
        async with outbox.unit_of_work() as uow:
            uow.publish(Scan(name="sealed", blob=secret))
        await wait_until(lambda: len(seen) == 1, timeout=10)
    assert seen == [secret]
    store = outbox.claim_check_store
    assert isinstance(store, DatabasePayloadStore)
    async with outbox.engine.connect() as conn:
        [stored] = (await conn.execute(select(store.table.c.data))).scalars().all()
        [payload] = (await conn.execute(select(outbox.table.c.payload))).scalars().all()
    assert b"SECRET" not in stored and len(stored) > 120_000  # the ciphertext, stored
    assert payload == "{}"
    await outbox.aclose()


async def test_the_store_unreachable_is_waited_out_with_no_attempt_charged(pg_url: str) -> None:
    import logging

    from fastapi_outbox.brokers import MemoryBroker
    from tests.servers import TcpProxy

    proxy = TcpProxy(5432)
    await proxy.start()
    outbox = Outbox(
        pg_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}"),
        brokers={"default": MemoryBroker()},
        settings=OutboxSettings(**{**SETTINGS, "consumer_max_attempts": 1}),
    )
    handled: list[int] = []

    @outbox.subscriber("scans", group="scanner", start="all")
    async def handle(event: Scan, uow: UnitOfWork) -> None:
        handled.append(len(event.blob))

    await outbox.create_tables()
    store = outbox.claim_check_store
    assert isinstance(store, DatabasePayloadStore)
    waits: list[str] = []

    class Waits(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if getattr(record, "action", None) == "consumer.db_unavailable":
                waits.append(record.getMessage())

    get = store.get

    async def get_in_an_outage(ref: str) -> bytes | None:
        # The database goes away just when the subscriber fetches the payload.
        if not waits:
            await proxy.stop()
        return await get(ref)

    store.get = get_in_an_outage  # type: ignore[method-assign]
    watcher = Waits()
    logging.getLogger("fastapi_outbox.consume").addHandler(watcher)
    try:
        async with outbox.unit_of_work() as uow:
            uow.publish(Scan(name="big", blob="x" * 100_000))
        async with outbox.relaying():
            await wait_until(lambda: len(waits) >= 2, timeout=15)
            assert handled == []
            await proxy.start()  # back
            await wait_until(lambda: handled == [100_000], timeout=20)
    finally:
        logging.getLogger("fastapi_outbox.consume").removeHandler(watcher)
        await outbox.aclose()
        await proxy.stop()
    stats = outbox.subscribers[0].stats
    assert (stats.failures, stats.dead_lettered, stats.handled) == (0, 0, 1)
    assert "retrying the payload's restoring in place" in waits[0]


DAY = 86400.0


async def _days_pass(outbox: Outbox, days: float) -> None:
    """``days`` pass for the outbox's messages and payloads: every time they carry moves
    that far back (the database's clock and the file system's cannot be moved)."""
    back = dt.timedelta(days=days)
    t = outbox.table
    async with outbox.engine.begin() as conn:
        rows = (await conn.execute(select(t.c.id, t.c.created_at, t.c.next_attempt_at))).all()
        for id_, created, due in rows:
            await conn.execute(
                update(t)
                .where(t.c.id == id_)
                .values(created_at=created - back, next_attempt_at=due - back)
            )
        store = outbox.claim_check_store
        if isinstance(store, DatabasePayloadStore):
            p = store.table
            for ref, created in (await conn.execute(select(p.c.ref, p.c.created_at))).all():
                await conn.execute(
                    update(p).where(p.c.ref == ref).values(created_at=created - back)
                )
    if isinstance(store, FilePayloadStore):
        for path in store.directory.glob("*.payload"):
            mtime = path.stat().st_mtime - days * DAY
            os.utime(path, (mtime, mtime))


@pytest.mark.parametrize("where", ["database", "file"])
async def test_a_message_delayed_past_the_payload_retention_is_published_whole(
    db_url: str, tmp_path: Path, where: str
) -> None:
    """Payloads are kept 14 days by default (the inbox's retention) and ``publish(delay=…)``
    allows 30: a message delayed 15 days keeps its payload through retention runs until
    it is published, and its handler gets it whole (it was published as a stub and
    dead-lettered, "payload is gone", when the payload was dated from the commit)."""
    from fastapi_outbox.brokers import MemoryBroker

    store_url = "database" if where == "database" else f"file://{tmp_path}/payloads"
    outbox = Outbox(
        db_url,
        brokers={"default": MemoryBroker()},
        settings=OutboxSettings(**SETTINGS, claim_check_store=store_url),
    )
    stream = unique("scans")
    own_scan = _scan(stream)
    got: list[int] = []

    @outbox.subscriber(stream, group="g", start="all")
    async def handle(event: Scan, uow: UnitOfWork) -> None:  # own_scan declares the stream
        got.append(len(event.blob))

    await outbox.create_tables()
    big = "x" * 100_000
    async with outbox.unit_of_work() as uow:
        uow.publish(own_scan(name="later", blob=big), delay=15 * DAY)
    await _days_pass(outbox, 14.5)
    await outbox.cleaner.run_once()  # half a day before it is due
    await _days_pass(outbox, 0.5)
    await outbox.cleaner.run_once()  # due now, not published yet
    try:
        async with outbox.relaying():
            await wait_until(lambda: len(got) >= 1, timeout=10)
    finally:
        await outbox.aclose()
    assert got == [len(big)]


async def test_an_abandoned_message_keeps_its_payload_until_its_row_goes(
    db_url: str,
) -> None:
    """An abandoned message can be replayed while its row is there (30 days by default):
    its payload stays that long, past the payloads' own retention, and goes with the row."""
    outbox = Outbox(db_url, brokers={}, settings=OutboxSettings(**SETTINGS))
    await outbox.create_tables()
    async with outbox.unit_of_work() as uow:
        uow.publish(Scan(name="abandoned", blob="x" * 100_000))
    t = outbox.table
    async with outbox.engine.begin() as conn:
        now = (await conn.execute(select(t.c.created_at))).scalar_one()
        await conn.execute(update(t).values(status="abandoned", abandoned_at=now))
    await _days_pass(outbox, 20)  # the payload past its 14 days; the row abandoned now
    await outbox.cleaner.run_once()
    assert await _payload_rows(outbox) == 1
    async with outbox.engine.begin() as conn:  # the row past the abandoned retention
        await conn.execute(update(t).values(abandoned_at=now - dt.timedelta(days=31)))
    await outbox.cleaner.run_once()
    assert await _payload_rows(outbox) == 0
    await outbox.aclose()

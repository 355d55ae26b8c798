"""A producer's transaction sends its INSERT and its COMMIT, nothing else — counted on the
wire.

The database is reached through a :class:`~tests.servers.WireTap`, which records every
round trip each client connection makes. Once the pool and the prepared statements are
warm, a one-event ``unit_of_work()`` must make exactly the round trips of the same INSERT
through a bare ``AsyncSession`` (BEGIN, INSERT, COMMIT) on the one connection it checks
out; the wake-up of other processes rides the COMMIT's round trip (run after the commit)
and is received by a LISTEN connection. A change that adds a statement or a round trip,
or a second connection, fails here.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any

import asyncpg
import httpx
import pytest
from fastapi import Depends, FastAPI
from sqlalchemy.engine import make_url

from fastapi_outbox import Outbox, OutboxSettings, UnitOfWork, unit_of_work
from fastapi_outbox.brokers import MemoryBroker
from fastapi_outbox.events import Message
from fastapi_outbox.storage.statements.inserts import insert_rows
from tests.conftest import wait_until
from tests.servers import WireTap

pytestmark = pytest.mark.postgres(
    reason="counts round trips of asyncpg's fast path (hot statements on the driver) and the NOTIFY"
)

#: One pooled connection, used over and over: warmed once, its prepared statements cached
#: (one more may overflow when something else holds it; it is not kept).
ONE = {"pool_size": 1, "max_overflow": 1}


@pytest.fixture
async def tap(pg_url: str) -> AsyncIterator[tuple[WireTap, str]]:
    url = make_url(pg_url)
    proxy = WireTap(url.port or 5432)
    await proxy.start()
    try:
        tapped = url.set(host="127.0.0.1", port=proxy.port)
        yield proxy, tapped.render_as_string(hide_password=False)
    finally:
        await proxy.stop()


def shape(trip: str) -> str:
    """The statement's first word(s): what the round trip does."""
    words = trip.split()
    if words[:2] == ["INSERT", "INTO"]:
        return f"INSERT INTO {words[2]}"
    return " ".join(words[:1]).rstrip(";")


async def listen(pg_url: str, channel: str) -> tuple[asyncpg.Connection, list[str]]:
    received: list[str] = []
    conn = await asyncpg.connect(pg_url.replace("postgresql+asyncpg://", "postgresql://"))
    await conn.add_listener(channel, lambda _c, _pid, _ch, payload: received.append(payload))
    return conn, received


async def test_a_unit_of_work_sends_the_insert_and_the_commit_nothing_else(
    pg_url: str, tap: tuple[WireTap, str]
) -> None:
    proxy, url = tap
    # A script without a lifespan: no relay here, so other processes must be woken.
    outbox = Outbox(
        url, brokers={"default": MemoryBroker()}, settings=OutboxSettings(), engine_options=ONE
    )
    await outbox.create_tables()
    listener, received = await listen(pg_url, outbox.channel)
    try:

        async def one(n: int) -> None:
            async with outbox.unit_of_work() as uow:
                uow.publish(Message("orders", "OrderPlaced", {"n": n}))

        async def bare(n: int) -> None:
            params = outbox.store.inserts.row_params(
                [
                    {
                        "id": uuid.uuid4(),
                        "broker": "default",
                        "stream": "orders",
                        "type": "OrderPlaced",
                        "key": None,
                        "payload": f'{{"n":{n}}}',
                        "headers": "{}",
                        "delay": dt.timedelta(0),
                    }
                ]
            )
            async with outbox.session_factory() as session:
                await session.execute(insert_rows(outbox.table, outbox.engine.dialect), params)
                await session.commit()

        for n in range(3):  # warm: the pool's connection, the prepared INSERTs
            await one(n)
            await bare(n)
        await wait_until(lambda: len(received) >= 3, timeout=5)

        mark = proxy.mark()
        await bare(10)
        bare_trips = proxy.since(mark)

        mark, before = proxy.mark(), len(received)
        await one(11)
        library_trips = proxy.since(mark)

        assert [[shape(t) for t in trips] for trips in bare_trips] == [
            ["BEGIN", "INSERT INTO outbox_messages", "COMMIT"]
        ]
        # One connection, three round trips: BEGIN, the INSERT, the COMMIT — which also
        # carries the wake-up, run after the commit in the same round trip.
        assert [[shape(t) for t in trips] for trips in library_trips] == [
            ["BEGIN", "INSERT INTO outbox_messages", "COMMIT"]
        ]
        commit = library_trips[0][2]
        assert "pg_notify" in commit and commit.startswith("COMMIT;")
        await wait_until(lambda: len(received) > before, timeout=5)
        assert received[-1] == outbox.instance
    finally:
        await listener.close()
        await outbox.aclose()


async def test_the_request_dependency_sends_the_insert_and_the_commit_nothing_else(
    tap: tuple[WireTap, str],
) -> None:
    proxy, url = tap
    outbox = Outbox(
        url,
        brokers={"default": MemoryBroker()},
        settings=OutboxSettings(run_relays=False),
        engine_options=ONE,
    )
    await outbox.create_tables()
    app = FastAPI(lifespan=outbox.lifespan)

    @app.post("/orders", status_code=201)
    async def place(uow: Annotated[UnitOfWork, Depends(unit_of_work)]) -> dict[str, Any]:
        uow.publish(Message("orders", "OrderPlaced", {"n": 1}))
        return {}

    try:
        async with (
            outbox.lifespan(app),
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://test"
            ) as client,
        ):
            for _ in range(3):
                assert (await client.post("/orders")).status_code == 201
            mark = proxy.mark()
            # Two requests: a wake-up sent off the request's path (a NOTIFY sender of the
            # lifespan's, on a connection of its own) after the first would show by the end
            # of the second.
            for _ in range(2):
                assert (await client.post("/orders")).status_code == 201
            trips = proxy.since(mark)
        assert [[shape(t) for t in conn] for conn in trips] == [
            ["BEGIN", "INSERT INTO outbox_messages", "COMMIT"] * 2
        ]
        assert all("pg_notify" in conn[2] and "pg_notify" in conn[5] for conn in trips)
    finally:
        await outbox.aclose()

"""The operator dashboard over HTTP: guard, CSRF, actions through the shared operations,
keyset pages, filters, and what it refuses. (tests/browser drives it in Chromium.)"""

from __future__ import annotations

import base64
import datetime as dt
import logging
import re
import secrets
import uuid
from typing import Annotated, Any

import httpx
import pytest
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.security import HTTPBasic, HTTPBasicCredentials
from sqlalchemy import update

from fastapi_outbox import ConfigurationError, Message, Outbox, OutboxSettings
from fastapi_outbox.brokers import MemoryBroker
from fastapi_outbox.ops.dashboard import CSRF_COOKIE, CSRF_HEADER
from tests.conftest import asgi_client, unique

pytestmark = pytest.mark.mariadb

MARKER = "PAYLOAD-MARKER-5c1a"
basic = HTTPBasic()


def require_admin(
    request: Request, credentials: Annotated[HTTPBasicCredentials, Depends(basic)]
) -> None:
    ok = secrets.compare_digest(credentials.username, "admin") and secrets.compare_digest(
        credentials.password, "s3cret"
    )
    if not ok:
        raise HTTPException(401, "bad credentials", headers={"WWW-Authenticate": "Basic"})
    request.state.outbox_operator = credentials.username


AUTH = {"Authorization": "Basic " + base64.b64encode(b"admin:s3cret").decode()}


def make_outbox(db_url: str, **kw: Any) -> Outbox:
    settings = kw.pop("settings", OutboxSettings(run_relays=False))
    return Outbox(db_url, brokers={"default": MemoryBroker()}, settings=settings, **kw)


def app_for(outbox: Outbox) -> FastAPI:
    app = FastAPI()
    app.include_router(outbox.router)
    app.include_router(outbox.dashboard_router)
    return app


async def csrf(client: httpx.AsyncClient, **kw: Any) -> dict[str, str]:
    """Load a page (which sets the token cookie) and return the action headers."""
    page = await client.get("/outbox/dashboard", **kw)
    assert page.status_code == 200
    token = re.search(r'name="outbox-csrf" content="([^"]+)"', page.text)
    assert token is not None
    assert client.cookies.get(CSRF_COOKIE) == token.group(1)
    return {CSRF_HEADER: token.group(1), **kw.get("headers", {})}


async def publish(outbox: Outbox, stream: str, n: int, **kw: Any) -> list[uuid.UUID]:
    async with outbox.unit_of_work() as uow:
        return [
            uow.publish(
                Message(stream, kw.get("type", "Thing"), {"n": i, "m": MARKER}), key=kw.get("key")
            )
            for i in range(n)
        ]


async def set_status(outbox: Outbox, ids: list[uuid.UUID], status: str) -> None:
    t = outbox.table
    async with outbox.engine.begin() as conn:
        await conn.execute(
            update(t).where(t.c.id.in_(ids)).values(status=status, last_error="refused")
        )


def test_an_unguarded_dashboard_is_refused_unless_asked_for(sqlite_url: str) -> None:
    outbox = make_outbox(sqlite_url)
    with pytest.raises(ConfigurationError, match="dashboard_dependencies"):
        FastAPI().include_router(outbox.dashboard_router)
    open_on_purpose = make_outbox(sqlite_url, dashboard_dependencies=[])
    FastAPI().include_router(open_on_purpose.dashboard_router)


async def test_the_guard_protects_every_page_and_action(db_url: str, caplog: Any) -> None:
    outbox = make_outbox(db_url, dashboard_dependencies=[Depends(require_admin)])
    await outbox.create_tables()
    stream = unique("orders")
    ids = await publish(outbox, stream, 2)
    await set_status(outbox, ids, "abandoned")
    try:
        async with asgi_client(app_for(outbox)) as client:
            for path in (
                "",
                "/messages",
                f"/messages/{ids[0]}",
                "/fragments/overview",
                "/api/overview",
                "/static/dashboard.css",
            ):
                assert (await client.get(f"/outbox/dashboard{path}")).status_code == 401, path
            for action in ("replay", "abandon"):
                response = await client.post(
                    f"/outbox/dashboard/api/{action}", json={"ids": [str(ids[0])]}
                )
                assert response.status_code == 401
            assert await outbox.store.messages.count("abandoned") == 2  # nothing changed

            headers = await csrf(client, headers=AUTH)
            with caplog.at_level(logging.INFO, logger="fastapi_outbox"):
                response = await client.post(
                    "/outbox/dashboard/api/replay", json={"ids": [str(ids[0])]}, headers=headers
                )
            assert response.status_code == 200, response.text
            assert response.json() == {"changed": 1, "problems": []}
            assert await outbox.store.messages.count("abandoned") == 1
            record = next(
                r for r in caplog.records if getattr(r, "action", "") == "operator.replay"
            )
            assert record.operator == "admin"
            assert all(
                MARKER not in r.getMessage() and MARKER not in str(r.__dict__)
                for r in caplog.records
            )
    finally:
        await outbox.aclose()


async def test_actions_need_the_csrf_token_and_a_json_body(db_url: str) -> None:
    outbox = make_outbox(db_url, dashboard_dependencies=[])
    await outbox.create_tables()
    ids = await publish(outbox, unique("orders"), 1)
    await set_status(outbox, ids, "abandoned")
    try:
        async with asgi_client(app_for(outbox)) as client:
            body = {"ids": [str(ids[0])]}
            # No token at all, then a cookie without the header (a cross-site form post).
            assert (await client.post("/outbox/dashboard/api/replay", json=body)).status_code == 403
            headers = await csrf(client)
            no_header = await client.post("/outbox/dashboard/api/replay", json=body)
            assert no_header.status_code == 403
            assert CSRF_HEADER in no_header.json()["detail"]
            wrong = await client.post(
                "/outbox/dashboard/api/replay", json=body, headers={CSRF_HEADER: "nope"}
            )
            assert wrong.status_code == 403
            form = await client.post(
                "/outbox/dashboard/api/replay",
                content=f"ids={ids[0]}",
                headers={**headers, "content-type": "application/x-www-form-urlencoded"},
            )
            assert form.status_code == 415
            assert await outbox.store.messages.count("abandoned") == 1
            ok = await client.post("/outbox/dashboard/api/replay", json=body, headers=headers)
            assert ok.json()["changed"] == 1
    finally:
        await outbox.aclose()


async def test_replay_and_abandon_report_what_they_changed(db_url: str) -> None:
    outbox = make_outbox(db_url, dashboard_dependencies=[])
    await outbox.create_tables()
    stream, other = unique("orders"), unique("other")
    dead = await publish(outbox, stream, 3)
    elsewhere = await publish(outbox, other, 2)
    pending = await publish(outbox, stream, 2)
    await set_status(outbox, dead + elsewhere, "abandoned")
    try:
        async with asgi_client(app_for(outbox)) as client:
            headers = await csrf(client)
            unknown = uuid.uuid4()
            response = await client.post(
                "/outbox/dashboard/api/replay",
                json={"ids": [str(dead[0]), str(pending[0]), str(unknown)]},
                headers=headers,
            )
            body = response.json()
            assert body["changed"] == 1
            assert any(f"{pending[0]} is pending" in p for p in body["problems"])
            assert any(f"no outbox message with id {unknown}" in p for p in body["problems"])

            # The confirmation shows the count, and the button carries it.
            page = (await client.get("/outbox/dashboard")).text
            assert f"Replay all 2 abandoned message(s) of {stream}?" in page
            assert 'data-count="2"' in page
            # Every abandoned message of one stream, and only that stream: at most the
            # count the operator confirmed, which the request must carry.
            uncounted = await client.post(
                "/outbox/dashboard/api/replay",
                json={"all_abandoned": True, "stream": stream},
                headers=headers,
            )
            assert uncounted.status_code == 400 and "count" in uncounted.text
            response = await client.post(
                "/outbox/dashboard/api/replay",
                json={"all_abandoned": True, "stream": stream, "count": 1},
                headers=headers,
            )
            assert response.json() == {"changed": 1, "problems": []}
            response = await client.post(
                "/outbox/dashboard/api/replay",
                json={"all_abandoned": True, "stream": stream, "count": 5},
                headers=headers,
            )
            assert response.json() == {"changed": 1, "problems": []}
            assert await outbox.store.messages.count_matching("abandoned", stream=other) == 2

            response = await client.post(
                "/outbox/dashboard/api/abandon",
                json={"ids": [str(i) for i in pending], "reason": "customer withdrew"},
                headers=headers,
            )
            assert response.json() == {"changed": 2, "problems": []}
            row = await outbox.store.messages.get(pending[0])
            assert row is not None and row["status"] == "abandoned"
            assert "customer withdrew" in row["last_error"]

            bad = await client.post(
                "/outbox/dashboard/api/abandon", json={"ids": ["not-a-uuid"]}, headers=headers
            )
            assert bad.status_code == 422
    finally:
        await outbox.aclose()


async def test_messages_filter_and_page_by_keyset(db_url: str) -> None:
    outbox = make_outbox(db_url, dashboard_dependencies=[])
    await outbox.create_tables()
    stream = unique("orders")
    ids = await publish(outbox, stream, 7, type="OrderPlaced", key="acct-1")
    await publish(outbox, stream, 2, type="OrderCancelled", key="acct-2")
    try:
        async with asgi_client(app_for(outbox)) as client:
            seen: list[str] = []
            url: str | None = f"/outbox/dashboard/messages?stream={stream}&type=OrderPlaced&limit=3"
            for _ in range(5):
                assert url is not None
                page = await client.get(url)
                assert page.status_code == 200
                found = re.findall(r'name="id" value="([0-9a-f-]+)"', page.text)
                seen += found
                more = re.search(r'id="next-page" href="([^"]+)"', page.text)
                url = more.group(1).replace("&amp;", "&") if more else None
                if url is None:
                    break
            assert seen == [str(i) for i in reversed(ids)]  # newest first, no repeats
            by_key = await client.get(f"/outbox/dashboard/messages?stream={stream}&key=acct-2")
            assert len(re.findall(r'name="id" value=', by_key.text)) == 2
            future = (dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M")
            none = await client.get(f"/outbox/dashboard/messages?stream={stream}&since={future}")
            assert "No message matches" in none.text
            bad = await client.get("/outbox/dashboard/messages?status=lost")
            assert bad.status_code == 400 and "status" in bad.json()["detail"]
            bad = await client.get("/outbox/dashboard/messages?since=yesterday")
            assert bad.status_code == 400 and "since" in bad.json()["detail"]
            missing = await client.get(f"/outbox/dashboard/messages/{uuid.uuid4()}")
            assert missing.status_code == 404
    finally:
        await outbox.aclose()


async def test_payloads_can_be_kept_off_the_dashboard(db_url: str) -> None:
    outbox = make_outbox(
        db_url,
        settings=OutboxSettings(run_relays=False, dashboard_show_payloads=False),
        dashboard_dependencies=[],
    )
    await outbox.create_tables()
    (mid,) = await publish(outbox, unique("orders"), 1)
    try:
        async with asgi_client(app_for(outbox)) as client:
            page = await client.get(f"/outbox/dashboard/messages/{mid}")
            assert page.status_code == 200
            assert MARKER not in page.text
            assert "dashboard_show_payloads=False" in page.text
    finally:
        await outbox.aclose()


async def test_overview_counts_streams_and_the_last_hour(db_url: str) -> None:
    outbox = make_outbox(db_url, dashboard_dependencies=[])
    await outbox.create_tables()
    stream = unique("orders")
    ids = await publish(outbox, stream, 5)
    await set_status(outbox, ids[:1], "abandoned")
    async with outbox.unit_of_work() as uow:  # a delayed message: scheduled, also pending
        uow.publish(Message(stream, "Later", {"n": 0}), delay=dt.timedelta(hours=1))
    t = outbox.table
    async with outbox.engine.begin() as conn:
        await conn.execute(
            update(t)
            .where(t.c.id.in_(ids[1:3]))
            .values(status="published", published_at=dt.datetime.now(dt.UTC))
        )
    try:
        async with asgi_client(app_for(outbox)) as client:
            data = (await client.get("/outbox/dashboard/api/overview")).json()
            (s,) = [s for s in data["streams"] if s["stream"] == stream]
            assert (s["pending"], s["scheduled"], s["abandoned"]) == (3, 1, 1)
            page = await client.get("/outbox/dashboard/fragments/overview")
            assert f"status=scheduled&amp;stream={stream}" in page.text
            assert len(data["published_per_minute"]) == 60
            assert sum(p["count"] for p in data["published_per_minute"]) == 2
            assert data["database_ok"] is True
    finally:
        await outbox.aclose()


async def test_consumers_table_shows_the_lag_of_each_kafka_partition(
    pg_url: str, kafka_url: str
) -> None:
    from fastapi_outbox.brokers import KafkaBroker
    from tests.integration.consume.test_consumer_contract import _kafka

    async with _kafka(kafka_url, pg_url) as h:
        stream = h.stream()
        outbox = Outbox(
            pg_url,
            brokers={"default": KafkaBroker(kafka_url)},
            settings=OutboxSettings(run_relays=False),
            dashboard_dependencies=[],
        )

        @outbox.subscriber(stream, group="billing")
        async def bill(message: Message) -> None:
            pass

        await outbox.create_tables()  # the group exists: lag counts from here
        for n in range(2):  # both on partition 0 (the harness's producer)
            await h.inject(stream, f"m-{n}", "OrderPlaced", {"n": n}, {})
        try:
            async with asgi_client(app_for(outbox)) as client:
                page = await client.get("/outbox/dashboard/fragments/overview")
            assert page.status_code == 200
            assert "p0&nbsp;2 · p1&nbsp;0 · p2&nbsp;0" in page.text, page.text
        finally:
            await outbox.aclose()

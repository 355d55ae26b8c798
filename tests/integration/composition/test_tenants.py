"""Multi-tenant outboxes on SQLite tenant databases: each tenant's rows, messages and inbox
entries stay in its own database; one relay serves every tenant."""

import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any

import httpx
import pytest
from fastapi import Depends, FastAPI, Header
from sqlalchemy import Column, Integer, MetaData, String, Table, insert, select, text

from fastapi_outbox import Message, Outbox, OutboxSettings, UnitOfWork, unit_of_work
from fastapi_outbox.brokers import MemoryBroker
from fastapi_outbox.brokers.consumer import DEAD_LETTER_ERROR
from fastapi_outbox.events import Envelope, uuid7
from fastapi_outbox.exceptions import UnknownTenant
from fastapi_outbox.ops.dashboard import CSRF_COOKIE, CSRF_HEADER
from tests.conftest import wait_until

metadata = MetaData()
orders = Table("orders", metadata, Column("id", Integer, primary_key=True), Column("who", String))


def tenant_urls(tmp_path: Path, *names: str) -> dict[str, str]:
    return {name: f"sqlite+aiosqlite:///{tmp_path}/{name}.db" for name in names}


async def make(tenants: Any, **settings: Any) -> tuple[Outbox, MemoryBroker]:
    broker = MemoryBroker()
    outbox = Outbox(
        tenants=tenants,
        brokers={"default": broker},
        settings=OutboxSettings(poll_interval_seconds=0.1, **settings),
        tenant_dependency=tenant_header,
    )
    await outbox.create_tables()
    for name in outbox.tenants.names if outbox.tenants else []:
        async with outbox.tenant_outbox(name).engine.begin() as conn:
            await conn.run_sync(metadata.create_all)
    return outbox, broker


def tenant_header(x_tenant: Annotated[str, Header()]) -> str:
    return x_tenant


@pytest.fixture
async def two(tmp_path: Path) -> AsyncIterator[tuple[Outbox, MemoryBroker]]:
    outbox, broker = await make(tenant_urls(tmp_path, "acme", "globex"))
    try:
        yield outbox, broker
    finally:
        await outbox.aclose()


async def order_rows(outbox: Outbox, tenant: str) -> list[str]:
    async with outbox.tenant_outbox(tenant).engine.connect() as conn:
        return [r.who for r in await conn.execute(select(orders.c.who))]


async def test_a_request_commits_in_its_tenants_database(
    two: tuple[Outbox, MemoryBroker],
) -> None:
    outbox, broker = two
    app = FastAPI(lifespan=outbox.lifespan)

    @app.post("/orders/{who}")
    async def place(who: str, uow: Annotated[UnitOfWork, Depends(unit_of_work)]) -> None:
        await uow.session.execute(insert(orders).values(who=who))
        uow.publish(Message("orders", "OrderPlaced", {"who": who}))

    @app.post("/bound/{who}")
    async def bound(who: str, uow: Annotated[UnitOfWork, Depends(outbox.dependency)]) -> None:
        await uow.session.execute(insert(orders).values(who=who))
        uow.publish(Message("orders", "OrderPlaced", {"who": who}))

    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c,
    ):
        assert (await c.post("/orders/a1", headers={"x-tenant": "acme"})).status_code == 200
        r = await c.post("/bound/g1", headers={"x-tenant": "globex"})
        assert r.status_code == 200, r.text
        refused = await c.post("/orders/x", headers={"x-tenant": "initech"})
        assert refused.status_code == 404
        assert "unknown tenant 'initech'" in refused.text
        sent = await broker.wait_for(2)
    assert await order_rows(outbox, "acme") == ["a1"]
    assert await order_rows(outbox, "globex") == ["g1"]
    assert sorted((m.headers["tenant"], m.payload) for m in sent) == [
        ("acme", b'{"who":"a1"}'),
        ("globex", b'{"who":"g1"}'),
    ]
    for tenant in ("acme", "globex"):
        assert await outbox.tenant_outbox(tenant).store.messages.count("published") == 1


async def test_scripts_name_the_tenant_and_an_unknown_one_writes_nothing(
    two: tuple[Outbox, MemoryBroker],
) -> None:
    outbox, broker = two
    async with outbox.unit_of_work(tenant="acme") as uow:
        uow.publish(Message("orders", "OrderPlaced", {"n": 1}))
    with pytest.raises(UnknownTenant, match="unknown tenant 'nope'"):
        async with outbox.unit_of_work(tenant="nope") as uow:
            uow.publish(Message("orders", "OrderPlaced", {"n": 2}))
    with pytest.raises(UnknownTenant, match="name one"):
        async with outbox.unit_of_work() as uow:
            pass
    assert await outbox.tenant_outbox("acme").store.messages.count() == 1
    assert await outbox.tenant_outbox("globex").store.messages.count() == 0
    async with outbox.relaying():
        sent = await broker.wait_for(1)
    assert [m.headers["tenant"] for m in sent] == ["acme"]
    assert await outbox.tenant_outbox("acme").store.messages.count("published") == 1
    async with outbox.unit_of_work(tenant="globex") as uow:
        uow.publish(Message("orders", "OrderPlaced", {"n": 3}))
    async with outbox.relaying():  # a second run relays again
        sent = await broker.wait_for(2)
    assert [m.headers["tenant"] for m in sent] == ["acme", "globex"]


async def test_one_relay_drains_every_tenant(tmp_path: Path) -> None:
    names = [f"t{i}" for i in range(6)]
    outbox, broker = await make(tenant_urls(tmp_path, *names), tenant_connection_budget=2)
    try:
        for name in names:
            async with outbox.unit_of_work(tenant=name) as uow:
                for n in range(30):
                    uow.publish(Message("orders", "OrderPlaced", {"n": n}))
        async with outbox.relaying():
            sent = await broker.wait_for(180)
            assert len(outbox.lifecycle.relays.tenants.relay.turns) == 6
        assert sorted({m.headers["tenant"] for m in sent}) == names
        assert len({m.id for m in sent}) == 180
    finally:
        await outbox.aclose()


async def test_a_tenant_added_at_runtime_is_relayed_within_one_refresh(tmp_path: Path) -> None:
    urls = tenant_urls(tmp_path, "acme", "late")
    current = {"acme": urls["acme"]}

    async def read_tenants() -> dict[str, str]:
        return dict(current)

    outbox, broker = await make(read_tenants, tenant_refresh_seconds=0.3)
    try:
        late = Outbox(urls["late"], brokers={"default": MemoryBroker()})
        await late.create_tables()  # the tenant's database exists before it is declared
        await late.aclose()
        async with outbox.relaying():
            current["late"] = urls["late"]
            await wait_until(lambda: "late" in outbox.tenants.names if outbox.tenants else False)
            async with outbox.unit_of_work(tenant="late") as uow:
                uow.publish(Message("orders", "OrderPlaced", {"n": 1}))
            (sent,) = await broker.wait_for(1, timeout=2)
            assert sent.headers["tenant"] == "late"
            del current["acme"]
            await wait_until(lambda: outbox.tenants.names == ["late"] if outbox.tenants else False)
            with pytest.raises(UnknownTenant):
                async with outbox.unit_of_work(tenant="acme"):
                    pass
    finally:
        await outbox.aclose()


async def test_a_subscriber_handles_each_message_in_its_tenants_database(
    two: tuple[Outbox, MemoryBroker],
) -> None:
    outbox, broker = two
    handled: list[tuple[str, int]] = []

    @outbox.subscriber("orders", group="billing", start="all")
    async def bill(event: Message, uow: UnitOfWork) -> None:
        await uow.session.execute(insert(orders).values(who=f"billed-{event.payload['n']}"))
        async with outbox.unit_of_work() as inner:  # joins the handler: the message's tenant
            inner.publish(Message("invoices", "Invoiced", {"n": event.payload["n"]}))
        handled.append((event.headers["tenant"], event.payload["n"]))

    await outbox.create_tables()
    for tenant, n in (("acme", 1), ("globex", 2), ("acme", 3)):
        async with outbox.unit_of_work(tenant=tenant) as uow:
            uow.publish(Message("orders", "OrderPlaced", {"n": n}))
    await broker.publish(
        [Envelope(str(uuid7()), "orders", "OrderPlaced", None, b'{"n":9}', {"tenant": "nope"})]
    )
    async with outbox.relaying():
        await wait_until(lambda: len(handled) == 3)
        await wait_until(lambda: len(broker.on_stream("orders.billing.dlq")) == 1)
        await broker.wait_for(3 + 1 + 1 + 3)  # orders, the injected one, its dead letter, invoices
    (dead,) = broker.on_stream("orders.billing.dlq")
    assert dead.headers["tenant"] == "nope"
    assert "unknown tenant 'nope'" in dead.headers[DEAD_LETTER_ERROR]
    assert sorted(handled) == [("acme", 1), ("acme", 3), ("globex", 2)]
    assert sorted(await order_rows(outbox, "acme")) == ["billed-1", "billed-3"]
    assert await order_rows(outbox, "globex") == ["billed-2"]
    invoices = broker.on_stream("invoices")
    assert sorted((m.headers["tenant"], m.payload) for m in invoices) == [
        ("acme", b'{"n":1}'),
        ("acme", b'{"n":3}'),
        ("globex", b'{"n":2}'),
    ]
    for tenant, count in (("acme", 2), ("globex", 1)):
        inbox = outbox.tenant_outbox(tenant).inbox
        async with inbox.engine.connect() as conn:
            rows = (await conn.execute(select(inbox.table))).all()
        assert len(rows) == count


async def test_the_dashboard_shows_and_acts_on_the_selected_tenant_only(
    two: tuple[Outbox, MemoryBroker],
) -> None:
    outbox, _ = two
    outbox.dashboard_dependencies = []
    ids = {}
    for tenant in ("acme", "globex"):
        async with outbox.unit_of_work(tenant=tenant) as uow:
            ids[tenant] = uow.publish(Message("orders", "OrderPlaced", {"t": tenant}))
        await outbox.tenant_outbox(tenant).store.messages.abandon_unclaimed([ids[tenant]], "test")
    app = FastAPI()
    app.include_router(outbox.dashboard_router)
    base = "/outbox/dashboard"
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        index = await c.get(base)
        assert index.status_code == 200
        assert f'href="{base}/t/acme"' in index.text and f'href="{base}/t/globex"' in index.text
        page = await c.get(f"{base}/t/acme/messages")
        assert page.status_code == 200
        assert str(ids["acme"]) in page.text and str(ids["globex"]) not in page.text
        assert f'href="{base}/t/globex"' in page.text  # the selector
        assert (await c.get(f"{base}/t/globex/messages/{ids['acme']}")).status_code == 404
        assert (await c.get(f"{base}/t/initech/messages")).status_code == 404
        token = re.search(r'name="outbox-csrf" content="([^"]+)"', page.text)
        assert token is not None
        headers = {CSRF_HEADER: token.group(1)}
        c.cookies.set(CSRF_COOKIE, token.group(1), path=f"{base}/t/globex")
        replay = f"{base}/t/globex/api/replay"
        other = await c.post(replay, json={"ids": [str(ids["acme"])]}, headers=headers)
        assert other.status_code == 200 and other.json()["changed"] == 0
        own = await c.post(replay, json={"ids": [str(ids["globex"])]}, headers=headers)
        assert own.status_code == 200 and own.json()["changed"] == 1
    assert await outbox.tenant_outbox("acme").store.messages.count("abandoned") == 1
    assert await outbox.tenant_outbox("globex").store.messages.count("pending") == 1


async def test_a_schema_per_tenant_keeps_each_tenants_tables_in_its_schema(pg_url: str) -> None:
    broker = MemoryBroker()
    outbox = Outbox(
        pg_url,
        tenants={"acme": "tenant_acme", "globex": "tenant_globex"},
        brokers={"default": broker},
        settings=OutboxSettings(poll_interval_seconds=0.1),
    )
    try:
        await outbox.create_tables()
        for tenant in ("acme", "globex"):
            async with outbox.tenant_outbox(tenant).engine.begin() as conn:
                await conn.run_sync(metadata.create_all)
        async with outbox.unit_of_work(tenant="acme") as uow:
            await uow.session.execute(insert(orders).values(who="a1"))
            uow.publish(Message("orders", "OrderPlaced", {"who": "a1"}))
        async with outbox.relaying():
            (sent,) = await broker.wait_for(1)
        assert sent.headers["tenant"] == "acme"
        assert await order_rows(outbox, "acme") == ["a1"]
        assert await order_rows(outbox, "globex") == []
        assert await outbox.tenant_outbox("globex").store.messages.count() == 0
        async with outbox.tenant_outbox("acme").engine.connect() as conn:
            where = await conn.execute(
                text(
                    "SELECT table_schema FROM information_schema.tables WHERE table_name = 'orders'"
                )
            )
            assert sorted(r[0] for r in where) == ["tenant_acme", "tenant_globex"]
    finally:
        await outbox.aclose()

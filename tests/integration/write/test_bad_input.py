"""Bad input: an error that names the problem, raised where the caller made it, and nothing
committed (checked by counting rows). Credentials never show in errors, reprs or logs."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import Integer, func, select
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from fastapi_outbox import (
    AggregateRoot,
    ConfigurationError,
    Event,
    Message,
    Outbox,
    OutboxSettings,
    PayloadTooLarge,
    PublishError,
    SerializationError,
    UnitOfWorkDep,
    UnknownBroker,
)
from fastapi_outbox.brokers import MemoryBroker, RedisStreamsBroker
from tests.conftest import asgi_client, run_cli

SECRET = "s3cretPW"


class Base(DeclarativeBase):
    pass


class Order(Base, AggregateRoot):
    __tablename__ = "bad_input_orders"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)


class OrderPlaced(Event, stream="orders", key="order_id"):
    order_id: int


@pytest.fixture
async def outbox(db_url: str) -> AsyncIterator[Outbox]:
    box = Outbox(
        db_url,
        brokers={"default": MemoryBroker(), "audit": MemoryBroker()},
        settings=OutboxSettings(run_relays=False, max_payload_bytes=512),
    )
    async with box.engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    await box.create_tables()
    yield box
    await box.aclose()


async def counts(outbox: Outbox) -> tuple[int, int]:
    async with outbox.engine.connect() as conn:
        orders = (await conn.execute(select(func.count()).select_from(Order))).scalar_one()
    return orders, await outbox.store.messages.count()


def raised_in_publish(info: pytest.ExceptionInfo[BaseException]) -> bool:
    """The error surfaced from ``uow.publish`` in the test body, not later at commit."""
    return any(entry.name == "publish" for entry in info.traceback)


BAD_PUBLISHES: dict[str, tuple[type[PublishError], Any, dict[str, Any], list[str]]] = {
    "unknown broker": (
        UnknownBroker,
        OrderPlaced(order_id=1),
        {"broker": "kafka"},
        ["'kafka'", "default", "audit"],
    ),
    "set payload": (
        SerializationError,
        Message(stream="orders", type="Raw", payload={"tags": {"a", "b"}}),
        {},
        ["set", "'orders'"],
    ),
    "datetime payload": (
        SerializationError,
        Message(stream="orders", type="Raw", payload={"at": dt.datetime.now(dt.UTC)}),
        {},
        ["datetime", "'orders'"],
    ),
    "payload too large": (
        PayloadTooLarge,
        Message(stream="orders", type="Big", payload={"blob": "x" * 600}),
        {},
        ["611 bytes", "max_payload_bytes=512"],
    ),
}


@pytest.mark.parametrize("case", list(BAD_PUBLISHES))
async def test_bad_publish_raises_at_publish_and_commits_nothing(outbox: Outbox, case: str) -> None:
    error, event, kwargs, words = BAD_PUBLISHES[case]
    reached_after_publish = False

    async def work() -> None:
        nonlocal reached_after_publish
        async with outbox.unit_of_work() as uow:
            uow.session.add(Order(id=1))
            await uow.session.flush()
            uow.publish(OrderPlaced(order_id=1))  # a good event before the bad one
            uow.publish(event, **kwargs)
            reached_after_publish = True

    with pytest.raises(error) as info:
        await work()
    assert not reached_after_publish
    assert raised_in_publish(info)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert await counts(outbox) == (0, 0)


async def test_refused_publish_queues_nothing_when_the_caller_carries_on(
    outbox: Outbox,
) -> None:
    async with outbox.unit_of_work() as uow:
        uow.session.add(Order(id=2))
        with pytest.raises(SerializationError):
            uow.publish(Message(stream="orders", type="Raw", payload={"s": {1}}))
        uow.publish(OrderPlaced(order_id=2))
    assert await counts(outbox) == (1, 1)
    [row] = await outbox.store.messages.list_messages()
    assert row["type"] == "OrderPlaced"


def build_app(outbox: Outbox) -> FastAPI:
    app = FastAPI(lifespan=outbox.lifespan)

    @app.post("/orders/{mode}")
    async def place(mode: str, uow: UnitOfWorkDep) -> dict[str, Any]:
        order = Order()
        uow.session.add(order)
        await uow.session.flush()
        if mode == "unknown-broker":
            uow.publish(OrderPlaced(order_id=order.id), broker="kafka")
        elif mode == "set-payload":
            uow.publish(Message(stream="orders", type="Raw", payload={"s": {1}}))
        else:
            order.raise_event(OrderPlaced(order_id=order.id))
        return {"id": order.id}

    return app


@pytest.fixture
async def client(outbox: Outbox) -> AsyncIterator[httpx.AsyncClient]:
    async with asgi_client(build_app(outbox)) as http:
        yield http


@pytest.mark.parametrize("mode", ["unknown-broker", "set-payload"])
async def test_handler_publishing_bad_event_gives_500_and_writes_nothing(
    outbox: Outbox, client: httpx.AsyncClient, mode: str
) -> None:
    assert (await client.post("/orders/ok")).status_code == 200
    response = await client.post(f"/orders/{mode}")
    assert response.status_code == 500
    assert await counts(outbox) == (1, 1)  # only the good request's order and event


# -- credentials ---------------------------------------------------------------------------------


def test_repr_of_outbox_and_redis_broker_hide_passwords() -> None:
    outbox = Outbox(
        f"postgresql+asyncpg://app:{SECRET}@db.internal:5432/shop",
        brokers={"default": RedisStreamsBroker(f"redis://:{SECRET}@127.0.0.1:1/0")},
        settings=OutboxSettings(),
    )
    text = repr(outbox) + repr(outbox.brokers["default"])
    assert SECRET not in text
    assert "app:***@db.internal" in repr(outbox)
    assert repr(RedisStreamsBroker(f"redis://:{SECRET}@127.0.0.1:1/0")) == (
        "RedisStreamsBroker('redis://:***@127.0.0.1:1/0')"
    )


async def test_unreachable_redis_error_hides_the_password(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from fastapi_outbox import BrokerUnavailable

    broker = RedisStreamsBroker(f"redis://:{SECRET}@127.0.0.1:1/0", socket_timeout=1)
    caplog.set_level(logging.DEBUG)
    try:
        with pytest.raises(BrokerUnavailable) as info:
            await broker.connect()
    finally:
        await broker.aclose()
    assert "127.0.0.1:1" in str(info.value)
    assert SECRET not in str(info.value)
    assert SECRET not in caplog.text


@pytest.mark.parametrize(
    "url",
    [
        f"postgresql+asyncpg://app:{SECRET}@h:notaport/x",
        f"postgresql+asyncpg//app:{SECRET}@h/x",  # missing ':'
        f"app:{SECRET}@h/x",  # no scheme
        f"mysql+nodriver://app:{SECRET}@h/x",
        f"postgresql://app:{SECRET}@h/x",  # a sync driver
        f"sqlite+aiosqlite://app:{SECRET}@h/x",
    ],
)
def test_bad_database_url_is_a_configuration_error_without_the_password(url: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        Outbox(url, settings=OutboxSettings())
    assert SECRET not in str(info.value)
    assert "***" in str(info.value)
    assert info.value.__cause__ is None or SECRET not in str(info.value.__cause__)


@pytest.mark.parametrize(
    ("url", "why", "right"),
    [
        (f"postgres://app:{SECRET}@h/x", "postgres:// is not", "postgresql+asyncpg://app:***@h/x"),
        (f"postgresql://app:{SECRET}@h/x", "names no driver", "postgresql+asyncpg://app:***@h/x"),
        (f"postgresql+psycopg2://app:{SECRET}@h/x", "not an asyncio driver", "postgresql+asyncpg"),
        ("sqlite:///shop.db", "names no driver", "sqlite+aiosqlite:///shop.db"),
        ("sqlite://", "names no driver", "sqlite+aiosqlite://"),
        (f"mysql://app:{SECRET}@h/x", "names no driver", "mysql+asyncmy://app:***@h/x"),
        (f"mariadb+asyncmy://app:{SECRET}@h/x", "mariadb:// is not", "mysql+asyncmy://app:***@h/x"),
        (f"oracle://app:{SECRET}@h/x", "'oracle' is not a database", "mysql+asyncmy://"),
    ],
)
def test_a_url_without_an_async_driver_names_the_url_and_the_right_form(
    url: str, why: str, right: str
) -> None:
    # Refused before any driver is loaded: the error is ours, not "No module named ...".
    with pytest.raises(ConfigurationError) as info:
        Outbox(url, settings=OutboxSettings())
    message = str(info.value)
    assert why in message and right in message, message
    assert "No module named" not in message and "Can't load plugin" not in message
    assert SECRET not in message
    # The same check where the URL comes from settings (OUTBOX_DATABASE_URL, used by the CLI).
    with pytest.raises(ConfigurationError) as from_settings:
        OutboxSettings.from_env(database_url=url)
    assert "database_url" in str(from_settings.value) and right in str(from_settings.value)
    assert SECRET not in str(from_settings.value)


def test_cli_unreachable_database_hides_the_password() -> None:
    url = f"postgresql+asyncpg://app:{SECRET}@127.0.0.1:1/shop"
    result = run_cli("db", "create", "--url", url)
    assert result.returncode == 3, result.stderr
    assert SECRET not in result.stdout + result.stderr
    assert "app:***@127.0.0.1:1/shop" in result.stderr and "unreachable" in result.stderr


def test_cli_bad_table_name_is_a_usage_error_naming_table_name(tmp_path: Path) -> None:
    bad = "orders; drop table x"
    create = run_cli(
        "db", "create", "--url", f"sqlite+aiosqlite:///{tmp_path}/t.db", "--table", bad
    )
    sql = run_cli("db", "sql", "--table", bad)
    for result in (create, sql):
        assert result.returncode == 2, result.stderr
        assert "table_name" in result.stderr
        assert "Traceback" not in result.stderr
    assert not (tmp_path / "t.db").exists() or (tmp_path / "t.db").stat().st_size == 0


def test_table_name_through_outbox_settings() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="table_name"):
        Outbox("sqlite+aiosqlite://", settings=OutboxSettings(table_name="orders; drop table x"))

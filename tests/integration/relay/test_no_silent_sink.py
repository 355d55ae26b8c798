"""No silent sink: a memory broker only when asked for by name; an outbox with
no real broker refuses to dispatch instead of marking rows published into nowhere."""

from __future__ import annotations

import subprocess
import sys

import anyio
import pytest
from fastapi import FastAPI

from fastapi_outbox import Message, Outbox, OutboxSettings, exceptions
from fastapi_outbox.brokers import MemoryBroker
from tests.conftest import ROOT, asgi_client, run_cli, wait_until


async def publish_one(outbox: Outbox) -> None:
    async with outbox.unit_of_work() as uow:
        uow.publish(Message(stream="orders", type="OrderPlaced", payload={"n": 1}))


async def test_outbox_without_brokers_refuses_to_start_relays(pg_url: str) -> None:
    outbox = Outbox(pg_url, settings=OutboxSettings())
    try:
        await outbox.create_tables()
        await publish_one(outbox)  # an API-only process may write rows for "default"
        app = FastAPI(lifespan=outbox.lifespan)
        with pytest.raises(exceptions.ConfigurationError) as error:
            async with asgi_client(app):
                pass
        message = str(error.value)
        assert "brokers=" in message and "--broker-url" in message
        assert "OUTBOX_BROKER_URL" in message
        assert await outbox.store.messages.count("pending") == 1  # nothing was "published"
    finally:
        await outbox.aclose()


async def test_api_only_outbox_without_brokers_serves(pg_url: str) -> None:
    outbox = Outbox(pg_url, settings=OutboxSettings(run_relays=False))
    try:
        await outbox.create_tables()
        async with asgi_client(FastAPI(lifespan=outbox.lifespan)):
            await publish_one(outbox)
        assert await outbox.store.messages.count("pending") == 1
    finally:
        await outbox.aclose()


async def test_memory_broker_by_name(sqlite_url: str) -> None:
    outbox = Outbox(sqlite_url, settings=OutboxSettings(broker_url="memory://"))
    try:
        broker = outbox.brokers["default"]
        assert isinstance(broker, MemoryBroker)
        await outbox.create_tables()
        async with outbox.relaying():
            await publish_one(outbox)
            await wait_until(lambda: len(broker.messages) == 1)
    finally:
        await outbox.aclose()


async def test_dispatch_without_broker_exits_2_and_publishes_nothing(pg_url: str) -> None:
    outbox = Outbox(pg_url, settings=OutboxSettings(run_relays=False))
    try:
        await outbox.create_tables()
        await publish_one(outbox)
        result = await anyio.to_thread.run_sync(lambda: run_cli("dispatch", "--url", pg_url))
        assert result.returncode == 2, result.stderr
        assert "--broker-url" in result.stderr and "OUTBOX_BROKER_URL" in result.stderr
        assert await outbox.store.messages.count("pending") == 1
    finally:
        await outbox.aclose()


def test_example_embedded_default_asks_for_memory_by_name() -> None:
    # The embedded example keeps working: it names the memory broker itself.
    code = "from examples.orders.app import broker; print(type(broker).__name__)"
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert result.stdout.strip() == "MemoryBroker", result.stderr

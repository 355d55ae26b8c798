"""Mistakes an operator must fix are reported as what they are, never as "unreachable":
refused credentials (database and every broker) say "authentication failed" in the relay,
health and the CLI (exit code 4); a missing table says "table missing" with its fix;
``fastapi-outbox consumers`` prints the cause of unknown figures and exits non-zero."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from fastapi_outbox import Message, Outbox, OutboxSettings, exceptions
from fastapi_outbox.brokers import MemoryBroker, broker_from_url
from fastapi_outbox.ops.health import compute_health
from tests.conftest import run_cli, unique, wait_until
from tests.servers import NATS_SERVER, PrivateServer, StartingUpProxy, binary, free_port

# aio-pika drops a Connection.close coroutine unawaited when a login is refused while the
# client retries (its leak, not a lost message); the garbage collector may report it during
# any later test of this file.
pytestmark = [
    pytest.mark.filterwarnings(
        "ignore:Exception ignored in. <coroutine object Connection.close"
        ":pytest.PytestUnraisableExceptionWarning"
    ),
    pytest.mark.filterwarnings(
        "ignore:coroutine 'Connection.close' was never awaited:RuntimeWarning"
    ),
]

APP = "tests.integration.consumer_cli_app:outbox"
MISSING = "table missing: run `fastapi-outbox db create` or `outbox.create_tables()`"
SETTINGS = {"poll_interval_seconds": 0.05, "broker_backoff_max_seconds": 1.0}


async def _nats_with_a_password(tmp_path: Path) -> AsyncIterator[str]:
    """A private nats-server whose only user is app/right; yields a URL with a wrong
    password (the shared server has no authentication)."""
    port = free_port(range(4380, 4390))
    argv = [binary(NATS_SERVER), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(tmp_path)]
    server = PrivateServer([*argv, "--user", "app", "--pass", "right"], port, "")
    await server.start()
    try:
        # A newly started server may answer slowly on a loaded machine: the refusal is what
        # this test waits for, not the library's 2 s connect bound.
        yield f"nats://app:wrong@127.0.0.1:{port}?connect_timeout_seconds=10"
    finally:
        await server.kill()


@pytest.fixture
async def refused_broker_url(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    kind = request.param
    if kind == "redis":
        request.getfixturevalue("redis_url")
        # The shared Redis has no password: a named user that does not exist is WRONGPASS.
        yield "redis://nobody:wrong@127.0.0.1:6379"
    elif kind == "rabbitmq":
        request.getfixturevalue("rabbitmq_url")
        yield "amqp://guest:wrong@127.0.0.1:5672/"
    else:
        async for url in _nats_with_a_password(tmp_path):
            yield url


@pytest.mark.parametrize(
    "refused_broker_url",
    [
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("rabbitmq", marks=pytest.mark.rabbitmq),
        pytest.param("nats", marks=pytest.mark.nats),
    ],
    indirect=True,
)
async def test_refused_broker_credentials_are_reported_as_authentication_failed(
    refused_broker_url: str, sqlite_url: str
) -> None:
    broker = broker_from_url(refused_broker_url)
    with pytest.raises(exceptions.AuthenticationFailed, match="authentication failed") as refused:
        await broker.ping()
    assert "wrong" not in str(refused.value)
    await broker.aclose()

    outbox = Outbox(
        sqlite_url,
        brokers={"default": broker_from_url(refused_broker_url)},
        settings=OutboxSettings(**SETTINGS),
    )
    await outbox.create_tables()
    try:
        async with outbox.unit_of_work() as uow:
            uow.publish(Message(stream=unique("orders"), type="OrderPlaced", payload={}))
        async with outbox.relaying():
            table_relay = outbox.relays.tables["default"]
            await wait_until(lambda: not table_relay.broker_ok, timeout=15)
            assert table_relay.broker_authentication_failed
            assert "authentication failed" in (table_relay.last_error or "")
            health = await compute_health(outbox)
        assert health.status == "degraded"
        [reason] = [r for r in health.reasons if "broker 'default'" in r]
        assert "authentication failed" in reason and "unreachable" not in reason
        # An outage, not the message's fault: nothing charged.
        assert await outbox.store.messages.count("pending") == 1
        assert await outbox.store.messages.count("failed") == 0
    finally:
        await outbox.aclose()

    # The CLI answers within its own 3 s bound: the library's connect timeout.
    cli_url = refused_broker_url.removesuffix("?connect_timeout_seconds=10")
    env = {"CONSUMER_DATABASE_URL": sqlite_url, "CONSUMER_BROKER_URL": cli_url}
    listed = await anyio.to_thread.run_sync(lambda: run_cli("consumers", "--app", APP, env=env))
    assert listed.returncode == 4, listed.stderr
    assert "authentication failed" in listed.stderr and "billing" in listed.stderr
    assert "wrong" not in listed.stderr


@pytest.mark.redis
async def test_consumers_command_prints_an_unreachable_brokers_cause_and_exits_3(
    sqlite_url: str,
) -> None:
    outbox = Outbox(sqlite_url, brokers={"default": MemoryBroker()})
    await outbox.create_tables()
    await outbox.aclose()
    env = {"CONSUMER_DATABASE_URL": sqlite_url, "CONSUMER_BROKER_URL": "redis://127.0.0.1:1"}
    listed = await anyio.to_thread.run_sync(lambda: run_cli("consumers", "--app", APP, env=env))
    assert listed.returncode == 3, listed.stdout + listed.stderr
    assert "is unreachable" in listed.stderr and "127.0.0.1:1" in listed.stderr
    assert "billing" in listed.stdout  # what could be read is still listed


@pytest.mark.parametrize(
    "database",
    [
        "sqlite",
        pytest.param(
            "postgres",
            marks=pytest.mark.postgres(
                reason="PostgreSQL's refused-credentials SQLSTATE from a private server"
            ),
        ),
    ],
)
async def test_a_missing_table_is_reported_with_its_fix_not_as_an_outage(
    database: str, request: pytest.FixtureRequest
) -> None:
    url = str(request.getfixturevalue("sqlite_url" if database == "sqlite" else "pg_url"))
    outbox = Outbox(url, brokers={"default": MemoryBroker()}, settings=OutboxSettings(**SETTINGS))
    try:  # no create_tables()
        health = await compute_health(outbox)
        assert MISSING in health.reasons, health.reasons
        assert not any("unreachable" in r for r in health.reasons)
        async with outbox.relaying():
            table_relay = outbox.relays.tables["default"]
            await wait_until(lambda: MISSING in (table_relay.last_error or ""), timeout=10)
            assert table_relay.database_ok  # the database answers
    finally:
        await outbox.aclose()
    listed = await anyio.to_thread.run_sync(lambda: run_cli("list", "--url", url))
    assert listed.returncode == 1, listed.stderr
    assert "table missing" in listed.stderr and "fastapi-outbox db create" in listed.stderr


@pytest.mark.postgres(reason="PostgreSQL's refused-credentials SQLSTATE from a private server")
async def test_refused_database_credentials_are_reported_as_authentication_failed(
    pg_url: str,
) -> None:
    """PostgreSQL answers FATAL 28P01 (the shared server trusts everyone: a proxy plays a
    server that checks passwords)."""
    proxy = StartingUpProxy(5432)
    await proxy.start()
    proxy.refuse(60.0, "28P01", 'password authentication failed for user "postgres"')
    url = pg_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
    outbox = Outbox(url, brokers={"default": MemoryBroker()}, settings=OutboxSettings(**SETTINGS))
    try:
        health = await compute_health(outbox)
        assert health.status == "down"
        assert any(r.startswith("database authentication failed") for r in health.reasons)
        assert not any("unreachable" in r for r in health.reasons)
        async with outbox.relaying():
            table_relay = outbox.relays.tables["default"]
            await wait_until(lambda: not table_relay.database_ok, timeout=10)
            assert "authentication failed" in (table_relay.last_error or "")
        created = await anyio.to_thread.run_sync(lambda: run_cli("db", "create", "--url", url))
        assert created.returncode == 4, created.stderr
        assert "authentication failed" in created.stderr
        assert "check the user and password" in created.stderr
    finally:
        await outbox.aclose()
        await proxy.stop()

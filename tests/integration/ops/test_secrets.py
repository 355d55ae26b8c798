"""No credential, in any form a driver accepts, leaves the process through a log line, an
error, a table_relay's ``last_error``, the health body (public or guarded), the metrics or
a dashboard page; the public health body names no host, port or user either.

The brokers point at closed loopback ports, so every error path runs for real: the
connects fail with the drivers' own errors."""

from __future__ import annotations

import logging
import socket
from typing import Any

import pytest
from fastapi import Depends, FastAPI, HTTPException, Request
from prometheus_client import CollectorRegistry

from fastapi_outbox import BrokerUnavailable, Message, Outbox, OutboxSettings
from fastapi_outbox.brokers import NatsJetStreamBroker, RedisStreamsBroker, broker_from_url
from fastapi_outbox.log import JsonFormatter, TextFormatter, safe_error
from fastapi_outbox.ops.metrics import PrometheusInstrumentation, mount_metrics
from tests.conftest import asgi_client, unique, wait_until


def closed_ports(n: int) -> list[int]:
    """Loopback ports nothing listens on (bound, then released)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


# One secret per URL form; none of them is a substring of another.
NATS_TOKEN = "natsTok3n-a81f"
NATS_LIST_PASSWORD = "natsListPw-5c2e"
NATS_LIST_TOKEN = "natsListTok-77d0"
REDISS_PASSWORD = "redissPw-19be"
REDIS_AT_PASSWORD = "redis@tPw-e4c1"
REDIS_USER_ONLY = "redisUserOnly-3a9d"
REDIS_QUERY_PASSWORD = "redisQueryPw-0f6b"
DB_PASSWORD = "dbP@ss-2d7e"  # with an @, percent-encoded in the URL
DB_QUERY_TOKEN = "dbQueryTok-8e15"
SECRETS = [
    NATS_TOKEN,
    NATS_LIST_PASSWORD,
    NATS_LIST_TOKEN,
    REDISS_PASSWORD,
    REDIS_AT_PASSWORD,
    REDIS_USER_ONLY,
    REDIS_QUERY_PASSWORD,
    DB_PASSWORD,
    DB_PASSWORD.replace("@", "%40"),
    DB_QUERY_TOKEN,
]
#: User names: not secrets, but not for the public health body either.
USERS = ["natsListUser", "redisAtUser"]


def broker_urls(ports: list[int]) -> dict[str, str]:
    p = iter(ports)
    return {
        "nats_token": f"nats://{NATS_TOKEN}@127.0.0.1:{next(p)}",
        "nats_list": (
            f"nats://natsListUser:{NATS_LIST_PASSWORD}@127.0.0.1:{next(p)},"
            f"nats://{NATS_LIST_TOKEN}@127.0.0.1:{next(p)}"
        ),
        "rediss": f"rediss://:{REDISS_PASSWORD}@127.0.0.1:{next(p)}/0",
        "redis_at": f"redis://redisAtUser:{REDIS_AT_PASSWORD}@127.0.0.1:{next(p)}/0",
        "redis_user": f"redis://{REDIS_USER_ONLY}@127.0.0.1:{next(p)}/0",
        "redis_query": f"redis://127.0.0.1:{next(p)}/0?password={REDIS_QUERY_PASSWORD}",
    }


def database_url(pg_url: str) -> str:
    """``pg_url`` with a password containing ``@`` and a credential in the query string
    (the test server trusts loopback: both are ignored by it, not by the redaction)."""
    head, _, tail = pg_url.partition("://")
    user, _, rest = tail.partition("@")
    encoded = DB_PASSWORD.replace("@", "%40")
    return f"{head}://{user}:{encoded}@{rest}?password={DB_QUERY_TOKEN}"


def make_broker(url: str) -> Any:
    """The broker of ``url``; a NATS one gives up a connect after 0.2 s (its ports are closed:
    every health ping and page of the test waits that long per NATS broker)."""
    if url.startswith("nats://"):
        return NatsJetStreamBroker(url, connect_timeout_seconds=0.2)
    return broker_from_url(url)


def leaks(text: str, *, public: bool = False, ports: list[int] | None = None) -> list[str]:
    found = [s for s in SECRETS if s in text]
    if public:
        found += [u for u in USERS if u in text]
        found += ["127.0.0.1"] if "127.0.0.1" in text else []
        found += [f"port {p}" for p in ports or [] if str(p) in text]
    return found


def require_admin(request: Request) -> None:
    if request.headers.get("x-admin") != "yes":
        raise HTTPException(401, "operators only")


@pytest.mark.parametrize("form", ["nats_token", "nats_list", "rediss", "redis_at", "redis_user"])
async def test_unreachable_brokers_errors_carry_no_credential(form: str) -> None:
    """The error of a real failed connect, for each URL form, as the exception, its
    chained cause and safe_error show it."""
    url = broker_urls(closed_ports(7))[form]
    broker: Any = make_broker(url)
    with pytest.raises(BrokerUnavailable) as info:
        await broker.connect()
    await broker.aclose()
    texts = [str(info.value), repr(info.value), repr(broker), safe_error(info.value)]
    assert "unreachable" in str(info.value)
    assert not leaks("\n".join(texts)), texts


async def test_no_surface_shows_a_credential(pg_url: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    ports = closed_ports(7)
    urls = broker_urls(ports)
    brokers: dict[str, Any] = {name: make_broker(url) for name, url in urls.items()}
    registry = CollectorRegistry()
    outbox = Outbox(
        database_url(pg_url),
        brokers=brokers,
        settings=OutboxSettings(
            health_cache_seconds=0, poll_interval_seconds=0.1, broker_backoff_max_seconds=1
        ),
        instrumentation=PrometheusInstrumentation(registry),
        dashboard_dependencies=[Depends(require_admin)],
    )
    stream = unique("orders")

    @outbox.subscriber(stream, group="billing", broker="nats_token")
    async def bill(message: Message) -> None:  # never runs: its broker is unreachable
        raise AssertionError("unreachable broker delivered a message")

    await outbox.create_tables()
    async with outbox.unit_of_work() as uow:
        for name in brokers:
            uow.publish(Message(stream=stream, type="Thing", payload={"n": 1}), broker=name)
    app = FastAPI()
    app.include_router(outbox.router)
    app.include_router(outbox.dashboard_router)
    mount_metrics(app, outbox)
    try:
        async with asgi_client(app) as client:
            await wait_until(
                lambda: all(
                    p.last_error and not p.broker_ok for p in outbox.relays.tables.values()
                ),
                timeout=30,
            )
            await wait_until(lambda: bool(outbox.subscribers[0].stats.last_error), timeout=30)
            public = await client.get("/outbox/health")
            unguarded = await client.get("/outbox/health/detail")
            detail = await client.get("/outbox/health/detail", headers={"x-admin": "yes"})
            admin = {"x-admin": "yes"}
            pages = [
                await client.get("/outbox/dashboard", headers=admin),
                await client.get("/outbox/dashboard/fragments/overview", headers=admin),
                await client.get("/outbox/dashboard/api/overview", headers=admin),
                await client.get("/outbox/dashboard/messages", headers=admin),
            ]
            metrics = await client.get("/metrics")
    finally:
        await outbox.aclose()

    # The public body: degraded, says why, names no host, port, user or credential.
    assert public.status_code == 200, public.text
    body = public.json()
    assert body["status"] == "degraded"
    assert any("broker 'nats_token' unreachable for" in r for r in body["reasons"]), body
    assert all(p["last_error"] is None for p in body["relays"])
    assert body["consumers"][0]["handler"] is None and body["consumers"][0]["group"] == "billing"
    assert not leaks(public.text, public=True, ports=ports), public.text
    # The detail: for the guard only; errors there, redacted.
    assert unguarded.status_code == 401
    assert detail.status_code == 200
    errors = {p["broker"]: p["last_error"] for p in detail.json()["relays"]}
    assert "unreachable" in errors["nats_token"] and "***@127.0.0.1" in errors["nats_token"]
    assert detail.json()["consumers"][0]["handler"].endswith("bill")
    assert not leaks(detail.text), detail.text
    for page in pages:
        assert page.status_code == 200, page.text
        assert not leaks(page.text), (str(page.url), leaks(page.text))
    assert "outbox_relay_up" in metrics.text and not leaks(metrics.text)

    # Relays' and the consumer's errors; every log record as any formatter shows it.
    last_errors = [p.last_error or "" for p in outbox.relays.tables.values()]
    last_errors.append(outbox.subscribers[0].stats.last_error or "")
    assert not leaks("\n".join(last_errors)), last_errors
    assert any(getattr(r, "action", "") == "broker.unavailable" for r in caplog.records)
    plain = logging.Formatter("%(message)s")
    for record in caplog.records:
        shown = [
            JsonFormatter().format(record),
            TextFormatter().format(record),
            record.getMessage(),
            *(str(v) for k, v in vars(record).items() if k not in ("exc_info", "exc_text")),
        ]
        if record.exc_info and record.exc_info[1] is not None:
            shown.append(str(record.exc_info[1]))
        assert not leaks("\n".join(shown)), (record.getMessage(), leaks("\n".join(shown)))
        # A user's own formatter prints tracebacks with the chained driver errors.
        assert not leaks(plain.format(record)), plain.format(record)


async def test_health_detail_without_a_guard_is_refused_unless_made_public(
    sqlite_url: str,
) -> None:
    url = f"redis://someUser:{REDIS_AT_PASSWORD}@127.0.0.1:{closed_ports(1)[0]}/0"
    for public_detail, expected in ((False, 403), (True, 200)):
        outbox = Outbox(
            sqlite_url,
            brokers={"default": RedisStreamsBroker(url)},
            settings=OutboxSettings(health_cache_seconds=0, health_public_detail=public_detail),
        )
        await outbox.create_tables()
        app = FastAPI()
        app.include_router(outbox.router)
        try:
            async with asgi_client(app) as client:
                down = outbox.relays.tables["default"]
                await wait_until(lambda down=down: not down.broker_ok, timeout=30)
                detail = await client.get("/outbox/health/detail")
                public = (await client.get("/outbox/health")).json()
        finally:
            await outbox.aclose()
        assert detail.status_code == expected, detail.text
        if expected == 403:
            assert "dashboard_dependencies" in detail.text
            assert "health_public_detail" in detail.text
            assert public["relays"][0]["last_error"] is None
        else:  # on purpose: the detail in the public body, still without the password
            assert "someUser:***@127.0.0.1" in public["relays"][0]["last_error"]
        assert REDIS_AT_PASSWORD not in detail.text


async def test_connect_log_line_of_a_token_url_and_a_server_list(
    nats_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The ``broker.connect`` line of a real connection (the test server ignores the token),
    with a comma-separated server list whose second server is down: nats-py gets a list."""
    caplog.set_level(logging.INFO, logger="fastapi_outbox")
    host_port = nats_url.removeprefix("nats://")
    down = closed_ports(1)[0]
    url = (
        f"nats://{NATS_TOKEN}@{host_port}, "
        f"nats://natsListUser:{NATS_LIST_PASSWORD}@127.0.0.1:{down}"
    )
    broker = NatsJetStreamBroker(url)
    try:
        await broker.connect()
        await broker.ping()
    finally:
        await broker.aclose()
    [record] = [r for r in caplog.records if getattr(r, "action", "") == "broker.connect"]
    assert record.broker_url == (  # type: ignore[attr-defined]
        f"nats://***@{host_port}, nats://natsListUser:***@127.0.0.1:{down}"
    )
    assert not leaks(JsonFormatter().format(record) + TextFormatter().format(record))
    assert not leaks(repr(broker))


async def test_a_handler_error_quoting_a_url_is_redacted_in_the_dead_letter(
    redis_url: str, pg_url: str
) -> None:
    """The error kept with a dead letter (shown by the CLI and the dashboard) and the
    group's last_error: the handler's own text, through the same redaction."""
    outbox = Outbox(
        pg_url,
        brokers={"default": RedisStreamsBroker(redis_url)},
        settings=OutboxSettings(consumer_max_attempts=1, poll_interval_seconds=0.05),
    )
    stream = unique("orders")

    @outbox.subscriber(stream, group="billing", start="all")
    async def bill(message: Message) -> None:
        raise RuntimeError(f"cannot reach rediss://:{REDISS_PASSWORD}@cache.internal:6380/0")

    await outbox.create_tables()
    async with outbox.relaying():
        async with outbox.unit_of_work() as uow:
            uow.publish(Message(stream=stream, type="Thing", payload={"n": 1}))
        sub = outbox.subscribers[0]
        await wait_until(lambda: sub.stats.dead_lettered == 1, timeout=20)
        assert sub.consumer is not None
        [letter] = await sub.consumer.dead_letters()
    await outbox.aclose()
    assert "rediss://:***@cache.internal:6380/0" in letter.error
    assert not leaks(letter.error + (sub.stats.last_error or ""))

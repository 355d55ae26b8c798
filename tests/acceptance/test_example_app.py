"""The example service, ``python -m examples.orders``, as a user starts it: a subprocess on a
free port. Embedded default (SQLite file + memory broker), then PostgreSQL + Redis."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import unique, wait_until

ROOT = Path(__file__).parents[2]
STARTUP_TIMEOUT = 30.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Service:
    def __init__(self, process: subprocess.Popen[bytes], base_url: str, log: Path) -> None:
        self.process = process
        self.base_url = base_url
        self.log = log

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    async def wait_ready(self, client: httpx.AsyncClient) -> None:
        async def up() -> bool:
            assert self.process.poll() is None, f"service exited:\n{self.output()}"
            try:
                await client.get(f"{self.base_url}/outbox/health", timeout=2)
            except httpx.TransportError:
                return False
            return True

        try:
            await wait_until(up, timeout=STARTUP_TIMEOUT, interval=0.1)
        except TimeoutError:
            pytest.fail(f"service not up after {STARTUP_TIMEOUT} s:\n{self.output()}")


@pytest.fixture
def start_example(tmp_path: Path) -> Iterator[Callable[..., Service]]:
    """Starts the example in ``tmp_path`` (its orders.db lands there); kills it afterwards.

    Request this fixture AFTER ``pg_url`` so the service stops before its database is
    dropped."""
    started: list[subprocess.Popen[bytes]] = []

    def start(**extra_env: str) -> Service:
        port = free_port()
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("OUTBOX_") and k != "PYTHONTRACEMALLOC"
        }
        env.update(PYTHONPATH=str(ROOT), PORT=str(port), HOST="127.0.0.1", **extra_env)
        for name in ("DATABASE_URL", "BROKER_URL"):
            if name not in extra_env:
                env.pop(name, None)
        log = tmp_path / f"service-{port}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "examples.orders"],
                cwd=tmp_path,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        started.append(process)
        return Service(process, f"http://127.0.0.1:{port}", log)

    yield start
    for process in started:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)


async def place_order(client: httpx.AsyncClient, service: Service, customer: str) -> int:
    response = await client.post(
        f"{service.base_url}/orders", json={"customer": customer, "total": 42, "skus": ["a"]}
    )
    assert response.status_code == 201, response.text
    return int(response.json()["id"])


def customer_of(fields: dict[str, str]) -> str | None:
    """The customer of an OrderPlaced stream entry; None for anything else (other tests
    write other entries to the shared stream)."""
    if fields.get("type") != "OrderPlaced":
        return None
    try:
        payload = json.loads(fields["payload"])
    except (KeyError, ValueError):
        return None
    return payload.get("customer") if isinstance(payload, dict) else None


async def invoice_of(client: httpx.AsyncClient, service: Service, customer: str) -> dict[str, Any]:
    """The invoice the billing subscriber wrote for the (unique) ``customer``'s order, exactly
    one. (With a real broker the shared "orders" stream also carries other tests' orders, whose
    ids repeat across databases: the customer names this test's order.)"""
    found: list[dict[str, Any]] = []

    async def billed() -> bool:
        response = await client.get(f"{service.base_url}/invoices")
        found[:] = [i for i in response.json() if i["customer"] == customer]
        return bool(found)

    await wait_until(billed, timeout=15, interval=0.05)
    [invoice] = found
    return invoice


async def assert_healthy(client: httpx.AsyncClient, service: Service) -> None:
    last: list[Any] = []

    async def ok() -> bool:
        response = await client.get(f"{service.base_url}/outbox/health")
        last[:] = [response.status_code, response.json()]
        return response.status_code == 200 and response.json()["status"] == "ok"

    try:
        await wait_until(ok, timeout=10)
    except TimeoutError:
        pytest.fail(f"/outbox/health never answered 200 ok; last answer: {last}")


async def test_embedded_default_sqlite_and_memory_broker(
    tmp_path: Path, start_example: Callable[..., Service]
) -> None:
    service = start_example()
    async with httpx.AsyncClient(timeout=10) as client:
        await service.wait_ready(client)
        customer = unique("ada")
        order_id = await place_order(client, service, customer)
        published: list[dict[str, Any]] = []

        async def arrived() -> bool:
            response = await client.get(f"{service.base_url}/published")
            published[:] = [
                m
                for m in response.json()
                if m["type"] == "OrderPlaced" and m["payload"]["order_id"] == order_id
            ]
            return bool(published)

        await wait_until(arrived, timeout=10)
        [message] = published
        assert message["stream"] == "orders" and message["key"] == str(order_id)
        assert message["payload"] == {"order_id": order_id, "customer": customer, "total": 42.0}
        await assert_healthy(client, service)
        # The billing subscriber, in the same process on the memory broker: an invoice,
        # and InvoiceIssued raised with the OrderPlaced message as its cause.
        invoice = await invoice_of(client, service, customer)
        assert (invoice["order_id"], invoice["amount"]) == (order_id, 42.0)
        issued: list[dict[str, Any]] = []

        async def raised() -> bool:
            response = await client.get(f"{service.base_url}/published")
            issued[:] = [m for m in response.json() if m["type"] == "InvoiceIssued"]
            return bool(issued)

        await wait_until(raised, timeout=10)
        assert issued[0]["payload"] == {
            "order_id": order_id,
            "invoice_id": invoice["id"],
            "amount": 42.0,
        }
        orders = (await client.get(f"{service.base_url}/orders")).json()
        assert [o["id"] for o in orders if o["customer"] == customer] == [order_id]

        # The dashboard: guarded by the token the service printed at start.
        dashboard = f"{service.base_url}/outbox/dashboard"
        assert (await client.get(dashboard)).status_code == 401
        printed = re.search(r"user admin, password (\S+);", service.output())
        assert printed is not None, service.output()
        page = await client.get(dashboard, auth=("admin", printed.group(1)))
        assert page.status_code == 200 and "Published per minute" in page.text
        bearer = {"Authorization": f"Bearer {printed.group(1)}"}
        assert (await client.get(f"{dashboard}/api/overview", headers=bearer)).status_code == 200
    assert (tmp_path / "orders.db").is_file()  # the embedded database, in the cwd


async def test_postgresql_and_redis(
    pg_url: str, redis_url: str, start_example: Callable[..., Service]
) -> None:
    import redis.asyncio as aioredis

    redis = aioredis.Redis.from_url(redis_url, decode_responses=True)
    # The example's names are fixed ("orders", group "billing") on the shared Redis: what
    # earlier runs left there (dead letters, entries of other types the group has not read)
    # is not this test's; it starts the group at the stream's end, with no dead letter.
    await redis.delete("orders.billing.dlq")
    with contextlib.suppress(aioredis.ResponseError):  # no stream or no group yet
        await redis.xgroup_setid("orders", "billing", "$")
    service = start_example(DATABASE_URL=pg_url, BROKER_URL=redis_url)
    try:
        seconds, micros = await redis.time()
        # The "orders" stream is shared with other tests: read only entries added from
        # a second before this order, and look for this order's unique customer.
        since = f"{seconds * 1000 + micros // 1000 - 1000}-0"
        async with httpx.AsyncClient(timeout=10) as client:
            await service.wait_ready(client)
            customer = unique("grace")
            order_id = await place_order(client, service, customer)
            found: list[dict[str, Any]] = []

            async def in_stream() -> bool:
                entries = await redis.xrange("orders", min=since, max="+", count=10_000)
                found[:] = [f for _, f in entries if customer_of(f) == customer]
                return bool(found)

            await wait_until(in_stream, timeout=15, interval=0.05)
            [fields] = found
            assert json.loads(fields["payload"]) == {
                "order_id": order_id,
                "customer": customer,
                "total": 42.0,
            }
            assert fields["key"] == str(order_id)
            headers = json.loads(fields["headers"])
            assert headers["message-id"] == fields["id"]
            assert headers["type"] == "OrderPlaced"
            # the memory-broker view of the example is empty with a real broker
            assert (await client.get(f"{service.base_url}/published")).json() == []
            # Billing consumed the order from the Redis stream.
            invoice = await invoice_of(client, service, customer)
            assert (invoice["order_id"], invoice["amount"]) == (order_id, 42.0)
            await assert_healthy(client, service)
    finally:
        await redis.aclose()


async def test_postgresql_and_rabbitmq(
    pg_url: str, rabbitmq_url: str, start_example: Callable[..., Service]
) -> None:
    """``BROKER_URL=amqp://…``: the order goes through the ``outbox`` exchange to the
    billing group's queue and comes back as an invoice; InvoiceIssued reaches the mailer's
    queue (nothing is left unroutable), and the service reports healthy."""
    import aio_pika

    queues = ("orders.billing", "orders.billing.dlq", "invoices.mailer", "invoices.mailer.dlq")

    async def clear() -> None:
        # The example's names are fixed on the shared RabbitMQ: nothing of earlier runs.
        conn = await aio_pika.connect(rabbitmq_url)
        try:
            channel = await conn.channel()
            for name in queues:
                await channel.queue_delete(name)
        finally:
            await conn.close()

    await clear()
    service = start_example(DATABASE_URL=pg_url, BROKER_URL=rabbitmq_url)
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            await service.wait_ready(client)
            customer = unique("ada")
            order_id = await place_order(client, service, customer)
            invoice = await invoice_of(client, service, customer)
            assert (invoice["order_id"], invoice["amount"]) == (order_id, 42.0)
            await wait_until(lambda: "mailed" in service.output(), timeout=15)
            await assert_healthy(client, service)
    finally:
        service.process.terminate()  # before its queues go: it would declare them again
        service.process.wait(15)
        await clear()


async def test_postgresql_and_kafka(
    pg_url: str, kafka_url: str, start_example: Callable[..., Service]
) -> None:
    """``BROKER_URL=kafka://…``: the order goes to the ``orders`` topic, the billing group
    consumes it and issues the invoice; InvoiceIssued reaches the mailer, and the service
    reports healthy."""
    from aiokafka.admin import AIOKafkaAdminClient

    from fastapi_outbox.brokers.kafka.wire import bootstrap_servers

    topics = ["orders", "orders.billing.dlq", "invoices", "invoices.mailer.dlq"]

    async def clear() -> None:
        # The example's names are fixed on the session's Kafka server: nothing of earlier runs.
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers(kafka_url))
        await admin.start()
        try:
            with contextlib.suppress(Exception):
                await admin.delete_topics(topics)
        finally:
            await admin.close()

    await clear()
    # A group join waits half the session timeout on Tansu: 1 s rather than 5 s.
    url = kafka_url + "?session_timeout_seconds=2&heartbeat_interval_seconds=0.5"
    service = start_example(DATABASE_URL=pg_url, BROKER_URL=url)
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            await service.wait_ready(client)
            customer = unique("ada")
            order_id = await place_order(client, service, customer)
            invoice = await invoice_of(client, service, customer)
            assert (invoice["order_id"], invoice["amount"]) == (order_id, 42.0)
            await wait_until(lambda: "mailed" in service.output(), timeout=15)
            await assert_healthy(client, service)
    finally:
        service.process.terminate()
        service.process.wait(15)
        await clear()

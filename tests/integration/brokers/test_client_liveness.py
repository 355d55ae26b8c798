"""Every broker client's liveness policy is the library's: a connection whose server goes
silent (a proxy drops its bytes both ways and keeps it open: a frozen node, a NAT that
forgot it) is left within the policy's seconds, and the next call opens a new one. The
NATS cluster case (a node SIGSTOPped) is in tests/acceptance/test_nats_cluster.py, Redis's
in tests/integration/brokers/test_redis_consumer.py."""

from __future__ import annotations

import pytest

from fastapi_outbox.brokers.rabbitmq.connection import RabbitMQConnection
from tests.conftest import unique, wait_until
from tests.servers import TcpProxy


@pytest.mark.rabbitmq
async def test_a_silent_rabbitmq_is_left_within_the_heartbeat(rabbitmq_url: str) -> None:
    port = int(rabbitmq_url.rsplit(":", 1)[1].split("/", 1)[0])
    proxy = TcpProxy(port)
    await proxy.start()
    name = unique("silent")
    head, _, tail = rabbitmq_url.rpartition(f":{port}")
    conn = RabbitMQConnection(
        f"{head}:{proxy.port}{tail}", exchange=unique("x"), heartbeat_seconds=1, name=name
    )
    try:
        await conn.connect()
        assert proxy.blackhole(name.encode()) == 1
        # About three heartbeats; aiormq's default heartbeat is 60 s (three minutes).
        await wait_until(lambda: not conn.is_open, timeout=8)
        await conn.connect()  # a new connection, through the proxy
        assert conn.is_open
        channel = await conn._conn.channel()
        await channel.exchange_delete(conn.exchange)
    finally:
        await conn.aclose()
        await proxy.stop()

"""A unit of work whose rollback fails: its connection is discarded, its own error kept.

The block fails and, while it does, the connection to PostgreSQL is cut (a proxy stops), so
the rollback fails too. The caller gets the block's own error (not the rollback's
``InterfaceError`` in its place), the connection is invalidated rather than given back to
the pool, and the application's next units of work, once the database is reachable again,
all succeed.
"""

from __future__ import annotations

import pytest
from sqlalchemy import event, text

from fastapi_outbox import Outbox, OutboxSettings
from fastapi_outbox.brokers import MemoryBroker
from tests.servers import TcpProxy

pytestmark = pytest.mark.postgres(
    reason="a private PostgreSQL proxied to drop the connection during ROLLBACK"
)


class OrderRefused(Exception):
    """The block's own failure."""


async def refused_order(outbox: Outbox, proxy: TcpProxy) -> None:
    async with outbox.unit_of_work() as uow:
        await uow.session.execute(text("SELECT 1"))
        await proxy.stop()  # the rollback that follows finds the connection cut
        raise OrderRefused("out of stock")


async def test_a_failed_rollback_keeps_the_error_and_discards_the_connection(pg_url: str) -> None:
    proxy = TcpProxy(5432)
    await proxy.start()
    url = pg_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
    assert str(proxy.port) in url, url
    outbox = Outbox(
        url,
        brokers={"default": MemoryBroker()},
        settings=OutboxSettings(),
        engine_options={"pool_size": 5, "max_overflow": 0},
    )
    invalidated: list[object] = []
    event.listen(outbox.engine.sync_engine, "invalidate", lambda *args: invalidated.append(args))
    try:
        with pytest.raises(OrderRefused):
            await refused_order(outbox, proxy)
        assert invalidated  # discarded, not given back to the pool as it was
        await proxy.start()
        failed = 0
        for _ in range(20):
            try:
                async with outbox.unit_of_work() as uow:
                    await uow.session.execute(text("SELECT 1"))
            except Exception:
                failed += 1
        assert failed == 0
    finally:
        await outbox.aclose()
        await proxy.stop()

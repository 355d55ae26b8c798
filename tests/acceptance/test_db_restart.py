"""A PostgreSQL restarted (``pg_ctl restart``, fast shutdown) under a consumer's backlog: the
sessions are terminated (57P01 / connection closed), new connections get 57P03 "the
database system is shutting down / starting up" or are refused while no postmaster
listens. Every message waits in place, none is charged: all handled once, none
dead-lettered, with ``max_attempts=1`` (the reviewer saw 20 of 20 dead-lettered)."""

from __future__ import annotations

from collections.abc import Iterator

import anyio
import pytest

from tests.integration.consume.test_db_outage import BACKLOG, backlog_through_an_outage
from tests.servers import PrivatePostgres, answers

pytestmark = [pytest.mark.redis, pytest.mark.slow]

#: Ports of this module's private cluster (others use 56400-56549, 56700-56799).
PORTS = range(56900, 57000)


@pytest.fixture(scope="module")
def restartable_pg() -> Iterator[PrivatePostgres]:
    cluster = PrivatePostgres(PORTS, options="-c fsync=off -c max_connections=50")
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


async def test_a_postgresql_restart_under_a_backlog_charges_no_attempt(
    restartable_pg: PrivatePostgres, redis_url: str
) -> None:
    cluster = restartable_pg
    restarted = anyio.Event()

    async def restart() -> None:
        await anyio.to_thread.run_sync(cluster.restart)
        restarted.set()

    async with anyio.create_task_group() as tg:

        async def outage() -> None:
            """Start the restart: the backlog goes on flowing (20 ms a message) through it."""
            tg.start_soon(restart)

        figures = await backlog_through_an_outage(cluster.url, redis_url, outage, pace=0.02)
    print(f"restart under a backlog: {figures}")
    assert restarted.is_set() and answers(cluster.port)
    assert figures["waits"] > 0
    assert figures["rows"] == figures["distinct"] == BACKLOG
    # A batch whose commit went through but whose answer the restart cut: a duplicate.
    assert figures["handled"] + figures["duplicates"] == BACKLOG
    assert figures["dead_lettered"] == figures["dead_letters"] == 0

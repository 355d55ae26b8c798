"""MariaDB: a handler whose statement waits for a row lock past ``innodb_lock_wait_timeout``
(error 1205) is retried in place without spending an attempt, as a deadlock (1213) is: with
``consumer_max_attempts=1`` a charged attempt would dead-letter the message. The classifier's
numbers are unit-tested in ``tests/unit/test_mysql_dialect.py``."""

from __future__ import annotations

import anyio
import pytest
from sqlalchemy import text

from fastapi_outbox import Message, Outbox, OutboxSettings, UnitOfWork
from fastapi_outbox.brokers import RedisStreamsBroker
from tests.conftest import unique, wait_until
from tests.integration.consume.test_db_outage import SETTINGS, publish_raw

pytestmark = pytest.mark.redis


async def test_a_lock_wait_timeout_is_retried_without_charging_an_attempt(
    mysql_url: str, redis_url: str
) -> None:
    broker = RedisStreamsBroker(redis_url)
    settings = OutboxSettings(**{**SETTINGS, "consumer_max_attempts": 1})
    outbox = Outbox(mysql_url, brokers={"default": broker}, settings=settings)
    stream = unique("contended")
    runs = 0

    @outbox.subscriber(stream, group="effects", start="all")
    async def effect(message: Message, uow: UnitOfWork) -> None:
        nonlocal runs
        runs += 1
        await uow.session.execute(text("SET SESSION innodb_lock_wait_timeout = 1"))
        await uow.session.execute(text("UPDATE hot SET n = n + 1 WHERE id = 1"))

    sub = outbox.subscribers[0]
    try:
        await outbox.create_tables()
        async with outbox.engine.begin() as conn:
            await conn.exec_driver_sql("CREATE TABLE hot (id INTEGER PRIMARY KEY, n INTEGER)")
            await conn.exec_driver_sql("INSERT INTO hot VALUES (1, 0)")
        async with outbox.engine.connect() as holder:
            # Another transaction holds the row: the handler's UPDATE times out (1205).
            await holder.exec_driver_sql("UPDATE hot SET n = n WHERE id = 1")
            await publish_raw(broker, stream, range(1))
            async with outbox.relaying():
                await wait_until(lambda: runs >= 2, timeout=30)  # failed, retried in place
                await holder.rollback()  # the lock goes: the next run succeeds
                await wait_until(lambda: sub.stats.handled == 1, timeout=30)
        assert sub.stats.dead_lettered == 0
        async with outbox.engine.connect() as conn:
            assert (await conn.execute(text("SELECT n FROM hot"))).scalar_one() == 1
    finally:
        with anyio.CancelScope(shield=True):
            await outbox.aclose()

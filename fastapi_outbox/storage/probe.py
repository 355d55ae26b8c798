"""Health's own view of the database: a connection that never queues behind the
application's requests, and a look at how busy the application's pool is.

A health check that borrows from the application's pool reads a busy pool as a dead
database: with every connection held by slow requests, its check waits out its timeout and
says "down" while the server answers direct connections at once. So the counts are read on
a pool of one connection of health's own (PostgreSQL; an SQLite file has no server to
reach, its engine is shared), and the application's pool is looked at separately: how many
of its connections are in use, and how long one took to get (``busy`` past a bound).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import anyio
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import AsyncAdaptedQueuePool, QueuePool
from sqlalchemy.sql.schema import Table

from fastapi_outbox.storage.connector import Connector
from fastapi_outbox.storage.messages import Messages
from fastapi_outbox.storage.read_models import BrokerStats

__all__ = ["POOL_PROBE_SECONDS", "DatabaseProbe", "PoolUsage"]

#: How long health waits for a connection of the application's pool before it reports the
#: pool busy (requests wait for connections): never a reason to call the database down.
POOL_PROBE_SECONDS = 1.0


class PoolUsage:
    """The application's pool as health saw it: connections in use, its capacity (None:
    unbounded or not a queue pool) and how long health waited for one (None: not within
    ``POOL_PROBE_SECONDS``)."""

    __slots__ = ("capacity", "in_use", "reachable", "wait_seconds")

    def __init__(
        self,
        in_use: int | None,
        capacity: int | None,
        wait_seconds: float | None,
        *,
        reachable: bool = True,
    ) -> None:
        self.in_use = in_use
        self.capacity = capacity
        self.wait_seconds = wait_seconds
        #: False: a new connection failed (the database itself is the problem, not the pool).
        self.reachable = reachable

    @property
    def busy(self) -> bool:
        return self.reachable and self.wait_seconds is None


class DatabaseProbe:
    """The store health reads its counts from (one connection of its own), and the
    application pool's usage. Built on first use; `aclose` disposes of its engine."""

    def __init__(self, engine: AsyncEngine, table: Table, app_messages: Messages) -> None:
        self._engine = engine
        self._table = table
        self._app_messages = app_messages
        self._own: AsyncEngine | None = None
        self._messages: Messages | None = None

    @property
    def messages(self) -> Messages:
        if self._messages is None:
            if self._engine.dialect.name == "sqlite":
                self._messages = self._app_messages
            else:
                self._own = _own_engine(self._engine)
                self._messages = Messages(Connector(self._own), self._table)
        return self._messages

    async def stats(self, brokers: Iterable[str], *, ordered: bool) -> dict[str, BrokerStats]:
        """`Messages.stats` on health's own connection. Its kept connection may have died
        while idle (the database restarted since the last check): on an error it is tried
        once more, on a new connection, so the first check after an outage does not report
        the database down when it is back. (No pre-ping: it would cost round trips on every
        check to save one on the rare dead connection.)"""
        try:
            return await self.messages.stats(brokers, ordered=ordered)
        except Exception:
            if self._own is None:
                raise
            await self._own.dispose()  # drops the dead connection, keeps the engine
            return await self.messages.stats(brokers, ordered=ordered)

    async def pool_usage(self, limit: float = POOL_PROBE_SECONDS) -> PoolUsage:
        """Check a connection of the application's pool out and back in (no statement),
        bounded by ``limit``: the wait a request would see now."""
        pool = self._engine.sync_engine.pool
        in_use = capacity = None
        if isinstance(pool, QueuePool):
            in_use = pool.checkedout()
            overflow = pool._max_overflow  # the public size() leaves the overflow out
            capacity = None if overflow < 0 else pool.size() + overflow
        started = time.monotonic()
        waited: float | None
        try:
            with anyio.fail_after(limit):
                async with self._engine.connect():
                    waited = time.monotonic() - started
        except TimeoutError:
            waited = None
        except Exception:
            return PoolUsage(in_use, capacity, None, reachable=False)
        return PoolUsage(in_use, capacity, None if waited is None else round(waited, 3))

    async def aclose(self) -> None:
        if self._own is not None:
            await self._own.dispose()
            self._own = None
            self._messages = None


def _own_engine(engine: AsyncEngine) -> AsyncEngine:
    """An engine of one pooled connection made the way ``engine`` makes its own (same URL,
    driver options and connect arguments): health's reads never wait for the application."""
    pool: Any = engine.sync_engine.pool
    own_pool = AsyncAdaptedQueuePool(
        pool._creator,
        pool_size=1,
        max_overflow=0,
        dialect=engine.dialect,
    )
    return create_async_engine(engine.url, pool=own_pool)

"""Test helpers: drain the outbox synchronously, and pytest fixtures.

``await drain(outbox)`` claims and publishes everything due, as a dispatcher would, and
returns how many messages were published; tests need no running dispatcher.

The pytest plugin (``pytest_plugins = ["fastapi_outbox.testing"]``) provides
``memory_broker`` and ``sqlite_outbox`` fixtures.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import pytest

from fastapi_outbox.brokers.memory.broker import MemoryBroker
from fastapi_outbox.relay.table import Processor, process_batch

if TYPE_CHECKING:
    from fastapi_outbox.outbox import Outbox

__all__ = ["drain", "memory_broker", "sqlite_outbox"]


async def drain(outbox: Outbox, *, broker: str | None = None, max_batches: int = 1000) -> int:
    """Publish every due message (of ``broker``, or of all brokers); returns the count.

    With ``capture="wal"`` the messages waiting in the replication slot are relayed first
    (to all their brokers, whatever ``broker`` says), as the WAL relay would."""
    names = [broker] if broker is not None else list(outbox.all_brokers)
    published = 0
    if outbox.wal_slot is not None:
        from fastapi_outbox.relay.wal import WalRelay

        relay = WalRelay(
            store=outbox.store,
            slot=outbox.wal_slot,
            brokers=outbox.all_brokers,
            settings=outbox.settings,
            instance=outbox.instance + ":drain",
            instrumentation=outbox.instrumentation,
        )
        await relay.drain()
        published += relay.relayed_total
    for name in names:
        processor = Processor(
            store=outbox.store,
            broker_name=name,
            broker=outbox.all_brokers[name],
            settings=outbox.settings,
            instance=outbox.instance + ":drain",
            instrumentation=outbox.instrumentation,
        )
        await processor.broker.connect()
        for n in range(max_batches):
            token = f"{processor.instance}:{n}"
            batch = await outbox.store.claim(
                name,
                outbox.settings.batch_size,
                token,
                outbox.settings.lease_seconds,
                ordered=outbox.settings.ordered,
            )
            if not batch:
                break
            before = processor.published_total
            await process_batch(processor, batch, token)
            published += processor.published_total - before
    return published


@pytest.fixture
def memory_broker() -> MemoryBroker:
    return MemoryBroker()


@pytest.fixture
async def sqlite_outbox(tmp_path: object, memory_broker: MemoryBroker) -> AsyncIterator[Outbox]:
    """An Outbox on a temporary SQLite file with the memory broker; tables created."""
    from fastapi_outbox.outbox import Outbox
    from fastapi_outbox.settings import OutboxSettings

    outbox = Outbox(
        f"sqlite+aiosqlite:///{tmp_path}/outbox.db",
        brokers={"default": memory_broker},
        settings=OutboxSettings(),
    )
    await outbox.create_tables()
    try:
        yield outbox
    finally:
        await outbox.aclose()

"""The pytest plugin and ``drain``: what a user's test suite gets from fastapi_outbox.testing."""

from __future__ import annotations

from fastapi_outbox import Message, Outbox
from fastapi_outbox.brokers import MemoryBroker
from fastapi_outbox.testing import drain


async def test_plugin_fixtures_and_drain(
    sqlite_outbox: Outbox, memory_broker: MemoryBroker
) -> None:
    async with sqlite_outbox.unit_of_work() as uow:
        for n in range(3):
            uow.publish(Message("orders", "OrderPlaced", {"n": n}), key=str(n))
    assert memory_broker.messages == []  # no relay runs: nothing moves by itself

    assert await drain(sqlite_outbox) == 3
    assert [m.json() for m in memory_broker.messages] == [{"n": 0}, {"n": 1}, {"n": 2}]
    assert await sqlite_outbox.store.messages.count("published") == 3
    assert await drain(sqlite_outbox) == 0  # nothing left
